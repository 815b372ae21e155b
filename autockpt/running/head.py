"""The head of a language model and its loss, run in chunks of rows.

A transform: :func:`chunk_rows` returns a new graph in which the stretch that
:func:`autockpt.planning.head.find_row_stretch` found (NOTE [ The head in chunks of rows ]
there) is one node, an autograd Function that computes it a chunk of rows at a time.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autockpt.capturing.meta import autocast_enabled
from autockpt.capturing.trace import TracedModel
from autockpt.errors import AutockptError
from autockpt.planning.head import (LINEAR_OPS, MIN_CHUNK_ROWS, RowShapes, is_one_of,
                                    loss_operands, node_argument)
from autockpt.profiling.stats import ChunkedHead, RowStretch
from autockpt.units import format_names

__all__ = ["chunk_rows", "ChunkedRows"]

aten = torch.ops.aten


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
    if is_one_of(node, LINEAR_OPS):
        weight, bias = node_argument(node, 1, "weight"), node_argument(node, 2, "bias")
        by_weight = False
    elif node.target is aten.addmm.default:
        if node_argument(node, 3, "beta", 1) != 1 or node_argument(node, 4, "alpha", 1) != 1:
            return None
        x = node_argument(node, 1, "mat1")
        weight, bias = node_argument(node, 2, "mat2"), node.args[0]
        by_weight = True
    else:
        other = node_argument(node, 1, "other")
        weight, bias, by_weight = node_argument(node, 1, "mat2", other), None, True
    if name(x) is None or name(weight) is None or (bias is not None and name(bias) is None):
        return None
    if len(RowShapes.of(weight) or (0,)) != 2 and "autockpt_tensor" in weight.meta:
        return None
    return name(x), name(weight), name(bias), by_weight  # type: ignore[return-value]


def _program(gm: fx.GraphModule, stretch: RowStretch) -> list[_Step]:
    by_name = {n.name: n for n in gm.graph.nodes}
    whole = set(stretch.whole)
    steps = []
    for name, kind in zip(stretch.nodes, stretch.kinds):
        node = by_name[name]
        if kind == "loss":
            logits, target, _ = loss_operands(node, gm)  # type: ignore[misc]
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
                last = [-1] if isinstance(node_argument(node, 1, "dim"), (list, tuple)) else -1
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


# NOTE [ A chunked head for every shape ]
# One program serves every shape its plan covers (NOTE [ Buckets of shapes ] in
# autockpt/planning/buckets.py), so the loop over chunks cannot bake in the rows of the shape
# it was planned at. It keeps the plan's chunk count and takes the rows per chunk from the
# call: ceil(rows / chunks), but never fewer than the plan's own rows per chunk or
# MIN_CHUNK_ROWS, whichever is less (a small batch run by a plan for the largest one would
# otherwise run many tiny chunks, each reading the whole projection). At the planned shape
# that is the plan's chunking exactly; at a smaller one, chunks no larger than the plan's,
# so no more memory. A fixed count also lets the profile on symbolic sizes run the loop
# without fixing the rows (NOTE [ One profile for every shape ] in
# autockpt/profiling/symbolic.py): the comparisons of rows with chunk bounds become guards.


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
        # NOTE [ A chunked head for every shape ]
        step = max(-(-rows // runner.head.chunks),
                   min(runner.head.chunk_rows, MIN_CHUNK_ROWS))
        for index in range(runner.head.chunks):
            start = index * step
            if start >= rows:
                break
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


