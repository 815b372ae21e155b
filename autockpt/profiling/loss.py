"""The loss of a training step: the one default, the named losses, and checking a user's.

Every entry point that runs or plans a step (``apply``, ``plan``, ``measure``, ``diagnose``,
``memory_curves`` and the command line) takes ``loss_fn(output) -> scalar tensor`` with the
same meaning, and without it uses the same default, :func:`default_loss`.

# NOTE [ The default loss ]
A model whose output holds its own loss (a Hugging Face model given ``labels=``, any model
that returns a mapping with a scalar ``"loss"``, or that returns a scalar, as
:func:`with_loss` does) is trained on that loss: the default is that tensor, as the user's
``outputs = model(**batch); outputs.loss.backward()`` does, and the logits beside it get no
gradient from the loss; they are held through backward all the same, as ``outputs`` holds
them (NOTE [ The loss node ] in :mod:`autockpt.profiling.profile`). Any other output is reduced by
summing every floating-point tensor that requires grad, in at least float32 without a
converted copy. Such a sum sends a broadcast scalar into the output, which costs no memory,
while every real loss (cross-entropy, MSE) sends an output-sized gradient and often saves
output-sized tensors of its own: planning without ``loss_fn`` therefore assumes an
output-sized gradient for each such output (never optimistic), and says so in the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autockpt.errors import InvalidArgumentError

__all__ = ["LossFn", "NAMED_LOSSES", "default_loss", "inner_loss", "named_loss", "check_loss_fn",
           "output_tensors", "output_parts", "call_loss", "planned_loss", "WithLoss",
           "with_loss"]

LossFn = Callable[[Any], torch.Tensor]
"""``loss_fn(output) -> scalar tensor``: what a training step backpropagates from."""


def output_tensors(obj: Any, _seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor in a nested value, once: tuples, lists, sets, mappings (``ModelOutput``
    included) and dataclass instances are walked.

    Example:
        >>> t = torch.ones(2)
        >>> len(list(output_tensors({"a": t, "b": [t, torch.zeros(1)]})))
        2
    """
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        yield obj
        return
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from output_tensors(value, seen)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for item in obj:
            yield from output_tensors(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from output_tensors(getattr(obj, f.name), seen)


def output_parts(output: Any) -> list[tuple[str, list[torch.Tensor]]]:
    """The tensors of an output by the name of its top-level part, each tensor once: the keys
    of a mapping (a ``ModelOutput``'s ``loss``, ``logits``, ...), the fields of a dataclass,
    ``[i]`` for the items of a tuple or list, ``output`` for a tensor or anything else.

    Example:
        >>> t = torch.ones(2)
        >>> [(name, len(ts)) for name, ts in output_parts({"loss": t, "hidden": (t, t * 2)})]
        [('loss', 1), ('hidden', 1)]
    """
    seen: set[int] = set()
    if isinstance(output, Mapping):
        named = [(str(key), value) for key, value in output.items()]
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        named = [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
    elif isinstance(output, (tuple, list)):
        named = [(f"[{i}]", item) for i, item in enumerate(output)]
    else:
        named = [("output", output)]
    return [(name, list(output_tensors(value, seen))) for name, value in named]


def inner_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself: a scalar floating-point tensor that requires grad,
    returned as the output itself (:func:`with_loss`) or under the key (or attribute)
    ``loss`` of a mapping or dataclass output, else None.

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> inner_loss({"loss": x.sum(), "logits": x}) is not None, inner_loss(x)
        (True, None)
    """
    value: Any = output if isinstance(output, torch.Tensor) and output.dim() == 0 else None
    if isinstance(output, Mapping):
        value = output.get("loss")
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        value = getattr(output, "loss", None)
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()
            and value.requires_grad):
        return value
    return None


def default_loss(output: Any) -> torch.Tensor | None:
    """The loss every entry point uses without ``loss_fn`` (NOTE [ The default loss ]): the
    model's own loss when its output holds one, else the sum of every floating-point tensor
    that requires grad; None when there is nothing to differentiate.

    Example:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> default_loss((x * 2, torch.arange(3)))
        tensor(12., grad_fn=<SumBackward0>)
    """
    own = inner_loss(output)
    return own if own is not None else _sum_of_outputs(output)


def planned_loss(output: Any) -> torch.Tensor:
    """The loss a plan prices when it is given none (NOTE [ The default loss ]): the model's own
    loss when its output holds one, else a new gradient the size of each floating-point output that
    requires grad, all made when backward starts, as from a real loss. A replay of the plan
    (:mod:`autockpt.running.replay`) runs it; a step measured with it holds the whole output through
    backward, the model's own loss or not, as the default does.

    Example:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> planned_loss(x * 2).backward()
        >>> x.grad  # the zeros a real loss's gradient stands for, times 2
        tensor([[0., 0., 0.],
                [0., 0., 0.]])
    """
    own = inner_loss(output)
    if own is not None:
        return own
    outputs = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not outputs:
        raise InvalidArgumentError("the output holds no floating-point tensor that requires "
                                   "grad", fix="pass loss_fn")
    return _OutputSizedGradient.apply(*outputs)


class _OutputSizedGradient(torch.autograd.Function):
    """A zero loss whose backward hands each of its inputs a new gradient of its size."""

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outputs]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        return tuple(torch.zeros(shape, dtype=dtype, device=device)
                     for shape, dtype, device in ctx.shapes)


def _sum_of_outputs(output: Any) -> torch.Tensor | None:
    # ``t.sum(dtype=float32)`` reduces a half-precision output in float32 without the
    # output-sized copy that ``t.float().sum()`` would make.
    total: torch.Tensor | None = None
    for tensor in output_tensors(output):
        if not (tensor.is_floating_point() and tensor.requires_grad):
            continue
        part = tensor.sum(dtype=torch.promote_types(tensor.dtype, torch.float32))
        total = part if total is None else total + part
    return total


# --------------------------------------------------------------------------- named losses


def _logits(output: Any, name: str) -> torch.Tensor:
    own = inner_loss(output)
    if isinstance(output, Mapping) and "logits" in output:
        output = output["logits"]
    elif own is None and not isinstance(output, torch.Tensor):
        tensors = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
        if tensors:
            output = tensors[0]
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise InvalidArgumentError(
            f"the {name!r} loss needs a floating-point tensor output (or a mapping with "
            f"'logits'), got {type(output).__name__}",
            fix="pass loss_fn=... with your own loss in Python, or --loss sum",
        )
    return output


def _targets(shape: tuple[int, ...], high: int, device: torch.device) -> torch.Tensor:
    # Fixed seed: the same targets every call, without touching the global RNG.
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, max(high, 1), shape, generator=generator)
    return target.to(device) if device.type != "meta" else target.to("meta")


def cross_entropy_loss(output: Any) -> torch.Tensor:
    """Cross-entropy of the logits (the last dimension holds the classes) against fixed
    random targets, as a classifier or a language model's head is trained.

    Example:
        >>> cross_entropy_loss(torch.zeros(4, 10, requires_grad=True)).item() > 0
        True
    """
    logits = _logits(output, "cross_entropy")
    if logits.dim() < 2:
        raise InvalidArgumentError(
            f"the 'cross_entropy' loss needs logits with a class dimension, got shape "
            f"{tuple(logits.shape)}", fix="use --loss mse or --loss sum for this output")
    flat = logits.reshape(-1, logits.shape[-1])
    target = _targets((flat.shape[0],), logits.shape[-1], logits.device)
    return F.cross_entropy(flat, target)


def mse_loss(output: Any) -> torch.Tensor:
    """Mean squared error of the output against zeros (an image or regression output).

    Example:
        >>> mse_loss(torch.ones(2, 3, requires_grad=True)).item()
        1.0
    """
    prediction = _logits(output, "mse")
    return F.mse_loss(prediction, torch.zeros_like(prediction))


def sum_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point output tensor that requires grad, the model's own loss
    among them if it returns one; it sends no output-sized gradient.

    Example:
        >>> sum_loss(torch.ones(2, 3, requires_grad=True)).item()
        6.0
    """
    total = _sum_of_outputs(output)
    if total is None:
        raise InvalidArgumentError("the output holds no floating-point tensor that requires grad",
                                   fix="check that the model has trainable parameters")
    return total


NAMED_LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy_loss,
    "mse": mse_loss,
    "sum": sum_loss,
}
"""Losses the command line names with ``--loss``."""


def named_loss(name: str) -> LossFn:
    """The loss called ``name`` in :data:`NAMED_LOSSES`.

    Example:
        >>> named_loss("mse").__name__
        'mse_loss'
    """
    try:
        return NAMED_LOSSES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown loss {name!r}", fix=f"use one of: {', '.join(NAMED_LOSSES)}"
        ) from None


