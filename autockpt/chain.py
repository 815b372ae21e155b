"""The graph as a chain of stages, its memory model, and the optimal choice of segments.

Plain numbers only (no fx): :func:`build_chain` turns a :class:`~autockpt.stats.Profile` into
a :class:`Chain`; :func:`estimate_peak` predicts the peak activation bytes of any choice of
checkpointed stage ranges; :func:`optimal_ranges` finds the choice of least recompute under a
budget, or of least peak.

# NOTE [ The memory model ]
Cut points split the graph into stages (see ``_candidate_cuts``). Every activation storage is
one of three kinds:

* *internal* to its producing stage: held for backward iff that stage is not checkpointed and
  saves it;
* *crossing* exactly one cut, from stage ``c-1`` to stage ``c``: held iff ``c-1`` is not
  checkpointed and saves it, or ``c`` is not checkpointed and saves it, or ``c`` starts a
  checkpointed segment (checkpoint keeps its inputs for the recompute);
* *long-lived* (read more than one stage later, like an attention mask, or part of the
  model's output): held from its producer on, whatever the plan. This is conservative.

Backward runs the stages in reverse and frees a held storage once the earliest stage holding it
is done, so while backward is in stage ``t`` the storages held by stages ``<= t`` are alive:
``H(t)``, which grows left to right. Not checkpointed, stage ``t`` peaks in backward at
``H(t)`` plus the gradients crossing into it and its working set. A checkpointed segment
``[a, b]`` peaks at ``H(b)`` plus its recompute (every storage it produces and saves, a second
copy, and in reentrant mode its outputs) plus its largest gradients and working set. In forward
stage ``t`` peaks at what is held from earlier stages, the tensors crossing into it, and its
own working set (profiled node by node on fake tensors). The estimate is the largest of all
these. Because ``H`` only grows and every peak term depends on the choices before a cut only
through ``H`` and whether the stage before the cut is checkpointed, a dynamic programme over
cuts with Pareto frontiers of ``(H, cost)`` is exact for this model (:func:`optimal_ranges`).
"""

from __future__ import annotations

import gc
import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from autockpt.stats import NodeStat, Profile, node_cost

__all__ = ["Stage", "Chain", "Ranges", "build_chain", "estimate_peak", "recompute_cost",
           "optimal_ranges"]

Ranges = tuple[tuple[int, int], ...]
"""Checkpointed segments as inclusive ``(first_stage, last_stage)`` pairs, sorted, disjoint."""

_PLAIN, _CKPT = 0, 1  # what the block before a cut was


@dataclass(frozen=True)
class Stage:
    """A run of graph nodes between two candidate cuts."""

    start: int
    """Position of its first node."""
    end: int
    """Position one past its last node."""
    cost: int
    """Cost of recomputing it: the sum of its nodes' :func:`~autockpt.stats.node_cost`."""
    flops: int
    """FLOPs of its nodes."""
    carries_grad: bool
    """Whether any of its nodes produces a tensor that requires grad."""


@dataclass(frozen=True)
class Chain:
    """A graph restated as a chain of stages, with the numbers of the memory model.

    Arrays indexed by stage have one entry per stage; arrays indexed by cut have one more
    (cut ``c`` lies before stage ``c``; cut 0 and cut ``len(stages)`` cross nothing).
    """

    stages: tuple[Stage, ...]
    """The stages, in graph order."""
    internal_saved: tuple[int, ...]
    """Per stage: bytes of its internal storages that it saves."""
    cross_prev: tuple[int, ...]
    """Per cut: crossing bytes saved only by the stage before the cut."""
    cross_next: tuple[int, ...]
    """Per cut: crossing bytes saved only by the stage after the cut."""
    cross_both: tuple[int, ...]
    """Per cut: crossing bytes saved by both stages."""
    cross_none: tuple[int, ...]
    """Per cut: crossing bytes saved by neither (read, then freed)."""
    long_held: tuple[int, ...]
    """Per stage: bytes of long-lived storages it produces (held from then on)."""
    long_saved: tuple[int, ...]
    """Per stage: bytes of long-lived or output storages it produces and something saves."""
    output_bytes: tuple[int, ...]
    """Per stage: bytes of the model's output it produces (alive until the step ends)."""
    grad_cross: tuple[int, ...]
    """Per stage: gradient bytes alive when backward enters it (of tensors crossing its end,
    the model's output included)."""
    backward_work: tuple[int, ...]
    """Per stage: working set of its backward: for its largest op, the gradients of the op's
    inputs (and of its output, if that comes from inside the stage), or the op's forward
    working set beyond what it saves, if larger (a leaf module's internals)."""
    forward_plain: tuple[int, ...]
    """Per stage: its forward peak over what it receives, when not checkpointed."""
    forward_ckpt: tuple[int, ...]
    """Per stage: the same when checkpointed (what it saves is freed as it goes)."""

    def crossing(self, cut: int) -> int:
        """All bytes crossing ``cut``."""
        return (self.cross_prev[cut] + self.cross_next[cut] + self.cross_both[cut]
                + self.cross_none[cut])


