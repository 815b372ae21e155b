"""The plan's estimated peak is close to the peak the measure sees: within 10% for every zoo
case at the least memory, at half the baseline and with no checkpointing, in both modes, with a
real loss (one that sends an output-sized gradient into every output) planned and measured.

In reentrant mode the plan's estimate is its step replayed on fake tensors (NOTE [ Replaying a
plan on fake tensors ] in autockpt/running/replay.py); the tests of single faults of the memory model
check the model's own estimate, :attr:`~autockpt.Plan.modelled_peak_bytes`, by which the
search chooses."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch

import autockpt
from tests import random_graphs as graphs
from tests.zoo import CASES, ZooCase

TOLERANCE = 0.10
FRACTIONS = ("min", 0.5, 1.0)
SLOW = {"mlp72", "densenet_block", "resnet", "generator"}


def squares(output: Any) -> torch.Tensor:
    """``mean(t**2)`` summed over the floating-point outputs that require grad: every output
    gets an output-sized gradient, as from a real loss."""
    tensors = [t for t in autockpt.profiling.loss.output_tensors(output)
               if t.is_floating_point() and t.requires_grad]
    return torch.stack([t.float().square().mean() for t in tensors]).sum()


def modelled(plan: autockpt.Plan) -> int:
    """The memory model's estimate of ``plan`` (which a reentrant plan's replay replaces):
    what the search chose the plan by, checked here on its own."""
    return (plan.estimated_peak_bytes if plan.modelled_peak_bytes is None
            else plan.modelled_peak_bytes)


def _params() -> list[object]:
    out = []
    for case in CASES:
        for mode in ("non_reentrant", "reentrant"):
            marks = []
            if case.name in SLOW:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(case, mode, marks=marks, id=f"{case.name}-{mode}"))
    return out


@pytest.mark.parametrize(("case", "mode"), _params())
def test_estimate_is_within_10_percent_of_the_measured_peak(case: ZooCase, mode: str) -> None:
    model = case.build()
    args, kwargs = case.inputs()
    probe = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode, loss_fn=squares)
    seen: set[tuple[tuple[int, int], ...]] = set()
    for fraction in FRACTIONS:
        budget = (probe.min_peak_bytes if fraction == "min"
                  else max(probe.min_peak_bytes, int(probe.baseline_peak_bytes * fraction)))
        ckpt = autockpt.apply(model, budget / 2**20, example_inputs=args, example_kwargs=kwargs,
                              mode=mode, loss_fn=squares)
        plan = autockpt.plan_of(ckpt)
        segments = tuple((s.start, s.end) for s in plan.segments)
        if segments in seen:
            continue
        seen.add(segments)
        measured = autockpt.measure(ckpt, args, example_kwargs=kwargs,
                                    loss_fn=squares).peak_activation_bytes
        for estimated in (plan.estimated_peak_bytes, modelled(plan)):
            assert abs(estimated - measured) <= TOLERANCE * measured, (
                f"{case.name} at {fraction} ({mode}, {len(segments)} segments): estimated "
                f"{estimated} B, measured {measured} B ({estimated / measured:.3f}x)"
            )


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_recompute_clones_of_batchnorm_statistics_are_counted(mode: str) -> None:
    """A recompute runs BatchNorm on clones of its running statistics (so that they are
    updated once), and BatchNorm saves them for backward: activation memory only a
    recompute has. Counted, the least-memory plan of this stack, trained with cross-entropy
    over its logits, is estimated to within a few bytes of what the step measures; left out,
    4 KiB (0.5%) below it."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    x = torch.randn(64, 512)
    target = torch.randint(0, 10, (64,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, target)

    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, None, example_inputs=(x,), mode=mode,
                                     loss_fn=loss_fn)
    plan = autockpt.plan_of(transformed)
    assert any(segment.buffers for segment in plan.segments)  # BatchNorms are recomputed
    measured = autockpt.measure(transformed, (x,), loss_fn=loss_fn).peak_activation_bytes
    assert abs(modelled(plan) - measured) <= 0.002 * measured, (
        modelled(plan), measured)


