"""One profile for every shape: the profile taken once on symbolic sizes, evaluated per shape.

NOTE [ One profile for every shape ]
A fine-tuning loop changes shape nearly every batch (dynamic padding, multi-scale images), and
a plan priced at one shape does not serve a larger one. Profiling each new shape on fake
tensors costs a few tenths of a second for a small transformer on a CPU, more than its
training step. But for one graph, what the profile measures is a function of the input sizes:
a storage's bytes are a product of sizes, an op's FLOPs a polynomial in them, a working set a
sum of storages, and a node's peak the largest of a few such sums. So the profile runs once
with the input sizes as symbols of a ``ShapeEnv`` (every dimension of 2 or more of every input
tensor, one symbol per distinct size): fake tensors then carry expressions such as
``1024*s0*s1``, and every number of the :class:`~autockpt.profiling.stats.Profile` comes out
as an expression in the symbols. Where the run compares two sizes (the larger of two working
sets, a view that must divide, a branch of the model), the ``ShapeEnv`` takes the answer at
the profiled sizes and records it as a guard, such as
``144*s1**2 + 12288*s1 > 80*s1**2 + 16384*s1``; where something needs a plain int of a size
(a kernel that specialises, a model that branches on a value), it fixes the symbol to that
int. The expressions are therefore exact wherever every guard holds and every fixed symbol
has its value: there, a new shape's profile is an evaluation of a few dozen distinct
expressions (:meth:`ShapeFormula.at`), equal to what profiling that shape would measure
(tests/test_symbolic_profile.py compares them node by node). Elsewhere ``at`` returns
``None`` and the shape is profiled as before.

Sizes 0 and 1 stay fixed (they change broadcasting, so torch specialises them anyway), and so
does a call whose sizes break the symbols' pattern (two sizes that were one symbol because
they were equal, now different).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.functions import Max
from torch.utils._sympy.printers import PythonPrinter

from autockpt.profiling.stats import Profile

__all__ = ["SymbolicInputs", "ShapeFormula", "formula_of", "larger", "same"]

Shapes = tuple[tuple[int, ...], ...]


# NOTE [ The larger of two sizes, without comparing them ]
# A node's peak is the largest of the working sets its ops reach, one ``larger`` per output
# of every op. Of symbolic sizes a ``torch.sym_max`` holds at every shape, but a chain of
# them grows into one ``Max`` of every working set the node reached: sympy compares each new
# argument with the others (a millisecond and more per call once there are dozens), and the
# ShapeEnv's ``simplify`` of the profile's numbers compares them all again (together about a
# third of a symbolic profile). Most of those arguments are below another at every shape:
# a working set that only grew since (``live - freed`` between two releases). Where the
# difference of two expressions is a polynomial in the sizes with no negative coefficient,
# the first is at least the second at every shape (sizes are not negative), which
# ``_at_least`` reads off the difference's terms without asking sympy to prove anything. So
# ``larger`` keeps of the ``Max`` only the arguments no other one is known to be above: the
# same value at every shape, of a handful of arguments, no guard recorded. Two that neither
# bounds (``144*s1**2 + 12288*s1`` against ``80*s1**2 + 16384*s1``) both stay.


def larger(a: Any, b: Any) -> Any:
    """``max(a, b)``; of symbolic sizes, their symbolic maximum, which holds at every shape,
    where ``max`` would compare them at the profiled one and guard on the answer (NOTE [ The
    larger of two sizes, without comparing them ]).

    Example:
        >>> larger(3, 5)
        5
    """
    if not (isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)):
        return max(a, b)
    ea, eb = _expr(a), _expr(b)
    parts = ea.args if isinstance(ea, Max) else (ea,)
    if any(_at_least(part, eb) for part in parts):
        return a
    kept = tuple(part for part in parts if not _at_least(eb, part))
    if not kept:
        return b
    # Built as it stands: sympy's own ``Max`` would compare the arguments again. What was
    # dropped is below ``b``, so the hint (the value at the profiled sizes) is the larger one.
    node = (a if isinstance(a, torch.SymInt) else b).node
    expr = Max(*kept, eb, evaluate=False)
    return torch.SymInt(type(node)(expr, node.shape_env, int, max(_hint(a), _hint(b))))


def _expr(value: Any) -> sympy.Expr:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)


def _hint(value: Any) -> int:
    return int(value.node.hint) if isinstance(value, torch.SymInt) else int(value)


@functools.lru_cache(maxsize=8192)
def _terms(expr: sympy.Expr) -> dict[sympy.Expr, Any]:
    return dict(expr.as_coefficients_dict())


@functools.lru_cache(maxsize=8192)
def _at_least(x: sympy.Expr, y: sympy.Expr) -> bool:
    """Whether ``x >= y`` at every size, read off the terms of ``x - y``: true where it is a
    polynomial in the sizes without a negative coefficient (NOTE [ The larger of two sizes,
    without comparing them ]); false where that does not show it."""
    tx, ty = _terms(x), _terms(y)
    for term in (*tx, *(t for t in ty if t not in tx)):
        difference = tx.get(term, 0) - ty.get(term, 0)
        if difference != 0 and (difference < 0 or not (term == 1 or _monomial(term))):
            return False
    return True


@functools.lru_cache(maxsize=8192)
def _monomial(term: sympy.Expr) -> bool:
    """Whether ``term`` is a product of powers of non-negative symbols (sizes)."""
    factors = term.args if isinstance(term, sympy.Mul) else (term,)
    for factor in factors:
        base, exponent = factor.as_base_exp()
        if not (base.is_Symbol and base.is_nonnegative and exponent.is_Integer
                and exponent > 0):
            return False
    return True


def same(a: Any, b: Any) -> bool:
    """``a == b``; of symbolic sizes, whether they are the same expression. Asking torch
    whether two expressions are equal evaluates them at the profiled sizes and records the
    answer as a guard, a sympy proof of tens of milliseconds (most of a symbolic profile's
    time where it was asked per node), and narrows the shapes the formula holds at; a pair
    that is equal at every shape but written differently is only kept twice.

    Example:
        >>> same(3, 3), same(3, 4)
        (True, False)
    """
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)
                and a.node.expr == b.node.expr)
    return bool(a == b)


class SymbolicInputs:
    """Fake inputs whose sizes are symbols of one ``ShapeEnv`` (NOTE [ One profile for every
    shape ]): every dimension of 2 or more of every tensor, one symbol per distinct size.

    ``order`` is the call's tensors in the order :func:`autockpt.capturing.shapes.tensor_shapes`
    walks them: the formula binds its symbols to those positions.
    """

    def __init__(self, order: Sequence[torch.Tensor]) -> None:
        self.shape_env = ShapeEnv()
        # Parameters and buffers keep their sizes: only the inputs are made symbolic.
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=self.shape_env,
                                        static_shapes=True)
        self._positions: dict[int, list[int]] = {}
        for i, t in enumerate(order):
            self._positions.setdefault(id(t), []).append(i)
        self._made: dict[int, torch.Tensor] = {}
        self.shapes: Shapes = tuple(tuple(int(s) for s in t.shape) for t in order)
        self._symbols: dict[int, torch.SymInt] = {}
        self.symbols: dict[str, tuple[sympy.Symbol, int]] = {}
        """Each symbol made, by name, with the size it stands for here."""
        self.bindings: list[tuple[int, int, str]] = []

    def _size(self, size: int) -> Any:
        if size < 2:
            return size
        found = self._symbols.get(size)
        if found is None:
            source = ConstantSource(f"autockpt_size_{size}")
            symbol = self.shape_env.create_symbol(size, source, dynamic_dim=DimDynamic.DYNAMIC)
            found = self._symbols[size] = self.shape_env.create_symintnode(
                symbol, hint=size, source=source)
            self.symbols[str(symbol)] = (symbol, size)
        return found

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake copy of ``tensor`` with symbolic sizes where it is one of the call's tensors
        (a plain fake copy otherwise)."""
        positions = self._positions.get(id(tensor))
        if positions is None or tensor.layout != torch.strided:
            return self.fake_mode.from_tensor(tensor)
        if id(tensor) in self._made:  # one tensor passed twice (labels=input_ids) stays one
            return self._made[id(tensor)]
        sizes = [self._size(int(s)) for s in tensor.shape]
        for dim, size in enumerate(sizes):
            if isinstance(size, torch.SymInt):
                self.bindings.extend((p, dim, str(size.node.expr)) for p in positions)
        with self.fake_mode:
            if tensor.is_contiguous():
                fake = torch.empty(sizes, dtype=tensor.dtype, device=tensor.device)
            else:
                fake = torch.empty_strided(sizes, _strides(tensor, sizes), dtype=tensor.dtype,
                                           device=tensor.device)
        fake = fake.requires_grad_(tensor.requires_grad)
        self._made[id(tensor)] = fake
        return fake


