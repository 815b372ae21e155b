"""The public entry points: ``apply``, ``plan`` and ``plan_of``.

They validate arguments, run the stages (:mod:`autockpt.pipeline`: capture, profile, plan,
compile) and re-raise what goes wrong inside with the user's context: the model, the inputs,
the budget, and the fix.
"""

from __future__ import annotations

import fnmatch
import math
import sys
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch
from torch import nn

from autockpt.capturing.ladder import CAPTURES
from autockpt.capturing.meta import forward_failed
from autockpt.capturing.trace import base_class, split_inputs
from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.pipeline import ApplyConfig, make_any_plan
from autockpt.planning.planner import MODES, STRATEGIES, Plan
from autockpt.profiling.loss import LossFn, check_loss_fn
from autockpt.profiling.timing import COSTS
from autockpt.runtime import is_checkpointed, make_checkpointed

__all__ = ["__version__", "apply", "plan", "plan_of"]

__version__ = "0.1.0"  # the same as pyproject.toml's; ``autockpt.__version__``

MIB = 2**20


def apply(
    model: nn.Module,
    budget_mb: float | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    mode: str = "non_reentrant",
    strategy: str = "optimal",
    capture: str = "auto",
    cost: str = "flops",
    loss_fn: LossFn | str | None = None,
    grad_accumulation: bool = False,
    total_mb: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep_whole: str | Sequence[str] = (),
    chunk_head: bool = True,
    max_shapes: Mapping[str, Sequence[int | None]] | None = None,
) -> nn.Module:
    """Return a module that trains like ``model`` with activation memory within ``budget_mb``.

    The result is an instance of ``model``'s own class holding the very same submodules and
    Parameter objects (``state_dict()`` keys are identical). In train mode with gradients
    enabled its forward runs checkpointed segments; in eval mode or under ``torch.no_grad()``
    it runs ``model``'s own forward. ``model`` itself is not changed.

    Args:
        model: the module to transform.
        budget_mb: MiB (2**20 bytes) allowed for peak activation memory of one forward and
            backward at the input size; ``None`` asks for the least memory reachable.
        example_inputs: positional inputs (a tensor or a tuple) to plan for now; a dict is
            taken as keyword inputs. The plan serves them and every batch of the same
            structure no larger in any dimension (give the largest batch of the run). Without
            them, planning happens at the first training forward, from the real batch; a
            batch of a new shape runs a plan that serves it, or one priced at its bucket of
            sizes (docs/shapes.md).
        example_kwargs: keyword inputs to plan for.
        plan: a plan from :func:`plan` to apply as it is (no budget then; the plan's mode is
            used).
        mode: ``"non_reentrant"`` (default) or ``"reentrant"`` checkpoint.
        strategy: how segments are chosen: ``"optimal"`` (least recompute under the budget,
            by dynamic programming; in non-reentrant mode, below the least memory one level
            of segments reaches, with segments checkpointed again inside segments),
            ``"greedy"`` (a fast heuristic) or ``"sqrt"`` (Chen et al.'s sqrt(n) segments,
            whatever the budget).
        capture: how the forward is captured: ``"auto"`` (default) tries ``"fx"``
            (torch.fx), ``"export"`` (torch.export), ``"fx-leaves"`` (torch.fx with the
            submodules it cannot trace kept whole) and ``"modules"`` (checkpointing whole
            submodules, planned with hooks) in that order; name one to use only it. The
            plan's ``capture`` says which was used and ``capture_reason`` why.
        cost: what the planner minimises as recompute cost: ``"flops"`` (default; FLOPs plus
            bytes written, from the fake-tensor profile, so the same plan every time) or
            ``"profile"`` (each graph node timed on the real device with the example inputs:
            closer to real step time, but timings are noisy, so plans may differ from run to
            run). The ``"modules"`` rung has no graph to time and plans by FLOPs; the plan's
            ``cost_model`` says which was used.
        loss_fn: the loss of your training step, ``loss_fn(output) -> scalar tensor`` (or
            the name of a built-in one: ``"cross_entropy"``, ``"mse"``, ``"sum"``). It is
            profiled with the model, so its saved tensors, its temporaries and the gradient
            it sends into the output are in the budget; your own code still computes it.
            Without it, a model that returns its own loss (``labels=``) is planned with that
            loss, the rest of its output (the logits) held through backward as ``outputs =
            model(**batch); outputs.loss.backward()`` holds it, and any other with an
            output-sized gradient assumed for each output, which a real loss makes at least
            (the plan's header says which).
        grad_accumulation: plan for steps in which ``.grad`` is already allocated when
            backward runs (gradient accumulation, ``zero_grad(set_to_none=False)``): each
            weight gradient is then a temporary added into it, and the budget counts it.
        total_mb: a budget for the whole device instead of ``budget_mb``: parameters,
            gradients, optimizer state and inputs are taken off it, and activations get the
            rest (the plan's header shows the breakdown).
        optimizer: the optimizer whose state ``total_mb`` counts (Adam and AdamW two buffers
            per parameter, SGD with momentum one, or what its state already holds).
        keep_whole: submodules whose calls must stay module calls, so that hooks registered
            on them (by ``fully_shard(block)``, tensor parallelism, a profiler) run, also when
            registered after ``apply``: qualified names or patterns in which ``*`` stands for
            one name (``"layers.*"``: each child of ``layers``). A segment then contains each
            of them whole, and its recompute calls them again (their hooks run once more, as
            with any checkpoint). See docs/training-setups.md.
        chunk_head: let the plan run the end of the step, from the final norm through the
            head's projection to a cross-entropy inside the model (a Hugging Face model given
            ``labels=``, or :func:`autockpt.with_loss`), in chunks of tokens, when that pays:
            the whole logits never exist, forward makes each chunk's gradients (nothing
            is recomputed; backward runs once per forward), and the logits the model
            returns beside the loss are ``None``. ``False`` keeps the head
            whole and the logits returned. Non-reentrant mode only. See
            docs/chunked-head.md.
        max_shapes: the largest shape of inputs whose sizes change from batch to batch, by
            argument name (a path such as ``"batch['pixels']"`` inside a container), one
            size per dimension, ``None`` for a size that does not change:
            ``{"input_ids": (None, 512)}``. Each input structure is then planned once, at
            those sizes, for every batch (other tensors of the batch with the same size, such
            as ``attention_mask`` and ``labels``, are raised with it). Without it, the sizes
            seen to vary are planned per bucket (docs/shapes.md).

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[m for _ in range(16)
        ...                             for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
        >>> x = torch.randn(64, 512)
        >>> ckpt = autockpt.apply(net, budget_mb=1.5, example_inputs=(x,))
        >>> ckpt(x).sum().backward()
        >>> len(autockpt.plan_of(ckpt).segments) > 0
        True

    Raises:
        InvalidArgumentError: a bad argument (the message names it and the fix).
        TraceError: the model cannot be traced by torch.fx.
        InfeasibleBudgetError: the budget cannot be met; it says the least that can.
    """
    budget_bytes, step = _check_common(model, budget_mb, mode, strategy, capture, cost, loss_fn,
                                       grad_accumulation, total_mb, optimizer)
    if plan is not None and (total_mb is not None or loss_fn is not None or grad_accumulation):
        raise InvalidArgumentError(
            "a plan already fixes the segments: loss_fn, grad_accumulation and total_mb "
            "belong to autockpt.plan() when you make it",
            fix="pass them to autockpt.plan(model, inputs, ...) and apply(model, plan=p) alone",
        )
    if plan is not None and not isinstance(plan, Plan):
        raise InvalidArgumentError(
            f"plan must be an autockpt.Plan, got {type(plan).__name__}",
            fix="make one with autockpt.plan(model, example_inputs, budget_mb=...)",
        )
    if plan is not None and budget_mb is not None:
        raise InvalidArgumentError(
            "pass either budget_mb or plan, not both: a plan already fixes the segments",
            fix="drop budget_mb, or make the plan with that budget",
        )
    if plan is not None:
        mode = plan.mode  # a plan's memory estimate holds for the mode it was made for
        # The step it was made for travels with it (the accumulation warning reads it).
        step["grad_accumulation"] = plan.grad_accumulation
    config = ApplyConfig(budget_bytes=budget_bytes, mode=mode, strategy=strategy, fixed_plan=plan,
                         capture=capture, cost=cost, keep_whole=whole_modules(model, keep_whole),
                         chunk_head=_check_flag("chunk_head", chunk_head),
                         max_shapes=_check_max_shapes(model, max_shapes), **step)
    # A transformed module can be applied again: the new one shares the same tree.
    transformed = make_checkpointed(model, config)
    if example_inputs is not None or example_kwargs is not None:
        args, kwargs = split_inputs(example_inputs, example_kwargs)
        _with_context(transformed, args, kwargs, lambda: transformed._autockpt.prepare(
            transformed, args, kwargs))
    return transformed


