"""Stage 3: choose which stretches of the graph to checkpoint, on plain numbers.

The planner reads a :class:`~autockpt.profiling.stats.Profile` (numbers about nodes and storages, no
fx) and returns a :class:`Plan`. It works in three steps:

1. **Cut points.** A cut between two nodes is a candidate where few gradient-carrying tensors
   cross it (no more than at the cheapest cut: block boundaries of a ResNet or a
   transformer, every layer of an MLP). Tensors that carry no gradient (an attention mask built
   from token ids) do not count, so a mask that every layer reads does not prevent cutting.
   Cuts are never placed where a container of tensors crosses (reentrant checkpoint would lose
   their gradients) or between a tensor and an in-place op on it.
2. **Stages.** The candidate cuts split the graph into a chain of stages.
3. **Segments.** A strategy picks ranges of consecutive stages to checkpoint, and
   :func:`~autockpt.planning.memory_model.estimate_peak` predicts the peak activation memory of any
   choice. Below the least memory one level of segments reaches, ``"optimal"`` checkpoints
   ranges again inside segments (:mod:`autockpt.planning.nested`).

The layers below it, each using only the ones under it: the chain of stages and cuts
(:mod:`autockpt.planning.chain`), the memory model that prices a plan on it
(:mod:`autockpt.planning.memory_model`), and the two dynamic programmes, for single-level segments
(:mod:`autockpt.planning.optimal`) and nested ones (:mod:`autockpt.planning.nested`). This module
holds the strategies, the :class:`Plan` and the description of its rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from autockpt.errors import InfeasibleBudgetError, InvalidArgumentError
from autockpt.planning.budget import DeviceBudget
from autockpt.planning.chain import Chain, build_chain
from autockpt.planning.memory_model import (
    NO_KEEPS,
    Keeps,
    Ranges,
    Tree,
    as_tree,
    estimate_peak,
    estimate_tree_peak,
    flatten_tree,
    recompute_cost,
    tree_depth,
)
from autockpt.planning.nested import nested_plans
from autockpt.planning.optimal import least_peak, optimal_plan, optimal_ranges
from autockpt.planning.overhead import NO_OVERHEAD, Overhead
from autockpt.planning.search import search_kept, search_plan
from autockpt.profiling.stats import LOSS_OP, ChunkedHead, LossStat, NodeStat, Profile
from autockpt.report import format_plan

__all__ = ["Segment", "Plan", "make_plan", "STRATEGIES", "MODES", "BUDGET_SLACK"]

MODES = ("non_reentrant", "reentrant")

BUDGET_SLACK = 0.05
"""How far a measured peak may exceed the budget a plan fits: the estimate cannot see
temporaries inside a kernel or the allocator's rounding (documented in the README)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of consecutive graph nodes, checkpointed or left alone on purpose."""

    start: int
    """Position of its first node in graph order."""
    end: int
    """Position one past its last node."""
    first_node: str
    """Name of its first fx node."""
    last_node: str
    """Name of its last fx node."""
    first_module: str
    """Module path of its first node (``""`` for the model's own forward)."""
    last_module: str
    """Module path of its last node."""
    node_count: int
    """Number of graph nodes in it."""
    checkpointed: bool
    """Whether it runs under ``torch.utils.checkpoint.checkpoint``."""
    boundary_bytes: int
    """Bytes of activations it reads from before it; a checkpoint keeps them for the recompute."""
    freed_bytes: int
    """Bytes saved for backward inside it that checkpointing does not keep (0 if not
    checkpointed)."""
    recompute_flops: int
    """Forward FLOPs that backward runs again (0 if not checkpointed)."""
    dummy_arg: bool
    """Whether it gets the dummy-argument wrapper: reentrant mode, trainable parameters, and no
    tensor input that requires grad (without it, those parameters would get no gradient). The
    runtime does what this says."""
    preserve_rng: bool
    """Whether it contains random ops, so the RNG state is stashed and replayed."""
    buffers: tuple[str, ...]
    """Buffers its modules update in forward; the runtime restores them after a recompute so
    that BatchNorm statistics are updated once."""
    reason: str = ""
    """Why it is not checkpointed (empty for checkpointed segments)."""
    depth: int = 0
    """0 for a segment of the forward itself; 1 for one checkpointed again inside the
    recompute of the segment that contains it (its nodes then run forward three times), and
    so on."""
    input_count: int = 0
    """Activation storages made before it that it reads: what it keeps for its recompute
    (``boundary_bytes`` is their size). More than one where skip connections cross it."""
    output_count: int = 0
    """Storages made inside it that are read after it."""
    keeps: bool = False
    """Whether it keeps the outputs of its matrix products, convolutions and attention
    kernels from its forward, and its recompute runs only its other ops (torch's selective
    checkpoint; NOTE [ Keep the expensive, recompute the cheap ] in :mod:`autockpt.ops.kept`)."""
    kept_ops: int = 0
    """Where it keeps them: how many op outputs it keeps."""
    kept_bytes: int = 0
    """Where it keeps them: their bytes, held from its forward to its recompute."""
    recomputed_ops: int = 0
    """How many ATen ops (views aside) its recompute runs again (0 if not checkpointed)."""


