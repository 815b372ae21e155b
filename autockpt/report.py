"""Rendering: plans and reports as text tables with human units. No analysis happens here."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autockpt.units import format_bytes, format_flops, format_names

# NOTE [ Rendering sits above the data it renders ]
# planner (Plan, Segment) and findings (Report) import this module to render themselves in
# __str__; this module needs their types for annotations only, so it imports them for type
# checkers alone and at run time depends on nothing but units: the import graph runs one way.
if TYPE_CHECKING:
    from autockpt.planning.planner import Plan, Segment
    from autockpt.tools.findings import Report

__all__ = ["PLAN_COLUMNS", "PLAN_COLUMNS_RIGHT", "format_findings", "format_plan", "format_table",
           "loss_summary",
           "plan_rows", "plan_summary", "span_label"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] = ()
                 ) -> str:
    """A plain-text table: columns padded to their widest cell, numbers right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    align = list(right) + [False] * (len(header) - len(right))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, align)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def span_label(seg: Segment) -> str:
    """The modules a segment runs, as printed: ``"0 .. 4"``, or one name when it is one.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> span_label(autockpt.plan(net, (torch.randn(8, 64),)).segments[0])
        '0 .. 1'
    """
    first = seg.first_module or "(forward)"
    last = seg.last_module or "(forward)"
    return first if first == last else f"{first} .. {last}"


PLAN_COLUMNS = ("#", "modules", "nodes", "kept", "freed", "recompute", "dummy", "note")
"""Column names of the plan table, in order (``docs/plan-columns.md`` explains each)."""

PLAN_COLUMNS_RIGHT = (True, False, True, True, True, True, False, False)
"""Which of :data:`PLAN_COLUMNS` hold numbers and are right-aligned."""


CAPTURE_LABELS = {
    "fx": "torch.fx",
    "export": "torch.export",
    "fx-leaves": "torch.fx, untraceable submodules kept whole",
    "modules": "module hooks (checkpointing whole submodules)",
}
"""How a plan's ``capture`` is named in its printed header."""


def plan_summary(plan: Plan) -> list[str]:
    """The header lines of a printed plan: model, mode, peaks, budget, recompute, counts.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> plan_summary(autockpt.plan(net, (torch.randn(8, 64),)))[0]
        'autockpt plan for Sequential(input=float32[8, 64])'
    """
    budget = "none (least memory reachable)" if plan.budget_bytes is None else format_bytes(
        plan.budget_bytes
    )
    ratio = f"{100 * plan.recompute_ratio:.1f}% of forward FLOPs"
    inner = sum(1 for seg in plan.segments if seg.depth > 0)
    nested = f" ({inner} of them inside others)" if inner else ""
    header = [
        f"autockpt plan for {plan.model or 'model'}({plan.input_signature})",
        f"  mode {plan.mode}, strategy {plan.strategy}, {plan.node_count} graph nodes",
        f"  baseline peak   {format_bytes(plan.baseline_peak_bytes)} (no checkpointing)",
        f"  estimated peak  {format_bytes(plan.estimated_peak_bytes)}"
        f" (least reachable {format_bytes(plan.min_peak_bytes)}"
        f"{_replayed(plan)})",
        f"  budget          {budget}",
        f"  recompute       {format_flops(plan.recompute_flops)} ({ratio})",
        f"  segments        {len(plan.segments)} checkpointed{nested}, "
        f"{len(plan.skipped)} left alone",
    ]
    if plan.serves:
        header.append(f"  serves          {plan.serves}")
    header.extend(_step_lines(plan))
    if plan.cost_model != "flops":
        # Only worth a line when it differs from the default: timed plans are not reproducible.
        header.append(f"  cost model      {plan.cost_model} (node times measured on the device)")
    if plan.kept_whole:
        header.append(f"  kept whole      {format_names(plan.kept_whole)} (called as modules, "
                      "so that their hooks run)")
    head = plan.chunked_head
    if head is not None:
        stretch = head.stretch
        header.append(
            f"  head            {head.chunks} chunks of {head.chunk_rows} rows: "
            f"{stretch.first_module or stretch.nodes[0]}"
            f" .. {stretch.last_module or stretch.projection}"
            f" -> {stretch.loss} (the {stretch.rows} x {stretch.width} logits never whole; "
            f"gradients made in forward, {format_flops(head.gradient_flops)})")
        if stretch.returned:
            header.append(f"                  {format_names(stretch.returned)} returned as None")
    if plan.capture != "fx":
        # Only worth a line when the first rung of the ladder failed: it says why.
        header.append(f"  captured by     {CAPTURE_LABELS.get(plan.capture, plan.capture)}")
        if plan.capture_reason:
            header.append(f"    because {plan.capture_reason}")
    return header + [f"  note: {note}" for note in plan.notes]


