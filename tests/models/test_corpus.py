"""Real models from timm, torchvision, transformers and diffusers, checkpointed by autockpt.

For every corpus case, at half the estimated peak without checkpointing and at the least
reachable peak, in both checkpoint modes: ``apply`` keeps the state_dict keys and the very same
Parameter objects; one training step gives the loss, every parameter gradient and every buffer
of an identically seeded twin that runs without autockpt (dropout included: both steps start
from the same seed); and the measured peak activation memory of that step, with the case's own loss planned
(``loss_fn=``) and measured, stays within the budget plus the documented slack.

Run alone with ``python -m pytest -m models tests/models`` (needs ``pip install -e
".[models]"``); a case whose package is missing is skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import MODES, Step, assert_same_step, assert_same_step_in_float64, train_step
from tests.models.corpus import CASES, CorpusCase

pytestmark = pytest.mark.models

MIB = 2**20
BUDGETS = ("half", "min")
BUILD_SEED = 0
STEP_SEED = 1234

_probes: dict[tuple[str, str], tuple[int, int]] = {}


def _baseline_and_least(case: CorpusCase, model: nn.Module, mode: str) -> tuple[int, int]:
    """``(baseline_peak_bytes, min_peak_bytes)`` of the case's plan, computed once per mode."""
    key = (case.name, mode)
    if key not in _probes:
        args, kwargs = case.inputs()
        probe = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode,
                              loss_fn=case.loss_fn)
        _probes[key] = (probe.baseline_peak_bytes, probe.min_peak_bytes)
    return _probes[key]


def _step(model: nn.Module, case: CorpusCase) -> Step:
    """One seeded training step; its gradients are cleared after the snapshot, so that the
    step measured later starts from none, as after ``zero_grad()``."""
    step = train_step(model, case.loss_fn, *case.inputs(), seed=STEP_SEED)
    model.zero_grad(set_to_none=True)
    return step


def _build_twins(case: CorpusCase) -> tuple[nn.Module, nn.Module]:
    reference, model = case.build(BUILD_SEED), case.build(BUILD_SEED)
    state_a, state_b = reference.state_dict(), model.state_dict()
    assert list(state_a) == list(state_b)
    for key, value in state_a.items():
        assert torch.equal(value, state_b[key]), f"{case.name}: two builds differ at {key}"
    return reference, model


def _assert_same_module_tree(model: nn.Module, transformed: nn.Module) -> None:
    assert list(transformed.state_dict()) == list(model.state_dict())
    named = list(model.named_parameters())
    named_t = list(transformed.named_parameters())
    assert [n for n, _ in named_t] == [n for n, _ in named]
    for (name, p), (_, p_t) in zip(named, named_t):
        assert p_t is p, f"{name} is not the same Parameter object"
    assert [n for n, _ in transformed.named_buffers()] == [n for n, _ in model.named_buffers()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_checkpointed_training_step(case: CorpusCase, budget: str, mode: str) -> None:
    pytest.importorskip(case.requires)
    reference, model = _build_twins(case)
    baseline, least = _baseline_and_least(case, model, mode)
    budget_bytes = baseline // 2 if budget == "half" else least
    args, kwargs = case.inputs()
    what = f"{case.name} at {budget} ({budget_bytes} B, {mode})"

    # The case's own loss is planned too: the budget is for the step users run.
    apply_kwargs: dict[str, Any] = {"example_inputs": args, "example_kwargs": kwargs,
                                    "mode": mode, "loss_fn": case.loss_fn}
    try:
        transformed = autockpt.apply(model, budget_bytes / MIB, **apply_kwargs)
    except autockpt.InfeasibleBudgetError as err:
        # Only legitimate when the least reachable peak really is above the budget.
        assert budget == "half", f"{what}: the least reachable budget was refused: {err}"
        assert err.min_feasible_bytes > budget_bytes, f"{what}: {err}"
        assert err.min_feasible_bytes == least
        return

    plan = autockpt.plan_of(transformed)
    assert plan.budget_bytes == budget_bytes
    assert plan.estimated_peak_bytes <= budget_bytes
    _assert_same_module_tree(model, transformed)
    if mode == "reentrant":
        # NOTE [ Gradients summed in another order ] in tests/helpers.py
        assert_same_step_in_float64(lambda: case.build(BUILD_SEED), plan, case.loss_fn, args,
                                    kwargs, what=f"{what} ", seed=STEP_SEED)
    else:
        expected = _step(reference, case)
        assert_same_step(_step(transformed, case), expected, what=f"{what} ", allow_none=True)

    report = autockpt.measure(transformed, args, example_kwargs=kwargs, loss_fn=case.loss_fn)
    assert report.peak_activation_bytes <= budget_bytes * (1 + BUDGET_SLACK), (
        f"{what}: measured peak {report.peak_activation_bytes} B over the budget "
        f"(estimate {plan.estimated_peak_bytes} B, baseline {baseline} B)"
    )
