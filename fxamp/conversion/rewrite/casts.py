"""Apply the decisions: store parameters in their dtype (O2/O3), read them cheaply, insert the casts.

The passes read ``node.meta["fxamp"]`` (``classify/``) and change only the graph module
they are given.  Before and after, for ``y = exp(linear(x))`` under O1/float16::

    fc_weight = self.fc.weight                    fc = self.fc;  params = fc._parameters
    fc_bias = self.fc.bias                        fc_weight = params['weight'];  fc_bias = params['bias']
    linear = F.linear(x, fc_weight, fc_bias) ==>  weights = cast_weights(cache, (fc_weight, fc_bias), f16, keys)
    exp = torch.exp(linear)                       cast = cast(x, f16)          # x's dtype is known only at run time
    return exp                                    linear = F.linear(cast, weights[0], weights[1])
                                                  to = linear.to(f32)          # known float16: a plain .to()
                                                  exp = torch.exp(to)
                                                  return exp                   # known float32: no output cast

One cast per (value, dtype): a weight or activation used by several nodes is cast once (until
an in-place op writes into it).  All of a forward's weight casts go through one ``cast_weights``
call (one Python call, one cache check).  An unsafe in-place op on a low-precision activation runs
out of place in float32 and is written back: ``y.exp_()`` becomes ``exp_ = y.to(f32).exp();
y.copy_(exp_)``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import operator

from ...dtypes import CASTABLE, LOW, NOT_FLOAT
from ..classify.inference import DtypeInference
from ..graph import ATTR, CAST, Decision, attr_target, fetch_attr, rebind, rename_node, tensor_slots
from ..passes import Conversion, Pass, Stage
from ..op_lists import VIEW_ATTRS, VIEW_OPS, Category, Source, is_inplace, op_key, out_of_place
from ...info import watch_for_masters
from ...policy import Policy
from ..runtime import WeightCastCache, call_module_cast, cast, cast_dense, cast_weights, check_storage

__all__ = ["STORAGE", "ATTRIBUTE_READS", "CASTS", "store_params", "cast_kept_storage", "insert_casts",
           "lower_attribute_reads", "CACHE_NAME",
           "weight_cache_of"]

CACHE_NAME = "_fxamp_weight_cache"


def weight_cache_of(gm: nn.Module) -> Optional[WeightCastCache]:
    """The cache of low-precision weight copies ``insert_casts`` gave a converted graph module, or None."""
    cache = getattr(gm, CACHE_NAME, None)
    return cache if isinstance(cache, WeightCastCache) else None


def _storage_for(decision: Decision, policy: Policy) -> torch.dtype:
    """The dtype a tensor consumed by this decision wants to be stored in."""
    if decision.category is Category.UNLISTED or decision.source is Source.FLOAT64:
        return torch.float32  # an op fxamp does not know, or one running in float64: keep the tensor as is
    if decision.norm:
        return policy.norms
    if decision.compute is None or decision.compute in LOW:
        return policy.params
    return torch.float32


def store_params(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], policy: Policy) -> Dict[str, torch.dtype]:
    """Re-bind float32 parameters and float buffers to the dtype their consumers run in (O2/O3).

    A tensor is stored low only when every consumer runs in low precision (or follows its
    inputs); one float32 consumer (a norm, an unsafe op, an op on no list) keeps it float32.  A
    tensor that enters the activations through an op that follows its inputs (a class token
    concatenated, a position embedding or a layer scale added or multiplied in) is stored in
    ``Policy.unsafe``: float32 under O2, as under autocast, where it keeps the residual stream in
    float32; low under O3; so is every buffer, which has no float32 master to undo a rounding.  Lookups (an
    embedding table indexed by integer ids) are not such a mix.
    Consumers are found through views (``w.t()``, ``w.view(...)``, ``w[0]``, splits): a transpose
    follows its input, but the op the transposed weight reaches decides.  Tied parameters stay
    tied.  Returns ``{name: new dtype}`` for the tensors that changed.

    This is the one decision of storage from a graph; a :class:`~fxamp.conversion.lazy.LazyConverted` predicts
    its storage without one (``storage.predict_storage``, whose docstring says where the two differ and
    how ``cast_kept_storage`` and ``insert_casts`` make every op compute as it would here).
    """
    # the dtypes decided here are the ones every cast of the graph assumes: .half() on it is refused
    check_storage(gm, tuple(dict.fromkeys((torch.float32, policy.params, policy.norms))), str(policy))
    if policy.params == torch.float32 and policy.norms == torch.float32:
        return {}
    modules = dict(gm.named_modules())
    wants: Dict[int, set] = defaultdict(set)
    tensors: Dict[int, torch.Tensor] = {}
    infer = DtypeInference(gm, modules, decisions)

    def want(t: Any, dtype: torch.dtype) -> None:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            wants[id(t)].add(dtype)
            tensors[id(t)] = t

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            if not isinstance(value, nn.Parameter):
                # a buffer has no float32 master: stored low, its rounding would be permanent and saved (Llama's
                # rotary inv_freq, which forward reads .float() into float32 math: at position 2000 its angles were
                # off by up to 2.4 radians); float32 unless unsafe ops run low too (O3), as predict_storage keeps them
                want(value, policy.unsafe)
            for user in _consumers(node):
                want(value, _wanted_storage(user, decisions, policy, infer))
        elif node.op == "call_module":
            d = decisions[node]
            m = modules[node.target]
            dtype = _storage_for(d, policy)
            for t in list(m.parameters()) + list(m.buffers()):
                want(t, dtype)

    target: Dict[int, torch.dtype] = {}
    for key, dtypes in wants.items():
        dtype = torch.float32 if torch.float32 in dtypes else dtypes.pop()
        if dtype != torch.float32:
            target[key] = dtype
    if not target:
        return {}

    names = {name: target[id(t)] for name, _, _, t in tensor_slots(gm) if id(t) in target}
    changed = rebind(gm, names)
    watch_for_masters(new for _, new in changed.values())  # a plain torch optimizer would step them in place
    return {name: new.dtype for name, (_, new) in changed.items()}


#: a table indexed by integer ids: the tensor does not mix into the activations arithmetically
_LOOKUPS = frozenset(op_key(f) for f in (F.embedding, F.embedding_bag, torch.embedding, torch.embedding_bag,
                                         torch.ops.aten.embedding.default, torch.ops.aten._embedding_bag.default,
                                         torch.ops.aten.embedding_bag.default))


def _wanted_storage(user: fx.Node, decisions: Dict[fx.Node, Decision], policy: Policy,
                    infer: DtypeInference) -> torch.dtype:
    """The storage dtype one consumer (found through views) wants for a parameter or buffer it reads."""
    d = decisions.get(user)
    if d is None or user.op == "output":
        return torch.float32
    if d.compute is None and _mixes_into_activations(user, infer):
        return policy.unsafe
    return _storage_for(d, policy)


def _mixes_into_activations(user: fx.Node, infer: DtypeInference) -> bool:
    """An op that follows its inputs and combines several float values (add, mul, cat, where...)."""
    if user.op in ("call_function", "call_method") and op_key(user.target) in _LOOKUPS:
        return False
    floats = [i for i in user.all_input_nodes if infer(i) is not NOT_FLOAT]
    return len(floats) > 1


def _consumers(node: fx.Node):
    """The nodes that compute with ``node``'s values, looking through views of it (``w.t()``, ``w[0]``, a split)."""
    for user in node.users:
        if _is_view(user) and user.args and user.args[0] is node:
            yield from _consumers(user)
        else:
            yield user


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in VIEW_ATTRS
    return node.op in ("call_function", "call_method") and op_key(node.target) in VIEW_OPS


