"""The outputs of a few ATen ops made directly on fake tensors, for the profile.

# NOTE [ Ops answered by a shape rule ]
The profile runs every op of the model on fake tensors, forward and backward. For most ops
that is cheap: their meta kernel is C++, or FakeTensorMode's cache answers a shape it has
seen. Normalisations are the exception: BatchNorm, LayerNorm and GroupNorm have no C++ meta
kernel, so a fake tensor runs their Python decomposition, dozens of small ops, every time it
meets a new shape: 20-40 ms per op on this 2-core CPU. A DenseNet-121 meets 120 BatchNorm
shapes, forward and backward, and spent half of its planning time there; the elementwise
backwards of activations (ReLU's ``threshold_backward``, GELU's, SiLU's) cost a few ms each
the same way.

What the profile reads of an op is its outputs: shapes, strides, dtypes and storage sizes,
never values. For these ops those follow from the inputs by rules that are short and known,
so :data:`SHAPE_RULES` makes the outputs as empty fake tensors instead of running the op.
Each rule claims only the common case (floating inputs of one dtype in a dense contiguous or
channels-last layout, training mode) and returns None for anything else, which then runs
the op as before. tests/test_shape_rules.py checks every rule against the op itself on a grid
of shapes, layouts and dtypes, and the profiles of the zoo with and without the rules.
None of these ops is counted by ``FlopCounterMode`` (a normalisation's FLOPs are not in its
table), so skipping the kernel changes no FLOP count either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["SHAPE_RULES", "ShapeRule"]

ShapeRule = Callable[..., Any]
"""Takes an op's arguments as the op does; returns its outputs, or None to run the op."""

_FLOATS = (torch.float32, torch.float64)


