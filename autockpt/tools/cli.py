"""The ``autockpt`` command line: see the plan, the memory and what checkpointing costs.

    autockpt plan     MODEL --input SHAPE [...] [--budget-mb N | --budget P% | --total-mb N]
                      [STEP] [--plot F] [--json]
    autockpt bench    MODEL --input SHAPE [...] [--budgets 100,50,25] [--total-mb N] [STEP]
                      [--json]
    autockpt diagnose MODEL --input SHAPE [...] [--loss NAME] [--json]
    autockpt lint     train.py [--json]

    STEP: [--loss cross_entropy|mse|sum] [--grad-accumulation] [--optimizer adamw|adam|sgd]

``MODEL`` is ``package.module:factory`` or ``path/to/file.py:factory``; the factory is a class
or a function called with no arguments that returns an ``nn.Module`` (a module instance is
taken as it is). ``--input`` gives one positional input: dimensions joined by ``x``, with an
optional ``:dtype`` (``--input 16x128:int64``); repeat it, or separate shapes with ``;``, for
several inputs. Integer inputs are random ids in ``[0, --vocab)``.

The step planned, measured and diagnosed is ``loss(model(*inputs)).backward()``. Without
``--loss`` the loss is the library's default (NOTE [ The default loss ] in
:mod:`autockpt.profiling.loss`: the model's own loss when its output holds one, else the sum of its
floating outputs); ``--loss`` names one of :data:`autockpt.profiling.loss.NAMED_LOSSES` instead:
``cross_entropy`` (fixed random targets, classes in the last dimension), ``mse`` (against
zeros) or ``sum``. ``--grad-accumulation`` plans and measures steps in which ``.grad`` is
already allocated. ``--total-mb`` is a budget for the whole device rather than for activations
(so it excludes ``--budget-mb`` and ``--budget``): parameters, gradients, the state of
``--optimizer`` (AdamW, Adam, or SGD with momentum; none without it, and it needs
``--total-mb``) and the inputs are taken off it first, and the measured step runs the
optimizer's ``step()`` too. ``bench`` adds a row ``total`` for it to its sweep. ``--json``
output names the loss (``"default"`` without ``--loss``) and the step's settings.

Errors the user can fix print one line, ``autockpt: error: ... (fix: ...)``, and exit with
status 2; ``--debug`` adds the traceback. ``diagnose`` and ``lint`` exit with status 1 when
they find an error-severity problem (so they can gate CI), 0 otherwise. Only this module
prints.

# NOTE [ Adding a subcommand ]
A subcommand is one function decorated with :func:`subcommand`, which names it, gives its
help and the argument groups it takes (:func:`model_arguments` for MODEL and the inputs,
:func:`planning_arguments` for mode and strategy, :func:`loss_arguments` and
:func:`step_arguments` for the training step), and receives the parsed arguments and the
:class:`Ui` to print with. :func:`load_session` turns the arguments into a model and inputs,
with the helpful errors. ``diagnose`` below is the shortest example.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
from torch import nn

from autockpt import api
from autockpt.errors import AutockptError, InfeasibleBudgetError, InvalidArgumentError
from autockpt.planning.planner import BUDGET_SLACK, MODES, STRATEGIES, Plan
from autockpt.profiling.loss import NAMED_LOSSES, LossFn, named_loss
from autockpt.report import (
    PLAN_COLUMNS,
    PLAN_COLUMNS_RIGHT,
    format_table,
    plan_rows,
    plan_summary,
)
from autockpt.running.measure import MemoryReport
from autockpt.running.measure import measure as measure_step
from autockpt.tools.diagnose import diagnose as diagnose_model
from autockpt.tools.findings import Report
from autockpt.tools.lint import lint as lint_script
from autockpt.units import format_bytes, format_seconds

__all__ = [
    "EXIT_FINDINGS",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_USAGE",
    "InputSpec",
    "Session",
    "Ui",
    "build_parser",
    "load_model",
    "load_session",
    "loss_arguments",
    "main",
    "model_arguments",
    "parse_budget_percent",
    "parse_inputs",
    "plan_json",
    "planning_arguments",
    "step_arguments",
    "subcommand",
]

EXIT_OK = 0
"""Exit status of a command that did what it was asked."""
EXIT_INTERNAL = 1
"""Exit status when autockpt itself failed (a bug: rerun with ``--debug`` and report it)."""
EXIT_FINDINGS = 1
"""``diagnose`` and ``lint`` found an error-severity problem."""
EXIT_USAGE = 2
"""Exit status of a usage error or an error the user can fix (as argparse uses it)."""

MIB = 2**20
DEFAULT_SWEEP = (100, 90, 80, 70, 60, 50, 40, 30, 20, 10)
"""Budgets ``bench`` tries, in percent of the estimated peak without checkpointing."""
_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params),
    "adam": lambda params: torch.optim.Adam(params),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
"""What ``--optimizer`` builds on the model's parameters, for ``--total-mb`` to count its
state."""
_ROOMY_MB = float(2**30)
"""A ``--total-mb`` (a pebibyte) that any step fits in, to learn the least one it needs."""


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class InputSpec:
    """One positional input of the model, as given on the command line."""

    shape: tuple[int, ...]
    """Its dimensions."""
    dtype: torch.dtype | None
    """Its dtype, or None to use ``--dtype``."""


def _parse_dtype(text: str) -> torch.dtype:
    name = text.strip().removeprefix("torch.")
    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise InvalidArgumentError(
            f"unknown dtype {text!r}",
            fix="use a torch dtype name such as float32, bfloat16, float16 or int64",
        )
    return value


def parse_inputs(texts: Sequence[str]) -> list[InputSpec]:
    """Read ``--input`` values: ``16x1000``, ``16x128:int64``, or several joined by ``;``.

    Example:
        >>> [(s.shape, s.dtype) for s in parse_inputs(["16x1000;16x10:int64", "3"])]
        [((16, 1000), None), ((16, 10), torch.int64), ((3,), None)]

    Raises:
        InvalidArgumentError: a shape or dtype that does not parse.
    """
    specs = []
    for text in texts:
        for part in text.split(";"):
            part = part.strip()
            if not part:
                continue
            shape_text, _, dtype_text = part.partition(":")
            dims = [d.strip() for d in shape_text.lower().split("x")]
            if not all(d.isdigit() and int(d) > 0 for d in dims):
                raise InvalidArgumentError(
                    f"cannot read the input shape {part!r}: dimensions are positive integers "
                    "joined by 'x'",
                    fix="write e.g. --input 16x1000, --input 16x128:int64 for token ids, and "
                    "repeat --input (or separate shapes with ';') for several inputs",
                )
            dtype = _parse_dtype(dtype_text) if dtype_text else None
            specs.append(InputSpec(tuple(int(d) for d in dims), dtype))
    if not specs:
        raise InvalidArgumentError(
            "no input shape given", fix="pass --input with the shape of a batch, e.g. 16x1000"
        )
    return specs


def parse_budget_percent(text: str) -> float:
    """Read ``--budget``: a percentage of the estimated peak without checkpointing.

    Example:
        >>> parse_budget_percent("50%")
        0.5

    Raises:
        InvalidArgumentError: not a positive percentage.
    """
    number = text.strip().removesuffix("%")
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not text.strip().endswith("%") or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(
            f"--budget takes a percentage of the peak without checkpointing, got {text!r}",
            fix="write e.g. --budget 50%, or --budget-mb 300 for a budget in MiB",
        )
    return value / 100


def _parse_percent_list(text: str) -> list[float]:
    try:
        values = [float(v.strip().removesuffix("%")) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise InvalidArgumentError(
            f"--budgets takes percentages separated by commas, got {text!r}",
            fix="write e.g. --budgets 100,75,50,25",
        )
    return values


@dataclass(frozen=True)
class _ModelSpec:
    """The MODEL argument, taken apart."""

    text: str
    """As given."""
    source: str
    """The module name or the file path before the last colon."""
    attribute: str
    """The factory's name (dotted for a nested attribute)."""
    is_path: bool
    """Whether ``source`` is a file rather than a module name."""