def cast_kept_storage(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], policy: Policy) -> int:
    """The storage is given (``store_params`` did not choose it): cast low-precision tensors for the
    consumers that would have kept them float32 and do not cast their inputs themselves.

    A consumer with a ``compute`` dtype gets its casts from :func:`insert_casts`; one that follows its
    inputs (``compute`` None) but wants float32 storage (an unlisted op, a no-grad region) gets
    ``tensor.to(float32)`` here, one per tensor.  Runs before :func:`lower_attribute_reads`.
    Returns how many casts were made::

        w = self.w                 # stored bfloat16       w = self.w
        r = unlisted_op(x, w)                       ==>    to = w.to(torch.float32)
                                                           r = unlisted_op(x, to)
    """
    made = 0
    infer = DtypeInference(gm, dict(gm.named_modules()), decisions)

    def wants_float32(consumer: fx.Node) -> bool:  # and does not cast its inputs itself
        d = decisions.get(consumer)
        return (d is not None and d.compute is None
                and _wanted_storage(consumer, decisions, policy, infer) == torch.float32)

    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = fetch_attr(gm, str(node.target))
        if not isinstance(value, torch.Tensor) or value.dtype not in LOW:
            continue
        cast_node: Optional[fx.Node] = None
        for user in list(node.users):
            # through views, as store_params looks: the op a transposed weight reaches decides
            reached = list(_consumers(user)) if _is_view(user) and user.args and user.args[0] is node else [user]
            if not any(wants_float32(c) for c in reached):
                continue
            if cast_node is None:
                with gm.graph.inserting_after(node):
                    cast_node = gm.graph.call_method("to", (node, torch.float32))
                cast_node.meta[CAST] = (node, torch.float32)
                made += 1
            user.replace_input_with(node, cast_node)
    return made


