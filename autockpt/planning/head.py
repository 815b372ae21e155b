"""The head of a language model and its loss, found and priced to run in chunks of rows.

An analysis pass over a captured graph: :func:`find_row_stretch` finds the stretch that ends
the step (ops that act on each row, token, alone, one projection among them, ending in a
cross-entropy); :func:`chunked_head` says in how many chunks it runs and what its backward
costs. The pipeline prices the graph with and without it (:func:`autockpt.pipeline.plan_graph`)
and keeps the cheaper plan that fits; :func:`autockpt.running.head.chunk_rows` makes the graph
that runs it.

# NOTE [ The head in chunks of rows ]
Past the blocks, a language model's floor is its head: the logits (rows x vocabulary), the
loss's log-softmax and the gradient of the logits are alive together, and no segment boundary
can lower that, since the logits are one tensor. But every op from the final norm to the loss
treats each row alone, and the loss is a sum over rows (a mean is that sum over a count known
from the targets). So the stretch can run a chunk of rows at a time, never holding more than
one chunk of logits (NOTE [ Gradients in forward ] says when its backward runs). Liger-Kernel's
fused linear cross-entropy and torchtune's chunked output loss do the same by hand.

What counts as acting on each row is decided per op, conservatively: pointwise ops (torch's
``pointwise`` tag) whose other operands broadcast along the last dimension or are row-aligned
tensors without gradient, dtype conversions, views that keep the last dimension, reductions and
softmaxes over the last dimension with ``keepdim``, layer and RMS norms over it, one projection
(``linear``/``matmul`` by a weight), the matching torch.nn modules (without hooks), and a
cross-entropy (mean or sum, ``ignore_index`` and label smoothing, class or probability
targets; class weights not) whose class dimension is the last. Dropout is accepted only when
it drops nothing (a random op would need its RNG replayed per chunk). The stretch grows back
from the loss while it stays fed by one tensor, so a final norm joins it and a block before it
does not. A value of the stretch that the graph returns (Hugging Face returns the logits beside
the loss) is returned as ``None``: never having the whole logits is the point. Pass
``chunk_head=False`` to keep them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autockpt.capturing.ladder import has_hooks
from autockpt.capturing.trace import module_path
from autockpt.profiling.stats import ChunkedHead, RowStretch

__all__ = ["find_row_stretch", "chunk_count", "chunked_head"]

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, torch.reshape, torch.flatten, "view", "reshape", "flatten"}
_COPIES = {aten.alias.default, aten.contiguous.default, aten.clone.default, aten.to.dtype,
           aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default,
           "contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "type"}
_SLICES = {aten.slice.Tensor, operator.getitem}
_DROPOUTS = {aten.dropout.default, F.dropout, torch.dropout}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
               torch.mean, torch.sum, torch.amax, torch.amin, "mean", "sum", "amax", "amin"}
_SOFTMAXES = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
              aten.log_softmax.int, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
              "softmax", "log_softmax"}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default, F.layer_norm, F.rms_norm}
LINEAR_OPS = {aten.linear.default, F.linear}
_MATMULS = {aten.mm.default, aten.matmul.default, torch.matmul, torch.mm, operator.matmul,
            "matmul", "mm"}
_LOSSES = {aten.cross_entropy_loss.default, F.cross_entropy}
_ASSERTS = {aten._assert_tensor_metadata.default}
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_MAX_NODES = 256
"""How far back from the loss the stretch may grow (a head has a handful of ops)."""


def is_one_of(node: fx.Node, table: set[Any]) -> bool:
    if node.op == "call_method":
        return node.target in table
    if node.op != "call_function":
        return False
    try:
        return node.target in table
    except TypeError:  # an unhashable target
        return False


def _is_pointwise(node: fx.Node) -> bool:
    """Whether the op is elementwise, by torch's own ``pointwise`` tag on its aten op."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return torch.Tag.pointwise in target.tags
    if node.op not in ("call_function", "call_method"):
        return False
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    name = {"truediv": "div", "floordiv": "floor_divide"}.get(name, name).rstrip("_")
    if isinstance(target, str) or target in (operator.add, operator.sub, operator.mul,
                                             operator.truediv, operator.neg, operator.pow):
        pass
    elif getattr(target, "__module__", None) not in ("torch", "torch.nn.functional",
                                                     "torch._C._nn", "torch._C._VariableFunctions",
                                                     None):
        return False
    packet = getattr(aten, name, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def node_argument(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


@dataclass
class _Op:
    """How one node of the stretch takes part: its row operands (each a value of the stretch
    or its source), its row-aligned operands without gradient (chunked with it) and the
    operands it reads whole."""

    kind: str
    rows: list[fx.Node]
    side: dict[fx.Node, int]
    whole: list[fx.Node]
    attributes: list[str]


class RowShapes:
    """Shapes and gradient flags the profile wrote into ``node.meta``."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    @staticmethod
    def of(node: Any) -> tuple[int, ...] | None:
        if not isinstance(node, fx.Node):
            return None
        meta = node.meta.get("autockpt_tensor")
        return meta[0] if meta is not None else None

    @staticmethod
    def grad(node: fx.Node) -> bool:
        meta = node.meta.get("autockpt_tensor")
        return bool(meta and meta[2])

    def aligned(self, shape: tuple[int, ...] | None) -> bool:
        return shape is not None and len(shape) >= 1 and math.prod(shape[:-1]) == self.rows


def _last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _last_dim(dim[0], ndim)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _classify(node: fx.Node, gm: fx.GraphModule, shapes: RowShapes) -> _Op | None:
    """How ``node`` acts on rows, or None when it does not act on each row alone."""
    shape = shapes.of(node)
    if node.op not in ("call_function", "call_method", "call_module") or not shapes.aligned(shape):
        return None
    assert shape is not None
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) and node.op != "call_module":
        return None
    first_shape = shapes.of(first)
    if node.op == "call_module":
        return _classify_module(node, gm, shapes)
    if is_one_of(node, _VIEWS):
        if shapes.aligned(first_shape) and first_shape[-1] == shape[-1]:  # type: ignore[index]
            return _Op("view", [first], {}, [], [])
        return None
    if is_one_of(node, _COPIES):
        whole = [a for a in node.args[1:] if isinstance(a, fx.Node)]
        return _Op("copy", [first], {}, whole, []) if first_shape == shape else None
    if is_one_of(node, _SLICES):
        return _Op("identity", [first], {}, [], []) if first_shape == shape else None
    if is_one_of(node, _DROPOUTS):
        p, train = node_argument(node, 1, "p", 0.5), node_argument(node, 2, "train",
            node_argument(node, 2, "training", True))
        return _Op("identity", [first], {}, [], []) if (p == 0 or not train) else None
    if is_one_of(node, _REDUCTIONS):
        ndim = len(first_shape or ())
        if (_last_dim(node_argument(node, 1, "dim"), ndim)
                and node_argument(node, 2, "keepdim", False)
                and shapes.aligned(first_shape)):
            return _Op("reduce", [first], {}, [], [])
        return None
    if is_one_of(node, _SOFTMAXES):
        if _last_dim(node_argument(node, 1, "dim"),
                     len(first_shape or ())) and first_shape == shape:
            return _Op("softmax", [first], {}, [], [])
        return None
    if is_one_of(node, _NORMS):
        normalized = node_argument(node, 1, "normalized_shape")
        if isinstance(normalized, (list, tuple)) and len(normalized) == 1 and first_shape == shape:
            whole = [a for a in (*node.args[2:], *node.kwargs.values()) if isinstance(a, fx.Node)]
            return _Op("norm", [first], {}, whole, [])
        return None
    if is_one_of(node, LINEAR_OPS) or is_one_of(node, _MATMULS):
        weight = node_argument(node, 1, "weight", node_argument(node, 1, "other"))
        if node.target in (aten.mm.default, torch.mm, "mm") and len(first_shape or ()) != 2:
            return None
        if not isinstance(weight, fx.Node) or len(shapes.of(weight) or ()) not in (1, 2):
            return None
        if shapes.aligned(first_shape):
            whole = [a for a in (*node.args[1:], *node.kwargs.values())
                     if isinstance(a, fx.Node)]
            return _Op("projection", [first], {}, whole, [])
        return None
    if node.op == "call_function" and node.target is aten.addmm.default:
        mat1, mat2 = node_argument(node, 1, "mat1"), node_argument(node, 2, "mat2")
        if isinstance(mat1, fx.Node) and shapes.aligned(shapes.of(mat1)):
            return _Op("projection", [mat1], {}, [first, mat2], [])
        return None
    if _is_pointwise(node):
        return _classify_pointwise(node, shape, shapes)
    return None


def _classify_pointwise(node: fx.Node, shape: tuple[int, ...], shapes: RowShapes) -> _Op | None:
    rows: list[fx.Node] = []
    side: dict[fx.Node, int] = {}
    whole: list[fx.Node] = []
    for arg in (*node.args, *node.kwargs.values()):
        if not isinstance(arg, fx.Node):
            continue
        arg_shape = shapes.of(arg)
        if arg_shape is None:
            if "autockpt" in arg.meta and arg.meta["autockpt"].output_kind == "tensor":
                return None
            whole.append(arg)  # a Python number made by the graph
        elif all(d == 1 for d in arg_shape[:-1]) and (len(arg_shape) < len(shape) or not
                                                     shapes.aligned(arg_shape) or
                                                     shapes.rows == 1):
            whole.append(arg)
        elif len(arg_shape) == len(shape) and arg_shape[:-1] == shape[:-1]:
            if shapes.grad(arg):
                rows.append(arg)
            else:
                side[arg] = 1
        else:
            return None
    return _Op("pointwise", rows, side, whole, []) if rows else None


def _classify_module(node: fx.Node, gm: fx.GraphModule, shapes: RowShapes) -> _Op | None:
    module = gm.get_submodule(str(node.target))
    first = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    if (not isinstance(first, fx.Node) or not shapes.aligned(shapes.of(first))
            or has_hooks(module)):
        return None  # a module's hooks expect its whole input
    params = [f"{node.target}.{name}" for name, _ in module.named_parameters()]
    kind_of = {nn.Linear: "projection", nn.LayerNorm: "norm", nn.RMSNorm: "norm"}
    for cls, kind in kind_of.items():
        if isinstance(module, cls) and type(module).forward is cls.forward:
            if kind == "norm" and len(module.normalized_shape) != 1:  # type: ignore[arg-type]
                return None
            return _Op(kind, [first], {}, [], params)
    if isinstance(module, _ACTIVATIONS) and not list(module.buffers()):
        return _Op("pointwise", [first], {}, [], params)
    if isinstance(module, nn.Dropout) and (module.p == 0 or not module.training):
        return _Op("identity", [first], {}, [], [])
    return None


def loss_operands(node: fx.Node, gm: fx.GraphModule
                   ) -> tuple[fx.Node, fx.Node, dict[str, Any]] | None:
    """The logits, the targets and the options of a cross-entropy node, or None when the
    stretch cannot end in it (class weights, no reduction, legacy arguments)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if (type(module) is not nn.CrossEntropyLoss or module.weight is not None
                or len(node.args) != 2 or node.kwargs):
            return None
        bound = {"input": node.args[0], "target": node.args[1], "reduction": module.reduction,
                 "ignore_index": module.ignore_index,
                 "label_smoothing": module.label_smoothing}
        return _loss_options(bound, "mean")
    if not is_one_of(node, _LOSSES):
        return None
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
             "reduction", "label_smoothing")
    if node.target is aten.cross_entropy_loss.default:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    bound = dict(zip(names, node.args))
    bound.update({("input" if k == "self" else k): v for k, v in node.kwargs.items()})
    return _loss_options(bound, 1 if node.target is aten.cross_entropy_loss.default else "mean")


def _loss_options(bound: dict[str, Any], default_reduction: Any
                  ) -> tuple[fx.Node, fx.Node, dict[str, Any]] | None:
    reduction = bound.get("reduction", default_reduction)
    reduction = {1: "mean", 2: "sum"}.get(reduction, reduction)  # type: ignore[call-overload]
    logits, target = bound.get("input"), bound.get("target")
    if (bound.get("weight") is not None or bound.get("size_average") is not None
            or bound.get("reduce") is not None or reduction not in ("mean", "sum")
            or not isinstance(logits, fx.Node) or not isinstance(target, fx.Node)):
        return None
    options = {"reduction": reduction, "ignore_index": bound.get("ignore_index", -100),
               "label_smoothing": bound.get("label_smoothing", 0.0)}
    for value in options.values():
        if isinstance(value, fx.Node):
            return None
    return logits, target, options


def find_row_stretch(gm: fx.GraphModule) -> RowStretch | None:
    """The stretch at the end of a profiled graph that acts on each row and ends in a
    cross-entropy, one projection in it (NOTE [ The head in chunks of rows ]); None when the
    graph has none. Reads the shapes :func:`autockpt.profiling.profile.profile` wrote into
    ``node.meta``.

    Example:
        >>> import torch
        >>> from autockpt.capturing.trace import trace
        >>> from autockpt.profiling.profile import profile
        >>> class LM(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 64)
        ...     def forward(self, h, y):
        ...         return torch.nn.functional.cross_entropy(self.head(self.norm(h)), y)
        >>> h, y = torch.randn(16, 8, requires_grad=True), torch.randint(0, 64, (16,))
        >>> traced = trace(LM(), (h, y))
        >>> _ = profile(traced, {"h": h, "y": y})
        >>> stretch = find_row_stretch(traced.graph_module)
        >>> stretch.source, stretch.nodes, stretch.rows, stretch.width
        ('h', ('norm', 'head', 'cross_entropy'), 16, 64)
    """
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    for node in reversed(nodes):
        found = loss_operands(node, gm)
        if found is None:
            continue
        stretch = _grow(gm, node, nodes, output, *found)
        if stretch is not None:
            return stretch
    return None


def _grow(gm: fx.GraphModule, loss: fx.Node, nodes: list[fx.Node], output: fx.Node,
          logits: fx.Node, target: fx.Node, options: dict[str, Any]) -> RowStretch | None:
    logits_shape, target_shape = RowShapes.of(logits), RowShapes.of(target)
    loss_shape = RowShapes.of(loss)
    if (logits_shape is None or len(logits_shape) != 2 or target_shape is None
            or loss_shape != () or RowShapes.grad(target) or logits_shape[0] < 2):
        return None
    rows, width = logits_shape
    shapes = RowShapes(rows)
    class_targets = target_shape == (rows,)
    if not class_targets and target_shape != logits_shape:
        return None
    position = {n: i for i, n in enumerate(nodes)}
    members: list[fx.Node] = [loss]
    kinds = {loss: "loss"}
    inside = {loss}
    ext: dict[fx.Node, None] = {logits: None}
    side: dict[fx.Node, int] = {target: 1 if not class_targets else 0}
    whole: dict[fx.Node, None] = {}
    attributes: dict[str, None] = {}
    dropped: list[fx.Node] = []
    returned: list[fx.Node] = []
    projection: fx.Node | None = None
    best: RowStretch | None = None
    while len(members) < _MAX_NODES:
        if len(ext) == 1 and projection is not None:
            (source,) = ext
            if not any(s in inside for s in side) and source not in side:
                best = _stretch(members, kinds, source, side, whole, attributes, dropped,
                                returned, projection, loss, rows, width, options, class_targets,
                                gm)
        if not ext:
            break
        node = max(ext, key=position.__getitem__)
        op = _classify(node, gm, shapes)
        if op is None or (op.kind == "projection" and projection is not None):
            break
        users = list(node.users)
        asserts = [u for u in users if is_one_of(u, _ASSERTS) and not u.users]
        outside = [u for u in users if u not in inside and u not in asserts]
        if any(u is not output for u in outside):
            break
        if outside and projection is not None:
            break  # a value before the head the caller reads (hidden states): keep it whole
        members.append(node)
        kinds[node] = op.kind
        inside.add(node)
        dropped += asserts
        if outside:
            returned.append(node)
        del ext[node]
        for row in op.rows:
            ext[row] = None
        for value, trailing in op.side.items():
            if side.get(value, trailing) != trailing:
                return best
            side[value] = trailing
        for value in op.whole:
            whole[value] = None
        for name in op.attributes:
            attributes[name] = None
        if op.kind == "projection":
            projection = node
    return best


def _stretch(members: list[fx.Node], kinds: dict[fx.Node, str], source: fx.Node,
             side: dict[fx.Node, int], whole: dict[fx.Node, None], attributes: dict[str, None],
             dropped: list[fx.Node], returned: list[fx.Node], projection: fx.Node, loss: fx.Node,
             rows: int, width: int, options: dict[str, Any], class_targets: bool,
             gm: fx.GraphModule) -> RowStretch:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ordered = sorted(members, key=order.__getitem__)
    inside = set(members)
    source_shape = RowShapes.of(source) or (0,)
    return RowStretch(
        source=source.name,
        nodes=tuple(n.name for n in ordered),
        kinds=tuple(kinds[n] for n in ordered),
        dropped=tuple(n.name for n in sorted(dropped, key=order.__getitem__)),
        loss=loss.name,
        projection=projection.name,
        side=tuple((n.name, t) for n, t in sorted(side.items(), key=lambda i: order[i[0]])),
        whole=tuple(n.name for n in sorted(whole, key=order.__getitem__) if n not in inside),
        attributes=tuple(attributes),
        returned=tuple(n.name for n in sorted(returned, key=order.__getitem__)),
        rows=rows,
        hidden_width=source_shape[-1] if source_shape else 1,
        width=width,
        reduction=options["reduction"],
        ignore_index=int(options["ignore_index"]),
        label_smoothing=float(options["label_smoothing"]),
        class_targets=class_targets,
        first_module=module_path(ordered[0]),
        last_module=module_path(projection),
    )


MIN_CHUNK_ROWS = 128
"""Fewest rows in a chunk. Each chunk reads the whole projection weight and reads and writes
its whole gradient buffer: with fewer rows that traffic is the step's cost (8-row chunks of a
32768 x 256 head doubled a CPU step, at the same FLOPs)."""


def chunk_count(rows: int, hidden_width: int, width: int) -> int:
    """How many chunks the head runs in: enough that one chunk of logits is about as large as
    the hidden states it is computed from (``width / hidden_width``, to a power of two), at
    least 2, and no more than leaves :data:`MIN_CHUNK_ROWS` rows in each.

    Example:
        >>> chunk_count(rows=1024, hidden_width=256, width=8192)
        8
        >>> chunk_count(rows=8192, hidden_width=4096, width=128256)
        32
    """
    ratio = max(2, math.ceil(width / max(hidden_width, 1)))
    most = max(2, rows // MIN_CHUNK_ROWS)
    chunks = min(rows, most, 1 << (ratio - 1).bit_length())
    chunk_rows = math.ceil(rows / chunks)
    return math.ceil(rows / chunk_rows)


# --------------------------------------------------------------------------- the transform

def chunked_head(stretch: RowStretch, gradient_flops: int = 0) -> ChunkedHead:
    """The chunk count and rows per chunk for ``stretch``; its backward costs
    ``gradient_flops`` (known once the chunked graph is profiled)."""
    chunks = chunk_count(stretch.rows, stretch.hidden_width, stretch.width)
    return ChunkedHead(stretch=stretch, chunks=chunks, chunk_rows=math.ceil(stretch.rows / chunks),
                       gradient_flops=gradient_flops)
