"""Stage 2: measure every node of a traced graph on fake tensors.

The graph runs once under ``FakeTensorMode``, node by node, with fake copies of the
parameters and buffers swapped in (``torch.func.functional_call``): shapes, dtypes and autograd
behave as for real, but no memory is allocated and no real tensor, buffer or RNG stream is
touched. For each node the pass records the facts the planner needs (see
:class:`autockpt.stats.NodeStat`) and writes them into ``node.meta["autockpt"]``.

# NOTE [ Which bytes are saved for backward ]
A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves while a node runs. Tensors
are keyed by their storage, so that a ReLU saving its output and the next Linear saving the
same tensor as its input count once, and views count as their base. Storages of parameters,
buffers and model inputs are not activations and are left out. A storage first seen inside a
node (BatchNorm's saved mean, the internals of a leaf module) is attributed to that node.
"""

from __future__ import annotations

from typing import Any

import functools
import weakref

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from autockpt.errors import InvalidArgumentError
from autockpt.stats import NodeStat, Profile, StorageStat
from autockpt.trace import TracedModel

__all__ = ["profile", "describe_inputs"]


class _OpWatcher(TorchDispatchMode):
    """Notes whether an op that consumes the RNG ran, and which storages ops wrote in place.

    Writes are read off each op's schema (``Tensor(a!)`` arguments), which also catches
    BatchNorm's running statistics: fake kernels do not bump their version counters. Some
    batch-norm ops update ``running_mean`` and ``running_var`` in training without saying so
    in their schema (``native_batch_norm``, ``cudnn_batch_norm``, ``miopen_batch_norm``, the
    op ``F.batch_norm`` reaches on CPU): :func:`_unannotated_writes` adds those.
    """

    def __init__(self, old_keys: set[int]) -> None:
        super().__init__()
        self.random = False
        self.written: set[int] = set()
        # Storages that exist before a node runs (inputs, parameters, earlier activations)
        # are not part of its working set; the caller adds each node's results.
        self.old_keys = old_keys
        self._refs: list[weakref.ref[torch.UntypedStorage]] = []
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset(self) -> None:
        self.random = False
        self.written = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live = {}

    def _release(self, key: int, _ref: object) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def _note_output(self, tensor: torch.Tensor) -> None:
        # Fake storages are freed like real ones, so weak references tell how many bytes a
        # node's ops hold at once: its working set, temporaries inside leaf modules included.
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        size = storage.nbytes()
        self._live[key] = size
        self._refs.append(weakref.ref(storage, functools.partial(self._release, key)))
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in _tensors(value):
                    self.written.add(_storage_key(t))
        for t in _unannotated_writes(func, args, kwargs):
            self.written.add(_storage_key(t))
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if not self._is_old(t):
                self._note_output(t)
        return out

    def _is_old(self, tensor: torch.Tensor) -> bool:
        return _storage_key(tensor) in self.old_keys


_RUNNING_STATS = ("running_mean", "running_var")


@functools.cache
def _running_stat_positions(func: Any) -> tuple[int, tuple[int, ...]] | None:
    """``(position of training, positions of running stats)`` for an op that takes running
    statistics and a ``training`` flag but does not mark them written in its schema."""
    arguments = func._schema.arguments
    names = [a.name for a in arguments]
    if "training" not in names:
        return None
    stats = tuple(
        i for i, a in enumerate(arguments)
        if a.name in _RUNNING_STATS and not (a.alias_info is not None and a.alias_info.is_write)
    )
    return (names.index("training"), stats) if stats else None


def _unannotated_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> list[torch.Tensor]:
    """The running statistics a batch-norm op updates in training although its schema does
    not say so."""
    positions = _running_stat_positions(func)
    if positions is None:
        return []
    arguments = func._schema.arguments

    def value(i: int) -> Any:
        return args[i] if i < len(args) else kwargs.get(arguments[i].name)

    training, stats = positions
    if value(training) is not True:
        return []
    return [t for i in stats for t in _tensors(value(i))]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def describe_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``"x: float32[16, 1000]"``-style description of a call's tensor arguments."""

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
        return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(
            value
        ).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0])
    return ""


def _output_kind(node: fx.Node, value: Any) -> str:
    if node.op == "get_attr":
        return "parameter"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "container" if _tensors(value) else "constant"


