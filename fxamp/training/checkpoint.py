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
    stateful:      the positions (in ``optimizer``'s state) of the parameters that have state; the others'
                   entries there are zeros, made only so the dict can be loaded into (below); None for
                   an inner optimizer that is not a ``torch.optim.Optimizer``

Tensors are references, as in ``torch.optim.Optimizer.state_dict``; save or deep-copy them.

``torch.distributed.checkpoint`` takes the optimizer itself (``dcp.save({"model": model, "optim": opt})``,
``dcp.load`` into fresh objects, FSDP2-sharded or not): it loads only into the tensors ``state_dict()``
already holds, and a fresh inner optimizer has no state.  So ``state_dict()`` holds a state entry for every
parameter that can have one: those without state yet get zeros, made by the inner optimizer's own step at
learning rate 0 on zero gradients (as torch's ``get_state_dict`` does) and taken out of it again, so the
optimizer itself does not change; ``stateful`` says which entries are real, and :func:`load` keeps only
those (gradients still pending are set aside for that step).  Where no such entry can be made (lean state, an
optimizer other than torch's own Adam, AdamW, SGD...), :func:`load` refuses a checkpoint whose state did not
arrive, in one line.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from . import quant
from ..dtypes import LOW
from ..info import origin_of
from .ownership import refuse_foreign_model

__all__ = ["FORMAT", "STATE_KEYS", "StateDictError", "save", "load", "save_own", "load_own", "fp32_state_dict"]

FORMAT = 2
STATE_KEYS = ("optimizer", "masters", "scaler", "skipped_steps", "format")


class StateDictError(ValueError, KeyError):
    """A checkpoint in the wrong format; a KeyError too, as a missing key was before (numpy's AxisError does the same)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


def save(opt: Any) -> Dict[str, Any]:
    ws = opt._ws
    inner, stateful = _with_every_state(opt)
    return {
        "optimizer": inner,
        "masters": [m.detach() if ws is None else ws.saved_master(m) for m in opt._masters],
        "precision": None if ws is None else ws.state_dict(opt._masters),
        "scaler": opt.scaler.state_dict(),
        "skipped_steps": opt.skipped_steps,
        "format": FORMAT,
        "stateful": stateful,
    }


#: torch's optimizers whose step at learning rate 0 on zero gradients changes no parameter (a subclass or another
#: optimizer may count steps or move parameters whatever the learning rate: it gets no zeros)
_ZERO_STEP = tuple(getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adamax", "NAdam", "RAdam", "RMSprop",
                                                            "Adadelta", "Adagrad") if hasattr(torch.optim, name))


def _with_every_state(opt: Any) -> Tuple[Dict[str, Any], Optional[List[int]]]:
    """The inner optimizer's ``state_dict()`` with zeros for the parameters that have no state yet, and the
    positions of those that have (see the module docstring); None for an optimizer that is not a
    ``torch.optim.Optimizer`` (its ``state_dict`` may not key its state by position)."""
    inner = opt.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return inner.state_dict(), None
    params = [p for group in inner.param_groups for p in group["params"]]
    stateful = [i for i, p in enumerate(params) if inner.state.get(p)]
    missing = [p for p in params if p.requires_grad and not inner.state.get(p)]
    if not missing or opt._ws is not None or type(inner) not in _ZERO_STEP:
        return inner.state_dict(), stateful
    lrs = [group.get("lr") for group in inner.param_groups]
    groups = inner.state_dict()["param_groups"]  # (their learning rates, not the step's 0)
    # gradients still pending (a save between step() and zero_grad()) are set aside: the zero step then skips their
    # parameters and leaves their state be (a parameter no loss reached, XLNet's mask_emb, had no entry, and
    # torch.distributed.checkpoint refused to load the checkpoint into a fresh optimizer, which has one)
    pending = {p: p.grad for p in params if p.grad is not None}
    try:
        for p in pending:
            p.grad = None
        for group in inner.param_groups:
            if "lr" in group:  # a step that moves nothing: learning rate 0, zero gradients
                group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        for p in missing:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            inner.step()
        return {**inner.state_dict(), "param_groups": groups}, stateful
    finally:
        for group, lr in zip(inner.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in missing:
            p.grad = None
            inner.state.pop(p, None)
        for p, grad in pending.items():
            p.grad = grad


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
            raise ValueError(f"master {i} ({opt._engine.name(have)}) has shape {tuple(have.shape)}, the "
                             f"checkpoint's {tuple(saved.shape)}; build the optimizer on the same model")
    opt.scaler.check_state_dict(state["scaler"])  # (loaded last, below: a refusal there would come too late)
    inner = state["optimizer"]
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if isinstance(groups, (list, tuple)) and all(isinstance(g, Mapping) and "params" in g for g in groups):
        # (torch's own load would refuse it too, but after a lean wrapper's modes were switched above)
        saved_sizes = [len(g["params"]) for g in groups]
        sizes = [len(g["params"]) for g in opt.optimizer.param_groups]
        if saved_sizes != sizes:
            raise ValueError(f"the checkpoint's optimizer has param groups of {saved_sizes} parameters, this one "
                             f"{sizes}; build the optimizer with the same param groups, in the same order")
    if state.get("stateful") is not None and isinstance(inner, Mapping) and isinstance(inner.get("state"), Mapping):
        # only the real entries (the others are zeros a load could fill: see save)
        stateful = [int(i) for i in state["stateful"]]
        lost = [i for i in stateful if i not in inner["state"]]
        if lost:
            raise StateDictError(
                f"the checkpoint holds optimizer state for {len(stateful)} parameters, but this dict arrived without "
                f"it for {len(lost)} (torch.distributed.checkpoint loads only into tensors the fresh optimizer's "
                f"state_dict() holds, and this one holds none for them): save and load with "
                f"fxamp.sharded_state_dict(model, opt), or torch.save(opt.state_dict())")
        inner = {**inner, "state": {i: v for i, v in inner["state"].items() if int(i) in stateful}}
    opt._engine.settle()
    if ws is not None:
        for m, (mmode, smode) in zip(opt._masters, modes):
            ws.set_modes(m, mmode, smode)
    opt.optimizer.load_state_dict(inner)
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
        ws.restore(precision["seed"], precision["steps"])
        for m, entry in zip(opt._masters, precision["modes"]):
            c = ws.choices[id(m)]
            c.reason, c.lost, c.state_error, c.count = entry[2], entry[3], entry[4], int(entry[5])
    _refresh(opt)
    if ws is not None and precision is None and not ws.config.auto:  # float32 masters saved: now as configured
        for m in opt._masters:
            ws.set_modes(m, ws.config.masters.value, ws.config.state.value)
    opt.scaler.load_state_dict(state["scaler"])
    opt._engine.restore(state["skipped_steps"])


def _refresh(opt: Any) -> None:
    """Round the loaded masters into the low-precision parameters (a lean master's weight is loaded as it is)."""
    pairs = [(lo, m) for lo, m in zip(opt._lows, opt._masters) if opt._ws is None or not opt._ws.lean(m)]
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([lo for lo, _ in pairs], [m for _, m in pairs])


def save_own(opt: Any) -> Dict[str, Any]:
    """The wrapper's own state, beside an inner optimizer saved elsewhere (DCP): scaler and skipped steps."""
    return {"scaler": opt.scaler.state_dict(), "skipped_steps": opt.skipped_steps, "format": FORMAT}


def load_own(opt: Any, state: Mapping[str, Any]) -> None:
    """Restore :func:`save_own`'s dict (the inner optimizer loaded already)."""
    opt._engine.settle()
    opt.scaler.load_state_dict(dict(state["scaler"]))
    opt._engine.restore(state["skipped_steps"])


def fp32_state_dict(opt: Any, model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """``model.state_dict()`` in float32, each low-precision parameter's entry its master's float32 value (one
    without a master, frozen or not in the optimizer: its float32 original while alive, else widened).

    Matched by name (``named_parameters``), not by the identity of the state_dict's values: a module
    converted in place gives float32 copies there (``fxamp.convert_``'s state_dict hooks)."""
    refuse_foreign_model(model, [*opt._lows, *opt.master_params()])
    master_of = {id(low): m for low, m in zip(opt._lows, opt._masters)}
    by_name = {name: master_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
               if id(p) in master_of}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, value in model.state_dict(keep_vars=True).items():
        if key in by_name:
            m = by_name[key]
            out[key] = m.detach() if opt._ws is None else opt._ws.value(m)
        elif not isinstance(value, torch.Tensor):
            out[key] = value
        elif value.dtype in LOW:  # a weight the optimizer does not step (frozen, left out): its float32 original
            original = origin_of(value)  # while alive and still this weight's rounding, else the weight widened
            out[key] = value.detach().float() if original is None else original.detach()
        else:
            out[key] = value.detach()
    return out