@dataclass(frozen=True)
class Plan:
    """Where to checkpoint a model at one input size, and what it is expected to cost.

    ``str(plan)`` renders a table (see :func:`autockpt.report.format_plan`).
    """

    model: str
    """Class name of the planned model."""
    input_signature: str
    """Shapes and dtypes of the inputs the plan was made for."""
    mode: str
    """``"non_reentrant"`` or ``"reentrant"``: the ``use_reentrant`` flavour of checkpoint."""
    strategy: str
    """The name of the strategy that chose the segments."""
    budget_bytes: int | None
    """Peak activation memory allowed, in bytes; ``None`` asks for the least reachable."""
    baseline_peak_bytes: int
    """Estimated peak activation memory without checkpointing."""
    estimated_peak_bytes: int
    """Estimated peak activation memory with this plan."""
    min_peak_bytes: int
    """The smallest estimated peak the strategy can reach for this model and input size.
    For ``"optimal"`` in non-reentrant mode nested segments are searched only when the budget
    is below what one level of segments reaches (or is None): with a budget above it, this
    is the least of single-level plans, and nesting may reach lower. With a budget that the
    dynamic programme's least-memory plan meets, where the programme and the plan's estimate
    disagree (skip connections), it is the least the local search reaches, which the exact
    search of ``budget_bytes=None`` may lower (NOTE [ The least reachable of a budget met
    with room ] in :mod:`autockpt.planning.planner`)."""
    forward_flops: int
    """FLOPs of one forward pass."""
    recompute_flops: int
    """FLOPs recomputed in backward under this plan."""
    node_count: int
    """Number of nodes of the traced graph (a plan only fits the graph it was made for)."""
    segments: tuple[Segment, ...]
    """The checkpointed segments, in graph order, each outer segment before the segments
    nested in it (see :attr:`Segment.depth`)."""
    skipped: tuple[Segment, ...] = ()
    """Stretches of the graph left un-checkpointed on purpose, each with its reason."""
    graph_fingerprint: str = ""
    """A hash of the traced graph's node names and targets."""
    notes: tuple[str, ...] = field(default=())
    """Remarks for the reader (why nothing was checkpointed, for example)."""
    capture: str = "fx"
    """How the model's forward was captured: ``"fx"`` (torch.fx), ``"export"``
    (torch.export), ``"fx-leaves"`` (torch.fx with untraceable submodules kept whole) or
    ``"modules"`` (module-level planning with hooks); see :mod:`autockpt.capturing.ladder`."""
    capture_reason: str = ""
    """Why the earlier ways of capturing were not used (empty when torch.fx worked)."""
    loss: LossStat | None = None
    """The loss the plan priced: the user's ``loss_fn``, the model's own loss, or (neither
    given) an assumed output-sized gradient; ``None`` for a plan made without one (the
    ``"modules"`` rung prices an assumed gradient too, and says so)."""
    grad_accumulation: bool = False
    """Whether the plan holds for steps in which ``.grad`` is already allocated (gradient
    accumulation), counting the weight-gradient temporaries."""
    device: DeviceBudget | None = None
    """With ``total_mb``: the whole-device budget and what takes it before activations."""
    kept_whole: tuple[str, ...] = ()
    """Submodules whose calls the plan keeps as module calls (``keep_whole``), so that hooks on
    them (FSDP2's ``fully_shard``, profilers) run; segments contain them whole."""
    chunked_head: ChunkedHead | None = None
    """When the plan runs the end of the step (final norm, the head's projection, a
    cross-entropy) in chunks of rows: which nodes, how many chunks, and the FLOPs their
    recompute costs (counted in :attr:`recompute_flops`). The logits the model returned beside
    the loss are then ``None``."""
    estimate: str = "model"
    """How :attr:`estimated_peak_bytes` was found: ``"model"``, by the memory model that
    chose the segments, or ``"replay"``, by running the plan's step on fake tensors (reentrant
    mode; NOTE [ Replaying a plan on fake tensors ] in :mod:`autockpt.running.replay`), or for real
    (:attr:`real_replay`)."""
    real_replay: bool = False
    """Where :attr:`estimate` is ``"replay"``: the step was run for real, not on fake tensors
    (the ``"modules"`` rung, for a forward fake tensors cannot run; NOTE [ A real replay where
    fake tensors cannot run ] in :mod:`autockpt.running.replay`)."""
    modelled_peak_bytes: int | None = None
    """Where :attr:`estimate` is ``"replay"``: the memory model's estimate of the plan's peak,
    by which the search chose it; ``None`` where :attr:`estimated_peak_bytes` is that."""
    serves: str = ""
    """Which calls a transformed module runs this plan for, where it was priced at a shape
    other than its first call's: the largest sizes it serves (a bucket's, or the largest the
    user stated), for every call of the same input structure no larger in any dimension
    (NOTE [ Buckets of shapes ] in :mod:`autockpt.planning.buckets`); ``""``: the shape of
    :attr:`input_signature` and the smaller ones a stated largest shape covers."""
    cost_model: str = "flops"
    """What the recompute cost the segments were chosen by measures: ``"flops"`` (FLOPs plus
    bytes written, from the fake-tensor profile; the same plan every time) or ``"profile"``
    (each node timed on the real device, :func:`autockpt.profiling.timing.time_nodes`; timings are
    noisy, so two runs may give different plans). ``recompute_flops`` counts FLOPs either
    way."""

    @property
    def recompute_ratio(self) -> float:
        """Recomputed FLOPs as a fraction of one forward pass."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def __str__(self) -> str:
        return format_plan(self)


# --------------------------------------------------------------------------- strategies


def _grad_runs(chain: Chain) -> list[tuple[int, int]]:
    """Maximal runs of consecutive stages that carry gradient (inclusive bounds)."""
    runs: list[tuple[int, int]] = []
    for t, stage in enumerate(chain.stages):
        if not stage.carries_grad:
            continue
        if runs and runs[-1][1] == t - 1:
            runs[-1] = (runs[-1][0], t)
        else:
            runs.append((t, t))
    return runs


def _split_balanced(chain: Chain, k: int) -> list[tuple[int, int]]:
    """Split the gradient-carrying stages into about ``k`` groups of similar cost, never
    across a stage that carries no gradient."""
    runs = _grad_runs(chain)
    total = sum(chain.stages[t].backward_peak_bytes + 1 for a, b in runs for t in range(a, b + 1))
    if not runs or k <= 0:
        return []
    share = total / k
    groups: list[tuple[int, int]] = []
    for a, b in runs:
        start, acc = a, 0.0
        for t in range(a, b + 1):
            acc += chain.stages[t].backward_peak_bytes + 1
            if acc >= share and t < b:
                groups.append((start, t))
                start, acc = t + 1, 0.0
        groups.append((start, b))
    return groups


def _candidates(chain: Chain) -> list[Ranges]:
    """Plans of the shape ``checkpoint_sequential`` makes, for many segment counts."""
    grad_stages = sum(b - a + 1 for a, b in _grad_runs(chain))
    counts = sorted(
        {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, grad_stages}
        | {max(1, round(math.sqrt(grad_stages)) + d) for d in (-1, 0, 1)}
    )
    out: list[Ranges] = [()]
    seen: set[Ranges] = {()}
    for k in counts:
        if k > grad_stages:
            continue
        groups = _split_balanced(chain, k)
        for ranges in (tuple(groups), tuple(groups[:-1])):
            if ranges not in seen:
                seen.add(ranges)
                out.append(ranges)
    return out


def _moves(ranges: Ranges) -> list[Ranges]:
    """Plans that recompute less than ``ranges``: drop a segment, or trim one at either end."""
    out = []
    for i, (a, b) in enumerate(ranges):
        head, tail = ranges[:i], ranges[i + 1 :]
        out.append(head + tail)
        if b > a:
            out.append(head + ((a + 1, b),) + tail)
            out.append(head + ((a, b - 1),) + tail)
    return out


def _refine(chain: Chain, ranges: Ranges, budget: int, mode: str) -> Ranges:
    """Greedy descent: take the move that saves the most recompute and still fits."""
    cost = recompute_cost(chain, ranges, mode)
    while True:
        best = None
        for option in _moves(ranges):
            option_cost = recompute_cost(chain, option, mode)
            if option_cost >= cost or (best is not None and option_cost >= best[0]):
                continue
            if estimate_peak(chain, option, mode) <= budget:
                best = (option_cost, option)
        if best is None:
            return ranges
        cost, ranges = best


def _neighbours(chain: Chain, ranges: Ranges) -> list[Ranges]:
    """Plans one step from ``ranges``: a segment grown or shrunk by a stage at either end,
    shifted by a stage, dropped or split in two; two neighbours joined, or the boundary
    between two adjacent ones moved by a stage; a stage checkpointed alone."""
    grad = [stage.carries_grad for stage in chain.stages]
    out: list[Ranges] = []
    for i, (a, b) in enumerate(ranges):
        head, tail = ranges[:i], ranges[i + 1:]
        lo = ranges[i - 1][1] + 1 if i else 0
        hi = tail[0][0] - 1 if tail else len(grad) - 1
        for x, y in ((a - 1, b), (a + 1, b), (a, b - 1), (a, b + 1)):
            if lo <= x <= y <= hi and grad[x] and grad[y]:
                out.append(head + ((x, y),) + tail)
        # Two moves at once, which one at a time would pass through a worse plan: without
        # them the descent stopped up to 12.7% above the least estimate of 200 random
        # chains, with them up to 6.5% (tests/test_optimal.py measures how close it gets).
        for x, y in ((a - 1, b - 1), (a + 1, b + 1)):
            if lo <= x <= y <= hi and all(grad[x:y + 1]):
                out.append(head + ((x, y),) + tail)
        if tail and tail[0][0] == b + 1:
            c, d = tail[0]
            if b > a:
                out.append(head + ((a, b - 1), (b, d)) + tail[1:])
            if d > c:
                out.append(head + ((a, c), (c + 1, d)) + tail[1:])
        out.append(head + tail)
        out.extend(head + ((a, m), (m + 1, b)) + tail for m in range(a, b))
        if tail and all(grad[b + 1:tail[0][0]]):
            out.append(head + ((a, tail[0][1]),) + tail[1:])
    covered = {t for a, b in ranges for t in range(a, b + 1)}
    out.extend(tuple(sorted((*ranges, (t, t)))) for t, g in enumerate(grad)
               if g and t not in covered)
    return out


def _descend(chain: Chain, ranges: Ranges, mode: str) -> Ranges:
    """The programme's least-peak plan, improved step by step under the plan's own
    estimate: the neighbour of least (estimate, recompute) while one is below the current
    plan's (NOTE [ Storages held by the plan ] in :mod:`autockpt.planning.memory_model`)."""
    best = (estimate_peak(chain, ranges, mode), recompute_cost(chain, ranges, mode))
    while True:
        found = None
        for option in _neighbours(chain, ranges):
            score = (estimate_peak(chain, option, mode), recompute_cost(chain, option, mode))
            if score < best:
                best, found = score, option
        if found is None:
            return ranges
        ranges = found


