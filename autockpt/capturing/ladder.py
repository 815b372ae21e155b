"""Stage 1: capture a model's forward as a graph, falling back rung by rung.

Most models people train were not written for torch.fx: a Hugging Face transformer fails to
trace on its first ``if attention_mask is not None`` check of a tensor's size, a diffusers UNet
on ``len`` of a proxy. :func:`capture` tries, in order:

1. ``"fx"``: :func:`torch.fx.symbolic_trace`-style tracing of the whole forward
   (:func:`autockpt.capturing.trace.trace`); the graph names the model's own submodules.
2. ``"export"``: :func:`torch.export.export` (non-strict, train mode). Its graph holds aten
   ops whose ``nn_module_stack`` still names the modules, reads parameters and buffers by
   their qualified names, and takes and returns pytree-flattened values, so keyword inputs,
   ``None`` arguments and ``ModelOutput`` results pass through.
3. ``"fx-leaves"``: torch.fx again, with each submodule in which tracing failed kept whole
   as a leaf (a ``call_module`` node the profiler runs as a black box).
4. ``"modules"``: no graph at all: module-level planning with hooks
   (:mod:`autockpt.running.blocks`), which checkpoints whole submodules such as
   ``model.layers[i]``.

The first rung that works is used; the plan's ``capture`` field says which one, and
``capture_reason`` why the earlier ones were not.

# NOTE [ Export in train mode, on a view ]
Like fx, export bakes ``if self.training:`` branches into the graph, so it runs in train mode
(the flags are restored after). It runs on a ``shallow_view`` of the user's module, so nothing
export registers while it runs lands on the user's object, and it is called with every
forward parameter passed by name, so that the graph's input structure does not depend on
whether the caller passed a value positionally or by keyword. The exported module's
``_guards_fn`` (a check that the inputs match what was exported) is dropped: the runtime
already keeps one graph per input signature.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from autockpt.capturing.meta import MetaAutocastError
from autockpt.capturing.shapes import input_dims
from autockpt.capturing.trace import (
    TracedModel,
    TraceSpec,
    base_class,
    bind_inputs,
    functions_applied,
    functions_called,
    has_attr_path,
    shallow_view,
    trace,
)
from autockpt.errors import AutockptError, TraceError
from autockpt.ops.instrument import rng_forked
from autockpt.units import format_names

__all__ = ["CAPTURES", "RUNGS", "NoGraph", "capture", "export_trace", "has_hooks",
           "hooked_modules", "trace_with_leaves", "unsharded_view"]

RUNGS = ("fx", "export", "fx-leaves", "modules")
"""The ways of capturing a forward, in the order ``"auto"`` tries them."""

CAPTURES = ("auto", *RUNGS)
"""Valid values of the ``capture`` argument of :func:`autockpt.apply` and :func:`autockpt.plan`."""

MAX_LEAVES = 32
"""How many untraceable submodules the ``"fx-leaves"`` rung keeps whole before giving up."""


@dataclass(frozen=True)
class NoGraph:
    """What :func:`capture` returns when only the ``"modules"`` rung is left (or was asked
    for): the caller plans over whole submodules instead (see :mod:`autockpt.running.blocks`)."""

    reason: str
    """Why the graph rungs were not used."""


def capture(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    method: str = "auto",
    keep_whole: Sequence[str] = (),
    *,
    dynamic: bool = False,
) -> TracedModel | NoGraph:
    """Capture ``module``'s forward for these inputs with the first rung that works.

    With ``dynamic``, the export rung marks every input size dynamic, so that the graph serves
    every shape it admits (NOTE [ One graph for every shape ] in
    :mod:`autockpt.capturing.shapes`); a torch.fx graph does so anyway.

    Returns :class:`NoGraph` when only the ``"modules"`` rung is left (or asked for).

    ``keep_whole`` names submodules (qualified names) whose calls stay module calls in the
    graph, so that hooks on them run (NOTE [ Module calls kept whole ]): torch.fx keeps them as
    leaves, and torch.export, which inlines every module, is skipped.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         if x.shape[0] > 4:  # fx cannot branch on a traced size; export can
        ...             x = x * 2
        ...         return self.fc(x)
        >>> traced = capture(Net(), (torch.randn(8, 4),), {})
        >>> traced.capture, traced.capture_reason.startswith("fx: torch.fx could not trace Net")
        ('export', True)

    Raises:
        TraceError: ``method`` names a graph rung and it failed (``"auto"`` never raises it
            for an untraceable model: it ends at ``"modules"``).
    """
    # torch.fx calls a random op with no traced argument for real (``torch.rand([])`` in
    # LayerDrop): the draws of a capture are not the user's.
    with rng_forked(module, args, kwargs):
        return _capture(module, args, kwargs, method, keep_whole, dynamic)


# NOTE [ Python's random numbers while tracing ]
# A forward may draw with Python's ``random`` or numpy's global generator: Wav2Vec2's adapter
# and MusicGen decide LayerDrop with ``np.random.random()`` / ``random.uniform(0, 1)``, and
# SpecAugment picks the time steps it masks with ``np.random``. torch.fx and torch.export run
# that Python once, at trace time, and the graph keeps its outcome: the same layers skipped
# and the same steps masked in every training step, silently. So a rung after which either
# generator has moved is refused (the modules rung runs the user's own forward), and both are
# put back, as the user's stream is not ours to draw from. A ``numpy.random.Generator`` the
# model owns cannot be watched this way.


@contextlib.contextmanager
def _no_python_draw(model_name: str) -> Iterator[None]:
    """Refuse a capture during which Python's or numpy's global random generator moved
    (NOTE [ Python's random numbers while tracing ])."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        moved = [name for name, moved in (
            ("random", random.getstate() != python_state),
            ("numpy.random", not _same_numpy_state(np.random.get_state(), numpy_state)))
            if moved]
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    if moved:
        raise TraceError(
            f"{model_name}'s forward drew random numbers with {format_names(moved)} while it "
            "was traced: the graph would keep that one draw for every step",
            fix="draw with torch (torch.rand) so that the graph holds the draw, or pass "
            "capture='modules', which runs the model's own forward",
            model_name=model_name)


