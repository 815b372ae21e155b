"""A short correctness-and-memory check of autockpt on a GPU.

The CPU test suite proves autockpt exact and within budget where the CPU is the device; what
only a GPU can show is that the same holds with CUDA's kernels and CUDA's random numbers: that
a recomputed segment draws the very same dropout masks (CUDA's Philox generator, also inside
the fused attention kernel), and that the peak the caching allocator sees stays near the
budget asked for. For a few models, each in both checkpoint modes, at the least memory
(``budget_mb=None``) and at 50% of the measured peak without checkpointing:

* gradients: one training step of ``autockpt.apply(copy, ...)`` against an identically
  seeded untransformed twin, dropout active (``torch.manual_seed`` and
  ``torch.cuda.manual_seed_all`` before each step): the largest absolute difference over
  every ``param.grad``, over every buffer (BatchNorm's running statistics), and the loss
  difference. The twin is also run against itself: on CUDA some backward kernels add in a
  nondeterministic order, and that noise floor is printed beside the differences;
* memory: the peak ``autockpt.measure`` reports (live storages, the unit of the budget) as a
  ratio to the budget asked for (for the least memory, to the plan's estimate), and the
  least-memory peak as a ratio to the peak without checkpointing. On CUDA also what the
  caching allocator saw, as rises of ``torch.cuda.max_memory_allocated`` over one step:
  ``MemoryReport.cuda_max_memory_allocated_bytes`` (its step starts with every ``.grad``
  None, so the parameters' gradients, which no activation budget counts, are in it), and the
  rise over a step whose gradients are already allocated, as from the second step of a
  training loop, which leaves them out and is compared with the budget.

Models: the benchmarks' GPT-style decoder (``benchmarks/models.gpt``) with dropout 0.1 on the
embeddings, inside attention and on both residual branches; torchvision's ResNet-50
(``benchmarks/models.resnet50``, BatchNorm in train mode); Hugging Face GPT-2 from a small
config with a vocabulary of 8192 as in ``benchmarks/huggingface.py`` (its own dropout 0.1 and
loss; in non-reentrant mode autockpt runs the head in chunks, so its loss and gradients are
summed in another order and match to float tolerance, not bitwise). With ``--models skip``, the
models whose skip connections span most of the graph (tests/skip_models.py, as
tests/models/test_skip_connections.py builds them, with larger inputs): our UNet with
concatenated skips, the HRNet-like network, diffusers' ``UNet2DModel`` and
``UNet2DConditionModel`` (cross-attention to fixed encoder states), torchvision's DenseNet-121
and Hugging Face T5 and BART (their own dropout and loss, ``labels=``). Every loss is a real
one (cross-entropy or MSE against fixed targets, or the model's own), planned for with
``loss_fn=``, as the benchmarks do.

    python benchmarks/gpu_check.py --json gpu_check.json      # on CUDA when there is one
    python benchmarks/gpu_check.py --models skip --json s.json # the skip-connection models
    python benchmarks/gpu_check.py --device cpu --tiny        # a smoke test of the script

A model whose package (torchvision, transformers, diffusers) does not import is skipped with a note.
Exits 1 when a gradient or loss differs beyond tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository's root, for the skip-connection models the tests build (tests/skip_models.py).
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from compare import device_info, missing_package, parse_device, synchronize  # noqa: E402
from models import LOSSES, MODELS, Blocks, gpt, make_loss, resnet50  # noqa: E402

import autockpt  # noqa: E402
from autockpt.report import format_table  # noqa: E402
from tests import skip_models  # noqa: E402

MIB = 2**20
MODES = ("non_reentrant", "reentrant")
SEED = 1234
FRACTION = 0.5
"""The budget besides the least memory: this fraction of the measured peak without
checkpointing."""
GRAD_RTOL = 1e-4
"""A gradient matches when its largest difference is within this fraction of the largest
reference gradient (or within 10x the twin-against-itself noise): a wrong dropout mask or a
lost gradient differs by the size of the gradients themselves, summation order by far less."""
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run: ``--tiny`` for a CPU smoke test, else tens to hundreds of MiB of
    activations per model, so that activations, not the allocator's slack, set the peaks."""

    gpt_batch: int
    gpt_seq: int
    gpt_layers: int
    gpt_dim: int
    resnet_batch: int
    resnet_image: int
    hf_batch: int
    hf_seq: int
    hf_layers: int
    hf_dim: int
    skip_batch: int
    """The batch of every skip-connection model."""
    skip_image: int
    """Their images' side (latents' side for ``UNet2DConditionModel``: half of it)."""
    skip_seq: int
    """T5's and BART's tokens, and (an eighth of it) the conditioning UNet's encoder states."""


