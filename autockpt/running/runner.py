"""The one segment runner: a checkpointed segment of any rung runs through :func:`run_checkpointed`.

The graph rungs (a segment function compiled by :mod:`autockpt.running.rewrite`, called by
:mod:`autockpt.runtime`) and the modules rung (a block's own forward, called by
:mod:`autockpt.running.blocks`) both hand it a function of tensors and what the plan decided for
that segment; it calls ``torch.utils.checkpoint.checkpoint`` with the dummy argument, the RNG
replay and the buffer guard, and tells the observers (:func:`observe_segments`) what runs.

# NOTE [ Recompute must not update buffers twice ]
Checkpoint recomputes a segment's forward in backward. A BatchNorm in train mode would update
its running statistics (and ``num_batches_tracked``) a second time (pytorch/pytorch#96136, both
modes). The segment function counts its calls per checkpoint invocation: the first is the real
forward; on any later call (the recompute) it swaps in clones of the buffers the profiler saw
being updated in that segment, so that the recompute updates the clones, and puts the
originals back afterwards, also when a non-reentrant recompute stops early by raising.
BatchNorm saves its running statistics for backward, so the recompute's clones stay alive
until each BatchNorm has run backward: activation memory that only a recompute has, which the
memory model counts (``Stage.recompute_buffer_bytes`` in :mod:`autockpt.planning.chain`; left out, a
stack of BatchNorm layers trained with cross-entropy was estimated 0.5% below its measured
peak).

# NOTE [ RNG only where needed ]
``preserve_rng_state=True`` stashes and restores the CPU and CUDA RNG states around every
recompute. It is needed for dropout to drop the same elements twice, and costs time, so it is
only asked for in segments where the profiler saw an op that consumes the RNG.

# NOTE [ The dummy argument ]
Reentrant checkpoint only gives gradients when a tensor argument requires grad: a segment with
trainable parameters whose inputs do not would silently leave those parameters without gradient.
Such a segment gets a scalar that requires grad as its first argument, which its function drops. The
plan says which segments need it (:attr:`autockpt.planning.planner.Segment.dummy_arg` for the graph
rungs, :attr:`autockpt.running.blocks.BlockSpec.dummy_arg` for the modules rung). Under
``torch.compile`` no dummy is made: dynamo traces the call into checkpoint's higher-order op, whose
backward reaches the parameters whatever the inputs, and it graph-breaks on a tensor created with
``requires_grad=True`` (every segment after it would run uncompiled).

# NOTE [ Outputs no gradient reached ]
Reentrant checkpoint's backward gets a zero tensor for each output that received no gradient
(autograd materializes them for a Python Function) and runs its inner backward on every
output that requires grad: the parameters that feed only such an output (a value read by a
dead branch, or returned by the model and ignored by the loss) got ``.grad`` full of zeros
where the model without checkpointing leaves ``None``, so AdamW decayed them and DDP counted
them as used. So the runner tells the recompute which outputs those are. A pre-hook on the
checkpoint's backward node (it runs before the node materializes the zeros) records, in a
cell of this checkpoint call, the outputs whose gradient is ``None``; the recompute, which
runs inside that node's backward, returns them detached, and torch leaves them out of its
inner backward.

Torch refuses a recompute with no output that requires grad ("none of output has
requires_grad=True"). None does when no output got a gradient (every consumer's backward
returned ``None``), or when no output depends on anything that requires grad (a segment whose
only trainable ops are a dead branch inside it, checkpointed for the memory that branch
saves: torch raised there before). A scalar leaf expanded to one output's shape then stands
in for that output: the gradient handed to it stops there, and every input and parameter
gets ``None``, as without checkpointing.

A hook rather than an autograd Function around the outputs: it adds no node and no output
tensor (an output of a custom Function that returns its input as-is is a view that an
in-place op after the segment may not modify), and nothing in the forward changes. The
recompute frees the dead part of its graph when it returns instead of running a backward
of zeros through it. The replay on fake tensors (:mod:`autockpt.running.replay`) runs the same
runner, hooks included, so it still prices the step as it runs. Non-reentrant checkpoint
needs none of this: its recompute only refills saved tensors, and the ordinary graph gives
``None`` where the original does. Under ``torch.compile`` nothing is hooked: the compiled
checkpoint has no such node.

# NOTE [ Observing segments ]
Tools that look at a step from outside (:func:`autockpt.diagnose`, the memory picture of
:mod:`autockpt.tools.plot`) need to know which checkpoint call is which segment, and when its
recompute runs. The runner tells them: an observer registered with :func:`observe_segments`
on a thread hears of every segment that thread runs under checkpoint (just before checkpoint
is called, and when it returns) and of its recompute (around the second run of its function,
on whatever thread backward runs it: the observers are those of the forward). Events add no
ATen op: a tracked memory curve is the same with and without observers.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autockpt.ops.kept import keep_context
from autockpt.planning.planner import Segment
from autockpt.running.rewrite import SegmentProgram

__all__ = ["CheckpointedForward", "SegmentObserver", "SegmentRun", "observe_segments",
           "run_checkpointed", "run_segment", "unobserved"]


@dataclass(frozen=True)
class SegmentRun:
    """One checkpointed run of a segment, as observers hear of it."""

    module: nn.Module
    """The module whose segment runs: the transformed model (graph rungs) or the block
    (modules rung)."""
    segment: Segment | None
    """The plan's row for the segment (graph rungs); ``None`` for a block of the modules rung,
    which runs as one checkpoint per block (NOTE [ One checkpoint per block ] in
    :mod:`autockpt.running.blocks`)."""
    block: str
    """The block's qualified name (modules rung); ``""`` for the graph rungs."""
    mode: str
    """``"non_reentrant"`` or ``"reentrant"``."""
    dummy_arg: bool
    """Whether the checkpoint call gets the dummy argument first (NOTE [ The dummy argument ])."""


