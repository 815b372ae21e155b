"""Price a compiled plan by running its training step on fake tensors.

The memory model (:mod:`autockpt.memory_model`) prices every plan the search looks at from
numbers per stage, which keeps the search fast and exact for the model. What it cannot see are
events of single nodes inside a checkpoint's backward. :func:`replay_peak_bytes` prices the one
plan the search chose by running it: the rewritten forward, the loss and the backward, with the
real ``torch.utils.checkpoint`` and the real autograd engine, on fake tensors, tracked by the
same :class:`~autockpt.measure.track_activation_memory` that :func:`autockpt.measure` uses on a
real step (NOTE [ Replaying a plan on fake tensors ]).

# NOTE [ Replaying a plan on fake tensors ]
A reentrant checkpoint runs its recompute and its inner backward inside the outer backward, and
what is alive at its peak depends on single nodes: the frame keeps the gradient it was handed
for each output until the inner backward returns, autograd materializes zeros for an output
no one read, sums partial gradients in the order they arrive, and copies an operand's gradient
in one graph and not in another. The stage model prices these on average, and on random graphs
it was below the measured peak by up to 10% for a few plans in a hundred (benchmarks/RESULTS.md,
"Graphs the model was not fitted to").

Running the step is exact where the model is not: a fake tensor has a storage that lives and
dies as the real one would (autograd saves and frees the same tensors), only without memory
behind it, and the tracker counts storages. So the planner searches with the model and then
replays its choice: the step runs on fake copies of the parameters and inputs (the user's
module is reparametrized for the call, as the profile does, and put back), each checkpointed
segment through :func:`autockpt.runtime.run_segment` as at training time, and the loss the plan
priced: the user's ``loss_fn``, the model's own loss, or (neither) a gradient the size of each
output made when backward starts. Where the replay is above the budget, the planner asks the
model for a plan under a budget lowered by the difference (:mod:`autockpt.pipeline`).

Fake kernels make the storage an op's output shape needs; where a real kernel is known to return
a larger one (a reduced MSE loss keeps its element-wise buffer), the replay widens it as the
profile does (:func:`autockpt.instrument.widen_reduced_loss`). What the replay does not see is
what the measure does not see (NOTE [ What the dispatch-mode
measure cannot see ] in :mod:`autockpt.measure`), and what fake tensors do not run: a data-
dependent op fails, and the plan then keeps the model's estimate and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autockpt.instrument import (Op, OpObserver, OpWatch, map_tensors, run_with_state, tensors,
                                 widen_reduced_loss)
from autockpt.loss import LossFn
from autockpt.measure import make_step
from autockpt.planner import Plan
from autockpt.rewrite import RUN_METHOD, rewrite
from autockpt.runner import run_segment, unobserved
from autockpt.trace import TracedModel, base_class, shallow_view

__all__ = ["replay_peak_bytes"]


class _OutputSizedGradient(torch.autograd.Function):
    """The loss a plan assumes when it is given none (``LossStat.kind == "assumed"``): a new
    gradient the size of each output, all made when backward starts."""

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outputs]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        return tuple(torch.zeros(shape, dtype=dtype, device=device)
                     for shape, dtype, device in ctx.shapes)


def _assumed_loss(output: Any) -> torch.Tensor:
    outputs = [t for t in tensors(output) if t.requires_grad and t.is_floating_point()]
    return _OutputSizedGradient.apply(*outputs)


class _Widen(OpObserver):
    """Gives a reduced loss the storage its real kernel keeps, before the tracker, which
    runs above it, sees the op's outputs."""

    def after_op(self, op: Op, out: Any) -> None:
        widen_reduced_loss(op.func, op.args, out)


class _Replayed(nn.Module):
    """The rewritten forward of one plan as a module, for :func:`autockpt.measure.make_step`:
    it takes the graph's inputs and returns what the user's forward returns."""

    def __init__(self, view: nn.Module, forward: Any, unflatten: Any) -> None:
        super().__init__()
        self.view = view
        self._unflatten = unflatten
        self._forward = forward

    def forward(self, *inputs: Any) -> Any:
        out = self._forward(self.view, *inputs)
        return out if self._unflatten is None else self._unflatten(out)


