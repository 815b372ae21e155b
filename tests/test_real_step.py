"""The budget holds for the step users run: their loss, gradient accumulation, the device.

Every figure here is measured on a real step (``autockpt.measure``) with the loss the
model is trained with, not the cheap ``sum()`` the estimate used to assume, and compared
with the plan's estimate and budget.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import MODES, apply_at_fraction, assert_same_tensors, grads_of, loop_peak_bytes
from tests.zoo import get_case

SLACK = 1 + BUDGET_SLACK
ESTIMATE_TOLERANCE = 0.05
FRACTIONS = (0.75, 0.5, 0.25, "min")


# --------------------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder with a tied embedding and a language-model head over the whole vocabulary:
    its logits and the cross-entropy's tensors are the largest activations of the step."""

    def __init__(self, vocab: int = 4096, dim: int = 64, layers: int = 4, heads: int = 4,
                 seq: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


VOCAB, SEQ, BATCH = 4096, 128, 4


def _gpt() -> tuple[nn.Module, tuple[Any, ...], Any]:
    torch.manual_seed(0)
    model = GPT(VOCAB, seq=SEQ).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return model, (ids,), loss_fn


def _image() -> tuple[nn.Module, tuple[Any, ...], Any]:
    case = get_case("generator")
    model = case.build()
    (x,), _ = case.inputs()
    x = torch.cat([x] * 4)
    target = torch.rand_like(x) * 2 - 1

    def loss_fn(image: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(image, target)

    return model, (x,), loss_fn


def _dict_output() -> tuple[nn.Module, tuple[Any, ...], Any]:
    case = get_case("multi_output_dict")
    model = case.build()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 20, generator=gen)
    labels = torch.randint(0, 4, (512,), generator=gen)

    def loss_fn(out: dict[str, torch.Tensor]) -> torch.Tensor:
        # The task loss and an auxiliary reconstruction loss, as multi-task models train.
        return F.cross_entropy(out["logits"], labels) + 0.1 * F.mse_loss(out["recon"], x)

    return model, (x,), loss_fn


MODELS = {"gpt_cross_entropy": _gpt, "image_mse": _image, "dict_aux_loss": _dict_output}


# --------------------------------------------------------------------------- loss_fn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fraction", FRACTIONS, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_the_budget_holds_with_the_users_loss(name: str, fraction: object, mode: str) -> None:
    model, args, loss_fn = MODELS[name]()
    probe, _, ckpt = apply_at_fraction(model, fraction, args, loss_fn=loss_fn, mode=mode)
    if ckpt is None:
        return
    plan = autockpt.plan_of(ckpt)
    assert plan.loss is not None and plan.loss.kind == "loss_fn"
    measured = autockpt.measure(ckpt, args, loss_fn=loss_fn).peak_activation_bytes
    assert measured <= SLACK * plan.budget_bytes, (name, fraction, mode, measured, plan.budget_bytes)
    error = abs(plan.estimated_peak_bytes - measured) / measured
    assert error <= ESTIMATE_TOLERANCE, (
        f"{name} at {fraction} ({mode}): estimated {plan.estimated_peak_bytes} B, "
        f"measured {measured} B")


def test_the_loss_is_priced_not_assumed_away() -> None:
    """The cross-entropy's log-softmax and the logits' gradient are in the estimate: the
    baseline with the real loss is far above the one with a sum, and both are exact."""
    model, args, loss_fn = _gpt()
    with_ce = autockpt.plan(model, args, loss_fn=loss_fn)
    with_sum = autockpt.plan(model, args, loss_fn="sum")
    logits_bytes = BATCH * SEQ * VOCAB * 4
    assert with_ce.loss.saved_bytes >= logits_bytes  # type: ignore[union-attr]
    assert with_ce.loss.grad_bytes == logits_bytes  # type: ignore[union-attr]
    assert with_sum.loss.grad_bytes == 0  # type: ignore[union-attr]
    assert with_ce.baseline_peak_bytes >= with_sum.baseline_peak_bytes + 2 * logits_bytes
    for plan, fn in ((with_ce, loss_fn), (with_sum, autockpt.profiling.loss.sum_loss)):
        measured = autockpt.measure(model, args, loss_fn=fn).peak_activation_bytes
        assert abs(plan.baseline_peak_bytes - measured) <= ESTIMATE_TOLERANCE * measured


def test_without_a_loss_the_estimate_is_never_optimistic() -> None:
    """No loss_fn: an output-sized gradient is assumed, which any real loss makes at least;
    the plan's header says so."""
    model, args, loss_fn = _image()
    assumed = autockpt.plan(model, args)
    assert assumed.loss is not None and assumed.loss.kind == "assumed"
    assert "assumed an output-sized gradient; pass loss_fn" in str(assumed)
    for fn in (autockpt.profiling.loss.sum_loss, loss_fn, lambda out: out.pow(2).mean()):
        measured = autockpt.measure(model, args, loss_fn=fn).peak_activation_bytes
        assert measured <= SLACK * assumed.baseline_peak_bytes


class OwnLossGPT(nn.Module):
    """:class:`GPT` returning its own loss beside its logits, as a Hugging Face model given
    ``labels=`` does."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.gpt = GPT(vocab, seq=SEQ)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.gpt(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("mode", MODES)
def test_the_models_own_loss_holds_the_rest_of_its_output(mode: str) -> None:
    """``outputs = model(**batch); outputs["loss"].backward()`` holds the logits through
    backward: the plan counts them (NOTE [ The loss node ]), so the budget holds for that loop
    and for ``model(**batch)["loss"].backward()``, and ``measure`` measures the first."""
    vocab = 1024  # the head whole, with room at half the baseline
    torch.manual_seed(0)
    model = OwnLossGPT(vocab).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    batch = {"ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    _, budget_bytes, ckpt = apply_at_fraction(model, 0.5, (), batch, mode=mode,
                                              chunk_head=False)
    assert ckpt is not None
    plan = autockpt.plan_of(ckpt)
    held = loop_peak_bytes(ckpt, batch, hold=True)
    dropped = loop_peak_bytes(ckpt, batch, hold=False)
    assert held >= dropped
    for measured in (held, dropped):
        assert measured <= SLACK * budget_bytes, (measured, budget_bytes)
    assert abs(plan.estimated_peak_bytes - held) <= ESTIMATE_TOLERANCE * held, (
        f"estimated {plan.estimated_peak_bytes} B, measured {held} B")
    assert autockpt.measure(ckpt, (), example_kwargs=batch).peak_activation_bytes == held
    assert plan.loss is not None and plan.loss.kind == "inner"
    assert plan.loss.held == (("logits", BATCH * SEQ * vocab * 4),)
    assert "its other outputs (logits 2.00 MiB) held through backward" in str(plan)


def test_the_loss_is_planned_not_rewritten() -> None:
    """The user's loss runs in the user's code, once per step, with the original's grads."""
    model, args, loss_fn = _gpt()
    calls = []

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return loss_fn(logits)

    ckpt = autockpt.apply(model, example_inputs=args, loss_fn=counted)
    planned = len(calls)
    twin, _, _ = _gpt()
    for net in (ckpt, twin):
        torch.manual_seed(5)
        counted(net(*args)).backward()
    assert len(calls) == planned + 2
    assert_same_tensors(grads_of(ckpt), grads_of(twin), rtol=1e-5, atol=1e-7)


def test_a_bad_loss_fn_is_refused_with_the_fix() -> None:
    model, args, _ = _gpt()
    with pytest.raises(autockpt.InvalidArgumentError, match="scalar"):
        autockpt.plan(model, args, loss_fn=lambda logits: logits)
    with pytest.raises(autockpt.InvalidArgumentError, match="unknown loss"):
        autockpt.plan(model, args, loss_fn="hinge")
    with pytest.raises(autockpt.InvalidArgumentError, match="callable"):
        autockpt.apply(model, example_inputs=args, loss_fn=3)


# --------------------------------------------------------------------------- accumulation


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(256, 256), nn.ReLU())],
                         nn.Linear(256, 10)).train()


