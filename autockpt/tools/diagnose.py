"""Runtime diagnostics: one observed training step on a copy of the model.

:func:`diagnose` deep-copies the model, runs one forward and backward on the copy with
PyTorch's checkpoint functions observed, and turns what it saw into findings (see
:mod:`autockpt.tools.findings` for the codes and docs/diagnostics.md for an example of each). The
user's model, its gradients and buffers, the example inputs and the global RNG streams are left
exactly as they were.

# NOTE [ Observing checkpoint calls ]
Scripts reach checkpoint as ``torch.utils.checkpoint.checkpoint``, through a name imported
with ``from torch.utils.checkpoint import checkpoint`` (a global of the user's module, and of
``autockpt.running.runner``), through ``checkpoint_sequential`` (which calls ``checkpoint`` through
its module's globals) and through PyTorch's ``CheckpointWrapper``, whose instances hold a
``functools.partial`` of the function made when they were built. So for the length of the run
every global that *is* one of the two functions (or a partial of one) is replaced by a
recording twin: in every module in ``sys.modules``, in the namespaces the model's methods were
defined in (a doctest, ``exec``'d code) and in those of the calling frames; so are such
attributes of the copied modules. Everything is put back in a ``finally``, once the last
concurrent diagnosis ends. The twins pass straight through on threads that are not diagnosing.
A checkpoint function captured in a closure before the run cannot be reached.

A recorded call notes its call site (the first stack frame outside torch, autockpt and the
standard library), its flags (``use_reentrant`` and whether it was explicit,
``preserve_rng_state``), its tensor arguments (``requires_grad``, leaf, parameter), keyword and
container tensors, the module(s) the function belongs to, grad mode and training mode. It then
calls the real checkpoint with the function wrapped, so that each run of the function (the
forward, then the recompute in backward) is watched by a dispatch mode: which trainable
parameters it reads, whether it draws random numbers, whether it writes into its inputs or into
buffers.

# NOTE [ What counts as a buffer update ]
Version counters are not enough: the eager CPU BatchNorm kernel writes its running statistics
without bumping their versions (only ``num_batches_tracked`` moves), and its schema does not
mark them as written either. So a forward pre-hook on every module of the copy that has buffers
keeps a copy of their values the first time the module runs inside a watched function, and a
buffer counts as updated by that run when its value differs afterwards, when its version
counter moved, when an op's schema marks an argument sharing its storage as written
(``Tensor(a!)``), or when the module's ``_buffers`` slot holds another tensor. Only modules
that actually run inside a checkpoint pay for the copies. A buffer updated both in the forward
and in the recompute is updated twice. autockpt's segments swap clones in for the recompute
(NOTE [ Recompute must not update buffers twice ] in ``autockpt.running.runner``): the copies are
taken of the clones, and the real buffers are unchanged at the end of the recompute.

# NOTE [ Memory a checkpoint saves ]
Whether a region saves memory depends on what else holds its tensors, which one run cannot show. So
where ``torch.fx`` can trace the model, it is traced once more with the checkpoint calls inlined
(the twins note which graph nodes each call's function creates) and profiled on fake tensors
(:func:`autockpt.profiling.profile.profile`). A region frees the storages that nodes inside it save
for backward, that nothing outside it saves, and that are not model outputs; it keeps its inputs
that nothing saves. Freeing no more than it keeps, it saves nothing (AC011, a warning); when no node
after it saves anything, backward recomputes it first, at the peak (AC011, info). Regions are
matched with recorded calls by call site and occurrence.

# NOTE [ Recognising autockpt's own calls ]
The session observes the segments autockpt runs (NOTE [ Observing segments ] in
``autockpt.running.runner``): the runner announces each segment of a graph rung just before it calls
checkpoint, so the next observed call is that segment's; its plan row names the segment, and the
announcement says whether the first argument is the reentrant dummy input. (A block of the modules
rung has no plan row of its own and is observed like the user's calls.) Such calls are checked like
any other against what actually happened (no input requiring grad, random ops without RNG replay,
buffers moved by the recompute, inputs written), which is how the test suite shows that autockpt's
own checkpointing is clean; the checks that are about how a *user* wrote the call (an input given
requires_grad, the call site) do not apply to them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import linecache
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from autockpt.capturing.meta import forward_failed, meta_parts
from autockpt.capturing.trace import base_class, bind_inputs, split_inputs, trace
from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.ops.instrument import (
    Op,
    OpObserver,
    OpWatch,
    leaves,
    map_tensors,
    storage_key_or_none,
    tensors,
)
from autockpt.planning.planner import Segment
from autockpt.profiling.loss import (
    NAMED_LOSSES,
    LossFn,
    call_loss,
    check_loss_fn,
    default_loss,
    output_tensors,
)
from autockpt.profiling.profile import profile
from autockpt.profiling.stats import Profile
from autockpt.running.runner import SegmentObserver, SegmentRun, observe_segments
from autockpt.tools.findings import Finding, Report
from autockpt.tools.lint import source_with_flag
from autockpt.units import format_bytes, format_names

__all__ = ["diagnose"]

_REAL_CHECKPOINT = torch_checkpoint.checkpoint
_REAL_SEQUENTIAL = torch_checkpoint.checkpoint_sequential
_SEQUENTIAL_CODE = inspect.unwrap(_REAL_SEQUENTIAL).__code__
_CHECKPOINT_FILE = _SEQUENTIAL_CODE.co_filename
_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

# Keyword arguments that configure checkpoint itself; any other keyword goes to the function.
_CHECKPOINT_FLAGS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug",
     "early_stop"}
)
# Warnings that PyTorch prints about exactly what the findings report.
_QUIET = (
    r"torch\.utils\.checkpoint.*use_reentrant",
    r"None of the inputs have requires_grad=True",
)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def diagnose(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | str | None = None,
) -> Report:
    """Find the silent checkpointing bugs of ``model`` by running one training step on a copy.

    A deep copy of ``model`` runs one forward (in the mode ``model`` is in, ``train()`` or
    ``eval()``) and one backward, with ``torch.utils.checkpoint.checkpoint``,
    ``checkpoint_sequential`` and PyTorch's ``checkpoint_wrapper`` observed. The findings say
    which parameters got no gradient and why, which buffers were updated twice, where random
    ops are recomputed differently, which checkpoints save no memory, and more: one code each,
    listed in docs/diagnostics.md. ``model``, its gradients and buffers, the example inputs and
    the CPU and CUDA random number generators are left exactly as they were.

    A ``DistributedDataParallel``, ``DataParallel`` or ``torch.compile`` wrapper is looked
    through: the module inside runs, and DDP's ``find_unused_parameters`` is checked against
    reentrant checkpoints (AC010).

    Args:
        model: the module to check (your model, or one returned by :func:`autockpt.apply`).
        example_inputs: positional inputs of ``forward``: a tensor or a tuple (a dict is taken
            as keyword inputs).
        example_kwargs: keyword inputs of ``forward``.
        loss_fn: ``loss_fn(output) -> scalar tensor``, or the name of a built-in loss
            (``"cross_entropy"``, ``"mse"``, ``"sum"``:
            :data:`autockpt.profiling.loss.NAMED_LOSSES`). By default the same loss as every entry
            point (:func:`autockpt.profiling.loss.default_loss`): the model's own ``output.loss``
            when it returns one (the logits beside it get no gradient from it, as in
            ``model(**batch).loss.backward()``), else the sum of the output's floating-point tensors
            that require grad. The memory checks profile the step with this loss too. A loss that
            does not require grad (an output cut off from the parameters) is a finding (AC003), not
            an error.

    Returns:
        A :class:`~autockpt.tools.findings.Report`; ``print(report)`` shows a table, most severe
        first. Run failures caused inside a checkpoint or in backward are reported (AC000)
        rather than raised.

    Raises:
        InvalidArgumentError: ``model`` is not a module, it cannot be deep-copied,
            ``loss_fn`` is neither callable nor the name of a built-in loss, or the forward or
            ``loss_fn`` fails on the example inputs outside any checkpoint.

    Example:
        >>> import torch, autockpt
        >>> from torch.utils.checkpoint import checkpoint
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = torch.nn.Linear(4, 4)
        ...         self.head = torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return self.head(checkpoint(self.body, x, use_reentrant=True))
        >>> report = autockpt.diagnose(Net(), (torch.randn(2, 4),))
        >>> report.codes()
        ('AC001', 'AC003', 'AC011')
        >>> [f.where.split(" ")[0] for f in report.errors]
        ['body', 'body']
        >>> autockpt.diagnose(Net(), (torch.randn(2, 4),), loss_fn="mse").codes()
        ('AC001', 'AC003', 'AC011')
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}",
            fix="pass the module itself: autockpt.diagnose(model, (x,))",
        )
    loss = check_loss_fn(loss_fn)
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    inner, wrapper = _unwrap(model)
    cpu_state = torch.random.get_rng_state()
    cuda_states = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    try:
        try:
            twin = copy.deepcopy(inner)
        except Exception as err:
            raise InvalidArgumentError(
                f"diagnose runs on a deep copy of the model, and copy.deepcopy failed on "
                f"{type(inner).__name__}: {type(err).__name__}: {err}",
                fix="make the model deep-copyable (no open files, locks or generators held as "
                "attributes), or diagnose a freshly built twin of it",
            ) from err
        for param in twin.parameters():
            param.grad = None  # a gradient copied from the user's model would hide AC003
        twin_args = map_tensors(args, _copy_input)
        twin_kwargs = {k: map_tensors(v, _copy_input) for k, v in kwargs.items()}
        session = _Session(twin, wrapper)
        session.label_inputs(twin_args, twin_kwargs)
        return session.run(twin_args, twin_kwargs, loss)
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