def _same_numpy_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(a, b))


def _capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], method: str,
             keep_whole: Sequence[str], dynamic: bool = False) -> TracedModel | NoGraph:
    reasons: list[str] = []
    fx_failure: TraceError | None = None
    rungs = RUNGS if method == "auto" else (method,)
    for rung in rungs:
        if rung == "modules":
            return NoGraph("; ".join(reasons))
        try:
            with _no_python_draw(base_class(module).__name__):
                if rung == "fx":
                    traced = trace(module, args, kwargs, leaves=keep_whole)
                    traced.capture = "fx"  # the kept modules are the user's, not failures
                elif rung == "export":
                    if keep_whole:
                        raise TraceError(
                            f"torch.export inlines every module call, and {len(keep_whole)} "
                            f"must stay whole ({format_names(keep_whole)})",
                            fix="use a rung that keeps module calls: 'fx', 'fx-leaves' or "
                            "'modules'")
                    traced = export_trace(module, args, kwargs, dynamic=dynamic)
                elif fx_failure is None:
                    traced = trace_with_leaves(module, args, kwargs, leaves=keep_whole)
                else:
                    # Go on from where the first torch.fx attempt failed instead of tracing
                    # again.
                    _give_up_if_hopeless(fx_failure, keep_whole)
                    traced = trace_with_leaves(
                        module, args, kwargs, leaves=[*keep_whole, str(fx_failure.module_path)])
            if rung == "fx-leaves":
                _refuse_leaves_around(traced, keep_whole)
        except TraceError as err:
            if method != "auto":
                raise
            if rung == "fx":
                fx_failure = err
            reasons.append(f"{rung}: {_first_line(err.message)}")
            continue
        if rung == "fx" and method == "auto" and not keep_whole:
            traced = _enter_torch_nn_containers(module, args, kwargs, traced)
        if traced.capture_reason:  # what the rung itself noted comes after the earlier rungs
            reasons.append(traced.capture_reason)
        traced.capture_reason = "; ".join(reasons)
        return traced
    raise AssertionError("unreachable: the ladder ends with 'modules'")


