"""Hugging Face models on batches padded per batch, as a padding collator makes them: one
torch.export capture for every length, the budget kept at every step with ``outputs`` held
through backward, and every gradient equal to the untouched twin's (NOTE [ One graph for every
shape ] in autockpt/capturing/shapes.py)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import autockpt
from tests.helpers import assert_same_tensors, grads_of, loop_peak_bytes

pytestmark = pytest.mark.models

transformers = pytest.importorskip("transformers")

MIB = 2**20
LENGTHS = [48, 21, 64, 35, 57, 30, 64, 12]


def _batch(length: int, seed: int, vocab: int, masked_lm: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    rows = [length, *torch.randint(max(1, length // 2), length + 1, (2,), generator=gen).tolist()]
    ids = torch.randint(5, vocab, (3, length), generator=gen)
    mask = torch.zeros(3, length, dtype=torch.long)
    for row, size in enumerate(rows):
        mask[row, :size] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if masked_lm:
        labels = labels.masked_fill(torch.rand(3, length, generator=gen) > 0.3, -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def _model(name: str) -> tuple[torch.nn.Module, bool]:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512,
                                         n_positions=128, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config), False
    config = transformers.BertConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=512,
                                     max_position_embeddings=128)
    return transformers.BertForMaskedLM(config), True


def _step_against_twin(model: torch.nn.Module, twin: torch.nn.Module, batch: dict[str, Any],
                       step: int, budget_bytes: int, what: str) -> None:
    """One step of each on ``batch``, the model's own loss held through backward: equal
    losses and gradients, and the model's measured peak within the budget."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2 trains with use_cache=True: said once
        torch.manual_seed(step)
        outputs = model(**batch)
        outputs.loss.backward()
        torch.manual_seed(step)
        expected = twin(**batch)
        expected.loss.backward()
    torch.testing.assert_close(outputs.loss, expected.loss)
    assert_same_tensors(grads_of(model), grads_of(twin), what=f"{what} grad ", allow_none=True)
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peak = loop_peak_bytes(model, batch, hold=True)
    assert peak <= budget_bytes * 1.05, (what, peak / MIB, budget_bytes / MIB)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_padded_batches_are_captured_once_and_keep_the_budget(name: str) -> None:
    net, masked_lm = _model(name)
    largest = _batch(64, 0, 512, masked_lm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = autockpt.plan(net, example_kwargs=largest)
    budget_bytes = base.baseline_peak_bytes // 2
    model = autockpt.apply(copy.deepcopy(net), budget_mb=budget_bytes / MIB)
    twin = copy.deepcopy(net).train()
    model.train()
    for step, length in enumerate(LENGTHS):
        _step_against_twin(model, twin, _batch(length, step + 1, 512, masked_lm), step,
                           budget_bytes, f"length {length}")
        assert autockpt.plan_of(model).capture == "export"
    families = model.__dict__["_autockpt"].families.values()
    assert sum(len(f.graphs) for f in families) == 1
    assert sum(len(f.plans) for f in families) < len(set(LENGTHS))


def test_longer_batches_are_priced_by_evaluating_one_symbolic_profile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 with its head in chunks, each batch longer than every plan: the first plan
    profiles, the second profiles on symbolic sizes (the head whole and in chunks), every
    later one evaluates both (NOTE [ Pricing every shape of a shared graph ] in
    autockpt/pipeline.py); gradients equal the twin's, and the budget holds."""
    from autockpt import pipeline

    monkeypatch.setattr(pipeline, "SYMBOLIC_AFTER", 1)
    net, _ = _model("gpt2")
    lengths = [20, 27, 36, 48, 64]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = autockpt.plan(net, example_kwargs=_batch(64, 0, 512, False))
    budget_bytes = base.baseline_peak_bytes // 2
    model = autockpt.apply(copy.deepcopy(net), budget_mb=budget_bytes / MIB)
    twin = copy.deepcopy(net).train()
    for step, length in enumerate(lengths):
        _step_against_twin(model, twin, _batch(length, step + 1, 512, False), step,
                           budget_bytes, f"length {length}")
    plan = autockpt.plan_of(model)
    assert plan.chunked_head is not None
    (family,) = model.__dict__["_autockpt"].families.values()
    (pricing,) = family.pricing.values()
    assert pricing.failed is None and pricing.symbolic == 2  # the head whole and in chunks
    assert pricing.evaluated >= 2 * (len(lengths) - 2) - 1
    assert any(chunks is not None for chunks in pricing.formulas)


def test_a_head_too_large_at_a_smaller_length_is_not_searched_whole_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ A head too large at a smaller shape ] in autockpt/pipeline.py: once no plan with
    the head whole fits the budget at a length, a longer batch searches only the graph with
    its head in chunks, and gets the plan searching both gives, printed byte for byte;
    gradients equal the twin's and the budget holds."""
    from autockpt import pipeline

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=16384,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    net = transformers.GPT2LMHeadModel(config)
    lengths = [16, 20, 24, 28, 32]  # each past every plan's bucket: a plan each
    batches = [_batch(length, step + 1, 16384, False) for step, length in enumerate(lengths)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = autockpt.plan(net, example_kwargs=batches[0], chunk_head=False)
        chunked = autockpt.plan(net, example_kwargs=batches[-1])
    # No plan with the head whole at the shortest length, one in chunks at the longest.
    budget_bytes = (whole.min_peak_bytes + chunked.min_peak_bytes) // 2
    assert chunked.min_peak_bytes < budget_bytes < whole.min_peak_bytes
    searched: list[bool] = []
    real = pipeline._planned

    def counted(module: Any, traced: Any, inputs: Any, stats: Any, *rest: Any,
                **options: Any) -> Any:
        searched.append(any(n.target == "chunked_rows" for n in stats.nodes))
        return real(module, traced, inputs, stats, *rest, **options)

    monkeypatch.setattr(pipeline, "_planned", counted)
    model = autockpt.apply(copy.deepcopy(net), budget_mb=budget_bytes / MIB)
    twin = copy.deepcopy(net).train()
    printed = []
    for step, batch in enumerate(batches):
        _step_against_twin(model, twin, batch, step, budget_bytes, f"length {lengths[step]}")
        printed.append(str(autockpt.plan_of(model)))
    assert autockpt.plan_of(model).chunked_head is not None
    assert searched.count(False) == 1 and searched.count(True) == len(lengths)

    # Searching both graphs at every length gives the same plans.
    searched.clear()
    monkeypatch.setattr(pipeline.ShapePricing, "whole_head_fails", lambda *args: False)
    both = autockpt.apply(copy.deepcopy(net), budget_mb=budget_bytes / MIB)
    for step, batch in enumerate(batches):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autockpt.plan_of(both, **batch)
        assert str(plan) == printed[step], lengths[step]
    assert searched.count(False) == len(lengths)