def _parse_model_spec(text: str) -> _ModelSpec:
    source, sep, attribute = text.rpartition(":")
    if not sep or not source or not attribute or not all(
        a.isidentifier() for a in attribute.split(".")
    ):
        raise InvalidArgumentError(
            f"cannot read MODEL {text!r}: expected module:factory or file.py:factory",
            fix="write e.g. mypkg.models:make_model or models.py:Net (a class or a function "
            "called with no arguments that returns the nn.Module)",
        )
    is_path = source.endswith(".py") or os.sep in source or "/" in source
    return _ModelSpec(text, source, attribute, is_path)


def load_model(text: str) -> nn.Module:
    """Import ``module:factory`` or ``file.py:factory`` and call the factory.

    A module spec is imported with the current directory on ``sys.path``; a file is loaded
    with its own directory on ``sys.path``, so that it can import its neighbours.

    Example:
        >>> load_model("torch.nn:Tanh")
        Tanh()

    Raises:
        InvalidArgumentError: the spec does not parse, the module or file cannot be
            imported, the factory is missing, raises, or returns something else than an
            ``nn.Module``.
    """
    spec = _parse_model_spec(text)
    module = _import_file(spec) if spec.is_path else _import_module(spec)
    obj: Any = module
    for atom in spec.attribute.split("."):
        if not hasattr(obj, atom):
            names = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_"))[:8]
            where = spec.source
            raise InvalidArgumentError(
                f"{where} has no {spec.attribute!r}",
                fix="name a class or function defined there"
                + (f" (found: {', '.join(names)})" if names else ""),
            )
        obj = getattr(obj, atom)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise InvalidArgumentError(
            f"{text} is a {type(obj).__name__}, not a class or function",
            fix="name the class or the function that builds the model",
        )
    try:
        model = obj()
    except Exception as err:
        raise InvalidArgumentError(
            f"calling {text}() raised {type(err).__name__}: {err}",
            fix="MODEL must name a class or function that takes no arguments; wrap yours, "
            "e.g. def make(): return Net(width=512)",
        ) from err
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"{text}() returned a {type(model).__name__}, not a torch.nn.Module",
            fix="make the factory return the model instance",
        )
    return model


def _import_module(spec: _ModelSpec) -> Any:
    # Console scripts do not put the current directory on sys.path, python -m does: make
    # both find the user's package the same way.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec.source)
    except ModuleNotFoundError as err:
        if err.name and spec.source.startswith(err.name):
            raise InvalidArgumentError(
                f"cannot import {spec.source!r}: no module named {err.name!r}",
                fix="run from the directory that holds the package, set PYTHONPATH, or pass "
                "a file: path/to/models.py:factory",
            ) from err
        raise _import_failed(spec, err) from err
    except Exception as err:
        raise _import_failed(spec, err) from err


def _import_file(spec: _ModelSpec) -> Any:
    path = Path(spec.source)
    if not path.is_file():
        raise InvalidArgumentError(
            f"no such file: {spec.source}",
            fix="check the path, or write module:factory to import an installed module",
        )
    name = "_autockpt_model_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise InvalidArgumentError(f"cannot load {spec.source} as Python",
                                   fix="pass a .py file")
    module = importlib.util.module_from_spec(loader_spec)
    parent = str(path.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    # Registered before running it, so that classes defined there can be pickled.
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise _import_failed(spec, err) from err
    return module


def _import_failed(spec: _ModelSpec, err: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"importing {spec.source} raised {type(err).__name__}: {err}",
        fix="fix the error in that module (rerun with --debug to see where it is)",
    )


# --------------------------------------------------------------------------- the session


@dataclass(frozen=True)
class Session:
    """A model built from the command line and the inputs to run it on."""

    model: nn.Module
    """The model, in train mode, on ``--device``."""
    inputs: tuple[torch.Tensor, ...]
    """Random positional inputs of the shapes and dtypes asked for."""
    name: str
    """The MODEL argument, for messages."""

    @property
    def signature(self) -> str:
        """The inputs as ``float32[16, 1000], int64[16, 10]``."""
        return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                         for t in self.inputs)


