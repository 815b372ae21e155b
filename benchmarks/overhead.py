"""The fixed cost per segment and per recomputed op: plans made with it against plans made by
FLOPs alone, at the same budget, side by side in one run.

NOTE [ What a segment costs beyond its FLOPs ] in autockpt/planning/overhead.py says why the
planner prices a checkpoint call and each recomputed op beyond their arithmetic. Here each
model is planned twice at each budget (a fraction of its no-checkpointing peak): with the
fixed costs of the device it runs on (what ``autockpt.apply`` does) and without them (FLOPs
plus bytes only, as before). Both plans are applied to copies of the same seeded model and
timed round-robin with a plain model (median of ``--repeat`` steps); each is measured with
``autockpt.measure`` on the same step. Columns: segments, recomputed FLOPs as a share of the
forward, the measured peak against the budget, and the step time as a ratio to no
checkpointing.

    python benchmarks/overhead.py                        # CPU, three models, 3 budgets
    python benchmarks/overhead.py --device cuda --repeat 20 --json out.json

Timings on a shared machine are noisy: compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import time_interleaved  # noqa: E402

import autockpt  # noqa: E402
from autockpt import pipeline  # noqa: E402
from autockpt.planning.overhead import NO_OVERHEAD  # noqa: E402
from tests import zoo  # noqa: E402

Case = tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any],
             Callable[[Any], torch.Tensor]]


def _first_mean_square(output: Any) -> torch.Tensor:
    return zoo.flatten_output(output)[0].float().pow(2).mean()


def _own_loss(output: Any) -> torch.Tensor:
    return output.loss


def _gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=1024,
                                     n_positions=256, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def cases(device: torch.device) -> dict[str, Case]:
    ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    return {
        "tiny transformer (zoo)": (zoo.build_transformer, *zoo.inputs_transformer(),
                                   _first_mean_square),
        "resnet (zoo)": (zoo.build_resnet, *zoo.inputs_resnet(), _first_mean_square),
        "GPT-2 6 layers d128, 4x256": (_gpt2, (), {"input_ids": ids, "labels": ids},
                                       _own_loss),
    }


@dataclass
class Row:
    model: str
    fraction: float
    costs: str
    segments: int
    recompute_share: float
    peak_mib: float
    budget_mib: float
    time_ratio: float


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def run(name: str, case: Case, fractions: list[float], repeat: int,
        device: torch.device) -> list[Row]:
    build, args, kwargs, loss_fn = case
    args = tuple(_to(a, device) for a in args)
    kwargs = {k: _to(v, device) for k, v in kwargs.items()}
    base = build().to(device).train()
    baseline = autockpt.plan(base, args, example_kwargs=kwargs,
                             loss_fn=loss_fn).baseline_peak_bytes
    models: list[nn.Module] = [base]
    labels: list[tuple[float, str, autockpt.Plan | None]] = [(1.0, "none", None)]
    original = pipeline.plan_overhead
    for fraction in fractions:
        budget_mb = baseline * fraction / 2**20
        for costs in ("FLOPs + fixed costs", "FLOPs only"):
            if costs == "FLOPs only":
                pipeline.plan_overhead = lambda *_, **__: NO_OVERHEAD  # type: ignore[assignment]
            try:
                plan = autockpt.plan(base, args, example_kwargs=kwargs, loss_fn=loss_fn,
                                     budget_mb=budget_mb)
            except autockpt.InfeasibleBudgetError:
                print(f"{name}: {fraction:.0%} of its peak is below its least memory, skipped",
                      file=sys.stderr)
                break
            finally:
                pipeline.plan_overhead = original  # type: ignore[assignment]
            models.append(autockpt.apply(copy.deepcopy(base), plan=plan))
            labels.append((fraction, costs, plan))

    def step(model: nn.Module) -> torch.Tensor:
        return loss_fn(model(*args, **kwargs))

    times = time_interleaved(models, step, repeat, device=device)
    rows = []
    for model, (fraction, costs, plan), seconds in zip(models, labels, times):
        peak = autockpt.measure(model, args, example_kwargs=kwargs,
                                loss_fn=loss_fn).peak_activation_bytes
        rows.append(Row(
            model=name, fraction=fraction, costs=costs,
            segments=0 if plan is None else len(plan.segments),
            recompute_share=0.0 if plan is None else plan.recompute_ratio,
            peak_mib=peak / 2**20, budget_mib=baseline * fraction / 2**20,
            time_ratio=seconds / times[0]))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| model | budget | plan made by | segments | recompute | measured peak | "
             "step time |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        budget = "none" if r.costs == "none" else f"{r.fraction:.0%}"
        lines.append(f"| {r.model} | {budget} | {r.costs} | {r.segments} | "
                     f"{r.recompute_share:.0%} | {r.peak_mib:.2f} MiB "
                     f"({r.peak_mib / r.budget_mib:.2f}x) | x{r.time_ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=15, help="timed steps per plan")
    parser.add_argument("--fractions", default="0.8,0.6,0.5",
                        help="budgets as fractions of the no-checkpointing peak")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    warnings.simplefilter("ignore")
    device = torch.device(options.device)
    fractions = [float(f) for f in options.fractions.split(",")]
    rows: list[Row] = []
    for name, case in cases(device).items():
        rows.extend(run(name, case, fractions, options.repeat, device))
    print(table(rows))
    if options.json is not None:
        options.json.write_text(json.dumps({"device": str(device),
                                            "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