FULL = Sizes(gpt_batch=8, gpt_seq=256, gpt_layers=8, gpt_dim=256, resnet_batch=8,
             resnet_image=128, hf_batch=4, hf_seq=256, hf_layers=6, hf_dim=256,
             skip_batch=16, skip_image=64, skip_seq=128)
TINY = Sizes(gpt_batch=2, gpt_seq=64, gpt_layers=3, gpt_dim=64, resnet_batch=2,
             resnet_image=64, hf_batch=2, hf_seq=128, hf_layers=2, hf_dim=64,
             skip_batch=2, skip_image=32, skip_seq=32)
SKIP_MODELS = ("unet", "hrnet_like", "unet2d", "unet2d_condition", "densenet121", "t5", "bart")
"""``--models skip``: the models of tests/models/test_skip_connections.py."""
SKIP_PACKAGES = {"unet2d": "diffusers", "unet2d_condition": "diffusers",
                 "densenet121": "torchvision", "t5": "transformers", "bart": "transformers"}
ALL_MODELS = ("gpt", "resnet50", "gpt2", *SKIP_MODELS)
GPT_VOCAB = 2048
HF_VOCAB = 8192
DROPOUT = 0.1


def dropout_gpt(sizes: Sizes) -> Blocks:
    """The benchmarks' GPT-style decoder with dropout everywhere GPT-2 has it (embeddings,
    attention weights inside the fused kernel, both residual branches)."""
    return gpt(layers=sizes.gpt_layers, dim=sizes.gpt_dim, heads=4, vocab=GPT_VOCAB,
               length=sizes.gpt_seq, dropout=DROPOUT)


def hf_gpt2(sizes: Sizes) -> nn.Module:
    """Hugging Face GPT-2 from a config (random weights, nothing downloaded), its default
    dropout 0.1 on embeddings, attention and residuals."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=sizes.hf_layers, n_embd=sizes.hf_dim, n_head=4,
                        vocab_size=HF_VOCAB, n_positions=sizes.hf_seq, bos_token_id=0,
                        eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config)


def _own_loss(output: Any) -> torch.Tensor:
    """A Hugging Face model's own loss (``labels=`` given)."""
    return output.loss


@dataclass
class Case:
    """One model on the device, its inputs and the loss of its step."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    loss: str


def _sample(output: Any) -> torch.Tensor:
    """A diffusers model's prediction (``.sample``), or the output itself."""
    return output.sample if hasattr(output, "sample") else output


def _fixed_target_loss(kind: str, model: nn.Module, args: tuple[Any, ...]
                       ) -> Callable[[Any], torch.Tensor]:
    """``LOSSES[kind]`` with its targets shaped from one eval-mode forward (no BatchNorm
    update), applied to a diffusers model's ``.sample``."""
    model.eval()
    with torch.no_grad():
        bench = LOSSES[kind](_sample(model(*args)))
    model.train()
    return lambda output: bench.fn(_sample(output))


