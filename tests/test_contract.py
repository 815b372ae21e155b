"""The promises of ``autockpt.apply`` beyond equal gradients: identity of parameters, copies,
serialisation, devices, modes, lazy planning, given plans, and recomputation that happens."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import autockpt
import autockpt.runtime
from tests.helpers import Step, assert_same_step, train_step
from tests.zoo import get_case


class Chain(nn.Module):
    """A module-level class (so whole-module pickling works) with BatchNorm and dropout."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                          nn.Dropout(0.2))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _chain_and_input() -> tuple[Chain, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(), torch.randn(32, 64)


def _step(model: nn.Module, x: torch.Tensor) -> Step:
    return train_step(model, lambda out: out.square().mean(), (x,), seed=7)


def _least_memory(model: nn.Module, x: torch.Tensor, **kwargs: object) -> nn.Module:
    ckpt = autockpt.apply(model, example_inputs=(x,), **kwargs)  # type: ignore[arg-type]
    assert autockpt.plan_of(ckpt).segments, "the test needs a plan that checkpoints"
    return ckpt


def test_result_is_an_instance_of_the_users_class_with_the_same_parameters() -> None:
    model, x = _chain_and_input()
    ckpt = _least_memory(model, x)
    assert isinstance(ckpt, Chain)
    assert ckpt is not model
    assert all(a is b for a, b in zip(ckpt.parameters(), model.parameters()))
    assert list(ckpt.state_dict()) == list(model.state_dict())
    # An optimizer made for the original drives the transformed module, and the reverse.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.head.weight.detach().clone()
    ckpt(x).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.head.weight)
    ckpt.load_state_dict(model.state_dict())
    model.load_state_dict(ckpt.state_dict())


def test_forward_keeps_the_signature_of_the_users_forward() -> None:
    """What reads ``forward``'s signature (Trainer's column filter and loss kwargs, PEFT,
    accelerate) sees the user's, on the transformed module and on a lazily planned one, and
    the module still runs with keyword inputs."""
    case = get_case("kwargs_model")
    model = case.build()
    args, kwargs = case.inputs()
    ckpt = autockpt.apply(model, None, example_inputs=args, example_kwargs=kwargs)
    lazy = autockpt.apply(case.build(), 1.0)
    for transformed in (ckpt, lazy):
        assert inspect.signature(transformed.forward) == inspect.signature(model.forward)
        assert transformed.forward.__doc__ == model.forward.__doc__
    case.loss_fn(ckpt(*args, **kwargs)).backward()


def test_deepcopy_and_whole_module_pickle_train_identically() -> None:
    model, x = _chain_and_input()
    reference = copy.deepcopy(model)
    ckpt = _least_memory(model, x)
    clone = copy.deepcopy(ckpt)
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = _step(reference, x)
    for candidate in (clone, loaded):
        assert type(candidate) is type(ckpt)
        assert all(a is not b for a, b in zip(candidate.parameters(), ckpt.parameters()))
        assert autockpt.plan_of(candidate).segments == autockpt.plan_of(ckpt).segments
        assert_same_step(expected, _step(candidate, x))


