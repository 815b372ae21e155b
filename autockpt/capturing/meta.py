"""Planning a model built on the meta device ("Will it fit on my GPU?" in the README).

# NOTE [ Autocast on the meta device ]
A model built under ``torch.device("meta")`` is planned from tensors that have shapes and no
values: capture, profile and replay run its forward on meta (or fake meta) tensors. torch has
no autocast for the meta device: ``torch.autocast(device_type="meta", ...)`` raises in its
constructor (``get_autocast_dtype`` knows no dtype for it, and ``is_autocast_available("meta")``
is False), whether or not it is enabled, and ``torch.is_autocast_enabled("meta")`` raises too.
Models enter autocast with their tensors' device type to force float32 in a stretch: rotary
embeddings (Hugging Face Llama, Qwen2 and Gemma before ``maybe_autocast``), attention
upcasts, layer norms: ``with torch.autocast(device_type=x.device.type, enabled=False)``. On
the meta device that line raised, and the plan failed although the model is fine.

A disabled autocast on a device type that has no autocast is exactly a no-op: no autocast can be on
for "meta" (torch cannot enable it), so there is nothing to disable, and the ops inside run in the
dtypes they would run in anyway. So while autockpt plans a model with meta tensors
(:func:`meta_autocast`, around every stage of :mod:`autockpt.pipeline`: the capture rungs, the
profile, the budget and the replay, which are all the places autockpt runs the forward while it
plans), an autocast constructed for "meta" on the planning thread with ``enabled=False`` enters and
exits doing nothing. With ``enabled=True`` the model asks for lower-precision activations on the
device it will train on; which ops autocast changes and to what is that device's (CUDA's lists are
not CPU's), and meta tensors have no autocast dispatch key to apply any list, so the plan cannot be
made faithfully: :class:`MetaAutocastError` says so and how to plan instead, rather than a plan for
the wrong activation sizes.

How: for the planning's duration, the ``__init__``, ``__enter__`` and ``__exit__`` of torch's
own autocast class are wrapped, not the names ``torch.autocast`` / ``torch.amp.autocast``
replaced: the class stays the same object (``isinstance`` checks, torch.compile's recognition
of it, and a model that imported ``autocast`` by name all see torch's class), and the
subclasses (``torch.cpu.amp.autocast``...) inherit the wrapping. The wrappers call torch's
methods unchanged for every device type but "meta" and on every thread that is not planning
a meta model (a thread-local count), so another thread's autocast, meta or not, behaves as
without autockpt. Installing and removing are counted under a lock: nested or concurrent
plans share one installation, and the last to finish puts torch's own functions back, the
very objects that were there (checked by identity in the tests), or leaves alone whatever
another library put there meanwhile. Autocast entered in autockpt's own code (the chunked
head asks whether autocast is on) goes through :func:`autocast_enabled`, which answers False
for a device type autocast does not know.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from autockpt.errors import InvalidArgumentError

__all__ = ["MetaAutocastError", "autocast_enabled", "forward_failed", "meta_autocast",
           "meta_parts"]


class MetaAutocastError(InvalidArgumentError):
    """The model enters ``torch.autocast(device_type="meta", enabled=True)`` while it is
    planned on the meta device (NOTE [ Autocast on the meta device ])."""


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for a device type autocast does not
    know ("meta"), where torch raises.

    Example:
        >>> autocast_enabled("meta"), autocast_enabled("cpu")
        (False, False)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_enabled("cpu")
        True
    """
    if not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def meta_parts(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Which of ``module``'s parameters, buffers and the example inputs are on the meta
    device: ``["model's parameters", "example inputs"]``, or an empty list.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 2)
        >>> meta_parts(net, (torch.zeros(1, 2),), {})
        ["model's parameters"]
    """
    parts = []
    if any(p.is_meta for p in module.parameters()):
        parts.append("model's parameters")
    if any(b.is_meta for b in module.buffers()):
        parts.append("model's buffers")
    leaves = pytree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
        parts.append("example inputs")
    return parts


def forward_failed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   err: BaseException, *, name: str | None = None,
                   fix: str = "check that the example inputs have the shapes and dtypes the "
                   "model expects (call model(*example_inputs) once to see the error in full)"
                   ) -> InvalidArgumentError:
    """The error for a forward that failed on the example inputs. Where the model or the
    inputs are on the meta device, the message blames that device and not the inputs: meta
    tensors have shapes and no values, so code the inputs suit elsewhere can fail there
    (``name`` is the model's class name, by default ``type(module).__name__``).

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 2)
        >>> print(forward_failed(net, (), {}, RuntimeError("no data")).message)
        Linear.forward failed on the meta device (the model's parameters are meta tensors, \
which have shapes and no values; inputs none): RuntimeError: no data
    """
    from autockpt.capturing.trace import describe_inputs

    name = type(module).__name__ if name is None else name
    on_meta = meta_parts(module, args, kwargs)
    if on_meta:
        return InvalidArgumentError(
            f"{name}.forward failed on the meta device (the {' and '.join(on_meta)} are "
            f"meta tensors, which have shapes and no values; inputs "
            f"{describe_inputs(args, kwargs) or 'none'}): {type(err).__name__}: {err}",
            fix="call the model once on these meta inputs to see the error in full: code "
            "that reads a tensor's values (.item(), float(t), a branch on a tensor) or an op "
            "with no meta kernel cannot run on meta; skip it for meta tensors, or plan the "
            "model on a real device. If the model runs on meta and autockpt does not, that "
            "is autockpt's bug: please report it")
    return InvalidArgumentError(
        f"{name}.forward failed on the example inputs ({describe_inputs(args, kwargs)}): "
        f"{type(err).__name__}: {err}", fix=fix)


_AUTOCAST = torch.amp.autocast_mode.autocast
_lock = threading.Lock()
_installed: dict[str, Any] = {}  # torch's own methods while the wrappers are in place
_users = 0  # plans (any thread) inside meta_autocast
_local = threading.local()  # .depth: meta_autocast levels entered on this thread


def _planning_here() -> bool:
    return getattr(_local, "depth", 0) > 0


def _wrapped_init(original: Any) -> Any:
    def __init__(self: Any, device_type: str, dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None) -> None:
        # A string: torch.fx hands a Proxy here, which must not be compared (and fails).
        if not (_planning_here() and isinstance(device_type, str) and device_type == "meta"):
            original(self, device_type, dtype=dtype, enabled=enabled,
                     cache_enabled=cache_enabled)
            return
        if enabled:
            raise MetaAutocastError(
                f"the model enters torch.autocast(device_type='meta', enabled=True"
                f"{'' if dtype is None else f', dtype={dtype}'}) while it is planned on the "
                "meta device: torch has no autocast for meta tensors, so the activation "
                "dtypes autocast would give on the device you train on cannot be planned "
                "there",
                fix="build the model in the dtype autocast would give (e.g. "
                ".to(torch.bfloat16)) and let it skip autocast on meta (enabled=x.device.type "
                "!= 'meta'), or plan it on the device you train on under torch.autocast")
        # A disabled autocast on a device type that has none: nothing to disable.
        self.device = device_type
        self.fast_dtype = dtype
        self._enabled = False
        self._cache_enabled = cache_enabled
        self._autockpt_meta_noop = True
    return __init__


def _wrapped_enter(original: Any) -> Any:
    def __enter__(self: Any) -> Any:
        if self.__dict__.get("_autockpt_meta_noop"):
            return self
        return original(self)
    return __enter__


def _wrapped_exit(original: Any) -> Any:
    def __exit__(self: Any, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
        if self.__dict__.get("_autockpt_meta_noop"):
            return False
        return original(self, exc_type, exc_val, exc_tb)
    return __exit__


_WRAPPERS = {"__init__": _wrapped_init, "__enter__": _wrapped_enter, "__exit__": _wrapped_exit}


def _install() -> None:
    global _users
    with _lock:
        if _users == 0:
            for name, wrap in _WRAPPERS.items():
                original = _AUTOCAST.__dict__[name]
                wrapper = wrap(original)
                wrapper.__wrapped__ = original  # type: ignore[attr-defined]
                _installed[name] = (original, wrapper)
                setattr(_AUTOCAST, name, wrapper)
        _users += 1


def _remove() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for name, (original, wrapper) in _installed.items():
                # Whatever another library put there since is its own: left as it is.
                if _AUTOCAST.__dict__.get(name) is wrapper:
                    setattr(_AUTOCAST, name, original)
            _installed.clear()


@contextlib.contextmanager
def meta_autocast(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> Iterator[None]:
    """While planning ``module`` on these inputs, if any of them is on the meta device: a
    ``torch.autocast(device_type="meta", enabled=False)`` on this thread does nothing, and
    ``enabled=True`` raises :class:`MetaAutocastError` (NOTE [ Autocast on the meta device ]).
    torch's autocast is exactly as it was afterwards, and on other threads throughout.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 2)
        >>> with meta_autocast(net, (), {}):
        ...     with torch.autocast("meta", enabled=False):
        ...         print(net(torch.zeros(1, 2, device="meta")).shape)
        torch.Size([1, 2])
    """
    if not meta_parts(module, args, kwargs):
        yield
        return
    _install()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        _remove()
