"""The static checks of a training loop and of how it saves: a loss tensor accumulated across
steps (AC012), a state_dict saved or loaded through a wrapper's key prefix (AC013), and a
training checkpoint without the optimizer state (AC014).

They run as part of :func:`autockpt.lint`, after the activation-checkpoint rules, on the same
parsed :class:`~autockpt.tools.script.Script`; docs/diagnostics.md describes each code.

Example:
    >>> import ast
    >>> from autockpt.tools.script import Script
    >>> source = '''
    ... import torch
    ... model = torch.nn.DataParallel(net)
    ... torch.save(model.state_dict(), "weights.pt")
    ... '''
    >>> [(f.code, f.where) for f in training_findings(Script(ast.parse(source), "train.py"))]
    [('AC013', 'train.py:4')]
"""

from __future__ import annotations

import ast

from autockpt.tools.findings import Finding
from autockpt.tools.script import DDP_CLASSES, Script

__all__ = ["training_findings"]

_DP = frozenset({
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
})
_COMPILE = frozenset({"torch.compile"})
_SAVE = frozenset({"torch.save"})
_NUMBER_CALLS = frozenset({"item", "tolist", "numpy", "detach", "cpu"})
_NUMBER_BUILTINS = frozenset({"float", "int", "round", "len", "bool"})
_NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})


def training_findings(script: Script) -> list[Finding]:
    """The AC012, AC013 and AC014 findings in ``script``, in that order."""
    return _TrainingRules(script).findings()


class _TrainingRules:
    """One pass of the training-loop and checkpoint-saving rules over one script."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        found += self._accumulated_loss()
        found += self._wrapped_state_dicts()
        found += self._optimizer_state()
        return found

    # ----------------------------------------------------------------------- AC012

    def _accumulated_loss(self) -> list[Finding]:
        found = []
        backward_names = {
            (self.script.scope_of(n), n.func.value.id) for n in self.script.calls
            if isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
            and isinstance(n.func.value, ast.Name)
        }
        for node in ast.walk(self.script.tree):
            pair = _accumulation(node)
            if pair is None:
                continue
            total, loss = pair
            scope = self.script.scope_of(node)
            if (scope, total) in backward_names or not self._in_grad_loop(node):
                continue
            is_loss = (scope, loss) in backward_names
            if not is_loss and "loss" in loss.lower():
                value = self.script.value_at(loss, node.lineno, scope)  # type: ignore[attr-defined]
                is_loss = isinstance(value, (ast.Call, ast.BinOp)) and not _plain_number(value)
            if not is_loss:
                continue
            found.append(Finding(
                code="AC012",
                severity="warning",
                where=self.script.where(node),
                message=f"`{ast.unparse(node).strip()}` keeps the loss tensor `{loss}`, and "
                "with it the autograd graph of every step (all activations saved for "
                "backward), alive until the loop ends: memory grows every step.",
                fix=f"{total} += {loss}.item()  # or {loss}.detach()",
            ))
        return found

    def _in_grad_loop(self, node: ast.AST) -> bool:
        in_loop = False
        for ancestor in self.script.ancestors(node):
            if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                break
            if isinstance(ancestor, (ast.For, ast.While, ast.AsyncFor)):
                in_loop = True
            if isinstance(ancestor, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call)
                and self.script.resolve(i.context_expr.func) in _NO_GRAD for i in ancestor.items
            ):
                return False  # no graph is recorded under no_grad
        return in_loop

    # ----------------------------------------------------------------------- AC013

    def _wrapper_of(self, text: str, line: int) -> str | None:
        """The wrapper (DataParallel, DDP, torch.compile) ``text`` holds at ``line``."""
        if text.endswith((".module", "._orig_mod")):
            return None
        value = self.script.value_at(text, line)
        if isinstance(value, ast.Call):
            name = self.script.resolve(value.func)
            if name in _DP:
                return "DataParallel"
            if name in DDP_CLASSES:
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
        scope = self.script.scope_of(name)
        parts: list[ast.AST] = []
        value = self.script.value_at(name.id, line, scope)
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
        for node in self.script.calls:
            if self.script.resolve(node.func) in _SAVE and node.args:
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
                where=self.script.where(save),
                message=f"saves the state_dict of `{text}`, which is wrapped in {wrapper}: "
                f"every key starts with '{prefix}', so loading it into the bare model fails "
                "with missing and unexpected keys (or, with strict=False, loads nothing).",
                fix=f"torch.save({text}.{inner}.state_dict(), path)",
            ))
        for load, wrapper in loads:
            # Only a save and a load in the same function are known to share the file.
            scope = self.script.scope_of(load)
            wrapped_here = [s for s in wrapped_saves if self.script.scope_of(s[0]) is scope]
            bare_here = [s for s in bare_saves if self.script.scope_of(s[0]) is scope]
            if wrapper is None and wrapped_here:
                save = wrapped_here[0][0]
                found.append(Finding(
                    code="AC013",
                    severity="warning",
                    where=self.script.where(load),
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
                    where=self.script.where(load),
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
        for target, _, _, value in self.script.assignments:
            if not isinstance(value, ast.Call):
                continue
            name = self.script.resolve(value.func) or ""
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
        for target, _, _, value in self.script.assignments:
            if isinstance(value, ast.Call):
                name = self.script.resolve(value.func) or ""
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
        for node in self.script.calls:
            if self.script.resolve(node.func) not in _SAVE or not node.args:
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
                    where=self.script.where(node),
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
