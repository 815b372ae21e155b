"""Models whose skip connections span most of the graph, written here: a UNet with
concatenated skips and an HRNet-like network whose two resolutions exchange features in
every stage. Small enough for CI on a CPU.

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
