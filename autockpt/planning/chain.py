"""The graph as a chain of stages: one record per stage and one per cut, in plain numbers.

:func:`build_chain` turns a :class:`~autockpt.profiling.stats.Profile` into a :class:`Chain`: it
picks the cut points (where few gradient-carrying tensors cross), splits the graph there into
stages, and sorts every activation storage by how it lives in the chain. Each :class:`Stage` records
what running it costs and the bytes it keeps, each :class:`Cut` the bytes crossing it by which side
saves them. No fx here, and no pricing of a plan: the memory model in
:mod:`autockpt.planning.memory_model` reads these numbers (NOTE [ The memory model ] there), and the
dynamic programmes above it (:mod:`autockpt.planning.optimal`, :mod:`autockpt.planning.nested`) read
the model.

# NOTE [ Internal, crossing and long-lived storages ]
Cut points split the graph into stages (see ``_candidate_cuts``). Every activation storage is
one of three kinds:

* *internal* to its producing stage (``Stage.saved_bytes`` when the stage saves it);
* *crossing* exactly one cut, from stage ``c-1`` to stage ``c``: counted at that
  :class:`Cut` by which of the two stages saves it;
* *long-lived* (read more than one stage later, like an attention mask, or part of the
  model's output) and saved for backward by some node, or part of the model's output:
  ``Stage.long_lived_bytes`` or ``Stage.output_bytes`` of its producer, held from there on
  whatever the plan, except where one checkpointed segment holds its producer and all its
  readers (a :class:`LongLived` record; NOTE [ Long-lived storages inside a segment ] in
  :mod:`autockpt.planning.memory_model`). This is conservative.
* *passing*: read more than one stage later and saved by no node (a concatenated skip
  tensor): a :class:`Passing` record, alive in forward until its last reader and held for
  backward only by the checkpointed segments that read it.
"""

# NOTE [ Gradients in backward ]
# What autograd keeps alive in backward is read off the ops, not guessed from their shapes. The
# profiler runs each node once more on fake copies of the activations it reads and then its backward
# alone, from a fresh gradient of its output (autockpt.profiling.profile._probe_backward): the most
# bytes that backward holds at once (gradients of its inputs and temporaries, less what the node
# saved and has freed by then: a leaf module frees its internals op by op), and per input whether
# the gradient handed on is new storage or the output's gradient itself (an add passes it to both
# operands, a view to its base). ``_backward_grads`` then replays the backward over the whole graph
# in reverse, buffer by buffer: a gradient passed through lives until the last value holding it is
# done; a value read by several nodes (a residual stream) keeps its first partial gradient until the
# others arrive, and autograd adds them out of place (a new buffer, both parts freed); a gradient is
# freed once its producer has run backward. The model's outputs get what the measure's sum loss
# gives them: an expanded scalar, no bytes. An input that requires grad keeps its gradient to the
# end of backward, as its ``.grad``. A saved storage is freed once the first node that saved it has
# run backward, so a stage's saved bytes shrink as its backward goes. None of this depends on which
# stages are checkpointed (the backward runs the same ops), so each stage gets one number,
# ``Stage.backward_peak_bytes``, and the dynamic programme stays exact for the model.

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from autockpt.planning.overhead import NO_OVERHEAD, Overhead
from autockpt.profiling.stats import LOSS_OP, NodeStat, Profile, StorageStat, node_cost

__all__ = ["ForwardPeaks", "Stage", "Cut", "Passing", "LongLived", "SharedGradient", "Chain",
           "MAX_STAGES", "build_chain"]


@dataclass(frozen=True)
class ForwardPeaks:
    """The forward peak of one stage over what it receives from earlier stages, for each way
    the stage can run. Each is the most bytes alive at once while its nodes run forward:
    storages it made that are still needed, plus the working set of the node running
    (profiled node by node on fake tensors)."""

    plain_bytes: int
    """Not checkpointed: what it saves stays alive to the end of the stage."""
    checkpointed_bytes: int
    """Checkpointed: what it saves is freed as it goes."""
    plain_received_bytes: int
    """Not checkpointed, also counting the tensors crossing into it that the stage before
    does not save (``Cut.saved_by_reader_bytes`` and ``Cut.saved_by_neither_bytes`` of the cut
    before it), each alive until its last reader in the stage (to the end of the stage when
    the stage saves it). At most those two plus ``plain_bytes``, which would count them alive
    through the whole stage."""
    checkpointed_received_bytes: int
    """The same when checkpointed, the stage not being the first of its segment (the first
    keeps its inputs for the recompute)."""
    stopped_received_bytes: int
    """``plain_received_bytes`` when the stage is the last one of a non-reentrant recompute,
    which runs only up to where it stops (NOTE [ A non-reentrant recompute stops early ])."""


