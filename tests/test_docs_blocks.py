"""Every ```python block of README.md and docs/*.md runs, or says why not.

Each block is run here, with a prelude that defines what a fragment takes from its
surroundings (``model``, ``x``, ``y``...) with small real models, or is run by the test named
for it (docs/diagnostics.md's tagged examples by tests/test_diagnose.py, the training
checkpoints guide by tests/test_checkpoints_docs.py: checked here to be among the blocks that
test extracts), or is marked ``<!-- not-run: reason -->`` in the document. Where a document
shows a large model, the block is run with a visible substitution (a string the block must
contain, replaced by a small one: asserted, so the test fails when the block changes) and
as written in a ``slow`` test. The count of blocks per file is asserted: a new block fails
here until it is listed.

The ```bash blocks are the command line's: the README's and docs/migrating.md's name a model
(``mypkg.models:make_model``) that is a placeholder, and tests/test_cli.py and
tests/test_plot.py run ``plan`` (``--budget 50%``, ``--json``, ``--plot``, integer and
several inputs), ``bench``, ``diagnose`` and ``lint`` on models of theirs.
"""

from __future__ import annotations

import re
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?P<marker><!-- not-run:(?P<reason>[^>]*)-->\n)?(?P<indent>[ \t]*)"
                   r"```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- preludes

IMPORTS = """
import torch, autockpt
import torch.nn.functional as F
from torch import nn
"""

SMALL_MLP = IMPORTS + """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 10))
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

# The model the migrating guide and how-it-works measure: examples/quickstart.py's
# 72-layer MLP at batch 16 (their budgets, 1.3 and 1.34 MiB, are its numbers).
MLP72 = IMPORTS + """
from examples.quickstart import mlp72
model = mlp72()
x, y = torch.randn(16, 1000), torch.randint(0, 100, (16,))
"""

# docs/plan-columns.md's model: tests/expected/plan_sequential_non_reentrant.txt's.
PLAN_COLUMNS = IMPORTS + """
torch.manual_seed(0)
layers = [nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1)]
for _ in range(5):
    layers += [nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(512, 10))
x = torch.randn(64, 512)
"""

# docs/migrating.md's residual blocks, fewer of them.
BLOCKS = IMPORTS + """
class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), \\
            nn.Linear(4 * width, width)
    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(64, 10)
    def forward(self, h):
        return self.head(self.blocks(h))

torch.manual_seed(0)
model = Net()
h = torch.randn(32, 64)
"""

SMALL_LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
"""

HF = IMPORTS + SMALL_LLAMA + """
torch.manual_seed(0)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 512, (2, 64))
mask = torch.ones_like(ids)
optimizer = torch.optim.AdamW(model.parameters())
"""

# A dataset of token rows of changing lengths, padded per batch, as Trainer and accelerate
# loops are fed.
HF_DATA = HF + """
class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(1, 512, (int(n),), generator=g)
                     for n in torch.randint(8, 48, (8,), generator=g)]
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}

def collator(features):
    ids = torch.nn.utils.rnn.pad_sequence([f["input_ids"] for f in features], batch_first=True)
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

train_dataset = Rows()
loader = torch.utils.data.DataLoader(train_dataset, batch_size=4, collate_fn=collator)
"""

TINY_LM = IMPORTS + """
class TinyLM(nn.Module):
    def __init__(self, vocab=512, width=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.head = nn.Linear(width, vocab)
    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))

torch.manual_seed(0)
model = TinyLM()
ids = torch.randint(0, 512, (2, 128))
targets = torch.randint(0, 512, (2, 128))
"""

TRAINING_STATE = SMALL_MLP + """
from torch.utils.data import DataLoader, TensorDataset
optimizer = opt
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
sampler = autockpt.training.ResumableSampler(TensorDataset(x, y), seed=0)
step = 0
loss = F.cross_entropy(model(x), y)
"""

DDP_GROUP = SMALL_MLP + """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tests.helpers import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                        world_size=1)
"""

LINT_SCRIPT = SMALL_MLP + """
from pathlib import Path
Path("train.py").write_text('''import torch
from torch.utils.checkpoint import checkpoint
def forward(block, x):
    return checkpoint(block, x)
''')
"""


@dataclass(frozen=True)
class Run:
    """Run the block here after ``prelude``; ``replace`` pairs must each occur in the block;
    ``check`` is then evaluated in the block's namespace and must be true."""

    prelude: str
    replace: tuple[tuple[str, str], ...] = ()
    check: str = "True"
    teardown: str = ""


@dataclass(frozen=True)
class RunElsewhere:
    """Run by another test, which extracts it with its own pattern: ``test``."""

    test: str


@dataclass(frozen=True)
class NotRun:
    """Marked ``<!-- not-run: reason -->`` in the document."""


