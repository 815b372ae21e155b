"""autockpt.lint: each static finding on a script that shows it and on its fixed twin, name
resolution through imports, bad input, and quiet on this repository's own code."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import autockpt
from autockpt.tools.findings import Finding, Report
from autockpt.tools.lint import LintSyntaxError, source_with_flag

ROOT = Path(__file__).resolve().parent.parent


def _lint(source: str) -> Report:
    return autockpt.lint(textwrap.dedent(source))


def _only(report: Report, code: str) -> list[Finding]:
    return [f for f in report if f.code == code]


def _line(finding: Finding) -> int:
    return int(finding.where.rpartition(":")[2])


# --------------------------------------------------------------------------- AC006

UNSPECIFIED = """
import torch
from torch.utils.checkpoint import checkpoint

def run(block, x):
    return checkpoint(block, x)
"""


def test_ac006_missing_flag() -> None:
    [finding] = _only(_lint(UNSPECIFIED), "AC006")
    assert finding.severity == "warning" and finding.where == "<source>:6"
    assert finding.fix == "checkpoint(block, x, use_reentrant=False)"


def test_ac006_fixed_twin() -> None:
    assert _lint(UNSPECIFIED.replace("(block, x)", "(block, x, use_reentrant=False)")).codes() == ()


@pytest.mark.parametrize("call", [
    "import torch\ntorch.utils.checkpoint.checkpoint(f, x)",
    "import torch.utils.checkpoint as cp\ncp.checkpoint(f, x)",
    "from torch.utils import checkpoint as ck\nck.checkpoint(f, x)",
    "from torch.utils.checkpoint import checkpoint as ckpt\nckpt(f, x)",
    "from torch.utils.checkpoint import checkpoint_sequential\n"
    "checkpoint_sequential(layers, 2, x)",
])
def test_ac006_through_any_import(call: str) -> None:
    assert _lint(call).codes() == ("AC006",)


def test_a_function_of_ones_own_named_checkpoint_is_not_torchs() -> None:
    source = "def checkpoint(fn, x):\n    return fn(x)\n\ncheckpoint(f, x)\n"
    assert _lint(source).codes() == ()


def test_flags_passed_through_kwargs_are_unknown_not_missing() -> None:
    source = "from torch.utils.checkpoint import checkpoint\ncheckpoint(f, x, **flags)\n"
    assert _lint(source).codes() == ()


# --------------------------------------------------------------------------- AC001

RAW_LOOP = """
import torch
from torch.utils.checkpoint import checkpoint

for x, y in train_loader:
    out = checkpoint(model, x.to("cuda"), use_reentrant=True)
"""

RAW_FORWARD = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def forward(self, x):
        return checkpoint(self.mlp, x, use_reentrant=True)  # x: the previous block's output


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return x


model = Net()
"""


def test_ac001_checkpoint_on_the_data_batch() -> None:
    [finding] = _only(_lint(RAW_LOOP), "AC001")
    assert finding.severity == "error" and finding.where == "<source>:6"
    assert "x.to('cuda')" in finding.message
    assert "checkpoint(model, x.to('cuda'), use_reentrant=False)" in finding.fix


def test_ac001_checkpoint_on_the_top_level_forward_input() -> None:
    report = _lint(RAW_FORWARD)
    [finding] = _only(report, "AC001")
    assert _line(finding) == 19  # Net's loop, whose first iteration gets the raw x
    assert report.codes() == ("AC001",)  # Block, fed by the previous block, is left alone


def test_ac001_fixed_twins() -> None:
    assert _lint(RAW_LOOP.replace("use_reentrant=True", "use_reentrant=False")).codes() == ()
    embedded = RAW_FORWARD.replace(
        "        for block in self.blocks:",
        "        x = self.embed(x)\n        for block in self.blocks:")
    assert _lint(embedded).codes() == ()


# --------------------------------------------------------------------------- AC002

GRAD_INPUT = """
import torch
from torch.utils.checkpoint import checkpoint

for x, y in loader:
    x.requires_grad_()
    out = checkpoint(model, x, use_reentrant=True)
"""


