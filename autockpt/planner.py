"""Stage 3: choose which stretches of the graph to checkpoint, on plain numbers.

The planner reads a :class:`~autockpt.stats.Profile` (numbers about nodes and storages, no fx)
and returns a :class:`Plan`. It works in three steps:

1. **Cut points.** A cut between two nodes is a candidate where few gradient-carrying tensors
   cross it (the articulation points of the data flow: block boundaries of a ResNet or a
   transformer, every layer of an MLP). Tensors that carry no gradient (an attention mask built
   from token ids) do not count, so a mask that every layer reads does not prevent cutting.
   Cuts are never placed where a container of tensors crosses (reentrant checkpoint would lose
   their gradients) or between a tensor and an in-place op on it.
2. **Stages.** The candidate cuts split the graph into a chain of stages.
3. **Segments.** A strategy picks ranges of consecutive stages to checkpoint, and
   :func:`estimate_peak` predicts the peak activation memory of any choice.

# NOTE [ The memory model ]
A storage is *held* for backward by every stage that saves it and is not checkpointed, and by
every checkpointed segment that reads it as an input (checkpoint keeps its inputs for the
recompute). Backward runs the stages in reverse; a storage is freed once the earliest stage
that holds it is done. So while backward is at stage ``t`` the held storages whose earliest
holder is ``<= t`` are alive. When backward reaches a checkpointed segment it recomputes the
segment, which allocates again every storage the segment produces and saves (a second copy,
even where the first is still held elsewhere) and the segment's outputs. On top come gradients:
those of the tensors that cross into the stage from later stages, and a working pair (gradient
of an op's output and of its input) of the stage's largest op. Forward is modelled the same
way: what is held so far, what is still to be read, and the working pair. The estimate is the
largest of these numbers; ``tests/test_budget.py`` compares it with measured peaks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autockpt.errors import InfeasibleBudgetError, InvalidArgumentError
from autockpt.stats import NodeStat, Profile

__all__ = [
    "Segment",
    "Plan",
    "Stage",
    "Chain",
    "build_chain",
    "estimate_peak",
    "make_plan",
    "STRATEGIES",
    "MODES",
]

MODES = ("non_reentrant", "reentrant")


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
    tensor input that requires grad (without it, those parameters would get no gradient)."""
    preserve_rng: bool
    """Whether it contains random ops, so the RNG state is stashed and replayed."""
    buffers: tuple[str, ...]
    """Buffers its modules update in forward; the runtime restores them after a recompute so
    that BatchNorm statistics are updated once."""
    reason: str = ""
    """Why it is not checkpointed (empty for checkpointed segments)."""


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
    """The smallest estimated peak the strategy can reach for this model and input size."""
    forward_flops: int
    """FLOPs of one forward pass."""
    recompute_flops: int
    """FLOPs recomputed in backward under this plan."""
    node_count: int
    """Number of nodes of the traced graph (a plan only fits the graph it was made for)."""
    segments: tuple[Segment, ...]
    """The checkpointed segments, in graph order."""
    skipped: tuple[Segment, ...] = ()
    """Stretches of the graph left un-checkpointed on purpose, each with its reason."""
    graph_fingerprint: str = ""
    """A hash of the traced graph's node names and targets."""
    notes: tuple[str, ...] = field(default=())
    """Remarks for the reader (why nothing was checkpointed, for example)."""

    @property
    def recompute_ratio(self) -> float:
        """Recomputed FLOPs as a fraction of one forward pass."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def __str__(self) -> str:
        from autockpt.report import format_plan

        return format_plan(self)


@dataclass(frozen=True)
class Stage:
    """A run of graph nodes between two candidate cuts."""

    start: int
    """Position of its first node."""
    end: int
    """Position one past its last node."""
    cost: int
    """Cost of recomputing it: FLOPs plus bytes written (memory-bound ops are not free)."""
    flops: int
    """FLOPs of its nodes."""
    carries_grad: bool
    """Whether any of its nodes produces a tensor that requires grad."""
    work_bytes: int
    """Backward working set: for its largest gradient-carrying node, the gradients of the
    node's output and input, or the node's forward working set if larger (a leaf module's
    backward allocates about what its forward did)."""


@dataclass(frozen=True)
class _StorageRow:
    size: int
    producer: int  # stage
    savers: tuple[int, ...]  # stages
    users: tuple[int, ...]  # stages (output node excluded)
    last_use: int  # stage; -1 if unused
    is_output: bool
    requires_grad: bool
    producer_node: int
    last_use_node: int  # the producer itself if nothing reads it


@dataclass(frozen=True)
class Chain:
    """The graph as a chain of stages, with its storages expressed in stage positions."""

    stages: tuple[Stage, ...]
    storages: tuple[_StorageRow, ...]
    grad_cross_bytes: tuple[int, ...]
    """Per stage: bytes of gradient-carrying storages alive across its end, outputs included
    (their gradients are alive when backward enters the stage)."""
    node_work: tuple[int, ...]
    """Per graph node: its forward working set in bytes."""


# --------------------------------------------------------------------------- cut points


def _candidate_cuts(nodes: Sequence[NodeStat]) -> list[int]:
    """Positions ``c`` where a cut before node ``c`` is allowed and cheap."""
    n = len(nodes)
    last = n - 1  # the output node
    first = 1 + max((s.index for s in nodes if s.op == "placeholder"), default=-1)
    forbidden = [False] * (n + 1)
    grad_count = [0] * (n + 1)
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
    running_forbid = running_grad = 0
    for c in range(n + 1):
        running_forbid += diff_forbid[c]
        running_grad += diff_grad[c]
        forbidden[c] = running_forbid > 0
        grad_count[c] = running_grad
    allowed = [c for c in range(first, last) if not forbidden[c]]
    positive = [grad_count[c] for c in allowed if grad_count[c] > 0]
    threshold = max(1, min(positive, default=1))
    return [c for c in allowed if grad_count[c] <= threshold]


def build_chain(profile: Profile) -> Chain:
    """Split the graph into stages at the candidate cuts and restate storages per stage."""
    nodes = profile.nodes
    n = len(nodes)
    cuts = [0] + [c for c in _candidate_cuts(nodes) if c > 0] + [n - 1]
    cuts = sorted(set(cuts))
    stage_of = [0] * n
    stages = []
    for s, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        members = nodes[lo:hi]
        for i in range(lo, hi):
            stage_of[i] = s
        flops = sum(m.flops for m in members)
        stages.append(
            Stage(
                start=lo,
                end=hi,
                cost=flops + sum(m.output_bytes for m in members),
                flops=flops,
                carries_grad=any(m.requires_grad for m in members),
                work_bytes=max(
                    (max(2 * m.output_bytes, m.work_bytes) for m in members if m.requires_grad),
                    default=0,
                ),
            )
        )
    stage_of[n - 1] = len(stages)  # the output node sits after the last stage
    rows = []
    for st in profile.storages:
        users = tuple(sorted({stage_of[u] for u in st.users if u < n - 1}))
        rows.append(
            _StorageRow(
                size=st.size_bytes,
                producer=stage_of[st.producer],
                savers=tuple(sorted({stage_of[u] for u in st.saved_by})),
                users=users,
                last_use=max(users, default=-1),
                is_output=st.is_output,
                requires_grad=st.requires_grad,
                producer_node=st.producer,
                last_use_node=max([u for u in st.users if u < n - 1], default=st.producer),
            )
        )
    cross = [0] * (len(stages) + 1)
    for row in rows:
        last = len(stages) if row.is_output else row.last_use
        if row.requires_grad and last > row.producer:
            for t in range(row.producer, last):
                cross[t] += row.size
    return Chain(
        stages=tuple(stages),
        storages=tuple(rows),
        grad_cross_bytes=tuple(cross),
        node_work=tuple(node.work_bytes for node in nodes),
    )


# --------------------------------------------------------------------------- memory model


Ranges = tuple[tuple[int, int], ...]
"""Checkpointed segments as inclusive ``(first_stage, last_stage)`` pairs, sorted, disjoint."""


def estimate_peak(chain: Chain, ranges: Ranges, mode: str = "non_reentrant") -> int:
    """Estimated peak activation bytes of one forward and backward with ``ranges``
    checkpointed. See NOTE [ The memory model ]."""
    count = len(chain.stages)
    seg_start = [-1] * (count + 1)
    seg_end = [-1] * (count + 1)
    for a, b in ranges:
        for t in range(a, b + 1):
            seg_start[t] = a
            seg_end[t] = b
    held_from = [0] * (count + 1)  # bytes whose earliest holder is stage t
    nodes = len(chain.node_work)
    alive = [0] * (nodes + 1)  # bytes alive in forward, by node (difference array)
    recompute = {a: 0 for a, _ in ranges}
    for row in chain.storages:
        first_holder = count + 1
        for t in row.savers:
            a = seg_start[t]
            if a < 0:
                first_holder = min(first_holder, t)
            elif row.producer < a:
                first_holder = min(first_holder, a)
        for u in row.users:
            a = seg_start[u]
            if a >= 0 and row.producer < a:
                first_holder = min(first_holder, a)
        if row.is_output:
            first_holder = 0
        p = row.producer
        a = seg_start[p]
        if a >= 0:
            b = seg_end[p]
            saved_inside = any(t <= b for t in row.savers)
            escapes = row.last_use > b or row.is_output
            if saved_inside or (escapes and mode == "reentrant"):
                recompute[a] += row.size
        held = first_holder <= count
        if held:
            held_from[first_holder] += row.size
        # In forward a storage lives from the node after its producer (the producer's own
        # working set covers it there) to its last reader, or to the end if it is held.
        end = nodes - 1 if held else row.last_use_node
        if end > row.producer_node:
            alive[row.producer_node + 1] += row.size
            alive[end + 1] -= row.size
    peak = 0
    running = 0
    for k in range(nodes):
        running += alive[k]
        peak = max(peak, running + chain.node_work[k])
    live = sum(held_from)
    t = count - 1
    while t >= 0:
        a = seg_start[t]
        if a >= 0:
            work = max(chain.stages[u].work_bytes for u in range(a, t + 1))
            grads = max(chain.grad_cross_bytes[u] for u in range(a, t + 1))
            peak = max(peak, live + recompute[a] + grads + work)
            for u in range(t, a - 1, -1):
                live -= held_from[u]
            t = a - 1
        else:
            peak = max(peak, live + chain.grad_cross_bytes[t] + chain.stages[t].work_bytes)
            live -= held_from[t]
            t -= 1
    return peak


def _cost(chain: Chain, ranges: Ranges) -> int:
    return sum(chain.stages[t].cost for a, b in ranges for t in range(a, b + 1))


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
    total = sum(chain.stages[t].work_bytes + 1 for a, b in runs for t in range(a, b + 1))
    if not runs or k <= 0:
        return []
    share = total / k
    groups: list[tuple[int, int]] = []
    for a, b in runs:
        start, acc = a, 0.0
        for t in range(a, b + 1):
            acc += chain.stages[t].work_bytes + 1
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
    cost = _cost(chain, ranges)
    while True:
        best = None
        for option in _moves(ranges):
            option_cost = _cost(chain, option)
            if option_cost >= cost or (best is not None and option_cost >= best[0]):
                continue
            if estimate_peak(chain, option, mode) <= budget:
                best = (option_cost, option)
        if best is None:
            return ranges
        cost, ranges = best


Strategy = Callable[[Chain, "int | None", str], tuple[Ranges, int]]


def _choose(chain: Chain, budget: int | None, mode: str, refine: bool) -> tuple[Ranges, int]:
    scored = [(estimate_peak(chain, r, mode), _cost(chain, r), r) for r in _candidates(chain)]
    min_peak = min(peak for peak, _, _ in scored)
    if budget is None:
        _, _, ranges = min(scored, key=lambda item: (item[0], item[1]))
        return ranges, min_peak
    feasible = [item for item in scored if item[0] <= budget]
    if not feasible:
        return (), min_peak
    _, _, ranges = min(feasible, key=lambda item: (item[1], item[0]))
    if refine:
        ranges = _refine(chain, ranges, budget, mode)
    return ranges, min_peak


def _greedy(chain: Chain, budget: int | None, mode: str) -> tuple[Ranges, int]:
    return _choose(chain, budget, mode, refine=True)


def _sqrt(chain: Chain, budget: int | None, mode: str) -> tuple[Ranges, int]:
    """Chen et al.'s rule: about sqrt(n) equal segments, the last one left alone."""
    grad_stages = sum(b - a + 1 for a, b in _grad_runs(chain))
    groups = _split_balanced(chain, max(1, round(math.sqrt(grad_stages))))
    ranges = tuple(groups[:-1]) if len(groups) > 1 else tuple(groups)
    return ranges, estimate_peak(chain, ranges, mode)