# --------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class _Wrapper:
    """A parallel or compile wrapper the model came in."""

    name: str
    """Class name of the outermost wrapper, e.g. ``DistributedDataParallel``."""
    find_unused_parameters: bool
    """DDP's flag (False for other wrappers)."""
    static_graph: bool
    """DDP's flag: with a static graph DDP supports reentrant checkpoint."""


def _unwrap(model: nn.Module) -> tuple[nn.Module, _Wrapper | None]:
    """The module inside DDP / DataParallel / torch.compile wrappers, and the outermost one."""
    ddp_cls = _ddp_class()
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    optimized_cls = getattr(compiled, "OptimizedModule", None)
    wrapper: _Wrapper | None = None
    while True:
        if ddp_cls is not None and isinstance(model, ddp_cls):
            found = _Wrapper(type(model).__name__,
                             bool(getattr(model, "find_unused_parameters", False)),
                             bool(getattr(model, "static_graph", False)))
            model = model.module
        elif isinstance(model, nn.DataParallel):
            found = _Wrapper(type(model).__name__, False, False)
            model = model.module
        elif optimized_cls is not None and isinstance(model, optimized_cls):
            found = _Wrapper(type(model).__name__, False, False)
            model = model._orig_mod
        else:
            return model, wrapper
        if wrapper is None or found.find_unused_parameters:
            wrapper = found


def _ddp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _copy_input(tensor: torch.Tensor) -> torch.Tensor:
    """A copy that backward can write gradients into without touching the user's tensor; a
    leaf stays a leaf and a non-leaf stays a non-leaf (AC002 tells them apart)."""
    copied = tensor.detach().clone()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(copied, requires_grad=tensor.requires_grad)
    if not tensor.requires_grad:
        return copied
    copied.requires_grad_(True)
    return copied if tensor.is_leaf else copied.view_as(copied)


# --------------------------------------------------------------------------- patching


_LOCAL = threading.local()
_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_PATCHED: list[tuple[dict[str, Any], str, Any, Any]] = []


def _current() -> _Session | None:
    return getattr(_LOCAL, "session", None)


def _observed_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for ``torch.utils.checkpoint.checkpoint`` while diagnosing."""
    session = _current()
    if session is None:
        return _REAL_CHECKPOINT(function, *args, **kwargs)
    return session.on_checkpoint(function, args, kwargs, sys._getframe(1))


def _observed_sequential(functions: Any, segments: Any, input: Any, *args: Any, **kwargs: Any
                         ) -> Any:
    """Stands in for ``torch.utils.checkpoint.checkpoint_sequential`` while diagnosing."""
    session = _current()
    if session is None:
        return _REAL_SEQUENTIAL(functions, segments, input, *args, **kwargs)
    return session.on_sequential(functions, segments, input, args, kwargs, sys._getframe(1))


functools.update_wrapper(_observed_checkpoint, _REAL_CHECKPOINT)
functools.update_wrapper(_observed_sequential, _REAL_SEQUENTIAL)


def _observed_version(value: Any) -> Any:
    """The recording twin of ``value`` if it is a checkpoint function or a partial of one."""
    if value is _REAL_CHECKPOINT:
        return _observed_checkpoint
    if value is _REAL_SEQUENTIAL:
        return _observed_sequential
    # type() rather than isinstance(): some module globals warn when their __class__ is read.
    if issubclass(type(value), functools.partial):
        inner = _observed_version(value.func)
        if inner is not None:
            return functools.partial(inner, *value.args, **value.keywords)
    return None


@contextmanager
def _observing(session: _Session) -> Iterator[None]:
    """Install the recording twins (NOTE [ Observing checkpoint calls ]) for ``session``."""
    global _PATCH_DEPTH
    namespaces = _module_namespaces() + _namespaces_of(session.root, sys._getframe(2))
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            _PATCHED.clear()
        # Twins already in place (another session) are left alone: they are not originals.
        _PATCHED.extend(_install(namespaces))
        _PATCH_DEPTH += 1
    previous = _current()
    _LOCAL.session = session
    try:
        for module in session.root.modules():
            for key, value in list(module.__dict__.items()):
                twin = _observed_version(value)
                if twin is not None:
                    module.__dict__[key] = twin  # the copy is thrown away afterwards
        with warnings.catch_warnings():
            for pattern in _QUIET:
                warnings.filterwarnings("ignore", message=pattern)
            with observe_segments(session):
                yield
    finally:
        _LOCAL.session = previous
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for namespace, key, original, twin in reversed(_PATCHED):
                    if namespace.get(key) is twin:
                        namespace[key] = original
                _PATCHED.clear()


def _module_namespaces() -> list[dict[str, Any]]:
    namespaces = []
    for module in list(sys.modules.values()):
        try:
            namespace = module.__dict__
        except Exception:  # odd objects in sys.modules
            continue
        if isinstance(namespace, dict):
            namespaces.append(namespace)
    return namespaces


def _namespaces_of(root: nn.Module, frame: FrameType | None) -> list[dict[str, Any]]:
    """Global namespaces that are not a module's: those the model's methods were defined in
    (a doctest, ``exec``'d code) and those of the calling frames."""
    namespaces: list[dict[str, Any]] = []
    for module in root.modules():
        for cls in type(module).__mro__:
            for attribute in vars(cls).values():
                function = getattr(attribute, "__func__", attribute)
                if inspect.isfunction(function):
                    namespaces.append(function.__globals__)
    while frame is not None:
        namespaces.append(frame.f_globals)
        frame = frame.f_back
    return namespaces


def _install(namespaces: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], str, Any, Any]]:
    patched = []
    seen: set[int] = {id(globals())}  # ours holds the real functions
    for namespace in namespaces:
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for key, value in list(namespace.items()):
            twin = _observed_version(value)
            if twin is not None:
                namespace[key] = twin
                patched.append((namespace, key, value, twin))
    return patched


