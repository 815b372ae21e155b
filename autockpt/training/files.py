"""Crash-safe file writes and checksums: the only place training checkpoints touch the disk.

A file is written to a ``.tmp-*`` name in its own directory, flushed, fsynced and renamed over
the final name; its sha256 is computed on the way to disk and kept in a ``sha256sum``-format
sidecar. Reading verifies the checksum first and loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from autockpt.errors import CheckpointError

__all__ = [
    "SIDECAR_SUFFIX",
    "TEMP_PREFIX",
    "atomic_write",
    "atomic_write_text",
    "file_sha256",
    "fsync_directory",
    "hash_files",
    "read_sidecar",
    "rmtree",
    "sidecar_path",
    "temp_path_for",
    "torch_load",
    "verify_file",
]

TEMP_PREFIX = ".tmp-"
"""Every temporary file or directory the checkpoint code creates starts with this, so that a
later save can recognise and remove the leftovers of a writer that was killed."""

SIDECAR_SUFFIX = ".sha256"
"""A checkpoint file's checksum lives next to it under its name plus this suffix."""

_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# Crash-safe writes
# --------------------------------------------------------------------------------------------


class _HashingWriter:
    """A write-only file object that hashes and counts every byte on its way to disk, so that
    the checksum of a checkpoint costs no second pass over the file."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()


def fsync_directory(directory: Path) -> None:
    """Persist the directory entry changes (renames, deletions) made inside ``directory``."""
    # Windows cannot open a directory; there os.replace is already as durable as it gets.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(final: Path) -> Path:
    """A temp name next to ``final``: same directory, so :func:`os.replace` is a rename."""
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}")


def atomic_write(
    final: Path, write: Callable[[IO[bytes]], None], *, sync_dir: bool = True
) -> tuple[str, int]:
    """Write ``final`` so that it is either absent, its old version, or complete; never torn.

    ``write`` receives a binary file object. Returns the sha256 hex digest and size in bytes
    of what was written. The directory is fsynced after the rename unless ``sync_dir=False``
    (the caller then fsyncs it after a later rename in the same directory).
    """
    tmp = temp_path_for(final)
    try:
        with open(tmp, "wb") as raw:
            hashing = _HashingWriter(raw)
            write(hashing)  # type: ignore[arg-type]
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except BaseException:
        # A KeyboardInterrupt mid-write must not leave a temp file behind either.
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_directory(final.parent)
    return hashing.sha256.hexdigest(), hashing.size


def atomic_write_text(final: Path, text: str) -> None:
    """:func:`atomic_write` for a small UTF-8 text file."""
    data = text.encode("utf-8")
    atomic_write(final, lambda f: f.write(data))  # type: ignore[arg-type, return-value]


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(path: Path) -> Path:
    """Where the ``sha256sum``-format checksum of checkpoint file ``path`` lives."""
    return path.with_name(path.name + SIDECAR_SUFFIX)


def read_sidecar(path: Path) -> str | None:
    """The digest recorded next to ``path``, or None when there is no sidecar."""
    side = sidecar_path(path)
    try:
        text = side.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    digest = text.split(maxsplit=1)[0] if text.strip() else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointError(
            f"checksum file {str(side)!r} does not hold a sha256 digest (read {text[:80]!r})",
            fix=f"delete {str(side)!r} to load {str(path)!r} without verification, "
            "or restore the file from where the checkpoint came from",
        )
    return digest


def verify_file(path: Path, *, sha256: str | None, size: int | None) -> None:
    """Raise :class:`CheckpointError` unless ``path`` exists with the recorded size and hash."""
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is missing",
            fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
        ) from None
    if size is not None and actual_size != size:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is {actual_size} bytes but {size} bytes were "
            "written: it is truncated or was modified",
            fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
        )
    if sha256 is not None:
        actual = file_sha256(path)
        if actual != sha256:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is corrupted: sha256 {actual} does not match "
                f"the recorded {sha256}",
                fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
            )


# --------------------------------------------------------------------------------------------
# Directories and reading
# --------------------------------------------------------------------------------------------


def hash_files(directory: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under ``directory``, by relative POSIX path."""
    return {
        f.relative_to(directory).as_posix(): {"sha256": file_sha256(f), "size": f.stat().st_size}
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


def rmtree(path: Path) -> None:
    """Remove a file or a directory tree; what is already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def torch_load(path: Path, *, map_location: Any, verify: bool) -> Any:
    """``torch.load(path, weights_only=True)`` with every failure as a
    :class:`CheckpointError`; with ``verify``, checked against its sidecar first."""
    if verify and path.is_file():
        verify_file(path, sha256=read_sidecar(path), size=None)
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
