"""Module-level planning (autockpt.running.blocks) on models torch.fx cannot trace.

Each model is trained one step through the rung (profile, plan, install into a twin) and
compared with an identically seeded copy that runs without checkpointing: loss, every
gradient and every buffer must match; the twin must share the user's Parameters and
state_dict keys and leave the user's module tree alone; the measured peak must respect the
budget; and the FLOP count must show the recompute when blocks are checkpointed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autockpt
from autockpt.capturing.trace import shallow_view
from autockpt.planning.blocks import blocks_of_plan, build, plan_modules
from autockpt.planning.planner import BUDGET_SLACK
from autockpt.profiling import blocks as profiled_blocks
from autockpt.profiling.blocks import profile_modules
from autockpt.running.blocks import install, is_installed
from tests.helpers import MODES, assert_same_step, budget_for, live_tensors, train_step

BUDGETS = (1.0, 0.5, "min")


class ResidualMLP(nn.Module):
    """x + fc2(dropout(gelu(fc1(norm(x))))), optionally with a BatchNorm on the hidden."""

    def __init__(self, width: int, batchnorm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.bn = nn.BatchNorm1d(4 * width) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.bn(self.fc1(self.norm(x))))))


class BranchyNet(nn.Module):
    """Data-dependent control flow in the root around a ModuleList of residual blocks."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(ResidualMLP(width, batchnorm=(i == 2)) for i in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if h.sum() > 0:  # fx cannot trace this
            h = h * 0.5
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class KwBlock(nn.Module):
    """Takes keyword arguments (a tensor mask, a float, a flag) and returns a tuple whose
    second item is a Python number."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 3 * width)
        self.fc2 = nn.Linear(3 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0,
                gate: bool = True) -> tuple[torch.Tensor, int]:
        h = torch.tanh(self.fc1(x)) * mask
        out = x + scale * self.drop(self.fc2(h)) if gate else x
        return out, 1


class KwNet(nn.Module):
    """Calls ``.item()`` in forward and passes keyword arguments to its blocks."""

    def __init__(self, width: int = 48, depth: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(KwBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        count = 0
        scale = 1.0 / (1.0 + float(x.abs().mean().item()))  # a Python float from a tensor
        for layer in self.layers:
            x, n = layer(x, mask=mask, scale=scale, gate=True)
            count += n
        return self.out(x) * count


class _Stack(nn.Module):
    """A list of residual blocks, each reading ``memory`` when given (cross-attention's
    stand-in)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResidualMLP(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x if memory is None else x + memory)
        return x


class EncoderDecoder(nn.Module):
    """An encoder stack and a decoder stack of different classes, a data-dependent skip
    between them (as LayerDrop is), so that no graph rung captures it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = _Stack(width, 3)
        self.decoder = nn.ModuleDict({"stack": _Stack(width, 3)})
        self.head = nn.Linear(width, 4)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(src)
        if memory.mean() > 100:  # never: but only a real value says so
            memory = memory * 0
        return self.head(self.decoder["stack"](tgt, memory))


class _TwoStacks(nn.Module):
    """An encoder and a decoder of one class (LongT5's ``LongT5Stack``), and a data-dependent
    branch, so that no graph rung captures it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = _Stack(width, 3)
        self.decoder = _Stack(width, 3)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(src)
        if memory.mean() > 100:
            memory = memory * 0
        return self.decoder(tgt, memory)


def test_the_layers_of_two_stacks_of_one_class_are_the_blocks() -> None:
    """NOTE [ Stacks of layers ] in autockpt/profiling/blocks.py: the two stacks were the blocks, so
    the least memory checkpointed a whole stack at a time. The residual blocks' own linear
    layers (repeated parts of a block) do not make them stacks."""
    torch.manual_seed(0)
    model = _TwoStacks()
    args, kwargs = _encdec_inputs()
    prof = profile_modules(model, args, kwargs)
    assert prof.blocks == tuple(f"encoder.layers.{i}" for i in range(3)) + tuple(
        f"decoder.layers.{i}" for i in range(3))
    single = profile_modules(nn.Sequential(*[ResidualMLP(32) for _ in range(3)]),
                             (args[0],))
    assert single.blocks == ("0", "1", "2")


def test_blocks_of_an_encoder_and_a_decoder_are_both_found() -> None:
    """NOTE [ Blocks in sibling subtrees ] in autockpt/profiling/blocks.py: the search went down into
    one of the two stacks only, and the other was never checkpointed."""
    model = _encdec()
    args, kwargs = _encdec_inputs()
    prof = profile_modules(model, args, kwargs)
    assert prof.blocks == tuple(f"encoder.layers.{i}" for i in range(3)) + tuple(
        f"decoder.stack.layers.{i}" for i in range(3))


Case = tuple[Callable[[], nn.Module], Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]


def _branchy() -> nn.Module:
    torch.manual_seed(0)
    return BranchyNet()


def _branchy_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(32, 16, generator=gen),), {}


