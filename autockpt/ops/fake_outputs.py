"""The outputs of an ATen op on fake tensors, remembered from its first run.

# NOTE [ Fake outputs from an op's first run ]
Planning runs the model's ops on fake tensors three times over: the profile runs each node and
probes its backward, and the replay runs the chosen plan's forward, its recomputations and its
backward (:mod:`autockpt.profiling.profile`, :mod:`autockpt.running.replay`). The recomputations
repeat the forward's ops on the same shapes, a model's repeated blocks repeat each other's, and the
replay repeats most of what the profile ran. FakeTensorMode has a cache for this, but on this 2-core
CPU a hit still costs about 250 us: its key describes every argument in full, about 60% of the hit,
and the output is then built through the mode. A reentrant plan of diffusers' UNet2DModel (the
skip-connection tests' sizes) runs about 3,400 ops on fake tensors, 85% of them repeats of an
earlier one; one of T5, 5,300, 88% repeats.

What planning reads of an op's outputs is their metadata (shape, strides, dtype, device) and
their storages (which tensors share one, when one is freed), never values. An op that makes
fresh outputs, or views of an argument, from tensor arguments of fixed metadata does the same
every time, so :class:`FakeOutputs` keys each op by its arguments' metadata and, on a second
call, builds the outputs as FakeTensorMode's own cache hit does (an empty meta tensor, set to
the argument's storage for a view, wrapped in a FakeTensor of the arguments' mode) without
going through the mode: about 25 us.

It remembers only what that holds for, and runs the op otherwise:
- ops whose schema writes an argument (in-place and out= ops) and ops tagged with a
  data-dependent output shape are never remembered;
- every tensor argument must be a plain FakeTensor of a real dtype, without a constant value
  (a constant's outputs carry values that ``.item()`` reads);
- every output must be a FakeTensor (or None) without a constant value, either a view of one
  argument's storage (remembered with its offset) or with a storage of its own, at offset 0
  and exactly as large as its shape and strides need;
- other arguments must be plain Python values or torch's enums, keyed with their types (``1``
  and ``1.0`` give different dtypes), with the default dtype and inference mode.
The FLOPs counted for the first run (:class:`autockpt.ops.instrument.FlopTally`) are remembered
with the outputs, so a profile counts the same; a run that counts none (the replay's) remembers
none, and the first counting run after it runs the op to count them. The memo holds no tensor:
a reference to one would keep its storage alive, which is what planning watches (a recursive
closure, itself a reference cycle, did: the replay's peak grew by the tensors it held until the
collector ran).
tests/test_fake_outputs.py checks each case against the op, and that profiles and replays are
the same with the memo as without.

NOTE [ Remembered ops on symbolic sizes ]
A profile on symbolic sizes (NOTE [ One profile for every shape ] in
autockpt/profiling/symbolic.py) pays most for the fake runs themselves: every size an
expression, every check of one a question to the ``ShapeEnv``, and FakeTensorMode's cache hit
costs more than a millisecond there. The memo keys such an op by its arguments' size
expressions within their ``ShapeEnv`` (one profile's symbols mean nothing in another's), and
keeps the first run's output sizes, which are expressions of the same symbols. A second call
with the same expressions would compute the same sizes and record the same guards, which the
first already recorded; the outputs are made with guards suppressed, as FakeTensorMode makes
its cached ones. Such entries are kept on the ``ShapeEnv`` itself, not in the memo: their
sizes hold the env, which would otherwise live as long as the memo; there they die with it.
An output whose storage is not the size its shape needs, as polynomials (asking torch whether
two sizes are equal would itself guard), is not remembered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["MAX_ENTRIES", "SHARED", "FakeOutputs"]

MAX_ENTRIES = 50_000
"""Entries kept before the memo starts over (a few hundred bytes each)."""

_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_DATA_DEPENDENT = frozenset({torch.Tag.dynamic_output_shape,
                             getattr(torch.Tag, "data_dependent_output", None)}) - {None}

# An output's metadata: shape, strides, dtype, device, for a view the position of the fake
# tensor argument whose storage it shares (else None) and its storage offset, and for a fresh
# storage of symbolic size its size in bytes as the op wrote it (else None). A
# remembered op: its outputs' container (tuple, list, or None for one tensor), their
# metadata (None for an absent output) and the FLOPs counted for it (None: not counted).
_Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, int | None, int,
              torch.SymInt | None]
_Entry = tuple[type | None, tuple[_Meta | None, ...], int | None]


class _Unkeyable(Exception):
    """An argument the memo cannot key: the op runs."""


def _key_of(value: Any, parts: list[Any], fakes: list[FakeTensor]) -> None:
    """Append ``value``'s key to ``parts`` and its fake tensors, in order, to ``fakes`` (a
    recursive function, not a closure: a recursive closure is a reference cycle, which would
    keep the op's arguments, and the storages planning watches, alive until the garbage
    collector runs)."""
    kind = type(value)
    if kind is FakeTensor:
        if value.constant is not None or value.dtype.is_complex or value.is_sparse:
            raise _Unkeyable
        fakes.append(value)
        env = value.fake_mode.shape_env
        if env is None:
            parts.append((value.shape, value.stride(), value.dtype, value.storage_offset(),
                          value.fake_device))
        else:  # NOTE [ Remembered ops on symbolic sizes ]
            parts.append((_exprs(value.shape), _exprs(value.stride()), value.dtype,
                          _expr(value.storage_offset()), value.fake_device))
    elif kind in _PLAIN:
        parts.append((kind, value))
    elif kind is torch.SymInt:
        parts.append((kind, _expr(value)))
    elif kind is list or kind is tuple:
        parts.append((kind, len(value)))
        for item in value:
            _key_of(item, parts, fakes)
    else:
        raise _Unkeyable


def _expr(size: Any) -> Any:
    """A size as a key: its expression where symbolic (a ``SymInt`` does not hash)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _exprs(sizes: Any) -> tuple[Any, ...]:
    return tuple(_expr(size) for size in sizes)


