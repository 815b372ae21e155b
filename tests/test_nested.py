"""Nested (re-checkpointed) segments: below the least memory one level of segments reaches,
the optimal strategy checkpoints ranges again inside segments, and training stays exact.

Each test runs the real thing on CPU: gradients and buffers against an identically seeded
twin, memory measured with ``autockpt.measure``, recomputation counted with FlopCounterMode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autockpt
from autockpt.capturing.trace import trace
from autockpt.planning.chain import build_chain
from autockpt.planning.memory_model import (
    MemoryModel,
    as_tree,
    estimate_peak,
    estimate_tree_peak,
    tree_depth,
)
from autockpt.planning.optimal import optimal_ranges
from autockpt.planning.planner import make_plan
from autockpt.profiling.profile import profile
from autockpt.report import plan_rows
from tests.helpers import Step, assert_same_step, assert_same_tensors, grads_of, train_step
from tests.zoo import get_case

MIB = 2**20


def _deep(depth: int = 72, width: int = 256) -> nn.Sequential:
    """A long chain with BatchNorm and dropout in some blocks: where nesting pays."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i % 5 == 0:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.ReLU())
        if i % 7 == 0:
            layers.append(nn.Dropout(0.1))
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(32, 256)


def _profile(model: nn.Module, x: torch.Tensor):  # noqa: ANN202 - a Profile
    model.train()
    traced = trace(model, (x,), {})
    return profile(traced, dict(zip(traced.spec.param_names, traced.graph_inputs({"input": x}))))


def _flat_least(model: nn.Module, x: torch.Tensor) -> int:
    return make_plan(_profile(model, x), None, nesting=False).estimated_peak_bytes


def _step(model: nn.Module, x: torch.Tensor) -> Step:
    return train_step(model, lambda out: out.square().mean(), (x,), seed=7)


def test_least_memory_is_below_what_one_level_of_segments_reaches() -> None:
    model, x = _deep(), _input()
    flat = _flat_least(model, x)
    plan = autockpt.plan(model, (x,))
    assert plan.min_peak_bytes == plan.estimated_peak_bytes < 0.9 * flat
    assert max(seg.depth for seg in plan.segments) >= 1
    # Each nested segment lies inside the segment before it of one level less.
    for k, seg in enumerate(plan.segments):
        if seg.depth:
            parent = next(p for p in reversed(plan.segments[:k]) if p.depth == seg.depth - 1)
            assert parent.start <= seg.start and seg.end <= parent.end
    # Measured, not only estimated: the least nested plan uses less than the least flat one.
    measured = autockpt.measure(autockpt.apply(copy.deepcopy(model), plan=plan), x)
    assert measured.peak_activation_bytes < flat


def test_nested_plan_trains_exactly_like_the_model() -> None:
    """Dropout replays the same mask in both recomputes, BatchNorm statistics are updated
    once, and every gradient is bitwise the twin's."""
    model, x = _deep(), _input()
    twin = copy.deepcopy(model)
    budget = 0.9 * _flat_least(model, x)
    ckpt = autockpt.apply(model, budget / MIB, example_inputs=(x,))
    for _ in range(2):
        assert_same_step(_step(ckpt, x), _step(twin, x), exact=True)
    plan = autockpt.plan_of(ckpt)
    assert max(seg.depth for seg in plan.segments) >= 1
    assert plan.estimated_peak_bytes <= budget
    assert ckpt.state_dict().keys() == twin.state_dict().keys()


def test_nested_plan_fits_its_budget_measured() -> None:
    model, x = _deep(), _input()
    budget = int(0.85 * _flat_least(model, x))
    ckpt = autockpt.apply(model, budget / MIB, example_inputs=(x,))
    plan = autockpt.plan_of(ckpt)
    measured = autockpt.measure(ckpt, x).peak_activation_bytes
    assert measured <= budget * 1.05
    assert abs(plan.estimated_peak_bytes - measured) <= 0.10 * measured


def _backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    out = model(x).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops()


def test_nested_stages_are_recomputed_twice() -> None:
    """Backward FLOPs rise by the plan's recompute, which counts a nested stage twice."""
    model, x = _deep(), _input()
    baseline = _backward_flops(model, x)
    ckpt = autockpt.apply(copy.deepcopy(model), 0.85 * _flat_least(model, x) / MIB,
                          example_inputs=(x,))
    plan = autockpt.plan_of(ckpt)
    once = sum(seg.recompute_flops for seg in plan.segments if seg.depth == 0)
    assert plan.recompute_flops > once  # the nested segments add a second recompute
    rise = _backward_flops(ckpt, x) - baseline
    # More than one recompute of the outer segments could do; no more than planned (a
    # non-reentrant recompute stops once it has rebuilt what backward needs).
    assert once < rise <= plan.recompute_flops


