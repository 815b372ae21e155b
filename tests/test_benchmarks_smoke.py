"""benchmarks/compare.py measures, times and plans every method with the model's real loss.

A tiny model is registered in place of the benchmark models so that one whole
``run_model`` takes seconds; ``autockpt.apply`` and ``autockpt.measure`` are wrapped to
check that each call got the same loss, the one the rows name. benchmarks/planner_speed.py's
corpus part times two of the models the tests plan.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autockpt

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import compare  # noqa: E402
import models  # noqa: E402


def _tiny() -> models.Blocks:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)]
    return models.Blocks(nn.Identity(), blocks, nn.Linear(32, 10))


def test_cross_entropy_flattens_tokens_and_keeps_its_targets() -> None:
    spec = models.MODELS["gpt"]
    logits = torch.randn(2, 5, 7)
    loss = models.LOSSES[spec.loss](logits)
    assert loss.name == "cross_entropy"
    assert "7 classes, 10 targets" in loss.description
    leaf = logits.clone().requires_grad_()
    first = loss.fn(leaf)
    # Fixed targets: the same loss every call, and a real output-sized gradient.
    assert torch.equal(first, loss.fn(leaf))
    first.backward()
    assert leaf.grad is not None and leaf.grad.shape == logits.shape
    assert leaf.grad.abs().sum() > 0


def test_mse_has_a_fixed_target_of_the_output_shape() -> None:
    output = torch.zeros(2, 3, 4, 4)
    loss = models.LOSSES["mse"](output)
    assert loss.name == "mse"
    again = models.LOSSES["mse"](output)
    assert torch.equal(loss.fn(output), again.fn(output))
    assert loss.fn(output).item() > 0


def test_every_benchmark_model_names_a_known_loss() -> None:
    for spec in models.MODELS.values():
        assert spec.loss in models.LOSSES, spec.name


def test_make_loss_leaves_batch_norm_statistics_alone() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(5))
    model(torch.randn(2, 3, 8, 8))  # materialise the lazy layer
    before = model[1].running_mean.clone()
    spec = models.BenchModel("bn", lambda: model, lambda: torch.randn(2, 3, 8, 8),
                             "cross_entropy")
    models.make_loss(spec, model, torch.randn(2, 3, 8, 8))
    assert torch.equal(model[1].running_mean, before)
    assert model.training


@pytest.mark.slow  # about 10 s: six plans and as many measured steps
def test_run_model_uses_one_real_loss_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models.BenchModel("tiny", _tiny, lambda: torch.randn(4, 32), "cross_entropy")
    monkeypatch.setitem(compare.MODELS, "tiny", spec)
    applied: list[Any] = []
    measured: list[Any] = []
    real_apply, real_measure = autockpt.apply, autockpt.measure

    def apply(*args: Any, **kwargs: Any) -> nn.Module:
        applied.append(kwargs.get("loss_fn"))
        return real_apply(*args, **kwargs)

    def measure(*args: Any, **kwargs: Any) -> Any:
        measured.append(kwargs.get("loss_fn"))
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(autockpt, "apply", apply)
    monkeypatch.setattr(autockpt, "measure", measure)
    losses: dict[str, str] = {}
    rows = compare.run_model("tiny", repeat=1, compile_budgets=False, losses=losses)

    assert losses == {"tiny": "cross_entropy over 10 classes, 4 targets"}
    assert rows and all(row.loss == "cross_entropy" for row in rows)
    # One loss object for every measurement and every plan: none fell back to the default.
    assert applied and measured
    assert all(fn is not None for fn in applied + measured)
    assert len({id(fn) for fn in applied + measured}) == 1
    # Each autockpt row matched to an alternative reaches the budget it was given: the
    # alternative's peak, measured with the same loss.
    for row in rows:
        if row.matched_to is None or row.peak_activation_mib is None:
            continue
        alt = next(r for r in rows if r.method == row.matched_to)
        assert alt.peak_activation_mib is not None
        assert row.peak_activation_mib <= alt.peak_activation_mib * 1.05 + 0.01, row


def test_saved_for_backward_counts_the_loss_but_not_its_targets() -> None:
    model = _tiny()
    x = torch.randn(4, 32)
    spec = models.BenchModel("tiny", _tiny, lambda: x, "mse")
    loss = models.make_loss(spec, model, x)
    saved = compare._saved_for_backward(model, x, loss)
    # The 6 ReLU outputs (each also the next Linear's saved input; the first Linear's is x,
    # not counted) and the model output MSE saves; its (4, 10) target is not an activation.
    assert saved == 6 * 4 * 32 * 4 + 4 * 10 * 4


def test_planner_speed_corpus_times_the_models_the_tests_plan(capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    import planner_speed

    names = [name for name, _, _ in planner_speed.corpus_models()]
    assert {"tv_densenet121", "tv_vgg11_bn", "unet", "transformer_encoder"} <= set(names)
    rows = planner_speed.corpus(1, ["unet", "transformer_encoder"])
    assert [r["model"] for r in rows] == ["unet", "transformer_encoder"]
    assert [r["capture"] for r in rows] == ["fx", "export"]
    assert all(r["first_plan_seconds"] > 0 and r["capture_seconds"] > 0 for r in rows)
    planner_speed.print_corpus(rows)
    assert "slowest first plan: " in capsys.readouterr().out


def test_estimate_accuracy_measures_random_graphs() -> None:
    """benchmarks/estimate_accuracy.py plans, applies and measures a random graph at three
    budgets and summarises the ratios."""
    import estimate_accuracy

    rows = estimate_accuracy.run(1, ["non_reentrant"])
    assert [r["fraction"] for r in rows] == [None, 0.5, 0.75]
    assert all(r["measured_bytes"] > 0 and r["estimated_bytes"] >= 0.95 * r["measured_bytes"]
               for r in rows)
    assert estimate_accuracy.summary(rows).splitlines()[1].startswith("non_reentrant")


def test_unseen_models_runs_the_skip_connection_checks() -> None:
    """benchmarks/unseen_models.py checks a model as tests/models/test_skip_connections.py
    does, and its verdict flags what misses a target (ShuffleNet's least memory, 44% of its
    baseline, is above the skip models' 40%)."""
    pytest.importorskip("torchvision")
    import unseen_models

    case = next(c for c in unseen_models.CASES if c.name == "tv_shufflenet_v2_x0_5")
    row = unseen_models.check(case, "non_reentrant")
    assert row["gradients"] == "same" and row["capture"] == "fx"
    assert 0 < row["least_bytes"] < row["baseline_bytes"]
    assert row["estimate_over_measured"] >= 0.99
    assert all(row[f"budget_{f:.2f}"] <= 1.05 for f in (0.5, 0.75))
    verdict = unseen_models._verdict(row)
    assert ("least" in verdict) == (row["least_share"] > 0.40), (row, verdict)
