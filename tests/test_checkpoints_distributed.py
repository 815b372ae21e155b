"""DDP and FSDP (FSDP2 fully_shard and FSDP1) checkpoints with 2 gloo processes on CPU.

Both ranks run tests/ckpt_scripts/dist_worker.py once (it covers every scenario, so the ~4 s
process start is paid once); the tests below check what the workers recorded and what they
left on disk, and load the sharded checkpoints again in this single, unsharded process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autockpt.training import CheckpointFallbackWarning, CheckpointManager
from tests.helpers import run_workers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]

SCRIPT = Path(__file__).parent / "ckpt_scripts" / "dist_worker.py"
WORLD = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("dist")
    return directory, run_workers(SCRIPT, WORLD, directory, timeout_s=240)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)


def test_ddp_only_rank0_writes(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = run
    assert results[0]["ddp_own_files"] == [
        "ckpt-0000000001.pt",
        "ckpt-0000000001.pt.sha256",
        "index.json",
    ]
    assert results[1]["ddp_own_files"] == []  # rank 1 waited, wrote nothing
    assert results[1]["ddp_own_returned"] == "ckpt-0000000001.pt"


def test_ddp_every_rank_resumes_exactly_with_its_own_state(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = run
    assert sorted(p.name for p in (directory / "ddp-shared").iterdir()) == [
        "ckpt-0000000004.pt",
        "ckpt-0000000004.pt.sha256",
        "index.json",
    ]
    for rank, out in enumerate(results):
        assert out["ddp_state"] == (4, rank, rank)  # each rank got its own sampler_state
        assert same_state(out["ddp_straight"], out["ddp_resumed"])
        assert bitwise_equal(out["ddp_straight_rand"], out["ddp_resumed_rand"])
    # Ranks had different RNG streams (per-rank dropout), and each got its own back.
    assert not bitwise_equal(results[0]["ddp_straight_rand"], results[1]["ddp_straight_rand"])
    assert same_state(results[0]["ddp_straight"], results[1]["ddp_straight"])  # DDP in sync


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_sharded_each_rank_writes_its_shard_and_resumes_exactly(
    run: tuple[Path, list[dict[str, Any]]], name: str
) -> None:
    directory, results = run
    ckpt = directory / name / "ckpt-0000000001.dcp"
    assert ckpt.is_dir()
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    assert not [p for p in (directory / name).iterdir() if p.name.startswith(".tmp-")]
    for rank, out in enumerate(results):
        assert out[f"{name}_path"] == ckpt.name
        assert out[f"{name}_state"] == (1, rank, ckpt.name)
        assert same_state(out[f"{name}_straight"], out[f"{name}_resumed"])
        # Training went on after the save, so the equality above is not trivial.
        assert not same_state(out[f"{name}_straight"], out[f"{name}_at_save1"])


def plain_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_sharded_checkpoint_loads_into_one_unsharded_process(
    run: tuple[Path, list[dict[str, Any]]], name: str
) -> None:
    directory, results = run
    manager = CheckpointManager(directory / name)
    assert [(r.step, r.sharded, r.sha256) for r in manager.list()] == [
        (0, True, None),
        (1, True, None),
    ]
    model = plain_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = manager.resume(model=model, optimizer=opt, restore_rng=False)
    assert state is not None and state.step == 1 and state.sampler_state == {"rank": 0}
    assert same_state(model.state_dict(), results[0][f"{name}_at_save1"])
    assert int(opt.state_dict()["state"][0]["step"]) == 2  # Adam state came along


def test_corrupted_shard_falls_back_to_older_sharded_checkpoint(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, results = run
    import shutil

    copy = tmp_path / "fsdp2"
    shutil.copytree(directory / "fsdp2", copy)
    shard = copy / "ckpt-0000000001.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    model = plain_model()
    with pytest.warns(CheckpointFallbackWarning, match="__1_0.distcp.*sha256"):
        state = CheckpointManager(copy).resume(model=model, restore_rng=False)
    assert state is not None and state.step == 0
    assert state.skipped == (copy / "ckpt-0000000001.dcp",)
    assert same_state(model.state_dict(), results[0]["fsdp2_at_save0"])
