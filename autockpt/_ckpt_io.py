"""Private helpers of :mod:`autockpt.checkpoints`: crash-safe file writes, checksums, the
JSON encoding of user state, RNG capture/restore and state-dict key matching.

Nothing here is public API; :mod:`autockpt.checkpoints` re-raises and documents everything.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from autockpt.errors import CheckpointError, InvalidArgumentError

__all__: list[str] = []

TEMP_PREFIX = ".tmp-"
"""Every temporary file or directory the checkpoint code creates starts with this, so that a
later save can recognise and remove the leftovers of a writer that was killed."""

SIDECAR_SUFFIX = ".sha256"

_HASH_CHUNK = 1 << 20

# Key components that wrappers insert into ``state_dict`` keys. ``_fsdp_wrapped_module`` is
# FSDP1's, included because a user may hand us a ``named_parameters()``-style dict from it.
WRAPPER_COMPONENTS = frozenset(
    {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)

_MARK = "__autockpt__"


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
# JSON encoding of user state (metrics, extra, sampler_state)
# --------------------------------------------------------------------------------------------

# NOTE [ How user state is split into JSON and tensors ]
# ``extra`` and ``sampler_state`` may hold tensors (a torch.Generator state, a sampler's
# permutation) as well as plain values. Tensors go into the torch file, loaded with
# weights_only=True; everything else goes into one JSON string. A tensor is replaced in the JSON
# by {"__autockpt__": "tensor", "index": i}; a tuple by {"__autockpt__": "tuple", "items": [..]}
# so that it comes back as a tuple, not a list. Anything that would not round-trip exactly
# (non-str dict keys, numpy scalars, arbitrary objects) is rejected at save time, naming where it
# sits, instead of silently changing type on resume.


def encode_tree(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``value`` as JSON-able data, with tensors moved into ``tensors`` (see the NOTE)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {_MARK: "tensor", "index": len(tensors) - 1}
    if isinstance(value, tuple):
        return {
            _MARK: "tuple",
            "items": [encode_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)],
        }
    if isinstance(value, list):
        return [encode_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(
                    f"{where} has the key {key!r} of type {type(key).__name__}; "
                    "checkpoint state is stored as JSON, whose keys are strings",
                    fix=f"use str keys in {where}, e.g. {{{str(key)!r}: ...}}",
                )
            if key == _MARK:
                raise InvalidArgumentError(
                    f"{where} uses the reserved key {_MARK!r}",
                    fix="rename that key",
                )
            out[key] = encode_tree(item, tensors, f"{where}[{key!r}]")
        return out
    raise InvalidArgumentError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__} ({value!r:.80}), "
        "which a checkpoint cannot store exactly: only None, bool, int, float, str, list, tuple, "
        "dict with str keys and torch.Tensor are allowed",
        fix=f"convert it first (numpy: .tolist() or torch.from_numpy(...); objects: their "
        f"state as a dict) before passing it in {where.split('[')[0]}",
    )


def decode_tree(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Invert :func:`encode_tree`."""
    if isinstance(value, list):
        return [decode_tree(v, tensors) for v in value]
    if isinstance(value, dict):
        mark = value.get(_MARK)
        if mark == "tensor":
            return tensors[value["index"]]
        if mark == "tuple":
            return tuple(decode_tree(v, tensors) for v in value["items"])
        return {k: decode_tree(v, tensors) for k, v in value.items()}
    return value


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """Validate ``metrics`` and convert every value to a Python float."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"metrics must be a dict of name to number, got {type(metrics).__name__}",
            fix='pass e.g. metrics={"val_loss": 0.31}',
        )
    out: dict[str, float] = {}
    for name, val in metrics.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"metrics has the key {name!r} of type {type(name).__name__}",
                fix="use str metric names",
            )
        if isinstance(val, torch.Tensor) and val.numel() == 1:
            val = val.item()
        elif hasattr(val, "item") and callable(val.item) and not isinstance(val, (list, dict)):
            val = val.item()  # numpy scalars
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise InvalidArgumentError(
                f"metrics[{name!r}] is {val!r:.60} ({type(val).__name__}), not a number",
                fix=f"pass a float for metrics[{name!r}], e.g. loss.item()",
            )
        out[name] = float(val)
    return out


def dumps(obj: Any) -> str:
    """Deterministic JSON (sorted keys) that still round-trips NaN and infinities."""
    return json.dumps(obj, sort_keys=True, allow_nan=True, separators=(",", ":"))


def metric_sort_key(value: float | None, mode: str) -> float:
    """Smaller is better; NaN and absent metrics rank last."""
    if value is None or math.isnan(value):
        return math.inf
    return value if mode == "min" else -value


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """This process's RNG states as JSON-able data, torch states moved into ``tensors``."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [str(name), keys.tolist(), int(pos), int(has_gauss), float(cached)]
    tensors.append(torch.get_rng_state())
    state["torch_cpu"] = len(tensors) - 1
    if torch.cuda.is_available():
        cuda_states = torch.cuda.get_rng_state_all()
        state["cuda"] = list(range(len(tensors), len(tensors) + len(cuda_states)))
        tensors.extend(cuda_states)
    return state


