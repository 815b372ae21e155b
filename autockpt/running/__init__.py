"""Stage 4, run: the plan carried out in the transformed model, and a training step measured.

Takes: a :class:`~autockpt.planning.planner.Plan` and the captured graph (or the blocks of the
modules rung).
Hands on: code the runtime (:mod:`autockpt.runtime`) runs: the graph rewritten so that each
segment is one call of ``torch.utils.checkpoint.checkpoint`` (``rewrite``), the runner that
makes those calls (dummy argument, RNG, buffers updated once), checkpointed block views
(``blocks``), the head in chunks (``head``); the replay of a plan on fake tensors that checks
its estimate (``replay``), and the measured peak of a real step (``measure``).
"""

# The functions named like their modules (measure) are not re-exported here: the name would
# then be the function, and ``autockpt.running.measure.X`` would not reach the module.
from autockpt.running.measure import MemoryReport, track_activation_memory
from autockpt.running.runner import run_checkpointed

__all__ = ["MemoryReport", "run_checkpointed", "track_activation_memory"]
