"""Tests of autockpt.measure: activation memory of real training steps, checked against
sizes computed by hand from the shapes."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

# The package exports the function autockpt.measure, which shadows the module of that name.
measure_module = importlib.import_module("autockpt.running.measure")
units_module = importlib.import_module("autockpt.units")
from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.profiling.loss import default_loss
from autockpt.running.measure import MemoryReport, measure, track_activation_memory
from autockpt.units import format_bytes

BATCH = 16
WIDTH = 1000
FLOAT = 4
# One (BATCH, WIDTH) float32 activation: a Linear output or a ReLU output.
ACT = BATCH * WIDTH * FLOAT
# The weight and bias gradients backward computes, mm(grad.t(), input) and sum(grad, 0),
# become the parameters' .grad (measure() starts from .grad = None, as after zero_grad()):
# they are parameter gradients, not activations, at any moment, and are never counted.
# The default loss: a 0-dim float32 sum, and the ones_like seed backward starts from.
SCALAR = 4


def linear_chain(depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


class SequentialCheckpointed(nn.Module):
    """``checkpoint_sequential`` over a chain, in 4 segments; the last one runs normally."""

    def __init__(self, chain: nn.Sequential, *, use_reentrant: bool) -> None:
        super().__init__()
        self.chain = chain
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.chain, 4, x, use_reentrant=self.use_reentrant)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chains() -> dict[int, nn.Sequential]:
    torch.manual_seed(0)
    return {depth: linear_chain(depth) for depth in (8, 16, 32)}


@pytest.fixture(scope="module")
def plain_reports(chains: dict[int, nn.Sequential]) -> dict[int, MemoryReport]:
    return {depth: measure(chain, torch.randn(BATCH, WIDTH)) for depth, chain in chains.items()}


# --------------------------------------------------------------------------------------
# The linear chain, against sizes computed from the shapes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [8, 16, 32])
def test_linear_chain_matches_analytic_sizes(
    depth: int, plain_reports: dict[int, MemoryReport]
) -> None:
    report = plain_reports[depth]
    # Saved for backward: each ReLU output (saved by relu, which keeps its result, and by
    # the next addmm as its input); the last one is also the model output. The Linear
    # outputs are not saved (relu does not keep its input) and die right after the ReLU.
    # The first addmm saves the input, which is not an activation. Plus the 4-byte loss.
    assert report.saved_bytes == depth * ACT + SCALAR
    # Forward peaks at the last layer, when its Linear output and its ReLU output are
    # both alive on top of the depth - 1 earlier ReLU outputs.
    assert report.forward_peak_bytes == (depth + 1) * ACT
    # Backward peaks in the last layer's addmm backward: everything saved, the loss and
    # its seed gradient, the gradient of the last Linear output (threshold_backward), and
    # the gradient of addmm's input; its weight and bias gradients become .grad.
    expected_backward = (depth + 2) * ACT + 2 * SCALAR
    assert report.backward_peak_bytes == expected_backward
    assert report.peak_activation_bytes == expected_backward
    assert report.device == "cpu"
    assert report.cuda_max_memory_allocated_bytes is None
    assert report.step_seconds > 0


def test_linear_chain_grows_linearly_with_depth(plain_reports: dict[int, MemoryReport]) -> None:
    # Each extra Linear+ReLU layer keeps exactly one more activation for backward.
    r8, r16, r32 = plain_reports[8], plain_reports[16], plain_reports[32]
    assert r16.saved_bytes - r8.saved_bytes == 8 * ACT
    assert r32.saved_bytes - r16.saved_bytes == 16 * ACT
    assert r16.peak_activation_bytes - r8.peak_activation_bytes == 8 * ACT
    assert r32.peak_activation_bytes - r16.peak_activation_bytes == 16 * ACT


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("depth", [8, 16, 32])
def test_checkpoint_sequential_lowers_the_peak(
    depth: int,
    use_reentrant: bool,
    chains: dict[int, nn.Sequential],
    plain_reports: dict[int, MemoryReport],
) -> None:
    # The reentrant variant only differentiates the checkpointed segments' parameters when
    # an input requires grad, so give it one: without, their weights would get no
    # gradients and the memory would look lower than training really needs.
    x = torch.randn(BATCH, WIDTH, requires_grad=use_reentrant)
    report = measure(SequentialCheckpointed(chains[depth], use_reentrant=use_reentrant), x)
    plain = plain_reports[depth]

    # Kept for backward: the outputs of the three checkpointed segments (each the input of
    # the next segment) and the ReLU outputs of the last segment, which is not
    # checkpointed and holds depth / 4 layers; the segment boundary feeding it is counted
    # once.
    assert report.saved_bytes == (depth // 4 + 3) * ACT + SCALAR
    assert report.forward_peak_bytes == (depth // 4 + 4) * ACT

    # The peak is still at the top of backward, in the un-checkpointed last segment,
    # with the same constant weight-gradient temporary as the plain chain.
    expected_peak = (depth // 4 + 5) * ACT + 2 * SCALAR
    if use_reentrant:
        # The reentrant backward keeps the gradient of a segment's output alive in its
        # Python frame while the nested backward through the recomputed segment runs.
        assert expected_peak <= report.peak_activation_bytes <= expected_peak + ACT
    else:
        assert report.peak_activation_bytes == expected_peak
    assert report.peak_activation_bytes < plain.peak_activation_bytes
    saved_by_checkpointing = plain.peak_activation_bytes - report.peak_activation_bytes
    assert (3 * depth // 4 - 4) * ACT <= saved_by_checkpointing <= (3 * depth // 4 - 3) * ACT


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recomputation_in_backward_is_counted(use_reentrant: bool) -> None:
    # Four checkpointed layers that end in a 16x1 output: forward keeps almost nothing,
    # so every activation seen in backward comes from the recomputation.
    torch.manual_seed(0)
    body = linear_chain(4)
    head = nn.Linear(WIDTH, 1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = body, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = checkpoint(self.body, x, use_reentrant=use_reentrant)
            return self.head(hidden)

    x = torch.randn(BATCH, WIDTH, requires_grad=use_reentrant)
    report = measure(Model(), x)
    # The checkpoint output (saved by the head's addmm), the head output and the loss.
    assert report.saved_bytes == ACT + BATCH * FLOAT + SCALAR
    # Backward re-runs the body: its four ReLU outputs are alive again, at least for the
    # time the gradient reaches them; the Linear weight gradients come on top.
    assert report.backward_peak_bytes - report.saved_bytes >= 4 * ACT
    recompute = [p for p in report.timeline if p.phase == 2]
    assert len(recompute) > 0


# --------------------------------------------------------------------------------------
# What is not an activation
# --------------------------------------------------------------------------------------


class HugeParameterTinyActivations(nn.Module):
    """Large parameter, buffer, input and existing .grad; every activation is a scalar.

    The gradient of ``huge.sum()`` is a broadcast view of a scalar, which AccumulateGrad
    adds into the pre-allocated .grad in place, so no parameter-sized temporary exists
    even in backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.huge = nn.Parameter(torch.randn(2_000_000))  # 7.6 MiB
        self.register_buffer("big_buffer", torch.randn(1_000_000))  # 3.8 MiB
        self.small = nn.Parameter(torch.randn(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.huge.sum() * self.small + x.sum() + self.big_buffer[:4].sum()


def test_parameters_grads_buffers_and_inputs_are_not_counted() -> None:
    model = HugeParameterTinyActivations()
    model.huge.grad = torch.ones_like(model.huge)  # a large existing gradient
    x = torch.randn(1_000_000, requires_grad=True)  # a large input that gets a gradient
    report = measure(model, x)
    # Only 0-dim float32 tensors: sums, products and their gradients.
    assert 0 < report.peak_activation_bytes <= 16 * SCALAR
    assert report.saved_bytes <= 8 * SCALAR


class _NoGradBack(torch.autograd.Function):
    """The identity, whose backward hands its input no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


def test_a_parameter_no_gradient_reaches_is_measured_without_error() -> None:
    """Autograd still calls a parameter's post-accumulate hook when an op's backward hands it
    ``None``: measure's hook met a ``.grad`` of None there and raised."""

    class Stopped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(_NoGradBack.apply(self.first(x)))

    model = Stopped()
    report = measure(model, (torch.randn(4, 8),))
    assert report.peak_activation_bytes > 0
    assert all(p.grad is None for p in model.parameters())


def test_views_of_plain_tensor_attributes_are_not_counted() -> None:
    class WithTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            # Not a parameter nor a buffer, as rotary-embedding caches often are.
            self.table = torch.randn(4096, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.table[: x.shape[0]]

    report = measure(WithTable(), torch.randn(BATCH, WIDTH))
    # The sum is the only saved activation (add saves nothing; addmm saves the input);
    # the 15.6 MiB table is not counted although a slice of it enters the add.
    assert report.saved_bytes == ACT + SCALAR
    assert report.forward_peak_bytes == 2 * ACT


def test_default_loss_does_not_copy_half_precision_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16)
    x = torch.randn(BATCH, WIDTH, dtype=torch.bfloat16)
    output_bytes = BATCH * WIDTH * 2
    default = measure(model, x)
    assert default.forward_peak_bytes == output_bytes + SCALAR
    # The obvious o.float().sum() materialises a float32 copy of the output.
    copying = measure(model, x, loss_fn=lambda out: out.float().sum())
    assert copying.forward_peak_bytes == default.forward_peak_bytes + 2 * output_bytes


def test_default_loss_walks_nested_outputs() -> None:
    @dataclasses.dataclass
    class Extra:
        logits: torch.Tensor
        count: int

    class ModelOutput(OrderedDict):  # the shape of transformers' ModelOutput
        pass

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Any:
            out = ModelOutput()
            out["first"] = self.a(x)
            out["pair"] = (self.b(x), x.argmax(dim=-1))  # an integer tensor is skipped
            out["extra"] = Extra(self.c(x), 3)
            return out

    model = Nested()
    x = torch.randn(2, 8)
    output = model(x)
    loss = default_loss(output)
    assert loss is not None
    expected = output["first"].sum() + output["pair"][0].sum() + output["extra"].logits.sum()
    assert torch.allclose(loss, expected)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)  # every branch was reached

    report = measure(model, x)
    # Kept: the three 2x8 outputs (the integer argmax needs no gradient but is alive as
    # part of the output) and the loss terms; exact sizes are covered elsewhere.
    assert report.saved_bytes >= 3 * 2 * 8 * FLOAT


# --------------------------------------------------------------------------------------
# The model is left as it was
# --------------------------------------------------------------------------------------


class BatchNormDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x)))


