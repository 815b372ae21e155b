"""Hugging Face language models, trained on their own loss (``labels=``) or on a loss computed
outside (``loss_fn=``): the budget holds and the estimate is exact on the real step, for the
loop that holds the output through backward (``outputs = model(**batch);
outputs.loss.backward()``) as for the one that does not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autockpt
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import loop_peak_bytes

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


# The families of the issue (GPT-2, BERT's masked LM, T5, BART), small: 4 x 128 tokens.
SMALL_VOCAB, SMALL_BATCH, SMALL_SEQ = 4096, 4, 128


def _small(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    t = transformers
    if name == "gpt2":
        config = t.GPT2Config(vocab_size=SMALL_VOCAB, n_positions=SMALL_SEQ, n_embd=128,
                              n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
        return t.GPT2LMHeadModel(config).train()
    if name == "bert":
        config = t.BertConfig(vocab_size=SMALL_VOCAB, hidden_size=128, num_hidden_layers=4,
                              num_attention_heads=4, intermediate_size=256,
                              max_position_embeddings=SMALL_SEQ)
        return t.BertForMaskedLM(config).train()
    if name == "t5":
        config = t.T5Config(vocab_size=SMALL_VOCAB, d_model=128, d_kv=32, d_ff=256,
                            num_layers=2, num_decoder_layers=2, num_heads=4, use_cache=False,
                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return t.T5ForConditionalGeneration(config).train()
    config = t.BartConfig(vocab_size=SMALL_VOCAB, d_model=128, encoder_layers=2,
                          decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                          max_position_embeddings=SMALL_SEQ, use_cache=False)
    return t.BartForConditionalGeneration(config).train()


# The head whole and in chunks for every family; the modules rung (no graph) on one decoder
# and one encoder-decoder.
HELD_CASES = [(name, how) for name in ("gpt2", "bert", "t5", "bart")
              for how in ("whole", "chunks")] + [("gpt2", "modules"), ("bart", "modules")]


@pytest.mark.parametrize(("name", "how"), HELD_CASES, ids=[f"{n}-{h}" for n, h in HELD_CASES])
def test_the_output_beside_the_models_own_loss_is_held(name: str, how: str) -> None:
    """What the model returns beside its loss (the logits) is alive through backward in
    ``outputs = model(**batch); outputs.loss.backward()``: the plan counts it, unless the head
    runs in chunks and returns none of it. At half the baseline the budget holds for both
    loops, ``measure`` measures the holding one, and the estimate is within 5% of it."""
    model = _small(name)
    ids = torch.randint(3, SMALL_VOCAB, (SMALL_BATCH, SMALL_SEQ),
                        generator=torch.Generator().manual_seed(1))
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if name != "bert":
        batch["use_cache"] = False
    options: dict[str, Any] = ({"capture": "modules"} if how == "modules"
                               else {"chunk_head": how == "chunks"})
    probe = autockpt.plan(model, batch, **options)
    budget_bytes = max(probe.min_peak_bytes, probe.baseline_peak_bytes // 2)
    ckpt = autockpt.apply(model, budget_bytes / 2**20, example_kwargs=batch, **options)
    plan = autockpt.plan_of(ckpt)
    assert (plan.chunked_head is not None) == (how == "chunks")
    held = loop_peak_bytes(ckpt, batch, hold=True)
    dropped = loop_peak_bytes(ckpt, batch, hold=False)
    assert dropped <= held
    for measured in (held, dropped):
        assert measured <= (1 + BUDGET_SLACK) * budget_bytes, (measured, budget_bytes)
    assert abs(plan.estimated_peak_bytes - held) <= TOLERANCE * held, (
        f"estimated {plan.estimated_peak_bytes} B, measured {held} B")
    assert autockpt.measure(ckpt, (), example_kwargs=batch).peak_activation_bytes == held

    # The plan's loss line says what it held.
    assert plan.loss is not None and plan.loss.kind == "inner"
    held_parts = dict(plan.loss.held)
    if how == "chunks":
        assert "logits" not in held_parts
    else:
        assert held_parts["logits"] == SMALL_BATCH * SMALL_SEQ * SMALL_VOCAB * 4
        assert "held through backward" in str(plan)
