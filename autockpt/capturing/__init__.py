"""Stage 1, capture: a graph of the user's forward, or word that only its modules can be planned.

Takes: the user's ``nn.Module`` and example inputs (real, fake or on the meta device).
Hands on: a :class:`~autockpt.capturing.trace.TracedModel` (an fx graph over the model's own
parameters, with its input spec) from the first rung of the ladder that works, ``"fx"``, then
``"export"`` (:func:`~autockpt.capturing.ladder.capture`), or
:class:`~autockpt.capturing.ladder.NoGraph` and the reasons, which sends the pipeline to the
modules rung (profiled in :mod:`autockpt.profiling.blocks`).

Modules: ``ladder`` (the rungs, hooks and sharded models), ``trace`` (torch.fx and
torch.export tracing, twins of the user's module), ``draws`` (the random-draw guards, as
OpWatch observers), ``meta`` (planning a model on the meta device), ``shapes`` (input structures and
shapes, and the sizes a captured graph takes).
"""

from autockpt.capturing.ladder import CAPTURES, NoGraph, capture
from autockpt.capturing.trace import TracedModel

__all__ = ["CAPTURES", "NoGraph", "TracedModel", "capture"]