# README's meta example, on a small Llama config instead of Llama-3-8B's.
LLAMA_3_8B = """config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,  # Llama-3-8B
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0)"""
SMALL_LLAMA_CONFIG = """config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)"""

CASES: dict[str, list[Run | RunElsewhere | NotRun]] = {
    "README.md": [
        Run(SMALL_MLP, check="autockpt.plan_of(ckpt_model).budget_bytes == 300 * 2**20 "
            "and loss.item() > 0"),
        Run("", replace=((LLAMA_3_8B, SMALL_LLAMA_CONFIG),
                         ("torch.zeros(1, 2048, dtype=torch.long)",
                          "torch.zeros(1, 256, dtype=torch.long)"),
                         ("total_mb=80 * 1024", "total_mb=8")),
            check="plan.device is not None and plan.chunked_head is not None "
            "and plan.estimated_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes"),
        Run(HF, check="model.model.layers[0].self_attn.q_proj.weight.grad is not None"),
        Run(TRAINING_STATE, check="state is None and manager.latest() is not None"),
    ],
    "docs/chunked-head.md": [
        Run(TINY_LM, check="autockpt.plan_of(step).chunked_head is not None "
            "and model.head.weight.grad is not None"),
    ],
    "docs/diagnostics.md": [
        Run(LINT_SCRIPT, check="report.codes() and all(f.fix for f in report)"),
        *[RunElsewhere("tests/test_diagnose.py::test_docs_examples")] * 34,
    ],
    "docs/how-it-works.md": [
        Run(MLP72, check="Path('memory.png').stat().st_size > 0 and curves is not None"),
    ],
    "docs/huggingface.md": [
        Run(HF, check="model.is_gradient_checkpointing"),
        Run(HF, check="autockpt.plan_of(model).budget_bytes == 500 * 2**20 "
            "and out.loss.grad_fn is not None"),
        Run(HF_DATA, check="trainer.state.global_step == 3 "
            "and (Path('out/final') / 'model.safetensors').exists() "
            "and autockpt.plan_of(model).budget_bytes == 500 * 2**20"),
        Run(HF_DATA, check="autockpt.plan_of(model).budget_bytes == 500 * 2**20 "
            "and outputs.loss.grad_fn is not None"),
    ],
    "docs/migrating.md": [
        Run(SMALL_MLP + "x.requires_grad_()\n", check="out.shape == (32, 10)"),
        Run(MLP72, check="abs(autockpt.plan_of(model).budget_bytes - 1.3 * 2**20) < 1"),
        Run(MLP72, check="autockpt.plan_of(model).estimated_peak_bytes <= reached"),
        Run(BLOCKS, check="type(model.blocks[0]).__name__ == 'CheckpointWrapper'"),
        Run(BLOCKS, check="autockpt.plan_of(model).budget_bytes == 4 * 2**20"),
        Run(HF, check="model.is_gradient_checkpointing and not model.config.use_cache"),
        Run(HF, check="autockpt.plan_of(model).budget_bytes == 2000 * 2**20"),
    ],
    "docs/plan-columns.md": [
        Run(PLAN_COLUMNS, check="plan.segments and plan.skipped"),
    ],
    "docs/shapes.md": [
        Run("", check="autockpt.plan_of(model).budget_bytes == 8 * 2**20 and "
            "sum(len(f.graphs) for f in model.__dict__['_autockpt'].families.values()) == 1"),
        Run("", check="'input_ids [4, 256]' in autockpt.plan_of(model).serves and "
            "'largest stated' in autockpt.plan_of(model).serves and "
            "sum(len(f.plans) for f in model.__dict__['_autockpt'].families.values()) == 1"),
    ],
    "docs/training-checkpoints.md": [
        *[RunElsewhere("tests/test_checkpoints_docs.py::test_user_guide_code_runs")] * 7,
        NotRun(), NotRun(),
    ],
    "docs/training-setups.md": [
        Run(DDP_GROUP, check="isinstance(model, DDP)",
            teardown="dist.destroy_process_group()"),
        NotRun(),
    ],
}


def _blocks(name: str) -> list[re.Match[str]]:
    return list(BLOCK.finditer((ROOT / name).read_text(encoding="utf-8")))


def _code(block: re.Match[str]) -> str:
    return textwrap.dedent(block["code"])


def test_every_block_is_listed() -> None:
    """A block added to (or removed from) a document fails here until it is listed."""
    assert sorted(CASES) == DOCS
    for name in DOCS:
        blocks = _blocks(name)
        assert len(blocks) == len(CASES[name]), (
            f"{name} has {len(blocks)} python blocks, {len(CASES[name])} listed here")
        for i, (block, case) in enumerate(zip(blocks, CASES[name])):
            marked = block["marker"] is not None
            assert marked == isinstance(case, NotRun), (
                f"{name} block {i}: marked not-run in the document: {marked}, here: {case}")
            if marked:
                assert block["reason"].strip(), f"{name} block {i}: not-run without a reason"


