"""autockpt against every alternative, side by side, in one run.

The alternatives on a :class:`models.Blocks` model: no checkpointing, every block (Hugging
Face's and timm's switch), every second block, ``checkpoint_sequential`` with sqrt(n)
segments, PyTorch's ``apply_activation_checkpointing`` on every block, the same with
torchtitan's "selective op" policy (the matmuls' and attention's outputs saved, every other
op in the block recomputed; :data:`OP_POLICY_SAVED`), and with ``--compile`` torch.compile
with two activation memory budgets.

For each model and method: peak activation memory (measured with ``autockpt.measure``), the
step time as a ratio to no checkpointing (median of ``--repeat`` steps after a warm-up,
timed round-robin across the methods so that the machine's load falls on all alike), the
backward FLOPs as a ratio to no checkpointing (``FlopCounterMode``: what is recomputed; on
the CPU autockpt adds the attention kernel torch's table leaves at zero, on CUDA torch counts
its own attention kernels), and the time autockpt took to plan. With ``--device cuda`` the
models, inputs and targets live on the GPU, timed steps are bracketed by
``torch.cuda.synchronize()``, and a ``CUDA max MiB`` column adds what the caching allocator
saw: the rise of ``torch.cuda.max_memory_allocated`` over one step
(``MemoryReport.cuda_max_memory_allocated_bytes``; for torch.compile rows, the same rise
measured here, since the dispatch tracker cannot see inside compiled code). autockpt is
asked, for each alternative, for the memory that alternative measured, so each pair can be
compared at equal or lower memory.

Every step is a real training step: each model has one loss (cross-entropy against fixed
targets for the classifier heads and the GPT's tokens; see ``models.MODELS``), and every
method is measured, timed, FLOP-counted and, for autockpt, planned (``loss_fn=``) with it. A
``sum()`` of the output would send only a broadcast scalar into the model and hide the
output-sized gradient and the loss's own saved tensors, so neither the budgets autockpt is
given nor the peaks measured would be those of the step a user runs. The table's ``loss``
column and the JSON's ``loss`` field say which loss each row used.

    python benchmarks/compare.py                       # mlp72, gpt, vit (+ resnet50, unet2d if
                                                       # torchvision, diffusers import)
    python benchmarks/compare.py --models unet2d       # diffusers' UNet2DModel against its
                                                       # enable_gradient_checkpointing()
    python benchmarks/compare.py --models mlp72 --repeat 3 --json out.json --plot-dir out/
                                                       # --plot-dir: memory against backward
                                                       # FLOPs and time (needs matplotlib)
    python benchmarks/compare.py --compile             # adds torch.compile with a memory budget
    python benchmarks/compare.py --device cuda --models gpt,resnet50 --json cuda.json

A model whose optional package (torchvision, diffusers) does not import is skipped with a note.

Timings on a shared machine are noisy: compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import MODELS, BenchLoss, Blocks, make_loss, sqrt_segments  # noqa: E402

import autockpt  # noqa: E402
from autockpt.ops.instrument import flop_counter  # noqa: E402
from autockpt.profiling.loss import LossFn  # noqa: E402
from autockpt.report import format_table  # noqa: E402

MIB = 2**20

OPTIONAL_PACKAGES = {"resnet50": "torchvision", "unet2d": "diffusers"}
"""The package each optional model is built from: a model whose package does not import is
left out of the defaults and skipped with a note when named."""


@dataclass
class Row:
    """One method on one model."""

    model: str
    method: str
    peak_activation_mib: float | None
    step_ms: float
    time_ratio: float
    backward_flops_ratio: float | None
    plan_seconds: float | None = None
    matched_to: str | None = None
    note: str = ""
    saved_mib: float | None = None
    """torch.compile rows only: bytes saved for backward at the end of forward (packed by
    ``saved_tensors_hooks``), a lower bound of the peak the dispatch tracker cannot see."""
    loss: str = ""
    """The loss this row's step backpropagated from (``cross_entropy``, ``mse``); empty only
    where a subclass fills it in later."""
    cuda_max_allocated_mib: float | None = None
    """On CUDA: the rise of ``torch.cuda.max_memory_allocated`` over one step above what was
    allocated before it (``MemoryReport.cuda_max_memory_allocated_bytes``): what the caching
    allocator saw, kernel workspaces and parameter gradients included. None on the CPU."""


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels: a CUDA step returns before its kernels ran, so
    a timer read without this measures the launch, not the step. A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_step_peak(model: nn.Module, step: Callable[[nn.Module], torch.Tensor],
                   device: torch.device) -> int | None:
    """The rise of ``torch.cuda.max_memory_allocated`` over one step of ``model`` (gradients
    cleared first, as ``autockpt.measure`` does), or None off CUDA.

    For torch.compile rows: ``autockpt.measure`` would run the compiled code under its
    dispatch mode, but the allocator sees what compiled kernels allocate as it sees any other.
    """
    if device.type != "cuda":
        return None
    model.train()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(model).backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    model.zero_grad(set_to_none=True)
    return peak


def device_info(device: torch.device) -> dict[str, Any]:
    """What the JSON header records of the machine: the device, its name, torch's version
    and, on CUDA, the CUDA version torch was built with."""
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def parse_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device`` as a torch.device: ``cpu`` or ``cuda`` (``cuda:N`` too), refused with a
    clear message where CUDA is asked for and not available."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        parser.error(f"--device {name!r}: {err}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def missing_package(name: str) -> str | None:
    """The optional package model ``name`` needs when it does not import, else None."""
    package = OPTIONAL_PACKAGES.get(name)
    if package is None:
        return None
    try:
        __import__(package)
    except Exception:  # missing, or built for another torch
        return package
    return None


def _backward_flops(model: nn.Module, x: torch.Tensor, loss_fn: LossFn) -> int:
    """FLOPs of one backward from ``loss_fn(model(x))``: the loss's own backward is the same
    for every method, so the ratios differ by what each recomputes."""
    model.train()
    loss = loss_fn(model(x))
    with flop_counter() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


OP_POLICY_METHOD = "op policy on every block (torchtitan selective op)"

OP_POLICY_SAVED = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_flash_attention_for_cpu")
"""The aten ops whose outputs the op policy saves; every other op in a block is recomputed.