def load_session(args: argparse.Namespace) -> Session:
    """Build the model and random inputs from :func:`model_arguments`, and check that the
    model's forward accepts them.

    Seeds torch with ``--seed`` first, so that runs repeat exactly.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> model_arguments(parser)
        >>> s = load_session(parser.parse_args(["torch.nn:Tanh", "--input", "2x3"]))
        >>> s.signature
        'float32[2, 3]'

    Raises:
        InvalidArgumentError: the model cannot be loaded, an input cannot be made, or the
            forward fails on the inputs.
    """
    specs = parse_inputs(args.input)
    default_dtype = _parse_dtype(args.dtype)
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise InvalidArgumentError(f"unknown device {args.device!r}",
                                   fix="use cpu, cuda or cuda:N") from err
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_model(args.model)
    model.train()
    model.to(device)
    generator = torch.Generator().manual_seed(args.seed)
    inputs = tuple(
        _random_input(spec.shape, spec.dtype or default_dtype, args.vocab, generator).to(device)
        for spec in specs
    )
    session = Session(model=model, inputs=inputs, name=args.model)
    _check_forward(session)
    return session


def _random_input(shape: tuple[int, ...], dtype: torch.dtype, vocab: int,
                  generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, vocab, shape, generator=generator, dtype=dtype)


def _check_forward(session: Session) -> None:
    """Run the forward once, so that shape mistakes are reported in command-line terms.

    In eval mode and without autograd: cheap, and it neither updates BatchNorm statistics
    nor draws dropout's random numbers.
    """
    model = session.model
    try:
        model.eval()
        with torch.no_grad():
            model(*session.inputs)
    except Exception as err:
        flags = " ".join(f"--input {'x'.join(map(str, t.shape))}" for t in session.inputs)
        raise InvalidArgumentError(
            f"{type(model).__name__}.forward failed on inputs {session.signature} "
            f"({flags}): {type(err).__name__}: {err}",
            fix=f"pass one --input per positional argument of {type(model).__name__}.forward, "
            "with the shapes (and :dtype, e.g. 16x128:int64) it expects",
        ) from err
    finally:
        model.train()


# --------------------------------------------------------------------------- output


class Ui:
    """Where a command prints: rich tables and a progress bar on a terminal (when rich is
    installed), plain text otherwise. Results go to ``out``, progress to ``err``."""

    def __init__(self, out: TextIO, err: TextIO, *, fancy: bool | None = None) -> None:
        self.out = out
        self.err = err
        rich_ok = importlib.util.find_spec("rich") is not None
        if fancy is None:
            fancy = rich_ok and _isatty(out)  # rich itself honours NO_COLOR
        self.fancy = fancy and rich_ok
        self._console: Any = None
        if self.fancy:
            from rich.console import Console

            self._console = Console(file=out, highlight=False)

    def text(self, text: str = "", style: str | None = None) -> None:
        """Print a block of text (``style`` is a rich style, ignored in plain text)."""
        if self._console is not None:
            self._console.print(text, style=style, markup=False, soft_wrap=True)
        else:
            print(text, file=self.out)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]], *,
              right: Sequence[bool] = (), styles: Sequence[str | None] = ()) -> None:
        """Print a table; ``styles`` colours whole rows on a terminal."""
        if self._console is None:
            print(format_table(header, rows, right=right), file=self.out)
            return
        from rich.table import Table

        table = Table(show_edge=False, header_style="bold", pad_edge=False)
        align = list(right) + [False] * (len(header) - len(right))
        widths = [max([len(name), *(len(row[i]) for row in rows)])
                  for i, name in enumerate(header)]
        # Numbers don't wrap when the terminal is wide enough for them and some of the last
        # column (notes); on a narrow one everything wraps rather than a column vanishing.
        roomy = sum(widths[:-1]) + 3 * len(widths) + 16 <= self._console.width
        for i, (name, is_right) in enumerate(zip(header, align)):
            last = i == len(header) - 1
            table.add_column(name, justify="right" if is_right else "left",
                             no_wrap=roomy and not last, overflow="fold")
        row_styles = list(styles) + [None] * (len(rows) - len(styles))
        for row, style in zip(rows, row_styles):
            table.add_row(*row, style=style)
        self._console.print(table)

    def json(self, data: Any) -> None:
        """Print JSON (never styled, so that it can be piped)."""
        print(json.dumps(data, indent=2), file=self.out)

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Iterator[Callable[[str], None]]:
        """A progress bar on a terminal, one line per step otherwise; yields
        ``advance(what_was_done)``."""
        if self.fancy and _isatty(self.err):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[last]}"))
            with Progress(*columns, console=Console(file=self.err), transient=True) as bar:
                task = bar.add_task(description, total=total, last="")
                yield lambda what: bar.update(task, advance=1, last=what)
            return
        done = 0

        def advance(what: str) -> None:
            nonlocal done
            done += 1
            print(f"autockpt: {description} {done}/{total}: {what}", file=self.err, flush=True)

        yield advance


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _print_plan(ui: Ui, plan: Plan) -> None:
    ui.text("\n".join(plan_summary(plan)))
    ui.text()
    rows = plan_rows(plan)
    ui.table(PLAN_COLUMNS, [cells for _, cells in rows], right=PLAN_COLUMNS_RIGHT,
             styles=[None if seg.checkpointed else "dim" for seg, _ in rows])


