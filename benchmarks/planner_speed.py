"""How long autockpt takes to plan: end to end on real models, and the planner alone against
graph size.

**End to end** (``--end-to-end``): ``autockpt.plan(model, (x,))`` (trace, profile on fake
tensors, plan) and ``autockpt.apply(model, budget_mb, example_inputs=(x,))`` (the same plus
the rewrite) for a 24-layer GPT-style decoder and ResNet-50 (if torchvision imports). Each
model runs in a fresh Python process, so that its *first* call, which pays once for torch's
fake-tensor machinery (importing ``torch._dynamo``), is reported apart from the warm calls
(median of ``--repeat``). Two budgets: ``None`` (least memory) and halfway between the least
reachable peak and the peak without checkpointing.

**Corpus** (``--corpus``): ``autockpt.plan(model, budget_mb=None)`` (the least memory) for
every model the tests plan: the real models of tests/models/corpus.py, the skip-connection
models of tests/models/test_skip_connections.py and the torch.nn transformers of
tests/test_torch_nn_transformer.py, at the sizes the tests use, all in one warm process, with
the time split into capture (fx or torch.export), profiling and planning. The first plan of a
model is reported apart: fake tensors cache each op's result by shapes, so later plans of the
same model are faster. A model whose package
is missing is skipped. The slowest is printed last; the target is 3 s each on a 2-core CPU.

**Planner alone** (``--planner``): ``make_plan`` on a ready :class:`~autockpt.profiling.stats.Profile`
(building the chain of stages and running the strategy; no tracing or profiling), for graphs
of 100 to 10,000 nodes in two families:

* ``mlp``: a deep MLP (alternating Linear and ReLU) written directly as plain numbers, the
  way the profiler would report it, with deterministic pseudo-random layer widths;
* ``gpt``: GPT-style decoders (pre-norm attention + MLP blocks, small widths) of as many
  layers as give about that many nodes, traced and profiled on fake tensors beforehand
  (profiling time is not counted).

    python benchmarks/planner_speed.py                      # both parts
    python benchmarks/planner_speed.py --planner --sizes 100,1000,5000 --json out.json
    python benchmarks/planner_speed.py --end-to-end --models gpt24
    python benchmarks/planner_speed.py --corpus --json corpus.json
    python benchmarks/planner_speed.py --corpus --mode reentrant

Timings use one torch thread (``--threads``); on a shared machine compare medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import gpt, resnet50

import autockpt
from autockpt.capturing.trace import bind_inputs, trace
from autockpt.planning.chain import build_chain
from autockpt.planning.planner import make_plan
from autockpt.profiling.profile import profile
from autockpt.profiling.stats import NodeStat, Profile, StorageStat
from autockpt.report import format_table

MIB = 2**20
SIZES = (100, 500, 1000, 2000, 5000, 10000)

# --------------------------------------------------------------------------- end to end

E2E_MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], torch.Tensor]]] = {
    # The benchmark GPT of compare.py (width 256, 4 heads, batch 8 x 128 tokens), 24 layers.
    "gpt24": (lambda: gpt(layers=24), lambda: torch.randint(0, 2048, (8, 128))),
    "resnet50": (resnet50, lambda: torch.randn(8, 3, 128, 128)),
}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _seconds(fn: Callable[[], Any]) -> float:
    return _timed(fn)[0]


def end_to_end_child(name: str, repeat: int) -> dict[str, Any]:
    """Run in a fresh process: the first ``plan`` call, then warm calls of each kind."""
    build, batch = E2E_MODELS[name]
    model, x = build(), batch()
    # The first call in the process: torch's fake-tensor machinery is set up here, once.
    first_seconds, least = _timed(lambda: autockpt.plan(model, (x,)))
    budget_mb = (least.min_peak_bytes + least.baseline_peak_bytes) / 2 / MIB
    timings: dict[str, list[float]] = {"plan(None)": [], "plan(budget)": [], "apply(budget)": [],
                                       "trace": [], "profile": [], "make_plan(budget)": []}
    for _ in range(repeat):
        timings["plan(None)"].append(_seconds(lambda: autockpt.plan(model, (x,))))
        timings["plan(budget)"].append(
            _seconds(lambda: autockpt.plan(model, (x,), budget_mb=budget_mb)))
        timings["apply(budget)"].append(
            _seconds(lambda: autockpt.apply(model, budget_mb, example_inputs=(x,))))
        # The stages of plan(budget) one by one, to see where the time goes.
        seconds, traced = _timed(lambda: trace(model, (x,)))
        timings["trace"].append(seconds)
        seconds, prof = _timed(lambda: profile(traced, bind_inputs(model, (x,), {})))  # noqa: B023
        timings["profile"].append(seconds)
        timings["make_plan(budget)"].append(
            _seconds(lambda: make_plan(prof, int(budget_mb * MIB))))  # noqa: B023
    return {
        "model": name,
        "graph_nodes": least.node_count,
        "budget_mib": round(budget_mb, 2),
        "first_plan_seconds": first_seconds,
        "warm_median_seconds": {k: statistics.median(v) for k, v in timings.items()},
        "torch": torch.__version__,
    }


def end_to_end(names: list[str], repeat: int, threads: int) -> list[dict[str, Any]]:
    """Each model in its own process (the first call must find torch cold)."""
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--child", name, "--repeat", str(repeat),
                   "--threads", str(threads)]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["failed"])[-1]
            print(f"  {name}: skipped ({last})", flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"  {name}: first plan {row['first_plan_seconds']:.2f} s", flush=True)
    return rows


def print_end_to_end(rows: list[dict[str, Any]]) -> None:
    header = ["model", "nodes", "first plan s", "plan(None) s", "plan(budget) s",
              "apply(budget) s", "trace s", "profile s", "make_plan s"]
    table = []
    for r in rows:
        warm = r["warm_median_seconds"]
        table.append([r["model"], str(r["graph_nodes"]), f"{r['first_plan_seconds']:.2f}",
                      *(f"{warm[k]:.2f}" for k in ("plan(None)", "plan(budget)", "apply(budget)",
                                                    "trace", "profile", "make_plan(budget)"))])
    print(format_table(header, table, right=[False] + [True] * (len(header) - 1)))


# --------------------------------------------------------------------------- corpus

ROOT = Path(__file__).resolve().parents[1]
CORPUS_TARGET_SECONDS = 3.0


def corpus_models() -> list[tuple[str, Callable[[], torch.nn.Module], Callable[[], Any]]]:
    """``(name, build, inputs)`` for every model the tests plan; ``inputs()`` gives
    ``(args, kwargs)``. Imported from the tests, so that the sizes are theirs."""
    sys.path.insert(0, str(ROOT))
    from tests.models.corpus import CASES as CORPUS
    from tests.models.test_skip_connections import CASES as SKIPS
    from tests.test_torch_nn_transformer import CASES as TORCH_NN

    models = [(c.name, lambda c=c: c.build(0), c.inputs) for c in CORPUS]
    models += [(c.name, c.build, c.inputs) for c in SKIPS if c.name not in
               {name for name, _, _ in models}]
    models += [(name, lambda make=make: make().train(), lambda args=args: (args, {}))
               for name, (make, args) in TORCH_NN.items()]
    return models


def _importable(model_name: str) -> bool:
    package = {"timm": "timm", "tv": "torchvision", "hf": "transformers",
               "diffusers": "diffusers"}.get(model_name.split("_")[0])
    if package is None:
        return True
    try:
        __import__(package)
    except ImportError:
        return False
    return True


def corpus(repeat: int, names: list[str] | None = None, mode: str = "non_reentrant"
           ) -> list[dict[str, Any]]:
    """Seconds of ``plan(model, budget_mb=None, mode=mode)`` per model (those in ``names``, or
    all): the first call for the model, which finds torch's fake-tensor caches cold for its op
    shapes (what a user waits for), and the median of the later ones, split by stage (in
    reentrant mode the rest includes the replay of the plan on fake tensors)."""
    from autockpt.capturing.ladder import capture
    from autockpt.capturing.trace import TracedModel

    # torch's fake-tensor machinery is set up by the first plan of the process; not counted.
    autockpt.plan(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    rows = []
    for name, build, inputs in corpus_models():
        if names is not None and name not in names:
            continue
        if not _importable(name):
            print(f"  {name}: skipped (package missing)", flush=True)
            continue
        model = build()
        args, kwargs = inputs()
        totals, captures, profiles = [], [], []
        for _ in range(repeat):
            total, plan = _timed(lambda: autockpt.plan(  # noqa: B023
                model, args, example_kwargs=kwargs, mode=mode))
            seconds, traced = _timed(lambda: capture(model, args, kwargs))  # noqa: B023
            totals.append(total)
            captures.append(seconds)
            if isinstance(traced, TracedModel):
                arguments = bind_inputs(model, args, kwargs)
                profiles.append(_seconds(lambda: profile(  # noqa: B023
                    traced, dict(zip(traced.spec.param_names,  # noqa: B023
                                     traced.graph_inputs(arguments))))))  # noqa: B023
        row = {"model": name, "mode": mode, "capture": plan.capture,
               "graph_nodes": plan.node_count,
               "first_plan_seconds": totals[0],
               "plan_seconds": statistics.median(totals[1:] or totals),
               "capture_seconds": statistics.median(captures),
               "profile_seconds": statistics.median(profiles) if profiles else None}
        rows.append(row)
        print(f"  {name}: {row['plan_seconds']:.2f} s", flush=True)
    return rows


def print_corpus(rows: list[dict[str, Any]]) -> None:
    header = ["model", "capture", "nodes", "first plan s", "plan(None) s", "capture s",
              "profile s", "rest s"]
    table = []
    for r in rows:
        profiled = r["profile_seconds"]
        rest = r["plan_seconds"] - r["capture_seconds"] - (profiled or 0.0)
        table.append([r["model"], r["capture"], str(r["graph_nodes"]),
                      f"{r['first_plan_seconds']:.2f}", f"{r['plan_seconds']:.2f}",
                      f"{r['capture_seconds']:.2f}",
                      "-" if profiled is None else f"{profiled:.2f}", f"{max(rest, 0.0):.2f}"])
    print(format_table(header, table, right=[False, False] + [True] * (len(header) - 2)))
    if rows:
        slowest = max(rows, key=lambda r: r["first_plan_seconds"])
        over = [r["model"] for r in rows if r["first_plan_seconds"] > CORPUS_TARGET_SECONDS]
        print(f"slowest first plan: {slowest['model']} {slowest['first_plan_seconds']:.2f} s; "
              f"over {CORPUS_TARGET_SECONDS:.0f} s: {', '.join(over) or 'none'}")


# --------------------------------------------------------------------------- planner alone


def mlp_profile(nodes: int, seed: int = 0) -> Profile:
    """A deep MLP as the profiler reports one: an input, ``nodes - 2`` layers alternating
    Linear and ReLU, and the output node. Widths are pseudo-random (fixed by ``seed``), so that
    segments differ in size as in real models.

    A Linear saves its input for backward (the previous ReLU's output, which that ReLU also
    saves) and a ReLU saves its output: the same sharing the real profile shows.
    """
    rng = random.Random(seed)
    batch = 16
    layers = nodes - 2
    widths = [rng.choice((256, 512, 1024, 2048)) for _ in range(layers + 1)]
    stats = [NodeStat(index=0, name="x", op="placeholder", target="x", module_path="",
                      inputs=(), users=(1,), output_kind="tensor", requires_grad=False, flops=0,
                      output_bytes=0, work_bytes=0, random=False, trainable=False,
                      mutated_inputs=(), mutated_buffers=())]
    storages = []
    width_in = widths[0]
    for i in range(1, layers + 1):
        linear = i % 2 == 1
        width_out = widths[i] if linear else width_in
        size = batch * width_out * 4
        stats.append(NodeStat(
            index=i, name=f"layer{i}", op="call_module", target=str(i), module_path=str(i),
            inputs=(i - 1,), users=(i + 1,), output_kind="tensor", requires_grad=True,
            flops=2 * batch * width_in * width_out if linear else 0, output_bytes=size,
            work_bytes=size, random=False, trainable=linear, mutated_inputs=(),
            mutated_buffers=()))
        # What saves this output: a ReLU saves its own, the Linear after it saves its input.
        saved_by = (i, i + 1) if not linear and i < layers else (i,) if not linear else ()
        storages.append(StorageStat(size_bytes=size, producer=i, users=(i + 1,),
                                    saved_by=saved_by, requires_grad=True,
                                    is_output=i == layers))
        width_in = width_out
    stats.append(NodeStat(index=layers + 1, name="output", op="output", target="output",
                          module_path="", inputs=(layers,), users=(), output_kind="constant",
                          requires_grad=False, flops=0, output_bytes=0, work_bytes=0,
                          random=False, trainable=False, mutated_inputs=(), mutated_buffers=()))
    return Profile(nodes=tuple(stats), storages=tuple(storages),
                   input_signature=f"x: float32[{batch}, {widths[0]}]")


def gpt_profile(nodes: int) -> Profile:
    """A small GPT-style decoder deep enough for about ``nodes`` graph nodes, profiled."""
    per_layer, fixed = 23, 10  # nodes of one block, and of the embedding and head
    layers = max(1, round((nodes - fixed) / per_layer))
    model = gpt(layers=layers, dim=64, heads=2, vocab=128, length=32)
    x = torch.randint(0, 128, (2, 32))
    return profile(trace(model, (x,)), bind_inputs(model, (x,), {}))


FAMILIES: dict[str, Callable[[int], Profile]] = {"mlp": mlp_profile, "gpt": gpt_profile}


def time_planner(prof: Profile, repeat: int) -> dict[str, Any]:
    """Median seconds of ``make_plan`` with no budget and with a budget halfway between the
    least reachable peak and the peak without checkpointing."""
    least = make_plan(prof, None)
    budget = (least.min_peak_bytes + least.baseline_peak_bytes) // 2
    none_s = [_seconds(lambda: make_plan(prof, None)) for _ in range(repeat)]
    budget_s = [_seconds(lambda: make_plan(prof, budget)) for _ in range(repeat)]
    return {
        "graph_nodes": len(prof.nodes),
        "chain_stages": len(build_chain(prof).stages),
        "plan_none_seconds": statistics.median(none_s),
        "plan_budget_seconds": statistics.median(budget_s),
    }


def planner_alone(families: list[str], sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        for size in sizes:
            prof = FAMILIES[family](size)
            row = {"family": family, **time_planner(prof, repeat)}
            rows.append(row)
            print(f"  {family} {row['graph_nodes']:6d} nodes: "
                  f"{row['plan_budget_seconds']:.3f} s with a budget", flush=True)
    return rows


def print_planner(rows: list[dict[str, Any]]) -> None:
    header = ["family", "graph nodes", "chain stages", "plan(None) s", "plan(budget) s"]
    table = [[r["family"], str(r["graph_nodes"]), str(r["chain_stages"]),
              f"{r['plan_none_seconds']:.3f}", f"{r['plan_budget_seconds']:.3f}"] for r in rows]
    print(format_table(header, table, right=[False, True, True, True, True]))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--end-to-end", action="store_true", help="only the end-to-end part")
    parser.add_argument("--planner", action="store_true", help="only the planner-alone part")
    parser.add_argument("--corpus", action="store_true",
                        help="only the corpus part: every model the tests plan")
    parser.add_argument("--models", default=None,
                        help=f"end to end, comma-separated, from: {', '.join(E2E_MODELS)}; "
                        "with --corpus, the corpus models to time (default: all)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"planner alone, comma-separated, from: {', '.join(FAMILIES)}")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="planner alone: graph node counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--mode", default="non_reentrant", choices=("non_reentrant", "reentrant"),
                        help="with --corpus, the checkpoint mode planned")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 keeps timings stable on a shared machine)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one end-to-end model, JSON out
    args = parser.parse_args(argv)
    args.models_given = args.models is not None
    if args.models is None:
        args.models = ",".join(E2E_MODELS)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(end_to_end_child(args.child, args.repeat)))
        return 0
    both = not (args.end_to_end or args.planner or args.corpus)
    out: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads}
    if both or args.end_to_end:
        names = [n for n in args.models.split(",") if n]
        unknown = [n for n in names if n not in E2E_MODELS]
        if unknown:
            parser.error(f"unknown model(s) {', '.join(unknown)}")
        print("end to end (fresh process per model):", flush=True)
        out["end_to_end"] = end_to_end(names, args.repeat, args.threads)
        print()
        print_end_to_end(out["end_to_end"])
        print()
    if both or args.planner:
        families = [f for f in args.families.split(",") if f]
        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            parser.error(f"unknown famil(ies) {', '.join(unknown)}")
        sizes = [int(s) for s in args.sizes.split(",") if s]
        print("planner alone (make_plan on a ready profile):", flush=True)
        out["planner"] = planner_alone(families, sizes, args.repeat)
        print()
        print_planner(out["planner"])
    if args.corpus:
        print(f"corpus (least memory, {args.mode}, warm process, median of --repeat):",
              flush=True)
        chosen = [n for n in args.models.split(",") if n] if args.models_given else None
        out["corpus"] = corpus(args.repeat, chosen, args.mode)
        print()
        print_corpus(out["corpus"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
