"""Which wrapper owns which tensors: the marks a :class:`~fxamp.MixedPrecisionOptimizer` sets, and the refusals they allow.

* a low-precision parameter with a float32 master is marked :data:`fxamp.info.MASTERED`: the
  converted module's first-gradient check (``fxamp.info.watch_for_masters``) then stays quiet;
* a master is marked too, so a second wrapper around the same torch optimizer (whose
  ``param_groups`` now hold the first wrapper's masters) is refused: it would step masters that
  never get gradients and report success;
* ``fp32_state_dict(model)`` refuses a model none of whose parameters the optimizer steps, and so does
  ``MixedPrecisionOptimizer(optimizer, model=model)`` (:func:`refuse_unheld_model`).

The marks are plain attributes on tensors the wrapper pairs; nothing global is kept.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import OptimizerStateError
from ..info import MASTERED, origin_of

__all__ = ["mark_master", "refuse_wrapped", "refuse_foreign_model", "refuse_unheld_model"]

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


def refuse_unheld_model(model: nn.Module, optimizer: Any) -> None:
    """Raise ValueError if ``model`` has parameters and ``optimizer`` holds none of them, nor (``fxamp.initialize``:
    the optimizer of the float32 original) the float32 tensor any of them was converted from.  A partial overlap
    is fine: frozen parameters left out of the optimizer, or an optimizer that also steps another module's."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = list(model.parameters())
    if not params or any(id(p) in held for p in params) or any(id(origin_of(p)) in held for p in params):
        return
    raise ValueError(
        f"model= is a {type(model).__name__} none of whose {len(params)} parameters this {type(optimizer).__name__} "
        f"holds (it was built on another module's): its weights would get no masters, a float16 model no loss "
        f"scaling; build the optimizer on model.parameters(), or pass as model= the module whose parameters it holds")
