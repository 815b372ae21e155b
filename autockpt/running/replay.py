"""Price a compiled plan by running its training step on fake tensors.

The memory model (:mod:`autockpt.planning.memory_model`) prices every plan the search looks at from
numbers per stage, which keeps the search fast and exact for the model. What it cannot see are
events of single nodes inside a checkpoint's backward. :func:`replay_peak_bytes` prices the one plan
the search chose by running it: the rewritten forward, the loss and the backward, with the real
``torch.utils.checkpoint`` and the real autograd engine, on fake tensors, tracked by the same
:class:`~autockpt.running.measure.track_activation_memory` that :func:`autockpt.measure` uses on a
real step (NOTE [ Replaying a plan on fake tensors ]).

# NOTE [ Replaying a plan on fake tensors ]
A reentrant checkpoint runs its recompute and its inner backward inside the outer backward, and
what is alive at its peak depends on single nodes: the frame keeps the gradient it was handed
for each output until the inner backward returns, autograd materializes zeros for an output
no one read, sums partial gradients in the order they arrive, and copies an operand's gradient
in one graph and not in another. The stage model prices these on average, and on random graphs
it was below the measured peak by up to 10% for a few plans in a hundred (benchmarks/RESULTS.md,
"Graphs the model was not fitted to").

Running the step is exact where the model is not: a fake tensor has a storage that lives and dies as
the real one would (autograd saves and frees the same tensors), only without memory behind it, and
the tracker counts storages. So the planner searches with the model and then replays its choice
(reentrant mode only: the non-reentrant model is not below the measured peak on those graphs, and a
replay costs one fake step per plan). The step runs on fake copies of the parameters and inputs (the
user's module is reparametrized for the call, as the profile does, and put back), each checkpointed
segment through :func:`autockpt.running.runner.run_segment` as at training time, with the user's
``loss_fn`` or, without one, the loss plans price (:func:`autockpt.profiling.loss.planned_loss`: the
model's own, else a gradient the size of each output). A plan of the ``"modules"`` rung is replayed
the same way, its blocks installed on a view of the model (:func:`replay_blocks_peak_bytes`), in
both modes: that rung cannot run ``loss_fn`` with the model while profiling, so its replay is the
first time the user's loss is priced, and its model prices whole blocks from one forward (a
non-reentrant plan of Hugging Face BART's measured 9-11% above it, at half the baseline). Running
Hugging Face's own forward on fake tensors can take a longer path than on real ones where it looks
at values (BART builds an attention mask it skips for real inputs): such a replay is above the step,
by 2-5% there. Where the replay is above the budget, the planner asks the model for a plan under a
budget lowered by the difference (:func:`autockpt.pipeline._replanned`).

Fake kernels make the storage an op's output shape needs; where a real kernel is known to return a
larger one (a reduced MSE loss keeps its element-wise buffer), the replay widens it as the profile
does (:func:`autockpt.ops.instrument.widen_reduced_loss`). With nothing to checkpoint, the runtime
runs the user's own forward, and so does the replay: its Python locals may hold values longer than
the graph does. What the replay does not see is what the measure does not see
(NOTE [ What the dispatch-mode measure cannot see ] in :mod:`autockpt.running.measure`), and what
fake tensors do not run: a data-dependent op fails, and the plan then keeps the model's estimate and
says why. A modules-rung forward that already needed a real profile is replayed as one real step
instead (NOTE [ A real replay where fake tensors cannot run ]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autockpt.capturing.draws import no_layer_dropped, python_draws_high
from autockpt.capturing.trace import TracedModel, base_class, shallow_view
from autockpt.ops.fake_outputs import SHARED
from autockpt.ops.instrument import (
    Op,
    OpObserver,
    OpWatch,
    fake_copy,
    is_fake,
    map_tensors,
    run_with_state,
    tensors,
    widen_reduced_loss,
)
from autockpt.planning.planner import Plan
from autockpt.profiling.blocks import ModuleProfile
from autockpt.profiling.loss import LossFn, planned_loss
from autockpt.profiling.shape_rules import SHAPE_RULES
from autockpt.running.blocks import installed
from autockpt.running.measure import PreservedState, make_step
from autockpt.running.rewrite import RUN_METHOD, compile_onto
from autockpt.running.runner import run_segment, unobserved

__all__ = ["replay_blocks_peak_bytes", "replay_peak_bytes"]


class _Widen(OpObserver):
    """Gives a reduced loss the storage its real kernel keeps, before the tracker, which
    runs above it, sees the op's outputs."""

    def after_op(self, op: Op, out: Any) -> None:
        widen_reduced_loss(op.func, op.args, out)


