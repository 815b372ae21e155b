"""Instrumentation: seeing the ATen ops a piece of code runs, and the storages they make.

Every analysis of autockpt that watches code run uses this module and nothing else:
:mod:`autockpt.profiling.profile` (the working set of each node, on fake tensors),
:mod:`autockpt.running.blocks` (the log of one forward at the level of submodules),
:mod:`autockpt.measure` (the activation memory of a real step), :mod:`autockpt.diagnose` (parameters
read, random ops and writes inside a checkpoint) and :mod:`autockpt.profiling.timing` (the nodes run
one by one).

- :func:`tensors` and :func:`leaves` flatten a nested value, one way for all of them;
  :func:`map_tensors` rebuilds one with its tensors replaced.
- :func:`storage_key` names a storage for as long as the process lives.
- :class:`OpWatch` is the one ``TorchDispatchMode``: it numbers the ops and hands each, before
  and after it runs, to an :class:`OpObserver`; an :class:`Op` says what the op is (random,
  which tensors it writes). What is counted is the observer's business.
- :class:`LiveStorages` remembers storages while they live and says when one is freed: the
  working sets and peaks are built on it.
- :func:`flop_counter` counts FLOPs (a mode of torch's own, beside the watch).
- :func:`watch_saved` hands each tensor autograd saves to a callback, and lets it go after.
- :func:`run_with_state` runs a graph with other parameters and buffers swapped in.

Example:
    >>> import torch
    >>> class Random(OpObserver):
    ...     def __init__(self) -> None:
    ...         self.names: list[str] = []
    ...     def before_op(self, op: Op) -> None:
    ...         if op.random:
    ...             self.names.append(op.name)
    >>> seen = Random()
    >>> with OpWatch(seen):
    ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5) + 1
    >>> seen.names
    ['bernoulli_']
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import flop_counter as flop_formulas
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from autockpt.ops.fake_outputs import FakeOutputs

__all__ = [
    "LiveStorages",
    "Op",
    "OpObserver",
    "OpWatch",
    "FlopTally",
    "SavedTensors",
    "fake_copy",
    "flop_counter",
    "is_sharded",
    "leaves",
    "map_tensors",
    "run_with_state",
    "watch_saved",
    "storage_key",
    "storage_key_or_none",
    "storage_of",
    "tensors",
]

T = TypeVar("T")


# --------------------------------------------------------------------------- flattening


def leaves(value: Any) -> list[Any]:
    """The leaves of a nested value, in order: what ``torch.utils._pytree`` flattens
    (tuples, lists, dicts, named tuples and the types registered with it, such as Hugging
    Face's ``ModelOutput``), and inside it the mappings, dataclass instances and tuple or list
    subclasses that pytree keeps whole.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Out:
        ...     a: int
        ...     b: list[int]
        >>> leaves({"x": (1, Out(2, [3]))})
        [1, 2, 3]
    """
    found: list[Any] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, Mapping):
            found += leaves(list(leaf.values()))
        elif isinstance(leaf, (list, tuple)):
            found += leaves(list(leaf))
        elif is_dataclass(leaf) and not isinstance(leaf, type):
            found += leaves([getattr(leaf, f.name) for f in fields(leaf)])
        else:
            found.append(leaf)
    return found


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among :func:`leaves` of ``value``, in order (a tensor found twice is listed
    twice).

    Example:
        >>> t = torch.ones(2)
        >>> len(tensors({"a": t, "b": [t, 1.0]}))
        2
    """
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in leaves(value) if isinstance(v, torch.Tensor)]


