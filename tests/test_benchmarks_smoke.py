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
import overhead  # noqa: E402
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


def _tiny_gpt_spec() -> models.BenchModel:
    """The benchmark's GPT block (LayerNorm, SDPA, GELU MLP) at a size that runs in
    milliseconds: 3 blocks of width 32, 2 sequences of 16 tokens."""
    size = {"layers": 3, "dim": 32, "heads": 2, "vocab": 64, "length": 16}
    return models.BenchModel("tiny_gpt", lambda: models.gpt(**size),
                             lambda: torch.randint(0, 64, (2, 16),
                                                   generator=torch.Generator().manual_seed(0)),
                             "cross_entropy")


def test_op_policy_is_compared_and_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op policy (torchtitan's selective op) has its row, and autockpt is asked for the
    memory it measured. It saves every op the FLOP counter counts (the linears' ``addmm``,
    the CPU's attention kernel), so it recomputes no FLOPs, and drops what the norms, GELU
    and residual adds save: less memory than no checkpointing, more than every block."""
    monkeypatch.setitem(compare.MODELS, "tiny_gpt", _tiny_gpt_spec())
    rows = compare.run_model("tiny_gpt", repeat=1, compile_budgets=False)
    by_method = {row.method: row for row in rows if row.matched_to is None}
    none = by_method["no checkpointing"]
    every = by_method["every block (HF/timm style)"]
    op = by_method[compare.OP_POLICY_METHOD]
    assert none.peak_activation_mib and every.peak_activation_mib and op.peak_activation_mib
    assert every.peak_activation_mib < op.peak_activation_mib < none.peak_activation_mib
    assert op.backward_flops_ratio == none.backward_flops_ratio == 1.0
    assert every.backward_flops_ratio is not None and every.backward_flops_ratio > 1.0
    matched = [row for row in rows if row.matched_to == compare.OP_POLICY_METHOD]
    assert len(matched) == 1 and matched[0].peak_activation_mib is not None
    assert matched[0].peak_activation_mib <= op.peak_activation_mib * 1.05 + 0.01


def test_op_policy_keeps_the_gradients() -> None:
    spec = _tiny_gpt_spec()
    base = spec.build()
    x = spec.batch()
    loss = models.make_loss(spec, base, x)
    alternatives = {name: model for name, model, _ in compare._alternatives(base, False)}
    grads = []
    for name in ("no checkpointing", compare.OP_POLICY_METHOD):
        model = alternatives[name]
        model.zero_grad(set_to_none=True)
        loss.fn(model(x)).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def _plot_rows() -> list[compare.Row]:
    def row(method: str, peak: float | None, time_ratio: float, flops: float | None,
            matched_to: str | None = None, saved: float | None = None) -> compare.Row:
        return compare.Row(model="tiny", method=method, peak_activation_mib=peak, step_ms=1.0,
                           time_ratio=time_ratio, backward_flops_ratio=flops,
                           matched_to=matched_to, saved_mib=saved)

    return [row("no checkpointing", 10.0, 1.0, 1.0),
            row("every block (HF/timm style)", 3.0, 1.3, 1.32),
            row(compare.OP_POLICY_METHOD, 7.0, 1.1, 1.0),
            row("torch.compile(memory budget 0.5)", None, 1.05, None, saved=5.0),
            row("autockpt (budget 10.00 MiB)", 9.9, 1.0, 1.0, "no checkpointing"),
            row("autockpt (budget 3.00 MiB)", 3.0, 1.25, 1.3, "every block (HF/timm style)"),
            row("autockpt (budget 7.00 MiB)", 6.9, 1.05, 1.08, compare.OP_POLICY_METHOD),
            row("autockpt (least memory)", 2.0, 1.5, 1.8)]


def test_plot_draws_memory_against_flops_and_time(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    real_savefig = Figure.savefig

    def savefig(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    paths = compare.plot(_plot_rows(), tmp_path)
    assert paths == [tmp_path / "pareto_tiny.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (figure,) = saved
    flops_ax, time_ax = figure.axes
    assert "FLOPs" in flops_ax.get_xlabel() and "time" in time_ax.get_xlabel()
    assert "memory" in flops_ax.get_ylabel()
    labels = {text.get_text() for ax in figure.axes for text in ax.texts}
    labels = {line for text in labels for line in text.splitlines()}
    assert {"no checkpointing", "every block (HF/timm style)", compare.OP_POLICY_METHOD,
            "autockpt (least memory)"} <= labels
    # torch.compile has no FLOP count: only the time panel shows what it saves.
    assert "torch.compile(memory budget 0.5): saves (lower bound)" in {
        line for text in time_ax.texts for line in text.get_text().splitlines()}
    # autockpt's four rows are one line, in order of memory.
    (line,) = [ln for ln in flops_ax.lines if len(ln.get_xdata()) == 4]
    assert list(line.get_ydata()) == [2.0, 3.0, 6.9, 9.9]


def test_plot_dir_without_matplotlib_fails_before_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    monkeypatch.setattr(compare, "run_model", lambda *a, **k: pytest.fail("ran a model"))
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--models", "mlp72", "--plot-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--plot-dir needs matplotlib" in capsys.readouterr().err
    with pytest.raises(ImportError, match="needs matplotlib"):
        compare.plot(_plot_rows(), tmp_path)


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


def test_estimate_models_measures_a_zoo_model_at_three_budgets() -> None:
    """benchmarks/estimate_models.py applies a model at 90%, 75% and 60% of its measured peak,
    counts the segments that keep their matmuls, and summarises the ratios."""
    import estimate_models
    from tests import zoo

    case = next(c for c in zoo.CASES if c.name == "transformer")
    rows = estimate_models.run_case(case.name, case.build, case.inputs, case.loss_fn)
    assert [r["fraction"] for r in rows] == [0.9, 0.75, 0.6]
    planned = [r for r in rows if not r["infeasible"]]
    assert planned and all(
        abs(r["estimated_bytes"] - r["measured_bytes"]) <= 0.01 * r["measured_bytes"]
        and 0 <= r["keeping"] <= r["segments"] for r in planned)
    assert estimate_models.summary(rows).startswith(f"plans {len(planned)} ")


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


def test_overhead_compares_plans_made_with_and_without_the_fixed_costs() -> None:
    """benchmarks/overhead.py on the zoo's transformer at 60%: a row per plan, the plan with
    the fixed costs has fewer segments and both meet the budget."""
    case = overhead.cases(torch.device("cpu"))["tiny transformer (zoo)"]
    rows = overhead.run("tiny", case, [0.6], repeat=1, device=torch.device("cpu"))
    assert [r.costs for r in rows] == ["none", "FLOPs + fixed costs", "FLOPs only"]
    none, fixed, flops = rows
    assert none.segments == 0 and none.time_ratio == 1.0
    assert 0 < fixed.segments < flops.segments
    assert fixed.peak_mib <= 1.05 * fixed.budget_mib and flops.peak_mib <= 1.05 * flops.budget_mib
    assert "| tiny | 60% | FLOPs + fixed costs |" in overhead.table(rows)
