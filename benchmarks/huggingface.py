"""Hugging Face models: ``gradient_checkpointing_enable()`` against autockpt, side by side.

For a small GPT-2 and a small Llama built from configs (random weights, nothing downloaded),
in one process: no checkpointing; Hugging Face's ``gradient_checkpointing_enable()`` with its
default kwargs and with ``use_reentrant=True``; autockpt asked for the memory each Hugging
Face variant measured; autockpt at 50% of its own baseline estimate; and autockpt at the
least memory it can reach (``budget_mb=None``). The loss is the model's own (``labels`` are
the input ids, ``out.loss``).

Columns: peak activation memory (``autockpt.measure``), step time as a ratio to no
checkpointing (median of ``--repeat`` steps after a warm-up, timed round-robin across the
methods so that the load of a shared machine falls on all alike), backward FLOPs as a ratio to no
checkpointing (``FlopCounterMode`` around backward: what is recomputed), the seconds
``autockpt.apply`` took with the example inputs, the capture rung and the checkpointed
segments. Every method starts from the same weights (deep copies of one seeded build), and
the loss of each checkpointed step is compared with the un-checkpointed one under the same
seed; a mismatch is printed as a warning row.

    python benchmarks/huggingface.py                        # gpt2 and llama
    python benchmarks/huggingface.py --models llama --repeat 3 --json out.json
    python benchmarks/huggingface.py --device cuda --json cuda.json

With ``--device cuda`` the models and the batch live on the GPU, timed steps are bracketed by
``torch.cuda.synchronize()`` (compare.py's ``time_interleaved``), and a ``CUDA max MiB``
column adds the rise of ``torch.cuda.max_memory_allocated`` over one step
(``MemoryReport.cuda_max_memory_allocated_bytes``: the step starts with every ``.grad`` None,
so the parameters' gradients are in it, besides kernel workspaces and allocator rounding).

Needs ``transformers``. Timings on a shared machine are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autockpt  # noqa: E402
from autockpt.ops.instrument import flop_counter  # noqa: E402
from autockpt.report import format_table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import Row as CompareRow  # noqa: E402
from compare import device_info, parse_device, time_interleaved  # noqa: E402

MIB = 2**20
BATCH, SEQ, VOCAB, LAYERS, DIM = 4, 256, 8192, 6, 256
LOSS_SEED = 1234
LOSS = "model's own (cross_entropy, labels = input ids)"
"""What every row's step backpropagates from: ``out.loss``, the causal LM's shifted
cross-entropy over the vocabulary (the table's header line and the JSON's ``loss`` field)."""


@dataclass
class Row(CompareRow):
    """One method on one model: compare.py's row, plus what autockpt planned."""

    capture: str | None = None
    segments: int | None = None
    estimated_peak_mib: float | None = None
    step_flops_ratio: float | None = None
    """FLOPs of forward and backward together, as a ratio to no checkpointing: a head in
    chunks makes its gradients in forward, so backward FLOPs alone would flatter it."""


def build_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=LAYERS, n_embd=DIM, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config)


def build_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=DIM, intermediate_size=2 * DIM,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0, use_cache=False)
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": build_gpt2, "llama": build_llama}


