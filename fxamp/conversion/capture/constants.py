"""Fill values that fit the dtype their op runs in.

Code written for float32 fills masks with ``torch.finfo(x.dtype).min`` (baked into the graph as
``-3.4028e38`` by torch.export) or ``-1e9``; once mixed precision runs the op in float16 or
bfloat16, torch refuses the scalar ("value cannot be converted to type c10::Half without
overflow").  :func:`fit_fill_values` passes each such scalar through :func:`fit_scalar`, which
clamps it at run time into the range of the dtype the op's tensor has then (unchanged in float32)::

    masked_fill = aten.masked_fill.Scalar(matmul, mask, -3.4028e38)
        ==>
    fit_scalar = fxamp.conversion.capture.constants.fit_scalar(-3.4028e38, matmul)     # finfo(matmul.dtype).min
    masked_fill = aten.masked_fill.Scalar(matmul, mask, fit_scalar)

The same holds for a tensor made in ``forward`` (``torch.where(mask, x, torch.tensor(finfo.min))``, GPT-Neo's and
ImageGPT's mask value), which torch.export lifts into a constant: converted to the op's bfloat16 or float16 it
would become ``-inf``, and a fully masked row of a softmax NaN (float32 and autocast, which reads ``finfo`` of the
low dtype, give finite values).  Such a constant, read through views and copies, is clamped at run time into
that range (``torch.clamp`` between two :func:`fit_scalar` bounds: unchanged in float32).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph import fetch_attr
from ..op_lists import VIEW_OPS, op_key

__all__ = ["fit_scalar", "fit_fill_values"]

#: ops that convert a scalar argument to their tensor's dtype, raising when it does not fit
#: (in-place spellings included: the trailing ``_`` is dropped before lookup)
_FILL_OPS = frozenset({"masked_fill", "fill", "full_like", "new_full", "index_fill", "where", "clamp", "clip",
                       "clamp_min", "clamp_max", "threshold", "_threshold", "hardtanh", "nan_to_num"})
#: beyond this, a scalar overflows float16 (the narrowest low-precision range)
_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def fit_scalar(value: Any, like: Any) -> Any:
    """``value`` clamped into the range of ``like``'s floating dtype; as is for other tensors and values."""
    if isinstance(like, torch.Tensor) and like.is_floating_point():
        info = torch.finfo(like.dtype)
        return min(max(value, info.min), info.max)
    return value


def _op_name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif isinstance(target, torch._ops.OpOverload):
        name = target._opname
    else:
        name = getattr(target, "__name__", "")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _too_wide(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) > _FLOAT16_MAX)


def _like(node: fx.Node, name: str, value: Any = None) -> Optional[fx.Node]:
    """The tensor whose dtype the scalar (or the tensor ``value``) is converted to: ``where``'s other branch, else
    the first input."""
    args = node.args
    if name == "where":
        branches = [a for a in args[1:3] if isinstance(a, fx.Node) and a is not value]
        return branches[0] if len(branches) == 1 else None
    return args[0] if args and isinstance(args[0], fx.Node) and args[0] is not value else None


def _too_wide_constant(gm: fx.GraphModule, node: Any) -> bool:
    """``node`` reads a float tensor constant (through views and copies: export's ``lift_fresh_copy``) with a
    finite value beyond float16's range."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and op_key(node.target) in VIEW_OPS:
        node = node.args[0] if node.args else None
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False
    value = fetch_attr(gm, str(node.target))
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or isinstance(value, nn.Parameter):
        return False
    with torch.no_grad():
        return bool(((value.abs() > _FLOAT16_MAX) & value.isfinite()).any())


def fit_fill_values(gm: fx.GraphModule) -> List[str]:
    """Route out-of-float16-range scalars of fill-like ops through :func:`fit_scalar`; returns notes."""
    graph = gm.graph
    fitted = []
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        name = _op_name(node)
        if name not in _FILL_OPS:
            continue
        if node.kwargs.get("dtype") is not None:  # an explicit dtype: the value is the user's
            continue
        args = list(node.args)
        kwargs = dict(node.kwargs)
        changed = False
        for table, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
            for k in keys:
                value = table[k]
                scalar = _too_wide(value) and k != 0
                if not (scalar or _too_wide_constant(gm, value)):
                    continue
                like = _like(node, name, value)
                if like is None:
                    continue
                with graph.inserting_before(node):
                    if scalar:
                        fit = graph.call_function(fit_scalar, (value, like))
                    else:
                        bounds = [graph.call_function(fit_scalar, (b, like)) for b in (-_FLOAT32_MAX, _FLOAT32_MAX)]
                        fit = graph.call_function(torch.clamp, (value, *bounds))
                fit.meta.update({"val": value} if scalar else value.meta)
                fitted.append(f"{node.name} ({value:g})" if scalar else f"{node.name} (a tensor constant)")
                table[k] = fit
                changed = True
        if changed:
            node.args, node.kwargs = tuple(args), kwargs
    if not fitted:
        return []
    return ["fill value(s) beyond float16's range clamp at run time to the range of the dtype the op runs in: "
            + ", ".join(fitted)]
