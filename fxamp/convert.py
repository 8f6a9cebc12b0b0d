"""``convert()``: trace → classify → rewrite, returning a plain ``GraphModule`` that runs mixed precision."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .classify import ModuleOverrides, annotate
from .debug import add_overflow_checks
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
    dynamic: Union[bool, str] = True,
    dynamic_shapes: Any = None,
    weight_cache: bool = True,
    debug_overflow: Union[bool, str] = False,
) -> fx.GraphModule:
    """Return a copy of ``model`` whose forward runs mixed precision through explicit casts.

    policy:           ``"O0"``..``"O3"``, a ``"params=...,compute=..."`` string, or a :class:`Policy`.
    dtype:            the low-precision dtype for a preset (float16 by default, or bfloat16).
    keep_norms_fp32:  O3 only: keep normalisation layers in float32 (apex's keep_batchnorm_fp32).
    overrides:        change op categories: ``{torch.exp: "neutral", nn.GELU: "unsafe", "Tensor.sum": ...}``.
    module_overrides: change every op under a module path: ``{"encoder.layers.3": "unsafe"}``.
    op_lists:         replace the default op lists altogether (``overrides`` apply on top).
    leaf_modules:     module classes or paths that torch.fx must not trace into (a float32 leaf holding
                      more than 10% of the parameters is noted and warned about).
    example_inputs / example_kwargs: let fxamp fall back to ``torch.export`` (or force it with
                      ``frontend="export"``).
    dynamic:          export only: True keeps batch and sequence sizes free (image sizes stay static),
                      ``"all"`` every dim, False none; ``dynamic_shapes`` goes to ``torch.export`` as given.
    weight_cache:     reuse low-precision weight copies across no-grad calls until a weight changes.
    debug_overflow:   True: record the first node whose output (forward) or gradient (backward) has
                      inf/NaN (``fxamp.overflow_info(amp)``); ``"raise"``: raise there.  See ``fxamp.debug``.

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
                       example_kwargs=example_kwargs, dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    gm = captured.graph_module
    decisions = annotate(gm, pol, lists, module_overrides)
    if pol.enabled:
        store_params(gm, decisions, pol)
        lower_attribute_reads(gm)
        insert_casts(gm, decisions, pol, weight_cache=weight_cache)
        gm.graph.lint()
        gm.recompile()
    if debug_overflow:
        add_overflow_checks(gm, raise_on_overflow=debug_overflow == "raise")
    leaf_notes = _float32_leaves(gm, decisions) if pol.enabled else []
    for note in leaf_notes:
        warnings.warn(f"fxamp: {note}", stacklevel=2)
    info = ConversionInfo(pol, captured.frontend, tuple(captured.notes) + tuple(leaf_notes))
    # pickling keeps instance attributes; GraphModule's deepcopy keeps the ones listed in meta
    setattr(gm, INFO_ATTR, info)
    gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
    return gm


#: a float32 leaf holding more of the parameters than this is reported and warned about
FLOAT32_LEAF_SHARE = 0.10


def _float32_leaves(gm: fx.GraphModule, decisions: Mapping[fx.Node, Any]) -> List[str]:
    """Opaque leaf modules that run in float32 with a large share of the model's work.

    No inputs exist at convert time, so the share of FLOPs is estimated by the share of parameters;
    norms (float32 by design) and embedding lookups (parameters without FLOPs) are left out.
    """
    total = sum(p.numel() for p in gm.parameters())
    notes = []
    for node, d in decisions.items():
        if node.op != "call_module" or d.compute != torch.float32 or d.norm:
            continue
        m = gm.get_submodule(str(node.target))
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        share = sum(p.numel() for p in m.parameters()) / total if total else 0.0
        if share > FLOAT32_LEAF_SHARE:
            notes.append(f"leaf module {node.target!r} ({type(m).__name__}) runs whole in float32 and holds "
                         f"{share:.0%} of the parameters, so about that share of the work gets no speed-up: "
                         f"let torch.fx trace into it (drop it from leaf_modules), override its category "
                         f"(overrides={{{type(m).__name__}: 'safe'}} if its math is safe in low precision), "
                         f"or use frontend='export'")
    return notes


def clear_cast_cache(module: nn.Module) -> None:
    """Drop cached low-precision weight copies (needed only after writing weights through ``.data``)."""
    cache = getattr(module, CACHE_NAME, None)
    if cache is not None:
        cache.clear()
