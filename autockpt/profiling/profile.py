"""Stage 2: measure every node of a traced graph on fake tensors.

The graph runs once under ``FakeTensorMode``, node by node, with fake copies of the
parameters and buffers swapped in (``torch.func.functional_call``): shapes, dtypes and autograd
behave as for real, but no memory is allocated and no real tensor, buffer or RNG stream is
touched. For each node the pass records the facts the planner needs (see
:class:`autockpt.profiling.stats.NodeStat`) and writes them into ``node.meta["autockpt"]``.

# NOTE [ Which bytes are saved for backward ]
A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves while a node runs. Tensors
are keyed by their storage, so that a ReLU saving its output and the next Linear saving the
same tensor as its input count once, and views count as their base. Storages of parameters,
buffers and model inputs are not activations and are left out. A storage first seen inside a
node (BatchNorm's saved mean, the internals of a leaf module) is attributed to that node.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from autockpt.capturing.ladder import has_hooks
from autockpt.capturing.trace import TracedModel, describe_inputs, module_path
from autockpt.errors import InvalidArgumentError
from autockpt.ops.fake_outputs import SHARED
from autockpt.ops.kept import is_kept
from autockpt.ops.instrument import (
    FlopTally,
    LiveStorages,
    Op,
    OpObserver,
    OpWatch,
    SavedTensors,
    fake_copy,
    map_tensors,
    run_with_state,
    storage_key,
    tensors,
    watch_saved,
    widen_reduced_loss,
)
from autockpt.profiling.loss import LossFn, call_loss, inner_loss, output_parts
from autockpt.profiling.shape_rules import SHAPE_RULES
from autockpt.profiling.stats import LOSS_OP, LossStat, NodeStat, Profile, StorageStat
from autockpt.profiling.symbolic import SymbolicInputs, larger, same

__all__ = ["ProfileShare", "profile", "describe_inputs"]


class _WorkingSet(OpObserver):
    """Per node (between two :meth:`reset`), what the :class:`~autockpt.ops.instrument.OpWatch`
    saw: whether an op consumed the RNG, which storages ops wrote in place, the most bytes
    of new storages alive at once, how many ops ran, and the outputs of those a segment may
    keep (:data:`autockpt.ops.kept.KEPT_OPS`)."""

    def __init__(self, old_keys: set[int],
                 formulas: Mapping[Any, Callable[..., Any]] | None = None) -> None:
        self.random = False
        # FLOP formulas by op packet, for the kept ops' FLOPs (NOTE [ Keep the expensive,
        # recompute the cheap ] in autockpt.ops.kept).
        self._formulas = formulas or {}
        self.kept_bytes = 0
        self.kept_flops = 0
        self.kept_ops = 0
        self.ops = 0
        self.written: set[int] = set()
        # Storages saved for backward since the last op started, and whether one of them
        # was an op's output (see saves_fresh).
        self._pending: list[int] = []
        self._fresh = False
        # Storages that exist before a node runs (inputs, parameters, earlier activations)
        # are not part of its working set; the caller adds each node's results.
        self.old_keys = old_keys
        self._live: LiveStorages[int] = LiveStorages(self._release)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.freed_bytes = 0

    def reset(self) -> None:
        self._pending = []
        self._fresh = False
        self.random = False
        self.written = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.freed_bytes = 0
        self.kept_bytes = 0
        self.kept_flops = 0
        self.kept_ops = 0
        self.ops = 0
        self._live.clear()

    def note_freed(self, size: int) -> None:
        """An older storage (saved by the node whose backward runs) was freed."""
        self.freed_bytes += size

    def _release(self, size: int) -> None:
        self.live_bytes -= size

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saves ``tensor`` for backward (called from the pack hook)."""
        self._pending.append(storage_key(tensor))

    def saves_fresh(self) -> bool:
        """Whether the node's ops saved one of their own outputs, as opposed to only their
        inputs (``NodeStat.saves_fresh``).

        Autograd saves an op's inputs before its kernel runs and its outputs after, so a
        save that the next op of the node reads was an input of that op; any other save
        was an output of the op before it.
        """
        return self._fresh or bool(self._pending)

    def before_op(self, op: Op) -> None:
        # Metadata and aliasing ops (``prim.device``, the detach of a saved output) compute
        # nothing: they say nothing of which op a save belonged to.
        if self._pending and op.func.namespace != "prim" and op.func not in _ALIASING:
            reads = {storage_key(t) for t in tensors((op.args, op.kwargs))}
            if any(key not in reads for key in self._pending):
                self._fresh = True
            self._pending = []
        if op.random:
            self.random = True
        for t in op.written():
            self.written.add(storage_key(t))

    def after_op(self, op: Op, out: Any) -> None:
        widen_reduced_loss(op.func, op.args, out)
        fresh = [t for t in tensors(out) if storage_key(t) not in self.old_keys]
        if op.func.namespace != "prim" and not op.func.is_view and op.func not in _ALIASING:
            self.ops += 1
        if is_kept(op.func):
            self.kept_ops += 1
            seen: set[int] = set()
            for t in fresh:
                key = storage_key(t)
                if key not in seen:
                    seen.add(key)
                    self.kept_bytes += t.untyped_storage().nbytes()
            formula = self._formulas.get(op.func.overloadpacket)
            if formula is not None:
                self.kept_flops += formula(*op.args, **op.kwargs, out_val=out)
        for t in fresh:
            self._note_output(t)

    def _note_output(self, tensor: torch.Tensor) -> None:
        # Fake storages are freed like real ones, so a ledger of the live ones tells how many
        # bytes a node's ops hold at once: its working set, temporaries inside leaf modules
        # included.
        storage = tensor.untyped_storage()
        if storage in self._live:
            return
        size = storage.nbytes()
        self._live.add(storage, size)
        self.live_bytes += size
        self.peak_bytes = larger(self.peak_bytes, self.live_bytes - self.freed_bytes)


_ALIASING = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})

_SHAPE_RULES = SHAPE_RULES
"""The ops whose fake outputs a rule makes (NOTE [ Ops answered by a shape rule ] in
:mod:`autockpt.profiling.shape_rules`); tests set it to ``{}`` to run every op."""


def _output_kind(node: fx.Node, value: Any) -> str:
    if node.op == "get_attr":
        return "parameter"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "container" if tensors(value) else "constant"


ProbeCache = dict[tuple[Any, ...], Any]
"""Backward probes by what they depend on (:func:`_probe_key`); one cache may serve several
profiles of graphs that share nodes (the graph with its head whole and in chunks)."""


# NOTE [ A second graph resumes the first ]
# The graph with its head in chunks is the plain graph with a few nodes at its end replaced
# (autockpt.running.head.chunk_rows): every node before the first that differs is the same node
# on the same inputs, and its profile is the same. So the plain profile keeps its run (the
# fake tensors of its environment, what autograd saved of them, its records), and the second
# profile starts from that run's state at the first differing node: the records of the
# nodes before it, cut to what they were then (a storage's users and savers before it, a
# node's users by their positions in the new graph), and only the nodes from there on run.
# That skips the forward of most of the graph a second time (T5: 0.3-0.45 s of a plan). A
# plain graph whose later nodes write in place into earlier values (which the second run
# would see changed) is profiled again from the start. tests/test_profile.py checks the
# resumed profile against a fresh one.


