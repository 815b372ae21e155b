"""The shapes of a call: its keys, the tensor shapes inside it, and which shapes a graph takes.

A transformed module plans once per input *structure* (the arguments' nesting, dtypes, devices,
``requires_grad`` and Python constants: :func:`structure_key`) and prices each input *shape*
(:func:`tensor_shapes`) on the graph captured for that structure. A graph captured by
torch.export with dynamic dimensions runs at every shape its symbolic sizes admit
(:class:`InputDims`); a torch.fx graph holds sizes as graph values and runs at any.

NOTE [ One graph for every shape ]
Fine-tuning loops change shape every batch (dynamic padding, multi-scale images, the smaller
last batch). torch.fx graphs are shape-generic already: sizes are read in the graph. An
exported graph specialises on every size unless dimensions are marked dynamic, so the export
rung marks every dimension of every tensor input ``Dim.AUTO``: torch.export keeps a size
symbolic where the model allows and specialises it where the model branches on it (or where
it is 0 or 1). The placeholders' fake values then say, per dimension, a fixed size or a
symbol with its range; :meth:`InputDims.accepts` checks a new call against them (the same
symbol the same size everywhere), so one capture serves every shape it admits and a shape it
does not admit is captured again, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autockpt.capturing.meta import autocast_enabled

__all__ = [
    "InputDims",
    "Shapes",
    "input_dims",
    "resized",
    "resized_call",
    "tensor_names",
    "tensors_in",
    "signature_key",
    "structure_key",
    "tensor_shapes",
]

Shapes = tuple[tuple[int, ...], ...]
"""The shapes of the tensors in a call, in the order :func:`tensor_shapes` walks them."""


def signature_key(arguments: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two calls run different code: tensor shapes, dtypes, devices and
    ``requires_grad``, the values of Python constants (they are baked into the graph), and the
    structure of nested inputs (a dict batch with another key, or a tensor where ``None`` was,
    is another graph), down to the tensors and constants inside them.

    Example:
        >>> import torch
        >>> signature_key({"x": torch.ones(2, 3)})[0]
        ('x', ((2, 3), torch.float32, 'cpu', False))
    """
    return _key(arguments, shapes=True)


