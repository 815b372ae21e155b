"""The memory picture: the numbers behind it (measured, as ``measure`` measures), the files
it writes (PNG and SVG), the ``--plot`` option of the command line, and the error when
matplotlib is missing."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import autockpt
from autockpt import cli
from autockpt.tools.plot import MemoryCurves, SegmentSpan
from tests import cli_models

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def curves() -> MemoryCurves:
    torch.manual_seed(0)
    model = cli_models.mlp()
    return autockpt.memory_curves(model, (torch.randn(8, 128),), budget_mb=0.06)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (checking the signature on the way)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# --------------------------------------------------------------------------- the numbers


def test_curves_are_the_measured_timelines(curves: MemoryCurves) -> None:
    torch.manual_seed(0)
    model = cli_models.mlp()
    x = torch.randn(8, 128)
    assert curves.baseline_peak_bytes == autockpt.measure(model, (x,)).peak_activation_bytes
    ckpt = autockpt.apply(model, plan=curves.plan)
    after = autockpt.measure(ckpt, (x,))
    assert curves.checkpointed_peak_bytes == after.peak_activation_bytes
    assert len(curves.checkpointed_bytes) == len(after.timeline)
    assert curves.checkpointed_peak_bytes <= 1.05 * curves.plan.budget_bytes
    assert curves.checkpointed_peak_bytes < curves.baseline_peak_bytes
    assert all(isinstance(b, int) and b >= 0 for b in curves.checkpointed_bytes)


def test_every_segment_is_located_in_forward_and_backward(curves: MemoryCurves) -> None:
    plan = curves.plan
    assert plan.segments, "the budget should need checkpointing"
    for number, segment in enumerate(plan.segments, start=1):
        spans = {s.phase: s for s in curves.spans if s.number == number}
        assert set(spans) == {"forward", "backward"}
        forward, backward = spans["forward"], spans["backward"]
        assert 0 <= forward.start_op < forward.end_op <= curves.checkpointed_backward_op
        assert curves.checkpointed_backward_op <= backward.start_op < backward.end_op
        assert backward.end_op <= len(curves.checkpointed_bytes)
        assert forward.modules == backward.modules
        assert forward.modules.startswith(segment.first_module)
    # Backward runs the segments in reverse order.
    order = [s.number for s in curves.spans if s.phase == "backward"]
    assert order == sorted(order, reverse=True)


def test_curves_are_deterministic(curves: MemoryCurves) -> None:
    torch.manual_seed(0)
    again = autockpt.memory_curves(cli_models.mlp(), (torch.randn(8, 128),), budget_mb=0.06)
    assert again == curves


def test_reentrant_curves_and_a_given_plan() -> None:
    model = cli_models.TinyLM()
    ids = torch.randint(0, 100, (4, 16))
    plan = autockpt.plan(model, (ids,), mode="reentrant")
    result = autockpt.memory_curves(model, (ids,), plan=plan)
    assert result.plan is plan
    assert {s.phase for s in result.spans} == {"forward", "backward"}
    assert result.checkpointed_peak_bytes == autockpt.measure(
        autockpt.apply(model, plan=plan), (ids,)).peak_activation_bytes


def test_a_plan_without_segments_draws_without_bands(tmp_path: Path) -> None:
    model = cli_models.mlp()
    x = torch.randn(8, 128)
    result = autockpt.memory_curves(model, (x,), budget_mb=100)
    assert result.plan.segments == () and result.spans == ()
    assert result.checkpointed_peak_bytes == result.baseline_peak_bytes
    figure = autockpt.draw_memory(result, tmp_path / "flat.png")
    assert "0 checkpointed segments" in figure.axes[0].get_title()


def test_bad_arguments() -> None:
    model = cli_models.mlp()
    x = torch.randn(8, 128)
    with pytest.raises(autockpt.InvalidArgumentError, match="original model"):
        autockpt.memory_curves(autockpt.apply(model, example_inputs=(x,)), (x,))
    with pytest.raises(autockpt.InvalidArgumentError, match="not both"):
        autockpt.memory_curves(model, (x,), budget_mb=1, plan=autockpt.plan(model, (x,)))
    with pytest.raises(autockpt.InvalidArgumentError, match="extension"):
        autockpt.plot_memory(model, (x,), path="memory.jpg")  # refused before running
    with pytest.raises(autockpt.InfeasibleBudgetError):
        autockpt.memory_curves(model, (x,), budget_mb=0.001)


# --------------------------------------------------------------------------- the files


def test_png(curves: MemoryCurves, tmp_path: Path) -> None:
    path = tmp_path / "memory.png"
    figure = autockpt.draw_memory(curves, path)
    width, height = png_size(path)
    assert width >= 600 and 300 <= height <= width
    assert path.stat().st_size >= 10_000
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert any(t.startswith("budget") for t in legend)
    assert any(t.startswith("estimated peak with the plan") for t in legend)
    assert any(t.startswith("with the plan, measured") for t in legend)
    labels = [t.get_text() for t in figure.axes[0].texts]
    first = curves.plan.segments[0]
    assert any(t.startswith(f"1: {first.first_module}") for t in labels)


def test_svg_is_valid_xml_and_repeatable(curves: MemoryCurves, tmp_path: Path) -> None:
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    autockpt.draw_memory(curves, first)
    autockpt.draw_memory(curves, second)
    root = ET.parse(first).getroot()
    assert root.tag.endswith("svg")
    assert first.read_bytes() == second.read_bytes()


def test_missing_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                   curves: MemoryCurves) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(autockpt.AutockptError, match=r"autockpt\[plot\]"):
        autockpt.draw_memory(curves)
    with pytest.raises(autockpt.AutockptError, match=r"autockpt\[plot\]"):
        autockpt.plot_memory(cli_models.mlp(), (torch.randn(8, 128),))
    err = io.StringIO()
    code = cli.main(["plan", "tests.cli_models:mlp", "--input", "8x128", "--plot", "m.png"],
                    out=io.StringIO(), err=err)
    assert code == 2
    assert err.getvalue().startswith("autockpt: error: drawing the memory picture needs "
                                     "matplotlib")
    assert "pip install 'autockpt[plot]'" in err.getvalue()


def test_span_fields_are_documented() -> None:
    assert SegmentSpan.__doc__ and MemoryCurves.__doc__


# --------------------------------------------------------------------------- the CLI


def test_cli_plot_writes_a_png(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    path = tmp_path / "memory.png"
    result = subprocess.run(
        [sys.executable, "-m", "autockpt", "plan", "tests.cli_models:mlp", "--input", "8x128",
         "--budget", "60%", "--steps", "1", "--plot", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"memory picture written to {path}" in result.stdout
    width, _ = png_size(path)
    assert width >= 600 and path.stat().st_size >= 10_000


def test_cli_plot_svg_with_json(tmp_path: Path) -> None:
    import json

    path = tmp_path / "memory.svg"
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["plan", "tests.cli_models:mlp", "--input", "8x128", "--json", "--steps",
                     "1", "--plot", str(path)], out=out, err=err)
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["plot"] == str(path)
    assert ET.parse(path).getroot().tag.endswith("svg")


def test_cli_refuses_an_unknown_picture_format_before_running() -> None:
    err = io.StringIO()
    code = cli.main(["plan", "tests.cli_models:mlp", "--input", "8x128", "--plot", "m.bmp"],
                    out=io.StringIO(), err=err)
    assert code == 2
    assert "cannot tell the picture format of 'm.bmp'" in err.getvalue()