def plan(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    budget_mb: float | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    mode: str = "non_reentrant",
    strategy: str = "optimal",
    capture: str = "auto",
    cost: str = "flops",
    loss_fn: LossFn | str | None = None,
    grad_accumulation: bool = False,
    total_mb: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep_whole: str | Sequence[str] = (),
    chunk_head: bool = True,
) -> Plan:
    """Plan checkpoint segments for ``model`` at these inputs without changing anything.

    Tracing and profiling run on fake tensors: no memory is allocated for activations, and
    ``model``'s parameters, buffers and RNG streams are left as they were.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[m for _ in range(16)
        ...                             for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
        >>> p = autockpt.plan(net, (torch.randn(64, 512),), budget_mb=1.5)
        >>> p.estimated_peak_bytes <= p.budget_bytes
        True

    ``capture``, ``cost``, ``loss_fn``, ``grad_accumulation``, ``total_mb``, ``optimizer``
    ``keep_whole`` and ``chunk_head`` are as for :func:`apply`. With ``total_mb`` a model built on
    the meta device plans too, so whether a model fits a GPU, and how, is answered before renting
    one.

    Raises:
        InvalidArgumentError, TraceError, InfeasibleBudgetError: as for :func:`apply`.
    """
    budget_bytes, step = _check_common(model, budget_mb, mode, strategy, capture, cost, loss_fn,
                                       grad_accumulation, total_mb, optimizer)
    if example_inputs is None and example_kwargs is None:
        raise InvalidArgumentError(
            "plan() needs example inputs: activation sizes depend on the input size",
            fix="call autockpt.plan(model, (x,)) with a batch shaped like the real one",
        )
    args, kwargs = split_inputs(example_inputs, example_kwargs)

    config = ApplyConfig(budget_bytes=budget_bytes, mode=mode, strategy=strategy,
                         capture=capture, cost=cost, keep_whole=whole_modules(model, keep_whole),
                         chunk_head=_check_flag("chunk_head", chunk_head), **step)

    def run() -> Plan:
        return make_any_plan(model, args, kwargs, config)

    return _with_context(model, args, kwargs, run)


