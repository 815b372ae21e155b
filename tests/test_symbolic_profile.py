"""A profile taken once on symbolic sizes, evaluated at another shape, is the profile of that
shape (NOTE [ One profile for every shape ] in autockpt/profiling/symbolic.py).

Each test captures a real model once for every shape (``pipeline.capture_shared``), profiles
its graph on fake inputs whose sizes are symbols (``SymbolicInputs``), turns that into a
``ShapeFormula`` and evaluates it at other shapes; each evaluation must be exactly the
``Profile`` (every node, every storage, the loss) that a plain fake-tensor profile of the
same graph measures at that shape. Where the symbolic profile does not hold (a size the
model branched on, a size of 1, two sizes that were one symbol now different, another rank
or number of tensors) ``at`` must return None. Models: Hugging Face GPT-2 and BERT with their
own loss, a small ResNet with the loss passed as ``loss_fn``, GPT-2's graph with its head
in chunks of rows, and a module that branches in Python on a length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autockpt import pipeline
from autockpt.capturing.ladder import NoGraph
from autockpt.capturing.shapes import tensor_shapes, tensors_in
from autockpt.capturing.trace import TracedModel, bind_inputs
from autockpt.planning.head import chunked_head, find_row_stretch
from autockpt.profiling.loss import LossFn
from autockpt.profiling.profile import ProfileShare, profile
from autockpt.profiling.stats import Profile
from autockpt.profiling.symbolic import ShapeFormula, SymbolicInputs, formula_of, larger
from autockpt.running.head import chunk_rows
from tests.zoo import get_case

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
CONFIG = pipeline.ApplyConfig(budget_bytes=None, mode="non_reentrant", strategy="auto")

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Captured:
    """A model and the graph ``capture_shared`` made of it for every shape."""

    model: nn.Module
    traced: TracedModel
    loss_fn: LossFn | None = None

    def arguments(self, call: Call) -> dict[str, Any]:
        args, kwargs = call
        return bind_inputs(self.model, args, kwargs)

    def profile(self, arguments: dict[str, Any], graph: TracedModel | None = None, *,
                symbolic: SymbolicInputs | None = None,
                share: ProfileShare | None = None) -> Profile:
        """The fake-tensor profile of ``graph`` (the captured one by default) at the call."""
        graph = self.traced if graph is None else graph
        inputs = dict(zip(graph.spec.param_names, graph.graph_inputs(arguments)))
        return profile(graph, inputs, loss_fn=self.loss_fn, share=share, symbolic=symbolic)

    def formula(self, call: Call) -> ShapeFormula:
        """The formula of the graph's profile taken on the call's sizes as symbols."""
        arguments = self.arguments(call)
        symbolic = SymbolicInputs(tensors_in(arguments))
        formula = formula_of(self.profile(arguments, symbolic=symbolic), symbolic)
        assert formula.symbols, "the symbolic profile made no size a symbol"
        return formula

    def evaluated(self, formula: ShapeFormula, call: Call, graph: TracedModel | None = None
                  ) -> tuple[Profile | None, Profile]:
        """``formula`` evaluated at the call, and the graph's direct profile there."""
        arguments = self.arguments(call)
        direct = self.profile(arguments, graph)
        return formula.at(tensor_shapes(arguments), direct.input_signature), direct