# --------------------------------------------------------------------------- subcommands


@dataclass(frozen=True)
class _Subcommand:
    """A registered ``autockpt NAME``."""

    name: str
    """What users type."""
    help: str
    """One line for ``--help``."""
    arguments: tuple[Callable[[argparse.ArgumentParser], None], ...]
    """Functions that add its arguments to its parser."""
    run: Callable[[argparse.Namespace, Ui], int]
    """Runs it; returns the exit status."""


_SUBCOMMANDS: dict[str, _Subcommand] = {}


def subcommand(name: str, help: str, *arguments: Callable[[argparse.ArgumentParser], None]
               ) -> Callable[[Callable[[argparse.Namespace, Ui], int]],
                             Callable[[argparse.Namespace, Ui], int]]:
    """Register ``autockpt NAME``: the decorated function gets the parsed arguments and the
    :class:`Ui`, and returns the exit status. See NOTE [ Adding a subcommand ].

    Example:
        >>> sorted(_SUBCOMMANDS)
        ['bench', 'diagnose', 'lint', 'plan']
    """
    def register(run: Callable[[argparse.Namespace, Ui], int]
                 ) -> Callable[[argparse.Namespace, Ui], int]:
        _SUBCOMMANDS[name] = _Subcommand(name, help, arguments, run)
        return run

    return register


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add MODEL, ``--input``, ``--dtype``, ``--vocab``, ``--device``, ``--seed`` and
    ``--threads``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> model_arguments(parser)
        >>> parser.parse_args(["m:f", "--input", "4x8"]).dtype
        'float32'
    """
    parser.add_argument("model", metavar="MODEL",
                        help="package.module:factory or path/to/file.py:factory; the factory "
                        "(a class or function) is called with no arguments")
    parser.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
                        help="one positional input, dimensions joined by x: 16x1000, or "
                        "16x128:int64 for token ids; repeat (or separate with ';') for more")
    parser.add_argument("--dtype", default="float32",
                        help="dtype of inputs without :DTYPE (default float32)")
    parser.add_argument("--vocab", type=_positive_int, default=100, metavar="N",
                        help="integer inputs are random ids in [0, N) (default 100)")
    parser.add_argument("--device", default="cpu", help="where to run (default cpu)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the model's initialisation and the inputs (default 0)")
    parser.add_argument("--threads", type=_positive_int, metavar="N",
                        help="CPU threads for torch (default: torch's choice); 1 gives steadier "
                        "step times on a busy machine")


def planning_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--mode``, ``--strategy`` and ``--steps``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> planning_arguments(parser)
        >>> parser.parse_args([]).mode
        'non_reentrant'
    """
    parser.add_argument("--mode", choices=MODES, default="non_reentrant",
                        help="checkpoint flavour (default non_reentrant)")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="optimal",
                        help="how segments are chosen (default optimal)")
    parser.add_argument("--steps", type=_positive_int, default=3, metavar="N",
                        help="timed training steps per measurement; the median is reported "
                        "(default 3)")


def loss_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--loss``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> loss_arguments(parser)
        >>> parser.parse_args([]).loss, parser.parse_args(["--loss", "mse"]).loss
        (None, 'mse')
    """
    parser.add_argument("--loss", choices=list(NAMED_LOSSES), metavar="NAME",
                        help="the loss of the step: cross_entropy (fixed random targets, "
                        "classes in the last dimension), mse (against zeros) or sum (default: "
                        "the model's own loss when it returns one, else the sum of its "
                        "floating outputs)")


def step_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--loss``, ``--grad-accumulation``, ``--total-mb`` and ``--optimizer``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> step_arguments(parser)
        >>> args = parser.parse_args(["--total-mb", "8000", "--optimizer", "adamw"])
        >>> args.total_mb, args.optimizer, args.grad_accumulation
        (8000.0, 'adamw', False)
    """
    loss_arguments(parser)
    parser.add_argument("--grad-accumulation", action="store_true",
                        help="plan and measure steps in which .grad is already allocated "
                        "(gradient accumulation)")
    parser.add_argument("--total-mb", type=float, metavar="MIB",
                        help="a budget for the whole device, in MiB, instead of one for "
                        "activations: they get what parameters, gradients, optimizer state and "
                        "inputs leave of it (bench: one more row, 'total')")
    parser.add_argument("--optimizer", choices=list(_OPTIMIZERS),
                        help="with --total-mb: the optimizer whose state it counts and whose "
                        "step() is measured: AdamW, Adam, or SGD with momentum (default: none)")


def _plan_only_arguments(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-mb", type=float, metavar="MIB",
                        help="peak activation memory allowed, in MiB")
    budget.add_argument("--budget", metavar="P%",
                        help="budget as a percentage of the estimated peak without "
                        "checkpointing, e.g. 50%%; without a budget (nor --total-mb): the least "
                        "reachable")
    parser.add_argument("--plot", metavar="FILE",
                        help="draw the memory picture to FILE (.png, .svg or .pdf); needs "
                        "matplotlib")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (plan, segments, measured numbers) instead of tables")


