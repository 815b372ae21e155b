"""What a transformed module runs: its class, its per-instance state and its segments.

``autockpt.apply`` returns an object of a subclass of the user's own class, made once per class
by :func:`checkpointed_class`, whose ``__dict__`` is a shallow copy of the original's. So the
result *is a* ``MyNet``, holds the very same submodules and Parameter objects, and has the same
``state_dict()`` keys; its methods other than ``forward`` are the user's.

At a training forward the state finds the plan for the call: by its signature, else among the
plans of its input structure one that serves its shape, else it captures the structure once
(:func:`autockpt.pipeline.capture_shared`), plans the shape's bucket
(:func:`autockpt.pipeline.plan_shared`) and compiles the plan unless a program with the same
segments exists (NOTE [ Buckets of shapes ] in :mod:`autockpt.planning.buckets`).

Each checkpointed segment runs through :func:`autockpt.running.runner.run_checkpointed`, the
runner the modules rung shares (NOTE [ Recompute must not update buffers twice ] and NOTE
[ RNG only where needed ] there).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import fx, nn

from autockpt import pipeline
from autockpt.capturing.ladder import NoGraph, has_hooks
from autockpt.capturing.shapes import (Shapes, resized_call, signature_key, structure_key,
                                       tensor_names, tensor_shapes)
from autockpt.capturing.trace import (TracedModel, base_class, bind_inputs, generated_subclass,
                                      shallow_view)
from autockpt.errors import AutockptError, BudgetWarning, InvalidArgumentError

# Modules pickled before the pipeline existed name autockpt.runtime.ApplyConfig.
from autockpt.pipeline import ApplyConfig, BlockPlan
from autockpt.planning.buckets import (choose, covering, dominates, plan_pays,
                                       recompute_seconds, target_shapes, varying_dims)
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

KNOWN_SHAPES = 4096
"""How many input signatures a module remembers the plan of, to find it without a search;
the plans themselves are all kept (one per bucket of shapes, NOTE [ Buckets of shapes ] in
:mod:`autockpt.planning.buckets`)."""


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
    priced: Shapes = ()
    """The tensor shapes the plan was priced at; every call no larger in any dimension keeps
    its budget (NOTE [ Buckets of shapes ] in :mod:`autockpt.planning.buckets`)."""
    stated: bool = False
    """Priced at a shape the user stated as the largest (``example_inputs``, ``max_shapes``):
    serves every smaller call."""
    graph: TracedModel | NoGraph | None = None
    """The shared capture the plan was made on; ``None`` for a plan made for one signature."""

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


@dataclass
class _StandIn:
    """A call run by a larger plan than its bucket's: where what it recomputes is counted
    (NOTE [ Buckets of shapes ] in :mod:`autockpt.planning.buckets`)."""

    family: _Family
    bucket: Shapes


@dataclass
class _Family:
    """The calls of one input structure (:func:`structure_key`): the graphs captured for
    them, the plans priced for their shapes, and the programs those plans compiled to."""

    first: Shapes | None = None
    """The shapes of the structure's first call."""
    largest: Shapes | None = None
    """The largest size met in each dimension (of any call, not necessarily of one)."""
    varying: tuple[tuple[int, int], ...] = ()
    """``(tensor, dimension)`` of each size seen to differ from the first call's."""
    graphs: list[TracedModel | NoGraph] = field(default_factory=list)
    """The shared captures (NOTE [ One graph for every shape ] in
    :mod:`autockpt.capturing.shapes`); a ``NoGraph`` for the modules rung."""
    plans: list[_Variant] = field(default_factory=list)
    """One per priced shape, in the order they were made."""
    programs: dict[tuple[Any, ...], tuple[int, Program]] = field(default_factory=dict)
    """``(variant id, program)`` by graph and segments: compiled once per distinct plan."""
    recomputed: dict[Shapes, float] = field(default_factory=dict)
    """By bucket without a plan of its own: the seconds the larger plans that ran its calls
    are estimated to have recomputed (NOTE [ Buckets of shapes ] in
    :mod:`autockpt.planning.buckets`)."""
    plan_seconds: float | None = None
    """What the structure's last plan took to make (profile, search, compile; not the
    capture)."""
    failed_beyond: list[Shapes] = field(default_factory=list)
    """The largest sizes met at which a plan failed (a budget no plan meets there, a size the
    graph fixes): no call larger than every plan is planned at sizes at least those again."""
    pricing: dict[int, pipeline.ShapePricing] = field(default_factory=dict)
    """By graph (its index in :attr:`graphs`): its profile at every shape (NOTE [ Pricing
    every shape of a shared graph ] in :mod:`autockpt.pipeline`)."""

    def see(self, shapes: Shapes) -> None:
        self.largest = shapes if self.largest is None else tuple(
            tuple(max(a, b) for a, b in zip(mine, theirs))
            for mine, theirs in zip(self.largest, shapes))
        if self.first is None:
            self.first = shapes
            return
        more = varying_dims([self.first, shapes])
        if not set(more) <= set(self.varying):
            self.varying = tuple(sorted(set(self.varying) | set(more)))