def rng_forked(module: torch.nn.Module, *values: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.random.fork_rng`` over the CPU and every CUDA device that ``module``'s
    parameters and buffers or the tensors in ``values`` live on.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> state = torch.get_rng_state()
        >>> with rng_forked(net, torch.ones(1)):
        ...     _ = torch.rand(1)
        >>> torch.equal(torch.get_rng_state(), state)
        True
    """
    devices = sorted({t.device.index or 0 for t in [*module.parameters(), *module.buffers(),
                                                    *tensors(values)]
                      if t.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to the tensors in its nested tuples (named ones too),
    lists, dicts and dataclass instances; a dict of another class (``OrderedDict``,
    ``ModelOutput``) and a dataclass instance are copied and updated, so they keep their class.

    Example:
        >>> map_tensors({"x": (torch.ones(1), 2)}, lambda t: t * 3)
        {'x': (tensor([3.]), 2)}
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_tensors(item, fn) for item in value]
    if isinstance(value, dict):
        mapped = {key: map_tensors(item, fn) for key, item in value.items()}
        return mapped if type(value) is dict else _rebuild_dict(value, mapped)
    if is_dataclass(value) and not isinstance(value, type):
        rebuilt = copy.copy(value)
        for item in fields(value):
            # object.__setattr__: a frozen dataclass refuses plain assignment.
            object.__setattr__(rebuilt, item.name, map_tensors(getattr(value, item.name), fn))
        return rebuilt
    return value


def _rebuild_dict(original: dict[Any, Any], mapped: dict[Any, Any]) -> dict[Any, Any]:
    try:
        rebuilt = original.copy()
        rebuilt.update(mapped)
        return rebuilt
    except Exception:  # noqa: BLE001 - a dict class that cannot be copied: a plain dict
        return mapped


# --------------------------------------------------------------------------- fake storages


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes and storages, no data): its storage is
    on the meta device and has no address, but lives and dies as a real one would."""
    return isinstance(tensor, FakeTensor)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters are), whose own shape is the
    full one while it holds only this rank's shard."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no tensor is one
    return module is not None and isinstance(tensor, module.DTensor)


def fake_copy(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """``mode.from_tensor(tensor)``; a DTensor becomes a plain fake tensor of its full shape
    on its shard's device instead (NOTE [ Planning a sharded model ] in
    :mod:`autockpt.capturing.ladder`): a fake DTensor would run DTensor's own ops, collectives
    included, on the shard.

    Example:
        >>> mode = FakeTensorMode()
        >>> fake_copy(mode, torch.ones(2, 3, requires_grad=True)).requires_grad
        True
    """
    if not is_sharded(tensor):
        return mode.from_tensor(tensor)
    with mode:
        fake = torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype,
                                   device=tensor.device)
    return fake.requires_grad_(tensor.requires_grad)


def _reduced_losses() -> tuple[Any, ...]:
    aten = torch.ops.aten
    return tuple(getattr(aten, name).default for name in
                 ("mse_loss", "smooth_l1_loss", "binary_cross_entropy")
                 if hasattr(aten, name))


_REDUCED_LOSSES = _reduced_losses()
"""Losses whose kernels return the reduced loss in the storage of the element-wise one."""
_WIDENED_DEVICES = frozenset({"cpu", "cuda"})
"""The devices whose kernels of :data:`_REDUCED_LOSSES` do that (others are not known)."""


def widen_reduced_loss(func: Any, args: tuple[Any, ...], out: Any) -> None:
    """Give a fake result the storage the real kernel gives it (the profile's and the replay's
    fake steps call it after every op).

    The CPU and CUDA kernels of ``mse_loss``, ``smooth_l1_loss`` and ``binary_cross_entropy``
    compute the element-wise loss into a buffer the size of their input and reduce it into
    that buffer: the scalar they return keeps the whole buffer alive for as long as the
    caller keeps the loss (through backward). Fake kernels make a 4-byte storage. On CUDA
    this was measured on an H100 (benchmarks/RESULTS.md, 2026-11-26): a UNet trained with
    ``mse_loss`` held its output's size, 3 MiB, beyond an estimate that widened on the CPU
    only, and the same step measured the same bytes on both devices.
    """
    if func not in _REDUCED_LOSSES or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.device.type not in _WIDENED_DEVICES:
        return
    # Reduction "none" returns the element-wise loss itself, not a scalar: left above.
    nbytes = first.numel() * out.element_size()
    if out.untyped_storage().nbytes() < nbytes:
        out.untyped_storage().resize_(nbytes)