def _bench_only_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_SWEEP)),
                        metavar="P,P,...",
                        help="budgets in percent of the estimated peak without checkpointing "
                        "(default 100,90,...,10); the least reachable is always added, and "
                        "--total-mb as the row 'total'")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class _Step:
    """The training step a command plans and measures (:func:`step_arguments`)."""

    loss_name: str | None
    """``--loss``; None for the library's default loss."""
    loss_fn: LossFn | None
    """The loss ``--loss`` names; None for the default."""
    grad_accumulation: bool
    """``--grad-accumulation``."""
    total_mb: float | None
    """``--total-mb``."""
    optimizer_name: str | None
    """``--optimizer``."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer ``--optimizer`` built on the model's parameters."""

    def planning(self) -> dict[str, Any]:
        """Keywords of :func:`autockpt.plan` for a plan under an activation budget."""
        return {"loss_fn": self.loss_fn, "grad_accumulation": self.grad_accumulation}

    def whole_device(self) -> dict[str, Any]:
        """Keywords of :func:`autockpt.plan` for a plan under ``--total-mb``."""
        return {**self.planning(), "total_mb": self.total_mb, "optimizer": self.optimizer}

    def measuring(self) -> dict[str, Any]:
        """Keywords of :func:`autockpt.measure` for the same step (the optional ones only
        when asked for)."""
        kwargs: dict[str, Any] = {"loss_fn": self.loss_fn}
        if self.grad_accumulation:
            kwargs["grad_accumulation"] = True
        if self.optimizer is not None:
            kwargs["optimizer"] = self.optimizer
        return kwargs

    def describe(self) -> str:
        """What one measured step runs, for the line above the measured numbers.

        Example:
            >>> _Step("mse", None, True, None, None, None).describe()
            'one forward + backward of --loss mse into allocated .grad'
        """
        loss = f"--loss {self.loss_name}" if self.loss_name else "the default loss"
        text = f"one forward + backward of {loss}"
        if self.grad_accumulation:
            text += " into allocated .grad"
        if self.optimizer is not None:
            text += f" + {type(self.optimizer).__name__}.step()"
        return text

    def json(self) -> dict[str, Any]:
        """The step, for ``--json``."""
        return {"loss": self.loss_name or "default", "grad_accumulation": self.grad_accumulation,
                "total_mb": self.total_mb, "optimizer": self.optimizer_name}


def _check_step_arguments(args: argparse.Namespace) -> None:
    """Refuse contradictory step flags before minutes of loading and planning."""
    total_mb = args.total_mb
    if total_mb is not None and (not math.isfinite(total_mb) or total_mb <= 0):
        raise InvalidArgumentError(
            f"--total-mb must be a positive number of MiB, got {total_mb:g}",
            fix="write the memory of the whole device, e.g. --total-mb 24000",
        )
    given = [flag for flag, value in (("--budget-mb", getattr(args, "budget_mb", None)),
                                      ("--budget", getattr(args, "budget", None)))
             if value is not None]
    if total_mb is not None and given:
        raise InvalidArgumentError(
            f"pass either --total-mb (a budget for the whole device) or {given[0]} (a budget "
            "for activations alone), not both",
            fix=f"keep --total-mb {total_mb:g} to plan for the whole device, or drop it",
        )
    if args.optimizer is not None and total_mb is None:
        raise InvalidArgumentError(
            "--optimizer only matters with --total-mb: its state takes device memory, not "
            "activation memory",
            fix=f"add --total-mb with the MiB of your device, or drop --optimizer {args.optimizer}",
        )


def _step_of(args: argparse.Namespace, session: Session) -> _Step:
    """The step from :func:`step_arguments` (already checked), its optimizer built on the
    session's model."""
    optimizer = None
    if args.optimizer is not None:
        optimizer = _OPTIMIZERS[args.optimizer](session.model.parameters())
    return _Step(
        loss_name=args.loss,
        loss_fn=named_loss(args.loss) if args.loss is not None else None,
        grad_accumulation=args.grad_accumulation,
        total_mb=args.total_mb,
        optimizer_name=args.optimizer,
        optimizer=optimizer,
    )


def _budget_for(session: Session, args: argparse.Namespace, step: _Step
                ) -> tuple[float | None, Plan | None]:
    """``budget_mb`` for :func:`autockpt.plan`, and the unbudgeted plan if one was needed to
    turn a percentage into MiB."""
    if args.budget_mb is not None:
        if not math.isfinite(args.budget_mb) or args.budget_mb <= 0:
            raise InvalidArgumentError(
                f"--budget-mb must be a positive number of MiB, got {args.budget_mb}",
                fix="write e.g. --budget-mb 300, or --budget 50%",
            )
        return args.budget_mb, None
    if args.budget is None:
        return None, None
    fraction = parse_budget_percent(args.budget)
    free = api.plan(session.model, session.inputs, mode=args.mode, strategy=args.strategy,
                         **step.planning())
    return _mib(fraction * free.baseline_peak_bytes), free


def _mib(num_bytes: float) -> float:
    # Half a byte up, so that budget_mb * 2**20 truncates back to the byte count asked for.
    return (num_bytes + 0.5) / MIB


def _infeasible(err: InfeasibleBudgetError, session: Session, mode: str, strategy: str,
                step: _Step) -> InvalidArgumentError:
    """Restate an infeasible budget with the command-line flags that would work."""
    if step.total_mb is not None:
        total = math.ceil(_least_total(err, session, mode, strategy, step) / MIB * 100) / 100
        lighter = (", --optimizer sgd (half the state of Adam)"
                   if step.optimizer_name in ("adam", "adamw") else "")
        return InvalidArgumentError(
            err.message.replace("total_mb", "--total-mb"),
            fix=f"pass --total-mb {total:.2f} or more{lighter}, or use smaller inputs",
        )
    free = api.plan(session.model, session.inputs, mode=mode, strategy=strategy,
                         **step.planning())
    least = err.min_feasible_bytes
    mib = math.ceil(least / MIB * 100) / 100
    percent = math.ceil(100 * least / free.baseline_peak_bytes) if free.baseline_peak_bytes else 100
    return InvalidArgumentError(
        f"the budget {format_bytes(err.budget_bytes)} cannot be met: "
        f"{type(session.model).__name__} at {session.signature} needs at least "
        f"{format_bytes(least)} of activation memory ({mode})",
        fix=f"pass --budget-mb {mib:.2f} or more, --budget {percent}% or more, or no budget "
        "for the least reachable; or use smaller inputs",
    )


