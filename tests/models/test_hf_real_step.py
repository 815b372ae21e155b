"""Hugging Face language models, trained on their own loss (``labels=``) or on a loss computed
outside (``loss_fn=``): the budget holds and the estimate is exact on the real step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autockpt
from autockpt.planner import BUDGET_SLACK

pytestmark = pytest.mark.models
transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 8192, 2, 256
TOLERANCE = 0.05


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128,
                                         n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).train()


def _batch() -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "use_cache": False}


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("budget", ["half", "min"])
@pytest.mark.parametrize("where", ["labels", "loss_fn"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_budget_holds_on_the_real_step(name: str, where: str, budget: str, mode: str) -> None:
    model = _model(name)
    batch = _batch()
    loss_fn = None
    if where == "labels":
        batch["labels"] = batch["input_ids"]
    else:
        targets = torch.roll(batch["input_ids"], -1, dims=1)

        def loss_fn(out: Any) -> torch.Tensor:
            return F.cross_entropy(out.logits.float().reshape(-1, VOCAB), targets.reshape(-1))

    # The head whole: the estimate is exact for it (the head in chunks has tests of its own,
    # tests/models/test_hf_chunked_head.py).
    probe = autockpt.plan(model, batch, loss_fn=loss_fn, mode=mode, chunk_head=False)
    assert probe.loss is not None
    assert probe.loss.kind == ("inner" if where == "labels" else "loss_fn")
    budget_bytes = (probe.min_peak_bytes if budget == "min"
                    else max(probe.min_peak_bytes, probe.baseline_peak_bytes // 2))
    ckpt = autockpt.apply(model, budget_bytes / 2**20, example_kwargs=batch, loss_fn=loss_fn,
                          mode=mode, chunk_head=False)
    plan = autockpt.plan_of(ckpt)
    measured = autockpt.measure(ckpt, (), example_kwargs=batch,
                                loss_fn=loss_fn).peak_activation_bytes
    assert measured <= (1 + BUDGET_SLACK) * budget_bytes, (measured, budget_bytes)
    assert abs(plan.estimated_peak_bytes - measured) <= TOLERANCE * measured, (
        f"estimated {plan.estimated_peak_bytes} B, measured {measured} B")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_users_get_the_memory_of_gradient_checkpointing_enable(name: str) -> None:
    """Asked for what Hugging Face's own switch measures (loss inside, ``labels=``), autockpt
    plans it, and its step measures within the budget."""
    batch = _batch()
    batch["labels"] = batch["input_ids"]
    hf = _model(name)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    theirs = autockpt.measure(hf, batch).peak_activation_bytes
    ours = autockpt.apply(_model(name), theirs / 2**20, example_kwargs=batch, chunk_head=False)
    plan = autockpt.plan_of(ours)
    measured = autockpt.measure(ours, batch).peak_activation_bytes
    assert measured <= (1 + BUDGET_SLACK) * theirs, (measured, theirs)
    assert abs(plan.estimated_peak_bytes - measured) <= TOLERANCE * measured
