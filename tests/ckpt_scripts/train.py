"""Train a small dropout model on a shuffling DataLoader, for the exact-resume test.

Usage: python train.py MODE DIRECTORY TOTAL_STEPS STOP_STEP OUT
  MODE straight     train TOTAL_STEPS steps without saving
  MODE stop         train STOP_STEP steps, save a checkpoint, exit (the process ends)
  MODE resume       resume from DIRECTORY and train up to TOTAL_STEPS
  MODE resume-norng like resume but restore_rng=False: a control that must NOT match
OUT receives the final parameters, optimizer state and the next draws of every RNG.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autockpt.training import CheckpointManager, ResumableSampler


def main() -> None:
    mode, directory, total, stop, out = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(123)
    dataset = TensorDataset(
        torch.randn(40, 8, generator=data_gen), torch.randn(40, 1, generator=data_gen)
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    sampler = ResumableSampler(dataset, seed=7)
    # The loader's own generator keeps iter(loader) from drawing on the global RNG.
    loader = DataLoader(dataset, batch_size=6, sampler=sampler, generator=torch.Generator())
    manager = CheckpointManager(directory, keep_last=2)

    step = 0
    if mode.startswith("resume"):
        state = manager.resume(
            model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=mode == "resume"
        )
        assert state is not None and state.step == stop - 1, state
        sampler.load_state_dict(state.sampler_state)
        step = state.step + 1

    while step < total:
        for x, y in loader:
            # Python and NumPy RNGs take part too, so their restore is checked as well.
            jitter = torch.from_numpy(np.random.normal(0.0, 0.05, size=x.shape)).float()
            x = x + jitter * random.random()
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if mode == "stop" and step == stop - 1:
                manager.save(
                    step,
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    epoch=sampler.epoch,
                    sampler_state=sampler.state_dict(),
                )
                sys.exit(0)
            step += 1
            if step == total:
                break
    torch.save(
        {
            "params": model.state_dict(),
            "optimizer": optimizer.state_dict()["state"],
            "torch": torch.rand(4),
            "python": random.random(),
            "numpy": float(np.random.rand()),
        },
        out,
    )


if __name__ == "__main__":
    main()
