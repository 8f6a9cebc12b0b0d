"""torch.fx tracing with the values of one call: shapes stay symbolic, Python branches on them are guarded.

A block of a model converted in place (``blocks.py``) is captured at its first call, so the call's
values exist.  Plain ``torch.fx`` cannot trace code that unpacks a shape (``(*x.shape[:-1], -1, d)``)
or branches on one (``if q.shape[2] > 1``); ``torch.export`` can, but cannot take an opaque Python
object such as a Hugging Face KV cache, whose ``update`` must run at every call.  This front end
traces with proxies, as torch.fx does, while running every recorded op on the call's values::

    x.shape unpacked            ==>  one getitem node per dim (the rank is the value's)
    if q.shape[2] > 1: ...      ==>  gt = getitem(...) > 1;  guard(gt, True, early)   (the branch taken)
    cache.update(k, v, idx)     ==>  a call_method node; run on a deep copy of the cache while tracing

Only values that depend on no tensor data (shapes, dtypes, Python numbers, an opaque object's
attributes) may decide a branch; a branch on tensor data is refused (a ``TraceError``).  After the
trace each guard, with the shape arithmetic it reads, moves up to just after its inputs, and is
marked *early* when no side effect (a method of an opaque object) precedes it.  At run time an
early guard that fails raises :class:`GuardFailed` before anything changed, so the caller can run
or capture another variant; a late one raises :class:`~fxamp.errors.FxampError`.
"""

from __future__ import annotations

import builtins
import copy
import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import FxampError, TraceError
from ..graph import RECEIVER
from ..op_lists import is_inplace
from .fx import FxFrontEnd, FxTracer
from .hooks import hooks_run_by_values_error

__all__ = ["ConcreteFxFrontEnd", "GuardFailed", "LATE_BRANCH", "LateGuardFailed", "guard"]

_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)
_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_floating_point")
_META_METHODS = ("size", "dim", "numel", "is_floating_point", "get_device", "is_contiguous")
_CONTAINERS = (dict, list, tuple, set)
_READERS = ("get", "keys", "values", "items", "index", "count", "__getitem__", "__contains__", "__len__")
_WRITERS = (operator.setitem, operator.delitem, builtins.setattr, builtins.delattr)
#: methods that change the list, dict or set they are called on
_MUTATORS = ("append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem", "sort",
             "reverse", "add", "discard", "__setitem__", "__delitem__")
#: in-place tensor methods that change what a shape read or a branch reads (``y.unsqueeze_(1)``,
#: ``h.requires_grad_()``)
_META_WRITERS = ("unsqueeze_", "squeeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "resize_", "resize_as_",
                 "as_strided_", "set_", "requires_grad_", "detach_")
#: arguments that do not make a function call a side effect (a module: attention interfaces take ``self``)
_VALUES = (torch.Tensor, nn.Module, slice, type(Ellipsis)) + _SIMPLE


LATE_BRANCH = ("fxamp: this call takes another Python branch than the call the block was captured at, after the "
               "block changed an object it was given (a KV cache's update): convert the model whole with "
               "fxamp.convert, or call it without that object (use_cache=False)")


class LateGuardFailed(FxampError):
    """A late guard failed: a method of an object the block was given already ran (the caller may undo it)."""


class GuardFailed(Exception):
    """An early guard of a graph captured by :class:`ConcreteFxFrontEnd` failed: nothing ran that matters."""


def guard(value: Any, expected: bool, early: bool) -> None:
    """The branch the capture took must be this call's too."""
    if bool(value) is not expected:
        if early:
            raise GuardFailed
        raise LateGuardFailed(LATE_BRANCH)


