"""The ``autockpt`` command line, driven as users drive it: ``python -m autockpt`` in a
subprocess, checking what it prints and its exit status (0 done, 2 a usage or user error)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autockpt
from autockpt import cli
from tests import cli_models

REPO = Path(__file__).resolve().parents[1]
MLP = "tests.cli_models:mlp"
MLP_INPUT = "8x128"


# In-process runs use one thread too (see run_cli).
pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # One thread: the machine is shared, and two threads fighting a busy neighbour make a
    # millisecond step take a second.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autockpt", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autockpt: error: ") and "(fix: " in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------- plan


def test_plan_prints_the_plan_and_the_measured_peaks() -> None:
    result = run_cli("plan", MLP, "--input", MLP_INPUT, "--steps", "1")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert "\x1b[" not in out  # piped: plain text, no colours
    assert out.startswith("autockpt plan for Sequential(input=float32[8, 128])")
    plan = autockpt.plan(cli_models.mlp(), (torch.randn(8, 128),))
    assert str(plan) in out  # the same table as print(plan)
    assert "measured on cpu" in out
    before = next(line for line in out.splitlines() if line.startswith("without autockpt"))
    after = next(line for line in out.splitlines() if line.startswith("with this plan"))
    assert "KiB" in before and "%" in after and after.rstrip().endswith("x")


def test_plan_json_matches_autockpt_plan(tmp_path: Path) -> None:
    # The path form of MODEL, run from another directory, with a budget in percent.
    result = run_cli("plan", str(REPO / "tests" / "cli_models.py") + ":mlp", "--input",
                     MLP_INPUT, "--budget", "60%", "--json", "--steps", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    model = cli_models.mlp()
    x = torch.randn(8, 128)
    free = autockpt.plan(model, (x,))
    budget = data["plan"]["budget_bytes"]
    assert abs(budget - 0.6 * free.baseline_peak_bytes) <= 1
    expected = autockpt.plan(model, (x,), budget_mb=budget / 2**20)
    for name in ("baseline_peak_bytes", "estimated_peak_bytes", "min_peak_bytes",
                 "recompute_flops", "forward_flops", "node_count", "mode", "model",
                 "input_signature", "graph_fingerprint"):
        assert data["plan"][name] == getattr(expected, name), name
    assert data["plan"]["recompute_ratio"] == pytest.approx(expected.recompute_ratio)
    assert [(s["start"], s["end"], s["first_module"], s["last_module"])
            for s in data["plan"]["segments"]] == [
        (s.start, s.end, s.first_module, s.last_module) for s in expected.segments]
    measured = data["measured"]
    before = measured["without_autockpt"]["peak_activation_bytes"]
    after = measured["with_plan"]["peak_activation_bytes"]
    assert before == autockpt.measure(model, (x,)).peak_activation_bytes
    assert after < before and after <= 1.05 * budget
    assert measured["device"] == "cpu" and data["plot"] is None
    assert (data["loss"], data["grad_accumulation"], data["total_mb"], data["optimizer"]) == (
        "default", False, None, None)


def test_plan_with_several_inputs_int_ids_and_reentrant_mode() -> None:
    result = run_cli("plan", "tests.cli_models:TinyLM", "--input", "4x16:int64", "--json",
                     "--mode", "reentrant", "--budget-mb", "1", "--steps", "1")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["plan"]["mode"] == "reentrant"
    assert data["plan"]["input_signature"] == "ids=int64[4, 16]"
    assert data["plan"]["budget_bytes"] == 2**20

    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["plan", "tests.cli_models:TwoInputs", "--input", "4x32;4x32", "--json",
                     "--steps", "1"], out=out, err=err)
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["plan"]["input_signature"] == (
        "x=float32[4, 32], y=float32[4, 32]")


def _in_process(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_plan_with_a_named_loss() -> None:
    code, out, err = _in_process("plan", "tests.cli_models:TinyLM", "--input", "4x16:int64",
                                 "--loss", "cross_entropy", "--json", "--steps", "1")
    assert code == 0, err
    data = json.loads(out)
    assert data["loss"] == "cross_entropy"
    # The plan prices that loss, as autockpt.plan with it does (its log-softmax saved, an
    # output-sized gradient sent), not the default.
    ids = torch.randint(0, 100, (4, 16))
    expected = autockpt.plan(cli_models.TinyLM(), (ids,), loss_fn="cross_entropy")
    assert expected.loss is not None
    # Through JSON, as the command line writes it: tuples (LossStat.held) become lists.
    assert data["plan"]["loss"] == json.loads(json.dumps(dataclasses.asdict(expected.loss)))
    assert data["plan"]["loss"]["name"] == "cross_entropy_loss"
    assert data["plan"]["loss"]["saved_bytes"] > 0
    code, out, err = _in_process("plan", "tests.cli_models:TinyLM", "--input", "4x16:int64",
                                 "--loss", "cross_entropy", "--steps", "1")
    assert code == 0, err
    assert "loss            loss_fn cross_entropy_loss" in out
    assert "one forward + backward of --loss cross_entropy" in out


def test_plan_for_the_whole_device() -> None:
    # Parameters and gradients of the MLP take 2.02 MiB: 2.07 MiB leaves ~52 KiB of its 72 KiB
    # of activations, so something is checkpointed.
    code, out, err = _in_process("plan", MLP, "--input", MLP_INPUT, "--total-mb", "2.07",
                                 "--steps", "1")
    assert code == 0, err
    assert "whole device    2.07 MiB: parameters 1.01 MiB, gradients 1.01 MiB" in out
    budget = next(line for line in out.splitlines() if line.startswith("budget "))
    assert budget.rstrip().endswith("met")
    code, out, err = _in_process("plan", MLP, "--input", MLP_INPUT, "--total-mb", "2.07",
                                 "--json", "--steps", "1")
    assert code == 0, err
    data = json.loads(out)
    assert (data["loss"], data["total_mb"], data["optimizer"]) == ("default", 2.07, None)
    device = data["plan"]["device"]
    assert device["total_bytes"] == int(2.07 * 2**20) and device["optimizer"] == "none"
    assert data["plan"]["budget_bytes"] == device["total_bytes"] - (
        device["parameter_bytes"] + device["gradient_bytes"] + device["input_bytes"])
    assert data["plan"]["segments"]


def test_plan_for_the_whole_device_with_an_optimizer() -> None:
    # AdamW keeps two buffers per parameter: 2.02 MiB more, and its step() temporaries.
    code, out, err = _in_process("plan", MLP, "--input", MLP_INPUT, "--total-mb", "4.5",
                                 "--optimizer", "adamw", "--steps", "1")
    assert code == 0, err
    assert "whole device    4.50 MiB" in out and "AdamW state 2.02 MiB" in out
    assert "+ AdamW.step()" in out
    code, out, err = _in_process("plan", MLP, "--input", MLP_INPUT, "--total-mb", "4.5",
                                 "--optimizer", "adamw", "--json", "--steps", "1")
    assert code == 0, err
    data = json.loads(out)
    assert (data["total_mb"], data["optimizer"]) == (4.5, "adamw")
    device = data["plan"]["device"]
    assert device["optimizer"] == "AdamW" and device["optimizer_state_bytes"] > 0
    fixed = (device["parameter_bytes"] + device["gradient_bytes"]
             + device["optimizer_state_bytes"])
    assert data["measured"]["with_plan"]["peak_total_bytes"] >= fixed


def test_plan_with_grad_accumulation() -> None:
    code, out, err = _in_process("plan", MLP, "--input", MLP_INPUT, "--grad-accumulation",
                                 "--json", "--steps", "1")
    assert code == 0, err
    data = json.loads(out)
    assert data["grad_accumulation"] is True and data["plan"]["grad_accumulation"] is True


# --------------------------------------------------------------------------- bench


def test_bench_sweeps_budgets_with_infeasible_rows_and_progress() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["bench", MLP, "--input", MLP_INPUT, "--budgets", "100,60,1", "--steps",
                     "1"], out=out, err=err)
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("budget"))
    for column in ("estimated", "measured", "recompute", "step time"):
        assert column in header
    rows = {line.split()[0]: line for line in lines if line.split()[:1] and line.split()[0]
            in ("100%", "60%", "1%", "least")}
    assert set(rows) == {"100%", "60%", "1%", "least"}
    assert "infeasible" in rows["1%"] and "needs >=" in rows["1%"]
    assert rows["100%"].rstrip().endswith("x") and " 0.0% " in rows["100%"]
    # Not a terminal: progress is one plain line per step, on stderr.
    progress = err.getvalue().strip().splitlines()
    assert progress[0].startswith("autockpt: bench 1/5: 100%")
    assert progress[-1].startswith("autockpt: bench 5/5: timing round 1/1")


def test_bench_json() -> None:
    result = run_cli("bench", MLP, "--input", MLP_INPUT, "--budgets", "100,70,1", "--json",
                     "--steps", "1")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {row["label"]: row for row in data["rows"]}
    assert list(rows) == ["100%", "70%", "1%", "least"]
    assert rows["1%"]["feasible"] is False
    assert rows["1%"]["min_feasible_bytes"] == data["least_estimated_peak_bytes"]
    assert rows["100%"]["segments"] == 0 and rows["100%"]["recompute_ratio"] == 0
    assert rows["least"]["budget_bytes"] is None
    assert rows["least"]["measured_peak_bytes"] < rows["100%"]["measured_peak_bytes"]
    for row in (rows["100%"], rows["70%"], rows["least"]):
        assert row["estimated_peak_bytes"] > 0 and row["step_time_ratio"] > 0
    assert rows["70%"]["measured_peak_bytes"] <= 1.05 * rows["70%"]["budget_bytes"]
    assert data["loss"] == "default" and data["total_mb"] is None


def test_bench_with_a_loss_and_the_whole_device() -> None:
    code, out, err = _in_process("bench", MLP, "--input", MLP_INPUT, "--budgets", "100,50",
                                 "--loss", "mse", "--total-mb", "2.07", "--json", "--steps", "1")
    assert code == 0, err
    data = json.loads(out)
    assert (data["loss"], data["total_mb"], data["optimizer"]) == ("mse", 2.07, None)
    rows = {row["label"]: row for row in data["rows"]}
    assert list(rows) == ["100%", "50%", "total", "least"]
    total = rows["total"]
    expected = autockpt.plan(cli_models.mlp(), (torch.randn(8, 128),), loss_fn="mse",
                             total_mb=2.07)
    assert total["feasible"] and total["total_bytes"] == int(2.07 * 2**20)
    assert total["budget_bytes"] == expected.budget_bytes
    assert total["estimated_peak_bytes"] == expected.estimated_peak_bytes
    assert total["measured_peak_bytes"] <= 1.05 * total["budget_bytes"]
    # The percentages are of the peak planned with that loss.
    with_mse = autockpt.plan(cli_models.mlp(), (torch.randn(8, 128),), loss_fn="mse")
    assert data["baseline_estimated_peak_bytes"] == with_mse.baseline_peak_bytes

    # Too small a device: the row says so, the others are still measured.
    code, out, err = _in_process("bench", MLP, "--input", MLP_INPUT, "--budgets", "100",
                                 "--total-mb", "2", "--steps", "1")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("total"))
    assert "2.00 MiB" in row and "infeasible" in row
    # The least that holds the whole step (plan's fix rounds it up: --total-mb 2.06).
    assert "the whole device needs >= 2.05 MiB" in row
    assert "each step: one forward + backward of the default loss" in out


# --------------------------------------------------------------------------- errors


ERRORS = {
    "module missing": (["plan", "no_such_package.models:make", "--input", "2x3"],
                       ["cannot import 'no_such_package.models'",
                        "no module named 'no_such_package'"]),
    "factory missing": (["plan", "tests.cli_models:nope", "--input", "2x3"],
                        ["has no 'nope'", "found: ", "mlp"]),
    "not a module": (["plan", "tests.cli_models:not_a_module", "--input", "2x3"],
                     ["returned a int, not a torch.nn.Module"]),
    "factory needs arguments": (["plan", "tests.cli_models:needs_arguments", "--input", "2x3"],
                                ["TypeError", "takes no arguments"]),
    "factory raises": (["plan", "tests.cli_models:raises", "--input", "2x3"],
                       ["RuntimeError: the weights file is missing"]),
    "file missing": (["plan", "nowhere/models.py:make", "--input", "2x3"],
                     ["no such file: nowhere/models.py"]),
    "bad MODEL": (["plan", "tests.cli_models", "--input", "2x3"],
                  ["expected module:factory or file.py:factory"]),
    "bad shape": (["plan", MLP, "--input", "8by128"], ["'8by128'", "joined by 'x'"]),
    "bad dtype": (["plan", MLP, "--input", "8x128:float33"], ["unknown dtype 'float33'"]),
    "forward fails": (["plan", MLP, "--input", "8x100"],
                      ["Sequential.forward failed on inputs float32[8, 100]",
                       "mat1 and mat2 shapes cannot be multiplied", "--input"]),
    "infeasible budget": (["plan", MLP, "--input", MLP_INPUT, "--budget", "1%"],
                          ["cannot be met", "needs at least", "--budget-mb",
                           "or no budget"]),
    "budget without %": (["plan", MLP, "--input", MLP_INPUT, "--budget", "50"],
                         ["percentage", "--budget-mb"]),
    "usage": (["plan", MLP], ["required: --input", "autockpt plan --help"]),
    "total with budget-mb": (["plan", MLP, "--input", MLP_INPUT, "--total-mb", "100",
                              "--budget-mb", "1"], ["--total-mb", "--budget-mb", "not both"]),
    "total with budget": (["plan", MLP, "--input", MLP_INPUT, "--budget", "50%", "--total-mb",
                           "100"], ["--total-mb", "--budget ", "not both"]),
    "optimizer without total": (["plan", MLP, "--input", MLP_INPUT, "--optimizer", "adamw"],
                                ["--optimizer only matters with --total-mb",
                                 "add --total-mb"]),
    "bench optimizer without total": (["bench", MLP, "--input", MLP_INPUT, "--optimizer",
                                       "sgd"], ["--optimizer", "--total-mb"]),
    "total not positive": (["plan", MLP, "--input", MLP_INPUT, "--total-mb", "0"],
                           ["--total-mb must be a positive number"]),
    "total too small": (["plan", MLP, "--input", MLP_INPUT, "--total-mb", "2"],
                        ["leaves nothing of --total-mb (2.00 MiB)",
                         "pass --total-mb 2.06 or more"]),
    "unknown loss": (["diagnose", MLP, "--input", MLP_INPUT, "--loss", "hinge"],
                     ["invalid choice: 'hinge'", "autockpt diagnose --help"]),
}


# Each kind of mistake once through a real subprocess; the rest in process (same code path,
# without two seconds of interpreter start-up each).
SUBPROCESS_ERRORS = ("module missing", "factory raises", "forward fails", "infeasible budget")


@pytest.mark.parametrize("case", SUBPROCESS_ERRORS)
def test_helpful_errors_are_one_line_without_traceback(case: str) -> None:
    argv, needles = ERRORS[case]
    assert_one_line_error(run_cli(*argv), *needles)


@pytest.mark.parametrize("case", [c for c in ERRORS if c not in SUBPROCESS_ERRORS])
def test_helpful_errors_in_process(case: str) -> None:
    argv, needles = ERRORS[case]
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(argv, out=out, err=err)
    assert_one_line_error(subprocess.CompletedProcess(argv, code, out.getvalue(),
                                                      err.getvalue()), *needles)


def test_import_error_in_a_model_file(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\ndef broken(:\n")
    assert_one_line_error(run_cli("plan", "broken.py:make", "--input", "2x3", cwd=tmp_path),
                          "importing broken.py raised SyntaxError")


def test_debug_shows_the_traceback() -> None:
    result = run_cli("plan", MLP, "--input", "8x100", "--debug")
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "mat1 and mat2 shapes cannot be multiplied" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("autockpt: error: ")


# --------------------------------------------------------------------------- in process


def test_without_a_command_prints_help_and_exits_2() -> None:
    err = io.StringIO()
    assert cli.main([], out=io.StringIO(), err=err) == 2
    assert "plan" in err.getvalue() and "bench" in err.getvalue()


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["plan", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
    assert "--budget-mb" in capsys.readouterr().out


def test_rich_output_on_a_terminal() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["plan", MLP, "--input", MLP_INPUT, "--steps", "1", "--budget", "80%"],
                    out=out, err=err, fancy=True)
    assert code == 0, err.getvalue()
    text = out.getvalue()
    assert "autockpt plan for Sequential" in text
    assert "━" in text  # rich's table rule, not the plain one
    assert "budget" in text and "met" in text


def test_parsers() -> None:
    specs = cli.parse_inputs(["16x1000;16x10:int64", " 3 "])
    assert [(s.shape, s.dtype) for s in specs] == [((16, 1000), None), ((16, 10), torch.int64),
                                                  ((3,), None)]
    assert cli.parse_budget_percent("12.5%") == 0.125
    for bad in ("0x3", "3x", "-1", ""):
        with pytest.raises(autockpt.InvalidArgumentError):
            cli.parse_inputs([bad])
    with pytest.raises(autockpt.InvalidArgumentError):
        cli.parse_budget_percent("0%")


# --------------------------------------------------------------------------- diagnose, lint


def test_diagnose_exits_1_on_an_error_finding_and_0_on_a_clean_model() -> None:
    bad = run_cli("diagnose", "tests.cli_models:ReentrantOnInput", "--input", "8x32")
    assert bad.returncode == 1, bad.stderr
    assert "AC001" in bad.stdout and "AC003" in bad.stdout and "use_reentrant=False" in bad.stdout
    clean = run_cli("diagnose", "tests.cli_models:mlp", "--input", "8x128", "--json")
    assert clean.returncode == 0, clean.stderr
    data = json.loads(clean.stdout)
    assert data["errors"] == 0 and all(f["severity"] != "error" for f in data["findings"])
    assert data["loss"] == "default"


OWN_LOSS_MODEL = """
import torch
from torch import nn


