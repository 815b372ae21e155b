"""autockpt.diagnose: every runtime finding on a model that triggers it and on its fixed twin,
the ground truth behind the findings, the promise to leave the user's model alone, and no false
positives on the zoo after autockpt.apply.

Each model calls checkpoint the way users do, through the name imported below; findings must
point at the line of that call in this file.
"""

from __future__ import annotations

import copy
import dataclasses
import linecache
import re
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import autockpt
from autockpt import runner
from autockpt.tools.findings import CODES, Finding, Report
from tests.helpers import assert_same_tensors, buffers_of, grads_of, params_of
from tests.zoo import CASES, ZooCase, get_case

# Kept in a tuple: diagnose swaps module globals that hold the real function, not tuples.
ORIGINALS = (checkpoint, checkpoint_sequential)


def _x(rows: int = 4, cols: int = 8) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))


def _only(report: Report, code: str) -> list[Finding]:
    return [f for f in report if f.code == code]


def _points_at_checkpoint_call(finding: Finding) -> bool:
    """Whether ``where`` ends in ``(file:line)`` of a line of this file calling checkpoint."""
    location = finding.where.rsplit("(", 1)[-1].rstrip(")")
    filename, _, line = location.rpartition(":")
    if not filename.endswith("test_diagnose.py"):
        return False
    return "checkpoint" in linecache.getline(__file__, int(line))


# --------------------------------------------------------------------------- models


class RawInputNet(nn.Module):
    """``body`` checkpointed right on the raw input."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.body, x, use_reentrant=self.reentrant))


class PlainNet(nn.Module):
    """No checkpoint at all, with optional unused or detached parts."""

    def __init__(self, unused: bool = False, detach: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.detach = detach
        if unused:
            self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h.detach() if self.detach else h)


class BatchNormNet(nn.Module):
    """A BatchNorm inside (or, fixed, outside) the checkpointed function."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.inside = inside
        self.pre = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def run_block(self, h: torch.Tensor) -> torch.Tensor:
        return self.bn(self.block(h)) if self.inside else self.block(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.run_block, self.pre(x), use_reentrant=False)
        return self.head(h if self.inside else self.bn(h))


class DropoutNet(nn.Module):
    def __init__(self, preserve: bool) -> None:
        super().__init__()
        self.preserve = preserve
        self.pre = nn.Linear(8, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.body, self.pre(x), use_reentrant=False,
                       preserve_rng_state=self.preserve)
        return self.head(h)


class LoopNet(nn.Module):
    """Four blocks checkpointed in a loop, the flag given or not."""

    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.explicit = explicit
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
            for _ in range(4)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if self.explicit:
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = checkpoint(block, h)
        return self.head(h)


class NoGradNet(nn.Module):
    """Checkpoint under torch.no_grad() inside forward (a frozen feature extractor)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = checkpoint(self.frozen, x, use_reentrant=False)
        return self.head(h)


class InplaceNet(nn.Module):
    """The checkpointed function scales its (raw) input: in place (autograd notices), in place
    through ``.data`` (nothing notices), or out of place (the fix)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def scaled_body(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "inplace":
            h.mul_(2.0)
        elif self.how == "data":
            h.data.mul_(2.0)
        else:
            h = h * 2.0
        return self.body(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.scaled_body, x.clone(), use_reentrant=False))