@dataclass(frozen=True)
class Stage:
    """A run of graph nodes between two cuts: what recomputing it costs, and the bytes of
    the memory model it contributes (see NOTE [ Internal, crossing and long-lived
    storages ])."""

    start: int
    """Position of its first node."""
    end: int
    """Position one past its last node."""
    cost: int
    """Cost of recomputing it: the sum of its nodes' :func:`~autockpt.profiling.stats.node_cost`
    and, per node that runs an op, the chain's op cost (NOTE [ What a segment costs beyond
    its FLOPs ] in :mod:`autockpt.planning.overhead`)."""
    flops: int
    """FLOPs of its nodes."""
    carries_grad: bool
    """Whether any of its nodes produces a tensor that requires grad (never the loss's stage:
    the loss is the user's code, not a segment; never the inputs' stage)."""
    saved_bytes: int
    """Bytes of its internal storages that it saves for backward: held until its backward
    when it is not checkpointed, freed in forward and saved again by the recompute when it
    is."""
    long_lived_bytes: int
    """Bytes of the long-lived storages it produces (read more than one stage later), held
    from then on whatever the plan."""
    long_lived_saved_bytes: int
    """Bytes of the long-lived or output storages it produces that something saves for
    backward (a recompute of the stage saves them a second time)."""
    output_bytes: int
    """Bytes of the model's output it produces, alive until the step ends."""
    grad_entry_bytes: int
    """Gradient bytes alive when backward enters it (from later stages and the loss)."""
    backward_peak_bytes: int
    """Peak of its backward over what is held from outside it: its own saved internal
    storages, each freed once the ops that saved it have run backward, plus the gradients
    alive and the working set of the op running (NOTE [ Gradients in backward ])."""
    forward: ForwardPeaks
    """Its forward peaks, plain and checkpointed."""
    ops: int = 0
    """How many of its nodes run an op (each costs the chain's :attr:`Chain.op_cost` in
    :attr:`cost`)."""
    tail_cost: int = 0
    """Cost of the trailing nodes that a non-reentrant recompute ending with this stage
    skips (see NOTE [ A non-reentrant recompute stops early ]): its own, and those of the
    stages before it when it saves nothing. A segment is spared at most its own cost."""
    tail_flops: int = 0
    """FLOPs of those nodes."""
    passing_bytes: int = 0
    """Bytes of the passing storages alive through its forward: made by an earlier stage, read
    by this one or a later one (see :class:`Passing`)."""
    passing_made_bytes: int = 0
    """Bytes of the passing storages it makes."""
    recompute_buffer_bytes: int = 0
    """Bytes a recompute of it saves beside ``saved_bytes``: its clones of the buffers its
    nodes update and save (:attr:`~autockpt.profiling.stats.NodeStat.saved_buffer_bytes`). A segment
    makes the clones of all its stages when its recompute starts."""
    recompute_backward_extra_bytes: int = 0
    """What those clones add to ``backward_peak_bytes`` when the stage runs backward
    recomputed: each is freed once the node that saved it has run backward."""
    frame_backward_peak_bytes: int = 0
    """``backward_peak_bytes`` when the gradients of the passing values it makes stay alive
    after their producers have run backward: as the last stage of a reentrant segment, whose
    frame keeps the gradients it was handed (NOTE [ Reentrant backward ] in
    :mod:`autockpt.planning.memory_model`). 0 where unknown: then those gradients are counted
    whole."""
    kept_bytes: int = 0
    """Bytes its nodes' matrix products, convolutions and attention make: what a segment
    that keeps those outputs holds of this stage from its forward to its recompute (NOTE
    [ Segments that keep their matmuls ] in :mod:`autockpt.planning.memory_model`)."""
    kept_cost: int = 0
    """The part of :attr:`cost` such a segment does not run again."""
    kept_flops: int = 0
    """The part of :attr:`flops` such a segment does not run again."""
    kept_ops: int = 0
    """How many of those ops its nodes run."""
    aten_ops: int = 0
    """How many ATen ops its nodes run, views aside."""
    first_backward_peak_bytes: int | None = None
    """``backward_peak_bytes`` when the stage is the first of a reentrant segment, whose
    inputs are leaves: with a copy of each input's gradient from where it arrives as the
    gradient of its only reader's output (an add's, a concatenation's slice) to the end of
    the stage (NOTE [ A reentrant segment copies its inputs' gradients ] in
    :mod:`autockpt.planning.memory_model`). None where unknown: then every input's gradient is
    counted on top of ``backward_peak_bytes``."""


@dataclass(frozen=True)
class Cut:
    """The tensors crossing one cut, from the stage before it (their producer) to the stage
    after it (their only reader), by which of the two saves them for backward. Whether each
    is held in backward depends on which of the two stages are checkpointed."""

    saved_by_producer_bytes: int
    """Saved by the stage before the cut only."""
    saved_by_reader_bytes: int
    """Saved by the stage after the cut only."""
    saved_by_both_bytes: int
    """Saved by both stages."""
    saved_by_neither_bytes: int
    """Saved by neither: read by the stage after the cut, then freed."""

    @property
    def crossing_bytes(self) -> int:
        """All bytes crossing the cut; a checkpoint starting after it keeps them all."""
        return (self.saved_by_producer_bytes + self.saved_by_reader_bytes
                + self.saved_by_both_bytes + self.saved_by_neither_bytes)

    @property
    def producer_saved_bytes(self) -> int:
        """What the stage before the cut saves of them: held while it is not checkpointed."""
        return self.saved_by_producer_bytes + self.saved_by_both_bytes

    @property
    def saved_bytes(self) -> int:
        """What either stage saves of them: saved again when both are recomputed."""
        return self.saved_by_producer_bytes + self.saved_by_reader_bytes + self.saved_by_both_bytes


@dataclass(frozen=True)
class Passing:
    """A storage that nobody saves for backward, read more than one stage after the stage
    that makes it (a feature map a DenseNet concatenates again in every later layer, a skip
    tensor a UNet's decoder concatenates). In forward it lives until its last reader; in
    backward it is held only by a checkpointed segment that reads it, as one of the
    segment's inputs (see NOTE [ Passing storages ] in :mod:`autockpt.planning.memory_model`)."""

    producer: int
    """The stage that makes it."""
    readers: tuple[int, ...]
    """The later stages that read it, ascending."""
    size_bytes: int
    """Its size."""
    view_readers: tuple[int, ...] = ()
    """The readers (stages, ascending) with a node whose output leaves the stage and that hands it
    the gradient of that output, not new storage (a concatenation's slice, an add's shared
    gradient). A reentrant segment ending there copies that gradient
    (NOTE [ A reentrant segment copies its inputs' gradients ] in
    :mod:`autockpt.planning.memory_model`)."""
    after_read_bytes: tuple[int, ...] = ()
    """Per reader (as ``readers``): the most bytes its stage's backward holds once the last of
    its nodes that read this storage has run backward (as ``Stage.backward_peak_bytes``; 0
    where nothing runs after it). A reentrant segment that reads it, with a reader after the
    segment, holds two gradients of it from there on (NOTE [ Sums a reentrant segment
    delays ] in :mod:`autockpt.planning.memory_model`). Empty where unknown."""