def plan_of(module: nn.Module, *inputs: Any, **kwargs: Any) -> Plan:
    """The plan a transformed module runs: for the inputs it saw last, or, given inputs, the
    plan a training forward on them runs (made now, on fake tensors, if none serves them
    yet; nothing runs for real). Its ``serves`` line says which shapes it covers.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> ckpt = autockpt.apply(net, example_inputs=(torch.randn(8, 4),))
        >>> autockpt.plan_of(ckpt).model
        'Sequential'
        >>> autockpt.plan_of(ckpt, torch.randn(2, 4)) is autockpt.plan_of(ckpt)
        True

    Raises:
        InvalidArgumentError: ``module`` was not returned by :func:`apply`.
        AutockptError: it has not planned yet (no example inputs and no training forward).
    """
    if not is_checkpointed(module):
        raise InvalidArgumentError(
            f"{type(module).__name__} is not a module returned by autockpt.apply",
            fix="pass the module that autockpt.apply(model, ...) returned",
        )
    state = module.__dict__["_autockpt"]
    if inputs or kwargs:
        args = tuple(inputs)
        return _with_context(module, args, kwargs,
                             lambda: state.plan_for(module, args, dict(kwargs)))
    if state.last_plan is None:
        raise AutockptError(
            "this module has not planned yet: it plans at its first training forward",
            fix="run one training step first, or pass example_inputs to autockpt.apply",
        )
    return state.last_plan