# --------------------------------------------------------------------------- the watcher


class _Watch(OpObserver):
    """Notes, for the ops an :class:`~autockpt.ops.instrument.OpWatch` sees, the trainable
    parameters read, random ops, and writes into given storages (inputs, buffers)."""

    def __init__(self, params: Mapping[int, str], inputs: Mapping[int, int],
                 buffers: Mapping[int, str]) -> None:
        self._params = params
        self._inputs = inputs
        self._buffers = buffers
        self.params_used: dict[str, None] = {}
        self.random_ops: dict[str, None] = {}
        self.input_writes: dict[tuple[int, str], None] = {}
        self.buffer_writes: dict[str, None] = {}

    def before_op(self, op: Op) -> None:
        if op.random:
            self.random_ops[op.name] = None
        for tensor in op.inputs():
            name = self._params.get(storage_key_or_none(tensor))  # type: ignore[arg-type]
            if name is not None:
                self.params_used[name] = None
        for tensor in op.written():
            key = storage_key_or_none(tensor)
            if key in self._inputs:
                self.input_writes[(self._inputs[key], op.name)] = None
            if key in self._buffers:
                self.buffer_writes[self._buffers[key]] = None


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class _Input:
    """A tensor given positionally to a checkpoint call."""

    position: int
    """Its position among the arguments after the function."""
    label: str
    """How findings name it: ``input `x```, or ``argument 2``."""
    requires_grad: bool
    """Whether it requires grad."""
    is_leaf: bool
    """Whether it is a leaf of the autograd graph."""
    is_param: bool
    """Whether it is a parameter."""
    nbytes: int
    """Its size in bytes (the gradient it gets is as large)."""
    numel: int
    """Its number of elements."""


@dataclass
class _Call:
    """Everything recorded about one checkpoint call; filled in while the step runs."""

    index: int
    """Order of the call among all recorded calls."""
    kind: str
    """``"checkpoint"`` or ``"checkpoint_sequential"``."""
    via: str
    """Who made the call: ``""`` (the user's code), ``"checkpoint_sequential"``,
    ``"checkpoint_wrapper"`` or ``"autockpt"``."""
    site: str | None
    """``file:line`` of the user's code that made the call (None for autockpt's segments)."""
    source: str
    """The source line at ``site``, to write fixes in the user's own words."""
    label: str
    """Module path(s) the checkpointed function runs, for ``where``."""
    function_expr: str
    """Python naming the checkpointed function from the caller (``self.blocks[0]``)."""
    explicit_reentrant: bool
    """Whether ``use_reentrant`` was given."""
    reentrant: bool
    """Whether the reentrant variant runs (PyTorch's default when the flag is missing)."""
    preserve_rng: bool
    """The ``preserve_rng_state`` flag."""
    grad_enabled: bool
    """Whether grad mode was on at the call."""
    training: bool
    """Whether the function's modules (or the caller) were in training mode."""
    nested: bool
    """Whether the call happened inside another observed checkpoint's function."""
    inputs: tuple[_Input, ...]
    """The tensors given positionally."""
    container_grad_positions: tuple[int, ...]
    """Positions of tuples/lists/dicts holding tensors that require grad."""
    keyword_tensors: tuple[str, ...]
    """Keyword arguments (other than checkpoint's own flags) holding tensors."""
    segment: Segment | None = None
    """The plan row, for autockpt's segments."""
    runs: int = 0
    """How many times the function ran: 1 after forward, 2 after the recompute."""
    params_used: dict[str, None] = field(default_factory=dict)
    """Trainable parameters the function read in forward, in order (a dict as ordered set)."""
    random_ops: dict[str, None] = field(default_factory=dict)
    """Random ops the function ran in forward."""
    input_writes: dict[tuple[int, str], None] = field(default_factory=dict)
    """``(input position, op)`` of in-place writes into the inputs' storage in forward."""
    buffers_forward: dict[str, None] = field(default_factory=dict)
    """Buffers updated while the function ran in forward."""
    buffers_recompute: dict[str, None] = field(default_factory=dict)
    """Buffers updated while it was recomputed in backward."""
    output_keys: tuple[int, ...] = ()
    """Storages of the call's output tensors."""

    @property
    def where(self) -> str:
        """The finding location: module path(s) and, where known, the call site."""
        return f"{self.label} ({self.site})" if self.site else self.label


@dataclass(frozen=True)
class _Region:
    """The graph nodes a checkpoint call's function traced to."""

    key: tuple[str | None, int]
    """``(call site, occurrence at that site)``: how it is matched with a recorded call."""
    nodes: tuple[str, ...]
    """Names of the nodes, in graph order."""
    nested: bool
    """Whether it lies inside another checkpoint's region."""


@dataclass
class _Step:
    """What the training step left for the judges."""

    forward_done: bool = False
    """Whether forward ran to the end."""
    backward_done: bool = False
    """Whether backward ran to the end (or there was nothing to run it on)."""
    output_detached: bool = False
    """Whether the loss did not require grad, so backward could not run at all."""
    used_anywhere: dict[str, None] = field(default_factory=dict)
    """Trainable parameters read anywhere in forward, in order of first use."""
    output_keys: set[int] = field(default_factory=set)
    """Storages of the output's tensors."""


# --------------------------------------------------------------------------- the session