class PairNet(nn.Module):
    """Two branches merged inside a reentrant checkpoint: in a tuple, or positionally."""

    def __init__(self, in_tuple: bool) -> None:
        super().__init__()
        self.in_tuple = in_tuple
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.mix = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def merge_pair(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.mix(pair[0] + pair[1])

    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.mix(a + b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        if self.in_tuple:
            h = checkpoint(self.merge_pair, (a, b), use_reentrant=True)
        else:
            h = checkpoint(self.merge, a, b, use_reentrant=True)
        return self.head(h)


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def scaled(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.body(h) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.head(checkpoint(self.scaled, h, scale=h.mean(), use_reentrant=True))


class SingleLayerNet(nn.Module):
    """One Linear checkpointed on its own: nothing it saves is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.layer, self.stem(x), use_reentrant=False))


class LastBlockNet(nn.Module):
    """The checkpointed block is the last thing before the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.stem(x), use_reentrant=False)


class TailNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=True)


class UntraceableNet(nn.Module):
    """Python control flow on a tensor value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum() > 0:
            x = self.stem(x)
        return checkpoint(self.block, x, use_reentrant=False)


class NestedNet(nn.Module):
    """A checkpoint inside a checkpointed function, in every combination of variants."""

    def __init__(self, outer: bool, inner: bool) -> None:
        super().__init__()
        self.outer, self.inner = outer, inner
        self.stem = nn.Linear(8, 8)
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def two_stages(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.b, self.a(h), use_reentrant=self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.two_stages, self.stem(x), use_reentrant=self.outer))


class SequentialNet(nn.Module):
    def __init__(self, flag: bool | None) -> None:
        super().__init__()
        self.flag = flag
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flag is None:
            return checkpoint_sequential(self.layers, 2, x)
        return checkpoint_sequential(self.layers, 2, x, use_reentrant=self.flag)


class WrappedNet(nn.Module):
    """Blocks wrapped with PyTorch's checkpoint_wrapper."""

    def __init__(self, impl: CheckpointImpl) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
                               checkpoint_impl=impl)
            for _ in range(2)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------- AC001, AC003


def test_ac001_reentrant_checkpoint_on_raw_input() -> None:
    report = autockpt.diagnose(RawInputNet(reentrant=True), (_x(),))
    [finding] = _only(report, "AC001")
    assert finding.severity == "error"
    assert finding.where.startswith("body (") and _points_at_checkpoint_call(finding)
    assert "body.0.weight" in finding.message
    assert "use_reentrant=False" in finding.fix and "autockpt.apply(" in finding.fix
    # Ground truth from the same backward: AC003 names the very parameters.
    [lost] = _only(report, "AC003")
    for name in ("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"):
        assert name in lost.message
    assert "head" not in lost.message


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_ac001_ground_truth_outside_diagnose() -> None:
    """What AC001/AC003 claim really happens in plain training."""
    model = RawInputNet(reentrant=True)
    model(_x()).sum().backward()
    assert model.body[0].weight.grad is None
    assert model.head.weight.grad is not None


def test_ac001_fixed_twin_is_clean() -> None:
    report = autockpt.diagnose(RawInputNet(reentrant=False), (_x(),))
    assert not report.errors and not report.warnings, str(report)
    assert report.checkpoint_calls == 1


def test_ac001_when_the_whole_output_loses_grad() -> None:
    # The checkpoint is the model's last op: its output does not require grad at all, so
    # backward cannot even run.
    report = autockpt.diagnose(TailNet(), (_x(),))
    assert {"AC001", "AC003"} <= set(report.codes())
    [lost] = _only(report, "AC003")
    assert "block.0.weight" in lost.message


def test_ac003_parameters_never_used() -> None:
    report = autockpt.diagnose(PlainNet(unused=True), (_x(),))
    [finding] = _only(report, "AC003")
    assert finding.severity == "error" and finding.where == "spare"
    assert "spare.weight" in finding.message and "never used" in finding.message
    assert "requires_grad_(False)" in finding.fix


def test_ac003_parameters_cut_off_by_detach() -> None:
    report = autockpt.diagnose(PlainNet(detach=True), (_x(),))
    [finding] = _only(report, "AC003")
    assert "stem.weight" in finding.message and "detach" in finding.message


def test_ac003_fixed_twins() -> None:
    frozen = PlainNet(unused=True)
    frozen.spare.requires_grad_(False)
    assert autockpt.diagnose(frozen, (_x(),)).codes() == ()
    assert autockpt.diagnose(PlainNet(), (_x(),)).codes() == ()


# --------------------------------------------------------------------------- AC002