class ProfileShare:
    """What the profiles of two graphs that share their first nodes (the graph with its head
    whole and in chunks) share: the backward probes, and the first profile's run, which the
    second resumes (NOTE [ A second graph resumes the first ]). :meth:`release` lets the run's
    fake tensors go; the first profile keeps it until then.

    Example:
        >>> import torch
        >>> from autockpt.capturing.trace import trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> share = ProfileShare()
        >>> first = profile(trace(net, (x,)), {"input": x}, share=share)
        >>> again = profile(trace(net, (x,)), {"input": x}, share=share)  # nothing differs
        >>> share.release()
        >>> first.nodes == again.nodes
        True
    """

    def __init__(self) -> None:
        self.probes: ProbeCache = {}
        self._kept: _KeptRun | None = None

    def release(self) -> None:
        """Drop the kept run."""
        if self._kept is not None:
            self._kept.runner.release()
            self._kept = None


@dataclass
class _KeptRun:
    runner: _ProfileRunner
    fake_mode: FakeTensorMode
    fake_state: dict[str, torch.Tensor]
    values_in: list[Any]
    param_keys: set[int]
    input_keys: set[int]
    buffer_names: dict[int, str]
    symbolic: SymbolicInputs | None


def profile(traced: TracedModel, inputs: dict[str, Any], *, loss_fn: LossFn | None = None,
            share: ProfileShare | None = None, symbolic: SymbolicInputs | None = None
            ) -> Profile:
    """Run the traced graph on fake tensors and measure each node, and the loss of the step.

    ``inputs`` maps the forward's parameter names to the example values (real or fake tensors,
    or Python values); only their shapes, dtypes and ``requires_grad`` matter. ``loss_fn`` is
    the user's loss, run on the fake output after the graph; without it the profile takes the
    model's own loss when its output holds one, else assumes an output-sized gradient for each
    floating output (see NOTE [ The loss node ]). ``share``, when given, carries the backward
    probes from one profile to the next, and the first profile's run, which the second resumes
    where the graphs start to differ (NOTE [ A second graph resumes the first ]); the caller
    calls ``share.release()`` when done. ``symbolic``, when given, makes the inputs' sizes
    symbols: the profile's numbers are then ``torch.SymInt`` expressions in them, which
    :func:`autockpt.profiling.symbolic.formula_of` turns into a formula for every shape (NOTE
    [ One profile for every shape ]).

    Example:
        >>> import torch
        >>> from autockpt.capturing.trace import trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> prof = profile(trace(net, (x,)), {"input": x})
        >>> [(n.op, n.output_bytes) for n in prof.nodes][1:]
        [('call_module', 128), ('call_module', 128), ('loss', 0), ('output', 0)]
        >>> prof.loss.kind, prof.loss.grad_bytes
        ('assumed', 128)
    """
    gm = traced.graph_module
    kept = share._kept if share is not None else None
    # A run on symbolic sizes is resumed only by a profile on the same symbols, and the
    # reverse: the values carried over are of one kind.
    start = (_resume_point(kept.runner, gm)
             if kept is not None and kept.symbolic is symbolic else None)
    if kept is not None and start is not None:
        fake_mode, fake_state, values_in = kept.fake_mode, kept.fake_state, kept.values_in
        param_keys, input_keys = set(kept.param_keys), kept.input_keys
        buffer_names = kept.buffer_names
    else:
        fake_mode = (FakeTensorMode(allow_non_fake_inputs=False) if symbolic is None
                     else symbolic.fake_mode)
        # Tied parameters (shared embeddings) appear once here; functional_call re-ties them.
        named = list(gm.named_parameters()) + list(gm.named_buffers())
        fake_state = {name: fake_copy(fake_mode, t) for name, t in named}
        param_keys = {storage_key(t) for t in fake_state.values()}
        buffer_names = {storage_key(fake_state[n]): n for n, _ in gm.named_buffers()}

        def fakeify(value: Any) -> Any:
            # Tensors inside containers too: a dict or dataclass batch is one placeholder
            # whose tensors the graph reads with getitem/getattr.
            return map_tensors(value, fake_mode.from_tensor if symbolic is None
                               else symbolic.fake)

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values_in = []
        for node, name in zip(placeholders, traced.spec.param_names):
            if name not in inputs:
                raise InvalidArgumentError(
                    f"no example value for the forward's parameter {name!r}")
            values_in.append(fakeify(inputs[name]))
        input_keys = {storage_key(t) for v in values_in for t in tensors(v)}

    keep = share is not None and kept is None
    runner = _ProfileRunner(gm, set(param_keys), input_keys, buffer_names,
                            {} if share is None else share.probes, keep=keep)
    runner.real_state = dict(list(gm.named_parameters()) + list(gm.named_buffers()))
    runner.loss_fn = loss_fn
    runner.unflatten = traced.unflatten
    if kept is not None and start is not None:
        runner.resume(kept.runner, start)
    with fake_mode:
        run_with_state(gm, fake_state, runner.profile_graph, tuple(values_in))
    if keep:
        assert share is not None
        share._kept = _KeptRun(runner, fake_mode, fake_state, values_in, param_keys,
                               input_keys, buffer_names, symbolic)
    description = describe_inputs((), {n: inputs[n] for n in traced.spec.param_names})
    return runner.result(description)


def _resume_point(first: _ProfileRunner, gm: fx.GraphModule) -> int | None:
    """The position of the first node of ``gm`` that differs from the graph ``first`` ran,
    or None where the second profile must run from the start (NOTE [ A second graph resumes
    the first ])."""
    old = list(first.module.graph.nodes)
    new = list(gm.graph.nodes)
    # The output node runs the loss node too (NOTE [ The loss node ]): always run again.
    last = min(len(old), len(new)) - 1
    start = next((i for i, (a, b) in enumerate(zip(old[:last], new)) if not _same_node(a, b)),
                 last)
    stats = first._stats
    if start == 0 or start >= len(stats) or any(
            st.mutated_inputs or st.mutated_buffers for st in stats[start:]):
        return None
    if any(st.index != i for i, st in enumerate(stats[:start])):
        return None
    producers = [st["producer"] for st in first._storages]
    if producers != sorted(producers):
        return None
    return start


def _same_node(a: fx.Node, b: fx.Node) -> bool:
    def names(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: n.name)

    return (a.name == b.name and a.op == b.op and a.target == b.target
            and names(a.args) == names(b.args) and names(a.kwargs) == names(b.kwargs))


