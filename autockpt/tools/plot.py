"""The memory picture: activation memory over one training step, with and without a plan.

:func:`memory_curves` runs one real forward and backward of the model as it is and one of the
model under a plan, and returns the live activation bytes after every op of each
(:class:`MemoryCurves`, plain numbers). :func:`draw_memory` turns those numbers into a
matplotlib figure; :func:`plot_memory` does both. Only drawing needs matplotlib, an optional
dependency: ``pip install 'autockpt[plot]'``.

Example:
    >>> import torch, autockpt
    >>> net = torch.nn.Sequential(*[m for _ in range(8)
    ...                             for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])
    >>> curves = autockpt.memory_curves(net, (torch.randn(8, 64),))
    >>> curves.checkpointed_peak_bytes < curves.baseline_peak_bytes
    True

NOTE [ Where the segments are in the timeline ]
    The curves are the timelines of :class:`~autockpt.running.measure.track_activation_memory`,
    taken exactly as :func:`~autockpt.running.measure.measure` takes them (same gradient handling,
    same default loss), so their maxima are the peaks ``measure`` reports. To know which ops belong
    to which checkpointed segment, the step of the transformed model is observed
    (NOTE [ Observing segments ] in :mod:`autockpt.running.runner`): the observer marks the tracker
    when one of that model's outermost segments starts and ends in forward and when its recompute in
    backward starts and ends, and hooks the segment's inputs so that the moment their gradients are
    ready ends the segment's backward. Marks add no ATen op, so the curve is the same as without
    them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.planning.planner import Plan
from autockpt.profiling.loss import LossFn
from autockpt.report import span_label
from autockpt.running.measure import PreservedState, check_arguments, make_step
from autockpt.running.runner import SegmentObserver, SegmentRun, observe_segments
from autockpt.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MemoryCurves",
    "SegmentSpan",
    "draw_memory",
    "memory_curves",
    "plot_memory",
    "require_matplotlib",
]

PICTURE_FORMATS = (".png", ".svg", ".pdf")
"""File extensions :func:`plot_memory` and :func:`draw_memory` can write."""


@dataclass(frozen=True)
class SegmentSpan:
    """Where one checkpointed segment ran in the timeline of the checkpointed step."""

    number: int
    """The segment's number in the printed plan (1 for the first checkpointed segment)."""
    modules: str
    """The modules it runs, as the plan prints them (``"0 .. 7"``)."""
    phase: str
    """``"forward"`` (its first run) or ``"backward"`` (recompute, then its backward)."""
    start_op: int
    """Index of the first op of the span in :attr:`MemoryCurves.checkpointed_bytes`."""
    end_op: int
    """Index one past the last op of the span."""


@dataclass(frozen=True)
class MemoryCurves:
    """Measured activation memory of one training step, op by op, without and with a plan.

    Both curves count what :func:`autockpt.measure` counts (activations and temporaries, not
    parameters, gradients or inputs); entry ``i`` is the bytes alive right after op ``i``.
    """

    plan: Plan
    """The plan the checkpointed step ran."""
    baseline_bytes: tuple[int, ...]
    """Live activation bytes after each op of the step without autockpt."""
    baseline_backward_op: int
    """Index of the first op of backward in :attr:`baseline_bytes`."""
    checkpointed_bytes: tuple[int, ...]
    """Live activation bytes after each op of the step with the plan."""
    checkpointed_backward_op: int
    """Index of the first op of backward in :attr:`checkpointed_bytes`."""
    spans: tuple[SegmentSpan, ...]
    """Where each checkpointed segment ran, in forward and in backward, in time order."""

    @property
    def baseline_peak_bytes(self) -> int:
        """Measured peak without autockpt."""
        return max(self.baseline_bytes, default=0)

    @property
    def checkpointed_peak_bytes(self) -> int:
        """Measured peak with the plan."""
        return max(self.checkpointed_bytes, default=0)


# --------------------------------------------------------------------------- analysis