@lru_cache(maxsize=4)
def _least_estimate(chain: Chain, ranges: Ranges, mode: str) -> Ranges:
    """The plan of least estimate (then least recompute), from the programme's least-peak
    plan ``ranges``: exactly where the search of NOTE [ An exact search under the plan's own
    estimate ] (:mod:`autockpt.planning.search`) finishes, bounded by the local search's plan;
    that plan where it gives up.

    Cached by value (a chain is plain numbers): a plan for a budget needs the least plan too,
    and a reentrant one whose replay is above its budget asks for it again (one search
    saved per budget, 0.1-0.5 s on the skip-connection models)."""
    descended = _descend(chain, ranges, mode)
    exact = search_plan(chain, mode, bound=estimate_peak(chain, descended, mode))
    return exact[0] if exact is not None else descended


# NOTE [ Searched plans and the reentrant estimate ]
# An exact optimiser finds the plans where the estimate is most wrong in its favour. In
# non-reentrant mode that did no harm: on the 60 random graphs of
# benchmarks/estimate_accuracy.py every plan it chose is estimated 1.000-1.040 of its
# measured peak. In reentrant mode 8 of the 180 were first estimated below their measured
# peaks, by up to 6.1%, so for a while reentrant plans kept the local search's. The
# shortfalls, traced op by op: a skip tensor's gradient handed as a view taken off as if
# counted twice (seeds 0, 48, 49; NOTE [ Handed gradients the replay counts again ]); an add
# of two of a segment's inputs, whose gradient autograd copies for one of them (seeds 40, 51;
# NOTE [ Gradients shared by a reentrant segment's inputs ]). With those counted, and three
# over-counts of the same family gone (a recomputed output saved inside its segment, seed
# 18, 10% above; a copy where two readers' parts are summed, and a handed gradient the
# replay holds anyway, seed 12, 6.1% above), none of the searched plans is below its
# measured peak by more than the loss's 8 bytes, 159 of 180 are within them and 170 within
# 1% (the largest 5.4% above, seed 37);
# the least memory measured is lower than the local search's on 19 of the 60 graphs (by up
# to 11.8%) and higher on none. Those are the graphs the estimate was corrected on; on
# others some reentrant plans are still below their measured peaks (NOTE [ What the
# reentrant estimate still gets wrong ] in autockpt/planning/memory_model.py).