def test_ac002_input_given_requires_grad() -> None:
    report = _lint(GRAD_INPUT)
    [finding] = _only(report, "AC002")
    assert finding.severity == "warning" and finding.where == "<source>:6"
    assert "line 7" in finding.message
    assert "checkpoint(model, x, use_reentrant=False)" in finding.fix
    assert "AC001" not in report.codes()  # the workaround works, it only wastes


@pytest.mark.parametrize("marking", [
    "x = x.detach().requires_grad_()",
    "x.requires_grad = True",
    "x = torch.randn(4, 8, requires_grad=True)",
])
def test_ac002_other_spellings(marking: str) -> None:
    source = GRAD_INPUT.replace("x.requires_grad_()", marking)
    assert "AC002" in _lint(source).codes()


@pytest.mark.parametrize(("change", "replacement"), [
    ("    x.requires_grad_()\n", ""),  # dropped: the fix
    ("use_reentrant=True)", "use_reentrant=True)\n    saliency = x.grad"),  # .grad is read
    ("    x.requires_grad_()\n", "    x = torch.empty((), requires_grad=True)\n"),  # a dummy
])
def test_ac002_twins(change: str, replacement: str) -> None:
    assert "AC002" not in _lint(GRAD_INPUT.replace(change, replacement)).codes()


# --------------------------------------------------------------------------- AC009


def test_ac009_container_and_keywords() -> None:
    source = """
    from torch.utils.checkpoint import checkpoint
    h = checkpoint(fn, (a, b), use_reentrant=True)
    h = checkpoint(fn, a, mask=m, use_reentrant=True)
    h = checkpoint(fn, a, b, use_reentrant=True)
    h = checkpoint(fn, (a, b), mask=m, use_reentrant=False)
    """
    findings = _only(_lint(source), "AC009")
    assert [_line(f) for f in findings] == [3, 4]
    assert "(a, b)" in findings[0].message and "mask" in findings[1].message


# --------------------------------------------------------------------------- AC010

DDP_SCRIPT = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

class Net(torch.nn.Module):
    def forward(self, x):
        return self.head(checkpoint(self.body, self.embed(x), use_reentrant=True))

model = DDP(Net(), device_ids=[0], find_unused_parameters=True)
"""


def test_ac010_ddp_find_unused_with_reentrant() -> None:
    [finding] = _only(_lint(DDP_SCRIPT), "AC010")
    assert finding.severity == "error" and finding.where == "<source>:10"
    assert "line 8" in finding.message and "static_graph=True" in finding.fix


@pytest.mark.parametrize(("change", "replacement"), [
    ("use_reentrant=True", "use_reentrant=False"),
    ("find_unused_parameters=True", "find_unused_parameters=False"),
    ("find_unused_parameters=True", "find_unused_parameters=True, static_graph=True"),
])
def test_ac010_twins(change: str, replacement: str) -> None:
    assert "AC010" not in _lint(DDP_SCRIPT.replace(change, replacement)).codes()


def test_ac010_with_checkpoint_wrapper_and_autockpt() -> None:
    wrapper = DDP_SCRIPT.replace("checkpoint(self.body, self.embed(x), use_reentrant=True)",
                                 "self.body(self.embed(x))") + textwrap.dedent("""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
    """)
    assert "AC010" in _lint(wrapper).codes()
    assert "AC010" not in _lint(wrapper.replace("REENTRANT)", "NO_REENTRANT)")).codes()
    applied = DDP_SCRIPT.replace("checkpoint(self.body, self.embed(x), use_reentrant=True)",
                                 "self.body(self.embed(x))") + \
        "import autockpt\nnet = autockpt.apply(net, 300, mode=\"reentrant\")\n"
    assert "AC010" in _lint(applied).codes()


# --------------------------------------------------------------------------- AC012

ACCUMULATE = """
import torch

