"""A parameter read inside a checkpointed segment and again after it.

fx places a ``get_attr`` node where forward first reads the attribute, so a segment can hold
the ``get_attr`` of a parameter that a later stage uses too. The segment must not return the
parameter: a reentrant checkpoint's autograd Function would take the Parameter as its own
output and give it the checkpoint's backward as ``grad_fn``, and backward then re-entered that
checkpoint without end (found on timm's ViT: ``blocks.8.norm2.weight``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from tests.helpers import assert_same_tensors, grads_of


class SharedNorm(nn.Module):
    """Eight Linear-ReLU layers; one LayerNorm's weight and bias are used mid-way and at the
    end."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.norm_w = nn.Parameter(torch.full((64,), 1.5))
        self.norm_b = nn.Parameter(torch.full((64,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == 3:
                x = F.layer_norm(x, (64,), self.norm_w, self.norm_b)
        return F.layer_norm(x, (64,), self.norm_w, self.norm_b)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_parameter_stays_a_leaf_and_gets_its_gradient(mode: str) -> None:
    torch.manual_seed(0)
    model = SharedNorm()
    reference = SharedNorm()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 64)
    transformed = autockpt.apply(model, None, example_inputs=(x,), mode=mode)
    assert autockpt.plan_of(transformed).segments

    out = transformed(x)
    # Checked before backward: with the parameter as a segment output, backward recursed.
    assert model.norm_w.is_leaf and model.norm_w.grad_fn is None
    assert model.norm_b.is_leaf and model.norm_b.grad_fn is None
    out.pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert_same_tensors(grads_of(model), grads_of(reference))
