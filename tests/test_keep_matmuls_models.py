"""Segments that keep their matmuls, on models (NOTE [ Keep the expensive, recompute the
cheap ] in autockpt.ops.kept): asked for the memory of torch's selective op policy on every
block, autockpt meets it measured, at no more FLOPs; its estimate is the measured peak; the
gradients, dropout and BatchNorm statistics are those of an untouched twin; the printed plan
says what each segment keeps."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

import autockpt
from autockpt.ops.kept import is_kept, keep_context
from tests.helpers import assert_same_step, assert_same_tensors, grads_of, train_step

VOCAB, LENGTH = 512, 256


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("causal", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p.view(b, t, self.heads, -1).transpose(1, 2)
                   for p in self.qkv(self.norm1(x)).split(d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        att = scores.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        x = x + self.drop(self.proj((self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class Decoder(nn.Module):
    """A small GPT-style decoder: the loss stays outside, as ``loss_fn``."""

    def __init__(self, blocks: int = 3, dim: int = 128, heads: int = 2) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(LENGTH, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


_HAND_KEPT = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten.bmm.default]


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _HAND_KEPT else CheckpointPolicy.PREFER_RECOMPUTE


class _OpPolicy(nn.Module):
    """torchtitan's selective op policy, written by hand around one block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(_policy))


def _step_flops(model: nn.Module, loss_fn: Any, x: torch.Tensor) -> int:
    torch.manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def decoder_case() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Decoder()
    x = torch.randint(0, VOCAB, (1, LENGTH))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), x.flatten())

    by_hand = copy.deepcopy(model)
    by_hand.blocks = nn.ModuleList(_OpPolicy(b) for b in by_hand.blocks)
    return {
        "model": model, "x": x, "loss_fn": loss_fn,
        "none": autockpt.measure(model, x, loss_fn=loss_fn).peak_activation_bytes,
        "none_flops": _step_flops(model, loss_fn, x),
        "by_hand": autockpt.measure(by_hand, x, loss_fn=loss_fn).peak_activation_bytes,
        "by_hand_flops": _step_flops(by_hand, loss_fn, x),
    }


def _applied(case: dict[str, Any], budget_bytes: float) -> nn.Module:
    return autockpt.apply(copy.deepcopy(case["model"]), budget_mb=budget_bytes / 2**20,
                          example_inputs=(case["x"],), loss_fn=case["loss_fn"])


def test_at_the_op_policy_memory_no_matmul_runs_twice(decoder_case: dict[str, Any]) -> None:
    case = decoder_case
    assert case["by_hand"] < 0.9 * case["none"]  # the op policy saves memory here
    assert case["by_hand_flops"] == case["none_flops"]  # and recomputes no matmul
    applied = _applied(case, case["by_hand"])
    plan = autockpt.plan_of(applied)
    assert any(s.keeps for s in plan.segments), plan
    assert all(s.kept_ops > 0 and s.kept_bytes > 0 for s in plan.segments if s.keeps)
    measured = autockpt.measure(applied, case["x"], loss_fn=case["loss_fn"])
    assert measured.peak_activation_bytes <= case["by_hand"] * 1.05
    assert abs(plan.estimated_peak_bytes - measured.peak_activation_bytes) <= (
        0.01 * measured.peak_activation_bytes)
    assert _step_flops(applied, case["loss_fn"], case["x"]) <= case["by_hand_flops"]
    assert "keeps" in str(plan) and "matmul/conv output" in str(plan)


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_keeping_plans_train_like_the_twin(decoder_case: dict[str, Any],
                                           fraction: float) -> None:
    """Gradients and loss equal to the untouched twin's with dropout on (the recompute
    draws the same masks), and at 70% of no checkpointing, FLOPs within 3% of none."""
    case = decoder_case
    budget = fraction * case["none"]
    applied = _applied(case, budget)
    plan = autockpt.plan_of(applied)
    assert any(s.keeps for s in plan.segments), plan
    measured = autockpt.measure(applied, case["x"], loss_fn=case["loss_fn"])
    assert measured.peak_activation_bytes <= budget * 1.05
    if fraction == 0.7:
        assert (_step_flops(applied, case["loss_fn"], case["x"])
                <= 1.03 * case["none_flops"])
    twin = copy.deepcopy(case["model"])
    for seed in (1, 2):
        assert_same_step(train_step(applied, case["loss_fn"], (case["x"],), seed=seed),
                         train_step(twin, case["loss_fn"], (case["x"],), seed=seed))