class _TiedInTheMiddle(torch.nn.Module):
    """An encoder over features, then a decoder whose token embedding its head reads again
    (Whisper's shape): the embedding's backward runs while the encoder's activations are
    still held."""

    def __init__(self, vocab: int = 2048, width: int = 256) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.encoder(features))


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_the_first_readers_gradient_of_a_tied_parameter_is_counted(mode: str) -> None:
    """The head's gradient of a tied embedding waits for the embedding's backward, which
    makes its own gradient of the table and adds the two into a new buffer: both are alive
    there, with what the graph still holds. With a table larger than the activations of a few
    tokens, that is the step's peak; with the embedding's gradient left out, the estimate
    was 2 MiB (a table) short of it (and Whisper's least plan 11% below its measured peak,
    where the encoder's activations are held at that point)."""
    torch.manual_seed(0)
    model = _TiedInTheMiddle()
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(2, 4, 256, generator=generator)
    ids = torch.randint(0, 2048, (2, 4), generator=generator)
    target = torch.randint(0, 2048, (2 * 4,), generator=generator)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 2048), target)

    args = (features, ids)
    plain = autockpt.plan(model, args, mode=mode, loss_fn=loss_fn)
    measured = autockpt.measure(model, args, loss_fn=loss_fn).peak_activation_bytes
    assert abs(plain.baseline_peak_bytes - measured) <= 0.01 * measured, (
        plain.baseline_peak_bytes, measured)
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(model, None, example_inputs=args, mode=mode,
                                     loss_fn=loss_fn)
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    estimated = modelled(autockpt.plan_of(transformed))
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


