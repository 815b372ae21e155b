"""autockpt: automatic activation checkpointing and exact training checkpoints for PyTorch."""

from autockpt.errors import (
    AutockptError,
    CheckpointError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    TraceError,
)

__version__ = "0.1.0"

__all__ = [
    "AutockptError",
    "CheckpointError",
    "InfeasibleBudgetError",
    "InvalidArgumentError",
    "TraceError",
    "__version__",
]
