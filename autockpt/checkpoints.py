"""Training checkpoints that resume exactly, load into any wrapper, and survive a crash mid-save.

What a checkpoint file holds
    One ``torch.save`` file, readable with ``torch.load(path, weights_only=True)``, holding a
    dict: ``"autockpt_checkpoint"`` (format version, 1), ``"meta"`` (a JSON string: step, epoch,
    metrics, time, ``extra``, and per rank the Python/NumPy RNG states and ``sampler_state``),
    ``"model"`` (the model's state_dict with wrapper prefixes removed), ``"optimizer"``,
    ``"scheduler"``, ``"scaler"`` (each only when given), ``"tensors"`` (tensors referenced from
    ``extra``) and ``"rank_tensors"`` (per rank: the torch CPU and CUDA RNG states and tensors in
    ``sampler_state``). Next to it, ``<file>.sha256`` holds its checksum in ``sha256sum`` format.

Crash safety
    Every file is written to a ``.tmp-*`` file in the same directory, flushed, fsynced and
    renamed over the final name with :func:`os.replace`, then the directory is fsynced. The
    :class:`CheckpointManager` index (``index.json``) is written the same way, after the
    checkpoint itself, so it only ever names complete files; their size and sha256 are in it.

Distributed
    Under DDP (an initialised process group, unsharded model) every rank calls ``save``; rank 0
    writes, after gathering each rank's RNG and sampler state, and the others wait for it. A
    model with DTensor parameters (FSDP2 ``fully_shard``) or FSDP1 modules is saved with
    ``torch.distributed.checkpoint`` (DCP) into ``ckpt-<step>.dcp/``, each rank writing its shard.
    Both run on CPU with gloo in torch 2.13 and are tested that way. DCP reads its ``.metadata``
    file with :mod:`pickle`; autockpt checks every file of such a directory against the sha256
    recorded at save time before DCP reads it, so it catches corruption, but only load sharded
    checkpoint directories you trust.

Example:
    >>> import tempfile, torch
    >>> from autockpt.checkpoints import CheckpointManager
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> manager = CheckpointManager(tempfile.mkdtemp(), keep_last=2)
    >>> for step in range(3):
    ...     _ = manager.save(step, model=model, optimizer=opt, metrics={"loss": 1.0 / (step + 1)})
    >>> [r.step for r in manager.list()]
    [1, 2]
    >>> manager.resume(model=model, optimizer=opt).step
    2
"""

from __future__ import annotations

import builtins
import contextlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Sampler

from autockpt import _ckpt_io as io
from autockpt.errors import CheckpointError, InvalidArgumentError

__all__ = [
    "CheckpointFallbackWarning",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWarning",
    "LoadResult",
    "ResumableSampler",
    "ShapeMismatch",
    "TrainingState",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
]

FORMAT_VERSION = 1
_FORMAT_KEY = "autockpt_checkpoint"
_INDEX_NAME = "index.json"
_INDEX_FORMAT = "autockpt-checkpoint-index"
_NAME_RE = re.compile(r"^ckpt-(\d{10,})\.(pt|dcp)$")
_DCP_META = "meta.pt"


class _Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


# --------------------------------------------------------------------------------------------
# Public result types and warnings
# --------------------------------------------------------------------------------------------


class CheckpointWarning(UserWarning):
    """Something about a checkpoint was not as expected, but loading went on.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("error", CheckpointWarning)  # make them fatal in CI
    """


class CheckpointFallbackWarning(CheckpointWarning):
    """:meth:`CheckpointManager.resume` skipped a missing, truncated or corrupted checkpoint
    and resumed from an older one. The message names the skipped file and why.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", CheckpointFallbackWarning)
    """


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint known to a :class:`CheckpointManager`.

    Example:
        >>> import tempfile, torch
        >>> m = CheckpointManager(tempfile.mkdtemp())
        >>> _ = m.save(7, model=torch.nn.Linear(1, 1), metrics={"loss": 0.5})
        >>> rec = m.latest()
        >>> (rec.step, rec.metrics["loss"], rec.path.name)
        (7, 0.5, 'ckpt-0000000007.pt')
    """

    step: int
    """The training step passed to :meth:`CheckpointManager.save`."""
    path: Path
    """The checkpoint file, or the ``.dcp`` directory of a sharded checkpoint."""
    metrics: Mapping[str, float]
    """The metrics passed at save time (read-only)."""
    time: float
    """When the save finished, in seconds since the epoch (:func:`time.time`)."""
    epoch: int | None = None
    """The epoch passed at save time, if any."""
    sha256: str | None = None
    """Checksum of the file; None for a sharded checkpoint, whose files each have one."""
    size: int = 0
    """Total size in bytes of the file or of the files of a sharded checkpoint."""
    sharded: bool = False
    """True when written with ``torch.distributed.checkpoint``, one shard per rank."""


@dataclass(frozen=True)
class TrainingState:
    """What :meth:`CheckpointManager.resume` / :func:`load_checkpoint` restored, besides the
    objects they loaded in place.

    Example:
        >>> import tempfile, torch
        >>> m = CheckpointManager(tempfile.mkdtemp())
        >>> _ = m.save(3, model=torch.nn.Linear(1, 1), epoch=1, extra={"best": 0.2})
        >>> s = m.resume(model=torch.nn.Linear(1, 1))
        >>> (s.step, s.epoch, s.extra, s.path.name)
        (3, 1, {'best': 0.2}, 'ckpt-0000000003.pt')
    """

    step: int
    """The step the checkpoint was saved at; continue training at ``step + 1``."""
    epoch: int | None
    """The epoch passed at save time, if any."""
    metrics: Mapping[str, float]
    """The metrics passed at save time (read-only)."""
    extra: Any
    """The ``extra`` passed at save time, tuples and tensors included, or None."""
    sampler_state: Any
    """This rank's ``sampler_state`` from save time, or None; give it to your sampler."""
    path: Path
    """The checkpoint that was actually loaded (older than the newest after a fallback)."""
    skipped: tuple[Path, ...] = ()
    """Newer checkpoints that were skipped because they were missing or corrupted."""