def structure_key(arguments: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`signature_key` with each tensor's shape replaced by its number of dimensions:
    the calls that share one captured graph (NOTE [ One graph for every shape ]).

    Example:
        >>> import torch
        >>> structure_key({"x": torch.ones(2, 3)}) == structure_key({"x": torch.ones(5, 7)})
        True
    """
    return _key(arguments, shapes=False)


def _key(arguments: dict[str, Any], *, shapes: bool) -> tuple[Any, ...]:
    devices: list[str] = []
    key: list[Any] = [(name, _value_key(value, devices, shapes))
                      for name, value in arguments.items()]
    # Autocast changes the dtype, so the size, of every activation: a plan made under
    # bfloat16 autocast and reused without it (or the reverse) holds for the wrong sizes, and
    # a bf16 plan run in float32 overshoots its budget. Plan once per autocast setting.
    for device in sorted(set(devices)):
        if autocast_enabled(device):  # False for a device type autocast does not know
            key.append(("autocast", device, torch.get_autocast_dtype(device)))
    return tuple(key)


def _value_key(value: Any, devices: list[str], shapes: bool) -> Any:
    if isinstance(value, torch.Tensor):
        devices.append(value.device.type)
        size = tuple(value.shape) if shapes else value.dim()
        return (size, value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, (type(None), bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(item, devices, shapes) for item in value))
    if isinstance(value, Mapping):
        return (type(value).__name__,
                tuple((key, _value_key(item, devices, shapes)) for key, item in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple(
            (f.name, _value_key(getattr(value, f.name), devices, shapes))
            for f in dataclasses.fields(value)))
    return type(value).__name__


def _named_tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor inside ``value`` (at ``path``) and its path, in the order
    :func:`_value_key` walks them."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _named_tensors(item, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named_tensors(item, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _named_tensors(getattr(value, f.name), f"{path}.{f.name}")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value``, in the order :func:`_value_key` walks them."""
    return [tensor for _, tensor in _named_tensors(value, "")]


def tensors_in(arguments: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a call, in the order :func:`tensor_shapes` gives their shapes.

    Example:
        >>> import torch
        >>> [tuple(t.shape) for t in tensors_in({"x": torch.ones(2), "y": [torch.ones(3)]})]
        [(2,), (3,)]
    """
    return _tensors(dict(arguments))


def tensor_shapes(arguments: dict[str, Any]) -> Shapes:
    """The shape of each tensor in a call, in the order of its bound arguments (inside nested
    tuples, lists, dicts and dataclasses too).

    Example:
        >>> import torch
        >>> tensor_shapes({"x": torch.ones(2, 3), "batch": {"mask": torch.ones(2)}})
        ((2, 3), (2,))
    """
    return tuple(tuple(t.shape) for t in _tensors(dict(arguments)))


def resized(arguments: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """The call ``arguments`` with each tensor at the matching shape of ``shapes`` (each at
    least as large in every dimension): zeros, with the call's own values in the leading
    corner, so that token ids, masks and labels stay ones the model takes. What a plan for a
    larger shape than the call's is priced on (fake tensors read only the shapes; a real
    replay reads the values).

    Example:
        >>> import torch
        >>> resized({"x": torch.ones(1, 2)}, ((2, 3),))["x"]
        tensor([[1., 1., 0.],
                [0., 0., 0.]])
    """
    found = iter(shapes)

    def grow(value: torch.Tensor) -> torch.Tensor:
        shape = next(found)
        if tuple(value.shape) == tuple(shape):
            return value
        with torch.no_grad():
            bigger = value.new_zeros(shape)
            bigger[tuple(slice(0, size) for size in value.shape)] = value
        return bigger.requires_grad_(value.requires_grad)

    return {name: _map_tensors(value, grow) for name, value in arguments.items()}


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` rebuilt with ``fn`` applied to each tensor inside it, in the order
    :func:`_value_key` walks them."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [_map_tensors(item, fn) for item in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, Mapping):
        mapped = {key: _map_tensors(item, fn) for key, item in value.items()}
        try:
            return type(value)(mapped)
        except TypeError:
            return mapped
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: _map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)
            if f.init})
    return value


def resized_call(args: tuple[Any, ...], kwargs: dict[str, Any], arguments: dict[str, Any],
                 shapes: Shapes) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """A call ``(args, kwargs)`` bound to ``arguments``, with its tensors at ``shapes``
    (:func:`resized`): the new ``args``, ``kwargs`` and bound arguments."""
    grown = resized(arguments, shapes)
    swap = {id(old): new for old, new in zip(_tensors(dict(arguments)), _tensors(grown))}

    def put(value: torch.Tensor) -> torch.Tensor:
        return swap.get(id(value), value)

    return (tuple(_map_tensors(a, put) for a in args),
            {k: _map_tensors(v, put) for k, v in kwargs.items()}, grown)


def tensor_names(arguments: dict[str, Any]) -> tuple[str, ...]:
    """A name for each tensor of :func:`tensor_shapes`, as the user would index it.

    Example:
        >>> import torch
        >>> tensor_names({"x": torch.ones(1), "batch": {"mask": torch.ones(1)}})
        ('x', "batch['mask']")
    """
    return tuple(path for name, value in arguments.items()
                 for path, _ in _named_tensors(value, name))


@dataclass(frozen=True)
class InputDims:
    """The input sizes an exported graph was captured for: per placeholder, per dimension,
    a fixed size or a symbol's name, and each symbol's range (NOTE [ One graph for every
    shape ])."""

    dims: tuple[tuple[int | str, ...] | None, ...]
    """Per placeholder (in order): its tensor's dimensions, ``None`` for a non-tensor."""
    ranges: tuple[tuple[str, int, int | None], ...]
    """``(symbol, lowest, highest)`` for each symbol; ``None``: no upper bound."""

    @property
    def dynamic(self) -> bool:
        """Whether any size is symbolic."""
        return any(isinstance(d, str) for dims in self.dims if dims for d in dims)

    def accepts(self, values: Sequence[Any]) -> bool:
        """Whether the graph runs on placeholder values ``values``.

        Example:
            >>> import torch
            >>> dims = InputDims(dims=((4, "s0"),), ranges=(("s0", 2, None),))
            >>> dims.accepts([torch.ones(4, 9)]), dims.accepts([torch.ones(3, 9)])
            (True, False)
        """
        if len(values) != len(self.dims):
            return False
        bound: dict[str, int] = {}
        for value, dims in zip(values, self.dims):
            if dims is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() != len(dims):
                return False
            for want, size in zip(dims, value.shape):
                if isinstance(want, int):
                    if want != size:
                        return False
                elif bound.setdefault(want, int(size)) != size:
                    return False
        for symbol, lowest, highest in self.ranges:
            if symbol in bound and (bound[symbol] < lowest
                                    or (highest is not None and bound[symbol] > highest)):
                return False
        return True


def input_dims(graph: fx.Graph, range_constraints: Mapping[Any, Any]) -> InputDims:
    """The :class:`InputDims` of an exported graph, read off its placeholders' fake values. A
    size that is an expression of symbols rather than one symbol is taken as fixed at its
    captured value, so that such a graph takes no other size there."""
    dims: list[tuple[int | str, ...] | None] = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            dims.append(None)
            continue
        one: list[int | str] = []
        for size in value.shape:
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                one.append(str(expr) if getattr(expr, "is_Symbol", False)
                           else int(size.node.hint))
            else:
                one.append(int(size))
        dims.append(tuple(one))
    ranges = []
    for symbol, bounds in range_constraints.items():
        lowest, highest = bounds.lower, bounds.upper
        ranges.append((str(symbol), int(lowest) if _finite(lowest) else 0,
                       int(highest) if _finite(highest) else None))
    return InputDims(tuple(dims), tuple(sorted(ranges)))


def _finite(bound: Any) -> bool:
    # torch's int_oo is an integer to sympy but no finite one.
    return bool(getattr(bound, "is_finite", True)) and bool(getattr(bound, "is_integer", True)
                                                            ) and "oo" not in str(bound)