# --------------------------------------------------------------------------- building


def _candidate_cuts(nodes: Sequence[NodeStat]) -> list[int]:
    """Positions ``c`` where a cut before node ``c`` is allowed and cheap.

    A cut is allowed unless a container of tensors crosses it (reentrant checkpoint would lose
    their gradients) or it separates a tensor from an in-place op on it. It is cheap where no
    more gradient-carrying tensors cross than at the cheapest cut: block boundaries. Tensors
    that carry no gradient (a mask built from token ids) do not count.
    """
    n = len(nodes)
    last = n - 1  # the output node
    first = 1 + max((s.index for s in nodes if s.op == "placeholder"), default=-1)
    diff_forbid = [0] * (n + 2)
    diff_grad = [0] * (n + 2)
    for node in nodes:
        if node.op in ("get_attr", "output") or not node.users:
            continue
        lo, hi = node.index + 1, max(node.users)  # cuts crossed by this value
        if lo > hi:
            continue
        if node.output_kind == "container" and node.op != "placeholder":
            diff_forbid[lo] += 1
            diff_forbid[hi + 1] -= 1
        if node.output_kind == "tensor" and node.requires_grad:
            diff_grad[lo] += 1
            diff_grad[hi + 1] -= 1
        for producer in node.mutated_inputs:
            diff_forbid[producer + 1] += 1
            diff_forbid[node.index + 1] -= 1
    forbid = grads = 0
    allowed: list[tuple[int, int]] = []
    for c in range(n + 1):
        forbid += diff_forbid[c]
        grads += diff_grad[c]
        if first <= c < last and forbid == 0:
            allowed.append((c, grads))
    threshold = max(1, min((g for _, g in allowed if g > 0), default=1))
    return [c for c, g in allowed if g <= threshold]


MAX_STAGES = 64
"""Longer chains are coarsened to this many stages before planning (see :func:`_coarsen`)."""


def _coarsen(profile: Profile, cuts: list[int], max_stages: int) -> list[int]:
    """Keep at most ``max_stages - 1`` inner cuts: one per equal share of the recompute cost,
    the one in each share's window that the fewest bytes cross (the cheapest boundary).

    The dynamic programme's time grows with the square of the chain's length; a plan rarely
    needs more than a few dozen segment boundaries to choose from.
    """
    inner = [c for c in cuts if 0 < c < len(profile.nodes) - 1]
    if len(inner) < max_stages:
        return cuts
    nodes = profile.nodes
    cumulative = [0]
    for node in nodes:
        cumulative.append(cumulative[-1] + node.flops + node.output_bytes + 1)
    crossing = [0] * (len(nodes) + 1)
    for st in profile.storages:
        last = max(st.users, default=st.producer)
        for c in range(st.producer + 1, last + 1):
            crossing[c] += st.size_bytes
    total = cumulative[-1]
    # The first cut separates the inputs (placeholders) from the graph: always keep it.
    kept: list[int] = [inner[0]]
    for k in range(1, max_stages - 1):
        lo, hi = (k - 0.5) * total / max_stages, (k + 0.5) * total / max_stages
        ideal = k * total / max_stages
        window = [c for c in inner if lo <= cumulative[c] < hi and (not kept or c > kept[-1])]
        if window:
            kept.append(min(window, key=lambda c: (crossing[c], abs(cumulative[c] - ideal), c)))
    return sorted({cuts[0], cuts[-1], *kept})


