"""The ops a checkpointed segment may keep instead of recomputing: matrix products,
convolutions and attention kernels.

# NOTE [ Keep the expensive, recompute the cheap ]
A checkpointed segment recomputes every op it ran. Most of its FLOPs are in a few ops (the
matrix products of a linear layer or attention, the convolutions of a CNN) and most of its
saved bytes in many cheap ones (norms, activations, softmax, dropout's mask, residual adds).
torch's selective checkpoint (``create_selective_checkpoint_contexts``, the policy of
torchtitan's "selective op" mode and of Megatron's selective recompute) keeps the outputs of
chosen ops from the first forward, and the recompute reuses them instead of running the op
again. A segment that keeps the outputs of :data:`KEPT_OPS` holds them from its forward until
its recompute, and recomputes only the rest: at no FLOPs for a pointwise op, where recomputing
the segment whole would run every matmul again.

The planner chooses, per checkpointed segment, whether it keeps them
(NOTE [ Segments that keep their matmuls ] in :mod:`autockpt.planning.memory_model`). The profile
counts, per node, the bytes, FLOPs and number of these ops' outputs
(:attr:`~autockpt.profiling.stats.NodeStat.kept_bytes`), and the runner passes :func:`keep_context`
to ``checkpoint`` as its ``context_fn``. Only non-reentrant checkpoint takes a ``context_fn``:
reentrant segments recompute whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["KEPT_OPS", "is_kept", "keep_context"]

_aten = torch.ops.aten

KEPT_OPS: frozenset[torch._ops.OpOverloadPacket] = frozenset(
    getattr(_aten, name) for name in (
        "mm", "addmm", "bmm", "baddbmm", "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ) if hasattr(_aten, name))
"""The ops whose outputs a segment that keeps them holds from its forward to its recompute
(NOTE [ Keep the expensive, recompute the cheap ])."""


def is_kept(func: Any) -> bool:
    """Whether ``func`` (an ATen overload) is one of :data:`KEPT_OPS`.

    Example:
        >>> is_kept(torch.ops.aten.mm.default), is_kept(torch.ops.aten.relu.default)
        (True, False)
    """
    packet = getattr(func, "overloadpacket", None)
    return packet is not None and packet in KEPT_OPS


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def keep_context() -> tuple[Any, Any]:
    """The ``context_fn`` result of a segment that keeps the outputs of :data:`KEPT_OPS`:
    torch's selective checkpoint contexts, fresh for each checkpoint call.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> out = checkpoint(lambda x: (x @ w).relu(), torch.randn(2, 4), use_reentrant=False,
        ...                  context_fn=keep_context)
        >>> out.sum().backward()
        >>> w.grad.shape
        torch.Size([4, 4])
    """
    return create_selective_checkpoint_contexts(_policy)

