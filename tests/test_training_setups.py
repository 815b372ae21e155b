"""Real training setups around a transformed model, each compared with an identically seeded
twin that runs without autockpt: gradient accumulation, bfloat16 autocast on CPU,
``torch.compile``, ``nn.DataParallel``, and (2 gloo processes) DDP and FSDP2 ``fully_shard``.

The model (tests/train_scripts/setups_model.py) has residual blocks with LayerNorm, dropout and
BatchNorm; it is transformed at 40% of its estimated no-checkpoint peak, which checkpoints
several segments (``checkpointed`` asserts at least 2). What each setup supports, and why, is
in docs/training-setups.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from tests.helpers import (
    MODES,
    assert_same_tensors,
    buffers_of,
    grads_of,
    params_of,
    run_workers,
)
from tests.train_scripts.setups_model import batch, build, checkpointed, loss_of

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_scripts" / "dist_setups.py"


def state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every gradient, parameter and buffer, cloned, under the keys the two-process worker
    (tests/train_scripts/dist_setups.py) uses."""
    out: dict[str, torch.Tensor | None] = {f"grad:{n}": g for n, g in grads_of(model).items()}
    out.update({f"param:{n}": p for n, p in params_of(model).items()})
    out.update({f"buf:{n}": b for n, b in buffers_of(model).items()})
    return out


def assert_same(expected: dict[str, torch.Tensor | None], actual: dict[str, torch.Tensor | None],
                exact: bool = True) -> None:
    assert_same_tensors(actual, expected, exact=exact)


def step(model: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
         micro: int = 1) -> dict[str, torch.Tensor | None]:
    """One training step: ``micro`` micro-batches, each with its own backward, then SGD."""
    run = run or (lambda m, x: m(x))
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    for k in range(micro):
        loss_of(run(model, batch(10 + k))).backward()
    grads = state(model)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    after = {k.replace("param:", "stepped:"): v for k, v in state(model).items()
             if k.startswith("param:")}
    return {**grads, **after}


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_over_three_backward_passes(mode: str) -> None:
    reference, transformed = build(), checkpointed(build(), mode)
    expected = step(reference, micro=3)
    assert_same(expected, step(transformed, micro=3))
    # Accumulation really happened: one micro-batch gives other gradients.
    single = step(build(), micro=1)
    assert not torch.equal(single["grad:stem.weight"], expected["grad:stem.weight"])


