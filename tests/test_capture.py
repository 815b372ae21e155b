"""The capture ladder: models torch.fx cannot trace still train right, through torch.export
or with their untraceable submodules kept whole.

Each model is trained one step with and without autockpt and compared tensor by tensor (loss,
every gradient, every buffer); the measured peak must be within the budget.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from autockpt.capturing.ladder import NoGraph, capture
from autockpt.planning.planner import BUDGET_SLACK
from tests.helpers import (
    MODES,
    assert_same_case_step,
    assert_same_step,
    assert_same_tensors,
    grads_of,
    train_step,
)
from tests.test_modules import BranchyNet
from tests.zoo import ZooCase, clone_case, flatten_output


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if mask is not None:
            h = h * mask
        return x + self.drop(h)


class ShapeBranches(nn.Module):
    """torch.fx cannot branch on a traced size (``x.shape[0] > 1``); torch.export can.

    Also: keyword inputs with ``None`` defaults and a float, a dict-with-tuple output, tied
    embedding and head weights, BatchNorm statistics and dropout.
    """

    def __init__(self, vocab: int = 50, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in most language models

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None, scale: float = 1.0
                ) -> dict[str, object]:
        x = self.embed(input_ids) * scale
        if x.shape[0] > 1:
            x = x + x.flip(0) * 0.5
        mask = None if attention_mask is None else attention_mask.unsqueeze(-1).to(x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        pooled = self.bn(x.mean(1))
        return {"logits": self.head(x), "extra": (pooled, x.shape[-1])}


class _Gate(nn.Module):
    """Data-dependent Python control flow: neither torch.fx nor torch.export can capture it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.relu(self.proj(x))
        return torch.tanh(self.proj(x))


class GatedNet(nn.Module):
    """Regular layers around submodules that only the fx-with-leaves rung can handle."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(),
                          _Gate(width), nn.Dropout(0.1))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().train()


def _loss(output: object) -> torch.Tensor:
    if isinstance(output, dict):
        output = [output["logits"], output["extra"][0]]
    return sum(t.float().pow(2).mean() for t in flatten_output(output))  # type: ignore[return-value]


def _token_inputs() -> tuple[tuple[object, ...], dict[str, object]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 50, (4, 24), generator=g)
    mask = (torch.rand(4, 24, generator=g) > 0.2).long()
    return (ids,), {"attention_mask": mask, "scale": 0.5}


def _vector_inputs(width: int = 64) -> tuple[tuple[object, ...], dict[str, object]]:
    return (torch.randn(32, width, generator=torch.Generator().manual_seed(3)),), {}


CASES = [
    (ZooCase("shape_branches", lambda: _seeded(ShapeBranches), _token_inputs, _loss), "export"),
    (ZooCase("gated", lambda: _seeded(GatedNet), _vector_inputs, _loss), "fx-leaves"),
    # The root's own forward branches on a tensor value: only whole blocks can be checkpointed.
    (ZooCase("branchy", lambda: _seeded(BranchyNet), lambda: _vector_inputs(16), _loss),
     "modules"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fraction", [0.5, "min"])
@pytest.mark.parametrize("case, rung", CASES, ids=[c.name for c, _ in CASES])
def test_untraceable_models_train_like_the_original(case: ZooCase, rung: str, fraction: object,
                                                   mode: str) -> None:
    reference, model = clone_case(case)
    args, kwargs = case.inputs()
    probe = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode)
    assert probe.capture == rung
    assert probe.capture_reason.startswith("fx: torch.fx could not trace")
    budget = probe.min_peak_bytes if fraction == "min" else int(probe.baseline_peak_bytes * 0.5)
    keys = list(model.state_dict())
    params = dict(model.named_parameters(remove_duplicate=False))
    transformed = autockpt.apply(model, budget / 2**20, example_inputs=args,
                                 example_kwargs=kwargs, mode=mode)
    plan = autockpt.plan_of(transformed)
    assert plan.capture == rung and plan.segments, "nothing was checkpointed"
    if rung == "modules":
        assert "fx-leaves: torch.fx fails in the model's own forward" in plan.capture_reason
    assert list(transformed.state_dict()) == keys
    for name, param in transformed.named_parameters(remove_duplicate=False):
        assert param is params[name]
    assert_same_case_step(case, reference, transformed)
    # The budget is defined with measure's default loss (see autockpt.measure): a loss of
    # one's own adds its own gradient of the output, which no plan can remove.
    report = autockpt.measure(transformed, args, example_kwargs=kwargs)
    assert report.peak_activation_bytes <= budget * (1 + BUDGET_SLACK)


def test_exported_model_returns_the_original_output_structure() -> None:
    case = CASES[0][0]
    args, kwargs = case.inputs()
    transformed = autockpt.apply(case.build(), None, example_inputs=args, example_kwargs=kwargs)
    out = transformed(*args, **kwargs)
    assert set(out) == {"logits", "extra"} and out["extra"][1] == 32
    assert isinstance(out["extra"], tuple) and out["logits"].shape == (4, 24, 50)
    transformed.eval()  # eval runs the original forward (an exported module cannot eval)
    with torch.no_grad():
        assert transformed(*args, **kwargs)["logits"].shape == (4, 24, 50)


def test_a_new_input_signature_is_exported_again() -> None:
    case = CASES[0][0]
    args, kwargs = case.inputs()
    transformed = autockpt.apply(case.build(), None)
    transformed(*args, **kwargs)
    first = autockpt.plan_of(transformed)
    transformed(args[0][:2], attention_mask=None)  # other batch size, no mask
    second = autockpt.plan_of(transformed)
    assert first.capture == second.capture == "export"
    assert first.input_signature != second.input_signature


def test_a_named_rung_is_used_alone() -> None:
    case = CASES[0][0]
    args, kwargs = case.inputs()
    with pytest.raises(autockpt.TraceError, match="torch.fx could not trace ShapeBranches"):
        autockpt.plan(case.build(), args, example_kwargs=kwargs, capture="fx")
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert autockpt.plan(net, (torch.randn(2, 8),), capture="export").capture == "export"
    assert autockpt.plan(net, (torch.randn(2, 8),)).capture == "fx"


class _StatefulNet(nn.Module):
    """Everything an exported program lifts: tied parameters, a BatchNorm whose running
    statistics the step writes (in place, in the training dialect), a non-persistent buffer,
    a tensor constant, and a region under no_grad (a higher-order op with a submodule of its
    own)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        h = h * self.scale + torch.tensor([0.5])
        with torch.no_grad():
            shift = h.mean()
        return self.head(h) - shift