def profile(traced: TracedModel, inputs: dict[str, Any]) -> Profile:
    """Run the traced graph on fake tensors and measure each node.

    ``inputs`` maps the forward's parameter names to the example values (real or fake tensors,
    or Python values); only their shapes, dtypes and ``requires_grad`` matter.

    Example:
        >>> import torch
        >>> from autockpt.trace import trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> prof = profile(trace(net, (x,)), {"input": x})
        >>> [n.output_bytes for n in prof.nodes]
        [0, 128, 128, 0]
    """
    gm = traced.graph_module
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    # Tied parameters (shared embeddings) appear once here; functional_call re-ties them.
    named = list(gm.named_parameters()) + list(gm.named_buffers())
    fake_state = {name: fake_mode.from_tensor(t) for name, t in named}
    param_keys = {_storage_key(t) for t in fake_state.values()}
    buffer_names = {_storage_key(fake_state[n]): n for n, _ in gm.named_buffers()}

    def fakeify(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fake_mode.from_tensor(value)
        return value

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values_in = []
    for node, name in zip(placeholders, traced.spec.param_names):
        if name not in inputs:
            raise InvalidArgumentError(f"no example value for the forward's parameter {name!r}")
        values_in.append(fakeify(inputs[name]))
    input_keys = {_storage_key(t) for v in values_in for t in _tensors(v)}

    runner = _ProfileRunner(gm, param_keys, input_keys, buffer_names)
    with fake_mode:
        torch.func.functional_call(runner, {f"gm.{k}": v for k, v in fake_state.items()},
                                   tuple(values_in), strict=False)
    description = describe_inputs((), {n: inputs[n] for n in traced.spec.param_names})
    return runner.result(description)


class _ProfileRunner(torch.nn.Module):
    """Runs the graph node by node (a module, so ``functional_call`` can swap in fake state)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        param_keys: set[int],
        input_keys: set[int],
        buffer_names: dict[int, str],
    ) -> None:
        super().__init__()
        self.gm = gm
        self._param_keys = param_keys
        self._input_keys = input_keys
        self._buffer_names = buffer_names
        self._stats: list[NodeStat] = []
        self._storages: list[dict[str, Any]] = []

    def forward(self, *values_in: Any) -> None:
        gm = self.gm
        nodes = list(gm.graph.nodes)
        position = {node: i for i, node in enumerate(nodes)}
        interpreter = fx.Interpreter(gm)
        # storage key -> index into self._storages; inputs and parameters are not activations.
        storage_index: dict[int, int] = {}
        value_storages: dict[fx.Node, list[int]] = {}
        storages = self._storages
        saved_now: list[torch.Tensor] = []
        args_iter = iter(values_in)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved_now.append(tensor)
            return tensor

        def own(key: int, tensor: torch.Tensor, producer: int) -> int | None:
            if key in self._param_keys or key in self._input_keys:
                return None
            if key not in storage_index:
                storage_index[key] = len(storages)
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
            return storage_index[key]

        flop_counter = FlopCounterMode(display=False)
        watcher = _OpWatcher(old_keys=set(self._param_keys) | set(self._input_keys))
        with flop_counter, watcher, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for index, node in enumerate(nodes):
                flops_before = flop_counter.get_total_flops()
                watcher.reset()
                saved_now.clear()
                input_nodes = node.all_input_nodes
                if node.op == "placeholder":
                    value = next(args_iter)
                elif node.op == "output":
                    value = None
                else:
                    value = interpreter.run_node(node)
                interpreter.env[node] = value
                written = watcher.written
                mutated_buffers = {self._buffer_names[k] for k in written if k in self._buffer_names}
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
                watcher.old_keys.update(_storage_key(t) for t in _tensors(value))
                watcher.old_keys.update(_storage_key(t) for t in saved_now)
                out_storages: list[int] = []
                output_bytes = 0
                if node.op not in ("output", "get_attr"):
                    for t in _tensors(value):
                        key = _storage_key(t)
                        is_new = key not in storage_index
                        slot = own(key, t, index)
                        if slot is not None:
                            if slot not in out_storages:
                                out_storages.append(slot)
                            if is_new:
                                output_bytes += storages[slot]["size_bytes"]
                value_storages[node] = out_storages
                for t in saved_now:
                    slot = own(_storage_key(t), t, index)
                    if slot is not None:
                        storages[slot]["saved_by"].add(index)
                for i in input_nodes:
                    for slot in value_storages.get(i, ()):
                        storages[slot]["users"].add(index)
                        if node.op == "output":
                            storages[slot]["is_output"] = True
                trainable = False
                if node.op == "call_module":
                    module = gm.get_submodule(str(node.target))
                    trainable = any(p.requires_grad for p in module.parameters())
                trainable = trainable or any(
                    i.op == "get_attr"
                    and isinstance(interpreter.env.get(i), torch.Tensor)
                    and interpreter.env[i].requires_grad
                    for i in input_nodes
                )
                stat = NodeStat(
                    index=index,
                    name=node.name,
                    op=node.op,
                    target=_target_name(node),
                    module_path=_module_path(node),
                    inputs=tuple(sorted(position[i] for i in input_nodes)),
                    users=tuple(sorted(position[u] for u in node.users)),
                    output_kind=_output_kind(node, value),
                    requires_grad=any(t.requires_grad for t in _tensors(value)),
                    flops=int(flop_counter.get_total_flops() - flops_before),
                    output_bytes=output_bytes,
                    work_bytes=max(work_bytes, output_bytes),
                    random=watcher.random,
                    trainable=trainable,
                    mutated_inputs=tuple(mutated_inputs),
                    mutated_buffers=tuple(sorted(mutated_buffers)),
                )
                node.meta["autockpt"] = stat
                self._stats.append(stat)

    def result(self, description: str) -> Profile:
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
        return Profile(nodes=tuple(self._stats), storages=storages, input_signature=description)


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", repr(target))
