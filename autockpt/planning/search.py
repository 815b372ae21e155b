"""The single-level plan of least estimate, or of least recompute under a budget, exactly for a
plan's own estimate (:meth:`~autockpt.planning.memory_model.MemoryModel.plan_peak`).

Plain numbers only, like :mod:`autockpt.planning.optimal`, whose programme prices a plan at
:meth:`~autockpt.planning.memory_model.MemoryModel.peak`: an upper bound of the plan's estimate that
keeps the programme's state small. This search walks the plans the way ``plan_peak`` does,
so what it finds is least for the estimate autockpt prints and checks budgets against.

# NOTE [ An exact search under the plan's own estimate ]
``plan_peak`` is a walk over the stages that carries, besides the held bytes and the peak so
far, a :class:`~autockpt.planning.memory_model.WalkKey`: whether the last stage ended a segment, the
long-lived storages alive but held by nothing yet, and the passing storages a segment already
holds. Every later peak term is the held bytes plus a number that depends only on that key
and on the stages to come (every term of the model is ``held + constant``). So two walks
that reach a stage with the same key are compared on (held bytes, peak, recompute): one no
worse on all three can be completed by whatever completes the other, at no more memory and no
more recompute, and the other is dropped. What is left per key is a Pareto frontier, as in
:mod:`autockpt.planning.optimal`, and the search is a dynamic programme over ``(stage, key)``.

Two things make it exact rather than a heuristic:

* keys forget only what no later stage can see: a long-lived storage past its last reader, a
  passing storage past its last reader;
* in reentrant mode a segment's price depends on the future (whether each long-lived
  storage escaping it is next held by a segment or by a plain stage). The search carries a
  promise for each in the key, or leaves it to the holder (NOTE [ Promises decided by the
  holder ]); the stage that first holds the storage keeps or breaks a promise, and a broken
  promise ends that walk. The plan's own walk (``plan_peak``) makes the promises by looking
  ahead, so both walks price a plan the same.

# NOTE [ Promises that change no price ]
A promise changes one number of the segment that makes it: its own backward term, which counts
the storages kept (a promise about the future), and nothing else: the bytes it adds to the held
ones, the terms of later stages and what a later holder pays are the same under every promise;
only which later walks are plans differs (a broken promise ends the walk). So where an entry's
peak is the same under every promise (the segment's term with every storage kept is no
higher than the entry's peak and the segment's forward), the promises are not tried: the entry
goes on with the escaping storages unpromised, which every later holder may take, as a
storage made by a plain stage is. Its peak is that of each promise's walk, and its walks
are the union of theirs.

# NOTE [ Promises decided by the holder ]
Trying every promise multiplies the keys: each pending storage made by a segment is in two versions
of every key it is in. On diffusers' UNet2DModel (the skip-connection tests' inputs and loss,
reentrant, least memory: 7 long-lived storages, up to 7 escaping one segment) the search gave up
past 100,000 frontier entries, 1,422 keys at a stage. A segment with more than ``MAX_PROMISED``
storages to promise leaves them undecided instead: one key, in which they form a group
(``UNDECIDED + first stage``), and each entry carries a debt for the group: the segment's term with
none of them kept, plus the bytes of those a segment has held since. Keeping a storage only adds its
bytes to that term, so the entry's peak takes the debt in each time a segment holds one of the
group's storages, and a plain stage that holds one, or its death, leaves the debt as it is; the
walk's peak is then that of the promise its holders make. Two entries of a key are compared on their
debts too (a lower debt is no worse), and a debt that can no longer pass the entry's peak, even with
every storage of its group kept, is dropped and the group's storages unpromised
(NOTE [ Promises that change no price ]). A storage's promise alone stays tried in the key
(``MAX_PROMISED = 1``): there two keys prune better than one key with a debt per entry, and the
models below were planned fastest so. UNet2DModel's search now finishes, at 55,794 entries
(0.8-1.3 s here; with every promise left undecided, 32,992 entries, but our UNet's search five times
slower). On 150 random chains of 8 to 25 stages, both modes, least memory and budgets at 60% and 80%
of the baseline, every search that finished before gives the same estimate and recompute, and 47 of
the 900 that gave up now finish, with the answers the former search gives without its limits
(checked on the first 60 chains).

The number of keys grows with the pending storages crossing a stage, 2 to the number of them
in the worst case. An upper ``bound`` on the
answer keeps the frontiers small: with no budget, the estimate of the plan the local search
(``planner._descend``) found drops every walk whose peak passes it; under a budget, the
budget does, and the recompute of the programme's plan drops every walk that recomputes
more. The search gives up past ``MAX_KEYS`` keys or ``MAX_ENTRIES`` frontier entries
(about 1-2 s here), and the planner then keeps the plan it had. On every model the tests
plan (tests/models/corpus.py's and the skip-connection tests', with their inputs and losses;
both modes; least memory and budgets at 50% and 75% of the baseline) it finished, at most
61,416 entries (UNet2DModel, reentrant, 50%).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import product

from autockpt.planning.chain import Chain
from autockpt.planning.memory_model import (
    KEPT,
    NOT_KEPT,
    START,
    UNDECIDED,
    UNPROMISED,
    Keeps,
    MemoryModel,
    Ranges,
    Undecided,
    WalkKey,
    model_of,
)
from autockpt.planning.optimal import (  # the same linked list of chosen blocks
    RangePath,
    path_keeps,
    path_ranges,
)

__all__ = ["MAX_ENTRIES", "MAX_KEYS", "MAX_PROMISED", "search_kept", "search_plan"]

MAX_KEYS = 20_000
"""The most ``(stage, key)`` states a search visits before it gives up."""

MAX_ENTRIES = 100_000
"""The most frontier entries a search extends before it gives up."""

MAX_PROMISED = 1
"""The most storages escaping one reentrant segment whose promises are tried one by one (2 to
this many keys); the promises of more are left to their holders (NOTE [ Promises decided by
the holder ])."""

_Entry = tuple[int, int, int, "RangePath | None", tuple[tuple[int, int], ...]]
"""A frontier entry: ``(held bytes, peak, score, path, debts)``; the score is the recompute
cost times :data:`_PER_COST` plus the number of segments, so that of two plans that recompute
as much the one with fewer checkpoints (each has a cost of its own at run time) wins. The
debts, in reentrant mode, are ``(group, term)`` for each undecided group of the key: the
backward term of the segment that made the group's storages, as it stands with those held so
far kept (NOTE [ Promises decided by the holder ])."""

_PER_COST = 1 << 20
"""Segments a plan may have before its count would spill into its recompute cost."""


def search_plan(chain: Chain, mode: str, *, budget: int | None = None,
                bound: int | None = None) -> tuple[Ranges, int] | None:
    """The single-level plan of least estimated peak (then least recompute), or with
    ``budget`` the plan of least recompute whose estimate fits it (of equal ones, one of
    lower peak), and that estimate. ``bound``, an upper bound the caller knows from a plan it
    already has: no plan above this estimate is wanted, or with ``budget``, no plan that
    recomputes more than this. None where nothing fits, or where the search gave up
    (NOTE [ An exact search under the plan's own estimate ]). Every segment recomputes
    whole; :func:`search_kept` lets segments keep their matmuls.

    Example:
        >>> from autockpt.planning.chain import Chain, Cut, ForwardPeaks, Stage
        >>> stage = Stage(start=0, end=1, cost=1, flops=1, carries_grad=True, saved_bytes=64,
        ...               long_lived_bytes=0, long_lived_saved_bytes=0, output_bytes=8,
        ...               grad_entry_bytes=0, backward_peak_bytes=88,
        ...               forward=ForwardPeaks(72, 8, 72, 8, 72))
        >>> chain = Chain(stages=(stage,), cuts=(Cut(0, 0, 0, 0), Cut(0, 0, 0, 0)))
        >>> search_plan(chain, "non_reentrant")
        ((), 96)
    """
    found = search_kept(chain, mode, budget=budget, bound=bound, keep=False)
    return None if found is None else (found[0], found[2])


def search_kept(chain: Chain, mode: str, *, budget: int | None = None,
                bound: int | None = None, keep: bool = True
                ) -> tuple[Ranges, Keeps, int] | None:
    """:func:`search_plan` where a non-reentrant segment may keep its matmuls (NOTE
    [ Segments that keep their matmuls ] in :mod:`autockpt.planning.memory_model`): the
    ranges, the first stages of those that keep, and the estimate.

    Example:
        >>> from dataclasses import replace
        >>> from autockpt.planning.chain import Chain, Cut, ForwardPeaks, Stage
        >>> stage = Stage(start=0, end=1, cost=100, flops=90, carries_grad=True,
        ...               saved_bytes=64, long_lived_bytes=0, long_lived_saved_bytes=0,
        ...               output_bytes=0, grad_entry_bytes=0, backward_peak_bytes=88,
        ...               forward=ForwardPeaks(72, 8, 72, 8, 72))
        >>> last = replace(stage, start=1, end=2, output_bytes=8)
        >>> chain = Chain(stages=(replace(stage, kept_bytes=16, kept_cost=90), last),
        ...               cuts=(Cut(0, 0, 0, 0), Cut(32, 0, 0, 0), Cut(0, 0, 0, 0)))
        >>> search_plan(chain, "non_reentrant", budget=180)  # stage 0 recomputed whole
        (((0, 0),), 128)
        >>> search_kept(chain, "non_reentrant", budget=180)  # 16 B more, 90 of 100 spared
        (((0, 0),), frozenset({0}), 144)
        >>> from autockpt.planning.optimal import optimal_plan
        >>> optimal_plan(chain, 180)  # the programme, where the two prices agree
        (((0, 0),), frozenset({0}), 144)
    """
    try:
        found = _Search(model_of(chain, mode), mode, budget, bound, keep).run()
    except _GiveUp:
        return None
    if found is None:
        return None
    peak, _, path = found
    return path_ranges(path), path_keeps(path), peak


class _GiveUp(Exception):
    """The search would visit too many states to stay fast."""


class _Search:
    """One search: the frontiers by stage and key, and the bounds that prune them."""

    def __init__(self, model: MemoryModel, mode: str, budget: int | None,
                 bound: int | None, keep: bool = False) -> None:
        self.model = model
        self.mode = mode
        self.keeps = (False, True) if keep and model.keeps else (False,)
        """Whether a segment keeps its matmuls, the choices tried for each."""
        self.budget = budget
        self.limit = budget if budget is not None else bound
        """No walk whose peak passes this is kept."""
        self.cost_bound = (None if budget is None or bound is None
                           else bound * _PER_COST + _PER_COST - 1)
        """No walk whose score shows more recompute than ``bound`` is kept."""
        self.visited_entries = 0
        """Frontier entries extended so far, against :data:`MAX_ENTRIES`."""
        self.scores: dict[tuple[int, int, bool], int] = {}
        self.open: dict[tuple[int, int], tuple[int, ...]] = {}
        self.remaining: dict[WalkKey, dict[int, int]] = {}
        self.freed: dict[tuple[WalkKey, tuple[int, ...]], WalkKey] = {}
        self.promised: dict[tuple[WalkKey, int], list[tuple[WalkKey, int]]] = {}
        self.carries = [stage.carries_grad for stage in model.chain.stages]

    def run(self) -> tuple[int, int, RangePath | None] | None:
        model = self.model
        count = model.count
        carries = self.carries
        reentrant = self.mode == "reentrant"
        # fronts[t]: key -> entries, for the walks that reached stage t; keys in the order
        # first reached, so that the search is deterministic.
        fronts: list[dict[WalkKey, list[_Entry]]] = [{} for _ in range(count + 1)]
        fronts[0][START] = [(0, 0, 0, None, ())]
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
                least_spent = min(entry[2] for entry in entries)
                for b in range(t, count):
                    if not carries[b]:
                        break
                    if not reentrant:
                        for keep in self.keeps:
                            cost = self._cost(t, b, keep)
                            if keep and not model.keep_pays(t, b, cost, self._cost(t, b)):
                                continue
                            # A longer segment recomputes more, but in non-reentrant mode
                            # may cost less (its recompute stops earlier in its last stage).
                            if (self.cost_bound is not None
                                    and least_spent + cost > self.cost_bound):
                                continue
                            step = model.walk_segment(key, t, b, keep=keep)
                            if step is not None:
                                self._push(fronts[b + 1], step, entries, cost,
                                           (t, b, 1) if keep else (t, b))
                        continue
                    cost = self._cost(t, b)
                    if self.cost_bound is not None and least_spent + cost > self.cost_bound:
                        break
                    open_ = self._open(t, b)
                    undecided = model.walk_segment_undecided(key, t, b, open_)
                    if undecided is not None:
                        self._push_undecided(fronts[b + 1], undecided, entries, cost, (t, b),
                                             open_)
            fronts[t] = {}
        finals = [entry for entries in fronts[count].values() for entry in entries]
        if not finals:
            return None
        if self.budget is None:
            _, peak, score, path, _ = min(finals, key=lambda e: (e[1], e[2]))
        else:
            _, peak, score, path, _ = min(finals, key=lambda e: (e[2], e[1]))
        return peak, score, path

    def _push(self, front: dict[WalkKey, list[_Entry]], step: tuple[WalkKey, int, int],
              entries: list[_Entry], cost: int, block: tuple[int, ...] | None) -> None:
        key, grown, value = step
        limit, cost_bound = self.limit, self.cost_bound
        remaining = self._remaining(key) if entries[0][4] else {}
        out = []
        for held, peak, spent, path, debts in entries:  # by held bytes, ascending
            if limit is not None and held + value > limit:
                break  # the rest hold more
            if cost_bound is not None and spent + cost > cost_bound:
                continue
            entry = (held + grown, max(peak, held + value), spent + cost,
                     path if block is None else (block, path), debts)
            if debts:
                self._place(front, key, remaining, entry, debts)
            else:
                out.append(entry)
        if out:
            front.setdefault(key, []).extend(out)

    def _push_undecided(self, front: dict[WalkKey, list[_Entry]], step: Undecided,
                        entries: list[_Entry], cost: int, block: tuple[int, int],
                        open_: tuple[int, ...]) -> None:
        """:meth:`_push` for a reentrant segment, whose escaping storages' promises are left
        to their holders (NOTE [ Promises decided by the holder ])."""
        limit, cost_bound = self.limit, self.cost_bound
        resolved = dict(step.resolved)
        group = block[0] + UNDECIDED
        undecided = self._remaining(step.following)
        # The keys an entry goes on under depend on the step alone; they differ from
        # ``step.following`` in ``group`` alone, so its undecided bytes hold for them.
        free = self._freed(step.following, (group,))
        promises = (self._promises(step.following, group, open_)
                    if 0 < len(open_) <= MAX_PROMISED else [])
        for held, peak, spent, path, debts in entries:  # by held bytes, ascending
            if limit is not None and held + step.value > limit:
                break  # the rest hold more
            if cost_bound is not None and spent + cost > cost_bound:
                continue
            new_peak = max(peak, held + step.value)
            if resolved:
                # The storages of earlier groups this segment holds are kept by a segment:
                # their bytes join their group's term.
                raised = []
                for g, debt in debts:
                    debt += resolved.get(g, 0)
                    if debt > new_peak:
                        new_peak = debt
                    raised.append((g, debt))
                debts = tuple(raised)
            if limit is not None and new_peak > limit:
                continue
            entry = (held + step.grown, new_peak, spent + cost, (block, path), debts)
            if held + step.term + step.open_bytes <= new_peak:  # no promise matters
                self._place(front, free, undecided, entry, debts)
            elif promises:
                for promised, kept_bytes in promises:
                    peak = max(new_peak, held + step.term + kept_bytes)
                    if limit is None or peak <= limit:
                        self._place(front, promised, undecided, entry[:1] + (peak,) + entry[2:],
                                    debts)
            else:
                self._place(front, step.following, undecided, entry,
                            debts + ((group, held + step.term),))

    def _place(self, front: dict[WalkKey, list[_Entry]], key: WalkKey,
               remaining: dict[int, int], entry: _Entry, debts: tuple[tuple[int, int], ...]
               ) -> None:
        """Add ``entry`` with ``debts`` to ``front`` under ``key``: without the debts of groups
        that have left the key, and with the storages of a group whose debt can no longer
        raise the peak unpromised (NOTE [ Promises decided by the holder ])."""
        if debts:
            peak = entry[1]
            kept = []
            freed: list[int] = []
            for g, debt in debts:
                left = remaining.get(g)
                if left is None:
                    continue  # every storage of the group is held or dead
                if debt + left <= peak:
                    freed.append(g)
                else:
                    kept.append((g, debt))
            if freed:
                key = self._freed(key, tuple(freed))
            entry = entry[:4] + (tuple(kept),)
        found = front.get(key)
        if found is None:
            front[key] = [entry]
        else:
            found.append(entry)

    def _promises(self, key: WalkKey, group: int, open_: tuple[int, ...]
                  ) -> list[tuple[WalkKey, int]]:
        """Every promise for the storages of ``group`` in ``key`` (``open_``): the key with
        each kept or not, and the bytes kept."""
        found = self.promised.get((key, group))
        if found is None:
            sizes = self.model.chain.long_lived
            found = self.promised[key, group] = []
            for chosen in product((False, True), repeat=len(open_)):
                kept = {i for i, keep in zip(open_, chosen) if keep}
                promised = key._replace(pending=tuple(
                    (i, promise if promise != group else KEPT if i in kept else NOT_KEPT)
                    for i, promise in key.pending))
                found.append((promised, sum(sizes[i].size_bytes for i in kept)))
        return found

    def _remaining(self, key: WalkKey) -> dict[int, int]:
        """The bytes of each undecided group's storages pending in ``key``: the most its debt
        can still grow by."""
        found = self.remaining.get(key)
        if found is None:
            found = self.remaining[key] = {}
            sizes = self.model.chain.long_lived
            for i, promise in key.pending:
                if promise >= UNDECIDED:
                    found[promise] = found.get(promise, 0) + sizes[i].size_bytes
        return found

    def _freed(self, key: WalkKey, groups: tuple[int, ...]) -> WalkKey:
        """``key`` with the storages of ``groups`` unpromised."""
        found = self.freed.get((key, groups))
        if found is None:
            found = self.freed[key, groups] = key._replace(pending=tuple(sorted(
                (i, UNPROMISED if promise in groups else promise)
                for i, promise in key.pending)))
        return found

    def _open(self, a: int, b: int) -> tuple[int, ...]:
        """The storages escaping ``a..b`` whose promise is worth deciding: only a storage that
        a later gradient-carrying stage reads or saves can be held by a segment."""
        found = self.open.get((a, b))
        if found is None:
            ll, carries = self.model.chain.long_lived, self.carries
            found = self.open[a, b] = tuple(
                i for i in self.model.escaping(a, b)
                if any(s > b and carries[s] for s in (*ll[i].savers, *ll[i].readers)))
        return found

    def _cost(self, a: int, b: int, keep: bool = False) -> int:
        """The score of segment ``a..b`` (``keep``: keeping its matmuls)."""
        cost = self.scores.get((a, b, keep))
        if cost is None:
            cost = self.scores[a, b, keep] = (self.model.segment_cost(a, b, keep)
                                            * _PER_COST + 1)
        return cost


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """The entries no other entry matches or beats on held bytes, peak, recompute and every
    debt; of equal ones, the first."""
    entries.sort(key=lambda e: (e[0], e[1], e[2], e[4]))  # stable
    if entries[0][4]:
        return _pareto_debts(entries, lambda k, e: k[1] <= e[1] and k[2] <= e[2])
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
    """Under a budget, the entries no other entry matches or beats on held bytes, recompute
    and every debt: their peaks need only fit the budget, already checked; of equal ones, the
    one of least peak."""
    entries.sort(key=lambda e: (e[0], e[2], e[1], e[4]))
    if entries[0][4]:
        return _pareto_debts(entries, lambda k, e: k[2] <= e[2])
    kept: list[_Entry] = []
    least = None
    for entry in entries:
        if least is None or entry[2] < least:
            kept.append(entry)
            least = entry[2]
    return kept


def _pareto_debts(entries: list[_Entry], beats: Callable[[_Entry, _Entry], bool]
                  ) -> list[_Entry]:
    """The sorted ``entries`` that no earlier kept one ``beats`` with no debt above theirs
    (a key's entries have debts for the same groups, in the same order)."""
    kept: list[_Entry] = []
    for entry in entries:
        debts = entry[4]
        if not any(beats(k, entry) and all(x[1] <= y[1] for x, y in zip(k[4], debts))
                   for k in kept):
            kept.append(entry)
    return kept
