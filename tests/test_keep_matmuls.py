"""Segments that keep their matmuls (NOTE [ Segments that keep their matmuls ] in
autockpt.planning.memory_model), on plain numbers: the programme and the search choose, per
segment, whether it keeps, at the least cost a brute force over every choice finds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from itertools import combinations

import pytest

from autockpt.planning.chain import Chain
from autockpt.planning.memory_model import (
    Keeps,
    Ranges,
    as_tree,
    estimate_peak,
    model_of,
    recompute_cost,
)
from autockpt.planning.optimal import optimal_plan, optimal_ranges
from autockpt.planning.search import search_kept
from tests.test_optimal import _with_passing, all_ranges, random_chain


def _with_kept(rng: random.Random, chain: Chain) -> Chain:
    """``chain`` with kept matmul outputs drawn for its stages: some bytes, and a part of the
    stage's cost (some stages none)."""
    stages = []
    for stage in chain.stages:
        if rng.random() < 0.25:
            stages.append(stage)
            continue
        kept_cost = rng.randrange(0, stage.cost + 1)
        stages.append(replace(stage, kept_bytes=rng.randrange(1, 120), kept_cost=kept_cost,
                              kept_ops=1, aten_ops=rng.randrange(1, 4)))
    return replace(chain, stages=tuple(stages))


def _all_plans(chain: Chain) -> Iterator[tuple[Ranges, Keeps]]:
    """Every choice of ranges, and of which of them keep their matmuls."""
    for ranges in all_ranges(chain):
        starts = [a for a, _ in ranges]
        for k in range(len(starts) + 1):
            for chosen in combinations(starts, k):
                yield ranges, frozenset(chosen)


def _brute(chain: Chain, budget: int, price: str) -> int | None:
    """The least recompute cost of a plan whose price fits ``budget``: the programme's price
    (``"programme"``) or the plan's own estimate (``"estimate"``)."""
    model = model_of(chain, "non_reentrant")
    best = None
    for ranges, keeps in _all_plans(chain):
        peak = (model.peak(as_tree(ranges), keeps) if price == "programme"
                else estimate_peak(chain, ranges, "non_reentrant", keeps))
        if peak <= budget:
            cost = recompute_cost(chain, ranges, "non_reentrant", keeps)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_programme_matches_brute_force_with_keeps(seed: int) -> None:
    rng = random.Random(seed)
    chain = _with_kept(rng, random_chain(rng, count=rng.randrange(3, 8)))
    model = model_of(chain, "non_reentrant")
    baseline = model.peak(())
    least = optimal_ranges(chain, None, "non_reentrant")
    assert least is not None
    for budget in sorted({least[1], baseline, (least[1] + baseline) // 2,
                          rng.randrange(least[1], baseline + 1), least[1] - 1}):
        expected = _brute(chain, budget, "programme")
        found = optimal_plan(chain, budget, "non_reentrant")
        if expected is None:
            assert found is None
            continue
        assert found is not None
        ranges, keeps, peak = found
        assert keeps <= {a for a, _ in ranges}
        assert peak == model.peak(as_tree(ranges), keeps) <= budget
        assert recompute_cost(chain, ranges, "non_reentrant", keeps) == expected
        without = optimal_ranges(chain, budget, "non_reentrant")
        assert without is not None
        assert expected <= recompute_cost(chain, without[0], "non_reentrant")


def test_keeps_are_chosen_and_pay_on_some_chains() -> None:
    """Not a vacuous choice: on many of the random chains some budget is met for less with a
    segment that keeps than without."""
    cheaper = 0
    for seed in range(25):
        rng = random.Random(seed)
        chain = _with_kept(rng, random_chain(rng, count=rng.randrange(3, 8)))
        least = optimal_ranges(chain, None, "non_reentrant")
        assert least is not None
        baseline = model_of(chain, "non_reentrant").peak(())
        for budget in range(least[1], baseline, max(1, (baseline - least[1]) // 6)):
            with_keeps = optimal_plan(chain, budget, "non_reentrant")
            without = optimal_ranges(chain, budget, "non_reentrant")
            assert with_keeps is not None and without is not None
            if with_keeps[1] and (
                    recompute_cost(chain, with_keeps[0], "non_reentrant", with_keeps[1])
                    < recompute_cost(chain, without[0], "non_reentrant")):
                cheaper += 1
                break
    assert cheaper >= 8


@pytest.mark.parametrize("seed", range(20))
def test_search_matches_brute_force_under_the_estimate_with_keeps(seed: int) -> None:
    """With long-lived and passing storages the plan's own estimate is below the programme's
    price; the search is exact for the estimate, keeps included."""
    rng = random.Random(seed)
    chain = _with_kept(rng, _with_passing(rng, random_chain(rng, count=rng.randrange(3, 7))))
    baseline = estimate_peak(chain, (), "non_reentrant")
    least = min(estimate_peak(chain, r, "non_reentrant") for r in all_ranges(chain))
    for budget in sorted({least, baseline, (least + baseline) // 2}):
        expected = _brute(chain, budget, "estimate")
        found = search_kept(chain, "non_reentrant", budget=budget)
        assert expected is not None and found is not None
        ranges, keeps, peak = found
        assert peak == estimate_peak(chain, ranges, "non_reentrant", keeps) <= budget
        assert recompute_cost(chain, ranges, "non_reentrant", keeps) == expected


def test_reentrant_segments_keep_nothing() -> None:
    """Reentrant checkpoint takes no selective policy: the programme never keeps there."""
    for seed in range(10):
        rng = random.Random(seed)
        chain = _with_kept(rng, random_chain(rng, count=rng.randrange(3, 8)))
        model = model_of(chain, "reentrant")
        assert not model.keeps
        baseline = model.peak(())
        found = optimal_plan(chain, baseline - 1, "reentrant")
        assert found is None or not found[1]


def test_a_kept_segment_holds_its_outputs_until_its_recompute() -> None:
    """The bytes a keeping segment holds are on top of every later stage's peak, and its
    recompute is spared the kept cost."""
    rng = random.Random(3)
    chain = _with_kept(rng, random_chain(rng, count=6))
    chain = replace(chain, stages=tuple(replace(s, carries_grad=True) for s in chain.stages))
    model = model_of(chain, "non_reentrant")
    plain = model.peak(as_tree(((1, 2),)))
    kept = model.peak(as_tree(((1, 2),)), frozenset({1}))
    assert kept >= plain
    assert (recompute_cost(chain, ((1, 2),), "non_reentrant", frozenset({1}))
            <= recompute_cost(chain, ((1, 2),), "non_reentrant"))
