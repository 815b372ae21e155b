"""Model zoo for the autockpt test-suite.

Every entry is a :class:`ZooCase`: a deterministic model builder, a deterministic input
factory and a loss that turns the model's output (tensor, tuple or dict) into a scalar that
depends on every output element.  Tests train each model one step with and without autockpt
and compare every gradient and buffer; :func:`clone_case` builds the twins and
tests/helpers.py's ``train_step`` takes the step.

Each model is written so that ``torch.fx.symbolic_trace`` works in train mode (no Python
control flow on tensor values; masks are built with tensor ops) and each one exercises a
particular pitfall for a checkpoint planner / rewriter, described in its docstring and in the
case's ``notes``.

This module deliberately does not import autockpt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
from torch import Tensor
from torch.nn.utils import skip_init

__all__ = [
    "CASES",
    "ZooCase",
    "clone_case",
    "flatten_output",
    "get_case",
    "param_count",
]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    ``build()`` seeds the global RNG with 0 and constructs the model (in train mode);
    ``inputs()`` returns fresh ``(args, kwargs)`` from its own seeded generator;
    ``loss_fn(output)`` reduces the model's output to a scalar depending on every output.
    ``traceable`` says whether ``torch.fx.symbolic_trace(model)`` is expected to work.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Inputs]
    loss_fn: Callable[[Any], Tensor]
    traceable: bool = True
    notes: str = ""


# --------------------------------------------------------------------------------------
# Output / loss helpers
# --------------------------------------------------------------------------------------


def flatten_output(output: Any) -> list[Tensor]:
    """All tensors of a (possibly nested) tuple/list/dict output, dict keys in sorted order."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for key in sorted(output) for t in flatten_output(output[key])]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in flatten_output(item)]
    raise TypeError(f"unsupported model output type {type(output).__name__}")


def _mean_square_loss(output: Any) -> Tensor:
    """Sum over output tensors of ``mean(t**2)``: every element of every output contributes."""
    tensors = flatten_output(output)
    if not tensors:
        raise ValueError("model produced no tensor output")
    loss = tensors[0].float().pow(2).mean()
    for t in tensors[1:]:
        loss = loss + t.float().pow(2).mean()
    return loss


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def param_count(model: nn.Module) -> int:
    """Total number of parameter elements (trainable or frozen)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------
# 1. mlp72
# --------------------------------------------------------------------------------------

MLP72_WIDTH = 1000
MLP72_OUT = 100
MLP72_LINEARS = 72


def build_mlp72() -> nn.Sequential:
    """The classic deep MLP: 72 ``Linear`` layers, ReLU between them.

    Exact layout (``nn.Sequential`` with 143 children, indices in brackets)::

        [0]   Linear(1000, 1000)   [1]   ReLU
        [2]   Linear(1000, 1000)   [3]   ReLU
        ...                                  (71 Linear(1000,1000)+ReLU pairs, [0]..[141])
        [140] Linear(1000, 1000)   [141] ReLU
        [142] Linear(1000, 100)              (no activation after the last layer)

    71 * (1000*1000 + 1000) + (1000*100 + 100) = 71,171,100 parameters.

    Pitfall: a long homogeneous chain, the textbook case for sqrt(n) checkpointing: many
    equally good cut points, and memory dominated by 143 activations of shape (16, 1000).

    Initialisation: He/Kaiming-uniform weights (ReLU gain) and zero biases.  PyTorch's default
    ``Linear`` init shrinks the backward signal by about 6x in variance per layer, so after
    71 layers the first layer's gradient would be ~1e-32 - so close to float32's denormal
    range that gradient comparisons would be meaningless.  He init keeps every layer's
    gradient O(1e-2).  (``skip_init`` avoids paying for the default init first.)
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(MLP72_LINEARS - 1):
        layers.append(skip_init(nn.Linear, MLP72_WIDTH, MLP72_WIDTH))
        layers.append(nn.ReLU())
    layers.append(skip_init(nn.Linear, MLP72_WIDTH, MLP72_OUT))
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)
    return model