def test_model_state_is_left_untouched() -> None:
    torch.manual_seed(0)
    model = BatchNormDropout().train()
    model.lin.weight.grad = torch.full_like(model.lin.weight, 7.0)
    weight_grad = model.lin.weight.grad
    buffers_before = {name: (b, b.clone()) for name, b in model.named_buffers()}
    x = torch.randn(8, 32, requires_grad=True)
    rng_before = torch.get_rng_state()

    report = measure(model, x, warmup=1, repeat=2)

    assert report.peak_activation_bytes > 0
    assert model.training and model.bn.training
    # Existing grads: the same tensor with the same values; None stays None.
    assert model.lin.weight.grad is weight_grad
    assert torch.equal(weight_grad, torch.full_like(weight_grad, 7.0))
    assert model.lin.bias.grad is None
    assert model.bn.weight.grad is None and model.bn.bias.grad is None
    assert x.grad is None
    # Buffers: the same tensors with the pre-call values, although four steps ran.
    for name, buffer in model.named_buffers():
        original, values = buffers_before[name]
        assert buffer is original
        assert torch.equal(buffer, values), name
    assert int(model.bn.num_batches_tracked) == 0
    # The dropout stream continues as if measure had not run.
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_model_state_is_restored_when_forward_raises() -> None:
    class FailsAfterBatchNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.bn(x)
            torch.rand(3)
            raise KeyError("boom")

    model = FailsAfterBatchNorm()
    x = torch.randn(8, 4)
    rng_before = torch.get_rng_state()
    with pytest.raises(InvalidArgumentError) as info:
        measure(model, x)
    assert isinstance(info.value.__cause__, KeyError)
    assert "FailsAfterBatchNorm.forward raised KeyError" in str(info.value)
    assert info.value.fix is not None
    assert int(model.bn.num_batches_tracked) == 0
    assert torch.equal(model.bn.running_mean, torch.zeros(4))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model.bn.weight.grad is None


