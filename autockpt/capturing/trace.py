"""Stage 1: trace a model into an fx graph whose names are the model's own.

The graph is traced from a *view* of the user's module: a new object of the same class whose
attribute dictionary is a shallow copy of the original's. The view shares every submodule,
Parameter and buffer with the original, so the graph's ``call_module`` and ``get_attr`` targets
are the original's qualified names, yet nothing the tracer stores on its root (tensor constants)
lands on the user's module.

# NOTE [ Custom autograd Functions stay whole ]
A ``torch.autograd.Function`` the model defines (BLOOM's ``GeLUFunction``, a fused kernel's wrapper)
often exists to save less for backward than its forward's ops would: GeLUFunction saves its input
only and recomputes the rest in its own backward. fx would trace into its forward and record those
ops, so the graph's backward would be autograd's, saving every intermediate: for four such layers
trained with cross-entropy (tests/test_capture.py) the plan put the graph's baseline at 2.5x the
model's measured peak, and the least plan measured 704 KiB where the Function kept whole needs
512 KiB. While tracing, ``Function.apply`` with a proxy among its arguments becomes one
``call_function`` node that calls the real ``apply``, so the rewritten model runs the user's
Function, its forward and its backward. Functions defined in torch itself, and calls with an
argument the graph cannot hold as a constant (a Python function, a module), are traced into as
before. torch.export has no such switch and inlines every Function it meets; so while it traces, a
Function applied to tensors only is replaced by an operator of its own
(``autockpt_function::f<k>(Tensor[] args) -> Tensor[]``, :func:`_operator_of`), which export records
as one node whose fake kernel runs the real ``apply`` on fake tensors for the output shapes, and
:func:`functions_called` then makes that node call the real ``apply`` (BLOOM, whose root fx cannot
trace: least memory 65% -> 49% of its baseline). One with another argument (a number, a flag) or
output, which the operator's schema cannot carry, is still inlined by export, and the plan says so.

# NOTE [ Trace in train mode ]
fx bakes Python-level ``if self.training:`` branches into the graph. A graph traced in eval
mode would drop dropout or DropPath and train wrongly, so tracing always runs in train mode and
the flags are restored afterwards. The checkpointed forward only runs in train mode; eval mode
runs the model's own forward.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from autockpt.capturing.draws import NoRealDraw
from autockpt.errors import InvalidArgumentError, TraceError
from autockpt.ops.instrument import OpWatch
from autockpt.units import format_names

if TYPE_CHECKING:
    from autockpt.capturing.shapes import InputDims

__all__ = ["TraceSpec", "TracedModel", "trace", "bind_inputs", "forward_signature",
           "split_inputs", "describe_inputs", "module_path", "base_class", "shallow_view",
           "generated_subclass", "functions_applied"]

#: Python values that are baked into the graph (a new value means a new plan).
_CONSTANT_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class TraceSpec:
    """How the model's forward was called when it was traced."""

    param_names: tuple[str, ...]
    """Names of the forward's parameters (without ``self``), in order."""
    constants: tuple[tuple[str, Any], ...]
    """Parameters whose value was a Python constant (``None``, a flag, a number) and so is baked
    into the graph, as ``(name, value)`` pairs in parameter order."""


@dataclass
class TracedModel:
    """The result of :func:`trace`: a graph plus what is needed to run it on the user's module."""

    graph_module: fx.GraphModule
    """The traced graph in a GraphModule whose submodules are the user's own objects."""
    spec: TraceSpec
    """Which forward parameters were constants when traced."""
    constants: dict[str, Any]
    """Tensor constants the tracer created (``_tensor_constant0``...), by attribute name: they
    are not part of the user's module and must travel with the rewritten forward."""
    capture: str = "fx"
    """Which rung of the capture ladder made the graph (see :mod:`autockpt.capturing.ladder`)."""
    capture_reason: str = ""
    """Why the rungs before it were not used."""
    flatten: Callable[[dict[str, Any]], tuple[Any, ...]] | None = field(default=None, repr=False)
    """Maps the forward's bound arguments to the graph's placeholders, in order; ``None``
    means one placeholder per name in ``spec.param_names``."""
    unflatten: Callable[[Any], Any] | None = field(default=None, repr=False)
    """Rebuilds the forward's real output from what the graph returns; ``None``: as it is."""
    notes: tuple[str, ...] = ()
    """What the plan must say about the graph (custom autograd Functions traced into)."""
    input_dims: InputDims | None = None
    """The input sizes the graph runs at (an exported graph); ``None``: any (torch.fx reads
    sizes in the graph). NOTE [ One graph for every shape ] in
    :mod:`autockpt.capturing.shapes`."""

    def accepts(self, arguments: dict[str, Any]) -> bool:
        """Whether the graph runs on a call bound to ``arguments`` of this graph's input
        structure."""
        if self.input_dims is None:
            return True
        try:
            values = self.graph_inputs(arguments)
        except Exception:  # noqa: BLE001 - another structure than the graph's
            return False
        return self.input_dims.accepts(values)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def graph_inputs(self, arguments: dict[str, Any]) -> tuple[Any, ...]:
        """The values of the graph's placeholders for a call bound to ``arguments``."""
        if self.flatten is not None:
            return self.flatten(arguments)
        return tuple(arguments[name] for name in self.spec.param_names)


