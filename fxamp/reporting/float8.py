"""The float8 column: for every matmul a float8 policy could run in float8, its error and its scales, measured.

``measure_float8(gm, batches)`` runs a converted graph (a policy with ``float8=``) and, at each
candidate matmul (``Decision.float8`` set, chosen or not), computes from the inputs the graph gives it:

* the bfloat16 matmul (what the node runs without float8) and the float8 one (the policy's recipe),
  and the SQNR of the float8 result against the bfloat16 one, in dB (the worst batch);
* the amax of the input's and the weight's scaling groups (one per tensor, or per row for rowwise
  recipes) and the range of the scales made from them;
* how far one non-finite input spreads: the output rows that turn NaN once one NaN is planted in
  the input's first row.  A rowwise recipe confines it to that row; tensorwise computes one scale from
  the whole tensor's amax, which the NaN (or an inf) makes non-finite, so every output row turns NaN.

A matmul's own float8 error is about 28 dB against bfloat16 (e4m3 keeps 3 mantissa bits);
much lower means its operands span more range than one scale can hold (an outlier feature:
every other value is flushed to zero).  :func:`float8_refusals` turns the measurement into
``node_overrides`` (``"no_float8"``) for the nodes under a budget: what ``autotune`` does first for a
float8 policy.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..conversion.classify.float8 import REFUSE, matmul_shape
from ..conversion.runtime.float8 import (E4M3, einsum_plan, float8_addmm, float8_einsum, float8_linear, float8_matmul,
                                         to_float8)
from ..conversion.graph import DECISION
from ..conversion.convert import policy_of
from ..policy import Float8, Float8Recipe
from .numerics import sqnr
from .records import Float8Measure

__all__ = ["Float8Measure", "measure_float8", "float8_refusals", "FLOAT8_MIN_SQNR_DB"]

#: autotune's default budget: a float8 matmul whose SQNR against bfloat16 falls below this stays in bfloat16
FLOAT8_MIN_SQNR_DB = 20.0


_FLOAT8_FORMS = {float8_linear: "linear", float8_matmul: "matmul", float8_addmm: "addmm", float8_einsum: "einsum"}


def _linear_form(gm: fx.GraphModule, node: fx.Node, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The node's operands as ``F.linear``'s (x (..., K), weight (N, K), bias), from its run-time arguments."""
    kind = _FLOAT8_FORMS.get(node.target) or matmul_shape(gm, node)[0]
    if kind == "linear":
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        return x, w, b
    if kind == "matmul":
        return args[0], args[1].t(), None
    if kind == "addmm":
        return args[1], args[2].t(), args[0]
    eq = args[0]
    a, b = (args[1], args[2]) if len(args) > 2 and not isinstance(args[1], (list, tuple)) else tuple(args[1])[:2]
    plan = einsum_plan(eq, a.dim(), b.dim())
    assert plan is not None, eq  # a candidate: classify checked the equation
    return a.permute(plan[0]), (b if plan[1] else b.t()), None


def _measure_one(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], config: Float8) -> Float8Measure:
    low = F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
    f8 = float8_linear(x, w.to(x.dtype), b, config)
    rowwise = config.recipe is not Float8Recipe.TENSORWISE
    x2 = x.reshape(-1, x.shape[-1])
    xa = x2.abs().amax(dim=-1) if rowwise else x2.abs().amax().reshape(1)
    wa = w.abs().amax(dim=-1) if rowwise else w.abs().amax().reshape(1)
    scales = torch.cat([to_float8(x2, E4M3, config.power_of_two, dim=-1 if rowwise else None)[1].flatten(),
                        to_float8(w.t(), E4M3, config.power_of_two, dim=0 if rowwise else None)[1].flatten()])
    # the input's own non-finite values zeroed, one NaN planted in its first row: the rows it reaches
    planted = x2.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    planted[0, 0] = float("nan")
    out = float8_linear(planted.reshape(x.shape), w.to(x.dtype), b, config)
    nan_rows = (int(out.reshape(-1, out.shape[-1]).isnan().any(dim=-1).sum()), x2.shape[0])
    return Float8Measure(sqnr(low.float(), f8.float()), (float(xa.min()), float(xa.max())),
                         (float(wa.min()), float(wa.max())), (float(scales.min()), float(scales.max())), nan_rows)


class _Probe(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, config: Float8):
        super().__init__(gm)
        self.config = config
        self.found: Dict[str, Float8Measure] = {}

    def run_node(self, n: fx.Node) -> Any:
        d = n.meta.get(DECISION)
        if d is not None and d.float8 is not None and n.op in ("call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            m = _measure_one(*_linear_form(self.module, n, args, kwargs), self.config)
            self.found[n.name] = m if n.name not in self.found else self.found[n.name].merged(m)
        return super().run_node(n)


def measure_float8(gm: fx.GraphModule, batches: Sequence[Tuple[Any, ...]], kwargs: Optional[Dict[str, Any]] = None
                   ) -> Dict[str, Float8Measure]:
    """``{node name: Float8Measure}`` for every float8 candidate of a converted graph, over ``batches``
    (run in eval mode, under ``no_grad``); empty for a policy without float8."""
    from .observe import bind_inputs

    policy = policy_of(gm)
    if policy is None or policy.float8 is None:
        return {}
    probe = _Probe(gm, policy.float8)
    modes = [(m, m.training) for m in gm.modules()]
    for m, _ in modes:
        m.training = False
    try:
        with torch.no_grad():
            for batch in batches:
                probe.run(*bind_inputs(gm, batch, kwargs or {}))
    finally:
        for m, mode in modes:
            m.training = mode
    return probe.found


def float8_refusals(gm: nn.Module, measured: Dict[str, Float8Measure], min_sqnr_db: float) -> Dict[str, str]:
    """``{node: "no_float8"}`` for each matmul that runs in float8 in ``gm`` and measured below ``min_sqnr_db``."""
    chosen = {n.name for n in gm.graph.nodes
              if (d := n.meta.get(DECISION)) is not None and d.float8 is not None and d.float8.chosen}
    return {name: REFUSE for name, m in measured.items()
            if name in chosen and not (m.sqnr_db >= min_sqnr_db)}
