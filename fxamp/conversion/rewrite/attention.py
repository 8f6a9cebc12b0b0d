"""Attention with dropout that saves low-precision probabilities (a pass over a converted graph).

PyTorch's CPU ``scaled_dot_product_attention`` has no fused kernel for dropout: it takes the math
path, which computes and saves the attention probabilities in float32 whatever its inputs' dtype
(``nn.TransformerEncoderLayer`` with dropout 0.1 under autocast or fxamp saves as much for its
attention as in float32).  :func:`low_precision_attention` replaces each SDPA node whose dropout
may be active, and whose inputs fxamp casts to a low-precision dtype, by
:func:`fxamp.conversion.runtime.attention`: ``F.scaled_dot_product_attention`` itself when dropout is off or
the tensors are not on CPU (or are float32), else ``softmax(q·scale @ kᵀ + mask)`` in the inputs'
dtype (the softmax kernel accumulates in float32) → dropout → ``@ v``, which saves the
probabilities in low precision.  ``nn.MultiheadAttention`` leaf modules (the default front end
keeps them whole, e.g. inside ``nn.TransformerEncoderLayer``) whose dropout is on and which run in
low precision call :func:`fxamp.conversion.runtime.multi_head_attention` instead, which does the same in the
middle of the module's own steps.
"""

from __future__ import annotations

from typing import List

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ...dtypes import LOW
from ..graph import DECISION, fetch_attr
from ..passes import Conversion, Pass, Stage
from ..runtime import attention, call_module_cast, multi_head_attention

__all__ = ["low_precision_attention", "ATTENTION"]

_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def low_precision_attention(gm: fx.GraphModule) -> int:
    """Route SDPA nodes with (possibly) active dropout and low-precision inputs through ``runtime.attention``.

    Run after the casts are inserted, before the graph is recompiled; returns how many nodes were replaced.
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        replaced += _multi_head_attention(gm, node)
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        bound = dict(zip(_ARGS, node.args))
        bound.update(node.kwargs)
        dropout_p = bound.get("dropout_p", 0.0)
        if isinstance(dropout_p, (int, float)) and dropout_p == 0.0:
            continue  # no dropout: the fused kernels save no probabilities at all
        if bound.get("enable_gqa", False) is not False:
            continue
        if getattr(node.meta.get(DECISION), "compute", None) not in LOW:
            continue  # fxamp does not run this attention in low precision
        args = tuple(bound.get(k, d) for k, d in zip(_ARGS, (None, None, None, None, 0.0, False)))
        node.target = attention
        node.args = args + (bound.get("scale"),)
        node.kwargs = {}
        replaced += 1
    return replaced  # the pipeline lints and recompiles once, after its last pass


def _multi_head_attention(gm: fx.GraphModule, node: fx.Node) -> int:
    """Route an ``nn.MultiheadAttention`` call with dropout, run in low precision, through
    ``runtime.multi_head_attention``: the module called as is (O2/O3, its weights stored low), or
    through ``call_module_cast`` (O1).  Returns 1 if the node was changed."""
    compute = getattr(node.meta.get(DECISION), "compute", None)
    if compute not in LOW:
        return 0
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, nn.MultiheadAttention) or module.dropout == 0.0:
            return 0
        with gm.graph.inserting_before(node):
            owner = gm.graph.get_attr(str(node.target))
        node.op, node.target = "call_function", multi_head_attention
        node.args = (owner, compute) + tuple(node.args)
        return 1
    if node.op == "call_function" and node.target is call_module_cast and node.args:
        owner = node.args[0]
        module = fetch_attr(gm, str(owner.target)) if isinstance(owner, fx.Node) and owner.op == "get_attr" else None
        if not isinstance(module, nn.MultiheadAttention) or module.dropout == 0.0:
            return 0
        node.target = multi_head_attention  # the same arguments: (module, dtype, *args, **kwargs)
        return 1
    return 0


def _attention(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    low_precision_attention(gm)  # CPU SDPA with dropout would save float32 probabilities
    return []


ATTENTION = Pass("attention", Stage.REWRITE, _attention, applies=lambda c: c.policy.enabled)