@dataclass(frozen=True)
class ShapeMismatch:
    """A key present in both the checkpoint and the model, with different shapes.

    Example:
        >>> ShapeMismatch("fc.weight", (4, 3), (4, 5)).key
        'fc.weight'
    """

    key: str
    """The model's key (as in ``model.state_dict()``)."""
    checkpoint_shape: tuple[int, ...]
    """Shape of the tensor in the checkpoint."""
    model_shape: tuple[int, ...]
    """Shape of the model's tensor."""


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_state_dict` matched and what it could not.

    Example:
        >>> import torch
        >>> r = load_state_dict(torch.nn.Linear(2, 2), {"weight": torch.zeros(2, 2)}, strict=False)
        >>> (r.missing_keys, r.ok)
        (('bias',), False)
    """

    loaded_keys: tuple[str, ...]
    """Model keys that received a value from the checkpoint."""
    missing_keys: tuple[str, ...] = ()
    """Model keys with no counterpart in the checkpoint (left unchanged)."""
    unexpected_keys: tuple[str, ...] = ()
    """Checkpoint keys (as spelt in the checkpoint) with no counterpart in the model."""
    shape_mismatches: tuple[ShapeMismatch, ...] = ()
    """Matched keys whose shapes differ (left unchanged)."""

    @property
    def ok(self) -> bool:
        """True when every key matched with the right shape."""
        return not (self.missing_keys or self.unexpected_keys or self.shape_mismatches)


# --------------------------------------------------------------------------------------------
# Loading a model's weights from anywhere
# --------------------------------------------------------------------------------------------


def load_state_dict(
    model: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    strict: bool = True,
    map_location: str | torch.device | None = "cpu",
) -> LoadResult:
    """Load weights into ``model`` whatever wrapped the model that saved them, or wraps this one.

    ``source`` is a path (an autockpt checkpoint, or any file ``torch.load`` reads with
    ``weights_only=True``) or an object: a bare state_dict, or one nested under
    ``"state_dict"``, ``"model_state_dict"`` or ``"model"``. Keys may carry ``module.``
    (DataParallel/DDP), ``_orig_mod.`` (torch.compile) or ``_checkpoint_wrapped_module.``
    (checkpoint_wrapper) components anywhere, combined; so may the model's own keys. Both sides
    are normalised and matched, then loaded under the model's real key names.

    With ``strict=True`` nothing is loaded unless every key matches with the same shape, and a
    :class:`CheckpointError` lists the missing and unexpected keys and both shapes of each
    mismatch. With ``strict=False`` the matching keys are loaded and the rest reported.

    Example:
        >>> import torch
        >>> src = torch.nn.DataParallel(torch.nn.Linear(3, 3))
        >>> dst = torch.compile(torch.nn.Linear(3, 3))  # keys "_orig_mod.weight", ...
        >>> load_state_dict(dst, src.state_dict()).ok
        True
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}",
            fix="pass the model (wrapped or not) whose weights to load",
        )
    if _is_sharded(model):
        raise CheckpointError(
            f"{type(model).__name__} has sharded (DTensor/FSDP) parameters, which "
            "load_state_dict does not fill",
            fix="resume it with CheckpointManager.resume, which uses torch.distributed.checkpoint",
        )
    if isinstance(source, (str, os.PathLike)):
        obj = _torch_load(Path(source), map_location=map_location, verify=True)
        where = repr(str(source))
    else:
        obj, where = source, "the given object"
    state = _find_state_dict(obj, where)
    return _load_into(model, state, strict=strict, where=where)


def _find_state_dict(obj: Any, where: str) -> Mapping[str, Any]:
    """The state_dict inside ``obj``: itself, or nested under a conventional key."""
    for _ in range(4):
        if not isinstance(obj, Mapping):
            break
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
        else:
            # A state_dict may hold non-tensor `_extra_state` entries next to tensors.
            if obj and any(isinstance(v, torch.Tensor) for v in obj.values()):
                return obj
            break
    keys = list(obj)[:8] if isinstance(obj, Mapping) else None
    raise CheckpointError(
        f"no state_dict found in {where}: expected a dict of tensors, or one under "
        f"'state_dict', 'model_state_dict' or 'model'; got {type(obj).__name__}"
        + (f" with keys {keys}" if keys is not None else ""),
        fix="pass the state_dict itself, e.g. load_state_dict(model, ckpt['my_key'])",
    )


def _load_into(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool, where: str
) -> LoadResult:
    target = model.state_dict()
    pairs = io.match_keys(state.keys(), target.keys())
    used = set(pairs.values())
    missing = tuple(k for k in target if k not in pairs)
    unexpected = tuple(k for k in state if k not in used)
    mismatches: list[ShapeMismatch] = []
    mapped: OrderedDict[str, Any] = OrderedDict()
    for tkey, skey in pairs.items():
        src, dst = state[skey], target[tkey]
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
            if src.shape != dst.shape:
                mismatches.append(ShapeMismatch(tkey, tuple(src.shape), tuple(dst.shape)))
                continue
        mapped[tkey] = src
    result = LoadResult(tuple(mapped), missing, unexpected, tuple(mismatches))
    if strict and not result.ok:
        raise CheckpointError(
            _describe_mismatch(result, type(model).__name__, where),
            fix="load the checkpoint into the model it was saved from, or pass strict=False "
            "to load the matching keys and get the rest in the returned LoadResult",
        )
    mapped._metadata = _map_metadata(  # type: ignore[attr-defined]
        getattr(state, "_metadata", None), getattr(target, "_metadata", None)
    )
    # Our own matching already decided what loads; strict=False here only stops torch from
    # re-reporting the keys we deliberately left out.
    model.load_state_dict(mapped, strict=strict)
    return result


def _describe_mismatch(result: LoadResult, model_name: str, where: str) -> str:
    def names(keys: Sequence[str]) -> str:
        shown = ", ".join(repr(k) for k in keys[:10])
        return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")

    lines = [f"the state_dict from {where} does not fit {model_name}:"]
    if result.missing_keys:
        lines.append(f"  missing in the checkpoint: {names(result.missing_keys)}")
    if result.unexpected_keys:
        lines.append(f"  not in the model: {names(result.unexpected_keys)}")
    for m in result.shape_mismatches[:10]:
        lines.append(
            f"  shape of {m.key!r}: checkpoint {list(m.checkpoint_shape)}, "
            f"model {list(m.model_shape)}"
        )
    return "\n".join(lines)


def _map_metadata(
    source: Mapping[str, Any] | None, target: Mapping[str, Any] | None
) -> OrderedDict[str, Any]:
    """Module version metadata under the target's module names, so each module's
    ``_load_from_state_dict`` sees the version it was saved with."""
    out: OrderedDict[str, Any] = OrderedDict(target or {})
    if source:
        for tkey, skey in io.match_keys(source.keys(), out.keys()).items():
            out[tkey] = source[skey]
    return out


# --------------------------------------------------------------------------------------------
# Single-file save / load
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    step: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: _Stateful | None = None,
    scaler: _Stateful | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
    extra: Any = None,
    sampler_state: Any = None,
) -> Path:
    """Write one crash-safe checkpoint file (and its ``.sha256`` sidecar); returns its path.

    This process's RNG states are saved too. It does no collective communication: under DDP
    call it on one rank, or use :class:`CheckpointManager`, which gathers every rank's state.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "last.pt")
        >>> save_checkpoint(path, model=torch.nn.Linear(2, 2), step=10).name
        'last.pt'
    """
    final = _as_path(path, "path")
    if final.is_dir():
        raise InvalidArgumentError(
            f"path {str(final)!r} is a directory",
            fix="pass a file name inside it, e.g. os.path.join(path, 'checkpoint.pt')",
        )
    if not final.parent.is_dir():
        raise InvalidArgumentError(
            f"the directory of path {str(final)!r} does not exist",
            fix=f"create it first: os.makedirs({str(final.parent)!r}, exist_ok=True)",
        )
    _check_components(model, optimizer, scheduler, scaler)
    step = _check_step(step)
    payload = _payload(
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        epoch=_check_epoch(epoch),
        metrics=io.encode_metrics(metrics),
        extra=extra,
        ranks=[_local_state(sampler_state)],
    )
    _write_file(final, payload)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: _Stateful | None = None,
    scaler: _Stateful | None = None,
    strict: bool = True,
    map_location: str | torch.device | None = "cpu",
    restore_rng: bool = True,
) -> TrainingState:
    """Load a file written by :func:`save_checkpoint` or :class:`CheckpointManager`.

    The file's sha256 is checked against its ``.sha256`` sidecar when there is one, then it is
    read with ``torch.load(weights_only=True)``. The model is loaded as by
    :func:`load_state_dict` (so any wrapper works); the optimizer, scheduler and scaler get
    their saved state and, unless ``restore_rng=False``, the RNGs are set as they were.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "last.pt")
        >>> _ = save_checkpoint(path, model=torch.nn.Linear(2, 2), step=10, epoch=2)
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 2)).step
        10
    """
    _check_components(model, optimizer, scheduler, scaler)
    file = _as_path(path, "path")
    if file.is_dir():
        raise InvalidArgumentError(
            f"path {str(file)!r} is a directory",
            fix="for a sharded (.dcp) checkpoint use CheckpointManager(parent).resume(...)",
        )
    payload = _read_payload(file, sha256=None, size=None, map_location=map_location)
    return _apply(
        payload,
        path=file,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        strict=strict,
        restore_rng=restore_rng,
    )


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class CheckpointManager:
    """Keeps the last ``keep_last`` checkpoints (and the ``keep_best`` best by ``monitor``) in
    one directory and resumes from the newest one that is intact.

    Files: ``ckpt-<step>.pt`` (+ ``.sha256``) or ``ckpt-<step>.dcp/`` for sharded models, and
    ``index.json`` listing them with size, sha256, metrics and time. The directory belongs to
    the manager: stray ``.tmp-*`` files and ``ckpt-*`` files the index does not list are deleted
    on save. Pass ``keep_last=None`` to keep every checkpoint.

    Under ``torch.distributed`` every rank must call :meth:`save` and :meth:`resume` (they
    communicate); with a shared file system each rank can resume.

    Example:
        >>> import tempfile, torch
        >>> model = torch.nn.Linear(4, 1)
        >>> m = CheckpointManager(tempfile.mkdtemp(), keep_last=1, keep_best=1, monitor="loss")
        >>> for step, loss in enumerate([0.9, 0.2, 0.5, 0.7]):
        ...     _ = m.save(step, model=model, metrics={"loss": loss})
        >>> [r.step for r in m.list()], m.best().step, m.latest().step
        ([1, 3], 1, 3)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_best: int = 0,
        monitor: str | None = None,
        mode: str = "min",
    ) -> None:
        self.directory = _as_path(directory, "directory")
        if self.directory.exists() and not self.directory.is_dir():
            raise InvalidArgumentError(
                f"directory {str(self.directory)!r} exists and is not a directory",
                fix="pass a directory path (it is created if missing), not a file",
            )
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise InvalidArgumentError(
                f"keep_last must be an int >= 1 or None, got {keep_last!r}",
                fix="pass keep_last=1 or more, or keep_last=None to keep every checkpoint",
            )
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
            raise InvalidArgumentError(
                f"keep_best must be an int >= 0, got {keep_best!r}",
                fix="pass keep_best=0 (off) or the number of best checkpoints to keep",
            )
        if mode not in ("min", "max"):
            raise InvalidArgumentError(
                f"mode must be 'min' or 'max', got {mode!r}",
                fix="use mode='min' for losses and mode='max' for accuracies",
            )
        if monitor is not None and not isinstance(monitor, str):
            raise InvalidArgumentError(
                f"monitor must be a metric name (str), got {type(monitor).__name__}",
                fix='pass e.g. monitor="val_loss"',
            )
        if keep_best > 0 and monitor is None:
            raise InvalidArgumentError(
                f"keep_best={keep_best} needs a metric to rank checkpoints by",
                fix='pass monitor="<metric name>" and that metric in save(metrics=...)',
            )
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.directory)!r}, keep_last={self.keep_last}, "
            f"keep_best={self.keep_best}, monitor={self.monitor!r}, mode={self.mode!r})"
        )

    # ---- queries ----------------------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointRecord]:
        """The kept checkpoints, oldest step first.

        Example:
            >>> import tempfile, torch
            >>> m = CheckpointManager(tempfile.mkdtemp())
            >>> _ = m.save(1, model=torch.nn.Linear(1, 1))
            >>> [r.step for r in m.list()]
            [1]
        """
        return [self._record(e) for e in self._read_index()]

    def latest(self) -> CheckpointRecord | None:
        """The checkpoint with the highest step, or None when there is none.

        Example:
            >>> import tempfile
            >>> CheckpointManager(tempfile.mkdtemp()).latest() is None
            True
        """
        entries = self._read_index()
        return self._record(entries[-1]) if entries else None

    def best(self) -> CheckpointRecord | None:
        """The kept checkpoint with the best ``metrics[monitor]`` (ties: the newer one).

        Example:
            >>> import tempfile, torch
            >>> m = CheckpointManager(tempfile.mkdtemp(), monitor="acc", mode="max")
            >>> for s, acc in enumerate([0.5, 0.9, 0.7]):
            ...     _ = m.save(s, model=torch.nn.Linear(1, 1), metrics={"acc": acc})
            >>> m.best().step
            1
        """
        if self.monitor is None:
            raise InvalidArgumentError(
                "best() needs a metric to rank by, but this manager has monitor=None",
                fix='create the manager with monitor="<metric name>"',
            )
        entries = [e for e in self._read_index() if self.monitor in e["metrics"]]
        if not entries:
            return None
        return self._record(min(entries, key=self._rank_key))

    # ---- save -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: _Stateful | None = None,
        scaler: _Stateful | None = None,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        extra: Any = None,
        sampler_state: Any = None,
    ) -> Path:
        """Save a checkpoint for ``step``, update the index, apply retention; returns its path.

        ``extra`` (rank 0's) and ``sampler_state`` (each rank's) may hold JSON-able values
        (None, bool, int, float, str, list, tuple, dict with str keys) and tensors.
        Saving a step that already exists replaces it.

        Example:
            >>> import tempfile, torch
            >>> m = CheckpointManager(tempfile.mkdtemp())
            >>> m.save(100, model=torch.nn.Linear(2, 2), epoch=3, metrics={"loss": 0.1}).name
            'ckpt-0000000100.pt'
        """
        step = _check_step(step)
        _check_components(model, optimizer, scheduler, scaler)
        metrics_f = io.encode_metrics(metrics)
        if self.keep_best > 0 and self.monitor not in metrics_f:
            raise InvalidArgumentError(
                f"save(step={step}) got metrics {sorted(metrics_f)} without the monitored "
                f"metric {self.monitor!r} (keep_best={self.keep_best})",
                fix=f"pass metrics={{{self.monitor!r}: value, ...}} on every save",
            )
        epoch = _check_epoch(epoch)
        rank, world = _dist_rank_world()
        local = _local_state(sampler_state)
        ranks = _gather_to_rank0(local, rank, world)
        sharded = _is_sharded(model)
        stem = f"ckpt-{step:010d}"
        final = self.directory / (stem + (".dcp" if sharded else ".pt"))
        error: BaseException | None = None
        if sharded:
            error = self._save_sharded(
                final, step, model, optimizer, scheduler, scaler, epoch, metrics_f, extra,
                ranks, rank, world,
            )
        elif rank == 0:
            try:
                payload = _payload(
                    step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                    scaler=scaler, epoch=epoch, metrics=metrics_f, extra=extra,
                    ranks=ranks,
                )
                self._drop_from_index(final)
                sha, size = _write_file(final, payload)
                self._commit(final, step, epoch, metrics_f, sha=sha, size=size, files=None)
            except BaseException as err:
                error = err
        _raise_if_rank0_failed(error, rank, world, final)
        return final

    def _save_sharded(
        self,
        final: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: _Stateful | None,
        scaler: _Stateful | None,
        epoch: int | None,
        metrics: dict[str, float],
        extra: Any,
        ranks: builtins.list[tuple[Any, builtins.list[torch.Tensor]]] | None,
        rank: int,
        world: int,
    ) -> BaseException | None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        tmp = self.directory / f"{io.TEMP_PREFIX}{final.name}"
        if rank == 0:
            _rmtree(tmp)
            tmp.mkdir()
        if world > 1:
            dist.barrier()
        # Every rank takes part in DCP's collectives; only rank 0 finalises afterwards.
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp))
        if rank != 0:
            return None
        try:
            payload = _payload(
                step=step, model=None, optimizer=None, scheduler=scheduler, scaler=scaler,
                epoch=epoch, metrics=metrics, extra=extra, ranks=ranks,
            )
            payload["sharded"] = True
            _write_file(tmp / _DCP_META, payload, sidecar=False)
            files = {}
            for f in sorted(tmp.rglob("*")):
                if f.is_file():
                    files[f.relative_to(tmp).as_posix()] = {
                        "sha256": io.file_sha256(f),
                        "size": f.stat().st_size,
                    }
            self._drop_from_index(final)
            _rmtree(final)
            os.replace(tmp, final)
            io.fsync_directory(self.directory)
            self._commit(final, step, epoch, metrics, sha=None, size=None, files=files)
        except BaseException as err:
            return err
        return None

    def _drop_from_index(self, final: Path) -> None:
        """Before overwriting a step that exists, unlist it, so the index never names a file
        that is being rewritten."""
        entries = self._read_index()
        kept = [e for e in entries if e["file"] != final.name]
        if len(kept) != len(entries):
            self._write_index(kept)

    def _commit(
        self,
        final: Path,
        step: int,
        epoch: int | None,
        metrics: dict[str, float],
        *,
        sha: str | None,
        size: int | None,
        files: dict[str, dict[str, Any]] | None,
    ) -> None:
        entry: dict[str, Any] = {
            "step": step,
            "file": final.name,
            "time": time.time(),
            "epoch": epoch,
            "metrics": metrics,
        }
        if files is None:
            entry.update(sha256=sha, size=size)
        else:
            entry["files"] = files
        entries = self._read_index(pending=final.name)
        entries = [e for e in entries if e["file"] != final.name] + [entry]
        entries.sort(key=lambda e: e["step"])
        kept = self._retain(entries)
        self._write_index(kept)
        # Deleting only after the index stops naming a file keeps "index => file is complete".
        self._cleanup({e["file"] for e in kept})

    def _retain(self, entries: builtins.list[dict[str, Any]]) -> builtins.list[dict[str, Any]]:
        if self.keep_last is None:
            return entries
        keep = {e["file"] for e in entries[-self.keep_last :]}
        if self.keep_best > 0:
            ranked = sorted(entries, key=self._rank_key)
            keep.update(e["file"] for e in ranked[: self.keep_best])
        return [e for e in entries if e["file"] in keep]

    def _rank_key(self, entry: Mapping[str, Any]) -> tuple[float, int]:
        value = entry["metrics"].get(self.monitor)
        return (io.metric_sort_key(value, self.mode), -entry["step"])

    def _cleanup(self, keep: set[str]) -> None:
        # No directory fsync: a deletion lost to a power cut only brings back a file the index
        # no longer names, which the next save removes again.
        for child in self.directory.iterdir():
            name = child.name
            base = name[: -len(io.SIDECAR_SUFFIX)] if name.endswith(io.SIDECAR_SUFFIX) else name
            if name.startswith(io.TEMP_PREFIX) or (_NAME_RE.match(base) and base not in keep):
                _rmtree(child)

    # ---- index ------------------------------------------------------------------------------

    def _index_path(self) -> Path:
        return self.directory / _INDEX_NAME

    def _write_index(self, entries: builtins.list[dict[str, Any]]) -> None:
        doc = {"format": _INDEX_FORMAT, "version": FORMAT_VERSION, "checkpoints": entries}
        io.atomic_write_text(self._index_path(), json.dumps(doc, indent=1, sort_keys=True))

    def _read_index(self, *, pending: str | None = None) -> builtins.list[dict[str, Any]]:
        """The index entries, oldest step first. ``pending`` names a checkpoint being saved
        right now, which a rebuild must not count as found."""
        path = self._index_path()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return self._rebuild_index("index.json is missing", pending)
        try:
            doc = json.loads(text)
            if doc.get("format") != _INDEX_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}")
            if doc.get("version", 0) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{str(path)!r} has index version {doc['version']}, newer than this "
                    f"autockpt understands ({FORMAT_VERSION})",
                    fix="upgrade autockpt",
                )
            entries = doc["checkpoints"]
            for e in entries:
                e["step"], e["file"], e["metrics"]  # noqa: B018 - schema check
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return self._rebuild_index(f"index.json is unreadable ({err})", pending)
        return sorted(entries, key=lambda e: e["step"])

    def _rebuild_index(self, why: str, pending: str | None) -> builtins.list[dict[str, Any]]:
        """Recover the list from the checkpoint files themselves (each one's own metadata and
        checksum sidecar) when ``index.json`` was deleted or damaged outside autockpt."""
        found = sorted(
            (p for p in self.directory.iterdir() if _NAME_RE.match(p.name) and p.name != pending),
            key=lambda p: p.name,
        )
        if not found:
            return []
        entries = []
        for p in found:
            try:
                if p.is_dir():
                    meta_file = p / _DCP_META
                    files = {
                        f.relative_to(p).as_posix(): {
                            "sha256": io.file_sha256(f),
                            "size": f.stat().st_size,
                        }
                        for f in sorted(p.rglob("*"))
                        if f.is_file()
                    }
                    extra: dict[str, Any] = {"files": files}
                else:
                    meta_file = p
                    sha = io.read_sidecar(p)
                    if sha is None:
                        continue
                    io.verify_file(p, sha256=sha, size=None)
                    extra = {"sha256": sha, "size": p.stat().st_size}
                meta = json.loads(_torch_load(meta_file, map_location="cpu", verify=False)["meta"])
            except (CheckpointError, OSError, KeyError, ValueError, TypeError):
                continue
            entries.append(
                {
                    "step": meta["step"],
                    "file": p.name,
                    "time": meta.get("time", p.stat().st_mtime),
                    "epoch": meta.get("epoch"),
                    "metrics": meta.get("metrics", {}),
                    **extra,
                }
            )
        warnings.warn(
            f"{why} in {str(self.directory)!r}; rebuilt the list from {len(entries)} intact "
            "checkpoint file(s) found there",
            CheckpointWarning,
            stacklevel=4,
        )
        return sorted(entries, key=lambda e: e["step"])

    def _record(self, entry: Mapping[str, Any]) -> CheckpointRecord:
        files = entry.get("files")
        return CheckpointRecord(
            step=entry["step"],
            path=self.directory / entry["file"],
            metrics=MappingProxyType(dict(entry["metrics"])),
            time=entry["time"],
            epoch=entry.get("epoch"),
            sha256=entry.get("sha256"),
            size=sum(f["size"] for f in files.values()) if files else entry.get("size", 0),
            sharded=files is not None,
        )

    # ---- resume -----------------------------------------------------------------------------

    def resume(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: _Stateful | None = None,
        scaler: _Stateful | None = None,
        strict: bool = True,
        map_location: str | torch.device | None = "cpu",
        restore_rng: bool = True,
    ) -> TrainingState | None:
        """Load the newest intact checkpoint into the given objects; None if there is none.

        A missing, truncated or corrupted checkpoint (size or sha256 differs from the index)
        is skipped with a :class:`CheckpointFallbackWarning` and the next older one is used;
        :attr:`TrainingState.path` says which. If every checkpoint is damaged a
        :class:`CheckpointError` lists why each was rejected.

        Example:
            >>> import tempfile, torch
            >>> m = CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> state = m.resume(model=model)
            >>> start = 0 if state is None else state.step + 1
            >>> start
            0
        """
        _check_components(model, optimizer, scheduler, scaler)
        sharded_model = _is_sharded(model)
        entries = self._read_index()
        skipped: builtins.list[Path] = []
        reasons: builtins.list[str] = []
        for entry in reversed(entries):
            path = self.directory / entry["file"]
            try:
                payload = self._read_entry(entry, map_location)
            except CheckpointError as err:
                skipped.append(path)
                reasons.append(f"{path.name}: {err.message}")
                warnings.warn(
                    f"skipping checkpoint {str(path)!r}: {err.message}; trying the next older one",
                    CheckpointFallbackWarning,
                    stacklevel=2,
                )
                continue
            if entry.get("files") is not None:
                _load_sharded(path, model, optimizer)
                model_for_apply = None
            elif sharded_model:
                raise CheckpointError(
                    f"{str(path)!r} is a single-file checkpoint but {type(model).__name__} "
                    "is sharded (DTensor/FSDP parameters)",
                    fix="resume the unsharded model first, then shard it; or save from the "
                    "sharded model so the manager writes a .dcp checkpoint",
                )
            else:
                model_for_apply = model
            state = _apply(
                payload,
                path=path,
                model=model_for_apply,
                optimizer=None if model_for_apply is None else optimizer,
                scheduler=scheduler,
                scaler=scaler,
                strict=strict,
                restore_rng=restore_rng,
            )
            return TrainingState(
                step=state.step,
                epoch=state.epoch,
                metrics=state.metrics,
                extra=state.extra,
                sampler_state=state.sampler_state,
                path=path,
                skipped=tuple(skipped),
            )
        if entries:
            raise CheckpointError(
                f"no intact checkpoint in {str(self.directory)!r}:\n  " + "\n  ".join(reasons),
                fix="restore a checkpoint from a backup, or delete the directory to start over",
            )
        return None

    def _read_entry(
        self, entry: Mapping[str, Any], map_location: str | torch.device | None
    ) -> dict[str, Any]:
        path = self.directory / entry["file"]
        files = entry.get("files")
        if files is None:
            return _read_payload(
                path, sha256=entry["sha256"], size=entry["size"], map_location=map_location
            )
        rank, world = _dist_rank_world()
        # One rank reads all shards to verify them, instead of every rank reading everything.
        problem: str | None = None
        if rank == 0:
            try:
                for rel, rec in sorted(files.items()):
                    io.verify_file(path / rel, sha256=rec["sha256"], size=rec["size"])
            except CheckpointError as err:
                problem = err.message
        if world > 1:
            import torch.distributed as dist

            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem is not None:
            raise CheckpointError(problem)
        return _read_payload(path / _DCP_META, sha256=None, size=None, map_location=map_location)


# --------------------------------------------------------------------------------------------
# Resumable sampler
# --------------------------------------------------------------------------------------------


class ResumableSampler(Sampler[int]):
    """A shuffling sampler whose position can be saved and restored mid-epoch.

    Epoch ``e`` visits a permutation drawn from a private generator seeded with ``seed + e``,
    so it neither reads nor advances the global RNG. :meth:`state_dict` returns
    ``{"epoch", "position", "seed"}``; ``position`` counts the indices already handed to the
    DataLoader this epoch, which equals what the training loop consumed when the DataLoader has
    ``num_workers=0``. (With workers, indices are fetched ahead: call
    ``sampler.set_epoch(epoch, start=samples_consumed)`` on resume with your own count.)
    When an epoch's indices run out the sampler moves to the next epoch by itself, so calling
    :meth:`set_epoch` is optional. With ``num_replicas > 1`` each rank gets every
    ``num_replicas``-th index of the permutation, padded by repeating, like
    ``DistributedSampler``.

    Give the DataLoader its own generator (``generator=torch.Generator()``): otherwise each
    ``iter(loader)`` draws a worker seed from the global RNG, and a resumed run, which creates
    its iterator after restoring the RNG, would be one draw off.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> data = torch.arange(10)
        >>> sampler = ResumableSampler(data, seed=0)
        >>> loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
        >>> first = next(iter(loader))
        >>> state = sampler.state_dict()        # {"epoch": 0, "position": 4, "seed": 0}
        >>> again = ResumableSampler(data, seed=0)
        >>> again.load_state_dict(state)
        >>> rest = [b for b in DataLoader(data, batch_size=4, sampler=again)]
        >>> sorted(torch.cat([first] + rest).tolist()) == list(range(10))
        True
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if isinstance(data_source, int) and not isinstance(data_source, bool):
            length = data_source
        elif isinstance(data_source, Sized):
            length = len(data_source)
        else:
            raise InvalidArgumentError(
                f"data_source must be a sized dataset or a length, got "
                f"{type(data_source).__name__}",
                fix="pass the dataset (it must have __len__) or its length",
            )
        if length < 0:
            raise InvalidArgumentError(
                f"data_source length must be >= 0, got {length}", fix="pass the dataset length"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(
                f"seed must be an int, got {seed!r}", fix="pass e.g. seed=0"
            )
        d_rank, d_world = _dist_rank_world()
        num_replicas = d_world if num_replicas is None else num_replicas
        rank = d_rank if rank is None else rank
        if not (isinstance(num_replicas, int) and num_replicas >= 1):
            raise InvalidArgumentError(
                f"num_replicas must be an int >= 1, got {num_replicas!r}",
                fix="pass the world size, or leave it None to read it from torch.distributed",
            )
        if not (isinstance(rank, int) and 0 <= rank < num_replicas):
            raise InvalidArgumentError(
                f"rank must be an int in [0, {num_replicas}), got {rank!r}",
                fix="pass this process's rank, or leave it None",
            )
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return math.ceil(self.length / self.num_replicas) if self.length else 0

    def _order(self) -> builtins.list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen).tolist()
        else:
            order = builtins.list(range(self.length))
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if order and total > len(order):
            order = (order * math.ceil(total / len(order)))[:total]
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        for i in range(self.position, len(order)):
            # Counted before the yield: once the DataLoader holds index i, it is consumed.
            self.position = i + 1
            yield order[i]
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int, *, start: int | None = None) -> None:
        """Move to ``epoch``. ``start`` (samples of this rank to skip) defaults to keeping the
        position when ``epoch`` is the current epoch (i.e. just after a resume) and 0 otherwise.

        Example:
            >>> s = ResumableSampler(8)
            >>> s.set_epoch(3, start=2)
            >>> (s.epoch, s.position)
            (3, 2)
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgumentError(
                f"epoch must be an int >= 0, got {epoch!r}", fix="pass the epoch number"
            )
        if start is None:
            start = self.position if epoch == self.epoch else 0
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(self):
            raise InvalidArgumentError(
                f"start must be an int in [0, {len(self)}], got {start!r}",
                fix="pass the number of this rank's samples already consumed in that epoch",
            )
        self.epoch, self.position = epoch, start

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``, JSON-able, for ``save(sampler_state=...)``.

        Example:
            >>> ResumableSampler(4, seed=5).state_dict()
            {'epoch': 0, 'position': 0, 'seed': 5}
        """
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue where :meth:`state_dict` was taken.

        Example:
            >>> s = ResumableSampler(4)
            >>> s.load_state_dict({"epoch": 2, "position": 1, "seed": 0})
            >>> (s.epoch, s.position)
            (2, 1)
        """
        if not isinstance(state, Mapping) or not {"epoch", "position", "seed"} <= set(state):
            raise InvalidArgumentError(
                f"sampler state must be a dict with 'epoch', 'position' and 'seed', got {state!r}",
                fix="pass what ResumableSampler.state_dict() returned",
            )
        if state["seed"] != self.seed:
            raise InvalidArgumentError(
                f"the state was saved with seed={state['seed']} but this sampler has "
                f"seed={self.seed}; the permutations would differ",
                fix=f"create the sampler with seed={state['seed']}",
            )
        self.set_epoch(int(state["epoch"]), start=int(state["position"]))


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _as_path(value: Any, name: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"{name} must be a str or os.PathLike, got {type(value).__name__}",
            fix=f"pass {name} as a path string",
        )
    return Path(value)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(
            f"step must be an int >= 0, got {step!r}",
            fix="pass the global step counter, e.g. save(step, ...)",
        )
    return int(step)


def _check_epoch(epoch: Any) -> int | None:
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise InvalidArgumentError(
            f"epoch must be an int or None, got {epoch!r}", fix="pass the epoch number"
        )
    return epoch


def _check_components(
    model: Any, optimizer: Any, scheduler: Any, scaler: Any
) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"model must be a torch.nn.Module, got {type(model).__name__}",
            fix="pass model=<your nn.Module> (wrapped in DDP/compile/FSDP or not)",
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
            fix="pass optimizer=<your optimizer> or leave it out",
        )
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise InvalidArgumentError(
                f"{name} must have state_dict() and load_state_dict(), got {type(obj).__name__}",
                fix=f"pass a torch {name} object or leave {name} out",
            )


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _is_sharded(model: nn.Module) -> bool:
    """FSDP2 parameters are DTensors; FSDP1 leaves its wrapper modules in the tree."""
    # A DTensor or FSDP module can only exist once its module was imported; checking
    # sys.modules first spares every unsharded user a ~1 s import on the first save.
    dtensor_mod = sys.modules.get("torch.distributed.tensor") or sys.modules.get(
        "torch.distributed._tensor"
    )
    dtensor = getattr(dtensor_mod, "DTensor", None)
    if dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters()):
        return True
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    return fsdp is not None and any(isinstance(m, fsdp) for m in model.modules())


def _local_state(sampler_state: Any) -> tuple[dict[str, Any], builtins.list[torch.Tensor]]:
    """This rank's RNG states and sampler state, JSON tree plus its tensors."""
    tensors: builtins.list[torch.Tensor] = []
    tree = {
        "rng": io.capture_rng(tensors),
        "sampler_state": io.encode_tree(sampler_state, tensors, "sampler_state"),
    }
    return tree, tensors


def _gather_to_rank0(
    local: tuple[dict[str, Any], builtins.list[torch.Tensor]], rank: int, world: int
) -> builtins.list[tuple[dict[str, Any], builtins.list[torch.Tensor]]] | None:
    if world == 1:
        return [local]
    import torch.distributed as dist

    out: builtins.list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(local, out, dst=0)
    return out


def _raise_if_rank0_failed(error: BaseException | None, rank: int, world: int, path: Path) -> None:
    """Tell every rank whether rank 0's write worked, so none waits forever or carries on
    believing a checkpoint exists."""
    if world > 1:
        import torch.distributed as dist

        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if rank != 0 and box[0] is not None:
            raise CheckpointError(
                f"rank 0 failed to write checkpoint {str(path)!r}: {box[0]}",
                fix="see rank 0's traceback",
            )
    if error is not None:
        raise error


_WEIGHTS_ONLY_LEAVES = (
    type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
    torch.device, torch.Size,
)


def _check_loadable(obj: Any, where: str) -> None:
    """Refuse at save time what ``torch.load(weights_only=True)`` would refuse at resume."""
    if isinstance(obj, _WEIGHTS_ONLY_LEAVES):
        return
    if isinstance(obj, (dict, OrderedDict)):
        for k, v in obj.items():
            _check_loadable(k, f"{where} key")
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise InvalidArgumentError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) refuses, so the checkpoint could not be resumed",
        fix="keep only tensors, numbers, strings and lists/dicts of them in that state_dict",
    )


def _payload(
    *,
    step: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: _Stateful | None,
    scaler: _Stateful | None,
    epoch: int | None,
    metrics: dict[str, float],
    extra: Any,
    ranks: builtins.list[tuple[dict[str, Any], builtins.list[torch.Tensor]]] | None,
) -> dict[str, Any]:
    assert ranks is not None
    tensors: builtins.list[torch.Tensor] = []
    meta = {
        "step": step,
        "epoch": epoch,
        "metrics": metrics,
        "time": time.time(),
        "extra": io.encode_tree(extra, tensors, "extra"),
        "ranks": [tree for tree, _ in ranks],
        "torch_version": torch.__version__,
    }
    payload: dict[str, Any] = {
        _FORMAT_KEY: FORMAT_VERSION,
        "meta": io.dumps(meta),
        "tensors": tensors,
        "rank_tensors": [ts for _, ts in ranks],
    }
    if model is not None:
        payload["model"] = io.canonical_state_dict(model.state_dict())
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            state = obj.state_dict()
            _check_loadable(state, f"{name}.state_dict()")
            payload[name] = state
    return payload


def _write_file(final: Path, payload: dict[str, Any], *, sidecar: bool = True) -> tuple[str, int]:
    """Atomic torch.save plus, optionally, the ``.sha256`` sidecar (written second, so a
    sidecar always describes a complete file)."""
    try:
        # With a sidecar, one directory fsync after its rename makes both renames durable
        # before the caller writes the index that names them.
        sha, size = io.atomic_write(final, lambda f: torch.save(payload, f), sync_dir=not sidecar)
        if sidecar:
            io.atomic_write_text(io.sidecar_path(final), f"{sha}  {final.name}\n")
    except OSError as err:
        raise CheckpointError(
            f"could not write checkpoint {str(final)!r}: {err}",
            fix="check free disk space and write permission on that directory",
        ) from err
    return sha, size


def _torch_load(path: Path, *, map_location: Any, verify: bool) -> Any:
    if verify and path.is_file():
        io.verify_file(path, sha256=io.read_sidecar(path), size=None)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} does not exist",
            fix="check the path, or use CheckpointManager(dir).list() to see what exists",
        ) from None
    except IsADirectoryError:
        raise CheckpointError(
            f"{str(path)!r} is a directory, not a checkpoint file",
            fix="pass the file path; sharded .dcp directories load via CheckpointManager.resume",
        ) from None
    except Exception as err:
        text = str(err)
        if "weights_only" in text or "Unsupported global" in text:
            raise CheckpointError(
                f"{str(path)!r} holds Python objects that torch.load(weights_only=True) "
                f"refuses to unpickle: {text.splitlines()[0][:300]}",
                fix="if you trust this file, load it yourself with torch.load(path, "
                "weights_only=False) and pass the resulting object to load_state_dict",
            ) from err
        raise CheckpointError(
            f"{str(path)!r} is not a readable torch file (truncated or corrupted?): "
            f"{text.splitlines()[0][:300] if text else type(err).__name__}",
            fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
        ) from err


def _read_payload(
    path: Path, *, sha256: str | None, size: int | None, map_location: Any
) -> dict[str, Any]:
    if sha256 is not None or size is not None:
        io.verify_file(path, sha256=sha256, size=size)
        payload = _torch_load(path, map_location=map_location, verify=False)
    else:
        payload = _torch_load(path, map_location=map_location, verify=True)
    if not isinstance(payload, dict) or _FORMAT_KEY not in payload:
        raise CheckpointError(
            f"{str(path)!r} is not an autockpt checkpoint (no {_FORMAT_KEY!r} entry)",
            fix="to load only the weights of another file use load_state_dict(model, path)",
        )
    if payload[_FORMAT_KEY] > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {payload[_FORMAT_KEY]}, newer than this "
            f"autockpt reads ({FORMAT_VERSION})",
            fix="upgrade autockpt",
        )
    try:
        payload["meta"] = json.loads(payload["meta"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{str(path)!r} has unreadable metadata: {err}",
            fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
        ) from err
    return payload


def _apply(
    payload: dict[str, Any],
    *,
    path: Path,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: _Stateful | None,
    scaler: _Stateful | None,
    strict: bool,
    restore_rng: bool,
) -> TrainingState:
    meta = payload["meta"]
    if model is not None:
        if "model" not in payload:
            raise CheckpointError(f"{str(path)!r} holds no model state", fix="check the path")
        _load_into(model, payload["model"], strict=strict, where=repr(str(path)))
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is None or (name == "optimizer" and model is None):
            continue
        if name not in payload:
            raise CheckpointError(
                f"{str(path)!r} was saved without {name} state, but {name}= was passed",
                fix=f"pass {name}=None to keep its current (fresh) state",
            )
        try:
            obj.load_state_dict(payload[name])
        except (ValueError, KeyError, RuntimeError, TypeError) as err:
            raise CheckpointError(
                f"the {name} state in {str(path)!r} does not fit {type(obj).__name__}: {err}",
                fix=f"build the {name} exactly as when saving (same parameter groups and "
                f"order), or pass {name}=None",
            ) from err
    rank, _ = _dist_rank_world()
    ranks = meta["ranks"]
    sampler_state = None
    if rank < len(ranks):
        tensors = payload["rank_tensors"][rank]
        if restore_rng:
            io.restore_rng(ranks[rank]["rng"], tensors, CheckpointWarning)
        sampler_state = io.decode_tree(ranks[rank]["sampler_state"], tensors)
    else:
        warnings.warn(
            f"{str(path)!r} was saved by {len(ranks)} rank(s); rank {rank} has no saved RNG or "
            "sampler state, so it keeps its current ones",
            CheckpointWarning,
            stacklevel=3,
        )
    return TrainingState(
        step=meta["step"],
        epoch=meta["epoch"],
        metrics=MappingProxyType(dict(meta["metrics"])),
        extra=io.decode_tree(meta["extra"], payload["tensors"]),
        sampler_state=sampler_state,
        path=path,
    )


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def _load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _dcp_state(model, optimizer)
    try:
        with warnings.catch_warnings():
            # Loading a sharded checkpoint into one unsharded process is intended here.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as err:
        raise CheckpointError(
            f"could not load sharded checkpoint {str(path)!r} into {type(model).__name__}: "
            f"{str(err).splitlines()[0][:400] if str(err) else type(err).__name__}",
            fix="build the model and optimizer as when saving (same parameter names), then resume",
        ) from err
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


def _rmtree(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
