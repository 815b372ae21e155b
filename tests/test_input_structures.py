"""Example inputs of any structure: a dict inside the positional arguments, a list of tensors,
nested dicts with Python numbers, ``None``, a dataclass and a ``ModelOutput``-like mapping.

Each works in every public function that takes example inputs (``plan``, ``apply``,
``measure``, ``diagnose``, ``memory_curves``), and the transformed model trains to the same
gradients as an untransformed twin. A nested input of another shape (a new batch size inside the
dict) is a new input signature, planned again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.runtime import signature_key
from tests.helpers import assert_same_step, train_step

WIDTH = 64


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(6)
                                      for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
        self.head = nn.Linear(WIDTH, 10)

    def run(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(h))


class DictBatch(_Body):
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.run(batch["x"] * batch["scale"])


class TensorList(_Body):
    def forward(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return self.run(parts[0] + parts[1])


class NestedDict(_Body):
    def forward(self, batch: dict[str, Any], mask: torch.Tensor | None = None) -> torch.Tensor:
        h = batch["inputs"]["x"] + batch["extra"][0] * batch["weight"]
        return self.run(h if mask is None else h * mask)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    noise: torch.Tensor
    name: str = "train"


class DataclassBatch(_Body):
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.run(batch.x + batch.noise)


class Output(collections.OrderedDict):  # what transformers' ModelOutput is, as far as a model sees
    pass


class MappingBatch(_Body):
    def forward(self, batch: Output) -> torch.Tensor:
        return self.run(batch["hidden"])


def _x(batch: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(seed))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "dict_in_tuple": (DictBatch, lambda: ({"x": _x(), "scale": _x(seed=2)},)),
    "list_of_tensors": (TensorList, lambda: ([_x(), _x(seed=2)],)),
    "nested_dict_with_numbers_and_none": (
        NestedDict, lambda: ({"inputs": {"x": _x()}, "extra": [_x(seed=2)], "weight": 0.5},
                             None)),
    "dataclass": (DataclassBatch, lambda: (Batch(_x(), _x(seed=2)),)),
    "model_output_like_mapping": (MappingBatch, lambda: (Output(hidden=_x()),)),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().train()


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, torch.arange(logits.shape[0]) % 10)


@pytest.mark.parametrize("name", CASES)
def test_every_public_function_takes_the_inputs(name: str) -> None:
    args = CASES[name][1]()
    baseline = autockpt.measure(_build(name), args, loss_fn=_loss).peak_activation_bytes
    plan = autockpt.plan(_build(name), budget_mb=None, example_inputs=args, loss_fn=_loss)
    assert plan.segments, f"{name}: nothing checkpointed\n{plan}"
    assert plan.min_peak_bytes < plan.baseline_peak_bytes

    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(_build(name), budget_mb=None, example_inputs=args,
                                     loss_fn=_loss)
    expected = train_step(_build(name), _loss, args, seed=7)
    assert_same_step(train_step(transformed, _loss, args, seed=7), expected, what=f"{name} ")
    measured = autockpt.measure(transformed, args, loss_fn=_loss).peak_activation_bytes
    assert measured < baseline

    report = autockpt.diagnose(_build(name), args, loss_fn=_loss)
    assert not report.findings, report
    curves = autockpt.memory_curves(_build(name), args, loss_fn=_loss)
    assert curves.checkpointed_peak_bytes < curves.baseline_peak_bytes


def test_a_new_shape_inside_a_dict_is_planned_again() -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        model = autockpt.apply(_build("dict_in_tuple"), budget_mb=None,
                               example_inputs=({"x": _x(), "scale": _x(seed=2)},), loss_fn=_loss)
    first = autockpt.plan_of(model)
    model({"x": _x(128), "scale": _x(128, seed=2)})
    again = autockpt.plan_of(model)
    assert again is not first
    assert again.baseline_peak_bytes > first.baseline_peak_bytes


def test_signature_key_sees_inside_containers() -> None:
    def key(value: Any) -> tuple[Any, ...]:
        return signature_key({"batch": value})

    x = torch.zeros(2, 3)
    assert key({"x": x}) == key({"x": torch.ones(2, 3)})
    assert key({"x": x}) != key({"x": torch.zeros(4, 3)})
    assert key({"x": x}) != key({"y": x})
    assert key([x, None]) != key([x, x])
    assert key(Batch(x, x)) != key(Batch(x, x, name="eval"))
    assert key((x, 1)) != key((x, 2))