@contextlib.contextmanager
def _real_tensors_allowed(output: Any) -> Iterator[None]:
    """Let the loss read real tensors (its targets, captured from the user's code) beside the
    fake output: the fake mode converts them as they come."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = next((t.fake_mode for t in tensors(output) if isinstance(t, FakeTensor)), None)
    if mode is None:
        yield
        return
    before = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = before


def _held_parts(output: Any, loss_key: int, storage_index: dict[int, int],
                storages: list[dict[str, Any]]) -> tuple[tuple[str, int], ...]:
    """The parts of ``output`` beside the model's own loss that hold storages the step made,
    with their bytes (each storage counted once, in the first part that holds it)."""
    seen = {loss_key}
    parts = []
    for name, found in output_parts(output):
        size = 0
        for t in found:
            key = storage_key(t)
            if key in seen or key not in storage_index:
                continue
            seen.add(key)
            size += storages[storage_index[key]]["size_bytes"]
        if size:
            parts.append((name, size))
    return tuple(parts)


# NOTE [ The loss node ]
# The step users run is ``loss_fn(model(x)).backward()``: the loss's saved tensors (the
# log-softmax of a cross-entropy), its temporaries and the gradient it sends into the output
# are part of the peak, and for a language model they are the largest tensors of the step. So
# the profile ends with one more node, op ``"loss"``, between the graph's last node and its
# output node: the user's ``loss_fn`` run on the fake output and probed like any node. It is
# never part of a segment (its stage is closed by a cut of its own and marked as carrying no
# gradient) and never rewritten: the user's code still computes the loss. Everything the
# model returns stays alive through backward, one rule whoever computes the loss: with
# ``loss_fn`` (or nothing) the caller holds the output, ``out = model(x);
# loss_fn(out).backward()``; a model that returns its own loss is trained as ``outputs =
# model(**batch); outputs.loss.backward()`` (accelerate's and most examples' loop), which holds
# the logits beside the loss until ``outputs`` goes out of scope. ``model(**batch).loss
# .backward()`` frees them earlier, so counting them is never optimistic, and costs one logits
# tensor where the head is whole: the chunked head (NOTE [ The head in chunks of rows ] in
# autockpt.planning.head) returns no logits, so there is nothing to hold. Without ``loss_fn`` and
# without a loss of its own, the node hands an output-sized gradient to every floating output
# that requires grad, which any real loss does at least (NOTE [ The default loss ]).


class _ProfileRunner(fx.Interpreter):
    """Runs the graph node by node on fake tensors and writes what each node did into its
    ``node.meta["autockpt"]``, as ``torch.fx.passes.shape_prop.ShapeProp`` writes shapes."""

    def __init__(
        self,
        gm: fx.GraphModule,
        param_keys: set[int],
        input_keys: set[int],
        buffer_names: dict[int, str],
        probes: ProbeCache,
        keep: bool = False,
    ) -> None:
        # Every value stays in the environment: the loss node and the probes read them.
        super().__init__(gm, garbage_collect_values=False)
        # Whether the run outlives profile_graph (ProfileShare): until release().
        self._keep = keep
        self._saved = SavedTensors()
        self._initial_env: dict[fx.Node, Any] | None = None
        self.extra_traceback = False
        self._param_keys = param_keys
        self._input_keys = input_keys
        self._buffer_names = buffer_names
        self._stats: list[NodeStat] = []
        self._param_reads: list[dict[int, int]] = []
        # Probing a backward is the dearest part of the profile, and the layers of a deep
        # model repeat the same ops on the same shapes: one probe per distinct call.
        self._probes = probes
        self._storages: list[dict[str, Any]] = []
        self.loss_fn: LossFn | None = None
        self.unflatten: Any = None
        self.loss: LossStat | None = None
        self._position = {node: i for i, node in enumerate(gm.graph.nodes)}
        # storage key -> index into self._storages; inputs and parameters are not activations.
        self._storage_index: dict[int, int] = {}
        self._value_storages: dict[fx.Node, list[int]] = {}
        self._saved_now: list[torch.Tensor] = []
        self._counter = FlopTally()
        self._watcher = _WorkingSet(old_keys=set(param_keys) | set(input_keys),
                                    formulas=self._counter.formulas)

    def profile_graph(self, *values_in: Any) -> None:
        """One run of the graph on the forward's (fake) parameters, every node measured (from
        the resumed node on, after :meth:`resume`)."""
        watch = OpWatch(self._watcher, _SHAPE_RULES, flops=self._counter, memo=SHARED)
        try:
            with watch, watch_saved(self._pack, self._saved):
                self.run(*values_in, initial_env=self._initial_env,
                         enable_io_processing=False)
        finally:
            self._initial_env = None
            if not self._keep:
                self.release()

    def release(self) -> None:
        """Let the fake graphs die with their tensors (NOTE [ Saved tensors held from C++ ]
        in autockpt/ops/instrument.py); what was measured is in the runner's records."""
        self._saved.release()
        self._saved_now.clear()
        self.env.clear()

    def resume(self, first: _ProfileRunner, start: int) -> None:
        """Take ``first``'s state as it was before its node at ``start``, the nodes before it
        being the same in both graphs (NOTE [ A second graph resumes the first ])."""
        old_nodes = list(first.module.graph.nodes)[:start]
        new_nodes = list(self.module.graph.nodes)
        position = self._position
        kept = sum(1 for st in first._storages if st["producer"] < start)
        self._storages = [
            {**st, "users": {u for u in st["users"] if u < start},
             "saved_by": {u for u in st["saved_by"] if u < start}, "is_output": False}
            for st in first._storages[:kept]]
        self._storage_index = {key: slot for key, slot in first._storage_index.items()
                               if slot < kept}
        self._watcher.old_keys |= set(self._storage_index)
        self._param_reads = [dict(reads) for reads in first._param_reads[:start]]
        self._initial_env = {}
        # _resume_point checked that the first records are the first nodes, in order.
        for old, new, old_stat in zip(old_nodes, new_nodes, first._stats):
            self._initial_env[new] = first.env[old]
            if old in first._value_storages:
                self._value_storages[new] = list(first._value_storages[old])
            stat = replace(old_stat, users=tuple(sorted(position[u] for u in new.users)))
            new.meta["autockpt"] = stat
            if "autockpt_tensor" in old.meta:
                new.meta["autockpt_tensor"] = old.meta["autockpt_tensor"]
            self._stats.append(stat)

    def _pack(self, tensor: torch.Tensor) -> None:
        self._saved_now.append(tensor)
        self._watcher.note_saved(tensor)

    def _own(self, key: int, tensor: torch.Tensor, producer: int) -> int | None:
        if key in self._param_keys or key in self._input_keys:
            return None
        storages = self._storages
        if key not in self._storage_index:
            self._storage_index[key] = len(storages)
            storages.append(
                {
                    "size_bytes": tensor.untyped_storage().nbytes(),
                    "producer": producer,
                    "users": set(),
                    "saved_by": set(),
                    "requires_grad": tensor.requires_grad,
                    "is_output": False,
                }
            )
        return self._storage_index[key]

    def evaluate(self, node: fx.Node) -> Any:
        """The node's value as the plain interpreter computes it (the probes run it again)."""
        return super().run_node(node)

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        submodule = self.fetch_attr(target)
        if has_hooks(submodule):
            # Its hooks belong to the real step (FSDP2 gathers parameters in them, a profiler
            # counts calls): see NOTE [ Module calls kept whole ] in autockpt/capturing/ladder.py. A
            # module whose forward needs what a pre-hook computes (the old weight_norm's
            # weight, from the fake weight_g and weight_v) runs with its hooks.
            try:
                return submodule.forward(*args, **kwargs)
            except Exception:  # noqa: BLE001 - any failure: the hooks are needed
                pass
        return submodule(*args, **kwargs)

    def run_node(self, node: fx.Node) -> Any:
        gm = self.module
        position = self._position
        index = position[node]
        storage_index = self._storage_index
        value_storages = self._value_storages
        storages = self._storages
        saved_now = self._saved_now
        counter = self._counter
        watcher = self._watcher
        own = self._own
        if node.op == "output":
            index = self._loss_node(node, index, position, counter, watcher, saved_now, own,
                                    storage_index, value_storages)
        flops_before = counter.total
        watcher.reset()
        saved_now.clear()
        input_nodes = node.all_input_nodes if node.op != "output" else []
        ordered_inputs = sorted(input_nodes, key=position.__getitem__)
        probe_key = _probe_key(self, node, storage_index)
        cached = probe_key is not None and probe_key in self._probes
        # See NOTE [ One forward for the node and its probe ].
        ready = None if cached else self._evaluate_on_leaves(node, ordered_inputs)
        if ready is None:  # forget whatever a failed try on leaves ran
            flops_before = counter.total
            watcher.reset()
            saved_now.clear()
        if ready is not None:
            value = ready[0]
        elif node.op == "output":
            value = None
        elif node.op == "call_module":
            value = self._run_module(node, saved_now)
        else:
            recorder = getattr(node.target, "record_parameter_gradients", None)
            recorded = recorder() if recorder is not None else []
            value = self.evaluate(node)
            if recorded:
                # Gradients of parameters made in forward (the chunked head's, NOTE
                # [ Gradients in forward ] in autockpt.planning.head) become the parameters'
                # ``.grad`` as they are, as measure counts them: not activations. Not so for
                # a parameter an earlier node reads too (tied embeddings): autograd adds
                # that reader's gradient to a new buffer, and this one stays an activation
                # until then.
                earlier = set().union(*self._param_reads) if self._param_reads else set()
                grads = [g for param, g in recorded if storage_key(param) not in earlier]
                self._param_keys.update(storage_key(g) for g in grads)
                watcher.peak_bytes = larger(0, watcher.peak_bytes - sum(
                    g.untyped_storage().nbytes() for g in grads))
                recorded.clear()
        self.env[node] = value
        written = watcher.written
        mutated_buffers = {self._buffer_names[k] for k in written if k in self._buffer_names}
        saved_buffers = {storage_key(t): t.untyped_storage().nbytes() for t in saved_now
                         if storage_key(t) in written and storage_key(t) in self._buffer_names}
        if mutated_buffers and node.op == "call_module":
            # Snapshot the module's buffers together: they are updated as a set.
            module = gm.get_submodule(str(node.target))
            mutated_buffers |= {f"{node.target}.{n}" for n, _ in module.named_buffers()}
        mutated_inputs = sorted(
            {
                storages[storage_index[k]]["producer"]
                for k in written
                if k in storage_index and storages[storage_index[k]]["producer"] != index
            }
        )
        work_bytes = watcher.peak_bytes
        flops = _count(counter.total - flops_before)
        kept = (watcher.kept_bytes, _count(watcher.kept_flops), watcher.kept_ops, watcher.ops)
        watcher.old_keys.update(storage_key(t) for t in tensors(value))
        watcher.old_keys.update(storage_key(t) for t in saved_now)
        random = watcher.random  # before the probe resets the watcher
        # Whether it saves what its last op made: that kernel must run in a recompute that
        # stops here (a saved copy made by an earlier op, as a 4-D matmul makes of a
        # transposed operand before its bmm, lets the bmm be skipped).
        saves_fresh = watcher.saves_fresh()
        out_storages: list[int] = []
        output_bytes = 0
        if node.op not in ("output", "get_attr"):
            for t in tensors(value):
                key = storage_key(t)
                is_new = key not in storage_index
                slot = own(key, t, index)
                if slot is not None:
                    if slot not in out_storages:
                        out_storages.append(slot)
                    if is_new:
                        output_bytes += storages[slot]["size_bytes"]
        value_storages[node] = out_storages
        for t in saved_now:
            slot = own(storage_key(t), t, index)
            if slot is not None:
                storages[slot]["saved_by"].add(index)
        if cached:
            backward, accumulate = self._probes[probe_key]
        else:
            backward, accumulate = self._probe(node, ordered_inputs, ready)
            if probe_key is not None:
                self._probes[probe_key] = (backward, accumulate)
        for i in input_nodes:
            for slot in value_storages.get(i, ()):
                storages[slot]["users"].add(index)
                if node.op == "output":
                    storages[slot]["is_output"] = True
        trainable = False
        read_params = [self.env.get(i) for i in input_nodes if i.op == "get_attr"]
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            trainable = any(p.requires_grad for p in module.parameters())
            read_params += list(module.parameters())
        self._param_reads.append({
            storage_key(t): t.untyped_storage().nbytes() for t in read_params
            if isinstance(t, torch.Tensor) and t.requires_grad
        })
        trainable = trainable or any(
            i.op == "get_attr"
            and isinstance(self.env.get(i), torch.Tensor)
            and self.env[i].requires_grad
            for i in input_nodes
        )
        stat = NodeStat(
            index=index,
            name=node.name,
            op=node.op,
            target=_target_name(node),
            module_path=module_path(node),
            inputs=(tuple(sorted(position[i] for i in input_nodes))
                    if node.op != "output" else (index - 1,)),
            users=tuple(sorted(position[u] for u in node.users)),
            output_kind=_output_kind(node, value),
            requires_grad=any(t.requires_grad for t in tensors(value)),
            flops=flops,
            output_bytes=output_bytes,
            work_bytes=larger(work_bytes, output_bytes),
            random=random,
            trainable=trainable,
            mutated_inputs=tuple(mutated_inputs),
            mutated_buffers=tuple(sorted(mutated_buffers)),
            saved_buffer_bytes=sum(saved_buffers.values()),
            backward_bytes=backward[0] if backward else 0,
            input_grad_bytes=backward[1] if backward else (),
            grad_bytes=_grad_size(value),
            accumulate_backward_bytes=(accumulate if backward and not same(accumulate,
                                                                           backward[0])
                                       else None),
            saves_fresh=saves_fresh,
            kept_bytes=kept[0],
            kept_flops=kept[1],
            kept_ops=kept[2],
            ops=kept[3],
        )
        node.meta["autockpt"] = stat
        if isinstance(value, torch.Tensor):
            # Shapes for the passes that read them after the profile (autockpt.planning.head).
            node.meta["autockpt_tensor"] = (tuple(_hint(d) for d in value.shape),
                                            value.dtype, value.requires_grad)
            # Symbolic sizes, for what a formula evaluates beside the profile (the head's
            # rows): NOTE [ One profile for every shape ] in autockpt.profiling.symbolic.
            if any(isinstance(d, torch.SymInt) for d in value.shape):
                node.meta["autockpt_sizes"] = tuple(value.shape)
            else:
                node.meta.pop("autockpt_sizes", None)
        self._stats.append(stat)
        return value

    def _evaluate_on_leaves(self, node: fx.Node, inputs: list[fx.Node]
                            ) -> tuple[Any, _Leaves, list[Any]] | None:
        """The node's value computed on fake leaves standing for the activations it reads,
        with the leaves and their gradient edges; None where the node needs its usual
        evaluation (NOTE [ One forward for the node and its probe ])."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return None
        target = node.target
        if (getattr(target, "record_parameter_gradients", None) is not None
                or getattr(target, "makes_every_gradient", False)
                or _writes_in_place(self, node) or _is_join(node)):
            return None
        env = self.env
        substituted, leaves, edges = _leaf_inputs(env, inputs, self._storage_index, copy=False)
        if not leaves:
            return None
        originals = {i: env[i] for i in substituted}
        env.update(substituted)
        try:
            value = self.evaluate(node)
        except Exception:  # noqa: BLE001 - the usual evaluation says what fails, and how
            return None
        finally:
            env.update(originals)
        leaf_keys = {storage_key(leaf) for _, leaf in leaves}
        if any(storage_key(t) in leaf_keys for t in tensors(value)):
            return None  # an input or a view of it: a later in-place op would refuse a leaf
        return value, leaves, edges

    def _probe(self, node: fx.Node, inputs: list[fx.Node],
               ready: tuple[Any, _Leaves, list[Any]] | None
               ) -> tuple[tuple[int, tuple[int, ...]] | None, int | None]:
        """The node's backward peak and its inputs' gradient bytes, and its peak with the
        parameters' gradients counted (see NOTE [ Temporaries of parameter gradients ]);
        ``(None, None)`` when it has no backward that can be probed. ``ready`` is its forward
        already run on leaves, or None to run it again here."""
        args = (self, node, inputs, self._storage_index, self._watcher, self._saved_now)
        norm = _fused_norm(self, node)
        if ready is not None:
            params = [] if norm else _trainable_params(self, node, inputs)
            saved = list(self._saved_now)
            self._saved_now.clear()  # the backward frees what the node saved, and counts it
            found = _backward_peaks(ready[0], saved, ready[1], ready[2], params, len(inputs),
                                    self._watcher)
            if found is not None:
                return (found[0], found[1]), found[2]
            if not params:
                return None, None
            probed = _probe_backward(*args)  # the probe with parameters failed
            return (None, None) if probed is None else ((probed[0], probed[1]), probed[0])
        with_params = None if norm else _probe_backward(*args, with_params=True)
        every = getattr(node.target, "makes_every_gradient", False)
        if with_params is not None and not every:
            return (with_params[0], with_params[1]), with_params[2]
        probed = _probe_backward(*args)
        if probed is None:
            return None, None
        if with_params is not None:
            # Its backward makes its parameters' gradients even when only the activations'
            # are asked for: they are in ``probed`` as temporaries, but they become ``.grad``
            # (or wait for a tied reader) as any other's.
            return (with_params[0], probed[1]), with_params[2]
        return (probed[0], probed[1]), probed[0]

    def _loss_node(self, node: fx.Node, index: int, position: dict[fx.Node, int],
                   counter: FlopTally, watcher: _WorkingSet,
                   saved_now: list[torch.Tensor], own: Any, storage_index: dict[int, int],
                   value_storages: dict[fx.Node, list[int]]) -> int:
        """Add the loss node at ``index`` (NOTE [ The loss node ]); return the output node's
        position, one after it."""
        producers = sorted(node.all_input_nodes, key=position.__getitem__)

        def structure() -> Any:
            flat = self.fetch_args_kwargs_from_env(node)[0][0]
            return self.unflatten(flat) if self.unflatten is not None else flat

        output = structure()
        own_loss = inner_loss(output) if self.loss_fn is None else None
        with _real_tensors_allowed(output):
            return self._loss_stat(node, index, position, counter, watcher, saved_now, own,
                                   storage_index, value_storages, producers, structure, output,
                                   own_loss)

    def _loss_stat(self, node: fx.Node, index: int, position: dict[fx.Node, int],
                   counter: FlopTally, watcher: _WorkingSet,
                   saved_now: list[torch.Tensor], own: Any, storage_index: dict[int, int],
                   value_storages: dict[fx.Node, list[int]], producers: list[fx.Node],
                   structure: Any, output: Any, own_loss: torch.Tensor | None) -> int:
        env = self.env
        storages = self._storages

        def slots_of(nodes: list[fx.Node]) -> list[int]:
            return [slot for i in nodes for slot in value_storages.get(i, ())]

        flops = work = output_bytes = grad_size = 0
        held_parts: tuple[tuple[str, int], ...] = ()
        random = False
        backward: tuple[int, tuple[int, ...], int] | None = None
        if self.loss_fn is None and own_loss is None:
            kind, name = "assumed", "an output-sized gradient"
            inputs = [i for i in producers if _carries_float_grad(env.get(i))]
            grads = tuple(_grad_size(env.get(i)) for i in inputs)
            backward = (sum(grads), grads, sum(grads))
            held = slots_of(producers)
        elif own_loss is not None:
            kind = "inner"
            name = "its scalar output" if own_loss is output else "output.loss"
            key = storage_key(own_loss)
            inputs = [i for i in producers
                      if any(storage_key(t) == key for t in tensors(env.get(i)))][:1]
            backward = (0, (0,) * len(inputs), 0)  # the loss's own gradient, passed through
            grad_size = _grad_size(own_loss)
            # ``out = model(**batch); out.loss.backward()`` holds the logits beside the loss
            # through backward, so they are held whichever loop runs (NOTE [ The loss node ]).
            held = slots_of(producers)
            held_parts = _held_parts(output, key, storage_index, storages)
        else:
            kind = "loss_fn"
            name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
            inputs = producers
            fn = self.loss_fn
            watcher.reset()
            saved_now.clear()
            before = counter.total
            value = call_loss(fn, output, "the model")
            flops = _count(counter.total - before)
            work = watcher.peak_bytes
            random = watcher.random
            watcher.old_keys.update(storage_key(t) for t in [value, *saved_now])
            saved = list(saved_now)
            backward = _probe_backward(self, node, inputs, storage_index, watcher,
                                       saved_now, run=lambda: fn(structure()))
            key = storage_key(value)
            is_new = key not in storage_index
            slot = own(key, value, index)
            if slot is not None:
                output_bytes = storages[slot]["size_bytes"] if is_new else 0
                storages[slot]["is_output"] = True
                storages[slot]["users"].add(index + 1)
            for t in saved:
                saved_slot = own(storage_key(t), t, index)
                if saved_slot is not None:
                    storages[saved_slot]["saved_by"].add(index)
            grad_size = _grad_size(value)
            held = slots_of(producers)
        for slot in slots_of(inputs):
            storages[slot]["users"].add(index)
        for slot in held:
            # The caller holds these through backward (NOTE [ The loss node ]).
            storages[slot]["is_output"] = True
            storages[slot]["users"].add(index + 1)
        saved_bytes = sum(st["size_bytes"] for st in storages
                          if st["producer"] == index and index in st["saved_by"])
        handed = backward[1] if backward is not None else ()
        stat = NodeStat(
            index=index, name="loss", op=LOSS_OP, target=name, module_path="",
            inputs=tuple(position[i] for i in inputs), users=(index + 1,),
            output_kind="tensor", requires_grad=True, flops=flops, output_bytes=output_bytes,
            work_bytes=larger(work, output_bytes), random=random, trainable=False,
            mutated_inputs=(), mutated_buffers=(),
            backward_bytes=backward[0] if backward is not None else sum(handed),
            input_grad_bytes=handed if backward is not None else (),
            grad_bytes=grad_size,
        )
        self._stats.append(stat)
        self._param_reads.append({})
        self.loss = LossStat(kind=kind, name=name, saved_bytes=saved_bytes,
                             grad_bytes=sum(handed), work_bytes=stat.work_bytes,
                             held=held_parts)
        return index + 1

    def _run_module(self, node: fx.Node, saved_now: list[torch.Tensor]) -> Any:
        """Run a leaf module on fake tensors or, if its forward needs tensor values (the
        reason the fx-leaves rung kept it whole), on real stand-ins; see NOTE [ Leaves that
        need real values ]."""
        try:
            return self.evaluate(node)
        except _DATA_DEPENDENT as err:
            failure = err
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return _run_real(self.module, str(node.target), self.real_state, args, kwargs, saved_now,
                         failure)

    def result(self, description: str) -> Profile:
        # A parameter read by several nodes gets one gradient per reader, summed before it
        # becomes .grad: those of the later readers wait for the first reader's backward.
        first_reader: dict[int, int] = {}
        for index, reads in enumerate(self._param_reads):
            for key in reads:
                first_reader.setdefault(key, index)
        shared: set[int] = set()
        for index, reads in enumerate(self._param_reads):
            held = tuple((size, first_reader[key]) for key, size in reads.items()
                         if first_reader[key] != index)
            shared.update(key for key in reads if first_reader[key] != index)
            if held:
                self._stats[index] = replace(self._stats[index], param_grad_held=held)
        # The first reader's own gradient of such a parameter is a temporary too: it is added
        # to the held ones when its backward has run.
        for index, reads in enumerate(self._param_reads):
            own = sum(size for key, size in reads.items()
                      if key in shared and first_reader[key] == index)
            if own:
                self._stats[index] = replace(self._stats[index], summed_param_grad_bytes=own)
        storages = tuple(
            StorageStat(
                size_bytes=s["size_bytes"],
                producer=s["producer"],
                users=tuple(sorted(s["users"])),
                saved_by=tuple(sorted(s["saved_by"])),
                requires_grad=s["requires_grad"],
                is_output=s["is_output"],
            )
            for s in self._storages
        )
        return Profile(nodes=tuple(self._stats), storages=storages, input_signature=description,
                       loss=self.loss)


# NOTE [ Leaves that need real values ]
# The fx-leaves rung keeps a submodule whole because its forward branches on tensor values
# (``if x.sum() > 0``); fake tensors have no values, so such a module raises here. It is run
# once for real instead, on stand-ins of its inputs' shapes and dtypes (random floats, zero
# integers), with the real parameters and clones of its buffers (so no BatchNorm statistic
# moves), under a forked RNG. Its saved tensors that are stand-ins for its inputs are mapped
# back to the fake inputs, so that a saved input counts once, where it was made; its outputs
# become fake tensors again for the nodes after it. The branch taken on random values may not
# be the one real data takes: the memory figures of that one module are an approximation.


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException,
            GuardOnDataDependentSymNode)


_DATA_DEPENDENT = _data_dependent_errors()


def _run_real(
    gm: fx.GraphModule,
    target: str,
    real_state: dict[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    saved_now: list[torch.Tensor],
    failure: BaseException,
) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._pytree import tree_map

    fake_of: dict[int, torch.Tensor] = {}

    def stand_in(value: Any) -> Any:
        if not isinstance(value, FakeTensor):
            return value
        if value.dtype.is_floating_point or value.dtype.is_complex:
            real = torch.randn(value.shape, dtype=value.dtype)
        else:
            real = torch.zeros(value.shape, dtype=value.dtype)
        real.requires_grad_(value.requires_grad)
        fake_of[storage_key(real)] = value
        return real

    fake_mode = next((v.fake_mode for v in tensors((args, kwargs)) if isinstance(v, FakeTensor)),
                     None)
    if fake_mode is None:
        raise failure
    prefix = f"{target}."
    module = gm.get_submodule(target)
    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
        state = {
            name[len(prefix):]: (t.detach().clone() if name[len(prefix):] in dict(
                module.named_buffers()) else t)
            for name, t in real_state.items() if name.startswith(prefix)
        }
        real_args, real_kwargs = tree_map(stand_in, (args, kwargs))
        start = len(saved_now)
        out = torch.func.functional_call(module, state, real_args, real_kwargs, strict=False)
        flags = [t.requires_grad for t in tensors(out)]
        out = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
    for i in range(start, len(saved_now)):
        saved_now[i] = fake_of.get(storage_key(saved_now[i]), saved_now[i])
    flag = iter(flags)

    def to_fake(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return fake_mode.from_tensor(value).requires_grad_(next(flag))
        return value

    return tree_map(to_fake, out)
def _carries_float_grad(value: Any) -> bool:
    return any(t.is_floating_point() and t.requires_grad for t in tensors(value))


def _grad_size(value: Any) -> int:
    """Bytes of the gradients of the tensors in ``value`` that require grad."""
    seen: set[int] = set()
    total = 0
    for t in tensors(value):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _count(value: Any) -> Any:
    """An int, or a symbolic one as it is (NOTE [ One profile for every shape ]): ``int()``
    would fix the sizes it depends on."""
    return value if isinstance(value, torch.SymInt) else int(value)


def _hint(size: Any) -> int:
    """A size's value at the shape profiled, without fixing a symbolic one."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _sizes_key(sizes: Iterable[Any]) -> tuple[Any, ...]:
    """Sizes as a hashable key: a symbolic size (NOTE [ One profile for every shape ]) as its
    expression, which two tensors of the same symbolic shape share."""
    return tuple(("sym", str(size.node.expr)) if isinstance(size, torch.SymInt) else size
                 for size in sizes)