# NOTE [ Module calls kept whole ]
# A rewritten forward runs the ops of the graph, not the modules that made them: a module that
# torch.fx (or torch.export) traced into is never called, so hooks registered on it never run.
# FSDP2's ``fully_shard(block)`` gathers a block's parameters in such a hook; tensor
# parallelism, activation offloading and profilers hook modules too. The modules named in
# ``keep_whole``, and every submodule that already has a hook when the graph is captured, stay
# ``call_module`` nodes: segments contain them whole, the generated code calls them (hooks
# run, once more in a recompute, as with any checkpoint), and the profile runs their forward
# without their hooks (a hook must not run on fake tensors). torch.export inlines every module,
# so such a model is captured by torch.fx (with leaves) or by the modules rung. A hook added
# after planning to a module the graph traced into is found at the next forward
# (:func:`autockpt.runtime.inlined_modules`), which plans again with it kept whole (blocks
# already sharded too: NOTE [ Planning a sharded model ]), or raises ``AutockptError`` naming
# ``keep_whole`` when that fails, never skipping it.


# NOTE [ Planning a sharded model ]
# torchtitan applies activation checkpointing first and then FSDP2's ``fully_shard`` to each
# block and to the root, so the blocks' hooks are found at the first forward and the model is
# planned again with the blocks kept whole. By then a sharded block holds DTensor parameters
# (this rank's shard; the DTensor's own shape is the full one), and its hooks gather them in
# a collective and free them again. Planning must neither run those hooks (a collective on
# fake tensors, or parameters swapped under the profile) nor profile the shards. So the
# stages before compiling run on :func:`unsharded_view`: the model's tree with each FSDP2
# module replaced by a view of the class it had before ``fully_shard``, its hooks left out;
# and a DTensor's fake copy is a plain fake tensor of its full shape
# (:func:`autockpt.ops.instrument.fake_copy`), what FSDP2 gathers for the block's forward. The
# root's own parameters are already gathered then (its pre-hook ran: the replan happens in
# its forward), or never sharded. The plan is compiled onto the transformed module itself,
# whose calls of the blocks run FSDP2's hooks. Nothing runs for real on sharded parameters:
# a forward that fake tensors cannot run, or ``cost="profile"`` timing, fails on the shards
# and the forward raises ``AutockptError`` naming ``keep_whole`` instead (planned before
# sharding, nothing of this is needed). Without FSDP2 modules the view is the model itself.


def unsharded_view(module: nn.Module) -> nn.Module:
    """``module`` as planning sees it: where its tree holds FSDP2 modules, a view of it in
    which each is a view of its class before ``fully_shard``, with no hooks, and each module
    on the path to one is a view too (NOTE [ Planning a sharded model ]); else ``module``.
    The Parameters, buffers and other submodules are the very same objects.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> unsharded_view(net) is net
        True
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return module

    def view_of(sub: nn.Module) -> nn.Module:
        children = {name: view_of(child) for name, child in sub._modules.items()
                    if child is not None}
        sharded = isinstance(sub, fsdp_module)
        if not sharded and all(children[name] is child for name, child in sub._modules.items()
                               if child is not None):
            return sub
        view = shallow_view(sub, _class_before_sharding(sub, fsdp_module))
        view._modules.update(children)
        if sharded:
            for hooks in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                          "_backward_hooks", "_forward_pre_hooks_with_kwargs",
                          "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                if isinstance(view.__dict__.get(hooks), dict):
                    view.__dict__[hooks].clear()
        return view

    return view_of(module)


def _class_before_sharding(module: nn.Module, fsdp_module: type) -> type[nn.Module]:
    """The user's class of ``module``: the first module class of its MRO that ``fully_shard``
    did not make, seen through autockpt's generated subclass (a block view's class is made
    from the sharded class, so the user's class comes after it)."""
    cls = next(c for c in type(module).__mro__
               if issubclass(c, nn.Module) and not issubclass(c, fsdp_module))
    return getattr(cls, "_autockpt_base", cls)


