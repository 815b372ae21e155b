"""The profiler's shortcuts give what its probes measure.

NOTE [ Backwards known without a probe ], NOTE [ One forward for the node and its probe ] and
the in-place rule of NOTE [ Probing without copies ] in autockpt/profiling/profile.py skip
work; here each shortcut is turned off and the profile of the same graph must come out the
same, node for node.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from autockpt import profile as profile_module
from autockpt.capturing.ladder import capture
from autockpt.capturing.trace import bind_inputs
from autockpt.profiling.profile import profile
from autockpt.profiling.stats import Profile
from tests.helpers import live_tensors
from tests.zoo import CASES, ZooCase


class Joins(nn.Module):
    """Concatenations and a stack of activations, one fed twice, one fed by the input, a
    mixed-dtype one (cast back in backward: must be probed), and in-place ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(48, 16)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.act(self.a(x))
        h2 = torch.tanh(self.b(h1))
        joined = torch.cat([h1, h2, x], dim=1)
        twice = torch.cat((h2, h2), dim=-1)
        stacked = torch.stack([h1, h2], dim=0).sum(0)
        mixed = torch.cat([h1.double(), h2], dim=1).float()
        out = self.c(joined) + twice[:, :16] + stacked + mixed[:, :16]
        return torch.relu_(out)


def _profile(model: nn.Module, x: torch.Tensor) -> Profile:
    traced = capture(model, (x,), {}, method="fx")
    return profile(traced, {name: x for name in traced.spec.param_names})


@pytest.mark.parametrize("input_grad", [False, True])
def test_shortcuts_match_the_probes(monkeypatch: pytest.MonkeyPatch, input_grad: bool) -> None:
    torch.manual_seed(0)
    model = Joins().train()
    x = torch.randn(8, 16, requires_grad=input_grad)
    shortcut = profile_module._joins_without_copies
    taken: list[tuple[str, bool]] = []

    def counted(env, node):  # type: ignore[no-untyped-def]
        taken.append((node.name, shortcut(env, node)))
        return taken[-1][1]

    monkeypatch.setattr(profile_module, "_joins_without_copies", counted)
    fast = _profile(model, x)
    # The shortcut is taken for the plain joins, not for the one fed twice nor the mixed one.
    assert [name for name, took in taken if took] == ["cat", "stack"]
    targets = [n.target for n in fast.nodes]
    assert targets.count("cat") == 3 and "stack" in targets and "relu_" in targets

    monkeypatch.setattr(profile_module, "_joins_without_copies", lambda env, node: False)
    monkeypatch.setattr(profile_module, "_writes_in_place", lambda interpreter, node: False)
    probed = _profile(model, x)
    assert fast.nodes == probed.nodes
    assert fast.storages == probed.storages


@pytest.mark.parametrize("case", [c for c in CASES if c.traceable], ids=lambda c: c.name)
def test_one_forward_per_node_measures_what_two_did(monkeypatch: pytest.MonkeyPatch,
                                                    case: ZooCase) -> None:
    """NOTE [ One forward for the node and its probe ]: with the node's forward on leaves
    turned off, every node runs its forward twice, as before; the profile is the same."""
    model = case.build().train()
    args, kwargs = case.inputs()
    traced = capture(model, args, kwargs, method="fx")
    inputs = dict(zip(traced.spec.param_names, traced.graph_inputs(
        bind_inputs(model, args, kwargs))))
    taken: list[bool] = []
    on_leaves = profile_module._ProfileRunner._evaluate_on_leaves

    def counted(self, node, node_inputs):  # type: ignore[no-untyped-def]
        ready = on_leaves(self, node, node_inputs)
        taken.append(ready is not None)
        return ready

    monkeypatch.setattr(profile_module._ProfileRunner, "_evaluate_on_leaves", counted)
    fast = profile(traced, inputs)
    assert any(taken)
    monkeypatch.setattr(profile_module._ProfileRunner, "_evaluate_on_leaves",
                        lambda self, node, node_inputs: None)
    twice = profile(traced, inputs)
    assert fast.nodes == twice.nodes
    assert fast.storages == twice.storages
    assert fast.loss == twice.loss


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_a_plan_leaves_no_tensor_alive(mode: str) -> None:
    """NOTE [ Saved tensors held from C++ ] in autockpt/ops/instrument.py: the profile's pack hook
    returned the saved tensor itself, and every ReLU saving its own output kept the whole
    fake forward (its tensors, the runner, the graph) alive for good: 201 fake tensors per
    plan of a ResNet-18, and later plans slowed as the collector walked them."""
    case = next(c for c in CASES if c.name == "resnet")
    model = case.build()
    args, kwargs = case.inputs()
    for _ in range(2):  # torch's and autockpt's own caches are filled once
        autockpt.plan(model, args, example_kwargs=kwargs, mode=mode)
    before = live_tensors()
    for _ in range(3):
        autockpt.plan(model, args, example_kwargs=kwargs, mode=mode)
    assert not live_tensors() - before


