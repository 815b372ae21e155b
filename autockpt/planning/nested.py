"""Nested (re-checkpointed) segments: the rotor dynamic programme that proposes them.

Plain numbers only. A nested plan is a :data:`~autockpt.planning.memory_model.Tree`: checkpointed
stage ranges, each with the ranges checkpointed again inside it. Backward recomputes an outer
segment once; the inner segments then run without saving during that recompute and are
recomputed a second time when backward reaches them, so a stage at depth ``d`` runs forward
``d + 1`` times. That is what buys memory below the least a single level of segments reaches.

# NOTE [ Where nesting pays ]
With one level of segments the peak cannot go below the inputs every segment keeps plus the
recompute of the longest one; on a chain of ``n`` equal stages that is about ``2 * sqrt(n)``
stages' worth. Re-checkpointing inside the longest segments lowers it further at the price of
a third forward of those stages. So the planner only turns to nested plans when a budget is
below the least peak of single-level plans (``strategy="optimal"``), or when asked
(``strategy="nested"``). Nested plans are made in non-reentrant mode only: reentrant
checkpoint runs a backward of its own inside each recompute, which the nested memory model
(NOTE [ The nested memory model ] in :mod:`autockpt.planning.memory_model`) does not describe.

# NOTE [ The rotor programme ]
Beaumont et al., "Optimal checkpointing for heterogeneous chains" (2019): ``C(s, t, m)``, the least
forward cost of running backward through stages ``s..t`` with memory ``m`` when the input of ``s``
is held and the gradient of ``t``'s output is there. Either stage ``s`` runs and keeps what it saves
(then ``C(s + 1, t, m - kept[s])``), or stages ``s..s'-1`` run without saving, the input of ``s'``
is kept, and ``C(s', t, m - inputs[s']) + C(s, s'-1, m)``: the second term is the recompute of the
segment ``s..s'-1``, itself planned the same way, which is nesting. Memory is counted in slots
(``_SLOTS`` per budget, sizes rounded up) and with the simple sizes of this programme; every plan it
proposes is then priced by the nested memory model
(:func:`~autockpt.planning.memory_model.estimate_tree_peak`), and the cheapest one that fits is
kept.
"""

from __future__ import annotations

import math

from autockpt.planning.chain import Chain
from autockpt.planning.memory_model import Tree, estimate_tree_peak, tree_cost

__all__ = ["nested_plans"]


_SLOTS = 160
"""Memory resolution of the rotor programme: the budget range is cut into this many slots."""