def split_inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from the ``example_inputs`` / ``example_kwargs`` the public
    functions take: a tensor, a tuple or list of positional inputs, or a dict of keyword
    inputs.

    Example:
        >>> split_inputs({"x": 1}, {"mask": None})
        ((), {'x': 1, 'mask': None})
    """
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise InvalidArgumentError(
            f"example_kwargs must be a dict, got {type(example_kwargs).__name__}",
            fix="pass example_kwargs={'mask': mask}",
        )
    kwargs = dict(example_kwargs or {})
    if example_inputs is None:
        return (), kwargs
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), kwargs
    if isinstance(example_inputs, Mapping):
        return (), {**dict(example_inputs), **kwargs}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), kwargs
    raise InvalidArgumentError(
        f"example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword "
        f"inputs, got {type(example_inputs).__name__}",
        fix="pass example_inputs=(x,) for model(x)",
    )


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


def module_path(node: fx.Node) -> str:
    """The qualified name of the module a node of a captured graph runs in ("" at the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0])
    return ""


def base_class(module: nn.Module) -> type[nn.Module]:
    """The user's class of ``module``, looking through autockpt's generated subclass."""
    cls = type(module)
    return getattr(cls, "_autockpt_base", cls)


_GENERATED: dict[tuple[type, type], type] = {}
_GENERATED_LOCK = threading.Lock()


def generated_subclass(mixin: type, base: type[nn.Module]) -> type[nn.Module]:
    """The subclass ``(mixin, base)`` autockpt gives a module it wraps, made once per pair.

    It carries ``base``'s name, module and docstring, so it reads as the user's class, and
    ``_autockpt_base`` so that :func:`base_class` sees through it. A ``forward`` the mixin
    defines shows ``base.forward``'s signature and docstring: what reads the signature (the
    columns Hugging Face's Trainer keeps, whether it passes loss kwargs, PEFT, accelerate)
    sees what it saw before.

    Example:
        >>> import inspect
        >>> class Mixin:
        ...     def forward(self, *args, **kwargs):
        ...         return super().forward(*args, **kwargs)
        >>> cls = generated_subclass(Mixin, torch.nn.Linear)
        >>> str(inspect.signature(cls(2, 2).forward))
        '(input: torch.Tensor) -> torch.Tensor'
    """
    with _GENERATED_LOCK:
        cls = _GENERATED.get((mixin, base))
        if cls is None:
            attrs: dict[str, Any] = {
                "_autockpt_base": base, "__module__": base.__module__,
                "__qualname__": base.__qualname__, "__doc__": base.__doc__}
            if hasattr(mixin, "forward"):
                attrs["forward"] = _forward_as(mixin.forward, base)
            cls = type(base.__name__, (mixin, base), attrs)
            _GENERATED[(mixin, base)] = cls
        return cls