def _strides(tensor: torch.Tensor, sizes: list[Any]) -> list[Any]:
    """Strides for ``sizes`` laid out in ``tensor``'s order of dimensions (a permuted or
    channels-last input keeps its layout)."""
    order = sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), -d))
    strides: list[Any] = [0] * tensor.dim()
    step: Any = 1
    for dim in order:
        strides[dim] = step
        step = step * sizes[dim]
    return strides


@dataclass(frozen=True)
class _Slot:
    """Where a symbolic number sits in the profile: ``path`` names the object and field."""

    path: tuple[Any, ...]
    expression: int


class ShapeFormula:
    """A profile taken on symbolic sizes, evaluated at a shape by :meth:`at` (NOTE [ One
    profile for every shape ]).

    Example:
        >>> import torch
        >>> from autockpt.capturing.trace import trace
        >>> from autockpt.profiling.profile import profile
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> symbolic = SymbolicInputs([x])
        >>> formula = formula_of(profile(trace(net, (x,)), {"input": x}, symbolic=symbolic),
        ...                      symbolic)
        >>> formula.at(((32, 8),), "input: float32[32, 8]").nodes[1].output_bytes
        2048
        >>> formula.at(((1, 8),), "") is None  # a size of 1 is another graph to torch
        True
    """

    def __init__(self, template: Profile, symbolic: SymbolicInputs,
                 expressions: list[sympy.Expr], slots: list[_Slot],
                 extras: dict[str, int]) -> None:
        env = symbolic.shape_env
        self._template = template
        self._expressions = expressions
        self._owners = _owners(slots)
        self._extras = extras
        self.symbols: tuple[str, ...] = tuple(sorted({name for _, _, name in symbolic.bindings}))
        # The ShapeEnv's own symbols: a symbol made here with other assumptions would not be
        # the same to sympy.
        self._symbol_of = {name: symbolic.symbols[name][0] for name in self.symbols}
        bound = {(t, d): name for t, d, name in symbolic.bindings}
        self._bindings = tuple(symbolic.bindings)
        # Every size not bound to a symbol must be what it was.
        self._fixed = tuple(
            (t, d, size) for t, dims in enumerate(symbolic.shapes) for d, size in enumerate(dims)
            if (t, d) not in bound)
        self._ranks = tuple(len(dims) for dims in symbolic.shapes)
        checks: list[sympy.Basic] = [guard.expr for guard in env.guards]
        for symbol, value in env.replacements.items():
            checks.append(sympy.Eq(symbol, value))
        self._checks = tuple(checks)
        # The last shapes evaluated: a plan asks for the profile, then the head's rows.
        self._last: tuple[Shapes, list[int] | None] | None = None
        # A symbol no input size binds (an unbacked size, from a data-dependent op) cannot be
        # evaluated: such a formula holds nowhere but where it was taken.
        known = set(self._symbol_of.values())
        self._usable = all(e.free_symbols <= known for e in (*checks, *expressions))
        self._compiled = _compiled(self.symbols, self._symbol_of, self._checks, expressions,
                                   {name: symbolic.symbols[name][1] for name in self.symbols})

    def at(self, shapes: Shapes, input_signature: str) -> Profile | None:
        """The profile at ``shapes`` (the call's tensors' shapes, in the order of
        :class:`SymbolicInputs`), or ``None`` where the profile taken does not hold there."""
        numbers = self._numbers(shapes)
        if numbers is None:
            return None
        return _rebuilt(self._template, self._owners, numbers, input_signature)

    def extra(self, name: str, shapes: Shapes) -> int | None:
        """A named expression recorded with the profile (``"rows"``), at ``shapes``."""
        numbers = self._numbers(shapes)
        if numbers is None or name not in self._extras:
            return None
        return numbers[self._extras[name]]

    def _numbers(self, shapes: Shapes) -> list[int] | None:
        """Every expression at ``shapes``, or None where a guard fails."""
        if self._last is None or self._last[0] != shapes:
            self._last = (shapes, self._evaluated(shapes))
        return self._last[1]

    def _evaluated(self, shapes: Shapes) -> list[int] | None:
        values = self._bind(shapes) if self._usable else None
        if values is None:
            return None
        if self._compiled is not None:
            holds, numbers = self._compiled(*(values[name] for name in self.symbols))
            return list(numbers) if all(holds) else None
        mapping = {self._symbol_of[name]: sympy.Integer(v) for name, v in values.items()}
        if any(check.xreplace(mapping) is not sympy.true for check in self._checks):
            return None
        return [int(e.xreplace(mapping)) for e in self._expressions]

    def _bind(self, shapes: Shapes) -> dict[str, int] | None:
        if tuple(len(dims) for dims in shapes) != self._ranks:
            return None
        if any(shapes[t][d] != size for t, d, size in self._fixed):
            return None
        values: dict[str, int] = {}
        for t, d, name in self._bindings:
            size = shapes[t][d]
            if size < 2 or values.setdefault(name, size) != size:
                return None
        return values