class _Session(SegmentObserver):
    """One diagnostic run: records the checkpoint calls of one step, then judges them."""

    def __init__(self, root: nn.Module, wrapper: _Wrapper | None) -> None:
        self.root = root
        self.wrapper = wrapper
        self.paths: dict[int, str] = {}
        self.order: dict[int, int] = {}
        for i, (name, module) in enumerate(root.named_modules()):
            self.paths[id(module)] = name
            self.order[id(module)] = i
        self.param_names: dict[int, str] = {}
        self.param_order: dict[str, int] = {}
        for i, (name, param) in enumerate(root.named_parameters()):
            self.param_order[name] = i
            key = storage_key_or_none(param)
            if param.requires_grad and key is not None:
                self.param_names.setdefault(key, name)
        self.buffer_slots: list[tuple[nn.Module, str, str]] = []
        for owner_path, owner in root.named_modules():
            for name in owner._buffers:
                self.buffer_slots.append((owner, name, _join(owner_path, name)))
        self.buffer_order = {qualname: i for i, (_, _, qualname) in enumerate(self.buffer_slots)}
        self.calls: list[_Call] = []
        self.announced: SegmentRun | None = None
        self.sequential_calls: list[_Call] = []
        self.active: list[tuple[_Call, str]] = []
        self.snapshots: list[dict[str, tuple[nn.Module, str, torch.Tensor]]] = []
        self.failed_call: _Call | None = None
        self.function_failed = False
        self.input_labels: dict[int, str] = {}
        self.site_counts: dict[str | None, int] = {}
        self.call_keys: dict[int, tuple[str | None, int]] = {}
        self.tracing = False
        self.regions: list[_Region] = []
        self.region_depth = 0
        self.region_counts: dict[str | None, int] = {}
        self.subject = base_class(root).__name__
        if wrapper is not None:
            self.subject = f"{wrapper.name}({self.subject})"

    # ----------------------------------------------------------------------- recording

    def label_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Name the example input tensors after the forward's parameters."""
        try:
            bound = bind_inputs(self.root, args, kwargs)
        except AutockptError:
            bound = {f"example_inputs[{i}]": a for i, a in enumerate(args)} | kwargs
        for name, value in bound.items():
            found = tensors(value)
            for i, tensor in enumerate(found):
                suffix = "" if len(found) == 1 else f"[{i}]"
                self.input_labels.setdefault(id(tensor), f"{name}{suffix}")

    def segment_started(self, run: SegmentRun, inputs: tuple[Any, ...]) -> None:
        if run.segment is not None:
            self.announced = run  # the next checkpoint call is this segment's

    def segment_finished(self, run: SegmentRun) -> None:
        self.announced = None

    def on_checkpoint(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      caller: FrameType) -> Any:
        announced, self.announced = self.announced, None
        if self.tracing:
            return self._trace_region(function, args, kwargs, caller)
        if self.active and self.active[-1][1] == "recompute":
            # Nested in a function being recomputed: recorded already when the forward ran.
            return _REAL_CHECKPOINT(function, *args, **kwargs)
        call = self._record("checkpoint", function, args, kwargs, caller, announced)
        input_keys: dict[int, int] = {}
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                key = storage_key_or_none(value)
                if key is not None:
                    input_keys.setdefault(key, position)
        try:
            output = _REAL_CHECKPOINT(self._observed(call, function, input_keys), *args, **kwargs)
        except BaseException:
            if self.failed_call is None:
                self.failed_call = call
            raise
        call.output_keys = tuple(k for t in tensors(output)
                                 if (k := storage_key_or_none(t)) is not None)
        return output

    def on_sequential(self, functions: Any, segments: Any, input: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any], caller: FrameType) -> Any:
        if not self.tracing and not (self.active and self.active[-1][1] == "recompute"):
            flags = dict(kwargs)
            if args:  # use_reentrant given positionally
                flags["use_reentrant"] = args[0]
            self._record("checkpoint_sequential", functions, (input,), flags, caller)
        return _REAL_SEQUENTIAL(functions, segments, input, *args, **kwargs)

    def _record(self, kind: str, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                caller: FrameType, announced: SegmentRun | None = None) -> _Call:
        via = ""
        segment = None
        site_frame = _user_frame(caller)
        site = _format_site(site_frame) if site_frame is not None else None
        caller_self = site_frame.f_locals.get("self") if site_frame is not None else None
        source = "" if site_frame is None else linecache.getline(
            site_frame.f_code.co_filename, site_frame.f_lineno, site_frame.f_globals)
        del site_frame
        if announced is not None:
            via, site = "autockpt", None
            segment = announced.segment
        elif caller.f_code is _SEQUENTIAL_CODE:
            via = "checkpoint_sequential"
        elif caller.f_code.co_name == "forward" and type(
            caller.f_locals.get("self")
        ).__module__ == _WRAPPER_MODULE:
            via = "checkpoint_wrapper"
        modules = self._modules(function)
        caller_path = (self.paths.get(id(caller_self))
                       if isinstance(caller_self, nn.Module) else None)
        if segment is not None:
            label = f"autockpt segment {_span(segment)}"
        else:
            label = self._label(modules, caller_path, function)
        dummy = announced is not None and announced.dummy_arg
        inputs = []
        containers = []
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                if dummy and position == 0:
                    name = "autockpt's dummy input"
                else:
                    name = self.input_labels.get(id(value), f"argument {position + 1}")
                inputs.append(_Input(
                    position=position,
                    label=name,
                    requires_grad=value.requires_grad,
                    is_leaf=value.is_leaf,
                    is_param=isinstance(value, nn.Parameter)
                    or storage_key_or_none(value) in self.param_names,
                    nbytes=value.numel() * value.element_size(),
                    numel=value.numel(),
                ))
            elif any(t.requires_grad for t in tensors(value)):
                containers.append(position)
        keyword_tensors = tuple(
            name for name, value in kwargs.items()
            if name not in _CHECKPOINT_FLAGS and tensors(value)
        )
        if modules:
            training = any(m.training for m in modules)
        elif isinstance(caller_self, nn.Module):
            training = caller_self.training
        else:
            training = self.root.training
        call = _Call(
            index=len(self.calls) + len(self.sequential_calls),
            kind=kind,
            via=via,
            site=site,
            source=source,
            label=label,
            function_expr=self._expression(function, caller_path),
            explicit_reentrant=kwargs.get("use_reentrant") is not None,
            # torch 2.x still picks the reentrant variant when the flag is missing.
            reentrant=kwargs.get("use_reentrant") is not False,
            preserve_rng=bool(kwargs.get("preserve_rng_state", True)),
            grad_enabled=torch.is_grad_enabled(),
            training=training,
            nested=bool(self.active),
            inputs=tuple(inputs),
            container_grad_positions=tuple(containers),
            keyword_tensors=keyword_tensors,
            segment=segment,
        )
        if kind == "checkpoint":
            self.calls.append(call)
            if not call.nested and via != "autockpt":
                occurrence = self.site_counts.get(site, 0)
                self.site_counts[site] = occurrence + 1
                self.call_keys[call.index] = (site, occurrence)
        else:
            self.sequential_calls.append(call)
        return call

    def _observed(self, call: _Call, function: Any, input_keys: dict[int, int]
                  ) -> Callable[..., Any]:
        """``function`` wrapped so that each run of it (forward, recompute) is watched."""

        def observed(*args: Any, **kwargs: Any) -> Any:
            phase = "forward" if call.runs == 0 else "recompute"
            call.runs += 1
            before = self._buffer_state()
            watch = _Watch(
                self.param_names,
                input_keys if phase == "forward" else {},
                {key: name for name, (_, _, key) in before.items() if key is not None},
            )
            self.active.append((call, phase))
            self.snapshots.append({})
            try:
                with OpWatch(watch):
                    return function(*args, **kwargs)
            except BaseException:
                if phase == "forward":
                    self.function_failed = True  # the model's own error, not checkpoint's
                raise
            finally:
                self.active.pop()
                snapshot = self.snapshots.pop()
                updated = dict(watch.buffer_writes)
                after = self._buffer_state()
                for name, (identity, version, _) in before.items():
                    if after.get(name, (None, None, None))[:2] != (identity, version):
                        updated[name] = None
                for name, (owner, slot, value) in snapshot.items():
                    current = owner._buffers.get(slot)
                    if current is None or not _same_values(current, value):
                        updated[name] = None
                updated = dict(sorted(updated.items(), key=lambda kv: self.buffer_order[kv[0]]))
                if phase == "forward":
                    call.params_used.update(watch.params_used)
                    call.random_ops.update(watch.random_ops)
                    call.input_writes.update(watch.input_writes)
                    call.buffers_forward.update(updated)
                else:
                    call.buffers_recompute.update(updated)

        return observed

    def _snapshot_buffers(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: keep the values of a module's buffers as they were when it first
        ran in the function being watched (NOTE [ What counts as a buffer update ])."""
        if not self.snapshots:
            return
        snapshot = self.snapshots[-1]
        prefix = self.paths.get(id(module))
        if prefix is None:
            return
        for slot, tensor in module._buffers.items():
            name = _join(prefix, slot)
            if tensor is not None and name not in snapshot and name in self.buffer_order:
                snapshot[name] = (module, slot, tensor.detach().clone())

    def _buffer_state(self) -> dict[str, tuple[int, int, int | None]]:
        state = {}
        for owner, name, qualname in self.buffer_slots:
            tensor = owner._buffers.get(name)
            if tensor is not None:
                state[qualname] = (id(tensor), tensor._version, storage_key_or_none(tensor))
        return state

    def _trace_region(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      caller: FrameType) -> Any:
        """At trace time, inline the checkpointed function and note the nodes it made."""
        user_kwargs = {k: v for k, v in kwargs.items() if k not in _CHECKPOINT_FLAGS}
        proxies = [v for v in leaves([*args, *user_kwargs.values()]) if isinstance(v, fx.Proxy)]
        if not proxies:
            return function(*args, **user_kwargs)
        graph = proxies[0].tracer.graph
        site_frame = _user_frame(caller)
        site = _format_site(site_frame) if site_frame is not None else None
        del site_frame
        occurrence = self.region_counts.get(site, 0)
        self.region_counts[site] = occurrence + 1
        nested = self.region_depth > 0
        start = len(graph.nodes)
        self.region_depth += 1
        try:
            output = function(*args, **user_kwargs)
        finally:
            self.region_depth -= 1
        names = tuple(node.name for node in list(graph.nodes)[start:])
        self.regions.append(_Region(key=(site, occurrence), nodes=names, nested=nested))
        return output

    # ----------------------------------------------------------------------- naming

    def _modules(self, function: Any) -> list[nn.Module]:
        found = [m for m in _modules_of(function) if id(m) in self.paths]
        unique = {id(m): m for m in found}
        return sorted(unique.values(), key=lambda m: self.order[id(m)])

    def _path(self, module: nn.Module) -> str:
        path = self.paths[id(module)]
        # PyTorch's checkpoint_wrapper puts the real module one level down.
        return path.replace("._checkpoint_wrapped_module", "").replace(
            "_checkpoint_wrapped_module", "") or self.subject

    def _label(self, modules: Sequence[nn.Module], caller_path: str | None, function: Any) -> str:
        if modules:
            first, last = self._path(modules[0]), self._path(modules[-1])
            return first if first == last else f"{first} .. {last}"
        if caller_path is not None:
            return caller_path or self.subject
        return getattr(function, "__qualname__", type(function).__name__)

    def _expression(self, function: Any, caller_path: str | None) -> str:
        """Python for the checkpointed callable as the caller's code would name it."""
        target, suffix = function, ""
        if inspect.ismethod(function) and isinstance(function.__self__, nn.Module):
            target, suffix = function.__self__, f".{function.__name__}"
        if not isinstance(target, nn.Module) or id(target) not in self.paths \
                or caller_path is None:
            return "fn"
        path = self.paths[id(target)]
        if caller_path:
            if path != caller_path and not path.startswith(caller_path + "."):
                return "fn"
            path = path[len(caller_path) + 1:]
        expression = "self"
        for atom in path.split(".") if path else ():
            expression += f"[{atom}]" if atom.isdigit() else f".{atom}"
        return expression + suffix if expression != "self" or suffix else "fn"

    # ----------------------------------------------------------------------- the run

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None
            ) -> Report:
        findings: list[Finding] = []
        graph: tuple[fx.Graph, Profile] | None = None
        with _observing(self), torch.inference_mode(False), torch.enable_grad():
            step = self._step(args, kwargs, loss_fn, findings)
            if step.forward_done and any(not c.nested and c.via != "autockpt"
                                         for c in self.calls):
                graph = self._trace(args, kwargs, loss_fn)
        findings += self._judge_calls()
        findings += self._judge_memory(graph, step.output_keys)
        if step.backward_done:
            findings += self._judge_gradients(step)
        return Report(tuple(findings), subject=self.subject, checkpoint_calls=len(self.calls))

    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None,
              findings: list[Finding]) -> _Step:
        """Forward, loss and backward; a failure inside a checkpoint or in backward becomes a
        finding (AC000), any other failure of forward or the loss an InvalidArgumentError."""
        step = _Step()
        hooks = [m.register_forward_pre_hook(self._snapshot_buffers)
                 for m in self.root.modules() if m._buffers]
        watch = _Watch(self.param_names, {}, {})
        try:
            try:
                with OpWatch(watch):
                    output = self.root(*args, **kwargs)
            except Exception as err:
                if (self.failed_call is None or self.function_failed) and meta_parts(
                        self.root, args, kwargs):
                    raise forward_failed(self.root, args, kwargs, err,
                                         name=self.subject) from err
                if self.failed_call is None or self.function_failed:
                    raise InvalidArgumentError(
                        f"{self.subject}.forward failed on the example inputs: "
                        f"{type(err).__name__}: {err}",
                        fix="check that the example inputs have the shapes and dtypes the "
                        "model expects (call model(*example_inputs) once to see the error)",
                    ) from err
                findings.append(self._failure("forward", err))
                return step
            step.forward_done = True
            step.used_anywhere = watch.params_used
            step.output_keys = {k for t in tensors(output)
                                if (k := storage_key_or_none(t)) is not None}
            loss = _loss(output, loss_fn, self.subject)
            del output
            if loss is None:
                step.output_detached = True
                step.backward_done = True  # nothing to differentiate: no parameter gets a grad
                return step
            try:
                loss.backward()
                step.backward_done = True
            except Exception as err:
                findings.append(self._failure("backward", err))
            return step
        finally:
            for hook in hooks:
                hook.remove()

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None
               ) -> tuple[fx.Graph, Profile] | None:
        """The traced graph with each checkpoint call's nodes noted, and its profile of the
        step with the user's loss (what it saves and the gradient it sends into the output
        are part of the step the memory checks judge)."""
        self.tracing = True
        try:
            traced = trace(self.root, args, kwargs)
            stats = profile(traced, bind_inputs(self.root, args, kwargs), loss_fn=loss_fn)
        except AutockptError:  # TraceError: the memory checks need the graph; skip them
            return None
        except Exception:  # an op fake tensors cannot run: same
            return None
        finally:
            self.tracing = False
        return traced.graph, stats

    def _failure(self, phase: str, err: BaseException) -> Finding:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        call = self.failed_call
        where = call.where if call is not None and phase == "forward" else self.subject
        return Finding(
            code="AC000",
            severity="error",
            where=where,
            message=f"the {phase} raised {type(err).__name__}: {text[:300]}. The other findings "
            "come from what ran before it.",
            fix="fix the findings above it first (AC009 explains checkpoint's ValueError on "
            "keyword arguments), then run the step once without diagnose to see the full "
            "traceback:\n    loss_fn(model(x)).backward()",
        )

    # ----------------------------------------------------------------------- judging

    def _judge_calls(self) -> list[Finding]:
        findings: list[Finding] = []
        findings += self._judge_explicit_flag()
        for call in self.calls:
            checks_grad = not call.nested and call.grad_enabled
            if checks_grad and self._loses_parameters(call):
                findings.append(_no_input_grad(call))
            if checks_grad and call.via != "autockpt":
                findings += _grad_only_inputs(call)
            if checks_grad and call.reentrant and (call.container_grad_positions
                                                   or call.keyword_tensors):
                findings.append(_lost_containers(call))
            if not call.nested and (not call.grad_enabled or not call.training):
                findings.append(_overhead(call))
            if call.random_ops and not call.preserve_rng:
                findings.append(_rng_not_preserved(call))
            twice = [b for b in call.buffers_forward if b in call.buffers_recompute]
            if twice:
                findings.append(self._buffers_twice(call, twice))
            if call.input_writes:
                findings.append(_inplace_input(call))
        reentrant = [c for c in self.calls if c.reentrant and c.grad_enabled and not c.nested]
        wrapper = self.wrapper
        if wrapper is not None and wrapper.find_unused_parameters and not wrapper.static_graph \
                and reentrant:
            findings.append(_ddp_unused(wrapper, reentrant[0]))
        return findings

    def _loses_parameters(self, call: _Call) -> bool:
        return call.reentrant and bool(call.params_used) and not any(
            i.requires_grad for i in call.inputs
        )

    def _judge_explicit_flag(self) -> list[Finding]:
        sites: dict[str, list[_Call]] = {}
        for call in [*self.sequential_calls, *self.calls]:
            if call.explicit_reentrant or call.via in ("autockpt", "checkpoint_sequential"):
                continue
            sites.setdefault(call.site or call.label, []).append(call)
        findings = []
        for where, calls in sites.items():
            first = calls[0]
            count = f" ({len(calls)} calls)" if len(calls) > 1 else ""
            fix = _call_text(first, "use_reentrant=False")
            findings.append(Finding(
                code="AC006",
                severity="warning",
                where=where,
                message=f"{first.kind}() is called without use_reentrant{count}: PyTorch then "
                "warns and picks the reentrant variant, which gives no gradient to the "
                "function's parameters when no input requires grad, drops keyword and "
                "container tensors, and does not work with torch.autograd.grad. Say which "
                "one you mean; the non-reentrant one is recommended.",
                fix=fix,
            ))
        return findings

    def _buffers_twice(self, call: _Call, names: list[str]) -> Finding:
        names = sorted(names, key=lambda n: self.buffer_order.get(n, 0))
        owners = list(dict.fromkeys(n.rpartition(".")[0] or self.subject for n in names))
        owner = owners[0] if len(owners) == 1 else f"{owners[0]} .. {owners[-1]}"
        where = f"{owner} ({call.site})" if call.site else f"{owner} in {call.label}"
        return Finding(
            code="AC004",
            severity="warning",
            where=where,
            message=f"the checkpointed function updates buffers in its forward "
            f"({_names(names)}), and the recompute in backward ran it again and updated "
            "them a second time: BatchNorm running statistics move twice per step (with the "
            "second update computed from the same batch), and num_batches_tracked counts "
            "double (pytorch/pytorch#96136).",
            fix=_AUTOCKPT_REPLAN if call.via == "autockpt" else
            "# keep the module that updates buffers out of the checkpointed function:\n"
            f"h = {_call_text(call, 'use_reentrant=False')}\n"
            "h = self.bn(h)\n"
            "# or let autockpt checkpoint the model: it restores buffers after a recompute\n"
            "model = autockpt.apply(model, budget_mb=300, example_inputs=(x,))",
        )

    def _judge_memory(self, graph: tuple[fx.Graph, Profile] | None, output_keys: set[int]
                      ) -> list[Finding]:
        findings = []
        for call in self.calls:
            segment = call.segment
            if call.via == "autockpt" and segment is not None and segment.freed_bytes == 0:
                findings.append(Finding(
                    code="AC011",
                    severity="info",
                    where=call.where,
                    message="autockpt's plan checkpoints this segment although it frees no "
                    "activation memory by the planner's own estimate.",
                    fix="print(autockpt.plan_of(model))  # and lower or raise budget_mb",
                ))
        candidates = {
            key: call for call in self.calls
            if (key := self.call_keys.get(call.index)) is not None
            and call.grad_enabled and call.training
        }
        if graph is None:
            # Without a graph only the plainest case is visible: the last checkpoint's output
            # is the model's output, so backward recomputes it first.
            if candidates:
                last = list(candidates.values())[-1]
                if output_keys.intersection(last.output_keys):
                    findings.append(_last_region(last, None))
            return findings
        fx_graph, stats = graph
        position = {node.name: i for i, node in enumerate(fx_graph.nodes)}
        for region in self.regions:
            call = candidates.get(region.key)
            if call is None or region.nested:
                continue
            members = [position[name] for name in region.nodes if name in position]
            if not members:
                continue
            inside = frozenset(members)
            end = max(members)
            freed = kept = 0
            for storage in stats.storages:
                saved_inside = any(k in inside for k in storage.saved_by)
                saved_outside = any(k not in inside for k in storage.saved_by)
                if storage.producer in inside:
                    if saved_inside and not saved_outside and not storage.is_output:
                        freed += storage.size_bytes
                elif not storage.saved_by and any(u in inside for u in storage.users):
                    kept += storage.size_bytes
            if freed <= kept:
                findings.append(_saves_nothing(call, freed, kept))
            elif not any(k > end for storage in stats.storages for k in storage.saved_by):
                findings.append(_last_region(call, freed))
        return findings

    def _judge_gradients(self, step: _Step) -> list[Finding]:
        missing = [name for name, p in self.root.named_parameters()
                   if p.requires_grad and p.grad is None]
        if not missing:
            return []
        owner: dict[str, _Call] = {}
        for call in self.calls:
            for name in missing:
                if name in call.params_used and name not in owner:
                    owner[name] = call
        findings = []
        for call in self.calls:
            names = [n for n in missing if owner.get(n) is call]
            if not names:
                continue
            cause = ""
            fix = "# make sure the loss depends on this checkpoint's output\n" \
                  f"h = {_call_text(call, 'use_reentrant=False')}"
            if not call.nested and self._loses_parameters(call):
                cause = (" The checkpoint is reentrant and none of its tensor inputs requires "
                         "grad (AC001).")
                fix = _reentrant_fix(call)
            elif call.reentrant and (call.container_grad_positions or call.keyword_tensors):
                cause = " Its tensors travel in a container or as keywords (AC009)."
                fix = _reentrant_fix(call)
            findings.append(Finding(
                code="AC003",
                severity="error",
                where=call.where,
                message=f"{_count(len(names), 'trainable parameter')} read inside this "
                f"checkpoint got no gradient after one forward and backward: {_names(names)}."
                f"{cause} The optimizer will never update them.",
                fix=fix,
            ))
        rest = [n for n in missing if n not in owner]
        used = [n for n in rest if n in step.used_anywhere]
        unused = [n for n in rest if n not in step.used_anywhere]
        if used:
            findings.append(Finding(
                code="AC003",
                severity="error",
                where=_common_owner(used) or self.subject,
                message=f"{_count(len(used), 'trainable parameter')} used in forward got no "
                f"gradient: {_names(used)}. " + (
                    "The model's output does not require grad, so backward cannot run at all."
                    if step.output_detached else
                    "No path from the loss reaches them: the output they feed is not part of "
                    "the loss, or .detach() / torch.no_grad() cuts them off."),
                fix="# list them, then fix the cut or freeze them on purpose:\n"
                "print([n for n, p in model.named_parameters() "
                "if p.requires_grad and p.grad is None])\n"
                f"model.{_common_owner(used) or 'part'}.requires_grad_(False)",
            ))
        if unused:
            findings.append(Finding(
                code="AC003",
                severity="error",
                where=_common_owner(unused) or self.subject,
                message=f"{_count(len(unused), 'trainable parameter')} never used by forward "
                f"on these inputs got no gradient: {_names(unused)}.",
                fix="# freeze or remove what this forward does not use:\n"
                f"model.{_common_owner(unused) or 'part'}.requires_grad_(False)",
            ))
        return findings


