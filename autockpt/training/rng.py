"""Capture and restore of every RNG a training step draws from: Python ``random``, NumPy's
global RNG, torch CPU and each CUDA device."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng_state(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """This process's RNG states as JSON-able data, torch states moved into ``tensors``."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [str(name), keys.tolist(), int(pos), int(has_gauss), float(cached)]
    tensors.append(torch.get_rng_state())
    state["torch_cpu"] = len(tensors) - 1
    if torch.cuda.is_available():
        cuda_states = torch.cuda.get_rng_state_all()
        state["cuda"] = list(range(len(tensors), len(tensors) + len(cuda_states)))
        tensors.extend(cuda_states)
    return state


def restore_rng_state(
    state: Mapping[str, Any], tensors: list[torch.Tensor], warn: type[Warning]
) -> None:
    """Set this process's RNGs to a state made by :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np = _numpy()
    if "numpy" in state:
        if np is None:
            warnings.warn(
                "the checkpoint holds a NumPy RNG state but NumPy is not installed here; "
                "np.random draws will differ from the uninterrupted run",
                warn,
                stacklevel=4,
            )
        else:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors[state["torch_cpu"]].to("cpu", torch.uint8))
    cuda_ids = state.get("cuda", [])
    if cuda_ids and torch.cuda.is_available():
        if len(cuda_ids) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint holds RNG states of {len(cuda_ids)} CUDA devices but this "
                f"process sees {torch.cuda.device_count()}; CUDA RNG states were not restored",
                warn,
                stacklevel=4,
            )
        else:
            torch.cuda.set_rng_state_all([tensors[i].to("cpu", torch.uint8) for i in cuda_ids])
