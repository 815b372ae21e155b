"""The graph as a chain of stages, its memory model, and the optimal choice of segments.

Plain numbers only (no fx): :func:`build_chain` turns a :class:`~autockpt.stats.Profile` into
a :class:`Chain`; :func:`estimate_peak` predicts the peak activation bytes of any choice of
checkpointed stage ranges; :func:`optimal_ranges` finds the choice of least recompute under a
budget, or of least peak; :func:`least_peak` says what that least peak is.

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
``H(t)`` less its own internal saved storages, plus ``backward_peak[t]``: those storages as
its ops free them, the gradients alive and the working set of the op running (NOTE
[ Gradients in backward ]). In a checkpointed segment ``[a, b]``, stage ``t`` runs its
backward with ``H(b)`` and what the recompute saved for stages ``a..t-1`` (a second copy of
every storage they save; in reentrant mode also the segment's outputs and their gradients),
plus its ``backward_peak``; the recompute itself peaks like a forward with the gradient
entering ``b`` alive. In forward
stage ``t`` peaks at what is held from earlier stages, the tensors crossing into it, and its
own working set (profiled node by node on fake tensors). The estimate is the largest of all
these. Because ``H`` only grows and every peak term depends on the choices before a cut only
through ``H`` and whether the stage before the cut is checkpointed, a dynamic programme over
cuts with Pareto frontiers of ``(H, cost)`` is exact for this model (:func:`optimal_ranges`).
"""

# NOTE [ Gradients in backward ]
# What autograd keeps alive in backward is read off the ops, not guessed from their shapes.
# The profiler runs each node once more on fake copies of the activations it reads and then
# its backward alone, from a fresh gradient of its output (autockpt.profile._probe_backward):
# the most bytes that backward holds at once (gradients of its inputs and temporaries, less
# what the node saved and has freed by then: a leaf module frees its internals op by op), and
# per input whether the gradient handed on is new storage or the output's gradient itself (an
# add passes it to both operands, a view to its base). ``_backward_grads`` then replays the
# backward over the whole graph in reverse, buffer by buffer: a gradient passed through lives
# until the last value holding it is done; a value read by several nodes (a residual stream)
# keeps its first partial gradient until the others arrive, and autograd adds them out of
# place (a new buffer, both parts freed); a gradient is freed once its producer has run
# backward. The model's outputs get what the measure's sum loss gives them: an expanded
# scalar, no bytes. A saved storage is freed once the first node that saved it has run
# backward, so a stage's saved bytes shrink as its backward goes. None of this depends on
# which stages are checkpointed (the backward runs the same ops), so each stage gets one
# number, ``backward_peak``, and the dynamic programme stays exact for the model.

from __future__ import annotations

import gc
import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from autockpt.stats import LOSS_OP, NodeStat, Profile, node_cost

__all__ = ["Stage", "Chain", "Ranges", "build_chain", "estimate_peak", "recompute_cost",
           "segment_cost", "optimal_ranges", "least_peak"]

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
    tail_cost: int = 0
    """Cost of its trailing nodes that a non-reentrant recompute ending with this stage
    skips (see NOTE [ A non-reentrant recompute stops early ])."""
    tail_flops: int = 0
    """FLOPs of those nodes."""


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
    grad_entry: tuple[int, ...]
    """Per stage: gradient bytes alive when backward enters it."""
    backward_peak: tuple[int, ...]
    """Per stage: peak of its backward over what is held from outside it: its own internal
    saved storages, each freed once the ops that saved it have run backward, plus the
    gradients alive and the working set of the op running (see NOTE [ Gradients in
    backward ])."""
    forward_plain: tuple[int, ...]
    """Per stage: its forward peak over what it receives, when not checkpointed."""
    forward_ckpt: tuple[int, ...]
    """Per stage: the same when checkpointed (what it saves is freed as it goes)."""
    forward_plain_in: tuple[int, ...]
    """Per stage: its forward peak when not checkpointed, with the tensors crossing into it
    that the stage before does not save (``cross_next``, ``cross_none``), each alive until
    its last reader in the stage (to the end of the stage when the stage saves it). At most
    ``cross_next[t] + cross_none[t] + forward_plain[t]``, which counts them alive through
    the whole stage."""
    forward_ckpt_in: tuple[int, ...]
    """The same when checkpointed, the stage not being the first of its segment (the first
    keeps its inputs for the recompute)."""
    forward_stop_in: tuple[int, ...]
    """``forward_plain_in`` of the last stage of a non-reentrant recompute, which runs only
    up to where it stops (NOTE [ A non-reentrant recompute stops early ])."""

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


