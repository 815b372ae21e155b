"""Stage 2, profile: what each node of the captured forward costs, in plain numbers.

Takes: a :class:`~autockpt.capturing.trace.TracedModel` and example inputs (or, on the modules
rung, the module itself), and the loss.
Hands on: a :class:`~autockpt.profiling.stats.Profile`: per node its output, saved and working
bytes, FLOPs, random ops and buffer updates, the storages and who reads them, and the loss
node (:class:`~autockpt.profiling.stats.LossStat`); no fx object passes beyond it. Measured
times per node when ``cost="profile"``.

Modules: ``profile`` (one forward on fake tensors, watched), ``shape_rules`` (outputs made
without running the op), ``loss`` (the user's loss and the model's own), ``timing`` (measured
node times), ``stats`` (the profile's dataclasses), ``blocks`` (the modules rung's profile),
``symbolic`` (the profile taken on symbolic sizes, evaluated at every shape).
"""

from autockpt.profiling.stats import LossStat, NodeStat, Profile, StorageStat

__all__ = ["LossStat", "NodeStat", "Profile", "StorageStat"]