def memory_curves(
    model: nn.Module,
    example_inputs: Any,
    *,
    budget_mb: float | None = None,
    plan: Plan | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | str | None = None,
    mode: str = "non_reentrant",
    strategy: str = "greedy",
) -> MemoryCurves:
    """Measure activation memory op by op for one step of ``model`` without and with a plan.

    Runs two real forward and backward passes (one of ``model``, one of
    ``autockpt.apply(model, plan=plan)``) and leaves ``model`` as it was, as
    :func:`autockpt.measure` does. The plan is ``plan`` if given, else
    ``autockpt.plan(model, example_inputs, budget_mb=budget_mb, loss_fn=loss_fn, mode=mode,
    strategy=strategy)``: both steps and the plan use the same loss, ``loss_fn`` (a callable
    or the name of a built-in loss) or the library's default (NOTE [ The default loss ] in
    :mod:`autockpt.profiling.loss`). Inputs take the same forms as everywhere: a tensor, a tuple or
    list of positional inputs, or a dict of keyword inputs.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[m for _ in range(8)
        ...                             for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])
        >>> x = torch.randn(8, 64)
        >>> curves = autockpt.memory_curves(net, (x,))
        >>> curves.checkpointed_peak_bytes == autockpt.measure(
        ...     autockpt.apply(net, plan=curves.plan), (x,)).peak_activation_bytes
        True
        >>> sorted({s.phase for s in curves.spans})
        ['backward', 'forward']

    Raises:
        InvalidArgumentError: bad arguments (a module already returned by ``apply``, both a
            budget and a plan), or the model fails on the inputs.
        InfeasibleBudgetError, TraceError: as for :func:`autockpt.plan`.
    """
    from autockpt.api import apply
    from autockpt.api import plan as make_plan
    from autockpt.runtime import is_checkpointed

    if is_checkpointed(model):
        raise InvalidArgumentError(
            "memory_curves needs the original model, not one returned by autockpt.apply: "
            "the curve without autockpt is measured on it",
            fix="pass the model you gave to autockpt.apply, and plan=autockpt.plan_of(ckpt)",
        )
    if plan is not None and budget_mb is not None:
        raise InvalidArgumentError(
            "pass either budget_mb or plan, not both: a plan already fixes the segments",
            fix="drop budget_mb, or make the plan with that budget",
        )
    args, kwargs, loss_fn = check_arguments(model, example_inputs, loss_fn, example_kwargs,
                                             0, 1)
    if plan is None:
        plan = make_plan(model, args, budget_mb=budget_mb, example_kwargs=kwargs,
                         loss_fn=loss_fn, mode=mode, strategy=strategy)
    elif not isinstance(plan, Plan):
        raise InvalidArgumentError(
            f"plan must be an autockpt.Plan, got {type(plan).__name__}",
            fix="make one with autockpt.plan(model, example_inputs, budget_mb=...)",
        )

    baseline, baseline_marks = _tracked_step(model, args, kwargs, loss_fn, None)
    ckpt = apply(model, plan=plan, example_inputs=args, example_kwargs=kwargs)
    # Only the outermost segments are marked: nested ones run inside their recompute.
    outer = [seg for seg in plan.segments if seg.depth == 0]
    numbers = {seg.start: i + 1 for i, seg in enumerate(outer)}
    checkpointed, marks = _tracked_step(ckpt, args, kwargs, loss_fn, numbers)
    labels = {i + 1: span_label(seg) for i, seg in enumerate(outer)}
    return MemoryCurves(
        plan=plan,
        baseline_bytes=baseline,
        baseline_backward_op=_mark_op(baseline_marks, "backward"),
        checkpointed_bytes=checkpointed,
        checkpointed_backward_op=_mark_op(marks, "backward"),
        spans=_spans(marks, labels),
    )


def _tracked_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    segment_numbers: dict[int, int] | None,
) -> tuple[tuple[int, ...], list[tuple[str, int]]]:
    """One tracked step, set up as :func:`autockpt.measure` sets it up; returns the bytes
    after each op and the marks as ``(label, op_index)``. With ``segment_numbers`` (the
    printed number of each outermost segment, by its first node) the segments of ``model``
    are marked too (NOTE [ Where the segments are in the timeline ])."""
    step = make_step(model, args, kwargs, loss_fn)
    observer = _SegmentMarks(model, step, segment_numbers or {})
    with PreservedState(model, step.grad_leaves, step.device), observe_segments(observer):
        result = step.run(track=True)
    tracker = result.tracker
    assert tracker is not None
    curve = tuple(point.current_bytes for point in tracker.timeline)
    return curve, [(m.label, m.op_index) for m in tracker.marks]