# NOTE [ A non-reentrant recompute stops early ]
# Non-reentrant checkpoint stops its recompute as soon as every tensor the segment saved in
# forward has been saved again, and autograd saves an op's inputs before its kernel runs. So
# the nodes after the segment's last saving node never run again, nor does that node's kernel
# when it saves only tensors made before it (a final Linear saves its input and weight: its
# matmul is skipped). ``Stage.tail_cost`` is what a segment ending with the stage is spared;
# hand-written per-block checkpoints get this for free on every block, so a cost model
# without it would see them recompute more than they do. Reentrant checkpoint reruns the
# whole segment to get its outputs.


def _savers(profile: Profile) -> tuple[list[bool], list[bool]]:
    """Per node: whether it saves a tensor it made itself, and whether it saves any."""
    saves_own = [False] * len(profile.nodes)
    saves_any = [False] * len(profile.nodes)
    for st in profile.storages:
        for saver in st.saved_by:
            saves_any[saver] = True
            if saver == st.producer:
                saves_own[saver] = True
    return saves_own, saves_any


def _tails(profile: Profile, start: int, end: int, saves_own: Sequence[bool],
           saves_any: Sequence[bool]) -> tuple[int, int, int]:
    """Cost and FLOPs of the nodes ``start..end-1`` that a recompute ending there skips, and
    the position of the first of them (``end`` when none is skipped)."""
    cost = flops = 0
    stop = end
    for node in reversed(profile.nodes[start:end]):
        if saves_own[node.index]:
            break
        cost += node_cost(node)
        flops += node.flops
        stop = node.index
        if saves_any[node.index]:
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
    NOTE [ The loss node ] in :mod:`autockpt.profile`)."""
    nodes = profile.nodes
    return (len(nodes) - 2,) if len(nodes) >= 2 and nodes[-2].op == LOSS_OP else ()


def build_chain(profile: Profile, *, max_stages: int = MAX_STAGES,
                grad_accumulation: bool = False) -> Chain:
    """Split the graph at the candidate cuts and compute the numbers of the memory model.

    ``grad_accumulation``: the parameters' ``.grad`` exists when backward runs, so every
    weight gradient is a temporary added into it (``NodeStat.accumulate_backward_bytes``).
    """
    nodes = profile.nodes
    n = len(nodes)
    cuts = sorted({0, n - 1, *(c for c in _candidate_cuts(nodes) if c > 0), *_loss_cut(profile)})
    cuts = _merge_aliases(profile, cuts)
    cuts = _join_gradless_gaps(profile, cuts)
    cuts = _coarsen(profile, cuts, max_stages)
    count = len(cuts) - 1
    stage_of = [0] * n
    stages = []
    stops: list[int] = []  # per stage, where a non-reentrant recompute ending there stops
    saves_own, saves_any = _savers(profile)
    for s, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        members = nodes[lo:hi]
        stage_of[lo:hi] = [s] * (hi - lo)
        flops = sum(m.flops for m in members)
        tail_cost, tail_flops, stop = _tails(profile, lo, hi, saves_own, saves_any)
        stops.append(stop)
        # The loss is the user's code, never a segment: its stage carries no gradient here.
        stages.append(Stage(start=lo, end=hi, flops=flops,
                            cost=sum(node_cost(m) for m in members),
                            carries_grad=any(m.requires_grad for m in members)
                            and all(m.op != LOSS_OP for m in members),
                            tail_cost=tail_cost, tail_flops=tail_flops))
    stage_of[n - 1] = count
    internal = [0] * count
    long_held = [0] * count
    long_saved = [0] * count
    outputs = [0] * count
    prev, nxt, both, none = ([0] * (count + 1) for _ in range(4))
    # Per stage, (first node that saves it, bytes) of its internal saved storages.
    internal_spans: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    # Storages held through the forward sweep of their own stage, per kind of stage.
    held_plain: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    held_ckpt: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    # Tensors crossing into a stage, alive from its start (as if made just before it).
    received_plain: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    received_ckpt: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
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
            receiver = stages[p + 1]
            last_read = max((u for u in st.users if receiver.start <= u < receiver.end),
                            default=receiver.start)
            if not by_prev:  # what the stage before saves is held, and counted there
                received_plain[p + 1].append(
                    (receiver.start - 1, receiver.end - 1 if by_next else last_read, size))
            received_ckpt[p + 1].append((receiver.start - 1, last_read, size))
        else:
            if p in savers:
                internal[p] += size
                internal_spans[p].append((min(st.saved_by), size))
            held_plain[p].append(
                (st.producer, stages[p].end - 1 if p in savers else end_in_stage, size))
            held_ckpt[p].append((st.producer, end_in_stage, size))
    grads_at, entry = _backward_grads(nodes, [stage.end for stage in stages],
                                      grad_accumulation=grad_accumulation)
    peak = [0] * count
    for s, stage in enumerate(stages):
        # Walk the stage backwards: a saved storage is alive until the first node that saved
        # it has run its backward.
        spans = sorted(internal_spans[s])
        alive = sum(size for _, size in spans)
        k = len(spans)
        for u in range(stage.end - 1, stage.start - 1, -1):
            if grads_at[u] is not None:
                peak[s] = max(peak[s], alive + grads_at[u])
            while k and spans[k - 1][0] >= u:
                k -= 1
                alive -= spans[k][1]
    forward_plain = [_sweep(nodes, stage, held_plain[s]) for s, stage in enumerate(stages)]
    forward_ckpt = [_sweep(nodes, stage, held_ckpt[s]) for s, stage in enumerate(stages)]
    forward_plain_in = [_sweep(nodes, stage, held_plain[s] + received_plain[s])
                        for s, stage in enumerate(stages)]
    forward_ckpt_in = [_sweep(nodes, stage, held_ckpt[s] + received_ckpt[s])
                       for s, stage in enumerate(stages)]
    forward_stop_in = [_sweep(nodes, stage, held_plain[s] + received_plain[s], stops[s])
                       for s, stage in enumerate(stages)]
    return Chain(
        stages=tuple(stages), internal_saved=tuple(internal), cross_prev=tuple(prev),
        cross_next=tuple(nxt), cross_both=tuple(both), cross_none=tuple(none),
        long_held=tuple(long_held), long_saved=tuple(long_saved), output_bytes=tuple(outputs),
        grad_entry=tuple(entry[s] for s in range(count)), backward_peak=tuple(peak),
        forward_plain=tuple(forward_plain), forward_ckpt=tuple(forward_ckpt),
        forward_plain_in=tuple(forward_plain_in), forward_ckpt_in=tuple(forward_ckpt_in),
        forward_stop_in=tuple(forward_stop_in),
    )


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
    carries = [node.requires_grad and node.op not in ("get_attr", "output", "placeholder")
               for node in nodes]
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
        if probed:
            work = node.backward_bytes
            if grad_accumulation and node.accumulate_backward_bytes is not None:
                work = node.accumulate_backward_bytes
        else:  # not probed: a new gradient for every input
            work = sum(nodes[v].grad_bytes for _, v in targets)
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


def _sweep(nodes: Sequence[NodeStat], stage: Stage, spans: list[tuple[int, int, int]],
           stop: int | None = None) -> int:
    """Forward peak inside a stage: storages it produced that are still alive, plus the
    working set of the node running. A storage lives from the node after its producer (the
    producer's working set covers it there) to its last reader in the stage. With ``stop``,
    only the nodes before that position run."""
    alive = [0] * (stage.end - stage.start + 1)
    for producer, end, size in spans:
        if end > producer:
            alive[producer + 1 - stage.start] += size
            alive[end + 1 - stage.start] -= size
    peak = running = 0
    for k in range(stage.start, stage.end if stop is None else stop):
        running += alive[k - stage.start]
        peak = max(peak, running + nodes[k].work_bytes)
    return peak


# --------------------------------------------------------------------------- the model


def _running_max(values: Sequence[int]) -> list[list[int]]:
    """``out[a][k]``: the largest of ``values[a : a + k + 1]``."""
    out = []
    for a in range(len(values)):
        row = []
        best = values[a]
        for v in values[a:]:
            best = max(best, v)
            row.append(best)
        out.append(row)
    return out


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
        self.base = sum(c.output_bytes)
        # NOTE [ Gradients in backward ]: inside a checkpointed segment that starts at ``a``,
        # stage ``t`` runs its backward with the segment's recomputed storages of stages
        # ``a..t-1`` still alive (each is freed when the op that saved it has run backward),
        # the crossing storages saved at cuts ``a+1..t`` and what ``t`` saves at ``t+1``.
        # That is ``key[t] - start[a]``: the largest over a segment is a range maximum.
        pb = [c.cross_prev[k] + c.cross_both[k] for k in range(self.count + 1)]
        self.key = [self.internal[t] + self.cross_saved[t + 1] + pb[t + 1]
                    + self.long_saved[t + 1] + c.backward_peak[t] for t in range(self.count)]
        self.start = [self.internal[a] + self.cross_saved[a + 1] + self.long_saved[a]
                      for a in range(self.count)]
        # Recomputing stage t: what stages a..t-1 saved, what crosses into t, t's sweep.
        refwd = [self.internal[t] + self.cross_saved[t] + c.cross_prev[t] + c.cross_both[t]
                 + self.long_saved[t] + c.forward_plain_in[t] for t in range(self.count)]
        self.key_max = _running_max(self.key)
        self.refwd_max = _running_max(refwd)
        # Its last stage runs only up to where a non-reentrant recompute stops.
        self.refwd_last = [refwd[t] - c.forward_plain_in[t] + c.forward_stop_in[t]
                           for t in range(self.count)]

    def plain(self, t: int, before: int, held: int) -> tuple[int, int]:
        """Stage ``t`` not checkpointed: its peak, and the held bytes after it."""
        c = self.chain
        received = c.cross_next[t] + (c.cross_prev[t] + c.cross_both[t] if before == _CKPT else 0)
        after = (held + received + c.internal_saved[t] + c.long_held[t]
                 + c.cross_prev[t + 1] + c.cross_both[t + 1])
        forward = held + self.outputs[t] + c.forward_plain_in[t] + (
            c.cross_prev[t] + c.cross_both[t] if before == _CKPT else 0)
        backward = after - c.internal_saved[t] + self.base + c.backward_peak[t]
        return max(forward, backward), after

    def segment(self, a: int, b: int, held: int, inputs: int
                ) -> tuple[int, int, int]:
        """Stages ``a..b`` checkpointed: the backward peak, the held bytes after it, and a
        lower bound of the peak that never decreases as ``b`` grows.

        ``inputs`` is what ``a`` newly holds of the tensors crossing into it."""
        c = self.chain
        after = held + inputs + self.long_held[b + 1] - self.long_held[a]
        held_now = after + self.base
        lower = held_now + self.key_max[a][b - a] - self.start[a]
        recompute = self.refwd_max[a][b - a]
        if not self.reentrant:
            recompute = max(self.refwd_max[a][b - a - 1] if b > a else 0, self.refwd_last[b])
        refwd = held_now + c.grad_entry[b] + recompute - (
            self.internal[a] + self.cross_saved[a + 1] + self.long_saved[a])
        if not self.reentrant:
            return max(lower, refwd), after, lower
        # Reentrant backward re-runs the segment to its outputs and runs a backward of its
        # own through them: the recomputed outputs, their incoming gradients (accumulated from
        # every reader) and the gradients it hands on are alive at once, and its detached
        # inputs get a .grad of their own before it is handed on.
        # Three copies of what escapes the segment, one of them already among the storages
        # the recompute saves again when something saves it.
        extra = (3 * (self.long_held[b + 1] - self.long_held[a] + self.outputs[b + 1]
                      - self.outputs[a]) - (self.long_saved[b + 1] - self.long_saved[a])
                 + c.crossing(a))
        boundary = 3 * c.crossing(b + 1) - c.cross_prev[b + 1] - c.cross_both[b + 1]
        lower += extra
        return max(lower + boundary, refwd + extra), after, lower

    def peak(self, ranges: Ranges,
             backward: Callable[[int, int, int, int], int] | None = None) -> int:
        """The estimated peak with ``ranges`` checkpointed. ``backward(first, last, value,
        held)``, when given, replaces a segment's peak in backward (``value``) knowing the
        bytes ``held`` when its backward starts: nested segments price themselves there."""
        starts = {a: b for a, b in ranges}
        peak = held = 0
        before = _PLAIN
        t = 0
        while t < self.count:
            if t in starts:
                b = starts[t]
                inputs = self.segment_inputs(t, before)
                for u in range(t, b + 1):
                    peak = max(peak, self.segment_forward(t, u, held, inputs))
                value, held, _ = self.segment(t, b, held, inputs)
                if backward is not None:
                    value = backward(t, b, value, held + self.base)
                before, t = _CKPT, b + 1
            else:
                value, held = self.plain(t, before, held)
                before, t = _PLAIN, t + 1
            peak = max(peak, value)
        return peak

    def segment_inputs(self, a: int, before: int) -> int:
        c = self.chain
        fresh = c.cross_next[a] + c.cross_none[a]
        return fresh + (c.cross_prev[a] + c.cross_both[a] if before == _CKPT else 0)

    def segment_forward(self, a: int, t: int, held: int, inputs: int) -> int:
        """Forward peak of stage ``t`` inside a segment that starts at ``a``."""
        c = self.chain
        if t == a:
            return held + c.crossing(a) + self.outputs[t] + c.forward_ckpt[t]
        carried = held + inputs + self.long_held[t] - self.long_held[a]
        return carried + self.outputs[t] + c.forward_ckpt_in[t]


def estimate_peak(chain: Chain, ranges: Ranges, mode: str = "non_reentrant") -> int:
    """Estimated peak activation bytes of one forward and backward with ``ranges``
    checkpointed. See NOTE [ The memory model ].

    Example:
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_entry=(0,), backward_peak=(88,),
        ...               forward_plain=(72,), forward_ckpt=(8,), forward_plain_in=(72,),
        ...               forward_ckpt_in=(8,), forward_stop_in=(72,))
        >>> estimate_peak(chain, ())   # 64 held + 8 output + 8 gradient + 16 working set
        96
    """
    return _Model(chain, mode).peak(ranges)


def recompute_cost(chain: Chain, ranges: Ranges, mode: str = "non_reentrant") -> int:
    """Total cost of what ``ranges`` recompute (see NOTE [ A non-reentrant recompute stops
    early ])."""
    return sum(segment_cost(chain, a, b, mode) for a, b in ranges)


def segment_cost(chain: Chain, a: int, b: int, mode: str = "non_reentrant") -> int:
    """Cost of recomputing stages ``a..b`` as one segment."""
    total = sum(chain.stages[t].cost for t in range(a, b + 1))
    return total - (chain.stages[b].tail_cost if mode == "non_reentrant" else 0)


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
    bytes, cost). The least peak itself (:func:`least_peak`) needs no frontier: every peak
    term is ``held + constant``, so a backward pass over the blocks finds it.

    Example:
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_entry=(0,), backward_peak=(88,),
        ...               forward_plain=(72,), forward_ckpt=(8,), forward_plain_in=(72,),
        ...               forward_ckpt_in=(8,), forward_stop_in=(72,))
        >>> optimal_ranges(chain, 200)
        ((), 96)
    """
    model = _Model(chain, mode)
    rest = _least_suffix_peaks(model)
    if budget is None:
        budget = int(rest[(0, _PLAIN)])  # the least peak, then the cheapest plan reaching it
    with _gc_paused():
        # A quick pass that keeps only a few entries per state finds a plan that fits,
        # usually of near-least cost. Its cost bounds the exact pass: an entry that already
        # costs more can never lead to the optimum (costs only add up), and dropping it
        # changes nothing else (it dominates no cheaper entry). Same result, far smaller
        # frontiers.
        bound = None
        sketch = _solve_frontiers(model, rest, budget, width=_SKETCH_WIDTH)
        if sketch is not None:
            bound = recompute_cost(chain, sketch[0], mode)
        return _solve_frontiers(model, rest, budget, bound=bound)