def test_ac002_input_given_requires_grad_for_checkpoint() -> None:
    x = _x().requires_grad_()
    report = autockpt.diagnose(RawInputNet(reentrant=True), (x,))
    [finding] = _only(report, "AC002")
    assert finding.severity == "warning" and _points_at_checkpoint_call(finding)
    assert "x is a leaf tensor" in finding.message
    assert "use_reentrant=False" in finding.fix
    assert "AC001" not in report.codes()  # the workaround works; it only wastes
    assert x.grad is None  # the user's input got no gradient from diagnose


def test_ac002_fixed_twin() -> None:
    report = autockpt.diagnose(RawInputNet(reentrant=False), (_x(),))
    assert "AC002" not in report.codes()


# --------------------------------------------------------------------------- AC004


def test_ac004_batchnorm_updated_twice() -> None:
    report = autockpt.diagnose(BatchNormNet(inside=True), (_x(),))
    [finding] = _only(report, "AC004")
    assert finding.severity == "warning"
    assert finding.where.startswith("bn (") and _points_at_checkpoint_call(finding)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert name in finding.message
    assert "autockpt.apply(" in finding.fix


def test_ac004_ground_truth_outside_diagnose() -> None:
    model = BatchNormNet(inside=True)
    model(_x()).sum().backward()
    assert int(model.bn.num_batches_tracked) == 2  # once in forward, once in the recompute


def test_ac004_fixed_twin() -> None:
    report = autockpt.diagnose(BatchNormNet(inside=False), (_x(),))
    assert report.checkpoint_calls == 1 and "AC004" not in report.codes()


# --------------------------------------------------------------------------- AC005


def test_ac005_dropout_without_rng_state() -> None:
    report = autockpt.diagnose(DropoutNet(preserve=False), (_x(),))
    [finding] = _only(report, "AC005")
    assert finding.severity == "error" and _points_at_checkpoint_call(finding)
    assert finding.where.startswith("body (")


def test_ac005_fixed_twin() -> None:
    report = autockpt.diagnose(DropoutNet(preserve=True), (_x(),))
    assert not report.errors and not report.warnings, str(report)


# --------------------------------------------------------------------------- AC006


def test_ac006_flag_not_explicit_once_per_call_site() -> None:
    report = autockpt.diagnose(LoopNet(explicit=False), (_x(),))
    [finding] = _only(report, "AC006")
    assert finding.severity == "warning" and "(4 calls)" in finding.message
    filename, _, line = finding.where.rpartition(":")
    assert filename.endswith("test_diagnose.py")
    assert "checkpoint(block, h)" in linecache.getline(__file__, int(line))
    assert finding.fix == "checkpoint(block, h, use_reentrant=False)"


def test_ac006_fixed_twin() -> None:
    report = autockpt.diagnose(LoopNet(explicit=True), (_x(),))
    assert report.checkpoint_calls == 4 and report.codes() == ()


def test_ac006_checkpoint_sequential() -> None:
    report = autockpt.diagnose(SequentialNet(flag=None), (_x(),))
    assert {"AC001", "AC003", "AC006"} <= set(report.codes())
    [first] = _only(report, "AC001")
    assert first.where.startswith("layers.0 .. layers.1 (")
    assert "checkpoint_sequential(" in first.fix
    assert autockpt.diagnose(SequentialNet(flag=False), (_x(),)).codes() == ()


# --------------------------------------------------------------------------- AC007


def test_ac007_eval_mode() -> None:
    model = RawInputNet(reentrant=False).eval()
    [finding] = _only(autockpt.diagnose(model, (_x(),)), "AC007")
    assert finding.severity == "info" and "eval mode" in finding.message
    assert "self.training" in finding.fix


def test_ac007_under_no_grad() -> None:
    [finding] = _only(autockpt.diagnose(NoGradNet(), (_x(),)), "AC007")
    assert "no_grad" in finding.message


def test_ac007_fixed_twin() -> None:
    assert "AC007" not in autockpt.diagnose(RawInputNet(reentrant=False), (_x(),)).codes()


