"""NOTE [ Fake outputs from an op's first run ] in autockpt/ops/fake_outputs.py: an op answered from
the memo gives what the op gives on fake tensors (shape, strides, dtype, device, storage offset
and size of every output, and which argument's storage a view shares); what the memo must not
remember runs every time; and profiles and replays are the same with the memo as without."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from autockpt import fake_outputs
from autockpt.capturing.ladder import capture
from autockpt.capturing.trace import bind_inputs
from autockpt.ops.fake_outputs import FakeOutputs
from autockpt.ops.instrument import FlopTally, OpObserver, OpWatch, tensors
from autockpt.planning.planner import make_plan
from autockpt.profiling.profile import profile
from autockpt.running.replay import replay_peak_bytes
from tests.zoo import CASES, ZooCase

aten = torch.ops.aten


def _described(out: Any, args: tuple[Any, ...]) -> Any:
    """Everything planning reads of an op's outputs: metadata, storage, and aliasing."""
    inputs = [t.untyped_storage()._cdata for t in tensors(args)]

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        shares = inputs.index(storage._cdata) if storage._cdata in inputs else None
        return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(),
                storage.nbytes(), shares)

    if isinstance(out, (list, tuple)):
        return type(out), [one(t) for t in out]
    return one(out)


def _twice(func: Any, make: Callable[[], tuple[Any, ...]]) -> tuple[Any, list[bool]]:
    """Runs ``func`` on the fake arguments ``make()`` builds: by itself, then twice through
    a new memo. Returns the op's own outputs described, and whether each memo run was
    remembered; every run's outputs must describe the same."""
    with FakeTensorMode():
        args = make()
        expected = _described(func(*args), args)
        memo = FakeOutputs()
        remembered = []
        for _ in range(2):
            out, flops, hit = memo.run(func, args, {}, lambda: (func(*args), 7))
            assert _described(out, args) == expected, func
            assert flops == 7
            remembered.append(hit)
    return expected, remembered


