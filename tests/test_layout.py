"""The package's layout: one package per stage, dependencies pointing one way (NOTE [ Old
module paths ] in autockpt/_aliases.py for the paths before it).

Read off the source with ``ast``, so every import counts, those inside functions included;
imports under ``if TYPE_CHECKING:`` do not run and are left out.
"""

from __future__ import annotations

import ast
import importlib
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import networkx as nx
import pytest
import torch

import autockpt
from autockpt._aliases import MOVED, SPLIT

ROOT = Path(autockpt.__file__).parent

# The order of the stages: a module may import from its own package and from lower ranks.
RANK = {
    "autockpt.errors": 0, "autockpt._aliases": 0, "autockpt.units": 0.1, "autockpt.report": 0.2,
    "autockpt.ops": 1,
    "autockpt.capturing": 2,
    "autockpt.profiling": 3,
    "autockpt.planning": 4,
    "autockpt.running": 5,
    "autockpt.pipeline": 6,
    "autockpt.runtime": 7,
    "autockpt.api": 8,
    "autockpt.tools": 9,
    "autockpt": 10, "autockpt.__main__": 10,
}
STANDS_APART = "autockpt.training"  # training checkpoints: imports no stage, no stage imports it


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _runs(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` that run, those under ``if TYPE_CHECKING:`` left out."""
    found: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _imports(name: str) -> list[tuple[str, str]]:
    """``(module imported, name imported or "")`` for every autockpt import ``name`` makes."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in _runs(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base == "autockpt" or base.startswith("autockpt."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.append((sub, "") if sub in MODULES else (base, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("autockpt")]
    return out


def _home(name: str) -> str:
    """The stage a module belongs to: its package under autockpt, or itself at the top."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or name in RANK else name


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 10, top
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert packages == ["capturing", "ops", "planning", "profiling", "running", "tools",
                        "training"]


def test_each_package_says_what_it_takes_and_hands_on() -> None:
    for package in ["ops", "capturing", "profiling", "planning", "running", "tools"]:
        module = importlib.import_module(f"autockpt.{package}")
        doc = module.__doc__ or ""
        assert "Takes:" in doc and "Hands on:" in doc, package
        assert module.__all__, package


def test_no_private_name_imported_from_another_module() -> None:
    found = [f"{name} imports {module}.{imported}" for name in MODULES
             for module, imported in _imports(name)
             if imported.startswith("_") and not imported.endswith("__") and module != name]
    found += [f"{name} imports the private module {module}" for name in MODULES
              for module, _ in _imports(name)
              if module.rpartition(".")[2].startswith("_") and module != "autockpt._aliases"
              and module != "autockpt.__main__"]
    assert found == []


def test_dependencies_point_one_way() -> None:
    wrong = []
    for name in MODULES:
        home = _home(name)
        for module, _ in _imports(name):
            target = _home(module)
            if target == home:
                continue
            if home.startswith(STANDS_APART):
                if RANK.get(target, 1) >= 1:  # the errors and units, nothing of a stage
                    wrong.append(f"{name} -> {module}")
                continue
            if target.startswith(STANDS_APART):
                if RANK[home] < RANK["autockpt.tools"]:
                    wrong.append(f"{name} -> {module}")
                continue
            if RANK[target] >= RANK[home]:
                wrong.append(f"{name} -> {module}")
    assert wrong == []


def test_no_import_cycle() -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name in MODULES:
        for module, _ in _imports(name):
            if module in MODULES and module != name:
                graph.add_edge(name, module)
    # A package's __init__ imports its own modules, which import their siblings by full
    # path: that is no cycle of modules, so the edges into a package's own __init__ go.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges)
                             if MODULES[b].name == "__init__.py" and a.startswith(b + ".")])
    assert list(nx.simple_cycles(graph)) == []


def test_one_dispatch_mode() -> None:
    modes = [f"{name}.{node.name}" for name, path in MODULES.items()
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ClassDef)
             and any("TorchDispatchMode" in ast.unparse(b) for b in node.bases)]
    assert modes == ["autockpt.ops.instrument.OpWatch"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_still_import(old: str) -> None:
    """Each moved module, in a fresh interpreter: the old path warns, names the new one, and
    is the same module."""
    code = (
        "import warnings, importlib\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module('autockpt.{old}')\n"
        f"new = importlib.import_module('autockpt.{MOVED[old]}')\n"
        "assert old is new, (old, new)\n"
        "messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        f"assert any('autockpt.{MOVED[old]}' in m for m in messages), messages\n"
        "import autockpt\n"
        "assert callable(autockpt.measure) and callable(autockpt.diagnose) "
        "and callable(autockpt.lint)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_split_modules_keep_every_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, parts in SPLIT.items():
            merged = importlib.import_module(f"autockpt.{old}")
            for part in parts:
                module = importlib.import_module(f"autockpt.{part}")
                for name in module.__all__:
                    assert getattr(merged, name) is getattr(module, name), (old, name)


def test_a_module_pickled_before_the_packages_loads() -> None:
    """A block view's class was rebuilt by ``autockpt.modules._rebuild_block``; a pickle
    that names it still loads."""
    from autockpt.running.blocks import _BlockMixin

    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                for _ in range(4)])
    data = pickle.dumps(autockpt.apply(net, None, example_inputs=(torch.randn(2, 8),)))
    rebuild = _BlockMixin._autockpt_rebuild.__qualname__
    old = data.replace(b"autockpt.running.blocks", b"autockpt.modules")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loaded = pickle.loads(old)
    assert rebuild == "_rebuild_block"
    x = torch.randn(2, 8)
    torch.testing.assert_close(loaded(x), net(x))