def hooked_modules(module: nn.Module) -> tuple[str, ...]:
    """Qualified names of ``module``'s submodules that have forward or backward hooks.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = net[1].register_forward_hook(lambda m, i, o: None)
        >>> hooked_modules(net)
        ('1',)
    """
    return tuple(name for name, sub in module.named_modules() if name and has_hooks(sub))


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks or module backward (pre-)hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


# NOTE [ torch.nn containers ]
# torch.fx never enters a module of the torch.nn namespace: ``nn.TransformerEncoder``, its
# layers, ``nn.TransformerDecoder`` and ``nn.Transformer`` become one ``call_module`` node each,
# and their forwards (fast-path checks on tensor properties, ``src.size(0) != tgt.size(0)``)
# cannot be traced symbolically anyway. A model built on them would be one opaque node: no cut
# inside it, nothing saved. torch.export traces through them down to aten ops whose
# ``nn_module_stack`` still names each layer, so such a graph goes to the export rung instead.
# A torch.nn module with fewer than two modules inside that hold parameters
# (``MultiheadAttention``: its ``out_proj``, a ``Linear``) stays a leaf: there is no layer
# boundary inside it to cut at, and it is still checkpointed whole as a node of the plan.
# When export fails, the fx graph with the containers kept whole is used, as before.


def _opaque_containers(traced: TracedModel) -> list[str]:
    """``'path' (Class)`` of each torch.nn module that fx kept whole although it holds layers
    of its own (NOTE [ torch.nn containers ])."""
    found = []
    for node in traced.graph.nodes:
        if node.op != "call_module":
            continue
        sub = traced.graph_module.get_submodule(str(node.target))
        layered = sum(1 for name, inner in sub.named_modules() if name and next(
            inner.parameters(recurse=False), None) is not None)
        if type(sub).__module__.startswith(("torch.nn.", "torch.ao.nn.")) and layered >= 2:
            found.append(f"{node.target!r} ({type(sub).__name__})")
    return found


def _enter_torch_nn_containers(module: nn.Module, args: tuple[Any, ...],
                               kwargs: dict[str, Any], traced: TracedModel) -> TracedModel:
    opaque = _opaque_containers(traced)
    if not opaque:
        return traced
    whole = f"fx: keeps the torch.nn container {', '.join(opaque)} whole"
    try:
        exported = export_trace(module, args, kwargs)
    except TraceError as err:
        traced.capture_reason = f"{whole}; export, which would enter it: " + _first_line(
            err.message)
        return traced
    exported.capture_reason = whole
    return exported


def _refuse_leaves_around(traced: TracedModel, keep_whole: Sequence[str]) -> None:
    """Raise when torch.fx failed in a module that holds modules to keep whole: the graph
    would have that whole module as one node, nothing to plan inside (the modules rung
    checkpoints the kept modules themselves)."""
    for node in traced.graph.nodes:
        target = str(node.target)
        if node.op == "call_module" and any(name.startswith(target + ".")
                                            for name in keep_whole):
            raise TraceError(
                f"torch.fx fails in {target!r}, which holds modules to keep whole",
                fix="autockpt.apply(..., capture='modules') checkpoints the kept modules "
                "themselves")


