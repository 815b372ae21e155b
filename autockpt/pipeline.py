"""The stages of planning, in order: capture -> profile -> plan -> compile.

One driver for what :func:`autockpt.plan` and the first training forward of a transformed
module both do. Each stage hands the next a typed result:

1. :func:`autockpt.capturing.ladder.capture` -> a :class:`~autockpt.capturing.trace.TracedModel`, or
   :class:`~autockpt.capturing.ladder.NoGraph` when no rung of the ladder gives a graph;
2. :func:`plan_graph` (profile on fake tensors, optionally time, plan) -> a
   :class:`GraphPlan`; or :func:`plan_blocks` (the modules rung: hooks, blocks, plan) -> a
   :class:`BlockPlan`; a plan given by the user is checked against the graph by
   :func:`fit_plan` instead;
3. :func:`compile_plan` -> a :class:`~autockpt.running.rewrite.Program`, the code the runtime runs
   (with its plan, a :class:`Compiled`).

:func:`build` runs them for one input signature; :mod:`autockpt.runtime` only keeps and runs
what it returns.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autockpt.capturing.ladder import NoGraph, capture, hooked_modules, unsharded_view
from autockpt.capturing.meta import meta_autocast
from autockpt.capturing.shapes import Shapes, tensor_shapes, tensors_in
from autockpt.capturing.trace import (TracedModel, base_class, bind_inputs,
                                      describe_inputs, forward_signature, shallow_view)
from autockpt.errors import AutockptError, InfeasibleBudgetError, InvalidArgumentError
from autockpt.ops.instrument import tensors
from autockpt.planning.blocks import blocks_of_plan, plan_modules
from autockpt.planning.budget import DeviceBudget, device_budget
from autockpt.planning.gc import paused
from autockpt.planning.head import chunked_head, find_row_stretch
from autockpt.planning.overhead import Overhead, overhead_for
from autockpt.planning.planner import Plan, make_plan
from autockpt.profiling.blocks import ModuleProfile, profile_modules
from autockpt.profiling.loss import LossFn
from autockpt.profiling.profile import ProfileShare, profile
from autockpt.profiling.stats import LOSS_OP, ChunkedHead, Profile, RowStretch
from autockpt.profiling.symbolic import ShapeFormula, SymbolicInputs, formula_of
from autockpt.profiling.timing import time_nodes
from autockpt.running.blocks import suspended
from autockpt.running.head import chunk_rows
from autockpt.running.replay import replay_blocks_peak_bytes, replay_peak_bytes
from autockpt.running.rewrite import Program, compile_onto, graph_fingerprint
from autockpt.units import format_bytes

__all__ = [
    "ApplyConfig",
    "BlockPlan",
    "Compiled",
    "GraphPlan",
    "ShapePricing",
    "build",
    "capture_shared",
    "compile_plan",
    "fit_plan",
    "make_any_plan",
    "plan_blocks",
    "plan_graph",
    "plan_shared",
    "resolve_budget",
]


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
    """How to capture the forward (see :data:`autockpt.capturing.ladder.CAPTURES`)."""
    cost: str = "flops"
    """The recompute cost model (see :data:`autockpt.profiling.timing.COSTS`)."""
    loss_fn: LossFn | None = None
    """The user's loss, priced with the model (NOTE [ The loss node ] in
    :mod:`autockpt.profiling.profile`); ``None``: the default (NOTE [ The default loss ])."""
    grad_accumulation: bool = False
    """Plan for steps in which the parameters' ``.grad`` already exists."""
    total_bytes: int | None = None
    """A budget for the whole device; the activation budget is what the step's fixed memory
    leaves of it (:func:`autockpt.planning.budget.device_budget`)."""
    optimizer: Any = None
    """The optimizer whose state ``total_bytes`` counts."""
    keep_whole: tuple[str, ...] = ()
    """Qualified names of submodules whose calls stay module calls (NOTE [ Module calls kept
    whole ] in :mod:`autockpt.capturing.ladder`)."""
    chunk_head: bool = True
    """Whether the plan may run the head and a cross-entropy in chunks of rows (NOTE [ The
    head in chunks of rows ] in :mod:`autockpt.planning.head`)."""
    max_shapes: tuple[tuple[str, tuple[int | None, ...]], ...] = ()
    """``(tensor name, largest shape)`` pairs: a transformed module plans each input
    structure once, at these sizes, for every smaller call (NOTE [ Buckets of shapes ] in
    :mod:`autockpt.planning.buckets`); ``None`` in a shape: that size as the call has it."""


@dataclass(frozen=True)
class GraphPlan:
    """Stage 2's result on a graph rung: the captured graph and its plan."""

    traced: TracedModel
    """The captured graph the plan is for."""
    plan: Plan
    """The plan: its segments say how each runs (dummy argument, RNG replay, buffers)."""


@dataclass(frozen=True)
class BlockPlan:
    """Stage 2's result on the modules rung: the plan, over the blocks of a hook profile."""

    plan: Plan
    """The plan, over the chain of :attr:`profile`."""
    profile: ModuleProfile
    """The profile whose blocks the plan checkpoints."""


@dataclass(frozen=True)
class Compiled:
    """What a transformed module runs for one input signature on a graph rung."""

    planned: GraphPlan
    """The plan and the graph it is for."""
    program: Program
    """The compiled forward and segments."""


