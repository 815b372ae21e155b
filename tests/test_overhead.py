"""A fixed cost per checkpointed segment and per recomputed op (NOTE [ What a segment costs
beyond its FLOPs ] in autockpt/planning/overhead.py): the planner stays exact with it, prices
it from the profile's own nodes, takes fewer segments where they cost more than the FLOPs
they spare, never gives up memory for it, and the plans it makes run with exact gradients
within the budget."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import autockpt
from autockpt import pipeline
from autockpt.capturing.trace import bind_inputs, trace
from autockpt.planning.chain import RUNS_AN_OP, build_chain
from autockpt.planning.memory_model import recompute_cost, segment_cost, tree_cost
from autockpt.planning.overhead import NO_OVERHEAD, Overhead, overhead_for
from autockpt.planning.planner import make_plan
from autockpt.profiling.profile import profile
from autockpt.profiling.stats import node_cost
from tests import zoo
from tests.helpers import assert_same_step, train_step
from tests.test_optimal import assert_optimal_at, brute_force, random_chain


@pytest.mark.parametrize("per_segment", [25, 400])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("seed", range(12))
def test_optimal_stays_exact_with_a_cost_per_segment(seed: int, mode: str,
                                                     per_segment: int) -> None:
    rng = random.Random(seed)
    chain = replace(random_chain(rng, count=rng.randrange(3, 9)), segment_cost=per_segment)
    least = brute_force(chain, None, mode)
    assert least is not None
    baseline = brute_force(chain, 10**12, mode)
    assert baseline is not None and baseline[0] == 0
    # The brute force prices every set of ranges with the cost per segment.
    for budget in sorted({least[1], (least[1] + baseline[1]) // 2, baseline[1] - 1}):
        assert_optimal_at(chain, budget, mode)


def _profiled(name: str):  # -> Profile
    model = getattr(zoo, f"build_{name}")()
    args, kwargs = getattr(zoo, f"inputs_{name}")()
    traced = trace(model, args, kwargs)
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(
        bind_inputs(model, args, kwargs))))
    return profile(traced, inputs)


def test_the_chain_prices_each_op_and_each_segment() -> None:
    prof = _profiled("transformer")
    plain = build_chain(prof)
    priced = build_chain(prof, overhead=Overhead(segment_cost=7, op_cost=1000))
    assert [(s.start, s.end) for s in priced.stages] == [(s.start, s.end) for s in plain.stages]
    assert plain.segment_cost == 0 and priced.segment_cost == 7 and priced.op_cost == 1000
    for before, after in zip(plain.stages, priced.stages):
        members = prof.nodes[after.start:after.end]
        ops = sum(node.op in RUNS_AN_OP for node in members)
        assert after.ops == ops
        assert after.cost == sum(node_cost(node) for node in members) + 1000 * ops
        assert before.cost == sum(node_cost(node) for node in members)
        assert after.flops == before.flops
    grad = [t for t, s in enumerate(priced.stages) if s.carries_grad]
    a, b = grad[0], grad[-1]
    assert segment_cost(priced, a, b, "reentrant") == 7 + sum(
        s.cost for s in priced.stages[a:b + 1])


def test_overhead_for_turns_seconds_into_the_cost_unit() -> None:
    cpu, gpu = overhead_for("cpu"), overhead_for("cuda")
    assert overhead_for("meta") == gpu
    # The same seconds are worth many more FLOPs on an accelerator.
    assert gpu.segment_cost > 1000 * cpu.segment_cost // 1000 > 0
    assert gpu.segment_cost / gpu.op_cost == cpu.segment_cost / cpu.op_cost == 10
    # Timed nodes already include their launch: only the segment's nanoseconds are added.
    assert overhead_for("cuda", timed=True) == Overhead(segment_cost=100_000, op_cost=0)


@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_fewer_segments_where_each_costs_more(name: str) -> None:
    prof = _profiled(name)
    baseline = make_plan(prof, None).baseline_peak_bytes
    fewer = False
    for fraction in (0.8, 0.6):
        budget = int(baseline * fraction)
        plain = make_plan(prof, budget)
        for overhead in (overhead_for("cpu"), overhead_for("cuda")):
            priced = make_plan(prof, budget, overhead=overhead)
            assert priced.estimated_peak_bytes <= budget
            # A segment that keeps its matmuls pays the op cost for every op it runs (the
            # selective checkpoint's modes watch them all), so the fixed costs may trade one
            # such segment for two whole ones: the count falls only between whole segments.
            if not any(s.keeps for s in (*priced.segments, *plain.segments)):
                assert len(priced.segments) <= len(plain.segments)
            fewer |= (len(priced.segments) < len(plain.segments)
                      or sum(s.keeps for s in priced.segments)
                      < sum(s.keeps for s in plain.segments))
            # It is the optimum for its price: the plan made without the fixed costs costs
            # at least as much once they are counted.
            chain = build_chain(prof, overhead=overhead)

            def price(plan: autockpt.Plan) -> int:
                return recompute_cost(chain, tuple(
                    (_stage_of(chain, s.start), _stage_of(chain, s.end - 1))
                    for s in plan.segments), "non_reentrant", frozenset(
                    _stage_of(chain, s.start) for s in plan.segments if s.keeps))

            assert price(priced) <= price(plain)
    assert fewer, "no budget made the fixed costs matter"


def _stage_of(chain, node: int) -> int:  # noqa: ANN001 - a Chain
    return next(t for t, s in enumerate(chain.stages) if s.start <= node < s.end)


def test_the_least_memory_does_not_depend_on_the_fixed_costs() -> None:
    prof = _profiled("mlp72")
    plain = make_plan(prof, None)
    for overhead in (overhead_for("cpu"), overhead_for("cuda")):
        priced = make_plan(prof, None, overhead=overhead)
        assert priced.estimated_peak_bytes <= plain.estimated_peak_bytes
        assert priced.min_peak_bytes <= plain.min_peak_bytes


def test_a_nested_tree_is_priced_with_a_cost_per_range() -> None:
    prof = _profiled("mlp72")
    chain = build_chain(prof, overhead=Overhead(segment_cost=1000, op_cost=0))
    tree = ((1, 6, ((1, 3, ()),)),)
    plain = replace(chain, segment_cost=0)
    assert tree_cost(chain, tree) == tree_cost(plain, tree) + 2 * 1000


def _loss(output: object) -> torch.Tensor:
    return zoo.flatten_output(output)[0].float().pow(2).mean()


def test_apply_plans_with_the_device_costs_and_keeps_gradients_and_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = zoo.build_transformer()
    twin = zoo.build_transformer()
    args, kwargs = zoo.inputs_transformer()
    baseline = autockpt.plan(model, args, example_kwargs=kwargs,
                             loss_fn=_loss).baseline_peak_bytes
    budget_bytes = int(baseline * 0.6)
    ours = autockpt.apply(model, budget_mb=budget_bytes / 2**20, example_inputs=args,
                          example_kwargs=kwargs, loss_fn=_loss)
    plan = autockpt.plan_of(ours)
    assert plan is not None
    with monkeypatch.context() as patched:
        patched.setattr(pipeline, "plan_overhead", lambda *_, **__: NO_OVERHEAD)
        without = autockpt.plan(twin, args, example_kwargs=kwargs, loss_fn=_loss,
                                budget_mb=budget_bytes / 2**20)
    # On the CPU the plan takes the CPU's fixed costs: fewer segments than by FLOPs alone.
    assert len(plan.segments) < len(without.segments)
    report = autockpt.measure(ours, args, example_kwargs=kwargs, loss_fn=_loss)
    assert report.peak_activation_bytes <= budget_bytes * 1.05
    assert_same_step(train_step(ours, _loss, args, kwargs, seed=1),
                     train_step(twin, _loss, args, kwargs, seed=1))
