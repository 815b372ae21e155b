"""Static checks of a training script: the checkpointing and checkpoint-saving pitfalls that can
be seen in the source, without running it.

:func:`lint` parses the script with :mod:`ast` and reports findings with the same codes as
:func:`autockpt.diagnose` (docs/diagnostics.md lists them). Names are resolved through the
script's imports, so ``from torch.utils.checkpoint import checkpoint as ckpt`` and
``import torch.utils.checkpoint as cp`` are recognised alike.

The script is parsed once into a :class:`~autockpt.tools.script.Script`; :data:`RULE_SETS` then runs
the activation-checkpoint rules of this module (AC001-AC010) and the training-loop and
checkpoint-saving rules of :mod:`autockpt.tools.training_lint` (AC012-AC014), in that order.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autockpt.errors import InvalidArgumentError
from autockpt.tools.findings import Finding, Report
from autockpt.tools.script import DDP_CLASSES, Script
from autockpt.tools.training_lint import training_findings

__all__ = ["LintSyntaxError", "lint", "source_with_flag"]

_CHECKPOINT = "torch.utils.checkpoint.checkpoint"
_SEQUENTIAL = "torch.utils.checkpoint.checkpoint_sequential"
_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_WRAPPER = f"{_WRAPPER_MODULE}.checkpoint_wrapper"
_REENTRANT_IMPL = f"{_WRAPPER_MODULE}.CheckpointImpl.REENTRANT"
_GRAD_FN = frozenset({"torch.autograd.grad"})
_CHECKPOINT_FLAGS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug",
     "early_stop"}
)
_DATA_WORDS = ("loader", "dataset", "data", "batches")


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
        A :class:`~autockpt.tools.findings.Report` whose locations are ``file:line``.

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
    script = Script(tree, filename)
    return Report(tuple(f for rules in RULE_SETS for f in rules(script)), subject=filename)


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


class _CheckpointRules:
    """One pass of the activation-checkpoint rules over one script."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.checkpoints = [c for c in map(self._checkpoint_call, script.calls) if c is not None]
        self.grad_marks: list[tuple[str, int, ast.AST]] = sorted(
            ((name, node.lineno, script.scope_of(node)) for node in ast.walk(script.tree)
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
        return found

    # ----------------------------------------------------------------------- checkpoint calls

    def _checkpoint_call(self, node: ast.Call) -> _CheckpointCall | None:
        name = self.script.resolve(node.func)
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
            return _CheckpointCall(node, kind, self.script.scope_of(node), flag is not None or star,
                                   reentrant)
        if name == _WRAPPER:
            impl = keywords.get("checkpoint_impl", node.args[1] if len(node.args) > 1 else None)
            reentrant = impl is not None and self.script.resolve(impl) == _REENTRANT_IMPL
            return _CheckpointCall(node, "checkpoint_wrapper", self.script.scope_of(node), True,
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
                where=self.script.where(call.node),
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
                where=self.script.where(call.node),
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
        name = self.script.resolve(function)
        leaf = (name or "").rsplit(".", 1)[-1]
        if name is not None and name.startswith("torch.") and not leaf[:1].isupper():
            return False  # torch.relu, F.gelu...: nothing to train
        return True

    def _top_level_classes(self) -> set[str]:
        """Model classes the script builds outside any other module: their forward receives
        the data batch."""
        top: set[str] = set()
        for node in self.script.calls:
            if isinstance(node.func, ast.Name) and node.func.id in self.script.classes:
                if not any(isinstance(a, ast.ClassDef) for a in self.script.ancestors(node)):
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
        if loop is not None and not self.script.assigned_between(name, scope, loop.lineno, line):
            return ast.unparse(node)
        if base is not node:
            return None
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.name == "forward":
            owner = self.script.parents.get(scope)
            params = [a.arg for a in (*scope.args.posonlyargs, *scope.args.args,
                                       *scope.args.kwonlyargs)][1:]
            if isinstance(owner, ast.ClassDef) and owner.name in top_level and name in params \
                    and not self.script.assigned_between(name, scope, scope.lineno, line):
                return name
        return None

    def _data_loop(self, name: str, node: ast.AST) -> ast.For | None:
        for ancestor in self.script.ancestors(node):
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
            n.value.id for n in ast.walk(self.script.tree)
            if isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.value, ast.Name)
        }
        for node in self.script.calls:
            if self.script.resolve(node.func) in _GRAD_FN:
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
                    where=f"{self.script.filename}:{line}",
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
        value = self.script.value_at(name, line + 1)
        return isinstance(value, ast.Call) and (self.script.resolve(value.func) or "").endswith(
            "Parameter")

    def _is_scalar_dummy(self, name: str, line: int) -> bool:
        """``torch.empty((), requires_grad=True)``: a dummy whose gradient costs nothing."""
        value = self.script.value_at(name, line + 1)
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
                where=self.script.where(call.node),
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
        for node in self.script.calls:
            if self.script.resolve(node.func) == "autockpt.apply" and any(
                k.arg == "mode" and isinstance(k.value, ast.Constant)
                and k.value.value == "reentrant" for k in node.keywords
            ):
                reentrant.append(node)
        if not reentrant:
            return []
        reentrant.sort(key=lambda n: (n.lineno, n.col_offset))
        found = []
        for node in self.script.calls:
            if self.script.resolve(node.func) not in DDP_CLASSES:
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
                where=self.script.where(node),
                message="DistributedDataParallel with find_unused_parameters=True, and the "
                f"script uses reentrant checkpoint (line {reentrant[0].lineno}): the "
                "reentrant backward runs the checkpointed parameters' gradient hooks a second "
                "time, and DDP fails with \"Expected to mark a variable ready only once\".",
                fix="h = checkpoint(fn, x, use_reentrant=False)\n"
                "# or, if the set of used parameters is the same every step:\n"
                "model = DistributedDataParallel(model, static_graph=True)",
            ))
        return found


def _checkpoint_findings(script: Script) -> list[Finding]:
    """The AC006, AC001, AC002, AC009 and AC010 findings in ``script``, in that order."""
    return _CheckpointRules(script).findings()


RULE_SETS: tuple[Callable[[Script], list[Finding]], ...] = (_checkpoint_findings, training_findings)
"""What :func:`lint` runs on a script, in order: the activation-checkpoint rules here, then the
training-loop and checkpoint-saving rules of :mod:`autockpt.tools.training_lint`."""


# --------------------------------------------------------------------------- helpers


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
