"""A reentrant plan's estimate is its step replayed on fake tensors (NOTE [ Replaying a plan on
fake tensors ] in autockpt/running/replay.py): equal to what the real step measures where the memory
model is not, budgets planned again when the replay is above them, the least reachable the
replayed one, and the user's module, its parameters and the random stream left as they were."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch

import autockpt
from autockpt import pipeline
from autockpt.capturing.trace import shallow_view
from autockpt.planning.overhead import NO_OVERHEAD
from autockpt.profiling import blocks as profiled_blocks
from autockpt.profiling.blocks import profile_modules
from autockpt.running.blocks import installed, is_installed
from tests import random_graphs as graphs

SEEDS_THE_MODEL_MISSES = {
    240: "the frame holds the gradient handed for a segment output until the inner backward "
         "returns; the model frees it earlier (9.7% below)",
    60: "a plan at the least budget that the model prices 5.5% below its peak",
}
"""Random graphs (benchmarks/estimate_accuracy.py's seeds) whose reentrant least-memory plans
the memory model priced below the measured peak on 2026-11-27."""


def _graph(seed: int) -> tuple[graphs.GraphSpec, tuple[torch.Tensor, ...], object]:
    spec = graphs.seeded_spec(seed)
    return spec, graphs.example_inputs(spec), graphs.cross_entropy(spec)


def _apply(model: torch.nn.Module, budget_bytes: int | None, args: tuple[torch.Tensor, ...],
           loss_fn: object) -> torch.nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):
        return autockpt.apply(model, None if budget_bytes is None else budget_bytes / 2**20,
                              example_inputs=args, mode="reentrant", loss_fn=loss_fn)


@pytest.mark.parametrize("seed", sorted(SEEDS_THE_MODEL_MISSES))
def test_the_replayed_estimate_is_the_measured_peak(seed: int) -> None:
    spec, args, loss_fn = _graph(seed)
    transformed = _apply(graphs.build(spec), None, args, loss_fn)
    plan = autockpt.plan_of(transformed)
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    assert plan.estimate == "replay", plan.notes
    assert plan.segments
    assert abs(plan.estimated_peak_bytes - measured) <= 16, (plan.estimated_peak_bytes,
                                                             measured)
    assert plan.min_peak_bytes == plan.estimated_peak_bytes
    assert plan.modelled_peak_bytes is not None


def test_a_budget_the_models_plan_misses_is_planned_again_and_met(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At the least reachable budget, seed 60's plan by the model replays above it: the
    planner asks the model again under a lower budget, and the step meets the budget. The
    plans are chosen by arithmetic alone, as when this seed was found: with the fixed cost
    per segment (autockpt/planning/overhead.py) the model's first plan differs and fits."""
    monkeypatch.setattr(pipeline, "plan_overhead", lambda *_, **__: NO_OVERHEAD)
    spec, args, loss_fn = _graph(60)
    least = autockpt.plan(graphs.build(spec), args, mode="reentrant", loss_fn=loss_fn)
    budget = least.min_peak_bytes
    transformed = _apply(graphs.build(spec), budget, args, loss_fn)
    plan = autockpt.plan_of(transformed)
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    assert plan.budget_bytes == budget
    assert measured <= budget, (measured, budget)
    assert plan.estimated_peak_bytes == measured
    assert any("planned under a lower budget" in note for note in plan.notes), plan.notes


def test_a_budget_the_model_calls_infeasible_gets_the_plan_that_replays_within_it() -> None:
    """Seed 83: the model prices its least-memory plan 504 B above the peak it replays, so a
    budget at the replayed least is infeasible for the model; the replay admits that plan."""
    spec, args, loss_fn = _graph(83)
    least = autockpt.plan(graphs.build(spec), args, mode="reentrant", loss_fn=loss_fn)
    assert least.modelled_peak_bytes is not None
    transformed = _apply(graphs.build(spec), least.min_peak_bytes, args, loss_fn)
    plan = autockpt.plan_of(transformed)
    assert plan.segments == least.segments
    assert plan.budget_bytes == least.min_peak_bytes
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    assert measured <= least.min_peak_bytes, (measured, least.min_peak_bytes)


def test_below_the_replayed_least_the_budget_is_infeasible_at_that_number() -> None:
    """The error names the least-memory plan's replayed peak, the number to ask for."""
    spec, args, loss_fn = _graph(240)
    least = autockpt.plan(graphs.build(spec), args, mode="reentrant", loss_fn=loss_fn)
    model = graphs.build(spec)
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.plan(model, args, mode="reentrant", loss_fn=loss_fn,
                      budget_mb=least.min_peak_bytes / 2 / 2**20)
    assert info.value.min_feasible_bytes == least.min_peak_bytes
    assert "reentrant" in str(info.value)
    assert dict(model.named_parameters()) == before


def test_the_replay_leaves_the_module_and_the_random_stream_as_they_were() -> None:
    spec, args, loss_fn = _graph(240)
    model = graphs.build(spec)
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    attributes = set(model.__dict__)
    torch.manual_seed(5)
    autockpt.plan(model, args, mode="reentrant", loss_fn=loss_fn)
    after_plan = torch.rand(4)
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.testing.assert_close(after_plan, want, rtol=0, atol=0)
    assert set(model.__dict__) == attributes
    for name, p in model.named_parameters():
        original, values = params[name]
        assert p is original and type(p) is torch.nn.Parameter and p.grad is None
        torch.testing.assert_close(p.detach(), values, rtol=0, atol=0)


def test_a_replay_that_fails_keeps_the_models_estimate_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: object, **kwargs: object) -> int:
        raise RuntimeError("no fake kernel for this op\nsecond line")

    monkeypatch.setattr(pipeline, "replay_peak_bytes", fails)
    spec, args, loss_fn = _graph(240)
    plan = autockpt.plan(graphs.build(spec), args, mode="reentrant", loss_fn=loss_fn)
    assert plan.estimate == "model" and plan.modelled_peak_bytes is None
    assert any("replaying the step on fake tensors raised RuntimeError (no fake kernel for "
               "this op)" == note.split(": ", 1)[1] for note in plan.notes), plan.notes


