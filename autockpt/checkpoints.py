"""Where the training checkpoints used to live; imports written for it keep working.

The training-checkpoint product is :mod:`autockpt.training` now (the name ``checkpoints`` read
as activation checkpointing, the library's other half). Importing from here still gives the
same objects, with a ``DeprecationWarning`` that says where to import them from.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from autockpt.checkpoints import CheckpointManager
    >>> import autockpt.training
    >>> CheckpointManager is autockpt.training.CheckpointManager
    True
"""

from __future__ import annotations

import warnings

from autockpt import training
from autockpt.training import *  # noqa: F403  (the same names, re-exported)

__all__ = list(training.__all__)

warnings.warn(
    "autockpt.checkpoints moved to autockpt.training: import from autockpt.training (or the "
    "top-level autockpt) instead; this alias will be removed",
    DeprecationWarning,
    stacklevel=2,
)
