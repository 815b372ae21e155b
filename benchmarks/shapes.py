"""Every batch its own shape: whole training loops whose batches change shape, planning included.

Three loops, as users run them (docs/shapes.md):

- ``gpt2``: Hugging Face GPT-2 from a small config (6 layers, d 256, vocabulary 8192), batch 4,
  12 batches padded per batch as a padding collator pads them (each row its own length between
  32 and 256 tokens; the mask zero and the labels -100 on the padding), ``labels=`` inside;
- ``bert``: ``BertForMaskedLM`` (4 layers, d 256), the same padding, 15% of the tokens masked;
- ``cnn``: torchvision's ResNet-18 (no weights) on images of 8 sizes between 160 and 320 pixels
  (multi-scale training), batch 8, the cross-entropy outside the model, passed as ``loss_fn``.

Methods, each on a deep copy of the same seeded model and the same batches:

- ``none``: no checkpointing;
- ``every block``: every block checkpointed by hand (Hugging Face's
  ``gradient_checkpointing_enable()``; for the CNN, each residual block under
  ``torch.utils.checkpoint.checkpoint``);
- ``autockpt``: ``autockpt.apply(model, budget_mb=B)`` without example inputs, where ``B`` is
  the largest peak ``every block`` measured over the loop (the same memory);
- ``autockpt max``: the same with ``max_shapes=`` the loop's largest sizes (one plan).

Columns: the whole loop's seconds (planning included, median of ``--repeat`` loops run
round-robin across the methods, each on a fresh copy), its ratio to ``every block``, the seconds
of it autockpt spent capturing, planning and compiling, the largest measured activation peak
of a step (``autockpt.measure``, in a second pass over the same batches: parameters,
gradients and inputs left out) and its ratio to the budget, the plans and captures autockpt
made, and whether every loss of the loop equals that of ``none``.

    python benchmarks/shapes.py                   # all three loops
    python benchmarks/shapes.py --loops gpt2 --repeat 1 --json out.json
    python benchmarks/shapes.py --new-shapes 24   # what a plan for a new shape costs

``--new-shapes N`` runs each loop and then N more batches whose shapes keep coming (rows per
batch drawn too, as a sampler that fills a token budget draws them; images of two sides) on
autockpt alone, and reports what the first batch of each new shape after the first plan paid
for planning against the median step that planned nothing (median, mean and largest; how
many planned at all), the planning after the first plan against the whole loop, and the
planning time of the plans priced by evaluating the profile taken on symbolic sizes.

Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autockpt  # noqa: E402

MIB = 2**20

Batch = tuple[tuple[Any, ...], dict[str, Any]]
Loop = tuple[torch.nn.Module, list[Batch], Callable[..., Any] | None, str,
             dict[str, tuple[int | None, ...]]]
"""The model, its batches, the loss outside it (``None``: its own), how to checkpoint every
block by hand (``"hf"``: Hugging Face's switch), and the largest shape (``max_shapes=``)."""


def padded_batches(count: int, batch: int | tuple[int, ...], vocab: int, lowest: int,
                   highest: int, seed: int, masked_lm: bool = False) -> list[Batch]:
    """Batches as a padding collator makes them: each row its own length, padded to the
    longest row of its batch (``batch``: the rows, or the choices a sampler that fills a
    budget of tokens draws them from)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        rows = batch if isinstance(batch, int) else rng.choice(batch)
        lengths = [rng.randint(lowest, highest) for _ in range(rows)]
        width = max(lengths)
        ids = torch.randint(1, vocab, (rows, width), generator=gen)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
        ids = ids * mask
        labels = ids.masked_fill(mask == 0, -100)
        if masked_lm:
            chosen = (torch.rand(rows, width, generator=gen) < 0.15) & (mask == 1)
            labels = ids.masked_fill(~chosen, -100)
            ids = ids.masked_fill(chosen, 3)
        out.append(((), {"input_ids": ids, "attention_mask": mask, "labels": labels}))
    return out


def image_batches(count: int, batch: int, seed: int, aspect: bool = False) -> list[Batch]:
    """Multi-scale training: a side per batch (``aspect``: a height and a width each, as
    detection's aspect-ratio grouping makes them)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = [160, 192, 224, 256, 288, 320]
    out = []
    for _ in range(count):
        height = rng.choice(sizes)
        width = rng.choice(sizes) if aspect else height
        out.append(((torch.randn(batch, 3, height, width, generator=gen),), {}))
    return out


def gpt2_loop() -> Loop:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=512,
                        bos_token_id=0, eos_token_id=0)
    return (GPT2LMHeadModel(config).train(), padded_batches(12, 4, 8192, 32, 256, 1), None,
            "hf", {"input_ids": (None, 256)})


def bert_loop() -> Loop:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                        intermediate_size=1024, vocab_size=8192, max_position_embeddings=512)
    return (BertForMaskedLM(config).train(),
            padded_batches(12, 8, 8192, 32, 256, 2, masked_lm=True), None, "hf",
            {"input_ids": (None, 256)})


