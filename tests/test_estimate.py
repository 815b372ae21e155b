"""The plan's estimated peak is close to the peak the measure sees: within 10% for every zoo
case at the least memory, at half the baseline and with no checkpointing, in both modes, with a
real loss (one that sends an output-sized gradient into every output) planned and measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autockpt
from tests.zoo import CASES, ZooCase

TOLERANCE = 0.10
FRACTIONS = ("min", 0.5, 1.0)
SLOW = {"mlp72", "densenet_block", "resnet", "generator"}


def squares(output: Any) -> torch.Tensor:
    """``mean(t**2)`` summed over the floating-point outputs that require grad: every output
    gets an output-sized gradient, as from a real loss."""
    tensors = [t for t in autockpt.loss.output_tensors(output)
               if t.is_floating_point() and t.requires_grad]
    return torch.stack([t.float().square().mean() for t in tensors]).sum()


def _params() -> list[object]:
    out = []
    for case in CASES:
        for mode in ("non_reentrant", "reentrant"):
            marks = []
            if case.name in SLOW:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(case, mode, marks=marks, id=f"{case.name}-{mode}"))
    return out


@pytest.mark.parametrize(("case", "mode"), _params())
def test_estimate_is_within_10_percent_of_the_measured_peak(case: ZooCase, mode: str) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    probe = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode, loss_fn=squares)
    seen: set[tuple[tuple[int, int], ...]] = set()
    for fraction in FRACTIONS:
        budget = (probe.min_peak_bytes if fraction == "min"
                  else max(probe.min_peak_bytes, int(probe.baseline_peak_bytes * fraction)))
        ckpt = autockpt.apply(model, budget / 2**20, example_inputs=args, example_kwargs=kwargs,
                              mode=mode, loss_fn=squares)
        plan = autockpt.plan_of(ckpt)
        segments = tuple((s.start, s.end) for s in plan.segments)
        if segments in seen:
            continue
        seen.add(segments)
        measured = autockpt.measure(ckpt, args, example_kwargs=kwargs,
                                    loss_fn=squares).peak_activation_bytes
        estimated = plan.estimated_peak_bytes
        assert abs(estimated - measured) <= TOLERANCE * measured, (
            f"{case.name} at {fraction} ({mode}, {len(segments)} segments): estimated "
            f"{estimated} B, measured {measured} B ({estimated / measured:.3f}x)"
        )
