"""What a checkpoint file holds: the payload dict, the JSON encoding of user state, and the
checks that keep it loadable with ``torch.load(weights_only=True)``.

The layout is documented in :mod:`autockpt.training`; :func:`payload` builds it,
:func:`write_file` writes it crash-safely and :func:`read_payload` reads and checks it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.errors import CheckpointError, InvalidArgumentError
from autockpt.training.files import (
    atomic_write,
    atomic_write_text,
    sidecar_path,
    torch_load,
    verify_file,
)
from autockpt.training.rng import capture_rng_state
from autockpt.training.state_dict import canonical_state_dict

__all__ = [
    "DCP_META",
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "Stateful",
    "WEIGHTS_ONLY_LEAVES",
    "check_loadable",
    "decode_tree",
    "dumps",
    "encode_metrics",
    "encode_tree",
    "local_state",
    "build_payload",
    "read_payload",
    "write_file",
]

FORMAT_VERSION = 1
"""The checkpoint format this autockpt writes, and the newest it reads."""
FORMAT_KEY = "autockpt_checkpoint"
"""The payload entry that marks an autockpt checkpoint and holds its format version."""
DCP_META = "meta.pt"
"""Inside a sharded ``.dcp`` directory: the payload without model and optimizer state."""

_MARK = "__autockpt__"


class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: schedulers, grad scalers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


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


# --------------------------------------------------------------------------------------------
# The payload
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
"""The leaf types ``torch.load(weights_only=True)`` accepts in a state_dict."""


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


def local_state(sampler_state: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This rank's RNG states and sampler state, JSON tree plus its tensors."""
    tensors: list[torch.Tensor] = []
    tree = {
        "rng": capture_rng_state(tensors),
        "sampler_state": encode_tree(sampler_state, tensors, "sampler_state"),
    }
    return tree, tensors


def build_payload(
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
    """The dict a checkpoint file holds (layout in :mod:`autockpt.training`); ``ranks`` is
    every rank's :func:`local_state`, in rank order."""
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


def read_payload(
    path: Path, *, sha256: str | None, size: int | None, map_location: Any
) -> dict[str, Any]:
    """Read and check a checkpoint file: against ``sha256``/``size`` when the index recorded
    them, else against its sidecar; its metadata comes back decoded from JSON."""
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