class _Replayed(nn.Module):
    """The rewritten forward of one plan as a module, for
    :func:`autockpt.running.measure.make_step`: it takes the graph's inputs and returns what the
    user's forward returns."""

    def __init__(self, view: nn.Module, forward: Callable[..., Any],
                 unflatten: Callable[[Any], Any] | None) -> None:
        super().__init__()
        self.view = view
        self._unflatten = unflatten
        self._forward = forward

    def forward(self, *inputs: Any) -> Any:
        out = self._forward(self.view, *inputs)
        return out if self._unflatten is None else self._unflatten(out)


@contextlib.contextmanager
def _fake_mode_for(values: Any) -> Iterator[FakeTensorMode]:
    """The fake mode of fake example inputs, or a new one that turns real tensors it meets (a
    loss's targets, a constant the tracer lifted) into fake ones as they come."""
    existing = next((t.fake_mode for t in tensors(values) if is_fake(t)), None)
    mode = existing if existing is not None else FakeTensorMode()
    before = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with mode:
            yield mode
    finally:
        mode.allow_non_fake_inputs = before


def replay_peak_bytes(module: nn.Module, traced: TracedModel, plan: Plan,
                      inputs: dict[str, Any], *, loss_fn: LossFn | None = None,
                      grad_accumulation: bool = False) -> int:
    """The peak activation bytes of one training step of ``module`` under ``plan``, run on
    fake tensors (NOTE [ Replaying a plan on fake tensors ]).

    Args:
        module: the user's module (its parameters are replaced by fake copies for the call).
        traced: the graph ``plan`` was made for.
        plan: the plan, as the planner made it (its ``loss`` says which loss to run).
        inputs: the graph's inputs by the forward's parameter names (real or fake).
        loss_fn: the user's loss, when the plan priced one.
        grad_accumulation: run a step whose ``.grad`` already exists.

    Raises:
        Exception: whatever the step raises on fake tensors (a data-dependent op); the caller
            keeps the model's estimate then.

    Example:
        >>> import torch, autockpt
        >>> from autockpt.capturing.trace import trace
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> x = torch.randn(8, 64)
        >>> plan = autockpt.plan(net, (x,), mode="reentrant")
        >>> replayed = replay_peak_bytes(net, trace(net, (x,)), plan, {"input": x})
        >>> replayed == plan.estimated_peak_bytes
        True
    """
    view = shallow_view(module)
    if not plan.segments and plan.chunked_head is None and traced.flatten is None:
        # With nothing to checkpoint the runtime runs the user's own forward, whose Python
        # locals may hold values longer than the graph does.
        names = traced.spec.param_names

        def eager(module: nn.Module, *values: Any) -> Any:
            return base_class(module).forward(module, **dict(zip(names, values)))

        replayed = _Replayed(view, eager, None)
    else:
        program = compile_onto(view, traced.graph, traced.constants, plan, 0)

        def run(variant: int, index: int, *segment_inputs: Any) -> Any:
            return run_segment(view, program.segments[index], plan.mode, segment_inputs)

        # An instance attribute, found before the class's: the view is the user's class.
        view.__dict__[RUN_METHOD] = run
        replayed = _Replayed(view, program.forward, traced.unflatten)
    values = tuple(inputs[name] for name in traced.spec.param_names)
    return _fake_step_peak(replayed, values, {}, loss_fn, grad_accumulation)