def build_chain(profile: Profile, *, max_stages: int = MAX_STAGES) -> Chain:
    """Split the graph at the candidate cuts and compute the numbers of the memory model."""
    nodes = profile.nodes
    n = len(nodes)
    cuts = sorted({0, n - 1, *(c for c in _candidate_cuts(nodes) if c > 0)})
    cuts = _coarsen(profile, cuts, max_stages)
    count = len(cuts) - 1
    stage_of = [0] * n
    stages = []
    for s, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        members = nodes[lo:hi]
        stage_of[lo:hi] = [s] * (hi - lo)
        flops = sum(m.flops for m in members)
        stages.append(Stage(start=lo, end=hi, flops=flops,
                            cost=sum(node_cost(m) for m in members),
                            carries_grad=any(m.requires_grad for m in members)))
    stage_of[n - 1] = count
    internal = [0] * count
    long_held = [0] * count
    long_saved = [0] * count
    outputs = [0] * count
    prev, nxt, both, none = ([0] * (count + 1) for _ in range(4))
    grad_cross = [0] * count
    # Storages held through the forward sweep of their own stage, per kind of stage.
    held_plain: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    held_ckpt: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    for st in profile.storages:
        p = stage_of[st.producer]
        users = sorted({stage_of[u] for u in st.users if u < n - 1})
        savers = sorted({stage_of[u] for u in st.saved_by})
        reach = max(users + savers, default=p)
        last_node = max([u for u in st.users if u < n - 1], default=st.producer)
        end_in_stage = min(last_node, stages[p].end - 1)
        size = st.size_bytes
        if st.is_output or reach > p + 1:
            if st.is_output:
                outputs[p] += size
            else:
                long_held[p] += size
            if savers:
                long_saved[p] += size
            span = (st.producer, stages[p].end - 1, size)
            held_plain[p].append(span)
            held_ckpt[p].append(span)
        elif reach == p + 1:
            by_prev, by_next = p in savers, p + 1 in savers
            table = both if by_prev and by_next else prev if by_prev else nxt if by_next else none
            table[p + 1] += size
            kept = (st.producer, stages[p].end - 1, size)
            held_plain[p].append(kept if by_prev else (st.producer, end_in_stage, size))
            held_ckpt[p].append((st.producer, end_in_stage, size))
        else:
            if p in savers:
                internal[p] += size
            held_plain[p].append(
                (st.producer, stages[p].end - 1 if p in savers else end_in_stage, size))
            held_ckpt[p].append((st.producer, end_in_stage, size))
        last_stage = count if st.is_output else max(users, default=p)
        if st.requires_grad:
            for t in range(p, min(last_stage, count)):
                grad_cross[t] += size
    # What a node saves of its own making is already in the held or recomputed bytes; the
    # rest of its forward working set is what its backward is assumed to allocate again.
    # A node's backward allocates the gradients of its inputs; the gradient of its output is
    # counted in ``grad_cross`` when it comes from a later stage, and here when it does not.
    # A tensor read by several nodes of one stage has its gradient accumulated there: the
    # first partial gradient stays alive while the other readers' backward runs.
    own_saved = [0] * n
    grad_in = [0] * n
    fan_out = [0] * count
    for st in profile.storages:
        if st.producer in st.saved_by:
            own_saved[st.producer] += st.size_bytes
        if st.requires_grad:
            readers = [u for u in st.users if u < n - 1]
            for u in readers:
                grad_in[u] += st.size_bytes
            per_stage: dict[int, int] = {}
            for u in readers:
                per_stage[stage_of[u]] = per_stage.get(stage_of[u], 0) + 1
            for s, readers_in_stage in per_stage.items():
                if readers_in_stage > 1:
                    fan_out[s] += st.size_bytes
    work = [0] * count
    for s, stage in enumerate(stages):
        work[s] = fan_out[s] + max(
            (
                max(grad_in[m.index] + (m.output_bytes if m.index < stage.end - 1 else 0),
                    m.work_bytes - own_saved[m.index])
                for m in nodes[stage.start:stage.end]
                if m.requires_grad
            ),
            default=0,
        )
    forward_plain = [_sweep(nodes, stage, held_plain[s]) for s, stage in enumerate(stages)]
    forward_ckpt = [_sweep(nodes, stage, held_ckpt[s]) for s, stage in enumerate(stages)]
    return Chain(
        stages=tuple(stages), internal_saved=tuple(internal), cross_prev=tuple(prev),
        cross_next=tuple(nxt), cross_both=tuple(both), cross_none=tuple(none),
        long_held=tuple(long_held), long_saved=tuple(long_saved), output_bytes=tuple(outputs),
        grad_cross=tuple(grad_cross), backward_work=tuple(work),
        forward_plain=tuple(forward_plain), forward_ckpt=tuple(forward_ckpt),
    )