def test_planning_pauses_the_collector_and_restores_it() -> None:
    """NOTE [ Planning with the collector paused ] in autockpt/planning/gc.py: paused while the
    profile runs the user's loss, enabled again after the plan, after a failed plan, and
    left disabled for a user who disabled it."""
    seen: list[bool] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return out.pow(2).mean()

    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    assert gc.isenabled()
    autockpt.plan(net, (x,), loss_fn=loss_fn)
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(autockpt.InfeasibleBudgetError):
        autockpt.plan(net, (x,), budget_mb=1e-6)
    assert gc.isenabled()
    gc.disable()
    try:
        autockpt.plan(net, (x,))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_planning_collects_only_what_it_made_and_keeps_a_users_frozen_objects() -> None:
    """The objects that existed before a plan are set aside while it runs (its last scan
    walks only what it made) and handed back after; a process that froze objects itself
    keeps them frozen."""
    from autockpt.planning.gc import paused

    counts: list[int] = []
    with paused():
        counts.append(gc.get_freeze_count())
        cycle: list[Any] = []
        cycle.append(cycle)  # garbage the scan at the end must still find
        probe = weakref.ref(_Node(cycle))
        del cycle
    assert counts[0] > 0 and gc.get_freeze_count() == 0 and gc.isenabled()
    assert probe() is None
    gc.freeze()
    try:
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        autockpt.plan(net, (torch.randn(4, 8),))
        # Still frozen (frozen objects that die leave the count, so it only shrinks a little).
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


class _Node:
    """A weak-referenceable object held by a reference cycle."""

    def __init__(self, cycle: list[Any]) -> None:
        cycle.append(self)


@pytest.mark.parametrize("tied", [False, True])
def test_the_chunked_graph_resumes_the_plain_run(monkeypatch: pytest.MonkeyPatch,
                                                 tied: bool) -> None:
    """NOTE [ A second graph resumes the first ]: the graph with its head in chunks, profiled
    from the plain graph's run where the two start to differ, gives the profile a run of its
    own gives, node for node and storage for storage, and runs only the nodes from there on."""
    from autockpt.planning.head import chunked_head, find_row_stretch
    from autockpt.running.head import chunk_rows
    from tests.test_chunked_head import LM, batch, token_cross_entropy

    torch.manual_seed(0)
    model = autockpt.with_loss(LM(tied), token_cross_entropy)
    args = batch()
    traced = capture(model, args, {})
    inputs = dict(zip(traced.spec.param_names,
                      traced.graph_inputs(bind_inputs(model, args, {}))))
    share = profile_module.ProfileShare()
    profile(traced, inputs, share=share)
    stretch = find_row_stretch(traced.graph_module)
    assert stretch is not None
    run_node = profile_module._ProfileRunner.run_node
    ran: list[str] = []

    def counted(self, node):  # type: ignore[no-untyped-def]
        ran.append(node.name)
        return run_node(self, node)

    monkeypatch.setattr(profile_module._ProfileRunner, "run_node", counted)
    resumed = profile(chunk_rows(traced, chunked_head(stretch)), inputs, share=share)
    share.release()
    assert 0 < len(ran) < len(resumed.nodes) // 2
    fresh = profile(chunk_rows(traced, chunked_head(stretch)), inputs)
    assert resumed.nodes == fresh.nodes
    assert resumed.storages == fresh.storages
    assert resumed.loss == fresh.loss


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "binary_cross_entropy"])
def test_a_reduced_loss_gets_the_buffer_its_real_kernel_keeps(device: str, loss: str
                                                                   ) -> None:
    # The real kernels (CPU and CUDA) return the reduced loss in the element-wise buffer,
    # which the scalar keeps alive through backward. Fake CUDA tensors need no GPU.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autockpt.ops.instrument import widen_reduced_loss

    func = getattr(torch.ops.aten, loss).default
    with FakeTensorMode():
        x = torch.rand(16, 3, 8, 8, device=device)
        target = torch.rand(16, 3, 8, 8, device=device)
        out = func(x, target)
        assert out.untyped_storage().nbytes() == 4  # the fake kernel's own storage
        widen_reduced_loss(func, (x, target), out)
        assert out.untyped_storage().nbytes() == x.numel() * 4
        none = func(x, target, reduction=0)  # "none": the element-wise loss itself
        widen_reduced_loss(func, (x, target, 0), none)
        assert none.untyped_storage().nbytes() == x.numel() * 4
    if device == "cpu":  # what the real kernel does, where this machine can run it
        real = func(torch.rand(16, 3, 8, 8), torch.rand(16, 3, 8, 8))
        assert real.untyped_storage().nbytes() == 16 * 3 * 8 * 8 * 4