def train(model, loader, criterion, opt):
    total_loss = 0.0
    for x, y in loader:
        loss = criterion(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total_loss += loss
    return total_loss
"""


@pytest.mark.parametrize("spelling", [
    "total_loss += loss", "total_loss = total_loss + loss", "total_loss.append(loss)",
])
def test_ac012_loss_tensor_accumulated(spelling: str) -> None:
    [finding] = _only(_lint(ACCUMULATE.replace("total_loss += loss", spelling)), "AC012")
    assert finding.severity == "warning" and finding.where == "<source>:11"
    assert finding.fix.startswith("total_loss += loss.item()")


def test_ac012_by_name_without_backward() -> None:
    source = ACCUMULATE.replace("        loss.backward()\n", "")
    assert "AC012" in _lint(source).codes()


@pytest.mark.parametrize(("change", "replacement"), [
    ("total_loss += loss", "total_loss += loss.item()"),
    ("total_loss += loss", "total_loss += loss.detach()"),
    ("    for x, y in loader:", "    with torch.no_grad():\n     for x, y in loader:"),
    # Gradient accumulation: the sum itself is differentiated, on purpose.
    ("        loss.backward()\n", ""),
])
def test_ac012_twins(change: str, replacement: str) -> None:
    source = ACCUMULATE.replace(change, replacement)
    if change.startswith("        loss.backward"):
        source = source.replace("    return total_loss", "    total_loss.backward()")
    assert "AC012" not in _lint(source).codes()


def test_ac012_number_named_like_a_loss_is_fine() -> None:
    source = ACCUMULATE.replace("        loss.backward()\n", "").replace(
        "total_loss += loss", "loss_value = loss.item()\n        total_loss += loss_value")
    assert "AC012" not in _lint(source).codes()


# --------------------------------------------------------------------------- AC013, AC014

SAVE = """
import torch
from torch import nn

model = Net()
model = nn.DataParallel(model)
opt = torch.optim.Adam(model.parameters())
for epoch in range(3):
    train(model, opt)
torch.save(model.state_dict(), "weights.pt")
"""


@pytest.mark.parametrize(("wrap", "prefix"), [
    ("nn.DataParallel(model)", "module."),
    ("torch.nn.parallel.DistributedDataParallel(model)", "module."),
    ("torch.compile(model)", "_orig_mod."),
])
def test_ac013_state_dict_of_a_wrapped_model(wrap: str, prefix: str) -> None:
    [finding] = _only(_lint(SAVE.replace("nn.DataParallel(model)", wrap)), "AC013")
    assert finding.severity == "warning" and finding.where == "<source>:10"
    assert f"'{prefix}'" in finding.message
    inner = prefix.rstrip(".")
    assert finding.fix == f"torch.save(model.{inner}.state_dict(), path)"


def test_ac013_loaded_into_a_bare_model() -> None:
    source = SAVE + "bare = Net()\nbare.load_state_dict(torch.load(\"weights.pt\"))\n"
    assert [_line(f) for f in _only(_lint(source), "AC013")] == [10, 12]


def test_ac013_the_reverse() -> None:
    source = """
    import torch
    net = Net()
    torch.save(net.state_dict(), "w.pt")
    wrapped = torch.nn.DataParallel(Net())
    wrapped.load_state_dict(torch.load("w.pt"))
    """
    [finding] = _only(_lint(source), "AC013")
    assert _line(finding) == 6 and "wrapped.module.load_state_dict" in finding.fix


def test_ac013_loads_elsewhere_are_not_paired() -> None:
    source = SAVE + "def evaluate():\n    bare = Net()\n    bare.load_state_dict(torch.load(p))\n"
    assert [_line(f) for f in _only(_lint(source), "AC013")] == [10]


def test_ac013_fixed_twin() -> None:
    source = SAVE.replace("model.state_dict()", "model.module.state_dict()")
    source += "bare = Net()\nbare.load_state_dict(torch.load(\"weights.pt\"))\n"
    assert "AC013" not in _lint(source).codes()


CHECKPOINT_DICT = """
import torch

model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
for epoch in range(10):
    train(model, opt)
    torch.save({"epoch": epoch, "model": model.state_dict(), "sched": sched.state_dict()},
               f"ckpt{epoch}.pt")
"""


def test_ac014_checkpoint_without_optimizer_state() -> None:
    [finding] = _only(_lint(CHECKPOINT_DICT), "AC014")
    assert finding.severity == "warning" and finding.where == "<source>:9"
    assert "`opt` (AdamW)" in finding.message and "opt.state_dict()" in finding.fix


def test_ac014_sgd_with_momentum_has_state() -> None:
    source = CHECKPOINT_DICT.replace("torch.optim.AdamW(model.parameters(), lr=1e-3)",
                                     "torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)")
    assert "AC014" in _lint(source).codes()


def test_ac014_dict_built_step_by_step() -> None:
    saved = ('{"epoch": epoch, "model": model.state_dict(), "sched": sched.state_dict()},\n'
             '               f"ckpt{epoch}.pt")')
    source = CHECKPOINT_DICT.replace(
        f"    torch.save({saved}",
        '    state = {"epoch": epoch}\n    state["model"] = model.state_dict()\n'
        '    torch.save(state, "ckpt.pt")')
    assert "AC014" in _lint(source).codes()
    fixed = source.replace('torch.save(state', 'state["optim"] = opt.state_dict()\n'
                           '    torch.save(state')
    assert "AC014" not in _lint(fixed).codes()


@pytest.mark.parametrize(("change", "replacement"), [
    ('"sched": sched.state_dict()', '"opt": opt.state_dict()'),
    ("opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n", ""),  # no optimizer here
    ("torch.optim.AdamW(model.parameters(), lr=1e-3)", "torch.optim.SGD(model.parameters(), 0.1)"),
])
def test_ac014_twins(change: str, replacement: str) -> None:
    assert "AC014" not in _lint(CHECKPOINT_DICT.replace(change, replacement)).codes()


def test_ac014_weights_alone_are_not_a_training_checkpoint() -> None:
    source = CHECKPOINT_DICT.replace(
        '{"epoch": epoch, "model": model.state_dict(), "sched": sched.state_dict()}',
        "model.state_dict()")
    assert "AC014" not in _lint(source).codes()


# --------------------------------------------------------------------------- input


def test_path_str_and_pathlib(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNSPECIFIED)
    for given in (script, str(script)):
        [finding] = autockpt.lint(given)
        assert finding.where == f"{script}:6"
    assert autockpt.lint(str(script)).subject == str(script)


@pytest.mark.parametrize("bad", [b"import torch\n", None, 3, ["x = 1"], "", "   \n"],
                         ids=["bytes", "None", "int", "list", "empty", "blank"])
def test_bad_input(bad: object) -> None:
    with pytest.raises(autockpt.InvalidArgumentError) as info:
        autockpt.lint(bad)  # type: ignore[arg-type]
    assert info.value.fix


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="no such file"):
        autockpt.lint(str(tmp_path / "nope.py"))
    with pytest.raises(autockpt.InvalidArgumentError, match="is a directory"):
        autockpt.lint(tmp_path)


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(LintSyntaxError) as info:
        autockpt.lint("import torch\n\ndef f(:\n    pass\n")
    assert info.value.lineno == 3 and "line 3" in str(info.value)
    assert isinstance(info.value, autockpt.InvalidArgumentError)


def test_sorted_and_deterministic() -> None:
    source = "".join("from torch.utils.checkpoint import checkpoint\n" if i == 0 else
                     f"checkpoint(f{i}, x)\n" for i in range(12))
    report = _lint(source)
    assert [_line(f) for f in report] == list(range(2, 13))  # 9 before 10
    assert report == _lint(source)


def test_source_with_flag() -> None:
    assert source_with_flag("return self.head(checkpoint(self.body, x, use_reentrant=True))",
                            "use_reentrant=False") == \
        "checkpoint(self.body, x, use_reentrant=False)"
    assert source_with_flag("h = checkpoint(", "use_reentrant=False") is None


def test_quiet_on_this_repository() -> None:
    paths = sorted([*ROOT.joinpath("autockpt").glob("*.py"), ROOT / "tests" / "zoo.py",
                    *ROOT.joinpath("examples").glob("*.py")])
    assert len(paths) > 10
    noisy = {str(p): autockpt.lint(p).codes() for p in paths if len(autockpt.lint(p))}
    assert noisy == {}