def _forward_as(run: Callable[..., Any], base: type[nn.Module]) -> Callable[..., Any]:
    """``run`` (a mixin's ``forward(self, *args, **kwargs)``) under ``base.forward``'s
    signature, name and docstring."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return run(self, *args, **kwargs)

    original = base.forward
    try:
        forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a forward without a readable signature keeps its own
        pass
    forward.__doc__ = original.__doc__
    forward.__qualname__ = f"{base.__qualname__}.forward"
    return forward


def shallow_view(module: nn.Module, cls: type[nn.Module] | None = None) -> nn.Module:
    """A new module object of class ``cls`` sharing ``module``'s submodules, Parameters and
    buffers, with its own copies of every container in its ``__dict__``.

    Registering or replacing attributes on the view never touches the original, while the
    tensors and submodules are the very same objects.
    """
    cls = base_class(module) if cls is None else cls
    # object.__new__, not cls.__new__: FSDP2's FSDPModule.__new__ builds an instance of the
    # class the module had before fully_shard, which would drop the sharding from the view.
    view = object.__new__(cls)
    state = {}
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set, list)) and not key.startswith("_autockpt"):
            value = type(value)(value) if not isinstance(value, list) else list(value)
        state[key] = value
    state.pop("_autockpt", None)
    view.__dict__.update(state)
    return view


# Keyed by the forward function itself, so a forward patched onto the class later (kernel
# libraries replace a model class's forward) gets its own entry. A plain dict, not a weak one:
# torch.compile traces through this lookup and guards on the position of the forward among the
# keys, which a weak dict shifts whenever a dead class's forward is collected (planning collects
# at its end: "list index out of range" while building the guards). It holds a signature per
# forward function ever bound, a few hundred bytes each.
_SIGNATURES: dict[Any, inspect.Signature] = {}


def forward_signature(cls: type[nn.Module]) -> inspect.Signature:
    """``inspect.signature(cls.forward)``, ``self`` included, read once per forward function:
    every training forward binds its inputs with it.

    Example:
        >>> str(forward_signature(torch.nn.Linear))
        '(self, input: torch.Tensor) -> torch.Tensor'
    """
    forward = cls.forward
    try:
        return _SIGNATURES[forward]
    except (KeyError, TypeError):  # TypeError: a forward that does not hash
        signature = inspect.signature(forward)
    try:
        _SIGNATURES[forward] = signature
    except TypeError:
        pass
    return signature


def _forward_parameters(cls: type[nn.Module]) -> list[inspect.Parameter]:
    params = list(forward_signature(cls).parameters.values())
    return params[1:]  # drop self


def bind_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Bind a call's arguments to the forward's parameter names, defaults applied.

    Raises:
        InvalidArgumentError: the forward does not accept these arguments.
    """
    cls = base_class(module)
    signature = forward_signature(cls)
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError as err:
        raise InvalidArgumentError(
            f"{cls.__name__}.forward{signature} does not accept the example inputs "
            f"({_describe_call(args, kwargs)}): {err}",
            fix="pass example_inputs as a tuple of the positional arguments and the keyword "
            "arguments as example_kwargs, exactly as you call the model",
        ) from err
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    for param in _forward_parameters(cls):
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if arguments.get(param.name):
                raise TraceError(
                    f"{cls.__name__}.forward takes *{param.name}, which torch.fx cannot trace",
                    fix="give the forward named parameters, or wrap the model in a module whose "
                    "forward has them",
                    model_name=cls.__name__,
                )
            arguments.pop(param.name, None)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            # Keywords the forward takes through **kwargs (Trainer's num_items_in_batch,
            # output_attentions) are inputs like the named ones, passed by keyword: torch.export
            # and the modules rung take them; torch.fx refuses them (:func:`trace`).
            arguments.update(arguments.pop(param.name, None) or {})
    return arguments


def _describe_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"Tensor{tuple(value.shape)}"
        return type(value).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no arguments"


