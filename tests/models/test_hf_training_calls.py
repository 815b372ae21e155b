"""A Hugging Face model called as Trainer calls it in training: with its cache on (GPT-2's
config default; Trainer never passes ``use_cache``), autockpt runs the training forward
without the cache and warns once, as Hugging Face's own checkpointing does (NOTE [ A training
forward runs without the cache ] in autockpt/pipeline.py), and evaluation keeps the cache;
with ``num_items_in_batch=`` through the forward's ``**kwargs``, it is an input of the capture."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import autockpt
from tests.helpers import assert_same_tensors, grads_of

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.models


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=256,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    assert config.use_cache is True  # the default this is about
    return transformers.GPT2LMHeadModel(config)


def _batch(length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def _cache_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "use_cache=False" in str(w.message)]


@pytest.mark.parametrize("how", ["config default", "use_cache=True passed"])
def test_training_with_the_cache_on_runs_without_it_and_warns_once(how: str) -> None:
    reference = _gpt2()
    model = copy.deepcopy(reference)
    transformed = autockpt.apply(model, 0.5)
    extra = {} if how == "config default" else {"use_cache": True}
    said: list[str] = []
    for length in (16, 24, 16):
        batch = {**_batch(length), **extra}
        reference.zero_grad(set_to_none=True)
        transformed.zero_grad(set_to_none=True)
        reference(**batch).loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = transformed(**batch)
        out.loss.backward()
        said += _cache_warnings(caught)
        assert out.past_key_values is None
        assert_same_tensors(grads_of(transformed), grads_of(reference), what=f"{how} {length}")
    assert len(said) == 1, said
    assert autockpt.plan_of(transformed).segments


def test_the_cache_warning_is_said_once_per_model() -> None:
    transformed = autockpt.apply(_gpt2(), 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in (16, 24, 16):
            transformed(**_batch(length)).loss.backward()
    said = _cache_warnings(caught)
    assert len(said) == 1, said
    assert "GPT2LMHeadModel is trained with use_cache=True" in said[0]


def test_evaluation_keeps_the_cache() -> None:
    model = _gpt2()
    transformed = autockpt.apply(model, 0.5, example_kwargs=_batch(16))
    transformed.eval()
    with torch.no_grad():
        out = transformed(**_batch(16))
    assert out.past_key_values is not None


def test_plan_and_apply_with_example_inputs_plan_without_the_cache() -> None:
    model = _gpt2()
    with pytest.warns(UserWarning, match="use_cache=False"):
        plan = autockpt.plan(model, example_kwargs=_batch(16), budget_mb=0.5)
    assert plan.segments
    with pytest.warns(UserWarning, match="use_cache=False"):
        transformed = autockpt.apply(model, 0.5, example_kwargs=_batch(16))
    assert inspect.signature(transformed.forward) == inspect.signature(model.forward)


def test_num_items_in_batch_through_kwargs_is_an_input() -> None:
    """Trainer passes ``num_items_in_batch`` (the forward takes ``**kwargs``): the loss is
    divided by it, so gradients differ with it, and must equal the untouched model's."""
    reference = _gpt2()
    model = copy.deepcopy(reference)
    transformed = autockpt.apply(model, 0.5)
    for count in (20, 40):
        batch = {**_batch(16), "use_cache": False, "num_items_in_batch": torch.tensor(count)}
        reference.zero_grad(set_to_none=True)
        transformed.zero_grad(set_to_none=True)
        expected = reference(**batch).loss
        expected.backward()
        actual = transformed(**batch).loss
        actual.backward()
        torch.testing.assert_close(actual, expected)
        assert_same_tensors(grads_of(transformed), grads_of(reference), what=f"{count} items")
    plan = autockpt.plan_of(transformed)
    assert plan.segments and "num_items_in_batch=" in plan.input_signature
