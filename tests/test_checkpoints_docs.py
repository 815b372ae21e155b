"""The user guide's code and the docstring examples of autockpt.training actually run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import warnings
from pathlib import Path

import pytest

import autockpt.training

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "training-checkpoints.md"
MODULES = ["autockpt.training"] + sorted(
    m.name for m in pkgutil.iter_modules(autockpt.training.__path__, "autockpt.training.")
)
BLOCK = re.compile(r"(?P<marker><!-- not-run:[^>]*-->\n)?```python\n(?P<code>.*?)```", re.S)


def test_user_guide_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [m for m in BLOCK.finditer(GUIDE.read_text(encoding="utf-8"))]
    runnable = [m["code"] for m in blocks if not m["marker"]]
    assert len(runnable) >= 6 and len(blocks) - len(runnable) == 2
    monkeypatch.chdir(tmp_path)  # the guide writes ./checkpoints and ./single.pt
    namespace: dict[str, object] = {"__name__": "guide"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.compile's import chatter
        for i, code in enumerate(runnable):
            exec(compile(code, f"{GUIDE.name} block {i}", "exec"), namespace)
    # The quick start saved at steps 9, 19, 29; the corruption demo then fell back to 19.
    assert namespace["state"].path.name == "ckpt-0000000019.pt"  # type: ignore[attr-defined]


def test_docstring_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp() in the examples
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        results = [
            doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
            for name in MODULES
        ]
    failed = sum(r.failed for r in results)
    attempted = sum(r.attempted for r in results)
    assert attempted >= 20 and failed == 0