def _least_reentrant_estimate(layers: tuple[tuple[tuple[int, ...], str, str, bool], ...],
                              inputs: int, batch: int = 256, inputs_require_grad: bool = False
                              ) -> tuple[autockpt.Plan, int]:
    """The least-memory reentrant plan of a random graph (tests/random_graphs.py) and the peak
    its step measures."""
    spec = graphs.GraphSpec(inputs=inputs, inputs_require_grad=inputs_require_grad, batch=batch,
                            layers=tuple(
        graphs.LayerSpec(reads=r, combine=c, op=o, frozen=f) for r, c, o, f in layers))
    args, loss_fn = graphs.example_inputs(spec), graphs.cross_entropy(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        transformed = autockpt.apply(graphs.build(spec), None, example_inputs=args,
                                     mode="reentrant", loss_fn=loss_fn)
    measured = autockpt.measure(transformed, args, loss_fn=loss_fn).peak_activation_bytes
    return autockpt.plan_of(transformed), measured


def test_a_reentrant_segment_copies_only_the_input_gradients_it_must() -> None:
    """NOTE [ A reentrant segment copies its inputs' gradients ]: the gradients of the
    tensors crossing into a reentrant segment were all counted on top of its first stage's
    backward peak, which falls mid-stage, before they exist. Now only a gradient that
    autograd must copy into the input's ``.grad`` (handed as an add's or a concatenation's)
    is counted, from where it arrives. Random graph seed 8 of
    benchmarks/estimate_accuracy.py: its least-memory plan was estimated 5.5% above the
    measured peak (632,836 against 600,072 B), now exact to a few bytes."""
    layers = (((0,), "sum", "mlp", True), ((1,), "sum", "linear_relu", False),
              ((2,), "cat", "mlp", True), ((3,), "cat", "tanh", False),
              ((1, 3, 4), "sum", "tanh", False), ((5,), "gate", "norm", False),
              ((3, 6), "cat", "mlp", True), ((0, 4, 7), "sum", "tanh", False),
              ((1, 8), "gate", "linear", False), ((9,), "gate", "linear", False),
              ((3, 8, 10), "gate", "linear_relu", False), ((11,), "gate", "linear", False),
              ((2, 3, 12), "gate", "tanh", False), ((4, 7, 13), "gate", "norm", False),
              ((14,), "sum", "dropout", True))
    plan, measured = _least_reentrant_estimate(layers, inputs=1)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_reentrant_segment_does_not_count_its_handed_gradients_twice() -> None:
    """NOTE [ Handed gradients the replay counts again ]: one reentrant segment makes a skip
    tensor that a frozen concatenation inside it and two layers after it read. The gradient
    handed back for it is held by the checkpoint's frame and was also counted as waiting for
    its producer: the least-memory plan was estimated 7.2% above the measured peak of the
    step (305,156 against 284,684 B; random graph seed 20 of
    benchmarks/estimate_accuracy.py), and is now exact to a few bytes."""
    layers = (((2,), "gate", "linear", False), ((0, 1, 3), "cat", "tanh", True),
              ((4,), "sum", "norm", False), ((3, 5), "sum", "linear_relu", False),
              ((2, 5, 6), "cat", "tanh", True), ((3, 7), "sum", "linear_relu", False),
              ((8,), "sum", "linear_relu", True), ((9,), "sum", "norm", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=3)
    assert sum(s.checkpointed for s in plan.segments) == 1
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_gradient_handed_as_a_view_is_not_taken_off_again() -> None:
    """NOTE [ Handed gradients the replay counts again ], the exception: a skip tensor made
    inside a reentrant segment and read after it by one concatenation only is handed its
    gradient as a slice of that concatenation's, whose base the replay already counts; the
    frame's count of it is not a second one. Taking it off anyway put the plan the exact
    search finds for random graph seed 48 of benchmarks/estimate_accuracy.py 6.1% below its
    measured peak (125,444 against 133,644 B)."""
    layers = (((2,), "gate", "mlp", False), ((1, 3), "gate", "tanh", False),
              ((4,), "gate", "linear", False), ((1, 5), "gate", "dropout", False),
              ((6,), "cat", "linear_relu", True), ((7,), "cat", "linear", False),
              ((2, 8), "sum", "linear", False), ((4, 5, 9), "gate", "norm", True),
              ((10,), "cat", "norm", False), ((11,), "gate", "norm", False),
              ((12,), "cat", "mlp", False), ((13,), "sum", "tanh", False),
              ((0, 14), "cat", "linear", False), ((9, 15), "cat", "mlp", True))
    plan, measured = _least_reentrant_estimate(layers, inputs=3, batch=64)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_an_add_of_two_inputs_of_a_reentrant_segment_copies_one_gradient() -> None:
    """NOTE [ Gradients shared by a reentrant segment's inputs ]: an add inside a reentrant
    segment whose operands are both inputs of the segment (two skip tensors) hands both
    leaves one gradient; autograd copies it into the first ``.grad`` while the second still
    holds it. The replay counts one buffer, so the plan the exact search finds for random
    graph seed 40 of benchmarks/estimate_accuracy.py was estimated 4.3% below its measured
    peak (182,788 against 190,988 B), the copy short."""
    layers = (((1,), "sum", "norm", False), ((0, 2), "sum", "norm", False),
              ((0, 3), "gate", "mlp", False), ((4,), "gate", "linear_relu", False),
              ((0, 3, 5), "sum", "dropout", False), ((6,), "cat", "norm", False),
              ((1, 3, 7), "sum", "norm", False), ((3, 8), "gate", "linear_relu", False),
              ((9,), "gate", "norm", False), ((7, 10), "sum", "dropout", False),
              ((6, 11), "gate", "linear", False), ((3, 9, 12), "gate", "linear", True),
              ((9, 13), "cat", "linear", False), ((14,), "cat", "tanh", True),
              ((10, 15), "gate", "tanh", False), ((2, 7, 16), "sum", "linear_relu", False),
              ((5, 17), "gate", "tanh", True), ((6, 13, 18), "gate", "linear", False),
              ((16, 19), "sum", "linear_relu", False), ((5, 6, 20), "sum", "norm", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=2, batch=64)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_reentrant_segment_counts_no_copy_of_a_gradient_autograd_sums_or_holds() -> None:
    """Two over-counts of NOTE [ Gradients shared by a reentrant segment's inputs ]'s kind,
    on random graph seed 12 of benchmarks/estimate_accuracy.py, whose least plan was
    estimated 6.1% above its measured peak (567,300 against 534,540 B): a tensor crossing
    into a segment that two of its nodes read gets their sum as its ``.grad``, new storage
    taken as it is, not a copy; and the gradient an add after the segment hands both to the
    segment's output and to a value made before the segment is held by that value anyway
    (``MemoryModel._handed_and_held``)."""
    layers = (((0, 1), "cat", "linear", False), ((1, 2), "gate", "tanh", False),
              ((1, 2, 3), "sum", "mlp", False), ((4,), "cat", "norm", False),
              ((1, 5), "sum", "dropout", False), ((6,), "gate", "mlp", False),
              ((6, 7), "sum", "linear", True), ((3, 8), "sum", "tanh", False),
              ((9,), "gate", "tanh", False), ((5, 9, 10), "gate", "linear_relu", False),
              ((11,), "gate", "linear_relu", False), ((12,), "cat", "dropout", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=2)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_skip_tensor_holds_the_base_of_the_slice_a_reentrant_segment_is_handed() -> None:
    """``MemoryModel._handed_and_held`` for a concatenation's slices: the concatenation after
    a reentrant segment hands its output one slice of its gradient and a skip tensor made
    before the segment another; the skip tensor holds the base in the replay until its reader
    inside the segment has run backward, so the frame's count of the slice is a second one
    there. Random graph seed 37 of benchmarks/estimate_accuracy.py: its least plan was
    estimated 5.4% above its measured peak (109,060 against 103,436 B)."""
    layers = (((0, 2), "gate", "norm", False), ((0, 2, 3), "cat", "dropout", False),
              ((3, 4), "cat", "linear_relu", True), ((5,), "cat", "linear", False),
              ((2, 6), "gate", "mlp", False), ((5, 7), "gate", "dropout", True))
    plan, measured = _least_reentrant_estimate(layers, inputs=3, batch=64)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_an_input_that_requires_grad_is_a_leaf_of_a_reentrant_segment() -> None:
    """NOTE [ Gradients shared by a reentrant segment's inputs ]: an add of the model's input
    (which requires grad) in a reentrant segment's middle stage hands it its gradient, which
    the segment's leaf copies as it would a skip tensor's. Random graph seed 43 of
    benchmarks/estimate_accuracy.py, counted with a concatenation's slices held: 7% below
    its measured peak (436,228 against 469,000 B)."""
    layers = (((0,), "cat", "norm", False), ((0, 1), "gate", "tanh", False),
              ((2,), "gate", "tanh", False), ((3,), "cat", "linear_relu", True),
              ((4,), "sum", "tanh", False), ((5,), "sum", "dropout", False),
              ((6,), "cat", "dropout", False), ((2, 7), "cat", "linear", True),
              ((0, 2, 8), "sum", "linear_relu", False), ((1, 9), "gate", "dropout", True),
              ((0, 10), "sum", "dropout", False), ((5, 11), "cat", "dropout", False),
              ((2, 7, 12), "sum", "linear", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=1, inputs_require_grad=True)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_reentrant_segment_delays_the_sum_of_a_skip_tensors_gradient() -> None:
    """NOTE [ Sums a reentrant segment delays ]: a skip tensor read inside a reentrant segment
    and after it keeps the part of its gradient from after it while the segment's leaf
    holds the part from inside, until the segment's backward returns. Random graph seed 69
    of benchmarks/estimate_accuracy.py (not one the model was fitted to): its least plan
    was estimated 12% below its measured peak (239,620 against 272,392 B)."""
    layers = (((2,), "sum", "linear", False), ((2, 3), "gate", "tanh", False),
              ((4,), "cat", "dropout", False), ((3, 4, 5), "sum", "tanh", False),
              ((6,), "cat", "norm", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=3, inputs_require_grad=True)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)


def test_a_reentrant_segment_copies_every_slice_before_the_base_goes() -> None:
    """NOTE [ Gradients shared by a reentrant segment's inputs ]: a concatenation of three of
    a reentrant segment's inputs copies its three slices into their ``.grad`` while the
    gradient they slice is still alive. Random graph seed 92 of
    benchmarks/estimate_accuracy.py (not one the model was fitted to): its least plan was
    estimated 7.1% below its measured peak (215,556 against 231,944 B)."""
    layers = (((0, 1), "gate", "dropout", False), ((2,), "sum", "dropout", False),
              ((0, 2, 3), "sum", "linear", False), ((1, 4), "gate", "dropout", False),
              ((3, 5), "gate", "mlp", False), ((0, 5, 6), "sum", "tanh", True),
              ((5, 7), "cat", "linear", False), ((8,), "gate", "linear_relu", False),
              ((2, 3, 9), "gate", "linear_relu", False), ((10,), "cat", "mlp", False),
              ((4, 11), "gate", "linear", False), ((0, 8, 12), "cat", "tanh", False),
              ((4, 9, 13), "cat", "mlp", True), ((14,), "gate", "tanh", False),
              ((15,), "cat", "norm", False), ((7, 16), "gate", "dropout", False),
              ((17,), "sum", "norm", True), ((18,), "sum", "linear_relu", False),
              ((11, 19), "cat", "mlp", True), ((20,), "sum", "dropout", False))
    plan, measured = _least_reentrant_estimate(layers, inputs=2, batch=64)
    assert 0.999 * measured <= modelled(plan) <= 1.005 * measured, (
        modelled(plan), measured)
