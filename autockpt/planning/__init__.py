"""Stage 3, plan: which stretches of the forward to checkpoint, from numbers alone.

Takes: a :class:`~autockpt.profiling.stats.Profile` and a budget in bytes (or a device budget:
the whole device less parameters, gradients and optimizer state).
Hands on: a :class:`~autockpt.planning.planner.Plan`: the checkpointed segments (each
recomputed whole, or keeping its matmuls' outputs and recomputing the rest), the estimated
peak and the recompute, printable with one row per segment; and, for a language model's
head, whether it runs in chunks (:mod:`autockpt.planning.head`). The planner sees sizes and
costs, never fx objects or tensors, so it is tested on tables of data.

Modules: ``chain`` (the forward as a chain of stages), ``memory_model`` (the peak of a plan),
``optimal`` (the dynamic programme for one level of segments), ``search`` (its bounded
search), ``nested`` (segments inside segments), ``planner`` (strategies, budgets, the
:class:`Plan`), ``budget`` (the whole device), ``head`` (the chunked head found and priced),
``blocks`` (the modules rung's plan), ``gc`` (the collector paused while planning),
``buckets`` (which plan serves a call of a new shape, and where a new plan is priced).
"""

from autockpt.planning.budget import DeviceBudget
from autockpt.planning.planner import MODES, STRATEGIES, Plan, Segment, make_plan

__all__ = ["DeviceBudget", "MODES", "Plan", "STRATEGIES", "Segment", "make_plan"]