@dataclass(frozen=True)
class LongLived:
    """A long-lived storage that is not the model's output: saved for backward by some node
    and read or saved more than one stage after the stage that makes it (NOTE [ Long-lived
    storages inside a segment ] in :mod:`autockpt.planning.memory_model`)."""

    producer: int
    """The stage that makes it."""
    savers: tuple[int, ...]
    """The stages that save it for backward, ascending (its producer's stage or later)."""
    readers: tuple[int, ...]
    """The stages after its producer's that read it, ascending (every later saver is one)."""
    size_bytes: int
    """Its size."""
    view_readers: tuple[int, ...] = ()
    """As :attr:`Passing.view_readers`: the readers that hand it their output's gradient."""
    after_read_bytes: tuple[int, ...] = ()
    """As :attr:`Passing.after_read_bytes`."""

    @property
    def first_saver(self) -> int:
        """The first stage that saves it."""
        return self.savers[0]

    @cached_property
    def reach(self) -> int:
        """The last stage that reads or saves it."""
        # Cached: the plan search asks for it hundreds of thousands of times.
        return max(self.savers[-1], self.readers[-1] if self.readers else self.producer)


@dataclass(frozen=True)
class SharedGradient:
    """A node that hands the gradient of its output, unchanged or as a view, to passing or
    long-lived storages made in earlier stages, or to inputs of the model that require grad
    (an add of two skip tensors, a concatenation).
    A reentrant segment that reads them as inputs copies some of those gradients into their
    ``.grad`` (NOTE [ A reentrant segment copies its inputs' gradients ] in
    :mod:`autockpt.planning.memory_model`)."""

    stage: int
    """The node's stage."""
    output_reach: int
    """The last stage that reads the node's output (the number of stages where it is the
    model's output): a segment ending before it is handed that gradient by its frame."""
    output_grad_bytes: int
    """Bytes of the gradient of its output: the one buffer the replay counts for all of
    them (NOTE [ Gradients in backward ])."""
    inputs: tuple[tuple[int, int], ...]
    """Per passing or long-lived storage or input that requires grad it hands the gradient
    to: (the stage that makes it, its bytes)."""
    sharers: tuple[tuple[int, int, int], ...]
    """(stage that makes it, bytes, stage it holds the gradient to) of each value it hands
    the gradient to, these storages or others, by stage: each holds that gradient (or its
    slice) until the next of its readers or its producer has run backward, where it is
    added to another or handed on (``_holds_to``)."""
    running_bytes: int = 0
    """The most bytes its stage's backward holds while the node runs backward (as
    ``Stage.backward_peak_bytes``): where it hands slices to a reentrant segment's inputs,
    their copies are made then, beside the gradient they are sliced from."""


@dataclass(frozen=True)
class Chain:
    """A graph restated as a chain of stages, in plain numbers.

    Cut ``c`` lies before stage ``c``: there is one more cut than stages, and the first and
    the last cut cross nothing.
    """

    stages: tuple[Stage, ...]
    """The stages, in graph order."""
    cuts: tuple[Cut, ...]
    """The cuts, in graph order: ``cuts[c]`` lies before ``stages[c]``."""
    passing: tuple[Passing, ...] = ()
    """The passing storages, by producer."""
    long_lived: tuple[LongLived, ...] = ()
    """The long-lived storages that are not the model's output, by producer."""
    shared_gradients: tuple[SharedGradient, ...] = ()
    """The nodes that hand their output's gradient to passing or long-lived storages, in
    graph order."""
    segment_cost: int = 0
    """What each checkpointed segment costs beyond its stages' ops, in their cost's unit
    (NOTE [ What a segment costs beyond its FLOPs ] in :mod:`autockpt.planning.overhead`)."""
    op_cost: int = 0
    """What each recomputed op costs beyond its arithmetic (in :attr:`Stage.cost`)."""


# --------------------------------------------------------------------------- building

def _after_inputs(nodes: Sequence[NodeStat]) -> int:
    """The position of the first node after the graph's inputs (its placeholders)."""
    return 1 + max((s.index for s in nodes if s.op == "placeholder"), default=-1)


def _candidate_cuts(nodes: Sequence[NodeStat]) -> list[int]:
    """Positions ``c`` where a cut before node ``c`` is allowed and cheap.

    A cut is allowed unless a container of tensors crosses it (reentrant checkpoint would lose
    their gradients) or it separates a tensor from an in-place op on it. It is cheap where no
    more gradient-carrying tensors cross than at the cheapest cut: block boundaries. Tensors
    that carry no gradient (a mask built from token ids) do not count. A long stretch between
    two cheap cuts is searched again for its own block boundaries, not counting the tensors
    that cross all of it (see NOTE [ Block boundaries under skip connections ]).
    """
    n = len(nodes)
    last = n - 1  # the output node
    first = _after_inputs(nodes)
    diff_forbid = [0] * (n + 2)
    # The cuts each gradient-carrying tensor crosses, as (first, last).
    spans: list[tuple[int, int]] = []
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
            spans.append((lo, hi))
        for producer in node.mutated_inputs:
            diff_forbid[producer + 1] += 1
            diff_forbid[node.index + 1] -= 1
    forbid = 0
    allowed: list[int] = []
    for c in range(n + 1):
        forbid += diff_forbid[c]
        if first <= c < last and forbid == 0:
            allowed.append(c)
    if not allowed:
        return []
    cost = [0]
    for node in nodes:
        cost.append(cost[-1] + node_cost(node) + 1)
    # A stretch holding less than this share of the graph's cost is not searched again.
    least_cost = cost[-1] // _REFINE_SHARE
    found: list[int] = []
    # Stretches to search: (index of its first allowed cut, one past its last, the two
    # cuts bounding it). The graph's ends bound the first: no tensor crosses both.
    todo: list[tuple[int, int, int, int]] = [(0, len(allowed), 0, n)]
    while todo:
        i, j, lo, hi = todo.pop()
        inside = allowed[i:j]
        diff = [0] * (len(inside) + 1)
        for a, b in spans:
            if a <= lo and b >= hi:
                continue  # crosses the whole stretch: held whatever the cuts inside
            # The allowed cuts in [a, b] among ``inside``.
            x, y = bisect_left(inside, a), bisect_right(inside, b)
            if x < y:
                diff[x] += 1
                diff[y] -= 1
        counts: list[int] = []
        running = 0
        for k in range(len(inside)):
            running += diff[k]
            counts.append(running)
        threshold = max(1, min((g for g in counts if g > 0), default=1))
        picked = [i + k for k, g in enumerate(counts) if g <= threshold]
        found.extend(allowed[k] for k in picked)
        bounds = [i - 1, *picked, j]
        for a, b in zip(bounds, bounds[1:]):
            if b - a <= 2:
                continue  # at most one allowed cut between: nothing to choose
            left = allowed[a] if a >= i else lo
            right = allowed[b] if b < j else hi
            if cost[right] - cost[left] > least_cost:
                todo.append((a + 1, b, left, right))
    return sorted(set(found))


