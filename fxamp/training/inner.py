"""How the step engine calls the inner optimizer on fxamp's float32 masters: which of torch's paths runs them.

Torch picks a stock optimizer's implementation per call from each group's ``foreach``/``fused`` flags, defaulting
by device: on a CPU its for-loop, a handful of dispatched ops per parameter.  The engine
(:func:`fxamp.training.lean.step_inner`) steps the masters of a stock Adam/AdamW with the fused kernel there
(:data:`fxamp.training.lean.FUSED`), and a stock SGD's with the foreach path (:class:`ForeachSGD`): a few calls
for all of a group's tensors, so a step's ops do not grow with the number of parameters.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["plain", "ForeachSGD"]


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor or parameter, not a subclass such as DTensor (asked without ``t.data``,
    which is a detach: one dispatched op per master and step)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or type(t.data) is torch.Tensor


class ForeachSGD:
    """A stock SGD's groups that left ``foreach`` to torch step with ``foreach=True`` inside the block (restored
    after): the foreach path runs the same float32 operations on each tensor as the for-loop, in the same order
    (``buf.mul_(momentum).add_(grad, alpha=1 - dampening)``, ``param.add_(buf, alpha=-lr)``): bitwise the same
    step, in a few calls for all of a group's tensors.  A group that chose (``foreach=False``, ``fused``), is
    ``differentiable`` or holds a tensor subclass is left alone."""

    def __init__(self, optimizer: Any) -> None:
        self.groups = [] if type(optimizer) is not torch.optim.SGD else [
            g for g in optimizer.param_groups if g.get("foreach") is None and not g.get("fused")
            and not g.get("differentiable", False) and all(plain(p) for p in g["params"])]

    def __enter__(self) -> None:
        for g in self.groups:
            g["foreach"] = True

    def __exit__(self, *exc: Any) -> None:
        for g in self.groups:
            g["foreach"] = None