def _least_suffix_peaks(model: _Model) -> dict[tuple[int, int], float]:
    """For each state ``(cut, before)`` of the programme, the least peak that the stages
    from the cut on can add to what is held there: every peak term of a block is ``held +
    constant`` and the held bytes only grow, so a backward pass over the same blocks finds
    it. ``-inf`` past the last stage."""
    chain = model.chain
    count = model.count
    rest: dict[tuple[int, int], float] = {(count, _PLAIN): -math.inf, (count, _CKPT): -math.inf}
    for i in range(count - 1, -1, -1):
        for before in (_PLAIN, _CKPT):
            value0, after0 = model.plain(i, before, 0)
            best = max(value0, after0 + rest[(i + 1, _PLAIN)])
            if chain.stages[i].carries_grad:
                inputs = model.segment_inputs(i, before)
                forward0 = 0
                for b in range(i, count):
                    if not chain.stages[b].carries_grad:
                        break
                    forward0 = max(forward0, model.segment_forward(i, b, 0, inputs))
                    value, after, _ = model.segment(i, b, 0, inputs)
                    best = min(best, max(value, forward0, after + rest[(b + 1, _CKPT)]))
            rest[(i, before)] = best
    return rest


def least_peak(chain: Chain, mode: str = "non_reentrant") -> int:
    """The least estimated peak any choice of single-level ranges reaches.

    Example:
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_entry=(0,), backward_peak=(88,),
        ...               forward_plain=(72,), forward_ckpt=(8,), forward_plain_in=(72,),
        ...               forward_ckpt_in=(8,), forward_stop_in=(72,))
        >>> least_peak(chain)
        96
    """
    return int(_least_suffix_peaks(_Model(chain, mode))[(0, _PLAIN)])


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


