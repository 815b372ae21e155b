"""The modules rung, run: the chosen blocks checkpointed inside the transformed twin.

The last rung of the capture ladder plans and checkpoints at the level of submodules.

When no graph can be captured (data-dependent Python control flow, ``.item()`` in forward,
calls into non-torch code), autockpt can still checkpoint the model's repeated blocks
(``transformer.h.0``, ``transformer.h.1``...) by wrapping their ``forward`` in
``torch.utils.checkpoint.checkpoint``. Three steps:

1. :func:`autockpt.profiling.blocks.profile_modules` runs one forward with hooks on every submodule
   and records, per module call in execution order, its input, output and saved-for-backward bytes,
   FLOPs, random ops and buffer updates; it picks the chain of blocks
   (:func:`~autockpt.profiling.blocks.choose_blocks`) and restates the forward as a
   :class:`~autockpt.profiling.stats.Profile` over that chain.
2. :func:`autockpt.planning.blocks.plan_modules` hands that profile to
   :func:`autockpt.planning.planner.make_plan` (strategies, budgets and ``InfeasibleBudgetError``
   work as for a traced graph) and maps the plan's checkpointed node ranges back to blocks.
3. :func:`install` replaces the chosen blocks inside the transformed twin (never in the
   user's module tree) by views whose forward runs under checkpoint in train mode.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = nn.ModuleList(
    ...             nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    ...             for _ in range(6))
    ...     def forward(self, x):
    ...         if x.sum() > 0:          # data-dependent: torch.fx cannot trace this
    ...             x = -x
    ...         for block in self.blocks:
    ...             x = block(x)
    ...         return x
    >>> net, x = Net(), torch.randn(32, 64)
    >>> from autockpt.planning.blocks import build
    >>> from autockpt.capturing.trace import shallow_view
    >>> plan, prof = build(net, (x,), {}, budget_bytes=None)
    >>> prof.blocks[:2]
    ('blocks.0', 'blocks.1')
    >>> twin = shallow_view(net)        # the runtime's twin is such a view, of a subclass
    >>> install(twin, prof, plan)
    >>> is_installed(twin)[:2]
    ('blocks.0', 'blocks.1')
    >>> twin(x).sum().backward()
    >>> type(net.blocks[0]) is nn.Sequential, twin.blocks[0] is not net.blocks[0]
    (True, True)
    >>> twin.blocks[0][0].weight is net.blocks[0][0].weight
    True

# NOTE [ One checkpoint per block ]
A segment of the plan covering blocks ``a..b`` runs as ``b - a + 1`` checkpoints, one per
block: the blocks are called by the user's own Python code, with arbitrary code between the
calls, so a run of them cannot be re-executed as one function. Each checkpoint keeps its
block's inputs, so the tensors passed from one block to the next are held whatever the plan.
The profile says so to the planner: a storage that one block produces and a later block reads
gets a phantom reader two nodes on, which makes it *long-lived* in the memory model of
:mod:`autockpt.chain` (held from its producer on). The planner's recompute term for a
multi-block segment counts all its blocks at once, while one block at a time is recomputed
here: the estimate errs on the safe side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autockpt.capturing.trace import base_class, generated_subclass, shallow_view
from autockpt.errors import AutockptError, InvalidArgumentError
from autockpt.planning.blocks import blocks_of_plan, needs_dummy
from autockpt.planning.planner import MODES, Plan
from autockpt.profiling.blocks import ModuleProfile
from autockpt.running.runner import CheckpointedForward, SegmentRun, run_checkpointed

__all__ = ["BlockSpec", "install", "installed", "is_installed", "suspended"]

@dataclass(frozen=True)
class BlockSpec:
    """How one block view runs its forward under checkpoint."""

    qualname: str
    """The block's qualified name in the model."""
    mode: str
    """``"non_reentrant"`` or ``"reentrant"``."""
    preserve_rng: bool
    """Whether random ops ran in it: the RNG state is stashed and replayed."""
    buffers: tuple[str, ...]
    """Buffers it updates, relative to the block: cloned during the recompute."""
    trainable: bool
    """Whether it has parameters that require grad."""
    dummy_arg: bool
    """Whether it gets the reentrant dummy argument (NOTE [ The dummy argument ] in
    :mod:`autockpt.running.runner`): decided from the profile, see :func:`needs_dummy`."""
    carries_grad: bool
    """Whether gradient flows through it (trainable parameters, or a tensor argument that
    requires grad); one without runs plainly, as checkpoint would save nothing."""


