"""Plain helpers shared by the tests (fixtures are in tests/conftest.py).

Most tests prove a transformation exact the same way: train the transformed model and an
identically seeded twin one step each, snapshot what the step leaves behind (loss, every
parameter's gradient, every buffer) and compare the two tensor by tensor. :func:`train_step`
takes the snapshot and :func:`assert_same_step` / :func:`assert_same_tensors` compare; each
caller keeps its own argument order and tolerances. Budget tests plan at a fraction of the
peak without checkpointing with :func:`budget_for` and :func:`apply_at_fraction`. The
distributed tests start their workers with :func:`run_workers`.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import autockpt

if TYPE_CHECKING:
    from tests.zoo import ZooCase

__all__ = [
    "MODES",
    "AtFraction",
    "Step",
    "apply_at_fraction",
    "assert_same_case_step",
    "assert_same_step",
    "assert_same_step_in_float64",
    "assert_same_tensors",
    "budget_for",
    "buffers_of",
    "grads_of",
    "free_port",
    "loop_peak_bytes",
    "params_of",
    "run_workers",
    "train_step",
]

ROOT = Path(__file__).resolve().parents[1]
"""The repository: the workers import ``autockpt`` and ``tests`` from it."""

MODES = ("non_reentrant", "reentrant")
"""Both checkpoint modes, in the order tests parametrize over them."""


def live_tensors() -> set[int]:
    """The ids of the tensors (fake ones included) alive after a collection: a test compares
    two of these sets, since what earlier tests left may be freed in between."""
    gc.collect()
    # type(), not isinstance: the latter reads __class__, which warns on deprecated objects.
    return {id(obj) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)}


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    """Each parameter's gradient, cloned, by name in ``named_parameters`` order; None where
    the parameter has none (a frozen one, or before the first backward)."""
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def params_of(model: nn.Module) -> dict[str, Tensor]:
    """Each parameter's value, cloned, by name in ``named_parameters`` order."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def buffers_of(model: nn.Module) -> dict[str, Tensor]:
    """Each buffer, cloned, by name in ``named_buffers`` order."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


class Step(NamedTuple):
    """What one training step leaves behind, cloned. A tuple, so that call sites unpack it."""

    loss: Tensor
    """The loss, detached."""
    grads: dict[str, Tensor | None]
    """:func:`grads_of` the model after backward."""
    buffers: dict[str, Tensor]
    """:func:`buffers_of` the model after the step (BatchNorm's running statistics move)."""


def train_step(model: nn.Module, loss_fn: Callable[[Any], Tensor], args: tuple[Any, ...],
               kwargs: Mapping[str, Any] | None = None, *, seed: int) -> Step:
    """One forward and backward in train mode, no optimizer step.

    Clears the gradients (to None) and seeds the global RNG with ``seed`` first, so that two
    twins draw the same dropout masks.
    """
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(*args, **(kwargs or {})))
    loss.backward()
    return Step(loss.detach(), grads_of(model), buffers_of(model))


