"""The single-level dynamic programme: the checkpointed ranges of least recompute under a
budget, exactly for the memory model, and the least peak any such ranges reach.

Plain numbers only; it prices blocks with :class:`~autockpt.planning.memory_model.MemoryModel` and
nothing else. The states of the programme are ``(cut, follows_segment)``: a cut, and whether
the stage before it ends a checkpointed segment (NOTE [ The memory model ] in
:mod:`autockpt.planning.memory_model` says why that and the held bytes are all the past it needs).
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, bisect_right

from autockpt.planning.chain import Chain
from autockpt.planning.gc import paused
from autockpt.planning.memory_model import (
    Keeps,
    MemoryModel,
    Ranges,
    as_tree,
    model_of,
    recompute_cost,
)

__all__ = ["optimal_ranges", "optimal_plan", "least_peak", "RangePath", "path_ranges",
           "path_keeps"]

_State = tuple[int, bool]
"""A state of the programme: ``(cut, whether the stage before it ends a segment)``."""

RangePath = tuple[tuple[int, ...], "RangePath | None"]
"""Chosen blocks as a linked list of ``(block, parent)`` pairs, newest first; a block is
``(first, last)``, or ``(first, last, 1)`` for a segment that keeps its matmuls (NOTE
[ Segments that keep their matmuls ] in :mod:`autockpt.planning.memory_model`). Shared between
frontier entries; ``None`` is the empty list. Plain tuples, because the programme builds one
per frontier entry it extends (millions on long chains) and a tuple is several times cheaper
to create than an object."""

_Entry = tuple[int, int, "RangePath | None"]
"""A frontier entry: ``(held bytes, score, path)``."""


def path_ranges(path: RangePath | None) -> Ranges:
    """The blocks of ``path`` in graph order."""
    out = []
    while path is not None:
        out.append((path[0][0], path[0][1]))
        path = path[1]
    return tuple(reversed(out))


def path_keeps(path: RangePath | None) -> Keeps:
    """The first stages of the blocks of ``path`` that keep their matmuls."""
    out = []
    while path is not None:
        if len(path[0]) > 2:
            out.append(path[0][0])
        path = path[1]
    return frozenset(out)


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
    """:func:`optimal_plan` with no segment keeping its matmuls."""
    found = optimal_plan(chain, budget, mode, keep=False)
    return None if found is None else (found[0], found[2])


def optimal_plan(chain: Chain, budget: int | None, mode: str = "non_reentrant", *,
                 keep: bool = True) -> tuple[Ranges, Keeps, int] | None:
    """The checkpointed ranges of least recompute cost whose estimated peak fits ``budget``,
    and that peak; with ``budget=None``, those of least peak (then least cost). ``None`` if no
    choice fits.

    A dynamic programme over cuts: the state is the cut, whether the stage before it ends a
    checkpointed segment, and the bytes held so far; each state keeps the Pareto frontier of
    (held bytes, cost). The least peak itself (:func:`least_peak`) needs no frontier: every peak
    term is ``held + constant``, so a backward pass over the blocks finds it.

    ``keep``: a segment may keep its matmuls (non-reentrant mode; NOTE [ Segments that keep
    their matmuls ] in :mod:`autockpt.planning.memory_model`), one more choice per segment in
    the same programme; the ranges come with the set of those that do.

    The example of :func:`autockpt.planning.search.search_kept` finds the same plans here.
    """
    model = model_of(chain, mode)
    keep = keep and model.keeps
    rest = _least_suffix_peaks(model)
    if budget is None:
        budget = int(rest[(0, False)])  # the least peak, then the cheapest plan reaching it
    # The programme creates hundreds of thousands of small tuples that all stay alive until
    # it ends, none of them in a cycle: the collector would scan all of them again and again.
    with paused():
        # A quick pass that keeps only a few entries per state finds a plan that fits,
        # usually of near-least cost. Its cost bounds the exact pass: an entry that already
        # costs more can never lead to the optimum (costs only add up), and dropping it
        # changes nothing else (it dominates no cheaper entry). Same result, far smaller
        # frontiers.
        bound = None
        sketch = _solve_frontiers(model, rest, budget, width=_SKETCH_WIDTH, keep=keep)
        if sketch is not None:
            bound = recompute_cost(chain, sketch[0], mode, sketch[1])
        return _solve_frontiers(model, rest, budget, bound=bound, keep=keep)


def _least_suffix_peaks(model: MemoryModel) -> dict[_State, float]:
    """For each state ``(cut, follows_segment)`` of the programme, the least peak that the
    stages from the cut on can add to what is held there: every peak term of a block is
    ``held + constant`` and the held bytes only grow, so a backward pass over the same blocks
    finds it. ``-inf`` past the last stage."""
    count = model.count
    rest: dict[_State, float] = {(count, False): -math.inf, (count, True): -math.inf}
    for i in range(count - 1, -1, -1):
        for follows_segment in (False, True):
            value0, after0 = model.plain_stage(i, follows_segment, 0)
            best = max(value0, after0 + rest[(i + 1, False)])
            for b, _, value, after, _, _ in model.segments_from(i, follows_segment):
                best = min(best, max(value, after + rest[(b + 1, True)]))
            rest[(i, follows_segment)] = best
    return rest


def least_peak(chain: Chain, mode: str = "non_reentrant") -> int:
    """The least estimated peak any choice of single-level ranges reaches (see
    :func:`optimal_ranges` for an example)."""
    return int(_least_suffix_peaks(model_of(chain, mode))[(0, False)])


_SKETCH_WIDTH = 8
"""Frontier entries per state kept by the quick first pass of a budgeted solve."""


def _solve_frontiers(model: MemoryModel, rest: dict[_State, float], limit: int, *,
                     width: int | None = None, bound: int | None = None, keep: bool = False
                     ) -> tuple[Ranges, Keeps, int] | None:
    """The dynamic programme under the budget ``limit``; ``rest`` is
    :func:`_least_suffix_peaks` of ``model``. ``width`` keeps at most that many entries per
    state (evenly spread over the frontier, a heuristic); ``bound`` drops entries whose cost
    exceeds it."""
    count = model.count
    # frontier[(cut, follows_segment)] -> [(held, cost, path)]
    frontier: dict[_State, list[_Entry]] = {(0, False): [(0, 0, None)]}
    # An entry holding more than this at a cut cannot finish within the budget, whatever
    # comes after it: drop it before it costs a sort.
    cap = {key: limit - least for key, least in rest.items()}

    def push(key: _State, entries: list[_Entry]) -> None:
        if entries:
            most = cap[key]
            if entries[-1][0] > most:
                entries = [e for e in entries if e[0] <= most]
                if not entries:
                    return
            frontier.setdefault(key, []).extend(entries)

    for i in range(count):
        for follows_segment in (False, True):
            entries = frontier.pop((i, follows_segment), None)
            if not entries:
                continue
            entries = _pareto(entries)  # ascending held, descending cost
            if width is not None and len(entries) > width:
                step = (len(entries) - 1) / (width - 1)
                entries = [entries[round(k * step)] for k in range(width)]
            # Costs descend along the frontier: the entries within the cost bound, now and
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
            value0, after0 = model.plain_stage(i, follows_segment, 0)
            fit = entries[:bisect_right(helds, limit - value0)]
            push((i + 1, False), [(h + after0, sc, p) for h, sc, p in fit])
            for b, cost, value0, after0, lower0, keeps in model.segments_from(
                    i, follows_segment, keep):
                if helds[0] + lower0 > limit:
                    if keeps:
                        continue  # a longer segment recomputed whole may still fit
                    break  # the lower bound only grows with b: longer segments fail too
                hi = bisect_right(helds, limit - value0)
                lo = 0 if bound is None else bisect_left(negated, cost - bound)
                fit = entries[lo:hi]
                if fit:
                    block = (i, b, 1) if keeps else (i, b)
                    push((b + 1, True), [(h + after0, sc + cost, (block, p))
                                         for h, sc, p in fit])
    finals = frontier.get((count, False), []) + frontier.get((count, True), [])
    if not finals:
        return None
    _, _, path = min(finals, key=lambda e: (e[1], e[0]))
    ranges, keeps = path_ranges(path), path_keeps(path)
    return ranges, keeps, model.peak(as_tree(ranges), keeps)
