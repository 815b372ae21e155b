"""Plain numbers about a traced model: what the profiler measures and the planner reads.

Nothing here knows about torch.fx: positions are indices into the graph's node list, sizes are
bytes as ints. This is what lets the planner be tested on hand-written tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["NodeStat", "StorageStat", "LossStat", "Profile", "node_cost", "LOSS_OP", "assume_loss",
           "RowStretch", "ChunkedHead"]

LOSS_OP = "loss"
"""The ``op`` of the node that stands for the training step's loss, just before the output
node: it is not part of the model's graph, so it is never checkpointed or rewritten."""


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
    summed_param_grad_bytes: int = 0
    """Bytes of the gradients its backward makes for parameters that later nodes read too
    (a tied embedding read again by the head): autograd adds them to the later readers'
    gradients held for it (their ``param_grad_held``) into a new buffer, so they are
    temporaries alive beside those, not ``.grad``. Not in ``backward_bytes``."""
    accumulate_backward_bytes: int | None = None
    """``backward_bytes`` when the parameters' ``.grad`` already exists (gradient
    accumulation): autograd then computes each weight gradient into a temporary and adds it
    into ``.grad``, so those gradients count too. ``None``: the same as ``backward_bytes``."""
    time_ns: int | None = None
    """Median measured forward time of the node in nanoseconds, when it was timed on the real device
    (``cost="profile"``, :func:`autockpt.profiling.timing.time_nodes`); ``None`` otherwise."""
    saved_buffer_bytes: int = 0
    """Bytes of the buffers it updates and saves for backward (BatchNorm's running
    statistics). Not activations in a plain forward; a recompute runs the node on clones of
    them (NOTE [ Recompute must not update buffers twice ] in :mod:`autockpt.running.runner`), which
    it saves, so there they are."""
    saves_fresh: bool = True
    """Whether it saves a storage made by its last op (dropout's mask, tanh's result), as
    opposed to ones made by earlier ops only (a 4-D matmul saves the copy it made of a
    transposed operand as the input of its last op, the bmm). A non-reentrant recompute
    that stops at this node must then run it to the end (NOTE [ A non-reentrant recompute
    stops early ] in :mod:`autockpt.planning.chain`)."""
    kept_bytes: int = 0
    """Bytes of the new storages made by its matrix products, convolutions and attention
    kernels (:data:`autockpt.ops.kept.KEPT_OPS`): what a segment that keeps those ops' outputs
    holds of this node from its forward to its recompute (NOTE [ Keep the expensive, recompute
    the cheap ] in :mod:`autockpt.ops.kept`)."""
    kept_flops: int = 0
    """FLOPs of those ops: what such a segment does not run again."""
    kept_ops: int = 0
    """How many of those ops it runs."""
    ops: int = 0
    """How many ATen ops it runs (views and metadata queries aside)."""


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
class LossStat:
    """What the loss of the training step adds to it (see NOTE [ The default loss ] in
    :mod:`autockpt.profiling.loss`)."""

    kind: str
    """``"loss_fn"`` (the user's loss, profiled with the model), ``"inner"`` (the model
    returns its own loss, as a Hugging Face model given ``labels=``; the rest of its output
    is held through backward, as ``outputs = model(**batch); outputs.loss.backward()`` holds
    it) or ``"assumed"`` (no loss given: an output-sized gradient for each floating output
    that requires grad). Every kind counts the whole output alive through backward (NOTE
    [ The loss node ] in :mod:`autockpt.profiling.profile`)."""
    name: str
    """The loss function's name, or what was assumed."""
    saved_bytes: int
    """Bytes of new storages the loss saves for backward (a cross-entropy's log-softmax)."""
    grad_bytes: int
    """Bytes of the gradients it hands to the model's outputs."""
    work_bytes: int
    """Most new bytes alive at once while the loss is computed."""
    held: tuple[tuple[str, int], ...] = ()
    """With the model's own loss (``"inner"``): the other parts of the output that hold
    activations, by name (``("logits", 524288)``), with their bytes, each storage counted
    once; all held through backward. Empty when the model returns nothing else (a head in
    chunks returns no logits)."""


