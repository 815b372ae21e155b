"""The skip-connection checks, on models no test of this repository was written for.

tests/models/test_skip_connections.py holds its models to: the least memory at most 40% of
the measured baseline (55% reentrant), the least plan's estimate not below its measured peak,
the gradients of an untransformed twin, every budget from 50% up met within 5% measured, and
at the memory the library's own gradient checkpointing reaches, no more backward FLOPs than
it. This runs the same checks, with the same helpers, on other models built offline from
timm, torchvision, transformers and diffusers configs, and prints one row per model and mode:
the least memory as a share of the baseline, estimate / measured at the least, whether the
gradients are the twin's ("same"; "not " when the model cannot run in float64, as reentrant
mode is compared), measured / budget at 50% and 75%, the memory of the library's own
checkpointing as a share of the baseline and autockpt's backward FLOPs there over its own.
The 40% least-memory target is the skip-connection models'; the decoder-only language models
here are held to it too, for comparison.

    python benchmarks/unseen_models.py
    python benchmarks/unseen_models.py --models hf_bloom timm_nest_tiny --json out.json

A failed check is printed, not raised: the table is the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autockpt  # noqa: E402
from autockpt.planning.planner import BUDGET_SLACK  # noqa: E402
from tests.helpers import assert_same_step, assert_same_step_in_float64, train_step  # noqa: E402
from tests.models import test_skip_connections as skip  # noqa: E402
from tests.models.test_skip_connections import SkipCase  # noqa: E402

VOCAB = 512


def _hf(model_class: str, config_class: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return build


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision
        return getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)
    return build


def _deeplab() -> nn.Module:
    import torchvision
    return torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=5, aux_loss=False)


def _segmentation_loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = out["out"]
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], *logits.shape[2:],
                                               dtype=torch.long))


def _logits_loss(out: Any) -> torch.Tensor:
    return skip._cross_entropy(out.logits if hasattr(out, "logits") else out)


def _unet2d() -> nn.Module:
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(16, 32, 32, 64),
                       down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D",
                                         "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
                       norm_num_groups=8)


def _unet2d_condition() -> nn.Module:
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=skip.UNET2D_CONDITION_CROSS_DIM, attention_head_dim=8,
        norm_num_groups=8, transformer_layers_per_block=2)


def _vae() -> nn.Module:
    from diffusers import AutoencoderKL
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                         latent_channels=4, norm_num_groups=8, layers_per_block=1)


_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=64, encoder_layers=3, decoder_layers=3,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.1, use_cache=False,
                pad_token_id=0, decoder_start_token_id=0)
_T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_heads=4,
           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.1,
           use_cache=False)


def _token_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 32), generator=gen)
    return (), {"input_ids": ids, "labels": ids.clone()}


_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, max_position_embeddings=64, use_cache=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _decoder(name: str, model_class: str, config_class: str, **config: Any) -> SkipCase:
    """A causal language model trained with ``labels=``; ``None`` drops a key of _DECODER."""
    merged = {k: v for k, v in {**_DECODER, **config}.items() if v is not None}
    return SkipCase(name, "transformers", skip._seeded(_hf(model_class, config_class, **merged)),
                    _token_inputs, None, skip._hf_switch, strictly_fewer=False)


def _seq2seq(name: str, model_class: str, config_class: str, **config: Any) -> SkipCase:
    return SkipCase(name, "transformers", skip._seeded(_hf(model_class, config_class, **config)),
                    skip._seq2seq_inputs, None, skip._hf_switch, strictly_fewer=False)


def _images(name: str, requires: str, build: Callable[[], nn.Module], size: int,
            loss: Callable[[Any], torch.Tensor] = skip._cross_entropy) -> SkipCase:
    return SkipCase(name, requires, skip._seeded(build), skip._images(2, 3, size), loss)


_TIMM_MODELS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("hrnet_w18_small", 64, {}), ("hrnet_w18_small_v2", 64, {}), ("densenet121", 32, {}),
    ("dla34", 64, {}), ("dpn68", 64, {}), ("ese_vovnet19b_dw", 64, {}),
    ("res2net50_14w_8s", 64, {}), ("cspresnet50", 64, {}), ("nest_tiny", 32, {"img_size": 32}),
    ("levit_128s", 64, {"img_size": 64}), ("mobilevitv2_050", 64, {}), ("poolformer_s12", 64, {}),
    ("pvt_v2_b0", 64, {}), ("convnextv2_atto", 64, {}), ("edgenext_xx_small", 64, {}),
    ("twins_svt_small", 64, {}),
)
"""timm models, the input's side and the model's extra arguments."""

CASES = (
    _seq2seq("hf_marian", "MarianMTModel", "MarianConfig", **_SEQ2SEQ),
    _seq2seq("hf_pegasus", "PegasusForConditionalGeneration", "PegasusConfig", **_SEQ2SEQ),
    _seq2seq("hf_fsmt", "FSMTForConditionalGeneration", "FSMTConfig", langs=["en", "de"],
             src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
             **{k: v for k, v in _SEQ2SEQ.items() if k != "vocab_size"}),
    _seq2seq("hf_mt5", "MT5ForConditionalGeneration", "MT5Config", num_layers=3, **_T5),
    _seq2seq("hf_umt5", "UMT5ForConditionalGeneration", "UMT5Config", num_layers=2, **_T5),
    _seq2seq("hf_longt5", "LongT5ForConditionalGeneration", "LongT5Config", num_layers=2,
             local_radius=8, **_T5),
    _decoder("hf_gemma2", "Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=1,
             head_dim=16, sliding_window=16),
    _decoder("hf_phi3", "Phi3ForCausalLM", "Phi3Config"),
    _decoder("hf_qwen2", "Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    _decoder("hf_mixtral", "MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2,
             num_local_experts=4, num_experts_per_tok=2),
    _decoder("hf_falcon", "FalconForCausalLM", "FalconConfig", intermediate_size=None,
             max_position_embeddings=None, ffn_hidden_size=128, new_decoder_architecture=False,
             parallel_attn=True),
    _decoder("hf_gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    _decoder("hf_bloom", "BloomForCausalLM", "BloomConfig", intermediate_size=None,
             max_position_embeddings=None, num_hidden_layers=None, num_attention_heads=None,
             n_layer=3, n_head=4),
    _decoder("hf_opt", "OPTForCausalLM", "OPTConfig", intermediate_size=None, ffn_dim=128,
             word_embed_proj_dim=64),
    SkipCase("diffusers_unet2d_4_levels", "diffusers", skip._seeded(_unet2d),
             skip._images(2, 3, 32, torch.tensor([10, 500])), skip._mse_to_zero,
             skip._diffusers_switch),
    SkipCase("diffusers_unet2d_condition_deeper", "diffusers", skip._seeded(_unet2d_condition),
             skip._condition_inputs, skip._mse_to_zero, skip._diffusers_switch),
    SkipCase("diffusers_vae", "diffusers", skip._seeded(_vae), skip._images(2, 3, 32),
             skip._mse_to_zero, skip._diffusers_switch),
    *(_images(f"timm_{name}", "timm", _timm(name, **kwargs), size)
      for name, size, kwargs in _TIMM_MODELS),
    _images("tv_googlenet", "torchvision",
            _torchvision("googlenet", aux_logits=False, init_weights=True), 64, _logits_loss),
    _images("tv_shufflenet_v2_x0_5", "torchvision", _torchvision("shufflenet_v2_x0_5"), 64),
    _images("tv_deeplabv3_mobilenet_v3", "torchvision", _deeplab, 64, _segmentation_loss),
)


def _same_step(case: SkipCase, plan: autockpt.Plan, least: nn.Module, mode: str) -> str:
    args, kwargs = case.inputs()
    try:
        if mode == "reentrant":
            assert_same_step_in_float64(case.build, plan, skip._loss(case), args, kwargs,
                                        what=case.name, seed=skip.STEP_SEED)
        else:
            expected = train_step(case.build(), skip._loss(case), args, kwargs,
                                  seed=skip.STEP_SEED)
            assert_same_step(train_step(least, skip._loss(case), args, kwargs,
                                        seed=skip.STEP_SEED), expected, what=case.name,
                             allow_none=True)
    except AssertionError as err:
        return f"FAIL: {str(err).splitlines()[0]}"
    except Exception as err:  # noqa: BLE001 - a model that cannot run in float64, say
        return f"not compared: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return "same"


def check(case: SkipCase, mode: str) -> dict[str, Any]:
    """The checks of the skip-connection tests on ``case`` in ``mode``, as a row."""
    baseline = skip._peak(case, case.build())
    least = skip._apply(case, None, mode)
    plan = autockpt.plan_of(least)
    measured = skip._peak(case, least)
    row: dict[str, Any] = {
        "model": case.name, "mode": mode, "capture": plan.capture,
        "baseline_bytes": baseline, "least_bytes": measured,
        "least_share": round(measured / baseline, 3),
        "least_target": skip.LEAST[mode],
        "estimate_over_measured": round(plan.estimated_peak_bytes / measured, 3),
        "gradients": _same_step(case, plan, least, mode),
    }
    for fraction in skip.FRACTIONS:
        budget = int(baseline * fraction)
        try:
            row[f"budget_{fraction:.2f}"] = round(
                skip._peak(case, skip._apply(case, budget, mode)) / budget, 3)
        except autockpt.AutockptError as err:
            row[f"budget_{fraction:.2f}"] = f"{type(err).__name__}"
    if mode == "non_reentrant" and case.own_checkpointing is not None:
        switched = case.build()
        try:
            case.own_checkpointing(switched)
        except ValueError as err:  # a model the library's switch does not support
            row["own_checkpointing"] = str(err)
            return row
        target = skip._peak(case, switched)
        row["own_share"] = round(target / baseline, 3)
        try:
            ours = skip._apply(case, target, mode)
        except autockpt.InfeasibleBudgetError:
            row["own_checkpointing"] = "its memory is below autockpt's least"
            return row
        row["at_own_memory"] = round(skip._peak(case, ours) / target, 3)
        row["backward_flops_ours_over_own"] = round(
            skip._backward_flops(case, ours) / skip._backward_flops(case, switched), 3)
    return row


def _verdict(row: dict[str, Any]) -> str:
    problems = []
    if row["least_share"] > row["least_target"]:
        problems.append("least")
    if row["estimate_over_measured"] < 1 / (1 + skip.UNDER_ESTIMATE):
        problems.append("estimate low")
    if row["gradients"].startswith("FAIL"):
        problems.append("gradients")
    for fraction in skip.FRACTIONS:
        value = row[f"budget_{fraction:.2f}"]
        if isinstance(value, str) or value > 1 + BUDGET_SLACK:
            problems.append(f"budget {fraction:.0%}")
    if "own_checkpointing" in row and row["own_checkpointing"].startswith("its memory"):
        problems.append("own switch lower")
    if row.get("backward_flops_ours_over_own", 0) > 1:
        problems.append("more FLOPs than own")
    return ", ".join(problems) or "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="names of the cases to run (all)")
    parser.add_argument("--modes", nargs="*", default=["non_reentrant", "reentrant"])
    parser.add_argument("--json", type=Path, help="write the rows here")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cases = [c for c in CASES if not options.models or c.name in options.models]
    rows = []
    print(f"{'model':36} {'mode':13} {'capture':8} {'least':>6} {'est/meas':>8} {'grads':5} "
          f"{'50%':>6} {'75%':>6} {'own':>6} {'flops':>6}  verdict")
    for case in cases:
        for mode in options.modes:
            row = check(case, mode)
            rows.append(row)
            print(f"{case.name:36} {mode:13} {row['capture']:8} {row['least_share']:6.1%} "
                  f"{row['estimate_over_measured']:8.3f} {row['gradients'][:4]:5} "
                  + " ".join(f"{v:6.3f}" if isinstance(v, float) else f"{'-':>6}" for v in (
                      row["budget_0.50"], row["budget_0.75"], row.get("own_share"),
                      row.get("backward_flops_ours_over_own")))
                  + f"  {_verdict(row)}", flush=True)
    if options.json:
        options.json.write_text(json.dumps({"torch": torch.__version__, "rows": rows},
                                           indent=1) + "\n")


if __name__ == "__main__":
    main()
