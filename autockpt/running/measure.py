"""Measure the activation memory of one real training step.

:func:`measure` runs one forward and backward of a model on example inputs and reports how
many bytes of activations it held: the peak over the step, what was kept for backward, and
the peak of each phase. :class:`track_activation_memory` is the lower-level context manager
it is built on; it also records a timeline of the memory over the ops, to draw the curve.

Example:
    >>> import torch
    >>> from autockpt.running.measure import measure
    >>> model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU())
    >>> report = measure(model, torch.randn(16, 1000))
    >>> report.saved_bytes  # the ReLU output (16*1000*4 B) and the 4-byte loss
    64004

NOTE [ How activation memory is measured ]
    A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen op that runs
    while it is active, in forward and in backward alike: the autograd engine captures the
    thread-local dispatch-mode stack with the graph task and reinstalls it on the thread
    that runs the backward, including the recomputation inside
    ``torch.utils.checkpoint`` (reentrant or not). For every tensor an op returns we take
    its ``untyped_storage()``. A storage we have not seen before is a new allocation: its
    ``nbytes()`` is added to the running total and a weak reference with a callback is
    registered on it. Storages have PyObject preservation: the Python object stays the same
    for as long as the C++ storage lives (a view's ``untyped_storage()`` *is* its base's),
    and is only destroyed together with it, so the callback fires exactly when the memory
    is released, and subtracts it. The peak is updated on every allocation, which is the
    only moment the total can grow, so it is exact at the granularity of whole storages.

    Storages that existed before the step are not activations and must not be counted even
    when an op returns them (``weight.t()`` is a view of a parameter; ``grad += g`` returns
    the gradient). They are recognised two ways. The caller names them (parameters,
    buffers, gradients, inputs: their storages' ``data_ptr`` are kept, with a strong
    reference so that an address cannot be reused while we compare against it). And any
    storage that shows up as an op *input* without having been an op output first was
    allocated outside our view (a plain tensor attribute such as a cached rotary table, a
    global constant): it is remembered, weakly, as foreign, so a later view of it is not
    mistaken for a fresh allocation.

NOTE [ What the dispatch-mode measure cannot see ]
    * Scratch memory a kernel allocates and frees inside one op (a convolution's
      workspace, a reduction's internal copy, cuBLAS workspaces): only op outputs are seen.
    * Allocator effects: CUDA caching-allocator rounding and fragmentation, CPU allocator
      arenas. On CUDA, :attr:`MemoryReport.cuda_max_memory_allocated_bytes` shows what the
      allocator saw, for comparison.
    * Tensors created outside the dispatcher during the step (``torch.from_numpy`` inside
      ``forward``, C++ extension functions that bypass the dispatcher, work done on
      threads the model starts itself, ``torch.compile``'d regions whose generated code
      allocates directly) are treated as pre-existing and not counted.
    * The unit is the storage: a small view that keeps a large storage alive is charged the
      whole storage, which is what the allocator holds.
"""

from __future__ import annotations

import array
import copy
import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

import torch

from autockpt.capturing.trace import split_inputs
from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.ops.instrument import (
    LiveStorages,
    Op,
    OpObserver,
    OpWatch,
    is_fake,
    map_tensors,
    storage_of,
    tensors,
)
from autockpt.planning.budget import storage_bytes
from autockpt.profiling.loss import LossFn, call_loss, check_loss_fn, output_tensors
from autockpt.units import format_bytes, format_seconds

__all__ = [
    "Mark",
    "MemoryReport",
    "TimelinePoint",
    "measure",
    "track_activation_memory",
]


# --------------------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------------------


class Mark(NamedTuple):
    """A labelled moment in a :class:`track_activation_memory` timeline.

    Its first two fields are ``(label, current_bytes)``; ``op_index`` is the index of the
    first op that ran after the mark, so ``timeline[mark.op_index:]`` starts at it.
    """

    label: str
    """What the caller said happens next, e.g. ``"forward"`` or ``"backward"``."""
    current_bytes: int
    """Activation bytes alive when the mark was made."""
    op_index: int
    """Number of ops seen before the mark; the index of the first op after it."""


class TimelinePoint(NamedTuple):
    """Activation bytes alive right after one op."""

    op_index: int
    """Position of the op among all ops seen by the tracker, from 0."""
    phase: int
    """Index into :attr:`track_activation_memory.marks` of the last mark before the op, or
    -1 for ops that ran before the first mark."""
    current_bytes: int
    """Activation bytes alive right after the op's outputs were allocated."""


_LIFT_FRESH_OPS = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
)