def _strided(value: fx.Node) -> bool:
    """A value captured (torch.export's ``meta["val"]``) as neither row-major nor channels-last.

    ``x.to(dtype)`` keeps such strides, and ``linear`` of a transposed 3-D input whose weight needs
    no grad materialises one weight copy per row; ``runtime.cast_dense`` makes the copy row-major.
    """
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    try:
        return not (val.is_contiguous() or val.is_contiguous(memory_format=torch.channels_last))
    except Exception:  # symbolic strides it cannot decide: keep the plain cast
        return False


class _Casts:
    """Creates cast nodes, one per (value, dtype), placed before the first node that needs it."""

    def __init__(self, gm: fx.GraphModule, weight_cache: bool, dtypes: DtypeInference):
        self.gm = gm
        self.dtypes = dtypes
        self.graph = gm.graph
        self.made: Dict[Tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.count = 0
        self.weight_cache = weight_cache
        self._cache_node: Optional[fx.Node] = None
        # dtype -> (the one cast_weights node of that dtype, its weights, their names)
        self._batches: Dict[torch.dtype, Tuple[fx.Node, List[fx.Node], List[str]]] = {}

    def _cache(self) -> fx.Node:
        if self._cache_node is None:
            if not hasattr(self.gm, CACHE_NAME):
                self.gm.add_module(CACHE_NAME, WeightCastCache())
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            with self.graph.inserting_before(first):
                self._cache_node = self.graph.get_attr(CACHE_NAME)
        return self._cache_node

    def _weight(self, value: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """A weight's low-precision copy: an item of the forward's single ``cast_weights`` call."""
        if dtype not in self._batches:
            cache = self._cache()
            # before the first consumer: every later one follows it, and the weights it reads were
            # all read at the top of the graph (lower_attribute_reads runs first)
            with self.graph.inserting_before(before):
                batch = self.graph.call_function(cast_weights, (cache, (), dtype, ()))
            self._batches[dtype] = (batch, [], [])
        batch, weights, keys = self._batches[dtype]
        if value.op == "get_attr":  # a root-level tensor read where first used: to the top (it has no inputs), above
            # the batch and any earlier reader (a VQ-VAE's codebook, transposed before its lookup)
            top = next(n for n in self.graph.nodes if n.op != "placeholder")
            if top is not value:
                top.prepend(value)
        weights.append(value)
        keys.append(attr_target(value))
        with self.graph.inserting_before(before):
            return self.graph.call_function(operator.getitem, (batch, len(weights) - 1))

    def to(self, value: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        known = self.dtypes(value)
        if known is NOT_FLOAT or known == dtype or (known is not None and known not in CASTABLE):
            return value  # nothing to cast: not a float, already there, or float64
        if known is None and self.dtypes.if_castable(value) == dtype:
            return value  # already there if castable; a float64 (or int) the checked cast would leave alone
        key = (value, dtype)
        if key in self.made:
            return self.made[key]
        with self.graph.inserting_before(before):
            if attr_target(value) is not None and self.weight_cache and dtype in LOW:
                node = self._weight(value, dtype, before)
            elif known is not None:
                if _strided(value):
                    node = self.graph.call_function(cast_dense, (value, dtype))
                else:
                    node = self.graph.call_method("to", (value, dtype))
            else:
                node = self.graph.call_function(cast, (value, dtype))
        node.meta[CAST] = (value, dtype)
        self.made[key] = node
        self.count += 1
        return node

    def forget(self, value: fx.Node) -> None:
        """Drop the casts made of ``value`` (it was written in place: later uses need fresh ones)."""
        for key in [k for k in self.made if k[0] is value]:
            del self.made[key]

    def finish(self) -> None:
        """Give each ``cast_weights`` call its weights (set once: rebuilding per weight is quadratic)."""
        for dtype, (batch, weights, keys) in self._batches.items():
            batch.args = (batch.args[0], tuple(weights), dtype, tuple(keys))


def insert_casts(
    gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], policy: Policy, *, weight_cache: bool = True
) -> int:
    """Insert a cast before each node whose decision has a ``compute`` dtype; returns how many were made."""
    graph = gm.graph
    modules = dict(gm.named_modules())
    casts = _Casts(gm, weight_cache, DtypeInference(gm, modules, decisions))
    for node in list(graph.nodes):
        d = decisions.get(node)
        into = node.args[0] if is_inplace(node.op, node.target) and node.args else None
        if d is not None and d.compute is not None:
            dtype = d.compute
            if into is not None:
                _write_back(graph, node, dtype, casts)
            elif node.op == "call_module" and _needs_param_cast(modules[node.target], dtype):
                _run_module_cast(graph, node, dtype, casts)
            else:
                node.args = fx.node.map_arg(node.args, lambda n: casts.to(n, dtype, node))
                node.kwargs = fx.node.map_arg(node.kwargs, lambda n: casts.to(n, dtype, node))
        elif d is not None and d.norm:
            if policy.norms in LOW and node.args and isinstance(node.args[0], fx.Node):
                # norms stored low (O3): the kernels refuse a float32 input with low-precision weights
                # ("mixed dtype (CPU)"), as from a model whose first layer is a batch norm
                node.args = (casts.to(node.args[0], policy.norms, node), *node.args[1:])
            if node.op == "call_function":
                _cast_norm_tensors(node, policy.norms, casts)
        if isinstance(into, fx.Node):
            casts.forget(into)  # casts of it made before this write hold its old values
    casts.finish()
    return casts.count


#: the statistics and affine arguments of the batch/instance norm functions (positions 1-4 in each schema)
_NORM_TENSORS = ("running_mean", "running_var", "weight", "bias")


def _cast_norm_tensors(node: fx.Node, dtype: torch.dtype, casts: "_Casts") -> None:
    """A norm that follows its input still takes its weight, bias and statistics in ``policy.norms``.

    The kernels take a low-precision input with float32 tensors, but not a float32 input with
    low-precision ones ("mixed dtype (CPU)"): a weight computed from a low-precision parameter
    (weight standardisation's ``F.batch_norm(w, None, None, weight=gain * scale)``) gets a cast.
    """
    node.args = tuple(casts.to(a, dtype, node) if 1 <= i <= 4 and isinstance(a, fx.Node) else a
                      for i, a in enumerate(node.args))
    node.kwargs = {k: casts.to(v, dtype, node) if k in _NORM_TENSORS and isinstance(v, fx.Node) else v
                   for k, v in node.kwargs.items()}


def _write_back(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, casts: "_Casts") -> None:
    """Run an in-place op in ``dtype`` and write the result back: ``y.exp_()`` ->
    ``exp_ = y.to(float32).exp();  copy_ = y.copy_(exp_)`` (uses of the node read ``copy_``, i.e. ``y``).

    When ``y`` already is in ``dtype`` it runs in place as written, its other float inputs cast to ``dtype``
    (``out.index_add_(0, idx, src)`` takes no ``src`` of another dtype); nothing changes when ``y`` is not a
    tensor fxamp casts.
    """
    into = node.args[0]
    known = casts.dtypes(into)
    if known is NOT_FLOAT or (known is not None and known not in CASTABLE):
        return
    if known == dtype or casts.dtypes.if_castable(into) == dtype:
        node.args = (into, *fx.node.map_arg(node.args[1:], lambda n: casts.to(n, dtype, node)))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda n: casts.to(n, dtype, node))
        return
    plain = out_of_place(node.op, node.target)
    with graph.inserting_before(node):
        args = fx.node.map_arg(node.args, lambda n: casts.to(n, dtype, node))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: casts.to(n, dtype, node))
        value = graph.create_node(node.op, plain, args, kwargs)
        write = graph.call_method("copy_", (into, value))
    value.meta = dict(node.meta)  # the computation carries the decision (and the report row)
    node.replace_all_uses_with(write)
    name = node.name
    graph.erase_node(node)
    rename_node(graph, value, name)