def test_the_exported_graph_is_unlifted_as_torch_unlifts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Unlifting the exported graph ]: the same nodes, state, names and steps as
    ``ExportedProgram.module()`` gives."""
    from autockpt import capture as capture_module

    net, ids = _StatefulNet(), torch.randint(0, 10, (4, 6))
    unlift, made = capture_module._unlifted, []
    monkeypatch.setattr(capture_module, "_unlifted", lambda exported: made.append(
        unlift(exported)) or made[-1])
    ours = capture_module.export_trace(net, (ids,), {})
    assert made and made[0] is not None
    monkeypatch.setattr(capture_module, "_unlifted", lambda exported: None)
    torchs = capture_module.export_trace(net, (ids,), {})

    def described(traced: Any) -> Any:
        gm = traced.graph_module
        nodes = [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs),
                  sorted(k for k in n.meta if k != "from_node")) for n in gm.graph.nodes]
        return (nodes, [name for name, _ in gm.named_parameters()],
                [name for name, _ in gm.named_buffers()], list(gm.state_dict()),
                sorted(traced.constants))

    assert described(ours) == described(torchs)
    outputs = []
    for traced in (ours, torchs):
        twin = copy.deepcopy(net)
        gm = copy.deepcopy(traced.graph_module)
        gm.load_state_dict(twin.state_dict(), strict=False)
        out = traced.unflatten(gm(*traced.flatten({"ids": ids})))
        outputs.append({"out": out, "running_mean": gm.norm.running_mean.clone(),
                        "steps": gm.norm.num_batches_tracked.clone()})
    assert_same_tensors(outputs[0], outputs[1], exact=True)
    assert not torch.equal(outputs[0]["running_mean"], net.norm.running_mean)
    assert outputs[0]["steps"].item() == 1


def test_export_leaves_torchs_stack_trace_switch_as_it_found_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        pytest.skip("this torch has no torch.fx.config.do_not_emit_stack_traces")
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)
    case = CASES[0][0]
    args, kwargs = case.inputs()
    transformed = autockpt.apply(case.build(), None, example_inputs=args, example_kwargs=kwargs)
    assert autockpt.plan_of(transformed).capture == "export"
    assert_same_case_step(case, case.build(), transformed)
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_stack_traces_are_switched_off_only_where_torch_has_the_switch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11 (the CUDA build a lent GPU had) has no do_not_emit_stack_traces, and export
    # failed on reading it. torch's own export reads the switch in newer releases, so its
    # absence is shown to the helper alone, on a stand-in config.
    from types import SimpleNamespace

    from autockpt.capturing.ladder import _no_stack_traces

    old = SimpleNamespace()
    monkeypatch.setattr(torch.fx, "config", old)
    with _no_stack_traces():
        assert not hasattr(old, "do_not_emit_stack_traces")
    new = SimpleNamespace(do_not_emit_stack_traces=False)
    monkeypatch.setattr(torch.fx, "config", new)
    with pytest.raises(RuntimeError), _no_stack_traces():
        assert new.do_not_emit_stack_traces is True
        raise RuntimeError("export failed")
    assert new.do_not_emit_stack_traces is False


def test_fx_leaves_keeps_only_the_untraceable_submodules_whole() -> None:
    case = CASES[1][0]
    args, kwargs = case.inputs()
    plan = autockpt.plan(case.build(), args, capture="fx-leaves")
    assert "export: torch.export could not export" not in plan.capture_reason  # named: alone
    text = str(plan)
    assert "captured by     torch.fx, untraceable submodules kept whole" in text


def test_unknown_capture_lists_the_valid_ones() -> None:
    with pytest.raises(autockpt.InvalidArgumentError, match="unknown capture 'jit'") as info:
        autockpt.apply(nn.Linear(2, 2), capture="jit")
    for name in ("'auto'", "'fx'", "'export'", "'fx-leaves'", "'modules'"):
        assert name in str(info.value)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    layers: int


class DataclassOut(nn.Module):
    """Returns a dataclass holding tensors, a tuple of tensors and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, flag: bool = True, extra: object = None) -> _Out:
        hidden = []
        for layer in self.layers:
            x = x + torch.relu(layer(x))
            hidden.append(x)
        return _Out(self.head(x), tuple(hidden[-2:]), len(hidden))


