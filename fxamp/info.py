"""What ``convert`` leaves on a module: :class:`ConversionInfo`, read back by :func:`conversion_info`.

A low module (it imports only the policy) so that the training side can read a module's policy
without importing the conversion pipeline.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from .dtypes import LOW
from .policy import Policy

__all__ = ["ConversionInfo", "INFO_ATTR", "MASTERED", "ORIGIN", "conversion_info", "policy_of", "remember_origin",
           "remember_master", "origin_of", "take_origin", "held_origins", "release_origins", "release_originals",
           "watch_for_masters", "origins_for_copy", "hold_origins", "remember_loaded", "take_loaded"]


@dataclass(frozen=True)
class ConversionInfo:
    """What ``convert`` did; kept on the converted module (through deepcopy and pickling)."""

    policy: Policy
    frontend: str  # "fx" or "export"
    notes: Tuple[str, ...] = ()
    # a module that captures at its first call (fxamp.conversion.lazy.LazyConverted): the call signatures it holds a
    # graph for, in the order captured; None for a module captured by convert() itself
    signatures: Optional[Tuple[str, ...]] = None


#: the attribute of a converted module that holds its ConversionInfo
INFO_ATTR = "_fxamp_info"


def conversion_info(module: nn.Module) -> Optional[ConversionInfo]:
    """How fxamp converted ``module`` (policy, front end, notes), or None if it did not."""
    info = getattr(module, INFO_ATTR, None)
    return info if isinstance(info, ConversionInfo) else None


def policy_of(module: nn.Module) -> Optional[Policy]:
    """The policy a module was converted with, or None if fxamp did not convert it."""
    info = conversion_info(module)
    return None if info is None else info.policy


#: set to True on a float16/bfloat16 parameter by the ``MixedPrecisionOptimizer`` that keeps its
#: float32 master (and on the master); the converted module's first-gradient check reads it.  The
#: two wings meet here: conversion installs the check, training sets the mark.
MASTERED = "_fxamp_mastered"

#: what a converted module's low-precision parameters without float32 masters get at their first gradient
NO_MASTERS = ("fxamp: the converted module's {dtype} parameters got gradients but no MixedPrecisionOptimizer "
              "keeps float32 masters for them: a plain torch optimizer would update them in place in {dtype}, "
              "without masters or loss scaling; wrap it: fxamp.MixedPrecisionOptimizer(torch.optim.AdamW("
              "amp.parameters()), model=amp) and call opt.backward(loss), or fxamp.initialize(model, optimizer)")


def watch_for_masters(params: Iterable[torch.Tensor]) -> None:
    """Warn once, at the first gradient any of ``params`` gets, if none has a float32 master by then.

    ``params``: a converted module's new parameters; its float16/bfloat16 ones that require grad
    are watched (conversion made them: the hooks are on fxamp's own tensors).  The hooks remove themselves after that first gradient: one check
    per module, nothing on later backward passes.  A copy of the module (deepcopy, pickling) does
    not keep them: tensors' hooks are not copied.
    """
    unique = {id(p): p for p in params if isinstance(p, nn.Parameter) and p.requires_grad
              and p.dtype in LOW}  # (tied parameters: once)
    params = list(unique.values())
    if not params:
        return
    handles: List[torch.utils.hooks.RemovableHandle] = []

    def first_gradient(param: torch.Tensor) -> None:
        if not handles:
            return  # (another parameter of this module was first, in this same backward)
        for handle in handles:
            handle.remove()
        handles.clear()
        if not any(getattr(p, MASTERED, False) for p in params):
            warnings.warn(NO_MASTERS.format(dtype=str(param.dtype).removeprefix("torch.")), RuntimeWarning,
                          stacklevel=_user_stacklevel())

    handles.extend(p.register_post_accumulate_grad_hook(first_gradient) for p in params)


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for its caller, naming the first frame outside torch and fxamp: the user's
    ``loss.backward()`` line, not torch's autograd file the hook runs under; 1 (the caller) where there is none
    (a backward run on an autograd device thread has no user frame)."""
    internal = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


#: set on a float16/bfloat16 parameter that conversion made from a float32 one: a reference to that
#: float32 tensor, so a ``MixedPrecisionOptimizer`` built later takes its master from the exact float32
#: values instead of widening the rounded copy.  ``convert`` holds it weakly (the user's original
#: model holds it; an inference-only user keeps no float32 copy alive; once the original model is gone,
#: ``convert(Net())`` with no other reference to it, the master is widened from the low-precision copy,
#: as before); ``convert_`` holds it (it took the tensor out of the user's model) until the optimizer
#: takes it as the master itself, without a copy, or ``fxamp.release_originals`` lets go of it.  From
#: then on it reads that optimizer's master (:func:`remember_master`, weakly): the float32 truth a
#: converted module's ``state_dict`` gives back (``save_pretrained``, ``torch.save``) while the weight
#: is still its rounding.
ORIGIN = "_fxamp_origin"


class _Origin:
    """A reference to the float32 tensor a low-precision parameter was made from: weak (the user's
    original model holds it: ``convert``), or strong (``convert_`` replaced it in the user's model, so
    conversion holds it until a ``MixedPrecisionOptimizer`` takes it as the master, without a copy).

    Pickling drops it: it unpickles as a dead reference (a deep copy shares it where the parameter's
    attributes are copied; torch's ``Parameter.__deepcopy__`` does not copy them).  A module that must
    keep the float32 values through copies (``convert_``'s, whose ``state_dict`` gives them) takes them
    along itself: :func:`origins_for_copy`, :func:`hold_origins`."""

    __slots__ = ("ref", "held", "read", "stamp")

    def __init__(self, tensor: Optional[torch.Tensor], strong: bool = False,
                 read: Optional[Callable[[], Optional[torch.Tensor]]] = None,
                 stamp: Optional[Tuple[int, int]] = None) -> None:
        self.ref = None if tensor is None or strong else weakref.ref(tensor)
        self.held = tensor if strong else None
        self.read = read  # (a master: its float32 value, computed when asked; None once its optimizer is gone)
        # a copied value (hold_origins): the low tensor's stamp (_stamp) then; valid while it is unchanged, since a
        # lean master's value (low plus a term) need not round to low
        self.stamp = stamp

    def __call__(self) -> Optional[torch.Tensor]:
        if self.held is not None:
            return self.held
        if self.read is not None:
            return self.read()
        return None if self.ref is None else self.ref()

    def __deepcopy__(self, memo: dict) -> "_Origin":
        return self

    def __reduce__(self):
        return (_Origin, (None,))


def remember_origin(low: torch.Tensor, original: torch.Tensor, *, hold: bool = False,
                    stamp: Optional[Tuple[int, int]] = None) -> None:
    """Note on ``low`` (a float16/bfloat16 copy conversion made) the float32 tensor it was rounded from.

    hold: keep ``original`` alive (nothing else holds it: in-place conversion) until :func:`take_origin`.
    stamp: ``_stamp(low)`` when ``original`` is its float32 value though not its rounding (a lean master's,
    copied: :func:`hold_origins`); it stays valid while ``low`` is unchanged (or holds its rounding)."""
    if low.dtype in LOW and original.dtype == torch.float32 and low.shape == original.shape:
        setattr(low, ORIGIN, _Origin(original, strong=hold, stamp=stamp))


def remember_loaded(low: torch.Tensor, value: torch.Tensor) -> None:
    """Keep a copy of the float32 ``value`` being loaded into ``low`` (``load_state_dict`` of a float32 checkpoint into
    a converted module) as its float32 original, held: a master built later takes it, and one already built
    takes it at its next step (:func:`take_loaded`); valid while ``low`` holds its rounding.  A copy: the user's
    checkpoint tensor must not become a master stepped in place."""
    if low.dtype in LOW and value.dtype == torch.float32 and value.shape == low.shape:
        old = getattr(low, ORIGIN, None)
        kept = value.detach().to(device=low.device, copy=True)
        setattr(low, ORIGIN, _Origin(kept, strong=True, read=old.read if isinstance(old, _Origin) else None))


def take_loaded(low: torch.Tensor) -> Optional[torch.Tensor]:
    """The float32 value loaded into ``low`` since an optimizer made its master (:func:`remember_loaded`), if ``low``
    still holds its rounding, else None; ``low`` reads its master again from now on."""
    origin = getattr(low, ORIGIN, None)
    if not isinstance(origin, _Origin) or origin.held is None or origin.read is None:
        return None
    value = origin_of(low)
    setattr(low, ORIGIN, _Origin(None, read=origin.read))
    return value


def _stamp(low: torch.Tensor) -> Tuple[int, int]:
    """What changes when ``low``'s values may have: its version counter (in-place writes: a step, a load) and its
    memory (``.data =``, which keeps the counter)."""
    return low._version, low.data_ptr()


def remember_master(low: torch.Tensor, read: Callable[[], Optional[torch.Tensor]]) -> None:
    """Note on ``low`` that its float32 value now lives in a master: ``read()`` gives it, or None once the
    optimizer that keeps it is gone or ``low`` no longer holds its rounding (loaded since).  ``read`` must
    not keep that optimizer alive; it checks the rounding itself (a lean master's value is ``low`` plus a
    term, which may exceed half a unit of ``low``)."""
    if low.dtype in LOW:
        setattr(low, ORIGIN, _Origin(None, read=read))


def origins_for_copy(params: Iterable[torch.Tensor]) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
    """``(low, float32)`` for each of ``params`` whose float32 value :func:`origin_of` knows: what a copy of
    their module (deepcopy, pickling: its ``__reduce_ex__`` returns them) takes along, for :func:`hold_origins`.

    A copy's parameters lose the reference (``Parameter.__deepcopy__`` drops attributes, pickling drops
    :class:`_Origin`, and an optimizer's master is not in the module at all), so its ``state_dict`` would give
    the low-precision weights widened, not the float32 values the module's gives; the copy holds those values
    instead (copied with it: the master's value at the time of the copy), and a ``MixedPrecisionOptimizer`` built
    on the copy takes them as its masters, as it takes a fresh ``convert_``'s originals."""
    unique = {id(p): p for p in params}  # (tied parameters: once)
    pairs = ((p, origin_of(p)) for p in unique.values() if p.dtype in LOW)
    return tuple((low, value.detach()) for low, value in pairs if value is not None)


def hold_origins(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Let each copied low-precision parameter hold its copied float32 value (:func:`origins_for_copy`)."""
    for low, value in pairs:
        remember_origin(low, value, hold=True, stamp=_stamp(low))


def held_origins(params: Iterable[torch.Tensor]) -> int:
    """How many of ``params`` hold their float32 original alive (``remember_origin(..., hold=True)``)."""
    return sum(1 for p in params if isinstance(getattr(p, ORIGIN, None), _Origin) and getattr(p, ORIGIN).held
               is not None)


def release_origins(params: Iterable[torch.Tensor]) -> int:
    """Let go of the float32 originals ``params`` hold (inference needs none); returns how many."""
    count = 0
    for p in params:
        origin = getattr(p, ORIGIN, None)
        if isinstance(origin, _Origin) and origin.held is not None:
            if origin.read is not None:  # (a value loaded over a master's weight: the master is read again)
                setattr(p, ORIGIN, _Origin(None, read=origin.read))
            else:
                delattr(p, ORIGIN)
            count += 1
    return count


def release_originals(model: nn.Module) -> int:
    """Free the float32 originals an in-place converted model (``fxamp.convert_``, O2/O3), or a converted model a
    float32 checkpoint was loaded into (:func:`remember_loaded`), holds for masters: inference needs none.  Returns how many were let go."""
    return release_origins(model.parameters())


def take_origin(low: torch.Tensor) -> Tuple[Optional[torch.Tensor], bool]:
    """``(original, owned)``: :func:`origin_of`, and whether conversion alone held it (then ``low`` lets go
    of it: the caller may use it as it is, no copy needed)."""
    original = origin_of(low)
    origin = getattr(low, ORIGIN, None)
    owned = original is not None and isinstance(origin, _Origin) and origin.held is not None
    if isinstance(origin, _Origin) and origin.held is not None:
        delattr(low, ORIGIN)  # (also a stale one: the parameter was loaded or trained since)
    return original, owned


def origin_of(low: torch.Tensor) -> Optional[torch.Tensor]:
    """The float32 tensor ``low`` was rounded from (the original, or the master an optimizer steps for it), if
    it is still alive and ``low`` still holds exactly its rounding (a parameter loaded since, or trained by
    another optimizer, no longer does); else None."""
    origin = getattr(low, ORIGIN, None)
    original = origin() if isinstance(origin, _Origin) else None
    if original is None or original.shape != low.shape or original.dtype != torch.float32:
        return None
    if origin.read is not None and origin.held is not None:  # a float32 value loaded over a master's weight:
        with torch.no_grad():  # it while the weight is its rounding, else (stepped since) the master
            same = torch.equal(original.detach().to(device=low.device, dtype=low.dtype), low.detach())
        return original if same else origin.read()
    if origin.read is not None and origin.held is None:  # a master: its reader checked (remember_master)
        return original
    if origin.stamp is not None and origin.stamp == _stamp(low):  # a copied value, low unchanged since
        return original
    with torch.no_grad():
        if not torch.equal(original.detach().to(device=low.device, dtype=low.dtype), low.detach()):
            return None
    return original
