"""In-place conversion, block by block: :func:`convert_blocks` (``fxamp.convert_``).

The user's model object stays; only its repeated layers ("blocks") and a few leaf modules around
them ("glue") are replaced, each by a converted module of a subclass of its own class that holds
the same children, parameters, buffers, attributes and hooks::

    convert_blocks(model, policy, options, blocks)
      ├─ find_blocks: user globs ("model.layers.*"), else the repeated children of every nn.ModuleList
      ├─ glue: the leaf Linear/Embedding/convolution/norm modules outside blocks (module-level decisions)
      ├─ families: instances of one class with the same structure; plain attributes that differ between
      │  them (``layer_idx``) become graph inputs, so one capture serves every instance
      ├─ storage (O2/O3): lazy.predict_storage over the whole model, re-bound once through the root
      │  (tied tensors stay tied), before any capture, so an optimizer can be built at once
      └─ each instance re-registered where the original was (same names: state_dict keys unchanged)

    block(*args, **kwargs)      (the converted block's forward; hooks, checkpointing wrappers run as before)
      ├─ key: the call's structure (which arguments are None, constants' values, tensors' dtypes)
      ├─ family.graphs[key] hit → the graph's code, run with ``self`` = this block
      └─ miss → capture the class's own forward (torch.fx; torch.export from the call's values when fx
         fails and no argument is an opaque object) → classify → rewrite (storage kept) → cache

A block's graph reads its tensors through ``self`` (``self.mlp._modules['fc']._parameters['weight']``),
never through the capture's copy, so the graph of one instance runs any instance of its family.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen

from .calls import SIMPLE, bound_root, describe_call, flatten_call, leaf_names, undo_point
from .capture import capture, capture_with_values
from .capture.regions import confirmed, region_note, scan
from .capture.concrete import LATE_BRANCH, GuardFailed, LateGuardFailed, guard
from ..dtypes import LOW
from .capture.shapes import STATIC_SIZES
from .capture.modes import MODE_FLAG
from ..errors import FxampError, TraceError
from .graph import INPUT_DTYPE, fetch_attr, rebind
from ..info import INFO_ATTR, ConversionInfo, conversion_info, origin_of, remember_origin, watch_for_masters
from .lazy import float32_for_capture, is_norm, predict_storage
from .options import ConvertOptions
from .pipeline import rewrite_captured
from ..policy import Policy
from .runtime import WeightCastCache

__all__ = ["convert_blocks", "find_blocks", "glue_modules", "converted_modules", "BLOCKS_FRONTEND",
           "is_converted_block", "family_of", "Family"]

logger = logging.getLogger("fxamp")

#: ConversionInfo.frontend of a model converted in place
BLOCKS_FRONTEND = "blocks"
#: leaf modules outside blocks that get module-level decisions (and the policy's outputs)
_GLUE: Tuple[type, ...] = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)
_FAMILY = "_fxamp_family"
_LIFTED = "_fxamp_lifted"
#: a converted block's own attributes, which the module torch.fx traces must not have
_PRIVATE = (_FAMILY, _LIFTED, INFO_ATTR)


def find_blocks(model: nn.Module, patterns: Optional[Sequence[str]] = None) -> List[str]:
    """Module paths of the blocks: those matching ``patterns`` (globs such as ``"model.layers.*"``), else
    the children of every ``nn.ModuleList`` that holds two or more modules of one class, or a single module
    (outermost only)."""
    paths = [p for p, _ in model.named_modules() if p]
    if patterns is not None:
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"blocks= takes a list of module path globs such as ['model.layers.*'], not {patterns!r}")
        found: List[str] = []
        for pattern in patterns:
            hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
            if not hits:
                raise ValueError(f"blocks={list(patterns)!r}: {pattern!r} matches no module of "
                                 f"{type(model).__name__}; some paths it has: {', '.join(paths[:6])}")
            found += [p for p in hits if p not in found]
    else:
        found = []
        for path, m in model.named_modules():
            if not isinstance(m, nn.ModuleList) or isinstance(m, ParametrizationList) or \
                    any(_inside(path, b) for b in found):
                continue  # (a weight's parametrizations are not layers: weight_norm's list of one)
            counts: Dict[type, int] = {}
            for child in m.children():
                counts[type(child)] = counts.get(type(child), 0) + 1
            single = len(m) == 1  # a stack of one layer (a small config) is still the model's block list
            found += [f"{path}.{name}" if path else name for name, child in m.named_children()
                      if counts[type(child)] > 1 or single]
        if not found:
            raise ValueError(f"fxamp.convert_ found no blocks in {type(model).__name__} (no nn.ModuleList holds "
                             f"its layers): name them, e.g. blocks=['encoder.layers.*']")
    return [p for p in found if not any(q != p and _inside(p, q) for q in found)]  # outermost only


def glue_modules(model: nn.Module, blocks: Sequence[str]) -> List[str]:
    """Leaf modules outside ``blocks`` that get module-level decisions: linear, embedding, convolution, norms."""
    return [p for p, m in model.named_modules() if p and not any(_inside(p, b) for b in blocks)
            and not list(m.children()) and (isinstance(m, _GLUE) or is_norm(m)) and list(m.parameters())]


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def is_converted_block(module: nn.Module) -> bool:
    """Whether ``module`` is a block (or glue module) that :func:`convert_blocks` converted."""
    return _FAMILY in module.__dict__


def family_of(module: nn.Module) -> "Family":
    """The :class:`Family` a converted block or glue module belongs to (its captured graphs, its instances)."""
    return module.__dict__[_FAMILY]


def converted_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of every converted block and glue module of an in-place converted model."""
    return [(p, m) for p, m in model.named_modules() if is_converted_block(m)]