_REFINE_SHARE = 8
"""A stretch between two cheap cuts holding more than ``1 / _REFINE_SHARE`` of the graph's
cost is searched again for cuts of its own (NOTE [ Block boundaries under skip connections ])."""


# NOTE [ Block boundaries under skip connections ]
# Block boundaries are where the fewest gradient-carrying tensors cross. In a chain of blocks
# that is one tensor, and every block boundary qualifies. A skip connection raises the count
# over everything it spans: a UNet's encoder output at each resolution is read by the decoder
# at the same resolution, and a time embedding or an encoder output is read by every block.
# Counted over the whole graph, the only cheapest cuts of a UNet lie before its first layer
# and after its last, and the planner had nothing in between to choose from. So a stretch
# between two cheap cuts that holds a large share of the graph is searched again on its own,
# without the tensors that cross all of it: those are held through the stretch whatever is
# checkpointed inside (the memory model counts them as long-lived or passing), so they cost nothing
# extra at any boundary inside it. One level of skips is peeled off each time, and the
# block boundaries of each resolution show up. Chains of blocks are searched too but
# rarely change: their stretches are single blocks.

# NOTE [ A non-reentrant recompute stops early ]
# Non-reentrant checkpoint stops its recompute as soon as every tensor the segment saved in
# forward has been saved again, and autograd saves an op's inputs before its kernel runs. So
# the nodes after the segment's last saving node never run again, nor does that node's kernel
# when it saves only tensors made before it (a final Linear saves its input and weight: its
# matmul is skipped; a 4-D matmul copies a transposed operand, then saves the copy as the
# input of its bmm: the bmm is skipped, ``NodeStat.saves_fresh``). ``Stage.tail_cost`` is
# what a segment ending with the stage is spared; hand-written per-block checkpoints get
# this for free on every block, so a cost model without it would see them recompute more
# than they do. Reentrant checkpoint reruns the whole segment to get its outputs.
# The node the recompute stops in still runs the ops that make what it saves: a dropout
# makes its mask, then saves it as the input of its last op (the multiply), so the recompute
# ends with the mask allocated beside the dropout's input. The forward sweep of a stage
# where the recompute stops counts those storages (``_own_saved_bytes``); counting the node
# as not run at all left a recompute ending in a dropout one mask short of what it holds.


def _savers(profile: Profile) -> tuple[list[bool], list[bool]]:
    """Per node: whether it saves a tensor it made itself, and whether it saves any."""
    saves_own = [False] * len(profile.nodes)
    saves_any = [False] * len(profile.nodes)
    for st in profile.storages:
        for saver in st.saved_by:
            saves_any[saver] = True
            if saver == st.producer and profile.nodes[saver].saves_fresh:
                saves_own[saver] = True
    return saves_own, saves_any


def _own_saved_bytes(profile: Profile) -> list[int]:
    """Per node: bytes of the storages it makes and saves itself."""
    out = [0] * len(profile.nodes)
    for st in profile.storages:
        if st.producer in st.saved_by:
            out[st.producer] += st.size_bytes
    return out


def _tails(profile: Profile, end: int, saves_own: Sequence[bool],
           saves_any: Sequence[bool], op_cost: int = 0) -> tuple[int, int, int]:
    """Cost and FLOPs of the nodes before ``end`` that a recompute ending there skips, and
    the position of the first of them (``end`` when none is skipped). They may reach back
    over several stages: a stage that saves nothing is skipped whole."""
    cost = flops = 0
    stop = end
    for index in range(end - 1, -1, -1):
        node = profile.nodes[index]
        if saves_own[index]:
            break
        cost += _recompute_cost(node, op_cost)
        flops += node.flops
        stop = index
        if saves_any[index]:
            break
    return cost, flops, stop


def _merge_aliases(profile: Profile, cuts: list[int]) -> list[int]:
    """Drop the cuts that open a stage allocating no storage (views, ``getattr`` of a
    parameter, a ``select``), which joins it to the stage before it.

    See NOTE [ Stages that allocate nothing ].
    """
    allocates = [False] * len(profile.nodes)
    for st in profile.storages:
        allocates[st.producer] = True
    # The first inner cut separates the inputs from the graph: never join a stage to them.
    fixed = {cuts[0], cuts[1] if len(cuts) > 1 else cuts[0], cuts[-1], *_loss_cut(profile)}
    return [c for k, c in enumerate(cuts) if c in fixed or any(allocates[c:cuts[k + 1]])]


# NOTE [ Stages that allocate nothing ]
# A stage made only of views (``flatten``, ``transpose``, ``x[:, 0]``) or reads of
# parameters allocates nothing, so a segment boundary before it or after it keeps the same
# storages. Left as a stage of its own, it makes the storage it views cross two cuts to reach
# its reader, and the memory model holds such a storage to the end of backward whatever the
# plan (it is *long-lived*), though no one saves it: a ViT's patch embedding and class-token
# concatenation and the last hidden state read by the head through ``x[:, 0]`` made its
# estimate a constant 2.3 MiB too high. Joined to the stage before it, each of them crosses
# one cut and is held exactly as long as its reader needs it.

def _join_gradless_gaps(profile: Profile, cuts: list[int]) -> list[int]:
    """Drop the cuts between a storage nobody saves and its reader when only stages that
    carry no gradient lie between them, which joins producer and reader into one stage.

    See NOTE [ Joining over gradless gaps ].
    """
    nodes = profile.nodes
    n = len(nodes)
    stage_of = [0] * n
    for s, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        stage_of[lo:hi] = [s] * (hi - lo)
    carries = [any(m.requires_grad for m in nodes[lo:hi]) and all(m.op != LOSS_OP
                                                                  for m in nodes[lo:hi])
               for lo, hi in zip(cuts, cuts[1:])]
    drop: set[int] = set()
    for st in profile.storages:
        readers = [u for u in st.users if u < n - 1 and nodes[u].op != LOSS_OP]
        if st.is_output or st.saved_by or not readers:
            continue
        p, r = stage_of[st.producer], stage_of[max(readers)]
        if r > p + 1 and not any(carries[p + 1:r]):
            drop.update(cuts[p + 1:r + 1])
    fixed = {cuts[0], cuts[1] if len(cuts) > 1 else cuts[0], cuts[-1], *_loss_cut(profile)}
    return [c for c in cuts if c not in drop or c in fixed]


