"""The modules rung, profiled: one forward with hooks on every submodule, restated as a profile.

When no graph can be captured, :func:`profile_modules` runs one forward (on fake tensors, or
for real where a fake one cannot run) with hooks on every submodule and records, per module
call in execution order, its input, output and saved-for-backward bytes, FLOPs, random ops
and buffer updates; :func:`choose_blocks` picks the chain of repeated blocks, and the forward
is restated as a :class:`~autockpt.profiling.stats.Profile` over that chain, which the planner
of traced graphs plans (:mod:`autockpt.planning.blocks`) and :mod:`autockpt.running.blocks`
runs (the rung's overview is there).

# NOTE [ Glue is not checkpointable ]
Code that runs in the parents' forward between blocks (embeddings, a residual add in the
root, the head) becomes *glue* nodes. They cannot be wrapped, so they are given
``requires_grad=False``: the planner only builds segments from stages that carry gradient, so
segments are made of blocks only. Their saved bytes still count as held. A block that writes
in place into a tensor it did not create (other than a buffer) would be corrupted by a
recompute and is treated the same way.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autockpt.capturing.draws import no_layer_dropped, python_draws_high
from autockpt.capturing.meta import MetaAutocastError, forward_failed
from autockpt.capturing.trace import base_class
from autockpt.ops.instrument import (
    LiveStorages,
    Op,
    OpObserver,
    OpWatch,
    fake_copy,
    flop_counter,
    map_tensors,
    rng_forked,
    storage_key,
    tensors,
    watch_saved,
)
from autockpt.profiling.loss import inner_loss, output_parts
from autockpt.profiling.profile import describe_inputs
from autockpt.profiling.stats import LossStat, NodeStat, Profile, StorageStat

__all__ = ["ModuleCall", "ModuleProfile", "choose_blocks", "profile_modules"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ModuleCall:
    """What one submodule did during the profiled forward (its first call)."""

    qualname: str
    """Qualified name in the model (``"transformer.h.0"``)."""
    class_name: str
    """Class of the module."""
    calls: int
    """How many times it was called; only modules called once can be cut points."""
    start: int
    """Number of ops run before it was entered (its first call)."""
    end: int
    """Number of ops run when it returned (its first call)."""
    input_bytes: int
    """Bytes of the storages of its tensor arguments (shared storages once)."""
    output_bytes: int
    """Bytes of the storages of its tensor outputs."""
    saved_bytes: int
    """Bytes of activation storages autograd saved while it ran (not parameters, buffers or
    the model's inputs; shared storages once)."""
    flops: int
    """Forward FLOPs while it ran."""
    random: bool
    """Whether an op consuming the RNG ran inside it."""
    mutated_buffers: tuple[str, ...]
    """Qualified names of buffers it updated (BatchNorm running statistics)."""
    trainable: bool
    """Whether it has a parameter that requires grad."""


@dataclass(frozen=True)
class ModuleProfile:
    """One forward, measured at the level of submodules, and the chain of blocks chosen."""

    model: str
    """Class name of the profiled model."""
    input_signature: str
    """Shapes and dtypes of the inputs it was profiled at."""
    calls: tuple[ModuleCall, ...]
    """Every submodule that ran, in the order of first entry."""
    blocks: tuple[str, ...]
    """Qualified names of the chosen cut points, in execution order (may be empty)."""
    block_nodes: tuple[int, ...]
    """Position of each block's node in :attr:`profile`."""
    checkpointable: tuple[bool, ...]
    """Per block: whether it may be checkpointed (no in-place write to an input)."""
    block_inputs_grad: tuple[bool, ...]
    """Per block: whether a tensor argument required grad (reentrant mode needs a dummy
    argument when none does and the block has trainable parameters)."""
    profile: Profile
    """The forward restated as a chain: input, glue, blocks, glue, output."""
    fake: bool
    """Whether the forward ran on fake tensors (else on real ones, see :attr:`notes`)."""
    notes: tuple[str, ...] = ()
    """How the chain was chosen, and anything the reader should know."""
    own_loss: LossStat | None = None
    """When the output holds the model's own loss (a Hugging Face model given ``labels=``): that
    loss, kind ``"inner"``, with the rest of the output it returns, which the step holds through
    backward (NOTE [ The loss node ] in :mod:`autockpt.profiling.profile`); what a plan of this
    profile prices without ``loss_fn``. None otherwise."""

    def call(self, qualname: str) -> ModuleCall:
        """The record of the module ``qualname``."""
        for item in self.calls:
            if item.qualname == qualname:
                return item
        raise KeyError(qualname)


# --------------------------------------------------------------------------- recording


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class _Recorder(OpObserver):
    """Logs every op of the forward, as its :attr:`watch` sees them: what it reads, writes and
    allocates, whether it is random. Ops are numbered from 1; hooks note the count, so any
    stretch of the forward (a module call, the gap between two blocks) is an interval of op
    numbers.

    Storages are numbered in order of allocation (*serials*), which name them in the log
    after their death too; pre-existing storages are named by their
    :func:`~autockpt.ops.instrument.storage_key`."""

    def __init__(self, old_keys: set[int]) -> None:
        self.watch = OpWatch(self)
        self.old_keys = old_keys
        self.live: LiveStorages[int] = LiveStorages(self._freed)  # storage -> serial
        self.sizes: list[int] = []  # by serial
        self.produced_at: list[int] = []  # by serial: the op that allocated it
        self.reads: list[tuple[int, int, bool]] = []  # (op, serial, requires_grad)
        self.old_reads: list[tuple[int, int]] = []  # (op, key) of pre-existing storages
        self.writes: list[tuple[int, int]] = []  # (op, serial)
        self.old_writes: list[tuple[int, int]] = []  # (op, key): buffers
        self.random_ops: list[int] = []
        # (op, serial, +bytes or -bytes): allocations and frees, for working sets.
        self.memory: list[tuple[int, int, int]] = []
        # Storages autograd saved, whose frees are logged when the forward ends, where they
        # would be freed if autograd held them (see :meth:`_Session.run`).
        self.saved_serials: set[int] | None = None
        self.saved_freed: list[int] = []

    @property
    def count(self) -> int:
        """How many ops have run."""
        return self.watch.count

    def serial(self, tensor: torch.Tensor, op: int | None = None) -> int | None:
        """The serial of ``tensor``'s storage; a storage not seen before is registered as
        allocated by ``op`` (None: leave it unknown). Pre-existing storages have none."""
        if storage_key(tensor) in self.old_keys:
            return None
        storage = tensor.untyped_storage()
        found = self.live.get(storage)
        if found is not None or op is None:
            return found
        found = len(self.sizes)
        self.live.add(storage, found)
        self.sizes.append(storage.nbytes())
        self.produced_at.append(op)
        self.memory.append((op, found, storage.nbytes()))
        return found

    def _freed(self, serial: int) -> None:
        if self.saved_serials is not None and serial in self.saved_serials:
            self.saved_freed.append(serial)
            return
        self.memory.append((self.count, serial, -self.sizes[serial]))

    def log_saved_frees(self) -> None:
        """Log the frees :meth:`_freed` put off, at the current op count, and put off no
        more: a saved storage still alive (the output) is logged when it dies, as it would
        be if autograd had held it."""
        for serial in self.saved_freed:
            self.memory.append((self.count, serial, -self.sizes[serial]))
        self.saved_freed.clear()
        self.saved_serials = None

    def before_op(self, op: Op) -> None:
        if op.random:
            self.random_ops.append(op.index)
        for t in op.written():
            found = self.serial(t)
            if found is None:
                self.old_writes.append((op.index, storage_key(t)))
            else:
                self.writes.append((op.index, found))
        for t in op.inputs():
            found = self.serial(t)
            if found is None:
                self.old_reads.append((op.index, storage_key(t)))
            else:
                self.reads.append((op.index, found, t.requires_grad))

    def after_op(self, op: Op, out: Any) -> None:
        for t in tensors(out):
            self.serial(t, op.index)


@dataclass
class _Call:
    module: nn.Module
    qualname: str
    calls: int = 0
    start: int = 0
    end: int = 0
    flops_start: int = 0
    flops_end: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    input_grad: bool = False


class _Session:
    """Hooks on every submodule plus the recorder, for one forward."""

    def __init__(self, module: nn.Module, old_keys: set[int], buffer_names: dict[int, str]
                 ) -> None:
        self.root = module
        self.recorder = _Recorder(old_keys)
        self.flops = flop_counter()
        self.saved: list[tuple[int, int, bool]] = []  # (op, serial, requires_grad)
        self.buffer_names = buffer_names
        self.calls: dict[int, _Call] = {}
        self.order: list[int] = []
        self.input_keys: set[int] = set()
        self.inputs_grad = False
        for name, sub in module.named_modules():
            if sub is not module:
                self.calls[id(sub)] = _Call(sub, name)

    def pre(self, sub: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        record = self.calls[id(sub)]
        record.calls += 1
        if record.calls == 1:
            self.order.append(id(sub))
            record.start = self.recorder.count
            record.flops_start = int(self.flops.get_total_flops())
            given = tensors((args, kwargs))
            record.input_bytes = _unique_bytes(given)
            record.input_grad = any(t.requires_grad for t in given)

    def post(self, sub: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        record = self.calls[id(sub)]
        if record.calls == 1 and record.end == 0:
            record.end = self.recorder.count
            record.flops_end = int(self.flops.get_total_flops())
            returned = tensors(output)
            record.output_bytes = _unique_bytes(returned)
            for t in returned:
                found = self.recorder.serial(t)
                if t.requires_grad and found is not None:
                    self.recorder.reads.append((record.end, found, True))

    def pack(self, tensor: torch.Tensor) -> None:
        # A storage first seen here was allocated outside the dispatcher: counted here.
        found = self.recorder.serial(tensor, self.recorder.count)
        if found is not None:
            self.saved.append((self.recorder.count, found, tensor.requires_grad))
            if self.recorder.saved_serials is not None:
                self.recorder.saved_serials.add(found)

    def run(self, fn: Callable[[], Any], *, hold_saved: bool = True) -> Any:
        """Run ``fn`` (the forward) watched. With ``hold_saved=False`` what autograd saves is
        counted and dropped at once (a real forward then needs an inference forward's
        memory); the log still frees it when the forward ends, as holding it would."""
        handles = []
        if not hold_saved:
            self.recorder.saved_serials = set()
        try:
            for record in self.calls.values():
                sub = record.module
                handles.append(sub.register_forward_pre_hook(self.pre, with_kwargs=True))
                handles.append(sub.register_forward_hook(self.post, with_kwargs=True,
                                                         always_call=False))
            with self.flops, self.recorder.watch, watch_saved(self.pack, hold=hold_saved):
                output = fn()
                self.recorder.log_saved_frees()
            return output
        finally:
            for handle in handles:
                handle.remove()


# --------------------------------------------------------------------------- profiling


def profile_modules(module: nn.Module, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None) -> ModuleProfile:
    """Run one forward of ``module`` in train mode with hooks on its submodules, choose the
    chain of blocks and restate the forward as a :class:`~autockpt.profiling.stats.Profile` over it.

    The forward runs on fake tensors (``FakeTensorMode`` with fake copies of the parameters
    and buffers swapped in by ``torch.func.functional_call``): no memory, no buffer update,
    no RNG draw. A forward that fake tensors cannot run (``if x.sum() > 0:`` needs a value)
    runs for real instead, under ``torch.random.fork_rng`` and with the buffers restored
    afterwards, and with no layer dropped at random (NOTE [ A random scalar in a real
    forward ]); what autograd saves in it is counted and dropped at once, so it takes the
    memory of an inference forward; :attr:`ModuleProfile.fake` is then False and a note
    says why.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        ...                       for _ in range(3)])
        >>> prof = profile_modules(net, (torch.randn(4, 8),))
        >>> prof.blocks, prof.fake
        (('0', '1', '2'), True)
        >>> prof.call("1").saved_bytes      # inputs of the Linears and the GELU: 4*(8+32+32) floats
        1152

    Raises:
        InvalidArgumentError: the forward fails on these inputs, fake and real.
    """
    kwargs = {} if kwargs is None else dict(kwargs)
    flags = [(m, m.training) for m in module.modules()]
    notes: list[str] = []
    try:
        module.train()
        try:
            session, output = _run_fake(module, args, kwargs)
            fake = True
        except MetaAutocastError:
            raise  # a real forward on meta would enter the same autocast
        except Exception as err:  # noqa: BLE001 - fake tensors refuse data-dependent code in many ways
            notes.append(f"fake tensors could not run the forward ({type(err).__name__}: "
                         f"{_first_line(err)}); profiled one real forward, RNG and buffers "
                         "restored")
            session, output = _run_real(module, args, kwargs)
            fake = False
    finally:
        for mod, was_training in flags:
            mod.training = was_training
    return _summarise(module, session, output, args, kwargs, fake, notes)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _run_fake(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[_Session, Any]:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    named = list(module.named_parameters()) + list(module.named_buffers())
    fake_state = {name: fake_copy(fake_mode, t) for name, t in named}
    buffer_names = {storage_key(fake_state[n]): n for n, _ in module.named_buffers()}

    fake_args, fake_kwargs = map_tensors((args, kwargs), fake_mode.from_tensor)
    old = {storage_key(t) for t in fake_state.values()} | {
        storage_key(t) for t in tensors((fake_args, fake_kwargs))}
    session = _Session(module, set(old), buffer_names)
    _note_inputs(session, (fake_args, fake_kwargs))
    with fake_mode, python_draws_high():
        output = session.run(lambda: torch.func.functional_call(
            module, fake_state, tuple(fake_args), fake_kwargs, strict=False))
    return session, output


def _note_inputs(session: _Session, inputs: Any) -> None:
    given = tensors(inputs)
    session.input_keys = {storage_key(t) for t in given}
    session.inputs_grad = any(t.requires_grad for t in given)


def _run_real(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[_Session, Any]:
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    buffer_names = {storage_key(b): n for n, b in module.named_buffers()}
    old = {storage_key(t) for t in [*module.parameters(), *module.buffers()]} | {
        storage_key(t) for t in tensors((args, kwargs))}
    session = _Session(module, set(old), buffer_names)
    _note_inputs(session, (args, kwargs))
    try:
        # Nothing runs backward through this forward: what autograd saves is counted and
        # dropped, so profiling needs an inference forward's memory, not the step's.
        with rng_forked(module, args, kwargs), no_layer_dropped():
            output = session.run(lambda: module(*args, **kwargs), hold_saved=False)
    except MetaAutocastError:
        raise
    except Exception as err:
        raise forward_failed(
            module, args, kwargs, err, name=base_class(module).__name__,
            fix="check that the example inputs have the shapes and dtypes the model expects",
        ) from err
    finally:
        with torch.no_grad():
            for buf, value in buffers:
                buf.copy_(value)
    return session, output


# --------------------------------------------------------------------------- the chain


def choose_blocks(module: nn.Module, prof: ModuleProfile | None = None, *,
                  calls: Sequence[ModuleCall] | None = None) -> tuple[tuple[str, ...], str]:
    """The cut points: qualified names of blocks that run one after another, and how they
    were found.

    From the root, look at the children that ran exactly once. If they are the children of a
    ``ModuleList``/``Sequential``, or several of them share a class, and such a group saves at
    least as many bytes for backward as any single child, its members are the blocks (members
    that are containers of same-class modules are replaced by their children: ``layer1.0,
    layer1.1, layer2.0...``; members that are stacks of layers are replaced by their layers,
    NOTE [ Stacks of layers ]). Otherwise, when two or more children hold such blocks and they
    run one after another (an encoder's layers, then a decoder's), all of them are the blocks
    (NOTE [ Blocks in sibling subtrees ]); else descend into the child that saves the most.
    Blocks must not overlap in time; a module called twice (weight sharing) is never one.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        >>> choose_blocks(net, profile_modules(net, (torch.randn(4, 8),)))[0]
        ('0', '1', '2')
    """
    records = {c.qualname: c for c in (calls if calls is not None else prof.calls)}  # type: ignore[union-attr]

    def record_of(qual: str, mod: nn.Module) -> ModuleCall | None:
        # A container that is never called itself (a ModuleList) stands for its children.
        if qual in records:
            return records[qual]
        parts = [r for name, child in mod.named_children()
                 if (r := record_of(f"{qual}.{name}", child)) is not None]
        if not parts:
            return None
        records[qual] = ModuleCall(
            qualname=qual, class_name=type(mod).__name__,
            calls=1 if all(r.calls == 1 for r in parts) else 2,
            start=min(r.start for r in parts), end=max(r.end for r in parts),
            input_bytes=0, output_bytes=0, saved_bytes=sum(r.saved_bytes for r in parts),
            flops=sum(r.flops for r in parts), random=any(r.random for r in parts),
            mutated_buffers=tuple(b for r in parts for b in r.mutated_buffers),
            trainable=any(r.trainable for r in parts))
        return records[qual]

    def once(prefix: str, parent: nn.Module) -> list[tuple[str, nn.Module, ModuleCall]]:
        kids = []
        for name, child in parent.named_children():
            qual = f"{prefix}{name}"
            rec = record_of(qual, child)
            if rec is not None and rec.calls == 1:
                kids.append((qual, child, rec))
        return sorted(kids, key=lambda k: (k[2].start, k[2].end))

    def sequential(members: list[tuple[str, nn.Module, ModuleCall]]) -> bool:
        return all(b[2].start >= a[2].end for a, b in itertools.pairwise(members))

    def flatten(members: list[tuple[str, nn.Module, ModuleCall]]
                ) -> list[tuple[str, nn.Module, ModuleCall]]:
        out = []
        for qual, child, rec in members:
            inner = once(f"{qual}.", child) if isinstance(child, _CONTAINERS) else []
            if len(inner) >= 2 and sequential(inner) and \
                    len({type(c) for _, c, _ in inner}) == 1:
                out.extend(inner)
            else:
                out.append((qual, child, rec))
        return out

    Found = tuple[list[tuple[str, nn.Module, ModuleCall]], str]

    def repeated(prefix: str, current: nn.Module) -> tuple[Found | None, Found | None]:
        """The repeated blocks under ``current``, and the deepest fallback on the way."""
        kids = once(prefix, current)
        if not kids:
            return None, None
        groups = []
        if isinstance(current, _CONTAINERS) and len(kids) >= 2:
            groups.append(kids)
        by_class: dict[type, list[tuple[str, nn.Module, ModuleCall]]] = {}
        for kid in kids:
            by_class.setdefault(type(kid[1]), []).append(kid)
        groups.extend(g for g in by_class.values() if len(g) >= 2)
        groups = [g for g in groups if sequential(g)]
        best_kid = max(kids, key=lambda k: k[2].saved_bytes)  # first of equals
        if groups:
            group = max(groups, key=lambda g: sum(k[2].saved_bytes for k in g))
            saved = sum(k[2].saved_bytes for k in group)
            if saved > 0 and saved >= best_kid[2].saved_bytes:
                where = prefix.rstrip(".") or "the root"
                members = flatten(group)
                layers = [stack_layers(*m) for m in members]
                if all(layers):  # NOTE [ Stacks of layers ]
                    inner = [m for found in layers for m in found]  # type: ignore[union-attr]
                    if sequential(inner):
                        return (inner, f"layers of the stacks {', '.join(q for q, _, _ in members)}"
                                ), None
                return (members, f"repeated children of {where}"), None
        useful = [k for k in kids if k[2].saved_bytes > 0]
        fallback = (useful, "") if len(useful) >= 2 and sequential(useful) else None
        if best_kid[2].saved_bytes == 0:
            return None, fallback
        # NOTE [ Blocks in sibling subtrees ]: an encoder's layers and a decoder's.
        found = {kid[0]: repeated(f"{kid[0]}.", kid[1]) for kid in useful}
        holders = [(kid, found[kid[0]][0]) for kid in useful if found[kid[0]][0] is not None]
        largest = max((_saved(group) for _, (group, _) in holders), default=0)  # type: ignore[misc]
        holders = [h for h in holders if _saved(h[1][0]) * SIBLING_SHARE >= largest]  # type: ignore[index]
        if len(holders) >= 2:
            members = [m for _, (group, _) in holders for m in group]  # type: ignore[misc]
            if sequential(members):
                where = " and ".join(why.removeprefix("repeated children of ")
                                     for _, (_, why) in holders)  # type: ignore[misc]
                return (members, f"repeated children of {where}"), None
        inner, deeper = found[best_kid[0]]
        return inner, deeper or fallback

    def stack_layers(qual: str, child: nn.Module, rec: ModuleCall
                     ) -> list[tuple[str, nn.Module, ModuleCall]] | None:
        """The layers of ``child`` when it is a stack: the repeated blocks under it are
        modules of one class, the children of one ``ModuleList``/``Sequential``."""
        found, _ = repeated(f"{qual}.", child)
        if found is None or len({type(c) for _, c, _ in found[0]}) != 1:
            return None
        parents = {q.rsplit(".", 1)[0] for q, _, _ in found[0]}
        if len(parents) != 1 or not isinstance(module.get_submodule(parents.pop()), _CONTAINERS):
            return None
        return found[0]

    found, fallback = repeated("", module)
    if found is not None:
        return tuple(q for q, _, _ in found[0]), f"{len(found[0])} blocks: {found[1]}"
    if fallback is not None:
        return tuple(q for q, _, _ in fallback[0]), (
            f"{len(fallback[0])} blocks: no repeated blocks found; the children that save "
            "memory are used instead")
    return (), "no submodule that saves memory for backward runs once: nothing to cut"


# NOTE [ Stacks of layers ]
# Repeated children can be whole stacks: LongT5's encoder and decoder are both a
# ``LongT5Stack``, so the two stacks were the blocks, and checkpointing one at a time reached
# only 60% of the baseline (Hugging Face's per-layer switch: 37%). When every member of a
# group holds a list of layers (repeated blocks of one class that are the children of one
# ``ModuleList``/``Sequential``), the layers are the blocks instead. Members that only hold
# repeated parts of their own (a transformer block's two linear layers, a bottleneck's
# convolutions) stay whole.

SIBLING_SHARE = 4
"""Blocks in a sibling subtree join the largest group of blocks when they save at least
1/``SIBLING_SHARE`` as much as it (NOTE [ Blocks in sibling subtrees ])."""


def _saved(members: Sequence[tuple[str, nn.Module, ModuleCall]]) -> int:
    return sum(rec.saved_bytes for _, _, rec in members)


# NOTE [ Blocks in sibling subtrees ]
# Below a module with no repeated children of its own, the blocks used to be looked for in
# the child that saves the most only. An encoder-decoder (M2M100, FSMT) has its repeated
# layers in two siblings, the encoder and the decoder: only one list was found, and the other
# half of the model was never checkpointed (M2M100's least memory 62% of its baseline, where
# Hugging Face's per-layer switch reaches 45%). So every child that saves memory is searched,
# and when two or more of them hold repeated blocks that run one after another, all of those
# are the blocks, in the order they ran. Only groups that save at least a quarter as much as
# the largest join: a head of two linear layers beside a stack of encoder layers is left to
# the glue, as before. With one such child, or blocks that overlap in time, the search
# follows the child that saves the most, as before.


def _summarise(module: nn.Module, session: _Session, output: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any], fake: bool, notes: list[str]) -> ModuleProfile:
    rec = session.recorder
    saved_ops = [op for op, _, _ in session.saved]
    old_write_ops = [op for op, _ in rec.old_writes]

    def between(ops: list[int], lo: int, hi: int) -> tuple[int, int]:
        return bisect.bisect_right(ops, lo), bisect.bisect_right(ops, hi)

    calls = []
    for ident in session.order:
        c = session.calls[ident]
        i, j = between(saved_ops, c.start, c.end)
        saved = {serial for _, serial, _ in session.saved[i:j]}
        r0, r1 = between(rec.random_ops, c.start, c.end)
        w0, w1 = between(old_write_ops, c.start, c.end)
        mutated = sorted(_with_siblings(module, {
            session.buffer_names[k] for _, k in rec.old_writes[w0:w1]
            if k in session.buffer_names}))
        calls.append(ModuleCall(
            qualname=c.qualname, class_name=type(c.module).__name__, calls=c.calls,
            start=c.start, end=c.end, input_bytes=c.input_bytes, output_bytes=c.output_bytes,
            saved_bytes=sum(rec.sizes[k] for k in saved), flops=c.flops_end - c.flops_start,
            random=r1 > r0, mutated_buffers=tuple(mutated),
            trainable=any(p.requires_grad for p in c.module.parameters())))
    blocks, how = choose_blocks(module, calls=calls)
    notes.append(how)
    by_name = {c.qualname: c for c in calls}
    chain = [by_name[b] for b in blocks]
    input_grad = {c.qualname: c.input_grad for c in session.calls.values()}
    total_flops = int(session.flops.get_total_flops())
    stats, block_nodes, safe = _chain_profile(session, chain, output, total_flops,
                                              describe_inputs(args, kwargs))
    for name, ok in zip(blocks, safe):
        if not ok:
            notes.append(f"{name} writes in place into a tensor it did not create: "
                         "not checkpointed")
    return ModuleProfile(
        model=base_class(module).__name__, input_signature=stats.input_signature,
        calls=tuple(calls), blocks=blocks, block_nodes=block_nodes, checkpointable=safe,
        block_inputs_grad=tuple(input_grad[b] for b in blocks), profile=stats, fake=fake,
        notes=tuple(notes), own_loss=_own_loss(rec, output))


def _own_loss(rec: _Recorder, output: Any) -> LossStat | None:
    """The model's own loss in ``output``, and the other parts of the output that hold
    storages the forward made, with their bytes (each storage once), as the graph rungs'
    loss node reports them."""
    own = inner_loss(output)
    if own is None:
        return None
    seen = {rec.serial(own)}
    held = []
    for name, found in output_parts(output):
        size = 0
        for t in found:
            serial = rec.serial(t)
            if serial is None or serial in seen:
                continue
            seen.add(serial)
            size += rec.sizes[serial]
        if size:
            held.append((name, size))
    return LossStat(kind="inner", name="its scalar output" if own is output else "output.loss",
                    saved_bytes=0, grad_bytes=0, work_bytes=0, held=tuple(held))


def _with_siblings(module: nn.Module, buffers: set[str]) -> set[str]:
    """``buffers`` plus the other buffers of their modules: a module's buffers are updated
    as a set, and not every kernel declares each write (BatchNorm's running statistics)."""
    out = set(buffers)
    for qualname in buffers:
        owner_path = qualname.rpartition(".")[0]
        owner = module.get_submodule(owner_path)
        prefix = f"{owner_path}." if owner_path else ""
        out.update(f"{prefix}{name}" for name, _ in owner.named_buffers(recurse=False))
    return out


def _chain_profile(session: _Session, chain: list[ModuleCall], output: Any,
                   total_flops: int, signature: str
                   ) -> tuple[Profile, tuple[int, ...], tuple[bool, ...]]:
    """Nodes: the input, then glue and blocks as they alternate in time (empty glue left
    out), then the output. See NOTE [ One checkpoint per block ] and NOTE [ Glue is not
    checkpointable ]."""
    rec = session.recorder
    # Slots: (kind, first op exclusive, last op inclusive, block record or None).
    slots: list[tuple[str, int, int, ModuleCall | None]] = []
    cursor = 0
    for block in chain:
        slots.append(("glue", cursor, block.start, None))
        slots.append(("block", block.start, block.end, block))
        cursor = block.end
    slots.append(("glue", cursor, rec.count, None))
    saved_ops = [op for op, _, _ in session.saved]
    slots = [s for s in slots if s[0] == "block" or s[2] > s[1] or any(
        s[1] < op <= s[2] for op in saved_ops)]
    bounds = [s[2] for s in slots]

    def node_of(op: int) -> int:
        return 1 + min(bisect.bisect_left(bounds, op), len(slots) - 1)

    n = len(slots) + 2
    out_node = n - 1
    count = len(rec.sizes)
    producer = [node_of(op) for op in rec.produced_at]
    users: list[set[int]] = [set() for _ in range(count)]
    saved_by: list[set[int]] = [set() for _ in range(count)]
    grad = [False] * count
    is_output = [False] * count
    node_reads: list[set[int]] = [set() for _ in range(n)]
    reads_input = [False] * n
    written_foreign = [False] * n
    for op, serial, needs_grad in rec.reads:
        node = node_of(op)
        if producer[serial] != node:
            users[serial].add(node)
            node_reads[node].add(producer[serial])
        grad[serial] = grad[serial] or needs_grad
    for op, key in rec.old_reads:
        if key in session.input_keys:
            reads_input[node_of(op)] = True
    for op, serial in rec.writes:
        if producer[serial] != node_of(op):
            written_foreign[node_of(op)] = True
    for op, serial, needs_grad in session.saved:
        saved_by[serial].add(node_of(op))
        grad[serial] = grad[serial] or needs_grad
    for t in tensors(output):
        serial = rec.serial(t)
        if serial is not None:
            is_output[serial] = True
            users[serial].add(out_node)
            grad[serial] = grad[serial] or t.requires_grad
            node_reads[out_node].add(producer[serial])
    is_block = [False] + [s[0] == "block" for s in slots] + [False]
    for serial in range(count):
        # NOTE [ One checkpoint per block ]: what a block hands to a later block is held.
        p = producer[serial]
        if is_block[p] and any(is_block[u] and u > p for u in users[serial]):
            users[serial].add(min(p + 2, out_node))
            if p + 2 >= out_node:
                is_output[serial] = True
    # Per-slot working set: most bytes of storages allocated in the slot alive at once.
    work = [0] * n
    alive: set[int] = set()
    current, running = -1, 0
    for op, serial, delta in rec.memory:
        node = node_of(op) if op > 0 else 1
        if node != current:
            current, running, alive = node, 0, set()
        if delta > 0:
            alive.add(serial)
            running += delta
            work[node] = max(work[node], running)
        elif serial in alive:
            alive.discard(serial)
            running += delta
    # A block is one node, so the planner cannot see the gradients its backward allocates
    # op by op; chain.py reads them off ``work_bytes - (what the node saves itself)``. So a
    # block's work also covers, for its largest op, the gradients of the op's inputs and
    # output on top of what it saves.
    op_grads: dict[int, int] = {}
    for op, serial, needs_grad in rec.reads:
        if needs_grad or grad[serial]:
            op_grads[op] = op_grads.get(op, 0) + rec.sizes[serial]
    for serial, op in enumerate(rec.produced_at):
        if grad[serial]:
            op_grads[op] = op_grads.get(op, 0) + rec.sizes[serial]
    own_saved = [0] * n
    for serial in range(count):
        if producer[serial] in saved_by[serial]:
            own_saved[producer[serial]] += rec.sizes[serial]
    for op, total in op_grads.items():
        node = node_of(op)
        work[node] = max(work[node], own_saved[node] + total)
    users_of: list[set[int]] = [set() for _ in range(n)]
    for node, producers in enumerate(node_reads):
        for p in producers:
            users_of[p].add(node)
    nodes = [NodeStat(
        index=0, name="inputs", op="placeholder", target="inputs", module_path="",
        inputs=(), users=tuple(sorted(i for i in range(n) if reads_input[i])),
        output_kind="tensor", requires_grad=session.inputs_grad, flops=0, output_bytes=0,
        work_bytes=0, random=False, trainable=False, mutated_inputs=(), mutated_buffers=())]
    produced_by: list[list[int]] = [[] for _ in range(n)]
    for serial in range(count):
        produced_by[producer[serial]].append(serial)
    block_nodes = []
    safe = []
    glue_count = 0
    for index, (kind, lo, hi, block) in enumerate(slots, start=1):
        mine = produced_by[index]
        r0, r1 = bisect.bisect_right(rec.random_ops, lo), bisect.bisect_right(rec.random_ops, hi)
        if block is not None:
            ok = not written_foreign[index]
            block_nodes.append(index)
            safe.append(ok)
            name, target, path = block.qualname, block.class_name, block.qualname
            flops = block.flops
            carries = ok and (any(grad[k] for k in mine) or block.trainable)
            buffers = block.mutated_buffers
            trainable = block.trainable
        else:
            name, target, path = f"glue_{glue_count}", "glue", ""
            glue_count += 1
            flops, carries, buffers, trainable = 0, False, (), False
        nodes.append(NodeStat(
            index=index, name=name, op="call_module" if block else "call_function",
            target=target, module_path=path,
            inputs=tuple(sorted(node_reads[index] | ({0} if reads_input[index] else set()))),
            users=tuple(sorted(users_of[index])),
            # "constant": every node boundary stays a cut candidate (see _candidate_cuts);
            # the blocks are the cut points by construction.
            output_kind="constant", requires_grad=carries, flops=flops,
            output_bytes=sum(rec.sizes[k] for k in mine), work_bytes=work[index],
            random=r1 > r0, trainable=trainable, mutated_inputs=(), mutated_buffers=buffers))
    # Glue FLOPs: whatever the blocks did not run, spread over the glue nodes.
    glue_flops = total_flops - sum(c.flops for c in chain)
    glue_nodes = [i for i, node in enumerate(nodes) if node.target == "glue"]
    if glue_nodes and glue_flops > 0:
        share, rest = divmod(glue_flops, len(glue_nodes))
        for k, i in enumerate(glue_nodes):
            nodes[i] = replace(nodes[i], flops=share + (rest if k == 0 else 0))
    nodes.append(NodeStat(
        index=out_node, name="output", op="output", target="output", module_path="",
        inputs=tuple(sorted(node_reads[out_node])), users=(), output_kind="constant",
        requires_grad=False, flops=0, output_bytes=0, work_bytes=0, random=False,
        trainable=False, mutated_inputs=(), mutated_buffers=()))
    order = sorted(range(count), key=lambda k: (producer[k], k))
    stats = tuple(
        StorageStat(size_bytes=rec.sizes[k], producer=producer[k],
                    users=tuple(sorted(users[k])), saved_by=tuple(sorted(saved_by[k])),
                    requires_grad=grad[k], is_output=is_output[k])
        for k in order)
    return (Profile(nodes=tuple(nodes), storages=stats, input_signature=signature),
            tuple(block_nodes), tuple(safe))