# --------------------------------------------------------------------------- AC008


def test_ac008_inplace_on_checkpoint_input() -> None:
    report = autockpt.diagnose(InplaceNet("inplace"), (_x(),))
    [finding] = _only(report, "AC008")
    assert finding.severity == "error" and _points_at_checkpoint_call(finding)
    assert "mul_" in finding.message
    # Here autograd's version check makes backward fail; the failure is reported too.
    [failure] = _only(report, "AC000")
    assert "modified by an inplace operation" in failure.message


def test_ac008_silent_through_data() -> None:
    report = autockpt.diagnose(InplaceNet("data"), (_x(),))
    assert report.codes() == ("AC008",)
    # Ground truth: nothing fails, and the gradients are those of a different function.
    broken, fixed = InplaceNet("data"), InplaceNet("out_of_place")
    fixed.load_state_dict(broken.state_dict())
    for model in (broken, fixed):
        model(_x()).sum().backward()
    assert not torch.allclose(broken.body[0].weight.grad, fixed.body[0].weight.grad)


def test_ac008_fixed_twin() -> None:
    report = autockpt.diagnose(InplaceNet("out_of_place"), (_x(),))
    assert "AC008" not in report.codes() and not report.errors


# --------------------------------------------------------------------------- AC009


def test_ac009_tensors_in_a_container() -> None:
    report = autockpt.diagnose(PairNet(in_tuple=True), (_x(),))
    [finding] = _only(report, "AC009")
    assert finding.severity == "error" and "argument 1" in finding.message
    lost = " ".join(f.message for f in _only(report, "AC003"))
    assert "a.weight" in lost and "mix.0.weight" in lost


def test_ac009_keyword_tensors() -> None:
    report = autockpt.diagnose(KeywordNet(), (_x(),))
    [finding] = _only(report, "AC009")
    assert "scale" in finding.message
    [failure] = _only(report, "AC000")  # torch's ValueError is reported, not raised
    assert "ValueError" in failure.message and _points_at_checkpoint_call(failure)


def test_ac009_fixed_twin() -> None:
    report = autockpt.diagnose(PairNet(in_tuple=False), (_x(),))
    assert not report.errors, str(report)


# --------------------------------------------------------------------------- AC010


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize(("unused", "reentrant", "expected"),
                         [(True, True, True), (False, True, False), (True, False, False)])
def test_ac010_ddp_find_unused_with_reentrant(process_group: None, unused: bool,
                                              reentrant: bool, expected: bool) -> None:
    inner = LoopNet(explicit=True)
    if reentrant:
        inner = nn.Sequential(nn.Linear(8, 8), RawInputNet(reentrant=True))
    model = nn.parallel.DistributedDataParallel(inner, find_unused_parameters=unused)
    report = autockpt.diagnose(model, (_x(),))
    assert report.subject.startswith("DistributedDataParallel(")
    assert ("AC010" in report.codes()) == expected
    if expected:
        [finding] = _only(report, "AC010")
        assert finding.severity == "error" and "static_graph=True" in finding.fix


# --------------------------------------------------------------------------- AC011


def test_ac011_single_layer_saves_nothing() -> None:
    [finding] = _only(autockpt.diagnose(SingleLayerNet(), (_x(),)), "AC011")
    assert finding.severity == "warning" and _points_at_checkpoint_call(finding)
    assert finding.where.startswith("layer (") and "frees 0 B" in finding.message


def test_ac011_last_segment() -> None:
    [finding] = _only(autockpt.diagnose(LastBlockNet(), (_x(),)), "AC011")
    assert finding.severity == "info" and "last" in finding.message


def test_ac011_last_region_without_a_graph() -> None:
    # No graph to measure with; the output of the last checkpoint is the model's output.
    [finding] = _only(autockpt.diagnose(UntraceableNet(), (_x(),)), "AC011")
    assert finding.severity == "info" and finding.where.startswith("block (")


