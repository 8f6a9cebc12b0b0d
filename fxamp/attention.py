"""Attention with dropout that saves low-precision probabilities (a pass over a converted graph).

PyTorch's CPU ``scaled_dot_product_attention`` has no fused kernel for dropout: it takes the math
path, which computes and saves the attention probabilities in float32 whatever its inputs' dtype
(``nn.TransformerEncoderLayer`` with dropout 0.1 under autocast or fxamp saves as much for its
attention as in float32).  :func:`low_precision_attention` replaces each SDPA node whose dropout
may be active, and whose inputs fxamp casts to a low-precision dtype, by
:func:`fxamp.runtime.attention`: ``F.scaled_dot_product_attention`` itself when dropout is off or
the tensors are not on CPU (or are float32), else ``softmax(q·scale @ kᵀ + mask)`` in the inputs'
dtype (the softmax kernel accumulates in float32) → dropout → ``@ v``, which saves the
probabilities in low precision.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .dtypes import LOW
from .graph import DECISION
from .runtime import attention

__all__ = ["low_precision_attention"]

_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def low_precision_attention(gm: fx.GraphModule) -> int:
    """Route SDPA nodes with (possibly) active dropout and low-precision inputs through ``runtime.attention``.

    Run after the casts are inserted, before the graph is recompiled; returns how many nodes were replaced.
    """
    replaced = 0
    for node in list(gm.graph.nodes):
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
    return replaced  # the caller (pipeline.rewrite_captured) lints and recompiles once
