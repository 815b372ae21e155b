"""Benchmark models, built offline from code (no weights).

Every model is a :class:`Blocks` model: ``pre`` (stem or embedding), a list of ``blocks`` that
each take and return one tensor, and ``post`` (head). That is the shape hand-written
checkpointing needs, so each alternative can be applied the way users apply it:

* ``every``: ``checkpoint(block, x, use_reentrant=False)`` around every ``every``-th block,
  as Hugging Face's and timm's ``gradient_checkpointing`` do for every block;
* ``sequential``: ``checkpoint_sequential`` over the blocks with a number of segments.

Each model also names the loss it is trained with (:attr:`BenchModel.loss`), and
:func:`make_loss` builds it with fixed targets, so that every method is measured, timed and
planned on the step a user really runs rather than on ``output.sum()``, whose backward sends
only a broadcast scalar into the output.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


class Blocks(nn.Module):
    """``post(blocks(pre(x)))``, with optional hand-written checkpointing of the blocks."""

    def __init__(self, pre: nn.Module, blocks: list[nn.Module], post: nn.Module) -> None:
        super().__init__()
        self.pre = pre
        self.blocks = nn.ModuleList(blocks)
        self.post = post
        self.every = 0  # checkpoint every n-th block (0: none)
        self.segments = 0  # checkpoint_sequential segments (0: none)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        if self.segments:
            x = checkpoint_sequential(nn.Sequential(*self.blocks), self.segments, x,
                                      use_reentrant=False)
        else:
            for i, block in enumerate(self.blocks):
                if self.every and i % self.every == 0 and self.training:
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
        return self.post(x)


def mlp72() -> Blocks:
    """The classic: 71 ``Linear(1000, 1000)`` + ReLU layers and a ``Linear(1000, 100)``."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(1000, 1000), nn.ReLU())
                               for _ in range(71)]
    return Blocks(nn.Identity(), blocks, nn.Linear(1000, 100))


def _dropout(p: float) -> nn.Dropout | None:
    """A dropout of ``p``, or None for none: a model without dropout keeps the graph it had
    (no node that does nothing)."""
    return nn.Dropout(p) if p else None


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        # Dropout on the attention weights happens inside the fused kernel: its random
        # numbers are the recompute's to draw again.
        extra = {"dropout_p": self.dropout if self.training else 0.0} if self.dropout else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, **extra)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, both residual, with GPT-2's
    dropout on both residual branches when ``dropout`` is not 0."""

    def __init__(self, dim: int, heads: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads, causal, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.attn(self.norm1(x))
        x = x + (branch if self.drop is None else self.drop(branch))
        branch = self.mlp(self.norm2(x))
        return x + (branch if self.drop is None else self.drop(branch))


class _TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, length: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(1, length, dim))
        self.drop = _dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[:, : ids.shape[1]]
        return x if self.drop is None else self.drop(x)


def gpt(layers: int = 12, dim: int = 256, heads: int = 4, vocab: int = 2048, length: int = 128,
        dropout: float = 0.0) -> Blocks:
    """A GPT-style decoder: token and position embeddings, causal blocks, tied-free LM head;
    ``dropout`` where GPT-2 has it (embeddings, attention weights, residual branches)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [TransformerBlock(dim, heads, causal=True, dropout=dropout)
                               for _ in range(layers)]
    return Blocks(_TokenEmbedding(vocab, dim, length, dropout), blocks,
                  nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)))


class _Patches(nn.Module):
    def __init__(self, image: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.positions


class _ClassHead(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, 0]))


def vit(layers: int = 12, dim: int = 192, heads: int = 3, image: int = 64, patch: int = 8
        ) -> Blocks:
    """A ViT with ViT-Tiny's width and depth (192, 12 blocks, 3 heads) on 64x64 images."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [TransformerBlock(dim, heads, causal=False) for _ in range(layers)]
    return Blocks(_Patches(image, patch, dim), blocks, _ClassHead(dim, 100))


def resnet50() -> Blocks:
    """torchvision's ResNet-50 (no weights), its 16 bottlenecks as the blocks."""
    import torchvision  # optional: needs a torch that torchvision's build matches

    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None)
    pre = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    blocks = [b for layer in (net.layer1, net.layer2, net.layer3, net.layer4) for b in layer]
    return Blocks(pre, blocks, nn.Sequential(net.avgpool, nn.Flatten(), net.fc))


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model, the batch it is measured with and the loss it is trained with."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], torch.Tensor]
    loss: str
    """A key of :data:`LOSSES`: every method on this model uses this loss."""
    alternatives: Callable[[nn.Module], list[tuple[str, nn.Module, str]]] | None = None
    """The methods autockpt is compared with, for a model that is not a :class:`Blocks`
    (``compare.py`` builds those of a Blocks model itself)."""


