"""Randomly generated models: general graphs (DAGs), not chains.

A :class:`GraphSpec` is plain data (so hypothesis can draw and shrink it): a list of layers,
each reading one or more earlier values (the inputs or earlier layers' outputs, skips of any
length) and combining them (sum, concatenation, gating), then applying a linear layer, a norm,
an activation or dropout. Some layers are frozen. A value no layer reads reaches the loss
(summed into the output), or, where the spec says so, it is a dead branch (computed, never read
again) or an output the model returns beside its logits and the loss ignores
(:data:`UNREAD`). :class:`RandomGraph` builds the module; its forward is plain Python that
torch.fx traces into a graph with the same shape.

This module deliberately does not import autockpt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 32
"""Features of every value (a concatenation is projected back to it)."""

COMBINES = ("sum", "cat", "gate")
"""How a layer with several inputs combines them: add, concatenate then project, or
``sigmoid(first) * rest``."""

OPS = ("linear", "linear_relu", "norm", "tanh", "dropout", "mlp")
"""What a layer applies after combining its inputs."""

UNREAD = ("loss", "dead", "returned")
"""What becomes of a value no later layer reads (the last layer's excepted): it is added into
the last layer's output, so that it reaches the loss as every branch of a real model does; it
is dropped, a dead branch, so the parameters feeding only it get no gradient, nor do those
feeding values that only dead layers read; or the model returns it after its logits, and the
loss (:func:`cross_entropy`) ignores it."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer: what it reads, how it combines it, what it applies."""

    reads: tuple[int, ...]
    """Values it reads: ``0 .. inputs-1`` are the model's inputs, then one per earlier layer."""
    combine: str
    """One of :data:`COMBINES` (ignored for a single input)."""
    op: str
    """One of :data:`OPS`."""
    frozen: bool
    """Whether its parameters are frozen (requires_grad=False)."""


@dataclass(frozen=True)
class GraphSpec:
    """A whole random model."""

    inputs: int
    """Number of input tensors of ``forward``."""
    inputs_require_grad: bool
    """Whether the example inputs require grad."""
    layers: tuple[LayerSpec, ...]
    """The layers in order; the output is the last one's (plus every value nobody read, as
    :attr:`unread` says)."""
    batch: int
    """Rows of each input."""
    unread: str = "loss"
    """What becomes of a value no layer reads: one of :data:`UNREAD`."""


class RandomGraph(nn.Module):
    """The model of a :class:`GraphSpec`, ending in a 10-way classifier head."""

    def __init__(self, spec: GraphSpec) -> None:
        super().__init__()
        self.spec = spec
        self.combiners = nn.ModuleList()
        self.ops = nn.ModuleList()
        for layer in spec.layers:
            fan_in = len(layer.reads)
            self.combiners.append(nn.Linear(WIDTH * fan_in, WIDTH)
                                  if fan_in > 1 and layer.combine == "cat" else nn.Identity())
            if layer.op in ("linear", "linear_relu"):
                op: nn.Module = nn.Linear(WIDTH, WIDTH)
            elif layer.op == "norm":
                op = nn.LayerNorm(WIDTH)
            elif layer.op == "dropout":
                op = nn.Dropout(0.2)
            elif layer.op == "mlp":
                op = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                   nn.Linear(2 * WIDTH, WIDTH))
            else:
                op = nn.Identity()
            self.ops.append(op)
            if layer.frozen:
                for module in (self.combiners[-1], op):
                    for p in module.parameters():
                        p.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 10)
        # Per value (inputs first, then one per layer): the last layer that reads it.
        self.last_reader: list[int | None] = [None] * (spec.inputs + len(spec.layers))
        for k, layer in enumerate(spec.layers):
            for i in layer.reads:
                self.last_reader[i] = k

    def forward(self, x0: Tensor, x1: Tensor | None = None, x2: Tensor | None = None
                ) -> Tensor | tuple[Tensor, ...]:
        # Written so that Python holds no value longer than the traced graph does: each value
        # is dropped after its last reader, and each part as soon as it is combined. A list
        # holding every value would keep them all alive through the forward, and the model
        # runs this forward itself when nothing is checkpointed.
        values: list[Tensor | None] = [x0, x1, x2][: self.spec.inputs]
        unread: Tensor | None = None
        returned: list[Tensor] = []
        for k in range(len(self.spec.layers)):
            h = self._layer(k, self._take(values, k))
            values.append(h)
            if self.last_reader[self.spec.inputs + k] is None and k < len(self.spec.layers) - 1:
                value = values.pop()
                values.append(None)
                if self.spec.unread == "loss":
                    unread = value if unread is None else unread + value
                elif self.spec.unread == "returned":
                    returned.append(value)
                # "dead": dropped here, never read.
        out = values[-1]
        assert out is not None
        logits = self.head(out if unread is None else out + unread)
        return (logits, *returned) if self.spec.unread == "returned" else logits

    def _take(self, values: list[Tensor | None], k: int) -> list[Tensor]:
        """The values layer ``k`` reads, each dropped from ``values`` after its last reader."""
        parts = []
        for i in self.spec.layers[k].reads:
            value = values[i]
            assert value is not None
            parts.append(value)
            if self.last_reader[i] == k:
                values[i] = None
        return parts

    def _layer(self, k: int, parts: list[Tensor]) -> Tensor:
        layer = self.spec.layers[k]
        if len(parts) == 1:
            h = parts.pop()
        elif layer.combine == "sum":
            h = parts.pop(0)
            while parts:
                h = h + parts.pop(0)
        elif layer.combine == "cat":
            h = torch.cat(parts, dim=-1)
            parts.clear()
            h = self.combiners[k](h)
        else:
            gate = torch.sigmoid(parts.pop(0))
            h = parts.pop(0)
            while parts:
                h = h + parts.pop(0)
            h = gate * h
        h = self.ops[k](h)
        if layer.op == "linear_relu":
            h = F.relu(h)
        elif layer.op == "tanh":
            h = torch.tanh(h)
        return h