def _first_line(message: str, limit: int = 160) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --------------------------------------------------------------------------- rung 2: export


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without recording each node's Python stack: that is a third of export's time on
    a transformer, and nothing here reads ``stack_trace``. The switch
    (``torch.fx.config.do_not_emit_stack_traces``) is newer than some torch releases we
    support (2.11 has none); there export records the stacks, slower but the same graph."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


def export_trace(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 dynamic: bool = False) -> TracedModel:
    """Capture the forward with :func:`torch.export.export` (non-strict, train mode).

    See NOTE [ Export in train mode, on a view ]. With ``dynamic``, every dimension of every
    tensor input is ``Dim.AUTO`` (NOTE [ One graph for every shape ] in
    :mod:`autockpt.capturing.shapes`); where torch.export refuses that, the sizes are fixed.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> traced = export_trace(net, (torch.randn(1, 2),), {})
        >>> [n.op for n in traced.graph.nodes]
        ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output']

    Raises:
        TraceError: torch.export failed; the message says why.
    """
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree

    cls = base_class(module)
    arguments = bind_inputs(module, args, kwargs)
    view = shallow_view(module, cls)
    flags = [(m, m.training) for m in view.modules()]
    # A failed export prints the partial graph it made to stderr (hundreds of lines for a
    # transformer); the error below says why, and the next rung runs. Kept for a success.
    printed = io.StringIO()
    inlined: list[str] = []
    try:
        view.train()
        with _no_stack_traces(), contextlib.redirect_stderr(printed), \
                functions_applied(inlined):
            exported = _export(view, dict(arguments), dynamic)
    except MetaAutocastError:
        raise  # the model cannot be planned on meta by any rung: said as it is
    except Exception as err:  # export raises many kinds; all mean "not exportable"
        fix = ("see the torch.export error above; autockpt.apply(..., capture='modules') "
               "checkpoints whole submodules without a graph")
        if "Unsupported input type" in str(err):
            # A dataclass (or other class) in the inputs that pytree does not know: export
            # takes it once it is registered; fx and the modules rung take it as it is.
            fix = ("register the input's class with torch.export.register_dataclass (or "
                   "torch.utils._pytree.register_pytree_node), or " + fix.split("; ", 1)[1])
        raise TraceError(
            f"torch.export could not export {cls.__name__}: {type(err).__name__}: "
            f"{_first_line(str(err), 400)}",
            fix=fix,
            model_name=cls.__name__,
        ) from err
    finally:
        for mod, was_training in flags:
            mod.training = was_training
    sys.stderr.write(printed.getvalue())
    in_spec, out_spec = exported.call_spec.in_spec, exported.call_spec.out_spec
    lifted = _unlifted(exported)
    if lifted is not None:
        graph, root = lifted
    else:
        unlifted = exported.module()
        graph, root = fx.Graph(), unlifted
        graph.output(graph.graph_copy(unlifted.graph, {}))
        for node in list(graph.nodes):
            if node.op == "call_module" and str(node.target) == "_guards_fn" \
                    and not node.users:
                graph.erase_node(node)
    functions_called(graph)
    # Export reads parameters (get_attr) before the inputs; the planner expects the inputs
    # first, as fx puts them, so that no segment can start before an input exists.
    first = next(iter(graph.nodes))
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if node is not first:
            first.prepend(node)
    graph.lint()
    graph_module = fx.GraphModule(root, graph, class_name=cls.__name__)
    _check_shared_state(module, graph_module)
    placeholders = tuple(n.name for n in graph.nodes if n.op == "placeholder")

    def flatten(bound: dict[str, Any]) -> tuple[Any, ...]:
        flat = fx_pytree.tree_flatten_spec(((), dict(bound)), in_spec)
        if len(flat) != len(placeholders):
            raise AutockptError(
                f"internal error: the exported graph takes {len(placeholders)} inputs, the "
                f"call gives {len(flat)}",
                fix="please report this with the model; pass capture='modules' meanwhile",
            )
        return tuple(flat)

    def unflatten(value: Any) -> Any:
        return pytree.tree_unflatten(list(value), out_spec)

    constants = {
        str(node.target): _fetch(graph_module, str(node.target))
        for node in graph.nodes
        if node.op == "get_attr" and not has_attr_path(module, str(node.target))
    }
    return TracedModel(
        graph_module=graph_module,
        spec=TraceSpec(param_names=placeholders, constants=()),
        constants=constants,
        capture="export",
        input_dims=input_dims(graph, exported.range_constraints),
        flatten=flatten,
        unflatten=unflatten,
        notes=(f"torch.export traced into the custom autograd Function "
               f"{format_names(inlined)}: autograd differentiates its forward's ops, which "
               "can save more for backward than its own backward needs; capture='fx', where "
               "the model traces, keeps it whole",) if inlined else (),
    )


