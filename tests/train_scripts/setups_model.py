"""The small model the training-setup tests train: residual blocks with LayerNorm, dropout
and BatchNorm. Imported by tests/test_training_setups.py and by the distributed worker, so
both build the very same model."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, DEPTH, BATCH, IN, OUT = 32, 6, 32, 16, 4


class Block(nn.Module):
    """x + BN(fc2(dropout(GELU(fc1(LN(x)))))); without ``bn``, no BN."""

    def __init__(self, width: int, p: float, bn: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * width, width)
        self.bn = nn.BatchNorm1d(width) if bn else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.fc2(self.drop(self.act(self.fc1(self.ln(x))))))


class ResidualNet(nn.Module):
    def __init__(self, p: float = 0.1, bn: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, p, bn) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(p: float = 0.1, bn: bool = True) -> ResidualNet:
    """Seeded: two calls give identical twins. ``p`` is the dropout probability."""
    torch.manual_seed(0)
    return ResidualNet(p, bn)


def batch(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(seed))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def checkpointed(model: nn.Module, mode: str, fraction: float | None = 0.4,
                 keep_whole: str | tuple[str, ...] = ()) -> nn.Module:
    """``autockpt.apply`` at ``fraction`` of the estimated peak without checkpointing (None:
    the least memory reachable); asserts that the plan checkpoints several segments, so a
    test using it can fail."""
    import autockpt

    x = batch(0)
    baseline = autockpt.plan(model, (x,), mode=mode, keep_whole=keep_whole).baseline_peak_bytes
    budget = None if fraction is None else fraction * baseline / 2**20
    transformed = autockpt.apply(model, budget, example_inputs=(x,), mode=mode,
                                 keep_whole=keep_whole)
    segments = len(autockpt.plan_of(transformed).segments)
    assert segments >= 2, f"only {segments} checkpointed segment(s) at {fraction}"
    return transformed