# --------------------------------------------------------------------------- storages


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor``, or None when it has none that can be accounted for
    (sparse and other storage-less layouts, wrapper subclasses). A DTensor (FSDP2's sharded
    parameters) has the storage of its local shard."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        tensor = local
    try:
        storage = tensor.untyped_storage()
        if not is_fake(tensor):
            storage.data_ptr()  # a wrapper subclass's storage refuses it: nothing to count
        return storage
    except (RuntimeError, NotImplementedError, TypeError):
        return None


# NOTE [ Storage keys ]
# A storage's address (``_cdata``) is reused as soon as the storage is freed, and profiling
# frees storages all the time (each probe's copies, the loss's targets), so a set of
# addresses of "old" storages would take a new storage at a reused address for an old one and
# leave it out of a working set: the estimate would then depend on where the allocator put
# things, and differ from one run to the next. A key is instead a serial number given to the
# storage object the first time it is seen; storages keep their Python object for as long as
# they live, and a weak key dictionary forgets the dead ones.
_KEYS: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()
_SERIALS = itertools.count(1)


def storage_key(tensor: torch.Tensor) -> int:
    """A number for ``tensor``'s storage that no other storage ever gets (NOTE [ Storage keys
    ]). Raises for a tensor without a storage (see :func:`storage_of`).

    Example:
        >>> x = torch.ones(4)
        >>> storage_key(x) == storage_key(x[1:]), storage_key(x) == storage_key(x.clone())
        (True, False)
    """
    storage = tensor.untyped_storage()
    key = _KEYS.get(storage)
    if key is None:
        key = _KEYS[storage] = next(_SERIALS)
    return key


def storage_key_or_none(tensor: torch.Tensor) -> int | None:
    """:func:`storage_key`, or None for a tensor without a storage (sparse, nested, wrapper
    subclasses), which code that watches any user's model meets."""
    return None if storage_of(tensor) is None else storage_key(tensor)


