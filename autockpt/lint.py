"""Static checks of a training script: the checkpointing and checkpoint-saving pitfalls that can
be seen in the source, without running it.

:func:`lint` parses the script with :mod:`ast` and reports findings with the same codes as
:func:`autockpt.diagnose` (docs/diagnostics.md lists them). Names are resolved through the
script's imports, so ``from torch.utils.checkpoint import checkpoint as ckpt`` and
``import torch.utils.checkpoint as cp`` are recognised alike.

# NOTE [ What a script shows and what it hides ]
Source alone cannot say whether a tensor requires grad, so the runtime checks that need that
(AC001, AC002) become patterns: a reentrant checkpoint whose tensor arguments are all *raw
input*, and an input given ``requires_grad`` and then passed to checkpoint. "Raw input" is
deliberately narrow, to stay quiet on correct code: a variable bound by a ``for`` loop over a
data loader (``for x, y in train_loader``) and not reassigned before the call, or a parameter
of the ``forward`` of a model class that the script builds itself outside any other module
(``model = Net()``), again not reassigned before the call. A block whose forward receives the
previous layer's output is never flagged. Everything else (which parameters get gradients,
which buffers move twice) needs the real run: :func:`autockpt.diagnose`.

Example:
    >>> import autockpt
    >>> report = autockpt.lint('''
    ... import torch
    ... from torch.utils.checkpoint import checkpoint
    ... def block(x):
    ...     return checkpoint(torch.relu, x)
    ... ''')
    >>> [(f.code, f.where) for f in report]
    [('AC006', '<source>:5')]
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autockpt.errors import InvalidArgumentError
from autockpt.findings import Finding, Report

__all__ = ["LintSyntaxError", "lint", "source_with_flag"]

_CHECKPOINT = "torch.utils.checkpoint.checkpoint"
_SEQUENTIAL = "torch.utils.checkpoint.checkpoint_sequential"
_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_WRAPPER = f"{_WRAPPER_MODULE}.checkpoint_wrapper"
_REENTRANT_IMPL = f"{_WRAPPER_MODULE}.CheckpointImpl.REENTRANT"
_DDP = frozenset({
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
})
_DP = frozenset({
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
})
_COMPILE = frozenset({"torch.compile"})
_SAVE = frozenset({"torch.save"})
_GRAD_FN = frozenset({"torch.autograd.grad"})
_CHECKPOINT_FLAGS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug",
     "early_stop"}
)
_DATA_WORDS = ("loader", "dataset", "data", "batches")
_NUMBER_CALLS = frozenset({"item", "tolist", "numpy", "detach", "cpu"})
_NUMBER_BUILTINS = frozenset({"float", "int", "round", "len", "bool"})
_NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})


class LintSyntaxError(InvalidArgumentError):
    """The script is not valid Python; ``lineno`` and ``offset`` say where.

    Attributes:
        filename: the script's path, or ``"<source>"`` for source text.
        lineno: the line of the error (1-based).
        offset: the column of the error (1-based), when known.
    """

    def __init__(self, message: str, *, fix: str, filename: str, lineno: int | None,
                 offset: int | None) -> None:
        self.filename = filename
        self.lineno = lineno
        self.offset = offset
        super().__init__(message, fix=fix)


def lint(path_or_source: str | os.PathLike[str]) -> Report:
    """Check a training script for checkpointing and checkpoint-saving pitfalls, statically.

    Nothing is imported or run: the script is parsed with :mod:`ast`. Codes found (see
    docs/diagnostics.md): AC001 (reentrant checkpoint on the raw input), AC002 (input given
    ``requires_grad`` for checkpoint), AC006 (no explicit ``use_reentrant``), AC009 (container
    or keyword tensors to a reentrant checkpoint), AC010 (DDP ``find_unused_parameters=True``
    with reentrant checkpoint), AC012 (loss tensor accumulated in a loop), AC013 (state_dict
    of a wrapped model) and AC014 (training checkpoint without optimizer state).

    Args:
        path_or_source: a path (``str`` ending in ``.py`` or naming a file, or a
            ``pathlib.Path``) or the source text itself.

    Returns:
        A :class:`~autockpt.findings.Report` whose locations are ``file:line``.

    Raises:
        InvalidArgumentError: not a path or a string, a path that is not a readable file, or
            empty source.
        LintSyntaxError: the script is not valid Python (an :class:`InvalidArgumentError`
            naming the line).

    Example:
        >>> import autockpt
        >>> source = '''
        ... for x, y in train_loader:
        ...     loss = criterion(model(x), y)
        ...     loss.backward()
        ...     total_loss += loss
        ... '''
        >>> [(f.code, f.severity, f.where) for f in autockpt.lint(source)]
        [('AC012', 'warning', '<source>:5')]
    """
    source, filename = _read(path_or_source)
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as err:
        where = f"{filename}:{err.lineno}" if err.lineno else filename
        column = f", column {err.offset}" if err.offset else ""
        raise LintSyntaxError(
            f"cannot lint {filename}: syntax error at line {err.lineno}{column}: {err.msg}",
            fix=f"fix the syntax at {where} (python -m py_compile shows the same error)",
            filename=filename,
            lineno=err.lineno,
            offset=err.offset,
        ) from err
    return Report(tuple(_Linter(tree, filename).findings()), subject=filename)


def _read(path_or_source: object) -> tuple[str, str]:
    """The source text and the name findings use for it."""
    if isinstance(path_or_source, os.PathLike):
        return _read_file(Path(path_or_source)), os.fspath(path_or_source)
    if not isinstance(path_or_source, str):
        fix = ("decode it first: autockpt.lint(data.decode())"
               if isinstance(path_or_source, (bytes, bytearray)) else
               "pass a path such as 'train.py' or the script's source text")
        raise InvalidArgumentError(
            f"lint expects a path or source text, got {type(path_or_source).__name__}", fix=fix
        )
    text = path_or_source
    one_line = "\n" not in text
    if one_line and (text.strip().endswith(".py") or os.path.isfile(text)):
        return _read_file(Path(text.strip())), text.strip()
    if not text.strip():
        raise InvalidArgumentError(
            "lint was given empty source text", fix="pass the script's path or its source"
        )
    return text, "<source>"


def _read_file(path: Path) -> str:
    if path.is_dir():
        raise InvalidArgumentError(
            f"{path} is a directory; lint checks one script",
            fix="pass a .py file: autockpt.lint('train.py')",
        )
    if not path.is_file():
        raise InvalidArgumentError(
            f"no such file to lint: {path}",
            fix="pass the path of an existing .py file, or the source text itself",
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(
            f"cannot read {path}: {type(err).__name__}: {err}",
            fix="pass a readable UTF-8 Python file",
        ) from err


# --------------------------------------------------------------------------- the linter


@dataclass(frozen=True)
class _CheckpointCall:
    """A call to checkpoint, checkpoint_sequential or checkpoint_wrapper in the script."""

    node: ast.Call
    """The call."""
    kind: str
    """``"checkpoint"``, ``"checkpoint_sequential"`` or ``"checkpoint_wrapper"``."""
    scope: ast.AST
    """The function (or module) the call is in."""
    explicit: bool
    """Whether ``use_reentrant`` (or ``checkpoint_impl``) is given, or ``**kwargs`` may give it."""
    reentrant: bool | None
    """True or False when known from the source (missing means True), None when computed."""


class _Linter:
    """One pass over one parsed script."""

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
        self.checkpoints = [c for c in map(self._checkpoint_call, self.calls) if c is not None]
        self.grad_marks: list[tuple[str, int, ast.AST]] = sorted(
            ((name, node.lineno, self.scope_of(node)) for node in ast.walk(tree)
             if (name := _requires_grad_target(node)) is not None),
            key=lambda mark: mark[1],
        )

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        found += self._explicit_flag()
        found += self._raw_input()
        found += self._grad_only_inputs()
        found += self._containers()
        found += self._ddp_unused()
        found += self._accumulated_loss()
        found += self._wrapped_state_dicts()
        found += self._optimizer_state()
        return found

    # ----------------------------------------------------------------------- names

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
        return f"{self.filename}:{getattr(node, 'lineno', 0)}"

    def scope_of(self, node: ast.AST) -> ast.AST:
        parent = self.parents.get(node)
        while parent is not None and not isinstance(
            parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        ):
            parent = self.parents.get(parent)
        return parent if parent is not None else self.tree

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
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
        return any(
            target == text and where is scope and start < at < end
            for target, at, where, _ in self.assignments
        )

    # ----------------------------------------------------------------------- checkpoint calls

    def _checkpoint_call(self, node: ast.Call) -> _CheckpointCall | None:
        name = self.resolve(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        star = any(k.arg is None for k in node.keywords)
        if name in (_CHECKPOINT, _SEQUENTIAL):
            flag = keywords.get("use_reentrant")
            if flag is None and name == _SEQUENTIAL and len(node.args) > 3:
                flag = node.args[3]
            reentrant: bool | None = True
            if flag is not None:
                reentrant = flag.value if isinstance(flag, ast.Constant) and isinstance(
                    flag.value, bool) else None
            elif star:
                reentrant = None
            kind = "checkpoint" if name == _CHECKPOINT else "checkpoint_sequential"
            return _CheckpointCall(node, kind, self.scope_of(node), flag is not None or star,
                                   reentrant)
        if name == _WRAPPER:
            impl = keywords.get("checkpoint_impl", node.args[1] if len(node.args) > 1 else None)
            reentrant = impl is not None and self.resolve(impl) == _REENTRANT_IMPL
            return _CheckpointCall(node, "checkpoint_wrapper", self.scope_of(node), True,
                                   reentrant)
        return None

    def _explicit_flag(self) -> list[Finding]:
        found = []
        for call in self.checkpoints:
            if call.explicit or call.kind == "checkpoint_wrapper":
                continue
            fix = ("checkpoint_sequential(functions, segments, x, use_reentrant=False)"
                   if call.kind == "checkpoint_sequential" else
                   _with_flag(call.node, "use_reentrant=False"))
            found.append(Finding(
                code="AC006",
                severity="warning",
                where=self.where(call.node),
                message=f"{call.kind}() is called without use_reentrant: PyTorch then warns and "
                "picks the reentrant variant, which gives no gradient to the function's "
                "parameters when no input requires grad, drops keyword and container "
                "tensors, and does not work with torch.autograd.grad. Say which one you "
                "mean; the non-reentrant one is recommended.",
                fix=fix,
            ))
        return found

    def _tensor_arguments(self, call: _CheckpointCall) -> list[ast.AST]:
        if call.kind == "checkpoint":
            return list(call.node.args[1:])
        if call.kind == "checkpoint_sequential":
            return list(call.node.args[2:3])
        return []

    # ----------------------------------------------------------------------- AC001

    def _raw_input(self) -> list[Finding]:
        found = []
        top_level = self._top_level_classes()
        for call in self.checkpoints:
            if call.reentrant is not True or call.kind == "checkpoint_wrapper":
                continue
            arguments = self._tensor_arguments(call)
            if not arguments or not self._trainable_looking(call):
                continue
            raw = [self._raw_name(a, call, top_level) for a in arguments]
            if any(r is None for r in raw):
                continue
            names = ", ".join(ast.unparse(a) for a in arguments)
            fix = (("checkpoint_sequential(functions, segments, x, use_reentrant=False)"
                    if call.kind == "checkpoint_sequential" else
                    _with_flag(call.node, "use_reentrant=False"))
                   + "\n# or keep reentrant and let autockpt add the dummy input it needs:\n"
                   "model = autockpt.apply(model, budget_mb=300, example_inputs=(x,), "
                   "mode=\"reentrant\")")
            found.append(Finding(
                code="AC001",
                severity="error",
                where=self.where(call.node),
                message=f"reentrant {call.kind}() on the raw input ({names}): input data does "
                "not require grad, so the checkpoint's output does not either, and the "
                "parameters inside it silently get no gradient.",
                fix=fix,
            ))
        return found

    def _trainable_looking(self, call: _CheckpointCall) -> bool:
        function = call.node.args[0] if call.node.args else None
        if function is None:
            return False
        name = self.resolve(function)
        leaf = (name or "").rsplit(".", 1)[-1]
        if name is not None and name.startswith("torch.") and not leaf[:1].isupper():
            return False  # torch.relu, F.gelu...: nothing to train
        return True

    def _top_level_classes(self) -> set[str]:
        """Model classes the script builds outside any other module: their forward receives
        the data batch."""
        top: set[str] = set()
        for node in self.calls:
            if isinstance(node.func, ast.Name) and node.func.id in self.classes:
                if not any(isinstance(a, ast.ClassDef) for a in self.ancestors(node)):
                    top.add(node.func.id)
        return top

    def _raw_name(self, node: ast.AST, call: _CheckpointCall, top_level: set[str]) -> str | None:
        """The name of the raw input ``node`` is, or None if it may require grad."""
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("to", "cuda", "float", "half", "bfloat16", "contiguous"):
            node = node.func.value  # x.to(device) is still the raw input
        base = node
        while isinstance(base, (ast.Subscript, ast.Attribute)):
            base = base.value
        if not isinstance(base, ast.Name):
            return None
        name = base.id
        scope = call.scope
        line = call.node.lineno
        if any(marked == name and where is scope and at < line
               for marked, at, where in self.grad_marks):
            return None  # given requires_grad on purpose: AC002's business
        loop = self._data_loop(name, call.node)
        if loop is not None and not self.assigned_between(name, scope, loop.lineno, line):
            return ast.unparse(node)
        if base is not node:
            return None
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.name == "forward":
            owner = self.parents.get(scope)
            params = [a.arg for a in (*scope.args.posonlyargs, *scope.args.args,
                                       *scope.args.kwonlyargs)][1:]
            if isinstance(owner, ast.ClassDef) and owner.name in top_level and name in params \
                    and not self.assigned_between(name, scope, scope.lineno, line):
                return name
        return None

    def _data_loop(self, name: str, node: ast.AST) -> ast.For | None:
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return None
            if isinstance(ancestor, ast.For) and name in {
                n.id for n in ast.walk(ancestor.target) if isinstance(n, ast.Name)
            }:
                text = ast.unparse(ancestor.iter).lower()
                return ancestor if any(word in text for word in _DATA_WORDS) else None
        return None

    # ----------------------------------------------------------------------- AC002

    def _grad_only_inputs(self) -> list[Finding]:
        read_grad = {
            n.value.id for n in ast.walk(self.tree)
            if isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.value, ast.Name)
        }
        for node in self.calls:
            if self.resolve(node.func) in _GRAD_FN:
                read_grad |= {n.id for a in node.args for n in ast.walk(a)
                              if isinstance(n, ast.Name)}
        found = []
        for name, line, scope in self.grad_marks:
            if name in read_grad or self._is_parameter(name, line) or \
                    self._is_scalar_dummy(name, line):
                continue
            for call in self.checkpoints:
                arguments = self._tensor_arguments(call)
                if call.scope is not scope or call.node.lineno < line or not any(
                    isinstance(a, ast.Name) and a.id == name for a in arguments
                ):
                    continue
                found.append(Finding(
                    code="AC002",
                    severity="warning",
                    where=f"{self.filename}:{line}",
                    message=f"`{name}` is made to require grad and then passed to "
                    f"{call.kind}() at line {call.node.lineno}, and its .grad is never read: "
                    "backward computes a gradient for it every step and throws it away. "
                    "Inputs are often given requires_grad only so that a reentrant "
                    "checkpoint produces gradients; the non-reentrant one needs no such trick.",
                    fix=f"# drop the requires_grad on `{name}`:\n"
                    f"{_with_flag(call.node, 'use_reentrant=False')}",
                ))
                break
        return found

    def _is_parameter(self, name: str, line: int) -> bool:
        value = self.value_at(name, line + 1)
        return isinstance(value, ast.Call) and (self.resolve(value.func) or "").endswith(
            "Parameter")

    def _is_scalar_dummy(self, name: str, line: int) -> bool:
        """``torch.empty((), requires_grad=True)``: a dummy whose gradient costs nothing."""
        value = self.value_at(name, line + 1)
        if not isinstance(value, ast.Call) or not value.args:
            return False
        shape = value.args[0]
        return (isinstance(shape, ast.Tuple) and not shape.elts) or (
            isinstance(shape, ast.Constant) and shape.value == 1 and len(value.args) == 1)

    # ----------------------------------------------------------------------- AC009

    def _containers(self) -> list[Finding]:
        found = []
        for call in self.checkpoints:
            if call.kind != "checkpoint" or call.reentrant is not True:
                continue
            containers = [ast.unparse(a) for a in call.node.args[1:]
                          if isinstance(a, (ast.Tuple, ast.List, ast.Dict))]
            keywords = [k.arg for k in call.node.keywords
                        if k.arg is not None and k.arg not in _CHECKPOINT_FLAGS]
            if not containers and not keywords:
                continue
            parts = []
            if containers:
                parts.append(f"tensors inside a container ({', '.join(containers)})")
            if keywords:
                parts.append(f"keyword arguments ({', '.join(keywords)})")
            found.append(Finding(
                code="AC009",
                severity="error",
                where=self.where(call.node),
                message=f"reentrant checkpoint given {' and '.join(parts)}: the reentrant "
                "variant only tracks tensors passed directly as positional arguments, so "
                "gradients never flow back through the others (keyword arguments make it "
                "raise ValueError).",
                fix="# pass each tensor positionally, or use the non-reentrant variant:\n"
                "h = checkpoint(fn, a, b, use_reentrant=True)  # def fn(a, b): ...\n"
                "h = checkpoint(fn, (a, b), mask=mask, use_reentrant=False)",
            ))
        return found

    # ----------------------------------------------------------------------- AC010

    def _ddp_unused(self) -> list[Finding]:
        reentrant = [c.node for c in self.checkpoints if c.reentrant is True]
        for node in self.calls:
            if self.resolve(node.func) == "autockpt.apply" and any(
                k.arg == "mode" and isinstance(k.value, ast.Constant)
                and k.value.value == "reentrant" for k in node.keywords
            ):
                reentrant.append(node)
        if not reentrant:
            return []
        reentrant.sort(key=lambda n: (n.lineno, n.col_offset))
        found = []
        for node in self.calls:
            if self.resolve(node.func) not in _DDP:
                continue
            flags = {k.arg: k.value for k in node.keywords if k.arg is not None}
            unused = flags.get("find_unused_parameters")
            static = flags.get("static_graph")
            if not (isinstance(unused, ast.Constant) and unused.value is True):
                continue
            if isinstance(static, ast.Constant) and static.value is True:
                continue
            found.append(Finding(
                code="AC010",
                severity="error",
                where=self.where(node),
                message="DistributedDataParallel with find_unused_parameters=True, and the "
                f"script uses reentrant checkpoint (line {reentrant[0].lineno}): the "
                "reentrant backward runs the checkpointed parameters' gradient hooks a second "
                "time, and DDP fails with \"Expected to mark a variable ready only once\".",
                fix="h = checkpoint(fn, x, use_reentrant=False)\n"
                "# or, if the set of used parameters is the same every step:\n"
                "model = DistributedDataParallel(model, static_graph=True)",
            ))
        return found

    # ----------------------------------------------------------------------- AC012

    def _accumulated_loss(self) -> list[Finding]:
        found = []
        backward_names = {
            (self.scope_of(n), n.func.value.id) for n in self.calls
            if isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
            and isinstance(n.func.value, ast.Name)
        }
        for node in ast.walk(self.tree):
            pair = _accumulation(node)
            if pair is None:
                continue
            total, loss = pair
            scope = self.scope_of(node)
            if (scope, total) in backward_names or not self._in_grad_loop(node):
                continue
            is_loss = (scope, loss) in backward_names
            if not is_loss and "loss" in loss.lower():
                value = self.value_at(loss, node.lineno, scope)  # type: ignore[attr-defined]
                is_loss = isinstance(value, (ast.Call, ast.BinOp)) and not _plain_number(value)
            if not is_loss:
                continue
            found.append(Finding(
                code="AC012",
                severity="warning",
                where=self.where(node),
                message=f"`{ast.unparse(node).strip()}` keeps the loss tensor `{loss}`, and "
                "with it the autograd graph of every step (all activations saved for "
                "backward), alive until the loop ends: memory grows every step.",
                fix=f"{total} += {loss}.item()  # or {loss}.detach()",
            ))
        return found

    def _in_grad_loop(self, node: ast.AST) -> bool:
        in_loop = False
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                break
            if isinstance(ancestor, (ast.For, ast.While, ast.AsyncFor)):
                in_loop = True
            if isinstance(ancestor, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call)
                and self.resolve(i.context_expr.func) in _NO_GRAD for i in ancestor.items
            ):
                return False  # no graph is recorded under no_grad
        return in_loop

    # ----------------------------------------------------------------------- AC013

    def _wrapper_of(self, text: str, line: int) -> str | None:
        """The wrapper (DataParallel, DDP, torch.compile) ``text`` holds at ``line``."""
        if text.endswith((".module", "._orig_mod")):
            return None
        value = self.value_at(text, line)
        if isinstance(value, ast.Call):
            name = self.resolve(value.func)
            if name in _DP:
                return "DataParallel"
            if name in _DDP:
                return "DistributedDataParallel"
            if name in _COMPILE:
                return "torch.compile"
        return None

    def _state_dict_owners(self, node: ast.AST) -> list[ast.Call]:
        """``X.state_dict()`` calls inside ``node`` (through a dict assigned to a name)."""
        values = [node]
        if isinstance(node, ast.Name):
            values += self._dict_values(node)
        found = []
        for value in values:
            for n in ast.walk(value):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                        n.func.attr == "state_dict":
                    found.append(n)
        return found

    def _dict_values(self, name: ast.Name) -> list[ast.AST]:
        """What a dict held in ``name`` was built from before its use: the dict literal and
        the ``name["key"] = value`` assignments."""
        line = name.lineno
        scope = self.scope_of(name)
        parts: list[ast.AST] = []
        value = self.value_at(name.id, line, scope)
        if value is not None:
            parts.append(value)
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and node.lineno < line:
                for target in node.targets:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                            and target.value.id == name.id:
                        parts += [target.slice, node.value]
        return parts

    def _wrapped_state_dicts(self) -> list[Finding]:
        saves: list[tuple[ast.Call, ast.Call, str | None]] = []
        loads: list[tuple[ast.Call, str | None]] = []
        optimizers = self._optimizers()
        for node in self.calls:
            if self.resolve(node.func) in _SAVE and node.args:
                for owner in self._state_dict_owners(node.args[0]):
                    text = ast.unparse(owner.func.value)  # type: ignore[attr-defined]
                    if text not in optimizers:
                        saves.append((node, owner, self._wrapper_of(text, node.lineno)))
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "load_state_dict":
                text = ast.unparse(node.func.value)
                if text not in optimizers:
                    loads.append((node, self._wrapper_of(text, node.lineno)))
        wrapped_saves = [s for s in saves if s[2] is not None]
        bare_saves = [s for s in saves if s[2] is None]
        found = []
        for save, owner, wrapper in wrapped_saves:
            text = ast.unparse(owner.func.value)  # type: ignore[attr-defined]
            prefix = "_orig_mod." if wrapper == "torch.compile" else "module."
            inner = "_orig_mod" if wrapper == "torch.compile" else "module"
            found.append(Finding(
                code="AC013",
                severity="warning",
                where=self.where(save),
                message=f"saves the state_dict of `{text}`, which is wrapped in {wrapper}: "
                f"every key starts with '{prefix}', so loading it into the bare model fails "
                "with missing and unexpected keys (or, with strict=False, loads nothing).",
                fix=f"torch.save({text}.{inner}.state_dict(), path)",
            ))
        for load, wrapper in loads:
            # Only a save and a load in the same function are known to share the file.
            scope = self.scope_of(load)
            wrapped_here = [s for s in wrapped_saves if self.scope_of(s[0]) is scope]
            bare_here = [s for s in bare_saves if self.scope_of(s[0]) is scope]
            if wrapper is None and wrapped_here:
                save = wrapped_here[0][0]
                found.append(Finding(
                    code="AC013",
                    severity="warning",
                    where=self.where(load),
                    message="loads into a bare model a state_dict that this script saves from "
                    f"a wrapped model (line {save.lineno}): its keys carry the wrapper's "
                    "prefix and do not match.",
                    fix="from torch.nn.modules.utils import "
                    "consume_prefix_in_state_dict_if_present\n"
                    "state = torch.load(path)\n"
                    "consume_prefix_in_state_dict_if_present(state, \"module.\")  # "
                    "or \"_orig_mod.\"\n"
                    "model.load_state_dict(state)",
                ))
            elif wrapper is not None and bare_here and not wrapped_here:
                text = ast.unparse(load.func.value)  # type: ignore[attr-defined]
                inner = "_orig_mod" if wrapper == "torch.compile" else "module"
                found.append(Finding(
                    code="AC013",
                    severity="warning",
                    where=self.where(load),
                    message=f"loads into `{text}`, wrapped in {wrapper}, a state_dict that "
                    f"this script saves from a bare model (line {bare_here[0][0].lineno}): "
                    "the wrapper expects every key with its prefix.",
                    fix=f"{text}.{inner}.load_state_dict(torch.load(path))",
                ))
        return found

    # ----------------------------------------------------------------------- AC014

    def _optimizers(self, stateful: bool = False) -> dict[str, str]:
        """Names holding an optimizer (``opt = torch.optim.Adam(...)``) -> its class; with
        ``stateful``, only those with state to lose (plain SGD without momentum has none)."""
        found: dict[str, str] = {}
        for target, _, _, value in self.assignments:
            if not isinstance(value, ast.Call):
                continue
            name = self.resolve(value.func) or ""
            cls = name.rsplit(".", 1)[-1]
            if not name.startswith("torch.optim.") or "lr_scheduler" in name or \
                    not cls[:1].isupper():
                continue
            if stateful and cls == "SGD":
                momentum = {k.arg: k.value for k in value.keywords}.get("momentum")
                if momentum is None or (isinstance(momentum, ast.Constant)
                                        and not momentum.value):
                    continue
            found.setdefault(target, cls)
        return found

    def _stateful_helpers(self) -> set[str]:
        """Names holding an LR scheduler or a gradient scaler: not model state either."""
        helpers = set()
        for target, _, _, value in self.assignments:
            if isinstance(value, ast.Call):
                name = self.resolve(value.func) or ""
                if "lr_scheduler" in name or name.endswith("GradScaler"):
                    helpers.add(target)
        return helpers

    def _optimizer_state(self) -> list[Finding]:
        stateful = self._optimizers(stateful=True)
        if not stateful:
            return []
        optimizers = self._optimizers()
        helpers = self._stateful_helpers()
        found = []
        for node in self.calls:
            if self.resolve(node.func) not in _SAVE or not node.args:
                continue
            payload = node.args[0]
            parts: list[ast.AST] = [payload]
            if isinstance(payload, ast.Name):
                parts = self._dict_values(payload)
            if not any(_is_dict(p) for p in parts):
                continue  # saving the weights alone (for inference) is fine
            owners = [ast.unparse(c.func.value)  # type: ignore[attr-defined]
                      for p in parts for c in self._state_dict_owners(p)]
            keys = [k.value.lower() for p in parts for k in ast.walk(p)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            has_model = any(o not in optimizers and o not in helpers for o in owners)
            has_optimizer = any(o in optimizers for o in owners) or any(
                "optim" in k for k in keys)
            if has_model and not has_optimizer:
                name, cls = next(iter(stateful.items()))
                found.append(Finding(
                    code="AC014",
                    severity="warning",
                    where=self.where(node),
                    message="saves a training checkpoint with the model's state but not the "
                    f"optimizer's, while the script trains with `{name}` ({cls}): resuming "
                    "from it restarts the optimizer's state (Adam's moments, SGD's momentum) "
                    "from zero, and the loss jumps.",
                    fix=f"torch.save({{\"model\": model.state_dict(), \"optimizer\": "
                    f"{name}.state_dict(), \"epoch\": epoch}}, path)\n"
                    f"# resume: {name}.load_state_dict(checkpoint[\"optimizer\"])",
                ))
        return found


# --------------------------------------------------------------------------- helpers


def _target_leaves(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [leaf for element in target.elts for leaf in _target_leaves(element)]
    if isinstance(target, ast.Starred):
        return _target_leaves(target.value)
    return [target]


def source_with_flag(line: str, flag: str) -> str | None:
    """The checkpoint call on a line of source, rewritten with ``flag`` (``use_reentrant=False``);
    None if the line holds no complete checkpoint call.

    Example:
        >>> source_with_flag("    h = checkpoint(block, h)  # why", "use_reentrant=False")
        'checkpoint(block, h, use_reentrant=False)'
    """
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:  # the call spans several lines
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in ("checkpoint", "checkpoint_sequential"):
                return _with_flag(node, flag)
    return None


def _with_flag(call: ast.Call, flag: str) -> str:
    """The call's source with ``use_reentrant`` set to ``flag``."""
    keywords = [k for k in call.keywords if k.arg != "use_reentrant"]
    name, _, value = flag.partition("=")
    rewritten = ast.Call(
        func=call.func,
        args=call.args,
        keywords=[*keywords, ast.keyword(arg=name, value=ast.Constant(value == "True"))],
    )
    return ast.unparse(rewritten)