class Family:
    """Instances of one module class with the same structure: the graphs they share, by call signature.

    lifted:  ``(submodule path, attribute)`` of plain attributes whose values differ between the
             instances; a capture reads them as graph inputs, so every instance runs its own values.
    glue:    module-level: the policy's outputs, and the report marks its rows.
    """

    def __init__(self, cls: type, paths: List[str], policy: Policy, options: ConvertOptions,
                 lifted: Tuple[Tuple[str, str], ...], glue: bool):
        self.cls = cls
        self.paths = paths
        # a block's outputs come back in policy.output, as a whole model's do: the ops that read them next
        # (a norm, a float32 residual add) are float32 ones, so ops feeding the output resolve as in the
        # whole-model graph, where those readers are visible
        self.policy = policy
        self.options = options
        self.lifted = lifted
        self.glue = glue
        # (signature, None | the training mode it is right in) -> its variants (guards pick), latest first
        self.graphs: Dict[Any, List["_Graph"]] = {}
        self.static: Dict[Any, Callable[..., Any]] = {}  # signature -> the sizes of the dims export kept static
        self.per_instance = False  # an export capture read a lifted attribute: graphs keyed by their values too
        self.captures = 0
        self.capture_seconds = 0.0
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_lock"] = None
        state["graphs"] = {}  # a copy captures again: the graphs hold the original instances' modules
        state["static"] = {}
        state["per_instance"] = False
        state["captures"] = 0
        state["capture_seconds"] = 0.0
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Family":
        new = Family.__new__(Family)
        memo[id(self)] = new
        new.__setstate__(self.__getstate__())  # (shares the class, policy and options: none changes)
        return new

    def run(self, block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        base, leaves, tree = flatten_call(args, kwargs)
        static = self.static.get(base)  # an export capture kept some dims static: their sizes are part of the key
        key = base if static is None else (base, tuple(static(tuple(leaves), {})))
        mode = block.training
        graphs = self.graphs
        keys = [(key, None), (key, mode)]
        if self.per_instance:  # export graphs that read a lifted attribute: one per value
            values = block.__dict__[_LIFTED]
            keys += [((key, values), None), ((key, values), mode)]
        for variants in [graphs[k] for k in keys if k in graphs]:
            for graph in variants:
                undo = undo_point(block, leaves) if graph.late else None
                try:
                    out = graph.call(block, leaves)
                except GuardFailed:  # an early guard: this call takes another branch; nothing ran that matters
                    continue
                except LateGuardFailed:  # a cache method ran first: try the others if it can be undone
                    if undo is None or not undo():
                        raise
                    continue
                if graph is not variants[0]:
                    variants.remove(graph)
                    variants.insert(0, graph)  # the latest variant first (a decoding loop's steps)
                return out
        with self._lock:
            graph = self._capture(block, base, key, tree, leaves)
        try:
            return graph.call(block, leaves)
        except GuardFailed:  # its own early copy of a late guard: a method it ran changed what the branch read
            raise FxampError(LATE_BRANCH) from None

    def _capture(self, block: nn.Module, base: Any, key: Any, tree: Any, leaves: List[Any]) -> "_Graph":
        start = time.perf_counter()
        names = leaf_names(tree, len(leaves))
        what = f"{'glue module' if self.glue else 'block'} {self.paths[0]!r} ({self.cls.__name__})"
        described = describe_call(tree, leaves)
        lifted = True
        concrete_error: Optional[TraceError] = None
        root = bound_root(block, self.cls, tree, names, self.lifted, drop=_PRIVATE)
        captured = fx_error = None
        if all(isinstance(v, torch.Tensor) for v in leaves):  # (an object's proxy fails isinstance checks)
            try:
                captured = capture(root, frontend="fx")
            except TraceError as e:
                fx_error = e
        if captured is None:  # shapes unpacked or branched on: trace with this call's values, branches guarded
            try:
                with float32_for_capture(root, _stored_low(root)) as restore:  # the forward runs as written
                    captured = capture_with_values(root, [*leaves, *block.__dict__[_LIFTED]])
                    restore.also(captured.graph_module)
            except TraceError as e:
                concrete_error = e
                logger.info("fxamp: %s: torch.fx with the call's values failed too: %s", what, e.short)
        if captured is None:
            e = fx_error or concrete_error
            opaque = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
            if opaque:
                raise TraceError(
                    f"fxamp.convert_: {what} could not be captured for a call with {described}: torch.fx failed "
                    f"({e.short}), with the call's values too ({concrete_error.short if concrete_error else '-'}), "
                    f"and torch.export cannot take the {', '.join(opaque)} argument; call the model "
                    f"without it (use_cache=False for a Hugging Face KV cache), or convert the model whole with "
                    f"fxamp.convert", short=e.short, module_path=self.paths[0], original=e.original) from e
        if captured is None:
            # torch.export bakes Python values in: the lifted attributes are first set to a value that
            # refuses every use, so a graph that succeeds cannot depend on them and serves every instance;
            # else each distinct set of values gets its own capture
            lifted, values = False, None
            try:
                captured = self._export(block, tree, names, leaves, (_UNREAD,) * len(self.lifted), fx_error)
            except Exception:
                if not self.lifted:
                    raise
                self.per_instance = True
                values = block.__dict__[_LIFTED]
                captured = self._export(block, tree, names, leaves, values, fx_error)
            static = captured.graph_module.meta.get(STATIC_SIZES)
            if base not in self.static and static is not None and static(tuple(leaves), {}):
                self.static[base] = static
                key = (base, tuple(static(tuple(leaves), {})))
            if values is not None:
                key = (key, values)
        placeholders = list(captured.graph_module.graph.find_nodes(op="placeholder"))
        for node, leaf in zip(placeholders, leaves):  # the key holds each tensor's dtype: the graph may know it
            if isinstance(leaf, torch.Tensor):
                node.meta[INPUT_DTYPE] = leaf.dtype
        gm = rewrite_captured(captured, self.policy, self.options, storage="keep",
                              notes=[f"{what}, shared by {len(self.paths)} instance(s), captured with "
                                     f"{captured.frontend} for a call with {described}"])
        _check_extras(gm, block, self.paths)
        graph = _Graph(gm, _forward_of(gm), described, captured.frontend, lifted)
        self.graphs.setdefault((key, captured.only_mode), []).insert(0, graph)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        logger.info("fxamp: captured %s with %s for a call with %s", what, captured.frontend, described)
        return graph

    def _export(self, block: nn.Module, tree: Any, names: List[str], leaves: List[Any], values: Tuple[Any, ...],
                fx_error: TraceError) -> Any:
        root = bound_root(block, self.cls, tree, names, self.lifted, values=values, drop=_PRIVATE)
        root.training = block.training
        with float32_for_capture(root, _stored_low(root)) as restore, torch.enable_grad():
            captured = capture(root, frontend="export", example_inputs=tuple(leaves), example_kwargs={},
                               dynamic=self.options.dynamic, fx_error=fx_error, graph_per_mode=True, at_call=True)
            restore.also(captured.graph_module)
        return captured


def _stored_low(root: nn.Module) -> frozenset:
    return frozenset(n for n, t in itertools.chain(root.named_parameters(), root.named_buffers()) if t.dtype in LOW)


def _forward_of(gm: fx.GraphModule) -> Callable[..., Any]:
    """The graph's code as a function of (self, *leaves).  An exported graph flattens its inputs and
    unflattens its outputs through ``self._in_spec``/``_out_spec``; the leaves are flat already, so its
    code is made plain and the outputs are unflattened here (``self`` is the block, not the graph)."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        return type(gm).forward
    out_spec = codegen.pytree_info.out_spec
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    plain = type(gm).forward
    if out_spec is None:
        return plain

    def forward(self: nn.Module, *leaves: Any) -> Any:
        return pytree.tree_unflatten(plain(self, *leaves), out_spec)
    return forward


class _Unread:
    """Stands for a lifted attribute in a torch.export capture: any use of it fails the capture."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("fxamp: a per-instance attribute was read during the capture")

    __index__ = __int__ = __float__ = __bool__ = __eq__ = __ne__ = __lt__ = __gt__ = __le__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __hash__ = __str__ = __format__ = _refuse
    __truediv__ = __floordiv__ = __mod__ = __neg__ = __len__ = __iter__ = __getitem__ = __call__ = _refuse

    def __repr__(self) -> str:
        return "<fxamp: per-instance attribute>"


_UNREAD = _Unread()


class _Graph:
    """One capture of a family: the converted graph module (for the report) and its forward code."""

    def __init__(self, gm: fx.GraphModule, fn: Callable[..., Any], description: str, frontend: str,
                 lifted: bool):
        self.lifted = lifted  # its forward takes the lifted attributes' values after the call's leaves
        self.gm = gm
        self.fn = fn
        self.description = description
        self.frontend = frontend
        # a guard after a side effect (capture/concrete.py): a failing call must be undone before another try
        self.late = any(n.target is guard and n.args[2] is False for n in gm.graph.find_nodes(op="call_function",
                                                                                             target=guard))

    def call(self, block: nn.Module, leaves: List[Any]) -> Any:
        if self.lifted:
            return self.fn(block, *leaves, *block.__dict__[_LIFTED])
        return self.fn(block, *leaves)


def _check_extras(gm: fx.GraphModule, block: nn.Module, paths: Sequence[str]) -> None:
    """What a graph reads from ``self`` beyond the block's own tree (higher-order-op bodies, constants):
    shared by every instance of the family, kept in the family's graph module."""
    own = set(block._modules) | set(block._parameters) | set(block._buffers)
    # (the weight cache is each instance's own; the root's mode flag is the block itself: see converted_class)
    extras = {n: m for n, m in gm._modules.items() if n not in own and n not in ("_fxamp_weight_cache", MODE_FLAG)}
    extras.update({n: t for n, t in itertools.chain(gm._parameters.items(), gm._buffers.items()) if n not in own})
    if extras:
        # a grad-mode/autocast region's body is a sub-graph (submod_1): name the region's line, not the attribute
        bodies = [m.graph for m in extras.values() if isinstance(m, fx.GraphModule)]
        found = confirmed(scan(block, graphs=[gm.graph, *bodies]), bodies) if bodies else []
        lines = [region_note(".".join(filter(None, (paths[0], p))), f) for p, _, f in found
                 if f.kind in ("grad", "autocast")]
        if lines:
            raise TraceError(f"fxamp.convert_: block {paths[0]!r} has a grad-mode or autocast region, "
                             f"{'; '.join(lines)}, which a per-block graph cannot keep (torch.export made it a "
                             f"sub-graph its instances do not have); convert this model whole with fxamp.convert, "
                             f"which keeps it", short=f"region {lines[0]} in a block", module_path=paths[0])
        raise TraceError(f"fxamp.convert_: the capture of block {paths[0]!r} made attributes its instances do not "
                         f"have ({', '.join(sorted(extras))}); convert this model whole with fxamp.convert",
                         short="capture made extra attributes")


# -- the converted classes -------------------------------------------------------------------------

def _converted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self.__dict__[_FAMILY].run(self, args, kwargs)


def _self(module: nn.Module) -> nn.Module:
    return module


def _converted_apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``nn.Module._apply`` (what ``.to()``, ``.half()``, ``.cuda()`` call), refusing a change of the floating
    dtypes conversion chose: the graphs cast per op for those, so ``.half()`` would break them deep in
    torch. Tried on empty tensors of the dtypes the module holds, before any tensor changes."""
    for dtype in {t.dtype for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()}:
        try:
            new = fn(torch.empty(0, dtype=dtype)).dtype
        except Exception:  # a function only for real tensors (to_empty, share_memory_): not a dtype change
            continue
        if new != dtype:
            family = self.__dict__[_FAMILY]
            raise FxampError(
                f"fxamp.convert_: {family.paths[0]!r} ({family.cls.__name__}) holds {str(dtype)[6:]} tensors that "
                f"this call (.half(), .float(), .to(dtype)...) would turn {str(new)[6:]}; the converted graphs cast "
                f"per op for the dtypes conversion chose ({family.policy}). "
                f"Convert the float32 model with the dtype you want instead (fxamp.convert_(model, policy, "
                f"dtype=...)); .to(device) is fine")
    # (not type(self): fully_shard swaps in a subclass of it)
    return super(converted_class(self.__dict__[_FAMILY].cls), self)._apply(fn, *args, **kwargs)


def _rebuild_block(cls: type, state: Dict[str, Any]) -> nn.Module:
    """Unpickling (and deep copies): an instance of ``cls``'s converted class with ``state``."""
    new = converted_class(cls).__new__(converted_class(cls))
    new.__dict__.update(state)
    return new


def _reduce_ex(self: nn.Module, protocol: Any) -> Any:
    return _rebuild_block, (self.__dict__[_FAMILY].cls, self.__dict__)


#: each original class's converted subclass, made once: every instance (and every copy or unpickled one)
#: of a class gets the same subclass, so ``type(a) is type(b)`` holds between converted blocks
_CLASSES: Dict[type, type] = {}


def converted_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward runs its family's graphs: same name, same methods otherwise
    (``isinstance`` checks, Hugging Face's ``GradientCheckpointingLayer.__call__``, class-name lists hold)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (cls,), {"forward": _converted_forward, "__reduce_ex__": _reduce_ex,
                                           "_apply": _converted_apply,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                           "_fxamp_converted": True,
                                           MODE_FLAG: property(_self, doc="the root's train/eval flag in a graph")})
        made.forward.__doc__ = cls.forward.__doc__
        _CLASSES[cls] = made
    return made