def _least_total(err: InfeasibleBudgetError, session: Session, mode: str, strategy: str,
                 step: _Step) -> int:
    """The least ``--total-mb`` (in bytes) that holds the step, after ``err`` refused one."""
    # When the fixed memory alone does not fit, the error's least is that part alone: a
    # budget with room to spare shows the whole step's, activations and step() included.
    roomy = api.plan(session.model, session.inputs, mode=mode, strategy=strategy,
                          **{**step.whole_device(), "total_mb": _ROOMY_MB})
    if roomy.device is None:
        return err.min_feasible_bytes
    device = roomy.device
    return max(err.min_feasible_bytes,
               device.fixed_bytes + max(roomy.min_peak_bytes, device.optimizer_step_bytes))


def _measure_all(models: Sequence[nn.Module], session: Session, steps: int, step: _Step,
                 advance: Callable[[str], None] | None = None) -> list[MemoryReport]:
    """Memory of one tracked step of each model; step time as the median over ``steps``
    rounds that time every model once in turn, so that a burst of load on a shared machine
    hits them alike instead of skewing one."""
    kwargs = step.measuring()
    reports = [measure_step(m, session.inputs, warmup=1, **kwargs) for m in models]
    times: list[list[float]] = [[] for _ in models]
    for round_number in range(steps):
        for model, samples in zip(models, times):
            samples.append(measure_step(model, session.inputs, **kwargs).step_seconds)
        if advance is not None:
            advance(f"timing round {round_number + 1}/{steps}")
    return [dataclasses.replace(r, step_seconds=statistics.median(t))
            for r, t in zip(reports, times)]