def _packed_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The strides torch gives a new tensor of ``shape`` whose dimensions lie in memory in
    ``order``, innermost first (a dimension of size 1 or 0 counts as 1)."""
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def _contiguous(tensor: Any) -> bool:
    """A fake tensor with the strides ``torch.empty`` gives its shape. Stricter than
    ``is_contiguous()``, which ignores the stride of a dimension of size 1: kernels copy that
    stride into their outputs, so a rule that chose its own would disagree with the op."""
    return isinstance(tensor, FakeTensor) and tensor.numel() > 0 and \
        tensor.stride() == _packed_strides(tensor.shape, range(tensor.dim() - 1, -1, -1))


def _channels_last(tensor: Any) -> bool:
    """A 4-D or 5-D fake tensor with the strides ``torch.empty(..., memory_format=
    torch.channels_last)`` (or ``channels_last_3d``) gives its shape."""
    if not isinstance(tensor, FakeTensor) or tensor.dim() not in (4, 5) or tensor.numel() == 0:
        return False
    order = [1, *range(tensor.dim() - 1, 1, -1), 0]
    return tensor.stride() == _packed_strides(tensor.shape, order)


def _dense(tensor: Any) -> bool:
    """A fake floating tensor laid out as a new contiguous or channels-last tensor is, the
    layouts in which the outputs of these ops copy their input's strides (dimensions of
    size 1 included, checked on the grid of tests/test_shape_rules.py)."""
    return isinstance(tensor, FakeTensor) and tensor.dtype in _FLOATS and \
        (_contiguous(tensor) or _channels_last(tensor))


def _vector(tensor: Any, size: int, dtype: torch.dtype) -> bool:
    """None, or a fake 1-D contiguous tensor of ``size`` elements of ``dtype``."""
    return tensor is None or (isinstance(tensor, FakeTensor) and tensor.dtype == dtype
                              and tensor.dim() == 1 and tensor.numel() == size
                              and _contiguous(tensor))


def _same_layout(first: torch.Tensor, *others: Any) -> bool:
    return all(isinstance(t, FakeTensor) and t.dtype == first.dtype and t.shape == first.shape
               and t.stride() == first.stride() for t in others)


def _empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _batch_norm(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                training: bool, momentum: float, eps: float) -> Any:
    if not training or not _dense(input) or input.dim() < 2 or input.numel() == input.shape[1]:
        # One value per channel: the op refuses it (torch.nn.functional.batch_norm says
        # "Expected more than 1 value per channel"), so it runs and raises as it would.
        return None
    channels = input.shape[1]
    if not all(_vector(t, channels, input.dtype)
               for t in (weight, bias, running_mean, running_var)):
        return None
    return (torch.empty_like(input), _empty((channels,), input),
            _empty((channels,), input))


def _batch_norm_backward(grad_out: Any, input: Any, weight: Any, running_mean: Any,
                         running_var: Any, save_mean: Any, save_invstd: Any, train: bool,
                         eps: float, output_mask: Sequence[bool]) -> Any:
    if not train or not _dense(input) or input.dim() < 2 or not _same_layout(input, grad_out):
        return None
    channels = input.shape[1]
    if not all(_vector(t, channels, input.dtype)
               for t in (weight, running_mean, running_var, save_mean, save_invstd)):
        return None
    # The decomposition that fake tensors run makes the input's gradient even when it is not
    # asked for; the rule gives what the op gives.
    return (torch.empty_like(input),
            _empty((channels,), input) if output_mask[1] else None,
            _empty((channels,), input) if output_mask[2] else None)


def _normalized(input: Any, normalized_shape: Sequence[int]) -> int:
    """Where the normalised dimensions of a dense contiguous ``input`` start, or -1."""
    if not _contiguous(input) or input.dtype not in _FLOATS:
        return -1
    axis = input.dim() - len(normalized_shape)
    return axis if axis >= 0 and tuple(input.shape[axis:]) == tuple(normalized_shape) else -1


def _affine(tensor: Any, input: torch.Tensor, normalized_shape: Sequence[int]) -> bool:
    return tensor is None or (isinstance(tensor, FakeTensor) and tensor.dtype == input.dtype
                              and tuple(tensor.shape) == tuple(normalized_shape)
                              and _contiguous(tensor))


def _layer_norm(input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any,
                eps: float) -> Any:
    axis = _normalized(input, normalized_shape)
    if axis < 0 or not all(_affine(t, input, normalized_shape) for t in (weight, bias)):
        return None
    stats = list(input.shape[:axis]) + [1] * len(normalized_shape)
    return torch.empty_like(input), _empty(stats, input), _empty(stats, input)


def _layer_norm_backward(grad_out: Any, input: Any, normalized_shape: Sequence[int], mean: Any,
                         rstd: Any, weight: Any, bias: Any, output_mask: Sequence[bool]) -> Any:
    if _normalized(input, normalized_shape) < 0 or not _same_layout(input, grad_out):
        return None
    if not all(_affine(t, input, normalized_shape) for t in (weight, bias)):
        return None
    if (output_mask[1] and weight is None) or (output_mask[2] and bias is None):
        return None
    return (torch.empty_like(input) if output_mask[0] else None,
            torch.empty_like(weight) if output_mask[1] else None,
            torch.empty_like(bias) if output_mask[2] else None)


def _group_norm(input: Any, weight: Any, bias: Any, n: int, channels: int, hxw: int,
                groups: int, eps: float) -> Any:
    if not _contiguous(input) or input.dtype not in _FLOATS or input.dim() < 2 or \
            input.shape[0] != n or input.shape[1] != channels:
        return None
    if not all(_vector(t, channels, input.dtype) for t in (weight, bias)):
        return None
    return torch.empty_like(input), _empty((n, groups), input), _empty((n, groups), input)


def _group_norm_backward(grad_out: Any, input: Any, mean: Any, rstd: Any, weight: Any, n: int,
                         channels: int, hxw: int, groups: int,
                         output_mask: Sequence[bool]) -> Any:
    if not _contiguous(input) or input.dtype not in _FLOATS or input.dim() < 2 \
            or not _same_layout(input, grad_out) or input.shape[0] != n \
            or input.shape[1] != channels:
        return None
    if not _vector(weight, channels, input.dtype):
        return None
    return (torch.empty_like(input) if output_mask[0] else None,
            _empty((channels,), input) if output_mask[1] else None,
            _empty((channels,), input) if output_mask[2] else None)


def _view_size(numel: int, size: Sequence[int]) -> list[int] | None:
    """``size`` with its -1 filled in, or None where it does not hold ``numel`` elements."""
    shape = list(size)
    if shape.count(-1) > 1 or any(n < -1 for n in shape):
        return None
    known = 1
    for n in shape:
        if n != -1:
            known *= n
    if -1 in shape:
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    elif known != numel:
        return None
    return shape


# NOTE [ The strides of a view ]
# A view needs no copy when each run of its dimensions falls inside a block of the input that
# is evenly strided in memory. Walking the input from its innermost dimension out, a block
# ends before a dimension whose stride is not the block's element count times the block's
# innermost stride; a dimension of size 1 never ends one (its stride is never used to reach
# an element). The view's dimensions are then dealt out to the blocks from the innermost:
# each takes the block's innermost stride times the elements of the view's dimensions dealt
# to the same block before it, and a dimension of size 1 goes to the block being dealt to,
# so the outermost ones go to the outermost block. Where a block's elements do not match a
# run of the view's dimensions exactly, the view would need a copy and the op raises; the
# rule leaves that to the op. This is the rule torch's C++ view follows, so the rule's
# strides equal the real op's on any layout. Fake tensors run torch's Python reference
# instead, which agrees except on the size-1 dimensions of an input whose own size-1
# dimensions are not packed (:func:`_packed_ones`); those the rule leaves to the op, so that
# a profile is the same with the rule or without. tests/test_shape_rules.py draws layouts,
# sizes of 1 with odd strides and storage offsets to check the rule against the op, fake and
# real.
def _view_strides(shape: Sequence[int], strides: Sequence[int], size: Sequence[int]
                  ) -> list[int] | None:
    """The strides of a view of ``size`` of a tensor laid out as (``shape``, ``strides``), or
    None where it needs a copy (NOTE [ The strides of a view ])."""
    blocks: list[tuple[int, int]] = []  # (elements, innermost stride), innermost block first
    elements, base = 1, strides[-1]
    for d in range(len(shape) - 1, -1, -1):
        elements *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != elements * base):
            blocks.append((elements, base))
            if d > 0:
                elements, base = 1, strides[d - 1]
    out = [0] * len(size)
    v = len(size) - 1
    for elements, base in blocks:
        dealt = 1
        while v >= 0 and (dealt < elements or size[v] == 1):
            out[v] = dealt * base
            dealt *= size[v]
            v -= 1
        if dealt != elements:
            return None
    return out if v < 0 else None


def _packed_ones(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether each dimension of size 1 has the stride it would have packed against the
    dimension inside it (1 for the innermost). torch's Python reference for ``view``, which
    fake tensors run, gives other strides than the C++ op to the size-1 dimensions of a view
    of any other layout; the rule claims only the layouts where both agree."""
    for d, n in enumerate(shape):
        if n == 1 and strides[d] != (1 if d == len(shape) - 1 else strides[d + 1] * shape[d + 1]):
            return False
    return True


