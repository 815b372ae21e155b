"""Inputs that arrive through the forward's ``**kwargs`` are inputs of the capture: tensors
as graph inputs, Python values as part of the input signature (a new value plans again).
torch.fx cannot trace them and says so; torch.export takes them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autockpt
from tests.helpers import MODES, assert_same_tensors, grads_of


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        scale = kwargs.get("scale")
        for layer in self.layers:
            x = torch.relu(layer(x))
            if isinstance(scale, torch.Tensor):
                x = x * scale
        if kwargs.get("double", False):
            x = x * 2
        return x


CALLS = [{}, {"scale": "tensor"}, {"scale": "tensor", "double": True},
         {"scale": "tensor", "double": False}]


@pytest.mark.parametrize("mode", MODES)
def test_kwargs_through_var_keyword_train_like_the_original(mode: str) -> None:
    torch.manual_seed(0)
    reference = Scaled()
    model = copy.deepcopy(reference)
    transformed = autockpt.apply(model, None, mode=mode)
    x = torch.randn(64, 32)
    scale = torch.rand(32, requires_grad=True)
    for call in CALLS:
        kwargs = {k: scale if v == "tensor" else v for k, v in call.items()}
        for net in (reference, transformed):
            net.zero_grad(set_to_none=True)
            scale.grad = None
            net(x, **kwargs).square().mean().backward()
            if net is reference:
                expected = grads_of(reference)
                expected_scale = scale.grad
        plan = autockpt.plan_of(transformed)
        assert plan.segments, call
        assert_same_tensors(grads_of(transformed), expected, what=str(call))
        if expected_scale is None:
            assert scale.grad is None, call
        else:
            torch.testing.assert_close(scale.grad, expected_scale)
        assert (call.get("scale") is None) == ("scale=" not in plan.input_signature)


def test_fx_names_the_keywords_it_cannot_trace() -> None:
    x, scale = torch.randn(4, 32), torch.rand(32)
    with pytest.raises(autockpt.TraceError, match=r"takes scale through \*\*kwargs"):
        autockpt.plan(Scaled(), (x,), example_kwargs={"scale": scale}, capture="fx")
    plan = autockpt.plan(Scaled(), (x,), example_kwargs={"scale": scale})
    assert plan.capture == "export" and "scale through **kwargs" in plan.capture_reason