def restore_rng(state: Mapping[str, Any], tensors: list[torch.Tensor], warn: type[Warning]) -> None:
    """Set this process's RNGs to a state made by :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np = _numpy()
    if "numpy" in state:
        if np is None:
            warnings.warn(
                "the checkpoint holds a NumPy RNG state but NumPy is not installed here; "
                "np.random draws will differ from the uninterrupted run",
                warn,
                stacklevel=4,
            )
        else:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors[state["torch_cpu"]].to("cpu", torch.uint8))
    cuda_ids = state.get("cuda", [])
    if cuda_ids and torch.cuda.is_available():
        if len(cuda_ids) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint holds RNG states of {len(cuda_ids)} CUDA devices but this "
                f"process sees {torch.cuda.device_count()}; CUDA RNG states were not restored",
                warn,
                stacklevel=4,
            )
        else:
            torch.cuda.set_rng_state_all([tensors[i].to("cpu", torch.uint8) for i in cuda_ids])


# --------------------------------------------------------------------------------------------
# state_dict key matching
# --------------------------------------------------------------------------------------------

# NOTE [ Matching state_dict keys across wrappers ]
# DataParallel/DDP add "module.", torch.compile adds "_orig_mod.", checkpoint_wrapper adds
# "_checkpoint_wrapped_module." (its own state_dict hook strips it again, but other tools do
# not), and they nest: a compiled DDP model saves "module._orig_mod.layer.weight", a model whose
# blocks were wrapped saves "blocks.0._checkpoint_wrapped_module.fc.weight". We match in two
# passes so that a model which really has a child called "module" is not confused:
#   1. strip the wrapper components that *all* keys of one side share as a leading prefix, then
#      match names exactly (this is the DDP/compile case and never guesses);
#   2. for keys still unmatched, drop wrapper components wherever they occur and match the rest
#      when exactly one key on each side has that normalised name.
# Ambiguous leftovers stay unmatched and are reported as missing/unexpected, never guessed.


def normalize_key(key: str) -> str:
    """``key`` without any wrapper component (see the NOTE above)."""
    return ".".join(part for part in key.split(".") if part not in WRAPPER_COMPONENTS)


def _strip_common_leading(keys: list[str]) -> dict[str, str]:
    """Map each key to itself minus the wrapper components every key starts with."""
    if not keys:
        return {}
    split = [k.split(".") for k in keys]
    depth = 0
    while True:
        # A key must keep at least one component: a bare "module" parameter stays "module".
        if any(len(parts) <= depth + 1 for parts in split):
            break
        first = split[0][depth]
        if first not in WRAPPER_COMPONENTS or any(parts[depth] != first for parts in split):
            break
        depth += 1
    return {k: ".".join(parts[depth:]) for k, parts in zip(keys, split)}


def match_keys(source: Iterable[str], target: Iterable[str]) -> dict[str, str]:
    """Pair target keys with source keys; returns ``{target_key: source_key}``."""
    src, tgt = list(source), list(target)
    pairs: dict[str, str] = {}
    src_lead, tgt_lead = _strip_common_leading(src), _strip_common_leading(tgt)
    by_lead: dict[str, list[str]] = {}
    for s in src:
        by_lead.setdefault(src_lead[s], []).append(s)
    for t in tgt:
        cands = by_lead.get(tgt_lead[t], [])
        if len(cands) == 1:
            pairs[t] = cands[0]
    used = set(pairs.values())
    by_norm_src: dict[str, list[str]] = {}
    for s in src:
        if s not in used:
            by_norm_src.setdefault(normalize_key(s), []).append(s)
    by_norm_tgt: dict[str, list[str]] = {}
    for t in tgt:
        if t not in pairs:
            by_norm_tgt.setdefault(normalize_key(t), []).append(t)
    for norm, ts in by_norm_tgt.items():
        ss = by_norm_src.get(norm, [])
        if len(ts) == 1 and len(ss) == 1:
            pairs[ts[0]] = ss[0]
    return pairs


def canonical_state_dict(state: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """``state`` with wrapper components removed from every key, so a saved file loads into the
    bare model with plain ``load_state_dict``. Keys stay as they are if removing them would
    make two keys equal."""
    names = [normalize_key(k) for k in state]
    if len(set(names)) != len(names) or any(not n for n in names):
        out = OrderedDict(state.items())
        meta = getattr(state, "_metadata", None)
    else:
        out = OrderedDict(zip(names, state.values()))
        meta = getattr(state, "_metadata", None)
        if meta is not None:
            meta = OrderedDict((normalize_key(k), v) for k, v in meta.items())
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out
