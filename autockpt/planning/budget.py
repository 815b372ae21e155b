"""A budget for the whole device: what parameters, gradients, optimizer state and inputs take
before activations get the rest.

Users ask "does this fit in my 24 GB GPU", not "in how much activation memory". With
``total_mb`` the activation budget is what is left of it after the step's fixed memory
(:class:`DeviceBudget`), worked out from sizes alone, so it holds for a model built on the
meta device as well: a plan for an 8B-parameter model can be made on a laptop.

# NOTE [ What an optimizer keeps ]
An optimizer's state is what it keeps per parameter between steps: Adam and its kin two
buffers the size of the parameter (three with ``amsgrad``) and a scalar step count, SGD with
momentum one, Adagrad one, RMSprop one more for momentum and one more when centered. State
that already exists (after a first ``optimizer.step()``) is counted as it is. ``step()`` also
makes temporaries: the for-each implementations (the default on CUDA) compute over a whole
parameter group at once, about one copy of its parameters (Adam's ``sqrt`` of the second
moment); the per-tensor implementations (the default on CPU) make about two copies of the
largest parameter; fused ones none. They live after backward, when the activations are gone,
so they bound the step on their own instead of adding to the activation peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.errors import InfeasibleBudgetError
from autockpt.profiling.loss import output_tensors
from autockpt.units import format_bytes

__all__ = ["DeviceBudget", "device_budget", "optimizer_state_bytes", "optimizer_step_bytes",
           "storage_bytes"]

_TWO_BUFFERS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD")


@dataclass(frozen=True)
class DeviceBudget:
    """How ``total_mb`` is shared out: the fixed memory of a training step, and what is left
    for activations."""

    total_bytes: int
    """The budget for the whole device (``total_mb``)."""
    parameter_bytes: int
    """The model's parameters and buffers."""
    gradient_bytes: int
    """The ``.grad`` of every parameter that requires grad."""
    optimizer_state_bytes: int
    """What the optimizer keeps between steps (NOTE [ What an optimizer keeps ])."""
    optimizer_step_bytes: int
    """Temporaries of ``optimizer.step()``, which run after the activations are freed."""
    input_bytes: int
    """The tensors of the batch."""
    optimizer: str
    """The optimizer's class name, or ``"none"``."""

    @property
    def fixed_bytes(self) -> int:
        """What the step holds besides activations: parameters, gradients, optimizer state
        and inputs."""
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes
                + self.input_bytes)

    @property
    def activation_budget_bytes(self) -> int:
        """What is left for activations."""
        return self.total_bytes - self.fixed_bytes