def _under_autocast(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    return out


@pytest.mark.parametrize("mode", MODES)
def test_autocast_bfloat16_plans_for_bfloat16_and_matches(mode: str) -> None:
    reference, transformed = build(), checkpointed(build(), mode)
    fp32_plan = autockpt.plan_of(transformed)
    assert_same(step(reference, _under_autocast), step(transformed, _under_autocast))
    # The forward under autocast planned again, for bfloat16 activations (smaller).
    runtime = transformed.__dict__["_autockpt"]
    assert len(runtime.variants) == 2
    bf16_plan = autockpt.plan_of(transformed)
    assert bf16_plan.baseline_peak_bytes < 0.8 * fp32_plan.baseline_peak_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = autockpt.plan(build(), (batch(0),), mode=mode)
    assert planned.baseline_peak_bytes == bf16_plan.baseline_peak_bytes
    # Back in float32 the float32 plan runs again: no third plan.
    step(transformed)
    assert len(runtime.variants) == 2 and autockpt.plan_of(transformed) is fp32_plan


def test_a_plan_made_under_autocast_is_not_reused_in_float32() -> None:
    x = batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        transformed = autockpt.apply(build(), budget_mb=None, example_inputs=(x,))
    bf16_plan = autockpt.plan_of(transformed)
    transformed(x)
    assert autockpt.plan_of(transformed) is not bf16_plan
    assert autockpt.plan_of(transformed).baseline_peak_bytes > bf16_plan.baseline_peak_bytes


def _compiled(backend: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    cache: dict[int, Any] = {}

    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if id(model) not in cache:
            cache[id(model)] = torch.compile(model, backend=backend)
        return cache[id(model)](x)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_aot_eager_compiles_every_segment_and_matches(mode: str) -> None:
    """Dropout and BatchNorm inside checkpointed segments: the compiled backward replays the
    dropout masks and updates the running statistics once."""
    torch._dynamo.reset()
    reference, transformed = build(), checkpointed(build(), mode)
    assert_same(step(reference), step(transformed, _compiled("aot_eager")))
    explained = torch._dynamo.explain(transformed)(batch(0))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_eager_backend_without_dropout_and_batchnorm(mode: str) -> None:
    """backend="eager" runs checkpoint's higher-order op with preserve_rng_state=False and
    recomputes BatchNorm's buffer update, for plain torch.utils.checkpoint as well, so only a
    model without dropout and BatchNorm in its segments trains right there."""
    torch._dynamo.reset()
    reference, transformed = build(p=0.0, bn=False), checkpointed(build(p=0.0, bn=False), mode, None)
    assert_same(step(reference), step(transformed, _compiled("eager")))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_torch_compile_inductor_without_dropout(mode: str) -> None:
    """The default backend (inductor, C++ on CPU) fuses and reorders floating-point ops, so
    gradients are compared with a tolerance; its dropout draws other random numbers than
    eager (for the plain model as well), so the model has none."""
    torch._dynamo.reset()
    reference, transformed = build(p=0.0, bn=False), checkpointed(build(p=0.0, bn=False), mode, None)
    assert_same(step(reference), step(transformed, _compiled("inductor")), exact=False)


def test_data_parallel_around_a_transformed_model() -> None:
    reference = build()
    transformed = checkpointed(build(), "non_reentrant")
    wrapped = nn.DataParallel(transformed)
    assert_same(step(reference), step(transformed, lambda _, x: wrapped(x)))
    assert list(wrapped.state_dict()) == [f"module.{k}" for k in reference.state_dict()]
    with pytest.raises(autockpt.InvalidArgumentError, match="DataParallel wrapper") as info:
        autockpt.apply(nn.DataParallel(build()), example_inputs=(batch(0),))
    assert "DataParallel(autockpt.apply(model, ...))" in str(info.value)


# --------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    directory = tmp_path_factory.mktemp("setups")
    return run_workers(WORKER, 2, directory, timeout_s=400, env={"OMP_NUM_THREADS": "1"})


def _assert_scenario_matches(results: list[dict[str, Any]], name: str) -> None:
    for rank, out in enumerate(results):
        assert "error" not in out[name], f"rank {rank}, {name}: {out[name]['error']}"
        assert_same(out[name]["plain"], out[name]["autockpt"])
    # Each rank trained on its own data, and the all-reduce made the gradients agree (not
    # BatchNorm's running statistics: each rank updates them from its own batch).
    synced = [{k: v for k, v in out[name]["autockpt"].items() if not k.startswith("buf:")}
              for out in results]
    assert_same(synced[0], synced[1])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ddp", ["default", "static_graph", "no_sync"])
def test_ddp_gradients_equal_ddp_without_autockpt(dist_results: list[dict[str, Any]], mode: str,
                                                  ddp: str) -> None:
    _assert_scenario_matches(dist_results, f"ddp/{mode}/{ddp}")


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_find_unused_parameters(dist_results: list[dict[str, Any]]) -> None:
    """Non-reentrant works; reentrant fails in DDP itself (the parameters of a reentrant
    segment get their gradients in a nested backward that DDP's unused-parameter search
    cannot see): use static_graph=True there."""
    _assert_scenario_matches(dist_results, "ddp/non_reentrant/find_unused")
    for out in dist_results:
        assert out["ddp/reentrant/find_unused"]["error"].startswith(
            "RuntimeError: Expected to mark a variable ready only once")


@pytest.mark.distributed
@pytest.mark.slow
def test_apply_on_a_ddp_wrapper_says_to_wrap_the_result(dist_results: list[dict[str, Any]]
                                                       ) -> None:
    for out in dist_results:
        message = out["ddp/apply_on_wrapper"]
        assert message.startswith("InvalidArgumentError: model is a DistributedDataParallel")
        assert "DistributedDataParallel(autockpt.apply(model, ...))" in message


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_fully_shard_on_the_root_matches(dist_results: list[dict[str, Any]], mode: str
                                               ) -> None:
    _assert_scenario_matches(dist_results, f"fsdp2/{mode}/root")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_fully_shard_per_block_with_keep_whole_matches(dist_results: list[dict[str, Any]],
                                                             mode: str) -> None:
    """torchtitan's recipe: apply(..., keep_whole="blocks.*"), then fully_shard(block) for each
    block and fully_shard(model): the segments call the blocks, so FSDP2's hooks gather their
    parameters; three steps equal FSDP2 without autockpt."""
    _assert_scenario_matches(dist_results, f"fsdp2/{mode}/blocks")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_fully_shard_per_block_without_keep_whole_plans_again(
        dist_results: list[dict[str, Any]], mode: str) -> None:
    """Without keep_whole the program runs the ops inside the blocks, whose hooks fully_shard
    adds afterwards; the first forward plans again with the blocks kept whole (on fake
    parameters of their full shapes, NOTE [ Planning a sharded model ] in autockpt/capturing/ladder.py),
    and three steps equal FSDP2 without autockpt."""
    _assert_scenario_matches(dist_results, f"fsdp2/{mode}/blocks_inlined")
    for out in dist_results:
        plan = out[f"fsdp2/{mode}/blocks_inlined"]["plan"]
        assert "re-planned at the first forward: FSDP2's fully_shard" in plan, plan
        assert "kept whole      blocks.0, blocks.1" in plan, plan