def test_ac011_fixed_twin() -> None:
    # Blocks of two layers each free their inner activation, and a head follows.
    assert "AC011" not in autockpt.diagnose(LoopNet(explicit=True), (_x(),)).codes()


# --------------------------------------------------------------------------- wrappers


def test_checkpoint_wrapper_is_observed() -> None:
    report = autockpt.diagnose(WrappedNet(CheckpointImpl.REENTRANT), (_x(),))
    assert report.checkpoint_calls == 2
    [first, second] = _only(report, "AC001")
    assert first.where.startswith("blocks.0 (") and second.where.startswith("blocks.1 (")
    assert "CheckpointImpl.NO_REENTRANT" in first.fix
    clean = autockpt.diagnose(WrappedNet(CheckpointImpl.NO_REENTRANT), (_x(),))
    assert clean.checkpoint_calls == 2 and clean.codes() == ()


@pytest.mark.parametrize("outer", [False, True])
@pytest.mark.parametrize("inner", [False, True])
def test_nested_checkpoints_are_not_misread(outer: bool, inner: bool) -> None:
    # Inside a reentrant forward grad mode is off: the inner call must not look like AC001
    # or AC007, and its repeat during the recompute must not be counted again.
    report = autockpt.diagnose(NestedNet(outer, inner), (_x(),))
    assert report.checkpoint_calls == 2 and not report.errors and not report.warnings, \
        str(report)


def test_data_parallel_is_looked_through() -> None:
    report = autockpt.diagnose(nn.DataParallel(RawInputNet(reentrant=True)), (_x(),))
    assert report.subject == "DataParallel(RawInputNet)"
    assert "AC001" in report.codes()


# --------------------------------------------------------------------------- the contract


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "params": params_of(model),
        "grads": grads_of(model),
        "buffers": buffers_of(model),
        "versions": {n: b._version for n, b in model.named_buffers()},
        "training": [m.training for m in model.modules()],
    }


def _assert_same_state(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for key in ("params", "grads", "buffers"):
        assert_same_tensors(after[key], before[key],  # type: ignore[arg-type]
                            what=f"{key} ", exact=True, allow_none=True)
    assert before["versions"] == after["versions"]
    assert before["training"] == after["training"]


def test_user_model_inputs_and_rng_untouched() -> None:
    model = BatchNormNet(inside=True)
    model.head.weight.grad = torch.full_like(model.head.weight, 7.0)  # a stale gradient
    before = _state(model)
    x = _x().requires_grad_()
    dropout = DropoutNet(preserve=False)  # building it draws from the RNG: before the snapshot
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    assert "AC005" in autockpt.diagnose(dropout, (x,)).codes()  # dropout drew random numbers
    report = autockpt.diagnose(model, (x,))
    assert "AC004" in report.codes()
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_same_state(before, _state(model))
    assert x.grad is None


def test_checkpoint_functions_restored() -> None:
    autockpt.diagnose(RawInputNet(reentrant=True), (_x(),))
    assert globals()["checkpoint"] is ORIGINALS[0]
    assert torch_checkpoint.checkpoint is ORIGINALS[0]
    assert runner.checkpoint is ORIGINALS[0]
    assert sys.modules["torch.utils.checkpoint"].checkpoint_sequential is ORIGINALS[1]


def test_checkpoint_functions_restored_after_an_error() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="forward failed"):
        autockpt.diagnose(RawInputNet(reentrant=True), (torch.randn(4, 3),))
    assert globals()["checkpoint"] is ORIGINALS[0]
    assert torch_checkpoint.checkpoint is ORIGINALS[0]


