"""What a transformed module runs: its class, its per-instance state and its segments.

``autockpt.apply`` returns an object of a subclass of the user's own class, made once per class
by :func:`checkpointed_class`, whose ``__dict__`` is a shallow copy of the original's. So the
result *is a* ``MyNet``, holds the very same submodules and Parameter objects, and has the same
``state_dict()`` keys; its methods other than ``forward`` are the user's.

At the first training forward with a new input signature the stages run
(:func:`autockpt.pipeline.build`); the state keeps what they return, per signature, and runs it.

Each checkpointed segment runs through :func:`autockpt.running.runner.run_checkpointed`, the runner the
modules rung shares (NOTE [ Recompute must not update buffers twice ] and NOTE [ RNG only where
needed ] there).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from autockpt import pipeline
from autockpt.capturing.ladder import has_hooks
from autockpt.capturing.meta import autocast_enabled
from autockpt.capturing.trace import base_class, bind_inputs, generated_subclass, shallow_view
from autockpt.errors import AutockptError, BudgetWarning

# Modules pickled before the pipeline existed name autockpt.runtime.ApplyConfig.
from autockpt.pipeline import ApplyConfig, BlockPlan
from autockpt.planning.planner import Plan
from autockpt.profiling.blocks import ModuleProfile
from autockpt.running.blocks import install
from autockpt.running.rewrite import Program
from autockpt.running.runner import CheckpointedForward, run_segment
from autockpt.units import format_names

__all__ = [
    "RuntimeState",
    "checkpointed_class",
    "make_checkpointed",
    "is_checkpointed",
    "run_segment",
    "signature_key",
]

MAX_VARIANTS = 8
"""How many input signatures a module keeps plans for before forgetting the oldest."""


@dataclass
class _Variant:
    """What a transformed module runs for one input signature."""

    key: tuple[Any, ...]
    """The signature (:func:`signature_key`)."""
    plan: Plan
    """The plan for it."""
    program: Program | None
    """The compiled code (graph rungs); ``None`` for the modules rung, or until a plan
    restored from a pickle is compiled again."""
    param_names: tuple[str, ...]
    """The forward's parameter names, in the order the program takes them."""
    flatten: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None
    """Maps the bound arguments to the program's inputs (an exported graph's pytree);
    ``None``: one input per name in :attr:`param_names`."""
    unflatten: Callable[[Any], Any] | None = None
    """Rebuilds the forward's output from what the program returns; ``None``: as it is."""
    blocks: ModuleProfile | None = None
    """The ``"modules"`` rung: the profile whose blocks the plan checkpoints (no program)."""
    inlined: tuple[tuple[str, nn.Module], ...] = ()
    """The submodules the program runs the ops of instead of calling them
    (:func:`inlined_modules`): a hook added to one of them later would never run."""

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
                install(module, self.blocks, self.plan)
                state.installed = self
            return base_class(module).forward(module, *args, **kwargs)
        assert self.program is not None
        if not self.plan.segments and self.plan.chunked_head is None:
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
        self.cache_warned = False
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

    def training_kwargs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> dict[str, Any]:
        """``kwargs`` as a training forward runs them: without a key/value cache, said once
        per module (NOTE [ A training forward runs without the cache ] in
        :mod:`autockpt.pipeline`)."""
        uncached = pipeline.without_cache(module, args, kwargs)
        if uncached is None:
            return kwargs
        if not self.cache_warned:
            self.cache_warned = True
            warnings.warn(pipeline.cache_turned_off_warning(module), UserWarning, stacklevel=5)
        return uncached

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

    def replan_for_hooks(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         arguments: dict[str, Any], stale: _Variant) -> _Variant:
        """Plan again with the submodules that got hooks after planning kept whole (NOTE
        [ Module calls kept whole ] in :mod:`autockpt.capturing.ladder`): running the old program
        would skip their hooks."""
        hooked = _hooked(stale)
        with self._lock:
            try:
                variant = self._build(module, args, kwargs, arguments, stale.key, None)
            except Exception as err:
                shown = format_names([repr(name) for name in hooked])
                raise AutockptError(
                    f"hooks were registered on {shown} after autockpt planned this model, "
                    "which runs the ops inside those modules instead of calling them, and "
                    f"planning again with them kept whole failed ({type(err).__name__}: "
                    f"{err})",
                    fix=f"pass keep_whole={hooked[:4]!r} (or a pattern such as 'layers.*') "
                    "to autockpt.apply, so that the first plan calls those modules whole",
                ) from err
            variant.plan = replace(variant.plan, notes=(
                *variant.plan.notes, _replanned_note(module, hooked)))
            self.last_plan = variant.plan
            return variant

    def prepare(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """Plan and compile for these inputs now (``apply`` with example inputs)."""
        variant, _ = self.variant_for(module, args, self.training_kwargs(module, args, kwargs))
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
        built = pipeline.build(module, args, kwargs, arguments, self.config, known,
                               self._next_id)
        if isinstance(built, BlockPlan):
            variant = _Variant(key=key, plan=built.plan, program=None, param_names=(),
                               blocks=built.profile)
            self._remember(key, variant)
            return variant
        variant_id = self._next_id
        self._next_id += 1
        traced = built.planned.traced
        variant = _Variant(key=key, plan=built.planned.plan, program=built.program,
                           param_names=traced.spec.param_names, flatten=traced.flatten,
                           unflatten=traced.unflatten,
                           inlined=inlined_modules(module, traced.graph))
        self.by_id[variant_id] = variant
        self._remember(key, variant)
        return variant

    def _remember(self, key: tuple[Any, ...], variant: _Variant) -> None:
        self.variants[key] = variant
        while len(self.variants) > MAX_VARIANTS:
            _, old = self.variants.popitem(last=False)
            self.by_id = {i: v for i, v in self.by_id.items() if v is not old}


def signature_key(arguments: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two calls need different plans: tensor shapes, dtypes, devices and
    ``requires_grad``, the values of Python constants (they are baked into the graph), and the
    structure of nested inputs (a dict batch with another key, or a tensor where ``None`` was,
    is another graph), down to the tensors and constants inside them."""
    devices: set[str] = set()
    key: list[Any] = [(name, _value_key(value, devices)) for name, value in arguments.items()]
    # Autocast changes the dtype, so the size, of every activation: a plan made under
    # bfloat16 autocast and reused without it (or the reverse) holds for the wrong sizes, and
    # a bf16 plan run in float32 overshoots its budget. Plan once per autocast setting.
    for device in sorted(devices):
        if autocast_enabled(device):  # False for a device type autocast does not know
            key.append(("autocast", device, torch.get_autocast_dtype(device)))
    return tuple(key)


def _value_key(value: Any, devices: set[str]) -> Any:
    if isinstance(value, torch.Tensor):
        devices.add(value.device.type)
        return (tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, (type(None), bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(item, devices) for item in value))
    if isinstance(value, Mapping):
        return (type(value).__name__,
                tuple((key, _value_key(item, devices)) for key, item in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple(
            (f.name, _value_key(getattr(value, f.name), devices))
            for f in dataclasses.fields(value)))
    return type(value).__name__


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


def inlined_modules(module: nn.Module, graph: fx.Graph) -> tuple[tuple[str, nn.Module], ...]:
    """``(name, submodule)`` for each submodule of ``module`` that ``graph`` does not call:
    neither a ``call_module`` target nor inside one (NOTE [ Module calls kept whole ] in
    :mod:`autockpt.capturing.ladder`)."""
    called = {str(node.target) for node in graph.nodes if node.op == "call_module"}

    def is_called(name: str) -> bool:
        atoms = name.split(".")
        return any(".".join(atoms[:k]) in called for k in range(1, len(atoms) + 1))

    return tuple((name, sub) for name, sub in module.named_modules()
                 if name and not is_called(name))


def _hooked(variant: _Variant) -> list[str]:
    """Submodules the program traced into that have hooks now (added after planning)."""
    return [name for name, sub in variant.inlined if has_hooks(sub)]


def _replanned_note(module: nn.Module, hooked: list[str]) -> str:
    """What the plan's printout says of a plan made again because of hooks added after the
    first (NOTE [ Planning a sharded model ] in :mod:`autockpt.capturing.ladder`)."""
    shown = format_names([repr(name) for name in hooked])
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    sharded = fsdp is not None and any(isinstance(module.get_submodule(name), fsdp)
                                       for name in hooked)
    if sharded:
        return (f"re-planned at the first forward: FSDP2's fully_shard put hooks on {shown} "
                "after apply, so those modules are kept whole; profiled on fake tensors of the "
                "sharded parameters' full shapes")
    return (f"re-planned at the first forward: hooks were registered on {shown} after apply, "
            "so those modules are kept whole")


def _rebuild(base: type[nn.Module]) -> nn.Module:
    cls = checkpointed_class(base)
    return object.__new__(cls)  # see trace.shallow_view


class _CheckpointedMixin(CheckpointedForward):
    """Methods added to the user's class. Only ``forward`` changes behaviour."""

    _autockpt_rebuild = staticmethod(_rebuild)

    def _autockpt_how(self) -> RuntimeState | None:
        return self.__dict__.get("_autockpt")

    def _autockpt_forward(self, how: RuntimeState, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        module: nn.Module = self  # type: ignore[assignment]
        if not how.checked_grads:
            _warn_if_accumulating(module, how)
        kwargs = how.training_kwargs(module, args, kwargs)
        variant, arguments = how.variant_for(module, args, kwargs)
        if (variant.plan.segments or variant.plan.chunked_head) and _hooked(variant):
            variant = how.replan_for_hooks(module, args, kwargs, arguments, variant)
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
    twin = shallow_view(module, checkpointed_class(base_class(module)))
    for name in [k for k in twin.__dict__ if k.startswith("_autockpt_const_")]:
        del twin.__dict__[name]
    twin.__dict__["_autockpt"] = RuntimeState(config)
    return twin


def is_checkpointed(module: Any) -> bool:
    """Whether ``module`` was returned by ``autockpt.apply``."""
    return isinstance(module, nn.Module) and isinstance(module.__dict__.get("_autockpt"),
                                                        RuntimeState)