def _mlp_step() -> tuple[nn.Module, tuple[Any, ...], Any]:
    model = _mlp()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    return model, (x,), loss_fn


ACCUMULATING = {**MODELS, "mlp_cross_entropy": _mlp_step}


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_prices_the_weight_gradient_temporaries(mode: str) -> None:
    model, args, loss_fn = _mlp_step()
    fresh = autockpt.plan(model, args, loss_fn=loss_fn, mode=mode)
    probe = autockpt.plan(model, args, loss_fn=loss_fn, mode=mode, grad_accumulation=True)
    # Each weight gradient is a 256 KiB temporary added into .grad: that is in the estimate,
    # which matches the step without checkpointing as measured with .grad allocated.
    assert probe.baseline_peak_bytes > fresh.baseline_peak_bytes
    unplanned = autockpt.measure(model, args, loss_fn=loss_fn,
                                 grad_accumulation=True).peak_activation_bytes
    assert unplanned > autockpt.measure(model, args, loss_fn=loss_fn).peak_activation_bytes
    assert abs(probe.baseline_peak_bytes - unplanned) <= ESTIMATE_TOLERANCE * unplanned


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fraction", FRACTIONS, ids=str)
@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_the_budget_holds_with_gradient_accumulation(name: str, fraction: object,
                                                     mode: str) -> None:
    model, args, loss_fn = ACCUMULATING[name]()
    _, budget, ckpt = apply_at_fraction(model, fraction, args, loss_fn=loss_fn, mode=mode,
                                        grad_accumulation=True)
    if ckpt is None:  # the weight-gradient temporaries cannot be checkpointed away
        return
    plan = autockpt.plan_of(ckpt)
    assert plan.grad_accumulation and "accumulated" in str(plan)
    # From the second micro-batch on, .grad exists when backward runs.
    measured = autockpt.measure(ckpt, args, loss_fn=loss_fn,
                                grad_accumulation=True).peak_activation_bytes
    assert measured <= SLACK * budget, (measured, budget)
    assert abs(plan.estimated_peak_bytes - measured) <= ESTIMATE_TOLERANCE * measured, (
        plan.estimated_peak_bytes, measured)


