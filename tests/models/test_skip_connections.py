"""Models whose skip connections span most of the graph: UNets (our own and diffusers'),
DenseNet, an HRNet-like multi-resolution network, encoder-decoder transformers (T5, BART,
M2M100 through the modules rung, Whisper with its tied decoder embedding).

Segments with several inputs and outputs anywhere in the graph (NOTE [ Block boundaries under
skip connections ] in autockpt/planning/chain.py) reach on each of them: the least memory at most 40%
of the measured peak without checkpointing (55% in reentrant mode), every budget from 50% up,
measured within 5%; the gradients of an untransformed twin; and at the memory the library's
own gradient checkpointing reaches, fewer backward FLOPs than diffusers' switch and no more than
Hugging Face's.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.ops.instrument import flop_counter
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import assert_same_step, assert_same_step_in_float64, train_step
from tests.skip_models import (
    SEQ2SEQ_VOCAB,
    UNET2D_CONDITION_CROSS_DIM,
    WHISPER_MEL_BINS,
    HRNetLike,
    UNet,
    bart,
    densenet121,
    m2m100,
    t5,
    unet2d,
    unet2d_condition,
    whisper,
)

pytestmark = pytest.mark.models

MIB = 2**20
LEAST = {"non_reentrant": 0.40, "reentrant": 0.55}
"""The least memory each mode must reach, as a fraction of the baseline's measured peak."""
FRACTIONS = (0.5, 0.75)
UNDER_ESTIMATE = 0.005
"""How far a least-memory plan's measured peak may exceed its estimate (a kernel's own
temporaries, not in any profile)."""
STEP_SEED = 1234

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class SkipCase:
    name: str
    requires: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Inputs]
    loss_fn: Callable[[Any], torch.Tensor] | None
    """None: the model's own loss (``labels=``)."""
    own_checkpointing: Callable[[nn.Module], None] | None = None
    """Switches on the library's own gradient checkpointing, where it has one."""
    strictly_fewer: bool = True
    """Whether autockpt must recompute strictly less than that switch at its memory, or
    may match it (a per-layer switch on a stack of identical layers is already the cheapest
    plan at its own memory)."""
    under_estimate: float = UNDER_ESTIMATE
    """How far its least-memory plan's measured peak may exceed the estimate."""


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().train()
    return build


def _images(batch: int, channels: int, size: int, *extra: torch.Tensor) -> Callable[[], Inputs]:
    def make() -> Inputs:
        gen = torch.Generator().manual_seed(1)
        return (torch.randn(batch, channels, size, size, generator=gen), *extra), {}
    return make


def _mse_to_zero(out: Any) -> torch.Tensor:
    sample = out.sample if hasattr(out, "sample") else out
    return F.mse_loss(sample, torch.zeros_like(sample))


def _cross_entropy(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1])


def _condition_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 16, 16, generator=gen), torch.tensor([10, 500]),
            torch.randn(2, 8, UNET2D_CONDITION_CROSS_DIM, generator=gen)), {}


def _seq2seq_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SEQ2SEQ_VOCAB, (4, 64), generator=gen)
    labels = torch.randint(3, SEQ2SEQ_VOCAB, (4, 64), generator=gen)
    return (), {"input_ids": ids, "labels": labels}


def _audio_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(1)
    return (), {"input_features": torch.randn(2, WHISPER_MEL_BINS, 64, generator=gen),
                "labels": torch.randint(3, SEQ2SEQ_VOCAB, (2, 32), generator=gen)}


def _diffusers_switch(model: nn.Module) -> None:
    model.enable_gradient_checkpointing()  # type: ignore[operator]


def _hf_switch(model: nn.Module) -> None:
    model.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": False})


CASES = (
    SkipCase("unet", "torch", _seeded(UNet), _images(4, 3, 64), _mse_to_zero),
    SkipCase("hrnet_like", "torch", _seeded(HRNetLike), _images(4, 3, 32), _cross_entropy),
    SkipCase("diffusers_unet2d", "diffusers", _seeded(unet2d),
             _images(2, 3, 32, torch.tensor([10, 500])), _mse_to_zero, _diffusers_switch),
    SkipCase("diffusers_unet2d_condition", "diffusers", _seeded(unet2d_condition),
             _condition_inputs, _mse_to_zero, _diffusers_switch),
    SkipCase("tv_densenet121", "torchvision", _seeded(densenet121), _images(2, 3, 32),
             _cross_entropy),
    SkipCase("hf_t5", "transformers", _seeded(t5), _seq2seq_inputs, None, _hf_switch,
             strictly_fewer=False),
    SkipCase("hf_bart", "transformers", _seeded(bart), _seq2seq_inputs, None, _hf_switch,
             strictly_fewer=False),
    # LayerDrop skips layers at random: the modules rung plans and prices the step that
    # keeps every layer (NOTE [ A random scalar in a real forward ] in autockpt/capturing/draws.py).
    SkipCase("hf_m2m100", "transformers", _seeded(m2m100), _seq2seq_inputs, None, _hf_switch,
             strictly_fewer=False),
    SkipCase("hf_whisper", "transformers", _seeded(whisper), _audio_inputs, None, _hf_switch,
             strictly_fewer=False),
)


