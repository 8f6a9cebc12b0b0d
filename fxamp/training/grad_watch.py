"""Tell a clip of the scaled gradients: torch's ``clip_grad_norm_`` on the model between ``backward()`` and ``step()``.

Under a loss scale the model's low-precision gradients hold ``scale`` times the true ones until ``unscale_()`` or
``step()``.  ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` there measures and clips those: the step then
moves by a gradient of norm about ``c / scale``, silently (``torch.amp.GradScaler`` users meet the same unless they
``unscale_()`` first).  :class:`ScaledGradWatch` records each gradient's version counter at the end of every scaled
``backward()`` (a Python loop, no tensor op) and, at the next ``unscale_()``/``clip_grad_norm_()``/``step()``, warns
once per optimizer if one changed since: something wrote the gradients in place while they were scaled.  Gradients
accumulated over several ``backward()`` calls are recorded again after each; ``zero_grad()`` forgets the record.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, List, Optional, Tuple

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
        self._seen: Optional[List[Tuple[torch.Tensor, torch.Tensor, int]]] = None  # (param, its grad, grad version)
        self.warned = False
        self.pending = False  # a record waits for its check (a plain attribute: the engine reads it every step)

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """After a ``backward()`` under a scale that is not 1: note each gradient as it is now."""
        if not self.warned:
            self._seen = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]
            self.pending = True

    def forget(self) -> None:
        """The gradients start over (``zero_grad()``): nothing to compare."""
        self._seen, self.pending = None, False

    def check(self, name_of: Callable[[torch.Tensor], str], scale: Callable[[], float], stacklevel: int) -> None:
        """Before the gradients are unscaled: warn if one was written in place since the last ``backward()``.

        scale: the loss scale (read only to warn); stacklevel: the caller's own, for ``warnings.warn``."""
        seen, self._seen, self.pending = self._seen, None, False
        if not seen or self.warned:
            return
        changed = next((p for p, grad, version in seen if p.grad is grad and grad._version != version), None)
        if changed is not None:
            self.warned = True
            warnings.warn(SCALED_GRADS_CHANGED.format(name=name_of(changed), scale=scale()), RuntimeWarning,
                          stacklevel=stacklevel + 1)