def _export(view: nn.Module, arguments: dict[str, Any], dynamic: bool) -> Any:
    """``torch.export.export`` of ``view`` called with ``arguments``, every tensor size
    ``Dim.AUTO`` where ``dynamic`` and torch.export takes it."""
    if dynamic:
        import torch.utils._pytree as pytree
        from torch.export import Dim

        shapes = pytree.tree_map(
            lambda value: {i: Dim.AUTO for i in range(value.dim())}
            if isinstance(value, torch.Tensor) else None, arguments)
        try:
            return torch.export.export(view, (), arguments, dynamic_shapes=shapes,
                                       strict=False)
        except MetaAutocastError:
            raise
        except Exception:  # noqa: BLE001 - fixed sizes are tried next, and say why they fail
            pass
    return torch.export.export(view, (), arguments, strict=False)


# NOTE [ Unlifting the exported graph ]
# An ExportedProgram's graph takes the parameters, buffers and constants as inputs ("lifted")
# and may return buffers it mutates before the user's outputs (in the training dialect
# export uses, BatchNorm's running statistics are written in place in the graph instead).
# ``ExportedProgram.module()`` turns that back into a module that reads its state with
# get_attr nodes and writes returned mutations back with ``copy_``; it was a sixth of
# export's time on a diffusers UNet, most of it building modules and code that autockpt then
# throws away for its own. :func:`_unlifted` makes the same graph directly from the program's
# signature: each lifted input becomes a get_attr of its qualified name, each mutated buffer
# (or input) an ``aten.copy_`` of its new value into it before the output, and the output the
# user's outputs alone, as a tuple the output spec unflattens. A program with anything else
# in its signature (effect tokens, outside the training dialect) goes through
# ``ExportedProgram.module()`` as before.

_LIFTED = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR", "CUSTOM_OBJ")
_MUTATED = ("BUFFER_MUTATION", "USER_INPUT_MUTATION", "PARAMETER_MUTATION")


def _unlifted(exported: Any) -> tuple[fx.Graph, nn.Module] | None:
    """The exported graph with its state read by get_attr and its mutations written back,
    and a module that holds that state by qualified name; None for a program it does not
    handle (NOTE [ Unlifting the exported graph ])."""
    signature = exported.graph_signature
    if exported.verifiers[0].dialect != "TRAINING" or any(
            spec.kind.name not in (*_LIFTED, "USER_INPUT") for spec in signature.input_specs) \
            or any(spec.kind.name not in (*_MUTATED, "USER_OUTPUT")
                   for spec in signature.output_specs):
        return None
    state = {**exported.state_dict, **exported.constants}
    graph = fx.Graph()
    out = graph.graph_copy(exported.graph, {})
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(signature.input_specs):
        return None
    read: dict[str, fx.Node] = {}
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind.name == "USER_INPUT":
            read[node.name] = node
            continue
        if spec.target not in state:
            return None
        with graph.inserting_after(node):
            getter = graph.get_attr(spec.target)
        node.replace_all_uses_with(getter)
        getter.meta = node.meta
        graph.erase_node(node)
        read[spec.target] = getter
    values = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(values) != len(signature.output_specs):
        return None
    outputs = []
    for value, spec in zip(values, signature.output_specs):
        if spec.kind.name == "USER_OUTPUT":
            outputs.append(value)
        elif spec.target in read:
            graph.call_function(torch.ops.aten.copy_.default, (read[spec.target], value))
        else:
            return None
    graph.output(tuple(outputs))
    # Installed in graph order, as the program's own module would give them to the graph
    # module: of two tied names, the first read is the one named_parameters() keeps.
    root = nn.Module()
    transient = set(signature.non_persistent_buffers)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            # The submodules of higher-order ops (a region under no_grad) are the program's.
            value = state[target] if target in state else _fetch(exported.graph_module, target)
            _install(root, target, value, buffer=target in signature.buffers,
                     persistent=target not in transient)
    return graph, root