def skip_case(name: str, sizes: Sizes, device: torch.device, generator: torch.Generator
              ) -> Case:
    """One model of :data:`SKIP_MODELS` on ``device``, seeded as the tests seed it."""
    batch, side = sizes.skip_batch, sizes.skip_image

    def images(channels: int, size: int) -> torch.Tensor:
        return torch.randn(batch, channels, size, size, generator=generator).to(device)

    torch.manual_seed(0)
    if name in ("t5", "bart"):
        model = (skip_models.t5() if name == "t5" else skip_models.bart()).to(device)
        ids, labels = (torch.randint(3, skip_models.SEQ2SEQ_VOCAB, (batch, sizes.skip_seq),
                                     generator=generator).to(device) for _ in range(2))
        return Case(name, model, (), {"input_ids": ids, "labels": labels}, _own_loss,
                    "model's own (labels=)")
    timesteps = (torch.arange(batch) * 37 % 1000).to(device)
    if name == "unet":
        model, args, kind = skip_models.UNet().to(device), (images(3, 2 * side),), "mse"
    elif name == "hrnet_like":
        model, args, kind = skip_models.HRNetLike().to(device), (images(3, side),), "cross_entropy"
    elif name == "unet2d":
        model, args, kind = skip_models.unet2d().to(device), (images(3, side), timesteps), "mse"
    elif name == "unet2d_condition":
        states = torch.randn(batch, max(1, sizes.skip_seq // 8),
                             skip_models.UNET2D_CONDITION_CROSS_DIM, generator=generator)
        model = skip_models.unet2d_condition().to(device)
        args, kind = (images(4, side // 2), timesteps, states.to(device)), "mse"
    elif name == "densenet121":
        model, args, kind = skip_models.densenet121().to(device), (images(3, side),), \
            "cross_entropy"
    else:
        raise ValueError(f"unknown model {name!r}")
    return Case(name, model, args, {}, _fixed_target_loss(kind, model, args),
                f"{kind}, fixed targets")


def build_cases(names: list[str], sizes: Sizes, device: torch.device
                ) -> tuple[list[Case], dict[str, str]]:
    """The cases named, built on the CPU from fixed seeds and moved to ``device``; the ones
    whose package does not import are returned as skipped, with why."""
    cases: list[Case] = []
    skipped: dict[str, str] = {}
    generator = torch.Generator().manual_seed(0)
    for name in names:
        if name == "gpt":
            model = dropout_gpt(sizes).to(device)
            ids = torch.randint(0, GPT_VOCAB, (sizes.gpt_batch, sizes.gpt_seq),
                                generator=generator).to(device)
            cases.append(Case(name, model, (ids,), {}, make_loss(MODELS[name], model, ids).fn,
                              "cross_entropy, fixed targets"))
        elif name == "resnet50":
            package = missing_package("resnet50")
            if package is not None:
                skipped[name] = f"{package} does not import"
                continue
            model = resnet50().to(device)
            x = torch.randn(sizes.resnet_batch, 3, sizes.resnet_image, sizes.resnet_image,
                            generator=generator).to(device)
            cases.append(Case(name, model, (x,), {}, make_loss(MODELS[name], model, x).fn,
                              "cross_entropy, fixed targets"))
        elif name == "gpt2":
            try:
                model = hf_gpt2(sizes).to(device)
            except ImportError as err:
                skipped[name] = f"transformers does not import: {err}"
                continue
            ids = torch.randint(0, HF_VOCAB, (sizes.hf_batch, sizes.hf_seq),
                                generator=generator).to(device)
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            cases.append(Case(name, model, (), kwargs, _own_loss,
                              "model's own (labels = input ids)"))
        elif name in SKIP_MODELS:
            package = SKIP_PACKAGES.get(name)
            try:
                if package is not None:
                    __import__(package)
                cases.append(skip_case(name, sizes, device, generator))
            except ImportError as err:
                skipped[name] = f"{package} does not import: {err}"
                continue
        else:
            raise ValueError(f"unknown model {name!r}")
        cases[-1].model.train()
    return cases, skipped


# --------------------------------------------------------------------------- steps


@dataclass
class StepResult:
    """What one seeded training step leaves behind."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def train_step(model: nn.Module, case: Case, seed: int = SEED) -> StepResult:
    """One forward and backward in train mode, gradients cleared first and every generator
    seeded alike, so that two twins draw the same dropout masks."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    loss = case.loss_fn(model(*case.args, **case.kwargs))
    loss.backward()
    result = StepResult(
        loss=loss.item(),
        grads={n: None if p.grad is None else p.grad.detach().clone()
               for n, p in model.named_parameters()},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()})
    model.zero_grad(set_to_none=True)
    return result


@dataclass
class Difference:
    """How far one step is from the reference step."""

    loss: float
    grad: float
    """Largest absolute difference over every parameter's gradient (inf where one side has a
    gradient and the other none)."""
    buffer: float
    """Largest absolute difference over every floating-point buffer (0 where none)."""


def difference(got: StepResult, want: StepResult) -> Difference:
    """Compare two steps tensor by tensor, by name."""
    grad = 0.0
    if list(got.grads) != list(want.grads):
        grad = math.inf
    for name, ref in want.grads.items():
        mine = got.grads.get(name)
        if ref is None and mine is None:
            continue
        if ref is None or mine is None:
            grad = math.inf
            continue
        grad = max(grad, (mine - ref).abs().max().item())
    buffer = 0.0
    for name, ref in want.buffers.items():
        mine = got.buffers.get(name)
        if mine is None:
            buffer = math.inf
        elif ref.is_floating_point():
            buffer = max(buffer, (mine - ref).abs().max().item())
        elif not torch.equal(mine, ref):
            buffer = math.inf
    return Difference(loss=abs(got.loss - want.loss), grad=grad, buffer=buffer)


def largest_gradient(step: StepResult) -> float:
    """The largest absolute gradient element: the scale gradient differences are judged by."""
    return max((g.abs().max().item() for g in step.grads.values() if g is not None),
               default=0.0)


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One mode and budget on one model."""

    model: str
    mode: str
    budget: str
    budget_mib: float | None
    """The budget asked for; None for the least memory."""
    estimated_mib: float | None = None
    """The plan's estimate of its peak."""
    peak_mib: float | None = None
    """Peak activation memory of one step, measured by ``autockpt.measure``."""
    cuda_max_allocated_mib: float | None = None
    """``MemoryReport.cuda_max_memory_allocated_bytes``: the rise of
    ``torch.cuda.max_memory_allocated`` over one step that starts with every ``.grad`` None,
    so the parameters' gradients are in it (None off CUDA)."""
    cuda_activations_mib: float | None = None
    """The same rise over a step whose ``.grad`` are already allocated: activations,
    temporaries and kernel workspaces as the allocator holds them (None off CUDA)."""
    peak_over_budget: float | None = None
    """``peak_mib`` over the budget (over the plan's estimate for the least memory)."""
    cuda_over_budget: float | None = None
    """``cuda_activations_mib`` over the same."""
    peak_over_baseline: float | None = None
    """``peak_mib`` over the measured peak without checkpointing."""
    loss_diff: float | None = None
    grad_max_abs_diff: float | None = None
    buffer_max_abs_diff: float | None = None
    exact: bool | None = None
    """Loss and every gradient within tolerance of the untransformed twin's (in float32, or
    else in float64: ``float64_grad_rel_diff``)."""
    float64_grad_rel_diff: float | None = None
    """Where float32 is not within tolerance: the same plan's check in float64, the largest
    gradient difference over the largest gradient (None where it was not needed)."""
    segments: int | None = None
    capture: str | None = None
    plan_seconds: float | None = None
    note: str = ""


@dataclass
class Baseline:
    """The untransformed model's step: what every row is compared with."""

    model: str
    loss: str
    peak_mib: float
    cuda_max_allocated_mib: float | None
    cuda_activations_mib: float | None
    loss_value: float
    largest_grad: float
    noise_grad: float
    """Twin against itself: the largest gradient difference of two identical seeded steps
    (0 where every kernel is deterministic)."""
    noise_loss: float
    dropout_effect: float
    """How much the loss changes with another seed: not 0, or dropout is not active and the
    check of the random numbers proves nothing."""


def cuda_rise_with_grads(model: nn.Module, case: Case, device: torch.device) -> float | None:
    """MiB the CUDA allocator's peak rose by over one step whose gradients exist before it
    (``zero_grad(set_to_none=False)``), the output held until backward ends as
    ``autockpt.measure`` holds it; None off CUDA.

    ``MemoryReport.cuda_max_memory_allocated_bytes`` starts from ``.grad`` None, so it also
    holds every parameter gradient, which is not activation memory: this one is the figure
    to hold against an activation budget. It differs from the budget's step (``.grad`` None,
    each gradient buffer handed to its parameter) by the weight gradient being added into its
    ``.grad`` at any moment, a temporary at most the largest parameter's size; autockpt's
    warning that the plan did not count those temporaries is silenced here for that reason.
    Buffers (BatchNorm's running statistics) are put back afterwards, as ``measure`` puts
    them back: the model is copied again for later rows.
    """
    if device.type != "cuda":
        return None
    model.train()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    torch.manual_seed(SEED)
    torch.cuda.manual_seed_all(SEED)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autockpt.BudgetWarning)
        output = model(*case.args, **case.kwargs)
        case.loss_fn(output).backward()
    del output
    torch.cuda.synchronize(device)
    rise = torch.cuda.max_memory_allocated(device) - before
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return rise / MIB


def measure_peaks(model: nn.Module, case: Case, device: torch.device
                  ) -> tuple[float, float | None, float | None]:
    """Measured peak, the CUDA allocator's rise over ``measure``'s step and over a step with
    the gradients already allocated, in MiB."""
    report = autockpt.measure(model, case.args or None, example_kwargs=case.kwargs or None,
                              loss_fn=case.loss_fn)
    cuda = report.cuda_max_memory_allocated_bytes
    return (report.peak_activation_bytes / MIB, None if cuda is None else cuda / MIB,
            cuda_rise_with_grads(model, case, device))


FLOAT64_RTOL = 1e-9
"""A float64 check passes within this fraction of the largest gradient."""


def _double(value: Any) -> Any:
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() \
        else value


def float64_check(case: Case, budget_mib: float | None, mode: str) -> float:
    """The twin check in float64: the model, its floating inputs and the plan made again
    for them (the budget scaled by 2, as every activation doubles); the loss's fixed
    targets stay as they are. Returns the largest gradient difference over the largest
    gradient."""
    base = copy.deepcopy(case.model).double()
    wide = Case(case.name, base, tuple(_double(a) for a in case.args),
                {k: _double(v) for k, v in case.kwargs.items()}, case.loss_fn, case.loss)
    reference = train_step(copy.deepcopy(base), wide)
    ckpt = autockpt.apply(copy.deepcopy(base),
                          budget_mb=None if budget_mib is None else 2 * budget_mib,
                          example_inputs=wide.args or None,
                          example_kwargs=wide.kwargs or None, loss_fn=wide.loss_fn, mode=mode)
    diff = difference(train_step(ckpt, wide), reference)
    scale = largest_gradient(reference) or 1.0
    return max(diff.grad, diff.loss) / scale


def check_case(case: Case, device: torch.device) -> tuple[Baseline, list[Row]]:
    """Every mode at every budget on one model, against its untransformed twin."""
    base = case.model
    reference = train_step(copy.deepcopy(base), case)
    again = train_step(copy.deepcopy(base), case)
    noise = difference(again, reference)
    other_seed = train_step(copy.deepcopy(base), case, seed=SEED + 1)
    del again
    peak, cuda, cuda_activations = measure_peaks(base, case, device)
    baseline = Baseline(model=case.name, loss=case.loss, peak_mib=peak,
                        cuda_max_allocated_mib=cuda, cuda_activations_mib=cuda_activations,
                        loss_value=reference.loss,
                        largest_grad=largest_gradient(reference), noise_grad=noise.grad,
                        noise_loss=noise.loss,
                        dropout_effect=abs(other_seed.loss - reference.loss))
    del other_seed
    cuda_text = ("" if cuda is None or cuda_activations is None
                 else f", CUDA max allocated {cuda:.2f} MiB ({cuda_activations:.2f} MiB with "
                      "the gradients allocated before the step)")
    print(f"  {case.name}: no checkpointing: peak {peak:.2f} MiB{cuda_text}; loss "
          f"{reference.loss:.6f}, largest gradient {baseline.largest_grad:.3g}; twin against "
          f"itself: grad {noise.grad:.3g}, loss {noise.loss:.3g}; another seed moves the loss "
          f"by {baseline.dropout_effect:.3g} "
          f"({'dropout active' if baseline.dropout_effect else 'no dropout'})", flush=True)

    grad_tolerance = max(GRAD_RTOL * baseline.largest_grad, 10 * noise.grad)
    loss_tolerance = max(LOSS_RTOL * max(1.0, abs(reference.loss)), 10 * noise.loss)
    largest_buffer = max((b.abs().max().item() for b in reference.buffers.values()
                          if b.is_floating_point() and b.numel()), default=0.0)
    buffer_tolerance = max(GRAD_RTOL * largest_buffer, 10 * noise.buffer)
    rows: list[Row] = []
    for mode in MODES:
        for label, budget_mib in (("least memory", None),
                                  (f"{FRACTION:.0%} of baseline", FRACTION * peak)):
            row = Row(model=case.name, mode=mode, budget=label, budget_mib=budget_mib)
            rows.append(row)
            start = time.perf_counter()
            try:
                ckpt = autockpt.apply(copy.deepcopy(base), budget_mb=budget_mib,
                                      example_inputs=case.args or None,
                                      example_kwargs=case.kwargs or None,
                                      loss_fn=case.loss_fn, mode=mode)
            except autockpt.InfeasibleBudgetError as err:
                row.note = (f"infeasible: least reachable {err.min_feasible_bytes / MIB:.2f} "
                            "MiB (estimated)")
                print(f"  {case.name} {mode} {label}: {row.note}", flush=True)
                continue
            row.plan_seconds = time.perf_counter() - start
            plan = autockpt.plan_of(ckpt)
            row.estimated_mib = plan.estimated_peak_bytes / MIB
            row.segments = len(plan.segments)
            row.capture = plan.capture
            if plan.chunked_head is not None:
                row.note = f"head in {plan.chunked_head.chunks} chunks"

            got = train_step(ckpt, case)
            diff = difference(got, reference)
            del got
            row.loss_diff, row.grad_max_abs_diff = diff.loss, diff.grad
            row.buffer_max_abs_diff = diff.buffer
            # BatchNorm's running statistics must move once per step, not again in the
            # recompute.
            row.exact = (diff.grad <= grad_tolerance and diff.loss <= loss_tolerance
                         and diff.buffer <= buffer_tolerance)
            if not row.exact:
                # NOTE [ Gradients summed in another order ] (tests/helpers.py): a segment
                # may sum an input's gradient in another order, and on a GPU float32
                # convolutions run in TF32 (10 bits of mantissa), so the difference can
                # reach 1e-3 of the largest gradient. In float64 a wrong gradient stays
                # wrong and rounding vanishes.
                row.float64_grad_rel_diff = float64_check(case, budget_mib, mode)
                row.exact = row.float64_grad_rel_diff <= FLOAT64_RTOL

            row.peak_mib, row.cuda_max_allocated_mib, row.cuda_activations_mib = (
                measure_peaks(ckpt, case, device))
            against = budget_mib if budget_mib is not None else row.estimated_mib
            if against:
                row.peak_over_budget = row.peak_mib / against
                if row.cuda_activations_mib is not None:
                    row.cuda_over_budget = row.cuda_activations_mib / against
            if peak:
                row.peak_over_baseline = row.peak_mib / peak
            del ckpt
            synchronize(device)
            print(f"  {case.name} {mode:13s} {label:16s} peak {row.peak_mib:8.2f} MiB "
                  f"(x{row.peak_over_budget or float('nan'):.3f} of "
                  f"{'budget' if budget_mib is not None else 'estimate'}) grad diff "
                  f"{diff.grad:.3g} loss diff {diff.loss:.3g} "
                  + ("" if row.float64_grad_rel_diff is None
                     else f"(float64: {row.float64_grad_rel_diff:.2g} of the largest) ")
                  + f"{'ok' if row.exact else 'MISMATCH'}  plan {row.plan_seconds:.1f} s",
                  flush=True)
    return baseline, rows


# --------------------------------------------------------------------------- main


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _small(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (the default where there is one) or cpu")
    parser.add_argument("--models", default="gpt,resnet50,gpt2",
                        help=f"comma-separated, from: {', '.join(ALL_MODELS)}; 'skip' for "
                             f"{', '.join(SKIP_MODELS)}; 'all' for every one")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny sizes: a smoke test of the script, on the CPU in seconds")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0 leaves torch's default)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = parse_device(parser, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    names: list[str] = []
    for name in (n.strip() for n in args.models.split(",") if n.strip()):
        names += (list(SKIP_MODELS) if name == "skip" else list(ALL_MODELS) if name == "all"
                  else [name])
    unknown = [n for n in names if n not in ALL_MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(ALL_MODELS)}, skip or all")
    sizes = TINY if args.tiny else FULL
    info = device_info(device)
    print(f"device {info['device']} ({info['device_name']}), torch {info['torch']}", flush=True)
    if device.type != "cuda":
        print("note: not on CUDA: the CUDA allocator and CUDA's random numbers are not checked",
              flush=True)
    started = time.perf_counter()
    cases, skipped = build_cases(names, sizes, device)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})", flush=True)
    baselines: list[Baseline] = []
    rows: list[Row] = []
    for case in cases:
        print(f"{case.name}:", flush=True)
        baseline, more = check_case(case, device)
        baselines.append(baseline)
        rows += more
        case.model.cpu()  # frees the device for the next model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - started

    on_cuda = device.type == "cuda"
    table = [[r.model, r.mode, r.budget, _number(r.budget_mib), _number(r.estimated_mib),
              _number(r.peak_mib), _number(r.peak_over_budget, 3),
              *([_number(r.cuda_max_allocated_mib), _number(r.cuda_activations_mib),
                 _number(r.cuda_over_budget, 3)] if on_cuda else []),
              _number(r.peak_over_baseline, 3), _small(r.grad_max_abs_diff),
              _small(r.loss_diff), _small(r.buffer_max_abs_diff),
              "-" if r.exact is None else ("ok" if r.exact else "MISMATCH")
              + ("" if r.float64_grad_rel_diff is None else " (float64)"),
              "" if r.segments is None else str(r.segments), r.note] for r in rows]
    print()
    print(format_table(
        ["model", "mode", "budget", "budget MiB", "est MiB", "peak MiB", "peak/budget",
         *(["CUDA max MiB", "CUDA act MiB", "act/budget"] if on_cuda else []), "peak/base",
         "grad diff",
         "loss diff", "buffer diff", "grads", "segments", "note"], table,
        right=[False, False, False, True, True, True, True,
               *([True, True, True] if on_cuda else []),
               True, True, True, True, False, True, False]))
    print("(peak/budget: for the least memory, over the plan's estimate; peak/base: over the "
          "measured peak without checkpointing" + ("; CUDA max: the allocator's rise over "
          "autockpt.measure's step, gradients included; CUDA act: the rise with the gradients "
          "allocated before the step, and act/budget that over the budget" if on_cuda else "")
          + ")")
    print()
    for b in baselines:
        cuda = ("" if b.cuda_max_allocated_mib is None
                else f", CUDA max allocated {b.cuda_max_allocated_mib:.2f} MiB, "
                     f"{b.cuda_activations_mib or 0:.2f} MiB with the gradients allocated")
        least = [r for r in rows if r.model == b.model and r.budget_mib is None
                 and r.peak_over_baseline is not None]
        ratios = ", ".join(
            f"{r.mode} x{r.peak_over_baseline:.3f}"
            + ("" if r.cuda_activations_mib is None or not b.cuda_activations_mib
               else f" (CUDA act x{r.cuda_activations_mib / b.cuda_activations_mib:.3f})")
            for r in least)
        print(f"{b.model} ({b.loss}): no checkpointing {b.peak_mib:.2f} MiB{cuda}; least memory "
              f"/ baseline: {ratios or '-'}; twin noise grad {b.noise_grad:.2g}; another seed "
              f"moves the loss by {b.dropout_effect:.3g}")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    mismatches = [r for r in rows if r.exact is False]
    over = [r for r in rows if r.budget_mib is not None and r.peak_over_budget is not None
            and r.peak_over_budget > 1.0]
    over_estimate = [r for r in rows if r.budget_mib is None and r.peak_over_budget is not None
                     and r.peak_over_budget > 1.0]
    print(f"{len(rows)} rows in {seconds:.0f} s: {len(mismatches)} gradient/loss mismatches; "
          f"measured peak over the budget in {len(over)}, least memory over its estimate in "
          f"{len(over_estimate)}")
    if args.json:
        args.json.write_text(json.dumps(
            {**info, "sizes": asdict(sizes), "seed": SEED, "fraction": FRACTION,
             "grad_rtol": GRAD_RTOL, "loss_rtol": LOSS_RTOL, "float64_rtol": FLOAT64_RTOL,
             "seconds": seconds,
             "skipped": skipped, "baselines": [asdict(b) for b in baselines],
             "rows": [asdict(r) for r in rows]}, indent=2))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