OPS: list[tuple[Any, Callable[[], tuple[Any, ...]]]] = [
    (aten.add.Tensor, lambda: (torch.empty(4, 8), torch.empty(8))),
    (aten.mm.default, lambda: (torch.empty(4, 8), torch.empty(3, 8).t())),
    (aten.convolution.default, lambda: (
        torch.empty(2, 3, 8, 8).to(memory_format=torch.channels_last), torch.empty(5, 3, 3, 3),
        None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    (aten.native_layer_norm.default, lambda: (torch.empty(2, 5, 8), [8], torch.empty(8),
                                              None, 1e-5)),
    (aten.native_dropout.default, lambda: (torch.empty(3, 4), 0.5, True)),
    (aten.sum.dim_IntList, lambda: (torch.empty(3, 4, 5), [1], True)),
    (aten._to_copy.default, lambda: (torch.empty(3, 4),)),
    (aten.t.default, lambda: (torch.empty(3, 4),)),
    (aten.transpose.int, lambda: (torch.empty(2, 3, 4)[1], 0, 1)),
    (aten.expand.default, lambda: (torch.empty(3, 1), [3, 5])),
    (aten._unsafe_view.default, lambda: (torch.empty(3, 4), [12])),
    (aten.slice.Tensor, lambda: (torch.empty(6, 4), 0, 2, 5)),
    (aten.split.Tensor, lambda: (torch.empty(6, 4), 2)),
    (aten.unbind.int, lambda: (torch.empty(3, 4),)),
    (aten.detach.default, lambda: (torch.empty(3, 4),)),
    (aten.native_batch_norm_backward.default, lambda: (
        torch.empty(2, 3, 4), torch.empty(2, 3, 4), torch.empty(3), None, None, torch.empty(3),
        torch.empty(3), True, 1e-5, [True, False, True])),
]


@pytest.mark.parametrize("func,make", OPS, ids=[str(op) for op, _ in OPS])
def test_a_remembered_op_gives_what_the_op_gives(func: Any,
                                                 make: Callable[[], tuple[Any, ...]]) -> None:
    _, remembered = _twice(func, make)
    assert remembered == [False, True]


def test_scalar_types_are_keyed_apart() -> None:
    """``x * 2`` on an integer tensor is an integer tensor, ``x * 2.0`` a floating one."""
    memo = FakeOutputs()
    with FakeTensorMode():
        x = torch.empty(3, dtype=torch.int64)
        for scalar, dtype in ((2, torch.int64), (2.0, torch.float32), (2, torch.int64),
                              (2.0, torch.float32)):
            out, _, _ = memo.run(aten.mul.Tensor, (x, scalar), {},
                                 lambda s=scalar: (aten.mul.Tensor(x, s), 0))
            assert out.dtype == dtype
    assert memo.hits == 2


@pytest.mark.parametrize("case", ["in_place", "constant", "real_argument", "data_dependent",
                                  "disabled"])
def test_what_must_run_is_never_remembered(case: str) -> None:
    memo = FakeOutputs()
    real = torch.ones(4)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # A fake tensor of a small real one can carry its values (.item() reads them).
    constant = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor([2.0, 3.0]),
                                                           make_constant=True)
    with mode:
        x = torch.empty(3, 4)
        if case == "in_place":
            func, args = aten.add_.Tensor, (x, x)
        elif case == "constant":
            func, args = aten.mul.Tensor, (constant, 2.0)
        elif case == "real_argument":
            func, args = aten.mul.Tensor, (x, real)
        elif case == "data_dependent":
            func, args = aten.nonzero.default, (x,)
        else:
            func, args = aten.mul.Tensor, (x, x)
            memo.enabled = False
        for _ in range(2):
            try:
                out, _, hit = memo.run(func, args, {}, lambda: (func(*args), 0))
            except Exception as err:  # noqa: BLE001 - the op's own refusal, each time
                assert case == "data_dependent", err
                continue
            assert not hit
            if case == "in_place":
                assert out is x
            assert isinstance(out, FakeTensor) and out.fake_mode is mode
    assert memo.hits == 0


def test_flops_are_counted_for_a_remembered_op() -> None:
    memo = FakeOutputs()
    counted = []
    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(8, 16)
        for _ in range(3):
            tally = FlopTally()
            with OpWatch(OpObserver(), flops=tally, memo=memo):
                torch.mm(a, b)
            counted.append(tally.total)
    assert counted == [2 * 4 * 8 * 16] * 3
    assert memo.hits == 2


def test_an_op_first_run_without_a_tally_is_counted_by_a_later_profile() -> None:
    """The replay watches ops without counting FLOPs: what it remembered must not give a later
    profile 0 FLOPs for the same op (it did, for a module a profile met after a replay)."""
    memo = FakeOutputs()
    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(8, 16)
        with OpWatch(OpObserver(), memo=memo):  # as the replay watches
            torch.mm(a, b)
        tally = FlopTally()
        with OpWatch(OpObserver(), flops=tally, memo=memo):  # as the profile watches
            torch.mm(a, b)
            torch.mm(a, b)
    assert tally.total == 2 * (2 * 4 * 8 * 16)
    assert memo.hits == 1  # the second counted run, from the first counted one


def _profiled(case: ZooCase) -> tuple[Any, Any, Any]:
    model = case.build().train()
    args, kwargs = case.inputs()
    traced = capture(model, args, kwargs, method="fx")
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(
        bind_inputs(model, args, kwargs))))
    return model, traced, inputs


@pytest.mark.parametrize("case", [c for c in CASES if c.traceable], ids=lambda c: c.name)
def test_profiles_and_replays_with_and_without_the_memo_agree(
        monkeypatch: pytest.MonkeyPatch, case: ZooCase) -> None:
    model, traced, inputs = _profiled(case)
    memo = FakeOutputs()
    monkeypatch.setattr(fake_outputs, "SHARED", memo)
    monkeypatch.setattr("autockpt.profiling.profile.SHARED", memo)
    monkeypatch.setattr("autockpt.running.replay.SHARED", memo)
    memo.enabled = False
    plain = profile(traced, inputs)
    plan = make_plan(plain, None, mode="reentrant")
    plain_peak = replay_peak_bytes(model, traced, plan, inputs)
    memo.enabled = True
    first = profile(traced, inputs)  # fills the memo
    hits = memo.hits
    again = profile(traced, inputs)  # answered from it
    assert memo.hits > hits
    for prof in (first, again):
        assert prof.nodes == plain.nodes
        assert prof.storages == plain.storages
        assert prof.loss == plain.loss
    assert replay_peak_bytes(model, traced, plan, inputs) == plain_peak


def _symbolic_sizes(env: ShapeEnv, *hints: int) -> list[torch.SymInt]:
    sizes = []
    for hint in hints:
        source = ConstantSource(f"test_size_{hint}")
        symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        sizes.append(env.create_symintnode(symbol, hint=hint, source=source))
    return sizes