def _user_frame(err: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the traceback that is not inside torch."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    location = None
    for frame in traceback.extract_tb(err.__traceback__):
        if not frame.filename.startswith(torch_dir) and "/autockpt/" not in frame.filename:
            location = f"{frame.filename}:{frame.lineno}"
    return location


class _LeafTracer(fx.Tracer):
    """An fx tracer that keeps the named submodules whole and remembers which submodule it
    was inside when tracing failed (the next one to keep whole)."""

    def __init__(self, leaves: Sequence[str]) -> None:
        super().__init__()
        # A buffer read in Python code (``self.num_batches_tracked.add_(1)`` in timm's
        # BatchNormAct2d) must become a graph node: as a plain tensor the tracer would run the
        # in-place update on the user's buffer while tracing, and never again in training.
        self.proxy_buffer_attributes = True
        self.leaves = frozenset(leaves)
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module sees the error first
                self.failed_in = self.path_of_module(m)
            raise


_GRAPH_CONSTANTS = (*_CONSTANT_TYPES, torch.dtype, torch.device)


def _holds_only_graph_values(value: Any) -> bool:
    """Whether ``value`` is a proxy, a constant the graph can hold, or a tuple/list of them."""
    if isinstance(value, (tuple, list)):
        return all(_holds_only_graph_values(v) for v in value)
    return isinstance(value, (fx.Proxy, *_GRAPH_CONSTANTS))


def _user_function(cls: type) -> bool:
    """Whether the autograd Function ``cls`` is the model's: defined outside torch and
    autockpt."""
    return cls.__module__.split(".")[0] not in ("torch", "autockpt")


_TORCH_APPLY = inspect.getattr_static(torch.autograd.Function, "apply")
"""torch's own ``Function.apply``, taken before any patch (:func:`_apply_patched`)."""
_CALLS: dict[type, Callable[..., Any]] = {}
_CALLS_LOCK = threading.Lock()


def _function_call(cls: type) -> Callable[..., Any]:
    """A plain function calling ``cls.apply``, made once per class: the target of its graph
    nodes (fx names a target by its module and name, which ``apply`` of a C base lacks)."""
    with _CALLS_LOCK:
        if cls not in _CALLS:
            apply = _TORCH_APPLY.__get__(None, cls)

            def call(*args: Any, **kwargs: Any) -> Any:
                return apply(*args, **kwargs)

            call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
            _CALLS[cls] = call
        return _CALLS[cls]


@contextlib.contextmanager
def _apply_patched(apply: Callable[..., Any]) -> Iterator[None]:
    """``torch.autograd.Function.apply`` is ``apply(cls, real_apply, *args, **kwargs)``."""
    function = torch.autograd.Function
    # A C classmethod on recent torch, a Python one on older releases, possibly inherited.
    original = inspect.getattr_static(function, "apply")
    own = "apply" in function.__dict__

    def patched(cls: type, *args: Any, **kwargs: Any) -> Any:
        return apply(cls, original.__get__(None, cls), *args, **kwargs)

    function.apply = classmethod(patched)  # type: ignore[assignment]
    try:
        yield
    finally:
        if own:
            function.apply = original  # type: ignore[assignment]
        else:
            del function.apply


def _functions_as_calls(tracer: fx.Tracer) -> contextlib.AbstractContextManager[None]:
    """NOTE [ Custom autograd Functions stay whole ]: ``Function.apply`` on proxies records
    one node calling the real ``apply``."""

    def apply(cls: type, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        if (_user_function(cls) and any(isinstance(v, fx.Proxy) for v in values)
                and _holds_only_graph_values(list(values))):
            return tracer.create_proxy("call_function", _function_call(cls), args, kwargs)
        return real(*args, **kwargs)

    return _apply_patched(apply)


def functions_applied(names: list[str]) -> contextlib.AbstractContextManager[None]:
    """While torch.export traces: each autograd Function defined outside torch that is
    applied to tensors only becomes one call of an operator of its own, which export keeps
    whole and :func:`functions_called` turns into a call of the real ``apply`` (NOTE
    [ Custom autograd Functions stay whole ]); the class of any other is appended to
    ``names``, as export traces into it."""

    def apply(cls: type, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not _user_function(cls):
            return real(*args, **kwargs)
        if not kwargs and args and all(isinstance(a, torch.Tensor) for a in args):
            try:
                outputs = _operator_of(cls)(list(args))
            except _NotOnlyTensors:
                pass
            else:
                return outputs[0] if _SINGLE_OUTPUT[cls] else tuple(outputs)
        if cls.__qualname__ not in names:
            names.append(cls.__qualname__)
        return real(*args, **kwargs)

    return _apply_patched(apply)


class _NotOnlyTensors(Exception):
    """A Function returned something other than tensors: it cannot be an operator."""


_LIBRARY: torch.library.Library | None = None
_OPERATORS: dict[type, Any] = {}
_CLASSES: dict[Any, type] = {}
_SINGLE_OUTPUT: dict[type, bool] = {}


def _operator_of(cls: type) -> Any:
    """The operator ``autockpt_function::f<k>(Tensor[] args) -> Tensor[]`` standing for
    ``cls.apply`` while torch.export traces, made once per class. Its kernels run the real
    ``apply`` (on fake tensors, for export) and return copies of its outputs, as an operator
    may not return its inputs."""
    global _LIBRARY
    with _CALLS_LOCK:
        if cls not in _OPERATORS:
            if _LIBRARY is None:
                _LIBRARY = torch.library.Library("autockpt_function", "FRAGMENT")
            name = f"f{len(_OPERATORS)}"
            _LIBRARY.define(f"{name}(Tensor[] args) -> Tensor[]")
            apply = _TORCH_APPLY.__get__(None, cls)

            def kernel(args: list[torch.Tensor]) -> list[torch.Tensor]:
                out = apply(*args)
                outputs = out if isinstance(out, tuple) else (out,)
                if not all(isinstance(o, torch.Tensor) for o in outputs):
                    raise _NotOnlyTensors(cls.__qualname__)
                _SINGLE_OUTPUT[cls] = not isinstance(out, tuple)
                return [o.detach().clone() for o in outputs]

            _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"autockpt_function::{name}", kernel, lib=_LIBRARY)
            operator = getattr(torch.ops.autockpt_function, name).default
            _OPERATORS[cls], _CLASSES[operator] = operator, cls
        return _OPERATORS[cls]


def functions_called(graph: fx.Graph) -> None:
    """Make each node of an operator of :func:`functions_applied` call the real ``apply`` of
    its Function (:func:`_function_call`, as torch.fx records it), with the same arguments.
    Export reads the operator's list of outputs with ``getitem``; where the Function returns
    one tensor, not a tuple, its readers read the node itself."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CLASSES:
            continue
        cls = _CLASSES[node.target]
        node.target = _function_call(cls)
        node.args = tuple(node.args[0])
        if _SINGLE_OUTPUT[cls]:
            for reader in list(node.users):  # getitem(node, 0), export's only reader
                reader.replace_all_uses_with(node)
                graph.erase_node(reader)


def trace(
    module: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    leaves: Sequence[str] = (),
) -> TracedModel:
    """Trace ``module`` in train mode with torch.fx.

    Arguments that are Python constants in this call (``None``, flags, numbers) are baked into
    the graph, so that ``if mask is not None:`` takes the branch this call takes.

    Example:
        >>> import torch
        >>> traced = trace(torch.nn.Sequential(torch.nn.Linear(2, 2)), (torch.randn(1, 2),))
        >>> [n.op for n in traced.graph.nodes]
        ['placeholder', 'call_module', 'output']

    ``leaves`` names submodules (by qualified name) to keep whole, as ``call_module`` nodes.

    Raises:
        TraceError: the model's forward cannot be traced by torch.fx; the message names the
            line of the user's code where tracing failed, and ``module_path`` the innermost
            submodule being traced then.
    """
    kwargs = {} if kwargs is None else kwargs
    cls = base_class(module)
    arguments = bind_inputs(module, args, kwargs)
    named = {p.name for p in _forward_parameters(cls)}
    extra = [name for name in arguments if name not in named]
    if extra:
        raise TraceError(
            f"{cls.__name__}.forward takes {format_names(extra)} through **kwargs, which "
            "torch.fx cannot trace",
            fix="capture='export' takes them; or give the forward named parameters",
            model_name=cls.__name__,
        )
    names = tuple(p.name for p in _forward_parameters(cls) if p.name in arguments)
    constants = tuple(
        (name, arguments[name])
        for name in names
        if isinstance(arguments[name], _CONSTANT_TYPES)
    )
    view = shallow_view(module, cls)
    flags = [(m, m.training) for m in view.modules()]
    tracer = _LeafTracer(leaves)
    try:
        view.train()
        with _functions_as_calls(tracer), OpWatch(NoRealDraw()):
            graph = tracer.trace(view, concrete_args=dict(constants) or None)
        graph_module = fx.GraphModule(view, graph, class_name=cls.__name__)
    except Exception as err:  # fx raises many kinds; all mean "not traceable"
        location = _user_frame(err)
        where = f" at {location}" if location else ""
        raise TraceError(
            f"torch.fx could not trace {cls.__name__}{where}: {type(err).__name__}: {err}",
            fix="avoid Python control flow on tensor values in forward (use torch.where), or "
            "mark the submodule that fails as a leaf; see docs/how-it-works.md",
            model_name=cls.__name__,
            location=location,
            module_path=tracer.failed_in if tracer.failed_in is not None else "",
        ) from err
    finally:
        for mod, was_training in flags:
            mod.training = was_training
    read = [str(n.target) for n in graph.nodes
            if n.op == "placeholder" and str(n.target).startswith("**") and n.users]
    if read:
        # torch.fx makes **kwargs one placeholder and traces what the forward does with the
        # dict (``kwargs.get("scale", 1.0)``) as graph ops on it, which the generated code
        # cannot run: the keywords are inputs one by one.
        raise TraceError(
            f"{cls.__name__}.forward reads {read[0]}, which torch.fx traces as one value",
            fix="capture='export' takes the keywords; or give the forward named parameters",
            model_name=cls.__name__,
        )
    tensor_constants = {}
    for node in graph.nodes:
        if node.op == "get_attr" and not has_attr_path(module, node.target):
            tensor_constants[node.target] = getattr(view, node.target)
    return TracedModel(
        graph_module=graph_module,
        spec=TraceSpec(param_names=names, constants=constants),
        constants=tensor_constants,
        capture="fx-leaves" if leaves else "fx",
    )


def has_attr_path(module: nn.Module, target: str) -> bool:
    """Whether ``module`` has an attribute at the dotted path ``target``."""
    obj: Any = module
    for atom in target.split("."):
        if not hasattr(obj, atom):
            return False
        obj = getattr(obj, atom)
    return True