class _ConcreteTracer(FxTracer):
    """A torch.fx tracer that also runs each node on real values (see the module docstring).

    Buffers are graph values (``get_attr`` nodes), as parameters are: ``~self.mask[:T, :T]`` is then
    an op on the block's own mask, not a constant computed from the traced instance's.  The trace runs
    on copies of them: running statistics and counters a forward updates in place change at the
    graph's calls, never during the capture.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf_types, leaf_paths, values: Sequence[Any]):
        super().__init__(leaf_types, leaf_paths)
        self.copies: Dict[str, Any] = {}  # buffer path -> the copy the trace's ops read and change
        # opaque objects are traced on copies: their methods (a cache's update) run during the trace; tensors
        # too, since an in-place op on an input (RWKV's ``state[0][:, :, i] = s``) runs here and again in the graph
        memo: Dict[int, Any] = {}
        self.values = [v if isinstance(v, _SIMPLE) else _copy(v, memo) if not isinstance(v, torch.Tensor)
                       else _input_copy(v, memo) for v in values]
        self.real: dict = {}
        self.meta_only: Set[fx.Node] = set()  # nodes whose values depend on no tensor data
        self.effects: Set[fx.Node] = set()  # method calls on opaque objects
        self.stateful: Set[fx.Node] = set()  # meta-only nodes that read an opaque object's state
        self.opaque: Set[fx.Node] = set()  # placeholders holding opaque objects
        # lists and dicts the traced code made and then changed; tensors an in-place method reshaped
        self.written: Set[fx.Node] = set()
        self._placeholders = 0

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "output" or node in self.real:
            return proxy
        if kind == "placeholder":
            value = self.values[self._placeholders] if self._placeholders < len(self.values) else None
            self._placeholders += 1
            self.real[node] = value
            if not isinstance(value, torch.Tensor):
                self.meta_only.add(node)
            if not isinstance(value, (torch.Tensor,) + _SIMPLE):
                self.opaque.add(node)
            return proxy
        a = fx.node.map_arg(node.args, self._real)
        k = fx.node.map_arg(node.kwargs, self._real)
        # in the grad mode the code runs in (the call's, and the regions of forward): a branch may read an
        # intermediate's requires_grad (a hook registered only when gradients flow), which no_grad made False; its
        # saved tensors kept as they are (the capture may run inside the user's checkpoint, whose hooks count them)
        with _unpatched(_touches_modules(kind, target, a, k)), \
                torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            if kind == "get_attr":
                value = self._attr(target)
            elif kind == "call_module":
                module = _raw_attr(self.root, target)
                own = {n: self._attr(f"{target}.{n}") for n, _ in module.named_buffers()}
                value = torch.func.functional_call(module, own, tuple(a), k, strict=False) if own else module(*a, **k)
            elif kind == "call_method":
                value = getattr(a[0], target)(*a[1:], **k)
            else:
                value = target(*a, **k)
        self.real[node] = value
        inputs = node.all_input_nodes
        receiver = a[0] if a else None
        all_meta = all(i in self.meta_only for i in inputs)
        if isinstance(receiver, torch.Tensor) and ((kind == "call_method" and target in _META_WRITERS) or (
                kind == "call_function" and target is builtins.setattr)):
            self.written.add(node.args[0])  # its shape read after this call is its shape after it (x.data = ...)
        if self._local_write(kind, target, node):
            self.written.add(node.args[0])  # pad[dim] = (0, n) on pad = [(0, 0)] * x.ndim: stays where it was
        elif kind == "call_method" and isinstance(receiver, _CONTAINERS) and target in _READERS and all_meta:
            self.meta_only.add(node)  # cache.is_updated.get(i): a read of an object's state
        elif kind == "call_method" and not isinstance(receiver, (torch.Tensor,) + _SIMPLE):
            self.effects.add(node)  # cache.update(...)
            node.meta[RECEIVER] = type(receiver).__name__
        elif kind in ("call_method", "call_function") and is_inplace(kind, target) and node.args and \
                isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
            self.effects.add(node)  # x.add_(1) on an input: running it twice would add twice
        elif kind == "call_module" and any(True for _ in _raw_attr(self.root, target).buffers()):
            self.effects.add(node)  # a batch norm's statistics
        elif kind == "call_function" and target in _WRITERS:
            self.effects.add(node)  # cache.is_updated[i] = True
        elif kind == "call_function" and target is builtins.getattr and len(a) > 1 and \
                (a[1] in _META_ATTRS or all_meta):
            self.meta_only.add(node)
        elif kind == "call_method" and target in _META_METHODS and isinstance(receiver, torch.Tensor):
            self.meta_only.add(node)
        elif kind == "call_function" and _pure(target) and all_meta:
            self.meta_only.add(node)
        elif kind == "call_function" and any(not isinstance(v, _VALUES) for v in _leaves((a, k))):
            self.effects.add(node)  # a function given an object may change it
        if node in self.meta_only and any(i in self.stateful or i in self.written or
                                          (i.op == "placeholder" and i in self.opaque) for i in inputs):
            # reads an object's state, which an effect may change, or a list the code changed: a read after the
            # write must stay after it (_place moves the other shape arithmetic up)
            self.stateful.add(node)
        return proxy

    def _local_write(self, kind: str, target: Any, node: fx.Node) -> bool:
        """A write to a list or dict the traced code built from shapes (``[(0, 0)] * x.ndim``): no effect on
        anything outside the call (no later guard becomes late), but the reads after it must stay after it."""
        mutates = (kind == "call_function" and target in (operator.setitem, operator.delitem)) or (
            kind == "call_method" and target in _MUTATORS)
        if not mutates or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        container = node.args[0]
        return (container in self.meta_only and container not in self.stateful and container.op != "placeholder"
                and isinstance(self.real.get(container), (list, dict, set)))

    def _real(self, node: fx.Node) -> Any:
        if node not in self.real and node.op == "get_attr":  # a tensor constant create_arg stored on the root
            self.real[node] = self._attr(str(node.target))
        return self.real[node]

    def _attr(self, target: str) -> Any:
        """The root's attribute at ``target``; a buffer's copy (the same one for every read of it)."""
        value = _raw_attr(self.root, target)
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            return value
        if target not in self.copies:
            self.copies[target] = value.clone()
        return self.copies[target]

    def to_bool(self, obj: fx.Proxy) -> bool:
        node = obj.node
        if node not in self.meta_only:
            raise TraceError(f"a Python branch on tensor data ({node.format_node()}) cannot be captured",
                             short="data-dependent branch")
        value = bool(self.real[node])
        self.create_proxy("call_function", guard, (obj, value, True), {})
        return value

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def length(self, obj: fx.Proxy) -> int:
        """``len(obj)``, guarded: a shape's (its rank) or a tensor's (its first dim)."""
        node = obj.node
        value = self.real.get(node)
        if isinstance(value, torch.Tensor):
            size = self.create_proxy("call_method", "size", (obj, 0), {})
        elif node in self.meta_only and isinstance(value, (tuple, list)):
            size = self.create_proxy("call_function", len, (obj,), {})
        else:
            raise TraceError(f"len() of {node.format_node()} cannot be captured", short="len of a traced value")
        self.to_bool(self.create_proxy("call_function", operator.eq, (size, len(value)), {}))
        return len(value)

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(self.length(obj))])


class _ConcreteProxy(fx.Proxy):
    """A proxy whose ``len()`` is its value's (guarded), so ``(*x.shape[:-1], -1)`` traces, and whose
    ``dtype`` is its value's (``torch.finfo(x.dtype)``): fixed by the input dtypes (the signature) and the
    float32 parameters the trace runs with, as a torch.export capture bakes it in."""

    def __len__(self) -> int:
        return self.tracer.length(self)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """An opaque object's proxy passes its class's ``isinstance`` checks (``isinstance(cache,
        EncoderDecoderCache)``): the signature holds each object's type, so the branch is the call's."""
        value = self.tracer.real.get(self.node, self)
        if value is self or isinstance(value, (torch.Tensor, tuple, list, dict, set) + _SIMPLE):
            return type(self)
        return type(value)

    def __getattr__(self, name: str) -> Any:
        value = self.tracer.real.get(self.node)
        if isinstance(value, torch.Tensor):
            if name == "dtype":
                return value.dtype
            if name not in _META_ATTRS:
                return super().__getattr__(name)  # a method: torch.fx's call_method node when called
        elif isinstance(value, torch.device) and name == "type":
            # fixed by the signature, which holds each tensor's device type: Hugging Face's maybe_autocast passes
            # x.device.type to torch.is_autocast_enabled, which takes a string (Nemotron's norm, in every block)
            return value.type
        elif value is None or isinstance(value, _SIMPLE) or callable(getattr(value, name, None)):
            return super().__getattr__(name)
        # a shape, or an object's data attribute (cache.is_updated): a node now, a proxy of this class
        return self.tracer.create_proxy("call_function", builtins.getattr, (self, name), {})

    def __setitem__(self, key: Any, item: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, item), {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("node", "tracer") or (name.startswith("__") and name.endswith("__")):
            object.__setattr__(self, name, value)  # the proxy's own
        else:  # cache.layer.keys = kv: a write to the object, recorded (run at every call; a side effect)
            self.tracer.create_proxy("call_function", builtins.setattr, (self, name, value), {})

    @property  # type: ignore[override]
    def keys(self) -> Any:
        """``fx.Proxy.keys`` (for ``**proxy``) hides a data attribute of that name: a KV cache layer's
        ``layer.keys`` tensor is read as the attribute, a dict's ``keys()`` stays a method."""
        value = self.tracer.real.get(self.node)
        if value is not None and not isinstance(value, (torch.Tensor,) + _SIMPLE + _CONTAINERS) and \
                not callable(getattr(value, "keys", None)):
            return self.tracer.create_proxy("call_function", builtins.getattr, (self, "keys"), {})
        return fx.Proxy.keys.__get__(self)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _input_copy(t: torch.Tensor, memo: Dict[int, Any]) -> torch.Tensor:
    """A tensor input's copy for the trace to run on, one per tensor (its flags kept: a branch may read
    ``requires_grad``)."""
    if id(t) not in memo:
        with torch.no_grad():
            new = t.detach().clone()
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            # not a leaf, as a block's input is at a call (an activation): the trace's values keep the call's grad
            # mode, in which an in-place op on a leaf that requires grad would raise
            new = new.requires_grad_(True).clone()
        memo[id(t)] = new
    return memo[id(t)]


