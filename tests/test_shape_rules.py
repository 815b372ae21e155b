"""NOTE [ Ops answered by a shape rule ] in autockpt/shape_rules.py: each rule gives what the op
itself gives on fake tensors (shape, strides, dtype, device, storage size of every output),
on a grid of shapes, layouts, dtypes and flags; where it does not claim a case, the op runs;
and profiles made with the rules equal those made without, node for node."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from autockpt import profile as profile_module
from autockpt.capture import capture
from autockpt.profile import profile
from autockpt.shape_rules import SHAPE_RULES
from autockpt.trace import bind_inputs
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
    return t


SHAPES = [(2, 3), (4, 3, 5), (2, 3, 4, 4), (2, 1, 1, 1), (1, 5, 1, 3), (2, 3, 2, 2, 2)]
LAYOUTS = ["contiguous", "channels_last", "transposed", "strided"]
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
    if layout != "transposed" and 1 not in shape and 1 not in size and 0 not in shape:
        assert claimed


def test_device() -> None:
    with FakeTensorMode():
        x = torch.empty(2, 3)
        assert SHAPE_RULES[torch.ops.prim.device.default](x) == torch.ops.prim.device.default(x)
        assert x.device == torch.device("cpu")
    assert SHAPE_RULES[torch.ops.prim.device.default](torch.ones(1)) is None
