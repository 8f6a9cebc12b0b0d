"""The verbs of an iteration outside its step: ``zero_grad`` (the iteration starts over) and ``clip_grad_norm_``
(a stage of its own between ``backward()`` and ``step()``), each the work of the facade's verb of that name on its
:class:`~fxamp.training.step.Engine` (:mod:`fxamp.training.step`: the step itself, which runs no code here).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .config import Stage
from .executors import FoundInf, unscale_own
from ..errors import OptimizerStateError
from .plan import Plan
from .step import Engine

__all__ = ["zero_grad", "clip_grad_norm_", "clip_in_place", "clip_factor"]


def zero_grad(engine: Engine, set_to_none: bool, lows: Sequence[torch.Tensor]) -> None:
    """:meth:`fxamp.MixedPrecisionOptimizer.zero_grad`: the iteration starts over (``lows``: the low-precision
    parameters whose gradients are cleared too)."""
    engine.settle()
    engine.check = None
    optimizer = engine.optimizer
    if set_to_none:
        if not _stock_zero_grad(optimizer):
            optimizer.zero_grad()  # (its default: a duck-typed one may take no set_to_none)
        for p in [*engine.params(), *lows]:  # what Optimizer.zero_grad does, whatever the inner one did
            p.grad = None
        if engine.release_grad_buffer and engine.kept is not None:
            for bucket in engine.kept.buckets:
                bucket.release()
    else:
        optimizer.zero_grad(set_to_none=False)
        grads = []
        for p in lows:
            if p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)
    engine.scaler.restart(engine.client, drop_scaled=engine.owns_scaler)


def _stock_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.zero_grad`` is ``Optimizer.zero_grad`` (no subclass or instance override)."""
    return type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in vars(optimizer)


def clip_grad_norm_(engine: Engine, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """:meth:`fxamp.MixedPrecisionOptimizer.clip_grad_norm_`: without leaving a segmented step, the norms
    from the low-precision gradients and the clip factor joined to the unscaling inside ``step()``."""
    engine.check_grads()
    engine.settle()
    if engine.check is not None and engine.check.coef is not None:  # the masters have no gradients to clip again
        raise OptimizerStateError(
            "clip_grad_norm_() already ran since the last backward(): call it once, between the last "
            "backward() and step()")
    plan = engine.plan()
    stage = engine.scaler.stage(engine.client)
    if not (stage is Stage.SCALED and engine.segmentable(plan)):
        if stage is not Stage.UNSCALED:
            engine.unscale_()  # (says what is wrong when there was no backward)
        return torch.nn.utils.clip_grad_norm_(list(engine.params()), max_norm, norm_type, error_if_nonfinite)
    flags = engine.scaler.start_unscale(engine.client)
    exact = engine.decides_on(plan) is not None  # (exact, and the host does not wait)
    with torch.no_grad():
        checked, norms, own = clip_in_place(plan, flags, norm_type, exact)
        check = engine.decide(flags, checked, plan, in_place=True)
        total, check.coef = clip_factor(norms, own, max_norm, norm_type, error_if_nonfinite)
    return total


def clip_in_place(plan: Plan, flags: FoundInf, norm_type: float, exact: bool
                  ) -> Tuple[int, List[torch.Tensor], List[torch.Tensor]]:
    """:func:`fxamp.training.executors.check_in_place` that also takes the norms of the true gradients (the low-precision
    ones in float32, divided by the scale); return how many were checked, the norms, and the float32
    parameters' gradients (to clip with :func:`clip_factor` once the check is decided).  ``exact``:
    check every low-precision gradient (the host does not read the norms), not only when a norm
    is non-finite."""
    norms: List[torch.Tensor] = []
    own: List[torch.Tensor] = []
    checked = 0
    for bucket in plan.buckets:
        grads = [p.grad for p in bucket.lows if p.grad is not None]
        if not grads:
            continue
        n = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
        n = n * flags.inv_scale_on(n.device)  # a norm scales with its tensor (the scale: a power of 2)
        if exact or not bool(torch.isfinite(n).all()):  # an inf/NaN, or finite values whose norm overflowed
            flags.check_(grads)
        norms.append(n)
        checked += len(grads)
    for params in plan.own:
        checked += unscale_own(params, flags)  # unscaled in place, as unscale_() does
        grads = [p.grad._values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
        if grads:
            norms.append(torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)))
            own.extend(grads)
    return checked, norms, own


def clip_factor(norms: List[torch.Tensor], own: List[torch.Tensor], max_norm: float, norm_type: float,
                error_if_nonfinite: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The total norm of :func:`clip_in_place`'s ``norms`` and torch's clip factor, which clips ``own``
    here (the masters' gradients are clipped inside ``step()``)."""
    total = torch.linalg.vector_norm(torch.cat([n.to(norms[0].device) for n in norms]), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
            "clipped (with loss scaling an overflow is expected now and then: pass "
            "error_if_nonfinite=False and let step() skip)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_ formula
    if own:
        torch._foreach_mul_(own, coef.to(own[0].device))
    return total, coef