def build(spec: GraphSpec, seed: int = 0) -> RandomGraph:
    """The model of ``spec``, initialised from ``seed``, in train mode."""
    torch.manual_seed(seed)
    return RandomGraph(spec).train()


def example_inputs(spec: GraphSpec, seed: int = 1) -> tuple[Tensor, ...]:
    """One batch of inputs for ``spec`` (leaves requiring grad when the spec says so)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(spec.batch, WIDTH, generator=gen).requires_grad_(
        spec.inputs_require_grad) for _ in range(spec.inputs))


def targets(spec: GraphSpec) -> Tensor:
    """Class labels for the classifier head."""
    return torch.arange(spec.batch) % 10


def cross_entropy(spec: GraphSpec):  # type: ignore[no-untyped-def]
    """The loss every test trains these models with."""
    labels = targets(spec)

    def loss(out: Tensor | tuple[Tensor, ...]) -> Tensor:
        # The logits only: what a model returns beside them is no part of the loss.
        return F.cross_entropy(out[0] if isinstance(out, tuple) else out, labels)

    return loss


def seeded_spec(seed: int) -> GraphSpec:
    """A graph drawn the way tests/test_random_graphs.py draws them, from a seeded
    ``random.Random`` (benchmarks/estimate_accuracy.py's seeds): reproducible without
    hypothesis."""
    rng = random.Random(seed)
    inputs = rng.randint(1, 3)
    layers = []
    for k in range(rng.randint(4, 20)):
        latest = inputs + k - 1
        extra = rng.sample(range(latest + 1), k=min(rng.randint(0, 2), latest + 1))
        layers.append(LayerSpec(reads=tuple(sorted({latest, *extra})),
                                combine=rng.choice(COMBINES), op=rng.choice(OPS),
                                frozen=rng.randint(0, 5) == 0))
    return GraphSpec(inputs=inputs, inputs_require_grad=rng.random() < 0.5,
                     layers=tuple(layers), batch=rng.choice((64, 256)))