def _needs_param_cast(m: nn.Module, dtype: torch.dtype) -> bool:
    return any(p.dtype in CASTABLE and p.dtype != dtype for p in m.parameters())


def _run_module_cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, casts: "_Casts") -> None:
    """A leaf module whose float32 weights must run in low precision: ``call_module_cast(m, dtype, ...)``,
    with the weight cache (``_fxamp_cache=(cache, path)``) unless it is off."""
    kwargs = dict(node.kwargs)
    if casts.weight_cache and dtype in LOW:
        kwargs["_fxamp_cache"] = (casts._cache(), str(node.target))
    with graph.inserting_before(node):
        module = graph.get_attr(node.target)
        new = graph.call_function(call_module_cast, (module, dtype, *node.args), kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def lower_attribute_reads(gm: fx.GraphModule) -> int:
    """Read parameters and buffers through their owners' ``_parameters``/``_buffers`` dicts.

    FX spells a read of ``layers.0.weight`` as ``getattr(self.layers, "0").weight``: three
    ``nn.Module.__getattr__`` calls per tensor per forward, which dominates a
    dispatch-bound model.  After lowering, each module on the way is fetched once per forward and
    each tensor is a dict lookup.  Reads stay live (never a stale reference), so replacing a
    parameter or submodule after conversion is seen.  The value node keeps the get_attr's name and
    meta, with ``meta[graph.ATTR]`` = the dotted name.  Returns how many reads were lowered.
    """
    graph = gm.graph
    # the anchor must survive: get_attr nodes before it may be lowered (erased)
    first = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    plumbing: Dict[Tuple[str, str], fx.Node] = {}  # (module path, "" | "_modules" | ...) -> node

    def fetch(path: str, kind: str = "") -> fx.Node:
        """A node yielding module ``path`` (kind ""), or one of its dicts (kind "_parameters"…)."""
        key = (path, kind)
        if key not in plumbing:
            with graph.inserting_before(first):
                if kind:
                    plumbing[key] = graph.call_function(getattr, (fetch(path), kind))
                elif "." not in path:
                    plumbing[key] = graph.get_attr(path)  # a child of the root: one __getattr__
                else:
                    parent, _, name = path.rpartition(".")
                    plumbing[key] = graph.call_function(operator.getitem, (fetch(parent, "_modules"), name))
        return plumbing[key]

    replaced: Dict[fx.Node, fx.Node] = {}
    modules = dict(gm.named_modules())
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        owner_path, _, name = str(node.target).rpartition(".")
        owner = modules.get(owner_path) if owner_path else None
        if owner is None:
            continue  # a root-level tensor or a module: leave it
        kind = "_parameters" if name in owner._parameters else "_buffers" if name in owner._buffers else None
        if kind is None or owner._parameters.get(name, owner._buffers.get(name)) is None:
            continue
        with graph.inserting_before(first):
            value = graph.call_function(operator.getitem, (fetch(owner_path, kind), name))
        value.meta = dict(node.meta)
        value.meta[ATTR] = str(node.target)
        node.replace_all_uses_with(value)
        replaced[node] = value
        old_name = node.name
        graph.erase_node(node)
        rename_node(graph, value, old_name)
    for node in graph.nodes:  # casts remember their source node
        source = node.meta.get(CAST)
        if source is not None and source[0] in replaced:
            node.meta[CAST] = (replaced[source[0]], source[1])
    return len(replaced)


def _enabled(conversion: Conversion) -> bool:
    return conversion.policy.enabled


def _storage(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    """O2/O3 storage: decided here (``storage="decide"``), or kept as made and cast where a consumer wants another."""
    if conversion.storage == "decide":
        store_params(gm, conversion.decisions, conversion.policy)
    else:
        cast_kept_storage(gm, conversion.decisions, conversion.policy)
    return []


def _attribute_reads(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    lower_attribute_reads(gm)
    return []


def _casts(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    insert_casts(gm, conversion.decisions, conversion.policy, weight_cache=conversion.options.weight_cache)
    return []


STORAGE = Pass("storage", Stage.REWRITE, _storage, applies=_enabled)
ATTRIBUTE_READS = Pass("attribute reads", Stage.REWRITE, _attribute_reads, applies=_enabled)
CASTS = Pass("casts", Stage.REWRITE, _casts, applies=_enabled)
