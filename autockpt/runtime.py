"""What a transformed module runs: its class, its per-instance state and the checkpoint call.

``autockpt.apply`` returns an object of a subclass of the user's own class, made once per class
by :func:`checkpointed_class`, whose ``__dict__`` is a shallow copy of the original's. So the
result *is a* ``MyNet``, holds the very same submodules and Parameter objects, and has the same
``state_dict()`` keys; its methods other than ``forward`` are the user's.

Each checkpointed segment runs through :func:`autockpt.runner.run_checkpointed`, the runner the
modules rung shares (NOTE [ Recompute must not update buffers twice ] and NOTE [ RNG only where
needed ] there).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autockpt import modules
from autockpt.capture import NoGraph, capture
from autockpt.budget import DeviceBudget, device_budget
from autockpt.errors import AutockptError, BudgetWarning, InfeasibleBudgetError, InvalidArgumentError
from autockpt.loss import LossFn
from autockpt.planner import Plan, make_plan
from autockpt.stats import LOSS_OP
from autockpt.units import format_bytes
from autockpt.profile import profile
from autockpt.rewrite import Program, SegmentProgram, graph_fingerprint, rewrite
from autockpt.runner import CheckpointedForward, SegmentRun, needs_dummy, run_checkpointed
from autockpt.timing import time_nodes
from autockpt.trace import TracedModel, base_class, bind_inputs, generated_subclass

__all__ = [
    "ApplyConfig",
    "RuntimeState",
    "checkpointed_class",
    "make_checkpointed",
    "is_checkpointed",
    "make_any_plan",
    "plan_blocks",
    "plan_graph",
    "run_segment",
]

MAX_VARIANTS = 8
"""How many input signatures a module keeps plans for before forgetting the oldest."""


@dataclass(frozen=True)
class ApplyConfig:
    """What ``apply`` was asked for; the same for every input size."""

    budget_bytes: int | None
    """Peak activation bytes allowed; ``None`` for the least reachable."""
    mode: str
    """``"non_reentrant"`` or ``"reentrant"``."""
    strategy: str
    """Name of the planning strategy."""
    fixed_plan: Plan | None = None
    """A plan given by the user: applied as it is to every input size."""
    capture: str = "auto"
    """How to capture the forward (see :data:`autockpt.capture.CAPTURES`)."""
    cost: str = "flops"
    """The recompute cost model (see :data:`autockpt.timing.COSTS`)."""
    loss_fn: LossFn | None = None
    """The user's loss, priced with the model (NOTE [ The loss node ] in
    :mod:`autockpt.profile`); ``None``: the default (NOTE [ The default loss ])."""
    grad_accumulation: bool = False
    """Plan for steps in which the parameters' ``.grad`` already exists."""
    total_bytes: int | None = None
    """A budget for the whole device; the activation budget is what the step's fixed memory
    leaves of it (:func:`autockpt.budget.device_budget`)."""
    optimizer: Any = None
    """The optimizer whose state ``total_bytes`` counts."""


@dataclass
class _Variant:
    key: tuple[Any, ...]
    plan: Plan
    program: Program | None
    param_names: tuple[str, ...]
    flatten: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None
    unflatten: Callable[[Any], Any] | None = None
    blocks: modules.ModuleProfile | None = None
    """The ``"modules"`` rung: the profile whose blocks the plan checkpoints (no program)."""

    @property
    def ready(self) -> bool:
        return self.program is not None or self.blocks is not None

    def run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            arguments: dict[str, Any]) -> Any:
        """The rewritten forward on a call bound to ``arguments``."""
        if self.blocks is not None:
            state: RuntimeState = module.__dict__["_autockpt"]
            if state.installed is not self:
                # The block views of the twin checkpoint what this variant's plan chose.
                modules.install(module, self.blocks, self.plan)
                state.installed = self
            return base_class(module).forward(module, *args, **kwargs)
        assert self.program is not None
        if not self.plan.segments:
            # Nothing to checkpoint: the user's own forward runs the same ops without the
            # generated code's per-node Python (an exported graph of a large model has
            # thousands of aten calls).
            return base_class(module).forward(module, *args, **kwargs)
        if self.flatten is not None:
            inputs = self.flatten(arguments)
        else:
            inputs = tuple(arguments[name] for name in self.param_names)
        out = self.program.forward(module, *inputs)
        return out if self.unflatten is None else self.unflatten(out)


