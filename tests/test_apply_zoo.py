"""Every zoo model, trained one step with and without autockpt, compared tensor by tensor.

For budgets from "no checkpointing needed" down to the least reachable, in both checkpoint
modes: the loss, every parameter's gradient and every buffer (BatchNorm running statistics
included) must match an identically seeded twin that runs without autockpt.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import autockpt
from tests.helpers import (
    MODES,
    assert_same_case_step,
    assert_same_step,
    assert_same_tensors,
    train_step,
)
from tests.zoo import CASES, ZooCase, clone_case

# Fractions of the estimated no-checkpoint peak; None asks for the least memory reachable and
# "min" for exactly the least reachable, as a number.
BUDGETS = (1.0, 0.75, 0.5, 0.25, "min", None)


def _budget_mb(model: torch.nn.Module, case: ZooCase, budget: object, mode: str
               ) -> tuple[float | None, int]:
    """The budget in MiB, and the least peak the planner can reach."""
    args, kwargs = case.inputs()
    probe = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode)
    if budget is None:
        return None, probe.min_peak_bytes
    if budget == "min":
        return probe.min_peak_bytes / 2**20, probe.min_peak_bytes
    return probe.baseline_peak_bytes * float(budget) / 2**20, probe.min_peak_bytes  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_same_training_step(case: ZooCase, budget: object, mode: str) -> None:
    reference, twin = clone_case(case)
    budget_mb, least = _budget_mb(twin, case, budget, mode)
    args, kwargs = case.inputs()
    if budget_mb is not None and int(budget_mb * 2**20) < least:
        with pytest.raises(autockpt.InfeasibleBudgetError) as info:
            autockpt.apply(twin, budget_mb, example_inputs=args, example_kwargs=kwargs, mode=mode)
        assert info.value.min_feasible_bytes == least
        assert_same_case_step(case, reference, twin)  # left untouched
        return
    transformed = autockpt.apply(twin, budget_mb, example_inputs=args, example_kwargs=kwargs,
                                 mode=mode)
    plan = autockpt.plan_of(transformed)
    if budget_mb is not None:
        assert plan.estimated_peak_bytes <= plan.budget_bytes
    if budget is None or budget == "min":
        assert plan.estimated_peak_bytes == plan.min_peak_bytes
    # The very same Parameter objects and names, so optimizers and state_dicts keep working.
    assert list(transformed.state_dict()) == list(twin.state_dict())
    assert [n for n, _ in transformed.named_buffers()] == [n for n, _ in twin.named_buffers()]
    for (name_a, p_a), (name_b, p_b) in zip(twin.named_parameters(),
                                            transformed.named_parameters()):
        assert name_a == name_b and p_a is p_b
    assert_same_case_step(case, reference, transformed)
    # The user's module still works on its own, unchanged.
    assert_same_case_step(case, reference, twin)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plans_checkpoint_something_at_least_memory(case: ZooCase) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    plan = autockpt.plan(model, args, example_kwargs=kwargs)
    if case.name == "frozen_backbone":
        # Only the head carries gradient; checkpointing can still save its activations.
        assert plan.min_peak_bytes <= plan.baseline_peak_bytes
    else:
        assert plan.segments, f"{case.name}: nothing checkpointed at the least-memory budget"
        assert plan.min_peak_bytes < plan.baseline_peak_bytes


def test_infeasible_budget_names_the_least_reachable() -> None:
    case = next(c for c in CASES if c.name == "resnet")
    model = case.build()
    args, kwargs = case.inputs()
    least = autockpt.plan(model, args).min_peak_bytes
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.apply(model, least / 2 / 2**20, example_inputs=args)
    assert info.value.min_feasible_bytes == least
    assert "budget_mb=" in str(info.value)
    # ... and the suggested budget is accepted.
    suggested = info.value.min_feasible_bytes / 2**20
    autockpt.apply(model, suggested, example_inputs=args)


def _inputs_requiring_grad(case: ZooCase) -> tuple[tuple[Any, ...], dict[str, Any], list[Tensor]]:
    """The case's inputs with every floating-point tensor a leaf that requires grad."""
    args, kwargs = case.inputs()
    leaves: list[Tensor] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            value = value.detach().clone().requires_grad_()
            leaves.append(value)
        return value

    args, kwargs = torch.utils._pytree.tree_map(mark, (args, kwargs))
    return args, kwargs, leaves


FLOAT_INPUT_CASES = [c for c in CASES if _inputs_requiring_grad(c)[2]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FLOAT_INPUT_CASES, ids=lambda c: c.name)
def test_inputs_that_require_grad(case: ZooCase, mode: str) -> None:
    """Inputs that require grad (a stage of a larger model, input-gradient methods), read by
    skip connections and by checkpointed segments: the least-memory plan gives the inputs
    and every parameter the gradients of the untransformed twin."""
    reference, twin = clone_case(case)
    args, kwargs, _ = _inputs_requiring_grad(case)
    transformed = autockpt.apply(twin, None, example_inputs=args, example_kwargs=kwargs,
                                 mode=mode)
    if not autockpt.plan_of(transformed).segments:
        # Reentrant checkpoint saves nothing on the smallest models; segments are what is
        # under test, so take them where the sqrt strategy puts them.
        transformed = autockpt.apply(twin, None, example_inputs=args, example_kwargs=kwargs,
                                     mode=mode, strategy="sqrt")
    assert autockpt.plan_of(transformed).segments, f"{case.name}: nothing checkpointed"
    steps = []
    for model in (reference, transformed):
        args, kwargs, leaves = _inputs_requiring_grad(case)
        step = train_step(model, case.loss_fn, args, kwargs, seed=1234)
        steps.append((step, {f"input {i}": t.grad for i, t in enumerate(leaves)}))
    (expected, expected_inputs), (actual, actual_inputs) = steps
    assert_same_step(actual, expected, what=f"{case.name} ", allow_none=True)
    assert_same_tensors(actual_inputs, expected_inputs, what=f"{case.name} ")