def _kw() -> nn.Module:
    torch.manual_seed(0)
    return KwNet()


def _kw_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, 48, generator=gen)
    mask = (torch.rand(24, 144, generator=gen) > 0.3).float()
    return (x,), {"mask": mask}


def _encdec() -> nn.Module:
    torch.manual_seed(0)
    return EncoderDecoder()


def _encdec_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)), {}


CASES: dict[str, Case] = {"branchy": (_branchy, _branchy_inputs), "kwargs": (_kw, _kw_inputs),
                          "encoder_decoder": (_encdec, _encdec_inputs)}


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _flops(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    counter = FlopCounterMode(display=False)
    state = copy.deepcopy({n: b for n, b in model.named_buffers()})
    with counter:
        torch.manual_seed(0)
        _loss(model(*args, **kwargs)).backward()
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(state[n])
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def test_no_graph_rung_captures_these_and_auto_ends_at_modules() -> None:
    for make, inputs in CASES.values():
        args, kwargs = inputs()
        for rung in ("fx", "export", "fx-leaves"):
            with pytest.raises(autockpt.TraceError):
                autockpt.plan(make(), args, example_kwargs=kwargs, capture=rung)
        assert autockpt.plan(make(), args, example_kwargs=kwargs).capture == "modules"


def test_profile_finds_the_blocks_without_touching_the_model() -> None:
    model = _branchy()
    args, _ = _branchy_inputs()
    before = {n: b.clone() for n, b in model.named_buffers()}
    model.eval()
    rng = torch.get_rng_state()
    prof = profile_modules(model, args)
    assert prof.blocks == tuple(f"blocks.{i}" for i in range(6))
    assert not prof.fake  # `if h.sum() > 0` needs a real value
    assert not model.training  # flags restored
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name
    block = prof.call("blocks.2")
    assert block.random and block.trainable
    assert block.mutated_buffers == ("blocks.2.bn.num_batches_tracked",
                                     "blocks.2.bn.running_mean", "blocks.2.bn.running_var")
    assert not prof.call("blocks.1").mutated_buffers
    # fc1 input, gelu input (and BN saves), dropout mask, fc2 input: 4x wider than the block.
    assert block.saved_bytes > 4 * block.input_bytes
    assert prof.call("embed").saved_bytes == 0  # reads only the model's input


def test_fake_profile_of_a_traceable_model_matches_real_sizes() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[ResidualMLP(32) for _ in range(4)])
    x = torch.randn(8, 32)
    prof = profile_modules(net, (x,))
    assert prof.fake and prof.blocks == ("0", "1", "2", "3")
    assert [prof.call(b).input_bytes for b in prof.blocks] == [8 * 32 * 4] * 4


@pytest.mark.parametrize("fake", [True, False])
def test_profile_leaves_no_tensor_alive(fake: bool) -> None:
    """The profile's forward is never run backward: its autograd graph must die with it
    (NOTE [ Saved tensors held from C++ ] in autockpt/ops/instrument.py). KwNet calls ``.item()``,
    so its forward runs for real: a leak there kept real activations."""
    torch.manual_seed(0)
    model = nn.Sequential(*[ResidualMLP(32) for _ in range(4)]) if fake else KwNet()
    args, kwargs = ((torch.randn(8, 32),), {}) if fake else _kw_inputs()
    assert profile_modules(model, args, kwargs).fake == fake
    before = live_tensors()
    for _ in range(2):
        profile_modules(model, args, kwargs)
    assert not live_tensors() - before


