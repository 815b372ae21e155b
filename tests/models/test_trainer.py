"""The loops users run, as they are: ``transformers.Trainer`` with its default arguments and
an accelerate loop, on a GPT-2 whose config keeps its defaults (``use_cache=True``), batches
padded to the longest row of each batch (so every batch has its own length).

Each run is compared with the same run of the untransformed model (same seed, same data
order): the logged losses, the evaluation loss, the saved weights, a run resumed from a
Trainer checkpoint.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import autockpt
import autockpt.runtime
from tests.helpers import assert_same_tensors

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

pytestmark = [pytest.mark.models, pytest.mark.slow]

VOCAB = 256


def _gpt2() -> torch.nn.Module:
    transformers.trainer_utils.set_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB,
                                     n_positions=64)
    return transformers.GPT2LMHeadModel(config)


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token rows of 8 to 39 tokens."""

    def __init__(self, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, VOCAB, (int(torch.randint(8, 40, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


def _pad(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as DataCollatorWithPadding does: to the longest row of the batch."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _trainer(model: torch.nn.Module, out: Path, **overrides: Any) -> Any:
    arguments = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4,
                     logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no")
    arguments.update(overrides)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**arguments),
                                train_dataset=_Rows(32, 0), eval_dataset=_Rows(8, 1),
                                data_collator=_pad)


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _transformed(**kwargs: Any) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the cache turned off, said once
        return autockpt.apply(_gpt2(), None, **kwargs)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_with_default_arguments_trains_like_the_original(
        tmp_path: Path, accumulation: int) -> None:
    plain = _trainer(_gpt2(), tmp_path / "plain", gradient_accumulation_steps=accumulation)
    plain.train()
    model = _transformed(grad_accumulation=accumulation > 1)
    assert inspect.signature(model.forward) == inspect.signature(_gpt2().forward)
    ours = _trainer(model, tmp_path / "ours", gradient_accumulation_steps=accumulation)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autockpt.BudgetWarning)  # planned for accumulation
        ours.train()
    assert len(_losses(ours)) == 6
    # The head in chunks sums the loss in another order: equal to float32 rounding.
    torch.testing.assert_close(_losses(ours), _losses(plain), rtol=1e-5, atol=1e-6)
    assert autockpt.plan_of(model).segments
    assert_same_tensors(dict(model.named_parameters()), dict(plain.model.named_parameters()),
                        what="after training", rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.evaluate()["eval_loss"], plain.evaluate()["eval_loss"])


def test_save_model_then_from_pretrained_and_resume(tmp_path: Path) -> None:
    """``save_model`` writes the plain model's files; a run resumed from a Trainer checkpoint
    logs the losses and ends with the weights of the untransformed model's run resumed the
    same way."""
    def resumed(model_for: Any, out: Path) -> Any:
        first = _trainer(model_for(), out, save_strategy="steps", save_steps=3, max_steps=3)
        first.train()
        first.save_model(str(out / "saved"))
        loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out / "saved"))
        assert type(loaded) is transformers.GPT2LMHeadModel
        assert_same_tensors(dict(loaded.named_parameters()),
                            dict(first.model.named_parameters()), what="from_pretrained")
        second = _trainer(model_for(), out, save_strategy="steps", save_steps=3)
        second.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        assert len(_losses(second)) == 6  # the 3 logged before the checkpoint, and 3 after
        return second

    plain = resumed(_gpt2, tmp_path / "plain")
    ours = resumed(_transformed, tmp_path / "ours")
    torch.testing.assert_close(_losses(ours), _losses(plain), rtol=1e-5, atol=1e-6)
    assert_same_tensors(dict(ours.model.named_parameters()),
                        dict(plain.model.named_parameters()), what="resumed", rtol=1e-5,
                        atol=1e-6)


def test_accelerate_loop_holding_outputs_meets_the_budget() -> None:
    """accelerate's training loop: ``outputs = model(**batch)`` held through
    ``accelerator.backward(outputs.loss)``, every batch its own length; each step's measured
    peak at most 1.05 x the budget, and the parameters end as the untouched model's."""
    rows = _Rows(16, 2)
    longest = max((_pad([rows[i] for i in range(k, k + 4)]) for k in range(0, len(rows), 4)),
                  key=lambda batch: batch["input_ids"].shape[1])
    baseline = autockpt.plan(_gpt2(), example_kwargs={**longest, "use_cache": False})
    budget_mb = 0.6 * baseline.baseline_peak_bytes / 2**20

    checkpointed = []

    def run(model: torch.nn.Module) -> tuple[torch.nn.Module, list[int]]:
        accelerator = accelerate.Accelerator(cpu=True)
        # SGD: a weight moves by its gradient, so equal gradients give equal weights (AdamW
        # divides by each gradient's norm, and turns the float32 rounding of one near zero,
        # summed in another order by the plan, into a step of up to the learning rate).
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=_pad)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        peaks = []
        for batch in loader:
            tracker = autockpt.track_activation_memory(
                exclude=[*model.parameters(), *model.buffers(), *batch.values()])
            hooks = [p.register_post_accumulate_grad_hook(
                lambda p: tracker.reclassify(p.grad)) for p in model.parameters()]
            with tracker:
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
            for hook in hooks:
                hook.remove()
            peaks.append(tracker.peak_bytes)
            if autockpt.runtime.is_checkpointed(model):
                plan = autockpt.plan_of(model)
                checkpointed.append(len(plan.segments) + (plan.chunked_head is not None))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del outputs
        return model, peaks

    plain, _ = run(_gpt2())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        transformed, peaks = run(autockpt.apply(_gpt2(), budget_mb))
    assert len(checkpointed) == len(peaks) and max(checkpointed) > 0, checkpointed
    assert max(peaks) <= 1.05 * budget_mb * 2**20, [p / 2**20 for p in peaks]
    assert_same_tensors(dict(transformed.named_parameters()), dict(plain.named_parameters()),
                        what="accelerate", rtol=1e-5, atol=1e-6)