def _replayed(plan: Plan) -> str:
    if plan.estimate != "replay":
        return ""
    return "; the step replayed for real" if plan.real_replay else \
        "; the step replayed on fake tensors"


def loss_summary(plan: Plan) -> str:
    """What a plan priced as the loss of the step, in one line.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Linear(64, 10)
        >>> loss_summary(autockpt.plan(net, (torch.randn(8, 64),)))
        'not given, assumed an output-sized gradient; pass loss_fn (320 B assumed)'
        >>> class OwnLoss(torch.nn.Module):  # as a Hugging Face model given labels=
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.head = torch.nn.Linear(64, 10)
        ...     def forward(self, x, labels):
        ...         logits = self.head(x)
        ...         loss = torch.nn.functional.cross_entropy(logits, labels)
        ...         return {"loss": loss, "logits": logits}
        >>> batch = {"x": torch.randn(8, 64), "labels": torch.zeros(8, dtype=torch.long)}
        >>> loss_summary(autockpt.plan(OwnLoss(), batch, chunk_head=False))
        "the model's own (output.loss); its other outputs (logits 320 B) held through backward"
    """
    loss = plan.loss
    if loss is None:
        return "not priced"
    if loss.kind == "assumed":
        return (f"not given, assumed an output-sized gradient; pass loss_fn "
                f"({format_bytes(loss.grad_bytes)} assumed)")
    if loss.kind == "inner":
        if loss.name != "output.loss":
            return f"the model's own ({loss.name})"
        # Everything the model returns is held through backward (NOTE [ The loss node ] in
        # autockpt.profiling.profile): the line names it, and why the logits are not among it.
        chunks = "the head runs in chunks" if plan.chunked_head is not None else ""
        if loss.held:
            parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in loss.held)
            return (f"the model's own (output.loss); its other outputs ({parts}) held "
                    f"through backward{'; no logits: ' + chunks if chunks else ''}")
        return ("the model's own (output.loss); its other outputs: none returned"
                f"{', ' + chunks if chunks else ''}")
    return (f"loss_fn {loss.name}: saves {format_bytes(loss.saved_bytes)}, sends "
            f"{format_bytes(loss.grad_bytes)} of gradient into the output")


def _step_lines(plan: Plan) -> list[str]:
    """Header lines on the step the plan holds for: its loss, accumulation, the device."""
    lines = [f"  loss            {loss_summary(plan)}"]
    if plan.grad_accumulation:
        lines.append("  gradients       accumulated: .grad exists at backward, weight-gradient "
                     "temporaries counted")
    if plan.device is not None:
        device = plan.device
        lines.append(f"  whole device    {format_bytes(device.total_bytes)}: parameters "
                     f"{format_bytes(device.parameter_bytes)}, gradients "
                     f"{format_bytes(device.gradient_bytes)}, {device.optimizer} state "
                     f"{format_bytes(device.optimizer_state_bytes)}, inputs "
                     f"{format_bytes(device.input_bytes)}; activations get "
                     f"{format_bytes(device.activation_budget_bytes)}")
        if device.optimizer_step_bytes:
            lines.append(f"    {device.optimizer}.step() temporaries "
                         f"{format_bytes(device.optimizer_step_bytes)} (after backward)")
    return lines