class _Forward(OpObserver):
    """Hands every op, after it ran, to its tracker."""

    def __init__(self, tracker: track_activation_memory) -> None:
        self._tracker = tracker

    def after_op(self, op: Op, out: Any) -> None:
        self._tracker._after_op(op, out)


_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
"""Operator namespaces of torch.distributed's collectives."""


class track_activation_memory:  # noqa: N801 - a context manager, named like torch.no_grad
    """Context manager that counts the bytes of tensor storages allocated by ops while it
    is active, minus those freed since: the activations and temporaries of the code it
    wraps. See NOTE [ How activation memory is measured ] in this module.

    Storages of tensors named in ``exclude`` (parameters, buffers, gradients, inputs) are
    never counted, nor are storages that existed before the context and reach an op as an
    input. Counting starts at zero.

    After the context exits, the readings are frozen: storages freed later do not change
    them. A tracker is used once.

    Args:
        exclude: tensors (or untyped storages) that exist before the tracked code and are
            not activations. Their storages are kept alive until the context exits, so
            that their addresses cannot be reused by new allocations.
        device: count only storages on this device (``"cuda"`` matches every CUDA device,
            ``"cuda:1"`` only that one). None counts every device except ``meta``.
        fake: count fake tensors (``FakeTensorMode``), on their fake device, instead of
            passing them over as ``meta`` storages: a step run on shapes alone, as
            :mod:`autockpt.running.replay` runs one. Off, fake ops the tracked code runs (autockpt
            planning inside it) are not counted.

    Example:
        >>> import torch
        >>> weight = torch.randn(100, 100, requires_grad=True)
        >>> weight.grad = torch.zeros_like(weight)  # so that backward adds into it in place
        >>> x = torch.randn(8, 100)
        >>> with track_activation_memory(exclude=[weight, weight.grad, x]) as tracker:
        ...     _ = tracker.mark("forward")
        ...     y = (x @ weight).relu()
        ...     _ = tracker.mark("backward")
        ...     y.sum().backward()
        >>> tracker.marks[1].current_bytes  # y, 8*100*4 B, kept for relu's backward
        3200
        >>> tracker.peak_bytes  # + the sum, its seed gradient, grad of x @ weight, grad of weight
        46408
    """

    def __init__(
        self,
        exclude: Iterable[torch.Tensor | torch.UntypedStorage] = (),
        *,
        device: torch.device | str | None = None,
        fake: bool = False,
    ) -> None:
        self._fake = fake
        if isinstance(exclude, (torch.Tensor, torch.UntypedStorage)):
            exclude = (exclude,)
        try:
            exclude_list = list(exclude)
        except TypeError:
            raise InvalidArgumentError(
                f"exclude must be an iterable of tensors, got {type(exclude).__name__}",
                fix="pass a list of tensors, e.g. exclude=list(model.parameters())",
            ) from None
        self._device = torch.device(device) if device is not None else None

        self._excluded_storages: list[torch.UntypedStorage] = []
        self._excluded_ptrs: set[int] = set()
        # Also by identity: a fake tensor's storage has no address (held strongly above, so
        # an id is not reused meanwhile).
        self._excluded_ids: set[int] = set()
        for item in exclude_list:
            if isinstance(item, torch.Tensor):
                storage = storage_of(item)
            elif isinstance(item, torch.UntypedStorage):
                storage = item
            else:
                raise InvalidArgumentError(
                    f"exclude must hold tensors or untyped storages, got a {type(item).__name__}",
                    fix="pass only tensors, e.g. exclude=list(model.parameters())",
                )
            if storage is None or storage.nbytes() == 0:
                continue
            self._exclude(storage)

        # Storages counted and alive: (nbytes, index of the op that allocated it, for
        # reclassify()).
        self._live: LiveStorages[tuple[int, int]] = LiveStorages(self._release)
        # Storages that existed before we saw them, held weakly.
        self._foreign: LiveStorages[None] = LiveStorages()

        self._current = 0
        self._peak = 0
        self._phase_peak = 0
        self._phase_peaks: list[int] = []
        self._marks: list[Mark] = []
        # One int per op; the phase of each op follows from the marks' op indices, so no
        # per-op object is built while the model runs.
        self._op_bytes = array.array("q")
        # Reentrant: a weakref callback can fire on the thread that holds the lock, when
        # dropping a reference inside _after_op frees a storage. The backward of a CUDA
        # model runs on the autograd engine's device threads, hence the lock at all.
        self._lock = threading.RLock()
        self._mode: OpWatch | None = None
        self._state = "new"

    # -- readings ------------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        """Bytes of counted storages alive now (or when the context exited)."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Largest value :attr:`current_bytes` reached."""
        return self._peak

    @property
    def num_ops(self) -> int:
        """Number of ops seen so far."""
        return len(self._op_bytes)

    @property
    def marks(self) -> list[Mark]:
        """The marks made with :meth:`mark`, in order."""
        return list(self._marks)

    @property
    def phase_peaks(self) -> list[int]:
        """Peak bytes of each phase: entry ``i`` covers the time from ``marks[i]`` to the
        next mark (or to now / the exit), including the bytes alive when it began."""
        if not self._marks:
            return []
        return [*self._phase_peaks, self._phase_peak]

    @property
    def timeline(self) -> list[TimelinePoint]:
        """``(op_index, phase, current_bytes)`` for every op seen, built on demand."""
        points: list[TimelinePoint] = []
        boundaries = [m.op_index for m in self._marks] + [len(self._op_bytes)]
        phase = -1
        start = 0
        for next_phase, end in enumerate(boundaries):
            points.extend(
                TimelinePoint(i, phase, self._op_bytes[i]) for i in range(start, end)
            )
            phase, start = next_phase, max(start, end)
        return points

    def mark(self, label: str) -> Mark:
        """Record ``(label, current_bytes)`` and start a new phase of the timeline.

        Example:
            >>> import torch
            >>> with track_activation_memory() as tracker:
            ...     mark = tracker.mark("forward")
            ...     y = torch.ones(256)
            >>> mark.label, mark.current_bytes, tracker.current_bytes
            ('forward', 0, 1024)
        """
        with self._lock:
            if self._marks:
                self._phase_peaks.append(self._phase_peak)
            self._phase_peak = self._current
            new_mark = Mark(str(label), self._current, len(self._op_bytes))
            self._marks.append(new_mark)
            return new_mark

    def reclassify(self, tensor: torch.Tensor) -> None:
        """Treat ``tensor``'s storage as never having been an activation: stop counting it
        and remove its bytes from every reading since it was allocated.

        ``measure`` calls it when backward's gradient buffer becomes a parameter's ``.grad``.

        Example:
            >>> import torch
            >>> with track_activation_memory() as tracker:
            ...     kept = torch.ones(256)
            ...     tracker.reclassify(kept)
            >>> tracker.peak_bytes
            0
        """
        with self._lock:
            storage = storage_of(tensor)
            if storage is None:
                return
            self._exclude(storage)
            entry = self._live.pop(storage)
            if entry is None:
                return
            nbytes, born = entry
            self._current -= nbytes
            for i in range(born, len(self._op_bytes)):
                self._op_bytes[i] -= nbytes
            self._marks = [
                m._replace(current_bytes=m.current_bytes - nbytes) if m.op_index > born else m
                for m in self._marks
            ]
            self._rederive_peaks()

    def _rederive_peaks(self) -> None:
        """Peaks from the timeline (after reclassify() changed it)."""
        ops = self._op_bytes
        self._peak = max(max(ops, default=0), self._current)
        bounds = [m.op_index for m in self._marks] + [len(ops)]
        peaks = [
            max([mark.current_bytes, *ops[start:end]])
            for mark, start, end in zip(self._marks, bounds, bounds[1:])
        ]
        if peaks:
            self._phase_peaks = peaks[:-1]
            self._phase_peak = max(peaks[-1], self._current)

    # -- context manager -----------------------------------------------------------------

    def __enter__(self) -> track_activation_memory:
        if self._state != "new":
            raise AutockptError(
                "a track_activation_memory tracker can only be entered once",
                fix="create a new tracker for each region you measure",
            )
        self._state = "active"
        self._mode = OpWatch(_Forward(self))
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._mode is not None
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            with self._lock:
                self._state = "done"
                self._mode = None
                # Dropping the weak references cancels their callbacks, which freezes the
                # readings and releases the storages of the excluded tensors.
                self._live.clear()
                self._foreign.clear()
                self._excluded_storages.clear()
                self._excluded_ids.clear()

    # -- bookkeeping, called from the dispatch mode and from weakref callbacks -----------

    def _exclude(self, storage: torch.UntypedStorage) -> None:
        self._excluded_storages.append(storage)
        self._excluded_ids.add(id(storage))
        if storage.device.type != "meta":
            self._excluded_ptrs.add(storage.data_ptr())

    def _after_op(self, op: Op, out: Any) -> None:
        with self._lock:
            if self._state != "active":
                return
            # A tensor that lift_fresh receives was just built from Python data by
            # torch.tensor(); it is new, so do not let it be classified as foreign.
            if op.func not in _LIFT_FRESH_OPS:
                for tensor in op.inputs():
                    self._note_input(tensor)
            for tensor in tensors(out):
                self._note_output(tensor)
            self._op_bytes.append(self._current)
        if getattr(op.func, "namespace", "") in _COLLECTIVE_NAMESPACES:
            # The buffers a collective reads and writes carry parameters or gradients
            # between ranks (FSDP2's all-gather of a block's parameters, its reduce-scatter
            # of their gradients): not activations, however the code allocated them.
            for tensor in [*op.inputs(), *tensors(out)]:
                self.reclassify(tensor)

    def _note_input(self, tensor: torch.Tensor) -> None:
        storage = storage_of(tensor)
        if storage is None or storage in self._live or storage in self._foreign:
            return
        self._foreign.add(storage, None)

    def _note_output(self, tensor: torch.Tensor) -> None:
        storage = storage_of(tensor)
        if storage is None:
            return
        known = self._live.get(storage)
        if known is not None:
            # An op may resize a storage it was handed (out= variants, resize_).
            nbytes = storage.nbytes()
            if nbytes != known[0]:
                self._live.add(storage, (nbytes, known[1]))
                self._add(nbytes - known[0])
            return
        if storage in self._foreign:
            return
        fake = self._fake and is_fake(tensor)
        device = tensor.device if fake else storage.device
        # A real meta tensor holds no memory; a fake one on meta stands for the memory of a
        # model planned on the meta device, in the replay of its plan.
        if device.type == "meta" and not fake:
            return
        if self._device is not None and (
            device.type != self._device.type
            or (self._device.index is not None and device.index != self._device.index)
        ):
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if id(storage) in self._excluded_ids or (
                not fake and storage.data_ptr() in self._excluded_ptrs):
            return
        self._live.add(storage, (nbytes, len(self._op_bytes)))
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self._current += nbytes
        if self._current > self._phase_peak:
            self._phase_peak = self._current
            if self._current > self._peak:
                self._peak = self._current

    def _release(self, entry: tuple[int, int]) -> None:
        with self._lock:
            if self._state == "active":
                self._current -= entry[0]


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryReport:
    """Activation memory and time of one training step, as measured by :func:`measure`.

    All byte counts exclude parameters, parameter gradients, buffers, optimizer state and
    the inputs: they cover activations saved for backward and the temporaries of forward
    and backward, counted per tensor storage as ops allocate and free them.
    """

    peak_activation_bytes: int
    """Largest number of activation bytes alive at once during forward and backward."""
    saved_bytes: int
    """Activation bytes alive at the end of forward (after the loss, just before backward):
    what autograd keeps for backward, plus the model output and the loss."""
    forward_peak_bytes: int
    """Peak within forward, including the loss computation."""
    backward_peak_bytes: int
    """Peak within backward, starting from :attr:`saved_bytes`."""
    step_seconds: float
    """Median wall time of forward, loss and backward over the timed steps, measured
    without the tracker (whose per-op Python overhead would distort it)."""
    cuda_max_memory_allocated_bytes: int | None
    """On CUDA, the rise of ``torch.cuda.max_memory_allocated`` over one untracked step
    above what was allocated before it: activations as the caching allocator sees them,
    including kernel workspaces and rounding. None on other devices."""
    device: str
    """Device of the model, e.g. ``"cpu"`` or ``"cuda:0"``."""
    peak_total_bytes: int | None = None
    """With ``optimizer=``: the peak of everything the step holds at once, ``optimizer.step()``
    included: parameters, buffers, inputs, gradients, optimizer state, activations and the
    temporaries of backward and of the optimizer, each storage counted once. What
    ``total_mb`` budgets. None without an optimizer."""
    timeline: tuple[TimelinePoint, ...] = field(default=(), repr=False, compare=False)
    """Bytes alive after each op of the tracked step; phases index :attr:`marks`."""
    marks: tuple[Mark, ...] = field(default=(), repr=False, compare=False)
    """Phase boundaries of :attr:`timeline`: ``forward``, ``loss``, ``backward``, ``end``."""

    def __str__(self) -> str:
        parts = [
            f"peak activations {format_bytes(self.peak_activation_bytes)} on {self.device}"
            f" (forward {format_bytes(self.forward_peak_bytes)},"
            f" backward {format_bytes(self.backward_peak_bytes)})",
            f"saved for backward {format_bytes(self.saved_bytes)}",
            f"step {format_seconds(self.step_seconds)}",
        ]
        if self.peak_total_bytes is not None:
            parts.append(f"whole step with the optimizer {format_bytes(self.peak_total_bytes)}")
        if self.cuda_max_memory_allocated_bytes is not None:
            parts.append(
                f"CUDA max allocated {format_bytes(self.cuda_max_memory_allocated_bytes)}"
            )
        return "; ".join(parts)