def _view(input: Any, size: Sequence[int]) -> Any:
    """The view as ``as_strided`` on the same storage, with the strides torch's view gives
    (``as_strided`` has a C++ meta kernel; ``view`` on a fake tensor runs torch's Python
    reference for every new shape)."""
    if not isinstance(input, FakeTensor) or input.dim() == 0 or input.numel() == 0 \
            or len(size) == 0:
        return None
    shape = _view_size(input.numel(), size)
    if shape is None:
        return None
    if not _packed_ones(input.shape, input.stride()):
        return None
    strides = _view_strides(input.shape, input.stride(), shape)
    if strides is None:
        return None
    return input.as_strided(shape, strides, input.storage_offset())


def _device(tensor: Any) -> Any:
    """``tensor.device`` of a fake tensor, as FakeTensorMode answers it (autograd asks it
    thousands of times per model, each through every mode on the stack)."""
    if not isinstance(tensor, FakeTensor):
        return None
    return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device


def _pointwise_backward(grad_out: Any, input: Any, *rest: Any, **kwargs: Any) -> Any:
    """The backward of an activation: the gradient of its input, laid out like both
    operands when they share a layout."""
    if not _dense(grad_out) or not _same_layout(grad_out, input):
        return None
    return torch.empty_like(grad_out)


def _symbolic(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and any(
        isinstance(size, torch.SymInt) for size in tensor.shape)


def _constant_pad(input: Any, pad: Sequence[Any], value: Any = 0) -> Any:
    """A constant padding of a tensor with symbolic sizes (NOTE [ One profile for every shape ]
    in :mod:`autockpt.profiling.symbolic`): the C++ kernel reads the sizes as ints, which
    fixes them, and torch's own decomposition does not."""
    if not _symbolic(input):
        return None
    from torch._decomp import decomposition_table

    return decomposition_table[_aten.constant_pad_nd.default](input, pad, value)


def _pad(input: Any, pad: Sequence[Any], mode: str = "constant", value: Any = None) -> Any:
    """``aten.pad`` in constant mode: :func:`_constant_pad`."""
    if mode != "constant":
        return None
    return _constant_pad(input, pad, 0 if value is None else value)


_aten = torch.ops.aten

SHAPE_RULES: Mapping[torch._ops.OpOverload, ShapeRule] = {
    _aten.native_batch_norm.default: _batch_norm,
    _aten.native_batch_norm_backward.default: _batch_norm_backward,
    _aten.native_layer_norm.default: _layer_norm,
    _aten.native_layer_norm_backward.default: _layer_norm_backward,
    _aten.native_group_norm.default: _group_norm,
    _aten.native_group_norm_backward.default: _group_norm_backward,
    _aten.threshold_backward.default: _pointwise_backward,
    _aten.gelu_backward.default: _pointwise_backward,
    _aten.silu_backward.default: _pointwise_backward,
    _aten.sigmoid_backward.default: _pointwise_backward,
    _aten.tanh_backward.default: _pointwise_backward,
    _aten.view.default: _view,
    _aten.constant_pad_nd.default: _constant_pad,
    _aten.pad.default: _pad,
    torch.ops.prim.device.default: _device,
}
"""The ops answered by a rule (NOTE [ Ops answered by a shape rule ])."""