class _OriginalDtypes:
    """A state_dict hook of a converted module: its re-bound tensors come out in the dtypes they had before
    conversion (float32), under the same names, a parameter as its master's (or original's) exact float32
    value (``fxamp.info.origin_of``); ``load_state_dict`` copies them back into the stored dtypes."""

    def __init__(self, dtypes: Dict[str, torch.dtype]):
        self.dtypes = dtypes  # name below the module -> original dtype

    def __call__(self, module: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, dtype in self.dtypes.items():
            key = prefix + name
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                # the float32 truth while the weight is its rounding: the master an optimizer steps, or the original
                exact = origin_of(fetch_attr(module, name))
                state[key] = exact.detach() if exact is not None and exact.dtype == dtype else value.to(dtype)


# -- the entry point -------------------------------------------------------------------------------

def _structure(m: nn.Module) -> Any:
    return (type(m), tuple((p, type(s)) for p, s in m.named_modules()),
            tuple((n, tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
                  for n, t in itertools.chain(m.named_parameters(), m.named_buffers())))


def _attrs(m: nn.Module) -> Dict[Tuple[str, str], Any]:
    out = {}
    for path, sub in m.named_modules():
        for name, value in sub.__dict__.items():
            if name.startswith("_") or name == "training":
                continue
            out[(path, name)] = value
    return out


def _families(model: nn.Module, paths: List[str], policy: Policy, options: ConvertOptions, glue: bool
              ) -> List[Tuple[Family, List[str]]]:
    """Group instances by class and structure; plain attributes that differ are lifted; other differing
    attributes (objects) split the group."""
    modules = dict(model.named_modules())
    groups: Dict[Any, List[str]] = {}
    rules = {p: _overrides_inside(p, options.module_overrides or {}) for p in paths}
    for p in paths:  # instances with other module_overrides inside them cannot share a graph
        groups.setdefault((_structure(modules[p]), tuple(sorted(rules[p].items(), key=str))), []).append(p)
    out = []
    for members in groups.values():
        own = dataclasses.replace(options, module_overrides=rules[members[0]] or None)
        attrs = [_attrs(modules[p]) for p in members]
        keys = set().union(*attrs)
        lifted, split = [], []
        for k in sorted(keys):
            values = [a.get(k, _MISSING) for a in attrs]
            if all(v is values[0] for v in values) or all(_same(v, values[0]) for v in values):
                continue
            if all(isinstance(v, (bool, int, float, str)) and type(v) is type(values[0]) for v in values):
                lifted.append(k)
            else:
                split.append(k)
        subgroups: Dict[Tuple[int, ...], List[str]] = {}
        for p, a in zip(members, attrs):
            subgroups.setdefault(tuple(id(a.get(k)) for k in split), []).append(p)
        for sub in subgroups.values():
            out.append((Family(type(modules[sub[0]]), sub, policy, own, tuple(lifted), glue), sub))
    return out


_MISSING = object()


def _overrides_inside(path: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The user's ``module_overrides`` as the capture of the module at ``path`` names them: paths below it
    relative to it, and the closest override of it or of a module around it as ``""`` (its whole graph)."""
    out: Dict[str, Any] = {}
    around = [p for p in overrides if _inside(path, p) or p == ""]
    if around:
        out[""] = overrides[max(around, key=len)]
    for p, value in overrides.items():
        if p.startswith(path + "."):
            out[p[len(path) + 1:]] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal plain values (tuples of them too: a norm's ``normalized_shape``)."""
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return isinstance(a, SIMPLE) and bool(a == b)
    except Exception:  # pragma: no cover - an __eq__ that does not return a bool
        return False


def convert_blocks(model: nn.Module, policy: Policy, options: ConvertOptions,
                   blocks: Optional[Sequence[str]] = None, notes: Sequence[str] = (), *,
                   keep_originals: bool = True) -> nn.Module:
    """Convert ``model`` in place (see the module docstring); returns ``model``.

    keep_originals: O2/O3 hold the float32 tensors the low-precision parameters replace, until a
    ``MixedPrecisionOptimizer`` takes them as its masters (exact, no copy: ``fxamp.info.take_origin``).
    """
    if conversion_info(model) is not None or converted_modules(model):
        raise ValueError(f"fxamp.convert_: this {type(model).__name__} was already converted by fxamp; convert "
                         f"the original model once")
    names = {p for p, _ in model.named_modules()}
    for path in options.module_overrides or {}:
        if path not in names:
            raise ValueError(f"module_overrides: {path!r} is not a submodule of {type(model).__name__}; some "
                             f"paths it has: {', '.join(sorted(names - {''})[:6])}")
    block_paths = find_blocks(model, blocks)
    glue_paths = glue_modules(model, block_paths)
    families = _families(model, block_paths, policy, options, glue=False) + \
        _families(model, glue_paths, policy, options, glue=True)
    saved: Dict[str, torch.dtype] = {}  # name -> the dtype state_dict gives back (the original's)
    if policy.enabled:
        storage = predict_storage(model, policy)
        converted = block_paths + glue_paths
        storage = {n: d for n, d in storage.items() if any(_inside(n.rpartition(".")[0], c) for c in converted)}
        changed = rebind(model, storage)
        if keep_originals:  # the float32 originals are the masters to be: held until an optimizer takes them
            for old, new in changed.values():
                remember_origin(new, old, hold=True)
        saved = {name: old.dtype for name, (old, _) in changed.items()}
        watch_for_masters(new for _, new in changed.values())
    modules = dict(model.named_modules())
    parents = [(m, name, child) for _, m in model.named_modules(remove_duplicate=False)
               for name, child in m._modules.items()]
    for family, members in families:
        cls = converted_class(family.cls)
        for path in members:
            old = modules[path]
            new = cls.__new__(cls)
            new.__dict__ = dict(old.__dict__)
            for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                new.__dict__[table] = type(old.__dict__[table])(old.__dict__[table])
            new.__dict__[_FAMILY] = family
            new.__dict__[_LIFTED] = tuple(getattr(old.get_submodule(p) if p else old, a) for p, a in family.lifted)
            new.__dict__["_fxamp_weight_cache"] = WeightCastCache()
            own = {n[len(path) + 1:]: d for n, d in saved.items() if n.startswith(path + ".")}
            if own:  # state_dict (save_pretrained, torch.save of it) gives the original dtypes back
                new._register_state_dict_hook(_OriginalDtypes(own))
            for parent, name, child in parents:
                if child is old:
                    parent._modules[name] = new
    info = ConversionInfo(policy, BLOCKS_FRONTEND, tuple(notes) + (
        f"converted in place: {len(block_paths)} blocks in {sum(not f.glue for f, _ in families)} families, "
        f"{len(glue_paths)} glue modules; each family captures at its first call per call signature",))
    model.__dict__[INFO_ATTR] = info
    return model