def test_non_leaf_inputs_do_not_leak_gradients_outside_the_model() -> None:
    outside = torch.randn(4, 8, requires_grad=True)
    x = outside * 2  # a non-leaf input, part of the caller's graph
    measure(nn.Linear(8, 8), x)
    assert outside.grad is None


# --------------------------------------------------------------------------------------
# The tracker and its timeline
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# The step users run: input forms, the model's own loss, accumulation, the optimizer
# --------------------------------------------------------------------------------------


def test_inputs_take_the_same_forms_as_apply() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    expected = measure(model, (x,)).saved_bytes
    assert measure(model, [x]).saved_bytes == expected
    assert measure(model, {"input": x}).saved_bytes == expected


class OwnLoss(nn.Module):
    """Returns its loss beside its logits, as a Hugging Face model given ``labels=``; only its
    loss with ``logits=False``."""

    def __init__(self, classes: int, logits: bool = True) -> None:
        super().__init__()
        self.head = nn.Linear(16, classes)
        self.logits = logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits} if self.logits else {"loss": loss}


def test_the_models_own_loss_is_the_default_and_its_logits_are_held() -> None:
    torch.manual_seed(0)
    model = OwnLoss(classes=1000)
    batch = {"x": torch.randn(8, 16), "labels": torch.randint(0, 1000, (8,))}
    default = measure(model, batch)
    # ``outputs = model(**batch); outputs["loss"].backward()``: the loop users run.
    held = measure(model, batch, loss_fn=lambda out: out["loss"])
    only_loss = OwnLoss(classes=1000, logits=False)
    only_loss.load_state_dict(model.state_dict())
    without = measure(only_loss, batch)
    assert default_loss(model(**batch)) is not None
    assert default.saved_bytes == held.saved_bytes
    assert default.peak_activation_bytes == held.peak_activation_bytes
    # The logits are alive through backward: cross-entropy saves its log-softmax, not them.
    assert default.saved_bytes - without.saved_bytes == 8 * 1000 * FLOAT


