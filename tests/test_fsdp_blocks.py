"""FSDP2 sharded block by block, as large models are trained, and hooks on submodules.

Two gloo processes on CPU run tests/train_scripts/fsdp_blocks.py: a GPT of our own and a
Llama-style decoder from a small Hugging Face config, planned at half their peak without
checkpointing with ``keep_whole`` naming the blocks, then sharded the way torchtitan does
(``fully_shard(block)`` for each block, then the root). Over three AdamW steps the losses,
the full gradients and the parameters equal the same FSDP2 setup without autockpt; each rank's
measured activation peak stays within the budget's slack; a run saved at step 1 with
``CheckpointManager`` (DCP, one shard per rank) and resumed into fresh models ends where the
uninterrupted run ends; with each block compiled before it is sharded, the same. Four
processes do the same for the GPT on a 2-D mesh (HSDP: replicate x shard). Sharded after
``apply`` without ``keep_whole`` (the root sharded or not), the first forward plans again with
the blocks kept whole and both models train as FSDP2 does without autockpt
(``AUTOCKPT_FSDP_RUN=late``). In one process: a hook registered after ``apply`` on a kept
module runs as often as without autockpt (plus the recompute); one on a module the graph
traced into makes the next forward plan again with that module kept whole; and per-block
``torch.compile`` runs on top.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autockpt
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import MODES, ROOT, assert_same_tensors, run_workers
from tests.train_scripts.setups_model import batch, build, loss_of

WORKER = ROOT / "tests" / "train_scripts" / "fsdp_blocks.py"
MODELS = ("gpt", "llama")
KEEP = {"gpt": "layers.*", "llama": "model.layers.*"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("fsdp_blocks")
    return run_workers(WORKER, 2, directory, timeout_s=600, env={"OMP_NUM_THREADS": "1"})


def _each_scenario(test: Any) -> Any:
    """Marks a test that reads the two-process run, once per model and mode."""
    for mark in (pytest.mark.parametrize("name", MODELS), pytest.mark.parametrize("mode", MODES),
                 pytest.mark.slow, pytest.mark.distributed):
        test = mark(test)
    return test


def _scenario(results: list[dict[str, Any]], rank: int, name: str, mode: str) -> dict[str, Any]:
    out = results[rank][f"{name}/{mode}"]
    assert "error" not in out, f"rank {rank}, {name}/{mode}:\n{out.get('traceback')}"
    return out


@_each_scenario
def test_three_steps_equal_fsdp2_without_autockpt(results: list[dict[str, Any]], name: str,
                                                 mode: str) -> None:
    for rank in range(2):
        out = _scenario(results, rank, name, mode)
        assert "kept whole" in out["plan"] and "checkpointed" in out["plan"], out["plan"]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["plain_losses"]))
        assert_same_tensors(out["grads"], out["plain_grads"], what=f"rank {rank} grad ")
        assert_same_tensors(out["params"], out["plain_params"], what=f"rank {rank} param ")
    # The all-reduce made every rank's full parameters agree.
    assert_same_tensors(_scenario(results, 0, name, mode)["params"],
                        _scenario(results, 1, name, mode)["params"], what="rank 0 vs 1 ")


@_each_scenario
def test_each_rank_meets_the_budget_sharded(results: list[dict[str, Any]], name: str,
                                            mode: str) -> None:
    for rank in range(2):
        out = _scenario(results, rank, name, mode)
        budget = out["budget_bytes"]
        assert out["peak_bytes"] <= budget * (1 + BUDGET_SLACK), (
            f"rank {rank}, {name}/{mode}: measured {out['peak_bytes']} B with FSDP2, budget "
            f"{budget} B (without autockpt {out['plain_peak_bytes']} B)\n{out['plan']}")
        assert out["peak_bytes"] < out["plain_peak_bytes"]


@_each_scenario
def test_dcp_save_and_resume_shard_by_shard(results: list[dict[str, Any]], name: str,
                                            mode: str) -> None:
    for rank in range(2):
        out = _scenario(results, rank, name, mode)
        assert out["resumed_step"] == 1
        assert_same_tensors(out["resumed"], out["uninterrupted"], what=f"rank {rank} param ",
                            exact=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_per_block_torch_compile_under_the_sharding(results: list[dict[str, Any]]) -> None:
    """torchtitan compiles each block, then shards it: the same three steps as without
    autockpt, compiled and sharded the same way (aot_eager)."""
    for rank in range(2):
        out = results[rank]["gpt/non_reentrant/compiled"]
        assert "error" not in out, out.get("traceback")
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["plain_losses"]))
        assert_same_tensors(out["params"], out["plain_params"], what=f"rank {rank} param ")


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_on_a_two_by_two_mesh(tmp_path: Any) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    results = run_workers(WORKER, 4, tmp_path, timeout_s=600, env={"OMP_NUM_THREADS": "1"})
    for rank in range(4):
        out = _scenario(results, rank, "gpt", "non_reentrant")
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["plain_losses"]))
        assert_same_tensors(out["grads"], out["plain_grads"], what=f"rank {rank} grad ")
        assert_same_tensors(out["params"], out["plain_params"], what=f"rank {rank} param ")
        assert out["peak_bytes"] <= out["budget_bytes"] * (1 + BUDGET_SLACK)
        assert_same_tensors(out["resumed"], out["uninterrupted"], what=f"rank {rank} resumed ",
                            exact=True)


# ------------------------------------------------------- sharded after apply, no keep_whole

LATE = [(name, keep, root) for name in MODELS for keep in (False, True) for root in (True, False)
        if keep is False or root is False]
"""(model, keep_whole given, root sharded too): the runs of ``AUTOCKPT_FSDP_RUN=late``; the
blocks kept whole with the root sharded is the module fixture's run."""