# NOTE [ Joining over gradless gaps ]
# A storage read more than one stage after its producer is *long-lived* in the memory model:
# held to the end of backward whatever the plan, because a segment starting between the two
# would keep it as a checkpoint input. When nobody saves it and the stages between carry no
# gradient, that is all pessimism: a language model's logits, read by a cross-entropy after
# a few stages that only shift the labels, were held through the whole backward (16 MiB of a
# 49 MiB step for a small GPT-2 given ``labels=``). No segment can start in a stage without
# gradient, so joining the producer, the gap and the reader into one stage loses no useful
# cut, and the storage is then freed at its last reader, as it is.

MAX_STAGES = 64
"""Longer chains are coarsened to this many stages before planning (see :func:`_coarsen`)."""


def _coarsen(profile: Profile, cuts: list[int], max_stages: int) -> list[int]:
    """Keep at most ``max_stages - 1`` inner cuts: one per equal share of the recompute cost,
    the one in each share's window that the fewest bytes cross (the cheapest boundary).

    The dynamic programme's time grows with the square of the chain's length; a plan rarely
    needs more than a few dozen segment boundaries to choose from.
    """
    loss_cut = _loss_cut(profile)
    max_stages -= len(loss_cut)  # the loss's stage is one of them
    inner = [c for c in cuts if 0 < c < len(profile.nodes) - 1 and c not in loss_cut]
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
    return sorted({cuts[0], cuts[-1], *kept, *loss_cut})


def _loss_cut(profile: Profile) -> tuple[int, ...]:
    """The cut before the loss node, which closes the stage the loss stands alone in (see
    NOTE [ The loss node ] in :mod:`autockpt.profiling.profile`)."""
    nodes = profile.nodes
    return (len(nodes) - 2,) if len(nodes) >= 2 and nodes[-2].op == LOSS_OP else ()


