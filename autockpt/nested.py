"""Nested (re-checkpointed) segments: their memory model and the rotor dynamic programme.

Plain numbers only, like :mod:`autockpt.chain`. A nested plan is a :data:`Tree`: checkpointed
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
checkpoint runs a backward of its own inside each recompute, which the model below does not
describe.

# NOTE [ The nested memory model ]
A segment without inner segments is priced exactly as in :mod:`autockpt.chain`. For one with
inner segments the first forward is the same (nothing inside is saved), and its backward is a
walk over its stages like a little model of its own, on top of what is held outside it (its
inputs, what earlier stages hold, the model's outputs) and the gradient entering its last
stage: the recompute saves what its plain stages save, and only their inputs for the inner
segments; then backward goes through the stages in reverse, an inner segment being priced
recursively on top of what the stages before it saved. Where the single-level model is exact
about which side of a cut saves a crossing tensor or how long a long-lived one lives, this walk
takes the larger count, so it over-estimates rather than under-estimates.

# NOTE [ The rotor programme ]
Beaumont et al., "Optimal checkpointing for heterogeneous chains" (2019): ``C(s, t, m)``, the
least forward cost of running backward through stages ``s..t`` with memory ``m`` when the
input of ``s`` is held and the gradient of ``t``'s output is there. Either stage ``s`` runs and
keeps what it saves (then ``C(s + 1, t, m - kept[s])``), or stages ``s..s'-1`` run without
saving, the input of ``s'`` is kept, and ``C(s', t, m - inputs[s']) + C(s, s'-1, m)``: the
second term is the recompute of the segment ``s..s'-1``, itself planned the same way, which is
nesting. Memory is counted in slots (``_SLOTS`` per budget, sizes rounded up) and with the
simple sizes of this programme; every plan it proposes is then priced by the model above, and
the cheapest one that fits is kept.
"""

from __future__ import annotations

import math

from autockpt.chain import _CKPT, _PLAIN, Chain, Ranges, _Model, segment_cost

__all__ = ["Tree", "as_tree", "flatten_tree", "tree_depth", "tree_cost", "estimate_tree_peak",
           "nested_plans"]

Tree = tuple[tuple[int, int, "Tree"], ...]
"""Checkpointed stage ranges ``(first, last, inner)``, sorted and disjoint, where ``inner`` is
the tree of ranges checkpointed again inside ``first..last``."""


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


def tree_cost(chain: Chain, tree: Tree) -> int:
    """Recompute cost: every range's stages run once more per range they are in (less what
    each non-reentrant recompute skips at its end)."""
    return sum(segment_cost(chain, a, b) for a, b, _ in flatten_tree(tree))


def as_tree(ranges: Ranges) -> Tree:
    """Single-level ranges as a tree."""
    return tuple((a, b, ()) for a, b in ranges)


def estimate_tree_peak(chain: Chain, tree: Tree) -> int:
    """Estimated peak activation bytes of one forward and backward with the nested plan
    ``tree`` (non-reentrant mode); equal to :func:`~autockpt.chain.estimate_peak` for a
    single-level plan. See NOTE [ The nested memory model ].

    Example:
        >>> from autockpt.chain import Stage
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_entry=(0,), backward_peak=(88,),
        ...               forward_plain=(72,), forward_ckpt=(8,), forward_plain_in=(72,),
        ...               forward_ckpt_in=(8,), forward_stop_in=(72,))
        >>> estimate_tree_peak(chain, ())
        96
    """
    model = _Model(chain, "non_reentrant")
    inner_of = {a: inner for a, _, inner in tree}

    def backward(a: int, b: int, value: int, held: int) -> int:
        inner = inner_of[a]
        return _nested_backward(model, a, b, inner, held) if inner else value

    return model.peak(tuple((a, b) for a, b, _ in tree), backward)