def formula_of(template: Profile, symbolic: SymbolicInputs,
               extras: dict[str, Any] | None = None) -> ShapeFormula:
    """The :class:`ShapeFormula` of a profile taken with ``symbolic``'s inputs (its numbers
    ints or ``torch.SymInt``); ``extras`` names more sizes to evaluate
    (:meth:`ShapeFormula.extra`)."""
    expressions: list[sympy.Expr] = []
    index: dict[sympy.Expr, int] = {}
    env = symbolic.shape_env

    def number(value: Any) -> int | None:
        if not isinstance(value, torch.SymInt):
            return None
        expr = env.simplify(value.node.expr)
        found = index.get(expr)
        if found is None:
            found = index[expr] = len(expressions)
            expressions.append(expr)
        return found

    slots: list[_Slot] = []

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.SymInt):
            slot = number(value)
            assert slot is not None
            slots.append(_Slot(path, slot))
            return 0  # the template's placeholder
        if isinstance(value, tuple):
            return tuple(walk(v, (*path, i)) for i, v in enumerate(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed = {f.name: walk(getattr(value, f.name), (*path, f.name))
                       for f in dataclasses.fields(value)}
            return replace(value, **changed)
        return value

    plain = walk(template, ())
    named = {}
    for name, value in (extras or {}).items():
        slot = number(value)
        if slot is None:
            slot = len(expressions)
            expressions.append(sympy.Integer(int(value)))
        named[name] = slot
    return ShapeFormula(plain, symbolic, expressions, slots, named)


Owners = dict[tuple[Any, ...], list[tuple[tuple[Any, ...], int]]]
"""Per object of a profile that holds symbolic numbers (``("nodes", 3)``, ``("loss",)``),
the field path and expression index of each."""


def _owners(slots: list[_Slot]) -> Owners:
    by_owner: Owners = {}
    for slot in slots:
        size = 1 if slot.path[0] == "loss" else 2
        by_owner.setdefault(slot.path[:size], []).append((slot.path[size:], slot.expression))
    return by_owner


def _rebuilt(template: Profile, owners: Owners, numbers: list[int],
             input_signature: str) -> Profile:
    """``template`` with each expression's number put in, each object that holds one rebuilt
    once."""
    nodes = list(template.nodes)
    storages = list(template.storages)
    loss = template.loss
    for owner, puts in owners.items():
        if owner[0] == "nodes":
            node = nodes[owner[1]] = _filled(nodes[owner[1]], puts, numbers)
            if node.accumulate_backward_bytes == node.backward_bytes:
                # As a profile of the shape says it: ``same`` kept the pair apart.
                object.__setattr__(node, "accumulate_backward_bytes", None)
        elif owner[0] == "storages":
            storages[owner[1]] = _filled(storages[owner[1]], puts, numbers)
        else:
            loss = _filled(loss, puts, numbers)
    return replace(template, nodes=tuple(nodes), storages=tuple(storages), loss=loss,
                   input_signature=input_signature)


def _filled(obj: Any, puts: list[tuple[tuple[Any, ...], int]], numbers: list[int]) -> Any:
    """``obj`` (a frozen dataclass) with the number of each ``(path, expression)`` at its
    field path. A shallow copy with its fields set: ``dataclasses.replace`` runs ``__init__``,
    several times slower, for hundreds of objects per shape."""
    new = copy.copy(obj)
    for path, expression in puts:
        name, *rest = path
        object.__setattr__(new, name, _put(getattr(new, name), rest, numbers[expression]))
    return new


def _put(value: Any, path: Sequence[Any], number: int) -> Any:
    if not path:
        return number
    first, *rest = path
    items = list(value)
    items[first] = _put(items[first], rest, number)
    return tuple(items)


def _compiled(symbols: Sequence[str], symbol_of: dict[str, sympy.Symbol],
              checks: Sequence[sympy.Basic], expressions: Sequence[sympy.Expr],
              hints: dict[str, int]) -> Callable[..., Any] | None:
    """One Python function of the symbols' values that returns every check's truth and
    every expression's value, printed by torch's printer of sizes; ``None`` where an
    expression does not print, or the function disagrees with sympy at the profiled sizes
    (then :meth:`ShapeFormula.at` substitutes with sympy, several times slower)."""
    printer = PythonPrinter()
    try:
        checks_text = "".join(printer.doprint(c) + ", " for c in checks)
        values_text = "".join(printer.doprint(e) + ", " for e in expressions)
        source = (f"def _evaluate({', '.join(symbols)}):\n"
                  f"    return ({checks_text}), ({values_text})\n")
        scope: dict[str, Any] = {}
        exec(compile(source, "<autockpt shape formula>", "exec"), scope)  # noqa: S102
        function = scope["_evaluate"]
        mapping = {symbol_of[n]: sympy.Integer(v) for n, v in hints.items()}
        holds, numbers = function(*(hints[n] for n in symbols))
        if list(holds) != [c.xreplace(mapping) is sympy.true for c in checks] or \
                list(numbers) != [int(e.xreplace(mapping)) for e in expressions]:
            return None
        return function
    except Exception:  # noqa: BLE001 - any expression the printer does not know
        return None