def check_loss_fn(loss_fn: Any) -> LossFn | None:
    """Validate a ``loss_fn`` argument: None, a callable, or the name of a named loss.

    Example:
        >>> check_loss_fn("sum").__name__
        'sum_loss'
    """
    if loss_fn is None:
        return None
    if isinstance(loss_fn, str):
        return named_loss(loss_fn)
    if not callable(loss_fn):
        raise InvalidArgumentError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}",
            fix="pass loss_fn=lambda out: torch.nn.functional.cross_entropy(out, y), the name "
            f"of a built-in loss ({', '.join(NAMED_LOSSES)}), or None",
        )
    return loss_fn


def call_loss(loss_fn: LossFn | None, output: Any, subject: str) -> torch.Tensor:
    """The scalar loss of ``output``: ``loss_fn(output)``, or :func:`default_loss`; a clear
    error when it is not a scalar tensor that requires grad."""
    if loss_fn is None:
        loss = default_loss(output)
        if loss is None:
            raise InvalidArgumentError(
                f"the output of {subject} holds no floating-point tensor that requires grad, "
                "so there is no backward",
                fix="give the model trainable parameters (requires_grad=True), do not run it "
                "under torch.inference_mode(), or pass loss_fn",
            )
        return loss
    try:
        loss = loss_fn(output)
    except InvalidArgumentError:
        raise
    except Exception as err:
        raise InvalidArgumentError(
            f"loss_fn raised {type(err).__name__} on the output of {subject}: {err}",
            fix="loss_fn receives exactly what forward returns and must return a scalar tensor",
        ) from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
               else f"a {type(loss).__name__}")
        raise InvalidArgumentError(f"loss_fn must return a scalar tensor, got {got}",
                                   fix="reduce the loss, e.g. return loss.mean()")
    if not loss.requires_grad:
        raise InvalidArgumentError(
            "the tensor returned by loss_fn does not require grad, so there is no backward",
            fix="compute the loss from the model output without .detach() or torch.no_grad()",
        )
    return loss