def test_other_threads_are_not_observed() -> None:
    """A thread that is not diagnosing runs the real checkpoint, even mid-diagnosis."""
    seen: list[bool] = []
    started, release = threading.Event(), threading.Event()

    class Blocking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            release.wait(timeout=30)
            return checkpoint(self.layer, x, use_reentrant=False)

    def other() -> None:
        started.wait(timeout=30)
        seen.append(globals()["checkpoint"] is not ORIGINALS[0])  # swapped right now
        model = RawInputNet(reentrant=True)
        model(_x()).sum().backward()  # the real checkpoint: no record, same behaviour
        seen.append(model.body[0].weight.grad is None)
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    report = autockpt.diagnose(Blocking(), (_x(),))
    thread.join()
    assert seen == [True, True]
    assert report.checkpoint_calls == 1  # the other thread's call was not recorded


def test_deterministic_and_sorted() -> None:
    first = autockpt.diagnose(PairNet(in_tuple=True), (_x(),))
    second = autockpt.diagnose(PairNet(in_tuple=True), (_x(),))
    assert first == second and str(first) == str(second)
    ranks = [("error", "warning", "info").index(f.severity) for f in first]
    assert ranks == sorted(ranks)


def test_bad_arguments() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="torch.nn.Module"):
        autockpt.diagnose("model", (_x(),))  # type: ignore[arg-type]
    with pytest.raises(autockpt.InvalidArgumentError, match="loss_fn must be callable"):
        autockpt.diagnose(PlainNet(), (_x(),), loss_fn=3)  # type: ignore[arg-type]
    with pytest.raises(autockpt.InvalidArgumentError, match="example_inputs"):
        autockpt.diagnose(PlainNet(), 3)
    with pytest.raises(autockpt.InvalidArgumentError, match="scalar"):
        autockpt.diagnose(PlainNet(), (_x(),), loss_fn=lambda out: out)


def test_custom_loss_fn_decides_ground_truth() -> None:
    # A loss that ignores the output: nothing gets a gradient, and AC003 says so.
    report = autockpt.diagnose(PlainNet(), (_x(),), loss_fn=lambda out: torch.zeros(()))
    [finding] = _only(report, "AC003")
    assert "does not require grad" in finding.message


class OwnLossNet(nn.Module):
    """Returns its own loss beside the logits, as a Hugging Face model given ``labels=``:
    ``scale`` is read only by the loss, ``probe`` only by the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(()))
        self.probe = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        logits = self.head(h)
        return {"loss": self.scale * logits.square().mean(), "logits": logits + self.probe(h)}


def _without_grad(model: nn.Module, loss_fn: object) -> set[str]:
    """The ground truth: trainable parameters left without a gradient by a real step."""
    twin = copy.deepcopy(model)
    loss = loss_fn(twin(_x()))  # type: ignore[operator]
    loss.backward()
    return {name for name, p in twin.named_parameters() if p.grad is None}


def _named_in_ac003(report: Report, model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()
            for f in _only(report, "AC003") if re.search(rf"\b{re.escape(name)}\b", f.message)}


def test_default_loss_is_the_models_own_loss() -> None:
    # The same default as measure and plan (autockpt.profiling.loss.default_loss): the step trains on
    # output["loss"], as model(x)["loss"].backward() does, not on every output.
    model = OwnLossNet()
    output = model(_x())
    assert autockpt.profiling.loss.default_loss(output) is output["loss"]
    truth = _without_grad(model, lambda out: out["loss"])
    assert truth == {"probe.weight", "probe.bias"}  # "scale" does get a gradient
    report = autockpt.diagnose(model, (_x(),))
    # Every parameter AC003 names really gets no gradient in training, and only those: none
    # for "scale" (read only by the loss) nor for the trunk and head the loss reaches.
    assert _named_in_ac003(report, model) == truth
    [finding] = _only(report, "AC003")
    assert "No path from the loss reaches them" in finding.message


def test_loss_fn_given_replaces_the_models_own_loss() -> None:
    model = OwnLossNet()
    # Training on the logits instead: now "scale" is the one left without a gradient.
    truth = _without_grad(model, lambda out: out["logits"].sum())
    assert truth == {"scale"}
    report = autockpt.diagnose(model, (_x(),), loss_fn=lambda out: out["logits"].sum())
    assert _named_in_ac003(report, model) == truth


@pytest.mark.parametrize("name", ["cross_entropy", "mse", "sum"])
def test_named_losses(name: str) -> None:
    model = OwnLossNet()
    # Whatever the named loss reaches, diagnose reports what a real step with it leaves out;
    # cross_entropy and mse read the logits of a mapping output, so "scale" is left out.
    truth = _without_grad(model, autockpt.profiling.loss.named_loss(name))
    if name != "sum":
        assert truth == {"scale"}
    report = autockpt.diagnose(model, (_x(),), loss_fn=name)
    assert _named_in_ac003(report, model) == truth
    assert not autockpt.diagnose(PlainNet(), (_x(),), loss_fn=name).has_errors


def test_memory_checks_profile_the_users_loss() -> None:
    # With the default loss nothing after the block saves activations: AC011 says it is the
    # last region. A cross-entropy saves its log-softmax after it, and the profile that the
    # memory checks read now holds that loss.
    [last] = _only(autockpt.diagnose(LastBlockNet(), (_x(),)), "AC011")
    assert last.severity == "info" and "last checkpointed region" in last.message
    report = autockpt.diagnose(LastBlockNet(), (_x(),), loss_fn="cross_entropy")
    assert "AC011" not in report.codes() and not report.has_errors


def test_bad_loss_arguments() -> None:
    for bad in (3, ["mse"], b"mse"):
        with pytest.raises(autockpt.InvalidArgumentError, match="loss_fn must be callable"):
            autockpt.diagnose(PlainNet(), (_x(),), loss_fn=bad)  # type: ignore[arg-type]
    with pytest.raises(autockpt.InvalidArgumentError, match="unknown loss 'hinge'") as info:
        autockpt.diagnose(PlainNet(), (_x(),), loss_fn="hinge")
    assert "cross_entropy" in (info.value.fix or "")
    # A named loss that cannot read the output is the user's mistake, said as such.
    with pytest.raises(autockpt.InvalidArgumentError, match="class dimension"):
        autockpt.diagnose(VectorNet(), (_x(),), loss_fn="cross_entropy")


class VectorNet(nn.Module):
    """One number per example: no class dimension for a cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).flatten()


