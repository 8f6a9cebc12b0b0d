"""The checkpoint of a :class:`~fxamp.MixedPrecisionOptimizer`: :func:`save` (its ``state_dict()``) and :func:`load`.

Layout (``format`` 2; format 1, from before per-tensor precision, loads as all float32)::

    optimizer:     the inner optimizer's state_dict (its state is the masters', compressed where the
                   state precision says so: bfloat16, or int8 codes with an ``<key>.absmax`` beside)
    masters:       per master, in pairing order: the float32 master, kahan's compensation term, or an
                   empty tensor (stochastic: the weight itself, in the model's state_dict, is all)
    precision:     None, or the :class:`~fxamp.training.lean.Workspace`'s modes, seed and counts
    scaler:        :meth:`LossScaler.state_dict`
    skipped_steps: this optimizer's skipped steps
    format:        version of this layout

Tensors are references, as in ``torch.optim.Optimizer.state_dict``; save or deep-copy them.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from . import quant

__all__ = ["FORMAT", "STATE_KEYS", "StateDictError", "save", "load", "save_own", "load_own"]

FORMAT = 2
STATE_KEYS = ("optimizer", "masters", "scaler", "skipped_steps", "format")


class StateDictError(ValueError, KeyError):
    """A checkpoint in the wrong format; a KeyError too, as a missing key was before (numpy's AxisError does the same)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


def save(opt: Any) -> Dict[str, Any]:
    ws = opt._ws
    return {
        "optimizer": opt.optimizer.state_dict(),
        "masters": [m.detach() if ws is None else ws.saved_master(m) for m in opt._masters],
        "precision": None if ws is None else ws.state_dict(opt._masters),
        "scaler": opt.scaler.state_dict(),
        "skipped_steps": opt.skipped_steps,
        "format": FORMAT,
    }


def load(opt: Any, state: Any) -> None:
    """Check ``state`` first (a bad one changes nothing), then restore it into ``opt``."""
    expected = (f"MixedPrecisionOptimizer.load_state_dict takes the dict MixedPrecisionOptimizer.state_dict() "
                f"returned (keys {', '.join(STATE_KEYS)})")
    if not isinstance(state, Mapping):
        raise TypeError(f"{expected}, not {type(state).__name__}; pass opt.state_dict(), or the entry "
                        f"of the checkpoint you saved it under")
    missing = sorted(set(STATE_KEYS) - set(state))
    if missing:
        hint = (" (this looks like the inner optimizer's state_dict: load it with opt.optimizer.load_state_dict)"
                if {"state", "param_groups"} <= set(state) else "")
        raise StateDictError(f"the state_dict lacks {missing}{hint}; {expected}")
    if state["format"] not in (1, FORMAT):
        raise ValueError(f"the state_dict has format {state['format']!r}, this version of fxamp reads 1 and {FORMAT}; "
                         f"{expected}")
    masters = state["masters"]
    if not isinstance(masters, (list, tuple)) or not all(torch.is_tensor(m) for m in masters):
        raise TypeError(f"state_dict['masters'] must be a list of tensors, not {type(masters).__name__}; {expected}")
    if len(masters) != len(opt._masters):
        kind = "float32 masters" if opt._ws is None else "masters"
        raise ValueError(f"the checkpoint has {len(masters)} {kind}, this optimizer "
                         f"{len(opt._masters)}; build it on the same model and policy")
    precision = state.get("precision")
    modes = [("fp32", "fp32")] * len(masters) if precision is None else [tuple(m[:2]) for m in precision["modes"]]
    ws = opt._ws
    if ws is None and any(m != ("fp32", "fp32") for m in modes):
        raise ValueError("the checkpoint has lean masters or state (masters=/state= other than 'fp32'); build the "
                         "MixedPrecisionOptimizer with the same masters=/state= (or precision=) to load it")
    for i, (have, saved, (mmode, _)) in enumerate(zip(opt._masters, masters, modes)):
        want = tuple(have.shape) if mmode != "stochastic" else (0,)
        if tuple(saved.shape) != want:
            raise ValueError(f"master {i} ({opt._name(have)}) has shape {tuple(have.shape)}, the "
                             f"checkpoint's {tuple(saved.shape)}; build the optimizer on the same model")
    opt._settle()
    if ws is not None:
        for m, (mmode, smode) in zip(opt._masters, modes):
            ws.set_modes(m, mmode, smode)
    opt.optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for m, saved in zip(opt._masters, masters):
            choice = None if ws is None else ws.choices[id(m)]
            if choice is not None and choice.state != "fp32" and m in opt.optimizer.state:
                quant.recompress(opt.optimizer.state[m], choice.state)
            elif choice is None and m in opt.optimizer.state:  # (saved from a master of other strides: torch's
                quant.conform(opt.optimizer.state[m], m)  # fused kernel would read the moments permuted)
            if choice is None or choice.master == "fp32":
                m.copy_(saved.to(m.device))
            elif choice.master == "kahan":
                choice.term.copy_(saved.to(choice.term.device))
    if ws is not None and precision is not None:
        ws.seed, ws.steps = int(precision["seed"]), int(precision["steps"])
        for m, entry in zip(opt._masters, precision["modes"]):
            c = ws.choices[id(m)]
            c.reason, c.lost, c.state_error, c.count = entry[2], entry[3], entry[4], int(entry[5])
    opt._refresh()
    if ws is not None and precision is None and not ws.config.auto:  # float32 masters saved: now as configured
        for m in opt._masters:
            ws.set_modes(m, ws.config.masters.value, ws.config.state.value)
    opt.scaler.load_state_dict(state["scaler"])
    opt._skipped = int(state["skipped_steps"])
    opt.scaler.forget(opt._client)
    opt._overflow = None


def save_own(opt: Any) -> Dict[str, Any]:
    """The wrapper's own state, beside an inner optimizer saved elsewhere (DCP): scaler and skipped steps."""
    return {"scaler": opt.scaler.state_dict(), "skipped_steps": opt.skipped_steps, "format": FORMAT}


def load_own(opt: Any, state: Mapping[str, Any]) -> None:
    """Restore :func:`save_own`'s dict (the inner optimizer loaded already)."""
    opt._settle()
    opt.scaler.load_state_dict(dict(state["scaler"]))
    opt._skipped = int(state["skipped_steps"])
    opt.scaler.forget(opt._client)
    opt._overflow = None