def _storage_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * itemsize


def _tight(out: FakeTensor, shape: tuple[Any, ...], stride: tuple[Any, ...]) -> bool:
    """Whether ``out``'s storage is exactly as large as its shape and strides need. Of
    symbolic sizes, whether the two are the same polynomial: comparing them would guard."""
    nbytes = out.untyped_storage().nbytes()
    if not any(isinstance(v, torch.SymInt) for v in (nbytes, *shape, *stride)):
        return bool(nbytes == _storage_bytes(shape, stride, out.element_size()))
    needed = (1 + sum((size - 1) * step for size, step in zip(shape, stride))) \
        * out.element_size()
    if not (isinstance(nbytes, torch.SymInt) and isinstance(needed, torch.SymInt)):
        return False
    # The two are written differently (a product against a sum over strides): expanded,
    # equal polynomials are the same expression. Only an op's first run pays for this.
    return bool(sympy.expand(nbytes.node.expr - needed.node.expr) == 0)


def _meta_of(out: Any, fakes: list[FakeTensor], seen: set[int]) -> _Meta | None:
    """The metadata of one output; raises _Unkeyable for one the memo cannot make."""
    if out is None:
        return None
    if type(out) is not FakeTensor or out.constant is not None or out.requires_grad \
            or out.dtype.is_complex or out.is_sparse or any(out is arg for arg in fakes):
        raise _Unkeyable
    storage = out.untyped_storage()._cdata
    shape, stride = tuple(out.shape), out.stride()
    meta = (shape, stride, out.dtype, out.fake_device)
    base = next((i for i, arg in enumerate(fakes) if arg.untyped_storage()._cdata == storage),
                None)
    if base is not None:  # a view of an argument (split's outputs share one)
        return (*meta, base, out.storage_offset(), None)
    offset = out.storage_offset()
    if storage in seen or isinstance(offset, torch.SymInt) or offset != 0 or \
            not _tight(out, shape, stride):
        raise _Unkeyable
    seen.add(storage)
    nbytes = out.untyped_storage().nbytes()
    return (*meta, None, 0, nbytes if isinstance(nbytes, torch.SymInt) else None)


