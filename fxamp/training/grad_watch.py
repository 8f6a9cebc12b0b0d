"""Tell a clip of the scaled gradients: torch's ``clip_grad_norm_`` on the model between ``backward()`` and ``step()``.

Under a loss scale the model's low-precision gradients hold ``scale`` times the true ones until ``unscale_()`` or
``step()``.  ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` there measures and clips those: the step then
moves by a gradient of norm about ``c / scale``, silently (``torch.amp.GradScaler`` users meet the same unless they
``unscale_()`` first).  :class:`ScaledGradWatch` records each gradient's version counter at the end of every scaled
``backward()`` (a Python loop, no tensor op); at the next ``unscale_()``/``clip_grad_norm_()``/``step()`` the
engine compares them (``Engine.check_grads``: a step runs code in the engine's files only) and the watch warns once
per optimizer if one changed since: something wrote the gradients in place while they were scaled.  Gradients
accumulated over several ``backward()`` calls are recorded again after each; ``zero_grad()`` forgets the record.
"""
from __future__ import annotations

import warnings
from typing import Iterable, List, Optional, Tuple

import torch

__all__ = ["ScaledGradWatch", "SCALED_GRADS_CHANGED"]

SCALED_GRADS_CHANGED = (
    "fxamp: the gradients of {name} (and maybe others) changed between backward() and step() while multiplied by "
    "the loss scale ({scale:g}); torch's clip_grad_norm_ on the model clips scaled gradients, so the step moves "
    "about {scale:g} times too little: use opt.clip_grad_norm_(max_norm), or call opt.unscale_() first and clip "
    "opt.master_params()")


class ScaledGradWatch:
    """The version counters of the gradients a scaled ``backward()`` left; one warning per optimizer at most."""

    def __init__(self) -> None:
        self.seen: Optional[List[Tuple[torch.Tensor, torch.Tensor, int]]] = None  # (param, its grad, grad version)
        self.warned = False
        self.pending = False  # a record waits for its check (a plain attribute: the engine reads it every step)

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """After a ``backward()`` under a scale that is not 1: note each gradient as it is now."""
        if not self.warned:
            self.seen = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]
            self.pending = True

    def forget(self) -> None:
        """The gradients start over (``zero_grad()``): nothing to compare."""
        self.seen, self.pending = None, False

    def warn(self, name: str, scale: float, stacklevel: int) -> None:
        """The engine's check (``Engine.check_grads``: the step's own module) found ``name``'s gradient written
        while scaled: say so, once per optimizer.  stacklevel: the caller's own, for ``warnings.warn``."""
        self.warned = True
        warnings.warn(SCALED_GRADS_CHANGED.format(name=name, scale=scale), RuntimeWarning, stacklevel=stacklevel + 1)