# --------------------------------------------------------------------------------------
# measure()
# --------------------------------------------------------------------------------------

def measure(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | str | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    warmup: int = 0,
    repeat: int = 1,
    optimizer: torch.optim.Optimizer | None = None,
    grad_accumulation: bool = False,
) -> MemoryReport:
    """Run real training steps of ``model`` and report its activation memory and step time.

    One step is tracked for memory (see :class:`track_activation_memory`); then ``repeat``
    steps are timed without the tracker, after ``warmup`` untimed ones, so ``warmup + 1 +
    repeat`` steps run in all. The model stays in the mode it is in (``train()`` or
    ``eval()``), and is left as it was: parameter gradients (None stays None), buffers
    (BatchNorm running statistics, ``num_batches_tracked``), parameters and optimizer state
    (when ``optimizer`` steps them) and the CPU and CUDA random number generators are
    restored, so measuring does not shift the dropout stream.

    A step is ``outputs = model(*args, **kwargs); loss = loss_fn(outputs); loss.backward()``, the
    whole output held until backward ends, as a training loop holds it, whatever the loss. The
    default loss is the one every autockpt entry point uses (NOTE [ The default loss ] in
    :mod:`autockpt.profiling.loss`): the model's own loss when its output holds one (a Hugging Face
    model given ``labels=``), measured as ``outputs = model(**batch); outputs.loss.backward()`` runs
    (accelerate's loop), the logits beside the loss held through backward
    (``model(**batch).loss.backward()`` frees them sooner, and peaks no higher); else the sum of
    every floating-point output tensor that requires grad, whose backward sends a broadcast scalar
    into the output and so leaves out the output-sized gradient a real loss makes. Pass ``loss_fn``
    to measure with your loss.

    Inputs that require grad get gradients during the step; leaf inputs have their
    ``.grad`` restored afterwards, and non-leaf inputs are detached first so that backward
    stays inside the model.

    Args:
        model: the module to measure, on the device to measure on.
        example_inputs: the inputs of ``forward``: one tensor, a tuple or list of positional
            inputs, or a dict of keyword inputs.
        loss_fn: ``loss_fn(output) -> scalar tensor``, or the name of a built-in loss
            (``"cross_entropy"``, ``"mse"``, ``"sum"``); defaults to the loss described above.
        example_kwargs: keyword inputs of ``forward``.
        warmup: untimed steps before the timed ones.
        repeat: timed steps; :attr:`MemoryReport.step_seconds` is their median.
        optimizer: an optimizer over the model's parameters: each step ends with
            ``optimizer.step()``, and :attr:`MemoryReport.peak_total_bytes` reports the peak
            of the whole step, its state and temporaries included (what ``total_mb``
            budgets).
        grad_accumulation: measure a step of gradient accumulation: every parameter's
            ``.grad`` is already allocated (a zero tensor) when backward runs, so each
            weight gradient is a temporary added into it.

    Returns:
        A :class:`MemoryReport`.

    Raises:
        InvalidArgumentError: ``model`` is not a module, an argument has the wrong type,
            ``forward``, ``loss_fn``, backward or ``optimizer.step()`` raise (chained to the
            original error), or the output has nothing to differentiate.

    Example:
        >>> import torch
        >>> from autockpt.running.measure import measure
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 1000)
        ... )
        >>> report = measure(model, torch.randn(16, 1000))
        >>> report.saved_bytes  # ReLU output and final output, 16*1000*4 B each, + loss
        128004
        >>> "KiB" in str(report)
        True
    """
    args, kwargs, loss = check_arguments(model, example_inputs, loss_fn, example_kwargs,
                                          warmup, repeat, optimizer, grad_accumulation)
    step = make_step(model, args, kwargs, loss, optimizer=optimizer,
                     grad_accumulation=grad_accumulation)
    device = step.device
    with PreservedState(model, step.grad_leaves, device, optimizer):
        for _ in range(warmup):
            step.run()

        tracked = step.run(track=True)
        assert tracked.tracker is not None
        tracker = tracked.tracker

        seconds: list[float] = []
        cuda_peak: int | None = None
        for index in range(repeat):
            result = step.run(cuda_peak=index == 0 and device.type == "cuda")
            seconds.append(result.seconds)
            if result.cuda_peak_bytes is not None:
                cuda_peak = result.cuda_peak_bytes

    marks = {m.label: i for i, m in enumerate(tracker.marks)}
    phase_peaks = tracker.phase_peaks
    return MemoryReport(
        peak_activation_bytes=tracker.peak_bytes,
        saved_bytes=tracker.marks[marks["backward"]].current_bytes,
        forward_peak_bytes=max(phase_peaks[marks["forward"]], phase_peaks[marks["loss"]]),
        backward_peak_bytes=phase_peaks[marks["backward"]],
        step_seconds=statistics.median(seconds),
        cuda_max_memory_allocated_bytes=cuda_peak,
        device=str(device),
        peak_total_bytes=tracked.total_bytes,
        timeline=tuple(tracker.timeline),
        marks=tuple(tracker.marks),
    )