# NOTE [ The least reachable of a budget met with room ]
# Where the programme's least-peak plan fits the budget, the plan is the programme's plan for
# the budget, improved by the exact search under it (``search_kept``); the plan of least
# estimate is not used, only its peak is reported (``Plan.min_peak_bytes``, "least
# reachable"). Its exact search (``_least_estimate``) only proves the local search's plan
# least: on the models of benchmarks/shapes.py and their shapes the two always agreed, and
# the proof was most of planning a new shape whose profile is an evaluation (about 0.1 s of
# BERT's and ResNet-18's plans, a tenth of their steps on a CPU). So a plan made for a new
# shape at run time (``exact_least=False``, where the profile was evaluated: the path that
# must cost little) reports, with such a budget, the local search's least (``_descend``): an
# upper bound of the least, which its note says, and which asking with ``budget_bytes=None``,
# or with a budget below the programme's least, finds exactly. Elsewhere it is proven: on
# the skip-connection models of benchmarks/plan_snapshot.py the local search stops above
# the least on 3 of 112 plans (by up to 11%: 993 KiB against 897 KiB).


LEAST_FOUND_NOTE = ("least reachable: where the budget is met with room, the least the local "
                    "search found, not searched exactly (plan with budget_mb=None for it)")
"""The note of a plan whose least peak may be the local search's (NOTE [ The least reachable
of a budget met with room ])."""