def _sweep(nodes: Sequence[NodeStat], stage: Stage, spans: list[tuple[int, int, int]]) -> int:
    """Forward peak inside a stage: storages it produced that are still alive, plus the
    working set of the node running. A storage lives from the node after its producer (the
    producer's working set covers it there) to its last reader in the stage."""
    alive = [0] * (stage.end - stage.start + 1)
    for producer, end, size in spans:
        if end > producer:
            alive[producer + 1 - stage.start] += size
            alive[end + 1 - stage.start] -= size
    peak = running = 0
    for k in range(stage.start, stage.end):
        running += alive[k - stage.start]
        peak = max(peak, running + nodes[k].work_bytes)
    return peak


# --------------------------------------------------------------------------- the model


class _Model:
    """Prefix sums over a chain, so that each block's numbers cost O(1)."""

    def __init__(self, chain: Chain, mode: str) -> None:
        self.chain = chain
        self.count = len(chain.stages)
        self.reentrant = mode == "reentrant"
        c = chain

        def prefix(values: Sequence[int]) -> list[int]:
            out = [0]
            for v in values:
                out.append(out[-1] + v)
            return out

        self.internal = prefix(c.internal_saved)
        # Crossing bytes saved inside a segment, by cut (recomputed when both sides are in).
        self.cross_saved = prefix([c.cross_prev[k] + c.cross_next[k] + c.cross_both[k]
                                   for k in range(self.count + 1)])
        self.long_held = prefix(c.long_held)
        self.long_saved = prefix(c.long_saved)
        self.outputs = prefix(c.output_bytes)
        self.unsaved_escape = prefix([c.long_held[t] + c.output_bytes[t] - c.long_saved[t]
                                      for t in range(self.count)])
        self.base = sum(c.output_bytes)

    def plain(self, t: int, before: int, held: int) -> tuple[int, int]:
        """Stage ``t`` not checkpointed: its peak, and the held bytes after it."""
        c = self.chain
        received = c.cross_next[t] + (c.cross_prev[t] + c.cross_both[t] if before == _CKPT else 0)
        after = (held + received + c.internal_saved[t] + c.long_held[t]
                 + c.cross_prev[t + 1] + c.cross_both[t + 1])
        forward = held + c.crossing(t) + self.outputs[t] + c.forward_plain[t]
        backward = after + self.base + c.grad_cross[t] + c.backward_work[t]
        return max(forward, backward), after

    def segment(self, a: int, b: int, held: int, inputs: int
                ) -> tuple[int, int, int]:
        """Stages ``a..b`` checkpointed: the backward peak, the held bytes after it, and a
        lower bound of the peak that never decreases as ``b`` grows.

        ``inputs`` is what ``a`` newly holds of the tensors crossing into it."""
        c = self.chain
        after = held + inputs + self.long_held[b + 1] - self.long_held[a]
        recompute = (self.internal[b + 1] - self.internal[a]
                     + self.cross_saved[b + 1] - self.cross_saved[a + 1]
                     + self.long_saved[b + 1] - self.long_saved[a])
        # What crosses out at b + 1 depends on where the segment ends, not on its length.
        boundary = c.cross_prev[b + 1] + c.cross_both[b + 1]
        if self.reentrant:
            # Reentrant backward re-runs the segment to its outputs and runs a backward of its
            # own through them: the recomputed outputs, their incoming gradients (accumulated
            # from every reader) and the gradients it hands on are alive at once, and its
            # detached inputs get a .grad of their own before it is handed on.
            recompute += (3 * (self.unsaved_escape[b + 1] - self.unsaved_escape[a])
                          + c.crossing(a))
            boundary = 3 * c.crossing(b + 1) - boundary
        grads = max(c.grad_cross[a:b + 1])
        work = max(c.backward_work[a:b + 1])
        lower = after + self.base + recompute + grads + work
        return lower + boundary, after, lower

    def segment_inputs(self, a: int, before: int) -> int:
        c = self.chain
        fresh = c.cross_next[a] + c.cross_none[a]
        return fresh + (c.cross_prev[a] + c.cross_both[a] if before == _CKPT else 0)

    def segment_forward(self, a: int, t: int, held: int, inputs: int) -> int:
        """Forward peak of stage ``t`` inside a segment that starts at ``a``."""
        c = self.chain
        if t == a:
            carried = held + c.crossing(a)
        else:
            carried = held + inputs + self.long_held[t] - self.long_held[a] + c.crossing(t)
        return carried + self.outputs[t] + c.forward_ckpt[t]