def inputs_mlp72() -> Inputs:
    gen = _generator(1)
    return (torch.randn(16, MLP72_WIDTH, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 2. cifar_cnn
# --------------------------------------------------------------------------------------


class CifarCNN(nn.Module):
    """A small CIFAR-10 CNN: two (conv-relu-conv-relu-maxpool) blocks, dropout, linear head.

    Pitfall: plain sequential conv net whose activations shrink (32x32 -> 16x16 -> 8x8), so
    the memory cost of cut points is very uneven, plus dropout whose RNG state has to be
    replayed exactly when a segment is recomputed.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(32 * 8 * 8, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.features(x)
        h = torch.flatten(h, 1)
        return self.head(self.dropout(h))


def build_cifar_cnn() -> nn.Module:
    torch.manual_seed(0)
    return CifarCNN()


def inputs_cifar_cnn() -> Inputs:
    gen = _generator(2)
    return (torch.randn(8, 3, 32, 32, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 3. generator
# --------------------------------------------------------------------------------------


class ResnetBlock(nn.Module):
    """CycleGAN residual block: pad-conv-IN-relu-pad-conv-IN, plus identity skip."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(channels, channels, 3, bias=False),
            nn.InstanceNorm2d(channels, affine=True),
            nn.ReLU(),
            nn.ReflectionPad2d(1),
            nn.Conv2d(channels, channels, 3, bias=False),
            nn.InstanceNorm2d(channels, affine=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class CycleGANGenerator(nn.Module):
    """A small CycleGAN-style ResNet generator (image in, image out).

    Layout: ReflectionPad2d(3) - Conv7x7(3->8) - IN - ReLU; two stride-2 Conv3x3 downsampling
    steps (8->16->32 channels, 32x32 -> 8x8, each conv-IN-ReLU, as in CycleGAN so that the
    output has the input's resolution); 3 residual blocks at 32 channels; two
    ConvTranspose2d upsampling steps (32->16->8, each convT-IN-ReLU); ReflectionPad2d(3) -
    Conv7x7(8->3) - Tanh.  Convs followed by an (affine) InstanceNorm have no bias, since the
    norm's mean subtraction would make that bias's gradient identically zero.

    Pitfall: padding layers and residual skips (a skip edge spans each block, so a cut point
    inside a block must keep the block input alive), and an hourglass activation profile
    (large at both ends, small in the middle).
    """

    def __init__(self, in_ch: int = 3, out_ch: int = 3, ngf: int = 8, n_blocks: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.ReflectionPad2d(3),
            nn.Conv2d(in_ch, ngf, 7, bias=False),
            nn.InstanceNorm2d(ngf, affine=True),
            nn.ReLU(),
        ]
        ch = ngf
        for _ in range(2):
            layers += [
                nn.Conv2d(ch, ch * 2, 3, stride=2, padding=1, bias=False),
                nn.InstanceNorm2d(ch * 2, affine=True),
                nn.ReLU(),
            ]
            ch *= 2
        layers += [ResnetBlock(ch) for _ in range(n_blocks)]
        for _ in range(2):
            layers += [
                nn.ConvTranspose2d(ch, ch // 2, 3, stride=2, padding=1, output_padding=1, bias=False),
                nn.InstanceNorm2d(ch // 2, affine=True),
                nn.ReLU(),
            ]
            ch //= 2
        layers += [nn.ReflectionPad2d(3), nn.Conv2d(ch, out_ch, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def build_generator() -> nn.Module:
    torch.manual_seed(0)
    return CycleGANGenerator()


def inputs_generator() -> Inputs:
    gen = _generator(3)
    return (torch.randn(2, 3, 32, 32, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 4. densenet_block
# --------------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-Conv3x3 producing ``growth`` new channels."""

    def __init__(self, in_ch: int, growth: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_ch)
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_ch, growth, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.relu(self.norm(x)))


class DenseBlock(nn.Module):
    """Each layer sees ``torch.cat`` of the block input and all previous layers' outputs."""

    def __init__(self, in_ch: int, n_layers: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(in_ch + i * growth, growth) for i in range(n_layers))
        self.out_channels = in_ch + n_layers * growth

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class DenseNetSmall(nn.Module):
    """Stem conv, dense block (4 layers, growth 8), transition, second dense block, head.

    Channels: stem 3->16; block1 16->48; transition BN-ReLU-Conv1x1(48->24)-AvgPool2d(2)
    (16x16 -> 8x8); block2 24->56; head BN-ReLU-global avg pool-Linear(56->10).

    Pitfall: inside a dense block every layer's output stays live until the block's final
    concatenation, so there are very few cheap cut points (essentially only the block
    boundaries / transition); the concatenations themselves are memory-hungry, gradient-free
    to recompute ops.  BatchNorm running statistics (buffers) must not be updated twice when a
    segment is recomputed.
    """

    def __init__(self, growth: int = 8, n_layers: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.block1 = DenseBlock(16, n_layers, growth)
        c1 = self.block1.out_channels
        self.transition = nn.Sequential(
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.Conv2d(c1, c1 // 2, 1, bias=False),
            nn.AvgPool2d(2),
        )
        self.block2 = DenseBlock(c1 // 2, n_layers, growth)
        c2 = self.block2.out_channels
        self.head_norm = nn.BatchNorm2d(c2)
        self.head_relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block1(self.stem(x))
        h = self.block2(self.transition(h))
        h = self.pool(self.head_relu(self.head_norm(h)))
        return self.fc(torch.flatten(h, 1))


def build_densenet_block() -> nn.Module:
    torch.manual_seed(0)
    return DenseNetSmall()


def inputs_densenet_block() -> Inputs:
    gen = _generator(4)
    return (torch.randn(4, 3, 16, 16, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 5. resnet
# --------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block; a 1x1 conv + BN shortcut when shape changes."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNetSmall(nn.Module):
    """Stem conv3x3(3->16)-BN-ReLU; stage1 2x BasicBlock(16); stage2 BasicBlock(16->32,
    stride 2, 1x1-conv shortcut) + BasicBlock(32); global avg pool; Linear(32->10).

    Pitfall: residual skips (only block boundaries are single-tensor cut points), a
    downsample block whose shortcut branch is a second parametrised path, and BatchNorm
    buffers (running stats, num_batches_tracked) that recomputation must not double-update.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.stage1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16))
        self.stage2 = nn.Sequential(BasicBlock(16, 32, stride=2), BasicBlock(32, 32))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stage2(self.stage1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(h), 1))


def build_resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNetSmall()


def inputs_resnet() -> Inputs:
    gen = _generator(5)
    return (torch.randn(4, 3, 32, 32, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 6. transformer (hand-written)
# --------------------------------------------------------------------------------------

TF_VOCAB = 64
TF_SEQ = 16
TF_DIM = 32
TF_HEADS = 4
TF_LENGTHS = (16, 13, 9, 4)  # real tokens per sequence; the rest is padding id 0


class SelfAttention(nn.Module):
    """Multi-head self-attention from Linear q/k/v, masked softmax and attention dropout."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.dim = dim
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        # pad_mask: bool (B, 1, 1, T), True where the key is padding.
        b, t = x.size(0), x.size(1)
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(pad_mask, float("-inf"))
        attn = self.attn_drop(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.dim)
        return self.proj_drop(self.proj(ctx))


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attn(LN(x), mask); x + MLP(LN(x)) with GELU and dropout."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim),
            nn.GELU(),
            nn.Linear(mlp_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), pad_mask)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token + learned position embedding, 4 pre-LN encoder blocks, final LN, vocab logits.

    The key-padding mask is computed inside ``forward`` from the raw int64 token ids
    (``ids == 0``) and passed to every block; positions come from ``torch.arange``.

    Pitfall: a part of the graph that carries no gradient (int ids -> bool mask, arange ->
    position ids) but is consumed by every block: a segment's non-differentiable inputs must
    be kept / re-supplied, and no-grad nodes should cost nothing in the plan.  Dropout (p=0.1)
    in attention and MLP requires exact RNG replay on recomputation.  Every sequence has at
    least one real token so no softmax row is fully masked.
    """

    def __init__(
        self,
        vocab: int = TF_VOCAB,
        max_len: int = TF_SEQ,
        dim: int = TF_DIM,
        heads: int = TF_HEADS,
        depth: int = 4,
        mlp_dim: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, mlp_dim, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        pad_mask = ids.eq(0).unsqueeze(1).unsqueeze(2)  # (B, 1, 1, T), no gradient
        positions = torch.arange(ids.size(1), device=ids.device).unsqueeze(0)
        h = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            h = block(h, pad_mask)
        return self.head(self.ln_f(h))


def _padded_token_ids(seed: int) -> Tensor:
    """int64 ids (4, 16) in [1, vocab) with trailing padding zeros per ``TF_LENGTHS``."""
    gen = _generator(seed)
    ids = torch.randint(1, TF_VOCAB, (len(TF_LENGTHS), TF_SEQ), generator=gen, dtype=torch.int64)
    lengths = torch.tensor(TF_LENGTHS, dtype=torch.int64)
    padding = torch.arange(TF_SEQ).unsqueeze(0) >= lengths.unsqueeze(1)
    return ids.masked_fill(padding, 0)


def build_transformer() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def inputs_transformer() -> Inputs:
    return (_padded_token_ids(6),), {}


# --------------------------------------------------------------------------------------
# 7. multi-output models
# --------------------------------------------------------------------------------------


class TwoHeadTuple(nn.Module):
    """Shared MLP trunk, two heads of different depth; returns ``(logits, regression)``.

    Pitfall: the graph has a tuple output with two leaves, and the trunk's last activation
    fans out to two branches (the planner must not assume a single output chain).
    """

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls_head = nn.Linear(64, 5)
        self.reg_head = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.trunk(x)
        return self.cls_head(h), self.reg_head(h)


class MultiOutputDict(nn.Module):
    """Returns ``{"features", "logits", "recon"}``; ``features`` is an intermediate that is
    also consumed by both heads.

    Pitfall: dict outputs, and an intermediate activation that is at the same time a model
    output and the input of later layers (it must stay live and must not be freed or
    replaced by a recomputed copy with a different identity).
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 32), nn.Tanh())
        self.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.decoder = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 20))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        features = self.encoder(x)
        return {
            "features": features,
            "logits": self.classifier(features),
            "recon": self.decoder(features),
        }


def build_multi_output_tuple() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeadTuple()


def build_multi_output_dict() -> nn.Module:
    torch.manual_seed(0)
    return MultiOutputDict()


def inputs_multi_output_tuple() -> Inputs:
    gen = _generator(7)
    return (torch.randn(8, 20, generator=gen),), {}


def inputs_multi_output_dict() -> Inputs:
    gen = _generator(8)
    return (torch.randn(8, 20, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 8. kwargs_model
# --------------------------------------------------------------------------------------


@torch.fx.wrap
def scale_if_given(x: Tensor, scale: Tensor | None) -> Tensor:
    """``x * scale``, or ``x`` when ``scale`` is None (an fx leaf, so the None check runs at
    call time instead of being baked in at trace time)."""
    return x if scale is None else x * scale


@torch.fx.wrap
def add_if_given(x: Tensor, bias: Tensor | None) -> Tensor:
    """``x + bias``, or ``x`` when ``bias`` is None (an fx leaf, see :func:`scale_if_given`)."""
    return x if bias is None else x + bias


class KwargsModel(nn.Module):
    """``forward(x, *, scale=None, bias_input=None)``; called with ``scale`` a tensor and
    ``bias_input=None``.

    Pitfall: keyword-only tensor arguments (placeholders that are not positional), one of
    them None at call time.  Branching on ``is None`` inside ``forward`` would be frozen by
    ``symbolic_trace`` (a Proxy is never None), so the optional ops live in
    ``torch.fx.wrap``-ed helpers that appear as ``call_function`` nodes taking a possibly-None
    argument: a rewriter must pass None through segment boundaries untouched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x: Tensor, *, scale: Tensor | None = None, bias_input: Tensor | None = None) -> Tensor:
        h = self.act1(self.fc1(x))
        h = scale_if_given(h, scale)
        h = self.act2(self.fc2(h))
        h = add_if_given(h, bias_input)
        return self.fc3(h)


def build_kwargs_model() -> nn.Module:
    torch.manual_seed(0)
    return KwargsModel()


def inputs_kwargs_model() -> Inputs:
    gen = _generator(9)
    x = torch.randn(4, 16, generator=gen)
    scale = torch.rand(4, 1, generator=gen) + 0.5
    return (x,), {"scale": scale, "bias_input": None}


# --------------------------------------------------------------------------------------
# 9. inplace_relu
# --------------------------------------------------------------------------------------


class InplaceBlock(nn.Module):
    """Conv-BN-ReLU(inplace)-Conv-BN, skip added in place, then ReLU(inplace)."""

    def __init__(self, ch: int, use_add_method: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.relu2 = nn.ReLU(inplace=True)
        self.use_add_method = use_add_method

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.use_add_method:  # plain Python attribute, not a tensor: fine for fx
            out.add_(x)  # traced as call_method add_
        else:
            out += x  # in place in eager; fx records it as an out-of-place add
        return self.relu2(out)


class InplaceReLUNet(nn.Module):
    """Conv stem with ReLU(inplace), two residual blocks with in-place skip adds
    (``out += x`` and ``out.add_(x)``), then an MLP head whose hidden activation is updated
    with ``h.add_(...)`` and ``nn.ReLU(inplace=True)``.

    Pitfall: in-place ops exactly where a planner would like to cut (after a block, on the
    skip add); a segment output/input that is later mutated in place would be corrupted if
    it were stashed by reference, and recomputation must reproduce the mutation.  Only
    intermediates are mutated, never the model input, and never a tensor that autograd saved
    for backward.

    The traced graph keeps ``out.add_(x)`` and ``z.add_(...)`` as ``call_method add_`` nodes
    whose *return value is unused* (later nodes read the mutated tensor); fx's
    ``Node.is_impure()`` is False for them, so ``graph.eliminate_dead_code()`` silently deletes
    them and changes the model - a rewriter must not run plain DCE.  (``out += x`` is
    recorded by fx as an out-of-place ``add``.)
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem_conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(16)
        self.stem_relu = nn.ReLU(inplace=True)
        self.block1 = InplaceBlock(16, use_add_method=False)
        self.block2 = InplaceBlock(16, use_add_method=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(16, 32)
        self.fc_skip = nn.Linear(16, 32)
        self.fc_relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem_relu(self.stem_bn(self.stem_conv(x)))
        h = self.block2(self.block1(h))
        flat = torch.flatten(self.pool(h), 1)
        z = self.fc1(flat)
        z.add_(self.fc_skip(flat))
        z = self.fc_relu(z)
        return self.fc2(z)


def build_inplace_relu() -> nn.Module:
    torch.manual_seed(0)
    return InplaceReLUNet()


def inputs_inplace_relu() -> Inputs:
    gen = _generator(10)
    return (torch.randn(4, 3, 16, 16, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 10. frozen_backbone / frozen_head
# --------------------------------------------------------------------------------------


class BackboneHead(nn.Module):
    """Conv/BN backbone producing a 32-d feature, MLP head producing 10 logits.

    With ``freeze="backbone"`` every backbone param has ``requires_grad=False``.  Pitfall: a
    segment fed only by inputs that do not require grad and holding no trainable params -
    its output carries no autograd history, so a checkpoint there is useless (and
    ``torch.utils.checkpoint`` with reentrant semantics would even drop the head's grads if
    the segment spanned it); BatchNorm buffers still update in train mode.

    With ``freeze="head"`` the head's params are frozen but gradients must still flow
    *through* it to the trainable backbone.  Pitfall: a segment whose params need no grad
    but whose input does.
    """

    def __init__(self, freeze: str) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 32),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
        if freeze == "backbone":
            self.backbone.requires_grad_(False)
        elif freeze == "head":
            self.head.requires_grad_(False)
        else:
            raise ValueError(f"freeze must be 'backbone' or 'head', got {freeze!r}")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


def build_frozen_backbone() -> nn.Module:
    torch.manual_seed(0)
    return BackboneHead(freeze="backbone")


def build_frozen_head() -> nn.Module:
    torch.manual_seed(0)
    return BackboneHead(freeze="head")


def inputs_frozen() -> Inputs:
    gen = _generator(11)
    return (torch.randn(4, 3, 16, 16, generator=gen),), {}


# --------------------------------------------------------------------------------------
# 11. transformer_encoder_layer
# --------------------------------------------------------------------------------------


class TorchEncoderStack(nn.Module):
    """Token + position embedding, 3 ``nn.TransformerEncoderLayer(d_model=32, nhead=4,
    dim_feedforward=64, dropout=0.1, batch_first=True)``, Linear head to vocab logits.

    The ``src_key_padding_mask`` is built inside ``forward`` from the token ids (``ids == 0``)
    and passed to every layer.  ``symbolic_trace``'s default tracer treats every ``torch.nn``
    module as a leaf, so each ``TransformerEncoderLayer`` (whose own forward is full of Python
    checks on the mask and fast-path conditions) would be a single opaque ``call_module``
    node; autockpt captures the model with torch.export instead (NOTE [ torch.nn containers ]).

    Pitfall: large modules torch.fx keeps opaque, a bool mask kwarg to them, and dropout
    inside them.
    """

    def __init__(
        self,
        vocab: int = TF_VOCAB,
        max_len: int = TF_SEQ,
        d_model: int = 32,
        nhead: int = 4,
        dim_feedforward: int = 64,
        depth: int = 3,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model=d_model,
                nhead=nhead,
                dim_feedforward=dim_feedforward,
                dropout=dropout,
                batch_first=True,
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        padding_mask = ids.eq(0)  # (B, T) bool, True = padding
        positions = torch.arange(ids.size(1), device=ids.device).unsqueeze(0)
        h = self.tok_emb(ids) + self.pos_emb(positions)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=padding_mask)
        return self.head(h)


def build_transformer_encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return TorchEncoderStack()


def inputs_transformer_encoder_layer() -> Inputs:
    return (_padded_token_ids(12),), {}


# --------------------------------------------------------------------------------------
# Registry and helpers
# --------------------------------------------------------------------------------------


def _case(
    name: str,
    build: Callable[[], nn.Module],
    inputs: Callable[[], Inputs],
    notes: str,
    traceable: bool = True,
) -> ZooCase:
    return ZooCase(name=name, build=build, inputs=inputs, loss_fn=_mean_square_loss, traceable=traceable, notes=notes)


CASES: tuple[ZooCase, ...] = (
    _case(
        "mlp72",
        build_mlp72,
        inputs_mlp72,
        "72 Linear layers (71x Linear(1000,1000)+ReLU, then Linear(1000,100)); long uniform chain; "
        "He init so early-layer grads are not ~1e-32.",
    ),
    _case("cifar_cnn", build_cifar_cnn, inputs_cifar_cnn, "sequential CNN, shrinking activations, dropout RNG."),
    _case("generator", build_generator, inputs_generator, "CycleGAN generator: reflection pad, InstanceNorm, residual skips, convT."),
    _case("densenet_block", build_densenet_block, inputs_densenet_block, "dense concatenations: few cut points; BN buffers."),
    _case("resnet", build_resnet, inputs_resnet, "BasicBlocks with skips and a 1x1-conv downsample shortcut; BN buffers."),
    _case(
        "transformer",
        build_transformer,
        inputs_transformer,
        "hand-written encoder; padding mask built from raw int ids inside forward, reused by all blocks; dropout.",
    ),
    _case("multi_output_tuple", build_multi_output_tuple, inputs_multi_output_tuple, "tuple output, trunk fans out to two heads."),
    _case(
        "multi_output_dict",
        build_multi_output_dict,
        inputs_multi_output_dict,
        "dict output; an intermediate is both an output and an input of later layers.",
    ),
    _case(
        "kwargs_model",
        build_kwargs_model,
        inputs_kwargs_model,
        "keyword-only tensor args, one given (scale), one None (bias_input); None handled in fx.wrap leaves.",
    ),
    _case("inplace_relu", build_inplace_relu, inputs_inplace_relu, "ReLU(inplace=True), out += x, out.add_(x), z.add_() on intermediates."),
    _case(
        "frozen_backbone",
        build_frozen_backbone,
        inputs_frozen,
        "backbone params frozen: a segment with no grad-requiring inputs or params; BN buffers still update.",
    ),
    _case("frozen_head", build_frozen_head, inputs_frozen, "head params frozen: gradients must flow through a frozen segment."),
    _case(
        "transformer_encoder_layer",
        build_transformer_encoder_layer,
        inputs_transformer_encoder_layer,
        "3x nn.TransformerEncoderLayer (opaque to fx) with src_key_padding_mask built from token ids in forward.",
    ),
)

_BY_NAME: dict[str, ZooCase] = {case.name: case for case in CASES}
assert len(_BY_NAME) == len(CASES), "duplicate case names"


def get_case(name: str) -> ZooCase:
    """The case called ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown zoo case {name!r}; known: {', '.join(_BY_NAME)}") from None


def clone_case(case: ZooCase) -> tuple[nn.Module, nn.Module]:
    """Build ``case`` twice; assert the twins have identical state_dicts and grad flags."""
    model = case.build()
    twin = case.build()
    sd_a, sd_b = model.state_dict(), twin.state_dict()
    assert list(sd_a) == list(sd_b), f"{case.name}: state_dict keys differ between builds"
    for key in sd_a:
        assert torch.equal(sd_a[key], sd_b[key]), f"{case.name}: {key} differs between builds"
    flags_a = [(n, p.requires_grad) for n, p in model.named_parameters()]
    flags_b = [(n, p.requires_grad) for n, p in twin.named_parameters()]
    assert flags_a == flags_b, f"{case.name}: requires_grad flags differ between builds"
    return model, twin