SYMBOLIC_OPS: list[tuple[Any, Callable[[Any, Any], tuple[Any, ...]]]] = [
    (aten.add.Tensor, lambda b, t: (torch.empty(b, t, 8), torch.empty(8))),
    (aten.bmm.default, lambda b, t: (torch.empty(b, t, 8), torch.empty(b, 8, t))),
    (aten.native_layer_norm.default, lambda b, t: (torch.empty(b, t, 8), [8], torch.empty(8),
                                                   None, 1e-5)),
    (aten.view.default, lambda b, t: (torch.empty(b, t, 8), [b * t, 8])),
    (aten.transpose.int, lambda b, t: (torch.empty(b, t, 8), 1, 2)),
    (aten.split.Tensor, lambda b, t: (torch.empty(b, t, 24), 8, -1)),
    (aten.sum.dim_IntList, lambda b, t: (torch.empty(b, t, 8), [1], True)),
]


@pytest.mark.parametrize("func,make", SYMBOLIC_OPS, ids=[str(op) for op, _ in SYMBOLIC_OPS])
def test_an_op_on_symbolic_sizes_is_remembered_without_new_guards(
        func: Any, make: Callable[[Any, Any], tuple[Any, ...]]) -> None:
    """NOTE [ Remembered ops on symbolic sizes ]: the second call's outputs have the first's
    size expressions, and asking the memo records no guard of its own."""
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env, static_shapes=True):
        args = make(*_symbolic_sizes(env, 4, 6))
        expected = _hinted(_described(func(*args), args))
        memo = FakeOutputs()
        out, _, first = memo.run(func, args, {}, lambda: (func(*args), 0))
        guards = len(env.guards)
        again, _, second = memo.run(func, args, {}, lambda: (func(*args), 0))
        assert len(env.guards) == guards
        for made in (out, again):
            assert _hinted(_described(made, args)) == expected, func
        # The remembered sizes are the first run's expressions, not numbers.
        assert str(_described(again, args)) == str(_described(out, args))
    assert (first, second) == (False, True)


def _hinted(value: Any) -> Any:
    """``value`` with each symbolic size at its hint (torch's own cache writes a storage's
    size as another, equal expression: only the values can be compared)."""
    if isinstance(value, torch.SymInt):
        return value.node.hint
    if isinstance(value, (tuple, list, torch.Size)):
        return type(value)(_hinted(v) for v in value) if not isinstance(value, torch.Size) \
            else tuple(_hinted(v) for v in value)
    return value


def test_symbolic_sizes_of_two_shape_envs_are_keyed_apart() -> None:
    """``s0`` of one profile is not ``s0`` of another: each env's ops run once."""
    memo = FakeOutputs()
    for _ in range(2):
        env = ShapeEnv()
        with FakeTensorMode(shape_env=env, static_shapes=True):
            b, t = _symbolic_sizes(env, 4, 6)
            x = torch.empty(b, t)
            _, _, hit = memo.run(aten.mul.Tensor, (x, x), {},
                                 lambda: (aten.mul.Tensor(x, x), 0))
            assert not hit


def test_a_symbolic_profile_is_the_same_with_and_without_the_memo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile on symbolic sizes, with the memo answering the repeated blocks and without
    it: the same numbers at the sizes profiled and at others, and guards that hold at the same
    shapes."""
    from autockpt.capturing.shapes import tensors_in
    from autockpt.profiling.symbolic import SymbolicInputs, formula_of

    case = next(c for c in CASES if c.name == "transformer")
    model, traced, inputs = _profiled(case)
    memo = FakeOutputs()
    monkeypatch.setattr("autockpt.profiling.profile.SHARED", memo)
    (shape,) = [tuple(t.shape) for t in tensors_in(inputs)]
    shapes = [(shape,), ((shape[0] * 3, *shape[1:]),), ((shape[0] + 5, *shape[1:]),),
              ((1, *shape[1:]),)]
    found = []
    for enabled in (False, True):
        memo.enabled = enabled
        symbolic = SymbolicInputs(tensors_in(inputs))
        formula = formula_of(profile(traced, inputs, symbolic=symbolic), symbolic)
        found.append([formula.at(s, "") for s in shapes])
    assert memo.hits > 0
    assert found[0] == found[1]
    assert found[0][0] is not None and found[0][1] is not None


def test_ops_on_symbolic_sizes_are_kept_with_their_shape_env() -> None:
    """NOTE [ Remembered ops on symbolic sizes ]: the memo itself holds no entry whose sizes
    would keep a profile's ShapeEnv alive as long as the memo; the env holds them."""
    memo = FakeOutputs()
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env, static_shapes=True):
        b, t = _symbolic_sizes(env, 4, 6)
        x = torch.empty(b, t)
        for _ in range(2):
            memo.run(aten.mul.Tensor, (x, x), {}, lambda: (aten.mul.Tensor(x, x), 0))
    assert memo.hits == 1 and not memo._entries
    assert len(env.__dict__["_autockpt_fake_outputs"]) == 1
