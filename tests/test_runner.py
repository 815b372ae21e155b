"""The segment runner (autockpt/running/runner.py) gives a parameter a gradient exactly where the model
without checkpointing does: a reentrant checkpoint's outputs that no gradient reaches (read
only by a dead branch, returned and ignored by the loss) leave the parameters feeding only
them at ``None``, not at zeros (NOTE [ Outputs no gradient reached ])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

import autockpt
from autockpt.running.runner import SegmentRun, run_checkpointed
from tests.helpers import MODES, assert_same_tensors, grads_of, train_step

pytestmark = pytest.mark.usefixtures("one_thread")


class DeadReader(nn.Module):
    """``side`` is computed beside the main path and read only by ``dead``, whose sum with
    the main path nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.side = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.stack = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.dead = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.a(x))
        s = torch.tanh(self.side(h))
        h = F.relu(self.b(h))
        for layer in self.stack:
            h = F.relu(layer(h))
        _ = self.dead(s) + h
        return self.head(h)


def _build() -> DeadReader:
    torch.manual_seed(0)
    return DeadReader()


@pytest.mark.parametrize("mode", MODES)
def test_segment_output_read_only_by_a_dead_node_leaves_its_parameters_without_grad(
        mode: str) -> None:
    x = torch.randn(256, 64)
    labels = torch.arange(256) % 10

    def loss_fn(out: Tensor) -> Tensor:
        return F.cross_entropy(out, labels)

    reference, model = _build(), _build()
    transformed = autockpt.apply(model, None, example_inputs=(x,), mode=mode, loss_fn=loss_fn)
    plan = autockpt.plan_of(transformed)
    # The shape under test: a checkpointed segment that computes ``side`` and hands it on
    # beside the main path, while the dead node reading it lies after the segment.
    names = [n.name for n in torch.fx.symbolic_trace(reference).graph.nodes]
    at = {name: k for k, name in enumerate(names)}
    assert any(s.checkpointed and s.output_count == 2
               and at[s.first_node] <= at["side"] <= at[s.last_node] < at["dead"]
               for s in plan.segments), plan

    expected = train_step(reference, loss_fn, (x,), seed=1)
    got = train_step(transformed, loss_fn, (x,), seed=1)
    assert expected.grads["side.weight"] is None and expected.grads["dead.weight"] is None
    torch.testing.assert_close(got.loss, expected.loss)
    assert_same_tensors(got.grads, expected.grads, what=f"{mode} grad ", allow_none=True)


class _NoGradBack(torch.autograd.Function):
    """The identity, whose backward hands its input no gradient (``None``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> None:
        return None


def _twins() -> tuple[nn.ModuleDict, nn.ModuleDict]:
    def make() -> nn.ModuleDict:
        torch.manual_seed(3)
        return nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8),
                              "after": nn.Linear(8, 8)})

    return make(), make()


def _run(layers: nn.ModuleDict, fn: Callable[..., Any], x: Tensor, *, checkpointed: bool,
         mode: str, dummy_arg: bool) -> Any:
    if not checkpointed:
        return fn(x)
    run = SegmentRun(layers, None, "", mode, dummy_arg=dummy_arg)
    return run_checkpointed(run, fn, (x,), preserve_rng=False, buffers=())


def _step(layers: nn.ModuleDict, x: Tensor, body: Callable[[nn.ModuleDict, Tensor], Any],
          loss: Callable[[nn.ModuleDict, Any], Tensor], **how: Any
          ) -> tuple[dict[str, Tensor | None], Tensor | None]:
    x = x.detach().requires_grad_(x.requires_grad)
    out = _run(layers, lambda t: body(layers, t), x, **how)
    loss(layers, out).backward()
    return grads_of(layers), x.grad


def _outputs_with_a_number(layers: nn.ModuleDict, x: Tensor) -> tuple[Any, ...]:
    return layers["used"](x), 7, layers["unused"](x)


def _returns_input_too(layers: nn.ModuleDict, x: Tensor) -> tuple[Any, ...]:
    return x, layers["used"](x), layers["unused"](x)


CASES = {
    # The loss reads the first output; the third is returned and ignored.
    "ignored output": (_outputs_with_a_number,
                       lambda layers, out: layers["after"](out[0]).sum()),
    # The unused output is read only by a node whose own output nobody reads.
    "dead reader": (_outputs_with_a_number,
                    lambda layers, out: (layers["after"](out[2]), out[0].sum())[1]),
    # Every consumer hands back None: nothing reaches the checkpoint, yet its backward runs.
    "no gradient at all": (_outputs_with_a_number,
                           lambda layers, out: layers["after"](_NoGradBack.apply(out[0])).sum()),
    # The output depends on nothing that requires grad; the trainable op inside is dead
    # (torch's reentrant backward raised "none of output has requires_grad=True").
    "nothing to differentiate": (lambda layers, x: (layers["unused"](x), torch.ones(4, 8))[1],
                                 lambda layers, out: layers["after"](out).sum()),
    # An input handed back as it is, and unread, beside a used output.
    "input returned as is": (_returns_input_too,
                             lambda layers, out: out[1].square().sum()),
    # A single tensor, used.
    "single output": (lambda layers, x: layers["used"](x),
                      lambda layers, out: out.sum()),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("inputs_require_grad", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_runner_gives_grads_exactly_where_the_plain_function_does(
        case: str, inputs_require_grad: bool, mode: str) -> None:
    body, loss = CASES[case]
    x = torch.randn(4, 8).requires_grad_(inputs_require_grad)
    plain_layers, layers = _twins()
    want, want_x = _step(plain_layers, x, body, loss, checkpointed=False, mode=mode,
                         dummy_arg=False)
    got, got_x = _step(layers, x, body, loss, checkpointed=True, mode=mode,
                       dummy_arg=not inputs_require_grad)
    assert_same_tensors(got, want, what=f"{case} grad ", allow_none=True)
    if want_x is None:
        assert got_x is None
    else:
        torch.testing.assert_close(got_x, want_x)


def test_an_output_modified_in_place_after_the_segment_still_trains() -> None:
    """The runner adds no Function around the outputs: an in-place op on one after the
    checkpoint is allowed, as on torch's own checkpoint output."""
    plain_layers, layers = _twins()

    def body(mods: nn.ModuleDict, x: Tensor) -> tuple[Tensor, Tensor]:
        return mods["used"](x), mods["unused"](x)

    def loss(mods: nn.ModuleDict, out: tuple[Tensor, Tensor]) -> Tensor:
        h = out[0]
        h.mul_(2)
        return h.sum()

    x = torch.randn(4, 8)
    want, _ = _step(plain_layers, x, body, loss, checkpointed=False, mode="reentrant",
                    dummy_arg=False)
    got, _ = _step(layers, x, body, loss, checkpointed=True, mode="reentrant", dummy_arg=True)
    assert want["unused.weight"] is None
    assert_same_tensors(got, want, what="grad ", allow_none=True)