@pytest.fixture(scope="module")
def late_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("fsdp_late")
    return run_workers(WORKER, 2, directory, timeout_s=600,
                       env={"OMP_NUM_THREADS": "1", "AUTOCKPT_FSDP_RUN": "late"})


KEPT = "\n  kept whole      "
"""The header line of a plan that keeps module calls whole."""


def _late_key(name: str, keep: bool, root: bool, mode: str) -> str:
    return f"late/{name}/{'keep' if keep else 'inlined'}/{'root' if root else 'no_root'}/{mode}"


def _without_budget_and_replan(plan: str) -> list[str]:
    """A printed plan without its budget line (half of each run's own first baseline), the
    note a plan made again adds, and the shapes it serves (a plan made from example inputs
    serves every smaller call; one made again serves its own call)."""
    return [line for line in plan.splitlines()
            if not line.startswith(("  budget ", "  note: re-planned at the first forward",
                                    "  serves "))]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "keep", "root"), LATE)
def test_fully_shard_per_block_after_apply_trains_like_fsdp2(
        late_results: list[dict[str, Any]], name: str, keep: bool, root: bool, mode: str) -> None:
    """torchtitan's order (``apply``, then ``fully_shard`` on each block, then on the root or
    not) on our GPT (torch.fx) and on Hugging Face Llama (torch.export at ``apply``): without
    ``keep_whole`` the first forward plans again with the sharded blocks kept whole, on fake
    parameters of their full shapes, and makes the very plan ``keep_whole`` makes before
    sharding; two AdamW steps give FSDP2's gradients (every parameter, full tensors) and
    parameters without autockpt, and the measured peak meets the budget."""
    for rank in range(2):
        out = late_results[rank][_late_key(name, keep, root, mode)]
        assert "error" not in out, f"rank {rank}:\n{out.get('traceback')}"
        if keep:
            assert out["plan"] == out["first_plan"]
        else:
            assert KEPT not in out["first_plan"], out["first_plan"]
            assert ("re-planned at the first forward: FSDP2's fully_shard put hooks on "
                    f"'{KEEP[name].replace('*', '0')}'") in out["plan"], out["plan"]
            # Profiled at the full shapes, not the shards': the plan apply makes with the
            # blocks kept whole before anything is sharded.
            before = late_results[rank][_late_key(name, True, False, mode)]["first_plan"]
            assert _without_budget_and_replan(out["plan"]) == _without_budget_and_replan(before)
        assert KEPT in out["plan"] and "checkpointed" in out["plan"], out["plan"]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["plain_losses"]))
        assert_same_tensors(out["grads"], out["plain_grads"], what=f"rank {rank} grad ",
                            allow_none=True)
        assert_same_tensors(out["params"], out["plain_params"], what=f"rank {rank} param ")
        assert out["peak_bytes"] <= out["budget_bytes"] * (1 + BUDGET_SLACK), out["plan"]
        assert out["peak_bytes"] < out["plain_peak_bytes"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_plan_that_cannot_be_made_again_when_sharded_names_keep_whole(
        late_results: list[dict[str, Any]]) -> None:
    """``cost="profile"`` times nodes on real tensors: once the blocks are sharded they are
    not whole, so the first forward raises autockpt's error, naming ``keep_whole``, rather
    than a torch error from inside FSDP2 or DTensor."""
    for out in late_results:
        error = out["late/gpt/timed"]["error"]
        assert error.startswith("AutockptError: hooks were registered on 'layers.0'"), error
        assert "keep_whole=['layers.0'" in error, error


# --------------------------------------------------------------------------- one process


def _step(model: torch.nn.Module, seed: int = 3) -> None:
    torch.manual_seed(seed)
    loss_of(model(batch(seed))).backward()


def _counted_step(model: torch.nn.Module) -> None:
    """:func:`_step` with every recompute running its whole segment (no early stop), so that
    a hook's call count follows from the plan (:func:`_recomputes`)."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _step(model)


def _recomputes(plan: autockpt.Plan, index: int) -> int:
    """How many checkpointed segments (nested ones too) hold ``blocks.<index>``: each runs it
    once more in backward."""

    def block(name: str, outside: int) -> int:
        return int(name.split(".")[1]) if name.startswith("blocks.") else outside

    return sum(block(s.first_module, 0) <= index <= block(s.last_module, 5)
               for s in plan.segments)


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_registered_after_apply_on_a_kept_block_runs(mode: str) -> None:
    reference = build()
    transformed = autockpt.apply(build(), None, example_inputs=(batch(0),), mode=mode,
                                 keep_whole="blocks.*")
    plan = autockpt.plan_of(transformed)
    assert plan.kept_whole == tuple(f"blocks.{i}" for i in range(6))
    assert any(_recomputes(plan, i) for i in range(6)), plan
    counts: dict[str, list[int]] = {"plain": [], "autockpt": []}
    for label, model in (("plain", reference), ("autockpt", transformed)):
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(lambda *_, i=i, label=label: counts[label].append(i))
        _counted_step(model)
    assert sorted(counts["plain"]) == list(range(6))
    # Each block once in forward, and once more for each segment that recomputes it.
    assert [counts["autockpt"].count(i) for i in range(6)] == [
        1 + _recomputes(plan, i) for i in range(6)], (counts["autockpt"], plan)


def test_a_hook_on_a_block_the_graph_traced_into_makes_it_plan_again() -> None:
    reference = build()
    transformed = autockpt.apply(build(), None, example_inputs=(batch(0),))
    assert autockpt.plan_of(transformed).kept_whole == ()
    counts: dict[str, int] = {"plain": 0, "autockpt": 0}
    for label, model in (("plain", reference), ("autockpt", transformed)):
        model.blocks[3].register_forward_pre_hook(
            lambda *_, label=label: counts.__setitem__(label, counts[label] + 1))
        _counted_step(model)
    plan = autockpt.plan_of(transformed)
    assert plan.kept_whole == ("blocks.3",)
    assert plan.notes[-1] == ("re-planned at the first forward: hooks were registered on "
                              "'blocks.3' after apply, so those modules are kept whole"), plan
    assert counts == {"plain": 1, "autockpt": 1 + _recomputes(plan, 3)}, (counts, plan)
    assert_same_tensors({n: p.grad for n, p in transformed.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})


def test_hooks_present_at_planning_are_kept_whole_and_not_run_while_profiling() -> None:
    model = build()
    calls: list[int] = []
    model.blocks[1].register_forward_hook(lambda *_: calls.append(1))
    transformed = autockpt.apply(model, None, example_inputs=(batch(0),))
    assert calls == []  # profiling runs on fake tensors and leaves hooks alone
    plan = autockpt.plan_of(transformed)
    assert plan.kept_whole == ("blocks.1",)
    _counted_step(transformed)
    assert len(calls) == 1 + _recomputes(plan, 1), (calls, plan)


def test_per_block_torch_compile_on_top() -> None:
    reference = build()
    transformed = autockpt.apply(build(), None, example_inputs=(batch(0),),
                                 keep_whole="blocks.*")
    for block in transformed.blocks:
        block.compile(backend="aot_eager")
    for block in reference.blocks:
        block.compile(backend="aot_eager")
    _step(reference)
    _step(transformed)
    assert_same_tensors({n: p.grad for n, p in transformed.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})


def test_keep_whole_names_are_checked() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="no submodule") as info:
        autockpt.plan(build(), (batch(0),), keep_whole="block.*")
    assert "stem, blocks, head" in str(info.value)
    with pytest.raises(autockpt.InvalidArgumentError, match="keep_whole must be"):
        autockpt.plan(build(), (batch(0),), keep_whole=[3])


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
def test_modules_whose_forward_needs_their_pre_hook_still_profile() -> None:
    """The old ``weight_norm`` computes ``weight`` in a forward pre-hook: such a module is kept
    whole like any hooked one, and profiled with its hook when its forward needs it."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[
            torch.nn.utils.weight_norm(torch.nn.Linear(32, 32)) if i % 2 == 0
            else torch.nn.Tanh() for i in range(12)])

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    reference = make()
    transformed = autockpt.apply(make(), None, example_inputs=(x,))
    assert autockpt.plan_of(transformed).segments
    transformed(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert_same_tensors({n: p.grad for n, p in transformed.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})


def test_kept_blocks_inside_a_module_fx_cannot_trace_go_to_the_module_rung() -> None:
    """torch.fx fails in ``body`` (it branches on a size), which holds the blocks to keep
    whole; keeping ``body`` whole would leave nothing to plan, so the modules rung
    checkpoints the blocks themselves."""

    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1:
                x = x * 2
            for layer in self.layers:
                x = layer(x)
            return x

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = Body(), torch.nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return Wrapped()

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    # sqrt: segments whatever the budget, so that checkpointed blocks are under test.
    transformed = autockpt.apply(make(), None, example_inputs=(x,), keep_whole="body.layers.*",
                                 strategy="sqrt")
    plan = autockpt.plan_of(transformed)
    assert plan.capture == "modules", plan
    assert "holds modules to keep whole" in plan.capture_reason
    assert plan.segments, plan
    reference = make()
    transformed(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert_same_tensors({n: p.grad for n, p in transformed.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})