def plan_blocks(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
    config: ApplyConfig,
) -> BlockPlan:
    """The ``"modules"`` rung: profile whole submodules with hooks and plan over them.

    It has no graph to time node by node: ``cost="profile"`` plans by FLOPs here, and the
    plan's notes say so. Nor does it run ``loss_fn`` with the model: it prices the gradient a
    loss sends into the output as an output-sized one, and says so; a model that returns its
    own loss computes it in the forward profiled, and the plan names it."""
    _refuse_caches(module, args, kwargs)
    budget_bytes, device = resolve_budget(module, args, kwargs, config)
    # The user's forward on the user's class, with the twin's block views running plainly.
    view = shallow_view(module)
    with suspended(view), _whole_device(device):
        prof = profile_modules(view, args, kwargs)

        # A node of this rung is a whole block, not an op: only the segment's own cost.
        overhead = replace(plan_overhead(module, (args, kwargs), timed=False), op_cost=0)

        def planned_for(budget: int | None) -> Plan:
            return plan_modules(prof, budget, strategy=config.strategy,
                                        mode=config.mode,
                                        grad_accumulation=config.grad_accumulation,
                                        overhead=overhead)

        # Unlike a graph rung's, this rung's plans are replayed in both modes: its estimate
        # prices whole blocks from one forward, and a non-reentrant plan of Hugging Face
        # BART's (capture="modules", both budgets at half the baseline) measured 9-11% above
        # it. A forward fake tensors cannot run is replayed for real (NOTE [ A real replay
        # where fake tensors cannot run ] in autockpt/running/replay.py).
        plan = _replanned(planned_for, lambda plan: replay_blocks_peak_bytes(
            view, prof, plan, args, kwargs, loss_fn=config.loss_fn,
            grad_accumulation=config.grad_accumulation), budget_bytes, real=not prof.fake)
        if plan.real_replay:
            plan = replace(plan, notes=(*plan.notes, "the forward does not run on fake "
                                        "tensors: the plan was replayed as one real training "
                                        "step, its gradients, buffers and random streams put "
                                        "back"))
    notes = plan.notes
    if config.loss_fn is None and prof.own_loss is not None:
        # The model's own loss runs in its forward, and the replay ran it, the whole output
        # held through backward: the plan says so instead of an assumed gradient.
        plan = replace(plan, loss=prof.own_loss)
    if config.cost != "flops":
        notes += (f"cost={config.cost!r} needs a graph to time; the modules rung planned by "
                  "FLOPs",)
    if config.loss_fn is not None and plan.estimate != "replay":
        notes += ("the modules rung cannot run loss_fn with the model: it priced an "
                  "output-sized gradient for each output instead",)
    elif config.loss_fn is not None:
        notes += ("the modules rung cannot run loss_fn with the model: it chose the blocks by "
                  "an output-sized gradient for each output, and replayed the step with "
                  "loss_fn",)
    return BlockPlan(replace(plan, model=base_class(module).__name__, capture="modules",
                             capture_reason=reason, notes=notes, device=device,
                             kept_whole=config.keep_whole), prof)


def plan_overhead(module: nn.Module, inputs: Any, *, timed: bool) -> Overhead:
    """The fixed costs of a segment and of a recomputed op on the device the model's
    parameters (else its inputs) live on, in nanoseconds where the nodes were ``timed``
    (NOTE [ What a segment costs beyond its FLOPs ] in :mod:`autockpt.planning.overhead`)."""
    found = next(iter(module.parameters()), None)
    if found is None:
        found = next(iter(tensors(inputs)), None)
    device_type = "cpu" if found is None else found.device.type
    return overhead_for(device_type, timed=timed)


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


# NOTE [ A training forward runs without the cache ]
# A block that appends to a key/value cache would append twice when it is recomputed: the
# gradients stay right but the cache the model returns is wrong, silently. Hugging Face's own
# switch runs a training forward without the cache and warns once; Hugging Face models default
# to ``use_cache=True`` (GPT-2's config), and Trainer never passes it, so refusing such a call
# stopped every Trainer run before its first step. So a training forward that would use the
# cache, by its argument or by ``model.config.use_cache``, is planned and run with
# ``use_cache=False`` passed by keyword, with one warning per transformed module; evaluation,
# ``torch.no_grad()`` and ``generate`` run the user's forward and keep the cache. The modules
# rung still refuses a call it sees with the cache on (a forward that takes ``use_cache``
# positionally, or reads it from elsewhere): it cannot turn it off.


def without_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> dict[str, Any] | None:
    """``kwargs`` with ``use_cache=False`` where this training call of ``module`` would use a
    key/value cache and its forward takes ``use_cache`` by keyword; ``None`` where nothing
    changes (NOTE [ A training forward runs without the cache ]).

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x, use_cache=True):
        ...         return x
        >>> without_cache(Net(), (torch.ones(1),), {})
        {'use_cache': False}
        >>> without_cache(Net(), (torch.ones(1),), {"use_cache": False}) is None
        True
    """
    parameters = forward_signature(base_class(module)).parameters
    parameter = parameters.get("use_cache")
    if parameter is None or parameter.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                               inspect.Parameter.VAR_POSITIONAL):
        return None
    if "use_cache" not in kwargs and list(parameters).index("use_cache") <= len(args):
        return None  # given by position
    if not _cache_on(module, kwargs.get("use_cache", parameter.default)):
        return None
    return {**kwargs, "use_cache": False}


def _cache_on(module: nn.Module, use_cache: Any) -> bool:
    """Whether a call with this ``use_cache`` argument uses the cache: unset (``None``, or
    no default), the model's config says."""
    if use_cache is None or use_cache is inspect.Parameter.empty:
        use_cache = getattr(getattr(module, "config", None), "use_cache", None)
    return use_cache is True


def cache_turned_off_warning(module: nn.Module) -> str:
    """What autockpt says once per module when it turns the cache off (NOTE [ A training
    forward runs without the cache ])."""
    return (f"{base_class(module).__name__} is trained with use_cache=True: autockpt runs its "
            "training forwards with use_cache=False, since a recomputed block would add its "
            "keys and values to the cache twice (Hugging Face's gradient checkpointing does "
            "the same); evaluation and generate keep the cache. Pass use_cache=False (or set "
            "model.config.use_cache = False) to silence this")


