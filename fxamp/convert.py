"""``convert()``: trace → classify → rewrite, returning a plain ``GraphModule`` that runs mixed precision."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import Captured, LeafSpec, capture
from .classify import ModuleOverrides, annotate
from .errors import TraceError
from .op_lists import DEFAULT_OP_LISTS, Category, OpEntry, OpKey, OpLists
from .policy import Policy, resolve_policy
from .rewrite import CACHE_NAME, cast_kept_storage, insert_casts, lower_attribute_reads, store_params

__all__ = ["convert", "rewrite_captured", "policy_of", "clear_cast_cache", "ConversionInfo", "conversion_info"]


@dataclass(frozen=True)
class ConversionInfo:
    """What ``convert`` did; kept on the converted module (through deepcopy and pickling)."""

    policy: Policy
    frontend: str  # "fx" or "export"
    notes: Tuple[str, ...] = ()
    # a module that captures at its first call (fxamp.LazyConverted): the call signatures it holds a
    # graph for, in the order captured; None for a module captured by convert() itself
    signatures: Optional[Tuple[str, ...]] = None


def convert(
    model: nn.Module,
    policy: Union[str, Policy] = "O1",
    *,
    dtype: Union[str, torch.dtype, None] = None,
    keep_norms_fp32: bool = False,
    overrides: Optional[Mapping[OpKey, Union[str, Category, OpEntry]]] = None,
    module_overrides: Optional[ModuleOverrides] = None,
    op_lists: Optional[OpLists] = None,
    leaf_modules: Sequence[LeafSpec] = (),
    example_inputs: Optional[Tuple[Any, ...]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    frontend: str = "auto",
    dynamic: bool = True,
    weight_cache: bool = True,
) -> nn.Module:
    """Return a copy of ``model`` whose forward runs mixed precision through explicit casts.

    policy:           ``"O0"``..``"O3"``, a ``"params=...,compute=..."`` string, or a :class:`Policy`.
    dtype:            the low-precision dtype for a preset (float16 by default, or bfloat16).
    keep_norms_fp32:  O3 only: keep normalisation layers in float32 (apex's keep_batchnorm_fp32).
    overrides:        change op categories: ``{torch.exp: "neutral", nn.GELU: "unsafe", "Tensor.sum": ...}``.
    module_overrides: change every op under a module path: ``{"encoder.layers.3": "unsafe"}``.
    op_lists:         replace the default op lists altogether (``overrides`` apply on top).
    leaf_modules:     module classes or paths that torch.fx must not trace into.
    example_inputs / example_kwargs: let fxamp fall back to ``torch.export`` (or force it with
                      ``frontend="export"``); ``dynamic`` keeps batch and sequence sizes free.
    weight_cache:     reuse low-precision weight copies across no-grad calls until a weight changes.

    Returns a ``GraphModule``; or, when torch.fx cannot trace ``model`` and no example inputs were
    given (or ``frontend="export"`` without them), a :class:`fxamp.LazyConverted` that captures with
    ``torch.export`` at its first call and again for each new call signature; its parameters exist
    at once, in their storage dtypes, so an optimizer can be built before the first call.

    The model passed in is never changed.  O0/O1 modules share its parameters (they stay float32);
    O2/O3 modules own low-precision copies, under the same ``state_dict`` keys.
    """
    pol = resolve_policy(policy, dtype, keep_norms_fp32=keep_norms_fp32)
    lists = op_lists if op_lists is not None else DEFAULT_OP_LISTS
    if not isinstance(lists, OpLists):
        raise TypeError(f"op_lists must be an fxamp.OpLists, not {type(lists).__name__}")
    if overrides:
        lists = lists.with_overrides(overrides)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxamp.convert takes an nn.Module, not {type(model).__name__}")
    from .lazy import LazyConverted  # lazy.py builds on this module's rewrite_captured

    has_inputs = example_inputs is not None or example_kwargs is not None
    changes_storage = pol.params != torch.float32 or pol.norms != torch.float32
    source = copy.deepcopy(model) if changes_storage else model
    lazy_options = dict(op_lists=lists, module_overrides=module_overrides, dynamic=dynamic, weight_cache=weight_cache)
    if frontend == "export" and not has_inputs:
        return LazyConverted(source, pol, owns_model=changes_storage, **lazy_options)
    try:
        captured = capture(source, frontend=frontend, leaf_modules=leaf_modules, example_inputs=example_inputs,
                           example_kwargs=example_kwargs, dynamic=dynamic)
    except TraceError as e:
        if frontend != "auto" or has_inputs or leaf_modules:
            raise  # export was tried already, or cannot help (leaf_modules)
        return LazyConverted(source, pol, owns_model=changes_storage, fx_error=e, **lazy_options)
    return rewrite_captured(captured, pol, lists, module_overrides, weight_cache=weight_cache)


def rewrite_captured(captured: Captured, policy: Policy, op_lists: OpLists,
                     module_overrides: Optional[ModuleOverrides] = None, *, weight_cache: bool = True,
                     storage: str = "decide", notes: Sequence[str] = ()) -> fx.GraphModule:
    """Classify and rewrite a captured graph in place; returns its graph module, its ConversionInfo attached.

    storage: ``"decide"``: O2/O3 re-bind parameters to the dtype their consumers run in
    (``store_params``); ``"keep"``: the parameters already have their dtypes (a lazily capturing
    module made them before any graph existed), and consumers that want another dtype get a cast.
    notes: put before the capture's own notes.
    """
    if storage not in ("decide", "keep"):
        raise ValueError(f"storage={storage!r} is not 'decide' or 'keep'")
    gm = captured.graph_module
    decisions = annotate(gm, policy, op_lists, module_overrides)
    if policy.enabled:
        if storage == "decide":
            store_params(gm, decisions, policy)
        else:
            cast_kept_storage(gm, decisions, policy)
        lower_attribute_reads(gm)
        insert_casts(gm, decisions, policy, weight_cache=weight_cache)
        gm.graph.lint()
        gm.recompile()
    info = ConversionInfo(policy, captured.frontend, tuple(notes) + tuple(captured.notes))
    # pickling keeps instance attributes; GraphModule's deepcopy keeps the ones listed in meta
    setattr(gm, INFO_ATTR, info)
    gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
    return gm


INFO_ATTR = "_fxamp_info"


def conversion_info(module: nn.Module) -> Optional[ConversionInfo]:
    """How fxamp converted ``module`` (policy, front end, notes), or None if it did not."""
    info = getattr(module, INFO_ATTR, None)
    return info if isinstance(info, ConversionInfo) else None


def policy_of(module: nn.Module) -> Optional[Policy]:
    """The policy a module was converted with, or None if fxamp did not convert it."""
    info = conversion_info(module)
    return None if info is None else info.policy


def clear_cast_cache(module: nn.Module) -> None:
    """Drop cached low-precision weight copies (needed only after writing weights through ``.data``)."""
    cache = getattr(module, CACHE_NAME, None)
    if cache is not None:
        cache.clear()