def assert_same_tensors(actual: Mapping[str, Tensor | None], expected: Mapping[str, Tensor | None],
                        *, what: str = "", exact: bool = False, allow_none: bool = False,
                        rtol: float | None = None, atol: float | None = None) -> None:
    """The same names in the same order, and each tensor close to the expected one.

    ``exact`` asks for bitwise equality, ``rtol`` / ``atol`` for other tolerances than
    ``torch.testing.assert_close``'s defaults. A None (a parameter without a gradient) is
    only allowed with ``allow_none``, and then only where the expected one is None too.
    ``what`` starts every message ("resnet grad ", say).
    """
    assert list(actual) == list(expected), f"{what}names differ"
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": rtol, "atol": atol}
    for name, want in expected.items():
        got = actual[name]
        if allow_none and want is None:
            assert got is None, f"{what}{name} is set where the expected one is None"
            continue
        assert want is not None and got is not None, f"{what}{name} is None"
        torch.testing.assert_close(got, want, **tolerance,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


def assert_same_step(actual: Step, expected: Step, *, what: str = "", exact: bool = False,
                     allow_none: bool = False) -> None:
    """The same loss, gradients and buffers (see :func:`assert_same_tensors`)."""
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {}
    torch.testing.assert_close(actual.loss, expected.loss, **tolerance,
                               msg=lambda m: f"{what}loss: {m}")
    assert_same_tensors(actual.grads, expected.grads, what=f"{what}grad ", exact=exact,
                        allow_none=allow_none)
    assert_same_tensors(actual.buffers, expected.buffers, what=f"{what}buffer ", exact=exact)


def _double(value: Any) -> Any:
    """``value`` with every floating-point tensor in it converted to float64."""
    return torch.utils._pytree.tree_map(
        lambda v: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v, value)


def assert_same_step_in_float64(build: Callable[[], nn.Module], plan: autockpt.Plan,
                                loss_fn: Callable[[Any], Tensor], args: tuple[Any, ...],
                                kwargs: Mapping[str, Any] | None = None, *, what: str = "",
                                seed: int = 1234) -> None:
    """Two fresh twins from ``build`` in float64, one transformed with ``plan``: one step
    each gives the same loss, gradients and buffers to float64's tolerance.

    For reentrant segments that share an input, where float32 cannot tell a wrong gradient
    from one summed in another order: see NOTE [ Gradients summed in another order ].
    """
    reference, model = build().double(), build().double()
    transformed = autockpt.apply(model, plan=plan)
    args, kwargs = _double(args), _double(dict(kwargs or {}))
    expected = train_step(reference, loss_fn, args, kwargs, seed=seed)
    assert_same_step(train_step(transformed, loss_fn, args, kwargs, seed=seed), expected,
                     what=f"{what}(float64) ", allow_none=True)


# NOTE [ Gradients summed in another order ]
# A tensor read by several reentrant segments (a DenseNet's features, concatenated again by
# every later layer; a UNet's skip tensor) gets its gradient as partial sums: each segment
# runs a backward of its own and hands back the gradient of its inputs, and autograd adds the
# partials. Without checkpointing the same terms are added in another order, and float
# addition is not associative. Where a gradient is a small difference of large terms (a
# BatchNorm weight's, under a loss with large gradients) float32 leaves little of it: on
# torchvision's densenet121 the first BatchNorm's weight gradient differed by 2% of its own
# largest element, while in float64 the same plan matches to 5e-11. Such comparisons run in
# float64 with the very same plan; non-reentrant checkpoint keeps the graph and the order,
# and stays compared in float32.


def assert_same_case_step(case: ZooCase, reference: nn.Module, transformed: nn.Module) -> None:
    """One step of each on ``case``'s inputs and loss, seeded alike: the same loss, gradients
    (None for a frozen parameter in both) and buffers. The gradients stay on the models."""
    args, kwargs = case.inputs()
    expected = train_step(reference, case.loss_fn, args, kwargs, seed=1234)
    assert_same_step(train_step(transformed, case.loss_fn, args, kwargs, seed=1234), expected,
                     allow_none=True)


def loop_peak_bytes(model: nn.Module, batch: Mapping[str, Any], *, hold: bool) -> int:
    """Peak activation bytes of a training step written as users write it for a model that
    returns its own loss (a Hugging Face model given ``labels=``, or any mapping with a
    ``"loss"``): ``outputs = model(**batch); outputs.loss.backward()`` with ``hold``
    (accelerate's loop: ``outputs`` and its logits alive until backward ends), else
    ``model(**batch).loss.backward()`` (the output dropped as soon as ``.loss`` is read).
    Counted as :func:`autockpt.measure` counts: parameters, buffers and inputs excluded, each
    parameter gradient reclassified as it is accumulated, from ``zero_grad()``."""
    from autockpt.running.measure import track_activation_memory

    model.train()
    model.zero_grad(set_to_none=True)
    inputs = [v for v in batch.values() if isinstance(v, Tensor)]
    tracker = track_activation_memory(exclude=[*model.parameters(), *model.buffers(), *inputs])
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.reclassify(p.grad))
             for p in model.parameters() if p.requires_grad]
    try:
        with tracker:
            if hold:
                outputs = model(**batch)  # a local: alive until the tracker has stopped
                outputs["loss"].backward()
            else:
                model(**batch)["loss"].backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def budget_for(plan: autockpt.Plan, fraction: object) -> int:
    """``fraction`` of the plan's peak without checkpointing, or its least peak for "min"."""
    if fraction == "min":
        return plan.min_peak_bytes
    return int(plan.baseline_peak_bytes * float(fraction))  # type: ignore[arg-type]


class AtFraction(NamedTuple):
    """What :func:`apply_at_fraction` planned and made. A tuple, so that call sites unpack it."""

    probe: autockpt.Plan
    """The plan without a budget, whose peaks the budget is a fraction of."""
    budget_bytes: int
    """:func:`budget_for` the probe."""
    model: nn.Module | None
    """The transformed model; None where the budget is below the least reachable peak (and
    ``autockpt.apply`` was checked to refuse it)."""


def apply_at_fraction(model: nn.Module, fraction: object, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any] | None = None, **options: Any) -> AtFraction:
    """``autockpt.apply`` at :func:`budget_for` ``fraction`` of the model's plan, with the same
    ``options`` (mode, loss_fn, ...) for the plan and the transformation."""
    probe = autockpt.plan(model, args, example_kwargs=kwargs, **options)
    budget = budget_for(probe, fraction)
    if budget < probe.min_peak_bytes:
        with pytest.raises(autockpt.InfeasibleBudgetError):
            autockpt.apply(model, budget / 2**20, example_inputs=args, example_kwargs=kwargs,
                           **options)
        return AtFraction(probe, budget, None)
    transformed = autockpt.apply(model, budget / 2**20, example_inputs=args,
                                 example_kwargs=kwargs, **options)
    return AtFraction(probe, budget, transformed)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the moment, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_workers(script: Path, world: int, directory: Path, *, timeout_s: float,
                env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``script rank world port directory`` in ``world`` processes at once and return
    what each rank saved to ``directory/result-<rank>.pt``.

    ``env`` is added to this process's environment. A rank that fails fails the test with the
    end of its output.
    """
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(port), str(directory)],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=timeout_s)[0].decode() for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [torch.load(directory / f"result-{r}.pt", weights_only=True) for r in range(world)]
