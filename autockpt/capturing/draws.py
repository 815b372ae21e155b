"""Guards on random draws while autockpt runs a user's forward to capture or plan it.

Two observers of :class:`autockpt.ops.instrument.OpWatch`, the one dispatch mode through which
autockpt watches ops: :class:`NoRealDraw` refuses a random op run for real while torch.fx
traces (NOTE [ A random draw while tracing ]), and
:func:`no_layer_dropped` makes LayerDrop keep every layer in the forwards autockpt runs to plan
(NOTE [ A random scalar in a real forward ] below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from autockpt.ops.instrument import Op, OpObserver, OpWatch

__all__ = ["NoLayerDropped", "NoRealDraw", "no_layer_dropped", "python_draws_high"]


# NOTE [ A random scalar in a real forward ]
# LayerDrop (Hugging Face's M2M100, NLLB, older BART) draws ``torch.rand([])`` in forward and
# skips the layer when it is below the drop probability. Fake tensors cannot compare it, so
# such a model's blocks are found on one real forward; a layer that forward skipped was never
# a block, never checkpointed, and the steps that run it (most of them) measured 52% of the
# baseline where one that checkpoints every layer measures 34% (M2M100, 2 + 2 layers, 5%).
# So in the real forwards autockpt runs to plan (this profile, and the replay of
# ``autockpt.running.replay``), a scalar drawn by ``aten.rand`` is the largest value below 1: every
# layer runs, and the plan prices the step that keeps them all, the most a step can take.
# The draw itself still runs, so the random stream advances as it would, and is restored
# afterwards in any case. LayerDrop drawn with Python's ``random`` or numpy's global generator
# (Wav2Vec2's adapter, MusicGen: ``np.random.random()``, ``random.uniform(0, 1)``) is met the
# same way, in fake forwards too: while autockpt runs such a forward, those draws return the
# largest value below their upper end, and both generators are put back afterwards.


class NoLayerDropped(OpObserver):
    """Makes each scalar ``aten.rand`` draws the largest value below 1, after the draw (NOTE
    [ A random scalar in a real forward ])."""

    def after_op(self, op: Op, out: Any) -> None:
        if op.func is torch.ops.aten.rand.default and isinstance(out, torch.Tensor) \
                and out.dim() == 0 and out.is_floating_point():
            one = torch.ones((), dtype=out.dtype, device=out.device)
            out.copy_(torch.nextafter(one, torch.zeros_like(one)))


@contextlib.contextmanager
def no_layer_dropped() -> Iterator[None]:
    """Random scalars drawn by ``torch.rand([])``, Python's ``random`` and numpy's global
    generator are the largest value below their upper end (NOTE [ A random scalar in a real
    forward ])."""
    with OpWatch(NoLayerDropped()), python_draws_high():
        yield


_BELOW_ONE = float(np.nextafter(1.0, 0.0))


@contextlib.contextmanager
def python_draws_high() -> Iterator[None]:
    """Python's and numpy's uniform draws give the largest value below their upper end
    meanwhile; both generators are put back afterwards (NOTE [ A random scalar in a real
    forward ])."""
    import random

    def top(low: float = 0.0, high: float = 1.0, size: Any = None) -> Any:
        value = float(np.nextafter(max(low, high), min(low, high)))
        return value if size is None else np.full(size, value)

    patches = [(random, "random", lambda: _BELOW_ONE),
               (random, "uniform", lambda a, b: top(a, b)),
               (np.random, "random", lambda size=None: top(size=size)),
               (np.random, "random_sample", lambda size=None: top(size=size)),
               (np.random, "rand", lambda *shape: top(size=shape or None)),
               (np.random, "uniform", top)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


# NOTE [ A random draw while tracing ]
# torch.fx runs an op none of whose arguments is traced for real, at trace time, and the
# graph keeps its result. For a random op (``torch.rand([])`` deciding whether LayerDrop
# skips a layer) that is one draw fixed for every step: the layers it skipped would be
# skipped in training for good and the others never, silently. Such a forward is refused,
# so the next rung takes it (torch.export traces the draw and then refuses the branch on
# it; the modules rung runs the user's own forward). The capture's draws are not the
# user's either: ``autockpt.capturing.ladder.capture`` restores the random streams.


class NoRealDraw(OpObserver):
    """Raises on a random op run for real while torch.fx traces (NOTE [ A random draw while
    tracing ])."""

    def before_op(self, op: Op) -> None:
        if op.random:
            raise RuntimeError(
                f"{op.func} drew random values at trace time, with no traced argument: the "
                "graph would keep this one draw for every step")