# NOTE [ Gradients during a measured step ]
#     Each step starts as after ``optimizer.zero_grad()`` (the default ``set_to_none=True``):
#     every trainable leaf's ``.grad`` is None. AccumulateGrad then *steals* the gradient
#     buffer backward allocated (or clones it): that storage is a parameter gradient from
#     the moment it exists, not an activation, so a post-accumulate-grad hook tells the
#     tracker to reclassify it, which removes its bytes from the whole timeline since it was
#     allocated. With ``grad_accumulation=True`` each trainable parameter's ``.grad`` is a
#     zero tensor before the step instead, as from the second micro-batch on: backward then
#     computes each weight gradient into a temporary and adds it in place, a parameter-sized
#     temporary that counts as activation memory because the step cannot run without it. The
#     user's own ``.grad`` tensors are never written: each leaf's previous ``.grad`` object
#     (or None) is put back when measuring ends.
#
# NOTE [ The whole step ]
#     With an optimizer, a second tracker runs around the first and never reclassifies: it
#     counts every storage the step allocates (activations, gradients, the optimizer's state
#     on its first step and the temporaries of ``optimizer.step()``), which runs after
#     backward while the output and the loss are still held, as in a training loop. Adding
#     what existed before the step (parameters, buffers, inputs, gradients and state already
#     allocated) gives the peak of the whole step, what ``total_mb`` must cover.