def _sizes(chain: Chain) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per stage, in bytes: what a checkpoint starting there keeps, what the stage keeps
    when it runs saving, its forward need without saving, and its need when run saving."""
    stages, cuts = chain.stages, chain.cuts
    keep_input = [cuts[t].crossing_bytes for t in range(len(stages))]
    kept = [s.saved_bytes + cuts[t].saved_by_reader_bytes + cuts[t + 1].producer_saved_bytes
            + s.long_lived_bytes for t, s in enumerate(stages)]
    forward_ck = [cuts[t].crossing_bytes + s.forward.checkpointed_bytes + s.grad_entry_bytes
                  for t, s in enumerate(stages)]
    need = [max(cuts[t].crossing_bytes + s.forward.plain_bytes,
                kept[t] - s.saved_bytes + s.backward_peak_bytes) + s.grad_entry_bytes
            for t, s in enumerate(stages)]
    return keep_input, kept, forward_ck, need


def _splits(s: int, t: int, grad: list[bool], fs: list[int], xs: list[int], width: int
            ) -> int:
    """How many checkpoints ``s..split-1`` (``split`` from ``s + 1``) the programme may try
    for stages ``s..t``: none covers a stage that carries no gradient, and none needs more
    slots in forward (or to keep the next input) than there are."""
    forward_need = 0
    count = 0
    for split in range(s + 1, t + 1):
        if not grad[split - 1]:
            break
        forward_need = max(forward_need, fs[split - 1])
        if max(forward_need, xs[split]) >= width:
            break
        count += 1
    return count


def nested_plans(chain: Chain, span: int, *, overhead: bool = True
                 ) -> list[tuple[int, int, Tree]]:
    """Nested plans found by the rotor programme for memory up to ``span`` bytes (see NOTE
    [ The rotor programme ]), each as ``(estimated peak, recompute cost, tree)``, from the
    most memory to the least, without repeats. ``overhead=False``: the programme chooses by
    the stages' arithmetic alone, without the chain's cost per segment and per op (the
    trees are still priced with them).
    """
    import numpy as np  # a dependency of autockpt (pyproject.toml); imported when needed

    count = len(chain.stages)
    slot = max(1, math.ceil(span / _SLOTS))

    def slots(num_bytes: int) -> int:
        return -(-num_bytes // slot)

    keep_input, kept, forward_ck, need = _sizes(chain)
    xs = [slots(v) for v in keep_input]
    ks = [slots(v) for v in kept]
    fs = [slots(v) for v in forward_ck]
    ns = [slots(v) for v in need]
    cost = [chain.stages[t].cost - (0 if overhead else chain.stages[t].ops * chain.op_cost)
            for t in range(count)]
    per_segment = chain.segment_cost if overhead else 0
    grad = [chain.stages[t].carries_grad for t in range(count)]
    width = _SLOTS + 1
    inf = math.inf
    table = np.full((count, count, width), inf)
    # choice: -1 runs stage s saving; s' > s checkpoints s..s'-1 and keeps the input of s'.
    choice = np.full((count, count, width), -2, dtype=np.int32)
    for s in range(count):
        lo = ns[s]
        if lo < width:
            table[s, s, lo:] = cost[s]
            choice[s, s, lo:] = -1
    columns = np.arange(width)
    for length in range(1, count):
        for s in range(count - length):
            t = s + length
            # Row 0 runs stage s saving; row k >= 1 checkpoints s..s+k-1 and keeps the input
            # of s+k. The first least row wins a tie, as a loop over them in this order would.
            options = np.full((length + 1, width), inf)
            lo = max(ns[s], ks[s])
            if lo < width:
                options[0, lo:] = cost[s] + table[s + 1, t, lo - ks[s]:width - ks[s]]
            splits = _splits(s, t, grad, fs, xs, width)
            if splits:
                rows = np.arange(s + 1, s + 1 + splits)
                forward_need = np.maximum.accumulate(np.asarray(fs[s:s + splits]))
                run_cost = np.cumsum(np.asarray(cost[s:s + splits], dtype=float))
                shift = np.asarray(xs[s + 1:s + 1 + splits])
                lows = np.maximum(forward_need, shift)
                source = columns[None, :] - shift[:, None]
                kept_part = table[rows[:, None], t, np.maximum(source, 0)]
                options[1:1 + splits] = np.where(
                    columns[None, :] >= lows[:, None],
                    (run_cost[:, None] + per_segment + kept_part)
                    + table[s, rows - 1, :], inf)
            pick = np.argmin(options, axis=0)
            best = options[pick, columns]
            table[s, t] = best
            choice[s, t] = np.where(np.isfinite(best), np.where(pick == 0, -1, s + pick), -2)

    def rebuild(s: int, t: int, m: int) -> Tree:
        nodes: list[tuple[int, int, Tree]] = []
        while True:
            split = int(choice[s, t, m])
            if split == -1:
                if s == t:
                    return tuple(nodes)
                m -= ks[s]
                s += 1
                continue
            nodes.append((s, split - 1, rebuild(s, split - 1, m)))
            m -= xs[split]
            s = split

    found: list[tuple[int, int, Tree]] = []
    seen: set[Tree] = set()
    for m in range(width - 1, -1, -1):
        if not math.isfinite(table[0, count - 1, m]):
            break
        tree = rebuild(0, count - 1, m)
        if tree not in seen:
            seen.add(tree)
            found.append((estimate_tree_peak(chain, tree), tree_cost(chain, tree), tree))
    return found