class DiffusersUNet(nn.Module):
    """diffusers' ``UNet2DModel`` (the denoiser of DDPM) at fixed timesteps, so that the
    benchmark's ``model(x)`` is one denoising training step's forward; the issue's size:
    four resolutions, attention at the third, batch 4 at 32x32."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
            block_out_channels=(32, 64, 64, 64), norm_num_groups=8,
            down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        timesteps = torch.arange(x.shape[0], device=x.device) * 100
        return self.unet(x, timesteps).sample


def unet2d() -> DiffusersUNet:
    torch.manual_seed(0)
    return DiffusersUNet().train()


def diffusers_alternatives(base: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """No checkpointing, and diffusers' own ``enable_gradient_checkpointing()``."""
    switched = copy.deepcopy(base)
    switched.unet.enable_gradient_checkpointing()  # type: ignore[union-attr, operator]
    return [("no checkpointing", base, ""),
            ("diffusers enable_gradient_checkpointing()", switched, "")]


MODELS: dict[str, BenchModel] = {
    # mlp72's Linear(1000, 100) head is a 100-way classifier head.
    "mlp72": BenchModel("mlp72", mlp72, lambda: torch.randn(16, 1000), "cross_entropy"),
    # Next-token prediction: every position's logits against a token.
    "gpt": BenchModel("gpt", gpt, lambda: torch.randint(0, 2048, (8, 128)), "cross_entropy"),
    "vit": BenchModel("vit", vit, lambda: torch.randn(16, 3, 64, 64), "cross_entropy"),
    "resnet50": BenchModel("resnet50", resnet50, lambda: torch.randn(8, 3, 128, 128),
                           "cross_entropy"),
    # A denoiser's step: the predicted noise against a fixed noise target.
    "unet2d": BenchModel("unet2d", unet2d, lambda: torch.randn(4, 3, 32, 32), "mse",
                         alternatives=diffusers_alternatives),
}


@dataclass(frozen=True)
class BenchLoss:
    """``fn(output) -> scalar``, with fixed targets built once, and what it is in words."""

    name: str
    """The kind, a key of :data:`LOSSES` (the table's column)."""
    description: str
    """The kind with its shapes, e.g. ``cross_entropy over 2048 classes, 1024 targets``."""
    fn: Callable[[torch.Tensor], torch.Tensor]
    target: torch.Tensor
    """The fixed target ``fn`` compares with: built before the step, so not an activation."""


TARGET_SEED = 0


def _cross_entropy(output: torch.Tensor) -> BenchLoss:
    """Cross-entropy of the logits (classes in the last dimension) against fixed targets;
    a language model's ``(batch, tokens, vocab)`` logits are flattened to one row per token,
    as ``GPT2LMHeadModel`` does."""
    classes = output.shape[-1]
    rows = output.numel() // classes
    # Own generator: the same targets in every run, without moving the global RNG, whose
    # state the models' initialisation and the batches depend on.
    generator = torch.Generator().manual_seed(TARGET_SEED)
    target = torch.randint(0, classes, (rows,), generator=generator).to(output.device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, classes), target)

    return BenchLoss("cross_entropy", f"cross_entropy over {classes} classes, {rows} targets",
                     loss, target)


def _mse(output: torch.Tensor) -> BenchLoss:
    """Mean squared error against a fixed random target of the output's shape (an image or
    regression output); unlike ``sum()`` it sends an output-sized gradient into the model."""
    generator = torch.Generator().manual_seed(TARGET_SEED)
    target = torch.randn(output.shape, generator=generator, dtype=output.dtype).to(output.device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    return BenchLoss("mse", f"mse against a fixed {tuple(output.shape)} target", loss, target)


LOSSES: dict[str, Callable[[torch.Tensor], BenchLoss]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
}
"""Loss builders: given an example output, the loss with its targets made to fit it."""


def make_loss(spec: BenchModel, model: nn.Module, x: torch.Tensor) -> BenchLoss:
    """The loss of ``spec``, its targets shaped from one forward of ``model`` on ``x``.

    That forward runs in eval mode under ``no_grad``: it only needs the output's shape and
    must not update BatchNorm's running statistics before the methods are measured.
    """
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(x)
    finally:
        model.train(training)
    return LOSSES[spec.loss](output)


def sqrt_segments(model: Blocks) -> int:
    """Chen et al.'s sqrt(n) segments for ``checkpoint_sequential``."""
    return max(2, round(math.sqrt(len(model.blocks))))