def build_chain(profile: Profile, *, max_stages: int = MAX_STAGES,
                grad_accumulation: bool = False, overhead: Overhead = NO_OVERHEAD) -> Chain:
    """Split the graph at the candidate cuts and compute the numbers of the memory model.

    ``grad_accumulation``: the parameters' ``.grad`` exists when backward runs, so every
    weight gradient is a temporary added into it (``NodeStat.accumulate_backward_bytes``).
    ``overhead``: the fixed costs of a segment and of a recomputed op (NOTE [ What a segment
    costs beyond its FLOPs ] in :mod:`autockpt.planning.overhead`).
    """
    nodes = profile.nodes
    n = len(nodes)
    # The inputs stand alone in the first stage, never checkpointed: a cut right after them
    # even where an input that requires grad is read far into the graph.
    first = _after_inputs(nodes)
    cuts = sorted({0, n - 1, *(c for c in _candidate_cuts(nodes) if c > 0), *_loss_cut(profile),
                   *((first,) if 0 < first < n - 1 else ())})
    cuts = _merge_aliases(profile, cuts)
    cuts = _join_gradless_gaps(profile, cuts)
    cuts = _coarsen(profile, cuts, max_stages)
    count = len(cuts) - 1
    stage_of = [0] * n
    spans = list(zip(cuts, cuts[1:]))  # per stage, its first node and one past its last
    for s, (lo, hi) in enumerate(spans):
        stage_of[lo:hi] = [s] * (hi - lo)
    stage_of[n - 1] = count
    # Per stage, the bytes of Stage's fields of the same names.
    saved = [0] * count
    long_lived = [0] * count
    long_lived_saved = [0] * count
    outputs = [0] * count
    # Per stage, Stage's ``passing_bytes`` and ``passing_made_bytes``.
    passing_alive = [0] * count
    made = [0] * count
    passing: list[Passing] = []
    lasting: list[LongLived] = []
    # Per cut, the bytes of Cut's fields ``saved_by_*``.
    by_producer, by_reader, by_both, by_neither = ([0] * (count + 1) for _ in range(4))
    # Per stage, (first node that saves it, bytes) of its internal saved storages.
    internal_spans: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    # Storages held through the forward sweep of their own stage, per kind of stage.
    held_plain: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    held_ckpt: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    # Tensors crossing into a stage, alive from its start (as if made just before it).
    received_plain: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    received_ckpt: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    # Per node, the gradient bytes of the passing value it makes.
    passing_grads: dict[int, int] = {}
    # Per node, the bytes of the tensors crossing into its stage whose gradient a reentrant
    # checkpoint starting there copies, the node being their only reader in the stage.
    input_copies: dict[int, int] = {}
    # By producing node, the bytes of the passing and long-lived storages (SharedGradient).
    skip_bytes: dict[int, int] = {}
    # Per passing and long-lived storage, its last reading node in each reader stage.
    passing_reads: list[tuple[int, ...]] = []
    lasting_reads: list[tuple[int, ...]] = []
    for st in profile.storages:
        p = stage_of[st.producer]
        users = sorted({stage_of[u] for u in st.users if u < n - 1})
        savers = sorted({stage_of[u] for u in st.saved_by})
        reach = max(users + savers, default=p)
        last_node = max([u for u in st.users if u < n - 1], default=st.producer)
        end_in_stage = min(last_node, spans[p][1] - 1)
        size = st.size_bytes
        if reach > p + 1 and not st.is_output and not savers:
            if nodes[st.producer].requires_grad:
                passing_grads[st.producer] = nodes[st.producer].grad_bytes
            made[p] += size
            for t in range(p + 1, reach + 1):
                passing_alive[t] += size
            skip_bytes[st.producer] = skip_bytes.get(st.producer, 0) + size
            passing_reads.append(_last_reads(st, stage_of, p, n))
            passing.append(Passing(producer=p, readers=tuple(u for u in users if u > p),
                                   size_bytes=size,
                                   view_readers=_view_readers(st, nodes, stage_of, spans)))
            span = (st.producer, spans[p][1] - 1, size)
            held_plain[p].append(span)
            held_ckpt[p].append(span)
        elif st.is_output or reach > p + 1:
            if st.is_output:
                outputs[p] += size
            else:
                long_lived[p] += size
                skip_bytes[st.producer] = skip_bytes.get(st.producer, 0) + size
                lasting_reads.append(_last_reads(st, stage_of, p, n))
                lasting.append(LongLived(producer=p, savers=tuple(savers),
                                         readers=tuple(u for u in users if u > p),
                                         size_bytes=size,
                                         view_readers=_view_readers(st, nodes, stage_of, spans)))
            if savers:
                long_lived_saved[p] += size
            span = (st.producer, spans[p][1] - 1, size)
            held_plain[p].append(span)
            held_ckpt[p].append(span)
        elif reach == p + 1:
            by_prev, by_next = p in savers, p + 1 in savers
            table = (by_both if by_prev and by_next else by_producer if by_prev
                     else by_reader if by_next else by_neither)
            table[p + 1] += size
            # Read by two nodes, its gradient is their sum, new storage .grad takes as it is.
            readers = {u for u in st.users if spans[p + 1][0] <= u < spans[p + 1][1]}
            if len(readers) == 1:
                reader, = readers
                if _hands_output_grad(nodes[reader], st.producer):
                    input_copies[reader] = input_copies.get(reader, 0) + size
            kept = (st.producer, spans[p][1] - 1, size)
            held_plain[p].append(kept if by_prev else (st.producer, end_in_stage, size))
            held_ckpt[p].append((st.producer, end_in_stage, size))
            start, end = spans[p + 1]
            last_read = max((u for u in st.users if start <= u < end), default=start)
            if not by_prev:  # what the stage before saves is held, and counted there
                received_plain[p + 1].append(
                    (start - 1, end - 1 if by_next else last_read, size))
            received_ckpt[p + 1].append((start - 1, last_read, size))
        else:
            if p in savers:
                saved[p] += size
                internal_spans[p].append((min(st.saved_by), size))
            held_plain[p].append(
                (st.producer, spans[p][1] - 1 if p in savers else end_in_stage, size))
            held_ckpt[p].append((st.producer, end_in_stage, size))
    # An input that requires grad is a leaf of every reentrant segment that reads it: an add
    # there hands it a gradient it copies, as it does for a skip tensor (random graph seed
    # 43: an add of the model's input in a segment's middle stage, 7% above its estimate).
    for node in nodes:
        if node.op == "placeholder" and node.requires_grad:
            skip_bytes[node.index] = node.grad_bytes
    grads_at, entry = _backward_grads(nodes, [end for _, end in spans],
                                      grad_accumulation=grad_accumulation)
    saves_own, saves_any = _savers(profile)
    own_saved = _own_saved_bytes(profile)
    stages = []
    # Per node, its stage's backward peak while it runs backward and once it has.
    at_node, after_node = [0] * n, [0] * n
    for s, (lo, hi) in enumerate(spans):
        members = nodes[lo:hi]
        backward_peak, frame_peak, first_peak = _backward_walk(
            internal_spans[s], grads_at, lo, hi, passing_grads, input_copies, after_node,
            at_node)
        # Recomputed, each node that updates and saves buffers saves clones of them too.
        clones = [(u, nodes[u].saved_buffer_bytes) for u in range(lo, hi)
                  if nodes[u].saved_buffer_bytes]
        recomputed_peak = (_backward_walk(internal_spans[s] + clones, grads_at, lo, hi, {})[0]
                           if clones else backward_peak)
        # A segment is spared at most all of its own nodes (the memory model caps it).
        tail_cost, tail_flops, stop = _tails(profile, hi, saves_own, saves_any,
                                             overhead.op_cost)
        stop = max(stop, lo)
        forward = ForwardPeaks(
            plain_bytes=_sweep(nodes, lo, hi, held_plain[s]),
            checkpointed_bytes=_sweep(nodes, lo, hi, held_ckpt[s]),
            plain_received_bytes=_sweep(nodes, lo, hi, held_plain[s] + received_plain[s]),
            checkpointed_received_bytes=_sweep(nodes, lo, hi, held_ckpt[s] + received_ckpt[s]),
            stopped_received_bytes=_sweep(nodes, lo, hi, held_plain[s] + received_plain[s],
                                          stop, own_saved[stop] if stop < hi else 0),
        )
        stages.append(Stage(
            start=lo, end=hi, cost=sum(_recompute_cost(m, overhead.op_cost) for m in members),
            ops=sum(m.op in RUNS_AN_OP for m in members),
            flops=sum(m.flops for m in members),
            # The loss is the user's code, never a segment: its stage carries no gradient.
            carries_grad=any(m.requires_grad for m in members)
            and all(m.op not in (LOSS_OP, "placeholder") for m in members),
            saved_bytes=saved[s], long_lived_bytes=long_lived[s],
            long_lived_saved_bytes=long_lived_saved[s], output_bytes=outputs[s],
            grad_entry_bytes=entry[s], backward_peak_bytes=backward_peak, forward=forward,
            tail_cost=tail_cost, tail_flops=tail_flops, passing_bytes=passing_alive[s],
            passing_made_bytes=made[s], frame_backward_peak_bytes=frame_peak,
            first_backward_peak_bytes=first_peak,
            recompute_buffer_bytes=sum(size for _, size in clones),
            recompute_backward_extra_bytes=recomputed_peak - backward_peak,
            kept_bytes=sum(m.kept_bytes for m in members),
            kept_cost=sum(_kept_cost(m, overhead.op_cost) for m in members),
            kept_flops=sum(m.kept_flops for m in members),
            kept_ops=sum(m.kept_ops for m in members),
            aten_ops=sum(m.ops for m in members),
        ))
    return Chain(stages=tuple(stages),
                 cuts=tuple(Cut(saved_by_producer_bytes=by_producer[c],
                                saved_by_reader_bytes=by_reader[c],
                                saved_by_both_bytes=by_both[c],
                                saved_by_neither_bytes=by_neither[c])
                            for c in range(count + 1)),
                 passing=tuple(replace(x, after_read_bytes=tuple(after_node[u] for u in reads))
                               for x, reads in zip(passing, passing_reads)),
                 long_lived=tuple(replace(x, after_read_bytes=tuple(after_node[u] for u in reads))
                                  for x, reads in zip(lasting, lasting_reads)),
                 shared_gradients=tuple(
                     replace(g, running_bytes=at_node[u])
                     for u, g in _shared_gradients(nodes, stage_of, skip_bytes, count)),
                 segment_cost=overhead.segment_cost, op_cost=overhead.op_cost)


