"""Training checkpoints that resume exactly, load into any wrapper, and survive a crash mid-save.

What a checkpoint file holds
    One ``torch.save`` file, readable with ``torch.load(path, weights_only=True)``, holding a
    dict: ``"autockpt_checkpoint"`` (format version, 1), ``"meta"`` (a JSON string: step, epoch,
    metrics, time, ``extra``, and per rank the Python/NumPy RNG states and ``sampler_state``),
    ``"model"`` (the model's state_dict with wrapper prefixes removed), ``"optimizer"``,
    ``"scheduler"``, ``"scaler"`` (each only when given), ``"tensors"`` (tensors referenced from
    ``extra``) and ``"rank_tensors"`` (per rank: the torch CPU and CUDA RNG states and tensors in
    ``sampler_state``). Next to it, ``<file>.sha256`` holds its checksum in ``sha256sum`` format.

Exact resume
    Resuming restores model, optimizer, scheduler and grad-scaler state and the RNGs (Python
    ``random``, NumPy's global RNG, torch CPU, every CUDA device), so training N steps, stopping
    and resuming for N more gives bitwise the same parameters as 2N steps straight, provided the
    data order resumes too: use :class:`ResumableSampler` and give the DataLoader its own
    ``generator=torch.Generator()``. Not covered: RNGs the user keeps elsewhere (NumPy
    ``default_rng`` objects: put their state in ``extra``), randomness inside DataLoader
    workers, and kernels that are nondeterministic by themselves (see
    ``torch.use_deterministic_algorithms``).

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
import math
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Sampler

from autockpt import _checkpoint_impl as impl
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

_Stateful = impl.Stateful


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
    if impl.is_sharded(model):
        raise CheckpointError(
            f"{type(model).__name__} has sharded (DTensor/FSDP) parameters, which "
            "load_state_dict does not fill",
            fix="resume it with CheckpointManager.resume, which uses torch.distributed.checkpoint",
        )
    if isinstance(source, (str, os.PathLike)):
        obj = impl.torch_load(Path(source), map_location=map_location, verify=True)
        where = repr(str(source))
    else:
        obj, where = source, "the given object"
    state = impl.find_state_dict(obj, where)
    return _load_into(model, state, strict=strict, where=where)


def _load_into(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool, where: str
) -> LoadResult:
    target = model.state_dict()
    pairs = impl.match_keys(state.keys(), target.keys())
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
    mapped._metadata = impl.map_metadata(  # type: ignore[attr-defined]
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
    final = impl.as_path(path, "path")
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
    impl.check_components(model, optimizer, scheduler, scaler)
    step = impl.check_step(step)
    payload = impl.payload(
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        epoch=impl.check_epoch(epoch),
        metrics=impl.encode_metrics(metrics),
        extra=extra,
        ranks=[impl.local_state(sampler_state)],
    )
    impl.write_file(final, payload)
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
    impl.check_components(model, optimizer, scheduler, scaler)
    file = impl.as_path(path, "path")
    if file.is_dir():
        raise InvalidArgumentError(
            f"path {str(file)!r} is a directory",
            fix="for a sharded (.dcp) checkpoint use CheckpointManager(parent).resume(...)",
        )
    payload = impl.read_payload(file, sha256=None, size=None, map_location=map_location)
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
        self.directory = impl.as_path(directory, "directory")
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
        self._index = impl.Index(self.directory, CheckpointWarning)

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
        return [self._record(e) for e in self._index.read()]

    def latest(self) -> CheckpointRecord | None:
        """The checkpoint with the highest step, or None when there is none.

        Example:
            >>> import tempfile
            >>> CheckpointManager(tempfile.mkdtemp()).latest() is None
            True
        """
        entries = self._index.read()
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
        entries = [e for e in self._index.read() if self.monitor in e["metrics"]]
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
        step = impl.check_step(step)
        impl.check_components(model, optimizer, scheduler, scaler)
        metrics_f = impl.encode_metrics(metrics)
        if self.keep_best > 0 and self.monitor not in metrics_f:
            raise InvalidArgumentError(
                f"save(step={step}) got metrics {sorted(metrics_f)} without the monitored "
                f"metric {self.monitor!r} (keep_best={self.keep_best})",
                fix=f"pass metrics={{{self.monitor!r}: value, ...}} on every save",
            )
        epoch = impl.check_epoch(epoch)
        rank, world = impl.dist_rank_world()
        local = impl.local_state(sampler_state)
        ranks = impl.gather_to_rank0(local, rank, world)
        sharded = impl.is_sharded(model)
        stem = f"ckpt-{step:010d}"
        final = self.directory / (stem + (".dcp" if sharded else ".pt"))
        error: BaseException | None = None
        if sharded:
            error = self._save_sharded(
                final,
                step,
                model,
                optimizer,
                scheduler,
                scaler,
                epoch,
                metrics_f,
                extra,
                ranks,
                rank,
                world,
            )
        elif rank == 0:
            try:
                payload = impl.payload(
                    step=step,
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    scaler=scaler,
                    epoch=epoch,
                    metrics=metrics_f,
                    extra=extra,
                    ranks=ranks,
                )
                self._index.unlist(final.name)
                sha, size = impl.write_file(final, payload)
                self._commit(final, step, epoch, metrics_f, sha=sha, size=size, files=None)
            except BaseException as err:
                error = err
        impl.raise_if_rank0_failed(error, rank, world, final)
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

        tmp = self.directory / f"{impl.TEMP_PREFIX}{final.name}"
        if rank == 0:
            impl.rmtree(tmp)
            tmp.mkdir()
        if world > 1:
            dist.barrier()
        # Every rank takes part in DCP's collectives; only rank 0 finalises afterwards.
        dcp.save(impl.dcp_state(model, optimizer), checkpoint_id=str(tmp))
        if rank != 0:
            return None
        try:
            payload = impl.payload(
                step=step,
                model=None,
                optimizer=None,
                scheduler=scheduler,
                scaler=scaler,
                epoch=epoch,
                metrics=metrics,
                extra=extra,
                ranks=ranks,
            )
            payload["sharded"] = True
            impl.write_file(tmp / impl.DCP_META, payload, sidecar=False)
            files = impl.hash_files(tmp)
            self._index.unlist(final.name)
            impl.rmtree(final)
            os.replace(tmp, final)
            impl.fsync_directory(self.directory)
            self._commit(final, step, epoch, metrics, sha=None, size=None, files=files)
        except BaseException as err:
            return err
        return None

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
        entries = self._index.read(pending=final.name)
        entries = [e for e in entries if e["file"] != final.name] + [entry]
        entries.sort(key=lambda e: e["step"])
        kept = self._retain(entries)
        self._index.write(kept)
        # Deleting only after the index stops naming a file keeps "index => file is complete".
        self._index.cleanup({e["file"] for e in kept})

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
        return (impl.metric_sort_key(value, self.mode), -entry["step"])

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
        :class:`CheckpointError` lists why each was rejected. A mismatch between the checkpoint
        and the objects passed (other keys, shapes, parameter groups) is an error, not a
        reason to fall back: an older checkpoint would not fit either.

        The model is loaded as by :func:`load_state_dict` (``strict`` means the same), tensors
        are read to ``map_location`` first, and ``restore_rng=False`` leaves the RNGs as they
        are. A sharded (``.dcp``) checkpoint loads into a sharded model on the same number of
        ranks or, resharded by DCP, into an unsharded model in one process.

        Example:
            >>> import tempfile, torch
            >>> m = CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> state = m.resume(model=model)
            >>> start = 0 if state is None else state.step + 1
            >>> start
            0
        """
        impl.check_components(model, optimizer, scheduler, scaler)
        sharded_model = impl.is_sharded(model)
        entries = self._index.read()
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
                impl.load_sharded(path, model, optimizer)
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
            return impl.read_payload(
                path, sha256=entry["sha256"], size=entry["size"], map_location=map_location
            )
        impl.verify_sharded(path, files)
        return impl.read_payload(
            path / impl.DCP_META, sha256=None, size=None, map_location=map_location
        )


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
            raise InvalidArgumentError(f"seed must be an int, got {seed!r}", fix="pass e.g. seed=0")
        d_rank, d_world = impl.dist_rank_world()
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
    rank, _ = impl.dist_rank_world()
    ranks = meta["ranks"]
    sampler_state = None
    if rank < len(ranks):
        tensors = payload["rank_tensors"][rank]
        if restore_rng:
            impl.restore_rng(ranks[rank]["rng"], tensors, CheckpointWarning)
        sampler_state = impl.decode_tree(ranks[rank]["sampler_state"], tensors)
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
        extra=impl.decode_tree(meta["extra"], payload["tensors"]),
        sampler_state=sampler_state,
        path=path,
    )