_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
           torch.layout)


def _probe_key(interpreter: fx.Interpreter, node: fx.Node, storage_index: dict[int, int]
               ) -> tuple[Any, ...] | None:
    """What a node's backward probe depends on: the op, and for each argument its value, or
    for a tensor its shape, strides, dtype, whether it is an activation that carries gradient
    and which earlier argument it shares storage with. ``None`` when an argument is something
    else (then the node is probed on its own)."""
    seen: dict[int, int] = {}

    def describe(value: Any) -> Any:
        if isinstance(value, fx.Node):
            value = interpreter.env.get(value)
        if isinstance(value, torch.Tensor):
            key = storage_key(value)
            alias = seen.setdefault(key, len(seen))
            return ("T", _sizes_key(value.shape), _sizes_key(value.stride()),
                    _sizes_key((value.storage_offset(),)), value.dtype, value.requires_grad,
                    key in storage_index, alias)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *(describe(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, describe(v)) for k, v in value.items()))
        if isinstance(value, _SIMPLE):
            return value
        if isinstance(value, torch.SymInt):
            return _sizes_key((value,))
        raise TypeError  # not described: no sharing

    if node.op == "call_module":
        module = interpreter.module.get_submodule(str(node.target))
        target: Any = (type(module), tuple(
            (name, tuple(t.shape), t.dtype, t.requires_grad)
            for name, t in [*module.named_parameters(), *module.named_buffers()]))
        if any(True for _ in module.children()) or module.training is False:
            return None  # composite leaves may hide state; probe each one
    elif node.op in ("call_function", "call_method"):
        target = node.target
    else:
        return None
    try:
        return (node.op, target, describe(node.args), describe(node.kwargs))
    except TypeError:
        return None