Strategy = Callable[[Chain, "int | None", str, bool], "tuple[Tree | None, int, Keeps]"]
"""``strategy(chain, budget_bytes, mode, nesting) -> (tree or None if the budget cannot be
met, least peak the strategy reaches, first stages of the segments that keep their
matmuls)``; ``budget_bytes=None`` asks for the least peak;
``nesting`` says whether segments may be checkpointed again inside segments."""


def _greedy(chain: Chain, budget: int | None, mode: str, nesting: bool
            ) -> tuple[Tree | None, int, Keeps]:
    """Plans shaped like ``checkpoint_sequential`` for many segment counts, then a descent
    that trims or drops segments while the budget still holds."""
    scored = [(estimate_peak(chain, r, mode), recompute_cost(chain, r, mode), r)
              for r in _candidates(chain)]
    min_peak = min(peak for peak, _, _ in scored)
    if budget is None:
        return as_tree(min(scored, key=lambda item: (item[0], item[1]))[2]), min_peak, NO_KEEPS
    feasible = [item for item in scored if item[0] <= budget]
    if not feasible:
        return None, min_peak, NO_KEEPS
    ranges = min(feasible, key=lambda item: (item[1], item[0]))[2]
    return as_tree(_refine(chain, ranges, budget, mode)), min_peak, NO_KEEPS


def _sqrt(chain: Chain, budget: int | None, mode: str, nesting: bool
          ) -> tuple[Tree | None, int, Keeps]:
    """Chen et al.'s rule: about sqrt(n) equal segments, the last one left alone."""
    grad_stages = sum(b - a + 1 for a, b in _grad_runs(chain))
    groups = _split_balanced(chain, max(1, round(math.sqrt(grad_stages))))
    ranges = tuple(groups[:-1]) if len(groups) > 1 else tuple(groups)
    peak = estimate_peak(chain, ranges, mode)
    return (as_tree(ranges) if budget is None or peak <= budget else None), peak, NO_KEEPS


def _prices_agree(chain: Chain) -> bool:
    """Whether the programme's price of every plan is its estimate: without long-lived or
    passing storages (NOTE [ Storages held by the plan ] in
    :mod:`autockpt.planning.memory_model`)."""
    return not (chain.long_lived or chain.passing)