# --------------------------------------------------------------------------- findings


def _no_input_grad(call: _Call) -> Finding:
    inputs = ", ".join(i.label for i in call.inputs) or "none"
    return Finding(
        code="AC001",
        severity="error",
        where=call.where,
        message=f"reentrant checkpoint, and none of its tensor inputs requires grad (tensor "
        f"inputs: {inputs}): its output then does not require grad either, so backward never "
        f"reaches the {_count(len(call.params_used), 'trainable parameter')} the function "
        f"uses ({_names(list(call.params_used))}). They silently get no gradient; this is "
        "the classic checkpoint right after the raw input.",
        fix=_reentrant_fix(call),
    )


def _grad_only_inputs(call: _Call) -> list[Finding]:
    findings = []
    for tensor in call.inputs:
        # A one-element dummy (the usual reentrant trick) costs nothing to differentiate.
        if tensor.requires_grad and tensor.is_leaf and not tensor.is_param \
                and tensor.numel > 1:
            findings.append(Finding(
                code="AC002",
                severity="warning",
                where=call.where,
                message=f"{tensor.label} is a leaf tensor that requires grad and is not a "
                "parameter; it is passed to checkpoint, so backward computes its gradient "
                f"({format_bytes(tensor.nbytes)} per step) and, unless you read its .grad, "
                "throws it away. Inputs are often given requires_grad_() only so that a "
                "reentrant checkpoint produces gradients.",
                fix="# drop the requires_grad_() on the input; the non-reentrant checkpoint "
                "needs none:\n"
                f"h = {_call_text(call, 'use_reentrant=False')}",
            ))
    return findings