def batch(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Keyword inputs of one training step: ids, a full mask, and the ids as labels; drawn on
    the CPU (the same batch on every device), then moved to ``device``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _loss(output: Any) -> torch.Tensor:
    """The loss every method is measured, timed and planned with: the model's own."""
    return output.loss


def _flops_and_loss(model: nn.Module, kwargs: dict[str, Any]) -> tuple[int, int, float]:
    """FLOPs of one forward and of its backward, and the loss of that step under a fixed seed
    (dropout)."""
    model.train()
    torch.manual_seed(LOSS_SEED)
    with flop_counter() as counter:
        loss = model(**kwargs).loss
    forward = counter.get_total_flops()
    with flop_counter() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, counter.get_total_flops(), loss.item()


def _hf_checkpointed(base: nn.Module, kwargs: dict[str, Any] | None) -> nn.Module:
    model = copy.deepcopy(base)
    if kwargs is None:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def check_save_pretrained(base: nn.Module, ckpt: nn.Module) -> str:
    """``save_pretrained`` of the transformed model: same files' keys and values as the
    original's, and ``from_pretrained`` loads them back into the model's class."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp, "original"), Path(tmp, "autockpt")
        base.save_pretrained(a)
        ckpt.save_pretrained(b)
        sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        if sorted(sa) != sorted(sb) or any(not torch.equal(sa[k], sb[k]) for k in sa):
            return "save_pretrained: keys or values differ from the original's"
        loaded = type(base).from_pretrained(b)
        own = ckpt.state_dict()
        back = loaded.state_dict()
        # from_pretrained loads onto the CPU: compare there, whatever device the model is on.
        if sorted(own) != sorted(back) or any(not torch.equal(own[k].cpu(), back[k].cpu())
                                              for k in own):
            return "from_pretrained: the loaded state_dict differs"
        return (f"save_pretrained/from_pretrained: {len(sb)} tensors, same keys and values as "
                f"the original's ({type(loaded).__name__})")


def run_model(name: str, repeat: int, device: torch.device | str = "cpu"
              ) -> tuple[list[Row], list[str]]:
    device = torch.device(device)
    torch.manual_seed(0)
    # Built on the CPU from the seed (the same weights on every device), then moved.
    base = MODELS[name]().to(device)
    base.train()
    kwargs = batch(device)
    rows: list[Row] = []
    lines: list[str] = []
    reference: dict[str, float] = {}

    timed: list[tuple[Row, nn.Module]] = []

    def record(method: str, model: nn.Module, **extra: Any) -> Row:
        report = autockpt.measure(model, (), example_kwargs=kwargs, loss_fn=_loss)
        forward, flops, loss = _flops_and_loss(model, kwargs)
        if not reference:
            reference.update(flops=float(flops), step=float(forward + flops), loss=loss)
        cuda = report.cuda_max_memory_allocated_bytes
        row = Row(model=name, method=method,
                  peak_activation_mib=report.peak_activation_bytes / MIB,
                  step_ms=float("nan"), time_ratio=float("nan"),
                  backward_flops_ratio=flops / reference["flops"],
                  step_flops_ratio=(forward + flops) / reference["step"],
                  cuda_max_allocated_mib=None if cuda is None else cuda / MIB, **extra)
        rows.append(row)
        timed.append((row, model))
        cuda_text = ("" if row.cuda_max_allocated_mib is None
                     else f"  CUDA max {row.cuda_max_allocated_mib:8.2f} MiB")
        print(f"  {name:6s} {method:44s} peak {row.peak_activation_mib:8.2f} MiB{cuda_text}"
              f"  bwd FLOPs x{row.backward_flops_ratio:.2f}"
              f"  step FLOPs x{row.step_flops_ratio:.2f}  loss {loss:.6f}", flush=True)
        # A head in chunks sums the loss in another order: float tolerance, not bitwise.
        if abs(loss - reference["loss"]) > 1e-5 * max(1.0, abs(reference["loss"])):
            warning = Row(model=name, method=f"WARNING: {method}", peak_activation_mib=None,
                          step_ms=0.0, time_ratio=float("nan"), backward_flops_ratio=None,
                          note=f"loss {loss:.6f} != {reference['loss']:.6f} without "
                               f"checkpointing")
            rows.append(warning)
            print(f"  {warning.method}: {warning.note}", flush=True)
        return row

    record("no checkpointing", base)
    hf_rows = [record("HF gradient_checkpointing_enable()", _hf_checkpointed(base, None))]
    try:
        reentrant = _hf_checkpointed(base, {"use_reentrant": True})
    except Exception as err:  # an older or newer transformers may refuse it
        lines.append(f"{name}: use_reentrant=True not run: {type(err).__name__}: {err}")
    else:
        hf_rows.append(record("HF gradient_checkpointing_enable(use_reentrant=True)",
                              reentrant))

    # Untimed first plan: pays torch's one-time fake-tensor start-up, gives the baseline.
    estimate = autockpt.plan(base, example_kwargs=kwargs, loss_fn=_loss)
    lines.append(f"{name}: autockpt estimate without checkpointing "
                 f"{estimate.baseline_peak_bytes / MIB:.2f} MiB (measured "
                 f"{rows[0].peak_activation_mib:.2f}), least reachable "
                 f"{estimate.min_peak_bytes / MIB:.2f} MiB, capture {estimate.capture}")
    budgets: list[tuple[str, float | None, str | None]] = [
        (f"autockpt, matched to {row.method[3:]}", row.peak_activation_mib, row.method)
        for row in hf_rows]
    budgets.append(("autockpt, 100% of its baseline estimate",
                    estimate.baseline_peak_bytes / MIB, None))
    budgets.append(("autockpt, 50% of its baseline estimate",
                    estimate.baseline_peak_bytes / 2 / MIB, None))
    budgets.append(("autockpt, least memory (budget None)", None, None))
    budgets.append(("autockpt, least memory, chunk_head=False", None, None))
    least: nn.Module | None = None
    for label, budget, matched_to in budgets:
        start = time.perf_counter()
        try:
            # The loss is named although it is also autockpt's default for an output that
            # holds its own loss: the plan must be for the step measured here, whatever the
            # default becomes.
            ckpt = autockpt.apply(copy.deepcopy(base), budget_mb=budget, example_kwargs=kwargs,
                                  loss_fn=_loss, chunk_head="chunk_head=False" not in label)
        except autockpt.InfeasibleBudgetError as err:
            rows.append(Row(model=name, method=label, peak_activation_mib=None, step_ms=0.0,
                            time_ratio=float("nan"), backward_flops_ratio=None,
                            matched_to=matched_to,
                            note=f"infeasible at {budget:.2f} MiB: least reachable "
                                 f"{err.min_feasible_bytes / MIB:.2f} MiB (estimated)"))
            print(f"  {name:6s} {label}: {rows[-1].note}", flush=True)
            continue
        seconds = time.perf_counter() - start
        plan = autockpt.plan_of(ckpt)
        budget_text = "none" if budget is None else f"{budget:.2f} MiB"
        chunks = (f", head in {plan.chunked_head.chunks} chunks"
                  if plan.chunked_head is not None else "")
        record(label, ckpt, plan_seconds=seconds, capture=plan.capture,
               segments=len(plan.segments), estimated_peak_mib=plan.estimated_peak_bytes / MIB,
               matched_to=matched_to,
               note=f"budget {budget_text}, estimated {plan.estimated_peak_bytes / MIB:.2f} MiB"
                    f"{chunks}")
        if budget is None and least is None:
            least = ckpt
    for row in rows:
        row.loss = LOSS
    seconds = time_interleaved([model for _, model in timed],
                               lambda model: model(**kwargs).loss, repeat, device=device)
    for (row, _), value in zip(timed, seconds):
        row.step_ms = value * 1000
        row.time_ratio = value / seconds[0]
        print(f"  {name:6s} {row.method:44s} step {row.step_ms:7.0f} ms  x{row.time_ratio:.2f}",
              flush=True)
    if least is not None:
        lines.append(f"{name}: output of the transformed model: "
                     f"{type(least(**kwargs)).__name__}; {check_save_pretrained(base, least)}")
    return rows, lines


def main(argv: list[str] | None = None) -> int:
    global VOCAB, SEQ, BATCH, LAYERS, DIM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per method")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: where the models and the batch live")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 keeps timings stable on a shared machine; "
                             "on CUDA they only run the planner's Python)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per batch")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers")
    parser.add_argument("--dim", type=int, default=DIM, help="hidden width")
    args = parser.parse_args(argv)
    VOCAB, SEQ, BATCH, LAYERS, DIM = args.vocab, args.seq, args.batch, args.layers, args.dim
    device = parse_device(parser, args.device)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    import transformers

    info = device_info(device)
    print(f"device {info['device']} ({info['device_name']}), torch {info['torch']}, "
          f"transformers {transformers.__version__}", flush=True)
    rows: list[Row] = []
    lines: list[str] = []
    for name in names:
        print(f"{name}:", flush=True)
        more_rows, more_lines = run_model(name, args.repeat, device)
        rows += more_rows
        lines += more_lines

    def number(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    on_cuda = device.type == "cuda"
    table = [[r.model, r.method, number(r.peak_activation_mib),
              *([number(r.cuda_max_allocated_mib)] if on_cuda else []), number(r.time_ratio),
              number(r.backward_flops_ratio), number(r.step_flops_ratio),
              "" if r.plan_seconds is None else f"{r.plan_seconds:.1f}", r.capture or "",
              "" if r.segments is None else str(r.segments), r.note] for r in rows]
    print()
    print(f"loss of every row: {LOSS}")
    print(format_table(["model", "method", "peak MiB", *(["CUDA max MiB"] if on_cuda else []),
                        "time x", "bwd FLOPs x", "step FLOPs x", "plan s", "capture",
                        "segments", "note"], table,
                       right=[False, False, True, *([True] if on_cuda else []), True, True,
                              True, True, False, True, False]))
    print()
    for line in lines:
        print(line)
    if args.json:
        args.json.write_text(json.dumps(
            {**info, "transformers": transformers.__version__,
             "threads": torch.get_num_threads(), "batch": BATCH, "seq": SEQ,
             "vocab": VOCAB, "layers": LAYERS, "dim": DIM, "loss": LOSS,
             "rows": [asdict(r) for r in rows], "notes": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