torchtitan's "selective op" activation checkpointing saves the matmuls and the attention
kernels. Its models' linears have no bias (``aten.mm``); here they have one, so ``addmm``,
and the batched ``bmm``/``baddbmm`` are saved too. The CPU's fused attention kernel
(``..._for_cpu``) stands for the CUDA ones, so that on the CPU attention is saved as it is on
CUDA. torchtitan also recomputes every second ``mm`` to save more; this policy saves them all.
"""


def _op_policy_packets() -> frozenset[Any]:
    """The op packets of :data:`OP_POLICY_SAVED` that this torch has."""
    return frozenset(getattr(torch.ops.aten, name) for name in OP_POLICY_SAVED
                     if hasattr(torch.ops.aten, name))


def op_policy_context_fn() -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` that
    saves the outputs of the ops in :data:`OP_POLICY_SAVED` (``MUST_SAVE``) and recomputes
    everything else in the checkpointed region (``PREFER_RECOMPUTE``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _op_policy_packets()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(func, "overloadpacket", None) in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # Each checkpointed call needs contexts of its own: they hold that call's saved outputs.
    return functools.partial(create_selective_checkpoint_contexts, policy)


def _wrap_every_block(base: Blocks, **checkpoint_kwargs: Any) -> Blocks:
    """A copy of ``base`` with every block wrapped by PyTorch's ``checkpoint_wrapper``
    (non-reentrant) through ``apply_activation_checkpointing``; ``checkpoint_kwargs`` go to
    ``torch.utils.checkpoint.checkpoint`` (``context_fn=`` for a selective policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapped = copy.deepcopy(base)
    blocks = set(wrapped.blocks)
    apply_activation_checkpointing(
        wrapped,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **checkpoint_kwargs),
        check_fn=lambda m: m in blocks,
    )
    return wrapped


def _alternatives(base: Blocks, compile_budgets: bool) -> list[tuple[str, nn.Module, str]]:
    out: list[tuple[str, nn.Module, str]] = [("no checkpointing", base, "")]
    every = copy.deepcopy(base)
    every.every = 1
    out.append(("every block (HF/timm style)", every, ""))
    second = copy.deepcopy(base)
    second.every = 2
    out.append(("every 2nd block", second, ""))
    seq = copy.deepcopy(base)
    seq.segments = sqrt_segments(seq)
    out.append((f"checkpoint_sequential({seq.segments})", seq, ""))
    out.append(("apply_activation_checkpointing", _wrap_every_block(base), ""))
    # Selective activation checkpointing as torchtitan's "op" mode: every block checkpointed,
    # the matmuls' and attention's outputs kept, the cheap ops between them recomputed.
    out.append((OP_POLICY_METHOD,
                _wrap_every_block(base, context_fn=op_policy_context_fn()), ""))
    if compile_budgets:
        for budget in (0.5, 0.1):
            out.append((f"torch.compile(memory budget {budget})", _compiled(base, budget), ""))
    return out