class FakeOutputs:
    """Outputs of ATen ops on fake tensors, made from the op's first run with the same argument
    metadata (NOTE [ Fake outputs from an op's first run ]).

    Example:
        >>> import torch
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> memo = FakeOutputs()
        >>> with FakeTensorMode():
        ...     x = torch.empty(4, 8)
        ...     mul = lambda: (torch.ops.aten.mul.Tensor(x, x), 0)
        ...     first, _, remembered_first = memo.run(torch.ops.aten.mul.Tensor, (x, x), {}, mul)
        ...     second, _, remembered_second = memo.run(torch.ops.aten.mul.Tensor, (x, x), {}, mul)
        >>> second.shape, second is first, remembered_first, remembered_second
        (torch.Size([4, 8]), False, False, True)
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], _Entry | None] = {}
        self._pure: dict[Any, bool] = {}
        self.hits = 0
        """Calls answered from the memo."""
        self.enabled = True
        """False: every op runs (tests compare the two)."""

    def clear(self) -> None:
        """Forget every op on plain sizes (those on symbolic sizes are kept with their
        ``ShapeEnv``)."""
        self._entries.clear()

    def _remembers(self, func: Any) -> bool:
        known = self._pure.get(func)
        if known is None:
            known = not func._schema.is_mutable and not any(
                tag in _DATA_DEPENDENT for tag in func.tags)
            self._pure[func] = known
        return known

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            call: Callable[[], tuple[Any, int]], counted: bool = True
            ) -> tuple[Any, int, bool]:
        """The outputs of ``func(*args, **kwargs)``, the FLOPs counted for them, and whether
        they came from the memo; ``call`` runs the op where they do not, and returns its
        outputs and the FLOPs it counted (``counted``: whether it counts them; what a run that
        does not, the replay's, remembers has no FLOPs, and a counting run runs the op once
        more to count them)."""
        if not self.enabled or not isinstance(func, torch._ops.OpOverload) \
                or not self._remembers(func):
            return (*call(), False)
        parts: list[Any] = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
        fakes: list[FakeTensor] = []
        try:
            _key_of(args, parts, fakes)
            _key_of(tuple(kwargs.items()), parts, fakes)
        except _Unkeyable:
            return (*call(), False)
        key = tuple(parts)
        env = fakes[0].fake_mode.shape_env if fakes else None
        # NOTE [ Remembered ops on symbolic sizes ]: kept with their ShapeEnv, gone with it.
        entries = self._entries if env is None else env.__dict__.setdefault(
            "_autockpt_fake_outputs", {})
        entry = entries.get(key, False)
        if entry is None:
            return (*call(), False)
        if entry is not False and (entry[2] is not None or not counted):
            self.hits += 1
            return _made(fakes, entry), entry[2] or 0, True
        out, flops = call()
        if len(entries) >= MAX_ENTRIES:
            entries.clear()
        entries[key] = _entry_of(out, fakes, flops if counted else None)
        return out, flops, False


def _entry_of(out: Any, fakes: list[FakeTensor], flops: int | None) -> _Entry | None:
    if not fakes:  # a factory: the mode to make its outputs in is not at hand
        return None
    seen: set[int] = set()
    try:
        if type(out) in (list, tuple):
            return (type(out), tuple(_meta_of(item, fakes, seen) for item in out), flops)
        return (None, (_meta_of(out, fakes, seen),), flops)
    except _Unkeyable:
        return None


def _made(fakes: list[FakeTensor], entry: _Entry) -> Any:
    container, metas, _ = entry
    mode = fakes[0].fake_mode
    # Sizes stay as the first run made them: the guards its shapes needed are recorded.
    env = mode.shape_env
    made = []
    for meta in metas:
        if meta is None:
            made.append(None)
            continue
        shape, stride, dtype, device, base, offset, nbytes = meta
        # As FakeTensorMode builds a cached output: the meta kernels, not the modes.
        quiet = env.suppress_guards() if env is not None else contextlib.nullcontext()
        with torch._C._DisableTorchDispatch(), quiet:
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if base is not None:
                empty.set_(fakes[base].untyped_storage(), offset, shape, stride)
            elif nbytes is not None:
                # The op's own expression of its storage's size (empty_strided writes an
                # equal one differently), so that a profile's expressions are the same.
                storage = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                empty.set_(storage.untyped_storage(), 0, shape, stride)
        made.append(FakeTensor(mode, empty, device))
    if container is None:
        return made[0]
    return container(made)


SHARED = FakeOutputs()
"""The memo the profile and the replay share (the replay repeats most of the profile's ops)."""