class RuntimeState:
    """Per-module state: the config, and the plans and programs for the shapes it has met."""

    def __init__(self, config: ApplyConfig) -> None:
        self.config = config
        self.variants: OrderedDict[tuple[Any, ...], _Variant] = OrderedDict()
        self.families: dict[tuple[Any, ...], _Family] = {}
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
        made: list[_Variant] = []
        for variant in self.variants.values():
            if not any(variant is other for other in made):
                made.append(variant)
        return {
            "config": replace(self.config, loss_fn=None, optimizer=None),
            "plans": [(v.key, v.plan) for v in made],
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

    def variant_for(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    *, stated: bool = False) -> tuple[_Variant, dict[str, Any]]:
        """The plan and program for this call: found by its signature, else chosen among the
        plans of its input structure, else priced and compiled (``stated``: the call is the
        largest the user will send, NOTE [ Buckets of shapes ] in
        :mod:`autockpt.planning.buckets`)."""
        variant, arguments, _ = self.find(module, args, kwargs, stated=stated)
        return variant, arguments

    def find(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             *, stated: bool = False) -> tuple[_Variant, dict[str, Any], _StandIn | None]:
        """:meth:`variant_for`, and where a larger plan stands in for the call's bucket, the
        account its recompute goes to (:meth:`count_recompute`)."""
        arguments = bind_inputs(module, args, kwargs)
        key = signature_key(arguments)
        variant = self.variants.get(key)
        if variant is not None and variant.ready and not stated:
            self.variants.move_to_end(key)
            self.last_plan = variant.plan
            return variant, arguments, None
        with self._lock:
            variant = self.variants.get(key)
            if variant is None or not variant.ready or stated:
                if (variant is not None and not variant.ready) or \
                        self.config.fixed_plan is not None:
                    known = variant.plan if variant is not None else None
                    variant = self._build(module, args, kwargs, arguments, key, known)
                else:
                    variant, standing_in = self._for_shape(module, args, kwargs, arguments, key,
                                                           stated)
                    if standing_in is not None:
                        # A larger plan standing in for this shape's bucket: the next call of
                        # the shape counts towards the bucket's own plan again.
                        self.last_plan = variant.plan
                        return variant, arguments, standing_in
                self._remember(key, variant)
            self.last_plan = variant.plan
            return variant, arguments, None

    def count_recompute(self, standing_in: _StandIn, plan: Plan, forward_seconds: float
                        ) -> None:
        """Add to a bucket's account what ``plan``, standing in for it, recomputed in a step
        whose forward took ``forward_seconds`` (NOTE [ Buckets of shapes ])."""
        spent = recompute_seconds(forward_seconds, plan.recompute_flops, plan.forward_flops)
        with self._lock:
            account = standing_in.family.recomputed
            account[standing_in.bucket] = account.get(standing_in.bucket, 0.0) + spent

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
            # The shared plans traced into those modules too: this structure is planned anew.
            self.families.pop(structure_key(arguments), None)
            self.variants = OrderedDict((k, v) for k, v in self.variants.items()
                                        if v.graph is None)
            self._remember(signature_key(arguments), variant)
            self.last_plan = variant.plan
            return variant

    def prepare(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """Plan and compile for these inputs now (``apply`` with example inputs): the plan
        serves them and every call of the same structure no larger."""
        variant, _ = self.variant_for(module, args, self.training_kwargs(module, args, kwargs),
                                      stated=True)
        return variant.plan

    def plan_for(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Plan:
        """The plan a training forward with these inputs runs, made now if none serves them
        (no forward runs)."""
        variant, _ = self.variant_for(module, args, self.training_kwargs(module, args, kwargs))
        return variant.plan

    def _for_shape(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   arguments: dict[str, Any], key: tuple[Any, ...], stated: bool
                   ) -> tuple[_Variant, _StandIn | None]:
        """The plan of the call's structure that serves its shape, or a new one priced at its
        bucket (NOTE [ Buckets of shapes ] in :mod:`autockpt.planning.buckets`), and where it
        only stands in for the bucket's own plan (a larger one), the bucket's account."""
        family = self.families.setdefault(structure_key(arguments), _Family())
        shapes = tensor_shapes(arguments)
        family.see(shapes)
        cover: int | None = None
        if not stated:
            # Each graph checked once: plans share their structure's few graphs.
            runs = {id(g): _runs_at(g, arguments) for g in family.graphs}
            usable = [v for v in family.plans if v.graph is not None and runs[id(v.graph)]]
            index = choose([v.priced for v in usable], [v.stated for v in usable], shapes,
                           family.varying)
            if index is not None:
                return usable[index], None
            # NOTE [ Buckets of shapes ]: a larger plan serves a bucket until its own pays.
            cover = covering([v.priced for v in usable], shapes)
            if cover is not None:
                bucket = target_shapes(shapes, family.varying)
                if not plan_pays(family.recomputed.get(bucket, 0.0), family.plan_seconds):
                    return usable[cover], _StandIn(family, bucket)
                family.recomputed.pop(bucket, None)
        beyond: Shapes | None = None
        target = _stated_target(self.config.max_shapes, arguments, shapes)
        if target is not None:
            stated = True
        elif stated:
            target = shapes
        else:
            target = target_shapes(shapes, family.varying)
            if cover is None and family.largest is not None:
                # NOTE [ Buckets of shapes ]: a call larger than every plan is planned at the
                # largest size met in each dimension, so that the calls to come, smaller in
                # some dimension and larger in another, find a plan that keeps their budget;
                # not where a plan at sizes no larger failed (memory grows with every size).
                largest = target_shapes(family.largest, family.varying)
                if not any(dominates(largest, failed) for failed in family.failed_beyond):
                    beyond = largest
        # A size the model fixes (a branch on it), a combination of sizes it refuses, or a
        # budget only the call's own size meets: the next smaller target.
        targets = [t for i, t in enumerate((beyond, target, shapes))
                   if t is not None and t not in (beyond, target, shapes)[:i]]
        for at in targets[:-1]:
            try:
                variant = self._price(module, args, kwargs, arguments, key, family, shapes, at,
                                      stated and at == target)
            except Exception:
                if at == beyond:
                    family.failed_beyond.append(at)
                continue
            # Planned beyond the call's bucket: it stands in for the bucket's plan.
            return variant, _StandIn(family, target) if at == beyond != target else None
        return self._price(module, args, kwargs, arguments, key, family, shapes, targets[-1],
                           stated and targets[-1] == target), None

    def _price(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               arguments: dict[str, Any], key: tuple[Any, ...], family: _Family,
               shapes: Shapes, target: Shapes, stated: bool) -> _Variant:
        """Plan the call's structure at ``target`` (at least the call's ``shapes``) on a shared
        graph that takes both, compile it unless a program for the same segments exists, and
        remember the plan in ``family``."""
        priced_args, priced_kwargs, priced = (args, kwargs, arguments) if target == shapes \
            else resized_call(args, kwargs, arguments, target)
        graph = next((g for g in family.graphs
                      if _runs_at(g, arguments) and _runs_at(g, priced)), None)
        if graph is None and any(_runs_at(g, arguments) for g in family.graphs):
            # A capture at the call's shape would fix the same sizes as the graph that runs it.
            raise AutockptError(f"the graph fixes a size of {_describe_shapes(arguments)}",
                                fix="none needed: planned at a smaller shape")
        if graph is None:
            graph = pipeline.capture_shared(module, args, kwargs, self.config)
            family.graphs.append(graph)
            if not _runs_at(graph, priced):
                raise AutockptError(f"the graph fixes a size of {_describe_shapes(arguments)}",
                                    fix="none needed: planned at the call's own shape")
        # A capture is made once per structure: what a later plan costs is the rest.
        start = time.perf_counter()
        pricing = family.pricing.setdefault(family.graphs.index(graph),
                                            pipeline.ShapePricing())
        built = pipeline.plan_shared(module, graph, priced_args, priced_kwargs, priced,
                                     self.config, pricing)
        plan = replace(built.plan, serves=_serves(arguments, target, family.varying, stated)
                       if target != shapes or stated else "")
        if isinstance(built, BlockPlan):
            variant = _Variant(key=key, plan=plan, program=None, param_names=(),
                               blocks=built.profile, priced=target, stated=stated, graph=graph)
        else:
            traced = built.traced
            head = plan.chunked_head
            program_key = (family.graphs.index(graph), repr(plan.segments),
                           None if head is None else (head.chunks, head.stretch.nodes))
            found = family.programs.get(program_key)
            if found is None:
                variant_id = self._next_id
                self._next_id += 1
                found = (variant_id, pipeline.compile_plan(module, replace(built, plan=plan),
                                                           variant_id))
                family.programs[program_key] = found
            variant_id, program = found
            variant = _Variant(key=key, plan=plan, program=program,
                               param_names=traced.spec.param_names, flatten=traced.flatten,
                               unflatten=traced.unflatten,
                               inlined=inlined_modules(module, traced.graph), priced=target,
                               stated=stated, graph=graph)
            self.by_id.setdefault(variant_id, variant)
        family.plans.append(variant)
        family.plan_seconds = time.perf_counter() - start
        return variant

    def _build(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arguments: dict[str, Any],
        key: tuple[Any, ...],
        known: Plan | None,
    ) -> _Variant:
        """A plan for this one signature: the config's fixed plan, one restored from a
        pickle, or one made again with hooked modules kept whole."""
        built = pipeline.build(module, args, kwargs, arguments, self.config, known,
                               self._next_id, dynamic=self.config.fixed_plan is None)
        if isinstance(built, BlockPlan):
            return _Variant(key=key, plan=built.plan, program=None, param_names=(),
                            blocks=built.profile)
        variant_id = self._next_id
        self._next_id += 1
        traced = built.planned.traced
        variant = _Variant(key=key, plan=built.planned.plan, program=built.program,
                           param_names=traced.spec.param_names, flatten=traced.flatten,
                           unflatten=traced.unflatten,
                           inlined=inlined_modules(module, traced.graph))
        self.by_id[variant_id] = variant
        return variant

    def _remember(self, key: tuple[Any, ...], variant: _Variant) -> None:
        self.variants[key] = variant
        self.variants.move_to_end(key)
        while len(self.variants) > KNOWN_SHAPES:
            self.variants.popitem(last=False)


def _runs_at(graph: TracedModel | NoGraph | None, arguments: dict[str, Any]) -> bool:
    """Whether a plan made on ``graph`` runs a call bound to ``arguments`` (of its
    structure)."""
    if graph is None:
        return False
    return isinstance(graph, NoGraph) or graph.accepts(arguments)


def _describe_shapes(arguments: dict[str, Any], shapes: Shapes | None = None) -> str:
    """``input_ids [4, 256], labels [4, 256]``: each tensor of a call and its shape."""
    shapes = tensor_shapes(arguments) if shapes is None else shapes
    return ", ".join(f"{name} {list(shape)}"
                     for name, shape in zip(tensor_names(arguments), shapes))


def _serves(arguments: dict[str, Any], target: Shapes, varying: tuple[tuple[int, int], ...],
            stated: bool) -> str:
    """What :attr:`Plan.serves` says of a plan priced at ``target``."""
    shown = _describe_shapes(arguments, target)
    if stated:
        return f"every call no larger than {shown} (the largest stated)"
    names = tensor_names(arguments)
    moving = sorted({names[t] for t, _ in varying})
    return (f"every call no larger than {shown}: priced at the bucket of the sizes that vary "
            f"({format_names(moving)})")


def _stated_target(max_shapes: tuple[tuple[str, tuple[int | None, ...]], ...],
                   arguments: dict[str, Any], shapes: Shapes) -> Shapes | None:
    """The shapes a call is priced at under ``max_shapes=`` (``None`` where it names none of
    the call's tensors): each stated size, and each size of the call's other tensors equal
    to one raised, raised with it (the same length in ``attention_mask`` and ``labels`` as in
    ``input_ids``)."""
    if not max_shapes:
        return None
    names = tensor_names(arguments)
    raised: dict[int, int] = {}
    named = False
    for name, largest in max_shapes:
        if name not in names:
            continue
        named = True
        have = shapes[names.index(name)]
        if len(largest) != len(have):
            raise InvalidArgumentError(
                f"max_shapes gives {name} {len(largest)} dimensions ({list(largest)}); the "
                f"call's {name} has {len(have)} ({list(have)})",
                fix=f"give max_shapes[{name!r}] one size (or None) per dimension")
        for size, most in zip(have, largest):
            if most is not None and most > size:
                raised[size] = max(raised.get(size, 0), most)
    if not named:
        return None
    return tuple(tuple(raised.get(size, size) for size in dims) for dims in shapes)


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
        variant, arguments, standing_in = how.find(module, args, kwargs)
        if (variant.plan.segments or variant.plan.chunked_head) and _hooked(variant):
            variant = how.replan_for_hooks(module, args, kwargs, arguments, variant)
            standing_in = None
        if standing_in is None:
            return variant.run(module, args, kwargs, arguments)
        start = time.perf_counter()
        out = variant.run(module, args, kwargs, arguments)
        how.count_recompute(standing_in, variant.plan, time.perf_counter() - start)
        return out

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