def plan_rows(plan: Plan) -> list[tuple[Segment, list[str]]]:
    """One row of cells (see :data:`PLAN_COLUMNS`) per stretch of the graph, in graph order,
    each with the :class:`~autockpt.planning.planner.Segment` it describes.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> [cells[0] for _, cells in plan_rows(autockpt.plan(net, (torch.randn(8, 64),)))]
        ['1', '-']
    """
    stretches = sorted([*plan.segments, *plan.skipped], key=lambda s: s.start)
    rows = []
    number: list[int] = []  # "2.1": the first segment nested in the second
    for seg in stretches:
        if seg.checkpointed:
            del number[seg.depth + 1:]
            if len(number) > seg.depth:
                number[seg.depth] += 1
            else:
                number.append(1)
            notes = []
            if seg.input_count > 1 or seg.output_count > 1:
                # Skip connections cross it: say how many tensors it keeps and hands on.
                notes.append(f"{_count(seg.input_count, 'input')}, "
                             f"{_count(seg.output_count, 'output')}")
            if seg.keeps:
                notes.append(f"keeps {_count(seg.kept_ops, 'matmul/conv output')} "
                             f"({format_bytes(seg.kept_bytes)}), recomputes "
                             f"{_count(seg.recomputed_ops, 'other op')}")
            if seg.preserve_rng:
                notes.append("rng replayed")
            if seg.buffers:
                notes.append(f"{len(seg.buffers)} buffers updated once")
            rows.append((seg, [
                ".".join(map(str, number)), "  " * seg.depth + span_label(seg),
                str(seg.node_count),
                format_bytes(seg.boundary_bytes), format_bytes(seg.freed_bytes),
                format_flops(seg.recompute_flops), "yes" if seg.dummy_arg else "no",
                ", ".join(notes),
            ]))
        else:
            rows.append((seg, ["-", span_label(seg), str(seg.node_count), "", "", "", "",
                               f"not checkpointed: {seg.reason}"]))
    return rows


def format_plan(plan: Plan) -> str:
    """Render a plan: a summary header, then one row per stretch of the graph in order.

    Example:
        >>> import torch, autockpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> print(format_plan(autockpt.plan(net, (torch.randn(8, 64),))))  # doctest: +SKIP
    """
    table = format_table(PLAN_COLUMNS, [cells for _, cells in plan_rows(plan)],
                         right=PLAN_COLUMNS_RIGHT)
    return "\n".join(plan_summary(plan)) + "\n\n" + table


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 or noun == "info" else f"{n} {noun}s"


def format_findings(report: Report, *, width: int = 96) -> str:
    """Render a diagnostics report: a summary line, a table of the findings (most severe
    first), then each finding's explanation and fix.

    Example:
        >>> from autockpt.tools.findings import Finding, Report
        >>> print(format_findings(Report((Finding("AC006", "warning", "train.py:3",
        ...     "checkpoint() is called without use_reentrant.",
        ...     "checkpoint(fn, x, use_reentrant=False)"),), subject="train.py")))
        autockpt report for train.py: 0 errors, 1 warning, 0 info
        <BLANKLINE>
        #  severity  code   where       problem
        -  --------  -----  ----------  -----------------------------------
        1  warning   AC006  train.py:3  use_reentrant not passed explicitly
        <BLANKLINE>
        1. AC006 (warning) at train.py:3
           checkpoint() is called without use_reentrant.
           fix:
             checkpoint(fn, x, use_reentrant=False)
    """
    counts = ", ".join([
        _count(len(report.errors), "error"),
        _count(len(report.warnings), "warning"),
        _count(len(report.infos), "info"),
    ])
    subject = report.subject or "model"
    header = f"autockpt report for {subject}: {counts}"
    if report.checkpoint_calls:
        header += f" ({_count(report.checkpoint_calls, 'checkpoint call')} observed)"
    if not report.findings:
        return header + "\nno findings"
    rows = [[str(i), f.severity, f.code, f.where, f.title]
            for i, f in enumerate(report.findings, 1)]
    table = format_table(["#", "severity", "code", "where", "problem"], rows, right=[True])
    details = []
    for i, finding in enumerate(report.findings, 1):
        lines = [f"{i}. {finding.code} ({finding.severity}) at {finding.where}"]
        for paragraph in finding.message.splitlines():
            lines += textwrap.wrap(paragraph, width - 3, initial_indent="   ",
                                   subsequent_indent="   ") or [""]
        lines.append("   fix:")
        lines += [("     " + line).rstrip() for line in finding.fix.splitlines()]
        details.append("\n".join(lines))
    return header + "\n\n" + table + "\n\n" + "\n\n".join(details)
