"""What a checkpointed segment and a recomputed op cost beyond their arithmetic.

Plain numbers: the planner adds them to the recompute cost of a plan, in the cost's own unit
(FLOPs plus bytes, or nanoseconds when the nodes were timed).

# NOTE [ What a segment costs beyond its FLOPs ]
A plan's recompute was priced by the FLOPs (and bytes) its segments run again. That is all a
large kernel costs, but not all a step pays: each checkpointed segment is a Python call into
``torch.utils.checkpoint`` that saves and restores RNG state, installs saved-tensor hooks and
builds an autograd node, and each recomputed op is dispatched again from Python, with its
autograd bookkeeping, and on an accelerator a kernel launch. On a 2-core CPU a checkpoint call
with its recompute cost about 100 us of its own and each recomputed op about 10-20 us beyond
its arithmetic (measured with ``tanh(linear(x))`` on 4x8 tensors: 64 one-layer segments
against one segment of 64 layers). On a GPU these are the same CPU-side seconds, while the
arithmetic is thousands of times faster: a GPT's 14-segment plan, at the memory of
``checkpoint_sequential(3)``, ran x2.07 of no checkpointing on an H200 against
``checkpoint_sequential(3)``'s x1.66, although it recomputed less. So without a price on
them, many small segments win on paper and lose in time.

:func:`overhead_for` turns those seconds into the cost's unit with a nominal arithmetic rate
per device type (:data:`FLOPS_PER_SECOND`): a fixed cost per segment and per recomputed op.
With ``cost="profile"`` the nodes' measured times already include their launch, so only the
segment's cost is added, in nanoseconds. The numbers are deliberately round constants, not a
measurement at planning time: the same model and budget must give the same plan on every
run (a measured rate would move with the machine's load). They decide only between plans that
fit the budget: the memory side of a plan is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Overhead", "NO_OVERHEAD", "SEGMENT_SECONDS", "OP_SECONDS", "FLOPS_PER_SECOND",
           "overhead_for"]

SEGMENT_SECONDS = 100e-6
"""Seconds one checkpointed segment costs beyond its ops (the checkpoint call, its RNG state
and hooks, its autograd node)."""

OP_SECONDS = 10e-6
"""Seconds one recomputed op costs beyond its arithmetic (dispatch, autograd, a launch)."""

FLOPS_PER_SECOND = {"cpu": 5e10, "accelerator": 2e14}
"""Nominal rates that turn seconds into the FLOPs-plus-bytes unit: a core of a server CPU,
and a data-centre GPU's dense half-precision throughput as training reaches it."""


@dataclass(frozen=True)
class Overhead:
    """Fixed costs the planner adds to a plan's recompute, in the cost's unit."""

    segment_cost: int
    """Per checkpointed segment (per range of a nested plan too)."""
    op_cost: int
    """Per node a segment runs again."""


NO_OVERHEAD = Overhead(segment_cost=0, op_cost=0)
"""Only the arithmetic counts (the tables of the planner's own tests)."""


def overhead_for(device_type: str, *, timed: bool = False) -> Overhead:
    """The fixed costs for a model on ``device_type`` (``"cpu"``, ``"cuda"``, ...; ``"meta"``
    is priced as an accelerator, the device such a model is planned for), in nanoseconds
    when the nodes were timed (``timed``), else in FLOPs (NOTE [ What a segment costs beyond
    its FLOPs ]).

    Example:
        >>> overhead_for("cpu")
        Overhead(segment_cost=5000000, op_cost=500000)
        >>> overhead_for("cuda").segment_cost > overhead_for("cpu").segment_cost
        True
        >>> overhead_for("cuda", timed=True)
        Overhead(segment_cost=100000, op_cost=0)
    """
    if timed:
        return Overhead(segment_cost=round(SEGMENT_SECONDS * 1e9), op_cost=0)
    rate = FLOPS_PER_SECOND["cpu" if device_type == "cpu" else "accelerator"]
    return Overhead(segment_cost=round(SEGMENT_SECONDS * rate), op_cost=round(OP_SECONDS * rate))