class OwnLoss(nn.Module):
    # Its own loss beside the logits; scale is read only by the loss, probe only by the logits.
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(()))
        self.probe = nn.Linear(8, 4)

    def forward(self, x):
        h = self.trunk(x)
        logits = self.head(h)
        return {"loss": self.scale * logits.square().mean(), "logits": logits + self.probe(h)}
"""


def test_diagnose_runs_the_step_with_the_loss_asked_for(tmp_path: Path) -> None:
    (tmp_path / "own_loss.py").write_text(OWN_LOSS_MODEL)
    model = str(tmp_path / "own_loss.py") + ":OwnLoss"

    def no_gradient(*flags: str) -> str:
        code, out, err = _in_process("diagnose", model, "--input", "4x8", "--json", *flags)
        assert code == 1, err  # one parameter is left out either way: an error finding
        data = json.loads(out)
        [finding] = [f for f in data["findings"] if f["code"] == "AC003"]
        return f"{data['loss']}: {finding['message']}"

    # By default the model's own loss, as model(x)["loss"].backward(): probe gets nothing.
    default = no_gradient()
    assert default.startswith("default: ") and "probe.weight" in default
    assert "scale" not in default
    # --loss mse trains the logits against zeros instead: now scale gets nothing.
    mse = no_gradient("--loss", "mse")
    assert mse.startswith("mse: ") and "scale" in mse and "probe" not in mse


def test_lint_exit_status_and_json(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "model = torch.nn.Linear(4, 4)\n"
        "loader = [(torch.randn(2, 4), torch.randn(2, 4))]\n"
        "for x, y in loader:\n"
        "    out = checkpoint(model, x, use_reentrant=True)\n"
        "    out.sum().backward()\n"
    )
    result = run_cli("lint", str(script), "--json")
    assert result.returncode == 1, result.stderr
    codes = [f["code"] for f in json.loads(result.stdout)["findings"]]
    assert "AC001" in codes
    script.write_text(script.read_text().replace("use_reentrant=True", "use_reentrant=False"))
    fixed = run_cli("lint", str(script))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "0 errors" in fixed.stdout


def test_lint_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("lint", str(tmp_path / "nope.py")), "no such file")
