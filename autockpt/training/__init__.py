"""Training checkpoints that resume exactly, load into any wrapper, and survive a crash mid-save.

What a checkpoint file holds
    One ``torch.save`` file, readable with ``torch.load(path, weights_only=True)``, holding a
    dict: ``"autockpt_checkpoint"`` (format version, 1), ``"meta"`` (a JSON string: step, epoch,
    metrics, time, ``extra``, and per rank the Python/NumPy RNG states and ``sampler_state``),
    ``"model"`` (the model's state_dict with wrapper prefixes removed), ``"optimizer"``,
    ``"scheduler"``, ``"scaler"`` (each only when given), ``"tensors"`` (tensors referenced from
    ``extra``) and ``"rank_tensors"`` (per rank: the torch CPU and CUDA RNG states and tensors in
    ``sampler_state``). Next to it, ``<file>.sha256`` holds its checksum in ``sha256sum`` format.

Exact resume
    Resuming restores model, optimizer, scheduler and grad-scaler state and the RNGs (Python
    ``random``, NumPy's global RNG, torch CPU, every CUDA device), so training N steps, stopping
    and resuming for N more gives bitwise the same parameters as 2N steps straight, provided the
    data order resumes too: use :class:`ResumableSampler` and give the DataLoader its own
    ``generator=torch.Generator()``. Not covered: RNGs the user keeps elsewhere (NumPy
    ``default_rng`` objects: put their state in ``extra``), randomness inside DataLoader
    workers, and kernels that are nondeterministic by themselves (see
    ``torch.use_deterministic_algorithms``).

Crash safety
    Every file is written to a ``.tmp-*`` file in the same directory, flushed, fsynced and
    renamed over the final name with :func:`os.replace`, then the directory is fsynced. The
    :class:`CheckpointManager` index (``index.json``) is written the same way, after the
    checkpoint itself, so it only ever names complete files; their size and sha256 are in it.

Distributed
    Under DDP (an initialised process group, unsharded model) every rank calls ``save``; rank 0
    writes, after gathering each rank's RNG and sampler state, and the others wait for it. A
    model with DTensor parameters (FSDP2 ``fully_shard``) or FSDP1 modules is saved with
    ``torch.distributed.checkpoint`` (DCP) into ``ckpt-<step>.dcp/``, each rank writing its shard.
    Both run on CPU with gloo in torch 2.13 and are tested that way. DCP reads its ``.metadata``
    file with :mod:`pickle`; autockpt checks every file of such a directory against the sha256
    recorded at save time before DCP reads it, so it catches corruption, but only load sharded
    checkpoint directories you trust.

Example:
    >>> import tempfile, torch
    >>> from autockpt.training import CheckpointManager
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> manager = CheckpointManager(tempfile.mkdtemp(), keep_last=2)
    >>> for step in range(3):
    ...     _ = manager.save(step, model=model, optimizer=opt, metrics={"loss": 1.0 / (step + 1)})
    >>> [r.step for r in manager.list()]
    [1, 2]
    >>> manager.resume(model=model, optimizer=opt).step
    2
"""

# NOTE [ The layers of the training-checkpoint package ]
# Each module uses only those above it in this list, so the package reads top down:
#   files        crash-safe writes, checksums and their sidecars, verified torch.load
#   rng          capture and restore of every RNG
#   distributed  ranks, sharded (DCP) save and load, verifying a sharded checkpoint once
#   state_dict   key matching across wrappers, load_state_dict
#   payload      what a checkpoint file holds, JSON encoding of user state, read and write
#   index        the manager's index.json and its recovery
#   sampler      the resumable sampler
#   manager      CheckpointManager, save_checkpoint, load_checkpoint
# The static checks of training loops and saves (AC012-AC014), which autockpt.lint runs after
# its own, live with the other tools: autockpt/tools/training_lint.py.

from __future__ import annotations

from autockpt.training.manager import (
    CheckpointFallbackWarning,
    CheckpointManager,
    CheckpointRecord,
    CheckpointWarning,
    TrainingState,
    load_checkpoint,
    save_checkpoint,
)
from autockpt.training.sampler import ResumableSampler
from autockpt.training.state_dict import LoadResult, ShapeMismatch, load_state_dict

__all__ = [
    "CheckpointFallbackWarning",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWarning",
    "LoadResult",
    "ResumableSampler",
    "ShapeMismatch",
    "TrainingState",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
]