def _optimal(chain: Chain, budget: int | None, mode: str, nesting: bool, *,
             exact_least: bool = True) -> tuple[Tree | None, int, Keeps]:
    """The least recompute under the budget, each non-reentrant segment keeping its matmuls or
    not (NOTE [ Segments that keep their matmuls ]), exactly for the price the dynamic programme
    over the chain puts on a plan
    (:meth:`~autockpt.planning.memory_model.MemoryModel.peak`, never below the
    plan's estimate); with no budget, its least-peak plan improved under the plan's estimate
    (:func:`_descend`); below the least peak of single-level plans, nested plans from the rotor
    programme (NOTE [ Where nesting pays ]). ``exact_least=False``: with a budget the
    programme's least-peak plan meets, the least peak reported is the local search's (NOTE
    [ The least reachable of a budget met with room ])."""
    # NOTE [ Storages held by the plan ] in autockpt.planning.memory_model: the programme prices a
    # plan at ``MemoryModel.peak``, the plan's estimate (``estimate_peak``) may be lower. A
    # budget between the two is met by the programme's least-peak plan when its estimate
    # fits, and ``min_peak`` is that plan's estimate, so that asking for it succeeds.
    # Without long-lived or passing storages the two agree on every plan: the programme's
    # least peak, found without a frontier, is the least estimate, and nothing to descend.
    agree = _prices_agree(chain)
    least_ranges: Ranges = ()
    if budget is not None and agree:
        programme_least = min_peak = least_peak(chain, mode)
    else:
        least = optimal_ranges(chain, None, mode)
        assert least is not None  # checkpointing nothing is always a choice
        programme_least = least[1]
        if agree:
            least_ranges = least[0]
        elif not exact_least and budget is not None and budget >= programme_least:
            # NOTE [ The least reachable of a budget met with room ]
            least_ranges = _descend(chain, least[0], mode)
        else:
            least_ranges = _least_estimate(chain, least[0], mode)
        min_peak = estimate_peak(chain, least_ranges, mode)
    if budget is not None:
        if budget >= estimate_peak(chain, (), mode):
            return (), min_peak, NO_KEEPS  # met as it is: nothing to search
        keeps = NO_KEEPS
        if budget >= programme_least:
            found = optimal_plan(chain, budget, mode)
            assert found is not None  # the least-peak plan fits
            ranges, keeps = found[0], found[1]
        elif budget >= min_peak:  # below the programme's least: only where they disagree
            ranges = least_ranges
        else:
            ranges = None
        if ranges is not None:
            if not agree:
                # A plan that recomputes less may fit under its own estimate.
                exact = search_kept(chain, mode, budget=budget,
                                    bound=recompute_cost(chain, ranges, mode, keeps))
                if exact is not None:
                    ranges, keeps = exact[0], exact[1]
            return as_tree(ranges), min_peak, keeps
    if not nesting or mode != "non_reentrant":
        return (as_tree(least_ranges) if budget is None else None), min_peak, NO_KEEPS
    found_nested = [item for item in _nested_candidates(chain, min_peak)
                    if tree_depth(item[2]) > 1]
    reach = min([min_peak, *(peak for peak, _, _ in found_nested)])
    if budget is None:
        if reach == min_peak:
            return as_tree(least_ranges), min_peak, NO_KEEPS
        return min(found_nested, key=lambda item: (item[0], item[1]))[2], reach, NO_KEEPS
    fits = [item for item in found_nested if item[0] <= budget]
    if not fits:
        return None, reach, NO_KEEPS
    return min(fits, key=lambda item: (item[1], item[0]))[2], reach, NO_KEEPS


def _nested_candidates(chain: Chain, span: int) -> list[tuple[int, int, Tree]]:
    """The rotor programme's nested plans (:func:`~autockpt.planning.nested.nested_plans`),
    chosen with the chain's fixed costs and, where it has some, without them too."""
    found = nested_plans(chain, span)
    if not (chain.segment_cost or chain.op_cost):
        return found
    # The programme counts memory in slots, so a price per segment moves which tree it keeps
    # at each slot count, and one the exact model prices higher may take the place of a
    # lower one: the trees chosen by arithmetic alone stay candidates, so that the least
    # memory reachable never depends on the fixed costs (NOTE [ What a segment costs beyond
    # its FLOPs ] in autockpt.planning.overhead).
    seen = {tree for _, _, tree in found}
    return found + [item for item in nested_plans(chain, span, overhead=False)
                    if item[2] not in seen]


