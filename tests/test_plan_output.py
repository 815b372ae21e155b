"""The printed plan, checked against a file: the table is part of the interface."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import autockpt

EXPECTED = Path(__file__).parent / "expected"


def _plan_text(mode: str, budget_mb: float | None) -> str:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(5):
        layers += [nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(512, 10))
    plan = autockpt.plan(model, (torch.randn(64, 512),), budget_mb=budget_mb, mode=mode)
    return str(plan) + "\n"


def _check(name: str, text: str) -> None:
    path = EXPECTED / name
    if os.environ.get("AUTOCKPT_UPDATE_EXPECTED"):
        path.write_text(text)
    assert text == path.read_text(), (
        f"the plan printed differently from {path}; if the change is intended, rerun with "
        "AUTOCKPT_UPDATE_EXPECTED=1 and review the diff"
    )


def test_plan_table_non_reentrant() -> None:
    _check("plan_sequential_non_reentrant.txt", _plan_text("non_reentrant", 1.5))


def test_plan_table_reentrant_shows_the_dummy_arg() -> None:
    text = _plan_text("reentrant", None)
    _check("plan_sequential_reentrant.txt", text)
    # The first segment reads only the raw input, which does not require grad.
    assert any(line.startswith("1 ") and " yes " in line for line in text.splitlines())


def test_plan_table_of_a_unet_shows_segments_with_several_inputs() -> None:
    """Skip connections cross some segments of a UNet: their rows say so."""
    from tests.skip_models import UNet

    torch.manual_seed(0)
    plan = autockpt.plan(UNet().train(), (torch.randn(4, 3, 64, 64),), loss_fn="mse")
    _check("plan_unet_non_reentrant.txt", str(plan) + "\n")
    several = [s for s in plan.segments if s.input_count > 1]
    assert several, "no segment of the UNet's least-memory plan has more than one input"
    for seg in several:
        assert seg.boundary_bytes > 0