def replay_blocks_peak_bytes(module: nn.Module, prof: ModuleProfile, plan: Plan,
                             args: tuple[Any, ...], kwargs: dict[str, Any], *,
                             loss_fn: LossFn | None = None, grad_accumulation: bool = False
                             ) -> int:
    """:func:`replay_peak_bytes` for a plan of the ``"modules"`` rung: the user's forward
    with the plan's blocks checkpointed, on a view of ``module`` (whose own tree is not
    touched), and the user's ``loss_fn`` where given, which that rung cannot price.

    A forward that fake tensors cannot run (``prof.fake`` is False: its profile was already a
    real forward) is replayed as one real training step instead, tracked as
    :func:`autockpt.measure` tracks it, with the gradients, buffers and random streams put
    back (NOTE [ A real replay where fake tensors cannot run ]).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from autockpt.planning.blocks import build
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        ...                       for _ in range(4)])
        >>> x = torch.randn(4, 8)
        >>> plan, prof = build(net, (x,), budget_bytes=None, mode="reentrant")
        >>> replay_blocks_peak_bytes(net, prof, plan, (x,), {}) > 0
        True
    """
    with installed(shallow_view(module), prof, plan) as twin:
        if not prof.fake:
            return _real_step_peak(twin, args, kwargs, loss_fn, grad_accumulation)
        with python_draws_high():  # NOTE [ A random scalar in a real forward ]
            return _fake_step_peak(twin, args, kwargs, loss_fn, grad_accumulation)


# NOTE [ A real replay where fake tensors cannot run ]
# A forward that looks at values in Python (``.item()``, LayerDrop's ``torch.rand([]) < p``
# under the transformers of torch 2.11's day) cannot run on fake tensors, so the modules rung
# profiled it on one real forward. Its model prices whole blocks from that forward and was
# 9.9% above half the baseline of Hugging Face BART on an H100 and an H200. So such a plan is
# replayed as the real step it is: the memory it takes is what the planned step itself
# takes, which the user's training loop is about to take anyway. It costs one real step per
# distinct plan replayed (see ``autockpt.pipeline._replanned``). The step runs on the view
# the plan is installed in, whose parameters and buffers are the user's: ``PreservedState``
# puts back every ``.grad`` (the step's own gradients are dropped), every buffer's values
# (BatchNorm's statistics) and the CPU and CUDA random streams, so planning changes nothing
# a later step sees. Its random scalars keep every layer, as in the real profile (NOTE [ A
# random scalar in a real forward ] in :mod:`autockpt.capturing.draws`).


def _real_step_peak(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    loss_fn: LossFn | None, grad_accumulation: bool) -> int:
    """The tracked peak of one real step of ``model``, everything it changes put back."""
    step = make_step(model, args, kwargs, loss_fn if loss_fn is not None else planned_loss,
                     grad_accumulation=grad_accumulation)
    with PreservedState(model, step.grad_leaves, step.device), unobserved(), \
            no_layer_dropped():
        result = step.run(track=True)
    assert result.tracker is not None
    return int(result.tracker.peak_bytes)


def _fake_step_peak(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    loss_fn: LossFn | None, grad_accumulation: bool) -> int:
    """The tracked peak of one step of ``model`` on fake copies of its state and inputs, with
    ``loss_fn`` or the loss plans price without one
    (:func:`autockpt.profiling.loss.planned_loss`)."""
    step_loss = loss_fn if loss_fn is not None else planned_loss
    with _fake_mode_for((args, kwargs)) as mode:
        named = [*model.named_parameters(), *model.named_buffers()]
        state = {name: _fake(mode, t) for name, t in named}
        fake_args, fake_kwargs = map_tensors((args, kwargs), lambda t: _fake(mode, t))

        def tracked() -> int:
            step = make_step(model, fake_args, fake_kwargs, step_loss,
                             grad_accumulation=grad_accumulation, fake=True)
            result = step.run(track=True)
            assert result.tracker is not None
            return result.tracker.peak_bytes

        # The fake step draws no random numbers, but a checkpoint stashes and sets the state.
        # The profile's shape rules answer the ops whose fake kernels are slow Python
        # decompositions (normalisations, activation backwards) with the same outputs, and
        # the memo the ops the profile or the step already ran (the recomputations).
        watch = OpWatch(_Widen(), SHAPE_RULES, memo=SHARED)
        with torch.random.fork_rng(devices=[]), unobserved(), watch:
            return int(run_with_state(model, state, tracked, ()))


def _fake(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    if is_fake(tensor):
        return tensor
    fake = fake_copy(mode, tensor)
    if tensor.is_leaf and tensor.requires_grad != fake.requires_grad:
        fake.requires_grad_(tensor.requires_grad)
    return fake