class LiveStorages(Generic[T]):
    """Storages known to be alive, each with a value of the caller's (its bytes, its serial);
    an entry goes when its storage is freed, and ``on_free`` is told.

    Storages keep their Python object for as long as they live (a view's
    ``untyped_storage()`` *is* its base's), and the object is destroyed together with the
    memory, so a weak reference's callback fires exactly when the memory is released. The
    object's ``id`` names it meanwhile: CPython clears weak references before it frees an
    object, so the entry is gone before the ``id`` can be reused.
    """

    def __init__(self, on_free: Callable[[T], None] | None = None) -> None:
        self._on_free = on_free
        self._values: dict[int, T] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __len__(self) -> int:
        return len(self._values)

    def get(self, storage: torch.UntypedStorage) -> T | None:
        """The value of ``storage``, or None when it is not known."""
        return self._values.get(id(storage))

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return id(storage) in self._values

    def add(self, storage: torch.UntypedStorage, value: T) -> None:
        """Remember ``storage`` with ``value`` until it is freed (or replace its value)."""
        key = id(storage)
        self._values[key] = value
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def pop(self, storage: torch.UntypedStorage) -> T | None:
        """Forget ``storage`` without telling ``on_free``; its value, or None."""
        key = id(storage)
        self._refs.pop(key, None)
        return self._values.pop(key, None)

    def clear(self) -> None:
        """Forget every storage; dropping the weak references cancels their callbacks."""
        self._refs.clear()
        self._values.clear()

    def _freed(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        if self._refs.get(key) is not ref:
            return
        del self._refs[key]
        value = self._values.pop(key)
        if self._on_free is not None:
            self._on_free(value)


# --------------------------------------------------------------------------- ops


_RUNNING_STATS = ("running_mean", "running_var")


@functools.cache
def _running_stat_positions(func: Any) -> tuple[int, tuple[int, ...]] | None:
    """``(position of training, positions of running stats)`` for an op that takes running
    statistics and a ``training`` flag but does not mark them written in its schema."""
    arguments = func._schema.arguments
    names = [a.name for a in arguments]
    if "training" not in names:
        return None
    stats = tuple(
        i for i, a in enumerate(arguments)
        if a.name in _RUNNING_STATS and not (a.alias_info is not None and a.alias_info.is_write)
    )
    return (names.index("training"), stats) if stats else None


@dataclass(frozen=True)
class Op:
    """One ATen op, as :class:`OpWatch` hands it to its observer.

    It holds the op's arguments: an observer reads what it needs and keeps none of it, or
    the tensors would live longer than the code watched lets them.
    """

    index: int
    """Its number among the ops the watch saw, from 1."""
    func: torch._ops.OpOverload
    """The overload that runs."""
    args: tuple[Any, ...]
    """Its positional arguments."""
    kwargs: dict[str, Any]
    """Its keyword arguments."""

    @property
    def name(self) -> str:
        """The op's name without overload, e.g. ``"bernoulli_"``."""
        return self.func.overloadpacket.__name__

    @property
    def random(self) -> bool:
        """Whether it consumes the random number generator."""
        return torch.Tag.nondeterministic_seeded in self.func.tags

    def argument(self, position: int) -> Any:
        """The value of the schema's argument at ``position``, given by position or name."""
        if position < len(self.args):
            return self.args[position]
        return self.kwargs.get(self.func._schema.arguments[position].name)

    def inputs(self) -> list[torch.Tensor]:
        """The tensors among its arguments, in the order of its schema."""
        return [t for i in range(len(self.func._schema.arguments))
                for t in tensors(self.argument(i))]

    def written(self) -> list[torch.Tensor]:
        """The tensors it writes in place, in the order of its arguments.

        Writes are read off the schema (``Tensor(a!)`` arguments), which also catches
        BatchNorm's running statistics on fake tensors, whose kernels do not bump version
        counters. Some batch-norm ops update ``running_mean`` and ``running_var`` in training
        without saying so in their schema (``native_batch_norm``, ``cudnn_batch_norm``,
        ``miopen_batch_norm``, the op ``F.batch_norm`` reaches on CPU): those are added when
        ``training`` is True.
        """
        found: list[torch.Tensor] = []
        for i, arg in enumerate(self.func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                found += tensors(self.argument(i))
        positions = _running_stat_positions(self.func)
        if positions is not None and self.argument(positions[0]) is True:
            found += [t for i in positions[1] for t in tensors(self.argument(i))]
        return found


class OpObserver:
    """What :class:`OpWatch` tells about each op; override the methods needed."""

    def before_op(self, op: Op) -> None:
        """Called before ``op`` runs."""

    def after_op(self, op: Op, out: Any) -> None:
        """Called after ``op`` ran and returned ``out`` (which the observer may adjust in
        place, as the profile does for fake results whose storage is too small)."""


_METADATA_QUERIES = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})


class OpWatch(TorchDispatchMode):
    """The dispatch mode through which autockpt watches code run: every ATen op that runs while
    it is active, in forward and in backward (the autograd engine reinstalls the thread's mode
    stack on the thread that runs backward, recomputations included), goes to ``observer``
    before and after it runs.

    Attributes:
        count: how many ops it has seen; the op running now is number ``count``.
    """

    def __init__(self, observer: OpObserver,
                 rules: Mapping[torch._ops.OpOverload, Callable[..., Any]] | None = None,
                 flops: FlopTally | None = None, memo: FakeOutputs | None = None) -> None:
        super().__init__()
        self.observer = observer
        self.count = 0
        # Ops whose outputs a rule makes without running them (the profile's, NOTE [ Ops
        # answered by a shape rule ] in autockpt.profiling.shape_rules); a rule returning None runs
        # the op.
        self._rules = rules or {}
        self.flops = flops
        # Outputs of ops on fake tensors remembered from their first run (NOTE [ Fake
        # outputs from an op's first run ] in autockpt.ops.fake_outputs): only for a watch that
        # runs directly above FakeTensorMode, whose outputs the memo replaces.
        self._memo = memo

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        rule = self._rules.get(func)
        if func in _METADATA_QUERIES:
            # Asked by autograd and by kernels thousands of times per model; it creates,
            # reads and writes no tensor, so observers have nothing to see.
            out = rule(*args) if rule is not None else None
            return func(*args, **(kwargs or {})) if out is None else out
        self.count += 1
        op = Op(self.count, func, args, kwargs or {})
        self.observer.before_op(op)
        if self._memo is None:
            out = self._run(func, args, op.kwargs, rule)[0]
        else:
            # Before the rules: a remembered op costs less than most rules.
            out, flops, remembered = self._memo.run(
                func, args, op.kwargs, lambda: self._run(func, args, op.kwargs, rule),
                counted=self.flops is not None)
            if remembered and self.flops is not None:
                self.flops.total += flops
        self.observer.after_op(op, out)
        return out

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             rule: Callable[..., Any] | None) -> tuple[Any, int]:
        """The op's outputs, by its rule where one claims the call, else by running it; and
        the FLOPs it added to the tally."""
        out = rule(*args, **kwargs) if rule is not None else None
        if out is not None:
            return out, 0
        if self.flops is None:
            return func(*args, **kwargs), 0
        before = self.flops.total
        out = self.flops.run(func, args, kwargs)
        return out, self.flops.total - before