def _loss(case: SkipCase) -> Callable[[Any], torch.Tensor]:
    return case.loss_fn if case.loss_fn is not None else (lambda out: out.loss)


def _apply(case: SkipCase, budget_bytes: int | None, mode: str) -> nn.Module:
    args, kwargs = case.inputs()
    with contextlib.redirect_stdout(io.StringIO()):
        return autockpt.apply(case.build(), None if budget_bytes is None else budget_bytes / MIB,
                              example_inputs=args, example_kwargs=kwargs, mode=mode,
                              loss_fn=case.loss_fn)


def _peak(case: SkipCase, model: nn.Module) -> int:
    """The measured peak of one step, at the same seed for every model compared: a model
    whose forward draws (LayerDrop) then takes the same branches in each."""
    args, kwargs = case.inputs()
    torch.manual_seed(STEP_SEED)
    return autockpt.measure(model, args, example_kwargs=kwargs,
                            loss_fn=case.loss_fn).peak_activation_bytes


def _backward_flops(case: SkipCase, model: nn.Module) -> int:
    args, kwargs = case.inputs()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    loss = _loss(case)(model(*args, **kwargs))
    with flop_counter() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_least_memory_budgets_and_gradients(case: SkipCase, mode: str) -> None:
    pytest.importorskip(case.requires)
    baseline = _peak(case, case.build())

    least = _apply(case, None, mode)
    plan = autockpt.plan_of(least)
    measured = _peak(case, least)
    # The plan's estimate is what a budget is held to: it must not fall short of the step
    # (it did by 3.3% on UNet2DModel in reentrant mode before NOTE [ A reentrant segment
    # copies its inputs' gradients ] in autockpt/planning/memory_model.py).
    assert measured <= plan.estimated_peak_bytes * (1 + case.under_estimate), (
        f"{case.name} ({mode}): measured {measured} B, estimated "
        f"{plan.estimated_peak_bytes} B\n{plan}"
    )
    assert measured <= LEAST[mode] * baseline, (
        f"{case.name} ({mode}): least memory {measured / MIB:.2f} MiB is "
        f"{measured / baseline:.0%} of the baseline's {baseline / MIB:.2f} MiB\n{plan}"
    )
    args, kwargs = case.inputs()
    if mode == "reentrant":
        # NOTE [ Gradients summed in another order ] in tests/helpers.py
        assert_same_step_in_float64(case.build, plan, _loss(case), args, kwargs,
                                    what=f"{case.name} ", seed=STEP_SEED)
    else:
        expected = train_step(case.build(), _loss(case), args, kwargs, seed=STEP_SEED)
        assert_same_step(train_step(least, _loss(case), args, kwargs, seed=STEP_SEED), expected,
                         what=f"{case.name} ", allow_none=True)

    for fraction in FRACTIONS:
        budget = int(baseline * fraction)
        transformed = _apply(case, budget, mode)  # InfeasibleBudgetError fails the test
        measured = _peak(case, transformed)
        assert measured <= budget * (1 + BUDGET_SLACK), (
            f"{case.name} ({mode}) at {fraction:.0%}: measured {measured / MIB:.2f} MiB over "
            f"the budget {budget / MIB:.2f} MiB\n{autockpt.plan_of(transformed)}"
        )


@pytest.mark.parametrize("case", [c for c in CASES if c.own_checkpointing is not None],
                         ids=lambda c: c.name)
def test_fewer_flops_than_the_librarys_own_checkpointing(case: SkipCase) -> None:
    pytest.importorskip(case.requires)
    assert case.own_checkpointing is not None
    plain = case.build()
    switched = case.build()
    case.own_checkpointing(switched)
    target = _peak(case, switched)
    assert target < _peak(case, plain), f"{case.name}: its own checkpointing saves nothing"
    transformed = _apply(case, target, "non_reentrant")
    measured = _peak(case, transformed)
    assert measured <= target * (1 + BUDGET_SLACK)
    ours, theirs = _backward_flops(case, transformed), _backward_flops(case, switched)
    assert ours < theirs if case.strictly_fewer else ours <= theirs, (
        f"{case.name}: at {target / MIB:.2f} MiB autockpt runs {ours} backward FLOPs, the "
        f"library's own checkpointing {theirs} (without: {_backward_flops(case, plain)})"
    )