def test_reentrant_plans_keep_nothing(decoder_case: dict[str, Any]) -> None:
    case = decoder_case
    plan = autockpt.plan(case["model"], (case["x"],), budget_mb=0.7 * case["none"] / 2**20,
                         loss_fn=case["loss_fn"], mode="reentrant")
    assert plan.segments and not any(s.keeps for s in plan.segments)


def test_the_profile_counts_the_kept_ops() -> None:
    """Per node, the bytes, FLOPs and count of the kept ops' outputs: a linear layer's
    product, and nothing for a norm."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    plan_nodes = autockpt.plan(net, (torch.randn(4, 16),))
    assert plan_nodes is not None
    from autockpt.capturing.trace import trace
    from autockpt.profiling.profile import profile

    x = torch.randn(4, 16)
    nodes = {n.name: n for n in profile(trace(net, (x,)), {"input": x}).nodes}
    linear = nodes["_0"]
    assert (linear.kept_ops, linear.kept_bytes, linear.kept_flops) == (1, 4 * 32 * 4,
                                                                       2 * 4 * 16 * 32)
    assert linear.ops == 1  # the addmm; the transpose of the weight is a view
    norm = nodes["_1"]
    assert (norm.kept_ops, norm.kept_bytes, norm.kept_flops) == (0, 0, 0)
    assert norm.ops >= 1


def test_keep_context_keeps_only_the_listed_ops() -> None:
    assert is_kept(torch.ops.aten.addmm.default) and is_kept(torch.ops.aten.convolution.default)
    assert not is_kept(torch.ops.aten.gelu.default)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with FlopCounterMode(display=False) as counter:
        checkpoint(lambda v: F.gelu(v @ w), x, use_reentrant=False,
                   context_fn=keep_context).sum().backward()
    # forward mm, and backward's one mm for w (x needs no gradient): no mm recomputed
    assert counter.get_total_flops() == 2 * (2 * 4 * 8 * 8)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (16, 16, 32, 32):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width),
                       nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_a_cnn_that_keeps_its_convolutions_updates_batchnorm_once() -> None:
    """A plan whose segments keep their convolutions (set by hand: on this net the planner
    finds segments whose recompute stops before a convolution cheaper) recomputes only the
    BatchNorms and ReLUs, whose running statistics move once per step, as the twin's."""
    torch.manual_seed(0)
    model = _ConvNet()
    x = torch.randn(4, 3, 32, 32)
    target = torch.randint(0, 10, (4,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    plan = autockpt.plan(model, (x,), budget_mb=None, loss_fn=loss_fn)
    assert plan.segments and all(s.buffers for s in plan.segments)
    keeping = dataclasses.replace(plan, segments=tuple(
        dataclasses.replace(s, keeps=True) for s in plan.segments))
    applied = autockpt.apply(copy.deepcopy(model), plan=keeping)
    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        step = train_step(applied, loss_fn, (x,), seed=1)
    # No convolution runs twice (the twin's FLOPs counted on a copy: a step moves statistics).
    assert counter.get_total_flops() == _step_flops(copy.deepcopy(model), loss_fn, x)
    assert_same_step(step, train_step(twin, loss_fn, (x,), seed=1))
    assert_same_step(train_step(applied, loss_fn, (x,), seed=2),
                     train_step(twin, loss_fn, (x,), seed=2))


def test_keeping_segments_compile_without_graph_breaks(decoder_case: dict[str, Any]) -> None:
    """Under torch.compile (aot_eager) a plan whose segments keep their matmuls compiles in one
    graph and trains like the twin, dropout included."""
    case = decoder_case
    applied = _applied(case, case["by_hand"])
    assert any(s.keeps for s in autockpt.plan_of(applied).segments)
    torch._dynamo.reset()
    compiled = torch.compile(applied, backend="aot_eager")
    twin = copy.deepcopy(case["model"])
    applied.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    case["loss_fn"](compiled(case["x"])).backward()
    expected = train_step(twin, case["loss_fn"], (case["x"],), seed=3)
    assert_same_tensors(grads_of(applied), expected.grads, what="compiled grad ")
    explained = torch._dynamo.explain(applied)(case["x"])
    assert explained.graph_break_count == 0, explained.break_reasons