@contextlib.contextmanager
def _fake_mode_for(values: Any) -> Iterator[FakeTensorMode]:
    """The fake mode of fake example inputs, or a new one that turns real tensors it meets (a
    loss's targets, a constant the tracer lifted) into fake ones as they come."""
    existing = next((t.fake_mode for t in tensors(values) if isinstance(t, FakeTensor)), None)
    mode = existing if existing is not None else FakeTensorMode()
    before = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with mode:
            yield mode
    finally:
        mode.allow_non_fake_inputs = before


def replay_peak_bytes(module: nn.Module, traced: TracedModel, plan: Plan,
                      inputs: dict[str, Any], *, loss_fn: LossFn | None = None,
                      grad_accumulation: bool = False) -> int:
    """The peak activation bytes of one training step of ``module`` under ``plan``, run on
    fake tensors (NOTE [ Replaying a plan on fake tensors ]).

    Args:
        module: the user's module (its parameters are replaced by fake copies for the call).
        traced: the graph ``plan`` was made for.
        plan: the plan, as the planner made it (its ``loss`` says which loss to run).
        inputs: the graph's inputs by the forward's parameter names (real or fake).
        loss_fn: the user's loss, when the plan priced one.
        grad_accumulation: run a step whose ``.grad`` already exists.

    Raises:
        Exception: whatever the step raises on fake tensors (a data-dependent op); the caller
            keeps the model's estimate then.

    Example:
        >>> import torch, autockpt
        >>> from autockpt.trace import trace
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> x = torch.randn(8, 64)
        >>> plan = autockpt.plan(net, (x,), mode="reentrant")
        >>> replay_peak_bytes(net, trace(net, (x,)), plan, {"input": x}) == (
        ...     autockpt.measure(autockpt.apply(net, example_inputs=(x,), mode="reentrant",
        ...                                     verbose=False), x).peak_activation_bytes)
        True
    """
    view = shallow_view(module)
    constant_names = {}
    for i, (name, value) in enumerate(sorted(traced.constants.items())):
        constant_names[name] = f"_autockpt_replay_const_{i}"
        view.__dict__[constant_names[name]] = value
    program = rewrite(traced.graph, plan, 0, constant_names=constant_names)

    def run(variant: int, index: int, *segment_inputs: Any) -> Any:
        return run_segment(view, program.segments[index], plan.mode, segment_inputs)

    # An instance attribute, found before the class's: the view is the user's class.
    view.__dict__[RUN_METHOD] = run
    replayed = _Replayed(view, program.forward, traced.unflatten)
    if not plan.segments and plan.chunked_head is None and traced.flatten is None:
        # With nothing to checkpoint the runtime runs the user's own forward, whose Python
        # locals may hold values longer than the graph does.
        names = traced.spec.param_names

        def eager(module: nn.Module, *values: Any) -> Any:
            return base_class(module).forward(module, **dict(zip(names, values)))

        replayed = _Replayed(view, eager, None)
    values = tuple(inputs[name] for name in traced.spec.param_names)
    kind = plan.loss.kind if plan.loss is not None else "inner"
    step_loss = {"loss_fn": loss_fn, "assumed": _assumed_loss}.get(kind)
    with _fake_mode_for(values) as mode:
        named = [*replayed.named_parameters(), *replayed.named_buffers()]
        state = {name: _fake(mode, t) for name, t in named}
        fake_values = map_tensors(values, lambda t: _fake(mode, t))

        def tracked() -> int:
            step = make_step(replayed, fake_values, {}, step_loss,
                             grad_accumulation=grad_accumulation, fake=True)
            result = step.run(track=True)
            assert result.tracker is not None
            return result.tracker.peak_bytes

        # The fake step draws no random numbers, but a checkpoint stashes and sets the state.
        with torch.random.fork_rng(devices=[]), unobserved(), OpWatch(_Widen()):
            return int(run_with_state(replayed, state, tracked, ()))


def _fake(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, FakeTensor):
        return tensor
    fake = mode.from_tensor(tensor)
    if tensor.is_leaf and tensor.requires_grad != fake.requires_grad:
        fake.requires_grad_(tensor.requires_grad)
    return fake
