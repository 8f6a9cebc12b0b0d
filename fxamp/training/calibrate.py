"""``"auto"`` masters and state: measure during the first steps, then choose per tensor, with the reason.

While a :class:`~fxamp.training.lean.Workspace` calibrates (its first ``calibration_steps``, run
with float32 masters and state), every step measures per master:

* ``lost``: the fraction of the update's mass that plain rounding into the weight's dtype would
  lose, ``sum|d - (round(w + d) - w)| / sum|d|`` with ``w`` the low-precision weight and ``d``
  the float32 update (1.0: no update survives, as for a norm weight of 1.0 under lr 1e-4);
* ``state_error``: the relative error of the update direction (Adam's ``m / sqrt(v)``, SGD's
  momentum) after an 8-bit round trip of the state (:func:`fxamp.training.quant.update_error`).

The largest over the calibration steps decides (:func:`decide`); a tensor is kept in float32 only
where measurement says it matters and it is small enough for that to cost little:

==================================  ==========================================================
masters                             when
==================================  ==========================================================
``stochastic`` (0 extra bytes)      ``lost`` < :data:`LOST_LIMIT`: rounding rarely bites, the
                                    unbiased rounding keeps the rest (float16 weights: kahan)
``fp32`` (4 bytes)                  ``lost`` >= the limit and the tensor is small
                                    (< :data:`SMALL` elements)
``kahan`` (2 bytes)                 ``lost`` >= the limit, a large tensor
==================================  ==========================================================

State: ``int8`` where ``state_error`` < :data:`STATE_LIMIT` and the tensor has at least
:data:`SMALL` elements, ``bf16`` where the error is larger, ``fp32`` for small tensors and
for optimizers whose state keys are unknown.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import quant

__all__ = ["LOST_LIMIT", "STATE_LIMIT", "SMALL", "lost_fraction", "decide", "bytes_per_param", "table"]

#: above this fraction of the update mass lost to rounding, a master keeps its full value (fp32 or kahan)
LOST_LIMIT = 0.1
#: above this relative error of the update direction, 8-bit state is not used (bf16 instead)
STATE_LIMIT = 0.1
#: tensors with fewer elements keep float32 masters (when rounding bites) and state: they cost little
SMALL = 65536


def lost_fraction(old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> float:
    """The fraction of the update ``new - old`` (float32) that plain rounding into ``dtype`` loses."""
    d = new - old
    w = old.to(dtype).float()
    applied = (w + d).to(dtype).float() - w
    mass = float(d.abs().sum())
    return 0.0 if mass == 0.0 else float((d - applied).abs().sum()) / mass


def decide(ws: Any) -> None:
    """Choose the modes of every master left to ``"auto"`` from its measurements; note the reason."""
    config = ws.config
    for mid, choice in ws.choices.items():
        low = ws.low_of[mid]
        master = next(m for m in _masters(ws) if id(m) == mid)
        numel = low.numel()
        reasons = []
        masters = choice.master
        if config.masters.value == "auto":
            lost = choice.lost if choice.lost is not None else 1.0
            if lost < LOST_LIMIT:
                masters = "stochastic" if low.dtype == torch.bfloat16 else "kahan"
                reasons.append(f"rounding loses {lost:.1%} of the update: {masters}")
            elif numel < config.small:
                masters = "fp32"
                reasons.append(f"rounding loses {lost:.0%} of the update, small: fp32")
            else:
                masters = "kahan"
                reasons.append(f"rounding loses {lost:.0%} of the update: compensated")
        state = choice.state
        if config.state.value == "auto":
            err = choice.state_error
            if not quant.compressible(ws.optimizer):
                state = "fp32"
                reasons.append(f"{type(ws.optimizer).__name__}'s state keys unknown: fp32 state")
            elif numel < config.small:
                state = "fp32"
                reasons.append("small: fp32 state")
            elif err is not None and err < STATE_LIMIT:
                state = "int8"
                reasons.append(f"8-bit state moves the update {err:.1%}: int8")
            else:
                state = "bf16"
                reasons.append("8-bit state error " + ("unmeasured" if err is None else f"{err:.0%}") + ": bf16")
        choice.reason = "; ".join(reasons) or choice.reason
        ws.set_modes(master, masters, state)


def _masters(ws: Any) -> List[torch.Tensor]:
    return [m for g in ws.optimizer.param_groups for m in g["params"] if id(m) in ws.choices]


_MASTER_BYTES = {"fp32": 4.0, "kahan": 2.0, "stochastic": 0.0}


def bytes_per_param(params: Sequence[Tuple[torch.Tensor, Optional[Any], int]]) -> float:
    """Bytes per parameter between steps, counted as in the issue's table (weight + master or term +
    gradient + state): ``params`` are (parameter, its :class:`~fxamp.training.lean.Choice` or None
    for a float32 parameter stepped directly, number of state tensors per element)."""
    total = numel = 0.0
    for p, choice, keys in params:
        n = p.numel()
        if choice is None:
            per = 2 * p.element_size() + keys * p.element_size()
        else:
            per = 2 * p.element_size() + _MASTER_BYTES[choice.master] + quant.state_bytes(choice.state, n, keys)
        total += per * n
        numel += n
    return total / numel if numel else 0.0


def table(rows: Sequence[Tuple[str, torch.Tensor, Optional[Any], int]]) -> str:
    """The per-tensor table, in the report's style (tabulate), and the total bytes per parameter."""
    from tabulate import tabulate

    body = []
    for name, p, choice, keys in rows:
        if choice is None:
            body.append([name, str(tuple(p.shape)), str(p.dtype).removeprefix("torch."), "(own)", "fp32",
                         f"{bytes_per_param([(p, None, keys)]):.2f}", "", "", "float32 parameter, stepped directly"])
            continue
        body.append([name, str(tuple(p.shape)), str(p.dtype).removeprefix("torch."), choice.master, choice.state,
                     f"{bytes_per_param([(p, choice, keys)]):.2f}",
                     "" if choice.lost is None else f"{choice.lost:.1%}",
                     "" if choice.state_error is None else f"{choice.state_error:.1%}", choice.reason])
    headers = ["parameter", "shape", "weight", "master", "state", "bytes/param", "lost", "state err", "reason"]
    text = tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True) if body else "(no rows)"
    total = bytes_per_param([(p, c, k) for _, p, c, k in rows])
    text = f"{text}\n{len(rows)} tensors, {sum(p.numel() for _, p, _, _ in rows):,} parameters: {total:.2f} bytes/param"
    if any(c is not None and c.master != "fp32" and c.state != "fp32" and p.dtype == torch.bfloat16
           and p.device.type == "cpu" for _, p, c, _ in rows):
        from . import native

        why = native.unavailable_reason()
        how = ("stepped by fxamp's CPU kernel, one pass an element" if why is None
               else f"stepped eagerly ({why}): two to three times the CPU kernel's step time")
        text += f"\nbfloat16 lean masters with 8-bit or bfloat16 state: {how}"
    return text
