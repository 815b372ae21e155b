"""``cost="profile"``: time every node of a captured graph on the real device.

FLOPs are a poor clock for ops that are bound by memory traffic or by launch overhead (norms,
activations, views, small elementwise ops), so a plan that minimises recomputed FLOPs may not
minimise recomputed *time*. :func:`time_nodes` runs the graph for real, node by node, and
measures each node; the planner then uses those times as the recompute cost of the nodes (see
:func:`autockpt.profiling.stats.node_cost`).

# NOTE [ Timing leaves the model as it was ]
The graph runs on the real example inputs with the model's own parameters, but on clones of
its buffers (swapped in with ``torch.func.functional_call``, as the profiler does with fake
state), so BatchNorm's running statistics do not move; on clones of the inputs, so an in-place
op in the forward cannot change the caller's tensors; under ``torch.random.fork_rng``, so
dropout does not advance the caller's RNG streams; and in train mode (the mode the graph was
captured in, and the one whose forward a checkpoint recomputes), the modules' flags being
restored afterwards.

# NOTE [ Times are noisy ]
Timings depend on what else the machine runs, on clocks and caches: two calls can give
different numbers, and so different plans. ``cost="flops"`` (the default) is deterministic;
``cost="profile"`` is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from autockpt.capturing.trace import TracedModel
from autockpt.errors import InvalidArgumentError
from autockpt.ops.instrument import run_with_state, tensors

__all__ = ["COSTS", "time_nodes"]

COSTS = ("flops", "profile")
"""Valid values of the ``cost`` argument of :func:`autockpt.apply` and :func:`autockpt.plan`:
``"flops"`` (FLOPs plus bytes written, from the fake-tensor profile; deterministic) or
``"profile"`` (each node timed on the real device; noisy)."""


def time_nodes(traced: TracedModel, inputs: dict[str, Any], *, repeat: int = 3
               ) -> tuple[int, ...]:
    """The median forward time of each node of ``traced``'s graph, in integer nanoseconds, in
    graph order (0 for placeholders, ``get_attr`` and the output).

    ``inputs`` maps the forward's parameter names (``traced.spec.param_names``) to real
    example values. The graph runs once to warm up, then ``repeat`` more times; each node's
    time is the median of its ``repeat`` samples. Parameters, buffers, inputs and RNG streams
    are left as they were (see NOTE [ Timing leaves the model as it was ]).

    Example:
        >>> import torch
        >>> from autockpt.capturing.trace import trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> times = time_nodes(trace(net, (x,)), {"input": x})
        >>> [t > 0 for t in times]
        [False, True, True, False]

    Raises:
        InvalidArgumentError: ``repeat`` is not a positive int, an input is missing, or an
            input is a fake or meta tensor (there is nothing to time on those).
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise InvalidArgumentError(f"repeat must be a positive int, got {repeat!r}",
                                   fix="pass e.g. repeat=3")
    gm = traced.graph_module
    values_in = []
    for name in traced.spec.param_names:
        if name not in inputs:
            raise InvalidArgumentError(f"no example value for the forward's parameter {name!r}")
        values_in.append(inputs[name])
    for t in tensors(values_in):
        if t.is_meta or _is_fake(t):
            raise InvalidArgumentError(
                "cost=\"profile\" times the model on real tensors, but an example input is a "
                f"{'meta' if t.is_meta else 'fake'} tensor",
                fix="pass real example inputs on the training device, or use cost=\"flops\"",
            )
    timer = _NodeTimer(gm, _device_of(gm, values_in))
    with _train_mode(gm), _forked_rng(timer.device), torch.no_grad():
        # no_grad is right for what this measures: the forward that a checkpoint recomputes.
        # (The recompute itself runs with grad enabled, which adds the cost of recording the
        # autograd graph, roughly in proportion to the forward; backward is not timed.)
        for run in range(repeat + 1):  # the first run warms up: lazy init, caches, allocator
            buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
            timer.record = run > 0
            run_with_state(gm, buffers, timer.run_graph, tuple(_clone(v) for v in values_in))
    return tuple(int(statistics.median(s)) if s else 0 for s in timer.samples)


class _NodeTimer(fx.Interpreter):
    """Runs the graph node by node, timing each, as ``torch.fx.passes.shape_prop.ShapeProp``
    runs it propagating shapes: :attr:`samples` gets one time per run for each node that
    computes."""

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        # Every value is kept to the end of the run, as the captured forward keeps them.
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.device = device
        self.record = False
        self._position = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.samples: list[list[int]] = [[] for _ in self._position]
        """Per node in graph order, its times in nanoseconds (when :attr:`record`)."""

    def run_graph(self, *values_in: Any) -> Any:
        """One run on the forward's parameters, in order."""
        return self.run(*values_in, enable_io_processing=False)

    def _sync(self) -> None:
        # CUDA kernels run asynchronously: without a barrier on both sides, a node's time
        # would be its launch overhead plus whatever earlier kernels were still running.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        self._sync()
        start = time.perf_counter_ns()
        value = super().run_node(n)
        self._sync()
        elapsed = time.perf_counter_ns() - start
        if self.record and n.op != "get_attr":
            # At least 1 ns: a compute node is never free, and 0 means "not timed".
            self.samples[self._position[n]].append(max(1, elapsed))
        return value


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _clone(value: Any) -> Any:
    """A copy of an input whose tensors an in-place op may write without harm (a clone of a
    leaf that requires grad stays one for the ops that read it: requires_grad is kept)."""

    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return v.detach().clone().requires_grad_(v.requires_grad)

    return tree_map(one, value)


def _device_of(gm: fx.GraphModule, values_in: list[Any]) -> torch.device:
    """Where the model computes: its parameters' device, else its buffers', else the
    inputs'."""
    for t in [*gm.parameters(), *gm.buffers(), *tensors(values_in)]:
        return t.device
    return torch.device("cpu")


@contextmanager
def _train_mode(gm: fx.GraphModule) -> Iterator[None]:
    """Train mode for the run, each module's own flag restored afterwards."""
    flags = [(m, m.training) for m in gm.modules()]
    gm.train()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


@contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """The CPU RNG and, on CUDA, the device's RNG, restored afterwards."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index], device_type="cuda"):
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            yield