# --------------------------------------------------------------------------- validation


def _check_common(model: Any, budget_mb: Any, mode: Any, strategy: Any, capture: Any, cost: Any,
                  loss_fn: Any, grad_accumulation: Any, total_mb: Any, optimizer: Any
                  ) -> tuple[int | None, dict[str, Any]]:
    """Validate what :func:`apply` and :func:`plan` both take, in the order the user reads
    it; the activation budget in bytes and the step's :class:`ApplyConfig` fields."""
    _check_model(model)
    budget_bytes = _budget_bytes(budget_mb)
    _check_choice("mode", mode, MODES)
    _check_choice("strategy", strategy, tuple(STRATEGIES))
    _check_choice("capture", capture, CAPTURES)
    _check_choice("cost", cost, COSTS)
    return budget_bytes, _check_step(budget_mb, loss_fn, grad_accumulation, total_mb, optimizer)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}",
            fix="pass the module itself (e.g. MyNet()), not its class, a function or a "
            "state_dict",
        )
    if isinstance(model, _wrapper_types()):
        # Their forward takes *inputs and runs the real model inside: tracing them would fail
        # with a TraceError that blames the signature, and checkpointing belongs inside anyway.
        kind = type(model).__name__
        raise InvalidArgumentError(
            f"model is a {kind} wrapper: autockpt transforms the module inside it, and the "
            f"wrapper goes around the result",
            fix=f"transform first, then wrap: {kind}(autockpt.apply(model, ...)); with an "
            f"existing wrapper, pass wrapper.module",
        )


def _wrapper_types() -> tuple[type, ...]:
    """Data-parallel wrappers whose ``.module`` is the model autockpt should transform."""
    types: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no model can be one
    if fsdp is not None:
        types.append(fsdp.FullyShardedDataParallel)
    return tuple(types)


def _budget_bytes(budget_mb: Any, name: str = "budget_mb") -> int | None:
    if budget_mb is None:
        return None
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, Real):
        raise InvalidArgumentError(
            f"{name} must be a number of MiB or None, got {budget_mb!r}",
            fix=f"pass e.g. {name}=300 for 300 MiB, or None for the least memory reachable",
        )
    value = float(budget_mb)
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(
            f"{name} must be a positive, finite number of MiB, got {budget_mb!r}",
            fix=f"pass e.g. {name}=300 for 300 MiB, or None for the least memory reachable",
        )
    return max(1, int(value * MIB))


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}",
                                   fix=f"pass {name}=True or {name}=False")
    return value


def _check_step(budget_mb: Any, loss_fn: Any, grad_accumulation: Any, total_mb: Any,
                optimizer: Any) -> dict[str, Any]:
    """Validate what describes the training step; the matching :class:`ApplyConfig` fields."""
    loss = check_loss_fn(loss_fn)
    if not isinstance(grad_accumulation, bool):
        raise InvalidArgumentError(
            f"grad_accumulation must be True or False, got {grad_accumulation!r}",
            fix="pass grad_accumulation=True when .grad is already allocated at backward",
        )
    total_bytes = None
    if total_mb is not None:
        if budget_mb is not None:
            raise InvalidArgumentError(
                f"pass either budget_mb ({budget_mb!r}, for activations) or total_mb "
                f"({total_mb!r}, for the whole device), not both",
                fix="keep total_mb to plan for the whole device, or budget_mb for activations",
            )
        total_bytes = _budget_bytes(total_mb, name="total_mb")
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
                fix="pass the optimizer you train with, e.g. torch.optim.AdamW(model.parameters())",
            )
        if total_mb is None:
            raise InvalidArgumentError(
                "optimizer= only matters with total_mb: its state is part of the device's "
                "memory, not of the activation budget",
                fix="pass total_mb=<your device's MiB> with it, or drop optimizer",
            )
    return dict(loss_fn=loss, grad_accumulation=grad_accumulation, total_bytes=total_bytes,
                optimizer=optimizer)


