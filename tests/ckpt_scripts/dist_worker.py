"""One rank of the distributed checkpoint tests (gloo on CPU, 127.0.0.1 only).

Usage: python dist_worker.py RANK WORLD PORT DIRECTORY
Runs three scenarios in turn and writes DIRECTORY/result-RANK.pt for the test to check:
  ddp    DDP model; rank 0 alone writes; every rank resumes its own RNG and sampler state
  fsdp2  fully_shard model; each rank writes its shard through torch.distributed.checkpoint
  fsdp1  FullyShardedDataParallel model, same checks
Each scenario trains, saves, trains on ("straight"), then resumes fresh objects and trains the
same steps again ("resumed"); the test compares the two bitwise.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autockpt.training import CheckpointManager

warnings.filterwarnings("ignore")  # torch's FSDP1/ShardedTensor deprecation chatter

RANK, WORLD, PORT, DIRECTORY = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    Path(sys.argv[4]),
)


def batch(step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on each rank, a pure function of (rank, step) so a resume replays it."""
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(4, width, generator=g), torch.randn(4, 2, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, width: int) -> None:
    for step in steps:
        x, y = batch(step, width)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def scenario_ddp(out: dict[str, Any]) -> None:
    def build(seed: int) -> DDP:
        torch.manual_seed(seed)
        return DDP(nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.4), nn.Linear(12, 2)))

    # 1. Only rank 0 writes: give each rank a directory of its own and look inside.
    own = DIRECTORY / "ddp-own" / f"rank{RANK}"
    model = build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + RANK)  # dropout masks differ per rank, so per-rank RNG matters
    train(model, opt, range(2), 6)
    returned = CheckpointManager(own).save(1, model=model, optimizer=opt)
    out["ddp_own_files"] = sorted(p.name for p in own.iterdir())
    out["ddp_own_returned"] = returned.name

    # 2. Exact resume from a shared directory.
    shared = CheckpointManager(DIRECTORY / "ddp-shared")
    train(model, opt, range(2, 5), 6)
    shared.save(
        4, model=model, optimizer=opt, sampler_state={"rank": RANK, "tensor": torch.tensor([RANK])}
    )
    train(model, opt, range(5, 8), 6)
    out["ddp_straight"] = {k: v.clone() for k, v in model.module.state_dict().items()}
    out["ddp_straight_rand"] = torch.rand(3)

    model2 = build(5)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    torch.manual_seed(12345)  # scramble the RNG; resume must put it back
    state = shared.resume(model=model2, optimizer=opt2)
    assert state is not None
    out["ddp_state"] = (state.step, state.sampler_state["rank"], int(state.sampler_state["tensor"]))
    train(model2, opt2, range(5, 8), 6)
    out["ddp_resumed"] = {k: v.clone() for k, v in model2.module.state_dict().items()}
    out["ddp_resumed_rand"] = torch.rand(3)


def scenario_sharded(
    name: str, shard: Callable[[nn.Module], nn.Module], out: dict[str, Any]
) -> None:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))

    manager = CheckpointManager(DIRECTORY / name, keep_last=2)
    model = build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        train(model, opt, range(step, step + 1), 8)
        path = manager.save(step, model=model, optimizer=opt, sampler_state={"rank": RANK})
        out[f"{name}_at_save{step}"] = full_state(model)
    out[f"{name}_path"] = path.name
    train(model, opt, range(2, 4), 8)
    out[f"{name}_straight"] = full_state(model)

    model2 = build(7)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    state = manager.resume(model=model2, optimizer=opt2)
    assert state is not None
    out[f"{name}_state"] = (state.step, state.sampler_state["rank"], state.path.name)
    train(model2, opt2, range(2, 4), 8)
    out[f"{name}_resumed"] = full_state(model2)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=WORLD
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))

    def fsdp2(model: nn.Module) -> nn.Module:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def fsdp1(model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))

    out: dict[str, Any] = {}
    scenario_ddp(out)
    scenario_sharded("fsdp2", fsdp2, out)
    scenario_sharded("fsdp1", fsdp1, out)
    torch.save(out, DIRECTORY / f"result-{RANK}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
