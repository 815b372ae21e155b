"""Stage 2b: the head of a language model and its loss, run in chunks of rows.

An analysis pass (:func:`find_row_stretch`) finds, in a profiled graph, the stretch that ends
the step: ops that act on each row (token) alone, one projection among them, ending in a
cross-entropy; a transform (:func:`chunk_rows`) returns a new graph in which that stretch is
one node that computes it a chunk of rows at a time. The planner prices the graph with and
without it (:func:`autockpt.pipeline.plan_graph`) and keeps the cheaper plan that fits.

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

# NOTE [ Gradients in forward ]
The loss is the step's last op, and its gradient is a scalar. So the forward of the chunked
stretch computes, chunk by chunk, the loss and its gradients with respect to the hidden states
and the stretch's parameters, as if the loss's gradient were 1, and keeps those gradients
(a hidden-state-sized one and the parameters'); backward multiplies them by the real gradient
of the loss and hands them on. Nothing is recomputed: the step's FLOPs are those of the
unchunked step, with the head's backward moved into forward. The projection's weight
gradient is added into one buffer with ``addmm`` (one vocabulary-sized buffer, not one per
chunk). The price: the gradients are made whether or not backward follows (a forward in train
mode under ``torch.no_grad()`` runs the model's own forward instead), and backward runs once
per forward (``retain_graph=True`` and double backward raise; pass ``chunk_head=False``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autockpt.capture import has_hooks
from autockpt.errors import AutockptError
from autockpt.meta_device import autocast_enabled
from autockpt.stats import ChunkedHead, RowStretch
from autockpt.trace import TracedModel
from autockpt.units import format_names

__all__ = ["find_row_stretch", "chunk_rows", "chunk_count", "ChunkedRows"]

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
_LINEAR = {aten.linear.default, F.linear}
_MATMULS = {aten.mm.default, aten.matmul.default, torch.matmul, torch.mm, operator.matmul,
            "matmul", "mm"}
_LOSSES = {aten.cross_entropy_loss.default, F.cross_entropy}
_ASSERTS = {aten._assert_tensor_metadata.default}
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_MAX_NODES = 256
"""How far back from the loss the stretch may grow (a head has a handful of ops)."""


def _in(node: fx.Node, table: set[Any]) -> bool:
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


def _arg(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
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


class _Shapes:
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


def _classify(node: fx.Node, gm: fx.GraphModule, shapes: _Shapes) -> _Op | None:
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
    if _in(node, _VIEWS):
        if shapes.aligned(first_shape) and first_shape[-1] == shape[-1]:  # type: ignore[index]
            return _Op("view", [first], {}, [], [])
        return None
    if _in(node, _COPIES):
        whole = [a for a in node.args[1:] if isinstance(a, fx.Node)]
        return _Op("copy", [first], {}, whole, []) if first_shape == shape else None
    if _in(node, _SLICES):
        return _Op("identity", [first], {}, [], []) if first_shape == shape else None
    if _in(node, _DROPOUTS):
        p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", _arg(node, 2, "training", True))
        return _Op("identity", [first], {}, [], []) if (p == 0 or not train) else None
    if _in(node, _REDUCTIONS):
        ndim = len(first_shape or ())
        if (_last_dim(_arg(node, 1, "dim"), ndim) and _arg(node, 2, "keepdim", False)
                and shapes.aligned(first_shape)):
            return _Op("reduce", [first], {}, [], [])
        return None
    if _in(node, _SOFTMAXES):
        if _last_dim(_arg(node, 1, "dim"), len(first_shape or ())) and first_shape == shape:
            return _Op("softmax", [first], {}, [], [])
        return None
    if _in(node, _NORMS):
        normalized = _arg(node, 1, "normalized_shape")
        if isinstance(normalized, (list, tuple)) and len(normalized) == 1 and first_shape == shape:
            whole = [a for a in (*node.args[2:], *node.kwargs.values()) if isinstance(a, fx.Node)]
            return _Op("norm", [first], {}, whole, [])
        return None
    if _in(node, _LINEAR) or _in(node, _MATMULS):
        weight = _arg(node, 1, "weight", _arg(node, 1, "other"))
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
        mat1, mat2 = _arg(node, 1, "mat1"), _arg(node, 2, "mat2")
        if isinstance(mat1, fx.Node) and shapes.aligned(shapes.of(mat1)):
            return _Op("projection", [mat1], {}, [first, mat2], [])
        return None
    if _is_pointwise(node):
        return _classify_pointwise(node, shape, shapes)
    return None


def _classify_pointwise(node: fx.Node, shape: tuple[int, ...], shapes: _Shapes) -> _Op | None:
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


def _classify_module(node: fx.Node, gm: fx.GraphModule, shapes: _Shapes) -> _Op | None:
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


def _loss_operands(node: fx.Node, gm: fx.GraphModule
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
    if not _in(node, _LOSSES):
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
    graph has none. Reads the shapes :func:`autockpt.profile.profile` wrote into
    ``node.meta``.

    Example:
        >>> import torch
        >>> from autockpt.trace import trace
        >>> from autockpt.profile import profile
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
        found = _loss_operands(node, gm)
        if found is None:
            continue
        stretch = _grow(gm, node, nodes, output, *found)
        if stretch is not None:
            return stretch
    return None


def _grow(gm: fx.GraphModule, loss: fx.Node, nodes: list[fx.Node], output: fx.Node,
          logits: fx.Node, target: fx.Node, options: dict[str, Any]) -> RowStretch | None:
    logits_shape, target_shape = _Shapes.of(logits), _Shapes.of(target)
    loss_shape = _Shapes.of(loss)
    if (logits_shape is None or len(logits_shape) != 2 or target_shape is None
            or loss_shape != () or _Shapes.grad(target) or logits_shape[0] < 2):
        return None
    rows, width = logits_shape
    shapes = _Shapes(rows)
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
        asserts = [u for u in users if _in(u, _ASSERTS) and not u.users]
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


def _stretch(members: list[fx.Node], kinds: dict[fx.Node, str], source: fx.Node, side: dict[fx.Node, int],
             whole: dict[fx.Node, None], attributes: dict[str, None], dropped: list[fx.Node],
             returned: list[fx.Node], projection: fx.Node, loss: fx.Node, rows: int, width: int,
             options: dict[str, Any], class_targets: bool, gm: fx.GraphModule) -> RowStretch:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ordered = sorted(members, key=order.__getitem__)
    inside = set(members)
    source_shape = _Shapes.of(source) or (0,)
    from autockpt.profile import _module_path

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
        first_module=_module_path(ordered[0]),
        last_module=_module_path(projection),
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


class _Ref:
    """A value of the chunk program: the node name it is kept under."""

    __slots__ = ("name", "flat")

    def __init__(self, name: str, flat: bool = False) -> None:
        self.name = name
        self.flat = flat


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


_unchanged = _identity


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)
    return call


def _module_call(module: nn.Module, names: Sequence[str]) -> Callable[..., Any]:
    """The module's forward as a function of its input and its parameters (by ``names``),
    without ``__call__``: hooks (a FLOP counter's module tracker) must not see the chunks."""
    local = [n.rsplit(".", 1)[-1] for n in names]

    def call(x: torch.Tensor, *params: torch.Tensor) -> Any:
        given = dict(zip(local, params))
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x, module.normalized_shape, given.get("weight"),
                                given.get("bias"), module.eps)
        if isinstance(module, nn.RMSNorm):
            return F.rms_norm(x, module.normalized_shape, given.get("weight"), module.eps)
        return module.forward(x)  # an activation: no parameters
    return call