def make_step(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              loss_fn: LossFn | None, *, optimizer: torch.optim.Optimizer | None = None,
              grad_accumulation: bool = False, fake: bool = False) -> _Step:
    """A training step of ``model`` on these (already checked) inputs, set up the way
    :func:`measure` measures it: non-leaf inputs detached, the leaves whose ``.grad`` backward
    writes collected, the device found."""
    args = map_tensors(args, _detach_non_leaf)
    kwargs = map_tensors(kwargs, _detach_non_leaf)
    parameters = list(model.parameters())
    buffers = list(model.buffers())
    input_tensors = list(output_tensors((args, kwargs)))
    device = _step_device(parameters, buffers, input_tensors)
    # Leaves whose .grad backward writes: trainable parameters and leaf inputs that require
    # grad. Deduplicated by identity; a tensor can be both an input and a parameter.
    grad_leaves: dict[int, torch.Tensor] = {}
    for tensor in [*parameters, *input_tensors]:
        if tensor.requires_grad and tensor.is_leaf:
            grad_leaves.setdefault(id(tensor), tensor)
    # Only parameters accumulate across micro-batches: each micro-batch brings new inputs.
    accumulating = ([p for p in parameters if p.requires_grad and p.is_leaf]
                    if grad_accumulation else [])
    return _Step(model, args, kwargs, loss_fn, list(grad_leaves.values()), device, optimizer,
                 list({id(p): p for p in accumulating}.values()), fake)


