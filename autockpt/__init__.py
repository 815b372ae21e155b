"""autockpt: automatic activation checkpointing and exact training checkpoints for PyTorch.

Example:
    >>> import torch, autockpt
    >>> net = torch.nn.Sequential(*[m for _ in range(16)
    ...                             for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
    >>> ckpt = autockpt.apply(net, budget_mb=1.5, example_inputs=(torch.randn(64, 512),))
"""

from autockpt.api import apply, plan, plan_of
from autockpt.budget import DeviceBudget
from autockpt.training import (
    CheckpointFallbackWarning,
    CheckpointManager,
    CheckpointRecord,
    CheckpointWarning,
    LoadResult,
    ResumableSampler,
    ShapeMismatch,
    TrainingState,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
)
from autockpt.diagnose import diagnose
from autockpt.errors import (
    AutockptError,
    BudgetWarning,
    CheckpointError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    TraceError,
)
from autockpt.findings import Finding, Report
from autockpt.lint import lint
from autockpt.loss import WithLoss, with_loss
from autockpt.measure import MemoryReport, measure, track_activation_memory
from autockpt.planner import STRATEGIES, Plan, Segment
from autockpt.plot import MemoryCurves, draw_memory, memory_curves, plot_memory

__version__ = "0.1.0"

__all__ = [
    "AutockptError",
    "BudgetWarning",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWarning",
    "DeviceBudget",
    "Finding",
    "InfeasibleBudgetError",
    "InvalidArgumentError",
    "LoadResult",
    "MemoryCurves",
    "MemoryReport",
    "Plan",
    "Report",
    "ResumableSampler",
    "STRATEGIES",
    "Segment",
    "ShapeMismatch",
    "TraceError",
    "TrainingState",
    "WithLoss",
    "__version__",
    "apply",
    "diagnose",
    "draw_memory",
    "lint",
    "load_checkpoint",
    "load_state_dict",
    "measure",
    "memory_curves",
    "plan",
    "plan_of",
    "plot_memory",
    "save_checkpoint",
    "track_activation_memory",
    "with_loss",
]