# NOTE [ Temporaries of parameter gradients ]
# A backward probed only towards the activations skips the parameters' gradients, and with
# them the temporaries their ops make: a Linear on a permuted (channels-last) input copies
# that input to a contiguous block to compute its weight gradient, and a convolution on
# channels-last activations makes a channels-last weight gradient, which autograd copies to
# the parameter's layout before it becomes ``.grad`` (timm's ConvNeXt: 18% of its peak). So a
# node with trainable parameters is probed towards its activations and its parameters
# together, and the gradients of the parameters that become ``.grad`` as they are (not
# activations, as ``measure`` counts them) are taken off that probe's peak. A node without
# any (or whose probe with them fails) is probed towards its activations alone. Both probes
# once ran for every node with parameters, the larger peak kept: over the 21 models of the
# planning corpus the probe with parameters, less those gradients, was never below the other
# (333 nodes equal, 7 above) and handed the inputs the same gradients, so the second probe
# bought nothing but time.


# NOTE [ One forward for the node and its probe ]
# A node's forward runs once on the activations it reads, to measure what it saves and keeps
# alive, and its probe needs a forward on leaves standing for them (NOTE [ Probing without
# copies ]). Leaves that share their input's storage leave every count of the forward as it
# is (the same storages are read, saved and made), so the forward runs once, on the leaves,
# and its backward is the probe: one fake forward less per node, the dearer half of a
# profile. The value the node hands on then has a history that starts at those leaves, which
# is all any later node reads of it: each probes its own forward on leaves of its own. Nodes
# that write to their inputs (a leaf refuses it), concatenations (NOTE [ Backwards known
# without a probe ]) and the chunked head run as before, and so do a node whose forward
# fails on leaves and one that returns an input or a view of it (a later in-place op on its
# value would meet a leaf).