class RuntimeState:
    """Per-module state: the config, and one plan and program per input signature."""

    def __init__(self, config: ApplyConfig) -> None:
        self.config = config
        self.variants: OrderedDict[tuple[Any, ...], _Variant] = OrderedDict()
        self.by_id: dict[int, _Variant] = {}
        self.last_plan: Plan | None = None
        self.installed: _Variant | None = None
        self.checked_grads = False
        self._next_id = 0
        self._lock = threading.RLock()

    # Compiled code is not pickled; it is rebuilt from the stored plans at the next forward.
    # Nor are the loss function (often a lambda) and the optimizer: the stored plans keep
    # what they priced, and a new input shape is planned with the default loss, which never
    # assumes less than a real loss's gradient.
    def __getstate__(self) -> dict[str, Any]:
        return {
            "config": replace(self.config, loss_fn=None, optimizer=None),
            "plans": [(v.key, v.plan) for v in self.variants.values()],
            "last_plan": self.last_plan,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]
        self.last_plan = state["last_plan"]
        for key, plan in state["plans"]:
            self.variants[key] = _Variant(key=key, plan=plan, program=None, param_names=())

    def variant_for(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[_Variant, dict[str, Any]]:
        arguments = bind_inputs(module, args, kwargs)
        key = signature_key(arguments)
        variant = self.variants.get(key)
        if variant is not None and variant.ready:
            self.variants.move_to_end(key)
            self.last_plan = variant.plan
            return variant, arguments
        with self._lock:
            variant = self.variants.get(key)
            if variant is None or not variant.ready:
                known = variant.plan if variant is not None else None
                variant = self._build(module, args, kwargs, arguments, key, known)
            self.last_plan = variant.plan
            return variant, arguments

    def prepare(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """Plan and compile for these inputs now (``apply`` with example inputs)."""
        variant, _ = self.variant_for(module, args, kwargs)
        return variant.plan

    def _build(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arguments: dict[str, Any],
        key: tuple[Any, ...],
        known: Plan | None,
    ) -> _Variant:
        plan = known if known is not None else self.config.fixed_plan
        # A given plan is re-applied to a graph captured the way it was made.
        method = plan.capture if plan is not None else self.config.capture
        traced = capture(module, args, kwargs, method)
        if isinstance(traced, NoGraph):
            made, prof = plan_blocks(module, args, kwargs, traced.reason, self.config)
            variant = _Variant(key=key, plan=plan if plan is not None else made, program=None,
                               param_names=(), blocks=prof)
            modules.blocks_of_plan(prof, variant.plan)  # a given plan must name these blocks
            self._remember(key, variant)
            return variant
        fingerprint = graph_fingerprint(traced.graph)
        if plan is not None:
            check_plan_fits(plan, traced, fingerprint)
        else:
            plan = plan_graph(module, traced, arguments, self.config)
        variant_id = self._next_id
        self._next_id += 1
        program = compile_plan(module, traced, plan, variant_id)
        variant = _Variant(key=key, plan=plan, program=program,
                           param_names=traced.spec.param_names, flatten=traced.flatten,
                           unflatten=traced.unflatten)
        self.by_id[variant_id] = variant
        self._remember(key, variant)
        return variant

    def _remember(self, key: tuple[Any, ...], variant: _Variant) -> None:
        self.variants[key] = variant
        while len(self.variants) > MAX_VARIANTS:
            _, old = self.variants.popitem(last=False)
            self.by_id = {i: v for i, v in self.by_id.items() if v is not old}


def plan_blocks(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
    config: ApplyConfig,
) -> tuple[Plan, modules.ModuleProfile]:
    """The ``"modules"`` rung: profile whole submodules with hooks and plan over them.

    It has no graph to time node by node: ``cost="profile"`` plans by FLOPs here, and the
    plan's notes say so. Nor does it run the loss with the model: it prices the gradient a
    loss sends into the output as an output-sized one, and says so."""
    from autockpt.trace import shallow_view

    _refuse_caches(module, args, kwargs)
    budget_bytes, device = resolve_budget(module, args, kwargs, config)
    # The user's forward on the user's class, with the twin's block views running plainly.
    view = shallow_view(module)
    with modules.suspended(view), _whole_device(device):
        plan, prof = modules.build(view, args, kwargs, budget_bytes=budget_bytes,
                                   mode=config.mode, strategy=config.strategy,
                                   grad_accumulation=config.grad_accumulation)
    notes = plan.notes
    if config.cost != "flops":
        notes += (f"cost={config.cost!r} needs a graph to time; the modules rung planned by "
                  "FLOPs",)
    if config.loss_fn is not None:
        notes += ("the modules rung cannot run loss_fn with the model: it priced an "
                  "output-sized gradient for each output instead",)
    return replace(plan, model=base_class(module).__name__, capture="modules",
                   capture_reason=reason, notes=notes, device=device), prof


def resolve_budget(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   config: ApplyConfig) -> tuple[int | None, DeviceBudget | None]:
    """The activation budget for these inputs: ``budget_bytes``, or what the step's fixed
    memory leaves of ``total_bytes``."""
    if config.total_bytes is None:
        return config.budget_bytes, None
    device = device_budget(module, (args, kwargs), config.total_bytes, config.optimizer,
                           subject=base_class(module).__name__)
    return device.activation_budget_bytes, device


@contextlib.contextmanager
def _whole_device(device: DeviceBudget | None) -> Iterator[None]:
    """Say what an activation budget that does not fit means for the whole device."""
    try:
        yield
    except InfeasibleBudgetError as err:
        if device is None:
            raise
        least = device.fixed_bytes + err.min_feasible_bytes
        raise InfeasibleBudgetError(
            f"the step needs at least {format_bytes(least)} of total_mb "
            f"({format_bytes(device.total_bytes)}): {format_bytes(device.fixed_bytes)} fixed "
            f"(parameters {format_bytes(device.parameter_bytes)}, gradients "
            f"{format_bytes(device.gradient_bytes)}, {device.optimizer} state "
            f"{format_bytes(device.optimizer_state_bytes)}, inputs "
            f"{format_bytes(device.input_bytes)}) and {format_bytes(err.min_feasible_bytes)} "
            f"of activations at the least",
            budget_bytes=device.total_bytes, min_feasible_bytes=least,
            fix=f"pass total_mb={-(-least * 100 // 2**20) / 100} or more, or use a smaller "
            "batch",
        ) from err


def _refuse_caches(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A block that appends to a key/value cache would append twice when it is recomputed:
    the gradients stay right but the cache the model returns is wrong, silently. Hugging
    Face turns the cache off when it checkpoints; here the user must."""
    use_cache = bind_inputs(module, args, kwargs).get("use_cache")
    config = getattr(module, "config", None)
    if use_cache is None and config is not None:
        use_cache = getattr(config, "use_cache", None)
    if use_cache is True:
        raise InvalidArgumentError(
            f"{base_class(module).__name__} is called with use_cache=True: checkpointing its "
            "blocks would add every key/value to the cache twice when they are recomputed",
            fix="pass use_cache=False in the training batch (or set model.config.use_cache = "
            "False); torch.export can then capture the model too",
        )


def make_any_plan(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  config: ApplyConfig) -> Plan:
    """Capture with the ladder and plan, whichever rung is used (what :func:`autockpt.plan`
    does)."""
    traced = capture(module, args, kwargs, config.capture)
    if isinstance(traced, NoGraph):
        return plan_blocks(module, args, kwargs, traced.reason, config)[0]
    return plan_graph(module, traced, bind_inputs(module, args, kwargs), config)


def plan_graph(module: nn.Module, traced: TracedModel, arguments: dict[str, Any],
               config: ApplyConfig) -> Plan:
    """Profile a captured graph and the loss on fake tensors and plan it (what
    :func:`autockpt.plan` and the first training forward of a transformed module both do).
    With ``cost="profile"`` the nodes are also timed on the real device and the planner
    weighs recompute by time."""
    budget_bytes, device = resolve_budget(module, (), arguments, config)
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(arguments)))
    stats = profile(traced, inputs, loss_fn=config.loss_fn)
    if config.cost == "profile":
        times = iter(time_nodes(traced, inputs))
        # The loss node is the user's code, never recomputed: it needs no time.
        stats = replace(stats, nodes=tuple(
            replace(node, time_ns=0 if node.op == LOSS_OP else next(times))
            for node in stats.nodes))
    with _whole_device(device):
        plan = make_plan(stats, budget_bytes, strategy=config.strategy, mode=config.mode,
                         model=base_class(module).__name__,
                         grad_accumulation=config.grad_accumulation)
    return replace(plan, graph_fingerprint=graph_fingerprint(traced.graph),
                   capture=traced.capture, capture_reason=traced.capture_reason,
                   cost_model=config.cost, device=device)


def check_plan_fits(plan: Plan, traced: TracedModel, fingerprint: str) -> None:
    """Raise if ``plan`` was made for a different graph than ``traced``."""
    count = len(traced.graph.nodes)
    if plan.node_count != count or (plan.graph_fingerprint and plan.graph_fingerprint != fingerprint):
        raise AutockptError(
            f"the plan was made for a different graph ({plan.model}, {plan.node_count} nodes, "
            f"fingerprint {plan.graph_fingerprint or '?'}) than this model traces to "
            f"({count} nodes, fingerprint {fingerprint})",
            fix="make the plan with autockpt.plan() on this model, with inputs that take the "
            "same branches (None arguments and flags must match)",
        )


def compile_plan(module: nn.Module, traced: TracedModel, plan: Plan, variant_id: int) -> Program:
    """Compile ``plan`` for ``traced`` and attach the tracer's tensor constants to ``module``."""
    constant_names = {}
    for i, (name, value) in enumerate(sorted(traced.constants.items())):
        new_name = f"_autockpt_const_{variant_id}_{i}"
        constant_names[name] = new_name
        module.__dict__[new_name] = value
    trainable = []
    for node in traced.graph.nodes:
        stat = node.meta.get("autockpt")
        if stat is not None:
            trainable.append(stat.trainable)
        elif node.op == "call_module":
            sub = traced.graph_module.get_submodule(str(node.target))
            trainable.append(any(p.requires_grad for p in sub.parameters()))
        else:
            trainable.append(
                any(
                    a.op == "get_attr" and getattr(_fetch(traced, a.target), "requires_grad", False)
                    for a in node.all_input_nodes
                )
            )
    return rewrite(traced.graph, plan, variant_id, trainable=trainable,
                   constant_names=constant_names)


def _fetch(traced: TracedModel, target: Any) -> Any:
    obj: Any = traced.graph_module
    for atom in str(target).split("."):
        obj = getattr(obj, atom)
    return obj


def signature_key(arguments: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two calls need different plans: tensor shapes, dtypes, devices and
    ``requires_grad``, and the values of Python constants (they are baked into the graph)."""
    key: list[Any] = []
    devices: set[str] = set()
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            key.append((name, tuple(value.shape), value.dtype, value.device.type,
                        value.requires_grad))
            devices.add(value.device.type)
        elif isinstance(value, (type(None), bool, int, float, str)):
            key.append((name, type(value).__name__, value))
        else:
            key.append((name, type(value).__name__))
    # Autocast changes the dtype, so the size, of every activation: a plan made under
    # bfloat16 autocast and reused without it (or the reverse) holds for the wrong sizes, and
    # a bf16 plan run in float32 overshoots its budget. Plan once per autocast setting.
    for device in sorted(devices):
        try:
            enabled = torch.is_autocast_enabled(device)
        except RuntimeError:  # a device type autocast does not know, e.g. "meta"
            enabled = False
        if enabled:
            key.append(("autocast", device, torch.get_autocast_dtype(device)))
    return tuple(key)


# --------------------------------------------------------------------------- running a segment


def run_segment(module: nn.Module, program: SegmentProgram, mode: str, inputs: tuple[Any, ...]
                ) -> Any:
    """Run one compiled segment of ``module`` under checkpoint (:mod:`autockpt.runner`)."""
    if not torch.is_grad_enabled():
        return program.fn(module, *inputs)
    segment = program.segment
    run = SegmentRun(module=module, segment=segment, block="", mode=mode,
                     dummy_arg=needs_dummy(mode, program.trainable, inputs))
    return run_checkpointed(run, functools.partial(program.fn, module), inputs,
                            preserve_rng=segment.preserve_rng, buffers=segment.buffers)


# --------------------------------------------------------------------------- the class


def _warn_if_accumulating(module: nn.Module, state: RuntimeState) -> None:
    """Warn once when ``.grad`` is already allocated at a training forward of a model planned
    for fresh gradients: its weight gradients are then temporaries the plan did not price."""
    if state.config.grad_accumulation:
        state.checked_grads = True
        return
    first = next((p for p in module.parameters() if p.requires_grad), None)
    if first is None or first.grad is None:
        return
    state.checked_grads = True
    warnings.warn(
        f"{base_class(module).__name__}: .grad is already allocated at this training forward "
        "(gradient accumulation, or zero_grad(set_to_none=False)), so each weight gradient is "
        "a temporary added into it, which the plan did not count: the budget may not hold. "
        "Fix: pass grad_accumulation=True to autockpt.apply, or call "
        "optimizer.zero_grad(set_to_none=True) between steps",
        BudgetWarning, stacklevel=6,
    )


class _CheckpointedMixin(CheckpointedForward):
    """Methods added to the user's class. Only ``forward`` changes behaviour."""

    def _autockpt_how(self) -> RuntimeState | None:
        return self.__dict__.get("_autockpt")

    def _autockpt_forward(self, how: RuntimeState, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        module: nn.Module = self  # type: ignore[assignment]
        if not how.checked_grads:
            _warn_if_accumulating(module, how)
        variant, arguments = how.variant_for(module, args, kwargs)
        return variant.run(module, args, kwargs, arguments)

    def _autockpt_run(self, variant_id: int, index: int, *inputs: Any) -> Any:
        state: RuntimeState = self.__dict__["_autockpt"]
        program = state.by_id[variant_id].program
        assert program is not None
        return run_segment(self, program.segments[index], state.config.mode, inputs)  # type: ignore[arg-type]


def checkpointed_class(base: type[nn.Module]) -> type[nn.Module]:
    """The subclass of ``base`` that transformed modules have (made once per class)."""
    return generated_subclass(_CheckpointedMixin, base)


def make_checkpointed(module: nn.Module, config: ApplyConfig) -> nn.Module:
    """A transformed twin of ``module`` sharing its submodules, parameters and buffers."""
    from autockpt.trace import shallow_view

    twin = shallow_view(module, checkpointed_class(base_class(module)))
    for name in [k for k in twin.__dict__ if k.startswith("_autockpt_const_")]:
        del twin.__dict__[name]
    twin.__dict__["_autockpt"] = RuntimeState(config)
    return twin


def is_checkpointed(module: Any) -> bool:
    """Whether ``module`` was returned by ``autockpt.apply``."""
    return isinstance(module, nn.Module) and isinstance(module.__dict__.get("_autockpt"),
                                                        RuntimeState)
