"""Models built on torch.nn's own transformer: ``nn.TransformerEncoder`` and ``nn.Transformer``.

torch.fx keeps every torch.nn module whole, so these used to be one opaque node each and got
nothing (NOTE [ torch.nn containers ] in autockpt/capturing/ladder.py). Captured through torch.export
their layers become segments: the least memory reaches at most 40% of the measured baseline,
half the baseline is met, gradients equal an untransformed twin's in both modes, and the
module itself (state dict keys, parameter objects, the eval-mode fast path) is unchanged.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import MODES, assert_same_step, assert_same_step_in_float64, train_step

MIB = 2**20
VOCAB = 256
LEAST = 0.40
"""The least memory both modes must reach, as a fraction of the baseline's measured peak."""
SEED = 1234


class EncoderLM(nn.Module):
    """Token embedding, a 4-layer ``nn.TransformerEncoder``, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (2 encoder and 2 decoder layers) between embeddings and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.transformer = nn.Transformer(64, 4, 2, 2, 256, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head(self.transformer(self.embed(source), self.embed(target)))


def _tokens(*lengths: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, VOCAB, (8, n), generator=gen) for n in lengths)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.arange(logits.shape[0] * logits.shape[1]) % VOCAB
    return F.cross_entropy(logits.flatten(0, 1), labels)


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    "transformer_encoder": (EncoderLM, _tokens(64)),
    "transformer": (Seq2Seq, _tokens(48, 32)),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().train()


def _apply(model: nn.Module, args: tuple[Any, ...], budget_bytes: int | None,
           mode: str) -> nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):
        return autockpt.apply(model, None if budget_bytes is None else budget_bytes / MIB,
                              example_inputs=args, mode=mode, loss_fn=_loss)


def _peak(model: nn.Module, args: tuple[Any, ...]) -> int:
    return autockpt.measure(model, args, loss_fn=_loss).peak_activation_bytes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_layers_become_segments(name: str, mode: str) -> None:
    args = CASES[name][1]
    baseline = _peak(_build(name), args)

    model = _build(name)
    keys, params = list(model.state_dict()), dict(model.named_parameters())
    least = _apply(model, args, None, mode)
    plan = autockpt.plan_of(least)
    assert "torch.nn container" in plan.capture_reason, plan.capture_reason
    measured = _peak(least, args)
    assert measured <= LEAST * baseline, (
        f"{name} ({mode}): least memory {measured / MIB:.2f} MiB is {measured / baseline:.0%} "
        f"of the baseline's {baseline / MIB:.2f} MiB\n{plan}")
    assert list(least.state_dict()) == keys
    assert all(p is params[n] for n, p in least.named_parameters())

    if mode == "reentrant":
        # NOTE [ Gradients summed in another order ] in tests/helpers.py
        assert_same_step_in_float64(lambda: _build(name), plan, _loss, args, what=f"{name} ",
                                    seed=SEED)
    else:
        expected = train_step(_build(name), _loss, args, seed=SEED)
        assert_same_step(train_step(least, _loss, args, seed=SEED), expected, what=f"{name} ")

    budget = baseline // 2
    half = _apply(_build(name), args, budget, mode)
    measured = _peak(half, args)
    assert measured <= budget * (1 + BUDGET_SLACK), (
        f"{name} ({mode}) at 50%: measured {measured / MIB:.2f} MiB over the budget "
        f"{budget / MIB:.2f} MiB\n{autockpt.plan_of(half)}")


def test_eval_mode_runs_the_modules_own_forward() -> None:
    """In eval mode without grad, ``nn.TransformerEncoderLayer`` takes its fused fast path;
    the transformed model runs the module's own forward there, so its output is the same."""
    args = CASES["transformer_encoder"][1]
    reference = _build("transformer_encoder").eval()
    transformed = _apply(_build("transformer_encoder"), args, None, "non_reentrant").eval()
    with torch.no_grad():
        torch.testing.assert_close(transformed(*args), reference(*args), rtol=0, atol=0)


def test_multihead_attention_alone_stays_one_node() -> None:
    """A torch.nn module without layers inside (MultiheadAttention: one ``out_proj``) is kept
    whole by torch.fx, as a node the plan can still checkpoint."""

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.attn(x, x, x, need_weights=False)[0] + x)

    plan = autockpt.plan(Attend().train(), budget_mb=None, example_inputs=(torch.randn(4, 16, 32),))
    assert plan.capture == "fx"
    assert plan.capture_reason == ""
