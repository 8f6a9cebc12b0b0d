"""Estimated floating point operations per node, from the shapes observed when the model ran."""

from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional, Sequence

import torch.fx as fx
import torch.nn as nn

from ..conversion.graph import Decision
from ..conversion.runtime import call_module_cast
from .observe import Meta, Recorder, leaves

__all__ = ["estimate_flops", "numel"]


def _base_name(op: str) -> str:
    name = op.rsplit(".", 1)[-1]
    return name.strip("_") if name.startswith("__") else name.lstrip("_")


def estimate_flops(node: fx.Node, d: Decision, rec: Recorder, modules: Dict[str, nn.Module]) -> int:
    args, kwargs = rec.args.get(node, ((), {}))
    result = rec.results.get(node)
    tensors = [a if isinstance(a, Meta) else None for a in args]
    out = [m for m in leaves(result)]
    out_numel = sum(numel(m.shape) for m in out)
    name = _base_name(d.op)

    def arg(i: int, key: str = "") -> Optional[Meta]:
        if key and isinstance(kwargs.get(key), Meta):
            return kwargs[key]
        return tensors[i] if i < len(tensors) else None

    try:
        module = None
        if node.op == "call_module":
            module = modules.get(str(node.target))
        elif node.op == "call_function" and node.target is call_module_cast:
            module = modules.get(d.module)
            args = args[2:]
            tensors = tensors[2:]
        if module is not None:
            return _module_flops(module, tensors, out_numel)
        if name in ("linear", "matmul", "mm", "bmm", "mv", "dot", "vdot") or node.target is operator.matmul:
            a = arg(0, "input")
            return 2 * max(out_numel, 1) * a.shape[-1]
        if name in ("addmm", "baddbmm", "addbmm", "addmv"):
            a = arg(1)
            return 2 * max(out_numel, 1) * a.shape[-1]
        if name == "einsum":
            return _einsum_flops(node, args)
        if name.startswith("conv_transpose"):
            x, w = arg(0, "input"), arg(1, "weight")
            return 2 * numel(x.shape) * numel(w.shape[1:])
        if name.startswith("conv") or name == "convolution":
            x, w = arg(0, "input"), arg(1, "weight")
            if name == "convolution" and len(node.args) > 6 and node.args[6] is True:  # aten: transposed
                return 2 * numel(x.shape) * numel(w.shape[1:])
            return 2 * out_numel * numel(w.shape[1:])
        if "scaled_dot_product" in name:
            q, k, v = arg(0, "query"), arg(1, "key"), arg(2, "value")
            lq, s = q.shape[-2], k.shape[-2]
            batch = numel(q.shape[:-2])
            return 2 * batch * lq * s * (q.shape[-1] + v.shape[-1]) + 3 * batch * lq * s
    except (AttributeError, IndexError, TypeError):
        pass
    return out_numel


def _module_flops(module: nn.Module, tensors: List[Optional[Meta]], out_numel: int) -> int:
    x = tensors[0] if tensors else None
    if isinstance(module, nn.Linear):
        return 2 * out_numel * module.in_features
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and x is not None:
        return 2 * numel(x.shape) * numel(module.weight.shape[1:])
    if isinstance(module, nn.modules.conv._ConvNd):
        return 2 * out_numel * numel(module.weight.shape[1:])
    if isinstance(module, nn.MultiheadAttention) and x is not None:
        k = tensors[1] if len(tensors) > 1 and tensors[1] is not None else x
        e = module.embed_dim
        s = k.shape[1] if module.batch_first and len(k.shape) == 3 else k.shape[0]
        q_tokens = numel(x.shape) // e
        k_tokens = numel(k.shape) // (module.kdim or e)
        return 2 * q_tokens * e * e * 2 + 2 * k_tokens * e * e * 2 + 4 * q_tokens * s * e
    if isinstance(module, nn.RNNBase) and x is not None:
        gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
        tokens = numel(x.shape) // module.input_size
        dirs = 2 if module.bidirectional else 1
        h = module.hidden_size
        return 2 * gates * h * (module.input_size + h) * tokens * module.num_layers * dirs
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if linears and x is not None and len(x.shape) >= 1 and x.shape[-1]:
        # an opaque module built of linears (an unlisted leaf): 2 * weights * tokens, roughly
        tokens = numel(x.shape) // x.shape[-1]
        return 2 * tokens * sum(m.weight.numel() for m in linears) + out_numel
    return out_numel


def _einsum_flops(node: fx.Node, args: Sequence[Any]) -> int:
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else None
    operands = [a for a in leaves(args)]
    if equation is None:
        raise TypeError("einsum without an equation string")
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: Dict[str, int] = {}
    for spec, meta in zip(lhs, operands):
        letters = [c for c in spec if c.isalpha()]
        for c, n in zip(letters, meta.shape[-len(letters):] if letters else ()):
            sizes[c] = n
    return 2 * numel(tuple(sizes.values()))

def numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if len(shape) else 1