def _copy(value: Any, memo: Optional[Dict[int, Any]] = None) -> Any:
    """A deep copy of an opaque object (a KV cache) for the trace to change: tensors detached and cloned,
    16-bit floats as float32 (a cache filled in training holds tensors with autograd history, which
    ``copy.deepcopy`` refuses),
    containers and plain objects copied member by member, shared members once."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        # the trace computes in float32, as an unconverted block would; a cache filled by converted blocks
        # holds bfloat16 keys that a float32 query could not attend to (the graph casts them at run time)
        low = value.is_floating_point() and value.element_size() < 4
        new: Any = value.detach().float() if low else value.detach().clone()
    elif isinstance(value, _SIMPLE) or callable(value) or isinstance(value, nn.Module):
        return value
    elif type(value) in (list, tuple, set):
        new = type(value)(_copy(v, memo) for v in value)
    elif type(value) is dict:
        new = {k: _copy(v, memo) for k, v in value.items()}
    elif hasattr(value, "__dict__"):
        new = object.__new__(type(value))
        memo[id(value)] = new
        new.__dict__.update({k: _copy(v, memo) for k, v in value.__dict__.items()})
        return new
    else:
        new = copy.deepcopy(value)
    memo[id(value)] = new
    return new


#: nn.Module's own methods, which torch.fx replaces while it traces (to hand out proxies and record calls)
_MODULE_METHODS = {name: nn.Module.__dict__[name] for name in ("__getattr__", "__call__")}


class _unpatched:
    """Within: nn.Module's ``__getattr__``/``__call__`` are torch's own, so the trace's real values are
    computed as a plain call computes them; torch.fx's replacements are put back on exit.  ``needed=False``: a
    no-op, for a computation that touches no module (setting an attribute of ``nn.Module``, whose subclasses'
    caches Python then invalidates, cost about 0.1 ms: a third of T5's in-place capture, four per node)."""

    def __init__(self, needed: bool = True) -> None:
        self.needed = needed

    def __enter__(self) -> None:
        if not self.needed:
            return
        self.patched = {name: nn.Module.__dict__[name] for name in _MODULE_METHODS}
        for name, method in _MODULE_METHODS.items():
            setattr(nn.Module, name, method)

    def __exit__(self, *exc: Any) -> None:
        if not self.needed:
            return
        for name, method in self.patched.items():
            setattr(nn.Module, name, method)


#: where the C functions and torch's own functional code live: a call of one of them on values that hold no module
#: runs no nn.Module method
_MODULE_FREE = frozenset({"torch", "torch.functional", "torch.nn.functional", "torch._C", "torch._C._nn",
                          "torch._C._VariableFunctions", "torch._C._linalg", "torch._C._fft", "torch._C._special",
                          "torch._tensor", "_operator", "operator", "math", "builtins"})


def _touches_modules(kind: str, target: Any, args: Any, kwargs: Any) -> bool:
    """Whether computing a node's real value may run an ``nn.Module`` method (its own code or a module among the
    values): only then need torch.fx's replacements be taken out around it."""
    if kind in ("call_module", "get_attr"):
        return True
    if any(isinstance(v, nn.Module) for v in _leaves((args, kwargs))):
        return True
    if kind == "call_method":
        return not (args and isinstance(args[0], torch.Tensor))  # (a tensor's methods: torch's own)
    return getattr(target, "__module__", None) not in _MODULE_FREE


def _raw_attr(root: nn.Module, target: str) -> Any:
    """``root``'s attribute at a dotted path, read from the modules' own tables (torch.fx patches
    ``nn.Module.__getattr__`` while tracing, to hand out proxies)."""
    value: Any = root
    for name in target.split("."):
        d = value.__dict__
        for table in ("_modules", "_parameters", "_buffers"):
            if name in d.get(table, {}):
                value = d[table][name]
                break
        else:
            value = d[name] if name in d else object.__getattribute__(value, name)
    return value


def _leaves(tree: Any) -> List[Any]:
    out: List[Any] = []
    fx.node.map_aggregate(tree, out.append)
    return out


def _pure(target: Any) -> bool:
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math") or target in (builtins.len, builtins.getattr, builtins.min,
                                                                      builtins.max, builtins.abs, math.prod)


