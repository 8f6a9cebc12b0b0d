"""Step many small float32 masters as a few tensors: one per param group and trailing shape.

On CPU a torch optimizer's step costs a few microseconds of dispatch per tensor and op, whatever
the tensor's size: a 200-layer MLP of ``Linear(16, 16)`` has 400 parameters, and its foreach SGD
step (three ops per tensor on CPU, which has no multi-tensor kernels) takes 2 ms for 51 K numbers.
So ``MixedPrecisionOptimizer`` stores the small masters it creates (at most ``_CAT_NUMEL``
elements, contiguous, on CPU) as consecutive rows of one float32 tensor per (param group,
trailing shape), a :class:`Pack` (apex's ``FP16_Optimizer(flat_master=True)`` did the same for
a whole group), and steps the pack in their place::

    the group's "params" list, for the call only: its other parameters, then each pack's tensor
    the pack's .grad: the rows of the float32 gradient segment its members' gradients fill already
    the pack's optimizer state: one tensor per state tensor the members have (momentum, moments)

Everything outside the call sees the members: the inner optimizer's ``param_groups`` and
``state`` hold them, and their state tensors shaped like them are views of the pack's, so
``state_dict()`` and checkpoints are what they were.  Scalar state (Adam's ``step``) is copied
to every member after the step, so a member stepped alone later (a missing gradient, a segmented
step) never shares a counter with the others.

It is the same step, bitwise: the stock torch optimizers (:data:`~fxamp.training.step.PER_PARAMETER`)
update each element from its own gradient and state with the group's hyperparameters.  A pack
is stepped only when every member has its gradient in the segment (else its members are stepped
one by one, as before) and its state is the one the last packed step left, or can be gathered
from the members (same keys, equal scalars): after a member was stepped alone, or a state_dict
was loaded, the members' state is gathered again (a copy); when it cannot be (the members' step
counts differ), the members are stepped one by one.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["Pack", "step_with_packs"]


class Pack:
    """Small float32 masters of one param group with the same shape but for dim 0, stored as the
    consecutive rows of ``flat`` (their ``.data`` are views of it), in the order of ``members``.

    ``grad()`` gives the float32 gradient for ``flat`` (rows of the wrapper's gradient segment), or
    None when a member's ``.grad`` is not the view the segment gave it (a missing or sparse
    gradient, or one replaced by the user).
    """

    __slots__ = ("group", "members", "flat", "bounds", "grad", "state", "_dicts", "_holder", "_shaped", "_scalars")

    def __init__(self, group: int, members: List[nn.Parameter], grad: Callable[[], Optional[torch.Tensor]]) -> None:
        self.group = group
        self.members = members
        self.grad = grad
        with torch.no_grad():
            self.flat = nn.Parameter(torch.cat([m.detach() for m in members]))
            self.bounds = []
            start = 0
            for m in members:
                end = start + m.shape[0]
                m.data = self.flat.data[start:end]  # the member keeps its identity; its numbers now live in flat
                self.bounds.append((start, end))
                start = end
        self.state: Optional[Dict[str, Any]] = None  # flat's optimizer state between packed steps; None: gather
        self._dicts: Optional[List[Dict[str, Any]]] = None  # the members' state dicts the last packed step left
        self._holder: Any = None  # the optimizer's state mapping they were left in
        self._shaped: Dict[str, int] = {}  # key -> id of flat's state tensor the members' entries view
        self._scalars: List[str] = []  # keys of other tensors: copied to every member after a step

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Pack":
        """A copy whose members are views of its own ``flat`` again (a Parameter's deep copy is a clone)."""
        new = Pack.__new__(Pack)
        memo[id(self)] = new
        for name in Pack.__slots__:
            setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        with torch.no_grad():
            for m, (start, end) in zip(new.members, new.bounds):
                m.data = new.flat.data[start:end]
        return new

    def invalidate(self) -> None:
        """The members were stepped (or their state changed) without the pack: gather it again."""
        self.state = self._dicts = None

    def ready(self, state: Any) -> bool:
        """Whether the pack can be stepped on ``state`` (the inner optimizer's), gathering the
        members' state into the pack's when the last packed step did not leave it."""
        if self.state is not None and self._holder is state and all(
                state.get(m) is d for m, d in zip(self.members, self._dicts)) and all(
                torch.equal(self._dicts[0][k], self.state[k]) for k in self._scalars):
            return True  # (the scalars: unless the inner optimizer was stepped behind the wrapper's back)
        self.invalidate()
        dicts = [state.get(m) for m in self.members]
        if not any(dicts):
            self.state = {}  # no step yet: the inner optimizer initializes the pack's state
            return True
        if not all(dicts) or any(d.keys() != dicts[0].keys() for d in dicts):
            return False
        gathered: Dict[str, Any] = {}
        with torch.no_grad():
            for key in dicts[0]:
                values = [d[key] for d in dicts]
                first = values[0]
                if all(torch.is_tensor(v) and v.shape == m.shape for v, m in zip(values, self.members)):
                    if any(v.dtype != first.dtype or v.device != first.device for v in values):
                        return False
                    gathered[key] = torch.cat(values)
                elif all(torch.is_tensor(v) and v.dim() == 0 for v in values):
                    if not bool(torch.stack([v.to(first.device, first.dtype) for v in values]).eq(first).all()):
                        return False  # e.g. step counts that differ: the members go on one by one
                    gathered[key] = first.clone()
                elif all(not torch.is_tensor(v) and type(v) is type(first) and v == first for v in values):
                    gathered[key] = first
                else:
                    return False
        self.state = gathered
        return True

    def spread(self, state: Any) -> None:
        """After a packed step: leave each member a state dict whose tensors shaped like it are views
        of the pack's, and whose other entries are copies."""
        flat_state = self.state
        if not flat_state:  # stateless (SGD without momentum): the members get no entries either
            self._dicts, self._holder, self._shaped, self._scalars = [state.get(m) for m in self.members], state, {}, []
            return
        shaped = {k: id(v) for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == self.flat.shape}
        if self._dicts is None or self._holder is not state or shaped != self._shaped:
            self._dicts = []
            for m, (start, end) in zip(self.members, self.bounds):
                d = {}
                for k, v in flat_state.items():
                    d[k] = v[start:end] if k in shaped else v.clone() if torch.is_tensor(v) else v
                state[m] = d
                self._dicts.append(d)
            self._holder, self._shaped = state, shaped
            self._scalars = [k for k, v in flat_state.items() if k not in shaped and torch.is_tensor(v)]
            return
        with torch.no_grad():
            for k in self._scalars:
                torch._foreach_copy_([d[k] for d in self._dicts], [flat_state[k]] * len(self._dicts))
        for k, v in flat_state.items():
            if not torch.is_tensor(v):
                for d in self._dicts:
                    d[k] = v


def step_with_packs(optimizer: Any, packs: Sequence[Pack]) -> None:
    """``optimizer.step()``, with each pack that can be (see the module docstring) stepped in place of
    its members; the others are invalidated and their members stepped one by one."""
    state = optimizer.state
    active, grads = [], []
    for pack in packs:
        grad = pack.grad()
        if grad is not None and pack.ready(state):
            active.append(pack)
            grads.append(grad)
        else:
            pack.invalidate()
    if not active:
        optimizer.step()
        return
    groups = optimizer.param_groups
    lists = [g["params"] for g in groups]
    packed: Dict[int, List[Pack]] = {}
    for pack in active:
        packed.setdefault(pack.group, []).append(pack)
    try:
        for gi, group_packs in packed.items():
            inside = {id(m) for pack in group_packs for m in pack.members}
            groups[gi]["params"] = [p for p in lists[gi] if id(p) not in inside] + [pack.flat for pack in group_packs]
        for pack, grad in zip(active, grads):
            pack.flat.grad = grad
            state[pack.flat] = pack.state
        optimizer.step()
    except BaseException:
        for pack in active:
            pack.invalidate()
        raise
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params
        for pack in active:
            pack.flat.grad = None
            flat_state = state.pop(pack.flat, None)
            if pack.state is not None:
                pack.state = flat_state if flat_state is not None else {}
    for pack in active:
        pack.spread(state)