class _SegmentMarks(SegmentObserver):
    """Marks the tracker of ``step`` where the outermost segments of ``module`` run."""

    def __init__(self, module: nn.Module, step: Any, numbers: dict[int, int]) -> None:
        self.module = module
        self.step = step
        self.numbers = numbers

    def _number(self, run: SegmentRun) -> int | None:
        # Nested segments run inside their parent's recompute: only the outermost are marked.
        if run.module is not self.module or run.segment is None or run.segment.depth > 0:
            return None
        return self.numbers.get(run.segment.start)

    def _mark(self, label: str) -> None:
        if self.step.tracker is not None:
            self.step.tracker.mark(label)

    def segment_started(self, run: SegmentRun, inputs: tuple[Any, ...]) -> None:
        number = self._number(run)
        if number is None:
            return
        self._mark(f"segment {number}")
        for tensor in inputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: self._mark(f"grads {number}"))

    def segment_finished(self, run: SegmentRun) -> None:
        number = self._number(run)
        if number is not None:
            self._mark(f"segment end {number}")

    def recompute_started(self, run: SegmentRun) -> None:
        number = self._number(run)
        if number is not None:
            self._mark(f"recompute {number}")

    def recompute_finished(self, run: SegmentRun) -> None:
        number = self._number(run)
        if number is not None:
            self._mark(f"recomputed {number}")


def _mark_op(marks: Sequence[tuple[str, int]], label: str) -> int:
    return next((op for name, op in marks if name == label), 0)


def _spans(marks: Sequence[tuple[str, int]], labels: dict[int, str]) -> tuple[SegmentSpan, ...]:
    """Segment spans from the marks: forward from ``segment N`` to ``segment end N``;
    backward from ``recompute N`` to ``grads N``, or to the next segment's recompute, or to
    the end of the step."""
    spans = []
    end_of_step = _mark_op(marks, "end")
    for i, (label, op) in enumerate(marks):
        kind, _, tail = label.rpartition(" ")
        if kind not in ("segment", "recompute") or not tail.isdigit():
            continue
        number = int(tail)
        if kind == "segment":
            end = next((o for name, o in marks[i + 1:] if name == f"segment end {number}"), op)
            spans.append(SegmentSpan(number, labels.get(number, ""), "forward", op, end))
            continue
        end = end_of_step
        for name, later in marks[i + 1:]:
            other, _, n = name.rpartition(" ")
            if (other == "grads" and n == tail) or (other == "recompute" and n != tail) or (
                name == "end"
            ):
                end = later
                break
        spans.append(SegmentSpan(number, labels.get(number, ""), "backward", op, end))
    return tuple(spans)


# --------------------------------------------------------------------------- drawing