# NOTE [ Probing without copies ]
# A probe needs the node's inputs as autograd leaves, so that backward stops there and hands
# their gradients back. Most nodes only read their inputs, and a detached leaf sharing the
# input's storage is enough: no copy is made (a DenseNet layer's cat reads dozens of tensors,
# and each copy is one more fake-tensor dispatch, the cost of profiling). A node that writes
# to an input in place (``ReLU(inplace=True)``) refuses a leaf that requires grad, so it runs
# again on copies with a history of their own. Either way the leaves' storages are the
# node's inputs, not new bytes of its backward.


# NOTE [ Backwards known without a probe ]
# A concatenation's backward hands each input a slice of its output's gradient: views, no
# new storage, nothing saved. Probing it costs what probing any node does, times the number
# of inputs (a leaf, a slice and an accumulation for each), and a DenseNet concatenates up
# to 32 tensors at each of its 62 joins: a quarter of its profile went there. So a
# concatenation of distinct tensors of one dtype is not probed: its backward needs no new
# bytes and hands no new storage to any input. Not so for a mixed one (the slices are cast
# back: new storage) nor for a tensor joined twice (its two slices are summed).
# tests/test_profile.py checks the shortcut against the probe.
_JOINS = frozenset([
    torch.cat, torch.concat, torch.concatenate, torch.stack,
    torch.ops.aten.cat.default, torch.ops.aten.stack.default,
])