def whole_modules(model: nn.Module, keep_whole: Any) -> tuple[str, ...]:
    """The qualified names of ``model``'s submodules that ``keep_whole`` names, in
    ``named_modules`` order: exact names, or patterns in which ``*`` (and the other
    :mod:`fnmatch` wildcards) stand within one dotted name.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(
        ...     torch.nn.Linear(2, 2), torch.nn.ReLU()))
        >>> whole_modules(net, "*")
        ('0', '1')
        >>> whole_modules(net, ["1.*"])
        ('1.0', '1.1')
    """
    patterns = [keep_whole] if isinstance(keep_whole, str) else keep_whole
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise InvalidArgumentError(
            f"keep_whole must be a module name or a list of them, got {keep_whole!r}",
            fix='pass e.g. keep_whole="layers.*" or keep_whole=["encoder.layers.0", "head"]')
    names = [name for name, _ in model.named_modules() if name]
    chosen: set[str] = set()
    for pattern in patterns:
        atoms = pattern.split(".")
        found = [name for name in names if len(name.split(".")) == len(atoms)
                 and all(fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), atoms))]
        if not found:
            nearby = ", ".join(n for n in names if "." not in n) or "none"
            raise InvalidArgumentError(
                f"keep_whole names {pattern!r}, which is no submodule of "
                f"{type(model).__name__}",
                fix=f"use qualified names from model.named_modules(); its children are "
                f"{nearby}")
        chosen.update(found)
    return tuple(name for name in names if name in chosen)


def _check_max_shapes(model: nn.Module, max_shapes: Any
                      ) -> tuple[tuple[str, tuple[int | None, ...]], ...]:
    """``max_shapes`` as ``(name, shape)`` pairs, each name one of the forward's arguments
    (or a path inside one)."""
    if max_shapes is None:
        return ()
    if not isinstance(max_shapes, Mapping) or not max_shapes:
        raise InvalidArgumentError(
            f"max_shapes must be a non-empty dict from argument name to shape, got "
            f"{max_shapes!r}",
            fix="pass e.g. max_shapes={'input_ids': (None, 512)}")
    import inspect

    from autockpt.capturing.trace import forward_signature

    parameters = forward_signature(base_class(model)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    pairs = []
    for name, shape in max_shapes.items():
        root = str(name).split("[", 1)[0].split(".", 1)[0]
        if not isinstance(name, str) or (root not in parameters and not takes_any):
            raise InvalidArgumentError(
                f"max_shapes names {name!r}, which is not an argument of "
                f"{base_class(model).__name__}.forward ({', '.join(parameters)})",
                fix="key max_shapes by the forward's argument names")
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, (tuple, list)) or not all(
                size is None or (isinstance(size, int) and not isinstance(size, bool)
                                 and size > 0) for size in shape):
            raise InvalidArgumentError(
                f"max_shapes[{name!r}] must be a tuple of positive ints or None, got {shape!r}",
                fix=f"pass e.g. max_shapes={{{name!r}: (None, 512)}}")
        pairs.append((name, tuple(shape)))
    return tuple(pairs)


def _check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise InvalidArgumentError(
            f"unknown {name} {value!r}", fix=f"use one of: {', '.join(repr(v) for v in valid)}"
        )


def _with_context(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Any
                  ) -> Any:
    """Run ``fn``; an error that is not ours means the forward failed on the inputs."""
    try:
        return fn()
    except AutockptError:
        raise
    except Exception as err:
        raise forward_failed(model, args, kwargs, err, name=base_class(model).__name__) from err