def _requires_grad_target(node: ast.AST) -> str | None:
    """The name a statement makes require grad: ``x.requires_grad_()``,
    ``x.requires_grad = True``, ``x = y.detach().requires_grad_()`` or
    ``x = torch.randn(..., requires_grad=True)``."""
    if isinstance(node, ast.Expr) and _is_requires_grad_call(node.value):
        base = node.value.func.value  # type: ignore[attr-defined]
        return base.id if isinstance(base, ast.Name) else None
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Attribute) and target.attr == "requires_grad" and \
                isinstance(target.value, ast.Name) and isinstance(node.value, ast.Constant) \
                and node.value.value is True:
            return target.value.id
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Call):
            value = node.value
            if _is_requires_grad_call(value):
                return target.id
            if any(k.arg == "requires_grad" and isinstance(k.value, ast.Constant)
                   and k.value.value is True for k in value.keywords):
                return target.id
    return None


def _is_requires_grad_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "requires_grad_"):
        return False
    flags = [*node.args, *(k.value for k in node.keywords)]
    return not flags or (isinstance(flags[0], ast.Constant) and flags[0].value is True)


def _accumulation(node: ast.AST) -> tuple[str, str] | None:
    """``(total, loss)`` for ``total += loss``, ``total = total + loss`` and
    ``totals.append(loss)``."""
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and \
            isinstance(node.target, ast.Name) and isinstance(node.value, ast.Name):
        return node.target.id, node.value.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
            isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.BinOp) and \
            isinstance(node.value.op, ast.Add):
        total = node.targets[0].id
        left, right = node.value.left, node.value.right
        if isinstance(left, ast.Name) and isinstance(right, ast.Name):
            if left.id == total:
                return total, right.id
            if right.id == total:
                return total, left.id
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        if isinstance(call.func, ast.Attribute) and call.func.attr == "append" and \
                isinstance(call.func.value, ast.Name) and len(call.args) == 1 and \
                isinstance(call.args[0], ast.Name):
            return call.func.value.id, call.args[0].id
    return None


def _plain_number(value: ast.AST) -> bool:
    """Whether an expression turns a tensor into a Python number or a detached tensor."""
    if not isinstance(value, ast.Call):
        return False
    if isinstance(value.func, ast.Attribute):
        return value.func.attr in _NUMBER_CALLS
    return isinstance(value.func, ast.Name) and value.func.id in _NUMBER_BUILTINS


def _is_dict(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
    )
