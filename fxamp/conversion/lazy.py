"""A converted module that captures at its first call: :class:`LazyConverted`.

``fxamp.convert(model, policy)`` returns one when torch.fx cannot trace ``model`` and no example
inputs were given (or with ``frontend="export"`` and no inputs).  ``torch.export`` needs inputs, so
the graph is captured at the first call, from the real arguments, and again for each new call
*signature*::

    amp = fxamp.convert(gpt2, "O2", dtype=torch.bfloat16)     # parameters exist now, in their dtypes
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters()), model=amp)
    amp(ids, labels=ids)                           # captures (ids, labels)            -> graph 1
    amp(ids2, labels=ids2)                         # same signature, other sizes       -> graph 1
    amp(ids, attention_mask=mask, labels=ids)      # another signature                 -> graph 2

    forward(*args, **kwargs)
      ├─ signature: positional count, sorted keyword names, per tensor leaf dtype, device and which
      │  sizes are 0/1 (export specialises those), other leaves' values; None keywords dropped; and,
      │  once a capture of that signature kept dims static (image sizes under dynamic='batch', a
      │  sequence dim the model loops over), the call's sizes of those dims: a new size captures again
      ├─ cache hit (LRU, ``max_signatures``)  → that graph
      └─ miss → capture(frontend="export") on the shared module tree, parameters float32 for the
         capture only → classify → rewrite with the storage kept (casts where a consumer wants
         another dtype) → cache; a note in ``conversion_info(amp).notes`` and one INFO log line

Parameters and storage.  The module is made at ``convert`` time, before any graph exists, so the
storage dtype of each parameter is predicted from the module tree (:func:`predict_storage`):
linear, convolution, embedding, attention and recurrent layers' tensors in ``policy.params``,
normalisation layers' in ``policy.norms``, everything else float32 (O3: ``policy.params``), float
buffers outside those layers float32.  Every capture reads the same parameter and buffer objects,
the children of this module (the original's children, under the same names, so ``state_dict``
keys are the original's); the graphs are not children.

The root's hooks are this module's (registered at ``__init__``, none left on the root the captures read): they
run once around each call, whichever capture it runs or captures, and receive this module.

A captured graph that depends on the training mode (the two modes capture different graphs) is
cached for that mode only; ``train()``/``eval()`` then capture again at the next call.  ``convert`` makes
one from example inputs when the modes differ; given ``dynamic_shapes=``, every capture uses them.

``convert`` also returns one for a model torch.fx traces whose two modes capture different graphs
(timm's ``drop_path(x, p, self.training)``): made with ``frontend="fx"``, it holds the graph
``convert`` captured for the current mode and captures the other mode with torch.fx at its first
call in that mode (a copy or a loaded module: each mode at its first call, or when its graph is
read).  A torch.fx graph takes any call, but for the inputs whose default is None: torch.fx traces an input
as a value, so ``if labels is not None:`` takes the branch where it is given.  The cache key is the mode and
which of those inputs (the ones the graph computes with) the call leaves None: a call without ``labels``
captures once more, tracing ``labels`` as None (``runtime.graph_module.none_pattern``).  Other Python values
(a ``return_dict=False`` flag) need no key: torch.fx traces them as values too, and refuses a branch on one
(and fxamp an identity test, ``flag is True``: ``capture/fx.py``'s ``identity_test_error``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .capture import Captured, LeafSpec, capture, copy_root_hooks, root_hooks_note, shallow_copy, without_hooks
from .capture.shapes import STATIC_SIZES, OtherInputSet, OutsideCapturedRange
from ..info import INFO_ATTR, ConversionInfo, conversion_info, hold_origins, origins_for_copy, watch_for_masters
from .pipeline import rewrite_captured
from ..dtypes import short_name
from ..errors import TraceError
from .graph import keep_loaded_float32, rebind, replace_tensors, tensor_slots
from .options import ConvertOptions
from ..policy import Policy
from .rewrite.casts import CACHE_NAME
from .runtime import NodeErrors, check_values, refuse_dtype_change, root_values
from .runtime.graph_module import indexing_message, none_pattern, optional_inputs
from .storage import float32_for_capture, predict_storage

__all__ = ["LazyConverted", "RangeFallback", "range_fallback", "with_range_fallback"]

logger = logging.getLogger("fxamp")

_MISSING = object()
#: the cache key of every call of a torch.fx capture that gives every optional input (its graph takes any
#: values): only the mode differs; (_ANY_CALL, names) for a call that leaves those optional inputs None
_ANY_CALL = "any call"


class _Entry:
    """One capture: the converted graph module, what it was captured for, and its own (unshared) modules."""

    def __init__(self, gm: fx.GraphModule, description: str, own_modules: List[nn.Module], number: int):
        self.gm = gm
        self.description = description
        self.own_modules = own_modules  # the mode flag, the weight cache, higher-order-op bodies
        self.number = number  # captures made before this one


def _with_signature(root: nn.Module) -> type:
    """A subclass of :class:`LazyConverted` for one module, whose ``forward`` shows ``root.forward``'s signature.

    The Hugging Face Trainer reads ``inspect.signature(type(model).forward)``, on the *class*: the
    label names (``labels``; without them ``evaluate()`` returns no ``eval_loss``) and the dataset
    columns to keep.  torch.fx gives each ``GraphModule`` a class of its own for the same reason
    (its generated ``forward``); this is that, for the forward that captures at the first call.
    Pickling goes through :class:`LazyConverted` itself (``__reduce_ex__``), which makes it again.
    """
    try:
        signature = inspect.signature(root.forward)
    except (TypeError, ValueError):  # pragma: no cover - a forward inspect cannot read: keep *args, **kwargs
        return LazyConverted
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self: "LazyConverted", *args: Any, **kwargs: Any) -> Any:
        return self._fxamp_forward(*args, **kwargs)

    forward.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    forward.__doc__ = getattr(type(root).forward, "__doc__", None)
    return type(LazyConverted.__name__, (LazyConverted,), {"forward": forward, "__module__": __name__,
                                                            "__qualname__": LazyConverted.__qualname__})


def _new_lazy() -> "LazyConverted":
    """Unpickling: an empty :class:`LazyConverted`; ``__setstate__`` gives it its class with the signature."""
    return LazyConverted.__new__(LazyConverted)


class LazyConverted(nn.Module):
    """A converted module that captures its graph with ``torch.export`` at the first call, and again
    for each new call signature, or (``frontend="fx"``) with torch.fx once per train/eval mode (see the
    module docstring).  Made by :func:`fxamp.convert`.

    Its children, parameters and buffers are the original's (for O2/O3 a copy's, in their storage
    dtypes); ``state_dict`` keys are the original's.  ``graph_module`` is the graph the latest call
    ran; ``graph_modules()`` lists every cached one (each a converted ``GraphModule`` that
    ``fxamp.report`` accepts).  ``max_signatures`` bounds the cache (least recently used evicted).
    """

    max_signatures: int = 8

    def __init__(self, model: nn.Module, policy: Policy, options: ConvertOptions = ConvertOptions(), *,
                 owns_model: bool, fx_error: Optional[TraceError] = None, lead_note: Optional[str] = None,
                 notes: Sequence[str] = (), frontend: str = "export", leaf_modules: Sequence[LeafSpec] = (),
                 dynamic_shapes: Any = None, tensors: Optional[Dict[str, torch.Tensor]] = None,
                 optional: Sequence[Tuple[int, str]] = ()):
        super().__init__()
        if not owns_model:  # the original's children are shared (O0/O1), its own attributes are not
            root = shallow_copy(model)
            for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                root.__dict__[table] = copy.copy(model.__dict__[table])
        else:
            root = model
        # the root's hooks run around this module's call, once, outside the retries over captures (a call outside
        # one capture's range tries the next): registered here, none left on the root a capture reads
        copy_root_hooks(model, self)
        notes = [*notes, *root_hooks_note(model)]
        without_hooks(root)
        if tensors is not None:  # a converted module's tensors, by name (RangeFallback): shared as they are stored
            storage = {name: tensors[name].dtype for name, _, _, t in tensor_slots(root)
                       if name in tensors and t.dtype == torch.float32 and tensors[name].dtype != torch.float32}
            replace_tensors(root, lambda name, _t: tensors.get(name))
        else:
            storage = predict_storage(root, policy, options.module_overrides) if policy.enabled else {}
            watch_for_masters(new for _, new in rebind(root, storage).values())  # (see info.watch_for_masters)
        d = self.__dict__
        # the tables are the root's own dicts: a parameter registered or replaced on either is seen by both
        for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            d[table] = root.__dict__[table]
        d["_fxamp_root"] = root
        d["_fxamp_policy"] = policy
        d["_fxamp_stored_low"] = frozenset(name for name, dtype in storage.items() if dtype != torch.float32)
        d["_fxamp_options"] = options
        d["_fxamp_frontend"] = frontend  # "fx": a graph per mode for any call (leaf_modules: torch.fx's)
        d["_fxamp_leaf_modules"] = tuple(leaf_modules)
        d["_fxamp_optional"] = tuple(optional)  # "fx": (position, name) of the inputs whose None is another graph
        # convert(dynamic_shapes=...) whose modes captured different graphs: every capture uses them, as the first did
        d["_fxamp_dynamic_shapes"] = dynamic_shapes
        d["_fxamp_fx_error"] = _detached(fx_error)
        d["_fxamp_cache"] = collections.OrderedDict()  # signature -> _Entry, least recently used first
        # signature -> static_sizes(args, kwargs) of its latest capture: the sizes of the dims it kept static
        d["_fxamp_static"] = {}
        d["_fxamp_last"] = None
        d["_fxamp_captures"] = 0
        why = (f"torch.fx could not trace the model ({fx_error.short})" if fx_error is not None
               else "frontend='export' without example inputs")
        d["_fxamp_notes"] = [*notes, lead_note or f"{why}: captures with torch.export at the first call, and again for each "
                                          f"new call signature (other keyword arguments, input rank or dtype)"]
        self.training = model.training
        self.__class__ = _with_signature(root)

    # -- what it reports ---------------------------------------------------------------------
    @property
    def _fxamp_info(self) -> ConversionInfo:
        return ConversionInfo(self._fxamp_policy, self._frontend, tuple(self._fxamp_notes),
                              signatures=tuple(e.description for e in self._entries()))

    @property
    def _frontend(self) -> str:
        return self.__dict__.get("_fxamp_frontend", "export")  # (a module pickled before fx captures existed)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The converted graph module the latest call ran (torch.fx's: the current mode's, captured now if need be)."""
        if self._fxamp_last is None and self._frontend == "fx":  # a copy: torch.fx captures without inputs
            self.__dict__["_fxamp_last"] = self._entry(_ANY_CALL, (), {})
        if self._fxamp_last is None:
            raise RuntimeError("this module captures its graph at the first call: call it once (with the inputs "
                               "you will use), then read graph_module")
        return self._fxamp_last.gm

    @property
    def graph(self) -> fx.Graph:
        """The graph the latest call ran.  Before the first call there is none: torch.fx's error, when
        torch.fx could not trace the model, is raised again (what ``convert`` raised before it could
        wait for the inputs)."""
        if self._fxamp_last is None and self._fxamp_fx_error is not None:
            e = self._fxamp_fx_error
            raise TraceError(f"{e} (this module captures with torch.export at its first call: call it once, "
                             f"then read its graph)", short=e.short, module_path=e.module_path,
                             original=e.original) from e
        return self.graph_module.graph

    @property
    def code(self) -> str:
        """The Python code of the graph the latest call ran."""
        return self.graph_module.code

    def graph_modules(self) -> List[fx.GraphModule]:
        """Every cached converted graph module, in the order they were captured."""
        return [e.gm for e in self._entries()]

    def _entries(self) -> List[_Entry]:
        return sorted(self._fxamp_cache.values(), key=lambda e: e.number)

    @property
    def _fxamp_weight_cache(self) -> "_WeightCaches":
        """What ``fxamp.conversion.convert.clear_cast_cache`` clears: every capture's cache of low-precision weights."""
        return _WeightCaches(self)

    # -- calling -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph captured for this call's signature, capturing it first if there is none.

        Each instance's class shows the original ``forward``'s signature (:func:`_with_signature`)."""
        return self._fxamp_forward(*args, **kwargs)

    def _fxamp_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._frontend == "fx":  # a graph per mode and None pattern takes every call, as the user wrote it
            return self._run(self._key(args, kwargs), args, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        base = self._key(args, kwargs)
        variant = 0
        while True:
            # a capture's dynamic dims hold only in the range its branches allow (``x.shape[0] > 2``):
            # a call outside it tries the next capture of the signature, or captures one for its range
            key = base if variant == 0 else (base, "range", variant)
            try:
                return self._run(key, args, kwargs)
            except RuntimeError as exc:  # an input check, a pre-hook: nothing of forward ran
                if not _outside_range(exc):
                    raise
            variant += 1

    def _entry(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> _Entry:
        """The graph cached for ``key`` and the current mode (or for both modes), captured first if there is none."""
        cache = self._fxamp_cache
        entry_key = (key, None) if (key, None) in cache else (key, self.training)
        entry = cache.get(entry_key)
        if entry is None:
            return self._capture(key, args, kwargs)
        cache.move_to_end(entry_key)
        return entry

    def _run(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        entry = self._entry(key, args, kwargs)
        self.__dict__["_fxamp_last"] = entry
        gm = entry.gm
        check_values(self, root_values(gm))  # (the root's attributes: a user sets them on this module)
        gm.training = self.training
        for m in entry.own_modules:
            m.training = self.training
        if self._parameters or self._buffers:  # root-level tensors: the same objects as ours
            gm._parameters.update(self._parameters)
            gm._buffers.update(self._buffers)
        return gm(*args, **kwargs)

    def _key(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The cache key of a call: its signature, and the sizes of the dims its capture kept static."""
        if self._frontend == "fx":
            pattern = none_pattern(self.__dict__.get("_fxamp_optional", ()), args, kwargs)
            return (_ANY_CALL, pattern) if pattern else _ANY_CALL
        # dynamic_shapes given: their ranges decide which sizes a capture takes (torch's check and fxamp's, which
        # refuses 0/1 where a range starts at 2, and the call then captures again), not a 0/1 in the key: a
        # capture from a size-1 call under a dim asked dynamic from 1 fails ("specialized it to be a constant")
        key = _signature(args, kwargs, zero_one=self.__dict__.get("_fxamp_dynamic_shapes") is None)
        # setdefault: a module pickled before this table existed has none
        static_sizes = self.__dict__.setdefault("_fxamp_static", {}).get(key)
        return key if static_sizes is None else (key, static_sizes(args, kwargs))

    def _learn_static(self, gm: fx.GraphModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Remember which dims this capture kept static (torch.export fixed them, or dynamic= asked it),
        and return the call's key with their sizes: another size of one of them captures again."""
        static_sizes = gm.meta.get(STATIC_SIZES)
        if static_sizes is not None and static_sizes(args, kwargs):
            zero_one = self.__dict__.get("_fxamp_dynamic_shapes") is None
            self.__dict__.setdefault("_fxamp_static", {})[_signature(args, kwargs, zero_one)] = static_sizes
        return self._key(args, kwargs)

    def _capture(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> _Entry:
        root = self._fxamp_root
        root.training = self.training
        fx_graph = self._frontend == "fx"
        none = key[1] if fx_graph and isinstance(key, tuple) else ()  # the inputs this graph traces as None
        with float32_for_capture(root, self._fxamp_stored_low) as restore, torch.enable_grad():
            if fx_graph:  # this mode's (and None pattern's) graph: torch.fx needs no inputs
                captured = capture(root, frontend="fx", leaf_modules=self._fxamp_leaf_modules, graph_per_mode=True,
                                   none_inputs=none)
            else:
                captured = capture(root, frontend="export", example_inputs=args, example_kwargs=kwargs,
                                   dynamic=self._fxamp_options.dynamic, fx_error=self._fxamp_fx_error,
                                   dynamic_shapes=self.__dict__.get("_fxamp_dynamic_shapes"),
                                   graph_per_mode=True, at_call=True)
            restore.also(captured.graph_module)
        if fx_graph and not none:  # (another mode's graph may compute with another optional input)
            self.__dict__["_fxamp_optional"] = tuple(dict.fromkeys(
                (*self.__dict__.get("_fxamp_optional", ()), *optional_inputs(captured.graph_module))))
        learned = key if fx_graph else self._learn_static(captured.graph_module, args, kwargs)
        key = learned if not (isinstance(key, tuple) and len(key) == 3 and key[1] == "range") else (
            learned, "range", key[2])  # another range of one signature: kept beside the first capture
        description = self._describe(args, kwargs, captured.graph_module, none)
        where = f"with torch.fx at this mode's first use {description}" if fx_graph else \
            f"at a call with {description}"
        gm = rewrite_captured(captured, self._fxamp_policy, self._fxamp_options, storage="keep",
                              notes=[f"captured {where}; parameter storage "
                                     f"predicted from the module tree (fxamp.conversion.lazy.LazyConverted)"])
        return self._store(key, description, captured.only_mode, gm)

    def _describe(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], gm: fx.GraphModule,
                  none: Tuple[str, ...] = ()) -> str:
        if self._frontend == "fx":  # a torch.fx graph's inputs are forward's parameters
            return "(any arguments)" if not none else f"(any arguments, {', '.join(none)} None)"
        return _describe(self._fxamp_root, args, kwargs, _static(gm, args, kwargs))

    def adopt_capture(self, captured: Captured, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Cache a capture made from ``args``/``kwargs`` before this module existed (``convert`` when the
        two modes capture different graphs: with example inputs, or torch.fx's with none), as if a call had made it.

        ``captured`` must have been made from this module's original, with float32 parameters.
        """
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        gm = captured.graph_module
        gm._parameters.update(self._parameters)  # root-level tensors: the ones in their storage dtypes
        gm._buffers.update(self._buffers)
        description = self._describe(args, kwargs, gm)
        if self._frontend == "fx":  # torch.fx's graph, every optional input given
            self.__dict__["_fxamp_optional"] = optional_inputs(gm)
            key = _ANY_CALL
        else:
            key = self._learn_static(gm, args, kwargs)
        where = "with torch.fx" if self._frontend == "fx" else f"from the example inputs {description}"
        gm = rewrite_captured(captured, self._fxamp_policy, self._fxamp_options, storage="keep",
                              notes=[f"captured at convert time {where}; parameter "
                                     f"storage predicted from the module tree (fxamp.conversion.lazy.LazyConverted)"])
        self.__dict__["_fxamp_last"] = self._store(key, description, captured.only_mode, gm)

    def _store(self, key: Any, description: str, mode: Optional[bool], gm: fx.GraphModule) -> _Entry:
        """Cache a converted graph for ``key`` (and ``mode`` when it is right in one mode only)."""
        if mode is not None:
            description += f" ({'training' if mode else 'eval'} mode)"
        shared = {id(m) for m in self._modules.values()}
        own = [sub for m in gm._modules.values() if id(m) not in shared for sub in m.modules()]
        self.__dict__["_fxamp_captures"] += 1
        entry = _Entry(gm, description, own, self._fxamp_captures)
        cache = self._fxamp_cache
        notes = self._fxamp_notes
        if len(cache) >= max(1, self.max_signatures):
            _, old = cache.popitem(last=False)
            notes.append(f"evicted the capture for {old.description}: least recently used, and "
                         f"max_signatures={self.max_signatures} are kept")
            logger.info("fxamp: %s", notes[-1])
        cache[(key, mode)] = entry
        notes.append(f"captured {description} (signature {len(cache)} of at most {self.max_signatures})")
        logger.info("fxamp: %s with %s", notes[-1], "torch.fx" if self._frontend == "fx" else "torch.export")
        return entry

    # -- nn.Module plumbing --------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and children as any module; then the original root's own data attributes
        (a Hugging Face ``config``), read-only.  Its methods are not offered: they would run the
        unconverted forward."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            root = self.__dict__.get("_fxamp_root")
            value = root.__dict__.get(name, _MISSING) if root is not None else _MISSING
            if value is not _MISSING and not callable(value):
                return value
            if root is not None and (callable(value) or callable(getattr(type(root), name, None))):
                raise AttributeError(_method_message(type(root), name)) from None
            raise

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(indexing_message(self, index))

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        keep_loaded_float32(self, state_dict, prefix)  # a float32 value loaded is kept for the master
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn: Any, recurse: bool = True) -> "LazyConverted":
        # nn.Module._apply is the one hook behind .to()/.float()/.cuda(); the graphs' own constants and
        # modules live outside the shared tree, so they are reached through their tables here
        policy = self._fxamp_policy
        if policy.enabled:  # before any tensor changes: the stored dtypes are what every capture assumes
            refuse_dtype_change(fn, tuple(dict.fromkeys((torch.float32, policy.params, policy.norms))), str(policy))
        super()._apply(fn, recurse)
        for entry in self._fxamp_cache.values():  # what the graphs own: constants, their modules' tensors
            gm = entry.gm
            for name, b in list(gm._buffers.items()):
                if b is not None and name not in self._buffers:
                    gm._buffers[name] = fn(b)
            for m in gm._modules.values():
                if m in entry.own_modules:
                    m._apply(fn)
        return self

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling and deepcopy drop the captured graphs (graphs from torch.export do not pickle): a
        copy captures again at its first call."""
        state = dict(self.__dict__)
        state["_fxamp_cache"] = collections.OrderedDict()
        state["_fxamp_static"] = {}
        state["_fxamp_last"] = None
        state["_fxamp_notes"] = list(self._fxamp_notes)
        # O2/O3: the float32 values of the low-precision parameters (originals, or masters' values now), which an
        # optimizer built on the copy takes as its masters (fxamp.info.origins_for_copy)
        state["_fxamp_origins"] = origins_for_copy(self.parameters())
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the class is this instance's own (_with_signature), which pickle cannot find by name
        return (_new_lazy, (), self.__getstate__())

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        origins = state.pop("_fxamp_origins", ())
        super().__setstate__(state)
        hold_origins(origins)
        root = self.__dict__["_fxamp_root"]
        self.__class__ = _with_signature(root)
        for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[table] = root.__dict__[table]  # keep the tables shared after unpickling
        watch_for_masters(self.parameters())  # (tensor hooks are not copied with the tensors)

    def extra_repr(self) -> str:
        return (f"policy={self._fxamp_policy}, captures at the first call "
                f"({len(self._fxamp_cache)} of at most {self.max_signatures} signatures cached)")


def _outside_range(exc: BaseException) -> bool:
    """A call a capture's input checks refused for its sizes (nothing of forward ran): fxamp's range check
    (capture/shapes.py), or torch.export's own for what it does not cover (dims related to others), recognised by
    torch's words."""
    text = str(exc)
    return isinstance(exc, OutsideCapturedRange) or (text.startswith("Expected input at ") and
                                                     ".shape[" in text.split(" to be ")[0])  # (not a constant's value)


class RangeFallback(NodeErrors):
    """How a module ``convert`` captured with torch.export from example inputs is called (its ``_wrapped_call``):
    as any converted ``GraphModule`` (:class:`~fxamp.conversion.runtime.NodeErrors`), but a call outside the
    range the capture holds for (a batch of 1 where the example's was 8: torch.export assumed sizes 0 and 1
    away), or with other inputs (``labels`` left out where the example gave them, or the reverse), runs
    ``module``, a :class:`LazyConverted` made on the same parameters and buffers, which captures a graph for that
    call's range or signature (and keeps it: sizes 0, 1 and each other range once, each signature once).
    Ordinary calls pay only the input checks the module had; the exception is the signal.  Copies and pickles
    take ``module`` along."""

    def __init__(self, module: LazyConverted):
        self.module = module

    def __call__(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(gm, *args, **kwargs)
        except (RuntimeError, OtherInputSet) as exc:  # OtherInputSet: labels left out, or given where the example had none
            if not (_outside_range(exc) or isinstance(exc, OtherInputSet)):
                raise
            why = str(exc).split(". What to do")[0].split(". A graph from")[0].split("\n")[0]
            why = (f"the call was outside the range the example inputs' capture holds for ({why})"
                   if _outside_range(exc) else f"the call's inputs are not the example inputs' ({why})")
        return call_fallback(gm, self.module, args, kwargs, lambda entry: (
            f"captured a second graph with torch.export, for {entry.description}, sharing this module's "
            f"parameters: {why}; calls like it run it from now on"))


def call_fallback(gm: fx.GraphModule, lazy: "LazyConverted", args: Tuple[Any, ...], kwargs: Dict[str, Any],
                  note_for: Callable[[Any], str]) -> Any:
    """Run on ``lazy`` (on ``gm``'s tensors) a call ``gm`` cannot take; note each graph it captures on ``gm``."""
    lazy.training = gm.training  # (its own flag: the shared modules' are set by the graphs' mode flags)
    before = lazy._fxamp_captures
    out = lazy(*args, **kwargs)
    if lazy._fxamp_captures != before:  # one note per graph captured, not per call
        note = note_for(lazy._fxamp_last)
        info = conversion_info(gm)
        if info is not None:
            info = dataclasses.replace(info, notes=(*info.notes, note))
            gm.__dict__[INFO_ATTR] = info
            gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
        logger.info("fxamp: %s", note)
    return out


def with_range_fallback(gm: fx.GraphModule, source: nn.Module, policy: Policy, options: ConvertOptions, *,
                        owns_model: bool) -> fx.GraphModule:
    """Give ``gm`` (captured with torch.export from example inputs, no ``dynamic_shapes=``) a
    :class:`RangeFallback` over ``source``, the module it was captured from, re-bound to ``gm``'s tensors."""
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    lazy = LazyConverted(source, policy, options, owns_model=owns_model, tensors=tensors,
                         lead_note="captures a call outside the range of the module converted from example inputs")
    gm._wrapped_call = RangeFallback(lazy)
    gm.meta.setdefault("_user_preserved_attributes", {})["_wrapped_call"] = gm._wrapped_call
    return gm


def range_fallback(gm: nn.Module) -> Optional[LazyConverted]:
    """The :class:`LazyConverted` that captures the calls of ``gm`` (a module ``convert`` captured with
    torch.export from example inputs) outside its captured range, on ``gm``'s parameters; None if it has none."""
    call = gm.__dict__.get("_wrapped_call")
    return call.module if isinstance(call, RangeFallback) else None


def _method_message(cls: type, name: str) -> str:
    """Why a converted module has no ``name`` although the original ``cls`` has that method, and what to do."""
    what = (f"'{name}' is a method of the original {cls.__name__}, which fxamp.conversion.lazy.LazyConverted does not offer: "
            "it would run the original, unconverted forward, or call this module with inputs no capture "
            "can take")
    original = ("Call it on the original model: for O0/O1 it shares this module's parameters; for O2/O3 "
                "fxamp.convert worked on a copy, so load the trained weights into it first: "
                "model.load_state_dict(opt.fp32_state_dict(amp)) (the float32 masters of a "
                "MixedPrecisionOptimizer) or model.load_state_dict(amp.state_dict()) (the same keys)")
    if name == "generate":
        return (f"{what} (generation passes a key/value cache object to every forward, which torch.export "
                f"cannot take as an input).  {original}, and generate under torch.autocast(device_type, "
                "dtype) or after model.to(dtype).  fxamp converts what runs one forward per batch: "
                "training, scoring, evaluation")
    return f"{what}.  {original}"


class _WeightCaches:
    """``clear()`` every capture's low-precision weight cache."""

    def __init__(self, module: LazyConverted):
        self.module = module

    def clear(self) -> None:
        for gm in self.module.graph_modules():
            cache = getattr(gm, CACHE_NAME, None)
            if cache is not None:
                cache.clear()


def _detached(e: Optional[TraceError]) -> Optional[TraceError]:
    """A copy of ``e`` (and of the error it wraps) that holds no traceback.

    A traceback holds its frames, and their locals: ``convert``'s ``model`` among them, so a stored
    error would keep the user's original model (gigabytes) alive after ``del model``.  The text,
    ``short`` and ``module_path`` are all a later message needs.
    """
    if e is None:
        return None
    original = e.original
    if original is not None:
        # a fresh exception of the same message: the caught one's traceback, cause and context
        # (torch.fx's frames, holding the traced module) are dropped with it
        try:
            original = type(original)(*original.args)
        except Exception:  # a constructor that does not take its own args back
            original = RuntimeError(f"{type(e.original).__name__}: {e.original}")
    return TraceError(str(e), short=e.short, module_path=e.module_path, original=original)


# ---------------------------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------------------------


def _leaf_key(leaf: Any, zero_one: bool = True) -> Any:
    if isinstance(leaf, torch.Tensor):
        # export specialises sizes 0 and 1: a call with such a size gets its own capture
        return ("tensor", leaf.dtype, leaf.device.type, tuple(min(int(s), 2 if zero_one else 0) for s in leaf.shape))
    if isinstance(leaf, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return (type(leaf).__name__, leaf)
    return (type(leaf).__name__, repr(leaf))


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any], zero_one: bool = True) -> Any:
    """What decides the graph: the argument structure, tensor dtypes, ranks, 0/1 sizes (unless ``zero_one`` is
    False: every size alike), other values."""
    Tensor = torch.Tensor
    top = 2 if zero_one else 0
    if all(type(a) is Tensor for a in args) and all(type(v) is Tensor for v in kwargs.values()):
        # the common call, plain tensors only: no pytree (this runs at every call)
        return (len(args), tuple(sorted(kwargs)),
                tuple((t.dtype, t.device.type, tuple(s if s < top else top for s in t.shape))
                      for t in (*args, *(kwargs[k] for k in sorted(kwargs)))))
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return (str(spec), tuple(_leaf_key(leaf, zero_one) for leaf in leaves))


def _static(gm: fx.GraphModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Dict[int, int]]:
    """Input name -> {dim: size} for the dims this capture kept static (a new size captures again)."""
    static_sizes = gm.meta.get(STATIC_SIZES)
    out: Dict[str, Dict[int, int]] = {}
    for name, dim, size in static_sizes(args, kwargs) if static_sizes is not None else ():
        out.setdefault(name, {})[dim] = size
    return out


def _describe_value(value: Any, static: Optional[Dict[int, int]] = None) -> str:
    if isinstance(value, torch.Tensor):
        static = static or {}
        return f"{short_name(value.dtype)}[" + ",".join(
            "*" if s > 1 and i not in static else str(s) for i, s in enumerate(value.shape)) + "]"
    leaves = pytree.tree_leaves(value)
    if leaves and any(isinstance(leaf, torch.Tensor) for leaf in leaves) or len(leaves) > 1:
        return type(value).__name__ + "(" + ", ".join(_describe_value(v) for v in leaves) + ")"
    return repr(value)


def _describe(root: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
              static: Optional[Dict[str, Dict[int, int]]] = None) -> str:
    """``(input_ids=i64[*,*], labels=i64[*,*])``: the arguments by name, * for a dynamic size (``static``:
    input name -> {dim: size} of the dims the capture kept static, written as their sizes)."""
    static = static or {}
    try:
        signature = inspect.signature(root.forward)
        bound = signature.bind(*args, **kwargs).arguments
        named = []
        for name, value in bound.items():
            param = signature.parameters[name]
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                named.extend(value.items())
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                named.extend((f"*{name}[{i}]", v) for i, v in enumerate(value))
            else:
                named.append((name, value))
    except (TypeError, ValueError):
        named = [(f"args[{i}]", v) for i, v in enumerate(args)] + list(kwargs.items())
    return "(" + ", ".join(f"{name}={_describe_value(v, static.get(name))}" for name, v in named) + ")"