# --------------------------------------------------------------------------- the loss inside


class WithLoss(nn.Module):
    """``model`` and a loss in one module: ``forward(input, target)`` returns
    ``loss_fn(model(input), target)``. Made by :func:`with_loss`.

    The model is the submodule ``model`` (its state dict keys gain the prefix ``model.``;
    save ``wrapper.model.state_dict()`` to keep the model's own keys)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, input: Any, target: Any) -> torch.Tensor:  # noqa: A002 - torch's name
        return self.loss_fn(self.model(input), target)


def with_loss(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> WithLoss:
    """``model`` with its loss inside the forward, so that ``autockpt.apply`` plans the loss
    with the model, and can run a language model's head and cross-entropy in chunks of tokens
    (NOTE [ The head in chunks of rows ] in :mod:`autockpt.planning.head`), without changing the
    model's class. ``loss_fn(output, target)`` must be traceable as the model is (torch
    functions and modules, no Python branches on tensor values).

    Example:
        >>> import torch, autockpt
        >>> lm = torch.nn.Sequential(torch.nn.Embedding(512, 32), torch.nn.LayerNorm(32),
        ...                          torch.nn.Linear(32, 512))
        >>> def loss_fn(logits, target):
        ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        >>> step = autockpt.with_loss(lm, loss_fn)
        >>> ids = torch.randint(0, 512, (4, 64))
        >>> step(ids, ids).backward()

    Raises:
        InvalidArgumentError: ``model`` is not a module or ``loss_fn`` is not callable.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"with_loss needs an nn.Module, got {type(model).__name__}",
                                   fix="pass the model itself: autockpt.with_loss(model, loss_fn)")
    if not callable(loss_fn):
        raise InvalidArgumentError(
            f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}",
            fix="pass e.g. lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())")
    return WithLoss(model, loss_fn)