def _check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` file whose extension names no picture format, or a missing
    matplotlib, before the model is loaded."""
    from autockpt.tools.plot import PICTURE_FORMATS, require_matplotlib

    if Path(path).suffix.lower() not in PICTURE_FORMATS:
        raise InvalidArgumentError(
            f"cannot tell the picture format of {path!r} from its extension",
            fix=f"name the file with one of {', '.join(PICTURE_FORMATS)}, e.g. memory.png",
        )
    require_matplotlib()


def _rounds(count: int) -> str:
    return f"{count} round{'s' * (count != 1)}"


def _report_json(report: MemoryReport) -> dict[str, Any]:
    return {
        "peak_activation_bytes": report.peak_activation_bytes,
        "saved_bytes": report.saved_bytes,
        "forward_peak_bytes": report.forward_peak_bytes,
        "backward_peak_bytes": report.backward_peak_bytes,
        "step_seconds": report.step_seconds,
        "cuda_max_memory_allocated_bytes": report.cuda_max_memory_allocated_bytes,
        "peak_total_bytes": report.peak_total_bytes,
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    """A :class:`~autockpt.planning.planner.Plan` as JSON-ready data: every field, plus
    ``recompute_ratio``.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> data = plan_json(autockpt.plan(net, (torch.randn(8, 64),)))
        >>> data["model"], data["segments"][0]["first_module"]
        ('Sequential', '0')
    """
    data = dataclasses.asdict(plan)
    data["recompute_ratio"] = plan.recompute_ratio
    return data


@subcommand("plan", "plan checkpoints under a budget, apply them and measure the peak before "
            "and after", model_arguments, planning_arguments, step_arguments,
            _plan_only_arguments)
def _plan_command(args: argparse.Namespace, ui: Ui) -> int:
    _check_step_arguments(args)
    if args.plot is not None:
        _check_plot_path(args.plot)  # fail before minutes of work, not after
    session = load_session(args)
    step = _step_of(args, session)
    budget_mb, _ = _budget_for(session, args, step)
    budget = step.whole_device() if step.total_mb is not None else {
        "budget_mb": budget_mb, **step.planning()}
    try:
        plan = api.plan(session.model, session.inputs, mode=args.mode,
                             strategy=args.strategy, **budget)
    except InfeasibleBudgetError as err:
        raise _infeasible(err, session, args.mode, args.strategy, step) from err
    ckpt = api.apply(session.model, plan=plan, example_inputs=session.inputs)
    before, after = _measure_all([session.model, ckpt], session, args.steps, step)
    if args.plot is not None:
        from autockpt.tools.plot import plot_memory

        plot_memory(session.model, session.inputs, plan=plan, path=args.plot,
                    loss_fn=step.loss_fn)

    if args.json:
        ui.json({
            "autockpt_version": api.__version__,
            "model_spec": session.name,
            **step.json(),
            "plan": plan_json(plan),
            "measured": {
                "device": before.device,
                "timed_steps": args.steps,
                "without_autockpt": _report_json(before),
                "with_plan": _report_json(after),
            },
            "plot": args.plot,
        })
        return EXIT_OK
    _print_plan(ui, plan)
    ui.text()
    ui.text(f"measured on {before.device} (autockpt.measure: {step.describe()}, median step "
            f"time of {_rounds(args.steps)}, interleaved)")
    change = after.peak_activation_bytes / before.peak_activation_bytes - 1 \
        if before.peak_activation_bytes else 0.0
    ratio = after.step_seconds / before.step_seconds if before.step_seconds else math.nan
    rows = [
        ["without autockpt", format_bytes(before.peak_activation_bytes), "",
         format_seconds(before.step_seconds), ""],
        ["with this plan", format_bytes(after.peak_activation_bytes), f"{100 * change:+.1f}%",
         format_seconds(after.step_seconds), f"{ratio:.2f}x"],
    ]
    styles: list[str | None] = [None, None]
    if plan.budget_bytes is not None:
        within = after.peak_activation_bytes <= plan.budget_bytes
        rows.append(["budget", format_bytes(plan.budget_bytes), "", "",
                     "met" if within else "measured peak is over it"])
        styles.append("green" if within else "bold red")
    if plan.device is not None and after.peak_total_bytes is not None:
        # What --total-mb is about: the whole step, optimizer state and step() included.
        total = plan.device.total_bytes
        fits = after.peak_total_bytes <= total
        rows.append(["whole step", format_bytes(after.peak_total_bytes), "", "",
                     f"{'within' if fits else 'over'} --total-mb {format_bytes(total)}"])
        styles.append("green" if fits else "bold red")
    ui.table(["", "peak activations", "change", "step", "time"], rows,
             right=[False, True, True, True, False], styles=styles)
    if args.plot is not None:
        ui.text()
        ui.text(f"memory picture written to {args.plot}")
    return EXIT_OK


@dataclass(frozen=True)
class _BenchRow:
    """One budget of the sweep."""

    label: str
    """``"50%"``, ``"total"`` (``--total-mb``) or ``"least"``."""
    budget_bytes: int | None
    """The activation budget; None for the least reachable, and for ``total`` when the whole
    device cannot hold the step."""
    plan: Plan | None
    """The plan made for it; None when the budget is infeasible."""
    report: MemoryReport | None
    """The measurement of that plan (shared by budgets that give the same segments)."""
    least_bytes: int
    """The least estimated peak reachable, for infeasible rows (of the whole device for
    ``total``)."""
    total_bytes: int | None = None
    """``--total-mb`` in bytes, for the ``total`` row."""


@subcommand("bench", "sweep budgets: estimated and measured peak, recompute and step time",
            model_arguments, planning_arguments, step_arguments, _bench_only_arguments)
def _bench_command(args: argparse.Namespace, ui: Ui) -> int:
    _check_step_arguments(args)
    percents = _parse_percent_list(args.budgets)
    session = load_session(args)
    step = _step_of(args, session)
    least = api.plan(session.model, session.inputs, mode=args.mode, strategy=args.strategy,
                          **step.planning())
    baseline = least.baseline_peak_bytes
    # Each row: its label, its activation budget, and the keywords of autockpt.plan (None for
    # the least-memory plan, made above).
    wanted: list[tuple[str, int | None, dict[str, Any] | None]] = [
        (f"{p:g}%", budget, {"budget_mb": _mib(budget), **step.planning()})
        for p in percents for budget in [round(p / 100 * baseline)]]
    total_bytes = None
    if step.total_mb is not None:
        total_bytes = int(step.total_mb * MIB)
        wanted.append(("total", None, step.whole_device()))
    wanted.append(("least", None, None))
    plans: list[_BenchRow] = []
    # Budgets that lead to the same segments run the same code: each is measured once.
    distinct: dict[tuple[tuple[int, int], ...], int] = {}
    with ui.progress(len(wanted) + args.steps, "bench") as advance:
        for label, budget, kwargs in wanted:
            total = total_bytes if label == "total" else None
            try:
                plan = least if kwargs is None else api.plan(
                    session.model, session.inputs, mode=args.mode, strategy=args.strategy,
                    **kwargs)
            except InfeasibleBudgetError as err:
                needs = err.min_feasible_bytes if total is None else _least_total(
                    err, session, args.mode, args.strategy, step)
                plans.append(_BenchRow(label, budget, None, None, needs, total))
                advance(f"{label}: infeasible")
                continue
            if label == "total":
                budget = plan.budget_bytes  # what the whole device leaves to activations
            plans.append(_BenchRow(label, budget, plan, None, least.min_peak_bytes, total))
            distinct.setdefault(_key(plan), len(distinct))
            advance(f"{label}: planned, {len(plan.segments)} segments")
        models: list[nn.Module] = [session.model]
        for row in plans:
            if row.plan is not None and len(models) == 1 + distinct[_key(row.plan)]:
                models.append(api.apply(session.model, plan=row.plan,
                                             example_inputs=session.inputs))
        before, *reports = _measure_all(models, session, args.steps, step, advance)
    rows = [row if row.plan is None else
            dataclasses.replace(row, report=reports[distinct[_key(row.plan)]])
            for row in plans]

    if args.json:
        ui.json({
            "autockpt_version": api.__version__,
            "model_spec": session.name,
            "model": least.model,
            "input_signature": least.input_signature,
            "mode": args.mode,
            "strategy": args.strategy,
            **step.json(),
            "device": before.device,
            "timed_steps": args.steps,
            "baseline_estimated_peak_bytes": baseline,
            "least_estimated_peak_bytes": least.min_peak_bytes,
            "without_autockpt": _report_json(before),
            "rows": [_bench_row_json(row, before) for row in rows],
        })
        return EXIT_OK
    ui.text(f"autockpt bench: {least.model}({least.input_signature}), {args.mode}, "
            f"{args.strategy}, on {before.device}")
    ui.text(f"  each step: {step.describe()}")
    ui.text(f"  without autockpt: estimated {format_bytes(baseline)}, measured "
            f"{format_bytes(before.peak_activation_bytes)}, step "
            f"{format_seconds(before.step_seconds)} (median of {_rounds(args.steps)})")
    ui.text()
    table, styles = [], []
    for row in rows:
        budget = format_bytes(row.budget_bytes) if row.budget_bytes is not None else "none"
        if row.plan is None or row.report is None:
            if row.total_bytes is not None:
                budget = format_bytes(row.total_bytes)
            whole = "" if row.total_bytes is None else "the whole device "
            table.append([row.label, budget, "infeasible", "", "", "", "",
                          f"{whole}needs >= {format_bytes(row.least_bytes)}"])
            styles.append("dim")
            continue
        peak = row.report.peak_activation_bytes
        over = row.budget_bytes is not None and peak > row.budget_bytes * (1 + BUDGET_SLACK)
        notes = []
        if row.total_bytes is not None:
            notes.append(f"what --total-mb {format_bytes(row.total_bytes)} leaves")
        if over:
            notes.append("measured peak over budget")
        if row.total_bytes is not None and row.report.peak_total_bytes is not None \
                and row.report.peak_total_bytes > row.total_bytes:
            over = True
            notes.append(f"whole step {format_bytes(row.report.peak_total_bytes)} over it")
        table.append([
            row.label, budget, format_bytes(row.plan.estimated_peak_bytes), format_bytes(peak),
            str(len(row.plan.segments)), f"{100 * row.plan.recompute_ratio:.1f}%",
            f"{row.report.step_seconds / before.step_seconds:.2f}x"
            if before.step_seconds else "",
            "; ".join(notes),
        ])
        styles.append("bold red" if over else None)
    ui.table(["budget", "bytes", "estimated", "measured", "segments", "recompute",
              "step time", "note"], table,
             right=[False, True, True, True, True, True, True, False], styles=styles)
    ui.text()
    ui.text("recompute: FLOPs run again in backward, in % of one forward; step time: median "
            "step with the plan / without autockpt")
    return EXIT_OK


def _json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _show_report(ui: Ui, report: Report, as_json: bool,
                 extra: dict[str, Any] | None = None) -> int:
    if as_json:
        ui.json({
            "autockpt_version": api.__version__,
            **(extra or {}),
            "subject": report.subject,
            "errors": len(report.errors),
            "warnings": len(report.warnings),
            "findings": [dataclasses.asdict(f) for f in report],
        })
    else:
        ui.text(str(report), style="bold red" if report.has_errors else None)
    return EXIT_FINDINGS if report.has_errors else EXIT_OK


@subcommand("diagnose", "run one training step on a copy and report the checkpointing "
            "pitfalls found (exit 1 on errors)", model_arguments, loss_arguments,
            _json_argument)
def _diagnose_command(args: argparse.Namespace, ui: Ui) -> int:
    session = load_session(args)
    # diagnose takes the loss's name itself (None: the same default loss as plan and bench).
    report = diagnose_model(session.model, session.inputs, loss_fn=args.loss)
    return _show_report(ui, report, args.json, {"loss": args.loss or "default"})


def _lint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", metavar="SCRIPT.py", help="the training script to check")
    _json_argument(parser)


@subcommand("lint", "check a training script's source for checkpointing and "
            "checkpoint-saving pitfalls, without running it (exit 1 on errors)",
            _lint_arguments)
def _lint_command(args: argparse.Namespace, ui: Ui) -> int:
    path = Path(args.script)
    if not path.is_file():
        raise InvalidArgumentError(f"no such file: {args.script}",
                                   fix="pass the path of a Python training script")
    return _show_report(ui, lint_script(path), args.json)


def _key(plan: Plan) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.end) for s in plan.segments)


def _bench_row_json(row: _BenchRow, before: MemoryReport) -> dict[str, Any]:
    data: dict[str, Any] = {"label": row.label, "budget_bytes": row.budget_bytes,
                            "feasible": row.plan is not None}
    if row.total_bytes is not None:
        data["total_bytes"] = row.total_bytes
    if row.plan is None or row.report is None:
        data["min_feasible_bytes"] = row.least_bytes
        return data
    data.update({
        "estimated_peak_bytes": row.plan.estimated_peak_bytes,
        "measured_peak_bytes": row.report.peak_activation_bytes,
        "measured_peak_total_bytes": row.report.peak_total_bytes,
        "segments": len(row.plan.segments),
        "recompute_flops": row.plan.recompute_flops,
        "recompute_ratio": row.plan.recompute_ratio,
        "step_seconds": row.report.step_seconds,
        "step_time_ratio": row.report.step_seconds / before.step_seconds
        if before.step_seconds else None,
    })
    return data


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """Usage errors in the same one-line form as every other error."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, fix=f"see '{self.prog} --help'")


class _UsageError(InvalidArgumentError):
    pass


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``autockpt``, with every registered subcommand.

    Example:
        >>> build_parser().parse_args(["plan", "m:f", "--input", "2x3", "--budget", "50%"]
        ...                           ).budget
        '50%'
    """
    parser = _Parser(prog="autockpt",
                     description="Automatic activation checkpointing for PyTorch: see the "
                     "plan, the memory and what it costs.")
    parser.add_argument("--version", action="version", version=f"autockpt {api.__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _SUBCOMMANDS.values():
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        for add in command.arguments:
            add(sub)
        # SUPPRESS: a subparser's default would overwrite the top-level --debug.
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks of errors")
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None,
         err: TextIO | None = None, fancy: bool | None = None) -> int:
    """Run ``autockpt`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Example:
        >>> import io
        >>> stderr = io.StringIO()
        >>> main(["plan", "nowhere:make", "--input", "2x3"], err=stderr)
        2
        >>> print(stderr.getvalue().strip())  # doctest: +ELLIPSIS
        autockpt: error: cannot import 'nowhere': no module named 'nowhere' (fix: ...)
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        debug = bool(getattr(args, "debug", False))
        if args.command is None:
            build_parser().print_help(err)
            return EXIT_USAGE
        ui = Ui(out, err, fancy=fancy)
        return _SUBCOMMANDS[args.command].run(args, ui)
    except AutockptError as error:
        if debug:
            traceback.print_exc(file=err)
        print(_one_line(error.message, error.fix), file=err)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python from complaining
        # again when it flushes stdout at exit.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("autockpt: interrupted", file=err)
        return 130
    except Exception as error:  # a bug in autockpt, not something the user can fix
        if debug:
            traceback.print_exc(file=err)
        print(_one_line(f"internal error: {type(error).__name__}: {error}",
                        "rerun with --debug and report the traceback"), file=err)
        return EXIT_INTERNAL


def _one_line(message: str, fix: str | None) -> str:
    text = " ".join(message.split())
    if fix:
        text += f" (fix: {' '.join(fix.split())})"
    return f"autockpt: error: {text}"
