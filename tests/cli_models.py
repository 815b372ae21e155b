"""Small models for the command-line and picture tests, named by ``tests.cli_models:NAME``
or ``tests/cli_models.py:NAME`` on the command line. Each builds in milliseconds and runs a
training step in a few milliseconds on a CPU."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Sequential:
    """Sixteen ``Linear(128, 128)`` + ``ReLU`` layers; input ``8x128``."""
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers)


class TinyLM(nn.Module):
    """Token ids in, logits out: an embedding, four residual MLP blocks and a head.
    Input ``4x16:int64`` (ids below 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            for _ in range(4)
        )
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class ReentrantOnInput(nn.Module):
    """The classic pitfall, written by hand: a reentrant checkpoint right after the raw input,
    so the first layer's weights get no gradient. Input ``8x32``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.rest = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.rest(checkpoint(self.first, x, use_reentrant=True))


class TwoInputs(nn.Module):
    """``forward(x, y)``; inputs ``4x32`` and ``4x32``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + y)


def not_a_module() -> int:
    """A factory that returns something else than a module."""
    return 42


def needs_arguments(width: int) -> nn.Module:
    """A factory that cannot be called without arguments."""
    return nn.Linear(width, width)


def raises() -> nn.Module:
    """A factory that fails."""
    raise RuntimeError("the weights file is missing")
