"""The modules rung, planned: the planner of traced graphs run on the blocks' profile.

:func:`plan_modules` hands the profile :func:`autockpt.profiling.blocks.profile_modules` made
to :func:`autockpt.planning.planner.make_plan` (strategies, budgets and
``InfeasibleBudgetError`` work as for a traced graph) and :func:`blocks_of_plan` maps the
plan's checkpointed node ranges back to blocks; :func:`build` does both.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from torch import nn

from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.planning.overhead import NO_OVERHEAD, Overhead
from autockpt.planning.planner import MODES, Plan, make_plan
from autockpt.profiling.blocks import ModuleProfile, profile_modules
from autockpt.profiling.stats import assume_loss

__all__ = ["blocks_of_plan", "build", "plan_modules"]

def plan_modules(prof: ModuleProfile, budget_bytes: int | None, *, strategy: str = "optimal",
                 mode: str = "non_reentrant", grad_accumulation: bool = False,
                 overhead: Overhead = NO_OVERHEAD) -> Plan:
    """Plan which blocks of ``prof`` to checkpoint under ``budget_bytes``, with the planner
    of traced graphs (:func:`autockpt.planning.planner.make_plan`) run on the chain's profile.

    The plan's segments are ranges of positions in ``prof.profile.nodes`` that cover blocks
    only (see NOTE [ Glue is not checkpointable ]); :func:`blocks_of_plan` names them.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> prof = profile_modules(net, (torch.randn(4, 8),))
        >>> plan_modules(prof, None).node_count == len(prof.profile.nodes)
        True

    Raises:
        InfeasibleBudgetError: no choice of blocks fits; ``min_feasible_bytes`` says what does.
        InvalidArgumentError: an unknown strategy or mode.
    """
    stats = prof.profile
    if mode == "reentrant":
        # Reentrant backward re-runs a block to its outputs and backpropagates through them
        # on its own: the recomputed outputs, their gradients and the gradients of its
        # detached inputs are alive at once. The memory model counts these from the tensors
        # crossing a segment's ends, but a block's hand-offs are long-lived here (NOTE [ One
        # checkpoint per block ]), so they are added to the block's working set.
        handed = [0] * len(stats.nodes)
        for st in stats.storages:
            if any(u > st.producer for u in st.users):
                handed[st.producer] += st.size_bytes
        nodes = list(stats.nodes)
        for k, index in enumerate(prof.block_nodes):
            extra = 2 * handed[index] + prof.call(prof.blocks[k]).input_bytes
            nodes[index] = replace(nodes[index], work_bytes=nodes[index].work_bytes + extra)
        stats = replace(stats, nodes=tuple(nodes))
    # Without a graph the loss cannot run with the model: price what any loss sends back.
    stats = assume_loss(stats)
    plan = make_plan(stats, budget_bytes, strategy=strategy, mode=mode, model=prof.model,
                     nesting=False, grad_accumulation=grad_accumulation, overhead=overhead)
    nodes = prof.profile.nodes
    position = {node: k for k, node in enumerate(prof.block_nodes)}
    segments = []
    for seg in plan.segments:
        members = [position[i] for i in range(seg.start, seg.end) if i in position]
        if len(members) != seg.end - seg.start:
            raise AutockptError(
                f"internal error: a segment of the module-level plan covers glue "
                f"({seg.first_node} .. {seg.last_node})",
                fix="please report this with the model; pass strategy='sqrt' meanwhile")
        dummy = any(needs_dummy(prof, k, mode) for k in members)
        segments.append(replace(seg, dummy_arg=dummy))
    skipped = []
    for seg in plan.skipped:
        if any(nodes[i].target == "glue" for i in range(seg.start, seg.end)):
            seg = replace(seg, reason="code between blocks: module-level checkpointing "
                                      "cannot wrap it")
        skipped.append(seg)
    digest = hashlib.sha256("|".join((prof.model, *prof.blocks, *(n.name for n in nodes)))
                            .encode()).hexdigest()[:16]
    return replace(plan, segments=tuple(segments), skipped=tuple(skipped),
                   graph_fingerprint=digest, notes=plan.notes + prof.notes)


def needs_dummy(prof: ModuleProfile, block: int, mode: str) -> bool:
    """Whether block number ``block`` of ``prof`` gets the reentrant dummy argument: it has
    trainable parameters and no tensor argument that requires grad."""
    return (mode == "reentrant" and prof.call(prof.blocks[block]).trainable
            and not prof.block_inputs_grad[block])


def blocks_of_plan(prof: ModuleProfile, plan: Plan) -> tuple[str, ...]:
    """Qualified names of the blocks ``plan`` checkpoints, in execution order.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        ...                       for _ in range(4)])
        >>> prof = profile_modules(net, (torch.randn(4, 8),))
        >>> blocks_of_plan(prof, plan_modules(prof, None))
        ('0', '1', '2')

    Raises:
        AutockptError: ``plan`` was not made from ``prof``.
    """
    if plan.node_count != len(prof.profile.nodes):
        raise AutockptError(
            f"the plan has {plan.node_count} nodes but the module profile of {prof.model} has "
            f"{len(prof.profile.nodes)}: it was made for another model or chain",
            fix="make the plan with autockpt.planning.blocks.plan_modules on this profile")
    position = {node: k for k, node in enumerate(prof.block_nodes)}
    return tuple(prof.blocks[position[i]] for seg in plan.segments
                 for i in range(seg.start, seg.end) if i in position)


def build(module: nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
          *, budget_bytes: int | None, mode: str = "non_reentrant",
          strategy: str = "optimal", grad_accumulation: bool = False
          ) -> tuple[Plan, ModuleProfile]:
    """Profile ``module`` at these inputs and plan its blocks: :func:`profile_modules` then
    :func:`plan_modules`. ``module`` is left as it was.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        ...                       for _ in range(4)])
        >>> plan, prof = build(net, (torch.randn(4, 8),), budget_bytes=None)
        >>> len(plan.segments) >= 1
        True
    """
    if mode not in MODES:
        raise InvalidArgumentError(f"unknown mode {mode!r}", fix=f"use one of: {', '.join(MODES)}")
    prof = profile_modules(module, args, kwargs)
    return plan_modules(prof, budget_bytes, strategy=strategy, mode=mode,
                        grad_accumulation=grad_accumulation), prof