class SegmentObserver:
    """Hears of the segments run under checkpoint (NOTE [ Observing segments ]).

    Subclass it and override the methods you need; each does nothing by default.
    """

    def segment_started(self, run: SegmentRun, inputs: tuple[Any, ...]) -> None:
        """Just before checkpoint is called on the segment's ``inputs`` in forward."""

    def segment_finished(self, run: SegmentRun) -> None:
        """When that checkpoint call returns or raises."""

    def recompute_started(self, run: SegmentRun) -> None:
        """Just before the segment's function runs again in backward (buffers swapped)."""

    def recompute_finished(self, run: SegmentRun) -> None:
        """When the recompute returns or raises (also when a non-reentrant one stops early)."""


_LOCAL = threading.local()
_O = TypeVar("_O", bound=SegmentObserver)


def _observers() -> tuple[SegmentObserver, ...]:
    return getattr(_LOCAL, "observers", ())


@contextlib.contextmanager
def observe_segments(observer: _O) -> Iterator[_O]:
    """Tell ``observer`` of the segments this thread runs under checkpoint within the block.

    Example:
        >>> class Count(SegmentObserver):
        ...     runs = 0
        ...     def segment_started(self, run, inputs):
        ...         self.runs += 1
        >>> with observe_segments(Count()) as count:
        ...     pass
        >>> count.runs
        0
    """
    previous = _observers()
    _LOCAL.observers = (*previous, observer)
    try:
        yield observer
    finally:
        _LOCAL.observers = previous