def test_weight_shared_module_is_not_a_block() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = ResidualMLP(16)
            self.b = ResidualMLP(16)
            self.c = ResidualMLP(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(self.b(x))))

    prof = profile_modules(Shared(), (torch.randn(4, 16),))
    assert "b" not in prof.blocks
    assert prof.call("b").calls == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_training_step(name: str, budget: object, mode: str) -> None:
    make, inputs = CASES[name]
    reference, model = make(), make()
    args, kwargs = inputs()
    probe, prof = build(model, args, kwargs, budget_bytes=None, mode=mode)
    budget_bytes = budget_for(probe, budget)
    if budget_bytes < probe.min_peak_bytes:
        with pytest.raises(autockpt.InfeasibleBudgetError) as info:
            plan_modules(prof, budget_bytes, mode=mode)
        assert info.value.min_feasible_bytes == probe.min_peak_bytes
        return
    plan = plan_modules(prof, budget_bytes, mode=mode)
    assert plan.estimated_peak_bytes <= budget_bytes
    str(plan)  # renders
    original = {n: (type(m), m) for n, m in model.named_modules()}
    twin = shallow_view(model)
    install(twin, prof, plan)
    chosen = blocks_of_plan(prof, plan)
    assert is_installed(twin) == chosen
    if budget != 1.0:
        assert chosen, "nothing checkpointed below the baseline"

    # Same Parameter objects and names, same state_dict keys; the user's tree is untouched.
    assert list(twin.state_dict()) == list(model.state_dict())
    for (name_a, p_a), (name_b, p_b) in zip(model.named_parameters(), twin.named_parameters(),
                                            strict=True):
        assert name_a == name_b and p_a is p_b
    assert {n: (type(m), m) for n, m in model.named_modules()} == original
    for qualname in chosen:
        assert "forward" not in model.get_submodule(qualname).__dict__
        assert twin.get_submodule(qualname) is not model.get_submodule(qualname)

    expected = train_step(reference, _loss, args, kwargs, seed=1234)
    assert_same_step(train_step(twin, _loss, args, kwargs, seed=1234), expected)

    report = autockpt.measure(twin, args, example_kwargs=kwargs, loss_fn=_loss)
    assert report.peak_activation_bytes <= budget_bytes * (1 + BUDGET_SLACK), (
        f"measured {report.peak_activation_bytes} B, budget {budget_bytes} B\n{plan}")

    plain_flops, ckpt_flops = _flops(reference, args, kwargs), _flops(twin, args, kwargs)
    if chosen:
        # Non-reentrant recompute stops once the saved tensors are back: at most the plan.
        assert plain_flops < ckpt_flops <= plain_flops + plan.recompute_flops
    else:
        assert ckpt_flops == plain_flops

    # Eval and no_grad run the blocks' own forward: same output as the user's model.
    twin.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(*args, **kwargs), reference(*args, **kwargs))


