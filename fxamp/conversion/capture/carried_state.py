"""Tensors a forward keeps in plain attributes from one call to the next (``if self.state is not None: x = x +
self.state`` ... ``self.state = y.detach()``; RecurrentGemma's ``conv1d_state`` and ``recurrent_states``).

A graph runs every call as the captured call ran: it read the attribute once, at capture, and never writes it,
so a converted module would drop the state the model carries, silently.  Such a capture is refused.  Only code
with a function that stores ``self.<name>`` after reading that attribute's value (not its shape, nor a test
against None) is watched while traced (``sys.setprofile``): each ``nn.Module.__setattr__`` of a tensor (a proxy, a
fake tensor) under such a name counts as carried state when a frame of the model's code on the stack read the
name's value before it, the value of the call before.  A cache a helper fills and forward reads after it (a
rotary table), a table grown for a longer sequence and a stash for a look after the call are not refused.  After
every trace, an attribute it set to a torch.fx proxy or a fake tensor is put back (:func:`undo_proxies`): a proxy
left in the user's module would reach the next call.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor  # (imported by torch itself)

from ...errors import TraceError
from ..bytecode import reads_value_before, stores_after_read

__all__ = ["CarriedState", "StateWatch", "carried_candidates", "undo_proxies"]

_SETATTR = nn.Module.__setattr__.__code__
_MISSING = object()


class CarriedState(TraceError):
    """A capture refused because the model keeps a tensor in a plain attribute from one call to the next."""

    def __init__(self, message: str, short: str, module: nn.Module) -> None:
        super().__init__(message, short=short)
        self.module = module


def carried_candidates(codes: Iterable[types.CodeType]) -> FrozenSet[str]:
    """The attribute names some function of the code stores on its ``self`` after reading that attribute's value
    (``bytecode.stores_after_read``): the only ones whose writes are watched (most models: none, and the trace is
    not watched)."""
    return frozenset(name for code in codes for name in stores_after_read(code))


class StateWatch:
    """What a profiler sees of the model's attribute writes during one trace (``see`` each call event)."""

    def __init__(self, names: FrozenSet[str], codes: Iterable[types.CodeType]) -> None:
        self.names = names
        self.codes = frozenset(codes)
        self.seen: Set[Tuple[int, str]] = set()  # (module id, name): its first write is the one that tells
        self.carried: List[Tuple[nn.Module, str, str]] = []  # (module, name, where it was set)

    def see(self, frame: Any) -> None:
        """A ``call`` event's frame: note a tensor written to a plain attribute the code reads."""
        if frame.f_code is not _SETATTR:
            return
        local = frame.f_locals
        module, name, value = local.get("self"), local.get("name"), local.get("value")
        if name not in self.names or not isinstance(value, (torch.Tensor, fx.Proxy)) or \
                not isinstance(module, nn.Module) or name in module._parameters or name in module._buffers:
            return
        if (id(module), name) not in self.seen:
            self.seen.add((id(module), name))
            where = self._reader(frame.f_back, name)
            if where is not None:
                self.carried.append((module, name, where))

    def _reader(self, frame: Any, name: str) -> Optional[str]:
        """Where a frame of the model's code on the stack read ``name``'s value before its current instruction."""
        while frame is not None:
            if frame.f_code in self.codes and reads_value_before(frame.f_code, name, frame.f_lasti):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def error(self) -> Optional[CarriedState]:
        """The refusal of a capture whose model carries a tensor from one call to the next, or None."""
        if not self.carried:
            return None
        module, name, where = self.carried[0]
        cls = type(module).__name__
        return CarriedState(
            f"{cls}'s forward keeps a tensor in self.{name} from one call to the next (set at {where}, after the "
            f"code read the value the call before left there): a graph runs every call as the captured call ran "
            f"and writes no attribute, so the converted module would drop that state. What to do: convert in place "
            f"(fxamp.convert_), where the block that holds it runs as written, or keep the state in a buffer "
            f"(register_buffer) updated in place (self.{name}.copy_(...)), which a graph records",
            short=f"{cls} keeps a tensor in self.{name} between calls", module=module)


#: what every nn.Module keeps in its __dict__ (its parameters, buffers, children, hooks): no trace writes a proxy there
_MODULE_OWN = frozenset(vars(nn.Module()))


def _traced(value: Any) -> bool:
    return isinstance(value, (fx.Proxy, FakeTensor))


def _holds_traced(value: Any) -> bool:
    """A proxy or fake tensor, or a dict or list holding one (at its first level)."""
    if type(value) is dict:
        return any(_traced(v) for v in value.values())
    return any(_traced(v) for v in value) if type(value) is list else _traced(value)


@contextlib.contextmanager
def undo_proxies(model: nn.Module) -> Any:
    """Around a trace: an attribute of the model's modules that the trace set to a torch.fx proxy or a fake tensor
    is put back (a proxy left there reaches the next call: RecurrentGemma's ``generate`` failed on one); so are the
    contents of a dict or list attribute the trace put one into (LeViT's ``attention_bias_cache``, filled at an eval
    call: the next capture read the last one's proxy, from another graph, and a fake tensor would reach a call), and an
    attribute set to a new dict or list holding one."""
    before = [(m, dict(m.__dict__)) for m in model.modules()]
    held = [(c, dict(c) if isinstance(c, dict) else list(c)) for _, old in before
            for name, c in old.items() if name not in _MODULE_OWN and type(c) in (dict, list)]
    try:
        yield
    finally:
        for m, old in before:
            for name, value in list(m.__dict__.items()):
                if old.get(name, _MISSING) is not value and _holds_traced(value):
                    if name in old:
                        m.__dict__[name] = old[name]
                    else:
                        del m.__dict__[name]
        for container, contents in held:
            if _holds_traced(container):
                if isinstance(container, dict):
                    container.clear()
                    container.update(contents)
                else:
                    container[:] = contents
