"""Models whose skip connections span most of the graph: written here, a UNet with
concatenated skips and an HRNet-like network whose two resolutions exchange features in
every stage; built from small configs, diffusers' ``UNet2DModel`` and ``UNet2DConditionModel``,
torchvision's DenseNet-121, Hugging Face T5, BART, M2M100 (with its LayerDrop, which no graph
rung captures) and Whisper (a tied decoder embedding read after the encoder). Small enough for CI on a CPU; the tests
(tests/models/test_skip_connections.py) and the GPU check (benchmarks/gpu_check.py) build the
same models, with inputs of their own sizes.

This module deliberately does not import autockpt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ConvBlock(nn.Module):
    """Two 3x3 convolutions, each followed by BatchNorm and ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class UNet(nn.Module):
    """Encoder, bottleneck and decoder; each decoder level concatenates the encoder's output
    at the same resolution."""

    def __init__(self, channels: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inc = ConvBlock(3, channels)
        self.downs = nn.ModuleList()
        self.upsample = nn.ModuleList()
        self.ups = nn.ModuleList()
        width = channels
        for _ in range(depth):
            self.downs.append(ConvBlock(width, 2 * width))
            width *= 2
        for _ in range(depth):
            self.upsample.append(nn.ConvTranspose2d(width, width // 2, 2, stride=2))
            self.ups.append(ConvBlock(width, width // 2))
            width //= 2
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inc(x)
        skips = [x]
        for down in self.downs:
            x = down(F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for upsample, up in zip(self.upsample, self.ups):
            x = up(torch.cat([upsample(x), skips.pop()], dim=1))
        return self.out(x)


class Residual(nn.Module):
    """``x + conv(relu(norm(conv(x))))``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.norm(self.conv1(x))))


class Exchange(nn.Module):
    """One stage: each resolution runs two residual units, then the high resolution gets the
    low one upsampled and the low one gets the high one strided down."""

    def __init__(self, high: int, low: int) -> None:
        super().__init__()
        self.high = nn.Sequential(Residual(high), Residual(high))
        self.low = nn.Sequential(Residual(low), Residual(low))
        self.down = nn.Conv2d(high, low, 3, stride=2, padding=1)
        self.up = nn.Conv2d(low, high, 1)

    def forward(self, h: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
        h, low = self.high(h), self.low(low)
        return (F.relu(h + F.interpolate(self.up(low), scale_factor=2.0)),
                F.relu(low + self.down(h)))


class HRNetLike(nn.Module):
    """Two resolutions in parallel from the stem on, exchanging features in every stage, both
    pooled into a classifier."""

    def __init__(self, high: int = 16, low: int = 32, stages: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, high, 3, padding=1)
        self.split = nn.Conv2d(high, low, 3, stride=2, padding=1)
        self.stages = nn.ModuleList(Exchange(high, low) for _ in range(stages))
        self.head = nn.Linear(high + low, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.stem(x))
        low = F.relu(self.split(h))
        for stage in self.stages:
            h, low = stage(h, low)
        return self.head(torch.cat([h.mean((2, 3)), low.mean((2, 3))], dim=1))


# The library models take no sizes: their configs are the tests' own, and a larger run
# (benchmarks/gpu_check.py) grows the batch and the resolution of the inputs instead.


def unet2d() -> nn.Module:
    """diffusers' ``UNet2DModel``: three resolutions, attention at the second."""
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
                       block_out_channels=(32, 64, 64),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                       norm_num_groups=8)


UNET2D_CONDITION_CROSS_DIM = 32
"""The width of the encoder hidden states (the text embedding) ``unet2d_condition`` reads."""


def unet2d_condition() -> nn.Module:
    """diffusers' ``UNet2DConditionModel`` (Stable Diffusion's denoiser) with cross-attention
    to ``UNET2D_CONDITION_CROSS_DIM``-wide encoder states on 4 latent channels."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=UNET2D_CONDITION_CROSS_DIM,
                                attention_head_dim=8, norm_num_groups=8)


def densenet121(classes: int = 10) -> nn.Module:
    """torchvision's DenseNet-121, no weights."""
    import torchvision

    return torchvision.models.densenet121(num_classes=classes)


SEQ2SEQ_VOCAB = 512
"""The vocabulary of ``t5`` and ``bart``: token ids are drawn below it."""


def t5() -> nn.Module:
    """Hugging Face T5 (4 + 4 layers, width 64), its dropout 0.1."""
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=SEQ2SEQ_VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.1,
        use_cache=False))


def bart() -> nn.Module:
    """Hugging Face BART (3 + 3 layers, width 64), its dropout 0.1."""
    import transformers

    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=SEQ2SEQ_VOCAB, d_model=64, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.1, use_cache=False))


def m2m100() -> nn.Module:
    """Hugging Face M2M100 (NLLB's architecture; 2 + 2 layers, width 64) with its default
    LayerDrop (0.05): a layer is skipped at random in training, so no graph can be captured
    and autockpt checkpoints whole layers (the modules rung)."""
    import transformers

    return transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
        vocab_size=SEQ2SEQ_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.1, use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2))


WHISPER_MEL_BINS = 16
"""The mel bins of ``whisper``'s input features."""


def whisper() -> nn.Module:
    """Hugging Face Whisper (2 + 2 layers, width 64): a convolutional encoder over audio
    features, and a decoder whose token embedding its head reads again."""
    import transformers

    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=SEQ2SEQ_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=WHISPER_MEL_BINS, max_source_positions=32,
        max_target_positions=64, dropout=0.1, use_cache=False, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2))