_TENSOR = object()
"""Where a block's output structure had a tensor (see :func:`_run_block`)."""


def _run_block(block: nn.Module, spec: BlockSpec, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """Run ``block``'s own forward under checkpoint
    (:func:`autockpt.running.runner.run_checkpointed`).

    Checkpoint is handed the tensors of the call only, flattened: reentrant checkpoint
    takes no keyword arguments and gives gradients only to top-level tensor arguments and
    outputs. Everything else (flags, ``None``, caches) is bound in the closure, and the
    output's structure is rebuilt from the first call."""
    base_forward = block._autockpt_base.forward  # type: ignore[attr-defined]
    if not spec.carries_grad:
        return base_forward(block, *args, **kwargs)
    leaves, tree = tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = tuple(leaves[i] for i in slots)
    first: dict[str, Any] = {}

    def fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(leaves)
        for i, t in zip(slots, flat):
            values[i] = t
        call_args, call_kwargs = tree_unflatten(values, tree)
        out_leaves, out_tree = tree_flatten(base_forward(block, *call_args, **call_kwargs))
        if not first:
            # Only the structure: checkpoint keeps ``fn`` until backward, and an output
            # tensor kept here would outlive the caller's use of it (a Hugging Face block's
            # attention weights, which its stack drops at once, were held until backward).
            first["leaves"] = [_TENSOR if isinstance(v, torch.Tensor) else v
                               for v in out_leaves]
            first["tree"] = out_tree
        return tuple(v for v in out_leaves if isinstance(v, torch.Tensor))

    run = SegmentRun(module=block, segment=None, block=spec.qualname, mode=spec.mode,
                     dummy_arg=spec.dummy_arg)
    result = run_checkpointed(run, fn, tensors, preserve_rng=spec.preserve_rng,
                              buffers=spec.buffers)
    outputs = iter(result)
    rebuilt = [next(outputs) if v is _TENSOR else v for v in first["leaves"]]
    return tree_unflatten(rebuilt, first["tree"])


def _rebuild_block(base: type[nn.Module]) -> nn.Module:
    cls = _block_class(base)
    return object.__new__(cls)  # see shallow_view


class _BlockMixin(CheckpointedForward):
    """Methods added to a block's class in the twin: only ``forward`` changes."""

    _autockpt_rebuild = staticmethod(_rebuild_block)

    def _autockpt_how(self) -> BlockSpec | None:
        return self.__dict__.get("_autockpt_block")

    def _autockpt_forward(self, how: BlockSpec, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        return _run_block(self, how, args, kwargs)  # type: ignore[arg-type]


def _block_class(base: type[nn.Module]) -> type[nn.Module]:
    return generated_subclass(_BlockMixin, base)


def _replace_child(parent: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` was in ``parent`` (a view owned by the twin): in its
    submodules and in plain lists, tuples and dicts of its attributes that hold ``old``."""
    parent._modules[name] = new
    for key, value in list(parent.__dict__.items()):
        if isinstance(value, list) and any(v is old for v in value):
            parent.__dict__[key] = [new if v is old else v for v in value]
        elif isinstance(value, tuple) and any(v is old for v in value):
            parent.__dict__[key] = tuple(new if v is old else v for v in value)
        elif isinstance(value, dict) and key not in ("_modules", "_parameters", "_buffers") \
                and not key.startswith("_") and any(v is old for v in value.values()):
            parent.__dict__[key] = {k: new if v is old else v for k, v in value.items()}


def _owned_view(parent: nn.Module, name: str) -> nn.Module:
    """The child ``name`` of ``parent``, made a view owned by the twin if it is not one."""
    child = parent._modules[name]
    if child is None:
        raise AutockptError(f"submodule {name!r} is None in the transformed model")
    if child.__dict__.get("_autockpt_view"):
        return child
    cls = _block_class(base_class(child)) if isinstance(child, _BlockMixin) else type(child)
    view = shallow_view(child, cls)
    view.__dict__["_autockpt_view"] = True
    if "_autockpt_block" in child.__dict__:
        view.__dict__["_autockpt_block"] = child.__dict__["_autockpt_block"]
    _replace_child(parent, name, child, view)
    return view


def install(twin: nn.Module, prof: ModuleProfile, plan_or_blocks: Plan | Sequence[str],
            mode: str | None = None) -> None:
    """Make the blocks ``plan_or_blocks`` names run under checkpoint in ``twin``.

    ``twin`` is the module the runtime returns (a view of the user's root sharing its
    submodules). Each chosen block, and every container on the path to it, is replaced in
    ``twin`` only by a view (:func:`autockpt.capturing.trace.shallow_view`) sharing its Parameters,
    buffers and children, so ``state_dict()`` keys and Parameter objects stay those of the
    user's model, whose own tree is not touched. A block view checkpoints its forward in
    train mode with grad enabled and runs its own forward otherwise.

    Calling it again (another plan, another input size) re-targets the same views: blocks no
    longer chosen run plainly.

    Args:
        twin: the transformed module (never the user's own module).
        prof: the profile the plan was made from.
        plan_or_blocks: a plan from :func:`plan_modules`, or block names from ``prof.blocks``.
        mode: ``"non_reentrant"`` or ``"reentrant"``; defaults to the plan's mode.

    Example:
        >>> # see the module's docstring
    """
    if isinstance(plan_or_blocks, Plan):
        chosen = blocks_of_plan(prof, plan_or_blocks)
        mode = plan_or_blocks.mode if mode is None else mode
    else:
        chosen = tuple(plan_or_blocks)
        unknown = [b for b in chosen if b not in prof.blocks]
        if unknown:
            raise InvalidArgumentError(f"not blocks of the profile: {', '.join(unknown)}",
                                       fix=f"choose among {', '.join(prof.blocks)}")
    mode = "non_reentrant" if mode is None else mode
    if mode not in MODES:
        raise InvalidArgumentError(f"unknown mode {mode!r}", fix=f"use one of: {', '.join(MODES)}")
    for sub in twin.modules():  # forget the previous choice
        if "_autockpt_block" in sub.__dict__ and sub.__dict__.get("_autockpt_view"):
            sub.__dict__["_autockpt_block"] = None
    for qualname in chosen:
        record = prof.call(qualname)
        number = prof.blocks.index(qualname)
        parent = twin
        atoms = qualname.split(".")
        for atom in atoms[:-1]:
            parent = _owned_view(parent, atom)
        block = parent._modules[atoms[-1]]
        if block is None:
            raise AutockptError(f"submodule {qualname!r} is None in the transformed model")
        if not isinstance(block, _BlockMixin):
            view = shallow_view(block, _block_class(base_class(block)))
            view.__dict__["_autockpt_view"] = True
            _replace_child(parent, atoms[-1], block, view)
            block = view
        elif not block.__dict__.get("_autockpt_view"):
            block = _owned_view(parent, atoms[-1])
        prefix = f"{qualname}."
        block.__dict__["_autockpt_block"] = BlockSpec(
            qualname=qualname, mode=mode, preserve_rng=record.random,
            buffers=tuple(b[len(prefix):] for b in record.mutated_buffers
                          if b.startswith(prefix)),
            trainable=record.trainable, dummy_arg=needs_dummy(prof, number, mode),
            carries_grad=record.trainable or prof.block_inputs_grad[number])


@contextlib.contextmanager
def installed(twin: nn.Module, prof: ModuleProfile, plan_or_blocks: Plan | Sequence[str],
              mode: str | None = None) -> Iterator[nn.Module]:
    """:func:`install` for the block only, then put back every block's choice as it was: a
    replay of a plan (:mod:`autockpt.running.replay`) on a view whose blocks are shared with a
    transformed module that runs another plan."""
    before = {id(sub): sub.__dict__["_autockpt_block"] for sub in twin.modules()
              if "_autockpt_block" in sub.__dict__}
    install(twin, prof, plan_or_blocks, mode)
    try:
        yield twin
    finally:
        for sub in twin.modules():
            if "_autockpt_block" in sub.__dict__:
                sub.__dict__["_autockpt_block"] = before.get(id(sub))


@contextlib.contextmanager
def suspended(module: nn.Module) -> Iterator[None]:
    """Within the block, the block views in ``module`` run their own forward (a profile of the
    twin must see the blocks as they are, not checkpointed)."""
    specs = [(sub, sub.__dict__["_autockpt_block"]) for sub in module.modules()
             if sub.__dict__.get("_autockpt_block") is not None]
    for sub, _ in specs:
        sub.__dict__["_autockpt_block"] = None
    try:
        yield
    finally:
        for sub, spec in specs:
            sub.__dict__["_autockpt_block"] = spec


def is_installed(module: nn.Module) -> tuple[str, ...]:
    """Qualified names of the blocks of ``module`` that checkpoint now.

    Example:
        >>> import torch
        >>> is_installed(torch.nn.Linear(2, 2))
        ()
    """
    return tuple(name for name, sub in module.named_modules()
                 if isinstance(sub.__dict__.get("_autockpt_block"), BlockSpec))
