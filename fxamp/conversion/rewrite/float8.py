"""Float8 matmuls in the graph: each matmul ``classify/float8.py`` chose calls its ``runtime/float8.py`` form."""

from __future__ import annotations

from typing import List, Mapping

import torch.fx as fx

from ...policy import Float8
from ..classify.float8 import einsum_args, matmul_shape
from ..graph import DECISION, Decision
from ..passes import Conversion, Pass, Stage
from ..runtime.float8 import float8_addmm, float8_einsum, float8_linear, float8_matmul, gemm_options

__all__ = ["rewrite_float8", "FLOAT8"]


def rewrite_float8(gm: fx.GraphModule, decisions: Mapping[fx.Node, Decision], config: Float8) -> int:
    """Replace each chosen matmul (its inputs already cast to bfloat16) by its float8 form; returns how many::

        linear = F.linear(x, w, b)           ==>  linear = float8_linear(x, w, b, "tensorwise")
        matmul = x @ w                       ==>  matmul = float8_matmul(x, w, "tensorwise")
        addmm = addmm(b, x, w)               ==>  addmm = float8_addmm(b, x, w, "tensorwise")
        einsum = einsum("bi,ij->bj", x, w)   ==>  einsum = float8_einsum("bi,ij->bj", x, w, "tensorwise")
    """
    text = str(config)
    gemm_options(text)  # (parsed once here: a compiled graph reads the options, see runtime/float8.py)
    made = 0
    for node in gm.graph.nodes:
        d = node.meta.get(DECISION)
        if d is None or d.float8 is None or not d.float8.chosen:
            continue
        kind = matmul_shape(gm, node)[0]
        if kind == "linear":
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w = args[0], args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            b = args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            target, new_args = float8_linear, (x, w, b, text)
        elif kind == "matmul":
            target, new_args = float8_matmul, (node.args[0], node.args[1], text)
        elif kind == "addmm":
            target, new_args = float8_addmm, (*node.args, text)
        else:
            eq, (a, b) = einsum_args(node)
            target, new_args = float8_einsum, (eq, a, b, text)
        # the same node (x.matmul(w) was a call_method): its name, meta, and the casts that point at it stay
        node.op, node.target, node.args, node.kwargs = "call_function", target, new_args, {}
        made += 1
    return made


def _float8(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    rewrite_float8(gm, conversion.decisions, conversion.policy.float8)
    return []


def _runs_float8(conversion: Conversion) -> bool:
    return conversion.policy.enabled and conversion.policy.float8 is not None


FLOAT8 = Pass("float8", Stage.REWRITE, _float8, applies=_runs_float8)  # after the casts: its inputs are bfloat16