def test_eval_and_no_grad_run_the_original_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _chain_and_input()
    ckpt = _least_memory(model, x)
    calls = []
    original = autockpt.runtime.run_segment
    monkeypatch.setattr(autockpt.runtime, "run_segment",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    ckpt.eval()
    model.eval()
    torch.testing.assert_close(ckpt(x), model(x))
    ckpt.train()
    with torch.no_grad():
        ckpt(x)
    assert calls == []
    ckpt(x).sum().backward()
    assert calls, "training forward did not run the checkpointed segments"


def test_to_moves_the_shared_tensors_and_keeps_training() -> None:
    model, x = _chain_and_input()
    reference = copy.deepcopy(model)
    ckpt = _least_memory(model, x)
    ckpt.to(torch.float64)
    assert model.head.weight.dtype == torch.float64  # same Parameter objects
    reference.to(torch.float64)
    assert_same_step(_step(reference, x.double()), _step(ckpt, x.double()))


def test_original_module_is_left_as_it_was() -> None:
    model, x = _chain_and_input()
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    keys = set(model.__dict__)
    ckpt = autockpt.apply(model, example_inputs=(x,))
    assert not model.training and all(not m.training for m in model.modules())
    assert ckpt.training is False  # the copy starts in the same mode
    assert set(model.__dict__) == keys and type(model) is Chain
    assert torch.equal(rng, torch.get_rng_state())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_lazy_planning_at_first_forward_and_per_input_shape() -> None:
    model, x = _chain_and_input()
    reference = copy.deepcopy(model)
    ckpt = autockpt.apply(model, budget_mb=None)
    with pytest.raises(autockpt.AutockptError, match="not planned yet"):
        autockpt.plan_of(ckpt)
    assert_same_step(_step(reference, x), _step(ckpt, x))
    first = autockpt.plan_of(ckpt)
    assert first.segments and "32, 64" in first.input_signature
    bigger = torch.randn(96, 64)
    assert_same_step(_step(reference, bigger), _step(ckpt, bigger))
    second = autockpt.plan_of(ckpt)
    assert "96, 64" in second.input_signature
    assert second.baseline_peak_bytes > first.baseline_peak_bytes
    state = ckpt.__dict__["_autockpt"]
    assert len(state.variants) == 2
    _step(ckpt, x)  # cached: no third plan
    assert len(state.variants) == 2 and autockpt.plan_of(ckpt) is first


def test_a_given_plan_is_applied_as_is_and_plans_are_deterministic() -> None:
    model, x = _chain_and_input()
    made = autockpt.plan(model, (x,))
    assert made == autockpt.plan(model, (x,))
    assert str(made) == str(autockpt.plan(model, (x,)))
    ckpt = autockpt.apply(model, plan=made)
    ckpt(x).sum().backward()
    assert autockpt.plan_of(ckpt) is made
    with pytest.raises(autockpt.InvalidArgumentError, match="either budget_mb or plan"):
        autockpt.apply(model, 10, plan=made)


def test_a_plan_for_another_graph_is_refused() -> None:
    model, x = _chain_and_input()
    other = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    foreign = autockpt.plan(other, (x,))
    ckpt = autockpt.apply(model, plan=foreign)
    with pytest.raises(autockpt.AutockptError, match="different graph"):
        ckpt(x)


def _backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    out = model(x).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_backward_flops_rise_by_the_planned_recompute(mode: str) -> None:
    case = get_case("transformer")
    model = case.build()
    args, _ = case.inputs()
    baseline = _backward_flops(model, args[0])
    ckpt = autockpt.apply(model, example_inputs=args, mode=mode)
    plan = autockpt.plan_of(ckpt)
    assert plan.recompute_flops > 0
    recomputing = _backward_flops(ckpt, args[0])
    assert recomputing > baseline
    # Recompute FLOPs counted on CPU are the plan's: in non-reentrant mode the plan already
    # leaves out what the recompute skips once it has rebuilt what backward needs.
    assert recomputing - baseline == plan.recompute_flops


def test_reentrant_segment_on_raw_input_gets_the_dummy_arg() -> None:
    """The classic pitfall: a reentrant checkpoint right after the raw input."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())],
                        nn.Linear(256, 1))
    x = torch.randn(64, 256)
    # What the pitfall does without the wrapper: the first layer gets no gradient.
    net.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        out = checkpoint(net[:2], x, use_reentrant=True)
    net[2:](out).sum().backward()
    assert net[0].weight.grad is None
    ckpt = autockpt.apply(net, example_inputs=(x,), mode="reentrant")
    plan = autockpt.plan_of(ckpt)
    first = plan.segments[0]
    assert first.start <= 1 and first.dummy_arg
    assert not any(s.dummy_arg for s in plan.segments[1:])
    net.zero_grad(set_to_none=True)
    ckpt(x).sum().backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0


def test_state_dict_keys_of_the_zoo_are_unchanged_after_a_step() -> None:
    case = get_case("densenet_block")
    model = case.build()
    args, kwargs = case.inputs()
    ckpt = autockpt.apply(model, example_inputs=args)
    train_step(ckpt, case.loss_fn, args, kwargs, seed=0)
    assert list(ckpt.state_dict()) == list(model.state_dict())
    assert [n for n, _ in ckpt.named_buffers()] == [n for n, _ in model.named_buffers()]


def test_parts_without_gradient_are_never_checkpointed() -> None:
    """The attention mask is built from raw token ids: nothing there is saved for backward."""
    case = get_case("transformer")
    model = case.build()
    args, _ = case.inputs()
    plan = autockpt.plan(model, args)
    assert plan.segments
    reasons = [s.reason for s in plan.skipped]
    assert any(r.startswith("no gradient flows here") for r in reasons)
    no_grad = [s for s in plan.skipped if s.reason.startswith("no gradient")]
    for segment in plan.segments:
        for stretch in no_grad:
            assert segment.end <= stretch.start or stretch.end <= segment.start


def test_applying_a_transformed_module_again_replans_on_the_same_tree() -> None:
    model, x = _chain_and_input()
    first = autockpt.apply(model, example_inputs=(x,))
    second = autockpt.apply(first, budget_mb=autockpt.plan_of(first).baseline_peak_bytes / 2**20,
                            example_inputs=(x,))
    assert not autockpt.plan_of(second).segments and autockpt.plan_of(first).segments
    assert all(a is b for a, b in zip(second.parameters(), model.parameters()))
    assert type(second) is type(first)