def captured(model: nn.Module, call: Call, loss_fn: LossFn | None = None,
             config: pipeline.ApplyConfig = CONFIG) -> Captured:
    args, kwargs = call
    traced = pipeline.capture_shared(model, args, kwargs, config)
    assert not isinstance(traced, NoGraph), traced.reason
    return Captured(model, traced, loss_fn)


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where two profiles (or parts of them) differ, field by field."""
    if got == want:
        return []
    if type(got) is type(want) and isinstance(got, tuple) and len(got) == len(want):
        return [d for i, (a, b) in enumerate(zip(got, want))
                for d in differences(a, b, f"{path}[{i}]")]
    if type(got) is type(want) and hasattr(got, "__dataclass_fields__"):
        return [d for f in fields(got)
                for d in differences(getattr(got, f.name), getattr(want, f.name),
                                     f"{path}.{f.name}")]
    return [f"{path}: evaluated {got!r}, profiled {want!r}"]


def assert_same_profile(got: Profile | None, want: Profile, what: str) -> None:
    assert got is not None, f"{what}: the formula does not hold"
    found = differences(got, want)
    assert not found, f"{what}: " + "; ".join(found[:10])
    assert got == want


def assert_equal_at(case: Captured, formula: ShapeFormula, calls: dict[str, Call],
                    graph: TracedModel | None = None) -> list[Profile]:
    """Each call's evaluation equals its direct profile; the direct profiles, which differ
    (so that the comparison is not of a profile that ignores sizes)."""
    profiles = []
    for name, call in calls.items():
        got, want = case.evaluated(formula, call, graph)
        assert_same_profile(got, want, name)
        profiles.append(want)
    for a, b in pairwise(profiles):
        assert a.nodes != b.nodes
    return profiles


# --------------------------------------------------------------------------- Hugging Face


def lm_call(batch: int, length: int, seed: int = 0) -> Call:
    """A language-model batch with labels, so that the model computes its own loss."""
    ids = torch.randint(5, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return (), {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long),
                "labels": ids.clone(), "use_cache": False}


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                     n_positions=256, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=256)
    return transformers.BertForMaskedLM(config).train()


@pytest.fixture(scope="module")
def gpt2_captured() -> Captured:
    return captured(gpt2(), lm_call(4, 40))


@pytest.fixture(scope="module")
def gpt2_formula(gpt2_captured: Captured) -> ShapeFormula:
    return gpt2_captured.formula(lm_call(4, 40))


LM_SHAPES = {"profiled": (4, 40), "short": (4, 9), "long, smaller batch": (3, 100),
             "larger batch": (6, 40), "smallest": (2, 2)}


def test_gpt2_evaluates_to_the_profile_of_each_shape(gpt2_captured: Captured,
                                                     gpt2_formula: ShapeFormula) -> None:
    assert gpt2_captured.traced.capture == "export"
    calls = {f"{name} {shape}": lm_call(*shape, seed=i)
             for i, (name, shape) in enumerate(LM_SHAPES.items())}
    assert_equal_at(gpt2_captured, gpt2_formula, calls)


def test_bert_evaluates_to_the_profile_of_each_shape() -> None:
    case = captured(bert(), lm_call(4, 40))
    formula = case.formula(lm_call(4, 40))
    calls = {f"{name} {shape}": lm_call(*shape, seed=i)
             for i, (name, shape) in enumerate(LM_SHAPES.items()) if name != "smallest"}
    assert_equal_at(case, formula, calls)


def test_gpt2_with_its_head_in_chunks(gpt2_captured: Captured) -> None:
    """The head in chunks of rows (NOTE [ A chunked head for every shape ]): the chunked graph
    is profiled on the same symbols as the graph, resuming its run through a shared profile,
    as :class:`autockpt.pipeline._Pricing` does; one chunked graph (one chunk count) serves
    every shape, its rows per chunk following the call's rows."""
    case = gpt2_captured
    arguments = case.arguments(lm_call(4, 40))
    symbolic = SymbolicInputs(tensors_in(arguments))
    share = ProfileShare()
    try:
        plain = formula_of(case.profile(arguments, symbolic=symbolic, share=share), symbolic)
        stretch = find_row_stretch(case.traced.graph_module)
        assert stretch is not None
        head = chunked_head(stretch)
        assert head.chunks >= 2
        chunked = chunk_rows(case.traced, head)
        formula = formula_of(case.profile(arguments, chunked, symbolic=symbolic, share=share),
                             symbolic)
    finally:
        share.release()
    calls = {f"{shape}": lm_call(*shape, seed=i)
             for i, shape in enumerate([(4, 40), (3, 100), (6, 40), (2, 2), (4, 9)])}
    # Where the rows fill every chunk (never fewer rows per chunk than the plan's), the
    # formula holds; fewer rows than that run fewer chunks, another loop: another formula.
    profiles = assert_equal_at(case, formula, {
        name: calls[name] for name in ("(4, 40)", "(3, 100)", "(6, 40)")}, chunked)
    assert all(any(n.target == "chunked_rows" for n in p.nodes) for p in profiles)
    for name in ("(2, 2)", "(4, 9)"):
        assert formula.at(tensor_shapes(case.arguments(calls[name])), "") is None, name
    # The graph with the head whole, profiled with the share, holds at every shape.
    assert_equal_at(case, plain, {name: calls[name] for name in ("(4, 9)", "(3, 100)")})


