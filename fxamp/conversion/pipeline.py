"""classify → rewrite over a captured graph: what ``convert()`` and the lazily capturing module share.

``rewrite_captured`` annotates every node with its :class:`~fxamp.conversion.graph.Decision`, chooses (or
keeps) parameter storage, lowers parameter reads, inserts the casts, optionally the overflow
checks, and attaches the :class:`~fxamp.info.ConversionInfo`.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .attention import low_precision_attention
from .capture import Captured
from .checkpointing import keep_checkpoints
from .classify import annotate, unused_overrides
from .debug import add_overflow_checks
from .float8 import float8_notes, rewrite_float8
from .islands import recompute_islands
from ..info import INFO_ATTR, ConversionInfo
from .options import ConvertOptions, DebugOverflow
from ..policy import Policy
from .rewrite import cast_kept_storage, insert_casts, lower_attribute_reads, store_params
from .runtime import as_converted, name_failing_nodes

__all__ = ["rewrite_captured", "FLOAT32_LEAF_SHARE"]


def rewrite_captured(captured: Captured, policy: Policy, options: ConvertOptions = ConvertOptions(), *,
                     storage: str = "decide", notes: Sequence[str] = ()) -> fx.GraphModule:
    """Classify and rewrite a captured graph in place; returns its graph module, its ConversionInfo attached.

    options: the op lists, overrides, weight cache, overflow checks (``options.debug_overflow``:
    the checks of :mod:`fxamp.conversion.debug`) and recomputed float32 islands (``options.recompute_islands``:
    :mod:`fxamp.conversion.islands`); ``options.dynamic`` was the capture's business.
    storage: ``"decide"``: O2/O3 re-bind parameters to the dtype their consumers run in
    (``store_params``); ``"keep"``: the parameters already have their dtypes (a lazily capturing
    module made them before any graph existed), and consumers that want another dtype get a cast.
    notes: put before the capture's own notes.
    """
    if storage not in ("decide", "keep"):
        raise ValueError(f"storage={storage!r} is not 'decide' or 'keep'")
    if not isinstance(options, ConvertOptions):
        raise TypeError(f"options must be a ConvertOptions, not {type(options).__name__}")
    gm = as_converted(captured.graph_module)  # (its copies keep what conversion sets up below)
    decisions = annotate(gm, policy, options)
    island_notes: List[str] = []
    if policy.enabled:
        if storage == "decide":
            store_params(gm, decisions, policy)
        else:
            cast_kept_storage(gm, decisions, policy)
        lower_attribute_reads(gm)
        insert_casts(gm, decisions, policy, weight_cache=options.weight_cache)
        if policy.float8 is not None:
            rewrite_float8(gm, decisions, policy.float8)
        low_precision_attention(gm)  # CPU SDPA with dropout would save float32 probabilities
        if options.debug_overflow is DebugOverflow.OFF:  # (the checks watch every op's gradient: run as written)
            island_notes = recompute_islands(gm, options)
        gm.graph.lint()
        gm.recompile()
    if options.debug_overflow is not DebugOverflow.OFF:
        add_overflow_checks(gm, raise_on_overflow=options.debug_overflow is DebugOverflow.RAISE)
    leaf_notes = (_float32_leaves(gm, decisions) if policy.enabled else []) + unused_overrides(gm, options)
    notes = tuple(notes) + tuple(float8_notes(decisions, policy.float8))
    for note in leaf_notes:
        warnings.warn(f"fxamp: {note}", stacklevel=3)
    # after the casts (and overflow checks) exist: each checkpointed block takes its casts along
    leaf_notes += keep_checkpoints(gm, captured.frontend)
    info = ConversionInfo(policy, captured.frontend,
                          tuple(notes) + tuple(captured.notes) + tuple(leaf_notes) + tuple(island_notes))
    # pickling keeps instance attributes; GraphModule's deepcopy keeps the ones listed in meta
    setattr(gm, INFO_ATTR, info)
    gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
    name_failing_nodes(gm)  # torch's message, the node named; not torch.fx's dump of the generated code
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


