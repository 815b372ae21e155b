"""The classic experiment: a 72-layer MLP, with and without activation checkpointing.

A ``nn.Sequential`` of 71 ``Linear(1000, 1000)`` + ``ReLU`` layers and a last
``Linear(1000, 100)``, batch 16, trained with cross-entropy over its 100 classes. For each
method it measures (not estimates) the peak activation memory of one forward, loss and
backward with ``autockpt.measure``, the median step time (timed round-robin across the
methods), and the backward FLOPs (``FlopCounterMode``), both as a ratio to no checkpointing.
autockpt is given the same loss (``loss_fn=``), so its plan counts what the loss keeps and the
gradient it sends back. Then it prints the plan autockpt chose for one of the budgets.

    python examples/quickstart.py            # about a minute on a 2-core CPU
    python examples/quickstart.py --repeat 3 # fewer timed steps
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
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


def backward_flops(model: nn.Module, x: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> int:
    loss = loss_fn(model(x))
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
    y = torch.randint(0, 100, (16,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    methods: list[tuple[str, nn.Module]] = [("no checkpointing", net)]
    methods += [(f"checkpoint_sequential({n})", Sequential(net, n)) for n in (2, 5, 10)]

    peaks: dict[str, int] = {}
    plans: dict[str, autockpt.Plan] = {}
    for name, model in methods:
        peaks[name] = autockpt.measure(model, (x,), loss_fn=loss_fn).peak_activation_bytes
    # autockpt, asked for the memory each checkpoint_sequential run measured.
    for n in (2, 5, 10):
        budget = peaks[f"checkpoint_sequential({n})"]
        name = f"autockpt(budget={format_bytes(budget)})"
        methods.append((name, autockpt.apply(net, budget_mb=budget / 2**20, example_inputs=(x,),
                                             loss_fn=loss_fn)))
        peaks[name] = autockpt.measure(methods[-1][1], (x,), loss_fn=loss_fn).peak_activation_bytes
        plans[name] = autockpt.plan_of(methods[-1][1])
    least = autockpt.apply(net, budget_mb=None, example_inputs=(x,), loss_fn=loss_fn)
    methods.append(("autockpt(budget=None: least)", least))
    peaks[methods[-1][0]] = autockpt.measure(least, (x,), loss_fn=loss_fn).peak_activation_bytes
    plans[methods[-1][0]] = autockpt.plan_of(least)

    # Steps timed round-robin (a warm-up round, then one step of each method per round), so
    # that a change in the machine's load falls on every method alike.
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    for round_index in range(options.repeat + 1):
        for name, model in methods:
            start = time.perf_counter()
            loss_fn(model(x)).backward()
            if round_index:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    step = {name: statistics.median(values) for name, values in times.items()}
    flops = {name: backward_flops(model, x, loss_fn) for name, model in methods}
    base = "no checkpointing"
    rows = [[name, format_bytes(peaks[name]), f"{step[name] * 1000:.0f} ms",
             f"{step[name] / step[base]:.2f}", f"{flops[name] / flops[base]:.2f}",
             f"{len(plans[name].segments)} segments" if name in plans else ""]
            for name, _ in methods]
    chosen = next(iter(plans.values()))

    print("72-layer MLP, batch 16, float32, one forward + cross-entropy + backward (measured "
          f"on {x.device})\n")
    print(format_table(
        ["method", "peak activation", "step", "time ratio", "bwd FLOPs ratio", "plan"],
        rows,
        right=[False, True, True, True, True, False],
    ))
    print("\nThe plan autockpt chose for the first budget:\n")
    print(chosen)


if __name__ == "__main__":
    main()