@dataclass
class _StepResult:
    seconds: float
    tracker: track_activation_memory | None = None
    cuda_peak_bytes: int | None = None
    total_bytes: int | None = None


@dataclass
class _Step:
    """One forward + loss + backward (+ optimizer step) of the model, runnable several
    times."""

    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: LossFn | None
    grad_leaves: list[torch.Tensor]
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None
    accumulating: list[torch.Tensor] = field(default_factory=list)
    """Parameters whose ``.grad`` is allocated before the step (gradient accumulation)."""
    fake: bool = False
    """The step runs on fake tensors, which its trackers count."""
    tracker: track_activation_memory | None = field(default=None, init=False)
    """The tracker of the tracked step running now, for marks made from outside (the
    memory picture marks its segments); ``None`` between steps."""

    def existing_tensors(self) -> list[torch.Tensor]:
        """What exists before the step and is not an activation: parameters, buffers,
        inputs, the gradients already allocated and the optimizer's state."""
        grads = [leaf.grad for leaf in self.grad_leaves if leaf.grad is not None]
        state = (list(output_tensors(list(self.optimizer.state.values())))
                 if self.optimizer is not None else [])
        return [*self.model.parameters(), *self.model.buffers(),
                *output_tensors((self.args, self.kwargs)), *grads, *state]

    def _reset_grads(self) -> None:
        # See NOTE [ Gradients during a measured step ].
        for leaf in self.grad_leaves:
            leaf.grad = None
        with torch.no_grad():
            for param in self.accumulating:
                param.grad = torch.zeros_like(param)

    def run(self, *, track: bool = False, cuda_peak: bool = False) -> _StepResult:
        """Run one step; track its memory when ``track``, or measure the CUDA allocator's
        peak when ``cuda_peak``."""
        self._reset_grads()
        handles = []
        try:
            before = 0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                if cuda_peak:
                    before = torch.cuda.memory_allocated(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
            if not track:
                start = time.perf_counter()
                held = self._forward_backward(None)
                self._optimizer_step()
                del held
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - start
                peak = None
                if cuda_peak:
                    peak = torch.cuda.max_memory_allocated(self.device) - before
                return _StepResult(seconds=seconds, cuda_peak_bytes=peak)

            exclude = self.existing_tensors()
            # See NOTE [ The whole step ].
            whole = (track_activation_memory(exclude=exclude, device=self.device, fake=self.fake)
                     if self.optimizer is not None else None)
            tracker = track_activation_memory(exclude=exclude, device=self.device,
                                              fake=self.fake)
            # Autograd calls the hook also where no gradient reached the leaf (an op's
            # backward returned None for it): its ``.grad`` is then None, nothing to move.
            handles = [
                leaf.register_post_accumulate_grad_hook(
                    lambda leaf: None if leaf.grad is None else tracker.reclassify(leaf.grad)
                )
                for leaf in self.grad_leaves
                if leaf.is_leaf
            ]
            self.tracker = tracker
            start = time.perf_counter()
            if whole is None:
                with tracker:
                    self._forward_backward(tracker)
                return _StepResult(seconds=time.perf_counter() - start, tracker=tracker)
            existing_bytes = storage_bytes(exclude)
            with whole:
                with tracker:
                    held = self._forward_backward(tracker)
                self._optimizer_step()
                del held
            return _StepResult(seconds=time.perf_counter() - start, tracker=tracker,
                               total_bytes=existing_bytes + whole.peak_bytes)
        finally:
            self.tracker = None
            for handle in handles:
                handle.remove()
            for leaf in self.grad_leaves:
                leaf.grad = None

    def _forward_backward(self, tracker: track_activation_memory | None) -> tuple[Any, ...]:
        """Forward, loss and backward; returns what the training loop still holds after
        backward (the output and the loss), for the optimizer step to run beside."""
        model_name = type(self.model).__name__
        with torch.enable_grad():
            if tracker is not None:
                tracker.mark("forward")
            try:
                output = self.model(*self.args, **self.kwargs)
            except Exception as err:
                raise InvalidArgumentError(
                    f"{model_name}.forward raised {type(err).__name__} "
                    f"on the example inputs: {err}",
                    fix=(
                        "check that example_inputs (positional) and example_kwargs match the "
                        f"signature of {model_name}.forward and live on {self.device}"
                    ),
                ) from err

            if tracker is not None:
                tracker.mark("loss")
            # The output is held through backward whatever the loss, the model's own
            # included: ``outputs = model(**batch); outputs.loss.backward()`` keeps the logits
            # alive until it ends (NOTE [ The loss node ] in autockpt.profiling.profile).
            loss = call_loss(self.loss_fn, output, model_name)

            if tracker is not None:
                tracker.mark("backward")
            try:
                loss.backward()
            except Exception as err:
                raise InvalidArgumentError(
                    f"backward through {model_name} raised {type(err).__name__}: {err}",
                    fix=(
                        "check that the model trains outside autockpt with the same inputs, "
                        "e.g. that nothing modifies a tensor in place that backward needs"
                    ),
                ) from err
            if tracker is not None:
                tracker.mark("end")
            return output, loss

    def _optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        try:
            self.optimizer.step()
        except Exception as err:
            raise InvalidArgumentError(
                f"{type(self.optimizer).__name__}.step() raised {type(err).__name__}: {err}",
                fix="pass an optimizer built on this model's parameters, e.g. "
                "torch.optim.AdamW(model.parameters())",
            ) from err


class PreservedState:
    """Snapshots what a training step changes in the user's world and puts it back.

    Restored on exit, also when the step raised: the ``.grad`` of each leaf (the same
    tensor object, or None), every buffer (the same tensor object, with its old values),
    with an optimizer the parameters' values and the optimizer's state, and the CPU and CUDA
    random number generators.
    """

    def __init__(
        self, model: torch.nn.Module, grad_leaves: list[torch.Tensor], device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self._model = model
        self._grad_leaves = grad_leaves
        self._device = device
        self._optimizer = optimizer
        self._grads: list[torch.Tensor | None] = []
        self._buffers: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._parameters: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._optimizer_state: dict[str, Any] | None = None
        self._cpu_rng: torch.Tensor | None = None
        self._cuda_rng: list[torch.Tensor] | None = None

    def __enter__(self) -> PreservedState:
        self._grads = [leaf.grad for leaf in self._grad_leaves]
        with torch.no_grad():
            for module in self._model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    # Keep the object too: a forward may rebind the attribute to a new
                    # tensor instead of updating in place.
                    self._buffers.append((module, name, buffer, buffer.detach().clone()))
            if self._optimizer is not None:
                # On the CPU, so that the copies take nothing from the device measured.
                self._parameters = [
                    (p, p.detach().to("cpu", copy=True))
                    for group in self._optimizer.param_groups for p in group["params"]
                ]
                self._optimizer_state = copy.deepcopy(self._optimizer.state_dict())
        self._cpu_rng = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_rng = torch.cuda.get_rng_state_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for leaf, grad in zip(self._grad_leaves, self._grads):
            leaf.grad = grad
        with torch.no_grad():
            for module, name, buffer, snapshot in self._buffers:
                setattr(module, name, buffer)
                buffer.copy_(snapshot)
            for param, saved in self._parameters:
                param.copy_(saved)
        self._buffers.clear()
        self._parameters.clear()
        if self._optimizer is not None and self._optimizer_state is not None:
            self._optimizer.load_state_dict(self._optimizer_state)
            self._optimizer_state = None
        assert self._cpu_rng is not None
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)


# --------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------


def check_arguments(
    model: Any,
    example_inputs: Any,
    loss_fn: Any,
    example_kwargs: Any,
    warmup: Any,
    repeat: Any,
    optimizer: Any = None,
    grad_accumulation: Any = False,
) -> tuple[tuple[Any, ...], dict[str, Any], LossFn | None]:
    """``(args, kwargs, loss_fn)`` from :func:`measure`'s arguments, or a clear error."""

    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}",
            fix="pass the module itself, e.g. measure(model, x), not its output or state_dict",
        )
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(
            "keyword inputs must be keyed by argument names (str), got keys "
            f"{[k for k in kwargs if not isinstance(k, str)]!r}",
            fix="pass a dict such as example_kwargs={'attention_mask': mask}",
        )
    loss = check_loss_fn(loss_fn)
    for name, value, least in (("warmup", warmup, 0), ("repeat", repeat, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgumentError(
                f"{name} must be an int >= {least}, got {value!r}",
                fix=f"pass {name}={max(least, 1)}",
            )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
            fix="pass the optimizer itself, e.g. optimizer=torch.optim.AdamW(model.parameters())",
        )
    if not isinstance(grad_accumulation, bool):
        raise InvalidArgumentError(
            f"grad_accumulation must be True or False, got {grad_accumulation!r}",
            fix="pass grad_accumulation=True to measure a micro-batch after the first",
        )

    for kind, tensors in (("parameter", model.named_parameters()),
                          ("buffer", model.named_buffers())):
        for name, tensor in tensors:
            if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
                raise InvalidArgumentError(
                    f"{kind} {name!r} of {type(model).__name__} is not initialized yet "
                    "(a lazy module); its first forward would allocate it inside the "
                    "measured step",
                    fix="run the model once on the example inputs before measuring",
                )
    return args, kwargs, loss


def _step_device(
    parameters: list[torch.Tensor], buffers: list[torch.Tensor], inputs: list[torch.Tensor]
) -> torch.device:
    """The device the step runs on: the model's, else the inputs', else the meta device
    where everything is on it (a fake step of a model planned there), else the CPU."""
    everything = [*parameters, *buffers, *inputs]
    for tensor in everything:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("meta") if everything else torch.device("cpu")


def _detach_non_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A non-leaf input would let backward run into the caller's graph and write the
    ``.grad`` of tensors we cannot restore; cut it to a fresh leaf sharing its storage."""
    if tensor.requires_grad and not tensor.is_leaf:
        return tensor.detach().requires_grad_(True)
    return tensor
