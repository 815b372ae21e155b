"""Planning on the meta device ("Will it fit on my GPU?"): Hugging Face decoders from small
configs, a model that enters ``torch.autocast`` with its tensors' device type on every rung,
the error for an autocast that is on, and torch's autocast untouched afterwards (NOTE
[ Autocast on the meta device ] in autockpt/capturing/meta.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from autockpt.capturing.meta import MetaAutocastError, meta_autocast

pytestmark = pytest.mark.usefixtures("one_thread")

AUTOCAST = torch.amp.autocast_mode.autocast


def _autocast_methods() -> dict[str, Any]:
    return {name: AUTOCAST.__dict__[name] for name in ("__init__", "__enter__", "__exit__")}


TORCH_AUTOCAST = _autocast_methods()


def _assert_autocast_untouched() -> None:
    assert _autocast_methods() == TORCH_AUTOCAST  # the very function objects
    assert torch.autocast is AUTOCAST and torch.amp.autocast is AUTOCAST
    with pytest.raises(RuntimeError):  # torch's own refusal of "meta", back in place
        torch.autocast(device_type="meta", enabled=False)


class Upcast(nn.Module):
    """Runs its stretch in float32 under ``torch.autocast(<the input's device type>,
    enabled=...)``, as rotary embeddings and attention upcasts do; ``enabled=None`` runs it
    with no autocast at all."""

    def __init__(self, width: int, enabled: bool | None) -> None:
        super().__init__()
        self.enabled = enabled
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = (contextlib.nullcontext() if self.enabled is None
                  else torch.autocast(device_type=x.device.type, enabled=self.enabled))
        with region:
            y = x.float() * self.scale.float()
            return (y.sin() * y.cos()).to(x.dtype)


class Stack(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6, enabled: bool | None = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), Upcast(width, enabled), nn.GELU())
            for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _stack_on(device: str, enabled: bool | None = False) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device(device):
        model = Stack(enabled=enabled).to(torch.bfloat16)
        x = torch.zeros(32, 64, dtype=torch.bfloat16)
    return model, x


def _numbers(plan: autockpt.Plan) -> tuple[Any, ...]:
    return (plan.capture, plan.baseline_peak_bytes, plan.estimated_peak_bytes,
            plan.min_peak_bytes, plan.recompute_flops,
            [(s.start, s.end) for s in plan.segments])


def _two_plans(model: nn.Module, x: torch.Tensor, **options: Any) -> list[tuple[Any, ...]]:
    first = autockpt.plan(model, (x,), budget_mb=None, loss_fn="sum", **options)
    budget = first.baseline_peak_bytes * 0.6 / 2**20
    return [_numbers(first), _numbers(autockpt.plan(model, (x,), budget_mb=budget,
                                                    loss_fn="sum", **options))]


@pytest.mark.parametrize(("capture", "mode"), [
    ("auto", "non_reentrant"), ("export", "non_reentrant"), ("fx-leaves", "non_reentrant"),
    ("modules", "non_reentrant"), ("export", "reentrant"), ("modules", "reentrant")])
def test_autocast_off_on_meta_is_a_no_op(capture: str, mode: str) -> None:
    """Every rung (export inlines the forward; fx-leaves profiles the kept module's own
    forward; the modules rung runs the model's forward with hooks), and the replay of a
    reentrant plan: the disabled meta autocast is the no-op it is. torch.export records a
    real autocast region as one opaque node, so there the plans are those of the same model
    without autocast, on meta and on the CPU; on the rungs that run the module, they are the
    CPU's, where torch's autocast(enabled=False) runs."""
    rung = "export" if capture == "auto" else capture
    meta = _two_plans(*_stack_on("meta", enabled=False), capture=capture, mode=mode)
    if rung == "export":
        references = [("meta", None), ("cpu", None)]
    else:
        references = [("cpu", False)]
    for device, enabled in references:
        assert meta == _two_plans(*_stack_on(device, enabled=enabled), capture=rung,
                                  mode=mode), (device, enabled)
    assert meta[0][0] == rung
    assert 0 < meta[1][2] < meta[1][1]  # checkpointed: the forward really ran
    _assert_autocast_untouched()


def test_meta_estimate_is_the_cpu_measurement() -> None:
    """The peak planned on meta for the model with its autocast(enabled=False) is the peak
    one real step of it measures on the CPU, where torch's autocast runs."""
    model, x = _stack_on("meta")
    planned = autockpt.plan(model, (x,), budget_mb=None, loss_fn="sum")
    real, _ = _stack_on("cpu")
    measured = autockpt.measure(real, (torch.randn(32, 64, dtype=torch.bfloat16),),
                                loss_fn="sum").peak_activation_bytes
    assert abs(planned.baseline_peak_bytes - measured) <= 0.01 * measured, (
        planned.baseline_peak_bytes, measured)


def test_autocast_on_over_meta_is_refused_clearly() -> None:
    model, x = _stack_on("meta", enabled=True)
    state = {k: v for k, v in model.state_dict().items()}
    for capture in ("auto", "export", "modules"):
        with pytest.raises(MetaAutocastError) as caught:
            autockpt.plan(model, (x,), capture=capture, loss_fn="sum")
        message = str(caught.value)
        assert "torch.autocast(device_type='meta', enabled=True)" in message, capture
        assert "meta device" in message and "fix:" in message
        assert "failed on the example inputs" not in message
    assert model.state_dict().keys() == state.keys()
    _assert_autocast_untouched()


def test_other_threads_keep_torchs_autocast() -> None:
    """While one thread plans a meta model, another thread's autocast on "meta" is refused
    by torch as without autockpt, and its CPU autocast works as ever."""
    model, _ = _stack_on("meta")
    seen: dict[str, Any] = {}

    def elsewhere() -> None:
        try:
            torch.autocast(device_type="meta", enabled=False)
        except RuntimeError as err:
            seen["meta"] = err
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["cpu"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype

    with meta_autocast(model, (), {}):
        with torch.autocast(device_type="meta", enabled=False):  # this thread: a no-op
            pass
        with meta_autocast(model, (), {}):  # nested: one installation
            pass
        assert _autocast_methods() != TORCH_AUTOCAST  # still installed for the outer one
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # and here too
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert isinstance(seen["meta"], RuntimeError) and seen["cpu"] == torch.bfloat16
    _assert_autocast_untouched()


def test_nothing_installed_for_a_model_off_meta() -> None:
    model, _ = _stack_on("cpu")
    with meta_autocast(model, (torch.zeros(1, 64),), {}):
        assert _autocast_methods() == TORCH_AUTOCAST


# --------------------------------------------------------------------------- Hugging Face

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _decoders() -> list[Any]:
    cases = [("LlamaForCausalLM", "LlamaConfig", {}), ("Qwen2ForCausalLM", "Qwen2Config", {}),
             ("MistralForCausalLM", "MistralConfig", {}),
             ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 16})]
    return [pytest.param(model, config, extra, id=model) for model, config, extra in cases
            if hasattr(transformers, model)]