# --------------------------------------------------------------------------- FLOPs


# NOTE [ Saved tensors held from C++ ]
# What a pack hook returns is kept by the autograd node that saved it, a C++ object the Python
# garbage collector cannot see into. A hook that returns the tensor itself closes a cycle the
# collector never breaks whenever an op saves its own output (ReLU, softmax, sigmoid): the
# tensor holds its grad_fn, which holds the tensor. A forward that is only watched, never
# run backward (the profile on fake tensors; the modules rung's one real forward), then keeps
# its whole autograd graph alive for the life of the process: thousands of objects per plan
# (each full collection walks them all, so later plans slowed down), and for a real forward
# its activations. The hook returns a box instead, emptied when the block ends; whatever
# holds the watched tensors past the block (an interpreter's environment) must let them go.


class _Saved:
    """What :func:`watch_saved`'s pack hook hands autograd: the tensor, until the block ends."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor: torch.Tensor | None = tensor

    def unpack(self) -> torch.Tensor | None:
        return self.tensor


class SavedTensors:
    """The tensors :func:`watch_saved` handed autograd, kept past its block until
    :meth:`release` (a second run that resumes the first one's graph needs them)."""

    def __init__(self) -> None:
        self._boxes: list[_Saved] = []

    def release(self) -> None:
        """Let the autograd graphs drop the tensors (NOTE [ Saved tensors held from C++ ])."""
        for box in self._boxes:
            box.tensor = None
        self._boxes.clear()


@contextlib.contextmanager
def watch_saved(on_save: Callable[[torch.Tensor], None], keep: SavedTensors | None = None,
                *, hold: bool = True) -> Iterator[None]:
    """Call ``on_save`` with every tensor autograd saves for backward inside the block; a
    backward run inside the block finds them as usual. After the block (or, with ``keep``,
    after ``keep.release()``), the autograd graphs built in it no longer hold them (NOTE
    [ Saved tensors held from C++ ]): a backward through them fails. With ``hold=False``
    they are not held even inside the block: a forward that is never run backward (a real
    one, profiled) then takes the memory of an inference forward, not a training one.

    Example:
        >>> import torch
        >>> sizes = []
        >>> x = torch.randn(3, requires_grad=True)
        >>> with watch_saved(lambda t: sizes.append(t.numel())):
        ...     y = torch.relu(x * 2)   # mul saves nothing it needs (scalar), relu its output
        >>> sizes
        [3]
    """
    held = keep if keep is not None else SavedTensors()

    def pack(tensor: torch.Tensor) -> _Saved:
        on_save(tensor)
        if not hold:
            return _Saved(None)
        held._boxes.append(_Saved(tensor))
        return held._boxes[-1]

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack):
            yield
    finally:
        if keep is None:
            held.release()


def _cpu_attention_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return flop_formulas.sdpa_flop_count(query, key, value)


