"""One rank of the per-block FSDP2 tests (gloo on CPU, 127.0.0.1 only).

Usage: python fsdp_blocks.py RANK WORLD PORT DIRECTORY
With 2 processes, for a GPT of our own and a Llama-style decoder from a small Hugging Face
config, in both checkpoint modes (with 4, the GPT in non-reentrant mode on a 2-D mesh, HSDP:
replicate x shard): ``autockpt.apply`` at half the peak without checkpointing with the blocks kept
whole, then torchtitan's sharding (``fully_shard(block)`` for each block, then the root), three
AdamW steps, against the same FSDP2 setup without autockpt; each rank's activation peak measured
with the model sharded; and a save at step 1 (``CheckpointManager``, DCP) resumed by a fresh
process-group state that trains on to step 3. With ``AUTOCKPT_FSDP_RUN=late`` in the
environment, instead: both models sharded per block after ``apply`` without ``keep_whole``
(root sharded or not) and with it (root not sharded), two AdamW steps against FSDP2 without
autockpt (:func:`late_scenario`). Writes DIRECTORY/result-RANK.pt for
tests/test_fsdp_blocks.py.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.training import CheckpointManager

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
RANK, WORLD, PORT, DIRECTORY = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
MODES = ("non_reentrant", "reentrant")
VOCAB, TOKENS, STEPS = 256, 64, 3


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, 4 pre-norm causal blocks, a vocabulary head."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Parameter(torch.zeros(1, TOKENS, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT().train()


def llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS,
        use_cache=False, attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config).train()


def gpt_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, TOKENS), generator=torch.Generator().manual_seed(seed))
    return {"ids": ids, "labels": ids.roll(-1, 1)}


def llama_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, TOKENS), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def gpt_loss(out: Any) -> torch.Tensor:
    return out


def llama_loss(out: Any) -> torch.Tensor:
    return out.loss


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], dict[str, torch.Tensor]],
                        Callable[[Any], torch.Tensor], Callable[[nn.Module], nn.ModuleList]]] = {
    "gpt": (gpt, gpt_batch, gpt_loss, lambda m: m.layers),
    "llama": (llama, llama_batch, llama_loss, lambda m: m.model.layers),
}
KEEP = {"gpt": "layers.*", "llama": "model.layers.*"}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


MESH: Any = None
"""The device mesh: None (1-D, every rank) with 2 processes, 2 x 2 (HSDP) with 4."""


def setup(name: str, mode: str | None, compiled: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The model (transformed at half its baseline when ``mode`` is given) sharded block by
    block (each compiled first with ``compiled``, as torchtitan does), its optimizer, and the
    activation budget in bytes (0 without autockpt)."""
    build, batch, _, blocks = MODELS[name]
    model, budget = build(), 0
    if mode is not None:
        probe = autockpt.plan(model, example_kwargs=batch(0), mode=mode, keep_whole=KEEP[name])
        budget = probe.baseline_peak_bytes // 2
        model = autockpt.apply(model, budget / 2**20, example_kwargs=batch(0), mode=mode,
                               keep_whole=KEEP[name])
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        if compiled:
            block.compile(backend="aot_eager")
        fully_shard(block, mesh=MESH)
    fully_shard(model, mesh=MESH)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), budget


def train(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range
          ) -> list[float]:
    _, batch, loss_of, _ = MODELS[name]
    losses = []
    for step in steps:
        torch.manual_seed(100 * RANK + step)  # per-rank, per-step dropout masks
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(**batch(1000 * RANK + step)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def scenario(out: dict[str, Any], name: str, mode: str) -> None:
    key = f"{name}/{mode}"
    _, batch, loss_of, _ = MODELS[name]
    plain, plain_opt, _ = setup(name, None)
    out[key] = {"plain_losses": train(name, plain, plain_opt, range(STEPS)),
                "plain_params": snapshot(plain), "plain_grads": grads(plain)}
    model, optimizer, budget = setup(name, mode)
    out[key]["plan"] = str(autockpt.plan_of(model))
    out[key]["losses"] = train(name, model, optimizer, range(STEPS))
    out[key]["params"], out[key]["grads"] = snapshot(model), grads(model)
    out[key]["budget_bytes"] = budget
    # Activations of one more step, on the sharded models (the buffers FSDP2 gathers
    # parameters into and reduces gradients from are not activations; measure leaves them out).
    for label, which in (("plain_peak_bytes", plain), ("peak_bytes", model)):
        torch.manual_seed(7)
        out[key][label] = autockpt.measure(which, (), example_kwargs=batch(99),
                                           loss_fn=loss_of).peak_activation_bytes

    # A run saved at step 1 and resumed in a fresh model and optimizer gives step 3's
    # parameters of the uninterrupted run.
    directory = DIRECTORY / f"ckpt-{name}-{mode}"
    model, optimizer, _ = setup(name, mode)
    train(name, model, optimizer, range(1))
    CheckpointManager(directory).save(1, model=model, optimizer=optimizer)
    train(name, model, optimizer, range(1, STEPS))
    out[key]["uninterrupted"] = snapshot(model)
    model, optimizer, _ = setup(name, mode)
    state = CheckpointManager(directory).resume(model=model, optimizer=optimizer)
    out[key]["resumed_step"] = state.step if state is not None else None
    train(name, model, optimizer, range(1, STEPS))
    out[key]["resumed"] = snapshot(model)


def compiled_scenario(out: dict[str, Any], name: str, mode: str) -> None:
    """Per-block ``torch.compile`` under the sharding: the same three steps as without
    autockpt, compiled the same way."""
    key = f"{name}/{mode}/compiled"
    plain, plain_opt, _ = setup(name, None, compiled=True)
    model, optimizer, _ = setup(name, mode, compiled=True)
    out[key] = {"plain_losses": train(name, plain, plain_opt, range(STEPS)),
                "losses": train(name, model, optimizer, range(STEPS)),
                "plain_params": snapshot(plain), "params": snapshot(model)}


LATE = [(name, keep, root) for name in MODELS for keep in (False, True) for root in (True, False)
        if keep is False or root is False]
"""The runs with ``AUTOCKPT_FSDP_RUN=late``: each model sharded per block after ``apply``
without ``keep_whole`` (root sharded or not), and with it and the root not sharded (with it
and the root sharded is :func:`scenario`'s)."""


def late_key(name: str, keep: bool, root: bool, mode: str) -> str:
    return f"late/{name}/{'keep' if keep else 'inlined'}/{'root' if root else 'no_root'}/{mode}"


def late_setup(name: str, mode: str | None, keep: bool, root: bool, cost: str = "flops"
               ) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """:func:`setup` with ``keep_whole`` only where ``keep``, and ``fully_shard`` on the root
    only where ``root`` (then each block is a root of its own, and the rest of the model is
    neither sharded nor synchronised: each rank compares with its own twin)."""
    build, batch, _, blocks = MODELS[name]
    model, budget = build(), 0
    if mode is not None:
        options: dict[str, Any] = {"mode": mode, "keep_whole": KEEP[name] if keep else (),
                                   "cost": cost}
        budget = autockpt.plan(model, example_kwargs=batch(0),
                               **options).baseline_peak_bytes // 2
        model = autockpt.apply(model, budget / 2**20, example_kwargs=batch(0), **options)
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block, mesh=MESH)
    if root:
        fully_shard(model, mesh=MESH)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), budget


