"""Crash safety: a process that saves checkpoints in a loop is SIGKILLed at random moments,
many times, in the same directory. After every kill the newest checkpoint must load, be one of
the saves that finished (or the one in flight, if its index update landed), never older than
the last finished one, and the next save must leave no temp file behind."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from torch import nn

from autockpt.training import CheckpointManager, CheckpointWarning, load_checkpoint

TRIALS = 60


def model_at(step: int) -> nn.Module:
    """A model whose every weight equals ``step``, so a loaded checkpoint shows its origin."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return model


def loss_at(step: int) -> float:
    return float(step * 7919 % 13)  # scrambled, so keep_best keeps old steps around too


def make_manager(directory: Path) -> CheckpointManager:
    return CheckpointManager(directory, keep_last=2, keep_best=1, monitor="loss")


def saver(directory: Path, conn: Connection) -> None:
    """Child: save step after step until killed, reporting each finished save."""
    torch.set_num_threads(1)
    manager = make_manager(directory)
    latest = manager.latest()
    step = 0 if latest is None else latest.step + 1
    conn.send("ready")
    while True:
        model = model_at(step)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        manager.save(step, model=model, optimizer=opt, metrics={"loss": loss_at(step)})
        conn.send(step)
        step += 1


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs fork and SIGKILL")
def test_sigkill_at_random_moments_never_loses_or_corrupts(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(20240611)
    manager = make_manager(tmp_path)
    # Warm up in the parent: the first optimizer and save import modules lazily (over a
    # second here), which forked children would otherwise each redo and be killed during.
    warm = model_at(0)
    manager.save(
        0,
        model=warm,
        optimizer=torch.optim.SGD(warm.parameters(), lr=0.1),
        metrics={"loss": loss_at(0)},
    )
    finished_max = 0  # highest step whose save() returned, in any process
    temp_files_seen = 0
    child_saves = 0
    for trial in range(TRIALS):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=saver, args=(tmp_path, send), daemon=True)
        child.start()
        send.close()
        # Time the kill from when the child is ready, so it lands among its saves.
        assert receive.poll(30) and receive.recv() == "ready"
        time.sleep(rng.uniform(0.0, 0.1))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        assert child.exitcode == -signal.SIGKILL, f"trial {trial}: child died on its own"
        while receive.poll():
            try:
                finished_max = max(finished_max, receive.recv())
                child_saves += 1
            except EOFError:
                break
        receive.close()
        temp_files_seen += any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())

        latest = manager.latest()
        assert latest is not None, f"trial {trial}: every checkpoint was lost"
        # The one save in flight may have landed just before the kill; nothing else may.
        assert latest.step in (finished_max, finished_max + 1), (trial, latest, finished_max)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)  # no fallback, no rebuild
            model = model_at(-1)
            state = manager.resume(model=model)
        assert state is not None and state.step == latest.step and state.skipped == ()
        assert all(bool((p == latest.step).all()) for p in model.parameters())
        for record in manager.list():  # every kept checkpoint is intact, not just the last
            load_checkpoint(record.path, model=model_at(-1), restore_rng=False)
        finished_max = latest.step

        # The next save, by anyone, cleans up after the killed writer.
        step = finished_max + 1
        manager.save(step, model=model_at(step), metrics={"loss": loss_at(step)})
        finished_max = step
        names = {p.name for p in tmp_path.iterdir()}
        assert not [n for n in names if n.startswith(".tmp-")], (trial, names)
        expected = {"index.json"}
        for record in manager.list():
            expected |= {record.path.name, record.path.name + ".sha256"}
        assert names == expected, (trial, names ^ expected)

    # The kills must have landed inside writes sometimes, or this test proved little.
    assert temp_files_seen >= 5, temp_files_seen
    assert child_saves >= TRIALS, f"children finished only {child_saves} saves"
    print(f"{TRIALS} kills; children finished {child_saves} saves; {temp_files_seen} mid-write")