def test_grad_accumulation_counts_the_weight_gradient_temporaries() -> None:
    model = nn.Linear(1000, 1000)
    x = torch.randn(4, 1000)
    model.weight.grad = mine = torch.ones_like(model.weight)
    fresh = measure(model, x)
    accumulating = measure(model, x, grad_accumulation=True)
    weight_bytes = 1000 * 1000 * FLOAT
    # Fresh: the weight gradient becomes .grad and is not an activation. Accumulating: it is
    # computed into a temporary that is added into the existing .grad.
    assert fresh.peak_activation_bytes < weight_bytes // 100
    assert weight_bytes <= accumulating.peak_activation_bytes <= weight_bytes + 4 * fresh.peak_activation_bytes
    assert model.weight.grad is mine and bool((mine == 1).all())
    assert model.bias.grad is None


def test_optimizer_step_is_in_the_whole_step_and_everything_is_restored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))
    x = torch.randn(16, 1000)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    before = [p.detach().clone() for p in model.parameters()]
    plain = measure(model, x)
    report = measure(model, x, optimizer=optimizer, repeat=2)

    assert plain.peak_total_bytes is None
    assert "whole step" in str(report)
    param_bytes = sum(p.numel() * FLOAT for p in model.parameters())
    input_bytes = x.numel() * FLOAT
    # Parameters, their gradients and AdamW's two moments exist at once during step(), plus
    # the inputs; the per-tensor AdamW makes a few copies of one parameter on top.
    least = 4 * param_bytes + input_bytes
    largest = 1000 * 1000 * FLOAT
    assert least < report.peak_total_bytes <= least + 3 * largest + report.peak_activation_bytes
    # The activation figures do not change with the optimizer.
    assert report.peak_activation_bytes == plain.peak_activation_bytes
    for param, old in zip(model.parameters(), before):
        assert torch.equal(param, old)
        assert param.grad is None
    assert not optimizer.state


