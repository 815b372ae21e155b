"""Private implementation of :mod:`autockpt.checkpoints`: crash-safe file writes, checksums,
the checkpoint payload, the JSON encoding of user state, RNG capture/restore, state_dict key
matching, the manager's index, and the distributed (DDP/DCP) plumbing.

Nothing here is public API; :mod:`autockpt.checkpoints` documents the behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import torch
from torch import nn

from autockpt.errors import CheckpointError, InvalidArgumentError

__all__: list[str] = []

FORMAT_VERSION = 1
FORMAT_KEY = "autockpt_checkpoint"
INDEX_NAME = "index.json"
INDEX_FORMAT = "autockpt-checkpoint-index"
NAME_RE = re.compile(r"^ckpt-(\d{10,})\.(pt|dcp)$")
DCP_META = "meta.pt"

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


class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: schedulers, grad scalers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


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
# (non-str dict keys, sets, numpy arrays, arbitrary objects) is rejected at save time, naming
# where it sits, instead of silently changing type on resume.


def encode_tree(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``value`` as JSON-able data, with tensors moved into ``tensors`` (see the NOTE)."""
    if value is None or isinstance(value, (bool, int, float, str)):
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
    return {k: ".".join(parts[depth:]) for k, parts in zip(keys, split, strict=True)}


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
        out = OrderedDict(zip(names, state.values(), strict=True))
        meta = getattr(state, "_metadata", None)
        if meta is not None:
            meta = OrderedDict((normalize_key(k), v) for k, v in meta.items())
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


# --------------------------------------------------------------------------------------------
# Validation, distributed helpers, the payload, reading and DCP
# --------------------------------------------------------------------------------------------

WEIGHTS_ONLY_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    torch.dtype,
    torch.device,
    torch.Size,
)


def as_path(value: Any, name: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"{name} must be a str or os.PathLike, got {type(value).__name__}",
            fix=f"pass {name} as a path string",
        )
    return Path(value)


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(
            f"step must be an int >= 0, got {step!r}",
            fix="pass the global step counter, e.g. save(step, ...)",
        )
    return int(step)


def check_epoch(epoch: Any) -> int | None:
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise InvalidArgumentError(
            f"epoch must be an int or None, got {epoch!r}", fix="pass the epoch number"
        )
    return epoch