def _saved_for_backward(model: nn.Module, x: torch.Tensor, loss: BenchLoss) -> int:
    """Bytes of the distinct activation storages (not parameters, buffers, the input or the
    loss's targets) that autograd saves for backward in one forward and its loss.

    Used for torch.compile, whose compiled forward allocates outside the dispatcher where
    ``autockpt.measure`` cannot see it; what it saves still goes through the saved-tensor
    hooks. The peak is at least this much (plus the model output and backward's gradients).
    """
    sizes: dict[int, int] = {}
    # Like autockpt.measure, count activations only: compiled code saves the weights too,
    # and the loss saves its targets, which exist before the step as the input does.
    not_activations = {t.untyped_storage().data_ptr()
                       for t in (*model.parameters(), *model.buffers(), x, loss.target)}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in not_activations:
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    # The loss runs inside the hooks: what it saves (cross-entropy's log-probabilities, as
    # big as the logits) is in the peak autockpt is measured with, so it is in this bound too.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss.fn(model(x))
    value.backward()
    model.zero_grad(set_to_none=True)
    return sum(sizes.values())


def _compiled(base: Blocks, budget: float) -> nn.Module:
    """``torch.compile`` (inductor) with ``activation_memory_budget=budget``.

    The budget goes into a backend of its own: dynamo reuses a compiled graph for another
    module of the same structure (parameters are graph inputs), and neither its guards nor
    the compile caches look at the budget, so two budgets compiled the plain way silently
    share the first one's partition.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    inductor_config.force_disable_caches = True

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(graph, example_inputs)

    return torch.compile(copy.deepcopy(base), backend=backend)


def run_model(name: str, repeat: int, compile_budgets: bool,
              losses: dict[str, str] | None = None,
              device: torch.device | str = "cpu") -> list[Row]:
    """Every method on model ``name``, all with the model's one loss, on ``device``;
    ``losses`` (when given) gets ``name``'s loss described in words."""
    device = torch.device(device)
    spec = MODELS[name]
    # Built on the CPU (the same seeded weights and batch on every device), then moved.
    base = spec.build().to(device)
    x = spec.batch().to(device)
    # Built once, before anything is measured or timed: its targets are fixed tensors, so
    # each step only computes the loss, and every method sees the very same targets.
    loss: BenchLoss = make_loss(spec, base, x)
    loss_fn = loss.fn
    if losses is not None:
        losses[name] = loss.description
    print(f"  loss: {loss.description}", flush=True)
    rows: list[Row] = []
    reference: dict[str, float] = {}

    timed: list[tuple[Row, nn.Module]] = []

    def record(method: str, model: nn.Module, *, plan_seconds: float | None = None,
               matched_to: str | None = None, note: str = "", memory: bool = True) -> Row:
        report = autockpt.measure(model, (x,), loss_fn=loss_fn) if memory else None
        flops = None if not memory else _backward_flops(model, x, loss_fn)
        if not reference:
            reference["flops"] = float(flops or 1)
        row = Row(
            model=name, method=method,
            peak_activation_mib=None if report is None else report.peak_activation_bytes / MIB,
            step_ms=float("nan"), time_ratio=float("nan"),
            backward_flops_ratio=None if flops is None else flops / reference["flops"],
            plan_seconds=plan_seconds, matched_to=matched_to, note=note, loss=loss.name,
        )
        if report is not None and report.cuda_max_memory_allocated_bytes is not None:
            row.cuda_max_allocated_mib = report.cuda_max_memory_allocated_bytes / MIB
        rows.append(row)
        timed.append((row, model))
        cuda = ("" if row.cuda_max_allocated_mib is None
                else f"  CUDA max {row.cuda_max_allocated_mib:8.2f} MiB")
        print(f"  {name:9s} {method:50s} peak {row.peak_activation_mib or float('nan'):8.2f} MiB"
              f"{cuda}", flush=True)
        return row

    alternatives = (spec.alternatives(base) if spec.alternatives is not None
                    else _alternatives(base, compile_budgets))
    measured = []
    for method, model, note in alternatives:
        if method.startswith("torch.compile"):
            # Compiles it, before the timed steps.
            saved = _saved_for_backward(model, x, loss) / MIB
            row = record(method, model, memory=False,
                         note=f"saves {saved:.2f} MiB for backward (a lower bound of its "
                              "peak: the dispatch tracker cannot see inside compiled code)")
            row.saved_mib = saved
            allocated = cuda_step_peak(model, lambda m: loss_fn(m(x)), device)
            if allocated is not None:
                row.cuda_max_allocated_mib = allocated / MIB
        else:
            row = record(method, model, note=note)
        measured.append(row)
    for row in measured:
        # Against torch.compile autockpt gets a budget of what the compiled code merely
        # saves: its true peak is higher, so this is the harder comparison for autockpt.
        target = row.peak_activation_mib if row.saved_mib is None else row.saved_mib
        assert target is not None
        if target <= 0:
            rows.append(Row(model=name, method="autockpt", peak_activation_mib=None, step_ms=0.0,
                            time_ratio=float("nan"), backward_flops_ratio=None,
                            matched_to=row.method,
                            note="not matched: the saved-tensor hooks saw nothing saved",
                            loss=loss.name))
            continue
        start = time.perf_counter()
        try:
            # The loss is planned for too: its saved tensors and the output-sized gradient
            # it sends back count in the budget, as they do in the measured peak.
            ckpt = autockpt.apply(copy.deepcopy(base), budget_mb=target, example_inputs=(x,),
                                  loss_fn=loss_fn)
        except autockpt.InfeasibleBudgetError as err:
            rows.append(Row(model=name, method="autockpt", peak_activation_mib=None, step_ms=0.0,
                            time_ratio=float("nan"), backward_flops_ratio=None,
                            matched_to=row.method,
                            note=f"infeasible: least reachable "
                                 f"{err.min_feasible_bytes / MIB:.2f} MiB",
                            loss=loss.name))
            continue
        seconds = time.perf_counter() - start
        plan = autockpt.plan_of(ckpt)
        record(f"autockpt (budget {target:.2f} MiB)", ckpt, plan_seconds=seconds,
               matched_to=row.method, note=_segments_note(plan))
    # The least memory autockpt reaches (segments nested inside segments where that pays).
    start = time.perf_counter()
    ckpt = autockpt.apply(copy.deepcopy(base), example_inputs=(x,), loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    record("autockpt (least memory)", ckpt, plan_seconds=seconds,
           note=_segments_note(autockpt.plan_of(ckpt)))
    seconds_per_step = time_interleaved([model for _, model in timed],
                                        lambda model: loss_fn(model(x)), repeat, device=device)
    for (row, _), step in zip(timed, seconds_per_step):
        row.step_ms = step * 1000
        row.time_ratio = step / seconds_per_step[0]
    return rows


def time_interleaved(models: list[nn.Module], loss: Callable[[nn.Module], torch.Tensor],
                     repeat: int, *, device: torch.device | str = "cpu") -> list[float]:
    """Median seconds of one training step (``loss(model)``, then backward) per model, timed
    round-robin: one warm-up round, then ``repeat`` rounds each running every model once,
    so that a change in the load of a shared machine falls on all methods alike. On CUDA
    each step starts and ends with :func:`synchronize`, so that it is timed whole and alone
    (not the previous model's kernels still queued)."""
    device = torch.device(device)
    samples: list[list[float]] = [[] for _ in models]
    for round_index in range(repeat + 1):
        for model, out in zip(models, samples):
            model.train()
            model.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            loss(model).backward()
            synchronize(device)
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if round_index:
                out.append(elapsed)
    return [statistics.median(out) for out in samples]


def _segments_note(plan: autockpt.Plan) -> str:
    nested = sum(1 for seg in plan.segments if seg.depth > 0)
    return f"{len(plan.segments)} segments" + (f", {nested} nested" if nested else "")


def verdicts(rows: list[Row]) -> list[str]:
    """For each alternative: does autockpt, at the same or lower memory, recompute no more
    and run no slower?"""
    out = []
    for row in rows:
        if row.matched_to is None or row.method == "autockpt":
            continue
        alt = next(r for r in rows if r.model == row.model and r.method == row.matched_to)
        if alt.saved_mib is not None and row.peak_activation_mib is not None:
            # torch.compile: its peak is not visible, only what it saves; FLOPs inside compiled
            # code are not counted either, so time is the comparison.
            memory_ok = row.peak_activation_mib <= alt.saved_mib * 1.05
            time_ok = row.time_ratio <= alt.time_ratio
            out.append(
                f"{row.model}: vs {alt.method}: peak {'<=' if memory_ok else '>'} what it "
                f"saves, time {'<=' if time_ok else '>'} ({row.peak_activation_mib:.2f} MiB "
                f"peak vs {alt.saved_mib:.2f} MiB saved, time x{row.time_ratio:.2f} vs "
                f"x{alt.time_ratio:.2f})")
            continue
        if row.peak_activation_mib is None or alt.peak_activation_mib is None:
            continue
        memory_ok = row.peak_activation_mib <= alt.peak_activation_mib * 1.001
        flops_ok = (row.backward_flops_ratio or 0) <= (alt.backward_flops_ratio or 0) + 1e-9
        time_ok = row.time_ratio <= alt.time_ratio
        out.append(
            f"{row.model}: vs {alt.method}: memory {'<=' if memory_ok else '>'}, "
            f"recompute {'<=' if flops_ok else '>'}, time {'<=' if time_ok else '>'} "
            f"({row.peak_activation_mib:.2f} vs {alt.peak_activation_mib:.2f} MiB, "
            f"FLOPs x{row.backward_flops_ratio:.2f} vs x{alt.backward_flops_ratio:.2f}, "
            f"time x{row.time_ratio:.2f} vs x{alt.time_ratio:.2f})"
        )
    return out


PLOT_NEEDS = "--plot-dir needs matplotlib: pip install matplotlib (or autockpt's [plot] extra)"


def matplotlib_missing() -> str | None:
    """Why ``--plot-dir`` cannot plot (matplotlib does not import), or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        return f"{PLOT_NEEDS} ({err})"
    return None


def _annotate(ax: Any, points: list[tuple[float, float, str]]) -> None:
    """One annotation per group of points whose labels would overlap (within 2% of the
    memory axis' span and 12% of the other's), their labels one per line; a label to the
    right of its point, or to the left (and below) in the right part of the panel, so that it
    stays inside the figure."""
    if not points:
        return
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    dx = 0.12 * ((max(xs) - min(xs)) or 1.0)
    dy = 0.02 * ((max(ys) - min(ys)) or 1.0)
    groups: list[list[tuple[float, float, str]]] = []
    for point in sorted(points, key=lambda p: (p[1], p[0])):
        for group in groups:
            x0, y0, _ = group[0]
            if abs(point[0] - x0) <= dx and abs(point[1] - y0) <= dy:
                group.append(point)
                break
        else:
            groups.append([point])
    middle = (min(xs) + max(xs)) / 2
    for group in groups:
        x, y, _ = group[0]
        left = x > middle and max(xs) > min(xs)
        # Left of the point and below it: autockpt's line rises to the left.
        ax.annotate("\n".join(dict.fromkeys(p[2] for p in group)), (x, y), fontsize=6.5,
                    xytext=(-6, -3) if left else (6, 2), textcoords="offset points",
                    ha="right" if left else "left", va="top" if left else "bottom")


def plot(rows: list[Row], directory: Path) -> list[Path]:
    """One PNG per model (``pareto_<model>.png``), two panels side by side: peak activation
    memory (MiB, measured) against backward FLOPs and against step time, both as ratios to no
    checkpointing. Every method is a labelled point (methods on the same spot share one
    label). autockpt's rows (one per alternative's memory, and its least memory) are joined by
    a line in order of memory; each sits at the height of the method it was asked to match,
    so only its least memory is named.

    torch.compile rows have no measured peak and no FLOP count (compiled code is invisible to
    both): they appear in the time panel only, at what they save for backward, a lower bound
    of their peak (hollow triangles). Needs matplotlib (:func:`matplotlib_missing`)."""
    why = matplotlib_missing()
    if why is not None:
        raise ImportError(why)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model and r.peak_activation_mib is not None]
        compiled = [r for r in rows if r.model == model and r.saved_mib is not None]
        ours = sorted((r for r in mine if r.method.startswith("autockpt")),
                      key=lambda r: (r.peak_activation_mib or 0, r.backward_flops_ratio or 0))
        others = [r for r in mine if not r.method.startswith("autockpt")]
        fig, (flops_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=110, sharey=True)
        panels = ((flops_ax, "backward_flops_ratio",
                   "backward FLOPs / no checkpointing (recompute shows here)"),
                  (time_ax, "time_ratio", "step time / no checkpointing (median)"))
        for ax, field, xlabel in panels:
            points: list[tuple[float, float, str]] = []
            for r in others:
                x = getattr(r, field)
                if x is None:
                    continue
                op_policy = r.method == OP_POLICY_METHOD
                ax.scatter(x, r.peak_activation_mib, marker="D" if op_policy else "s",
                           color="tab:orange" if op_policy else "tab:gray", zorder=3,
                           label="op policy (selective op)" if op_policy else None)
                points.append((x, r.peak_activation_mib, r.method))
            line = [(getattr(r, field), r.peak_activation_mib) for r in ours
                    if getattr(r, field) is not None]
            ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", color="tab:blue",
                    zorder=4, label="autockpt, asked for each other method's memory (the "
                                    "same height), and its least memory")
            # Each matched autockpt point sits at the height of the method it was asked to
            # match; only the one that matches none is named.
            points += [(getattr(r, field), r.peak_activation_mib, "autockpt (least memory)")
                       for r in ours if r.matched_to is None and getattr(r, field) is not None]
            if field == "time_ratio":
                for r in compiled:
                    ax.scatter(r.time_ratio, r.saved_mib, marker="v", facecolors="none",
                               edgecolors="tab:red", zorder=3)
                    points.append((r.time_ratio, r.saved_mib or 0.0,
                                   f"{r.method}: saves (lower bound)"))
            _annotate(ax, points)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        flops_ax.set_ylabel("peak activation memory (MiB, measured)")
        flops_ax.set_title(f"{model}: memory against recompute")
        time_ax.set_title(f"{model}: memory against step time")
        flops_ax.scatter([], [], marker="s", color="tab:gray", label="other methods")
        if compiled:
            time_ax.scatter([], [], marker="v", facecolors="none", edgecolors="tab:red",
                            label="torch.compile: bytes saved (a lower bound)")
        handles, labels = flops_ax.get_legend_handles_labels()
        more = time_ax.get_legend_handles_labels()
        for handle, text in zip(*more):
            if text not in labels:
                handles.append(handle)
                labels.append(text)
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7.5,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        path = directory / f"pareto_{model}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # An optional model whose package is missing (torchvision, or diffusers: pip install -e
    # ".[models]") or built for another torch is left out of the defaults.
    default = [m for m in MODELS if missing_package(m) is None]
    parser.add_argument("--models", default=",".join(default),
                        help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per method")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: where models, inputs and targets live")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 keeps timings stable on a shared machine; "
                             "on CUDA they only run the planner's Python)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile with activation_memory_budget 0.5 and 0.1")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot-dir", type=Path,
                        help="write a Pareto PNG per model here (two panels: memory against "
                             "backward FLOPs and against step time; needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot_dir is not None:
        # Before any model runs: a missing matplotlib must not cost a whole benchmark.
        why = matplotlib_missing()
        if why is not None:
            parser.error(why)
    device = parse_device(parser, args.device)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    skipped: dict[str, str] = {}
    for name in names:
        package = missing_package(name)
        if package is not None:
            skipped[name] = f"{package} does not import"
            print(f"{name}: skipped ({package} does not import)", flush=True)
    info = device_info(device)
    print(f"device {info['device']} ({info['device_name']}), torch {info['torch']}", flush=True)
    rows: list[Row] = []
    losses: dict[str, str] = {}
    for name in names:
        if name in skipped:
            continue
        print(f"{name}:", flush=True)
        rows += run_model(name, args.repeat, args.compile, losses, device=device)
    on_cuda = device.type == "cuda"
    table = [[r.model, r.loss, r.method,
              "-" if r.peak_activation_mib is None else f"{r.peak_activation_mib:.2f}",
              *(["-" if r.cuda_max_allocated_mib is None else f"{r.cuda_max_allocated_mib:.2f}"]
                if on_cuda else []),
              f"{r.time_ratio:.2f}",
              "-" if r.backward_flops_ratio is None else f"{r.backward_flops_ratio:.2f}",
              "" if r.plan_seconds is None else f"{r.plan_seconds:.2f}",
              r.note] for r in rows]
    print()
    for name, description in losses.items():
        print(f"loss of every {name} row: {description}")
    print(format_table(["model", "loss", "method", "peak MiB",
                        *(["CUDA max MiB"] if on_cuda else []), "time x", "bwd FLOPs x",
                        "plan s", "note"],
                       table, right=[False, False, False, True, *([True] if on_cuda else []),
                                     True, True, True, False]))
    print()
    for line in verdicts(rows):
        print(line)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    if args.json:
        args.json.write_text(json.dumps(
            {**info, "threads": torch.get_num_threads(), "losses": losses,
             "skipped": skipped, "rows": [asdict(r) for r in rows]}, indent=2))
    if args.plot_dir:
        for path in plot(rows, args.plot_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