@pytest.mark.parametrize("mode", MODES)
def test_dataclass_outputs_and_non_tensor_arguments(mode: str) -> None:
    torch.manual_seed(0)
    model = DataclassOut()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    kwargs = {"flag": True, "extra": None}
    transformed = autockpt.apply(model, None, example_inputs=(x,), example_kwargs=kwargs,
                                 mode=mode)
    assert autockpt.plan_of(transformed).segments
    outs = [m(x, **kwargs) for m in (transformed, reference)]
    for out in outs:
        (out.logits.pow(2).mean() + out.hidden[0].mean()).backward()
    assert isinstance(outs[0], _Out) and outs[0].layers == 6
    assert_same_tensors(grads_of(model), grads_of(reference), allow_none=True)


class _LayerDrop(nn.Module):
    """Skips its second layer at random in training, as LayerDrop does (M2M100, NLLB)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 0 or not (self.training and torch.rand([]) < 0.05):
                x = layer(x)
        return x


def test_a_failed_export_prints_no_partial_graph(capsys: pytest.CaptureFixture[str]) -> None:
    """torch.export prints the partial graph of a data-dependent failure to stderr; the
    modules rung then plans the model anyway, so the user saw a screen of generated code for
    nothing. The error's own message says why export failed."""
    from autockpt.capturing.ladder import export_trace
    from autockpt.errors import TraceError

    with pytest.raises(TraceError, match="torch.export could not export _LayerDrop"):
        export_trace(_LayerDrop(), (torch.randn(4, 8),), {})
    assert "def forward" not in capsys.readouterr().err


class _TanhGelu(torch.autograd.Function):
    """BLOOM's GeLUFunction: saves its input only, and recomputes the rest in backward."""

    backward_calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _TanhGelu.backward_calls += 1
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x))
                       + 0.5 * (1 + t))


class _GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_TanhGelu.apply(self.up(x)))


@pytest.mark.parametrize("rung", ["fx", "export"])
@pytest.mark.parametrize("mode", MODES)
def test_a_custom_autograd_function_stays_whole(mode: str, rung: str) -> None:
    """NOTE [ Custom autograd Functions stay whole ] in autockpt/capturing/trace.py: traced into, the
    Function's eight elementwise ops each saved a tensor for autograd's backward, and the
    plan put the graph's baseline at 2.5x the model's measured peak. Kept as
    one call, by torch.fx and by torch.export, the graph's baseline is the model's, and
    training runs the Function's own backward, with the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_GeluMLP() for _ in range(4)])
    x = torch.randn(256, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, torch.arange(256) % 16)

    own = autockpt.measure(model, (x,), loss_fn=loss_fn).peak_activation_bytes
    plan = autockpt.plan(model, (x,), loss_fn=loss_fn, mode=mode, capture=rung)
    assert abs(plan.baseline_peak_bytes - own) <= 0.01 * own, (plan.baseline_peak_bytes, own)
    assert not any("_TanhGelu" in note for note in plan.notes), plan.notes
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, None, example_inputs=(x,), loss_fn=loss_fn,
                                     mode=mode, capture=rung)
    least = autockpt.plan_of(transformed)
    assert least.segments
    measured = autockpt.measure(transformed, (x,), loss_fn=loss_fn).peak_activation_bytes
    assert measured <= least.estimated_peak_bytes * 1.005, (measured, least.estimated_peak_bytes)
    reference = copy.deepcopy(model)
    calls = _TanhGelu.backward_calls
    expected = train_step(reference, loss_fn, (x,), {}, seed=3)
    assert_same_step(train_step(transformed, loss_fn, (x,), {}, seed=3), expected)
    assert _TanhGelu.backward_calls >= calls + 8  # its own backward, in both


class _ScaledTanhGelu(torch.autograd.Function):
    """A Function with a Python number among its arguments."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return _TanhGelu.apply(x) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _ScaledGeluMLP(_GeluMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_ScaledTanhGelu.apply(self.up(x), 2.0))


