"""One rank of the distributed training-setup tests (gloo on CPU, 127.0.0.1 only).

Usage: python dist_setups.py RANK WORLD PORT DIRECTORY
Trains the model of setups_model.py three steps (SGD) on per-rank data, wrapped in DDP or
sharded with FSDP2 ``fully_shard``, once as it is and once transformed by autockpt, and
writes DIRECTORY/result-RANK.pt: per scenario the gradients and parameters of both runs (or
the error a scenario raised) for tests/test_training_setups.py to compare.
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

import autockpt

sys.path.insert(0, str(Path(__file__).parent))
from setups_model import batch, build, checkpointed, loss_of

warnings.filterwarnings("ignore")
RANK, WORLD, PORT, DIRECTORY = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
MODES = ("non_reentrant", "reentrant")


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(wrapped: nn.Module, inner: nn.Module, micro: int = 1) -> dict[str, torch.Tensor]:
    """Three SGD steps of ``micro`` micro-batches each (all but the last under DDP's no_sync);
    the gradients of the last step and the parameters after it."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    torch.manual_seed(100 + RANK)  # per-rank dropout masks
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        for k in range(micro):
            x = batch(1000 * RANK + 10 * step + k)
            sync = k == micro - 1 or not isinstance(wrapped, DDP)
            if sync:
                loss_of(wrapped(x)).backward()
            else:
                with wrapped.no_sync():
                    loss_of(wrapped(x)).backward()
        grads = {f"grad:{n}": full(p.grad) for n, p in inner.named_parameters()}
        opt.step()
    params = {f"param:{n}": full(p) for n, p in inner.named_parameters()}
    buffers = {f"buf:{n}": b.detach().clone() for n, b in inner.named_buffers()}
    return {**grads, **params, **buffers}


def compare(out: dict[str, Any], name: str, make: Callable[[bool], tuple[nn.Module, nn.Module]],
            micro: int = 1) -> None:
    """Record both runs of a scenario and the plan the autockpt run ended with, or the error
    the autockpt run raised."""
    out[name] = {"plain": train(*make(False), micro=micro)}
    try:
        wrapped, inner = make(True)
        out[name]["autockpt"] = train(wrapped, inner, micro=micro)
        out[name]["plan"] = str(autockpt.plan_of(inner))
    except Exception as err:  # noqa: BLE001 - recorded for the test; the others go on
        out[name]["error"] = f"{type(err).__name__}: {err}"


def scenario_ddp(out: dict[str, Any]) -> None:
    for mode in MODES:
        for label, kwargs in (("default", {}), ("static_graph", {"static_graph": True}),
                              ("find_unused", {"find_unused_parameters": True})):
            def make(auto: bool, mode: str = mode, kwargs: dict = kwargs) -> tuple[nn.Module, nn.Module]:
                model = build()
                if auto:
                    model = checkpointed(model, mode)
                return DDP(model, **kwargs), model

            compare(out, f"ddp/{mode}/{label}", make)
        compare(out, f"ddp/{mode}/no_sync", lambda auto, mode=mode: (
            DDP(m := checkpointed(build(), mode) if auto else build()), m), micro=3)
    try:
        autockpt.apply(DDP(build()), example_inputs=(batch(0),))
        out["ddp/apply_on_wrapper"] = "no error"
    except autockpt.AutockptError as err:
        out["ddp/apply_on_wrapper"] = f"{type(err).__name__}: {err}"


def scenario_fsdp2(out: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard

    for mode in MODES:
        for label in ("root", "blocks", "blocks_inlined"):
            def make(auto: bool, mode: str = mode, label: str = label) -> tuple[nn.Module, nn.Module]:
                model = build()
                if auto:
                    # torchtitan's order: activation checkpointing first, then sharding;
                    # "blocks_inlined" forgets keep_whole: the first forward plans again.
                    keep = "blocks.*" if label == "blocks" else ()
                    model = checkpointed(model, mode, keep_whole=keep)
                if label.startswith("blocks"):
                    for block in model.blocks:
                        fully_shard(block)
                fully_shard(model)
                return model, model

            compare(out, f"fsdp2/{mode}/{label}", make)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                            world_size=WORLD)
    out: dict[str, Any] = {}
    try:
        scenario_ddp(out)
        scenario_fsdp2(out)
    finally:
        dist.destroy_process_group()
    torch.save(out, DIRECTORY / f"result-{RANK}.pt")


if __name__ == "__main__":
    main()