def test_gpt2_does_not_hold_for_a_batch_of_one_or_another_call(
        gpt2_captured: Captured, gpt2_formula: ShapeFormula) -> None:
    case = gpt2_captured
    assert case.evaluated(gpt2_formula, lm_call(1, 40))[0] is None  # a size of 1
    assert case.evaluated(gpt2_formula, lm_call(4, 1))[0] is None
    args, kwargs = lm_call(4, 40)
    signature = case.profile(case.arguments((args, kwargs))).input_signature
    # Fewer tensors: no attention mask.
    fewer = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    assert gpt2_formula.at(tensor_shapes(case.arguments((args, fewer))), signature) is None
    # Another rank: a third dimension on the labels.
    deeper = dict(kwargs, labels=kwargs["labels"][..., None].expand(4, 40, 2))
    assert gpt2_formula.at(tensor_shapes(case.arguments((args, deeper))), signature) is None
    # Tensors in another order cannot be bound either.
    shapes = tensor_shapes(case.arguments((args, kwargs)))
    assert gpt2_formula.at(shapes[:1], signature) is None
    assert gpt2_formula.at(((4,), *shapes[1:]), signature) is None


# --------------------------------------------------------------------------- images


def image_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the logits against integer targets, outside the model."""
    targets = torch.arange(logits.shape[0], device=logits.device) % logits.shape[1]
    return F.cross_entropy(logits, targets)


def image_call(batch: int, height: int, width: int, seed: int = 0) -> Call:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, height, width, generator=gen),), {}


@pytest.fixture(scope="module")
def resnet() -> Captured:
    model = get_case("resnet").build().train()
    return captured(model, image_call(4, 32, 32), image_loss)


@pytest.mark.parametrize(("profiled", "equal", "other"), [
    # Profiled square: height and width are one symbol, so a call with them different does
    # not bind.
    ((4, 32, 32), [(4, 16, 16), (3, 40, 40), (2, 33, 33)], [(4, 32, 24), (4, 33, 32)]),
    # Profiled with two symbols: any other pair, a square one too.
    ((4, 32, 24), [(4, 16, 20), (3, 40, 28), (2, 33, 17), (4, 24, 24)], []),
], ids=["square", "oblong"])
def test_resnet_evaluates_to_the_profile_of_each_image_size(
        resnet: Captured, profiled: tuple[int, int, int], equal: list[tuple[int, int, int]],
        other: list[tuple[int, int, int]]) -> None:
    assert resnet.traced.capture == "fx"
    formula = resnet.formula(image_call(*profiled))
    calls = {f"{shape}": image_call(*shape, seed=i)
             for i, shape in enumerate([profiled, *equal])}
    profiles = assert_equal_at(resnet, formula, calls)
    assert all(p.loss.kind == profiles[0].loss.kind for p in profiles)
    for shape in other:
        assert resnet.evaluated(formula, image_call(*shape))[0] is None, shape


def test_resnet_profiled_at_a_batch_of_one_holds_only_there(resnet: Captured) -> None:
    formula = resnet.formula(image_call(1, 32, 32))
    assert_equal_at(resnet, formula, {"(1, 20, 20)": image_call(1, 20, 20)})
    assert resnet.evaluated(formula, image_call(2, 32, 32))[0] is None


# --------------------------------------------------------------------------- a size guard


class LengthGate(nn.Module):
    """Branches in Python on the length: a projection for long sequences only."""

    def __init__(self, width: int, longest_plain: int) -> None:
        super().__init__()
        self.longest_plain = longest_plain
        self.wide = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[1] > self.longest_plain:
            return h + self.wide(h).relu()
        return h * 2


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.gate = LengthGate(32, longest_plain=50)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(ids)))


def token_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.logsumexp(-1).mean()


def ids_call(batch: int, length: int, seed: int = 0) -> Call:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 64, (batch, length), generator=gen),), {}


@pytest.mark.parametrize(("profiled", "same_side", "other_side"), [
    (40, [30, 50, 2], [51, 80]),
    (80, [51, 64, 200], [50, 40]),
], ids=["short", "long"])
def test_a_branch_on_a_size_holds_on_its_side_only(profiled: int, same_side: list[int],
                                                   other_side: list[int]) -> None:
    """torch.export would inline the branch (its graph holds for one side, which the
    runtime's capture checks, not the profile); kept whole, the gate is one ``call_module``
    node that the profile runs on symbolic sizes, and its ``if`` becomes a guard."""
    torch.manual_seed(0)
    config = pipeline.ApplyConfig(budget_bytes=None, mode="non_reentrant", strategy="auto",
                                  keep_whole=("gate",))
    case = captured(Gated().train(), ids_call(4, profiled), token_loss, config)
    assert [n.target for n in case.traced.graph.nodes if n.op == "call_module"].count("gate") == 1
    formula = case.formula(ids_call(4, profiled))
    calls = {f"length {length}": ids_call(3, length, seed=i)
             for i, length in enumerate([profiled, *same_side])}
    assert_equal_at(case, formula, calls)
    for length in other_side:
        assert case.evaluated(formula, ids_call(3, length))[0] is None, length


def test_larger_keeps_only_the_sizes_no_other_bounds() -> None:
    """NOTE [ The larger of two sizes, without comparing them ]: a running peak over working
    sets that only grew is the last of them, not a ``Max`` of all; two that neither bounds
    both stay; at every shape the value is the largest of all, and no guard is recorded."""
    symbolic = SymbolicInputs([torch.zeros(4, 37)])
    fake = symbolic.fake(torch.zeros(4, 37))
    batch, length = fake.shape
    env = symbolic.shape_env
    guards = len(env.guards)
    quadratic = 144 * batch * length * length + 12288 * batch * length + 4096
    linear = 80 * batch * length * length + 16384 * batch * length
    peak: Any = 0
    candidates = [linear + i * length for i in range(20)] + [quadratic, 7]
    for candidate in candidates:
        peak = larger(peak, candidate)
    expr = peak.node.expr
    assert len(expr.args) == 2, expr  # the last linear one and the quadratic one
    assert larger(peak, linear) is peak  # below one of them at every shape
    bigger = linear + 100 * length
    assert larger(bigger, linear) is bigger
    grown = larger(linear, linear + length)
    assert grown.node.expr == (linear + length).node.expr  # no Max at all
    for b, n in [(2, 2), (4, 37), (3, 63), (8, 64), (16, 500)]:
        values = {batch.node.expr: b, length.node.expr: n}
        every = max(int(c.node.expr.xreplace(values)) if isinstance(c, torch.SymInt) else c
                    for c in candidates)
        assert int(expr.xreplace(values)) == every, (b, n)
    assert peak.node.hint == max(c.node.hint if isinstance(c, torch.SymInt) else c
                                 for c in candidates)
    assert len(env.guards) == guards