def test_infeasible_budget_names_the_least_reachable() -> None:
    model = _branchy()
    args, _ = _branchy_inputs()
    prof = profile_modules(model, args)
    least = plan_modules(prof, None).min_peak_bytes
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        plan_modules(prof, least // 2)
    assert info.value.min_feasible_bytes == least


def test_reinstall_retargets_and_deepcopy_works() -> None:
    model = _branchy()
    args, _ = _branchy_inputs()
    prof = profile_modules(model, args)
    twin = shallow_view(model)
    install(twin, prof, ["blocks.0", "blocks.1"])
    first = twin.blocks[0]
    install(twin, prof, ["blocks.3"])
    assert is_installed(twin) == ("blocks.3",)
    assert twin.blocks[0] is first  # the view stays, it just runs plainly
    clone = copy.deepcopy(twin)
    assert is_installed(clone) == ("blocks.3",)
    _loss(clone(*args)).backward()
    assert all(p.grad is not None for p in clone.parameters())


class _ScoringBlock(nn.Module):
    """Returns its output and a wide tensor of scores, as a Hugging Face layer returns its
    attention weights beside its hidden states."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 8 * width)
        self.down = nn.Linear(8 * width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self.up(x), dim=-1)
        return x + self.down(scores), scores


class _DropsScores(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6,
                 checkpointed: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScoringBlock(width) for _ in range(depth))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed is None:
                x, _ = block(x)
            else:
                x, _ = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpointed == "reentrant")
        return x


@pytest.mark.parametrize("mode", MODES)
def test_a_blocks_outputs_the_caller_drops_are_freed(mode: str) -> None:
    """The checkpointed block keeps the structure of its first output, never the tensors:
    its closure lives until backward, and each block's scores, which the caller drops at once,
    were held by it until then (LongT5's least memory fell from 45% to 36% of its baseline)."""
    x = torch.randn(64, 32, requires_grad=True)
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        ours = autockpt.apply(_DropsScores(), None, example_inputs=(x,), mode=mode,
                              capture="modules")
    assert len(autockpt.plan_of(ours).segments) > 0
    torch.manual_seed(0)
    by_hand = _DropsScores(checkpointed=mode)
    assert_same_step(train_step(ours, _loss, (x,), seed=1),
                     train_step(by_hand, _loss, (x,), seed=1))
    # Every block checkpointed by hand: ours, at its least memory, holds no more.
    assert (autockpt.measure(ours, (x,)).peak_activation_bytes
            <= autockpt.measure(by_hand, (x,)).peak_activation_bytes)


class _LayerDrop(nn.Module):
    """Skips each layer with probability 0.5 in training, as LayerDrop does: Hugging Face's
    M2M100 with ``torch.rand([])`` compared in Python (which fake tensors cannot run),
    Wav2Vec2's adapter with ``np.random.random()``, MusicGen with ``random.uniform(0, 1)``."""

    def __init__(self, draw: str = "torch", width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.draw == "torch":
                skip = bool(torch.rand([]) < 0.5)
            elif self.draw == "numpy":
                skip = np.random.random() < 0.5
            else:
                skip = random.uniform(0, 1) < 0.5
            if self.training and skip:
                continue
            x = layer(x)
        return x


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(3), float(np.random.random()), random.random()


@pytest.mark.parametrize("draw", ["torch", "numpy", "python"])
def test_a_layer_dropped_at_random_is_still_planned_and_priced(draw: str) -> None:
    """NOTE [ A random scalar in a real forward ]: whatever the random streams, every layer
    is a block and the estimate is the step that keeps them all, the most any step takes;
    the streams are left where they were. (A graph would keep the branches its trace drew:
    NOTE [ A random draw while tracing ] in autockpt/capturing/draws.py, NOTE [ Python's random numbers
    while tracing ] in autockpt/capturing/ladder.py.)"""
    torch.manual_seed(0)
    model = _LayerDrop(draw)
    x = torch.randn(64, 32, requires_grad=True)  # a step that drops every layer has a backward
    for seed in range(3):
        _seed_all(seed)
        prof = profile_modules(model, (x,))
        assert prof.blocks == tuple(f"layers.{i}" for i in range(6))
        assert prof.fake == (draw != "torch")
        _seed_all(seed)
        plan = autockpt.plan(model, (x,), mode="non_reentrant")
        after_plan = _draws()
        _seed_all(seed)
        torch.testing.assert_close(after_plan, _draws(), rtol=0, atol=0)
    assert plan.capture == "modules" and len(plan.segments) >= 5
    assert plan.estimate == "replay" and plan.real_replay == (draw == "torch")
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, plan=plan, example_inputs=(x,))
    peaks = []
    for seed in range(8):
        _seed_all(seed)
        peaks.append(autockpt.measure(transformed, (x,)).peak_activation_bytes)
    assert max(peaks) <= plan.estimated_peak_bytes and len(set(peaks)) > 1


def test_a_real_profile_takes_an_inference_forwards_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing runs backward through the real forward a profile needs (``if h.sum() > 0``):
    what autograd saves is counted and dropped at once, so profiling no longer holds a
    training forward's activations, and the profile is the one holding them gave."""
    from autockpt.running.measure import track_activation_memory

    model = _branchy()
    x = torch.randn(2048, 16)
    forward_peak = autockpt.measure(model, (x,), loss_fn=_loss).forward_peak_bytes
    with track_activation_memory(exclude=[*model.parameters(), *model.buffers(), x]) as t:
        dropped = profile_modules(model, (x,))
    assert not dropped.fake
    assert t.peak_bytes < forward_peak / 3, (t.peak_bytes, forward_peak)

    run = profiled_blocks._Session.run
    monkeypatch.setattr(profiled_blocks._Session, "run",
                        lambda self, fn, hold_saved=True: run(self, fn, hold_saved=True))
    with track_activation_memory(exclude=[*model.parameters(), *model.buffers(), x]) as t:
        held = profile_modules(model, (x,))
    assert t.peak_bytes > forward_peak / 2  # the old way: the forward's activations
    assert repr(held) == repr(dropped)