def _install(root: nn.Module, target: str, value: Any, *, buffer: bool,
             persistent: bool) -> None:
    *path, name = target.split(".")
    owner = root
    for atom in path:
        if not hasattr(owner, atom):
            owner.add_module(atom, nn.Module())
        owner = getattr(owner, atom)
    if hasattr(owner, name):
        return
    if buffer:
        owner.register_buffer(name, value, persistent=persistent)
    else:
        setattr(owner, name, value)


def _check_shared_state(module: nn.Module, graph_module: fx.GraphModule) -> None:
    """The exported graph must read the user's very Parameter objects: the segments fetch
    them from the user's module by the same names at run time."""
    own = dict(module.named_parameters(remove_duplicate=False))
    for name, param in graph_module.named_parameters():
        if name in own and own[name] is not param:
            raise TraceError(
                f"torch.export copied parameter {name!r} instead of sharing it",
                fix="pass capture='modules' to checkpoint whole submodules without a graph",
                model_name=base_class(module).__name__,
            )


def _fetch(root: Any, target: str) -> Any:
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


# --------------------------------------------------------------------------- rung 3: leaves


def trace_with_leaves(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      *, leaves: Sequence[str] = ()) -> TracedModel:
    """Trace with torch.fx, keeping each submodule in which tracing fails whole.

    Tracing is retried with the failing submodule added to the leaves until it succeeds; a
    failure in the model's own forward (outside any submodule) cannot be helped this way.

    Example:
        >>> import torch
        >>> class Gate(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x if x.sum() > 0 else -x  # data-dependent: fx cannot trace it
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), Gate(), torch.nn.Linear(4, 4))
        >>> traced = trace_with_leaves(net, (torch.randn(2, 4),), {})
        >>> [str(n.target) for n in traced.graph.nodes if n.op == "call_module"]
        ['0', '1', '2']

    Raises:
        TraceError: tracing failed outside any submodule, or in too many of them.
    """
    kept = list(leaves)
    while True:
        try:
            return trace(module, args, kwargs, leaves=kept)
        except TraceError as err:
            _give_up_if_hopeless(err, kept)
            kept.append(str(err.module_path))


def _give_up_if_hopeless(err: TraceError, kept: Sequence[str]) -> None:
    """Raise when keeping one more submodule whole cannot help: torch.fx failed outside any
    submodule, in one already kept whole, or in too many."""
    path = err.module_path
    if path and path not in kept and len(kept) < MAX_LEAVES:
        return
    where = "in the model's own forward" if not path else f"in {path!r}"
    raise TraceError(
        f"torch.fx fails {where} even with {len(kept)} submodules kept whole "
        f"({', '.join(kept) or 'none'}): {_first_line(err.message)}",
        fix="autockpt.apply(..., capture='modules') checkpoints whole submodules without a "
        "graph",
        model_name=err.model_name,
        location=err.location,
        module_path=path,
    ) from err
