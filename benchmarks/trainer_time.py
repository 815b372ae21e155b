"""transformers.Trainer as users run it: default arguments, a padding collator, 16 steps.

A GPT-2 whose config keeps its defaults except its size (6 layers, d 256, 4 heads; vocabulary
50257), rows of 16 to 255 tokens padded per batch, batch 4, the model's own loss. Trainer with
``gradient_checkpointing=True`` twice around one run of ``autockpt.apply(model, budget_mb=B)``,
where ``B`` is the activation peak ``autockpt.measure`` finds for Hugging Face's switch on the
longest batch the collator can make (the same memory). Prints both times (``Trainer.train``,
planning included), their ratio and whether the logged losses agree to 1e-4 (the head in
chunks sums the loss in another order).

    OMP_NUM_THREADS=1 python benchmarks/trainer_time.py
"""

from __future__ import annotations

import tempfile
import time
import warnings

import torch
import transformers

import autockpt


VOCAB = 50257


def gpt2():
    transformers.trainer_utils.set_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4))


class Rows(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows = [
            torch.randint(
                1, VOCAB, (int(torch.randint(16, 256, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(count)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(model, **over):
    d = tempfile.mkdtemp()
    args = transformers.TrainingArguments(
        output_dir=d,
        max_steps=16,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        **over,
    )
    tr = transformers.Trainer(model=model, args=args, train_dataset=Rows(64, 0), data_collator=pad)
    t = time.perf_counter()
    tr.train()
    return time.perf_counter() - t, [e["loss"] for e in tr.state.log_history if "loss" in e]


def main() -> None:
    warnings.simplefilter("ignore")
    # HF memory at the longest batch of the run, to ask autockpt for the same
    longest = pad([{"input_ids": list(range(1, 256))}] * 4)
    hf = gpt2()
    hf.config.use_cache = False
    hf.gradient_checkpointing_enable()
    budget = autockpt.measure(hf, (), example_kwargs=longest).peak_activation_bytes / 2**20
    print("budget MiB", round(budget, 1))
    t_hf, l_hf = run(gpt2(), gradient_checkpointing=True)
    t_ak, l_ak = run(autockpt.apply(gpt2(), budget_mb=budget))
    t_hf2, _ = run(gpt2(), gradient_checkpointing=True)
    print(
        "hf",
        round(t_hf, 2),
        round(t_hf2, 2),
        "autockpt",
        round(t_ak, 2),
        "ratio",
        round(t_ak / ((t_hf + t_hf2) / 2), 3),
    )
    print("losses equal", all(abs(a - b) < 1e-4 for a, b in zip(l_ak, l_hf)), l_ak[:3], l_hf[:3])


if __name__ == "__main__":
    main()