def cnn_loop() -> Loop:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=100).train()
    targets = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(3))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets[: logits.shape[0]])

    return model, image_batches(8, 8, 3), loss_fn, "blocks", {"x": (None, 3, 320, 320)}


LOOPS = {"gpt2": gpt2_loop, "bert": bert_loop, "cnn": cnn_loop}


class _Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint.checkpoint`` (by hand)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def every_block(model: torch.nn.Module, how: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if how == "hf":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for i in range(len(layer)):
            layer[i] = _Checkpointed(layer[i])
    return model


def step(model: torch.nn.Module, batch: Batch, loss_fn: Callable[..., Any] | None) -> float:
    args, kwargs = batch
    outputs = model(*args, **kwargs)
    loss = loss_fn(outputs) if loss_fn is not None else outputs.loss
    loss.backward()
    value = float(loss.detach())
    del outputs, loss
    for p in model.parameters():
        p.grad = None
    return value


class PlanningClock:
    """Seconds spent in autockpt's stages (capture, plan, compile) while it is entered."""

    STAGES = ("capture_shared", "plan_shared", "compile_plan")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> PlanningClock:
        from autockpt import pipeline

        for name in self.STAGES:
            real = self._real[name] = getattr(pipeline, name)

            def timed(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(pipeline, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        from autockpt import pipeline

        for name, real in self._real.items():
            setattr(pipeline, name, real)


def run_loop(make: Callable[[], torch.nn.Module], batches: list[Batch],
             loss_fn: Callable[..., Any] | None) -> tuple[float, list[float], torch.nn.Module]:
    model = make()
    start = time.perf_counter()
    losses = [step(model, batch, loss_fn) for batch in batches]
    return time.perf_counter() - start, losses, model


def peaks(model: torch.nn.Module, batches: list[Batch], loss_fn: Callable[..., Any] | None
          ) -> list[int]:
    """The measured activation peak of a training step on each batch (``autockpt.measure``:
    parameters, their gradients and the inputs left out)."""
    return [autockpt.measure(model, args, example_kwargs=kwargs,
                             loss_fn=loss_fn).peak_activation_bytes for args, kwargs in batches]


def bench(name: str, repeat: int) -> list[dict[str, Any]]:
    base, batches, loss_fn, how, largest = LOOPS[name]()
    hand = every_block(base, how)
    hand_peaks = peaks(hand, batches, loss_fn)
    budget_mb = max(hand_peaks) / MIB
    makers: dict[str, Callable[[], torch.nn.Module]] = {
        "none": lambda: copy.deepcopy(base),
        "every block": lambda: every_block(base, how),
        "autockpt": lambda: autockpt.apply(copy.deepcopy(base), budget_mb=budget_mb,
                                           loss_fn=loss_fn),
        "autockpt max": lambda: autockpt.apply(copy.deepcopy(base), budget_mb=budget_mb,
                                               loss_fn=loss_fn, max_shapes=largest),
    }
    times: dict[str, list[float]] = {m: [] for m in makers}
    planning: dict[str, list[float]] = {m: [] for m in makers}
    losses: dict[str, list[float]] = {}
    last: dict[str, torch.nn.Module] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(repeat):
            for method, make in makers.items():
                torch.manual_seed(0)
                with PlanningClock() as clock:
                    seconds, lost, model = run_loop(make, batches, loss_fn)
                times[method].append(seconds)
                planning[method].append(clock.seconds)
                losses[method] = lost
                last[method] = model
        step_peaks = {m: (hand_peaks if m == "every block" else peaks(last[m], batches, loss_fn))
                      for m in makers}
    counts = {}
    for method in ("autockpt", "autockpt max"):
        state = last[method]._autockpt
        counts[method] = (sum(len(f.plans) for f in state.families.values()),
                          sum(len(f.graphs) for f in state.families.values()))
    hand_time = statistics.median(times["every block"])
    rows = []
    for method in makers:
        seconds = statistics.median(times[method])
        worst = max(step_peaks[method])
        rows.append({
            "loop": name, "method": method, "batches": len(batches),
            "shapes": len({tuple(t.shape for t in (*b[0], *b[1].values())) for b in batches}),
            "loop_s": round(seconds, 3), "vs_every_block": round(seconds / hand_time, 3),
            "planning_s": round(statistics.median(planning[method]), 3),
            "max_peak_mib": round(worst / MIB, 2),
            "peak_vs_budget": round(worst / (budget_mb * MIB), 3),
            "plans": counts[method][0] if method in counts else None,
            "captures": counts[method][1] if method in counts else None,
            "step_peaks_mib": [round(b / MIB, 2) for b in step_peaks[method]],
            "losses_equal": all(abs(a - b) <= 1e-4 * max(1.0, abs(b))
                                for a, b in zip(losses[method], losses["none"])),
        })
    return rows


def new_shape_cost(name: str, extra: int, seed: int = 7) -> dict[str, Any]:
    """What the first batch of a new shape costs once the graph's profile is known (issue 40,
    item 6): the loop's batches, then ``extra`` more of fresh shapes (lengths or image sizes
    drawn as the loop draws them), on autockpt alone; per step its seconds and the seconds
    autockpt spent planning in it. A step that planned is compared with the median step
    that did not."""
    from autockpt import pipeline

    base, batches, loss_fn, _, _ = LOOPS[name]()
    # Shapes that keep coming: rows drawn per batch too (a sampler filling a token budget),
    # images of two sides (aspect-ratio grouping).
    more = (padded_batches(extra, (2, 3, 4, 6, 8), 8192, 32, 256, seed) if name == "gpt2" else
            padded_batches(extra, (4, 6, 8, 12), 8192, 32, 256, seed, masked_lm=True)
            if name == "bert" else image_batches(extra, 8, seed, aspect=True))
    budget_mb = max(peaks(every_block(base, LOOPS[name]()[3]), batches, loss_fn)) / MIB
    model = autockpt.apply(copy.deepcopy(base), budget_mb=budget_mb, loss_fn=loss_fn)
    kinds: list[str] = []
    real = pipeline._Pricing.profile

    def noted(self: Any, *args: Any) -> Any:
        before = (self.pricing.profiled, self.pricing.symbolic, self.pricing.evaluated)
        out = real(self, *args)
        after = (self.pricing.profiled, self.pricing.symbolic, self.pricing.evaluated)
        kinds.append(("profiled", "symbolic", "evaluated")[
            [a != b for a, b in zip(before, after)].index(True)])
        return out

    rows = []
    pipeline._Pricing.profile = noted  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for args, kwargs in batches + more:
                kinds.clear()
                with PlanningClock() as clock:
                    start = time.perf_counter()
                    step(model, (args, kwargs), loss_fn)
                    seconds = time.perf_counter() - start
                shape = tuple(tuple(t.shape) for t in (*args, *kwargs.values()))[0]
                rows.append({"shape": shape, "step_s": seconds, "planning_s": clock.seconds,
                             "profiles": sorted(set(kinds))})
    finally:
        pipeline._Pricing.profile = real  # type: ignore[method-assign]
    plain = statistics.median(r["step_s"] for r in rows if r["planning_s"] == 0)
    later = [r for r in rows if r["profiles"] == ["evaluated"]]
    # Issue 40, item 6: the first batch of each new shape after the first plan, what it paid
    # beyond a batch of a known shape: its planning against the median step that planned
    # nothing, and against its own step's time without the planning (nothing where a plan
    # made earlier serves it).
    seen: set[Any] = {rows[0]["shape"]}
    first_of_shape, against_own = [], []
    for r in rows[1:]:
        if r["shape"] not in seen:
            seen.add(r["shape"])
            first_of_shape.append(r["planning_s"] / plain)
            against_own.append(r["planning_s"] / max(r["step_s"] - r["planning_s"], 1e-9))
    return {
        "loop": name, "steps": len(rows), "known_step_s": round(plain, 4),
        "plans": sum(1 for r in rows if r["planning_s"] > 0),
        "profiled": sum(1 for r in rows if "profiled" in r["profiles"]),
        "symbolic": sum(1 for r in rows if "symbolic" in r["profiles"]),
        "evaluated_plans": len(later),
        "evaluated_plan_ms": [round(r["planning_s"] * 1000, 1) for r in later],
        "evaluated_plan_vs_step": (round(statistics.median(r["planning_s"] for r in later)
                                         / plain, 3) if later else None),
        "new_shapes_after": len(first_of_shape),
        "new_shapes_planned": sum(1 for x in first_of_shape if x > 0),
        "new_shape_extra_median": (round(statistics.median(first_of_shape), 3)
                                   if first_of_shape else None),
        "new_shape_extra_mean": (round(statistics.mean(first_of_shape), 3)
                                 if first_of_shape else None),
        "new_shape_extra_max": round(max(first_of_shape), 3) if first_of_shape else None,
        "new_shape_extra_own_max": round(max(against_own), 3) if against_own else None,
        "planning_after_first_vs_loop": round(
            sum(r["planning_s"] for r in rows[1:]) / sum(r["step_s"] for r in rows[1:]), 3),
        "first_plans_s": [round(r["planning_s"], 2) for r in rows
                          if r["planning_s"] > 0 and r["profiles"] != ["evaluated"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--new-shapes", type=int, default=0, metavar="N",
                        help="instead: run each loop and N more batches of fresh shapes on "
                        "autockpt alone, and say what a plan for a new shape costs once the "
                        "graph's profile is known")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.new_shapes:
        found = [new_shape_cost(loop, args.new_shapes) for loop in args.loops]
        print(f"{'loop':5} {'steps':>5} {'known step s':>12} {'plans':>5} {'profiled':>8} "
              f"{'symbolic':>8} {'evaluated':>9} {'evaluated plan / step':>21} "
              f"{'new shapes':>10} {'planned':>7} {'extra median':>12} {'extra mean':>10} "
              f"{'extra max':>9} {'planning / loop':>15}  plans s (not evaluated)")
        for r in found:
            ratio = r["evaluated_plan_vs_step"]
            median, most = r["new_shape_extra_median"], r["new_shape_extra_max"]
            mean = r["new_shape_extra_mean"]
            print(f"{r['loop']:5} {r['steps']:>5} {r['known_step_s']:>12.3f} {r['plans']:>5} "
                  f"{r['profiled']:>8} {r['symbolic']:>8} {r['evaluated_plans']:>9} "
                  f"{'' if ratio is None else f'{ratio:.3f}':>21} "
                  f"{r['new_shapes_after']:>10} {r['new_shapes_planned']:>7} "
                  f"{'' if median is None else f'{median:.3f}':>12} "
                  f"{'' if mean is None else f'{mean:.3f}':>10} "
                  f"{'' if most is None else f'{most:.3f}':>9} "
                  f"{r['planning_after_first_vs_loop']:>15.3f}  {r['first_plans_s']}")
        _dump(args.json, found)
        return
    rows = [row for loop in args.loops for row in bench(loop, args.repeat)]
    header = (f"{'loop':5} {'method':12} {'batches':>7} {'shapes':>6} {'loop s':>7} "
              f"{'x every block':>13} {'planning s':>10} {'max peak MiB':>12} {'x budget':>8} "
              f"{'plans':>5} {'captures':>8} {'losses':>6}")
    print(header)
    for r in rows:
        print(f"{r['loop']:5} {r['method']:12} {r['batches']:>7} {r['shapes']:>6} "
              f"{r['loop_s']:>7.2f} {r['vs_every_block']:>13.2f} {r['planning_s']:>10.2f} "
              f"{r['max_peak_mib']:>12.1f} "
              f"{r['peak_vs_budget']:>8.3f} {r['plans'] if r['plans'] is not None else '':>5} "
              f"{r['captures'] if r['captures'] is not None else '':>8} "
              f"{'equal' if r['losses_equal'] else 'DIFFER':>6}")
    _dump(args.json, rows)


def _dump(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