# --------------------------------------------------------------------------- Report


def test_report_api() -> None:
    info = Finding("AC011", "info", "b.py:2", "m", "f")
    warning = Finding("AC006", "warning", "a.py:10", "m", "f")
    error_late = Finding("AC001", "error", "a.py:10", "m", "f")
    error_early = Finding("AC009", "error", "a.py:9", "m", "f")
    report = Report((info, warning, error_late, error_early, info), subject="x")
    assert list(report) == [error_early, error_late, warning, info]  # line 9 before 10
    assert len(report) == 4 and report.has_errors
    assert report.errors == (error_early, error_late) and report.warnings == (warning,)
    assert report.codes() == ("AC001", "AC006", "AC009", "AC011")
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.findings = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.code = "AC002"  # type: ignore[misc]
    text = str(report)
    assert text.splitlines()[0] == "autockpt report for x: 2 errors, 1 warning, 1 info"
    assert text.index("AC009") < text.index("AC001") < text.index("AC006")
    assert "no findings" in str(Report())


def test_finding_validates() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="code"):
        Finding("AC999", "error", "x", "m", "f")
    with pytest.raises(autockpt.InvalidArgumentError, match="severity"):
        Finding("AC001", "fatal", "x", "m", "f")
    with pytest.raises(autockpt.InvalidArgumentError):
        Report(("AC001",))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the zoo


ZOO_RUNS = [(case, mode) for case in CASES for mode in ("non_reentrant", "reentrant")
            if not (case.name == "mlp72" and mode == "reentrant")]


@pytest.mark.parametrize(("case", "mode"), ZOO_RUNS,
                         ids=[f"{c.name}-{m}" for c, m in ZOO_RUNS])
