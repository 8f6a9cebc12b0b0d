"""Attention with dropout that saves low-precision probabilities: what ``rewrite/attention.py`` routes SDPA to.

PyTorch's CPU ``scaled_dot_product_attention`` with dropout takes its math path, which saves the
attention probabilities in float32 whatever the inputs' dtype; :func:`attention` runs softmax →
dropout → matmul in the inputs' dtype instead, and :func:`multi_head_attention` does the same
inside ``nn.MultiheadAttention``'s own steps.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...dtypes import LOW
from .casts import WeightCastCache, call_module_cast, cast

__all__ = ["attention", "multi_head_attention"]


try:
    _SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
except (AttributeError, RuntimeError):  # pragma: no cover (older torch)
    _SAFE_SOFTMAX = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Any = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that saves low-precision probabilities when dropout is on (CPU).

    PyTorch's CPU SDPA with dropout takes its math path, which computes and saves the probabilities
    in float32.  Here, on CPU with float16/bfloat16 inputs and dropout on, attention is computed in
    the inputs' dtype: ``softmax(q·scale @ kᵀ + mask)`` (the softmax kernel accumulates in float32)
    → dropout → ``@ v``.  Otherwise (no dropout, float32, another device) it is SDPA itself.
    Placed by :func:`fxamp.conversion.rewrite.attention.low_precision_attention`.
    """
    if (dropout_p == 0.0 or q.device.type != "cpu" or q.dtype not in LOW
            or k.dtype != q.dtype or v.dtype != q.dtype):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    L, S = q.size(-2), k.size(-2)
    s = (1.0 / math.sqrt(q.size(-1))) if scale is None else scale
    scores = (q * s) @ k.transpose(-2, -1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    # a fully masked row gives zeros, not NaN, as SDPA's math path (its _safe_softmax)
    # (the aten op, not torch._safe_softmax: torch.compile traces the former, breaks the graph on the latter)
    probs = _SAFE_SOFTMAX(scores, -1) if _SAFE_SOFTMAX is not None else torch.softmax(scores, dim=-1)
    return F.dropout(probs, dropout_p, training=True) @ v


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")
_MHA_DEFAULTS = (None, None, None, None, True, None, True, False)


def multi_head_attention(module: nn.MultiheadAttention, dtype: torch.dtype, *args: Any,
                         _fxamp_cache: Optional[Tuple[WeightCastCache, str]] = None, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` in ``dtype``, saving low-precision probabilities when dropout is on (CPU).

    ``nn.MultiheadAttention`` in training with dropout calls SDPA's CPU math path, which saves its
    probabilities in float32.  For the common form (batched inputs, packed same-size projections,
    no bias_k/bias_v/add_zero_attn, ``need_weights=False``, training, dropout > 0, on CPU) this is
    ``F.multi_head_attention_forward``'s own steps with :func:`attention` in their middle: the
    projections, the merged float mask, attention, the output projection.  Anything else is the
    module itself (through :func:`call_module_cast` when its parameters are not in ``dtype``, with
    the weight cache ``_fxamp_cache``).  Placed by :func:`fxamp.conversion.rewrite.attention.low_precision_attention`
    (O1: instead of ``call_module_cast``).
    """
    bound = dict(zip(_MHA_ARGS, _MHA_DEFAULTS))
    bound.update(zip(_MHA_ARGS, args))
    bound.update(kwargs)
    m, query = module, bound["query"]
    if (bound["need_weights"] or not m.training or m.dropout == 0.0 or not m._qkv_same_embed_dim
            or m.bias_k is not None or m.bias_v is not None or m.add_zero_attn or query.dim() != 3
            or query.device.type != "cpu" or dtype not in LOW):
        if all(p.dtype == dtype for p in m.parameters()):
            return m(*args, **kwargs)
        return call_module_cast(m, dtype, *args, _fxamp_cache=_fxamp_cache, **kwargs)
    same = query is bound["key"] and bound["key"] is bound["value"]
    if same:  # (cast once: three casts of one tensor would be three copies)
        query = key = value = cast(query, dtype)
    else:
        query, key, value = (cast(bound[k], dtype) for k in ("query", "key", "value"))
    if not m.batch_first:  # (L, N, E) -> (N, L, E)
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    n, tgt, embed = query.shape
    src, heads = key.shape[1], m.num_heads
    head_dim = embed // heads
    w, b = cast(m.in_proj_weight, dtype), cast(m.in_proj_bias, dtype) if m.in_proj_bias is not None else None
    if same:
        q, k, v = F.linear(query, w, b).chunk(3, dim=-1)
    else:
        ws, bs = w.chunk(3), b.chunk(3) if b is not None else (None, None, None)
        q, k, v = (F.linear(t, wi, bi) for t, wi, bi in zip((query, key, value), ws, bs))
    q = q.reshape(n, tgt, heads, head_dim).transpose(1, 2)
    k = k.reshape(n, src, heads, head_dim).transpose(1, 2)
    v = v.reshape(n, src, heads, head_dim).transpose(1, 2)
    mask, causal = _mha_mask(bound["attn_mask"], bound["key_padding_mask"], bool(bound["is_causal"]),
                             n, heads, tgt, src, dtype)
    out = attention(q, k, v, mask, m.dropout, causal)
    out = out.transpose(1, 2).reshape(n, tgt, embed)
    out = F.linear(out, cast(m.out_proj.weight, dtype),
                   cast(m.out_proj.bias, dtype) if m.out_proj.bias is not None else None)
    return (out if m.batch_first else out.transpose(0, 1)), None


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nn.MultiheadAttention's masks: True (bool) means masked out; float masks are added."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _mha_mask(attn_mask: Any, key_padding_mask: Any, is_causal: bool, n: int, heads: int, tgt: int, src: int,
              dtype: torch.dtype) -> Tuple[Any, bool]:
    """The (mask, is_causal) ``F.multi_head_attention_forward`` hands SDPA with ``need_weights=False``."""
    if is_causal and key_padding_mask is None:
        return None, True  # the causal hint alone (a given attn_mask is the causal mask)
    mask = None
    if attn_mask is not None:
        mask = _float_mask(attn_mask, dtype)
        mask = mask.view(1, 1, tgt, src) if mask.dim() == 2 else mask.view(n, heads, tgt, src)
    if key_padding_mask is not None:
        pad = _float_mask(key_padding_mask, dtype).view(n, 1, 1, src)
        mask = pad if mask is None else mask + pad
    return mask, False
