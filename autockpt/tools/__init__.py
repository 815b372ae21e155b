"""Tools over the stages: what a user runs besides ``apply`` and ``plan``.

Takes: a user's model, script or training step. Hands on: reports, never printed by the
analysis itself (:mod:`autockpt.report` renders them).

Modules: ``diagnose`` (the classic pitfalls found in a running model), ``lint`` (the same read
off a script's source), ``script`` (what lint reads a script as), ``findings`` (their
findings and reports), ``plot`` (memory over a step, with the plan's segments), ``cli`` (the
``autockpt`` command).
"""

# diagnose and lint are not re-exported here: the names would then be the functions, and
# ``autockpt.tools.diagnose.X`` would not reach the module (``autockpt.diagnose`` is the
# function).
from autockpt.tools.findings import Finding, Report

__all__ = ["Finding", "Report"]