def estimate_peak(chain: Chain, ranges: Ranges, mode: str = "non_reentrant") -> int:
    """Estimated peak activation bytes of one forward and backward with ``ranges``
    checkpointed. See NOTE [ The memory model ].

    Example:
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_cross=(8,), backward_work=(16,),
        ...               forward_plain=(72,), forward_ckpt=(8,))
        >>> estimate_peak(chain, ())   # 64 held + 8 output + 8 gradient + 16 working set
        96
    """
    model = _Model(chain, mode)
    starts = {a: b for a, b in ranges}
    peak = held = 0
    before = _PLAIN
    t = 0
    while t < model.count:
        if t in starts:
            b = starts[t]
            inputs = model.segment_inputs(t, before)
            for u in range(t, b + 1):
                peak = max(peak, model.segment_forward(t, u, held, inputs))
            value, held, _ = model.segment(t, b, held, inputs)
            before, t = _CKPT, b + 1
        else:
            value, held = model.plain(t, before, held)
            before, t = _PLAIN, t + 1
        peak = max(peak, value)
    return peak


def recompute_cost(chain: Chain, ranges: Ranges) -> int:
    """Total cost of the stages ``ranges`` recompute."""
    return sum(chain.stages[t].cost for a, b in ranges for t in range(a, b + 1))


# --------------------------------------------------------------------------- optimisation


_Path = tuple[tuple[int, int], "_Path | None"]
"""Chosen blocks as a linked list of ``(block, parent)`` pairs, newest first, shared between
frontier entries; ``None`` is the empty list. Plain tuples, because the programme builds one
per frontier entry it extends (millions on long chains) and a tuple is several times cheaper
to create than an object."""

_Entry = tuple[int, int, "_Path | None"]
"""A frontier entry: ``(held bytes, score, path)``."""


def _ranges(path: _Path | None) -> Ranges:
    """The blocks of ``path`` in graph order."""
    out = []
    while path is not None:
        out.append(path[0])
        path = path[1]
    return tuple(reversed(out))


_HELD_SCORE = operator.itemgetter(0, 1)


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """Keep the entries no other entry beats on both held bytes and score."""
    entries.sort(key=_HELD_SCORE)  # stable: among equal pairs the first pushed is kept
    kept: list[_Entry] = []
    last = math.inf
    for entry in entries:
        if entry[1] < last:
            kept.append(entry)
            last = entry[1]
    return kept


def optimal_ranges(chain: Chain, budget: int | None, mode: str = "non_reentrant"
                   ) -> tuple[Ranges, int] | None:
    """The checkpointed ranges of least recompute cost whose estimated peak fits ``budget``,
    and that peak; with ``budget=None``, those of least peak (then least cost). ``None`` if no
    choice fits.

    A dynamic programme over cuts: the state is the cut, whether the stage before it was
    checkpointed, and the bytes held so far; each state keeps the Pareto frontier of (held
    bytes, score), score being the cost, or for ``budget=None`` the peak so far.

    Example:
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_cross=(8,), backward_work=(16,),
        ...               forward_plain=(72,), forward_ckpt=(8,))
        >>> optimal_ranges(chain, 200)
        ((), 96)
    """
    if budget is None:
        best = _solve(chain, None, mode, minimise_peak=True)
        if best is None:
            return None
        budget = best[1]
    return _solve(chain, budget, mode, minimise_peak=False)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, if it runs, for the duration.

    The programme creates hundreds of thousands of small tuples that all stay alive until it
    ends, none of them in a cycle: every few hundred allocations the collector would scan
    all of them again, which made it several times slower on long graphs.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SKETCH_WIDTH = 8
"""Frontier entries per state kept by the quick first pass of a budgeted solve."""


