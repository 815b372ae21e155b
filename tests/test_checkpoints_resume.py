"""Exact resume across processes: 2N steps straight == N steps, exit, resume in a fresh
process, N more steps -- bitwise, with dropout, Adam, a scheduler, a shuffling DataLoader and
Python/NumPy randomness in the loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "ckpt_scripts" / "train.py"
ROOT = Path(__file__).resolve().parents[1]
TOTAL, STOP = 20, 10  # 7 batches an epoch: the stop is mid-epoch 1, the end mid-epoch 2


def run(*args: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen[bytes]) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.slow
def test_stop_and_resume_in_fresh_processes_is_bitwise_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    straight, stopped = (
        run("straight", ckpt / "unused", TOTAL, STOP, tmp_path / "a.pt"),
        run("stop", ckpt, TOTAL, STOP, tmp_path / "unused.pt"),
    )
    finish(straight)
    finish(stopped)
    assert not (tmp_path / "unused.pt").exists()  # the stopping run really exited early
    # The control resumes the same checkpoint without restoring the RNGs; it must diverge, so
    # the comparison below is able to fail. It only reads, so both run at once.
    resumed, control = (
        run("resume", ckpt, TOTAL, STOP, tmp_path / "b.pt"),
        run("resume-norng", ckpt, TOTAL, STOP, tmp_path / "c.pt"),
    )
    finish(resumed)
    finish(control)
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    for key in a["params"]:
        assert bitwise_equal(a["params"][key], b["params"][key]), key
    for pid in a["optimizer"]:
        for k in a["optimizer"][pid]:
            assert bitwise_equal(a["optimizer"][pid][k], b["optimizer"][pid][k]), (pid, k)
    assert bitwise_equal(a["torch"], b["torch"])
    assert (a["python"], a["numpy"]) == (b["python"], b["numpy"])

    c = torch.load(tmp_path / "c.pt", weights_only=True)
    assert not all(bitwise_equal(a["params"][k], c["params"][k]) for k in a["params"])