def _solve_frontiers(model: _Model, rest: dict[tuple[int, int], float], limit: int, *,
                     width: int | None = None, bound: int | None = None
                     ) -> tuple[Ranges, int] | None:
    """The dynamic programme under the budget ``limit``; ``rest`` is
    :func:`_least_suffix_peaks` of ``model``. ``width`` keeps at most that many entries per
    state (evenly spread over the frontier, a heuristic); ``bound`` drops entries whose cost
    exceeds it."""
    chain = model.chain
    count = model.count
    # frontier[(cut, before)] -> [(held, cost, path)]
    frontier: dict[tuple[int, int], list[_Entry]] = {(0, _PLAIN): [(0, 0, None)]}
    # An entry holding more than this at a cut cannot finish within the budget, whatever
    # comes after it: drop it before it costs a sort.
    cap = {key: limit - least for key, least in rest.items()}

    def push(key: tuple[int, int], entries: list[_Entry]) -> None:
        if entries:
            most = cap[key]
            if entries[-1][0] > most:
                entries = [e for e in entries if e[0] <= most]
                if not entries:
                    return
            frontier.setdefault(key, []).extend(entries)

    for i in range(count):
        for before in (_PLAIN, _CKPT):
            entries = frontier.pop((i, before), None)
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
            value0, after0 = model.plain(i, before, 0)
            fit = entries[:bisect_right(helds, limit - value0)]
            push((i + 1, _PLAIN), [(h + after0, sc, p) for h, sc, p in fit])
            if not chain.stages[i].carries_grad:
                continue
            inputs = model.segment_inputs(i, before)
            forward0 = 0
            total = 0
            for b in range(i, count):
                if not chain.stages[b].carries_grad:
                    break
                forward0 = max(forward0, model.segment_forward(i, b, 0, inputs))
                total += chain.stages[b].cost
                cost = total - (0 if model.reentrant else chain.stages[b].tail_cost)
                value0, after0, lower0 = model.segment(i, b, 0, inputs)
                value0 = max(value0, forward0)
                if helds[0] + max(lower0, forward0) > limit:
                    break  # the lower bound only grows with b: longer segments fail too
                hi = bisect_right(helds, limit - value0)
                lo = 0 if bound is None else bisect_left(negated, cost - bound)
                fit = entries[lo:hi]
                if fit:
                    block = (i, b)
                    push((b + 1, _CKPT), [(h + after0, sc + cost, (block, p))
                                          for h, sc, p in fit])
    finals = frontier.get((count, _PLAIN), []) + frontier.get((count, _CKPT), [])
    if not finals:
        return None
    _, _, path = min(finals, key=lambda e: (e[1], e[0]))
    ranges = _ranges(path)
    return ranges, model.peak(ranges)
