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

import dis
import functools
import types
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor  # (imported by torch itself)

from ...errors import TraceError
from ..bytecode import LOCAL_LOADS, METADATA, NONE_TESTS

__all__ = ["CarriedState", "StateWatch", "carried_candidates", "undo_proxies"]

_SETATTR = nn.Module.__setattr__.__code__
_LOADS = ("LOAD_ATTR", "LOAD_METHOD")
_STORE_ATTR = dis.opmap["STORE_ATTR"]
_MISSING = object()


class CarriedState(TraceError):
    """A capture refused because the model keeps a tensor in a plain attribute from one call to the next."""

    def __init__(self, message: str, short: str, module: nn.Module) -> None:
        super().__init__(message, short=short)
        self.module = module


def carried_candidates(codes: Iterable[types.CodeType]) -> FrozenSet[str]:
    """The attribute names some function of the code stores on its ``self`` after reading that attribute's value:
    the only ones whose writes are watched (most models: none, and the trace is not watched)."""
    return frozenset(name for code in codes for name in _candidates(code))


@functools.lru_cache(maxsize=4096)
def _candidates(code: types.CodeType) -> FrozenSet[str]:
    """One function's names stored on its first argument after a read of their value (asked at every capture)."""
    if _STORE_ATTR not in code.co_code[::2] or not code.co_argcount:  # (most code: no disassembly)
        return frozenset()
    me = code.co_varnames[0]
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PRECALL", "EXTENDED_ARG")]
    out = set()
    for k, i in enumerate(ins):
        if i.opname == "STORE_ATTR" and k and ins[k - 1].opname in LOCAL_LOADS and ins[k - 1].argval == me and \
                _read_before(code, i.argval, i.offset):
            out.add(i.argval)
    return frozenset(out)


def _read_before(code: types.CodeType, name: str, offset: int) -> bool:
    """Whether ``code`` reads the value of ``<x>.<name>`` before ``offset``: not its shape, dtype or device, nor a
    test against None (``if self.weights.size(0) < n:`` before a table grows is no state read)."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PRECALL", "EXTENDED_ARG")]
    for k, i in enumerate(ins):
        if i.offset >= offset:
            return False
        if i.opname in _LOADS and i.argval == name and not _meta_use(ins[k + 1:k + 3]):
            return True
    return False


def _meta_use(after: List[dis.Instruction]) -> bool:
    if not after:
        return False
    first = after[0]
    return (first.opname in _LOADS and first.argval in METADATA) or first.opname in NONE_TESTS or (
        first.opname == "LOAD_CONST" and first.argval is None and len(after) > 1 and after[1].opname == "IS_OP")


class StateWatch:
    """What a profiler sees of the model's attribute writes during one trace (``see`` each call event)."""

    def __init__(self, names: FrozenSet[str], codes: Iterable[types.CodeType]) -> None:
        self.names = names
        self.codes = frozenset(codes)
        self.undo: Dict[Tuple[int, str], Tuple[nn.Module, str, Any]] = {}
        self.carried: List[Tuple[nn.Module, str, str]] = []  # (module, name, where it was read)

    def see(self, frame: Any) -> None:
        """A ``call`` event's frame: note a tensor written to a plain attribute the code reads."""
        if frame.f_code is not _SETATTR:
            return
        local = frame.f_locals
        module, name, value = local.get("self"), local.get("name"), local.get("value")
        if name not in self.names or not isinstance(value, (torch.Tensor, fx.Proxy)) or \
                not isinstance(module, nn.Module) or name in module._parameters or name in module._buffers:
            return
        key = (id(module), name)
        if key not in self.undo:
            self.undo[key] = (module, name, module.__dict__.get(name, _MISSING))
            where = self._reader(frame.f_back, name)
            if where is not None:
                self.carried.append((module, name, where))

    def _reader(self, frame: Any, name: str) -> Optional[str]:
        """Where a frame of the model's code on the stack read ``name`` before its current instruction."""
        while frame is not None:
            if frame.f_code in self.codes and _read_before(frame.f_code, name, frame.f_lasti):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def restore(self) -> None:
        """Every attribute the trace wrote back to its value before (torch.export puts them back itself)."""
        for module, name, old in self.undo.values():
            if old is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old

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


@contextlib.contextmanager
def undo_proxies(model: nn.Module) -> Any:
    """Around a trace: an attribute of the model's modules that the trace set to a torch.fx proxy or a fake tensor
    is put back (a proxy left there reaches the next call: RecurrentGemma's ``generate`` failed on one)."""
    before = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, old in before:
            for name, value in list(m.__dict__.items()):
                if isinstance(value, (fx.Proxy, FakeTensor)) and old.get(name, _MISSING) is not value:
                    if name in old:
                        m.__dict__[name] = old[name]
                    else:
                        del m.__dict__[name]