def _cpu_attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any,
                                  *args: Any, **kwargs: Any) -> int:
    return flop_formulas.sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> FlopCounterMode:
    """A :class:`~torch.utils.flop_counter.FlopCounterMode` that also counts the CPU kernel
    of ``scaled_dot_product_attention``, which torch's own table leaves at zero (its CUDA
    kernels are counted). Without it attention would look free to recompute on CPU.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 8, 4)
        >>> with flop_counter() as counter:
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        >>> counter.get_total_flops()
        2048
    """
    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward_flops),
    ):
        op = getattr(aten, name, None)
        if op is not None and op not in flop_formulas.flop_registry:
            mapping[op] = formula
    return FlopCounterMode(display=False, custom_mapping=mapping)


# NOTE [ FLOPs counted by the watch ]
# FlopCounterMode is a dispatch mode of its own: every op of the profile, forward and backward,
# went through a second Python mode only to be looked up in a table of formulas, and for each
# op without a formula the mode entered itself again to try a decomposition. That was a fifth
# of the profile's time on a DenseNet and more on a UNet. :class:`FlopTally` counts inside
# :class:`OpWatch` instead, with the very table such a counter builds (torch's formulas and
# ours for CPU attention). An op without a formula that has a decomposition reaches a dispatch
# mode only where autograd did not decompose it already; it is decomposed under a counter of
# torch's, as the mode would have, so the count is the same. The tally tracks no modules: the
# profile reads totals, and the module tracker's backward hooks were in the way of its probes.


class FlopTally:
    """The FLOPs of the ops :class:`OpWatch` runs, counted as
    :func:`flop_counter`'s :class:`~torch.utils.flop_counter.FlopCounterMode` counts them
    (NOTE [ FLOPs counted by the watch ]).

    Attributes:
        total: FLOPs counted so far.

    Example:
        >>> tally = FlopTally()
        >>> with OpWatch(OpObserver(), flops=tally):
        ...     _ = torch.ones(4, 3) @ torch.ones(3, 2)
        >>> tally.total
        48
    """

    def __init__(self) -> None:
        self.total = 0
        self.formulas: Mapping[Any, Callable[..., Any]] = flop_counter().flop_registry
        """torch's FLOP formulas by op packet, with ours for CPU attention."""
        self._decomposes: dict[Any, bool] = {}

    def _decomposable(self, func: torch._ops.OpOverload) -> bool:
        """Whether ``func.decompose`` would decompose it (asked once per op)."""
        known = self._decomposes.get(func)
        if known is None:
            key = torch._C.DispatchKey.CompositeImplicitAutograd
            known = func is not torch.ops.prim.device.default and (
                key in func.py_kernels
                or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
            self._decomposes[func] = known
        return known

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, its FLOPs added to :attr:`total`."""
        if not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is None and self._decomposable(func):
            with flop_counter() as counter:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                self.total += counter.get_total_flops()
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


# --------------------------------------------------------------------------- state


class _Holder(torch.nn.Module):
    """``gm`` as a child, so that ``functional_call`` swaps its state for ``run``'s call."""

    def __init__(self, gm: fx.GraphModule, run: Callable[..., Any]) -> None:
        super().__init__()
        self.gm = gm
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


def run_with_state(gm: fx.GraphModule, state: Mapping[str, torch.Tensor],
                   run: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``run(*args)`` with ``gm``'s parameters and buffers named in ``state`` replaced for the
    call (``torch.func.functional_call``), and put back afterwards: fake copies for the
    profile, clones of the buffers for timing. ``run`` is typically an interpreter's ``run``
    over ``gm``.

    Example:
        >>> net = fx.symbolic_trace(torch.nn.Linear(2, 2, bias=False))
        >>> run_with_state(net, {"weight": torch.eye(2)}, net, (torch.ones(1, 2),))
        tensor([[1., 1.]])
    """
    return torch.func.functional_call(_Holder(gm, run), {f"gm.{k}": v for k, v in state.items()},
                                      args, strict=False)