def storage_bytes(tensors: Any) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (a view adds nothing to its
    base); a meta tensor counts its own elements.

    Example:
        >>> w = torch.zeros(10, 10)
        >>> storage_bytes([w, w.t(), w[0], torch.zeros(5)])
        420
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        # Meta tensors have no storage address: count each tensor once by identity.
        key = (t.device.type, id(t) if t.device.type == "meta" else t.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += (t.numel() * t.element_size() if t.device.type == "meta"
                  else t.untyped_storage().nbytes())
    return total


def _optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
    return params


def _buffers_per_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    name = type(optimizer).__name__
    if name in _TWO_BUFFERS:
        return 2 + (1 if group.get("amsgrad") else 0)
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "Adagrad":
        return 1
    if name == "RMSprop":
        return 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered") else 0)
    return 2  # an optimizer we do not know: assume Adam's two buffers (the common worst)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes an optimizer keeps between steps: its state as it is where it exists, else what
    its kind will make (NOTE [ What an optimizer keeps ]).

    Example:
        >>> net = torch.nn.Linear(100, 10)
        >>> optimizer_state_bytes(torch.optim.AdamW(net.parameters()))  # 2 x 1010 floats + steps
        8088
    """
    if optimizer is None:
        return 0
    total = 0
    for group in optimizer.param_groups:
        per = _buffers_per_parameter(optimizer, group)
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state.get(p)
            if state:
                total += storage_bytes(output_tensors(dict(state)))
                continue
            total += per * p.numel() * p.element_size()
            if type(optimizer).__name__ in _TWO_BUFFERS:
                total += 4  # the float32 step count
    return total


def optimizer_step_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Most bytes of temporaries ``optimizer.step()`` makes at once (NOTE [ What an
    optimizer keeps ]).

    Example:
        >>> net = torch.nn.Linear(100, 10)
        >>> optimizer_step_bytes(torch.optim.AdamW(net.parameters(), foreach=False))
        8000
    """
    if optimizer is None:
        return 0
    name = type(optimizer).__name__
    most = 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            continue
        sizes = [p.numel() * p.element_size() for p in params]
        if name == "SGD" and not group.get("weight_decay"):
            continue  # in-place updates only
        if group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach is None:  # torch's default: for-each on CUDA, per tensor elsewhere
            foreach = all(p.device.type == "cuda" for p in params)
        most = max(most, sum(sizes) if foreach else 2 * max(sizes))
    return most


def device_budget(module: nn.Module, inputs: Any, total_bytes: int,
                  optimizer: torch.optim.Optimizer | None, *, subject: str) -> DeviceBudget:
    """Share out ``total_bytes`` for one training step of ``module`` on ``inputs``.

    Raises :class:`~autockpt.errors.InfeasibleBudgetError` naming the part that alone does
    not fit.

    Example:
        >>> net = torch.nn.Linear(1000, 1000)
        >>> b = device_budget(net, (torch.randn(16, 1000),), 64 * 2**20,
        ...                   torch.optim.AdamW(net.parameters()), subject="Linear")
        >>> b.parameter_bytes, b.gradient_bytes, b.input_bytes
        (4004000, 4004000, 64000)
    """
    params = list(module.parameters())
    parameter_bytes = storage_bytes([*params, *module.buffers()])
    gradient_bytes = storage_bytes([p for p in params if p.requires_grad])
    if optimizer is not None:
        known = {id(p) for p in params}
        gradient_bytes += storage_bytes([p for p in _optimized(optimizer) if id(p) not in known])
    budget = DeviceBudget(
        total_bytes=total_bytes,
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=optimizer_state_bytes(optimizer),
        optimizer_step_bytes=optimizer_step_bytes(optimizer),
        input_bytes=storage_bytes(output_tensors(inputs)),
        optimizer=type(optimizer).__name__ if optimizer is not None else "none",
    )
    total = format_bytes(total_bytes)
    parts = [
        ("the parameters and buffers alone", budget.parameter_bytes),
        ("parameters and their gradients", budget.parameter_bytes + budget.gradient_bytes),
        (f"parameters, gradients and {budget.optimizer} state",
         budget.parameter_bytes + budget.gradient_bytes + budget.optimizer_state_bytes),
        (f"parameters, gradients, {budget.optimizer} state and the inputs", budget.fixed_bytes),
    ]
    for what, nbytes in parts:
        if nbytes >= total_bytes:
            raise InfeasibleBudgetError(
                f"{subject}: {what} take {format_bytes(nbytes)}, which leaves nothing of "
                f"total_mb ({total}) for activations",
                fix="raise total_mb, shrink the model or the batch, or use an optimizer that "
                "keeps less state (SGD, or Adam with sharded state under FSDP)",
                budget_bytes=total_bytes, min_feasible_bytes=nbytes + 1,
            )
    # The batch is still alive while the optimizer steps: the training loop holds it.
    step = budget.fixed_bytes + budget.optimizer_step_bytes
    if step > total_bytes:
        raise InfeasibleBudgetError(
            f"{subject}: {budget.optimizer}.step() needs {format_bytes(step)} (parameters, "
            f"gradients, state, inputs and {format_bytes(budget.optimizer_step_bytes)} of "
            f"temporaries), more than total_mb ({total})",
            fix="raise total_mb, or use a fused or per-tensor optimizer (foreach=False)",
            budget_bytes=total_bytes, min_feasible_bytes=step,
        )
    return budget