def test_zoo_after_apply_has_no_errors_or_warnings(case: ZooCase, mode: str) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    transformed = autockpt.apply(model, None, example_inputs=args, example_kwargs=kwargs,
                                 mode=mode)
    report = autockpt.diagnose(transformed, args, example_kwargs=kwargs, loss_fn=case.loss_fn)
    assert not report.errors and not report.warnings, str(report)
    # Every segment of the plan ran under the observed checkpoint.
    assert report.checkpoint_calls == len(autockpt.plan_of(transformed).segments)


def test_zoo_observer_sees_autockpt_buffer_and_rng_bugs() -> None:
    """The zoo check can fail: a plan that skips the buffer guard or the RNG replay is caught."""
    case = get_case("resnet")
    model = case.build()
    args, _ = case.inputs()
    plan = autockpt.plan(model, args, mode="reentrant")
    assert any(s.buffers for s in plan.segments)
    unguarded = replace(plan, segments=tuple(replace(s, buffers=()) for s in plan.segments))
    report = autockpt.diagnose(autockpt.apply(model, plan=unguarded), args)
    assert "AC004" in report.codes() and all(f.where.startswith("stage") or f.where.startswith(
        "stem") for f in _only(report, "AC004"))

    case = get_case("transformer")
    model = case.build()
    args, _ = case.inputs()
    plan = autockpt.plan(model, args)
    replayed = sum(s.preserve_rng for s in plan.segments)
    assert replayed > 0
    no_rng = replace(plan, segments=tuple(replace(s, preserve_rng=False) for s in plan.segments))
    report = autockpt.diagnose(autockpt.apply(model, plan=no_rng), args)
    findings = _only(report, "AC005")
    assert len(findings) == replayed
    assert all(f.where.startswith("autockpt segment ") for f in findings)


def test_diagnose_copy_is_independent_of_apply_state() -> None:
    """Diagnosing a transformed module neither plans nor runs it: it keeps its plans."""
    case = get_case("kwargs_model")
    model = case.build()
    args, kwargs = case.inputs()
    transformed = autockpt.apply(model, None, example_inputs=args, example_kwargs=kwargs)
    plan = autockpt.plan_of(transformed)
    snapshot = copy.deepcopy(transformed.state_dict())
    autockpt.diagnose(transformed, args, example_kwargs=kwargs)
    assert autockpt.plan_of(transformed) is plan
    for key, value in transformed.state_dict().items():
        assert torch.equal(value, snapshot[key])


# --------------------------------------------------------------------------- the docs


DOC = Path(__file__).resolve().parent.parent / "docs" / "diagnostics.md"
_BLOCK = re.compile(r"<!-- (example|fix) (AC\d{3}) (diagnose|lint) -->\n```python\n(.*?)```", re.S)
DOC_BLOCKS = _BLOCK.findall(DOC.read_text())


def test_docs_cover_every_code() -> None:
    text = DOC.read_text()
    for code in CODES:
        assert f"| [{code}](#{code.lower()}) |" in text, f"{code} missing from the table"
        kinds = {kind for kind, c, _, _ in DOC_BLOCKS if c == code}
        assert kinds == {"example", "fix"}, f"{code}: needs an example and a fix, has {kinds}"


@pytest.mark.parametrize(("kind", "code", "tool", "source"), DOC_BLOCKS,
                         ids=[f"{c}-{k}-{t}" for k, c, t, _ in DOC_BLOCKS])
def test_docs_examples(kind: str, code: str, tool: str, source: str) -> None:
    """Each documented example produces its code; each documented fix does not."""
    if tool == "lint":
        report = autockpt.lint(source)
    else:
        namespace: dict[str, object] = {"__name__": f"docs_{code}_{kind}"}
        exec(compile(source, f"<docs {code} {kind}>", "exec"), namespace)  # noqa: S102
        model, inputs = namespace["model"], namespace["inputs"]
        report = autockpt.diagnose(model, inputs)  # type: ignore[arg-type]
    if kind == "example":
        assert code in report.codes(), str(report)
    else:
        assert code not in report.codes() and not report.errors and not report.warnings, \
            str(report)
