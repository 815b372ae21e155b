"""What a plan costs on a :class:`~autockpt.planning.chain.Chain`: its peak memory and its
recompute.

Plain numbers only. A plan is a :data:`Tree` of checkpointed stage ranges (single-level plans are
:data:`Ranges`, :func:`as_tree` turns them into a tree). :class:`MemoryModel` estimates the peak
activation bytes of one forward and backward with any plan, and gives the dynamic programmes above
it (:mod:`autockpt.planning.optimal`, :mod:`autockpt.planning.nested`) each block's numbers in
constant time; :func:`estimate_peak`, :func:`estimate_tree_peak` and :func:`recompute_cost` price a
whole plan.

# NOTE [ The memory model ]
Every activation storage is internal to a stage, crosses one cut, or is long-lived (NOTE
[ Internal, crossing and long-lived storages ] in :mod:`autockpt.planning.chain`). It is held for
backward:

* internal: iff its stage is not checkpointed and saves it;
* crossing from stage ``c-1`` to stage ``c``: iff ``c-1`` is not checkpointed and saves it,
  or ``c`` is not checkpointed and saves it, or ``c`` starts a checkpointed segment
  (checkpoint keeps its inputs for the recompute);
* long-lived: from its producer on, whatever the plan, unless one checkpointed segment holds
  its producer and every stage that reads or saves it (NOTE [ Long-lived storages inside a
  segment ]). This is conservative: a plan's own estimate counts it only where that plan
  holds it (NOTE [ Storages held by the plan ]).

Backward runs the stages in reverse and frees a held storage once the earliest stage holding it
is done, so while backward is in stage ``t`` the storages held by stages ``<= t`` are alive:
``H(t)``, which grows left to right. Not checkpointed, stage ``t`` peaks in backward at
``H(t)`` less its own internal saved storages, plus its ``backward_peak_bytes``: those
storages as its ops free them, the gradients alive and the working set of the op running
(NOTE [ Gradients in backward ] in :mod:`autockpt.planning.chain`). In a checkpointed segment
``[a, b]``, stage ``t`` runs its backward with ``H(b)`` and what the recompute saved for
stages ``a..t-1`` (a second copy of every storage they save; in reentrant mode also the
segment's outputs and their gradients), plus its ``backward_peak_bytes``; the recompute
itself peaks like a forward with the gradient entering ``b`` alive. In forward stage ``t``
peaks at what is held from earlier stages, the tensors crossing into it, and its own working
set (its :class:`~autockpt.planning.chain.ForwardPeaks`). The estimate is the largest of all these.
Because ``H`` only grows and every peak term depends on the choices before a cut only through
``H`` and whether the stage before the cut ends a checkpointed segment, a dynamic programme
over cuts with Pareto frontiers of ``(H, cost)`` is exact for this model
(:func:`autockpt.planning.optimal.optimal_ranges`).

# NOTE [ The nested memory model ]
A segment without inner segments is priced exactly as above. For one with inner segments the
first forward is the same (nothing inside is saved), and its backward is a walk over its
stages like a little model of its own, on top of what is held outside it (its inputs, what
earlier stages hold, the model's outputs) and the gradient entering its last stage: the
recompute saves what its plain stages save, and only their inputs for the inner segments;
then backward goes through the stages in reverse, an inner segment being priced recursively
on top of what the stages before it saved. Where the single-level model is exact about which
side of a cut saves a crossing tensor or how long a long-lived one lives, this walk takes the
larger count, so it over-estimates rather than under-estimates
(:meth:`MemoryModel.nested_backward`). Nested plans are priced in non-reentrant mode only
(NOTE [ Where nesting pays ] in :mod:`autockpt.planning.nested`).

# NOTE [ Segments that keep their matmuls ]
A non-reentrant segment may keep the outputs of its matrix products, convolutions and
attention kernels from its forward and recompute only the rest (NOTE [ Keep the expensive,
recompute the cheap ] in :mod:`autockpt.ops.kept`); a set of segment starts, ``keeps``, beside
the ranges says which do. Such a segment is priced as the same segment that keeps nothing,
with three changes. In its forward, stage ``t`` holds on top the kept outputs of stages
``a..t`` (all of ``t``'s own at its peak: an over-estimate inside the stage). After it the
held bytes grow by all of its kept outputs, alive until its own recompute: every later stage
and segment sees them. Its recompute and backward peak are the plain segment's: the
recompute returns the kept tensors instead of making them again, so they are counted once,
among the storages the recompute holds, and not among the held bytes. Its cost is the plain
segment's less the cost of the kept ops its recompute would have run (what an early stop
spares already, :attr:`~autockpt.planning.chain.Stage.tail_cost`, may be kept ops: it is not
spared twice), plus the chain's op cost for each op it runs, twice watched by torch's
selective checkpoint modes (NOTE [ What a segment costs beyond its FLOPs ] in
:mod:`autockpt.planning.overhead`). The stage numbers do not see kept outputs that an
early-stopped recompute never reaches, which stay in the cache until the segment's backward
ends; tests/test_keep_matmuls_models.py holds the estimate to within 1% of the measured peak
on a decoder. Reentrant segments take no selective policy: they keep nothing.

The choice is one of two policies per segment, made by the same programmes, in the same
objective, as the segments themselves, so it is exact for this model (tests compare it with
a brute force over every plan and every choice). It is not the full choice per op: a segment
never keeps some of its matmuls and recomputes others, nor keeps a cheap op's output (a
norm's) while recomputing its neighbours. Those would make the choice a knapsack inside each
segment, as torch.compile's memory budget solves it on its joint graph; two policies keep the
programme's state what it was and cover the trade the field uses by hand (torchtitan's
selective op policy, Megatron's selective recompute).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from operator import add
from typing import Any, NamedTuple

from autockpt.planning.chain import Chain, LongLived, SharedGradient

__all__ = ["Ranges", "Keeps", "NO_KEEPS", "Tree", "WalkKey", "START", "as_tree", "flatten_tree",
           "tree_depth", "MemoryModel", "estimate_peak", "estimate_tree_peak", "model_of",
           "segment_cost", "recompute_cost", "tree_cost"]

Ranges = tuple[tuple[int, int], ...]
"""Checkpointed segments as inclusive ``(first_stage, last_stage)`` pairs, sorted, disjoint."""

Keeps = frozenset[int]
"""The first stages of the checkpointed segments that keep their matmuls' outputs (NOTE
[ Segments that keep their matmuls ])."""

NO_KEEPS: Keeps = frozenset()
"""No segment keeps anything."""

Tree = tuple[tuple[int, int, "Tree"], ...]
"""Checkpointed stage ranges ``(first, last, inner)``, sorted and disjoint, where ``inner`` is
the tree of ranges checkpointed again inside ``first..last``."""


UNPROMISED, NOT_KEPT, KEPT = 0, 1, 2
"""What a walk promised about a pending long-lived storage: nothing (made by a plain stage, or
any storage in non-reentrant mode), that its first holder will be a plain stage, or that it
will be a checkpointed segment (reentrant mode, NOTE [ Storages held by the plan ])."""


class WalkKey(NamedTuple):
    """Where a walk of :meth:`MemoryModel.plan_peak` stands at a stage, all but its held bytes
    and peak: every later term is those held bytes plus a number that depends on this key and
    on the stages to come only."""

    follows_segment: bool
    """Whether the stage before ends a checkpointed segment."""
    pending: tuple[tuple[int, int], ...]
    """The long-lived storages alive in forward and held by nothing yet, as ``(index into
    chain.long_lived, promise)``, sorted."""
    held_passing: tuple[int, ...]
    """The passing storages (indices into ``chain.passing``) a segment already holds and a
    later stage still reads, sorted."""


START = WalkKey(False, (), ())
"""The key before the first stage."""

UNDECIDED = 3
"""A promise the search has not decided yet: ``UNDECIDED + a`` for the storages escaping the
segment that starts at stage ``a`` (NOTE [ Promises decided by the holder ] in
:mod:`autockpt.planning.search`)."""


class Undecided(NamedTuple):
    """A reentrant segment's step with its escaping storages' promises undecided
    (:meth:`MemoryModel.walk_segment_undecided`); bytes are on top of the held bytes before
    it, as a step's are."""

    following: WalkKey
    """The key after it, the escaping storages undecided."""
    grown: int
    """What it adds to the held bytes, whatever the promises."""
    value: int
    """Its peak with no escaping storage kept, the least of any promise."""
    term: int
    """Its own backward term with no escaping storage kept; each one kept adds its bytes."""
    open_bytes: int
    """The bytes of the undecided storages: the most that keeping them can add to ``term``."""
    resolved: tuple[tuple[int, int], ...]
    """``(group, bytes)``: the storages of earlier undecided groups it holds, kept by it."""


def as_tree(ranges: Ranges) -> Tree:
    """Single-level ranges as a tree."""
    return tuple((a, b, ()) for a, b in ranges)