@pytest.mark.parametrize(("model_name", "config_name", "extra"), _decoders())
@pytest.mark.parametrize("budget", ["least", "device"])
def test_hugging_face_decoder_plans_on_meta(model_name: str, config_name: str,
                                            extra: dict[str, Any], budget: str) -> None:
    """The README's meta example on small configs: the head in chunks is priced on meta
    (its runner asks whether autocast is on, which torch cannot answer for "meta"), and the
    plan is the one the same model gets on the CPU. Eager attention: torch's fused attention
    picks its kernel by device, and on meta that is the math one (see the README)."""
    config = getattr(transformers, config_name)(**SMALL, **extra)
    config._attn_implementation = "eager"
    plans = []
    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(transformers, model_name)(config).to(torch.bfloat16)
            ids = torch.zeros(1, 256, dtype=torch.long)
        batch = dict(input_ids=ids, labels=ids, use_cache=False)
        if budget == "least":
            plan = autockpt.plan(model, example_kwargs=batch)
        else:
            plan = autockpt.plan(model, example_kwargs=batch, total_mb=8,
                                 optimizer=torch.optim.AdamW(model.parameters()))
        plans.append((plan.chunked_head is not None, *_numbers(plan)))
    meta, cpu = plans
    assert meta == cpu
    assert meta[0], "the head in chunks was planned"
    _assert_autocast_untouched()


def test_meta_failure_names_the_meta_device() -> None:
    """A forward that cannot run on meta tensors (it reads a value) fails with a message
    that blames the meta device, not the inputs' shapes."""

    class ReadsValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * float(x.sum())

    with torch.device("meta"):
        model = ReadsValue()
        x = torch.zeros(2, 4)
    with pytest.raises(autockpt.InvalidArgumentError) as caught:
        autockpt.plan(model, (x,), capture="modules")
    message = str(caught.value)
    assert "on the meta device" in message and "parameters" in message, message
    assert "example inputs" in message and "shapes and dtypes" not in message
