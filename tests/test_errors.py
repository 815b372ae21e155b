"""Bad input gets a clear exception from autockpt's family, and the model is left untouched."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import autockpt


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _snapshot(model: nn.Module) -> tuple[type, dict[str, object], dict[str, torch.Tensor], bool]:
    return (type(model), dict(model.__dict__),
            {k: v.clone() for k, v in model.state_dict().items()}, model.training)


def _assert_untouched(model: nn.Module, snap: tuple) -> None:  # type: ignore[type-arg]
    cls, attrs, state, training = snap
    assert type(model) is cls and model.training == training
    assert set(model.__dict__) == set(attrs)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return self.fc(x)
        return x


@pytest.mark.parametrize("bad", [nn.Linear, "model", None, {"w": torch.ones(1)}],
                         ids=["class", "str", "None", "state_dict"])
def test_not_a_module(bad: object) -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="torch.nn.Module") as info:
        autockpt.apply(bad, 10)  # type: ignore[arg-type]
    assert "fix:" in str(info.value)
    with pytest.raises(autockpt.InvalidArgumentError):
        autockpt.plan(bad, (torch.ones(1),))  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0, -5, math.nan, math.inf, "300", True, [1]])
def test_bad_budget(budget: object) -> None:
    model = _net()
    snap = _snapshot(model)
    with pytest.raises(autockpt.InvalidArgumentError, match="budget_mb") as info:
        autockpt.apply(model, budget, example_inputs=(torch.randn(4, 8),))  # type: ignore[arg-type]
    assert repr(budget) in str(info.value) or "number" in str(info.value)
    assert isinstance(info.value, ValueError)
    _assert_untouched(model, snap)


def test_impossible_budget_says_what_is_reachable_and_leaves_the_model() -> None:
    model = _net()
    snap = _snapshot(model)
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.apply(model, 1e-6, example_inputs=(torch.randn(4, 8),))
    err = info.value
    assert err.budget_bytes == 1 and err.min_feasible_bytes > 1
    assert "budget_mb=" in str(err)
    _assert_untouched(model, snap)


@pytest.mark.parametrize(
    "inputs, match",
    [
        ((torch.randn(4, 5),), "failed on the example inputs"),  # wrong feature size
        ((torch.randn(4, 8), torch.randn(4, 8)), "does not accept"),  # one too many
        (42, "example_inputs must be"),
    ],
    ids=["wrong-shape", "too-many", "wrong-type"],
)
def test_mismatched_example_inputs(inputs: object, match: str) -> None:
    model = _net()
    snap = _snapshot(model)
    with pytest.raises(autockpt.InvalidArgumentError, match=match) as info:
        autockpt.apply(model, 10, example_inputs=inputs)
    assert "fix:" in str(info.value)
    _assert_untouched(model, snap)


def test_untraceable_model_names_the_line() -> None:
    model = Untraceable()
    snap = _snapshot(model)
    with pytest.raises(autockpt.TraceError) as info:
        autockpt.apply(model, 10, example_inputs=(torch.randn(2, 4),), capture="fx")
    err = info.value
    assert err.location is not None and __file__ in err.location
    assert "Untraceable" in str(err) and "fix:" in str(err)
    _assert_untouched(model, snap)


@pytest.mark.parametrize("kwargs, match", [({"mode": "fast"}, "unknown mode"),
                                           ({"strategy": "magic"}, "unknown strategy"),
                                           ({"plan": "p"}, "plan must be")])
def test_bad_options_list_the_valid_ones(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match=match) as info:
        autockpt.apply(_net(), **kwargs)  # type: ignore[arg-type]
    if "mode" in kwargs:
        assert "'non_reentrant'" in str(info.value)
    if "strategy" in kwargs:
        assert "'greedy'" in str(info.value) and "'sqrt'" in str(info.value)


def test_plan_needs_example_inputs_and_plan_of_needs_a_transformed_module() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="needs example inputs"):
        autockpt.plan(_net())
    with pytest.raises(autockpt.InvalidArgumentError, match="not a module returned"):
        autockpt.plan_of(_net())


def test_every_error_is_an_autockpt_error() -> None:
    for cls in (autockpt.InvalidArgumentError, autockpt.TraceError,
                autockpt.InfeasibleBudgetError, autockpt.CheckpointError):
        assert issubclass(cls, autockpt.AutockptError)
