"""``convert()``: trace → classify → rewrite, returning a plain ``GraphModule`` that runs mixed precision."""

from __future__ import annotations

import copy
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .classify import ModuleOverrides, annotate
from .info import INFO_ATTR, ConversionInfo, conversion_info, policy_of
from .op_lists import DEFAULT_OP_LISTS, Category, OpEntry, OpKey, OpLists
from .policy import Policy, resolve_policy
from .rewrite import CACHE_NAME, insert_casts, lower_attribute_reads, store_params
from .capture import LeafSpec, capture

__all__ = ["convert", "policy_of", "clear_cast_cache", "ConversionInfo", "conversion_info"]


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
) -> fx.GraphModule:
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
    changes_storage = pol.params != torch.float32 or pol.norms != torch.float32
    source = copy.deepcopy(model) if changes_storage else model
    captured = capture(source, frontend=frontend, leaf_modules=leaf_modules, example_inputs=example_inputs,
                       example_kwargs=example_kwargs, dynamic=dynamic)
    gm = captured.graph_module
    decisions = annotate(gm, pol, lists, module_overrides)
    if pol.enabled:
        store_params(gm, decisions, pol)
        lower_attribute_reads(gm)
        insert_casts(gm, decisions, pol, weight_cache=weight_cache)
        from .attention import low_precision_attention; low_precision_attention(gm)  # noqa: E702 (issue 13: CPU SDPA+dropout saves fp32 probs)
        gm.graph.lint()
        gm.recompile()
    info = ConversionInfo(pol, captured.frontend, tuple(captured.notes))
    # pickling keeps instance attributes; GraphModule's deepcopy keeps the ones listed in meta
    setattr(gm, INFO_ATTR, info)
    gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
    return gm


def clear_cast_cache(module: nn.Module) -> None:
    """Drop cached low-precision weight copies (needed only after writing weights through ``.data``)."""
    cache = getattr(module, CACHE_NAME, None)
    if cache is not None:
        cache.clear()
