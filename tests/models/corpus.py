"""A corpus of real models from timm, torchvision, transformers and diffusers.

Each :class:`CorpusCase` builds a fresh model from code (random initialisation from a seed, no
weights, nothing downloaded) at a tiny size, so that a training step takes a fraction of a
second on one CPU thread, and makes inputs shaped like a real batch for it. The packages are
imported only when a case is built, so this module imports without them; ``requires`` names
the package a case needs (the tests skip a case whose package is missing).

This module deliberately does not import autockpt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["CASES", "CorpusCase", "output_loss"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class CorpusCase:
    """One real model of the corpus.

    ``build(seed)`` seeds the global RNG and returns a new model in train mode (two builds
    with one seed are identical); ``inputs()`` returns fresh ``(args, kwargs)`` from a seeded
    generator; ``loss_fn(output)`` is the scalar one training step minimises.
    """

    name: str
    requires: str
    build: Callable[[int], nn.Module]
    inputs: Callable[[], Inputs]
    loss_fn: Callable[[Any], Tensor]


def _float_tensors(output: Any) -> list[Tensor]:
    """The floating-point tensors of an output that carry a gradient, in a fixed order:
    tuples and lists in order, mappings (``ModelOutput``, diffusers' ``BaseOutput``) in their
    own key order, which is the order of the fields."""
    if isinstance(output, Tensor):
        return [output] if output.is_floating_point() and output.requires_grad else []
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _float_tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _float_tensors(item)]
    return []


def output_loss(output: Any) -> Tensor:
    """The loss of one training step from whatever a model returns.

    A Hugging Face output that computed its own loss (``labels`` were given) trains on it.
    Otherwise every floating-point output tensor contributes ``mean(t**2)`` (logits of timm
    and torchvision classifiers, ``ModelOutput.logits``, a UNet's ``.sample``), so every
    output element reaches the gradient.
    """
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]
    tensors = _float_tensors(output)
    if not tensors:
        raise ValueError(f"no floating-point output requiring grad in a {type(output).__name__}")
    loss = tensors[0].float().pow(2).mean()
    for tensor in tensors[1:]:
        loss = loss + tensor.float().pow(2).mean()
    return loss


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(seed)
    model = make()
    return model.train()


# --------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------


def _images(batch: int, size: int, seed: int) -> Callable[[], Inputs]:
    def make() -> Inputs:
        return (torch.randn(batch, 3, size, size, generator=_generator(seed)),), {}

    return make


def _timm(name: str, **kwargs: Any) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        import timm

        return _seeded(seed, lambda: timm.create_model(name, pretrained=False, num_classes=10,
                                                       **kwargs))

    return build


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        import torchvision

        return _seeded(seed, lambda: getattr(torchvision.models, name)(weights=None,
                                                                       num_classes=10))

    return build


# --------------------------------------------------------------------------------------
# Transformers, from small configs
# --------------------------------------------------------------------------------------

VOCAB = 100
SEQ = 16


def _token_batch(seed: int) -> tuple[Tensor, Tensor]:
    """Token ids (never 0, the pad id) and an attention mask whose second row is padded."""
    gen = _generator(seed)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    ids[1, SEQ - 4:] = 0
    return ids, mask


def _causal_lm_inputs(seed: int) -> Callable[[], Inputs]:
    def make() -> Inputs:
        ids, mask = _token_batch(seed)
        labels = ids.masked_fill(mask == 0, -100)
        return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


def _masked_lm_inputs() -> Inputs:
    ids, mask = _token_batch(21)
    gen = _generator(22)
    chosen = (torch.rand(ids.shape, generator=gen) < 0.3) & (mask == 1)
    chosen[0, 0] = True  # at least one predicted token
    labels = ids.masked_fill(~chosen, -100)
    inputs = ids.masked_fill(chosen, 3)  # 3 plays [MASK]
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, SEQ // 2:] = 1
    return (), {"input_ids": inputs, "attention_mask": mask, "token_type_ids": token_type_ids,
                "labels": labels}


def _seq2seq_inputs() -> Inputs:
    ids, mask = _token_batch(23)
    labels = torch.randint(1, VOCAB, (2, SEQ // 2), generator=_generator(24))
    labels[1, -2:] = -100
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _vit_inputs() -> Inputs:
    gen = _generator(25)
    pixels = torch.randn(2, 3, 32, 32, generator=gen)
    return (), {"pixel_values": pixels, "labels": torch.randint(0, 10, (2,), generator=gen)}


def _hf(model_class: str, config_class: str, **config: Any) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_class)(**config)
        cfg._attn_implementation = "eager"
        return _seeded(seed, lambda: getattr(transformers, model_class)(cfg))

    return build


# --------------------------------------------------------------------------------------
# Diffusers
# --------------------------------------------------------------------------------------


def _build_unet(seed: int) -> nn.Module:
    from diffusers import UNet2DModel

    return _seeded(seed, lambda: UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
    ))


def _unet_inputs() -> Inputs:
    gen = _generator(26)
    sample = torch.randn(2, 3, 16, 16, generator=gen)
    return (sample, torch.tensor([10, 500])), {}


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

CASES: tuple[CorpusCase, ...] = (
    CorpusCase("timm_resnet50", "timm", _timm("resnet50"), _images(2, 64, 1), output_loss),
    CorpusCase("timm_convnext_atto", "timm", _timm("convnext_atto", drop_path_rate=0.1), _images(2, 32, 2),
               output_loss),
    CorpusCase("timm_efficientnet_b0", "timm", _timm("efficientnet_b0"), _images(2, 32, 3),
               output_loss),
    CorpusCase("timm_vit_tiny", "timm",
               _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, drop_rate=0.1,
                     drop_path_rate=0.1), _images(2, 32, 4),
               output_loss),
    CorpusCase("timm_swin_tiny", "timm",
               _timm("swin_tiny_patch4_window7_224", img_size=32, window_size=4),
               _images(2, 32, 5), output_loss),
    CorpusCase("tv_resnet18", "torchvision", _torchvision("resnet18"), _images(2, 32, 6),
               output_loss),
    CorpusCase("tv_densenet121", "torchvision", _torchvision("densenet121"), _images(2, 32, 7),
               output_loss),
    CorpusCase("tv_mobilenet_v2", "torchvision", _torchvision("mobilenet_v2"),
               _images(2, 32, 8), output_loss),
    CorpusCase("tv_vgg11_bn", "torchvision", _torchvision("vgg11_bn"), _images(2, 32, 9),
               output_loss),
    CorpusCase("hf_gpt2", "transformers",
               _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=32, n_embd=32,
                   n_layer=2, n_head=2, use_cache=False, **_TOKEN_IDS),
               _causal_lm_inputs(20), output_loss),
    CorpusCase("hf_bert", "transformers",
               _hf("BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=32, pad_token_id=0),
               _masked_lm_inputs, output_loss),
    CorpusCase("hf_llama", "transformers",
               _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32, use_cache=False,
                   attention_dropout=0.1, **_TOKEN_IDS),
               _causal_lm_inputs(27), output_loss),
    CorpusCase("hf_t5", "transformers",
               _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32,
                   d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                   use_cache=False, decoder_start_token_id=0, **_TOKEN_IDS),
               _seq2seq_inputs, output_loss),
    CorpusCase("hf_vit", "transformers",
               _hf("ViTForImageClassification", "ViTConfig", image_size=32, patch_size=8,
                   hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, num_labels=10, hidden_dropout_prob=0.1,
                   attention_probs_dropout_prob=0.1),
               _vit_inputs, output_loss),
    CorpusCase("diffusers_unet2d", "diffusers", _build_unet, _unet_inputs, output_loss),
)

_NAMES = [case.name for case in CASES]
assert len(set(_NAMES)) == len(_NAMES), "duplicate case names"