def _refuse_caches(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A block that appends to a key/value cache would append twice when it is recomputed:
    the gradients stay right but the cache the model returns is wrong, silently. Hugging
    Face turns the cache off when it checkpoints; here the user must."""
    if _cache_on(module, bind_inputs(module, args, kwargs).get("use_cache")):
        raise InvalidArgumentError(
            f"{base_class(module).__name__} is called with use_cache=True: checkpointing its "
            "blocks would add every key/value to the cache twice when they are recomputed",
            fix="pass use_cache=False in the training batch (or set model.config.use_cache = "
            "False); torch.export can then capture the model too",
        )


def with_hooked_modules(module: nn.Module, config: ApplyConfig) -> ApplyConfig:
    """``config`` with the submodules that have hooks now added to ``keep_whole`` (NOTE
    [ Module calls kept whole ] in :mod:`autockpt.capturing.ladder`), in ``named_modules`` order."""
    hooked = set(hooked_modules(module))
    if hooked <= set(config.keep_whole):
        return config
    wanted = hooked | set(config.keep_whole)
    return replace(config, keep_whole=tuple(
        name for name, _ in module.named_modules() if name in wanted))


def make_any_plan(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  config: ApplyConfig) -> Plan:
    """Capture with the ladder and plan, whichever rung is used (what :func:`autockpt.plan`
    does)."""
    config = with_hooked_modules(module, config)
    module = unsharded_view(module)  # NOTE [ Planning a sharded model ] in
                                     # autockpt/capturing/ladder.py
    # NOTE [ Planning with the collector paused ] in autockpt/planning/gc.py; NOTE [ Autocast on the
    # meta device ] in autockpt/capturing/meta.py
    uncached = without_cache(module, args, kwargs)
    if uncached is not None:
        warnings.warn(cache_turned_off_warning(module), UserWarning, stacklevel=3)
        kwargs = uncached
    with paused(), meta_autocast(module, args, kwargs):
        traced = capture(module, args, kwargs, config.capture, config.keep_whole)
        if isinstance(traced, NoGraph):
            return plan_blocks(module, args, kwargs, traced.reason, config).plan
        return plan_graph(module, traced, bind_inputs(module, args, kwargs), config).plan


# NOTE [ Pricing every shape of a shared graph ]
# A transformed module plans each bucket of shapes on one shared graph (NOTE [ Buckets of
# shapes ] in autockpt/planning/buckets.py). A profile on symbolic sizes (NOTE [ One profile
# for every shape ] in autockpt/profiling/symbolic.py) prices every later shape where its
# guards hold by evaluation, milliseconds instead of a profile, but a plan made on it costs
# about six plans profiled at their shapes (4.1 s against 0.5-0.75 s for a 6-layer GPT-2 and
# its head in chunks on one CPU thread, measured 2026-12-07, after NOTE [ Remembered ops on
# symbolic sizes ] in autockpt/ops/fake_outputs.py; eight before it): a run that meets few
# buckets would pay more for it than it saves, and most do (the loops of
# benchmarks/shapes.py make one or two plans in 8 to 12 batches of one varying length or
# image side, two or three in 48 to 52 batches of two varying sizes, now that a bucket is
# planned only once its recompute pays for a plan). So, as a skier rents until renting has
# cost what buying would, a graph's first SYMBOLIC_AFTER plans are profiled at their
# shapes, as before, and the next one on symbolic sizes: a run pays at most about twice the
# least planning time it could have had, and one whose shapes keep coming (two sizes
# varying: rows and length, height and width) pays an evaluation and a search per new plan
# from then on. The plans are the same either way (an evaluation equals the profile); only
# the time differs.
#
# The head in chunks has its formulas per chunk count, on one chunked graph per count that
# runs at every shape (NOTE [ A chunked head for every shape ] in autockpt/running/head.py);
# a new shape takes a count that has a formula where one is near the count it would choose.
# Where no formula holds (a size the guards exclude, a batch of one) the shape is profiled
# symbolically again, up to SYMBOLIC_PROFILES times per graph, then per shape; a symbolic
# profile that fails (an op that cannot take symbolic sizes) turns the graph back to one
# profile per shape.

# NOTE [ A head too large at a smaller shape ]
# Where the graph ends in a head and a cross-entropy, each plan is made twice, with the head
# whole and in chunks, and the one that recomputes less is kept (NOTE [ The head in chunks of
# rows ] in autockpt/planning/head.py). Once a formula prices a shape in milliseconds, those
# two searches are most of a new shape's planning (about 35 and 30 ms for the 6-layer GPT-2 of
# benchmarks/shapes.py on one CPU thread), and the search with the head whole is the dearer
# where it fails: it tries nested plans before it gives up. But memory grows with every size
# (what NOTE [ Buckets of shapes ] already relies on): every plan's peak at a larger shape is
# at least its peak at a smaller one, so the least peak of any plan is too. A graph whose head
# whole met no plan at some shapes under some budget meets none at shapes at least as large in
# every size, under a budget no larger; there the graph with its head in chunks is planned
# alone, which is the plan both searches would have kept. Should the chunked search fail too,
# the search with the head whole runs after all, for its error.

SYMBOLIC_AFTER = 6
"""Plans of a graph profiled at their own shapes before one is profiled on symbolic sizes
(NOTE [ Pricing every shape of a shared graph ])."""
SYMBOLIC_PROFILES = 4
"""The most symbolic profiles of one graph (NOTE [ Pricing every shape of a shared graph ])."""


class ShapePricing:
    """What a shared graph knows of its profile at every shape (NOTE [ Pricing every shape of a
    shared graph ]); the runtime keeps one per graph."""

    def __init__(self) -> None:
        self.formulas: dict[int | None, list[ShapeFormula]] = {}
        """Formulas by the chunk count of the head (``None``: the head whole)."""
        self.stretches: dict[int, RowStretch | None] = {}
        """The row stretch found with each formula of the graph with the head whole (by
        ``id``)."""
        self.chunked_graphs: dict[int, TracedModel] = {}
        """The graph with its head in chunks, by chunk count: one serves every shape."""
        self.plans = 0
        """Plans made on the graph."""
        self.profiled = 0
        """Profiles run on one shape."""
        self.symbolic = 0
        """Profiles run on symbolic sizes."""
        self.evaluated = 0
        """Profiles answered by evaluating a formula."""
        self.failed: str | None = None
        """Why a symbolic profile failed, if one did: the graph is profiled per shape."""
        self.whole_head_infeasible: list[tuple[Shapes, int]] = []
        """The shapes and budgets at which the graph with its head whole met no plan (NOTE
        [ A head too large at a smaller shape ])."""

    def whole_head_fails(self, shapes: Shapes, budget_bytes: int | None) -> bool:
        """Whether the graph with its head whole is known to meet no plan at ``shapes``: it
        met none at shapes no larger, under a budget no smaller (NOTE [ A head too large at a
        smaller shape ])."""
        return budget_bytes is not None and any(
            budget_bytes <= budget and _at_least(shapes, smaller)
            for smaller, budget in self.whole_head_infeasible)

    def may_profile_symbolically(self) -> bool:
        return (self.failed is None and self.plans >= SYMBOLIC_AFTER
                and self.symbolic < SYMBOLIC_PROFILES)


def _at_least(shapes: Shapes, other: Shapes) -> bool:
    """Whether every size of ``shapes`` is at least ``other``'s (of the same ranks)."""
    return len(shapes) == len(other) and all(
        len(a) == len(b) and all(x >= y for x, y in zip(a, b)) for a, b in zip(shapes, other))


class _Pricing:
    """One plan's use of a :class:`ShapePricing`: the call's shapes, and the formula and
    symbols its profiles came from."""

    def __init__(self, pricing: ShapePricing, arguments: dict[str, Any]) -> None:
        self.pricing = pricing
        self.arguments = arguments
        self.shapes = tensor_shapes(arguments)
        self.symbolic: SymbolicInputs | None = None
        self.plain: ShapeFormula | None = None
        self.note: str | None = None
        """How the last profile was had, where it was not a profile of the call's shape."""
        self.by_formula = False
        """Whether the last profile was a formula's evaluation."""

    def profile(self, traced: TracedModel, inputs: dict[str, Any], loss_fn: LossFn | None,
                share: ProfileShare | None, chunks: int | None) -> Profile:
        """The profile of ``traced`` (``chunks``: its head in that many chunks) at the call's
        shapes: evaluated, profiled symbolically, or profiled."""
        pricing = self.pricing
        self.by_formula = False
        description = describe_inputs((), {n: inputs[n] for n in traced.spec.param_names})
        for formula in pricing.formulas.get(chunks, ()):
            found = formula.at(self.shapes, description)
            if found is not None:
                pricing.evaluated += 1
                self.by_formula = True
                self.note = ("priced by evaluating the profile taken on symbolic sizes: no "
                             "profile ran for this shape (docs/shapes.md)")
                if chunks is None:
                    self.plain = formula
                return found
        # The head in chunks is profiled on symbolic sizes where that resumes the symbolic run
        # of the head whole, or where it has no formula yet; another chunk count met later is
        # profiled at its shape (a symbolic run from the start costs about ten of those).
        chunked_known = any(count is not None for count in pricing.formulas)
        if pricing.may_profile_symbolically() and (
                chunks is None or self.symbolic is not None or not chunked_known):
            symbolic = self.symbolic if chunks is not None and self.symbolic is not None \
                else SymbolicInputs(tensors_in(self.arguments))
            try:
                stats = profile(traced, inputs, loss_fn=loss_fn, share=share, symbolic=symbolic)
                extras: dict[str, Any] = {}
                stretch = None
                if chunks is None and share is not None:
                    stretch = find_row_stretch(traced.graph_module)
                    if stretch is not None:
                        extras["rows"] = _symbolic_rows(traced, stretch)
                formula = formula_of(stats, symbolic, extras)
                found = formula.at(self.shapes, description)
            except Exception as err:  # noqa: BLE001 - any op that refuses symbolic sizes
                pricing.failed = f"{type(err).__name__}: {err}"
                if share is not None:
                    share.release()
            else:
                pricing.symbolic += 1
                if found is not None:
                    self.note = ("profiled on symbolic sizes: later shapes are priced by "
                                 "evaluating this profile (docs/shapes.md)")
                    self.symbolic = symbolic
                    pricing.formulas.setdefault(chunks, []).append(formula)
                    if chunks is None:
                        self.plain = formula
                        pricing.stretches[id(formula)] = stretch
                    return found
        pricing.profiled += 1
        self.note = None
        return profile(traced, inputs, loss_fn=loss_fn, share=share)

    def stretch(self, traced: TracedModel) -> RowStretch | None:
        """The row stretch of the graph with the head whole, with the call's rows."""
        if self.plain is None:  # profiled at these shapes: the graph's metadata is theirs
            return find_row_stretch(traced.graph_module)
        stretch = self.pricing.stretches.get(id(self.plain))
        rows = self.plain.extra("rows", self.shapes)
        if stretch is None or rows is None:
            return None
        return replace(stretch, rows=rows)

    def head(self, stretch: RowStretch) -> ChunkedHead:
        """How to chunk the head at the call's rows: in as many chunks as a formula of the
        graph has, where one is within a factor of four of :func:`chunked_head`'s count (its
        profile is then an evaluation, which prices the chunks' memory exactly), else in that
        count."""
        ideal = chunked_head(stretch)
        known = [c for c in self.pricing.formulas if c is not None
                 and ideal.chunks <= 4 * c and c <= 4 * ideal.chunks and c <= stretch.rows]
        if not known:
            return ideal
        chunks = min(known, key=lambda c: (abs(c - ideal.chunks), c))
        return replace(ideal, chunks=chunks, chunk_rows=-(-stretch.rows // chunks))

    def price_chunked(self, traced: TracedModel, stretch: RowStretch, inputs: dict[str, Any],
                      loss_fn: LossFn | None, share: ProfileShare | None) -> None:
        """Where this plan profiled the graph on symbolic sizes, profile the graph with its
        head in chunks too, resuming that run, for the formula of later shapes (about a third
        of a symbolic run of the chunked graph from the start)."""
        if self.symbolic is None or share is None or \
                not self.pricing.may_profile_symbolically():
            return  # (else the profile below would be one at this shape, for nothing)
        head = self.head(stretch)
        if head.chunks in self.pricing.formulas:
            return
        try:
            self.profile(self.chunked(traced, head), inputs, loss_fn, share, head.chunks)
        except Exception:  # noqa: BLE001 - only a formula for later was at stake
            pass

    def chunked(self, traced: TracedModel, head: ChunkedHead) -> TracedModel:
        """The graph with its head in ``head.chunks`` chunks, made once per chunk count."""
        graphs = self.pricing.chunked_graphs
        if head.chunks not in graphs:
            graphs[head.chunks] = chunk_rows(traced, head)
        return graphs[head.chunks]


def _symbolic_rows(traced: TracedModel, stretch: RowStretch) -> Any:
    """The rows of ``stretch`` as the symbolic profile saw them (an int where fixed)."""
    node = next(n for n in traced.graph.nodes if n.name == stretch.source)
    sizes = node.meta.get("autockpt_sizes")
    if sizes is None:
        return stretch.rows
    rows: Any = 1
    for size in sizes[:-1]:
        rows = rows * size
    return rows


def plan_graph(module: nn.Module, traced: TracedModel, arguments: dict[str, Any],
               config: ApplyConfig, pricing: ShapePricing | None = None) -> GraphPlan:
    """Profile a captured graph and the loss on fake tensors and plan it. With
    ``cost="profile"`` the nodes are also timed on the real device and the planner weighs
    recompute by time. Where the graph ends in a head and a cross-entropy that act on each
    row, the same graph with that stretch in chunks of rows is planned too, and the plan that
    fits at the least cost (or, with no budget, reaches the least memory) is kept (NOTE
    [ The head in chunks of rows ] in :mod:`autockpt.planning.head`)."""
    budget_bytes, device = resolve_budget(module, (), arguments, config)
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(arguments)))
    # Non-reentrant mode only: under reentrant segments (BART, float64) a chunked head sent
    # the segments' nested backwards into a runaway recursion (autograd made a thread per
    # level), not yet understood.
    chunk = config.chunk_head and config.mode == "non_reentrant"
    # The graph with its head in chunks shares every node before the head with this one: its
    # profile resumes this one's run and probes only the nodes that differ.
    share = ProfileShare() if chunk else None
    priced = None if pricing is None else _Pricing(pricing, arguments)
    try:
        return _plan_both(module, traced, inputs, config, budget_bytes, device, share, priced)
    finally:
        if share is not None:
            share.release()
        if pricing is not None:
            pricing.plans += 1


def _plan_both(module: nn.Module, traced: TracedModel, inputs: dict[str, Any],
               config: ApplyConfig, budget_bytes: int | None, device: DeviceBudget | None,
               share: ProfileShare | None, priced: _Pricing | None = None) -> GraphPlan:
    """:func:`plan_graph` once the inputs and the budget are known; ``share`` is None where
    the head is never chunked."""
    # NOTE [ A head too large at a smaller shape ]
    skip_plain = (priced is not None and share is not None
                  and priced.pricing.whole_head_fails(priced.shapes, budget_bytes))
    plain, plain_error, stats = _plan_traced(module, traced, inputs, config, budget_bytes, device,
                                             share, priced=priced, search=not skip_plain)
    stretch = None
    if share is not None:
        stretch = (find_row_stretch(traced.graph_module) if priced is None
                   else priced.stretch(traced))
    if skip_plain and stretch is None:
        plain, plain_error, _ = _plan_traced(module, traced, inputs, config, budget_bytes,
                                             device, share, priced=priced, profiled=stats)
        skip_plain = False
    if priced is not None and plain is None and plain_error is not None and \
            stretch is not None and budget_bytes is not None:
        priced.pricing.whole_head_infeasible.append((priced.shapes, budget_bytes))
    if stretch is None or (plain is not None and not _chunking_may_pay(plain, stats, stretch)):
        if plain is None:
            assert plain_error is not None
            raise plain_error
        if priced is not None and stretch is not None:
            # Chunking does not pay at this shape; it may at a later one, whose profile is
            # then an evaluation instead of a symbolic run from the start.
            priced.price_chunked(traced, stretch, inputs, config.loss_fn, share)
        return plain
    members = set(stretch.nodes)
    forward_flops = sum(n.flops for n in stats.nodes if n.name in members)
    head = chunked_head(stretch) if priced is None else priced.head(stretch)
    chunked_traced = (chunk_rows(traced, head) if priced is None
                      else priced.chunked(traced, head))
    try:
        chunked, chunked_error, _ = _plan_traced(module, chunked_traced, inputs, config,
                                                 budget_bytes, device, share, head,
                                                 forward_flops, priced)
    except InvalidArgumentError:
        # The user's loss_fn reads the logits the chunked graph no longer returns.
        chunked, chunked_error = None, None
    if chunked is None and skip_plain:
        plain, plain_error, _ = _plan_traced(module, traced, inputs, config, budget_bytes, device,
                                             share, priced=priced, profiled=stats)
    if chunked is None:
        if plain is None:
            assert plain_error is not None
            raise chunked_error if chunked_error is not None else plain_error
        return _with_note(plain, _not_chunked(head, "it cannot run here"))
    chunked = replace(chunked, plan=replace(
        chunked.plan,
        baseline_peak_bytes=max(chunked.plan.baseline_peak_bytes,
                                plain.plan.baseline_peak_bytes if plain else 0),
        min_peak_bytes=min(chunked.plan.min_peak_bytes,
                           plain.plan.min_peak_bytes if plain else chunked.plan.min_peak_bytes)))
    if plain is None:
        return chunked
    plain = replace(plain, plan=replace(plain.plan, min_peak_bytes=min(
        plain.plan.min_peak_bytes, chunked.plan.min_peak_bytes)))
    if budget_bytes is None:
        pays = chunked.plan.estimated_peak_bytes < plain.plan.estimated_peak_bytes * 0.99
        reason = "it would not lower the least memory"
    else:
        pays = chunked.plan.recompute_flops < plain.plan.recompute_flops
        reason = "the budget is met at less recompute without it"
    return chunked if pays else _with_note(plain, _not_chunked(head, reason))


def _plan_traced(module: nn.Module, traced: TracedModel, inputs: dict[str, Any],
                 config: ApplyConfig, budget_bytes: int | None, device: DeviceBudget | None,
                 share: ProfileShare | None, head: ChunkedHead | None = None,
                 head_forward_flops: int = 0, priced: _Pricing | None = None,
                 search: bool = True, profiled: Profile | None = None
                 ) -> tuple[GraphPlan | None, InfeasibleBudgetError | None, Profile]:
    """Profile and plan one graph; an infeasible budget is returned, not raised, so that
    the caller can try the graph with the head in chunks (``head``, whose stretch's forward
    costs ``head_forward_flops``). With ``priced``, the profile is a formula's evaluation
    where one holds (NOTE [ One profile for every shape ] in
    :mod:`autockpt.profiling.symbolic`). ``search=False``: the profile alone (no plan, no
    error); ``profiled``: the graph's profile, already taken."""
    if profiled is not None:
        stats = profiled
    elif priced is None or config.cost == "profile":
        stats = profile(traced, inputs, loss_fn=config.loss_fn, share=share)
    else:
        stats = priced.profile(traced, inputs, config.loss_fn, share,
                               None if head is None else head.chunks)
    if not search:
        return None, None, stats
    if head is not None:
        # The chunked node's FLOPs are the stretch's forward and backward: the model's
        # forward FLOPs stay the model's.
        made = sum(n.flops for n in stats.nodes
                   if n.op == "call_function" and n.target == "chunked_rows")
        head = replace(head, gradient_flops=max(0, made - head_forward_flops))
    if config.cost == "profile":
        times = iter(time_nodes(traced, inputs))
        # The loss node is the user's code, never recomputed: it needs no time.
        stats = replace(stats, nodes=tuple(
            replace(node, time_ns=0 if node.op == LOSS_OP else next(times))
            for node in stats.nodes))
    try:
        with _whole_device(device):
            # NOTE [ The least reachable of a budget met with room ] in
            # autockpt.planning.planner: a shape priced by evaluation must plan in little time.
            plan = _planned(module, traced, inputs, stats, config, budget_bytes,
                            exact_least=priced is None or not priced.by_formula)
    except InfeasibleBudgetError as err:
        return None, err, stats
    priced_note = () if priced is None or priced.note is None else (priced.note,)
    plan = replace(plan, graph_fingerprint=graph_fingerprint(traced.graph),
                   notes=(*traced.notes, *plan.notes, *priced_note),
                   capture=traced.capture, capture_reason=traced.capture_reason,
                   cost_model=config.cost, device=device, kept_whole=config.keep_whole,
                   chunked_head=head,
                   forward_flops=plan.forward_flops - (head.gradient_flops if head else 0))
    return GraphPlan(traced, plan), None, stats


NOT_REPLAYED = "the estimate is the memory model's"
"""How a reentrant plan's note begins where its step was not replayed (and why follows)."""
REPLANS = 3
"""How many times a reentrant plan whose replay is above the budget is planned again, each
time under a budget lowered by the excess, before the least-memory plan is tried."""


def _planned(module: nn.Module, traced: TracedModel, inputs: dict[str, Any], stats: Profile,
             config: ApplyConfig, budget_bytes: int | None, exact_least: bool = True) -> Plan:
    """The plan for ``budget_bytes`` on a graph rung (in reentrant mode replayed, see
    :func:`_replanned`); ``exact_least``: as :func:`~autockpt.planning.planner.make_plan`
    takes it."""
    overhead = plan_overhead(module, inputs, timed=config.cost == "profile")

    def planned_for(budget: int | None) -> Plan:
        return make_plan(stats, budget, strategy=config.strategy, mode=config.mode,
                         model=base_class(module).__name__,
                         grad_accumulation=config.grad_accumulation, overhead=overhead,
                         exact_least=exact_least)

    if config.mode != "reentrant":
        return planned_for(budget_bytes)
    return _replanned(planned_for, lambda plan: replay_peak_bytes(
        module, traced, plan, inputs, loss_fn=config.loss_fn,
        grad_accumulation=config.grad_accumulation), budget_bytes)


def _replanned(planned_for: Callable[[int | None], Plan], peak_of: Callable[[Plan], int],
               budget_bytes: int | None, *, real: bool = False) -> Plan:
    """The plan for ``budget_bytes`` whose replayed peak fits it: the model's plan for the
    budget, whose replayed peak becomes its estimate; one replayed above the budget is planned
    again under a budget lowered by the excess, and the least-memory plan is the last resort
    (NOTE [ Replaying a plan on fake tensors ] in :mod:`autockpt.running.replay`). Without a budget,
    the least-memory plan, replayed. The least reachable a plan reports is the least-memory
    plan's replayed peak where that plan was replayed (without a budget, or when the plan is
    that plan), else the model's estimate of it.

    Raises:
        InfeasibleBudgetError: not even the least-memory plan replays within the budget; the
            least reachable it names is that plan's replayed peak.
    """
    # Each distinct plan is replayed once (the plan for a budget is often the least one).
    peaks: dict[tuple[tuple[int, int, int], ...], int | Exception] = {}

    def replayed(plan: Plan) -> Plan:
        key = _segments_key(plan)
        if key not in peaks:
            try:
                peaks[key] = peak_of(plan)
            except Exception as err:  # noqa: BLE001 - any failure on fake tensors
                peaks[key] = err
        return _replayed(plan, peaks[key], real)

    if budget_bytes is None:
        return replayed(planned_for(None))
    # The least-memory plan is replayed only when needed: a plan for the budget that the
    # replay finds within it saves a second fake step.
    least = planned_for(None)
    try:
        plan = replayed(planned_for(budget_bytes))
    except InfeasibleBudgetError:
        # The model prices its least plan above the budget; the replay may not.
        found = replayed(least)
        if found.estimate != "replay":
            raise
        if found.estimated_peak_bytes > budget_bytes:
            raise _infeasible(found, budget_bytes) from None
        return _lowered(found, budget_bytes, "the least-memory plan, which alone replayed "
                        "within the budget")
    if plan.estimate != "replay":
        return plan
    target = budget_bytes
    for _ in range(REPLANS + 1):
        if plan.estimated_peak_bytes <= budget_bytes:
            # The least reachable: replayed where the least plan was, else the model's.
            known = peaks.get(_segments_key(least))
            floor = known if isinstance(known, int) else least.estimated_peak_bytes
            return replace(plan, min_peak_bytes=min(plan.estimated_peak_bytes, floor))
        target -= plan.estimated_peak_bytes - budget_bytes
        try:
            plan = _lowered(replayed(planned_for(target)), budget_bytes, "planned under a "
                            "lower budget: the memory model's plan for the budget replayed "
                            "above it")
        except InfeasibleBudgetError:
            break
        if plan.estimate != "replay":
            break
    found = replayed(least)
    if found.estimated_peak_bytes <= budget_bytes:
        return _lowered(found, budget_bytes, "the least-memory plan, which alone replayed "
                        "within the budget")
    raise _infeasible(found, budget_bytes)


def _segments_key(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    return tuple((seg.start, seg.end, seg.depth) for seg in plan.segments)


def _replayed(plan: Plan, peak: int | Exception, real: bool = False) -> Plan:
    """``plan`` with its replayed peak (of a step on fake tensors, or a ``real`` one) as its
    estimate, or, where the replay raised, with a note saying why the model's estimate
    stands."""
    if isinstance(peak, Exception):
        reason = str(peak).strip().splitlines()[0] if str(peak).strip() else ""
        return replace(plan, notes=(
            *plan.notes, f"{NOT_REPLAYED}: replaying the step "
            f"{'as a real step' if real else 'on fake tensors'} raised "
            f"{type(peak).__name__}" + (f" ({reason[:200]})" if reason else "")))
    # A least-memory plan's replay is the least reachable; :func:`_replanned` sets it for a
    # plan with a budget.
    least = peak if plan.budget_bytes is None else plan.min_peak_bytes
    return replace(plan, estimated_peak_bytes=peak, min_peak_bytes=least, estimate="replay",
                   modelled_peak_bytes=plan.estimated_peak_bytes, real_replay=real)


def _lowered(plan: Plan, budget_bytes: int, note: str) -> Plan:
    """A plan made under another budget than ``budget_bytes``, for it."""
    return replace(plan, budget_bytes=budget_bytes, notes=(*plan.notes, note))


def _infeasible(least: Plan, budget_bytes: int) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"{least.model or 'the model'} needs at least {format_bytes(least.estimated_peak_bytes)}"
        f" of activation memory at inputs ({least.input_signature}) in reentrant mode (its "
        f"least-memory plan{', replayed' if least.estimate == 'replay' else ''}); the budget "
        f"is {format_bytes(budget_bytes)}",
        budget_bytes=budget_bytes, min_feasible_bytes=least.estimated_peak_bytes)


def _chunking_may_pay(plain: GraphPlan, stats: Profile, stretch: RowStretch) -> bool:
    """Whether planning the graph again with the head in chunks is worth its time: not when
    the budget is met without recomputing anything, nor when the stretch's activations are a
    small part of the peak."""
    plan = plain.plan
    if plan.budget_bytes is not None and plan.baseline_peak_bytes <= plan.budget_bytes:
        return False
    members = {n.index for n in stats.nodes if n.name in set(stretch.nodes)}
    stretch_bytes = sum(s.size_bytes for s in stats.storages if s.producer in members)
    return stretch_bytes * 20 >= plan.estimated_peak_bytes


def _not_chunked(head: ChunkedHead, reason: str) -> str:
    return (f"the head ({head.stretch.first_module or head.stretch.nodes[0]} .. "
            f"{head.stretch.loss}) was priced in {head.chunks} chunks of rows and is kept "
            f"whole: {reason}")


def _with_note(planned: GraphPlan, note: str) -> GraphPlan:
    return replace(planned, plan=replace(planned.plan, notes=(*planned.plan.notes, note)))


def fit_plan(plan: Plan, traced: TracedModel) -> GraphPlan:
    """``plan`` (given, not made here) for ``traced``; raise if it was made for another graph.

    Raises:
        AutockptError: the graph has another node count or fingerprint than the plan's.
    """
    count = len(traced.graph.nodes)
    fingerprint = graph_fingerprint(traced.graph)
    if plan.node_count != count or (plan.graph_fingerprint
                                    and plan.graph_fingerprint != fingerprint):
        raise AutockptError(
            f"the plan was made for a different graph ({plan.model}, {plan.node_count} nodes, "
            f"fingerprint {plan.graph_fingerprint or '?'}) than this model traces to "
            f"({count} nodes, fingerprint {fingerprint})",
            fix="make the plan with autockpt.plan() on this model, with inputs that take the "
            "same branches (None arguments and flags must match)",
        )
    return GraphPlan(traced, plan)


def compile_plan(module: nn.Module, planned: GraphPlan, variant_id: int) -> Program:
    """Compile ``planned`` and attach the tracer's tensor constants to ``module``."""
    traced = planned.traced
    return compile_onto(module, traced.graph, traced.constants, planned.plan, variant_id)


def _with_head(traced: TracedModel, plan: Plan) -> TracedModel:
    """``traced`` with the head the plan runs in chunks made one node."""
    return traced if plan.chunked_head is None else chunk_rows(traced, plan.chunked_head)


def build(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
          arguments: dict[str, Any], config: ApplyConfig, known: Plan | None, variant_id: int,
          *, dynamic: bool = False) -> Compiled | BlockPlan:
    """All the stages for one input signature of ``module``: capture, then plan (or fit
    ``known``, or the config's fixed plan) and compile, or plan the modules rung.

    Args:
        module: the transformed module (its constants are attached to it).
        args, kwargs: the call's inputs.
        arguments: the same, bound to the forward's parameters.
        config: what ``apply`` was asked for.
        known: a plan already made for this signature (a module restored from a pickle).
        variant_id: the number the runtime knows the compiled program by.
        dynamic: capture as :func:`capture_shared` does (a plan a transformed module made,
            restored from a pickle) rather than with fixed sizes (a plan from
            :func:`autockpt.plan`); a given plan that does not fit the one graph is fitted to
            the other.

    Raises:
        AutockptError: a given plan does not fit the graph, or a modules-rung plan names
            blocks the profile does not have.
    """
    plan = known if known is not None else config.fixed_plan
    # A given plan is re-applied to a graph captured the way it was made.
    method = plan.capture if plan is not None else config.capture
    config = with_hooked_modules(module, config)
    # Captured and planned without FSDP2's hooks and shards, compiled onto the module itself, whose
    # block calls run them (NOTE [ Planning a sharded model ] in autockpt/capturing/ladder.py).
    planning = unsharded_view(module)
    # NOTE [ Planning with the collector paused ] in autockpt/planning/gc.py; NOTE [ Autocast on the
    # meta device ] in autockpt/capturing/meta.py
    with paused(), meta_autocast(planning, args, kwargs):
        traced = capture(planning, args, kwargs, method, config.keep_whole, dynamic=dynamic)
        if isinstance(traced, NoGraph):
            made = plan_blocks(planning, args, kwargs, traced.reason, config)
            if plan is None:
                return made
            blocks_of_plan(made.profile, plan)  # a given plan must name these blocks
            return BlockPlan(plan, made.profile)
        if plan is None:
            planned = plan_graph(planning, traced, arguments, config)
        else:
            try:
                planned = fit_plan(plan, _with_head(traced, plan))
            except AutockptError:
                # A plan made by a transformed module is for the graph of every shape; one
                # made by autockpt.plan() for the graph of its inputs' sizes.
                if traced.input_dims is None:
                    raise
                other = capture(planning, args, kwargs, method, config.keep_whole,
                                dynamic=not dynamic)
                assert not isinstance(other, NoGraph)
                planned = fit_plan(plan, _with_head(other, plan))
        return Compiled(planned, compile_plan(module, planned, variant_id))


def capture_shared(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   config: ApplyConfig) -> TracedModel | NoGraph:
    """Stage 1 for a transformed module: one graph for every shape of this input structure
    that it admits (NOTE [ One graph for every shape ] in :mod:`autockpt.capturing.shapes`),
    captured on the unsharded view (NOTE [ Planning a sharded model ] in
    autockpt/capturing/ladder.py)."""
    config = with_hooked_modules(module, config)
    planning = unsharded_view(module)
    with paused(), meta_autocast(planning, args, kwargs):
        return capture(planning, args, kwargs, config.capture, config.keep_whole, dynamic=True)


def plan_shared(module: nn.Module, captured: TracedModel | NoGraph, args: tuple[Any, ...],
                kwargs: dict[str, Any], arguments: dict[str, Any], config: ApplyConfig,
                pricing: ShapePricing | None = None) -> GraphPlan | BlockPlan:
    """Stages 2 for a graph :func:`capture_shared` made, at the call ``args, kwargs`` (bound
    to ``arguments``), which may be larger than any the graph was captured at: the plan,
    not yet compiled (a program is shared by every shape whose plan has the same
    segments). ``pricing`` is what earlier plans on the same graph learnt of its profile at
    every shape (NOTE [ Pricing every shape of a shared graph ])."""
    config = with_hooked_modules(module, config)
    planning = unsharded_view(module)
    with paused(), meta_autocast(planning, args, kwargs):
        if isinstance(captured, NoGraph):
            return plan_blocks(planning, args, kwargs, captured.reason, config)
        return plan_graph(planning, captured, arguments, config, pricing)
