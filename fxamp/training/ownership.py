"""Which wrapper owns which tensors: the marks a :class:`~fxamp.MixedPrecisionOptimizer` sets, and the refusals they allow.

* a low-precision parameter with a float32 master is marked :data:`fxamp.info.MASTERED`: the
  converted module's first-gradient check (``fxamp.info.watch_for_masters``) then stays quiet;
* a master is marked too, so a second wrapper around the same torch optimizer (whose
  ``param_groups`` now hold the first wrapper's masters) is refused: it would step masters that
  never get gradients and report success;
* ``fp32_state_dict(model)`` refuses a model none of whose parameters the optimizer steps.

The marks are plain attributes on tensors the wrapper pairs; nothing global is kept.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import OptimizerStateError
from ..info import MASTERED

__all__ = ["mark_master", "refuse_wrapped", "refuse_foreign_model"]

#: set on a float32 master by the wrapper that made or adopted it
_MASTER = "_fxamp_master"


def mark_master(low: torch.Tensor, master: torch.Tensor) -> None:
    """Note that ``master`` is the float32 master of ``low``."""
    setattr(low, MASTERED, True)
    setattr(master, _MASTER, True)


def refuse_wrapped(optimizer: Any) -> None:
    """Raise OptimizerStateError if ``optimizer``'s ``param_groups`` hold another wrapper's float32 masters."""
    for group in optimizer.param_groups:
        if any(getattr(p, _MASTER, False) for p in group["params"]):
            raise OptimizerStateError(
                f"this {type(optimizer).__name__} is already wrapped by a MixedPrecisionOptimizer (its param_groups "
                f"hold that wrapper's float32 masters): a second wrapper's step() would change no weight; keep "
                f"using the first one (its .optimizer is this {type(optimizer).__name__})")


def refuse_foreign_model(model: nn.Module, known: Iterable[torch.Tensor]) -> None:
    """Raise ValueError if ``model`` has parameters and none of them is in ``known`` (what the optimizer steps)."""
    ids = {id(t) for t in known}
    params = list(model.parameters())
    if params and not any(id(p) in ids for p in params):
        raise ValueError(
            f"fp32_state_dict(model): none of this {type(model).__name__}'s parameters is stepped by this "
            f"optimizer, so its masters are not that model's weights; pass the converted module the optimizer "
            f"was built on (or nothing: the model= given at construction)")