def _lost_containers(call: _Call) -> Finding:
    parts = []
    if call.container_grad_positions:
        positions = ", ".join(str(p + 1) for p in call.container_grad_positions)
        parts.append(f"tensors that require grad inside a tuple/list/dict (argument "
                     f"{positions})")
    if call.keyword_tensors:
        parts.append(f"keyword tensors ({', '.join(call.keyword_tensors)})")
    return Finding(
        code="AC009",
        severity="error",
        where=call.where,
        message=f"reentrant checkpoint given {' and '.join(parts)}: the reentrant variant only "
        "tracks tensors passed directly as positional arguments, so gradients never flow "
        "back through the others (keyword arguments make it raise ValueError).",
        fix="# pass each tensor positionally, or use the non-reentrant variant:\n"
        "h = checkpoint(fn, a, b, use_reentrant=True)  # def fn(a, b): ...\n"
        "h = checkpoint(fn, (a, b), mask=mask, use_reentrant=False)",
    )


def _overhead(call: _Call) -> Finding:
    reason = ("under torch.no_grad(): nothing is saved for backward anyway"
              if not call.grad_enabled else
              "with its modules in eval mode: unless you train in eval mode, nothing will "
              "run backward")
    return Finding(
        code="AC007",
        severity="info",
        where=call.where,
        message=f"checkpoint runs {reason}, so it only adds overhead.",
        fix="h = (checkpoint(fn, x, use_reentrant=False)\n"
        "     if self.training and torch.is_grad_enabled() else fn(x))",
    )