def _nested_backward(model: _Model, a: int, b: int, inner: Tree, outside: int) -> int:
    """Peak of the recompute and backward of segment ``a..b`` with ``inner`` checkpointed
    again, on top of ``outside`` bytes (everything held when its backward starts)."""
    c = model.chain
    grad = c.grad_entry[b]
    starts = {x: (y, tree) for x, y, tree in inner}
    peak = 0
    saved = 0  # what the recompute has saved so far
    before = _CKPT  # the segment's inputs are held as checkpoint inputs, not saved again
    steps: list[tuple[int, int, Tree, int, int]] = []  # (first, last, inner, saved before, inputs)
    t = a
    while t <= b:
        if t in starts:
            d, tree = starts[t]
            inputs = 0 if t == a else model.segment_inputs(t, before)
            for u in range(t, d + 1):
                # As in ``_Model.segment_forward``: at its first stage the inputs are what
                # crosses into it, counted once.
                if u == t:
                    carried = c.crossing(u) + c.forward_ckpt[u]
                else:
                    carried = (inputs + model.long_held[u] - model.long_held[t]
                               + c.forward_ckpt_in[u])
                peak = max(peak, outside + grad + saved + carried)
            steps.append((t, d, tree, saved, inputs))
            saved += inputs + model.long_saved[d + 1] - model.long_saved[t]
            before, t = _CKPT, d + 1
        else:
            received = 0 if t == a else c.cross_next[t] + (
                c.cross_prev[t] + c.cross_both[t] if before == _CKPT else 0)
            if t == a:  # what crosses into it is held as the segment's inputs
                working = c.forward_plain[t]
            else:
                working = (c.forward_stop_in[t] if t == b else c.forward_plain_in[t]) + (
                    c.cross_prev[t] + c.cross_both[t] if before == _CKPT else 0)
            peak = max(peak, outside + grad + saved + working)
            steps.append((t, t, (), saved, -1))
            saved += (received + c.internal_saved[t] + c.long_saved[t]
                      + c.cross_prev[t + 1] + c.cross_both[t + 1])
            before, t = _PLAIN, t + 1
    # Backward, last stage first: only what the steps before the current one saved is alive.
    ends = [s[3] for s in steps[1:]] + [saved]
    for (x, y, tree, saved_before, inputs), saved_after in zip(steps, ends):
        if inputs < 0:  # a plain stage
            value = outside + saved_after - c.internal_saved[x] + c.backward_peak[x]
        else:
            held = outside - model.base + saved_before
            value, after, _ = model.segment(x, y, held, inputs)
            if tree:
                value = max(value, _nested_backward(model, x, y, tree, after + model.base))
        peak = max(peak, value)
    return peak


# --------------------------------------------------------------------------- the programme


_SLOTS = 160
"""Memory resolution of the rotor programme: the budget range is cut into this many slots."""


def _sizes(chain: Chain) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per stage, in bytes: what a checkpoint starting there keeps, what the stage keeps
    when it runs saving, its forward need without saving, and its need when run saving."""
    c = chain
    count = len(c.stages)
    keep_input = [c.crossing(t) for t in range(count)]
    kept = [c.internal_saved[t] + c.cross_next[t] + c.cross_prev[t + 1] + c.cross_both[t + 1]
            + c.long_held[t] for t in range(count)]
    forward_ck = [c.crossing(t) + c.forward_ckpt[t] + c.grad_entry[t] for t in range(count)]
    need = [max(c.crossing(t) + c.forward_plain[t],
                kept[t] - c.internal_saved[t] + c.backward_peak[t]) + c.grad_entry[t]
            for t in range(count)]
    return keep_input, kept, forward_ck, need


def nested_plans(chain: Chain, span: int) -> list[tuple[int, int, Tree]]:
    """Nested plans found by the rotor programme for memory up to ``span`` bytes (see NOTE
    [ The rotor programme ]), each as ``(estimated peak, recompute cost, tree)``, from the
    most memory to the least, without repeats.

    Example:
        >>> from autockpt.chain import Stage
        >>> chain = Chain(stages=(Stage(0, 1, 1, 1, True),), internal_saved=(64,),
        ...               cross_prev=(0, 0), cross_next=(0, 0), cross_both=(0, 0),
        ...               cross_none=(0, 0), long_held=(0,), long_saved=(0,),
        ...               output_bytes=(8,), grad_entry=(0,), backward_peak=(88,),
        ...               forward_plain=(72,), forward_ckpt=(8,), forward_plain_in=(72,),
        ...               forward_ckpt_in=(8,), forward_stop_in=(72,))
        >>> nested_plans(chain, 200)
        [(96, 0, ())]
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
    cost = [chain.stages[t].cost for t in range(count)]
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
    for length in range(1, count):
        for s in range(count - length):
            t = s + length
            best = np.full(width, inf)
            pick = np.full(width, -2, dtype=np.int32)
            lo = max(ns[s], ks[s])
            if lo < width:
                option = np.full(width, inf)
                option[lo:] = cost[s] + table[s + 1, t, lo - ks[s]:width - ks[s]]
                better = option < best
                best[better], pick[better] = option[better], -1
            forward_need = 0
            run_cost = 0
            for split in range(s + 1, t + 1):
                if not grad[split - 1]:
                    break  # a checkpoint cannot cover a stage that carries no gradient
                forward_need = max(forward_need, fs[split - 1])
                run_cost += cost[split - 1]
                lo = max(forward_need, xs[split])
                if lo >= width:
                    break
                option = np.full(width, inf)
                option[lo:] = (run_cost + table[split, t, lo - xs[split]:width - xs[split]]
                               + table[s, split - 1, lo:])
                better = option < best
                best[better], pick[better] = option[better], split
            table[s, t] = best
            choice[s, t] = pick

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
