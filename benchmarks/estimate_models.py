"""How close autockpt's estimated peak is to the measured one on the zoo and the corpus of real
models, and which plans keep their matmuls.

Every model of tests/zoo.py and tests/models/corpus.py (those whose package imports: timm,
torchvision, transformers, diffusers) is measured without checkpointing, then applied in
non-reentrant mode at 90%, 75% and 60% of that measured peak with its own loss, and one real
step is measured with ``autockpt.measure``. Printed per plan: how many of its segments keep
their matmuls (NOTE [ Segments that keep their matmuls ] in autockpt/planning/memory_model.py),
estimated / measured, and measured / budget; then a summary, with the plans whose estimate is
more than 1% off.

    python benchmarks/estimate_models.py
    python benchmarks/estimate_models.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autockpt  # noqa: E402
from tests import zoo  # noqa: E402
from tests.models import corpus  # noqa: E402

FRACTIONS = (0.9, 0.75, 0.6)


def run_case(name: str, build: Callable[[], torch.nn.Module],
             inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
             loss_fn: Callable[[Any], torch.Tensor]) -> list[dict[str, Any]]:
    """One row per budget for model ``name``."""
    args, kwargs = inputs()
    none = autockpt.measure(build(), args, example_kwargs=kwargs,
                            loss_fn=loss_fn).peak_activation_bytes
    rows = []
    for fraction in FRACTIONS:
        budget = fraction * none
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                model = autockpt.apply(build(), budget / 2**20, example_inputs=args,
                                       example_kwargs=kwargs, loss_fn=loss_fn)
        except autockpt.InfeasibleBudgetError:
            rows.append({"model": name, "fraction": fraction, "infeasible": True})
            print(f"{name:26s} {fraction:.2f} infeasible", flush=True)
            continue
        plan = autockpt.plan_of(model)
        measured = autockpt.measure(model, args, example_kwargs=kwargs,
                                    loss_fn=loss_fn).peak_activation_bytes
        row = {"model": name, "fraction": fraction, "infeasible": False,
               "segments": len(plan.segments), "keeping": sum(s.keeps for s in plan.segments),
               "estimated_bytes": plan.estimated_peak_bytes, "measured_bytes": measured,
               "budget_bytes": budget}
        rows.append(row)
        print(f"{name:26s} {fraction:.2f} keeping {row['keeping']:2d}/{row['segments']:2d}  "
              f"estimated/measured {plan.estimated_peak_bytes / measured:.4f}  "
              f"measured/budget {measured / budget:.4f}", flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    planned = [r for r in rows if not r["infeasible"]]
    keeping = [r for r in planned if r["keeping"]]

    def ratios(of: list[dict[str, Any]]) -> str:
        values = [r["estimated_bytes"] / r["measured_bytes"] for r in of]
        return f"{min(values):.4f}-{max(values):.4f}" if values else "-"

    off = [f"{r['model']} at {r['fraction']:.0%}: "
           f"{r['estimated_bytes'] / r['measured_bytes']:.4f}" for r in planned
           if abs(r["estimated_bytes"] / r["measured_bytes"] - 1) > 0.01]
    return "\n".join([
        f"plans {len(planned)} (infeasible budgets {len(rows) - len(planned)}), "
        f"estimated/measured {ratios(planned)}",
        f"plans keeping their matmuls {len(keeping)}, estimated/measured {ratios(keeping)}",
        "more than 1% off: " + ("; ".join(off) or "none"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    rows: list[dict[str, Any]] = []
    for case in zoo.CASES:
        rows += run_case(case.name, case.build, case.inputs, case.loss_fn)
    for real in corpus.CASES:
        try:
            __import__(real.requires)
        except ImportError:
            print(f"{real.name}: skipped, {real.requires} does not import", flush=True)
            continue
        rows += run_case(real.name, lambda real=real: real.build(0), real.inputs, real.loss_fn)
    print(summary(rows))
    if options.json:
        options.json.write_text(json.dumps({"torch": torch.__version__, "rows": rows},
                                           indent=1))


if __name__ == "__main__":
    main()