RUNS_AN_OP = ("call_function", "call_method", "call_module")
"""The opcodes of nodes a recompute runs again (placeholders, parameters and the output are
not run)."""


def _recompute_cost(node: NodeStat, op_cost: int) -> int:
    """What running ``node`` again costs: its arithmetic, plus ``op_cost`` where it runs an
    op (NOTE [ What a segment costs beyond its FLOPs ] in :mod:`autockpt.planning.overhead`)."""
    return node_cost(node) + (op_cost if node.op in RUNS_AN_OP else 0)


def _kept_cost(node: NodeStat, op_cost: int) -> int:
    """The part of :func:`_recompute_cost` a segment that keeps its matmuls does not spend on
    ``node``: the FLOPs of those ops and the bytes they write, or that share of its measured
    time; the op cost too where they are all it computes."""
    if not node.kept_ops:
        return 0
    if node.time_ns is not None:
        return node.time_ns * node.kept_flops // max(node.flops, 1)
    whole = node.kept_flops >= node.flops and node.ops <= node.kept_ops
    return (min(node.kept_flops, node.flops) + min(node.kept_bytes, node.output_bytes)
            + (op_cost if whole and node.op in RUNS_AN_OP else 0))


def _shared_gradients(nodes: Sequence[NodeStat], stage_of: Sequence[int],
                      skip_bytes: dict[int, int], count: int
                      ) -> list[tuple[int, SharedGradient]]:
    """The nodes that hand their output's gradient to a passing or long-lived storage made
    in an earlier stage, or to an input that requires grad (``skip_bytes``: their bytes by
    producing node), in graph order, each with its node."""
    n = len(nodes)
    out = []
    for u, node in enumerate(nodes[:n - 1]):
        handed = [i for i in dict.fromkeys(i for i, grad in zip(node.inputs,
                                                                 node.input_grad_bytes)
                                           if grad == 0)
                  if nodes[i].requires_grad]
        r = stage_of[u]
        inputs = tuple((stage_of[i], skip_bytes[i]) for i in handed
                       if i in skip_bytes and stage_of[i] < r)
        if not node.requires_grad or not inputs:
            continue
        # The graph's output node (``n - 1``) reads it: the model's output, read after
        # every stage.
        readers = [stage_of[v] for v in node.users if v < n - 1]
        reach = max(readers) if readers and len(readers) == len(node.users) else count
        out.append((u, SharedGradient(
            stage=r, output_reach=reach, output_grad_bytes=node.grad_bytes, inputs=inputs,
            sharers=tuple(sorted((stage_of[i], nodes[i].grad_bytes,
                                  _holds_to(nodes, stage_of, i, u)) for i in handed)))))
    return out


def _holds_to(nodes: Sequence[NodeStat], stage_of: Sequence[int], value: int, reader: int
              ) -> int:
    """The stage down to which ``value`` holds the gradient ``reader`` hands it
    (:attr:`SharedGradient.sharers`): to its next reader, whose part is added to it (a new
    buffer), or to its producer. Where a later reader ran backward first, the part is added
    to that one's at once and not held: ``reader``'s own stage."""
    users = [v for v in nodes[value].users if v < len(nodes) - 1]
    if any(v > reader for v in users):
        return stage_of[reader]
    return max((stage_of[v] for v in users if v < reader), default=stage_of[value])


def _last_reads(st: StorageStat, stage_of: Sequence[int], producer: int, n: int
                ) -> tuple[int, ...]:
    """The last node reading ``st`` in each stage after ``producer``'s, by stage."""
    last: dict[int, int] = {}
    for u in st.users:
        if u < n - 1 and stage_of[u] > producer:
            last[stage_of[u]] = max(u, last.get(stage_of[u], u))
    return tuple(last[t] for t in sorted(last))


def _backward_walk(spans: list[tuple[int, int]], grads_at: Sequence[int | None], lo: int,
                   hi: int, passing_grads: dict[int, int],
                   input_copies: dict[int, int] | None = None,
                   after_node: list[int] | None = None, at_node: list[int] | None = None
                   ) -> tuple[int, int, int]:
    """Walk the stage ``lo..hi-1`` backwards: a saved storage (``(first saver, bytes)`` in
    ``spans``) is alive until its first saver has run backward. Returns the most bytes alive
    with the gradients; the same with the gradients of the passing values made by the
    nodes already walked kept (``passing_grads``: bytes by node); and the same with a copy of
    each input's gradient from its reader's backward on (``input_copies``: bytes by
    reader). Fills ``at_node`` (by node) with the most bytes alive while that node runs
    backward, and ``after_node`` with the most once it has, to the stage's end."""
    saved_spans = sorted(spans)
    alive = sum(size for _, size in saved_spans)
    k = len(saved_spans)
    peak = frame_peak = first_peak = kept = copied = 0
    at = [0] * (hi - lo)
    for u in range(hi - 1, lo - 1, -1):
        copied += (input_copies or {}).get(u, 0)
        if grads_at[u] is not None:
            at[u - lo] = value = alive + grads_at[u]
            peak = max(peak, value)
            frame_peak = max(frame_peak, value + kept)
            first_peak = max(first_peak, value + copied)
        kept += passing_grads.get(u, 0)
        while k and saved_spans[k - 1][0] >= u:
            k -= 1
            alive -= saved_spans[k][1]
    if at_node is not None:
        at_node[lo:hi] = at
    if after_node is not None:
        running = 0
        for u in range(lo, hi):
            after_node[u] = running
            running = max(running, at[u - lo])
    return peak, frame_peak, first_peak