STRATEGIES: dict[str, Strategy] = {"optimal": _optimal, "greedy": _greedy, "sqrt": _sqrt}
"""Segment-choosing strategies by name."""


# --------------------------------------------------------------------------- the plan


def make_plan(
    profile: Profile,
    budget_bytes: int | None,
    *,
    strategy: str = "optimal",
    mode: str = "non_reentrant",
    model: str = "",
    nesting: bool = True,
    grad_accumulation: bool = False,
    overhead: Overhead = NO_OVERHEAD,
    exact_least: bool = True,
) -> Plan:
    """Plan checkpoint segments for ``profile`` under ``budget_bytes``.

    ``nesting=False`` keeps to one level of segments (the module-level rung, which installs
    checkpoints on whole submodules, cannot nest them). ``grad_accumulation=True`` prices
    steps in which the parameters' ``.grad`` already exists. ``overhead`` adds a fixed cost
    per segment and per recomputed op to the recompute the plan minimises
    (:func:`autockpt.planning.overhead.overhead_for`). ``exact_least=False`` spares the
    exact search of the least peak where the budget is met with room, and reports the local
    search's (NOTE [ The least reachable of a budget met with room ]).

    Example:
        >>> from autockpt.profiling.stats import LOSS_OP, LossStat, NodeStat, Profile, StorageStat
        >>> plan = make_plan(Profile(nodes=(), storages=(), input_signature=""), None)
        Traceback (most recent call last):
        ...
        autockpt.errors.InvalidArgumentError: the profile has no nodes to plan

    Raises:
        InfeasibleBudgetError: no plan fits; ``min_feasible_bytes`` says what would.
        InvalidArgumentError: an unknown strategy or mode.
    """
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}",
            fix=f"use one of: {', '.join(sorted(STRATEGIES))}",
        )
    if mode not in MODES:
        raise InvalidArgumentError(f"unknown mode {mode!r}", fix=f"use one of: {', '.join(MODES)}")
    if len(profile.nodes) < 2:
        raise InvalidArgumentError("the profile has no nodes to plan")
    chain = build_chain(profile, grad_accumulation=grad_accumulation, overhead=overhead)
    baseline = estimate_peak(chain, (), mode)
    choose = STRATEGIES[strategy]
    quick_least = not exact_least and choose is _optimal
    if quick_least:
        tree, min_peak, keeps = _optimal(chain, budget_bytes, mode, nesting, exact_least=False)
    else:
        tree, min_peak, keeps = choose(chain, budget_bytes, mode, nesting)
    if budget_bytes is not None and baseline <= budget_bytes and strategy != "sqrt":
        tree, keeps = (), NO_KEEPS  # nothing to recompute when the budget is met as it is
    if tree is None:
        assert budget_bytes is not None
        raise InfeasibleBudgetError(
            f"{model or 'the model'} needs at least {_mib(min_peak)} of activation memory at "
            f"inputs ({profile.input_signature}); the budget is {_mib(budget_bytes)}",
            budget_bytes=budget_bytes,
            min_feasible_bytes=min_peak,
        )
    if tree_depth(tree) > 1:
        estimated = estimate_tree_peak(chain, tree)
    else:
        estimated = estimate_peak(chain, tuple((a, b) for a, b, _ in tree), mode, keeps)
    segments, skipped = _describe(profile, chain, tree, mode, budget_bytes, keeps)
    notes = []
    if tree_depth(tree) > 1:
        notes.append("segments numbered like 2.1 are checkpointed again inside the recompute "
                     "of the segment they belong to: their nodes run forward three times")
    if quick_least and budget_bytes is not None and not _prices_agree(chain):
        notes.append(LEAST_FOUND_NOTE)
    if not tree:
        if budget_bytes is not None and baseline <= budget_bytes:
            notes.append("the budget is met without checkpointing: nothing is recomputed")
        else:
            notes.append("no checkpoint lowers the estimated peak for this model")
    return Plan(
        model=model,
        input_signature=profile.input_signature,
        mode=mode,
        strategy=strategy,
        budget_bytes=budget_bytes,
        baseline_peak_bytes=baseline,
        estimated_peak_bytes=estimated,
        min_peak_bytes=min(min_peak, estimated),
        forward_flops=profile.forward_flops,
        recompute_flops=sum(s.recompute_flops for s in segments),
        node_count=profile.graph_node_count,
        segments=segments,
        skipped=skipped,
        notes=tuple(notes),
        loss=profile.loss,
        grad_accumulation=grad_accumulation,
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _describe(
    profile: Profile, chain: Chain, tree: Tree, mode: str, budget_bytes: int | None,
    keeps: Keeps = NO_KEEPS,
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """Turn a tree of stage ranges into Segment rows (those starting in ``keeps`` keeping
    their matmuls), and the stretches between the outermost ones into skipped rows."""
    nodes = profile.nodes
    stages = chain.stages
    ranges = tuple((a, b) for a, b, _ in tree)
    segments = []
    for a, b, depth in flatten_tree(tree):
        start, end = stages[a].start, stages[b].end
        members = nodes[start:end]
        inside = set(range(start, end))
        inputs = [st for st in profile.storages
                  if st.producer < start and any(u in inside for u in st.users)]
        freed = sum(
            st.size_bytes
            for st in profile.storages
            if st.producer in inside and any(s in inside for s in st.saved_by)
        )
        # The dummy argument is decided here, once, on what the runtime hands checkpoint:
        # the segment's inputs other than parameters, of which only tensors count (NOTE [ The
        # dummy argument ] in autockpt.running.runner).
        input_grad = any(
            nodes[i].requires_grad and nodes[i].output_kind == "tensor"
            for m in members
            for i in m.inputs
            if i < start and nodes[i].op != "get_attr"
        )
        outputs = [st for st in profile.storages
                   if start <= st.producer < end and any(u >= end for u in st.users)]
        flops = sum(m.flops for m in members)
        spared = min(flops, stages[b].tail_flops) if mode == "non_reentrant" else 0
        keep = a in keeps and depth == 0
        kept_flops = max(0, sum(m.kept_flops for m in members) - spared) if keep else 0
        kept_bytes = sum(m.kept_bytes for m in members) if keep else 0
        kept_ops = sum(m.kept_ops for m in members) if keep else 0
        segments.append(
            _segment(
                members,
                checkpointed=True,
                input_count=len(inputs),
                output_count=len(outputs),
                boundary_bytes=sum(st.size_bytes for st in inputs),
                freed_bytes=max(0, freed - kept_bytes),
                recompute_flops=flops - spared - kept_flops,
                keeps=keep,
                kept_ops=kept_ops,
                kept_bytes=kept_bytes,
                recomputed_ops=sum(m.ops for m in members) - kept_ops,
                dummy_arg=mode == "reentrant"
                and not input_grad
                and any(m.trainable for m in members),
                reason="",
                depth=depth,
            )
        )
    skipped = []
    covered = [False] * len(stages)
    for a, b in ranges:
        for t in range(a, b + 1):
            covered[t] = True
    t = 0
    while t < len(stages):
        if covered[t]:
            t += 1
            continue
        grad = stages[t].carries_grad
        u = t
        while u + 1 < len(stages) and not covered[u + 1] and stages[u + 1].carries_grad == grad:
            u += 1
        # The loss node is the user's code, described in the plan's header, not a row.
        members = [m for m in nodes[stages[t].start : stages[u].end] if m.op != LOSS_OP]
        if any(m.op not in ("placeholder", "get_attr") for m in members):
            trailing = not any(s.carries_grad for s in stages[u + 1 :])
            if not grad:
                reason = "no gradient flows here: nothing is saved for backward"
            elif budget_bytes is not None:
                reason = "cheaper to keep: the budget is met without recomputing it"
            elif trailing:
                reason = "backward reads these activations first: checkpointing saves nothing"
            else:
                reason = "recomputing it would not lower the peak"
            skipped.append(
                _segment(members, checkpointed=False, boundary_bytes=0, freed_bytes=0,
                         recompute_flops=0, dummy_arg=False, reason=reason)
            )
        t = u + 1
    return tuple(segments), tuple(skipped)


def _segment(members: Sequence[NodeStat], **fields: object) -> Segment:
    real = [m for m in members if m.op not in ("placeholder", "get_attr")] or list(members)
    return Segment(
        start=members[0].index,
        end=members[-1].index + 1,
        first_node=real[0].name,
        last_node=real[-1].name,
        first_module=real[0].module_path,
        last_module=real[-1].module_path,
        node_count=len(members),
        preserve_rng=any(m.random for m in members) and bool(fields["checkpointed"]),
        buffers=tuple(sorted({b for m in members for b in m.mutated_buffers}))
        if fields["checkpointed"]
        else (),
        **fields,  # type: ignore[arg-type]
    )