def test_optimizer_state_that_exists_is_counted_as_it_is() -> None:
    model = nn.Linear(1000, 1000)
    x = torch.randn(4, 1000)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    first = measure(model, x, optimizer=optimizer).peak_total_bytes
    model(x).sum().backward()
    optimizer.step()
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    weight = model.weight.detach().clone()
    model.zero_grad()
    later = measure(model, x, optimizer=optimizer).peak_total_bytes
    assert first is not None and later is not None
    # Made inside the first step, already there before a later one: the same bytes.
    assert abs(later - first) < 1000 * FLOAT
    assert all(torch.equal(v, optimizer.state[model.weight][k]) for k, v in state.items())
    assert torch.equal(model.weight, weight)


def test_timeline_and_marks(plain_reports: dict[int, MemoryReport]) -> None:
    report = plain_reports[8]
    assert [m.label for m in report.marks] == ["forward", "loss", "backward", "end"]
    assert report.marks[2].current_bytes == report.saved_bytes
    ops = report.timeline
    assert [p.op_index for p in ops] == list(range(len(ops)))
    # Every op belongs to a phase, in order; forward, loss and backward all ran ops.
    phases = [p.phase for p in ops]
    assert phases == sorted(phases)
    assert {0, 1, 2} <= set(phases)
    # The total only rises when an op allocates, so the timeline reaches the peak.
    assert max(p.current_bytes for p in ops) == report.peak_activation_bytes
    assert max(p.current_bytes for p in ops if p.phase == 0) == report.forward_peak_bytes


def test_tracker_counts_allocations_and_frees() -> None:
    weight = torch.randn(100, 100, requires_grad=True)
    # A present .grad makes AccumulateGrad add in place; with None it would adopt the
    # gradient temporary, which would then stay counted.
    weight.grad = torch.zeros_like(weight)
    x = torch.randn(8, 100)
    with track_activation_memory(exclude=[weight, weight.grad, x]) as tracker:
        tracker.mark("forward")
        y = (x @ weight).relu()  # the mm result is freed after relu
        mark = tracker.mark("backward")
        y.sum().backward()
        del y
        tracker.mark("end")
    # mm, relu and the detach autograd makes of relu's saved result; y is alive.
    assert mark == ("backward", 8 * 100 * 4, 3)
    assert tracker.marks[0].current_bytes == 0
    assert tracker.current_bytes == 0  # everything the step made is gone
    # y, the sum and its seed gradient, the gradient of the mm result, the weight gradient.
    assert tracker.peak_bytes == 2 * 8 * 100 * 4 + 2 * SCALAR + 100 * 100 * 4
    assert tracker.phase_peaks == [2 * 8 * 100 * 4, tracker.peak_bytes, 0]
    assert len(tracker.timeline) == tracker.num_ops

    # Frozen after exit: storages freed later do not change the readings.
    with track_activation_memory() as frozen:
        kept = torch.ones(256)
    del kept
    assert frozen.current_bytes == 1024 and frozen.peak_bytes == 1024


