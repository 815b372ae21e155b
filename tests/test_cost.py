"""``cost="profile"``: nodes timed on the real device, and plans that use those times."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import autockpt
from autockpt.capturing.ladder import capture
from autockpt.capturing.trace import trace
from autockpt.planning.chain import build_chain
from autockpt.profiling.profile import profile
from autockpt.profiling.timing import time_nodes
from tests.helpers import assert_same_tensors, buffers_of, grads_of


def _net() -> nn.Module:
    """Linear, BatchNorm (buffers a run would move), Dropout (RNG a run would advance), and an
    in-place ReLU (which a run on the caller's tensor would change)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True), nn.Dropout(0.2)]
    return nn.Sequential(*layers)


class _InPlaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # writes the caller's tensor: timing must run on a clone
        return self.lin(x)


@pytest.mark.parametrize("fn", ["plan", "apply"])
def test_unknown_cost_is_refused_with_the_valid_names(fn: str) -> None:
    net, x = _net(), torch.randn(4, 32)
    with pytest.raises(autockpt.InvalidArgumentError) as info:
        if fn == "plan":
            autockpt.plan(net, (x,), cost="time")
        else:
            autockpt.apply(net, example_inputs=(x,), cost="time")
    message = str(info.value)
    assert "cost 'time'" in message and "'flops'" in message and "'profile'" in message


@pytest.mark.parametrize("method", ["fx", "export"])
def test_time_nodes_times_compute_nodes_in_graph_order(method: str) -> None:
    net, x = _net(), torch.randn(16, 32)
    net.eval()  # the run is in train mode; the caller's flags come back
    traced = capture(net, (x,), {}, method)
    assert not isinstance(traced, autockpt.capturing.ladder.NoGraph)
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs({"input": x})))
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    versions = {k: v._version for k, v in net.named_buffers()}
    x_before = x.clone()
    rng = torch.get_rng_state()

    times = time_nodes(traced, inputs, repeat=2)

    nodes = list(traced.graph.nodes)
    assert len(times) == len(nodes) and all(isinstance(t, int) for t in times)
    for node, t in zip(nodes, times):
        if node.op in ("placeholder", "get_attr", "output"):
            assert t == 0, node
        else:
            assert t > 0, node
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, x_before)
    for name, value in net.named_buffers():
        assert torch.equal(value, buffers[name]), name
        assert value._version == versions[name], name
    assert not any(m.training for m in net.modules())


def test_time_nodes_runs_on_a_clone_of_the_inputs() -> None:
    net, x = _InPlaceOnInput(), torch.ones(2, 8)
    traced = trace(net, (x.clone(),))
    time_nodes(traced, {"x": x}, repeat=1)
    assert torch.equal(x, torch.ones(2, 8))


def test_time_nodes_refuses_a_bad_repeat() -> None:
    net, x = _net(), torch.randn(4, 32)
    with pytest.raises(autockpt.InvalidArgumentError, match="repeat"):
        time_nodes(trace(net, (x,)), {"input": x}, repeat=0)


def test_stage_cost_is_the_time_of_its_nodes_when_timed() -> None:
    net, x = _net(), torch.randn(4, 32)
    prof = profile(trace(net, (x,)), {"input": x})
    timed = replace(prof, nodes=tuple(replace(n, time_ns=1000 + n.index) for n in prof.nodes))
    for stage in build_chain(timed).stages:
        assert stage.cost == sum(1000 + i for i in range(stage.start, stage.end))
    # Untimed, the cost is FLOPs plus bytes written, as before.
    for stage in build_chain(prof).stages:
        members = prof.nodes[stage.start:stage.end]
        assert stage.cost == sum(n.flops + n.output_bytes for n in members)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_profile_cost_trains_like_the_original(mode: str) -> None:
    net, x = _net(), torch.randn(16, 32)
    twin = copy.deepcopy(net)
    ckpt = autockpt.apply(net, example_inputs=(x,), mode=mode, cost="profile")
    plan = autockpt.plan_of(ckpt)
    assert plan.cost_model == "profile"
    assert plan.segments, "the test needs checkpointed segments"
    assert "cost model      profile" in str(plan)
    # Same seed for both: dropout draws the same masks if planning advanced no RNG.
    torch.manual_seed(1)
    ckpt(x).square().sum().backward()
    torch.manual_seed(1)
    twin(x).square().sum().backward()
    assert_same_tensors(grads_of(net), grads_of(twin))
    assert_same_tensors(buffers_of(net), buffers_of(twin))


def test_flops_plans_print_no_cost_line_and_modules_rung_notes_it() -> None:
    net, x = _net(), torch.randn(4, 32)
    plan = autockpt.plan(net, (x,))
    assert plan.cost_model == "flops" and "cost model" not in str(plan)
    blocks = autockpt.plan(net, (x,), capture="modules", cost="profile")
    assert blocks.cost_model == "flops"
    assert any("planned by FLOPs" in note for note in blocks.notes)