def _is_join(node: fx.Node) -> bool:
    """Whether the node concatenates or stacks."""
    return node.op == "call_function" and node.target in _JOINS


def _joins_without_copies(env: dict[fx.Node, Any], node: fx.Node) -> bool:
    """Whether the node concatenates or stacks tensors of its output's dtype: see NOTE
    [ Backwards known without a probe ]."""
    if not _is_join(node):
        return False
    value = env.get(node)
    if not isinstance(value, torch.Tensor):
        return False
    read: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), read.append)
    if len(read) != len(set(read)):
        return False  # the slices of a tensor joined twice are summed: new storage
    dtypes = {t.dtype for i in node.all_input_nodes for t in tensors(env.get(i))}
    return dtypes == {value.dtype}


def _writes_in_place(interpreter: fx.Interpreter, node: fx.Node) -> bool:
    """Whether the node says it writes to its input (``ReLU(inplace=True)``, ``x.add_()``,
    ``F.relu(x, inplace=True)``): its probe goes straight to copies (NOTE [ Probing without
    copies ]) instead of failing on a leaf first."""
    if node.op == "call_module":
        return getattr(interpreter.module.get_submodule(str(node.target)), "inplace",
                       False) is True
    if node.kwargs.get("inplace") is True:
        return True
    if isinstance(node.target, torch._ops.OpOverload):  # torch.export's graphs: aten.relu_
        arguments = node.target._schema.arguments
        alias = arguments[0].alias_info if arguments else None
        return alias is not None and alias.is_write
    name = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


_NORM_MODULES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_NORM_FUNCTIONS = frozenset([
    F.batch_norm, F.layer_norm, F.group_norm, torch.batch_norm, torch.layer_norm,
    torch.group_norm,
    # What torch.export's graphs call.
    torch.ops.aten.batch_norm.default, torch.ops.aten.layer_norm.default,
    torch.ops.aten.group_norm.default, torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default,
    torch.ops.aten._native_batch_norm_legit_functional.default,
])


def _fused_norm(interpreter: fx.Interpreter, node: fx.Node) -> bool:
    """Whether the node is a normalization whose parameter gradients come out of the same fused
    kernel as its input gradient, as per-channel vectors: its backward makes none of the
    temporaries NOTE [ Temporaries of parameter gradients ] is about, and the second probe
    (a slow one: fake tensors run these backwards as decompositions) is skipped."""
    if node.op == "call_module":
        return isinstance(interpreter.module.get_submodule(str(node.target)), _NORM_MODULES)
    return node.op == "call_function" and node.target in _NORM_FUNCTIONS


def _trainable_params(interpreter: _ProfileRunner, node: fx.Node, inputs: list[fx.Node]
                      ) -> list[torch.Tensor]:
    """The trainable parameters the node reads (its module's, or fetched by ``get_attr``)."""
    env = interpreter.env
    found = [env.get(i) for i in inputs if i.op == "get_attr"]
    if node.op == "call_module":
        found += list(interpreter.module.get_submodule(str(node.target)).parameters())
    params: list[torch.Tensor] = []
    ids: set[int] = set()
    for t in found:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and id(t) not in ids:
            ids.add(id(t))
            params.append(t)
    return params