def _rng_not_preserved(call: _Call) -> Finding:
    ops = ", ".join(call.random_ops)
    return Finding(
        code="AC005",
        severity="error",
        where=call.where,
        message=f"the checkpointed function draws random numbers ({ops}: dropout) and "
        "preserve_rng_state=False: the recompute in backward draws a different mask than the "
        "forward did, so the gradients belong to a different function than the one that "
        "produced the loss.",
        fix=_AUTOCKPT_REPLAN if call.via == "autockpt" else
        f"h = {_call_text(call, 'use_reentrant=False')}  # preserve_rng_state defaults to True",
    )


def _inplace_input(call: _Call) -> Finding:
    labels = {i.position: i.label for i in call.inputs}
    writes = ", ".join(f"{op} on {labels.get(pos, f'argument {pos + 1}')}"
                       for pos, op in call.input_writes)
    return Finding(
        code="AC008",
        severity="error",
        where=call.where,
        message=f"the checkpointed function modifies its input in place ({writes}). "
        "Checkpoint keeps its inputs for the recompute: where autograd's version check sees "
        "the write, backward fails (\"modified by an inplace operation\"); where it does not "
        "(writes through .data, kernels that do not bump versions), backward silently "
        "recomputes from the modified value and the gradients are wrong.",
        fix="# write out of place inside the checkpointed function:\n"
        "x = torch.relu(x)  # not x.relu_() or nn.ReLU(inplace=True) on the input\n"
        "h = h + y          # not h += y",
    )