def test_three_micro_batches_accumulate_the_originals_gradients() -> None:
    model, twin = _mlp(), _mlp()
    batches = [torch.randn(64, 256, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    ckpt = autockpt.apply(model, example_inputs=(batches[0],), grad_accumulation=True,
                          loss_fn="cross_entropy")
    for net in (ckpt, twin):
        for x in batches:
            autockpt.profiling.loss.cross_entropy_loss(net(x)).backward()
    assert_same_tensors(grads_of(ckpt), grads_of(twin), rtol=1e-5, atol=1e-6)


def test_allocated_grads_in_a_plan_for_fresh_ones_warn_once_with_the_fix() -> None:
    model = _mlp()
    x = torch.randn(64, 256)
    ckpt = autockpt.apply(model, example_inputs=(x,))
    ckpt(x).sum().backward()  # .grad is None before this step: no warning
    with pytest.warns(autockpt.BudgetWarning, match="grad_accumulation=True"):
        ckpt(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt(x).sum().backward()  # once only
    quiet = autockpt.apply(model, example_inputs=(x,), grad_accumulation=True)
    accumulating = autockpt.plan(model, (x,), grad_accumulation=True)
    from_plan = autockpt.apply(model, plan=accumulating, example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(x).sum().backward()
        from_plan(x).sum().backward()  # the plan says it was made for accumulation


# --------------------------------------------------------------------------- whole device


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_total_mb_holds_for_the_whole_step_with_adamw(name: str) -> None:
    if name == "mlp":
        model, args = _mlp(), (torch.randn(64, 256),)
        loss_fn: Any = "cross_entropy"
    else:
        model, args, loss_fn = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = autockpt.plan(model, args, loss_fn=loss_fn, total_mb=10_000, optimizer=optimizer)
    device = probe.device
    assert device is not None and device.optimizer == "AdamW"
    params = sum(p.numel() * 4 for p in model.parameters())
    assert device.parameter_bytes == params and device.gradient_bytes == params
    assert device.optimizer_state_bytes >= 2 * params
    total = device.fixed_bytes + (probe.baseline_peak_bytes + probe.min_peak_bytes) // 2
    ckpt = autockpt.apply(model, example_inputs=args, loss_fn=loss_fn, total_mb=total / 2**20,
                          optimizer=optimizer)
    plan = autockpt.plan_of(ckpt)
    assert plan.estimated_peak_bytes <= plan.device.activation_budget_bytes  # type: ignore[union-attr]
    assert "whole device" in str(plan)
    report = autockpt.measure(ckpt, args, loss_fn=loss_fn, optimizer=optimizer)
    assert report.peak_total_bytes <= SLACK * total, (report.peak_total_bytes, total)


def test_total_mb_says_which_part_does_not_fit() -> None:
    model = _mlp()
    x = torch.randn(64, 256)
    params = sum(p.numel() * 4 for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(autockpt.InfeasibleBudgetError, match="parameters and buffers alone"):
        autockpt.plan(model, (x,), total_mb=params / 2 / 2**20, optimizer=optimizer)
    with pytest.raises(autockpt.InfeasibleBudgetError, match="AdamW state"):
        autockpt.plan(model, (x,), total_mb=3.5 * params / 2**20, optimizer=optimizer)
    # Plain SGD keeps no state and steps in place: all that is left goes to activations,
    # and it is less than their least reachable peak.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    room = 2 * params + x.numel() * 4 + 300_000
    with pytest.raises(autockpt.InfeasibleBudgetError, match="of activations at the least"):
        autockpt.plan(model, (x,), total_mb=room / 2**20, optimizer=sgd)
    with pytest.raises(autockpt.InvalidArgumentError, match="not both"):
        autockpt.plan(model, (x,), budget_mb=1, total_mb=100)
    with pytest.raises(autockpt.InvalidArgumentError, match="only matters with total_mb"):
        autockpt.plan(model, (x,), optimizer=optimizer)


def test_a_billion_parameter_model_on_the_meta_device_is_planned_for_a_gpu() -> None:
    """'Will this fit on my GPU, and how?' answered on a laptop: nothing is allocated."""
    with torch.device("meta"):
        model = GPT(vocab=32000, dim=2048, layers=20, heads=16, seq=1024)
        ids = torch.zeros(4, 1024, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters())
    assert params >= 1_000_000_000
    optimizer = torch.optim.AdamW(model.parameters())
    baseline = autockpt.plan(model, (ids,), loss_fn="cross_entropy", total_mb=10**9,
                             optimizer=optimizer)
    assert baseline.device is not None
    fixed = baseline.device.fixed_bytes
    assert fixed >= 16 * params  # fp32 weights, grads and two AdamW moments
    gpu = 24 * 1024  # a 24 GiB GPU
    plan = autockpt.plan(model, (ids,), loss_fn="cross_entropy", total_mb=gpu,
                         optimizer=optimizer)
    assert baseline.baseline_peak_bytes + fixed > gpu * 2**20  # does not fit as it is
    assert fixed + plan.estimated_peak_bytes <= gpu * 2**20  # fits with checkpointing
    assert plan.segments
    with pytest.raises(autockpt.InfeasibleBudgetError, match="AdamW state"):
        autockpt.plan(model, (ids,), total_mb=12 * 1024, optimizer=optimizer)
    assert math.isfinite(plan.recompute_ratio)