@dataclass(frozen=True)
class _Step:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    projection: tuple[str, str, str | None, bool] | None = None
    """For the projection: (input, weight, bias or None, whether ``x @ weight``)."""


class _Projection(torch.autograd.Function):
    """The head's projection in backward: the weight's gradient is added, chunk by chunk,
    into one buffer with ``addmm_`` rather than made whole for each chunk and then added (a
    vocabulary-sized weight gradient per chunk would be the largest temporary)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                by_weight: bool, into: dict[str, torch.Tensor], names: tuple[str, str | None]
                ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.by_weight, ctx.into, ctx.names = by_weight, into, names
        out = x @ weight if by_weight else x @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        into, (weight_name, bias_name) = ctx.into, ctx.names
        grad_x = grad @ (weight.t() if ctx.by_weight else weight)
        a, b = (x.t(), grad) if ctx.by_weight else (grad.t(), x)
        if weight_name in into:
            # ``out=`` rather than ``addmm_``: the same kernel, and FLOP counters know it.
            torch.addmm(into[weight_name], a, b, out=into[weight_name])
        else:
            into[weight_name] = a @ b
        if bias_name is not None:
            summed = grad.sum(0)
            into[bias_name] = into[bias_name].add_(summed) if bias_name in into else summed
        return grad_x, None, None, None, None, None


def _projection_operands(node: fx.Node, gm: fx.GraphModule
                         ) -> tuple[str, str, str | None, bool] | None:
    """(input, weight, bias, ``x @ weight``) of a projection the in-place weight gradient
    can take, by name; None for other forms (they run as they are)."""
    def name(value: Any) -> str | None:
        return value.name if isinstance(value, fx.Node) else None

    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        bias = f"{node.target}.bias" if getattr(module, "bias", None) is not None else None
        return node.args[0].name, f"{node.target}.weight", bias, False  # type: ignore[union-attr]
    x = node.args[0] if node.args else None
    if _in(node, _LINEAR):
        weight, bias = _arg(node, 1, "weight"), _arg(node, 2, "bias")
        by_weight = False
    elif node.target is aten.addmm.default:
        if _arg(node, 3, "beta", 1) != 1 or _arg(node, 4, "alpha", 1) != 1:
            return None
        x, weight, bias = _arg(node, 1, "mat1"), _arg(node, 2, "mat2"), node.args[0]
        by_weight = True
    else:
        weight, bias, by_weight = _arg(node, 1, "mat2", _arg(node, 1, "other")), None, True
    if name(x) is None or name(weight) is None or (bias is not None and name(bias) is None):
        return None
    if len(_Shapes.of(weight) or (0,)) != 2 and "autockpt_tensor" in weight.meta:
        return None
    return name(x), name(weight), name(bias), by_weight  # type: ignore[return-value]


def _program(gm: fx.GraphModule, stretch: RowStretch) -> list[_Step]:
    by_name = {n.name: n for n in gm.graph.nodes}
    whole = set(stretch.whole)
    steps = []
    for name, kind in zip(stretch.nodes, stretch.kinds):
        node = by_name[name]
        if kind == "loss":
            logits, target, _ = _loss_operands(node, gm)  # type: ignore[misc]
            steps.append(_Step(name, F.cross_entropy, (_Ref(logits.name), _Ref(target.name)),
                               {"reduction": "sum", "ignore_index": stretch.ignore_index,
                                "label_smoothing": stretch.label_smoothing}))
            continue
        def ref(value: Any, flat: bool = False) -> Any:
            return fx.node.map_arg(value, lambda n: _Ref(n.name, flat))  # type: ignore

        first = node.args[0] if node.args else None
        operands = _projection_operands(node, gm) if kind == "projection" else None
        if operands is not None:
            x, weight, bias, by_weight = operands
            steps.append(_Step(name, _identity, (), {}, projection=operands))
            continue
        assert isinstance(first, fx.Node), name
        if kind == "view":
            steps.append(_Step(name, _rows_2d, (_Ref(first.name),), {}))
        elif kind == "identity":
            steps.append(_Step(name, _identity, (_Ref(first.name),), {}))
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            params = [f"{node.target}.{p}" for p, _ in module.named_parameters()]
            steps.append(_Step(name, _module_call(module, params),
                               (_Ref(first.name), *(_Ref(a) for a in params)), {}))
        else:
            args, kwargs = list(node.args), dict(node.kwargs)
            if kind in ("reduce", "softmax"):
                last = [-1] if isinstance(_arg(node, 1, "dim"), (list, tuple)) else -1
                if "dim" in kwargs:
                    kwargs["dim"] = last
                else:
                    args[1] = last
            fn = node.target if node.op == "call_function" else _method(str(node.target))
            flat = kind == "pointwise"
            new_args = tuple(
                ref(a, flat=flat and isinstance(a, fx.Node) and a.name in whole) for a in args)
            new_kwargs = {k: ref(v, flat=flat and isinstance(v, fx.Node) and v.name in whole)
                          for k, v in kwargs.items()}
            steps.append(_Step(name, fn, new_args, new_kwargs))
    return steps


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        got = env[value.name]
        if value.flat and isinstance(got, torch.Tensor) and got.dim() > 1:
            got = got.reshape(got.shape[-1])  # [1, 1, W] against [rows, W] keeps two dims
        return got
    if isinstance(value, (tuple, list)):
        return type(value)(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    return value


class ChunkedRows:
    """The node a chunked stretch becomes: ``chunked_rows(source, *whole, *attributes,
    *side)`` returns the stretch's loss, computed ``chunks`` chunks of rows at a time
    (NOTE [ The head in chunks of rows ])."""

    makes_every_gradient = True
    """Its backward makes the gradient of every input that requires grad, whichever are
    asked for (the profiler counts its parameters' gradients as any node's)."""

    def __init__(self, gm: fx.GraphModule, head: ChunkedHead) -> None:
        self.head = head
        self.steps = _program(gm, head.stretch)
        stretch = head.stretch
        self.names = (*stretch.whole, *stretch.attributes, *(n for n, _ in stretch.side))
        self.recording = None
        self.__name__ = self.__qualname__ = "chunked_rows"

    def __repr__(self) -> str:
        head = self.head
        return f"chunked_rows({head.stretch.source} -> {head.stretch.loss}, {head.chunks} chunks)"

    def record_parameter_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A list the next forward fills with ``(parameter, gradient)`` for the gradients it
        makes of parameters (leaf tensors), then forgets; the profiler counts them as
        parameter gradients."""
        self.recording: list[tuple[torch.Tensor, torch.Tensor]] | None = []
        return self.recording

    def __call__(self, source: torch.Tensor, *externals: Any) -> torch.Tensor:
        return _ChunkedRowsFunction.apply(self, source, *externals)

    def run(self, rows: torch.Tensor, env: dict[str, Any],
            into: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The stretch's summed loss over one chunk (``env`` holds the other inputs). With
        ``into``, the projection's parameter gradients are added into it in backward."""
        env = dict(env)
        env[self.head.stretch.source] = rows
        autocast = autocast_enabled(rows.device.type)  # planned on meta: no autocast there
        for step in self.steps:
            if step.projection is not None:
                x, weight, bias, by_weight = step.projection
                w, b = env[weight], (env[bias] if bias is not None else None)
                if into is not None and w.requires_grad and not autocast and (
                        b is None or b.requires_grad):
                    env[step.name] = _Projection.apply(env[x], w, b, by_weight, into,
                                                       (weight, bias))
                else:
                    out = env[x] @ w if by_weight else F.linear(env[x], w)
                    env[step.name] = out + b if b is not None else out
                continue
            env[step.name] = step.fn(*_resolve(step.args, env), **_resolve(step.kwargs, env))
        return env[self.head.stretch.loss]

    def inputs(self, externals: Sequence[Any], start: int, stop: int,
               rows: int) -> dict[str, Any]:
        """The stretch's other inputs for rows ``start:stop``: side tensors sliced, the rest
        whole."""
        stretch = self.head.stretch
        env = dict(zip(self.names, externals))
        for name, trailing in stretch.side:
            value = env[name]
            env[name] = value.reshape(rows, *value.shape[-trailing:] if trailing else ())[
                start:stop]
        return env

    def normalizer(self, externals: Sequence[Any], rows: int) -> torch.Tensor | int:
        """What the summed loss is divided by: 1 for a sum; for a mean the count of targets
        that are not ``ignore_index`` (class targets) or the row count (probabilities)."""
        stretch = self.head.stretch
        if stretch.reduction == "sum":
            return 1
        if not stretch.class_targets:
            return rows
        target = dict(zip(self.names, externals))[stretch.side[0][0]]
        return (target != stretch.ignore_index).sum()


class _ChunkedRowsFunction(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, its gradients; backward scales them by
    the gradient of the loss (NOTE [ Gradients in forward ])."""

    @staticmethod
    def forward(ctx: Any, runner: ChunkedRows, source: torch.Tensor, *externals: Any
                ) -> torch.Tensor:
        width = source.shape[-1]
        rows = source.numel() // width if width else 0
        # Detached leaves: the chunks' graphs are this function's own; views of tensors that
        # require grad, made without grad mode, would also confuse module hooks.
        flat = source.detach().reshape(rows, width)
        wants_source = source.requires_grad
        leaves = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad
                  else (x.detach() if isinstance(x, torch.Tensor) else x) for x in externals]
        wanted = [i for i, x in enumerate(externals)
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        norm = runner.normalizer(leaves, rows)
        grad_source = torch.empty_like(flat) if wants_source else None
        grads: list[torch.Tensor | None] = [None] * len(externals)
        into: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        step = runner.head.chunk_rows
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            # Plain saved tensors: hooks around this forward (a profiler's, an offloading
            # one) must not keep every chunk's log-softmax: they are freed with the chunk.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_unchanged,
                                                                                _unchanged):
                chunk = flat[start:stop].requires_grad_(wants_source)
                part = runner.run(chunk, runner.inputs(leaves, start, stop, rows), into)
            total = part.detach() if total is None else total + part.detach()
            targets = ([chunk] if wants_source else []) + [leaves[i] for i in wanted]
            if targets and part.requires_grad:
                found = list(torch.autograd.grad(part, targets, allow_unused=True))
                if grad_source is not None:
                    grad_source[start:stop] = found.pop(0)
                for i, value in zip(wanted, found):
                    if value is not None:
                        grads[i] = value if grads[i] is None else grads[i].add_(value)
            del part, chunk
        assert total is not None
        for i, name in enumerate(runner.names):
            if name in into:
                grads[i] = into[name] if grads[i] is None else grads[i].add_(into[name])
        if runner.recording is not None:
            runner.recording.extend((x, g) for g, x in zip(grads, externals)
                                    if g is not None and x.is_leaf)
            runner.recording = None
        ctx.grad_at = [i for i, g in enumerate(grads) if g is not None]
        ctx.count = len(externals)
        ctx.has_source = grad_source is not None
        ctx.used = False
        if isinstance(norm, torch.Tensor):
            norm = norm.to(total.dtype)
        kept = ([grad_source.view(source.shape)] if grad_source is not None else []) + [
            g for g in grads if g is not None]
        for g in kept:  # this function's own buffers: scaled in place
            g.div_(norm)
        ctx.save_for_backward(*kept)
        return total / norm

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise AutockptError(
                "the chunked head's backward ran twice: its gradients were computed in "
                "forward and are handed on once",
                fix="pass chunk_head=False to autockpt.apply for steps that call backward "
                "twice on one forward (retain_graph=True) or differentiate twice")
        ctx.used = True
        # In place: the buffers are this function's, handed on once (``ctx.used``).
        kept = [k.mul_(grad) for k in ctx.saved_tensors]
        grad_source = kept.pop(0) if ctx.has_source else None
        grads: list[torch.Tensor | None] = [None] * ctx.count
        for i, value in zip(ctx.grad_at, kept):
            grads[i] = value
        return (None, grad_source, *grads)


def chunk_rows(traced: TracedModel, head: ChunkedHead) -> TracedModel:
    """``traced`` with ``head.stretch`` replaced by one :class:`ChunkedRows` node; values of
    the stretch the graph returned are returned as ``None``. The original is not modified.

    Example:
        >>> # see find_row_stretch; autockpt.pipeline.plan_graph calls both
    """
    old = traced.graph_module.graph
    graph = fx.Graph()
    graph._codegen = old._codegen
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(old, value_map)
    stretch = head.stretch
    members = set(stretch.nodes) | set(stretch.dropped)
    by_name = {n.name: n for n in graph.nodes}
    missing = [name for name in (*members, stretch.source, *stretch.whole,
                                 *(n for n, _ in stretch.side)) if name not in by_name]
    if missing:
        raise AutockptError(
            f"the plan runs a head in chunks over nodes this graph does not have "
            f"({format_names(missing)})",
            fix="make the plan with autockpt.plan() on this model and these inputs")
    # Whatever the graph returns of the stretch, the loss aside, is None now: which node
    # that is can differ between dtypes (a ``.float()`` that is a no-op in float32).
    returned = members - {stretch.loss}
    graph.output(fx.node.map_arg(out, lambda n: None if n.name in returned else n))
    loss = by_name[stretch.loss]
    gm = fx.GraphModule(traced.graph_module, graph, class_name=type(traced.graph_module).__name__)
    runner = ChunkedRows(gm, head)
    with graph.inserting_before(loss):
        attributes = [graph.get_attr(name) for name in stretch.attributes]
        inputs = ([by_name[stretch.source]] + [by_name[n] for n in stretch.whole] + attributes
                  + [by_name[n] for n, _ in stretch.side])
        node = graph.create_node("call_function", runner, tuple(inputs), {},
                                 name="chunked_rows")
    loss.replace_all_uses_with(node)
    for erased in reversed([n for n in graph.nodes if n.name in members]):
        graph.erase_node(erased)
    graph.lint()
    gm.recompile()
    return replace(traced, graph_module=gm)


def chunked_head(stretch: RowStretch, gradient_flops: int = 0) -> ChunkedHead:
    """The chunk count and rows per chunk for ``stretch``; its backward costs
    ``gradient_flops`` (known once the chunked graph is profiled)."""
    chunks = chunk_count(stretch.rows, stretch.hidden_width, stretch.width)
    return ChunkedHead(stretch=stretch, chunks=chunks, chunk_rows=math.ceil(stretch.rows / chunks),
                       gradient_flops=gradient_flops)