def all_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's full gradient, None where it has none."""
    return {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}


def late_scenario(out: dict[str, Any], name: str, keep: bool, root: bool, mode: str) -> None:
    """Two AdamW steps against the same FSDP2 setup without autockpt, the plan the first
    forward made (or the error it raised), and each rank's activation peak of one more step
    (as :func:`scenario` measures it)."""
    key = late_key(name, keep, root, mode)
    _, batch, loss_of, _ = MODELS[name]
    plain, plain_opt, _ = late_setup(name, None, keep, root)
    out[key] = {"plain_losses": train(name, plain, plain_opt, range(2)),
                "plain_grads": all_grads(plain), "plain_params": snapshot(plain)}
    model, optimizer, budget = late_setup(name, mode, keep, root)
    out[key]["first_plan"] = str(autockpt.plan_of(model))
    out[key]["budget_bytes"] = budget
    try:
        out[key]["losses"] = train(name, model, optimizer, range(2))
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out[key]["error"] = f"{type(err).__name__}: {err}"
        out[key]["traceback"] = traceback.format_exc()
        return
    out[key]["plan"] = str(autockpt.plan_of(model))
    out[key]["grads"], out[key]["params"] = all_grads(model), snapshot(model)
    for label, which in (("plain_peak_bytes", plain), ("peak_bytes", model)):
        torch.manual_seed(7)
        out[key][label] = autockpt.measure(which, (), example_kwargs=batch(99),
                                           loss_fn=loss_of).peak_activation_bytes


def late_timed_scenario(out: dict[str, Any]) -> None:
    """``cost="profile"`` times the nodes on real tensors, which the sharded blocks are not
    (NOTE [ Planning a sharded model ]): the first forward's plan cannot be made again, and
    the error it raises is autockpt's own, naming ``keep_whole``."""
    model, optimizer, _ = late_setup("gpt", "non_reentrant", False, True, cost="profile")
    try:
        train("gpt", model, optimizer, range(1))
        out["late/gpt/timed"] = {"error": "no error"}
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out["late/gpt/timed"] = {"error": f"{type(err).__name__}: {err}"}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                            world_size=WORLD)
    global MESH
    scenarios = [(name, mode) for name in MODELS for mode in MODES]
    if WORLD == 4:
        from torch.distributed.device_mesh import init_device_mesh

        MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        scenarios = [("gpt", "non_reentrant")]
    out: dict[str, Any] = {}
    try:
        runs: list[tuple[Callable[[], None], str]] = [
            (lambda name=name, mode=mode: scenario(out, name, mode), f"{name}/{mode}")
            for name, mode in scenarios]
        if WORLD == 2:
            runs.append((lambda: compiled_scenario(out, "gpt", "non_reentrant"),
                         "gpt/non_reentrant/compiled"))
        if os.environ.get("AUTOCKPT_FSDP_RUN") == "late":
            runs = [(lambda name=name, keep=keep, root=root, mode=mode: late_scenario(
                out, name, keep, root, mode), late_key(name, keep, root, mode))
                for name, keep, root in LATE for mode in MODES]
            runs.append((lambda: late_timed_scenario(out), "late/gpt/timed"))
        for run, key in runs:
            try:
                run()
            except Exception as err:  # noqa: BLE001 - recorded for the test
                out[key] = {"error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(out, DIRECTORY / f"result-{RANK}.pt")


if __name__ == "__main__":
    main()
