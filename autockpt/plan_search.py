"""The single-level plan of least estimate, or of least recompute under a budget, exactly for a
plan's own estimate (:meth:`~autockpt.memory_model.MemoryModel.plan_peak`).

Plain numbers only, like :mod:`autockpt.optimal`, whose programme prices a plan at
:meth:`~autockpt.memory_model.MemoryModel.peak`: an upper bound of the plan's estimate that
keeps the programme's state small. This search walks the plans the way ``plan_peak`` does,
so what it finds is least for the estimate autockpt prints and checks budgets against.

# NOTE [ An exact search under the plan's own estimate ]
``plan_peak`` is a walk over the stages that carries, besides the held bytes and the peak so
far, a :class:`~autockpt.memory_model.WalkKey`: whether the last stage ended a segment, the
long-lived storages alive but held by nothing yet, and the passing storages a segment already
holds. Every later peak term is the held bytes plus a number that depends only on that key
and on the stages to come (every term of the model is ``held + constant``). So two walks
that reach a stage with the same key are compared on (held bytes, peak, recompute): one no
worse on all three can be completed by whatever completes the other, at no more memory and no
more recompute, and the other is dropped. What is left per key is a Pareto frontier, as in
:mod:`autockpt.optimal`, and the search is a dynamic programme over ``(stage, key)``.

Two things make it exact rather than a heuristic:

* keys forget only what no later stage can see: a long-lived storage past its last reader, a
  passing storage past its last reader;
* in reentrant mode a segment's price depends on the future (whether each long-lived
  storage escaping it is next held by a segment or by a plain stage), so the search tries
  every promise for the escaping storages and carries it in the key; the stage that first
  holds the storage keeps or breaks it, and a broken promise ends that walk. The plan's
  own walk (``plan_peak``) makes the promises by looking ahead, so both walks price a plan
  the same.

# NOTE [ Promises that change no price ]
A promise changes one number of the segment that makes it: its own backward term, which counts
the storages kept (a promise about the future), and nothing else: the bytes it adds to the held
ones, the terms of later stages and what a later holder pays are the same under every promise;
only which later walks are plans differs (a broken promise ends the walk). So where an entry's
peak is the same under every promise (the segment's term with every storage kept is no
higher than the entry's peak and the segment's forward), the promises are not tried: the entry
goes on with the escaping storages unpromised, which every later holder may take, as a
storage made by a plain stage is. Its peak is that of each promise's walk, and its walks
are the union of theirs. Hugging Face T5 (tests/models/test_skip_connections.py's inputs and
loss, reentrant, least memory) extends 9,183 frontier entries where it extended 44,323.

The number of keys grows with the pending storages crossing a stage, 2 to the number of them
in the worst case (and the promises double it in reentrant mode). An upper ``bound`` on the
answer keeps the frontiers small: with no budget, the estimate of the plan the local search
(``planner._descend``) found drops every walk whose peak passes it; under a budget, the
budget does, and the recompute of the programme's plan drops every walk that recomputes
more. The search gives up past ``MAX_KEYS`` keys or ``MAX_ENTRIES`` frontier entries
(about 2 s here), and the planner then keeps the plan it had. On every model the tests plan
(``benchmarks/planner_speed.py --corpus``'s list, both modes, least memory and budgets at 50%
and 75% of the baseline) it finished, in at most 0.4 s and 22,000 entries (BART).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import combinations

from autockpt.chain import Chain
from autockpt.memory_model import START, MemoryModel, Ranges, WalkKey, model_of, segment_cost
from autockpt.optimal import _Path, _ranges  # the same linked list of chosen blocks

__all__ = ["MAX_ENTRIES", "MAX_KEYS", "MAX_PROMISED", "search_plan"]

MAX_KEYS = 20_000
"""The most ``(stage, key)`` states a search visits before it gives up."""

MAX_ENTRIES = 100_000
"""The most frontier entries a search extends before it gives up."""

MAX_PROMISED = 8
"""The most long-lived storages escaping one reentrant segment whose promises are tried (2 to
this many variants of the segment); with more, the search gives up."""

_Entry = tuple[int, int, int, "_Path | None"]
"""A frontier entry: ``(held bytes, peak, score, path)``; the score is the recompute cost
times :data:`_PER_COST` plus the number of segments, so that of two plans that recompute as
much the one with fewer checkpoints (each has a cost of its own at run time) wins."""

_PER_COST = 1 << 20
"""Segments a plan may have before its count would spill into its recompute cost."""


def search_plan(chain: Chain, mode: str, *, budget: int | None = None,
                bound: int | None = None) -> tuple[Ranges, int] | None:
    """The single-level plan of least estimated peak (then least recompute), or with
    ``budget`` the plan of least recompute whose estimate fits it (of equal ones, one of
    lower peak), and that estimate. ``bound``, an upper bound the caller knows from a plan it
    already has: no plan above this estimate is wanted, or with ``budget``, no plan that
    recomputes more than this. None where nothing fits, or where the search gave up
    (NOTE [ An exact search under the plan's own estimate ]).

    Example:
        >>> from autockpt.chain import Chain, Cut, ForwardPeaks, Stage
        >>> stage = Stage(start=0, end=1, cost=1, flops=1, carries_grad=True, saved_bytes=64,
        ...               long_lived_bytes=0, long_lived_saved_bytes=0, output_bytes=8,
        ...               grad_entry_bytes=0, backward_peak_bytes=88,
        ...               forward=ForwardPeaks(72, 8, 72, 8, 72))
        >>> chain = Chain(stages=(stage,), cuts=(Cut(0, 0, 0, 0), Cut(0, 0, 0, 0)))
        >>> search_plan(chain, "non_reentrant")
        ((), 96)
    """
    try:
        found = _Search(model_of(chain, mode), mode, budget, bound).run()
    except _GiveUp:
        return None
    if found is None:
        return None
    peak, _, path = found
    return _ranges(path), peak


class _GiveUp(Exception):
    """The search would visit too many states to stay fast."""


class _Search:
    """One search: the frontiers by stage and key, and the bounds that prune them."""

    def __init__(self, model: MemoryModel, mode: str, budget: int | None,
                 bound: int | None) -> None:
        self.model = model
        self.mode = mode
        self.budget = budget
        self.limit = budget if budget is not None else bound
        """No walk whose peak passes this is kept."""
        self.cost_bound = (None if budget is None or bound is None
                           else bound * _PER_COST + _PER_COST - 1)
        """No walk whose score shows more recompute than ``bound`` is kept."""
        self.visited_entries = 0
        """Frontier entries extended so far, against :data:`MAX_ENTRIES`."""
        self.scores: dict[tuple[int, int], int] = {}
        self.promises: dict[tuple[int, int], list[frozenset[int]]] = {}
        self.carries = [stage.carries_grad for stage in model.chain.stages]

    def run(self) -> tuple[int, int, _Path | None] | None:
        model = self.model
        count = model.count
        carries = self.carries
        # fronts[t]: key -> entries, for the walks that reached stage t; keys in the order
        # first reached, so that the search is deterministic.
        fronts: list[dict[WalkKey, list[_Entry]]] = [{} for _ in range(count + 1)]
        fronts[0][START] = [(0, 0, 0, None)]
        visited = 0
        for t in range(count):
            for key, entries in fronts[t].items():
                visited += 1
                if visited > MAX_KEYS:
                    raise _GiveUp
                entries = _pareto(entries) if self.budget is None else _pareto_cost(entries)
                self.visited_entries += len(entries)
                if self.visited_entries > MAX_ENTRIES:
                    raise _GiveUp
                step = model.walk_plain(key, t)
                if step is not None:
                    self._push(fronts[t + 1], step, entries, 0, None)
                for b in range(t, count):
                    if not carries[b]:
                        break
                    cost = self._cost(t, b)
                    if self.cost_bound is not None and entries[-1][2] + cost > self.cost_bound:
                        # A longer segment recomputes more, but in non-reentrant mode may
                        # cost less (its recompute stops earlier in its last stage).
                        if self.mode == "reentrant":
                            break
                        continue
                    promises = self._promises(t, b)
                    if len(promises) == 1:
                        step = model.walk_segment_promising(key, t, b, promises)[0]
                        if step is not None:
                            self._push(fronts[b + 1], step, entries, cost, (t, b))
                        continue
                    steps = model.walk_segment_promising(key, t, b, promises, unpromised=True)
                    free = steps.pop()
                    if free is not None:  # else no promise has a step either
                        self._push_promised(fronts[b + 1], free, steps, entries, cost, (t, b))
            fronts[t] = {}
        finals = [entry for entries in fronts[count].values() for entry in entries]
        if not finals:
            return None
        if self.budget is None:
            _, peak, score, path = min(finals, key=lambda e: (e[1], e[2]))
        else:
            _, peak, score, path = min(finals, key=lambda e: (e[2], e[1]))
        return peak, score, path

    def _push(self, front: dict[WalkKey, list[_Entry]], step: tuple[WalkKey, int, int],
              entries: list[_Entry], cost: int, block: tuple[int, int] | None) -> None:
        key, grown, value = step
        limit, cost_bound = self.limit, self.cost_bound
        out = []
        for held, peak, spent, path in entries:  # by held bytes, ascending
            if limit is not None and held + value > limit:
                break  # the rest hold more
            new_peak = max(peak, held + value)
            if cost_bound is not None and spent + cost > cost_bound:
                continue
            out.append((held + grown, new_peak, spent + cost,
                        path if block is None else (block, path)))
        if out:
            front.setdefault(key, []).extend(out)

    def _push_promised(self, front: dict[WalkKey, list[_Entry]], free: tuple[WalkKey, int, int],
                       steps: list[tuple[WalkKey, int, int] | None], entries: list[_Entry],
                       cost: int, block: tuple[int, int]) -> None:
        """:meth:`_push` for a reentrant segment whose escaping storages take promises: an
        entry whose peak no promise changes goes on with none (``free``), the others once per
        promise (NOTE [ Promises that change no price ])."""
        least = min(step[2] for step in steps if step is not None)
        most = free[2]
        kept: list[_Entry] = []
        split: list[_Entry] = []
        for entry in entries:
            held, peak = entry[0], entry[1]
            (kept if max(peak, held + least) >= held + most else split).append(entry)
        if kept:
            self._push(front, free, kept, cost, block)
        if split:
            for step in steps:
                if step is not None:
                    self._push(front, step, split, cost, block)

    def _promises(self, a: int, b: int) -> list[frozenset[int]]:
        """Every promise worth trying for the storages escaping ``a..b``: only a storage that
        a later gradient-carrying stage reads or saves can be held by a segment."""
        if self.mode != "reentrant":
            return [frozenset()]
        found = self.promises.get((a, b))
        if found is None:
            found = self.promises[a, b] = self._all_promises(a, b)
        return found

    def _all_promises(self, a: int, b: int) -> list[frozenset[int]]:
        ll, carries = self.model.chain.long_lived, self.carries
        open_ = [i for i in self.model.escaping(a, b)
                 if any(s > b and carries[s] for s in (*ll[i].savers, *ll[i].readers))]
        if len(open_) > MAX_PROMISED:
            raise _GiveUp
        return [frozenset(chosen) for k in range(len(open_) + 1)
                for chosen in combinations(open_, k)]

    def _cost(self, a: int, b: int) -> int:
        """The score of segment ``a..b``."""
        cost = self.scores.get((a, b))
        if cost is None:
            cost = self.scores[a, b] = (segment_cost(self.model.chain, a, b, self.mode)
                                      * _PER_COST + 1)
        return cost


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """The entries no other entry matches or beats on held bytes, peak and recompute; of
    equal ones, the first."""
    entries.sort(key=lambda e: (e[0], e[1], e[2]))  # stable
    kept: list[_Entry] = []
    # The staircase of the kept entries' (peak, score): peaks ascending, scores descending,
    # each point one no kept entry beats on both. An entry is beaten by a kept one (whose held
    # bytes are no more, by the order) when the point of greatest peak not above its own has
    # a score not above its own.
    peaks: list[int] = []
    scores: list[int] = []
    for entry in entries:
        peak, score = entry[1], entry[2]
        i = bisect_right(peaks, peak)
        if i and scores[i - 1] <= score:
            continue
        kept.append(entry)
        start = i - 1 if i and peaks[i - 1] == peak else i
        end = i
        while end < len(peaks) and scores[end] >= score:
            end += 1
        peaks[start:end] = [peak]
        scores[start:end] = [score]
    return kept


def _pareto_cost(entries: list[_Entry]) -> list[_Entry]:
    """Under a budget, the entries no other entry matches or beats on held bytes and
    recompute: their peaks need only fit the budget, already checked; of equal ones, the one
    of least peak."""
    entries.sort(key=lambda e: (e[0], e[2], e[1]))
    kept: list[_Entry] = []
    least = None
    for entry in entries:
        if least is None or entry[2] < least:
            kept.append(entry)
            least = entry[2]
    return kept