def check_components(model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
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


def dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_sharded(model: nn.Module) -> bool:
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


def local_state(sampler_state: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This rank's RNG states and sampler state, JSON tree plus its tensors."""
    tensors: list[torch.Tensor] = []
    tree = {
        "rng": capture_rng(tensors),
        "sampler_state": encode_tree(sampler_state, tensors, "sampler_state"),
    }
    return tree, tensors


def gather_to_rank0(
    local: tuple[dict[str, Any], list[torch.Tensor]], rank: int, world: int
) -> list[tuple[dict[str, Any], list[torch.Tensor]]] | None:
    if world == 1:
        return [local]
    import torch.distributed as dist

    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(local, out, dst=0)
    return out


def raise_if_rank0_failed(error: BaseException | None, rank: int, world: int, path: Path) -> None:
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


def check_loadable(obj: Any, where: str) -> None:
    """Refuse at save time what ``torch.load(weights_only=True)`` would refuse at resume."""
    if isinstance(obj, WEIGHTS_ONLY_LEAVES):
        return
    if isinstance(obj, (dict, OrderedDict)):
        for k, v in obj.items():
            check_loadable(k, f"{where} key")
            check_loadable(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            check_loadable(v, f"{where}[{i}]")
        return
    raise InvalidArgumentError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) refuses, so the checkpoint could not be resumed",
        fix="keep only tensors, numbers, strings and lists/dicts of them in that state_dict",
    )


def payload(
    *,
    step: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    epoch: int | None,
    metrics: dict[str, float],
    extra: Any,
    ranks: list[tuple[dict[str, Any], list[torch.Tensor]]] | None,
) -> dict[str, Any]:
    assert ranks is not None
    tensors: list[torch.Tensor] = []
    meta = {
        "step": step,
        "epoch": epoch,
        "metrics": metrics,
        "time": time.time(),
        "extra": encode_tree(extra, tensors, "extra"),
        "ranks": [tree for tree, _ in ranks],
        "torch_version": torch.__version__,
    }
    payload: dict[str, Any] = {
        FORMAT_KEY: FORMAT_VERSION,
        "meta": dumps(meta),
        "tensors": tensors,
        "rank_tensors": [ts for _, ts in ranks],
    }
    if model is not None:
        payload["model"] = canonical_state_dict(model.state_dict())
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            state = obj.state_dict()
            check_loadable(state, f"{name}.state_dict()")
            payload[name] = state
    return payload


def write_file(final: Path, payload: dict[str, Any], *, sidecar: bool = True) -> tuple[str, int]:
    """Atomic torch.save plus, optionally, the ``.sha256`` sidecar (written second, so a
    sidecar always describes a complete file)."""
    try:
        # With a sidecar, one directory fsync after its rename makes both renames durable
        # before the caller writes the index that names them.
        sha, size = atomic_write(final, lambda f: torch.save(payload, f), sync_dir=not sidecar)
        if sidecar:
            atomic_write_text(sidecar_path(final), f"{sha}  {final.name}\n")
    except OSError as err:
        raise CheckpointError(
            f"could not write checkpoint {str(final)!r}: {err}",
            fix="check free disk space and write permission on that directory",
        ) from err
    return sha, size


def torch_load(path: Path, *, map_location: Any, verify: bool) -> Any:
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


def read_payload(
    path: Path, *, sha256: str | None, size: int | None, map_location: Any
) -> dict[str, Any]:
    if sha256 is not None or size is not None:
        verify_file(path, sha256=sha256, size=size)
        payload = torch_load(path, map_location=map_location, verify=False)
    else:
        payload = torch_load(path, map_location=map_location, verify=True)
    if not isinstance(payload, dict) or FORMAT_KEY not in payload:
        raise CheckpointError(
            f"{str(path)!r} is not an autockpt checkpoint (no {FORMAT_KEY!r} entry)",
            fix="to load only the weights of another file use load_state_dict(model, path)",
        )
    if payload[FORMAT_KEY] > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {payload[FORMAT_KEY]}, newer than this "
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


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = dcp_state(model, optimizer)
    try:
        with warnings.catch_warnings():
            # Loading a sharded checkpoint into one unsharded process is intended here.
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single"
            )
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


def rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def find_state_dict(obj: Any, where: str) -> Mapping[str, Any]:
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


def map_metadata(
    source: Mapping[str, Any] | None, target: Mapping[str, Any] | None
) -> OrderedDict[str, Any]:
    """Module version metadata under the target's module names, so each module's
    ``_load_from_state_dict`` sees the version it was saved with."""
    out: OrderedDict[str, Any] = OrderedDict(target or {})
    if source:
        for tkey, skey in match_keys(source.keys(), out.keys()).items():
            out[tkey] = source[skey]
    return out


# --------------------------------------------------------------------------------------------
# The manager's index
# --------------------------------------------------------------------------------------------


class Index:
    """``index.json`` of a :class:`~autockpt.checkpoints.CheckpointManager` directory: one
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


def hash_files(directory: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under ``directory``, by relative POSIX path."""
    return {
        f.relative_to(directory).as_posix(): {"sha256": file_sha256(f), "size": f.stat().st_size}
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


def verify_sharded(path: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Check every file of a sharded checkpoint; all ranks get rank 0's verdict."""
    rank, world = dist_rank_world()
    # One rank reads all shards, instead of every rank reading everything.
    problem: str | None = None
    if rank == 0:
        try:
            for rel, rec in sorted(files.items()):
                verify_file(path / rel, sha256=rec["sha256"], size=rec["size"])
        except CheckpointError as err:
            problem = err.message
    if world > 1:
        box = [problem]
        torch.distributed.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise CheckpointError(
            problem,
            fix="restore it, or let CheckpointManager.resume fall back to an older checkpoint",
        )
