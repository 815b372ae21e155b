"""Watching the ops a forward runs: the layer under every stage.

Takes: code to run (a forward, a training step) on real or fake tensors.
Hands on: :class:`~autockpt.ops.instrument.OpWatch`, the one ``TorchDispatchMode`` of autockpt,
which tells an :class:`~autockpt.ops.instrument.OpObserver` about each ATen op before and after
it runs (the capture's random-draw guards, the profile, timing, the measured step and the
diagnosis are observers); FLOP tallies, live-storage accounting, and
:mod:`~autockpt.ops.fake_outputs`, the memo of fake ops' outputs from their first run.

Modules: ``instrument`` (the watch, its observers' protocol, storages and FLOPs),
``fake_outputs`` (outputs of ops on fake tensors remembered by their inputs' shapes),
``kept`` (the matmuls, convolutions and attention kernels a segment may keep, and torch's
selective checkpoint policy that keeps them).
"""

from autockpt.ops.instrument import Op, OpObserver, OpWatch

__all__ = ["Op", "OpObserver", "OpWatch"]
