"""A training script, parsed once for the lint rules: names resolved through its imports,
every call and binding in source order, and the scope each node sits in.

:func:`autockpt.lint` builds one :class:`Script` and hands it to every rule set: the
activation-checkpoint rules in :mod:`autockpt.lint` and the training-loop and
checkpoint-saving rules in :mod:`autockpt.tools.training_lint`.

Example:
    >>> import ast
    >>> source = '''
    ... import torch.utils.checkpoint as cp
    ... y = cp.checkpoint(f, x)
    ... '''
    >>> script = Script(ast.parse(source), "train.py")
    >>> [(script.resolve(c.func), script.where(c)) for c in script.calls]
    [('torch.utils.checkpoint.checkpoint', 'train.py:3')]
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

__all__ = ["DDP_CLASSES", "Script"]

DDP_CLASSES = frozenset({
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
})
"""The dotted names DistributedDataParallel is imported by."""


class Script:
    """One parsed script and the facts every lint rule reads.

    Attributes:
        tree: the parsed module.
        filename: the name findings use for the script (``"<source>"`` for source text).
        parents: each node's parent node.
        aliases: each name the script imports, mapped to the dotted name it stands for.
        classes: the classes the script defines, by name.
        calls: every call, in source order.
        assignments: every binding as ``(target text, line, scope, value)``, in source order.
    """

    def __init__(self, tree: ast.Module, filename: str) -> None:
        self.tree = tree
        self.filename = filename
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.aliases = self._imports()
        self.classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.calls.sort(key=lambda n: (n.lineno, n.col_offset))
        self.assignments = self._assignments()

    def _imports(self) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        return aliases

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to, through the script's imports."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None

    def where(self, node: ast.AST) -> str:
        """``file:line`` of ``node``, as findings name places."""
        return f"{self.filename}:{getattr(node, 'lineno', 0)}"

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The function or lambda ``node`` is in, or the module."""
        parent = self.parents.get(node)
        while parent is not None and not isinstance(
            parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        ):
            parent = self.parents.get(parent)
        return parent if parent is not None else self.tree

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """The nodes enclosing ``node``, innermost first."""
        parent = self.parents.get(node)
        while parent is not None:
            yield parent
            parent = self.parents.get(parent)

    def _assignments(self) -> list[tuple[str, int, ast.AST, ast.AST | None]]:
        """Every binding in the script as ``(target text, line, scope, value)``, in order;
        ``value`` is None for loop targets and other bindings without a single value."""
        bound: list[tuple[str, int, ast.AST, ast.AST | None]] = []
        for node in ast.walk(self.tree):
            targets: list[ast.AST] = []
            value: ast.AST | None = None
            if isinstance(node, ast.Assign):
                targets, value = list(node.targets), node.value
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets, value = [node.target], node.value
                if isinstance(node, ast.AugAssign):
                    value = None
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                targets = [node.target]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
            elif isinstance(node, ast.NamedExpr):
                targets, value = [node.target], node.value
            if not targets:
                continue
            scope = self.scope_of(node)
            line = node.target.lineno if isinstance(node, ast.comprehension) else node.lineno
            for target in targets:
                for leaf in _target_leaves(target):
                    single = value if leaf is target else None
                    bound.append((ast.unparse(leaf), line, scope, single))
        bound.sort(key=lambda b: b[1])
        return bound

    def value_at(self, text: str, line: int, scope: ast.AST | None = None) -> ast.AST | None:
        """The value last assigned to ``text`` before ``line`` (None if unknown)."""
        value = None
        for target, at, where, assigned in self.assignments:
            if at >= line:
                break
            if target == text and (scope is None or where is scope):
                value = assigned
        return value

    def assigned_between(self, text: str, scope: ast.AST, start: int, end: int) -> bool:
        """Whether ``text`` is bound in ``scope`` strictly between lines ``start`` and ``end``."""
        return any(
            target == text and where is scope and start < at < end
            for target, at, where, _ in self.assignments
        )


def _target_leaves(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [leaf for element in target.elts for leaf in _target_leaves(element)]
    if isinstance(target, ast.Starred):
        return _target_leaves(target.value)
    return [target]