@dataclass(frozen=True)
class RowStretch:
    """The end of a graph that acts on each row alone and reduces to the loss: a final norm,
    the head's projection and a cross-entropy (NOTE [ The head in chunks of rows ] in
    :mod:`autockpt.planning.head`). Nodes are named as in the captured graph."""

    source: str
    """The node whose value feeds the stretch: the hidden states."""
    nodes: tuple[str, ...]
    """The stretch's nodes in graph order; the last is :attr:`loss`."""
    kinds: tuple[str, ...]
    """How each of :attr:`nodes` acts on rows: ``"view"``, ``"copy"``, ``"identity"``,
    ``"pointwise"``, ``"reduce"``, ``"softmax"``, ``"norm"``, ``"projection"`` or
    ``"loss"``."""
    dropped: tuple[str, ...]
    """Metadata checks on its values (``_assert_tensor_metadata``), removed with it."""
    loss: str
    """The cross-entropy node that ends it."""
    projection: str
    """The node that projects each row to the classes (the vocabulary)."""
    side: tuple[tuple[str, int], ...]
    """Row-aligned inputs without gradient, chunked with the rows (the targets first), each
    with the number of trailing dimensions a row keeps (0 for class targets)."""
    whole: tuple[str, ...]
    """Nodes it reads whole: parameters, values broadcast along the last dimension."""
    attributes: tuple[str, ...]
    """Parameters of modules called in it, by qualified name."""
    returned: tuple[str, ...]
    """Its values the graph returned (the logits): returned as ``None`` once chunked."""
    rows: int
    """Rows of the loss's input (tokens in the batch)."""
    hidden_width: int
    """Last dimension of the source."""
    width: int
    """Classes per row (the vocabulary)."""
    reduction: str
    """``"mean"`` or ``"sum"``."""
    ignore_index: int
    """Targets equal to it count for nothing, and not in a mean's count."""
    label_smoothing: float
    """The cross-entropy's label smoothing."""
    class_targets: bool
    """Whether the targets are class indices (else probabilities per class)."""
    first_module: str
    """Module path of its first node."""
    last_module: str
    """Module path of the projection."""


@dataclass(frozen=True)
class ChunkedHead:
    """How a plan runs a :class:`RowStretch`: in chunks of rows, each chunk's loss and
    gradients made in forward."""

    stretch: RowStretch
    """What is chunked."""
    chunks: int
    """How many chunks of rows."""
    chunk_rows: int
    """Rows per chunk (the last may have fewer)."""
    gradient_flops: int
    """FLOPs of the stretch's backward, which its forward runs chunk by chunk (nothing of it
    is recomputed: NOTE [ Gradients in forward ] in :mod:`autockpt.running.head`)."""


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs to know about one model at one input size."""

    nodes: tuple[NodeStat, ...]
    """Every node of the graph, in graph order."""
    storages: tuple[StorageStat, ...]
    """Every activation storage, ordered by producer position."""
    input_signature: str
    """Human-readable shapes and dtypes of the inputs the profile was taken at."""
    loss: LossStat | None = None
    """The loss of the step, when it is in the profile: then ``nodes[-2]`` is a node with
    ``op`` :data:`LOSS_OP` that stands for it."""

    @property
    def graph_node_count(self) -> int:
        """Nodes of the captured graph (the loss node is not one of them)."""
        return len(self.nodes) - (1 if self.loss is not None else 0)

    @property
    def forward_flops(self) -> int:
        """FLOPs of one forward pass of the model (the loss not included)."""
        return sum(node.flops for node in self.nodes if node.op != LOSS_OP)


def assume_loss(profile: Profile) -> Profile:
    """``profile`` with a loss node that hands an output-sized gradient to each output that carries
    gradient, inserted before the output node: what a planner must assume of a loss it cannot run
    (see NOTE [ The loss node ] in :mod:`autockpt.profiling.profile`). A profile that has a loss
    node already is returned as it is.

    Example:
        >>> out = NodeStat(index=1, name="output", op="output", target="output",
        ...                module_path="", inputs=(0,), users=(), output_kind="constant",
        ...                requires_grad=False, flops=0, output_bytes=0, work_bytes=0,
        ...                random=False, trainable=False, mutated_inputs=(), mutated_buffers=())
        >>> lin = replace(out, index=0, name="fc", op="call_module", inputs=(), users=(1,),
        ...               output_kind="tensor", requires_grad=True, grad_bytes=64)
        >>> p = assume_loss(Profile(nodes=(lin, out), storages=(), input_signature=""))
        >>> [n.op for n in p.nodes], p.loss.grad_bytes
        (['call_module', 'loss', 'output'], 64)
    """
    if profile.loss is not None or not profile.nodes:
        return profile
    *body, output = profile.nodes
    at = output.index
    inputs = tuple(i for i in output.inputs if profile.nodes[i].requires_grad
                   and profile.nodes[i].grad_bytes > 0)
    grads = tuple(profile.nodes[i].grad_bytes for i in inputs)
    loss = replace(output, name="loss", op=LOSS_OP, target="an output-sized gradient",
                   inputs=inputs, users=(at + 1,), output_kind="tensor", requires_grad=True,
                   backward_bytes=sum(grads), input_grad_bytes=grads, grad_bytes=0)
    moved = replace(output, index=at + 1, inputs=(at,))
    stat = LossStat(kind="assumed", name="an output-sized gradient", saved_bytes=0,
                    grad_bytes=sum(grads), work_bytes=0)
    return replace(profile, nodes=(*body, loss, moved), loss=stat)
