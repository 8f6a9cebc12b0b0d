"""A :class:`~fxamp.MixedPrecisionOptimizer` and its model in ``torch.distributed.checkpoint`` (DCP).

DCP takes the optimizer itself (``dcp.save({"model": model, "optim": opt})``: ``opt.state_dict()``, which
keys the inner optimizer's state by position, holds zeros for a fresh optimizer to load into; see
:mod:`fxamp.training.checkpoint`), and resumes on the same ranks.  torch's ``get_state_dict`` does not take
the wrapper.  Here torch's ``get_state_dict`` /
``set_state_dict`` take the *inner* optimizer (keyed by parameter names, every state tensor
created, DTensors sharded as the parameters), and the wrapper's own state (the loss scaler,
skipped steps) travels beside it as plain values::

    state = fxamp.sharded_state_dict(model, opt)      # {"model": ..., "optimizer": ..., "fxamp": ...}
    dcp.save(state, checkpoint_id=path)
    ...                                               # resume, on as many ranks or fewer
    state = fxamp.sharded_state_dict(model, opt)      # this rank's tensors: what DCP loads into
    dcp.load(state, checkpoint_id=path)
    fxamp.load_sharded_state_dict(model, opt, state)

It covers optimizers whose parameters are their own masters (O0/O1, and so every model sharded
by :func:`fxamp.shard`); one with separate masters (O2/O3, float32 or lean) is refused (its
``state_dict()`` is the checkpoint there).
"""

from __future__ import annotations

from typing import Any, Dict

import torch.nn as nn

from . import checkpoint

__all__ = ["sharded_state_dict", "load_sharded_state_dict"]

KEYS = ("model", "optimizer", "fxamp")


def sharded_state_dict(model: nn.Module, opt: Any) -> Dict[str, Any]:
    """``{"model", "optimizer", "fxamp"}`` for ``torch.distributed.checkpoint.save``/``load`` (see the module)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _check(opt)
    model_sd, optim_sd = get_state_dict(model, opt.optimizer)
    own = checkpoint.save_own(opt)
    return {"model": model_sd, "optimizer": optim_sd, "fxamp": own}


def load_sharded_state_dict(model: nn.Module, opt: Any, state: Dict[str, Any]) -> None:
    """Put a loaded :func:`sharded_state_dict` into ``model`` and ``opt``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _check(opt)
    if not isinstance(state, dict) or set(state) != set(KEYS):
        raise ValueError(f"load_sharded_state_dict takes the dict fxamp.sharded_state_dict() gave (keys "
                         f"{', '.join(KEYS)}), loaded by torch.distributed.checkpoint.load; got "
                         f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    set_state_dict(model, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    checkpoint.load_own(opt, state["fxamp"])


def _check(opt: Any) -> None:
    if not hasattr(opt, "scaler") or not hasattr(opt, "optimizer"):
        raise TypeError(f"sharded_state_dict takes a fxamp.MixedPrecisionOptimizer, not {type(opt).__name__}")
    if opt._masters:  # (a lean workspace without masters, O1 with masters=/state= set, holds nothing to save)
        raise ValueError("sharded_state_dict covers optimizers whose parameters are their own masters (O0/O1, "
                         f"fxamp.shard); this one keeps {len(opt._masters)} separate masters: save "
                         "opt.state_dict() instead")