def _ddp_unused(wrapper: _Wrapper, call: _Call) -> Finding:
    return Finding(
        code="AC010",
        severity="error",
        where=f"{wrapper.name} ({call.site or call.label})",
        message="DistributedDataParallel with find_unused_parameters=True, and the model uses "
        "reentrant checkpoint: the reentrant backward runs the checkpointed parameters' "
        "gradient hooks a second time, and DDP fails with \"Expected to mark a variable "
        "ready only once\".",
        fix="h = checkpoint(fn, x, use_reentrant=False)\n"
        "# or, if the set of used parameters is the same every step:\n"
        "model = DistributedDataParallel(model, static_graph=True)",
    )


def _saves_nothing(call: _Call, freed: int, kept: int) -> Finding:
    return Finding(
        code="AC011",
        severity="warning",
        where=call.where,
        message=f"checkpointing this region frees {format_bytes(freed)} of activations saved "
        f"for backward and keeps {format_bytes(kept)} of inputs nothing else would: it saves "
        "no memory (what is saved inside is its output, or is saved by the next layer too) "
        "and costs a recompute.",
        fix="# checkpoint a longer stretch, several layers per call:\n"
        "def run(h):\n"
        "    for block in self.blocks[0:4]:\n"
        "        h = block(h)\n"
        "    return h\n"
        "h = checkpoint(run, x, use_reentrant=False)\n"
        "# or let autockpt choose: autockpt.apply(model, budget_mb=300, example_inputs=(x,))",
    )


def _last_region(call: _Call, freed: int | None) -> Finding:
    amount = f" ({format_bytes(freed)} of activations)" if freed is not None else ""
    return Finding(
        code="AC011",
        severity="info",
        where=call.where,
        message=f"this is the last checkpointed region before the loss{amount}: nothing after "
        "it saves activations, so backward recomputes it first, while everything else is "
        "still held, and the peak does not go down; it only costs the recompute.",
        fix=f"h = {call.function_expr}(h)  # run the last stretch without checkpoint",
    )


def _reentrant_fix(call: _Call) -> str:
    if call.via == "checkpoint_sequential":
        return _call_text(call, "use_reentrant=False")
    if call.via == "checkpoint_wrapper":
        return ("checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)\n"
                "# or keep reentrant and let autockpt add the dummy input it needs:\n"
                "model = autockpt.apply(model, budget_mb=300, example_inputs=(x,), "
                "mode=\"reentrant\")")
    if call.via == "autockpt":
        return _AUTOCKPT_REPLAN
    return (f"h = {_call_text(call, 'use_reentrant=False')}\n"
            "# or keep reentrant and let autockpt add the dummy input it needs:\n"
            "model = autockpt.apply(model, budget_mb=300, example_inputs=(x,), "
            "mode=\"reentrant\")")


_AUTOCKPT_REPLAN = (
    "# autockpt plans dummy inputs, RNG replay and buffer guards from its profile of the\n"
    "# model: re-plan rather than run an edited or stale plan\n"
    "model = autockpt.apply(model, budget_mb=300, example_inputs=(x,))"
)


def _call_text(call: _Call, flag: str) -> str:
    """The user's checkpoint call with ``flag`` set, from the source line when it holds the
    whole call, else from what the run saw."""
    rewritten = source_with_flag(call.source, flag) if call.source else None
    if rewritten is not None:
        return rewritten
    names = [i.label if i.label.isidentifier() else "x" for i in call.inputs
             if i.label != "autockpt's dummy input"]
    arguments = ", ".join(dict.fromkeys(names)) if names else "x"
    return f"checkpoint({call.function_expr}, {arguments}, {flag})"


# --------------------------------------------------------------------------- helpers


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach(), b))


def _loss(output: Any, loss_fn: LossFn | None, subject: str) -> torch.Tensor | None:
    """The scalar to run backward on (:func:`autockpt.profiling.loss.call_loss`, so the default loss
    is the library's one), or None when it does not require grad: then no parameter can get a
    gradient, which :meth:`_Session._judge_gradients` reports (AC003) instead of an error."""
    if loss_fn is None:
        return default_loss(output)
    returned: list[Any] = []

    def recorded(out: Any) -> torch.Tensor:
        value = loss_fn(out)
        returned.append(value)
        return value

    try:
        return call_loss(recorded, output, subject)
    except InvalidArgumentError:
        # call_loss refuses a scalar that does not require grad; so does a named loss given an
        # output with nothing to differentiate. Both are the model's problem, not the loss's.
        [value] = returned or [None]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
            return None
        if not returned and loss_fn in NAMED_LOSSES.values() and not any(
                t.requires_grad and t.is_floating_point() for t in output_tensors(output)):
            return None
        raise


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the user's code: not torch, autockpt or the standard library."""
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = (
            filename.startswith((_TORCH_DIR, _PACKAGE_DIR, "<autockpt", "<frozen"))
            or (filename.startswith(_STDLIB_DIR) and "-packages" not in filename)
        )
        if not internal:
            return frame
        frame = frame.f_back
    return None


def _format_site(frame: FrameType) -> str:
    filename = frame.f_code.co_filename
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        relative = filename
    shown = filename if relative.startswith("..") else relative
    return f"{shown}:{frame.f_lineno}"


def _modules_of(function: Any, depth: int = 0) -> list[nn.Module]:
    """The modules a checkpointed function runs, as far as they can be seen from outside:
    the module itself, a bound method's owner, a partial's arguments, a closure's cells."""
    if depth > 3:
        return []
    if isinstance(function, nn.Module):
        return [function]
    if isinstance(function, functools.partial):
        found = _modules_of(function.func, depth + 1)
        for value in (*function.args, *function.keywords.values()):
            found += _modules_of(value, depth + 1)
        return found
    if inspect.ismethod(function):
        return _modules_of(function.__self__, depth + 1)
    if isinstance(function, (list, tuple)):
        return [m for value in function for m in _modules_of(value, depth + 1)]
    if not inspect.isfunction(function):
        return []
    code = function.__code__
    cells = {}
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    if code.co_filename == _CHECKPOINT_FILE and {"functions", "start", "end"} <= set(cells):
        # checkpoint_sequential's segment: only its slice of the functions.
        return _modules_of(list(cells["functions"][cells["start"]:cells["end"] + 1]), depth + 1)
    found = []
    for value in cells.values():
        if isinstance(value, nn.Module):
            # A lambda or closure over ``self`` names the submodules it calls.
            named = [getattr(value, n) for n in code.co_names
                     if isinstance(value._modules.get(n), nn.Module)]
            found += named or [value]
        else:
            found += _modules_of(value, depth + 1)
    return found


def _span(segment: Segment) -> str:
    first = segment.first_module or "(forward)"
    last = segment.last_module or "(forward)"
    return first if first == last else f"{first} .. {last}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _names(names: Sequence[str]) -> str:
    return format_names(names, limit=6)


def _common_owner(names: Sequence[str]) -> str:
    """The deepest module path that owns every parameter in ``names``."""
    owners = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for atoms in zip(*owners):
        if len(set(atoms)) != 1:
            break
        common.append(atoms[0])
    return ".".join(common)