def test_reentrant_mode_does_not_nest() -> None:
    model, x = _deep(), _input()
    prof = _profile(model, x)
    single = make_plan(prof, None, mode="reentrant", nesting=False)
    plan = autockpt.plan(model, (x,), mode="reentrant")
    # The same single-level plan, its step replayed (NOTE [ Replaying a plan on fake
    # tensors ]): the memory model's estimate is kept beside the replayed one.
    assert plan.segments == single.segments
    assert plan.modelled_peak_bytes == single.estimated_peak_bytes
    assert all(seg.depth == 0 for seg in plan.segments)
    least = plan.estimated_peak_bytes
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.plan(model, (x,), budget_mb=0.9 * least / MIB, mode="reentrant")
    assert info.value.min_feasible_bytes == least


def test_below_the_nested_least_the_error_names_it() -> None:
    model, x = _deep(), _input()
    least = autockpt.plan(model, (x,)).estimated_peak_bytes
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.plan(model, (x,), budget_mb=0.5 * least / MIB)
    assert info.value.min_feasible_bytes == least
    # The model is left untouched by the refusal, and the named budget works.
    autockpt.plan(model, (x,), budget_mb=least / MIB)


def test_printed_rows_number_nested_segments_under_their_parent() -> None:
    model, x = _deep(), _input()
    plan = autockpt.plan(model, (x,))
    numbers = [cells[0] for seg, cells in plan_rows(plan) if seg.checkpointed]
    assert numbers[0] == "1"
    assert any("." in n for n in numbers)
    for seg, cells in plan_rows(plan):
        if seg.checkpointed:
            assert cells[0].count(".") == seg.depth
    assert "inside others" in str(plan)


def test_same_model_same_nested_plan() -> None:
    a = autockpt.plan(_deep(), (_input(),))
    b = autockpt.plan(_deep(), (_input(),))
    assert str(a) == str(b) and a.segments == b.segments


def test_tree_estimate_equals_the_flat_model_on_flat_plans() -> None:
    case = get_case("transformer")
    model = case.build()
    args, _ = case.inputs()
    traced = trace(model, args, {})
    arguments = dict(zip(traced.spec.param_names, args))
    chain = build_chain(profile(traced, dict(zip(traced.spec.param_names,
                                                 traced.graph_inputs(arguments)))))
    found = optimal_ranges(chain, None)
    assert found is not None and found[0]
    ranges = found[0]
    assert estimate_tree_peak(chain, as_tree(ranges)) == estimate_peak(chain, ranges)
    assert tree_depth(as_tree(ranges)) == 1


def test_nested_walk_never_prices_a_segment_below_the_exact_model() -> None:
    """The walk used for nested segments, run on a segment without inner ones, gives at
    least what the exact single-level model gives (it may only over-estimate)."""
    chain = build_chain(_profile(_deep(), _input()))
    model = MemoryModel(chain, "non_reentrant")
    grads = [t for t, stage in enumerate(chain.stages) if stage.carries_grad]
    checked = 0
    for a in grads[:6]:
        for b in grads:
            if b < a or any(not chain.stages[t].carries_grad for t in range(a, b + 1)):
                continue
            inputs = model.segment_inputs(a, follows_segment=True)
            exact, after, _ = model.segment(a, b, 0, inputs)
            walked = model.nested_backward(a, b, (), after + model.model_output_bytes)
            assert walked >= exact - chain.stages[b].grad_entry_bytes, (a, b)
            checked += 1
    assert checked > 20


def test_transformer_nested_least_memory_trains_like_the_model() -> None:
    case = get_case("transformer")
    model = case.build()
    args, _ = case.inputs()
    twin = copy.deepcopy(model)
    plan = autockpt.plan(model, args)
    ckpt = autockpt.apply(model, plan=plan)
    measured = autockpt.measure(ckpt, args).peak_activation_bytes
    assert measured <= plan.estimated_peak_bytes * 1.05
    model.train()
    twin.train()
    for net in (ckpt, twin):
        net.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    ckpt(*args).float().square().mean().backward()
    torch.manual_seed(3)
    twin(*args).float().square().mean().backward()
    assert_same_tensors(grads_of(ckpt), grads_of(twin), allow_none=True)
