"""The optimal strategy is optimal: on chains small enough to enumerate every choice of
checkpointed ranges, its recompute cost equals the brute-force optimum under the same budget,
and at ``budget=None`` its peak equals the least reachable peak."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import nn

from autockpt.capturing.trace import trace
from autockpt.planning.chain import (
    Chain,
    Cut,
    ForwardPeaks,
    LongLived,
    Passing,
    Stage,
    build_chain,
)
from autockpt.planning.memory_model import Ranges, as_tree, estimate_peak, model_of, recompute_cost
from autockpt.planning.optimal import optimal_ranges
from autockpt.planning.planner import _optimal
from autockpt.profiling.profile import profile


def all_ranges(chain: Chain) -> Iterator[Ranges]:
    """Every set of disjoint ranges of consecutive gradient-carrying stages."""
    count = len(chain.stages)

    def walk(t: int, acc: tuple[tuple[int, int], ...]) -> Iterator[Ranges]:
        if t >= count:
            yield acc
            return
        yield from walk(t + 1, acc)  # stage t not checkpointed
        b = t
        while b < count and chain.stages[b].carries_grad:
            yield from walk(b + 1, acc + ((t, b),))
            b += 1

    yield from walk(0, ())


def brute_force(chain: Chain, budget: int | None, mode: str) -> tuple[int, int] | None:
    """(least cost, its peak) under the budget, or (least peak, least cost at it)."""
    model = model_of(chain, mode)
    scored = [(model.peak(as_tree(r)), recompute_cost(chain, r, mode))
              for r in all_ranges(chain)]
    if budget is None:
        peak = min(p for p, _ in scored)
        return min(c for p, c in scored if p == peak), peak
    feasible = [(c, p) for p, c in scored if p <= budget]
    return min(feasible) if feasible else None


def assert_optimal_at(chain: Chain, budget: int, mode: str) -> None:
    """The optimal strategy's plan for ``budget`` fits it at the brute force's least cost, or
    there is none where the brute force finds none."""
    expected = brute_force(chain, budget, mode)
    result = optimal_ranges(chain, budget, mode)
    if expected is None:
        assert result is None, f"budget {budget} cannot be met, but a plan was returned"
        return
    assert result is not None, f"budget {budget}: brute force found a plan"
    ranges, peak = result
    assert peak <= budget
    assert recompute_cost(chain, ranges, mode) == expected[0]


def _long_lived(rng: random.Random, producer: int, reach: int, size: int) -> LongLived:
    """A long-lived storage read last at ``reach``, its first saver drawn first (as it was
    before savers and readers were drawn, so that each seed keeps its chain's other
    numbers); later savers are readers too."""
    first = rng.randrange(producer, reach + 1)
    readers = {reach, *(t for t in range(producer + 1, reach) if rng.random() < 0.3)}
    if first > producer:
        readers.add(first)
    savers = {first, *(t for t in readers if t > first and rng.random() < 0.3)}
    return LongLived(producer=producer, savers=tuple(sorted(savers)),
                     readers=tuple(sorted(readers)), size_bytes=size)


def random_chain(rng: random.Random, count: int) -> Chain:
    def ints(n: int, hi: int) -> tuple[int, ...]:
        return tuple(rng.randrange(0, hi) for _ in range(n))

    def stage(t: int) -> tuple[int, bool, int]:
        cost = rng.randrange(1, 100)
        # What a non-reentrant recompute ending there skips: part of the stage, or none.
        return (cost, t > 0 and rng.random() > 0.1, rng.choice([0, rng.randrange(0, cost + 1)]))

    costs = [stage(t) for t in range(count)]
    # Nothing crosses before the first stage or after the last one.
    cross = [(0, *ints(count - 1, 50), 0) for _ in range(4)]
    forward_plain, forward_ckpt = ints(count, 300), ints(count, 100)
    crossing = [sum(c[t] for c in cross) for t in range(count)]
    # Drawn in this order so that each seed gives the chains it always gave.
    saved, long_lived, long_lived_saved = ints(count, 200), ints(count, 20), ints(count, 20)
    output = (0,) * (count - 1) + (rng.randrange(1, 30),)
    grad_entry, backward_peak = ints(count, 60), ints(count, 300)
    # Received tensors die somewhere in the stage: between none and all of them counted.
    plain_in = tuple(f + rng.randrange(0, x + 1) for f, x in zip(forward_plain, crossing))
    ckpt_in = tuple(f + rng.randrange(0, x + 1) for f, x in zip(forward_ckpt, crossing))
    stop_in = tuple(rng.randrange(0, f + 1) for f in forward_plain)
    # The long-lived storages, each read up to a stage of its own: a segment that holds the
    # producer and that stage frees it (NOTE [ Long-lived storages inside a segment ]).
    reach = [rng.randrange(t + 2, count) if t + 2 < count else 0 for t in range(count)]
    lasting = tuple(_long_lived(rng, t, reach[t], long_lived[t])
                    for t in range(count) if long_lived[t] and t + 2 < count)
    return Chain(
        stages=tuple(
            Stage(start=t, end=t + 1, cost=cost, flops=0, carries_grad=grad,
                  saved_bytes=saved[t], long_lived_bytes=long_lived[t],
                  long_lived_saved_bytes=long_lived_saved[t], output_bytes=output[t],
                  grad_entry_bytes=grad_entry[t], backward_peak_bytes=backward_peak[t],
                  forward=ForwardPeaks(forward_plain[t], forward_ckpt[t], plain_in[t],
                                       ckpt_in[t], stop_in[t]),
                  tail_cost=tail)
            for t, (cost, grad, tail) in enumerate(costs)),
        cuts=tuple(Cut(*(c[k] for c in cross)) for k in range(count + 1)),
        long_lived=lasting,
    )


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("seed", range(30))
def test_optimal_matches_brute_force_on_random_chains(seed: int, mode: str) -> None:
    rng = random.Random(seed)
    chain = random_chain(rng, count=rng.randrange(3, 10))
    model = model_of(chain, mode)
    baseline = model.peak(())
    least = brute_force(chain, None, mode)
    assert least is not None
    found = optimal_ranges(chain, None, mode)
    assert found is not None
    ranges, peak = found
    assert peak == least[1] == model.peak(as_tree(ranges))
    assert recompute_cost(chain, ranges, mode) == least[0]
    for budget in sorted({least[1], baseline, (least[1] + baseline) // 2,
                          rng.randrange(least[1], baseline + 1), least[1] - 1}):
        assert_optimal_at(chain, budget, mode)


def _with_passing(rng: random.Random, chain: Chain) -> Chain:
    """``chain`` with passing storages drawn for it: each read by a few later stages."""
    count = len(chain.stages)
    passing = []
    for p in range(count - 2):
        if rng.random() < 0.5:
            readers = sorted({rng.randrange(p + 2, count),
                              *(t for t in range(p + 1, count) if rng.random() < 0.3)})
            passing.append(Passing(producer=p, readers=tuple(readers),
                                   size_bytes=rng.randrange(1, 60)))
    return replace(chain, passing=tuple(passing))


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_plan_estimate_never_exceeds_the_programme_price(mode: str) -> None:
    """NOTE [ Storages held by the plan ]: the plan's estimate counts the long-lived and
    passing storages only where the plan holds them, so it is never above what the
    programme prices the plan at; it is below it on most chains (else the test proves
    nothing), and it is the same whatever the plan where no storage is long-lived or
    passing."""
    lower = 0
    for seed in range(30):
        rng = random.Random(seed)
        chain = _with_passing(rng, random_chain(rng, count=rng.randrange(4, 10)))
        model = model_of(chain, mode)
        below = False
        for ranges in all_ranges(chain):
            estimate, price = estimate_peak(chain, ranges, mode), model.peak(as_tree(ranges))
            assert estimate <= price, (seed, ranges)
            below = below or estimate < price
        lower += below
        plain = replace(chain, long_lived=(), passing=())
        plain_model = model_of(plain, mode)
        for ranges in all_ranges(plain):
            assert estimate_peak(plain, ranges, mode) == plain_model.peak(as_tree(ranges))
    assert lower >= 10


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_least_plan_is_improved_under_its_own_estimate(mode: str) -> None:
    """The optimal strategy's least-memory plan: the programme's least-peak plan improved
    step by step under the plan's own estimate (NOTE [ Storages held by the plan ]). Its
    estimate is never above the programme's plan's, is lower on some chains, and a budget
    equal to it is met, by a plan whose estimate fits."""
    lowered = 0
    for seed in range(30):
        rng = random.Random(seed)
        chain = _with_passing(rng, random_chain(rng, count=rng.randrange(4, 10)))
        found = optimal_ranges(chain, None, mode)
        assert found is not None
        programme = estimate_peak(chain, found[0], mode)
        tree, least, _ = _optimal(chain, None, mode, False)
        assert tree is not None
        assert least == estimate_peak(chain, tuple((a, b) for a, b, _ in tree), mode)
        assert least <= programme
        lowered += least < programme
        tree, reported, _ = _optimal(chain, least, mode, False)
        assert tree is not None and reported == least
        assert estimate_peak(chain, tuple((a, b) for a, b, _ in tree), mode) <= least
    assert lowered >= 1


def _profiled_chain(model: nn.Module, x: torch.Tensor) -> Chain:
    traced = trace(model, (x,))
    name = traced.spec.param_names[0]
    return build_chain(profile(traced, {name: x}))


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_optimal_matches_brute_force_on_profiled_models(mode: str) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())])
    convs = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 10),
    )
    for model, x in ((mlp, torch.randn(16, 64)), (convs, torch.randn(4, 3, 16, 16))):
        chain = _profiled_chain(model, x)
        assert 3 <= len(chain.stages) <= 12
        baseline = model_of(chain, mode).peak(())
        least = brute_force(chain, None, mode)
        assert least is not None
        for budget in (None, least[1], (least[1] + baseline) // 2, baseline):
            expected = brute_force(chain, budget, mode)
            result = optimal_ranges(chain, budget, mode)
            assert expected is not None and result is not None
            assert recompute_cost(chain, result[0], mode) == expected[0]


def test_long_chains_are_coarsened_and_still_planned_quickly() -> None:
    import time

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(32, 32), nn.ReLU())])
    x = torch.randn(8, 32)
    chain = _profiled_chain(model, x)
    assert len(chain.stages) <= 64
    start = time.perf_counter()
    baseline = estimate_peak(chain, ())
    for budget in (None, baseline // 2, (3 * baseline) // 4):
        assert optimal_ranges(chain, budget) is not None
    assert time.perf_counter() - start < 5.0