def _runnable() -> list[object]:
    return [pytest.param(name, i, id=f"{name}-{i}") for name in DOCS
            for i, case in enumerate(CASES[name]) if isinstance(case, Run)]


def _substituted(code: str, case: Run) -> str:
    for old, new in case.replace:
        assert code.count(old) == 1, f"the block no longer contains {old!r}"
        code = code.replace(old, new)
    return code


def _exec(code: str, label: str, namespace: dict[str, object]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(code, label, "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize(("name", "index"), _runnable())
def test_block_runs(name: str, index: int, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name][index]
    assert isinstance(case, Run)
    code = _substituted(_code(_blocks(name)[index]), case)
    monkeypatch.chdir(tmp_path)  # blocks write checkpoints/, memory.png, train.py
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict[str, object] = {"__name__": f"docs_block_{index}", "Path": Path}
    _exec(textwrap.dedent(case.prelude), f"{name} prelude", namespace)
    try:
        _exec(code, f"{name} block {index}", namespace)
        assert eval(case.check, namespace), f"{name} block {index}: {case.check}"  # noqa: S307
    finally:
        if case.teardown:
            _exec(case.teardown, f"{name} teardown", namespace)


def test_blocks_run_elsewhere_are_extracted_there() -> None:
    """The blocks left to another test are among those that test runs."""
    from tests import test_checkpoints_docs, test_diagnose

    diagnose_sources = [source for *_, source in test_diagnose.DOC_BLOCKS]
    guide = (ROOT / "docs/training-checkpoints.md").read_text(encoding="utf-8")
    guide_runs = [m["code"] for m in test_checkpoints_docs.BLOCK.finditer(guide)
                  if not m["marker"]]
    for name in DOCS:
        for block, case in zip(_blocks(name), CASES[name]):
            if not isinstance(case, RunElsewhere):
                continue
            if case.test.startswith("tests/test_diagnose.py"):
                assert block["code"] in diagnose_sources
            else:
                assert block["code"] in guide_runs


# --------------------------------------------------------------------------- the large ones

LARGE = {
    "Llama-3-8B": None,  # the README's block as written
    "Qwen2.5-1.5B": """from transformers import Qwen2Config as LlamaConfig, Qwen2ForCausalLM as LlamaForCausalLM
config = LlamaConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,  # Qwen2.5-1.5B
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     max_position_embeddings=32768, rope_theta=1000000.0,
                     tie_word_embeddings=True)""",
    "Mistral-7B": """from transformers import MistralConfig as LlamaConfig, MistralForCausalLM as LlamaForCausalLM
config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,  # Mistral-7B
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096)""",
}

# What the README says each prints (the whole-device line and the peaks).
PRINTED = {
    "Llama-3-8B": ["parameters 14.96 GiB, gradients 14.96 GiB, AdamW state 29.92 GiB",
                   "activations get 20.17 GiB", "baseline peak   33.99 GiB",
                   "estimated peak  20.05 GiB", "29 checkpointed", "(9.2% of forward FLOPs)",
                   "16 chunks of 128 rows"],
    "Qwen2.5-1.5B": ["baseline peak   15.62 GiB", "0 checkpointed"],
    "Mistral-7B": ["parameters 13.49 GiB", "estimated peak  26.03 GiB", "9 checkpointed",
                   "(4.4% of forward FLOPs)"],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(LARGE))
def test_readme_meta_example_as_written(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's "Will it fit on my GPU?" block on the public sizes, within 60 s on the
    2-core CPU, printing the numbers the README quotes."""
    code = _code(_blocks("README.md")[1])
    if LARGE[model] is not None:
        code = _substituted(code, Run("", replace=((LLAMA_3_8B, LARGE[model]),)))
    namespace: dict[str, object] = {"__name__": "readme_meta"}
    start = time.perf_counter()
    _exec(code, f"README.md block 1 ({model})", namespace)
    seconds = time.perf_counter() - start
    printed = capsys.readouterr().out
    for text in PRINTED[model]:
        assert text in printed, f"{model}: {text!r} not in the printed plan:\n{printed}"
    assert seconds < 60, f"{model}: {seconds:.1f} s"
    if model == "Llama-3-8B":  # the README's 40 GiB GPU
        import autockpt

        with pytest.raises(autockpt.InfeasibleBudgetError, match="parameters, gradients and AdamW state take 59.83 GiB"):
            autockpt.plan(namespace["model"], example_kwargs=dict(
                input_ids=namespace["ids"], labels=namespace["ids"], use_cache=False),
                total_mb=40 * 1024, optimizer=torch.optim.AdamW(
                    namespace["model"].parameters()))  # type: ignore[union-attr]
    print(f"{model}: {seconds:.1f} s")