_Leaves = list[tuple[int, torch.Tensor]]


def _leaf_inputs(env: dict[fx.Node, Any], inputs: list[fx.Node], storage_index: dict[int, int],
                 copy: bool) -> tuple[dict[fx.Node, Any], _Leaves, list[Any]]:
    """The node's inputs with each activation that carries gradient replaced by a fake leaf
    (NOTE [ Probing without copies ]): the substituted values, the leaves by input position,
    and the gradient edges backward is asked for."""
    leaves: _Leaves = []
    edges: list[Any] = []

    def fresh(k: int, value: Any) -> Any:
        if (isinstance(value, torch.Tensor) and value.requires_grad
                and storage_key(value) in storage_index):
            # A leaf of its own whose gradient edge is where the node's history starts; a
            # copy with a history of its own when the node writes to it in place.
            leaf = value.detach().requires_grad_()
            if copy:
                leaf = leaf.clone()
                # The copy's edge, taken now: an in-place op gives the tensor a new history.
                edges.append(torch.autograd.graph.get_gradient_edge(leaf))
            else:
                edges.append(leaf)
            leaves.append((k, leaf))
            return leaf
        return value

    substituted = {i: tree_map(functools.partial(fresh, k), env[i])
                   for k, i in enumerate(inputs) if i in env}
    return substituted, leaves, edges


def _probe_backward(interpreter: _ProfileRunner, node: fx.Node, inputs: list[fx.Node],
                    storage_index: dict[int, int], watcher: _WorkingSet,
                    saved_now: list[torch.Tensor], *, with_params: bool = False,
                    run: Any = None) -> tuple[int, tuple[int, ...], int] | None:
    """Run one node again on fake leaves standing for the activations it reads, then its backward
    from a fresh gradient of its output (see NOTE [ Gradients in backward ] in
    :mod:`autockpt.planning.chain`); :func:`_backward_peaks` says what is returned. ``run``, when
    given, computes the node's value from the environment instead of the node itself (the
    loss node)."""
    if run is None and node.op in ("placeholder", "output", "get_attr"):
        return None
    env = interpreter.env
    params: list[torch.Tensor] = []
    if with_params:
        params = _trainable_params(interpreter, node, inputs)
        if not params:
            return None
    if not with_params and run is None and _joins_without_copies(env, node):
        # See NOTE [ Backwards known without a probe ].
        value = env.get(node)
        if not any(t.requires_grad for t in tensors(value)):
            return None
        return 0, (0,) * len(inputs), 0
    originals = {i: env[i] for i in inputs if i in env}
    mark = len(saved_now)
    # See NOTE [ Probing without copies ].
    for copy in ((True,) if _writes_in_place(interpreter, node) else (False, True)):
        substituted, leaves, edges = _leaf_inputs(env, inputs, storage_index, copy)
        if not leaves:
            return None
        try:
            env.update(substituted)
            out = interpreter.evaluate(node) if run is None else run()
            break
        except Exception:  # noqa: BLE001 - cannot run twice on fake tensors: use the fallback
            if copy:
                return None
        finally:
            env.update(originals)
            saved = saved_now[mark:]
            del saved_now[mark:]
    del substituted, originals
    return _backward_peaks(out, saved, leaves, edges, params, len(inputs), watcher)


def _backward_peaks(out: Any, saved: list[torch.Tensor], leaves: _Leaves, edges: list[Any],
                    params: list[torch.Tensor], input_count: int, watcher: _WorkingSet
                    ) -> tuple[int, tuple[int, ...], int] | None:
    """Run the backward of a node's forward already run on leaves (``out``, what it saved),
    towards the leaves' ``edges`` and ``params``.

    Returns the most new bytes alive at once in that backward, less the bytes the node saved
    that the backward has already freed (the internals of a leaf module are freed op by op)
    and less the gradients of parameters that become their ``.grad``; per input the bytes of
    new storage handed on as its gradient; and the same peak with those parameter gradients
    counted (when ``.grad`` already exists they are temporaries added into it). None when
    nothing is differentiated, or when the node cannot run so on fake tensors (the chain then
    falls back to the inputs' sizes). The caller must hold no other reference to ``saved``:
    what the node saved is freed as its backward runs, and this counts it.
    """
    outs = [t for t in tensors(out) if t.requires_grad]
    if not outs:
        return None
    seeds = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in outs]
    leaf_keys = {storage_key(t) for _, t in leaves}
    temp_old = ({storage_key(t) for t in [*outs, *seeds, *saved]} | leaf_keys) - watcher.old_keys
    # What the node saved of its own making is freed as its backward runs.
    own: dict[int, torch.UntypedStorage] = {}
    for t in saved:
        key = storage_key(t)
        if key not in leaf_keys:
            own.setdefault(key, t.untyped_storage())
    watcher.reset()
    watcher.old_keys |= temp_old
    freed = _ledger_of(own.values(), watcher.note_freed)
    saved.clear()
    del own, out
    try:
        grads = torch.autograd.grad(outs, [*edges, *params], seeds, allow_unused=True)
    except Exception:  # noqa: BLE001 - an op without a fake backward: use the fallback
        return None
    finally:
        watcher.old_keys -= temp_old
        freed.clear()
    per_input = [0] * input_count
    seen = {storage_key(g) for g in seeds}
    for (k, _), grad in zip(leaves, grads):
        if grad is None:
            continue
        key = storage_key(grad)
        if key not in seen:
            seen.add(key)
            per_input[k] += grad.untyped_storage().nbytes()
    # The parameters' own gradients become .grad: see NOTE [ Temporaries of parameter
    # gradients ].
    param_bytes = 0
    for param, grad in zip(params, grads[len(edges):]):
        if grad is not None and storage_key(grad) not in seen and _same_layout(grad, param):
            seen.add(storage_key(grad))
            param_bytes += grad.untyped_storage().nbytes()
    return larger(watcher.peak_bytes - param_bytes, 0), tuple(per_input), watcher.peak_bytes


def _ledger_of(storages: Iterable[torch.UntypedStorage], on_free: Callable[[int], None]
               ) -> LiveStorages[int]:
    """A ledger that tells ``on_free`` the bytes of each of ``storages`` when it is freed
    (a function, so that no local of the caller keeps one of them alive)."""
    ledger: LiveStorages[int] = LiveStorages(on_free)
    for storage in storages:
        ledger.add(storage, storage.nbytes())
    return ledger


def _same_layout(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd can make ``grad`` the parameter's ``.grad`` as it is. Otherwise
    (a channels-last weight gradient of a convolution on channels-last activations, as in
    timm's ConvNeXt downsampling) it copies it to the parameter's layout, and the gradient
    made by backward is a temporary the size of the parameter."""
    return all(g == p for g, p, n in zip(grad.stride(), param.stride(), param.shape) if n > 1)


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", repr(target))
