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
from typing import Any, List, Sequence, Set

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import FxampError, TraceError
from .fx import FxFrontEnd, FxTracer

__all__ = ["ConcreteFxFrontEnd", "GuardFailed", "guard"]

_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)
_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_floating_point")
_META_METHODS = ("size", "dim", "numel", "is_floating_point", "get_device", "is_contiguous")


class GuardFailed(Exception):
    """An early guard of a graph captured by :class:`ConcreteFxFrontEnd` failed: nothing ran that matters."""


def guard(value: Any, expected: bool, early: bool) -> None:
    """The branch the capture took must be this call's too."""
    if bool(value) is not expected:
        if early:
            raise GuardFailed
        raise FxampError("fxamp: this call takes another Python branch than the call the block was captured at, "
                         "after the block changed an object it was given (a KV cache's update): convert the model "
                         "whole with fxamp.convert, or call it without that object (use_cache=False)")


class _ConcreteTracer(FxTracer):
    """A torch.fx tracer that also runs each node on real values (see the module docstring)."""

    def __init__(self, leaf_types, leaf_paths, values: Sequence[Any]):
        super().__init__(leaf_types, leaf_paths)
        # opaque objects are traced on copies: their methods (a cache's update) run during the trace
        self.values = [v if isinstance(v, (torch.Tensor,) + _SIMPLE) else copy.deepcopy(v) for v in values]
        self.real: dict = {}
        self.meta_only: Set[fx.Node] = set()  # nodes whose values depend on no tensor data
        self.effects: Set[fx.Node] = set()  # method calls on opaque objects
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
            return proxy
        a = fx.node.map_arg(node.args, self._real)
        k = fx.node.map_arg(node.kwargs, self._real)
        with torch.no_grad(), _unpatched():
            if kind == "get_attr":
                value = _raw_attr(self.root, target)
            elif kind == "call_module":
                value = _raw_attr(self.root, target)(*a, **k)
            elif kind == "call_method":
                value = getattr(a[0], target)(*a[1:], **k)
            else:
                value = target(*a, **k)
        self.real[node] = value
        inputs = node.all_input_nodes
        receiver = a[0] if a else None
        if kind == "call_method" and not isinstance(receiver, (torch.Tensor,) + _SIMPLE):
            self.effects.add(node)
        elif kind == "call_function" and target is builtins.getattr and len(a) > 1 and \
                (a[1] in _META_ATTRS or inputs and all(i in self.meta_only for i in inputs)):
            self.meta_only.add(node)
        elif kind == "call_method" and target in _META_METHODS and isinstance(receiver, torch.Tensor):
            self.meta_only.add(node)
        elif kind == "call_function" and _pure(target) and all(i in self.meta_only for i in inputs):
            self.meta_only.add(node)
        return proxy

    def _real(self, node: fx.Node) -> Any:
        if node not in self.real and node.op == "get_attr":  # a tensor constant create_arg stored on the root
            self.real[node] = _raw_attr(self.root, str(node.target))
        return self.real[node]

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
    """A proxy whose ``len()`` is its value's (guarded), so ``(*x.shape[:-1], -1)`` traces."""

    def __len__(self) -> int:
        return self.tracer.length(self)


#: nn.Module's own methods, which torch.fx replaces while it traces (to hand out proxies and record calls)
_MODULE_METHODS = {name: nn.Module.__dict__[name] for name in ("__getattr__", "__call__")}


class _unpatched:
    """Within: nn.Module's ``__getattr__``/``__call__`` are torch's own, so the trace's real values are
    computed as a plain call computes them; torch.fx's replacements are put back on exit."""

    def __enter__(self) -> None:
        self.patched = {name: nn.Module.__dict__[name] for name in _MODULE_METHODS}
        for name, method in _MODULE_METHODS.items():
            setattr(nn.Module, name, method)

    def __exit__(self, *exc: Any) -> None:
        for name, method in self.patched.items():
            setattr(nn.Module, name, method)


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
        anchor = max(inputs, key=lambda n: order[n]) if inputs else first_placeholder_end
        if anchor is not None and order[anchor] < order[node] - 1:
            anchor.append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
    effect_seen = False
    for node in graph.nodes:
        if node in tracer.effects:
            effect_seen = True
        elif node.op == "call_function" and node.target is guard:
            node.args = (node.args[0], node.args[1], not effect_seen)


class ConcreteFxFrontEnd(FxFrontEnd):
    """:class:`~fxamp.conversion.capture.fx.FxFrontEnd` tracing with one call's values (``values``: one per
    input of the traced forward, in order)."""

    def __init__(self, model: nn.Module, values: Sequence[Any], leaf_modules=()):
        super().__init__(model, leaf_modules)
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
