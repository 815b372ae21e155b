"""Self-tests of the model zoo (tests/zoo.py): every case builds deterministically, traces
with torch.fx in train mode, the traced module reproduces the model exactly, one train step
gives finite loss and grads exactly where expected, and twins are bitwise reproducible."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn

from tests.helpers import assert_same_step, assert_same_tensors, buffers_of, grads_of, train_step
from tests.zoo import CASES, ZooCase, clone_case, flatten_output, get_case, param_count

EXPECTED_NAMES = {
    "mlp72",
    "cifar_cnn",
    "generator",
    "densenet_block",
    "resnet",
    "transformer",
    "multi_output_tuple",
    "multi_output_dict",
    "kwargs_model",
    "inplace_relu",
    "frozen_backbone",
    "frozen_head",
    "transformer_encoder_layer",
}

# Parameter-name prefixes that must be frozen in a case; every other param must be trainable.
FROZEN_PREFIX = {"frozen_backbone": "backbone.", "frozen_head": "head."}

CASE_PARAMS = [pytest.param(case, id=case.name) for case in CASES]


def _assert_same_structure_equal(a: Any, b: Any, what: str) -> None:
    assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{what}: keys {list(a)} != {list(b)}"
    ta, tb = flatten_output(a), flatten_output(b)
    assert len(ta) == len(tb), f"{what}: {len(ta)} tensors != {len(tb)}"
    for i, (x, y) in enumerate(zip(ta, tb)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs (max abs diff {(x - y).abs().max().item()})"


def _assert_inputs_equal(a: tuple[tuple[Any, ...], dict[str, Any]], b: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
    (args_a, kw_a), (args_b, kw_b) = a, b
    assert len(args_a) == len(args_b) and list(kw_a) == list(kw_b)
    for x, y in list(zip(args_a, args_b)) + [(kw_a[k], kw_b[k]) for k in kw_a]:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def test_registry() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))
    assert set(names) == EXPECTED_NAMES
    for case in CASES:
        assert get_case(case.name) is case
        assert isinstance(case, ZooCase)
    with pytest.raises(KeyError, match="unknown zoo case"):
        get_case("no_such_case")
    with pytest.raises(AttributeError):  # frozen dataclass
        CASES[0].name = "x"  # type: ignore[misc]


def test_mlp72_layout() -> None:
    model = get_case("mlp72").build()
    assert isinstance(model, nn.Sequential) and len(model) == 143
    for i in range(71):
        lin, act = model[2 * i], model[2 * i + 1]
        assert isinstance(lin, nn.Linear) and (lin.in_features, lin.out_features) == (1000, 1000)
        assert isinstance(act, nn.ReLU)
    last = model[142]
    assert isinstance(last, nn.Linear) and (last.in_features, last.out_features) == (1000, 100)
    assert param_count(model) == 71 * (1000 * 1000 + 1000) + 1000 * 100 + 100


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_build_and_inputs_deterministic(case: ZooCase) -> None:
    model, twin = clone_case(case)  # asserts identical state_dicts
    assert model.training and twin.training
    assert param_count(model) > 0
    _assert_inputs_equal(case.inputs(), case.inputs())


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_trace_matches_model(case: ZooCase) -> None:
    if not case.traceable:
        with pytest.raises(Exception):
            torch.fx.symbolic_trace(case.build())
        return
    model, twin = clone_case(case)
    gm = torch.fx.symbolic_trace(twin)  # train mode
    assert isinstance(gm, torch.fx.GraphModule) and gm.training
    args, kwargs = case.inputs()

    # Forward: same seed -> bitwise equal outputs (dropout included) and buffers.
    torch.manual_seed(99)
    out_ref = model(*args, **kwargs)
    torch.manual_seed(99)
    out_gm = gm(*args, **kwargs)
    _assert_same_structure_equal(out_ref, out_gm, f"{case.name} output")
    for (name, b_ref), (_, b_tw) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(b_ref, b_tw), f"{case.name}: buffer {name} differs after forward"

    # Backward through the traced module: grads land on the twin's (shared) parameters.
    loss_ref, grads_ref, bufs_ref = train_step(model, case.loss_fn, args, kwargs, seed=5)
    loss_gm, _, _ = train_step(gm, case.loss_fn, args, kwargs, seed=5)
    assert torch.equal(loss_ref, loss_gm)
    assert_same_tensors(grads_of(twin), grads_ref, what=f"{case.name} traced grad ", exact=True,
                        allow_none=True)
    assert_same_tensors(buffers_of(twin), bufs_ref, what=f"{case.name} buffer after step ",
                        exact=True)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_train_step_grads(case: ZooCase) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    loss, grads, _ = train_step(model, case.loss_fn, args, kwargs, seed=0)
    assert loss.dim() == 0 and math.isfinite(loss.item())

    prefix = FROZEN_PREFIX.get(case.name)
    params = dict(model.named_parameters())
    assert list(grads) == list(params)
    n_frozen = 0
    for name, p in params.items():
        expect_frozen = prefix is not None and name.startswith(prefix)
        assert p.requires_grad is not expect_frozen, f"{case.name}: {name} requires_grad={p.requires_grad}"
        g = grads[name]
        if p.requires_grad:
            assert g is not None, f"{case.name}: trainable {name} got no grad"
            assert torch.isfinite(g).all(), f"{case.name}: non-finite grad for {name}"
            assert g.abs().max() > 0, f"{case.name}: grad of {name} is identically zero"
        else:
            n_frozen += 1
            assert g is None, f"{case.name}: frozen {name} got a grad"
    assert (n_frozen > 0) == (prefix is not None)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_loss_uses_every_output(case: ZooCase) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    torch.manual_seed(0)
    outputs = flatten_output(model(*args, **kwargs))
    loss = case.loss_fn(outputs if len(outputs) > 1 else outputs[0])
    grads = torch.autograd.grad(loss, outputs)
    for i, g in enumerate(grads):
        assert g is not None and g.abs().max() > 0, f"{case.name}: loss ignores output {i}"


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_twins_bitwise(case: ZooCase) -> None:
    model, twin = clone_case(case)
    first = train_step(model, case.loss_fn, *case.inputs(), seed=7)
    assert_same_step(train_step(twin, case.loss_fn, *case.inputs(), seed=7), first,
                     what=f"{case.name} twin ", exact=True, allow_none=True)


def test_buffers_change_in_train_step() -> None:
    """BatchNorm cases really update buffers (so buffer comparisons are meaningful)."""
    for name in ("densenet_block", "resnet", "inplace_relu", "frozen_backbone"):
        case = get_case(name)
        model = case.build()
        before = {n: b.clone() for n, b in model.named_buffers()}
        assert before, name
        _, _, after = train_step(model, case.loss_fn, *case.inputs(), seed=0)
        assert all(not torch.equal(before[n], after[n]) for n in before), name


def test_transformer_inputs_have_padding() -> None:
    for name in ("transformer", "transformer_encoder_layer"):
        (ids,), kwargs = get_case(name).inputs()
        assert not kwargs and ids.dtype == torch.int64 and ids.shape == (4, 16)
        assert (ids == 0).any() and (ids != 0).any(dim=1).all()
        # padding is trailing: once a row hits 0 it stays 0
        pad = (ids == 0).int()
        assert torch.equal(pad, pad.cummax(dim=1).values)


def test_kwargs_model_none_and_tensor_kwargs() -> None:
    """The traced graph keeps the optional ops as leaves, so it is right for None and tensor."""
    case = get_case("kwargs_model")
    model = case.build()
    gm = torch.fx.symbolic_trace(model)
    (x,), kwargs = case.inputs()
    assert kwargs["bias_input"] is None and isinstance(kwargs["scale"], torch.Tensor)
    bias = torch.full((4, 32), 0.25)
    for kw in (kwargs, {"scale": kwargs["scale"], "bias_input": bias}, {}):
        assert torch.equal(model(x, **kw), gm(x, **kw))
    assert not torch.equal(model(x, **kwargs), model(x, scale=kwargs["scale"], bias_input=bias))


def test_inplace_relu_graph_keeps_inplace_ops() -> None:
    """The pitfall is present: in-place add_ nodes whose results are unused, and in-place ReLUs."""
    model = get_case("inplace_relu").build()
    gm = torch.fx.symbolic_trace(model)
    add_nodes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "add_"]
    assert len(add_nodes) == 2 and all(not n.users for n in add_nodes)
    inplace_relus = [m for m in model.modules() if isinstance(m, nn.ReLU) and m.inplace]
    assert len(inplace_relus) == 6