def require_matplotlib() -> None:
    """Raise a clear error when matplotlib, needed only for drawing, is not installed.

    Example:
        >>> require_matplotlib()  # silent when matplotlib is there
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise AutockptError(
            "drawing the memory picture needs matplotlib, which is not installed",
            fix="pip install 'autockpt[plot]' (or pip install matplotlib)",
        ) from err


def _check_path(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    target = Path(path)
    if target.suffix.lower() not in PICTURE_FORMATS:
        raise InvalidArgumentError(
            f"cannot tell the picture format of {str(path)!r} from its extension",
            fix=f"name the file with one of {', '.join(PICTURE_FORMATS)}, e.g. memory.png",
        )
    return target


def _unit(peak: int) -> tuple[str, float]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= size:
            return name, float(size)
    return "B", 1.0


def draw_memory(curves: MemoryCurves, path: str | Path | None = None, *,
                title: str | None = None) -> Figure:
    """Draw :class:`MemoryCurves`; write the figure to ``path`` (``.png``, ``.svg`` or
    ``.pdf``, by extension) when given.

    The picture shows both measured curves over the op index of one step, the budget as a
    solid line, the planner's estimated peaks as dashed lines, the start of backward, and
    each checkpointed segment shaded where it runs in forward and where it is recomputed
    and differentiated in backward, labelled with its number and modules. It uses the Agg
    renderer directly: no display, and pyplot's global state is left alone.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[m for _ in range(8)
        ...                             for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])
        >>> fig = autockpt.draw_memory(autockpt.memory_curves(net, (torch.randn(8, 64),)))
        >>> fig.axes[0].get_ylabel()
        'live activation memory (KiB)'

    Raises:
        AutockptError: matplotlib is not installed.
        InvalidArgumentError: ``path`` has an extension other than those above.
    """
    target = _check_path(path)
    require_matplotlib()
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    plan = curves.plan
    levels = [curves.baseline_peak_bytes, curves.checkpointed_peak_bytes,
              plan.baseline_peak_bytes, plan.estimated_peak_bytes, plan.budget_bytes or 0]
    unit, scale = _unit(max(levels))

    fig = Figure(figsize=(11, 5.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    grey, blue, red = "#7f7f7f", "#1f77b4", "#d62728"
    base_y = [b / scale for b in curves.baseline_bytes]
    ckpt_y = [b / scale for b in curves.checkpointed_bytes]
    ax.step(range(len(base_y)), base_y, where="post", color=grey, lw=1.4,
            label=f"without autockpt, measured (peak {format_bytes(curves.baseline_peak_bytes)})")
    ax.step(range(len(ckpt_y)), ckpt_y, where="post", color=blue, lw=1.6,
            label=f"with the plan, measured (peak {format_bytes(curves.checkpointed_peak_bytes)})")
    ax.axhline(plan.baseline_peak_bytes / scale, color=grey, ls="--", lw=1,
               label=f"estimated peak without ({format_bytes(plan.baseline_peak_bytes)})")
    ax.axhline(plan.estimated_peak_bytes / scale, color=blue, ls="--", lw=1,
               label=f"estimated peak with the plan ({format_bytes(plan.estimated_peak_bytes)})")
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / scale, color=red, lw=1.3,
                   label=f"budget ({format_bytes(plan.budget_bytes)})")

    top = max(levels) / scale * 1.22 or 1.0
    ax.set_ylim(0, top)
    ax.set_xlim(0, max(len(base_y), len(ckpt_y), 1))
    across = blended_transform_factory(ax.transData, ax.transAxes)
    for op, color, who in ((curves.checkpointed_backward_op, blue, "with the plan"),
                           (curves.baseline_backward_op, grey, "without")):
        ax.axvline(op, color=color, ls=":", lw=1)
        ax.text(op, 0.01, f" backward starts ({who})", transform=across, color=color,
                fontsize=7, rotation=90, ha="right", va="bottom")
    colors = {"forward": "#ff7f0e", "backward": "#9467bd"}
    for span in curves.spans:
        ax.axvspan(span.start_op, max(span.end_op, span.start_op + 1), color=colors[span.phase],
                   alpha=0.14, lw=0)
        text = f"{span.number}: {span.modules}" if span.phase == "forward" else (
            f"{span.number}: recompute + backward")
        ax.text((span.start_op + span.end_op) / 2, 0.985, text, transform=across, rotation=90,
                ha="center", va="top", fontsize=7, color=colors[span.phase])
    ax.set_xlabel("op index in one training step (forward, loss, then backward)")
    ax.set_ylabel(f"live activation memory ({unit})")
    ax.grid(axis="y", alpha=0.3)
    count = sum(1 for seg in plan.segments if seg.depth == 0)
    ax.set_title(title or (
        f"Activation memory of {plan.model or 'model'}({plan.input_signature}), "
        f"{plan.mode}: {count} checkpointed segment{'s' * (count != 1)}, "
        f"recompute {100 * plan.recompute_ratio:.0f}% of forward FLOPs"), fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8,
              frameon=False)
    if target is not None:
        # A fixed SVG id salt and no date keep the file identical from run to run.
        with matplotlib.rc_context({"svg.hashsalt": "autockpt"}):
            fmt = target.suffix.lower()[1:]
            fig.savefig(target, format=fmt, metadata={"Date": None} if fmt in ("svg", "pdf")
                        else None)
    return fig


def plot_memory(
    model: nn.Module,
    example_inputs: Any,
    *,
    budget_mb: float | None = None,
    plan: Plan | None = None,
    path: str | Path | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | str | None = None,
    mode: str = "non_reentrant",
    strategy: str = "greedy",
    title: str | None = None,
) -> Figure:
    """The memory picture of ``model``: :func:`memory_curves`, then :func:`draw_memory`.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[m for _ in range(8)
        ...                             for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])
        >>> fig = autockpt.plot_memory(net, (torch.randn(8, 64),), budget_mb=0.1)
        >>> fig.get_size_inches().tolist()
        [11.0, 5.6]

    Raises:
        AutockptError: matplotlib is not installed (checked before anything runs).
        InvalidArgumentError, InfeasibleBudgetError, TraceError: as for :func:`memory_curves`
            and :func:`draw_memory`.
    """
    _check_path(path)
    require_matplotlib()
    curves = memory_curves(model, example_inputs, budget_mb=budget_mb, plan=plan,
                           example_kwargs=example_kwargs, loss_fn=loss_fn, mode=mode,
                           strategy=strategy)
    return draw_memory(curves, path, title=title)
