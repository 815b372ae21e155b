"""Causal language models of Hugging Face nobody here wrote, given ``labels=``: the plan runs
the head in chunks of tokens and the step's gradients equal the model's own (NOTE [ The head
in chunks of rows ])."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import autockpt

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
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
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