def flatten_tree(tree: Tree) -> list[tuple[int, int, int]]:
    """Every range of ``tree`` as ``(first, last, depth)``, outer before inner (preorder)."""
    out: list[tuple[int, int, int]] = []

    def walk(nodes: Tree, depth: int) -> None:
        for a, b, inner in nodes:
            out.append((a, b, depth))
            walk(inner, depth + 1)

    walk(tree, 0)
    return out


def tree_depth(tree: Tree) -> int:
    """The deepest nesting: 0 for no range, 1 for single-level ranges."""
    return max((d + 1 for _, _, d in flatten_tree(tree)), default=0)


def _prefix(values: Sequence[int]) -> list[int]:
    """``out[t]``: the sum of ``values[:t]``."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


class MemoryModel:
    """The memory model of NOTE [ The memory model ] on one chain, in one checkpoint mode.

    It walks a plan stage by stage, carrying the bytes held for backward so far (``held``,
    the model's outputs not included): :meth:`plain_stage` prices a stage left alone,
    :meth:`segment_forward` and :meth:`segment` a checkpointed segment, :meth:`peak` a whole
    plan. Prefix sums and range maxima are computed once, so that each block's numbers cost
    O(1) for the dynamic programmes; every peak a method returns is ``held`` plus a number
    that does not depend on ``held``. ``follows_segment`` says whether the stage before the
    block ends a checkpointed segment (then what that stage saves of the tensors crossing
    into the block is not held yet).
    """

    def __init__(self, chain: Chain, mode: str) -> None:
        self.chain = chain
        """The chain priced."""
        self.count = len(chain.stages)
        """Its number of stages."""
        self.reentrant = mode == "reentrant"
        """Whether segments run in reentrant mode (its recompute runs a backward of its own)."""
        stages, cuts = chain.stages, chain.cuts
        self.model_output_bytes = sum(s.output_bytes for s in stages)
        """Bytes of the model's outputs, alive through the whole backward."""
        # Prefix sums, by stage (or by cut for ``_cut_saved``): the total before ``t``.
        self._saved = _prefix([s.saved_bytes for s in stages])
        # A recompute also saves clones of the buffers its nodes update and save (BatchNorm's
        # running statistics; not activations in a plain forward). The runner makes all of a
        # segment's clones when its recompute starts, and each is freed once its saver has
        # run backward (NOTE [ Recompute must not update buffers twice ] in
        # :mod:`autockpt.running.runner`).
        self._clones = _prefix([s.recompute_buffer_bytes for s in stages])
        # Crossing bytes saved inside a segment, by cut (recomputed when both sides are in).
        self._cut_saved = _prefix([cut.saved_bytes for cut in cuts])
        self._long_lived = _prefix([s.long_lived_bytes for s in stages])
        self._long_lived_saved = _prefix([s.long_lived_saved_bytes for s in stages])
        self._outputs = _prefix([s.output_bytes for s in stages])
        # NOTE [ Segments that keep their matmuls ]
        self._kept = _prefix([s.kept_bytes for s in stages])
        self._kept_cost = _prefix([s.kept_cost for s in stages])
        self._aten_ops = _prefix([s.aten_ops for s in stages])
        self.keeps = not self.reentrant and self._kept[-1] > 0
        """Whether a segment may keep its matmuls: non-reentrant, and some stage has some."""
        # NOTE [ Gradients in backward ]: inside a checkpointed segment that starts at ``a``,
        # stage ``t`` runs its backward with the segment's recomputed storages of stages
        # ``a..t-1`` still alive (each is freed when the op that saved it has run backward),
        # the crossing storages saved at cuts ``a+1..t`` and what ``t`` saves at ``t+1``.
        # Both that and the recompute of ``t`` are a count from the chain's start less
        # ``_segment_offset[a]``, so the largest over a segment is a range maximum.
        self._segment_offset = [self._saved[a] + self._cut_saved[a + 1]
                                + self._long_lived_saved[a] for a in range(self.count)]
        # In backward, the recomputed copy of a long-lived storage lives from its first saver
        # on (NOTE [ Long-lived storages inside a segment ]): those with a record are counted
        # by ``_copies``, the rest (the model's outputs) by producer.
        recorded = [0] * self.count
        for x in chain.long_lived:
            recorded[x.producer] += x.size_bytes
        by_producer = _prefix([max(0, s.long_lived_saved_bytes - recorded[t])
                               for t, s in enumerate(stages)])
        self._backward_offset = [self._saved[a] + self._clones[a] + self._cut_saved[a + 1]
                                 + by_producer[a] for a in range(self.count)]
        backward = [self._saved[t] + self._clones[t] + self._cut_saved[t + 1]
                    + cuts[t + 1].producer_saved_bytes + by_producer[t + 1]
                    + stages[t].backward_peak_bytes + stages[t].recompute_backward_extra_bytes
                    for t in range(self.count)]
        # Recomputing stage t: what stages a..t-1 saved, what crosses into t, t's sweep.
        recompute = [self._saved[t] + self._cut_saved[t] + cuts[t].producer_saved_bytes
                     + self._long_lived_saved[t] + stages[t].forward.plain_received_bytes
                     for t in range(self.count)]
        self._passing_in, self._passing_done, self._passing_before = _passing_tables(chain)
        # NOTE [ A reentrant segment copies its inputs' gradients ]
        self._grad_copies = _grad_copy_table(chain) if self.reentrant else []
        self._shared_cache: dict[tuple[int, int], list[int]] = {}
        # NOTE [ Gradients shared by a reentrant segment's inputs ], by the node's stage: a
        # segment looks only at its own stages' (and the next one's), not at all of them.
        self._shared_at: list[list[SharedGradient]] = [[] for _ in range(self.count + 1)]
        for g in chain.shared_gradients:
            self._shared_at[g.stage].append(g)
        # NOTE [ Sums a reentrant segment delays ], by reader stage: the passing and
        # long-lived storages (indices into ``_read_records``) each stage reads.
        self._read_records = (*chain.passing, *chain.long_lived)
        self._read_at: list[list[int]] = [[] for _ in range(self.count)]
        for i, x in enumerate(self._read_records):
            for r in x.readers:
                self._read_at[r].append(i)
        self._delayed_cache: dict[tuple[int, int], list[int]] = {}
        # NOTE [ Long-lived storages inside a segment ]
        self._inside = _made_from(chain, lambda x: x.reach)
        self._escaping_floor = _escaping_floor(self._inside, self._long_lived)
        self._passing_made = _prefix([s.passing_made_bytes for s in stages])
        self._backward = backward
        # As the first stage of a reentrant segment (NOTE [ A reentrant segment copies its
        # inputs' gradients ]): the inputs' gradient copies where they live, or all of the
        # tensors crossing into it on top where the chain does not say.
        self._backward_first = [
            backward[t] + cuts[t].crossing_bytes if s.first_backward_peak_bytes is None
            else backward[t] - s.backward_peak_bytes + s.first_backward_peak_bytes
            for t, s in enumerate(stages)]
        # The recomputed copies alive while backward runs stage ``a+k`` of a segment from
        # ``a``: those of the long-lived storages made in it and first saved by ``a+k``.
        self._copies = _made_from(chain, lambda x: x.first_saver)
        # The long-lived storages by producer, for ``plan_peak``.
        self._long_lived_index_at: list[list[int]] = [[] for _ in range(self.count)]
        for i, x in enumerate(chain.long_lived):
            self._long_lived_index_at[x.producer].append(i)
        self._escaping: dict[tuple[int, int], tuple[int, ...]] = {}
        self._read: dict[tuple[int, int], tuple[int, ...]] = {}
        self._touched: dict[tuple[int, int], frozenset[int]] = {}
        self._segment_static: dict[tuple[int, int, bool, bool], tuple[Any, ...]] = {}
        self._escaped_cache: dict[tuple[int, int, frozenset[int]],
                                  tuple[int, tuple[tuple[int, int], ...]]] = {}
        self._forward_cache: dict[tuple[int, int, bool, bool], list[int]] = {}
        self._segment_cache: dict[tuple[int, int, bool], tuple[int, int]] = {}
        self._backward_max = [list(accumulate((backward[a + k] + copies[k]
                                               for k in range(self.count - a)), max))
                              for a, copies in enumerate(self._copies)]
        # A recompute from ``a`` makes again the passing storages of stages ``a..t-1`` that
        # ``t`` or later stages read; those made before ``a`` are the segment's inputs.
        self._recompute_max = [
            list(accumulate((recompute[t] + stages[t].passing_bytes - before[t - a]
                             for t in range(a, self.count)), max))
            for a, before in enumerate(self._passing_before)]
        # Its last stage runs only up to where a non-reentrant recompute stops.
        self._recompute_last = [recompute[t] - stages[t].forward.plain_received_bytes
                                + stages[t].forward.stopped_received_bytes
                                + stages[t].passing_bytes
                                for t in range(self.count)]

    def plain_stage(self, t: int, follows_segment: bool, held: int) -> tuple[int, int]:
        """Stage ``t`` not checkpointed: its peak, and the held bytes after it."""
        forward, backward, after = self.plain_terms(t, follows_segment, held)
        return max(forward, backward), after

    def plain_terms(self, t: int, follows_segment: bool, held: int) -> tuple[int, int, int]:
        """Stage ``t`` not checkpointed: its forward peak, its backward peak and the held
        bytes after it."""
        stage, cut, next_cut = self.chain.stages[t], self.chain.cuts[t], self.chain.cuts[t + 1]
        # After a segment, what its last stage saves of the tensors crossing is held here.
        kept = cut.producer_saved_bytes if follows_segment else 0
        received = cut.saved_by_reader_bytes + kept
        after = (held + received + stage.saved_bytes + stage.long_lived_bytes
                 + next_cut.producer_saved_bytes)
        forward = (held + self._outputs[t] + stage.forward.plain_received_bytes + kept
                   + stage.passing_bytes)
        backward = (after - stage.saved_bytes + self.model_output_bytes
                    + stage.backward_peak_bytes)
        return forward, backward, after

    def segment_inputs(self, a: int, follows_segment: bool) -> int:
        """What a segment starting at ``a`` newly holds of the tensors crossing into it."""
        cut = self.chain.cuts[a]
        fresh = cut.saved_by_reader_bytes + cut.saved_by_neither_bytes
        return fresh + (cut.producer_saved_bytes if follows_segment else 0)

    def segment_forward(self, a: int, t: int, held: int, inputs: int, keep: bool = False
                        ) -> int:
        """Forward peak of stage ``t`` inside a segment that starts at ``a`` (``inputs``:
        :meth:`segment_inputs`); ``keep``: the segment keeps its matmuls."""
        stage = self.chain.stages[t]
        if keep:
            held += self._kept[t + 1] - self._kept[a]
        if t == a:
            return (held + self.chain.cuts[a].crossing_bytes + self._outputs[t]
                    + stage.forward.checkpointed_bytes + stage.passing_bytes)
        carried = (held + inputs + self._long_lived[t] - self._long_lived[a]
                   + self._passing_done[a][t - a])
        return (carried + self._outputs[t] + stage.forward.checkpointed_received_bytes
                + stage.passing_bytes)

    def segment(self, a: int, b: int, held: int, inputs: int, *, by_stage: bool = False
                ) -> tuple[int, int, int]:
        """Stages ``a..b`` checkpointed: the peak of its recompute and backward, the held
        bytes after it, and a lower bound of that peak that never decreases as ``b`` grows.

        ``inputs`` is what ``a`` newly holds of the tensors crossing into it
        (:meth:`segment_inputs`). ``by_stage`` (reentrant mode) prices the backward stage by
        stage without the gradients the frame already holds (NOTE [ Handed gradients the
        replay counts again ]): never above the price without it, and not a constant of the
        segment, so for one plan's walk only."""
        chain = self.chain
        # NOTE [ Long-lived storages inside a segment ]: those made in a..b and read only
        # there die in its forward; the others are held after it, and (non-reentrant) are
        # dead again by the time its own recompute and backward run. The lower bound counts
        # the fewest that escape any longer segment, so that it grows with ``b``.
        escaping_long_lived = (self._long_lived[b + 1] - self._long_lived[a]
                               - self._inside[a][b - a])
        after = held + inputs + escaping_long_lived + self._passing_in[a][b - a]
        floor = 0
        if self.reentrant:
            floor = self._escaping_floor[a][b - a] - escaping_long_lived
            held_now = after + self.model_output_bytes
        else:
            held_now = after - escaping_long_lived + self.model_output_bytes
        lower = held_now + floor + self._backward_max[a][b - a] - self._backward_offset[a]
        recompute = self._recompute_max[a][b - a]
        if not self.reentrant:
            recompute = max(self._recompute_max[a][b - a - 1] if b > a else 0,
                            self._recompute_last[b] - self._passing_before[a][b - a])
        recompute_peak = (held_now + chain.stages[b].grad_entry_bytes + recompute
                          - self._segment_offset[a] + self._clones[b + 1] - self._clones[a])
        if not self.reentrant:
            return max(lower, recompute_peak), after, lower
        # NOTE [ Reentrant backward ]: the recompute runs to the segment's outputs and a
        # backward of its own starts from them; until it returns, the recomputed outputs and
        # the gradients they were handed stay alive (held by its frame), one copy of each of
        # what escapes the segment. At the last stage the gradients crossing out of it are
        # among the stage's own (``backward``), so only the long-lived and passing ones are
        # extra; before it, all are. At the first stage the inputs' gradients are made while
        # all of that is still alive; the replay of NOTE [ Gradients in backward ] counts
        # them as it counts any gradient, and only the copies autograd makes of some of
        # them are extra (``_backward_first``: NOTE [ A reentrant segment copies its
        # inputs' gradients ]). Charging every input's gradient at every stage put 18 of
        # the 180 reentrant plans of benchmarks/estimate_accuracy.py more than 5% above the
        # measured peak; charging them whole on the first stage's peak, 10.
        cuts = chain.cuts
        inner = (escaping_long_lived + self._outputs[b + 1] - self._outputs[a]
                 + self._passing_made[b + 1] - self._passing_made[a])
        escaping = inner + cuts[b + 1].crossing_bytes
        base = held_now - self._backward_offset[a]
        # Even what the last stage saves of its outputs counts again: ``backward`` frees it
        # once its saver has run, the frame keeps it to the end. The gradients of the
        # passing values the last stage itself makes are among its own until their
        # producers have run backward, and the frame keeps them after that
        # (``frame_backward_peak_bytes``). Counting the long-lived ones the same way fell
        # 3.5% short on a random graph whose later reentrant segment reads one (its
        # gradient comes back as a copy, made where a checkpoint hands its inputs theirs).
        stage_b = chain.stages[b]
        handed = inner
        if stage_b.frame_backward_peak_bytes:
            handed += (stage_b.frame_backward_peak_bytes - stage_b.backward_peak_bytes
                       - stage_b.passing_made_bytes)
        shared = [x + y for x, y in zip(self._shared_copies(a, b), self._delayed_sums(a, b))]
        last = (base + (self._backward_first[b] if a == b else self._backward[b])
                + self._copies[a][b - a] + escaping + handed + self._grad_copies[a][b - a]
                + shared[b - a])
        first = self._backward_first[a] + self._copies[a][0]
        before = (base + 2 * escaping + max(self._backward_max[a][b - a - 1], first)
                  + self._grad_copies[a][b - a] + max(shared[:-1]) if b > a else 0)
        if by_stage:
            again = self._handed_again(a, b)
            twice = self._saved_outputs(a, b)
            last -= again[b - a] + twice[b - a]
            if b > a:
                held = self._handed_and_held(a, b)
                before = (base + 2 * escaping + self._grad_copies[a][b - a]
                          + max((self._backward_first if t == a else self._backward)[t]
                                + self._copies[a][t - a] - again[t - a] - twice[t - a]
                                + shared[t - a] - held[t - a] for t in range(a, b)))
        # The recompute makes the outputs crossing out of the last stage in that stage's
        # sweep, with their gradients among those entering it; the long-lived and passing
        # ones made earlier stay alive beside it.
        recompute_peak += inner
        return max(last, before, recompute_peak), after, lower + inner + floor

    def _handed_and_held(self, a: int, b: int) -> list[int]:
        """Per stage of ``a..b-1`` (reentrant), the bytes of the gradients handed to segment
        ``a..b`` for what its last stage makes and the next stage reads that the replay
        holds anyway while that stage runs backward: the next stage (an add, a
        concatenation) hands the same buffer, whole or as a slice, to a value made before
        ``a`` too, with no reader in ``a..b``, which holds it until its next reader or its
        producer has run backward (NOTE [ Gradients in backward ]). ``escaping`` counts it
        again. Only below the stage down to which that value holds it: random graph seed
        37's concatenation of a skip tensor that the segment's first stage reads put its
        plan 5.4% above its measured peak."""
        held = [0] * (b - a)
        for g in self._shared_at[b + 1]:
            to = min((to for p, _, to in g.sharers if p < a), default=b)
            handed = sum(size for p, size, _ in g.sharers if p == b)
            for t in range(max(a, to + 1), b):
                held[t - a] += handed
        return held

    def _saved_outputs(self, a: int, b: int) -> list[int]:
        """Per stage of ``a..b`` (reentrant), the bytes of the recomputed long-lived storages
        that leave the segment and that both ``_copies`` (saved in it) and ``escaping`` (kept
        by its frame) count while it runs backward: one buffer, counted twice. Counted so,
        a ReLU output that a later concatenation reads put the plan the exact search chose
        for random graph seed 18 (benchmarks/estimate_accuracy.py) 10% above its measured
        peak."""
        out = [0] * (b - a + 1)
        ll = self.chain.long_lived
        for i in self.escaping(a, b):
            for t in range(ll[i].first_saver, b + 1):
                out[t - a] += ll[i].size_bytes
        return out

    def _shared_copies(self, a: int, b: int) -> list[int]:
        """Per stage of ``a..b`` (reentrant), what NOTE [ Gradients shared by a reentrant
        segment's inputs ] adds to its backward peak."""
        out = self._shared_cache.get((a, b))
        if out is not None:
            return out
        out = [0] * (b - a + 1)
        for g in (g for t in range(a, b + 1) for g in self._shared_at[t]):
            inputs = sum(size for producer, size in g.inputs if producer < a)
            if not inputs:
                continue
            if g.output_reach > b:
                # Handed by the frame, which keeps it: every input copies it. At the last
                # stage ``_grad_copies`` counts those copies already.
                if g.stage == b:
                    continue
                held_to, beyond = a, inputs
            else:
                # Down to the producer of a value made inside that holds the gradient too,
                # all the copies are on top; below it, what they add beyond the gradient.
                # A value made in the node's own stage lets it go within the stage, most
                # often away from the stage's peak: not counted.
                held_to = min((p for p, _, _ in g.sharers if p >= a), default=g.stage)
                held_to = held_to if held_to < g.stage else g.stage + 1
                beyond = max(0, inputs - g.output_grad_bytes)
            for t in range(a, g.stage + 1):
                out[t - a] += inputs if t >= held_to else beyond
            if held_to > g.stage and g.running_bytes:
                # All of them are made while the node runs, beside the gradient they copy.
                own = g.running_bytes + inputs - self.chain.stages[g.stage].backward_peak_bytes
                out[g.stage - a] += max(0, own - beyond)
        self._shared_cache[a, b] = out
        return out

    def _delayed_sums(self, a: int, b: int) -> list[int]:
        """Per stage of ``a..b`` (reentrant), what NOTE [ Sums a reentrant segment delays ]
        adds to its backward peak."""
        out = self._delayed_cache.get((a, b))
        if out is not None:
            return out
        out = [0] * (b - a + 1)
        last_read: dict[int, int] = {}  # record -> its last reader in a..b
        for t in range(a, b + 1):
            for i in self._read_at[t]:
                x = self._read_records[i]
                if x.producer < a and x.readers[-1] > b:
                    last_read[i] = t
        # By stage: the most bytes its backward holds once the last of those readers in it
        # has run (its peak where the chain does not say), and their sizes.
        at_reader: dict[int, tuple[int, int]] = {}
        for i, r in last_read.items():
            x = self._read_records[i]
            for t in range(a, r):
                out[t - a] += x.size_bytes
            after = (x.after_read_bytes[x.readers.index(r)] if x.after_read_bytes
                     else self.chain.stages[r].backward_peak_bytes)
            known, sizes = at_reader.get(r, (0, 0))
            at_reader[r] = (max(known, after), sizes + x.size_bytes)
        for r, (after, sizes) in at_reader.items():
            out[r - a] += max(0, after + sizes - self.chain.stages[r].backward_peak_bytes)
        self._delayed_cache[a, b] = out
        return out

    def _handed_again(self, a: int, b: int) -> list[int]:
        """Per stage of ``a..b``, the bytes of NOTE [ Handed gradients the replay counts
        again ]."""
        again = [0] * (b - a + 1)
        for x in self.chain.passing:
            if not a <= x.producer < b or x.readers[-1] <= b:
                continue
            outside = [r for r in x.readers if r > b]
            if len(outside) == 1 and outside[0] in x.view_readers:
                continue  # handed as a view of a gradient the replay already counts
            inner = [r for r in x.readers if r <= b]
            for t in range(inner[-1] if inner else x.producer + 1, b + 1):
                again[t - a] += x.size_bytes
        return again

    def segments_from(self, a: int, follows_segment: bool, keep: bool = False
                      ) -> Iterator[tuple[int, int, int, int, int, bool]]:
        """Every segment starting at ``a``, shortest first, as long as its stages carry
        gradient, priced on nothing held: ``(last stage, recompute cost, peak, held bytes
        after it, lower bound of the peak, whether it keeps its matmuls)``; the peaks include
        the segment's forward and are ``held +`` these for any ``held``. ``keep``: each
        segment that may keep its matmuls comes a second time, keeping them, right after
        the same segment recomputed whole (NOTE [ Segments that keep their matmuls ]). The
        lower bound never decreases along the way, for either kind, and never is below the
        whole segment's for the one that keeps."""
        stages = self.chain.stages
        inputs = self.segment_inputs(a, follows_segment)
        forward = kept_forward = total = 0
        kept = self._kept
        for b in range(a, self.count):
            if not stages[b].carries_grad:
                return
            at_b = self.segment_forward(a, b, 0, inputs)
            forward = max(forward, at_b)
            total += stages[b].cost
            value, after, lower = self.segment(a, b, 0, inputs)
            cost = self.segment_cost(a, b, False, total)
            yield b, cost, max(value, forward), after, max(lower, forward), False
            if keep:
                kept_forward = max(kept_forward, at_b + kept[b + 1] - kept[a])
                kept_cost = self.segment_cost(a, b, True, total)
                if self.keep_pays(a, b, kept_cost, cost):
                    yield (b, kept_cost, max(value, kept_forward), after + kept[b + 1] - kept[a],
                           max(lower, kept_forward), True)

    def keep_pays(self, a: int, b: int, kept_cost: int, whole_cost: int) -> bool:
        """Whether ``a..b`` keeping its matmuls at ``kept_cost`` may beat it recomputing
        whole at ``whole_cost``: it keeps something, for less. Otherwise it holds more for as
        much or more, and no plan needs it."""
        return self._kept[b + 1] > self._kept[a] and kept_cost < whole_cost

    def segment_cost(self, a: int, b: int, keep: bool = False, total: int | None = None
                     ) -> int:
        """What recomputing ``a..b`` costs (``total``: its stages' costs, where known);
        ``keep``: it keeps its matmuls (NOTE [ Segments that keep their matmuls ])."""
        cost, spared = _whole_cost(self.chain, a, b, self.reentrant, total)
        if keep:
            kept = self._kept_cost[b + 1] - self._kept_cost[a]
            cost += (self.chain.op_cost * (self._aten_ops[b + 1] - self._aten_ops[a])
                     - max(0, kept - spared))
        return cost

    def peak(self, tree: Tree, keeps: Keeps = NO_KEEPS) -> int:
        """The estimated peak with ``tree`` checkpointed; a range with inner ranges is priced
        by :meth:`nested_backward` (NOTE [ The nested memory model ]); the single-level
        segments that start in ``keeps`` keep their matmuls."""
        starts = {a: (b, inner) for a, b, inner in tree}
        peak = held = 0
        follows_segment = False
        t = 0
        while t < self.count:
            if t in starts:
                b, inner = starts[t]
                inputs = self.segment_inputs(t, follows_segment)
                keep = t in keeps and not inner
                for u in range(t, b + 1):
                    peak = max(peak, self.segment_forward(t, u, held, inputs, keep))
                value, held, _ = self.segment(t, b, held, inputs)
                if keep:
                    held += self._kept[b + 1] - self._kept[t]
                if inner:
                    value = self.nested_backward(t, b, inner, held + self.model_output_bytes)
                follows_segment, t = True, b + 1
            else:
                value, held = self.plain_stage(t, follows_segment, held)
                follows_segment, t = False, t + 1
            peak = max(peak, value)
        return peak

    def plan_peak(self, ranges: Ranges, keeps: Keeps = NO_KEEPS) -> int:
        """The estimated peak with the single-level ``ranges`` checkpointed, each long-lived
        and passing storage counted only while this plan holds it: never above
        :meth:`peak`, the price the dynamic programmes use (NOTE [ Storages held by the
        plan ]). A fold of :meth:`walk_plain` and :meth:`walk_segment`."""
        starts = dict(ranges)
        key: WalkKey | None = START
        peak = held = 0
        t = 0
        while t < self.count:
            assert key is not None  # the plan's own lookahead keeps every promise
            b = starts.get(t)
            if b is None:
                key, grown, value = self.walk_plain(key, t)  # type: ignore[misc]
                t += 1
            else:
                kept = frozenset(i for i in self.escaping(t, b)
                                 if _kept_by_a_segment(self.chain.long_lived[i], b, starts))
                key, grown, value = self.walk_segment(  # type: ignore[misc]
                    key, t, b, kept, keep=t in keeps)
                t = b + 1
            peak = max(peak, held + value)
            held += grown
        return peak

    def escaping(self, a: int, b: int) -> tuple[int, ...]:
        """The long-lived storages (indices into ``chain.long_lived``) made in ``a..b`` and
        read or saved after ``b``."""
        out = self._escaping.get((a, b))
        if out is None:
            out = self._escaping[a, b] = tuple(
                i for t in range(a, b + 1) for i in self._long_lived_index_at[t]
                if self.chain.long_lived[i].reach > b)
        return out

    def walk_plain(self, key: WalkKey, t: int) -> tuple[WalkKey, int, int] | None:
        """Stage ``t`` left plain, after a walk that reached it in ``key``: the key after it,
        what it adds to the held bytes, and its peak, both on top of the held bytes before
        it. None where ``key`` promised that a segment keeps a storage this stage saves
        first (NOTE [ Storages held by the plan ])."""
        ll = self.chain.long_lived
        taken = rest = ()
        taken_bytes = 0
        if key.pending:
            taken_list, rest_list = [], []
            for entry in key.pending:
                (taken_list if t in ll[entry[0]].savers else rest_list).append(entry)
            if any(promise == KEPT for _, promise in taken_list):
                return None
            taken, rest = tuple(taken_list), tuple(rest_list)
            taken_bytes = sum(ll[i].size_bytes for i, _ in taken)
        forward, backward, after = self.plain_terms(t, key.follows_segment, taken_bytes)
        later = [i for i in self._long_lived_index_at[t] if t not in ll[i].savers]
        later_bytes = sum(ll[i].size_bytes for i in later)
        forward += (sum(ll[i].size_bytes for i, _ in rest if ll[i].producer < t <= ll[i].reach)
                    - _passing_alive(self.chain, key.held_passing, t))
        value = max(forward, backward - later_bytes)
        following = self._normalized(False, rest + tuple((i, UNPROMISED) for i in later),
                                     key.held_passing, t + 1)
        if following is None:
            return None
        return following, after - later_bytes, value

    def walk_segment(self, key: WalkKey, a: int, b: int, kept: frozenset[int] = frozenset(),
                     *, keep: bool = False) -> tuple[WalkKey, int, int] | None:
        """Stages ``a..b`` checkpointed, as :meth:`walk_plain`. ``kept`` (reentrant mode): the
        storages of :meth:`escaping` whose first holder after ``b`` is a checkpointed segment
        that reads them, a promise the key carries until a holder keeps or breaks it. None
        where ``key`` promised the opposite for a storage the segment reads. ``keep``: the
        segment keeps its matmuls (NOTE [ Segments that keep their matmuls ])."""
        static = self._static(a, b, key.follows_segment, keep)
        common = self._segment_walk(key, a, b, static)
        if common is None:
            return None
        rest, held, again, value, held_passing, _ = common
        escaping, escaping_bytes, total0, after0 = static[4:]
        dead, made = self._escaped(a, b, escaping, kept)
        base = held - again - dead  # ``segment`` is this plus its price on nothing held
        following = self._normalized(True, rest + made, held_passing, b + 1)
        if following is None:
            return None
        return following, base + after0 + dead - escaping_bytes, max(value, base + total0)

    def walk_segment_undecided(self, key: WalkKey, a: int, b: int, open_: tuple[int, ...]
                               ) -> Undecided | None:
        """:meth:`walk_segment` in reentrant mode with the promises of the escaping storages
        ``open_`` left undecided, for the search (NOTE [ Promises decided by the holder ] in
        :mod:`autockpt.planning.search`). None where ``key`` promised a storage the segment reads
        to a plain stage."""
        static = self._static(a, b, key.follows_segment)
        common = self._segment_walk(key, a, b, static)
        if common is None:
            return None
        rest, held, again, value, held_passing, resolved = common
        escaping, escaping_bytes, total0, after0 = static[4:]
        group = UNDECIDED + a
        # The segment's own term with nothing kept; each storage a later segment keeps adds
        # its bytes to it.
        term = held - again - escaping_bytes + total0
        undecided = tuple((i, group if i in open_ else NOT_KEPT) for i in escaping)
        following = self._normalized(True, rest + undecided, held_passing, b + 1)
        if following is None:
            return None
        return Undecided(following, held - again + after0 - escaping_bytes, max(value, term),
                         term, sum(self.chain.long_lived[i].size_bytes for i in open_),
                         resolved)

    def _segment_walk(self, key: WalkKey, a: int, b: int, static: tuple[Any, ...]
                      ) -> tuple[tuple[tuple[int, int], ...], int, int, int, tuple[int, ...],
                                 tuple[tuple[int, int], ...]] | None:
        """What every promise of segment ``a..b`` walked from ``key`` shares: the pending
        storages it does not touch, the bytes of those it holds, of the passing ones it holds
        again, its forward term, the passing storages held after it, and by undecided group
        the bytes it keeps of that group's storages. None where ``key`` promised a storage it
        reads to a plain stage."""
        chain, ll = self.chain, self.chain.long_lived
        touched, read, forward, top0 = static[:4]
        taken_list, rest_list = [], []
        for entry in key.pending:
            (taken_list if entry[0] in touched else rest_list).append(entry)
        resolved: dict[int, int] = {}
        for i, promise in taken_list:
            if promise == NOT_KEPT:
                return None
            if promise >= UNDECIDED:
                resolved[promise] = resolved.get(promise, 0) + ll[i].size_bytes
        rest = tuple(rest_list)
        held = sum(ll[i].size_bytes for i, _ in taken_list)
        held_passing = key.held_passing
        again = sum(chain.passing[i].size_bytes for i in read if i in held_passing)
        seen = _passing_alive(chain, held_passing, a)
        if rest:
            # What the pending storages add to each stage's forward peak: each is alive on
            # the stages after its producer up to its reach, a range of this segment's stages
            # (summed by differences, in one pass whatever the number of storages).
            added = [0] * (b - a + 2)
            for i, _ in rest:
                x = ll[i]
                first, last = max(x.producer + 1, a), min(x.reach, b)
                if first <= last:
                    added[first - a] += x.size_bytes
                    added[last - a + 1] -= x.size_bytes
            value = held - seen + max(map(add, forward, accumulate(added)))
        else:
            value = held - seen + top0
        held_passing = held_passing + tuple(i for i in read if i not in held_passing)
        return rest, held, again, value, held_passing, tuple(sorted(resolved.items()))

    def _static(self, a: int, b: int, follows: bool, keep: bool = False) -> tuple[Any, ...]:
        """What a walk of segment ``a..b`` needs whatever the key: the storages it touches,
        the passing ones it reads, its forward peaks on nothing held and their greatest, the
        storages escaping it and their bytes, and its peak and held bytes after it on nothing
        held."""
        out = self._segment_static.get((a, b, follows, keep))
        if out is None:
            forward = self._forward0(a, b, follows, keep)
            escaping = self.escaping(a, b)
            total0, after0 = self._segment0(a, b, follows, self.segment_inputs(a, follows))
            if keep:
                after0 += self._kept[b + 1] - self._kept[a]
            out = self._segment_static[a, b, follows, keep] = (
                self._touched_by(a, b), self._passing_read(a, b), forward, max(forward),
                escaping, sum(self.chain.long_lived[i].size_bytes for i in escaping),
                total0, after0)
        return out

    def _escaped(self, a: int, b: int, escaping: tuple[int, ...], kept: frozenset[int]
                 ) -> tuple[int, tuple[tuple[int, int], ...]]:
        """For the storages escaping ``a..b`` under the promise ``kept``: the bytes of those
        no later segment keeps, and their pending entries with their promises."""
        out = self._escaped_cache.get((a, b, kept))
        if out is None:
            ll = self.chain.long_lived
            # In reentrant mode ``segment`` counts the originals of the escaping storages as
            # alive while the segment runs backward; only a later segment that keeps one as
            # its input keeps it alive so long (NOTE [ Storages held by the plan ]).
            if self.reentrant:
                out = (sum(ll[i].size_bytes for i in escaping if i not in kept),
                       tuple((i, KEPT if i in kept else NOT_KEPT) for i in escaping))
            else:
                out = (0, tuple((i, UNPROMISED) for i in escaping))
            self._escaped_cache[a, b, kept] = out
        return out

    def _touched_by(self, a: int, b: int) -> frozenset[int]:
        """The long-lived storages (indices) a stage of ``a..b`` after their producer reads
        or saves."""
        out = self._touched.get((a, b))
        if out is None:
            out = self._touched[a, b] = frozenset(
                i for i, x in enumerate(self.chain.long_lived) if _touches(x, a, b))
        return out

    def _forward0(self, a: int, b: int, follows: bool, keep: bool = False) -> list[int]:
        """The forward peaks of stages ``a..b`` of a segment, on nothing held."""
        out = self._forward_cache.get((a, b, follows, keep))
        if out is None:
            inputs = self.segment_inputs(a, follows)
            out = self._forward_cache[a, b, follows, keep] = [
                self.segment_forward(a, u, 0, inputs, keep) for u in range(a, b + 1)]
        return out

    def _segment0(self, a: int, b: int, follows: bool, inputs: int) -> tuple[int, int]:
        """:meth:`segment`'s peak and held bytes after it, on nothing held, as a walk prices
        it (by stage in reentrant mode)."""
        out = self._segment_cache.get((a, b, follows))
        if out is None:
            total, after, _ = self.segment(a, b, 0, inputs, by_stage=self.reentrant)
            out = self._segment_cache[a, b, follows] = (total, after)
        return out

    def _passing_read(self, a: int, b: int) -> tuple[int, ...]:
        """The passing storages (indices) made before ``a`` and read in ``a..b``."""
        out = self._read.get((a, b))
        if out is None:
            out = self._read[a, b] = tuple(
                i for i, x in enumerate(self.chain.passing)
                if x.producer < a and any(a <= r <= b for r in x.readers))
        return out

    def _normalized(self, follows_segment: bool, pending: tuple[tuple[int, int], ...],
                    held_passing: tuple[int, ...], t: int) -> WalkKey | None:
        """The key at stage ``t``: only what a later stage can still see, in a canonical
        order, so that walks that differ only in what is over compare equal. None where a
        storage dies promised to a segment that never came."""
        ll, passing = self.chain.long_lived, self.chain.passing
        alive = []
        for entry in pending:
            if ll[entry[0]].reach >= t:
                alive.append(entry)
            elif entry[1] == KEPT:
                return None
        return WalkKey(follows_segment, tuple(sorted(alive)),
                       tuple(sorted(i for i in held_passing if passing[i].readers[-1] >= t)))

    def nested_backward(self, a: int, b: int, inner: Tree, outside: int) -> int:
        """Peak of the recompute and backward of segment ``a..b`` with ``inner`` checkpointed
        again, on top of ``outside`` bytes (everything held when its backward starts)."""
        stages, cuts = self.chain.stages, self.chain.cuts
        grad = stages[b].grad_entry_bytes
        starts = {x: (y, tree) for x, y, tree in inner}

        def remade(t: int) -> int:
            """Passing storages the recompute made again that stage ``t`` still needs."""
            return stages[t].passing_bytes - self._passing_before[a][t - a]

        peak = 0
        saved = 0  # what the recompute has saved so far
        # The segment's inputs are held as checkpoint inputs, not saved again.
        follows_segment = True
        # (first, last, inner, saved before it, inputs; -1 for a plain stage)
        steps: list[tuple[int, int, Tree, int, int]] = []
        t = a
        while t <= b:
            stage, cut = stages[t], cuts[t]
            if t in starts:
                d, tree = starts[t]
                inputs = 0 if t == a else self.segment_inputs(t, follows_segment)
                for u in range(t, d + 1):
                    # As in ``segment_forward``: at its first stage the inputs are what
                    # crosses into it, counted once.
                    if u == t:
                        carried = cuts[u].crossing_bytes + stages[u].forward.checkpointed_bytes
                    else:
                        carried = (inputs + self._long_lived[u] - self._long_lived[t]
                                   + stages[u].forward.checkpointed_received_bytes)
                    peak = max(peak, outside + grad + saved + carried + remade(u))
                steps.append((t, d, tree, saved, inputs))
                saved += inputs + self._long_lived_saved[d + 1] - self._long_lived_saved[t]
                follows_segment, t = True, d + 1
            else:
                kept = cut.producer_saved_bytes if follows_segment else 0
                received = 0 if t == a else cut.saved_by_reader_bytes + kept
                if t == a:  # what crosses into it is held as the segment's inputs
                    working = stage.forward.plain_bytes
                else:
                    working = kept + (stage.forward.stopped_received_bytes if t == b
                                      else stage.forward.plain_received_bytes)
                peak = max(peak, outside + grad + saved + working + remade(t)
                           + stage.recompute_buffer_bytes)
                steps.append((t, t, (), saved, -1))
                saved += (received + stage.saved_bytes + stage.recompute_buffer_bytes
                          + stage.long_lived_saved_bytes + cuts[t + 1].producer_saved_bytes)
                follows_segment, t = False, t + 1
        # Backward, last stage first: only what the steps before the current one saved is alive.
        ends = [s[3] for s in steps[1:]] + [saved]
        for (x, y, tree, saved_before, inputs), saved_after in zip(steps, ends):
            if inputs < 0:  # a plain stage
                value = (outside + saved_after - stages[x].saved_bytes
                         + stages[x].backward_peak_bytes)  # its buffer clones still alive
            else:
                held = outside - self.model_output_bytes + saved_before
                value, after, _ = self.segment(x, y, held, inputs)
                if tree:
                    value = max(value, self.nested_backward(x, y, tree,
                                                            after + self.model_output_bytes))
            peak = max(peak, value)
        return peak


def _passing_tables(chain: Chain) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Per segment start ``a`` and offset ``k``, in bytes, of the passing storages made before
    stage ``a``: those read by stages ``a..a+k`` (held by a segment ``a..a+k``), those whose
    last reader lies in ``a..a+k-1`` (held by it once they are dead in forward), and those
    still alive at stage ``a+k``. See NOTE [ Passing storages ]."""
    count = len(chain.stages)
    reads = [[0] * (count - a + 1) for a in range(count)]
    done = [[0] * (count - a + 1) for a in range(count)]
    before = [[0] * (count - a + 1) for a in range(count)]
    for x in chain.passing:
        last = x.readers[-1]
        k = 0
        for a in range(x.producer + 1, last + 1):
            while x.readers[k] < a:
                k += 1
            reads[a][x.readers[k] - a] += x.size_bytes
            done[a][last + 1 - a] += x.size_bytes
            before[a][0] += x.size_bytes
            before[a][last + 1 - a] -= x.size_bytes
    for table in (reads, done, before):
        for row in table:
            running = 0
            for k in range(len(row)):
                running += row[k]
                row[k] = running
    return reads, done, before


# NOTE [ Handed gradients the replay counts again ]
# A passing tensor made inside a reentrant segment and read after it leaves the segment as
# one of its outputs: its gradient, summed by the readers outside, is handed to the
# checkpoint and kept by its frame to the end of the segment's backward (``escaping``). The
# replay of NOTE [ Gradients in backward ] counts the same gradient again, as waiting for its
# producer, in every stage's backward between its producer and its last reader. Inside the
# segment that second count is the frame's buffer until the last reader inside the segment
# adds its own part: autograd adds it out of place (the frame still holds the handed one),
# and from there down to the producer the sum is a buffer of its own, which the replay's
# count stands for. So from that reader up to the segment's last stage (from the producer's
# next stage where no reader inside is left) the replay's count is one too many. The terms
# are per stage, not constants of the segment, so the dynamic programme keeps the
# conservative price and a plan's own walk (``plan_peak``) takes them off. On random graph
# seed 20 the one segment was estimated 305,156 B and peaked at 272,396 B; 272,388 B now.
# Not so where a single reader outside hands the gradient as a view (a concatenation's
# slice): the handed gradient is then no buffer of its own, the base it views is what the
# replay counts, and nothing is counted twice. Taking it off there put the plan the exact
# search chose for random graph seed 48 (reentrant) 6.1% below its measured peak
# (tests/test_estimate.py); the local search's plans did not meet the case.

# NOTE [ A reentrant segment copies its inputs' gradients ]
# A reentrant checkpoint runs its backward on detached copies of its inputs, leaves whose
# gradients autograd accumulates into ``.grad`` (AccumulateGrad) and hands back only when the
# whole inner backward returns. The first gradient to reach a leaf becomes its ``.grad``
# as it is when it is new storage that nothing else holds; a slice of a concatenation's
# gradient, or an add's gradient shared with its other operand, is copied (torch's layout
# contract for ``.grad``). Where that gradient is a view of one the plain model already
# counts alive (the replay of NOTE [ Gradients in backward ] keeps the base of a view to
# its producer's backward), the copy replaces it, and nothing is missed. Not so at the
# segment's last stage when the node is one whose output leaves the segment: its gradient
# is the one the checkpoint was handed, which the frame keeps (``escaping``), so the copy
# comes on top, from the last stage's backward to the end of the segment's. A UNet's
# decoder concatenation of a skip tensor at the end of a segment is such a node:
# diffusers' UNet2DModel's reentrant least-memory plan measured 3.3% (256 KiB, the skip's
# size) above its estimate. Counting every reader's copy instead (inside the segment too)
# counted DenseNet's concatenations twice, its reentrant least plan 11.7% above its
# measured peak.
#
# The tensors crossing into the segment's first stage are its inputs in the same way. The
# stage's backward walk (``Stage.first_backward_peak_bytes``, autockpt/planning/chain.py) adds the
# copy of each whose only reader in the stage hands it its own output's gradient, from that
# reader's backward to the end of the stage; a gradient made as new storage becomes the
# ``.grad`` as it is and is already in the walk, and so does the sum of two readers' parts
# (counting a copy there put random graph seed 12's plan 6.1% above its measured peak).
# Counting all of them on top of the stage's backward peak instead, which falls mid-stage
# before most of them exist, put random graph seed 8's least-memory plan 5.5% above its
# measured peak (tests/test_estimate.py).


# NOTE [ Gradients shared by a reentrant segment's inputs ]
# A node that hands its output's gradient on unchanged (an add) to two of a reentrant
# segment's inputs hands both leaves the same tensor: AccumulateGrad runs as soon as it is
# ready, before anything else, and copies the gradient into the first leaf's ``.grad`` while
# the other still holds it; the last takes it as it is. The replay of NOTE [ Gradients in
# backward ] counts the one buffer, so every input but one is a copy on top, alive from that
# node's backward to the end of the segment's (the checkpoint hands them back only then).
# Slices of a concatenation's gradient are all copied, but their base is no longer needed
# once they are, and it is at least as large: what the replay counts of it covers them. So a
# node's copies are what its inputs' sizes add up to beyond its output's gradient, counted
# from its stage down to the segment's first (the whole of its own stage, an upper bound).
# An add of two skip tensors in a segment's middle stage put the plans the exact search chose
# for random graphs 51 and 40 (benchmarks/estimate_accuracy.py) 5.2% and 4.3% below their
# measured peaks: each peaked on the copy the add made (tests/test_estimate.py).
#
# While a value made inside the segment still holds that gradient (an add's other operand, a
# slice of a concatenation), the base is alive beside the copies, so they are all on top,
# down to that value's producer: seed 44's plan from the local search peaked 2.5% above its
# estimate in a concatenation's backward that had copied two slices for inputs while the
# third was still read inside. Where that value is made in the node's own stage, the base
# goes within the stage, most often away from its peak, and is not counted: counting it put
# seed 8's least plan 5.5% above its measured peak. Where no value made inside holds it, the
# copies are still all made while the node runs backward, before the base it slices goes:
# on top of what its stage holds at that node (``SharedGradient.running_bytes``), not of the
# stage's peak, which may fall elsewhere. Counting only what they add beyond the base put
# random graph seed 92's plan 7.1% below its measured peak, at the third copy of a
# concatenation's slices. Where the node's output leaves the segment its gradient is the
# frame's, and every input copies it (NOTE [ A reentrant segment copies its inputs'
# gradients ]). An input of the model that requires grad is a leaf of the segment as much as
# a skip tensor: random graph seed 43's add of the model's input in a segment's middle stage
# measured 7% above its estimate, the copy short.


# NOTE [ Sums a reentrant segment delays ]
# A passing or long-lived storage made before a reentrant segment, read inside it and again
# after it, gets a partial gradient from the reader after it first. In the plain model the
# reader inside adds its part to that one as it runs backward (out of place, both parts
# freed: the replay of NOTE [ Gradients in backward ] counts one buffer from there on). Inside
# the segment the storage is a leaf: its part becomes the leaf's ``.grad`` and reaches the
# outer backward only when the segment's returns, so both are alive from the last reader
# inside (the first to run backward) down to the segment's first stage. At that reader's
# stage only what its backward holds once the reader has run counts
# (``Passing.after_read_bytes``): its peak may come before. Random graph seed 69's one
# segment multiplies such a storage by a sigmoid and measured 12% above its estimate
# (benchmarks/estimate_accuracy.py, seeds 60 on); counting the part on the whole stage
# instead put seed 8's plan 6% above its measured peak.


# NOTE [ What the reentrant estimate still gets wrong ]
# On the random graphs drawn after the last correction (seeds 160-259 of
# benchmarks/estimate_accuracy.py; benchmarks/RESULTS.md, "Graphs the model was not fitted
# to"), 9 of 300 reentrant plans measure above their estimates, 3 (one graph) by more than
# 5%; seeds 60-159 still have 16. Traced, each is a node-level event that a price by stage
# sees only on average, and fixing one by stage has so far uncovered another that the old
# error was hiding:
# - The frame keeps the gradient it was handed for what leaves the segment until the whole
#   inner backward returns; the replay frees it once the node that made that output has run
#   backward. At the segment's last stage, a peak after that node misses it (seed 240, a
#   gating node ending its segment: 9.7% below). Keeping it in ``frame_backward_peak_bytes``
#   put seed 8's plan 6% above its measured peak: at its delayed reader (NOTE [ Sums a
#   reentrant segment delays ]) the replay counts a sum, out of place, that the leaf never
#   makes. Keeping it with that sum left out of the walk fixed both, and random graphs
#   60-259 gained a little (25 plans below their measured peaks of 600, then 21), but the
#   real models of tests/models/test_skip_connections.py lost more: their reentrant least
#   plans went from 1.000-1.028 of their measured peaks to 1.000-1.088 (UNet2DModel 1.066,
#   T5 1.066, the HRNet-like network 1.088). Not kept.
# - A segment's output with no gradient is handed zeros of its size (autograd materializes
#   them for a custom Function): seed 116.
# - An add's operand that is a segment's input is copied into its ``.grad`` in some graphs
#   and not in others (seeds 158 and 8), by the order autograd runs the two branches.
# A replay of the chosen plan node by node, with the segments' leaves, frames and
# recomputes, would price all of these exactly; the dynamic programmes would keep the
# prices by stage.


def _grad_copy_table(chain: Chain) -> list[list[int]]:
    """Per segment start ``a`` and offset ``k``, in bytes: the copies of NOTE [ A reentrant
    segment copies its inputs' gradients ] that a reentrant segment ``a..a+k`` makes at its
    last stage (a single stage too: the inputs it copies there are long-lived or passing
    storages, not the tensors crossing into it that ``Stage.first_backward_peak_bytes``
    counts)."""
    count = len(chain.stages)
    at_last = [[0] * (count - a) for a in range(count)]
    for x in (*chain.passing, *chain.long_lived):
        for r in x.view_readers:
            for a in range(x.producer + 1, r + 1):
                at_last[a][r - a] += x.size_bytes
    return at_last


def _touches(x: LongLived, a: int, b: int) -> bool:
    """Whether a stage of ``a..b`` after ``x``'s producer reads or saves it."""
    return any(a <= s <= b for s in (*x.savers, *x.readers) if s > x.producer)


def _passing_alive(chain: Chain, held: Sequence[int], t: int) -> int:
    """Bytes of the passing storages ``held`` (indices) that the forward tables count at
    stage ``t``: those with a reader at ``t`` or later."""
    return sum(chain.passing[i].size_bytes for i in held if chain.passing[i].readers[-1] >= t)


def _kept_by_a_segment(x: LongLived, b: int, starts: dict[int, int]) -> bool:
    """Whether the first stage after ``b`` to hold ``x`` is in a checkpointed segment
    (``starts``: first stage to last) that reads it, not a plain stage that saves it."""
    t = b + 1
    while t <= x.reach:
        if t in starts:
            if _touches(x, t, starts[t]):
                return True
            t = starts[t] + 1
        elif t in x.savers:
            return False
        else:
            t += 1
    return False


def _made_from(chain: Chain, until: Callable[[LongLived], int]) -> list[list[int]]:
    """Per segment start ``a`` and offset ``k``, the bytes of the long-lived storages made in
    ``a..a+k`` whose stage ``until`` lies in ``a..a+k`` too (it is never before the
    producer)."""
    count = len(chain.stages)
    at = [[0] * count for _ in range(count)]  # at[p][s]: made at stage p, ``until`` at s
    for x in chain.long_lived:
        at[x.producer][until(x)] += x.size_bytes
    from_a = [0] * count  # from_a[s]: the bytes made from stage ``a`` on, ``until`` at s
    table: list[list[int]] = [[] for _ in range(count)]
    for a in range(count - 1, -1, -1):
        from_a = [total + made for total, made in zip(from_a, at[a])]
        table[a] = list(accumulate(from_a[a:]))
    return table


def _escaping_floor(inside: list[list[int]], made: Sequence[int]) -> list[list[int]]:
    """Per segment start ``a`` and offset ``k``, the fewest bytes of the long-lived storages
    made from ``a`` on that escape a segment ``a..a+j``, for any ``j >= k`` (``inside``:
    :func:`_made_from` by reach; ``made``: the prefix sum of ``Stage.long_lived_bytes``)."""
    return [list(accumulate(reversed([made[a + k + 1] - made[a] - row[k]
                                      for k in range(len(row))]), min))[::-1]
            for a, row in enumerate(inside)]


# NOTE [ Long-lived storages inside a segment ]
# A long-lived storage (saved by some node, read or saved more than one stage after its
# producer: a skip tensor a later layer saves, a mask every attention block reads) is held from
# its producer to the end of backward in the model, whatever the plan. That is wrong twice
# when its producer lies in a checkpointed segment ``a..b``, whose forward saves nothing:
#
# * if every stage that reads or saves it lies in ``a..b`` too, it dies at its last reader in
#   forward: nothing holds it after the segment (``_inside``);
# * otherwise it is held after the segment, by later stages only, and backward reaches the
#   segment after all of them (the autograd engine runs the ready node made last first), so
#   by the time a non-reentrant segment recomputes it, it is dead: only the copy the
#   recompute makes counts. In reentrant mode it is still counted there: on the random
#   graphs, dropping it there fell 3.5% short of the measured peak where a later reentrant
#   segment read it;
# * that copy is kept only if a stage of the segment saves it, and in backward it lives from
#   the first stage that saves it on (``_copies``), not from its producer.
#
# So a segment holds after it the long-lived storages it makes that escape it, and (non-
# reentrant) none of those it makes while its own recompute and backward run; in reentrant
# mode the escaping ones also stay in the frame as recomputed outputs. What escapes is not
# monotone in ``b`` (a storage escapes ``a..b`` and is inside ``a..b+1``); the lower bound the
# dynamic programme prunes with must grow with ``b``, so it counts the fewest escaping bytes
# of any segment ``a..b'`` with ``b' >= b`` (``_escaping_floor``).

# NOTE [ Storages held by the plan ]
# The dynamic programme needs every peak term to be ``held + constant`` with ``held`` only
# growing (NOTE [ The memory model ]), so it prices two kinds of storage by where they could
# be held, not where a given plan holds them:
#
# * a long-lived storage is held from its producer on (from the end of its producer's segment
#   when it escapes one), though only a stage that saves it, left plain, or a checkpointed
#   segment that reads it (keeping it as an input) holds it for backward. Before the first of
#   those it is only alive in forward, up to its last reader; with none (every saver inside
#   the segment that made it, later readers only reading it: a concatenation, a sum) it is
#   never held;
# * a passing storage that two checkpointed segments read is counted by both, though the
#   first of them already keeps it to the end of backward.
#
# ``MemoryModel.plan_peak`` walks one plan and counts each only where that plan holds it: a
# pending long-lived storage is added to the forward terms of the stages it lives through,
# and to ``held`` from the first plain stage that saves it or segment that reads it; a
# passing storage is added by the first segment that reads it and taken off the forward and
# held terms of the later ones. In reentrant mode ``segment`` also counts the originals of
# the storages escaping the segment as alive during its own backward; the walk drops those
# whose first holder later is a plain stage and keeps those a later segment holds as its
# input (dropping those too fell 3.5% short of the measured peak on a random graph). A
# passing storage two segments read is counted once in both modes. In reentrant mode that
# fell 4.3% short on random graph seed 40 (benchmarks/estimate_accuracy.py) until the
# copies of NOTE [ A reentrant segment copies its inputs' gradients ] were counted: what
# was missing there was a copy autograd makes of an input's gradient, which the second
# count of the storage had stood in for. Every term is the
# programme's or lower, so ``plan_peak <= peak`` for every plan (tests/test_optimal.py
# checks it over all plans of random chains), and the two agree where no storage is
# long-lived or passing.
#
# The single count once looked wrong in non-reentrant mode too: a plan with a segment per
# dense layer of torchvision's densenet121 measured 8% above its estimate. The shortfall was
# exactly the recompute's clones of the BatchNorm running statistics (89,600 B, then not in
# the model; now ``Stage.recompute_buffer_bytes``); with them the plan is estimated to 4 B.
#
# The programme still chooses by ``peak`` (its state would otherwise have to carry which
# storages are pending and which are held). Its least-peak plan is improved step by step under
# ``plan_peak`` (``planner._descend``: grow, shrink, shift, split, join, drop or add a segment,
# or move the boundary between two, while the estimate falls), and with that plan's estimate
# as an upper bound, the search of NOTE [ An exact search under the plan's own estimate ] (in
# :mod:`autockpt.planning.search`) finds the least estimate of any single-level plan: a programme
# whose state does carry them (``WalkKey``). Under a budget the same search, bounded by the
# recompute of the programme's plan, finds the least recompute of any plan whose estimate
# fits. The descent alone stopped above the least on 11 of 120 small random chains (up to
# 6.5%, non-reentrant) and 6 (3.7%, reentrant); under a budget the search's plan recomputed
# up to 32% less than the programme's (torchvision's densenet121 at 75% of the baseline;
# 46% more than needed, the other way round). Where the search gives up (too many states),
# the descent's plan and the programme's are kept. In reentrant mode the search at first
# chose plans the estimate put below their measured peaks (NOTE [ Searched plans and the
# reentrant estimate ] in :mod:`autockpt.planning.planner`).
# On the random graphs of benchmarks/estimate_accuracy.py the walk's single count took the
# largest non-reentrant estimate from 1.065 to 1.041 of the measured peak (reentrant 1.134
# to 1.090, with the reentrant changes of NOTE [ Reentrant backward ]), none below it.

# NOTE [ Passing storages ]
# A storage that no node saves, read more than one stage after its producer (a DenseNet layer's
# features, concatenated again by every later layer; a UNet's skip tensor when the decoder's
# concatenation is its only reader) lives in forward until its last reader, and in backward
# only as the input of a checkpointed segment that reads it: a checkpoint keeps its inputs
# until its backward. So a segment ``a..b`` holds those made before ``a`` and read in
# ``a..b`` (``_passing_in``), a plain stage holds none of them, and while stage ``t`` runs
# forward the ones made before it and read by it or later are alive (``passing_bytes``).
# Two segments reading the same storage both count it in the programme, though it is one
# storage: it over-counts there, never under-counts (a plan's own estimate counts it once:
# NOTE [ Storages held by the plan ]). Counting them as long-lived instead (held to the end
# of backward whatever the plan) made a DenseNet block's estimate 11% too high without any
# checkpoint, once the cuts of NOTE [ Block boundaries under skip connections ] let its
# layers be stages of their own.

def estimate_peak(chain: Chain, ranges: Ranges, mode: str = "non_reentrant",
                  keeps: Keeps = NO_KEEPS) -> int:
    """Estimated peak activation bytes of one forward and backward with ``ranges``
    checkpointed, those starting in ``keeps`` keeping their matmuls (NOTE [ Segments that keep
    their matmuls ]). See NOTE [ The memory model ]; each long-lived and passing storage is
    counted only where this plan holds it (NOTE [ Storages held by the plan ]), so this is
    at most what the dynamic programme prices the plan at (:meth:`MemoryModel.peak`).

    Example:
        >>> from autockpt.planning.chain import Chain, Cut, ForwardPeaks, Stage
        >>> stage = Stage(start=0, end=1, cost=1, flops=1, carries_grad=True, saved_bytes=64,
        ...               long_lived_bytes=0, long_lived_saved_bytes=0, output_bytes=8,
        ...               grad_entry_bytes=0, backward_peak_bytes=88,
        ...               forward=ForwardPeaks(72, 8, 72, 8, 72))
        >>> chain = Chain(stages=(stage,), cuts=(Cut(0, 0, 0, 0), Cut(0, 0, 0, 0)))
        >>> estimate_peak(chain, ())   # 64 held + 8 output + 8 gradient + 16 working set
        96
    """
    return model_of(chain, mode).plan_peak(ranges, keeps)


def estimate_tree_peak(chain: Chain, tree: Tree) -> int:
    """Estimated peak activation bytes of one forward and backward with the nested plan
    ``tree`` (non-reentrant mode); equal to :func:`estimate_peak` for a single-level plan.
    See NOTE [ The nested memory model ]."""
    model = model_of(chain, "non_reentrant")
    if tree_depth(tree) <= 1:
        return model.plan_peak(tuple((a, b) for a, b, _ in tree))
    return model.peak(tree)


_RECENT_MODELS: dict[tuple[int, str], tuple[Chain, MemoryModel]] = {}


def model_of(chain: Chain, mode: str) -> MemoryModel:
    """The memory model of ``chain``, built once for the few chains priced last: building it
    is quadratic in the stages, and a planner prices dozens of plans on one chain."""
    key = (id(chain), mode)
    found = _RECENT_MODELS.get(key)
    if found is not None and found[0] is chain:
        return found[1]
    if len(_RECENT_MODELS) >= 4:
        del _RECENT_MODELS[next(iter(_RECENT_MODELS))]
    model = MemoryModel(chain, mode)
    _RECENT_MODELS[key] = (chain, model)
    return model


def segment_cost(chain: Chain, a: int, b: int, mode: str = "non_reentrant",
                 keep: bool = False) -> int:
    """Cost of recomputing stages ``a..b`` as one segment (see NOTE [ A non-reentrant
    recompute stops early ] in :mod:`autockpt.planning.chain`); ``keep``: it keeps its
    matmuls (NOTE [ Segments that keep their matmuls ])."""
    if keep:
        return model_of(chain, mode).segment_cost(a, b, True)
    # Without the kept prefix sums: no memory model to build (quadratic in the stages).
    return _whole_cost(chain, a, b, mode == "reentrant")[0]


def _whole_cost(chain: Chain, a: int, b: int, reentrant: bool, total: int | None = None
                ) -> tuple[int, int]:
    """Stages ``a..b`` recomputed whole as one segment: its cost, and what a non-reentrant
    recompute's early stop spares of it (``total``: its stages' costs, where known)."""
    if total is None:
        total = sum(chain.stages[t].cost for t in range(a, b + 1))
    spared = 0 if reentrant else min(total, chain.stages[b].tail_cost)
    return chain.segment_cost + total - spared, spared


def recompute_cost(chain: Chain, ranges: Ranges, mode: str = "non_reentrant",
                   keeps: Keeps = NO_KEEPS) -> int:
    """Total cost of what ``ranges`` recompute, those starting in ``keeps`` keeping their
    matmuls."""
    return sum(segment_cost(chain, a, b, mode, a in keeps) for a, b in ranges)


def tree_cost(chain: Chain, tree: Tree) -> int:
    """Recompute cost: every range's stages run once more per range they are in (less what
    each non-reentrant recompute skips at its end)."""
    return sum(segment_cost(chain, a, b) for a, b, _ in flatten_tree(tree))