def run_checkpointed(
    run: SegmentRun,
    fn: Callable[..., Any],
    inputs: tuple[Any, ...],
    *,
    preserve_rng: bool,
    buffers: Sequence[str],
    keep: bool = False,
) -> Any:
    """``fn(*inputs)`` under ``torch.utils.checkpoint.checkpoint`` as the plan says.

    Args:
        run: the segment, its module, mode and whether it gets the dummy argument.
        fn: the segment's function of ``inputs``.
        inputs: its arguments; checkpoint keeps the tensors among them for the recompute.
        preserve_rng: stash and replay the RNG state (NOTE [ RNG only where needed ]).
        buffers: buffers the segment updates, qualified from ``run.module``: clones take
            their place during the recompute (NOTE [ Recompute must not update buffers
            twice ]).
        keep: keep the outputs of its matmuls, convolutions and attention from the forward
            and recompute only the rest (non-reentrant mode; NOTE [ Keep the expensive,
            recompute the cheap ] in :mod:`autockpt.ops.kept`).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> run = SegmentRun(lin, None, "", "reentrant", dummy_arg=True)
        >>> out = run_checkpointed(run, lin, (torch.randn(3, 2),), preserve_rng=False,
        ...                        buffers=())
        >>> out.sum().backward()
        >>> lin.weight.grad is not None
        True
    """
    observers = _observers()
    guarded = _guarded(run, fn, buffers, observers, keep and run.mode != "reentrant")
    for observer in observers:
        observer.segment_started(run, inputs)
    try:
        if run.mode != "reentrant":
            if keep:
                return checkpoint(guarded, *inputs, use_reentrant=False,
                                  preserve_rng_state=preserve_rng, context_fn=keep_context)
            return checkpoint(guarded, *inputs, use_reentrant=False,
                              preserve_rng_state=preserve_rng)
        unread = _Unread()
        target = _skipping_unread(guarded, unread)
        if not run.dummy_arg or torch.compiler.is_compiling():
            # Under torch.compile the checkpoint is traced into a higher-order op whose
            # backward reaches the parameters whatever the inputs, so the dummy is not needed,
            # and dynamo cannot create a tensor that requires grad inside the graph.
            out = checkpoint(target, *inputs, use_reentrant=True,
                             preserve_rng_state=preserve_rng)
        else:
            dummy = torch.empty((), device=_device_of(run.module, inputs), requires_grad=True)
            out = checkpoint(_drop_first(target), dummy, *inputs, use_reentrant=True,
                             preserve_rng_state=preserve_rng)
        _watch_unread(out, unread)
        return out
    finally:
        for observer in observers:
            observer.segment_finished(run)


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Run the block's segments unheard by this thread's observers: autockpt's replay of a
    plan on fake tensors (:mod:`autockpt.running.replay`), which may run while a user's step is
    observed (a module planned at its first forward)."""
    previous = _observers()
    _LOCAL.observers = ()
    try:
        yield
    finally:
        _LOCAL.observers = previous


def run_segment(module: nn.Module, program: SegmentProgram, mode: str, inputs: tuple[Any, ...]
                ) -> Any:
    """Run one compiled segment of ``module`` under checkpoint, as its plan row says."""
    if not torch.is_grad_enabled():
        return program.fn(module, *inputs)
    segment = program.segment
    run = SegmentRun(module=module, segment=segment, block="", mode=mode,
                     dummy_arg=segment.dummy_arg)
    return run_checkpointed(run, functools.partial(program.fn, module), inputs,
                            preserve_rng=segment.preserve_rng, buffers=segment.buffers,
                            keep=segment.keeps)


def _guarded(run: SegmentRun, fn: Callable[..., Any], buffers: Sequence[str],
             observers: tuple[SegmentObserver, ...], keep: bool = False) -> Callable[..., Any]:
    """The segment's function for one checkpoint call; see NOTE [ Recompute must not update
    buffers twice ]. ``keep``: it runs under torch's selective checkpoint (NOTE [ Clones a
    selective recompute must have seen ])."""
    calls = 0

    def guarded(*inputs: Any) -> Any:
        nonlocal calls
        if torch.compiler.is_compiling():
            # Under torch.compile the segment is traced once into checkpoint's higher-order
            # op and the recompute is done by the compiled backward, never by calling this
            # function again, so there is no second call to guard. Counting here would be a
            # side effect outside the op, which makes dynamo graph-break and run every
            # checkpointed segment uncompiled.
            return fn(*inputs)
        calls += 1
        if calls == 1:
            if keep:
                # NOTE [ Clones a selective recompute must have seen ]: torch's selective
                # checkpoint looks every op of the recompute up among those of the forward,
                # op by op, and fails on one the forward did not run: the clones of the
                # buffers the recompute makes below. So the forward makes them too, first,
                # as the recompute does, and drops them (a BatchNorm's statistics: bytes).
                for _, _, original in _buffer_slots(run.module, buffers):
                    if original is not None:
                        original.clone()
            return fn(*inputs)
        # The recompute updates clones; the real buffers keep the values (and the version
        # counters) the forward left. Copying values back instead would bump the version of a
        # buffer the recomputed graph saved, and backward would refuse to run.
        slots = _buffer_slots(run.module, buffers)
        for owner, name, original in slots:
            if original is not None:
                owner._buffers[name] = original.clone()
        try:
            for observer in observers:
                observer.recompute_started(run)
            try:
                return fn(*inputs)
            finally:
                for observer in observers:
                    observer.recompute_finished(run)
        finally:
            for owner, name, original in slots:
                owner._buffers[name] = original

    return guarded


def _buffer_slots(module: nn.Module, buffers: Sequence[str]
                  ) -> list[tuple[nn.Module, str, torch.Tensor | None]]:
    """``(owner, name, buffer)`` for each qualified buffer name, from ``module``."""
    slots = []
    for qualname in buffers:
        owner_path, _, name = qualname.rpartition(".")
        owner = module.get_submodule(owner_path)
        slots.append((owner, name, owner._buffers.get(name)))
    return slots


class _Unread:
    """Which outputs of one reentrant checkpoint call got no gradient in the backward now
    running (NOTE [ Outputs no gradient reached ])."""

    __slots__ = ("indices",)

    def __init__(self) -> None:
        self.indices: tuple[int, ...] | None = None
        """Positions in the function's output tuple (0 for a single tensor); ``None`` until
        the checkpoint's backward starts, so the forward's call is left alone."""


def _watch_unread(out: Any, unread: _Unread) -> None:
    """Hook the backward node of a reentrant checkpoint's outputs ``out`` so that it fills
    ``unread`` before the recompute runs."""
    if torch.compiler.is_compiling():
        return
    values = (out,) if isinstance(out, torch.Tensor) else out
    if not isinstance(values, tuple):
        return
    node = next((v.grad_fn for v in values
                 if isinstance(v, torch.Tensor) and v.grad_fn is not None), None)
    if node is None:
        return

    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        # A Python Function node has one gradient per output of its forward, non-tensors
        # included, so positions are the output tuple's.
        unread.indices = tuple(i for i, g in enumerate(grad_outputs) if g is None)

    node.register_prehook(record)


def _skipping_unread(fn: Callable[..., Any], unread: _Unread) -> Callable[..., Any]:
    """``fn``, whose outputs that got no gradient come back detached from the recompute
    (NOTE [ Outputs no gradient reached ])."""

    def run(*inputs: Any) -> Any:
        out = fn(*inputs)
        if unread.indices is None or torch.compiler.is_compiling():
            return out
        single = isinstance(out, torch.Tensor)
        if not single and not isinstance(out, tuple):
            return out
        values = [out] if single else list(out)
        live = False
        for i, value in enumerate(values):
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            if i in unread.indices:
                values[i] = value.detach()
            else:
                live = True
        if not live:
            # Torch refuses a recompute without an output that requires grad; none does when
            # no gradient reached the checkpoint, or when no output depends on anything that
            # requires grad (the segment's only trainable ops are a dead branch inside it).
            # A leaf stands in for one output and stops the gradient it is handed.
            for i, value in enumerate(values):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    values[i] = value.new_zeros(()).requires_grad_().expand(value.shape)
                    break
        return values[0] if single else tuple(values)

    return run


def _drop_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(_dummy: torch.Tensor, *inputs: Any) -> Any:
        return fn(*inputs)

    return run


def _device_of(module: nn.Module, inputs: tuple[Any, ...]) -> torch.device:
    """Where the dummy argument goes: with the first tensor input, else with the module."""
    for value in inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class CheckpointedForward:
    """The methods autockpt's generated subclasses add to the user's class (through
    :func:`autockpt.capturing.trace.generated_subclass`); only ``forward`` changes behaviour.

    A subclass says what one instance checkpoints (:meth:`_autockpt_how`, ``None`` for
    nothing), how (:meth:`_autockpt_forward`), and how unpickling rebuilds an instance
    (:attr:`_autockpt_rebuild`).
    """

    _autockpt_base: type[nn.Module]
    _autockpt_rebuild: Callable[[type[nn.Module]], nn.Module]
    """A module-level function (a ``staticmethod`` of the subclass) making an empty instance of
    the generated subclass of a user's class; pickles name it by module and name, so it stays
    where saved files expect it."""

    def _autockpt_how(self) -> Any:
        """What this instance checkpoints (its per-instance state), or ``None``."""
        raise NotImplementedError

    def _autockpt_forward(self, how: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward that checkpoints what ``how`` says."""
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module: nn.Module = self  # type: ignore[assignment]
        how = self._autockpt_how()
        # Eval and no_grad need no checkpoint: the user's own forward, untouched.
        if how is None or not module.training or not torch.is_grad_enabled():
            return self._autockpt_base.forward(module, *args, **kwargs)
        return self._autockpt_forward(how, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The generated class cannot be pickled by name: rebuild it from the user's class.
        return (self._autockpt_rebuild, (self._autockpt_base,), self.__dict__.copy())
