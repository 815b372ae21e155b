"""The module paths of autockpt before it had one package per stage, kept as deprecated aliases.

# NOTE [ Old module paths ]
Until 2026-11-28 every module sat directly under ``autockpt/`` (``autockpt.planner``,
``autockpt.measure``, ...), and users imported from them. Each old path still imports, with a
``DeprecationWarning`` that names the new one: a moved module is the same module object under
its old name, so ``autockpt.planner.Plan is autockpt.planning.planner.Plan``, and
``monkeypatch.setattr`` on either reaches the same code. Two modules were split along the
stages: ``autockpt.modules`` (the modules rung: profiled, planned, run) and
``autockpt.chunking`` (the chunked head: found, run). Their old paths give a module holding
every name of the parts, private ones included, so a pickle that names
``autockpt.modules._rebuild_block`` still loads.

Three old paths share their name with a public function of the package (``autockpt.measure``,
``autockpt.diagnose``, ``autockpt.lint``). Importing a submodule makes Python set it as an
attribute of its package, which would replace the function by the module; the package's
class keeps the function (:class:`_Package`).

The aliases are found by a finder on ``sys.meta_path`` rather than by files, so ``ls
autockpt`` shows the stages, not the history.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "SPLIT", "install"]

MOVED: dict[str, str] = {
    "instrument": "ops.instrument",
    "fake_outputs": "ops.fake_outputs",
    "trace": "capturing.trace",
    "capture": "capturing.ladder",
    "meta_device": "capturing.meta",
    "profile": "profiling.profile",
    "shape_rules": "profiling.shape_rules",
    "loss": "profiling.loss",
    "timing": "profiling.timing",
    "stats": "profiling.stats",
    "chain": "planning.chain",
    "memory_model": "planning.memory_model",
    "optimal": "planning.optimal",
    "plan_search": "planning.search",
    "nested": "planning.nested",
    "planner": "planning.planner",
    "budget": "planning.budget",
    "_gc": "planning.gc",
    "rewrite": "running.rewrite",
    "runner": "running.runner",
    "replay": "running.replay",
    "measure": "running.measure",
    "diagnose": "tools.diagnose",
    "lint": "tools.lint",
    "plot": "tools.plot",
    "cli": "tools.cli",
    "findings": "tools.findings",
    "script": "tools.script",
    "checkpoints": "training",
    "training.lint": "tools.training_lint",
}
"""Old module name (under ``autockpt.``) -> its new path."""

SPLIT: dict[str, tuple[str, ...]] = {
    "modules": ("profiling.blocks", "planning.blocks", "running.blocks", "capturing.draws"),
    "chunking": ("planning.head", "running.head"),
}
"""Old module name -> the modules its parts went to."""


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str) -> None:
        self.old = old

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.old in MOVED:
            new = MOVED[self.old]
            _warn(self.old, f"autockpt.{new}")
            return importlib.import_module(f"autockpt.{new}")
        parts = SPLIT[self.old]
        _warn(self.old, " and ".join(f"autockpt.{p}" for p in parts))
        merged = types.ModuleType(spec.name, f"Deprecated: the parts of autockpt.{self.old}.")
        for part in reversed(parts):  # the first part wins a name two parts define
            module = importlib.import_module(f"autockpt.{part}")
            merged.__dict__.update({k: v for k, v in vars(module).items()
                                    if not k.startswith("__")})
        return merged

    def exec_module(self, module: types.ModuleType) -> None:
        """The module is complete when created."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "autockpt" or (old not in MOVED and old not in SPLIT):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(old))


def _warn(old: str, new: str) -> None:
    # Attributed to the user's import statement: past this module's frames (warnings skips
    # importlib's own when it counts).
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not ("importlib" in name and "_bootstrap" in name):
            break
        if name == __file__:
            level += 1
        frame = frame.f_back
    warnings.warn(f"autockpt.{old} moved to {new}: import from there (or from the top-level "
                  "autockpt) instead; this alias will be removed", DeprecationWarning,
                  stacklevel=level)


class _Package(types.ModuleType):
    """The ``autockpt`` package's class: a submodule imported under the name of one of its
    functions does not replace the function (NOTE [ Old module paths ])."""

    def __setattr__(self, name: str, value: Any) -> None:
        current = self.__dict__.get(name)
        if isinstance(value, types.ModuleType) and callable(current) \
                and not isinstance(current, types.ModuleType):
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Make the old module paths of ``package`` (``autockpt``) importable.

    Example:
        >>> import warnings, autockpt
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     from autockpt.planner import Plan
        >>> Plan is autockpt.Plan
        True
    """
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())  # before a stale file of an older install
    package.__class__ = _Package
