"""Plain numbers about a traced model: what the profiler measures and the planner reads.

Nothing here knows about torch.fx: positions are indices into the graph's node list, sizes are
bytes as ints. This is what lets the planner be tested on hand-written tables.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeStat", "StorageStat", "Profile", "node_cost"]


@dataclass(frozen=True)
class NodeStat:
    """One node of the traced graph, at position ``index`` in graph order."""

    index: int
    """Position of the node in graph order."""
    name: str
    """The fx node's name (unique in the graph)."""
    op: str
    """The fx opcode: ``placeholder``, ``get_attr``, ``call_module``, ``call_function``,
    ``call_method`` or ``output``."""
    target: str
    """What the node calls: a module path, a function or method name."""
    module_path: str
    """Qualified name of the innermost user module this node belongs to (``""`` for the root)."""
    inputs: tuple[int, ...]
    """Positions of the nodes whose values this node reads."""
    users: tuple[int, ...]
    """Positions of the nodes that read this node's value."""
    output_kind: str
    """``"tensor"``, ``"constant"`` (a value holding no tensor), ``"container"`` (tensors inside
    a tuple, list or dict) or ``"parameter"`` (a parameter or buffer fetched by ``get_attr``)."""
    requires_grad: bool
    """Whether any tensor in the node's output carries gradient."""
    flops: int
    """Forward floating-point operations, as counted by ``torch.utils.flop_counter``."""
    output_bytes: int
    """Bytes of the new storages the node's output occupies (0 for a view of an older one)."""
    work_bytes: int
    """Most bytes of new storages alive at once while the node runs: its output plus the
    temporaries of its ops (inside a leaf module too)."""
    random: bool
    """Whether the node runs a random op (dropout, ``rand``...): recompute must replay the RNG."""
    trainable: bool
    """Whether the node uses a parameter that requires grad."""
    mutated_inputs: tuple[int, ...]
    """Positions of the producers of values this node modifies in place."""
    mutated_buffers: tuple[str, ...]
    """Qualified names of buffers this node updates in forward (BatchNorm running statistics):
    a recompute would update them a second time."""
    backward_bytes: int = 0
    """Most bytes of new storages alive at once while the node's backward runs, from the
    gradient of its output to the gradients of the activations it reads: those gradients and
    the temporaries of its backward ops (not parameter gradients)."""
    input_grad_bytes: tuple[int, ...] = ()
    """Per entry of ``inputs``: bytes of new storage its backward hands on as that input's
    gradient; 0 when it hands on the gradient of its output itself (an add, a view) or none
    (empty when the backward was not probed)."""
    grad_bytes: int = 0
    """Bytes of the gradient of its output (its tensors that require grad)."""
    param_grad_held: tuple[tuple[int, int], ...] = ()
    """Gradients of shared parameters its backward makes that wait for another reader's:
    ``(bytes, position)`` pairs. Autograd sums every contribution to a parameter read by
    several nodes (tied embeddings) before it becomes ``.grad``, so the gradient made by a
    later reader, whose backward runs first, stays alive until the backward of the first
    reader (at ``position``) has run."""
    time_ns: int | None = None
    """Median measured forward time of the node in nanoseconds, when it was timed on the real
    device (``cost="profile"``, :func:`autockpt.timing.time_nodes`); ``None`` otherwise."""


def node_cost(node: NodeStat) -> int:
    """What recomputing ``node`` costs the planner: its measured time in nanoseconds when it
    was timed, else its FLOPs plus the bytes it writes (so that memory-bound ops are not free).

    Within one profile either every node is timed or none is, so costs are never a mix of
    units.

    Example:
        >>> from dataclasses import replace
        >>> n = NodeStat(index=1, name="relu", op="call_module", target="1", module_path="1",
        ...              inputs=(0,), users=(2,), output_kind="tensor", requires_grad=True,
        ...              flops=0, output_bytes=128, work_bytes=128, random=False,
        ...              trainable=False, mutated_inputs=(), mutated_buffers=())
        >>> node_cost(n), node_cost(replace(n, time_ns=2500))
        (128, 2500)
    """
    if node.time_ns is not None:
        return node.time_ns
    return node.flops + node.output_bytes


@dataclass(frozen=True)
class StorageStat:
    """One activation storage (a block of memory, shared by a tensor and its views)."""

    size_bytes: int
    """Size of the storage in bytes."""
    producer: int
    """Position of the node that allocates it."""
    users: tuple[int, ...]
    """Positions of nodes that read a value backed by this storage, ascending."""
    saved_by: tuple[int, ...]
    """Positions of nodes that save it for backward, ascending; empty if nothing does."""
    requires_grad: bool
    """Whether the tensor carries gradient."""
    is_output: bool
    """Whether it is part of the model's output (the caller holds it through backward)."""


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs to know about one model at one input size."""

    nodes: tuple[NodeStat, ...]
    """Every node of the graph, in graph order."""
    storages: tuple[StorageStat, ...]
    """Every activation storage, ordered by producer position."""
    input_signature: str
    """Human-readable shapes and dtypes of the inputs the profile was taken at."""

    @property
    def forward_flops(self) -> int:
        """FLOPs of one forward pass."""
        return sum(node.flops for node in self.nodes)