def test_without_a_loss_the_replay_prices_an_output_sized_gradient() -> None:
    """No ``loss_fn`` and no loss of the model's own: the plan assumes a gradient the size of
    the output, as a real loss sends, which the default measure (a sum, whose gradient is a
    broadcast scalar) does not: the replay lies between it and it plus the logits."""
    spec, args, _ = _graph(240)
    transformed = _apply(graphs.build(spec), None, args, None)
    plan = autockpt.plan_of(transformed)
    assert plan.estimate == "replay" and plan.loss is not None and plan.loss.kind == "assumed"
    measured = autockpt.measure(transformed, args).peak_activation_bytes
    logits = transformed(*args)
    assert measured <= plan.estimated_peak_bytes <= measured + logits.nelement() * 4 + 16


def test_a_non_reentrant_plan_is_the_models_estimate() -> None:
    spec, args, loss_fn = _graph(240)
    plan = autockpt.plan(graphs.build(spec), args, loss_fn=loss_fn)
    assert plan.estimate == "model" and plan.modelled_peak_bytes is None


def test_a_plan_made_inside_a_measured_step_is_not_counted_in_it() -> None:
    """Applied without example inputs, the model plans (and replays) at its first forward,
    inside the step the user measures: the fake steps of planning are not the user's."""
    spec, args, loss_fn = _graph(240)
    with contextlib.redirect_stdout(io.StringIO()):
        lazy = autockpt.apply(graphs.build(spec), None, mode="reentrant", loss_fn=loss_fn)
    first = autockpt.measure(lazy, args, loss_fn=loss_fn).peak_activation_bytes
    assert autockpt.plan_of(lazy).estimate == "replay"
    assert first == autockpt.measure(lazy, args, loss_fn=loss_fn).peak_activation_bytes


