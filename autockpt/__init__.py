"""autockpt: automatic activation checkpointing and exact training checkpoints for PyTorch.

Example:
    >>> import torch, autockpt
    >>> net = torch.nn.Sequential(*[m for _ in range(16)
    ...                             for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
    >>> ckpt = autockpt.apply(net, budget_mb=1.5, example_inputs=(torch.randn(64, 512),))

One package per stage: :mod:`autockpt.capturing` (a graph of the forward),
:mod:`autockpt.profiling` (what each op costs), :mod:`autockpt.planning` (which segments to
checkpoint), :mod:`autockpt.running` (the transformed model, and measuring a step), beside
:mod:`autockpt.ops` (watching the ops a forward runs), :mod:`autockpt.tools` (diagnose, lint,
plot, the command line) and :mod:`autockpt.training` (training checkpoints). The public API is
the names below.
"""

import sys

from autockpt import _aliases
from autockpt.api import __version__, apply, plan, plan_of
from autockpt.errors import (
    AutockptError,
    BudgetWarning,
    CheckpointError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    TraceError,
)
from autockpt.planning.budget import DeviceBudget
from autockpt.planning.planner import STRATEGIES, Plan, Segment
from autockpt.profiling.loss import WithLoss, with_loss
from autockpt.running.measure import MemoryReport, measure, track_activation_memory
from autockpt.tools.diagnose import diagnose
from autockpt.tools.findings import Finding, Report
from autockpt.tools.lint import lint
from autockpt.tools.plot import MemoryCurves, draw_memory, memory_curves, plot_memory
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

_aliases.install(sys.modules[__name__])  # the module paths before the stages had packages
