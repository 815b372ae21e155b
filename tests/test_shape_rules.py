"""NOTE [ Ops answered by a shape rule ] in autockpt/profiling/shape_rules.py: each rule gives what the op
itself gives on fake tensors (shape, strides, dtype, device, storage size of every output),
on a grid of shapes, layouts, dtypes and flags; where it does not claim a case, the op runs;
and profiles made with the rules equal those made without, node for node."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from autockpt import profile as profile_module
from autockpt.capturing.ladder import capture
from autockpt.capturing.trace import bind_inputs
from autockpt.ops.fake_outputs import SHARED
from autockpt.profiling.profile import profile
from autockpt.profiling.shape_rules import SHAPE_RULES
from tests.zoo import CASES, ZooCase

aten = torch.ops.aten


def _meta(value: Any) -> Any:
    if value is None:
        return None
    return (tuple(value.shape), value.stride(), value.dtype, value.device,
            value.untyped_storage().nbytes(), value.storage_offset())


def _compare(op: torch._ops.OpOverload, make: Callable[[], tuple[Any, ...]]) -> bool:
    """Runs ``op`` on the fake arguments ``make()`` builds, by its rule and by itself; the
    outputs must agree. Returns whether the rule claimed the case."""
    with FakeTensorMode():
        args = make()
        by_rule = SHAPE_RULES[op](*args)
        by_op = op(*args)
    if by_rule is None:
        return False
    rule_out = by_rule if isinstance(by_rule, tuple) else (by_rule,)
    op_out = by_op if isinstance(by_op, tuple) else (by_op,)
    assert [_meta(t) for t in rule_out] == [_meta(t) for t in op_out], (op, args)
    return True


def _layout(shape: Sequence[int], layout: str, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(tuple(shape), dtype=dtype)
    if layout == "channels_last":
        return t.to(memory_format=torch.channels_last if t.dim() == 4
                    else torch.channels_last_3d)
    if layout == "transposed":
        return torch.empty(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)
    if layout == "strided":
        return torch.empty(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]
    if layout == "odd_ones":
        # Contiguous to is_contiguous(), which ignores the stride of a size-1 dimension; a
        # kernel's output copies that stride, so a rule must not claim it as contiguous.
        return t.as_strided(shape, [7 if n == 1 else st for n, st in zip(shape, t.stride())])
    return t


SHAPES = [(2, 3), (4, 3, 5), (2, 3, 4, 4), (2, 1, 1, 1), (1, 5, 1, 3), (2, 3, 2, 2, 2),
          (2, 4, 1, 1), (3, 1, 4), (1, 4, 3)]
LAYOUTS = ["contiguous", "channels_last", "transposed", "strided", "odd_ones"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _cases(min_dim: int = 2) -> list[tuple[tuple[int, ...], str, torch.dtype]]:
    return [(shape, layout, dtype) for shape, layout, dtype in itertools.product(
        SHAPES, LAYOUTS, DTYPES)
        if len(shape) >= min_dim and (layout != "channels_last" or len(shape) in (4, 5))]


def test_no_rule_skips_an_op_that_flops_are_counted_for() -> None:
    assert not set(SHAPE_RULES) & set(flop_registry)


@pytest.mark.parametrize("affine,stats", [(True, True), (False, True), (True, False)])
def test_batch_norm(affine: bool, stats: bool) -> None:
    claimed = 0
    for (shape, layout, dtype), training in itertools.product(_cases(), (True, False)):
        if not training and not stats:
            continue
        channels = shape[1]

        def vector(wanted: bool, d: torch.dtype = dtype) -> torch.Tensor | None:
            return torch.empty(channels, dtype=d) if wanted else None

        def forward() -> tuple[Any, ...]:
            return (_layout(shape, layout, dtype), vector(affine), vector(affine),
                    vector(stats), vector(stats), training, 0.1, 1e-5)

        claimed += _compare(aten.native_batch_norm.default, forward)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            def backward(mask: list[bool] = mask) -> tuple[Any, ...]:
                x = _layout(shape, layout, dtype)
                return (_layout(shape, layout, dtype), x, vector(affine), vector(stats),
                        vector(stats), vector(True), vector(True), training, 1e-5, mask)

            claimed += _compare(aten.native_batch_norm_backward.default, backward)
    assert claimed > 40  # the common cases are answered by the rule


def test_batch_norm_with_mixed_dtypes_runs_the_op() -> None:
    def forward() -> tuple[Any, ...]:
        return (torch.empty(2, 3, 4, 4), torch.empty(3, dtype=torch.float64), None, None,
                None, True, 0.1, 1e-5)

    assert not _compare(aten.native_batch_norm.default, forward)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine: bool) -> None:
    claimed = 0
    for shape, layout, dtype in _cases():
        for normalized in (shape[-1:], shape[-2:]):
            def weight() -> torch.Tensor | None:
                return torch.empty(normalized, dtype=dtype) if affine else None

            def forward() -> tuple[Any, ...]:
                return _layout(shape, layout, dtype), list(normalized), weight(), weight(), 1e-5

            claimed += _compare(aten.native_layer_norm.default, forward)
            for mask in ([True, affine, affine], [True, False, False]):
                def backward(mask: list[bool] = mask) -> tuple[Any, ...]:
                    x = _layout(shape, layout, dtype)
                    _, mean, rstd = aten.native_layer_norm.default(
                        x, list(normalized), None, None, 1e-5)
                    return (_layout(shape, layout, dtype), x, list(normalized), mean, rstd,
                            weight(), weight(), mask)

                claimed += _compare(aten.native_layer_norm_backward.default, backward)
    assert claimed > 20


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm(affine: bool) -> None:
    claimed = 0
    for shape, layout, dtype in _cases():
        channels = shape[1]
        hxw = 1
        for n in shape[2:]:
            hxw *= n
        for groups in sorted({1, channels}):
            def weight() -> torch.Tensor | None:
                return torch.empty(channels, dtype=dtype) if affine else None

            def forward(groups: int = groups) -> tuple[Any, ...]:
                return (_layout(shape, layout, dtype), weight(), weight(), shape[0], channels,
                        hxw, groups, 1e-5)

            claimed += _compare(aten.native_group_norm.default, forward)
            for mask in ([True, affine, affine], [True, False, False]):
                def backward(groups: int = groups, mask: list[bool] = mask) -> tuple[Any, ...]:
                    stats = torch.empty(shape[0], groups, dtype=dtype)
                    return (_layout(shape, layout, dtype), _layout(shape, layout, dtype),
                            stats, stats, weight(), shape[0], channels, hxw, groups, mask)

                claimed += _compare(aten.native_group_norm_backward.default, backward)
    assert claimed > 20


@pytest.mark.parametrize("op,extra", [
    (aten.threshold_backward.default, (0.0,)),
    (aten.gelu_backward.default, ()),
    (aten.silu_backward.default, ()),
    (aten.sigmoid_backward.default, ()),
    (aten.tanh_backward.default, ()),
])
def test_activation_backward(op: torch._ops.OpOverload, extra: tuple[Any, ...]) -> None:
    claimed = 0
    for (shape, layout, dtype), other in itertools.product(_cases(1), LAYOUTS):
        if other == "channels_last" and len(shape) not in (4, 5):
            continue

        def args(other: str = other) -> tuple[Any, ...]:
            return (_layout(shape, layout, dtype), _layout(shape, other, dtype), *extra)

        claimed += _compare(op, args)
    assert claimed > 10


@pytest.mark.parametrize("case", [c for c in CASES if c.traceable], ids=lambda c: c.name)
def test_profiles_with_and_without_rules_agree(monkeypatch: pytest.MonkeyPatch,
                                               case: ZooCase) -> None:
    model = case.build().train()
    args, kwargs = case.inputs()
    traced = capture(model, args, kwargs, method="fx")
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(
        bind_inputs(model, args, kwargs))))
    # Every op runs: the memo would answer the second profile from the first's outputs.
    monkeypatch.setattr(SHARED, "enabled", False)
    ruled = profile(traced, inputs)
    monkeypatch.setattr(profile_module, "_SHAPE_RULES", {})
    plain = profile(traced, inputs)
    assert ruled.nodes == plain.nodes
    assert ruled.storages == plain.storages
    assert ruled.loss == plain.loss


@pytest.mark.parametrize("shape,size", [
    ((8, 12, 5), (8, 60)), ((8, 12, 5), (-1, 5)), ((8, 12, 5), (2, 4, 3, 4, 5)),
    ((8, 12, 5), (480,)), ((8, 12, 5), (8, 1, 60)), ((8, 1, 5), (8, 5)), ((6, 4), (4, -1)),
    ((6, 4), (12, -1)), ((6, 4), (2, 3, -1)), ((0, 4), (4, 0)),
])
@pytest.mark.parametrize("layout", ["contiguous", "offset", "transposed"])
def test_view(shape: tuple[int, ...], size: tuple[int, ...], layout: str) -> None:
    def args() -> tuple[Any, ...]:
        if layout == "offset":
            return torch.empty(2, *shape)[1], list(size)
        if layout == "transposed" and len(shape) >= 2:
            return torch.empty(shape[1], shape[0], *shape[2:]).transpose(0, 1), list(size)
        return torch.empty(shape), list(size)

    try:
        claimed = _compare(aten.view.default, args)
    except (RuntimeError, ValueError):  # the op refuses it (a transposed tensor, so viewed)
        with FakeTensorMode():
            assert SHAPE_RULES[aten.view.default](*args()) is None
        return
    if layout != "transposed" and 0 not in shape:
        assert claimed


def _strided(shape: Sequence[int], order: Sequence[int], gaps: Sequence[int],
             ones: Sequence[int | None], offset: int) -> torch.Tensor:
    """A tensor of ``shape`` whose dimensions lie in memory in ``order`` (innermost first),
    each ``gaps[d]`` times as far apart as packing needs, a dimension of size 1 at stride
    ``ones[d]`` where that is not None, starting ``offset`` elements into its storage."""
    strides = [0] * len(shape)
    step = 1
    for d in order:
        strides[d] = step
        step *= shape[d] * gaps[d]
    strides = [o if n == 1 and o is not None else st for n, st, o in zip(shape, strides, ones)]
    span = offset + sum((n - 1) * st for n, st in zip(shape, strides)) + 1
    return torch.empty(span).as_strided(shape, strides, offset)


def _view_meta(view: Callable[[], torch.Tensor]) -> Any:
    try:
        out = view()
    except (RuntimeError, ValueError):  # needs a copy: the op refuses
        return "refused"
    return tuple(out.shape), out.stride(), out.storage_offset()


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_view_strides_equal_the_op_on_any_layout(data: st.DataObject) -> None:
    """NOTE [ The strides of a view ]: where the rule answers, it gives the strides of the
    C++ op on real tensors and of the op on fake tensors; where the op needs a copy, the rule
    leaves it to the op; where the input's size-1 dimensions are packed, it answers."""
    dims = data.draw(st.integers(1, 5))
    shape = data.draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=dims, max_size=dims))
    order = data.draw(st.permutations(range(dims)))
    gaps = data.draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=dims, max_size=dims))
    ones = data.draw(st.lists(st.sampled_from([None, None, 1, 2, 5, 7]), min_size=dims,
                              max_size=dims))
    offset = data.draw(st.sampled_from([0, 3]))
    numel = 1
    for n in shape:
        numel *= n
    primes = []
    for p in (2, 3):
        while numel % p == 0:
            primes.append(p)
            numel //= p
    # Each prime factor goes to one of the view's dimensions; dimensions given none, and
    # those inserted, have size 1.
    owner = data.draw(st.lists(st.integers(0, 3), min_size=len(primes), max_size=len(primes)))
    size = [1] * (max(owner, default=0) + 1)
    for p, d in zip(primes, owner):
        size[d] *= p
    for at in data.draw(st.lists(st.integers(0, len(size)), max_size=2)):
        size.insert(at, 1)
    if data.draw(st.booleans()):
        size[data.draw(st.integers(0, len(size) - 1))] = -1

    real = _view_meta(lambda: _strided(shape, order, gaps, ones, offset).view(size))
    with FakeTensorMode():
        x = _strided(shape, order, gaps, ones, offset)
        by_rule = SHAPE_RULES[aten.view.default](x, list(size))
        fake = _view_meta(lambda: x.view(size))
    if by_rule is None:
        packed = all(n != 1 or st_ == (1 if d == dims - 1 else x.stride()[d + 1] * shape[d + 1])
                     for d, (n, st_) in enumerate(zip(shape, x.stride())))
        assert real == "refused" or not packed, (shape, x.stride(), size)
        return
    ruled = (tuple(by_rule.shape), by_rule.stride(), by_rule.storage_offset())
    assert ruled == real == fake, (shape, x.stride(), size)
    assert by_rule.untyped_storage().nbytes() == x.untyped_storage().nbytes()


def test_device() -> None:
    with FakeTensorMode():
        x = torch.empty(2, 3)
        assert SHAPE_RULES[torch.ops.prim.device.default](x) == torch.ops.prim.device.default(x)
        assert x.device == torch.device("cpu")
    assert SHAPE_RULES[torch.ops.prim.device.default](torch.ones(1)) is None
