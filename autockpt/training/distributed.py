"""Training checkpoints under ``torch.distributed``: which rank writes, gathering every rank's
RNG and sampler state, sharded (DCP) saving and loading, and verifying a sharded checkpoint
once for all ranks."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autockpt.errors import CheckpointError
from autockpt.training.files import rmtree, verify_file

__all__ = [
    "dcp_state",
    "dist_rank_world",
    "gather_to_rank0",
    "is_sharded",
    "load_sharded",
    "raise_if_rank0_failed",
    "save_shards",
    "verify_sharded",
]


def dist_rank_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` outside ``torch.distributed``."""
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


def gather_to_rank0(
    local: tuple[dict[str, Any], list[torch.Tensor]], rank: int, world: int
) -> list[tuple[dict[str, Any], list[torch.Tensor]]] | None:
    """Every rank's :func:`~autockpt.training.payload.local_state` on rank 0 (None on the
    others)."""
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


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's (and optimizer's) state as DCP saves and loads it, sharded like the model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def save_shards(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
    world: int,
) -> None:
    """Every rank writes its shard of the model and optimizer state into the fresh
    ``directory`` with DCP; rank 0 creates it first."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if rank == 0:
        rmtree(directory)
        directory.mkdir()
    if world > 1:
        dist.barrier()
    dcp.save(dcp_state(model, optimizer), checkpoint_id=str(directory))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a ``.dcp`` checkpoint into ``model`` (and ``optimizer``), resharded by DCP."""
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