def test_the_plan_says_when_export_traced_into_a_custom_function() -> None:
    """torch.export keeps a Function applied to tensors only whole; one with a Python value
    among its arguments is traced into, and the plan says so, and what keeps it whole."""
    torch.manual_seed(0)
    model = nn.Sequential(_ScaledGeluMLP(), _ScaledGeluMLP())
    exported = autockpt.plan(model, (torch.randn(8, 16),), capture="export")
    assert any("_ScaledTanhGelu" in note and "capture='fx'" in note
               for note in exported.notes), exported.notes
    assert "_ScaledTanhGelu" in str(exported)
    whole = autockpt.plan(nn.Sequential(_GeluMLP()), (torch.randn(8, 16),), capture="export")
    assert not any("Function" in note for note in whole.notes), whole.notes


def test_tracing_leaves_autograd_function_apply_as_it_was() -> None:
    """Tracing patches ``torch.autograd.Function.apply`` (NOTE [ Custom autograd Functions
    stay whole ]); after a trace, a failed trace and an export it is torch's own again, and
    a Function applied outside tracing runs as usual."""
    import inspect

    from autockpt.errors import TraceError

    before = inspect.getattr_static(torch.autograd.Function, "apply")
    torch.manual_seed(0)
    autockpt.plan(nn.Sequential(_GeluMLP()), (torch.randn(4, 16),), capture="fx")
    autockpt.plan(nn.Sequential(_GeluMLP()), (torch.randn(4, 16),), capture="export")
    with pytest.raises(TraceError):
        autockpt.capturing.ladder.trace(BranchyNet(), (torch.randn(4, 16),))
    assert inspect.getattr_static(torch.autograd.Function, "apply") is before
    x = torch.randn(3, requires_grad=True)
    _TanhGelu.apply(x).sum().backward()
    assert x.grad is not None


class _DrawsInForward(nn.Module):
    """A random scalar with no traced argument decides a branch (Hugging Face's LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if torch.rand([]) < 0.5:
                continue
            x = layer(x)
        return x


def test_a_random_draw_with_no_traced_argument_is_not_kept_in_an_fx_graph() -> None:
    """NOTE [ A random draw while tracing ] in autockpt/capturing/draws.py: torch.fx traced the
    branches of one draw into the graph, which then skipped the same layers in every step.
    Refused, and the random stream left as it was by every rung tried."""
    model = _DrawsInForward()
    x = torch.randn(4, 8)
    with pytest.raises(autockpt.TraceError, match="aten.rand.default drew random values at "
                                                  "trace time"):
        capture(model, (x,), {}, "fx")
    torch.manual_seed(3)
    traced = capture(model, (x,), {})
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
    assert isinstance(traced, NoGraph)


class _DrawsInPython(nn.Module):
    """LayerDrop decided with numpy's global generator (Wav2Vec2's adapter) or Python's."""

    def __init__(self, draw: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        for layer in self.layers:
            value = np.random.random() if self.draw == "numpy" else random.random()
            if value < 0.5:
                continue
            x = layer(x)
        return x


@pytest.mark.parametrize("draw", ["numpy", "python"])
def test_a_draw_with_pythons_random_numbers_is_not_kept_in_a_graph(draw: str) -> None:
    """NOTE [ Python's random numbers while tracing ] in autockpt/capturing/ladder.py: fx and export
    ran the draw once and kept its branches; both are refused, the modules rung is left,
    and the generators are where they were."""
    import random

    import numpy as np

    model = _DrawsInPython(draw)
    x = torch.randn(4, 8)
    name = "numpy.random" if draw == "numpy" else "random"
    for rung in ("fx", "export"):
        with pytest.raises(autockpt.TraceError, match=f"drew random numbers with {name} "
                                                      "while it was traced"):
            capture(model, (x,), {}, rung)
    np.random.seed(3)
    random.seed(3)
    assert isinstance(capture(model, (x,), {}), NoGraph)
    after = (np.random.random(), random.random())
    np.random.seed(3)
    random.seed(3)
    assert after == (np.random.random(), random.random())
