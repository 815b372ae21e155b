"""The manager's ``index.json``: which checkpoints of a directory are complete, with their
checksums, and its recovery from the checkpoint files themselves when it is lost."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from autockpt.errors import CheckpointError
from autockpt.training.files import (
    SIDECAR_SUFFIX,
    TEMP_PREFIX,
    atomic_write_text,
    hash_files,
    read_sidecar,
    rmtree,
    torch_load,
    verify_file,
)
from autockpt.training.payload import DCP_META, FORMAT_VERSION

__all__ = ["INDEX_FORMAT", "INDEX_NAME", "NAME_RE", "Index"]

INDEX_NAME = "index.json"
"""The index's file name inside a manager's directory."""
INDEX_FORMAT = "autockpt-checkpoint-index"
"""The index document's ``"format"`` entry."""
NAME_RE = re.compile(r"^ckpt-(\d{10,})\.(pt|dcp)$")
"""The names of the checkpoints a manager writes: the step, zero-padded, and the kind."""


class Index:
    """``index.json`` of a :class:`~autockpt.training.CheckpointManager` directory: one
    entry per complete checkpoint (step, file, time, epoch, metrics, and sha256+size, or per
    file of a sharded checkpoint), always replaced atomically."""

    def __init__(self, directory: Path, warning: type[Warning]) -> None:
        self.directory = directory
        self.path = directory / INDEX_NAME
        self._warning = warning

    def write(self, entries: list[dict[str, Any]]) -> None:
        doc = {"format": INDEX_FORMAT, "version": FORMAT_VERSION, "checkpoints": entries}
        atomic_write_text(self.path, json.dumps(doc, indent=1, sort_keys=True))

    def read(self, *, pending: str | None = None) -> list[dict[str, Any]]:
        """The entries, oldest step first. ``pending`` names a checkpoint being saved right
        now, which a rebuild must not count as found."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return self._rebuild("index.json is missing", pending)
        try:
            doc = json.loads(text)
            if doc.get("format") != INDEX_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}")
            if doc.get("version", 0) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{str(self.path)!r} has index version {doc['version']}, newer than this "
                    f"autockpt understands ({FORMAT_VERSION})",
                    fix="upgrade autockpt",
                )
            entries = doc["checkpoints"]
            for e in entries:
                e["step"], e["file"], e["metrics"]  # noqa: B018 - schema check
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return self._rebuild(f"index.json is unreadable ({err})", pending)
        return sorted(entries, key=lambda e: e["step"])

    def unlist(self, name: str) -> None:
        """Before overwriting a step that exists, unlist it, so the index never names a file
        that is being rewritten."""
        entries = self.read()
        kept = [e for e in entries if e["file"] != name]
        if len(kept) != len(entries):
            self.write(kept)

    def cleanup(self, keep: set[str]) -> None:
        """Delete temp files and checkpoint files not in ``keep``.

        No directory fsync: a deletion lost to a power cut only brings back a file the index
        no longer names, which the next save removes again.
        """
        for child in self.directory.iterdir():
            name = child.name
            base = name[: -len(SIDECAR_SUFFIX)] if name.endswith(SIDECAR_SUFFIX) else name
            if name.startswith(TEMP_PREFIX) or (NAME_RE.match(base) and base not in keep):
                rmtree(child)

    def _rebuild(self, why: str, pending: str | None) -> list[dict[str, Any]]:
        """Recover the list from the checkpoint files themselves (each one's own metadata and
        checksum sidecar) when ``index.json`` was deleted or damaged outside autockpt."""
        found = sorted(
            p for p in self.directory.iterdir() if NAME_RE.match(p.name) and p.name != pending
        )
        if not found:
            return []
        entries = []
        for p in found:
            try:
                if p.is_dir():
                    meta_file = p / DCP_META
                    integrity: dict[str, Any] = {"files": hash_files(p)}
                else:
                    meta_file = p
                    sha = read_sidecar(p)
                    if sha is None:
                        continue
                    verify_file(p, sha256=sha, size=None)
                    integrity = {"sha256": sha, "size": p.stat().st_size}
                meta = json.loads(torch_load(meta_file, map_location="cpu", verify=False)["meta"])
            except (CheckpointError, OSError, KeyError, ValueError, TypeError):
                continue
            entries.append(
                {
                    "step": meta["step"],
                    "file": p.name,
                    "time": meta.get("time", p.stat().st_mtime),
                    "epoch": meta.get("epoch"),
                    "metrics": meta.get("metrics", {}),
                    **integrity,
                }
            )
        warnings.warn(
            f"{why} in {str(self.directory)!r}; rebuilt the list from {len(entries)} intact "
            "checkpoint file(s) found there",
            self._warning,
            stacklevel=4,
        )
        return sorted(entries, key=lambda e: e["step"])