def _solve(chain: Chain, budget: int | None, mode: str, *, minimise_peak: bool
           ) -> tuple[Ranges, int] | None:
    with _gc_paused():
        bound = None
        if budget is not None and not minimise_peak:
            # A quick pass that keeps only a few entries per state finds a plan that fits,
            # usually of near-least cost. Its cost bounds the exact pass: an entry that
            # already costs more can never lead to the optimum (costs only add up), and
            # dropping it changes nothing else (it dominates no cheaper entry). Same result,
            # far smaller frontiers.
            sketch = _solve_frontiers(chain, budget, mode, minimise_peak=False,
                                      width=_SKETCH_WIDTH)
            if sketch is not None:
                bound = recompute_cost(chain, sketch[0])
        return _solve_frontiers(chain, budget, mode, minimise_peak=minimise_peak, bound=bound)


def _solve_frontiers(chain: Chain, budget: int | None, mode: str, *, minimise_peak: bool,
                     width: int | None = None, bound: int | None = None
                     ) -> tuple[Ranges, int] | None:
    """The dynamic programme. ``width`` keeps at most that many entries per state (evenly
    spread over the frontier, a heuristic); ``bound`` drops entries whose cost exceeds it."""
    model = _Model(chain, mode)
    count = model.count
    limit = budget if budget is not None else None
    # frontier[(cut, before)] -> [(held, score, path)]; score is cost or the peak so far.
    frontier: dict[tuple[int, int], list[_Entry]] = {(0, _PLAIN): [(0, 0, None)]}

    def push(key: tuple[int, int], entries: list[_Entry]) -> None:
        if entries:
            frontier.setdefault(key, []).extend(entries)

    for i in range(count):
        for before in (_PLAIN, _CKPT):
            entries = frontier.pop((i, before), None)
            if not entries:
                continue
            entries = _pareto(entries)  # ascending held, descending score
            if width is not None and len(entries) > width:
                step = (len(entries) - 1) / (width - 1)
                entries = [entries[round(k * step)] for k in range(width)]
            # Scores descend along the frontier: the entries within the cost bound, now and
            # after a block's cost is added, are a suffix, found by bisection.
            if bound is not None:
                entries = entries[bisect_left([-e[1] for e in entries], -bound):]
                if not entries:
                    continue
            negated = [-e[1] for e in entries] if bound is not None else []
            # Every peak and held total below is ``held + constant``: compute the constants
            # once per block, then the entries that fit are a prefix of the frontier, found
            # by bisection on the held bytes.
            helds = [e[0] for e in entries]
            value0, after0 = model.plain(i, before, 0)
            fit = entries if limit is None else entries[:bisect_right(helds, limit - value0)]
            if minimise_peak:
                push((i + 1, _PLAIN), [(h + after0, max(sc, h + value0), p) for h, sc, p in fit])
            else:
                push((i + 1, _PLAIN), [(h + after0, sc, p) for h, sc, p in fit])
            if not chain.stages[i].carries_grad:
                continue
            inputs = model.segment_inputs(i, before)
            forward0 = 0
            cost = 0
            for b in range(i, count):
                if not chain.stages[b].carries_grad:
                    break
                forward0 = max(forward0, model.segment_forward(i, b, 0, inputs))
                cost += chain.stages[b].cost
                value0, after0, lower0 = model.segment(i, b, 0, inputs)
                value0 = max(value0, forward0)
                if limit is not None:
                    if helds[0] + max(lower0, forward0) > limit:
                        break  # the lower bound only grows with b: longer segments fail too
                    hi = bisect_right(helds, limit - value0)
                    lo = 0 if bound is None else bisect_left(negated, cost - bound)
                    fit = entries[lo:hi]
                    if not fit:
                        continue
                else:
                    fit = entries
                block = (i, b)
                if minimise_peak:
                    push((b + 1, _CKPT), [(h + after0, max(sc, h + value0), (block, p))
                                          for h, sc, p in fit])
                else:
                    push((b + 1, _CKPT), [(h + after0, sc + cost, (block, p))
                                          for h, sc, p in fit])
    finals = frontier.get((count, _PLAIN), []) + frontier.get((count, _CKPT), [])
    if not finals:
        return None
    if minimise_peak:
        # The least peak, then the least cost among those: costs only for the few that tie.
        least = min(e[1] for e in finals)
        _, peak, path = min((e for e in finals if e[1] == least),
                            key=lambda e: recompute_cost(chain, _ranges(e[2])))
        return _ranges(path), peak
    _, _, path = min(finals, key=lambda e: (e[1], e[0]))
    ranges = _ranges(path)
    return ranges, estimate_peak(chain, ranges, mode)
