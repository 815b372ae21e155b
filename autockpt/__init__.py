"""autockpt: automatic activation checkpointing and exact training checkpoints for PyTorch.

Example:
    >>> import torch, autockpt
    >>> net = torch.nn.Sequential(*[m for _ in range(16)
    ...                             for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())])
    >>> ckpt = autockpt.apply(net, budget_mb=1.5, example_inputs=(torch.randn(64, 512),))
"""

from autockpt.api import apply, plan, plan_of
from autockpt.diagnose import diagnose
from autockpt.errors import (
    AutockptError,
    CheckpointError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    TraceError,
)
from autockpt.findings import Finding, Report
from autockpt.lint import lint
from autockpt.measure import MemoryReport, measure, track_activation_memory
from autockpt.planner import STRATEGIES, Plan, Segment

__version__ = "0.1.0"

__all__ = [
    "AutockptError",
    "CheckpointError",
    "Finding",
    "InfeasibleBudgetError",
    "InvalidArgumentError",
    "MemoryReport",
    "Plan",
    "Report",
    "STRATEGIES",
    "Segment",
    "TraceError",
    "__version__",
    "apply",
    "diagnose",
    "lint",
    "measure",
    "plan",
    "plan_of",
    "track_activation_memory",
]