def test_tracker_ignores_excluded_views_and_in_place_updates() -> None:
    weight = torch.randn(64, 64)
    with track_activation_memory(exclude=[weight]) as tracker:
        weight.t()  # a view of an excluded storage
        weight.add_(1)  # an in-place update of it
        weight.view(-1)[:10].mul_(2)
        torch.empty(0)  # zero-size storages are ignored
    assert tracker.peak_bytes == 0


def test_tracker_counts_tensors_built_from_python_data() -> None:
    with track_activation_memory() as tracker:
        t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert tracker.current_bytes == 16
    del t


def test_tracker_is_single_use_and_checks_exclude() -> None:
    tracker = track_activation_memory()
    with tracker:
        pass
    with pytest.raises(AutockptError):
        with tracker:
            pass
    with pytest.raises(InvalidArgumentError):
        track_activation_memory(exclude=[1, 2])
    with pytest.raises(InvalidArgumentError):
        track_activation_memory(exclude=3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------


def test_str_is_a_short_summary_in_binary_units(plain_reports: dict[int, MemoryReport]) -> None:
    text = str(plain_reports[32])
    assert "MiB" in text
    assert format_bytes(plain_reports[32].peak_activation_bytes) in text
    assert format_bytes(plain_reports[32].saved_bytes) in text
    assert "cpu" in text
    assert "\n" not in text and len(text) < 200


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3072, "3.00 KiB"),
        (3 * 2**19, "1.50 MiB"),
        (2**20 - 1, "1.00 MiB"),  # not "1024.00 KiB"
        (2 * 2**30, "2.00 GiB"),
        (2**40, "1.00 TiB"),
        (-1536, "-1.50 KiB"),
        (np.int64(2048), "2.00 KiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize("bad", [1.5, True, "1024", None])
def test_format_bytes_rejects_non_integers(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        format_bytes(bad)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


def _small() -> nn.Module:
    return nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: measure("model", torch.randn(2, 4)), "must be a torch.nn.Module"),  # type: ignore[arg-type]
        (lambda: measure(_small(), 3), "got int"),  # type: ignore[arg-type]
        (lambda: measure(_small(), torch.randn(2, 5)), "Linear.forward raised RuntimeError"),
        (lambda: measure(_small(), (), example_kwargs={"input": torch.randn(2, 4)}, warmup=-1), "warmup"),
        (lambda: measure(_small(), torch.randn(2, 4), repeat=0), "repeat"),
        (lambda: measure(_small(), torch.randn(2, 4), example_kwargs=[1]), "example_kwargs"),  # type: ignore[arg-type]
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn=3), "loss_fn must be callable"),  # type: ignore[arg-type]
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn="nope"), "unknown loss"),
        (lambda: measure(_small(), torch.randn(2, 4), optimizer="adam"), "torch.optim.Optimizer"),  # type: ignore[arg-type]
        (lambda: measure(_small(), torch.randn(2, 4), grad_accumulation=1), "grad_accumulation"),  # type: ignore[arg-type]
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn=lambda o: o), "scalar tensor"),
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn=lambda o: o.sum().item()), "scalar tensor"),
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn=lambda o: o.detach().sum()), "does not require grad"),
        (lambda: measure(_small(), torch.randn(2, 4), loss_fn=lambda o: o.no_such_attribute), "loss_fn raised"),
        (lambda: measure(_small().requires_grad_(False), torch.randn(2, 4)), "so there is no backward"),
        (lambda: measure(nn.LazyLinear(4), torch.randn(2, 4)), "not initialized"),
    ],
)
def test_bad_input_raises_invalid_argument(call: Any, needle: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert needle in str(info.value)
    assert info.value.fix


def test_keyword_inputs_are_passed_to_forward() -> None:
    report = measure(_small(), (), example_kwargs={"input": torch.randn(2, 4)})
    assert report.saved_bytes == 2 * 4 * FLOAT + SCALAR


def test_docstring_examples() -> None:
    for module in (measure_module, units_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
