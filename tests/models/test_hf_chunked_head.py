"""Causal language models of Hugging Face nobody here wrote, given ``labels=``: the plan runs
the head in chunks of tokens and the step's gradients equal the model's own (NOTE [ The head
in chunks of rows ])."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import autockpt
from autockpt.planning.planner import BUDGET_SLACK

pytestmark = pytest.mark.models
transformers = pytest.importorskip("transformers")

VOCAB = 4096
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=256, max_position_embeddings=256, use_cache=False)


def _builders() -> dict[str, Callable[[], torch.nn.Module]]:
    t = transformers
    return {
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(num_key_value_heads=2, **COMMON)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(num_key_value_heads=2,
                                                                **COMMON)),
        # Gemma 2 soft-caps its logits (divide, tanh, multiply) between head and loss.
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(num_key_value_heads=2,
                                                             head_dim=32, **COMMON)),
        "phi": lambda: t.PhiForCausalLM(t.PhiConfig(**COMMON)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**COMMON)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(
            vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            ffn_dim=256, max_position_embeddings=256, word_embed_proj_dim=128,
            use_cache=False)),
        "bloom": lambda: t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=128,
                                                          n_layer=2, n_head=4,
                                                          use_cache=False)),
    }


@pytest.mark.parametrize("name", list(_builders()))
def test_head_in_chunks_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = _builders()[name]().train()
    # 1024 tokens: chunks of at least 128 (autockpt.planning.head.MIN_CHUNK_ROWS), 8 of them.
    ids = torch.randint(0, VOCAB, (4, 256), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    ckpt = autockpt.apply(copy.deepcopy(model), example_kwargs=batch)
    head = autockpt.plan_of(ckpt).chunked_head
    assert head is not None and head.stretch.last_module == "lm_head"

    torch.manual_seed(1)
    out = ckpt(**batch)
    out.loss.backward()
    torch.manual_seed(1)
    want = model(**batch)
    want.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    # Sums over chunks are in another order: a gradient that is zero in exact arithmetic
    # (a key bias, which softmax cancels) differs in its noise, so the tolerance is
    # relative to the largest gradient.
    largest = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
    for (key, got), (_, param) in zip(ckpt.named_parameters(), model.named_parameters()):
        assert (got.grad is None) == (param.grad is None), key
        if param.grad is not None:
            torch.testing.assert_close(got.grad, param.grad, rtol=1e-4,
                                       atol=1e-6 * float(largest), msg=key)


def _lm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":  # ties its head to the embedding
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=8192, n_positions=256, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0)).train()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=8192, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).train()


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("budget", ["half", "min"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_budget_holds_with_the_head_in_chunks(name: str, budget: str, mode: str) -> None:
    """The budget holds on the real step; the estimate is never optimistic, and within 5%
    where no parameter is tied and segments are non-reentrant. A head tied to the embedding
    is over-estimated (its gradient, made in forward, is counted until the embedding's
    backward; measure counts it as a parameter gradient), and reentrant segments are
    over-estimated as everywhere (issue 14)."""
    ids = torch.randint(0, 8192, (2, 256), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    probe = autockpt.plan(_lm(name), batch, mode=mode)
    # Reentrant plans keep the head whole (see autockpt.pipeline).
    assert (probe.chunked_head is not None) == (mode == "non_reentrant")
    budget_bytes = (probe.min_peak_bytes if budget == "min"
                    else max(probe.min_peak_bytes, probe.baseline_peak_bytes // 2))
    ckpt = autockpt.apply(_lm(name), budget_bytes / 2**20, example_kwargs=batch, mode=mode)
    plan = autockpt.plan_of(ckpt)
    assert (plan.chunked_head is not None) == (mode == "non_reentrant")
    measured = autockpt.measure(ckpt, (), example_kwargs=batch).peak_activation_bytes
    assert measured <= (1 + BUDGET_SLACK) * budget_bytes, (measured, budget_bytes)
    assert measured <= (1 + BUDGET_SLACK) * plan.estimated_peak_bytes
    if name == "llama" and mode == "non_reentrant":
        assert abs(plan.estimated_peak_bytes - measured) <= 0.05 * measured, (
            f"estimated {plan.estimated_peak_bytes} B, measured {measured} B")
