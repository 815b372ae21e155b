"""The classic experiment: a 72-layer MLP, with and without activation checkpointing.

A ``nn.Sequential`` of 71 ``Linear(1000, 1000)`` + ``ReLU`` layers and a last
``Linear(1000, 100)``, batch 16. For each method it measures (not estimates) the peak
activation memory of one forward and backward with ``autockpt.measure``, the median step
time, and the backward FLOPs (``FlopCounterMode``) as a ratio to no checkpointing. Then it
prints the plan autockpt chose for one of the budgets.

    python examples/quickstart.py            # about a minute on a 2-core CPU
    python examples/quickstart.py --repeat 3 # fewer timed steps
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import autockpt
from autockpt.report import format_table
from autockpt.units import format_bytes


def mlp72() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(71):
        layers += [nn.Linear(1000, 1000), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1000, 100))


class Sequential(nn.Module):
    """``checkpoint_sequential`` with a fixed number of segments, as people write it by hand."""

    def __init__(self, net: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.net = net
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.net, self.segments, x, use_reentrant=False)


def backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    loss = model(x).sum()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per method")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 keeps timings stable on a shared machine)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)

    net = mlp72()
    x = torch.randn(16, 1000)
    methods: list[tuple[str, nn.Module]] = [("no checkpointing", net)]
    methods += [(f"checkpoint_sequential({n})", Sequential(net, n)) for n in (2, 5, 10)]

    rows = []
    results = {}

    def run(name: str, model: nn.Module, plan: autockpt.Plan | None = None) -> None:
        report = autockpt.measure(model, (x,), warmup=1, repeat=options.repeat)
        results[name] = report
        base = results["no checkpointing"]
        flops = backward_flops(model, x)
        results[name + "/flops"] = flops  # type: ignore[assignment]
        base_flops = results["no checkpointing/flops"]
        rows.append([
            name,
            format_bytes(report.peak_activation_bytes),
            f"{report.step_seconds * 1000:.0f} ms",
            f"{report.step_seconds / base.step_seconds:.2f}",
            f"{flops / base_flops:.2f}",  # type: ignore[operator]
            "" if plan is None else f"{len(plan.segments)} segments",
        ])

    for name, model in methods:
        run(name, model)
    # autockpt, asked for the memory each checkpoint_sequential run measured.
    chosen = None
    for n in (2, 5, 10):
        budget = results[f"checkpoint_sequential({n})"].peak_activation_bytes
        ckpt = autockpt.apply(net, budget_mb=budget / 2**20, example_inputs=(x,))
        plan = autockpt.plan_of(ckpt)
        run(f"autockpt(budget={format_bytes(budget)})", ckpt, plan)
        chosen = chosen or plan
    least = autockpt.apply(net, budget_mb=None, example_inputs=(x,))
    run("autockpt(budget=None: least)", least, autockpt.plan_of(least))

    print("72-layer MLP, batch 16, float32, one forward + backward (measured on "
          f"{results['no checkpointing'].device})\n")
    print(format_table(
        ["method", "peak activation", "step", "time ratio", "bwd FLOPs ratio", "plan"],
        rows,
        right=[False, True, True, True, True, False],
    ))
    print("\nThe plan autockpt chose for the first budget:\n")
    print(chosen)


if __name__ == "__main__":
    main()
