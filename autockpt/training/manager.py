"""The training-checkpoint API: :class:`CheckpointManager`, :func:`save_checkpoint`,
:func:`load_checkpoint` and what they return. The package docstring of
:mod:`autockpt.training` describes the file format and the guarantees."""

from __future__ import annotations

import builtins
import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from autockpt.errors import CheckpointError, InvalidArgumentError
from autockpt.training.distributed import (
    dist_rank_world,
    gather_to_rank0,
    is_sharded,
    load_sharded,
    raise_if_rank0_failed,
    save_shards,
    verify_sharded,
)
from autockpt.training.files import TEMP_PREFIX, fsync_directory, hash_files, rmtree
from autockpt.training.index import Index
from autockpt.training.payload import (
    DCP_META,
    Stateful,
    build_payload,
    decode_tree,
    encode_metrics,
    local_state,
    read_payload,
    write_file,
)
from autockpt.training.rng import restore_rng_state
from autockpt.training.state_dict import load_into

__all__ = [
    "CheckpointFallbackWarning",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWarning",
    "TrainingState",
    "load_checkpoint",
    "save_checkpoint",
]

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


# --------------------------------------------------------------------------------------------
# Argument checks
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


def _check_components(model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
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


def _metric_sort_key(value: float | None, mode: str) -> float:
    """Smaller is better; NaN and absent metrics rank last."""
    if value is None or math.isnan(value):
        return math.inf
    return value if mode == "min" else -value


# --------------------------------------------------------------------------------------------
# Single-file save / load
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    step: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
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
    payload = build_payload(
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        epoch=_check_epoch(epoch),
        metrics=encode_metrics(metrics),
        extra=extra,
        ranks=[local_state(sampler_state)],
    )
    write_file(final, payload)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
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
    payload = read_payload(file, sha256=None, size=None, map_location=map_location)
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
        self._index = Index(self.directory, CheckpointWarning)

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
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
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
        metrics_f = encode_metrics(metrics)
        if self.keep_best > 0 and self.monitor not in metrics_f:
            raise InvalidArgumentError(
                f"save(step={step}) got metrics {sorted(metrics_f)} without the monitored "
                f"metric {self.monitor!r} (keep_best={self.keep_best})",
                fix=f"pass metrics={{{self.monitor!r}: value, ...}} on every save",
            )
        epoch = _check_epoch(epoch)
        rank, world = dist_rank_world()
        local = local_state(sampler_state)
        ranks = gather_to_rank0(local, rank, world)
        sharded = is_sharded(model)
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
                payload = build_payload(
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
                sha, size = write_file(final, payload)
                self._commit(final, step, epoch, metrics_f, sha=sha, size=size, files=None)
            except BaseException as err:
                error = err
        raise_if_rank0_failed(error, rank, world, final)
        return final

    def _save_sharded(
        self,
        final: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Stateful | None,
        scaler: Stateful | None,
        epoch: int | None,
        metrics: dict[str, float],
        extra: Any,
        ranks: builtins.list[tuple[Any, builtins.list[torch.Tensor]]] | None,
        rank: int,
        world: int,
    ) -> BaseException | None:
        tmp = self.directory / f"{TEMP_PREFIX}{final.name}"
        # Every rank takes part in DCP's collectives; only rank 0 finalises afterwards.
        save_shards(tmp, model, optimizer, rank, world)
        if rank != 0:
            return None
        try:
            payload = build_payload(
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
            write_file(tmp / DCP_META, payload, sidecar=False)
            files = hash_files(tmp)
            self._index.unlist(final.name)
            rmtree(final)
            os.replace(tmp, final)
            fsync_directory(self.directory)
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
        return (_metric_sort_key(value, self.mode), -entry["step"])

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
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
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
        _check_components(model, optimizer, scheduler, scaler)
        sharded_model = is_sharded(model)
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
                load_sharded(path, model, optimizer)
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
            return read_payload(
                path, sha256=entry["sha256"], size=entry["size"], map_location=map_location
            )
        verify_sharded(path, files)
        return read_payload(
            path / DCP_META, sha256=None, size=None, map_location=map_location
        )


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _apply(
    payload: dict[str, Any],
    *,
    path: Path,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    strict: bool,
    restore_rng: bool,
) -> TrainingState:
    meta = payload["meta"]
    if model is not None:
        if "model" not in payload:
            raise CheckpointError(f"{str(path)!r} holds no model state", fix="check the path")
        load_into(model, payload["model"], strict=strict, where=repr(str(path)))
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
    rank, _ = dist_rank_world()
    ranks = meta["ranks"]
    sampler_state = None
    if rank < len(ranks):
        tensors = payload["rank_tensors"][rank]
        if restore_rng:
            restore_rng_state(ranks[rank]["rng"], tensors, CheckpointWarning)
        sampler_state = decode_tree(ranks[rank]["sampler_state"], tensors)
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
        extra=decode_tree(meta["extra"], payload["tensors"]),
        sampler_state=sampler_state,
        path=path,
    )
