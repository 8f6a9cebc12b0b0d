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
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.fx as fx

__all__ = ["fit_scalar", "fit_fill_values"]

#: ops that convert a scalar argument to their tensor's dtype, raising when it does not fit
#: (in-place spellings included: the trailing ``_`` is dropped before lookup)
_FILL_OPS = frozenset({"masked_fill", "fill", "full_like", "new_full", "index_fill", "where", "clamp", "clip",
                       "clamp_min", "clamp_max", "threshold", "_threshold", "hardtanh", "nan_to_num"})
#: beyond this, a scalar overflows float16 (the narrowest low-precision range)
_FLOAT16_MAX = float(torch.finfo(torch.float16).max)


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


def _like(node: fx.Node, name: str) -> Optional[fx.Node]:
    """The tensor whose dtype the scalar is converted to: ``where``'s other branch, else the first input."""
    args = node.args
    if name == "where":
        branches = [a for a in args[1:3] if isinstance(a, fx.Node)]
        return branches[0] if len(branches) == 1 else None
    return args[0] if args and isinstance(args[0], fx.Node) else None


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
        like = _like(node, name)
        if like is None or node.kwargs.get("dtype") is not None:  # an explicit dtype: the value is the user's
            continue
        args = list(node.args)
        kwargs = dict(node.kwargs)
        changed = False
        for table, keys in ((args, range(1, len(args))), (kwargs, list(kwargs))):
            for k in keys:
                if _too_wide(table[k]):
                    with graph.inserting_before(node):
                        fit = graph.call_function(fit_scalar, (table[k], like))
                    fit.meta["val"] = table[k]
                    fitted.append(f"{node.name} ({table[k]:g})")
                    table[k] = fit
                    changed = True
        if changed:
            node.args, node.kwargs = tuple(args), kwargs
    if not fitted:
        return []
    return ["fill value(s) beyond float16's range clamp at run time to the range of the dtype the op runs in: "
            + ", ".join(fitted)]