class _Stack(torch.nn.Module):
    """Eight residual MLP blocks and a head: the modules rung's kind of model."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(8))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_the_modules_rung_replays_its_plan_with_the_users_loss(mode: str) -> None:
    """Without a graph the rung cannot run ``loss_fn`` with the model, so it chooses blocks by
    an assumed gradient; the replay runs the step with the user's loss, and is its peak, in
    both modes."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    target = torch.randint(0, 10, (32,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, target)

    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(_Stack(), None, example_inputs=(x,), mode=mode,
                                     capture="modules", loss_fn=loss_fn)
    plan = autockpt.plan_of(transformed)
    assert plan.capture == "modules" and plan.segments
    assert plan.estimate == "replay", plan.notes
    assert any("replayed the step with loss_fn" in note for note in plan.notes), plan.notes
    measured = autockpt.measure(transformed, (x,), loss_fn=loss_fn).peak_activation_bytes
    assert plan.estimated_peak_bytes == measured


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_the_modules_rung_meets_half_the_baseline_on_hugging_face_bart(
        mode: str, fake: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face BART through the modules rung (as under torch 2.11, whose export fails on
    its LayerDrop): at half the measured peak without checkpointing, its own loss, the step
    measures within the budget. A non-reentrant plan priced by the rung's model alone
    measured 11% above its estimate here (and 10% above its budget on an H100). ``real``:
    as with the transformers of torch 2.11's day, whose LayerDrop draws a number and compares
    it in Python, the forward does not run on fake tensors and the plan is replayed as a real
    step."""
    pytest.importorskip("transformers")
    from tests import skip_models

    if not fake:
        def refused(*args: object, **kwargs: object) -> None:
            raise RuntimeError("data-dependent: LayerDrop compares torch.rand([]) in Python")

        monkeypatch.setattr(profiled_blocks, "_run_fake", refused)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(3, skip_models.SEQ2SEQ_VOCAB, (4, 64), generator=gen)
                   for _ in range(2))
    kwargs = {"input_ids": ids, "labels": labels}

    def own_loss(out: Any) -> torch.Tensor:
        return out.loss

    model = skip_models.bart().train()
    baseline = autockpt.measure(model, (), example_kwargs=kwargs,
                                loss_fn=own_loss).peak_activation_bytes
    budget_mb = baseline / 2 / 2**20
    plan = autockpt.plan(model, (), example_kwargs=kwargs, mode=mode, capture="modules",
                         budget_mb=budget_mb, loss_fn=own_loss)
    assert plan.capture == "modules" and plan.segments and plan.estimate == "replay"
    assert plan.real_replay != fake
    assert fake != any("replayed as one real training step" in n for n in plan.notes)
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, plan=plan, example_kwargs=kwargs)
    measured = autockpt.measure(transformed, (), example_kwargs=kwargs,
                                loss_fn=own_loss).peak_activation_bytes
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
    if not fake:
        assert measured == plan.estimated_peak_bytes


class _LooksAtValues(torch.nn.Module):
    """Blocks with BatchNorm and dropout behind a branch on a value, which fake tensors cannot
    take: the modules rung profiles it on a real forward."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width),
                                torch.nn.BatchNorm1d(4 * width), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(4 * width, width))
            for _ in range(6))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if x.abs().mean() > 1e3:
                x = x / 1e3
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_forward_fake_tensors_cannot_run_is_replayed_as_a_real_step(mode: str) -> None:
    """NOTE [ A real replay where fake tensors cannot run ] in autockpt/running/replay.py: the plan's
    estimate is its real step's tracked peak, the budget is met, and planning leaves the
    parameters, their gradients, BatchNorm's statistics and the random stream as they were."""
    torch.manual_seed(0)
    model = _LooksAtValues().train()
    x = torch.randn(64, 64)
    target = torch.randint(0, 10, (64,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, target)

    baseline = autockpt.measure(model, (x,), loss_fn=loss_fn).peak_activation_bytes
    model.head.weight.grad = torch.ones_like(model.head.weight)
    grad = model.head.weight.grad
    values = {name: t.detach().clone() for name, t in model.state_dict().items()}
    torch.manual_seed(7)
    plan = autockpt.plan(model, (x,), mode=mode, budget_mb=baseline / 2 / 2**20,
                         loss_fn=loss_fn)
    after_plan = torch.rand(4)
    torch.manual_seed(7)
    torch.testing.assert_close(after_plan, torch.rand(4), rtol=0, atol=0)
    assert model.head.weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, values[name], rtol=0, atol=0, msg=name)

    assert plan.capture == "modules" and plan.segments and plan.estimate == "replay", plan.notes
    assert plan.real_replay and "; the step replayed for real)" in str(plan)
    assert any("replayed as one real training step" in note for note in plan.notes), plan.notes
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, plan=plan, example_inputs=(x,))
    model.head.weight.grad = None
    measured = autockpt.measure(transformed, (x,), loss_fn=loss_fn).peak_activation_bytes
    assert measured == plan.estimated_peak_bytes <= plan.budget_bytes


def test_a_real_replay_that_fails_keeps_the_models_estimate_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: object, **kwargs: object) -> int:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(pipeline, "replay_blocks_peak_bytes", fails)
    torch.manual_seed(0)
    plan = autockpt.plan(_LooksAtValues().train(), (torch.randn(64, 64),), mode="reentrant")
    assert plan.capture == "modules" and plan.estimate == "model"
    assert any(note.endswith("replaying the step as a real step raised RuntimeError (out of "
                             "memory)") for note in plan.notes), plan.notes


def test_a_modules_replay_puts_back_the_blocks_the_running_plan_chose() -> None:
    """A second input size of a transformed module is planned (and replayed) while the first
    size's blocks are installed in views it shares: they are left as they were."""
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(_Stack(), None, example_inputs=(torch.randn(32, 64),),
                                     mode="reentrant", capture="modules")
    transformed(torch.randn(32, 64)).sum().backward()
    chosen = is_installed(transformed)
    assert chosen
    others = tuple(b for b in profile_modules(_Stack(), (torch.randn(4, 64),)).blocks
                   if b not in chosen)
    prof = profile_modules(_Stack(), (torch.randn(4, 64),))
    assert others
    with installed(shallow_view(transformed), prof, others, "reentrant"):
        assert set(is_installed(transformed)) != set(chosen)  # the views are shared
    assert is_installed(transformed) == chosen


def test_a_plan_with_nothing_to_checkpoint_replays_the_users_own_forward() -> None:
    """Seed 117: no checkpoint lowers the peak, and the runtime then runs the user's own
    forward, whose locals hold values longer than the graph (3.5% more than the graph's
    step): the replay runs that forward too."""
    spec, args, loss_fn = _graph(117)
    transformed = _apply(graphs.build(spec), None, args, loss_fn)
    plan = autockpt.plan_of(transformed)
    assert not plan.segments and plan.estimate == "replay"
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    assert plan.estimated_peak_bytes == measured
    assert plan.modelled_peak_bytes is not None and plan.modelled_peak_bytes < measured