def _place(graph: fx.Graph, tracer: _ConcreteTracer) -> None:
    """Move guards and the shape arithmetic they read up to just after their inputs; mark each guard early
    when no side effect precedes it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_placeholder_end = max((n for n in graph.nodes if n.op == "placeholder"), key=order.get, default=None)
    for node in list(graph.nodes):
        if node.op != "call_function" or not (node in tracer.meta_only or node.target is guard):
            continue
        inputs = node.all_input_nodes
        if node in tracer.stateful or any(i in tracer.stateful for i in inputs):
            continue  # a read of an object's state stays where the code read it (an effect may change it)
        anchor = max(inputs, key=lambda n: order[n]) if inputs else first_placeholder_end
        if anchor is not None and order[anchor] < order[node] - 1:
            anchor.append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
    effect_seen = False
    late = []
    for node in graph.nodes:
        if node in tracer.effects:
            effect_seen = True
        elif node.op == "call_function" and node.target is guard:
            node.args = (node.args[0], node.args[1], not effect_seen)
            if effect_seen:
                late.append(node)
    for node in late:
        _precheck(graph, node, tracer, first_placeholder_end)


def _precheck(graph: fx.Graph, late: fx.Node, tracer: _ConcreteTracer, top: Optional[fx.Node]) -> None:
    """A late guard that reads only an object's state and shapes of inputs (``cache.is_updated.get(i)``)
    also gets an early copy at the top of the graph: it picks the variant before anything changed, and
    the late one still checks that no side effect changed that state in between."""
    chain: List[fx.Node] = []

    def collect(node: fx.Node) -> bool:
        if node.op in ("placeholder", "get_attr") or node in chain:
            return True
        if node not in tracer.meta_only or node in tracer.effects:
            return False
        if not all(collect(i) for i in node.all_input_nodes):
            return False
        chain.append(node)  # inputs first
        return True

    cond = late.args[0]
    if top is None or not isinstance(cond, fx.Node) or not collect(cond):
        return
    copies: Dict[fx.Node, fx.Node] = {}
    anchor = top
    for node in chain:
        anchor.append(new := graph.node_copy(node, lambda n: copies.get(n, n)))
        copies[node] = new
        anchor = new
    anchor.append(graph.call_function(guard, (copies[cond], late.args[1], True)))


class ConcreteFxFrontEnd(FxFrontEnd):
    """:class:`~fxamp.conversion.capture.fx.FxFrontEnd` tracing with one call's values (``values``: one per
    input of the traced forward, in order)."""

    trace_with_grad = False  # the call's values are computed as the call would: in its grad mode

    def __init__(self, model: nn.Module, values: Sequence[Any], leaf_modules=()):
        super().__init__(model, leaf_modules)
        refused = hooks_run_by_values_error(model)  # (the trace would call a hooked module to get its value)
        if refused is not None:
            raise refused
        self.values = list(values)
        self._tracers: List[_ConcreteTracer] = []

    def make_tracer(self) -> fx.Tracer:
        tracer = _ConcreteTracer(self.leaf_types, self.leaf_paths, self.values)
        self._tracers.append(tracer)
        return tracer

    def trace(self) -> fx.GraphModule:
        gm = super().trace()
        tracer = self._tracers[-1]
        # fx.GraphModule(root, graph) keeps the tracer's graph and nodes: place the guards in it
        _place(gm.graph, tracer)
        gm.graph.lint()
        gm.recompile()
        return gm