def _backward_grads(nodes: Sequence[NodeStat], stage_ends: Sequence[int], *,
                    grad_accumulation: bool = False) -> tuple[list[int | None], list[int]]:
    """Replay the backward over the graph, node by node in reverse, counting the gradient
    bytes alive (see NOTE [ Gradients in backward ]).

    Returns, per node, the most gradient bytes alive while its backward runs (its working set
    included), or None when it runs no backward; and per stage, the gradient bytes alive when
    backward enters it (stages are given by their ends).
    """
    n = len(nodes)
    # Which value a node really reads: an in-place op whose result the graph does not use
    # (``x.add_(y)``) makes a new autograd version that later readers of ``x`` see.
    reads: list[list[int]] = [[] for _ in range(n)]
    current: dict[int, int] = {}
    for node in nodes:
        reads[node.index] = [current.get(i, i) for i in node.inputs]
        for producer in node.mutated_inputs:
            if producer in node.inputs and not node.users:
                current[producer] = node.index
    # An input that requires grad gets its gradient too: it is alive from the first partial
    # that reaches it to the end of backward (it becomes the input's ``.grad``).
    carries = [node.requires_grad and node.op not in ("get_attr", "output") for node in nodes]
    size: dict[int, int] = {}  # buffer -> bytes
    refs: dict[int, int] = {}  # buffer -> how many values' gradients it holds
    grad_of: dict[int, int] = {}  # value -> buffer of its gradient (so far)
    alive = 0
    fresh = 0

    def new(nbytes: int) -> int:
        nonlocal alive, fresh
        fresh += 1
        size[fresh], refs[fresh] = nbytes, 1
        alive += nbytes
        return fresh

    def drop(buffer: int) -> None:
        nonlocal alive
        refs[buffer] -= 1
        if refs[buffer] == 0:
            alive -= size.pop(buffer)
            del refs[buffer]

    def receive(value: int, buffer: int) -> int:
        """Hand ``buffer`` to ``value`` as a partial gradient; the transient bytes it costs."""
        old = grad_of.get(value)
        if old is None:
            grad_of[value] = buffer
            return 0
        total = new(nodes[value].grad_bytes)  # old + partial, out of place
        drop(old)
        drop(buffer)
        grad_of[value] = total
        return size[total]

    # The backward starts from the loss's scalar gradient (the loss node's); a profile
    # without a loss node starts from a sum's, which hands each output an expanded scalar:
    # no bytes either way.
    for i in nodes[n - 1].inputs if n else ():
        if carries[i]:
            receive(i, new(0))
    grads_at: list[int | None] = [None] * n
    waiting: dict[int, list[int]] = {}  # reader -> gradient buffers that wait for it
    entry = [0] * len(stage_ends)
    last_of = {end - 1: t for t, end in enumerate(stage_ends)}
    for u in range(n - 2, -1, -1):
        if u in last_of:
            entry[last_of[u]] = alive
        node = nodes[u]
        out = grad_of.pop(u, None)
        if not carries[u] or out is None:
            if out is not None:
                drop(out)
            for buffer in waiting.pop(u, ()):
                drop(buffer)
            continue
        probed = len(node.input_grad_bytes) == len(node.inputs)
        targets = [(k, v) for k, v in enumerate(reads[u]) if carries[v]]
        if probed and grad_accumulation and node.accumulate_backward_bytes is not None:
            # Every weight gradient is a temporary there, a tied one's too.
            work = node.accumulate_backward_bytes
        elif probed:
            work = node.backward_bytes + node.summed_param_grad_bytes
        else:  # not probed: a new gradient for every input
            work = sum(nodes[v].grad_bytes for _, v in targets) + node.summed_param_grad_bytes
        peak = alive + work
        for k, v in targets:
            handed = node.input_grad_bytes[k] if probed else nodes[v].grad_bytes
            if handed:
                buffer = new(handed)
            else:
                buffer = out
                refs[out] += 1
            peak = max(peak, alive + receive(v, buffer))
        # Gradients of a shared parameter wait for its first reader's (tied embeddings).
        for nbytes, until in node.param_grad_held:
            waiting.setdefault(until, []).append(new(nbytes))
            peak = max(peak, alive + work)
        drop(out)
        for buffer in waiting.pop(u, ()):
            drop(buffer)
        grads_at[u] = peak
    return grads_at, entry


def _sweep(nodes: Sequence[NodeStat], start: int, end: int, spans: list[tuple[int, int, int]],
           stop: int | None = None, stopped_bytes: int = 0) -> int:
    """Forward peak inside the stage of nodes ``start..end-1``: storages it produced that
    are still alive (``spans`` of ``(producer, last reader, bytes)``), plus the
    working set of the node running. A storage lives from the node after its producer (the
    producer's working set covers it there) to its last reader in the stage. With ``stop``,
    only the nodes before that position run in full, and the node at ``stop`` makes only
    ``stopped_bytes`` (what it saves of its own) before the recompute ends."""
    alive = [0] * (end - start + 1)
    for producer, last, size in spans:
        if last > producer:
            alive[producer + 1 - start] += size
            alive[last + 1 - start] -= size
    peak = running = 0
    ran_to = end if stop is None else stop
    for k in range(start, ran_to):
        running += alive[k - start]
        peak = max(peak, running + nodes[k].work_bytes)
    if stopped_bytes and ran_to < end:
        peak = max(peak, running + alive[ran_to - start] + stopped_bytes)
    return peak


def _view_readers(st: StorageStat, nodes: Sequence[NodeStat], stage_of: Sequence[int],
                  spans: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The stages after ``st``'s producer's with a reader that hands it the gradient of an
    output leaving that stage (:attr:`Passing.view_readers`)."""
    n, p = len(nodes), stage_of[st.producer]
    return tuple(sorted({stage_of[u] for u in st.users
                         if u < n - 1 and stage_of[u] > p
                         and _hands_output_grad(nodes[u], st.producer)
                         and _leaves_its_stage(nodes[u], spans[stage_of[u]][1], n)}))


def _leaves_its_stage(node: NodeStat, end: int, count: int) -> bool:
    """Whether ``node``'s output is read after its stage (which ends before node ``end``)
    or is the model's output: its gradient is then handed to the stage from outside."""
    return any(u >= end for u in node.users) or not node.users or end >= count


def _hands_output_grad(node: NodeStat, producer: int) -> bool:
    """Whether ``node``'s backward hands the value of ``producer`` the gradient of its own
    output (or a view of it) rather than new storage; False where it was not probed."""
    if not node.requires_grad or not node.input_grad_bytes:
        return False
    return any(i == producer and grad == 0
               for i, grad in zip(node.inputs, node.input_grad_bytes))
