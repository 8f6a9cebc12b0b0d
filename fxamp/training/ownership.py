"""Which wrapper owns which tensors: the marks a :class:`~fxamp.MixedPrecisionOptimizer` sets, and the refusals they allow.

* a low-precision parameter with a float32 master is marked :data:`fxamp.info.MASTERED`: the
  converted module's first-gradient check (``fxamp.info.watch_for_masters``) then stays quiet; and
  its :data:`fxamp.info.ORIGIN` reads the master's float32 value from then on (weakly: a dropped
  optimizer's masters are freed), so the module's ``state_dict`` gives the masters, not their rounding;
* a master is marked too, so a second wrapper around the same torch optimizer (whose
  ``param_groups`` now hold the first wrapper's masters) is refused: it would step masters that
  never get gradients and report success;
* the inner torch optimizer's ``state`` becomes a :class:`MasterState`: the same dict, keyed by the masters, where
  a model's low-precision parameter reads its master's entry (``opt.state[p]["exp_avg"]``), not a new empty one;
* ``fp32_state_dict(model)`` refuses a model none of whose parameters the optimizer steps, and so does
  ``MixedPrecisionOptimizer(optimizer, model=model)`` (:func:`refuse_unheld_model`);
* a model converted in place whose frozen parameters still hold their float32 originals, a sizable share of its
  memory (a base model under LoRA), is named once (:func:`note_frozen_originals`): no optimizer will take them.

The marks are plain attributes on tensors the wrapper pairs; nothing global is kept.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from typing import Any, Iterable, List, Optional, Sequence

import torch
import torch.nn as nn

from ..dtypes import LOW
from ..errors import OptimizerStateError
from ..info import MASTERED, held_origins, origin_of, remember_master

__all__ = ["MasterState", "master_state", "mark_master", "refuse_wrapped", "refuse_foreign_model", "refuse_unheld_model", "originals_held",
           "note_frozen_originals"]

#: the share of a model's parameter memory frozen parameters' held float32 originals must reach to be named
FROZEN_ORIGINALS_SHARE = 0.1

#: set on a float32 master by the wrapper that made or adopted it
_MASTER = "_fxamp_master"


def mark_master(low: torch.Tensor, master: torch.Tensor, workspace: Any = None) -> None:
    """Note that ``master`` is the float32 master of ``low`` (a lean one: ``workspace`` holds its value)."""
    setattr(low, MASTERED, True)
    setattr(master, _MASTER, True)
    remember_master(low, _MasterValue(low, master, workspace))


class _MasterValue:
    """The float32 value of ``low``'s master, read when asked (``fxamp.info.origin_of``): None once the master
    is gone, or when ``low`` no longer holds its rounding (a weight loaded into the model since).

    Weak references only: the model's parameter must not keep the optimizer's masters alive."""

    __slots__ = ("low", "master", "workspace")

    def __init__(self, low: torch.Tensor, master: torch.Tensor, workspace: Any) -> None:
        self.low = weakref.ref(low)
        self.master = weakref.ref(master)
        self.workspace = None if workspace is None else weakref.ref(workspace)

    def __call__(self) -> Optional[torch.Tensor]:
        low, master = self.low(), self.master()
        workspace = None if self.workspace is None else self.workspace()
        if low is None or master is None or (self.workspace is not None and workspace is None):
            return None
        if workspace is not None and workspace.lean(master):
            return workspace.value(master)  # (low + its term: computed from the weight itself)
        with torch.no_grad():
            return master.detach() if torch.equal(master.detach().to(low.dtype), low.detach()) else None


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


def originals_held(model: nn.Module, optimizer: Any, paired: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The low-precision parameters of ``model``, but those ``paired`` with a master, whose float32 original
    (``fxamp.info.origin_of``) ``optimizer`` holds: it was built on the model before conversion.  Unless they become
    masters (``adopt_masters``, as ``fxamp.initialize`` does) before the first step, that step trains the originals,
    not the model.  (Usually every low-precision parameter is paired: no weight is read.)"""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    skip = {id(p) for p in paired}
    return [p for p in dict.fromkeys(model.parameters()) if p.dtype in LOW and id(p) not in skip
            and id(origin_of(p)) in held]


class MasterState(defaultdict):
    """A torch optimizer's ``state`` (a ``defaultdict(dict)`` keyed by the tensors it steps) under a wrapper: a
    missing low-precision parameter with a master reads the master's entry.  A user writes ``opt.state[p]`` for
    a parameter ``p`` of their model, as with any torch optimizer; a plain defaultdict would insert an empty
    entry for ``p`` (which the optimizer never steps) and answer ``{}``.

    ``lows``/``masters``: the wrapper's own lists of pairs (the same objects: pairs added later are seen, and a
    copy or pickle of the wrapper and its optimizer shares them); searched only for a low-precision key."""

    def __init__(self, state: Any, lows: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
        super().__init__(dict, state)
        self.lows, self.masters = lows, masters

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, torch.Tensor) and key.dtype in LOW:
            for low, master in zip(self.lows, self.masters):
                if low is key:
                    return self[master]
        return super().__missing__(key)

    def __reduce__(self) -> Any:
        return (type(self), (dict(self), self.lows, self.masters))


def master_state(optimizer: Any, lows: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    """Make ``optimizer.state`` a :class:`MasterState` over the same entries, where it is torch's defaultdict held
    as an attribute (a duck-typed optimizer's own mapping, or a property such as a Lookahead's reading its inner
    optimizer's, is left as it is); again after its ``load_state_dict`` replaced it."""
    state = getattr(optimizer, "__dict__", {}).get("state")
    if type(state) is defaultdict and state.default_factory is dict:
        optimizer.state = MasterState(state, lows, masters)


def note_frozen_originals(model: nn.Module) -> Optional[str]:
    """Warn (and return the text) when frozen parameters of ``model`` (``requires_grad=False``, stored low) hold their
    float32 originals, together at least :data:`FROZEN_ORIGINALS_SHARE` of its parameter memory.

    ``fxamp.convert_`` holds each original until an optimizer takes it as a master, so that ``state_dict()`` gives
    the user's float32 weights back; a frozen parameter is stepped by no optimizer, so its original stays for the
    model's life: 6 bytes a parameter where a float32 model takes 4 (a frozen 7B base under LoRA: 28 GB more).
    Keeping them is right by default (nothing the user had is lost); the user who does not need them is told how
    to let them go."""
    params = list({id(p): p for p in model.parameters()}.values())
    holding = [p for p in params if p.dtype in LOW and held_origins([p])]
    frozen = [p for p in holding if not p.requires_grad]
    held = sum(p.numel() * 4 for p in frozen)
    stored = sum(p.numel() * p.element_size() for p in params) + sum(p.numel() * 4 for p in holding)
    if not frozen or held < FROZEN_ORIGINALS_SHARE * stored:
        return None
    low = frozen[0].dtype
    text = (f"fxamp.MixedPrecisionOptimizer: {len(frozen)} frozen parameters of the model (requires_grad=False) hold "
            f"their float32 originals, {_size(held)} beside their {str(low).replace('torch.', '')} storage "
            f"({held / stored:.0%} of the model's parameter memory), so that state_dict() gives them back exactly and "
            f"a later add_param_group starts their masters from them. If they stay frozen (a base model under LoRA), "
            f"fxamp.release_originals(model) frees that memory; state_dict() then gives their "
            f"{str(low).replace('torch.', '')} values widened")
    warnings.warn(text, UserWarning, stacklevel=3)
    return text


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"
