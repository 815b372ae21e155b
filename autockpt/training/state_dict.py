"""Loading a model's weights whatever wrapped the model that saved them: matching state_dict
keys across ``module.``, ``_orig_mod.`` and ``_checkpoint_wrapped_module.`` components, and
:func:`load_state_dict` built on it."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autockpt.errors import CheckpointError, InvalidArgumentError
from autockpt.training.distributed import is_sharded
from autockpt.training.files import torch_load

__all__ = [
    "WRAPPER_COMPONENTS",
    "LoadResult",
    "ShapeMismatch",
    "canonical_state_dict",
    "find_state_dict",
    "load_into",
    "load_state_dict",
    "map_metadata",
    "match_keys",
    "normalize_key",
]

# Key components that wrappers insert into ``state_dict`` keys. ``_fsdp_wrapped_module`` is
# FSDP1's, included because a user may hand us a ``named_parameters()``-style dict from it.
WRAPPER_COMPONENTS = frozenset(
    {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)

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
# Loading a model's weights from anywhere
# --------------------------------------------------------------------------------------------


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
    if is_sharded(model):
        raise CheckpointError(
            f"{type(model).__name__} has sharded (DTensor/FSDP) parameters, which "
            "load_state_dict does not fill",
            fix="resume it with CheckpointManager.resume, which uses torch.distributed.checkpoint",
        )
    if isinstance(source, (str, os.PathLike)):
        obj = torch_load(Path(source), map_location=map_location, verify=True)
        where = repr(str(source))
    else:
        obj, where = source, "the given object"
    state = find_state_dict(obj, where)
    return load_into(model, state, strict=strict, where=where)


def load_into(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool, where: str
) -> LoadResult:
    """:func:`load_state_dict` once the state_dict is found; ``where`` names its source in
    error messages."""
    target = model.state_dict()
    pairs = match_keys(state.keys(), target.keys())
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
    mapped._metadata = map_metadata(  # type: ignore[attr-defined]
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
