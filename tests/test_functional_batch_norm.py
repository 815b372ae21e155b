"""BatchNorm written as ``F.batch_norm`` on buffers (as timm's ``BatchNormAct2d`` does) is
traced through, not a leaf module. The op it reaches, ``aten.native_batch_norm``, updates the
running statistics without declaring it in its schema; the profile must still see the write,
or a recompute updates them a second time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt


class FunctionalBN(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, 0.1, 1e-5)


class ConvStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8 if i else 3, 8, 3, padding=1) for i in range(6))
        self.norms = nn.ModuleList(FunctionalBN(8) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = torch.relu(norm(conv(x)))
        return x


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_running_statistics_are_updated_once(mode: str) -> None:
    torch.manual_seed(0)
    model, reference = ConvStack(), ConvStack()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 16, 16)
    transformed = autockpt.apply(model, None, example_inputs=(x,), mode=mode)
    plan = autockpt.plan_of(transformed)
    assert any(seg.buffers for seg in plan.segments)
    transformed(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buf, ref, msg=lambda m, name=name: f"{name}: {m}")