STRATEGIES: dict[str, Strategy] = {"greedy": _greedy, "sqrt": _sqrt}
"""Segment-choosing strategies by name."""


# --------------------------------------------------------------------------- the plan


def make_plan(
    profile: Profile,
    budget_bytes: int | None,
    *,
    strategy: str = "greedy",
    mode: str = "non_reentrant",
    model: str = "",
) -> Plan:
    """Plan checkpoint segments for ``profile`` under ``budget_bytes``.

    Example:
        >>> from autockpt.stats import NodeStat, Profile, StorageStat
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
    chain = build_chain(profile)
    baseline = estimate_peak(chain, (), mode)
    if budget_bytes is not None and baseline <= budget_bytes and strategy != "sqrt":
        ranges, min_peak = (), None
    else:
        ranges, min_peak = STRATEGIES[strategy](chain, budget_bytes, mode)
    estimated = estimate_peak(chain, ranges, mode)
    if budget_bytes is not None and estimated > budget_bytes:
        floor = min_peak if min_peak is not None else estimated
        raise InfeasibleBudgetError(
            f"{model or 'the model'} needs at least {_mib(floor)} of activation memory at "
            f"inputs ({profile.input_signature}); the budget is {_mib(budget_bytes)}",
            budget_bytes=budget_bytes,
            min_feasible_bytes=floor,
        )
    if min_peak is None:
        min_peak = min(estimate_peak(chain, r, mode) for r in _candidates(chain))
    segments, skipped = _describe(profile, chain, ranges, mode, budget_bytes)
    notes = []
    if not ranges:
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
        node_count=len(profile.nodes),
        segments=segments,
        skipped=skipped,
        notes=tuple(notes),
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _describe(
    profile: Profile, chain: Chain, ranges: Ranges, mode: str, budget_bytes: int | None
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """Turn stage ranges into Segment rows, and the stretches between them into skipped rows."""
    nodes = profile.nodes
    stages = chain.stages
    segments = []
    for a, b in ranges:
        start, end = stages[a].start, stages[b].end
        members = nodes[start:end]
        inside = set(range(start, end))
        inputs = [st for st in profile.storages if st.producer < start and any(u in inside for u in st.users)]
        freed = sum(
            st.size_bytes
            for st in profile.storages
            if st.producer in inside and any(s in inside for s in st.saved_by)
        )
        input_grad = any(st.requires_grad for st in inputs) or any(
            nodes[i].requires_grad and nodes[i].output_kind == "tensor" and nodes[i].op == "placeholder"
            for m in members
            for i in m.inputs
            if i < start
        )
        segments.append(
            _segment(
                members,
                checkpointed=True,
                boundary_bytes=sum(st.size_bytes for st in inputs),
                freed_bytes=freed,
                recompute_flops=sum(m.flops for m in members),
                dummy_arg=mode == "reentrant"
                and not input_grad
                and any(m.trainable for m in members),
                reason="",
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
        members = nodes[stages[t].start : stages[u].end]
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

