"""Which plain values a capture read from the model's modules (:func:`held_values`): the graph holds them as
constants, and each call of the converted module checks they still hold (``runtime/held_values.py``).

A value is held when a module whose code the capture traced through has it in its ``__dict__`` under a name that
code reads (``x / self.tau``, ``if self.use_cache:``, ``F.dropout(x, self.p)``).  A module the graph calls whole
(a torch.fx leaf) reads its attributes at run time: not recorded.
"""

from __future__ import annotations

import enum
from typing import Any, FrozenSet, Iterable, Set, Tuple

import torch.nn as nn

from ..bytecode import codes_of
from ..calls import SIMPLE
from ..runtime.held_values import Held

__all__ = ["held_values"]

def _plain(value: Any, depth: int = 0) -> bool:
    """A value a graph holds as a constant when forward reads it: a number, flag, string, dtype, enum member,
    or a short tuple of them (``kernel_size``); not a tensor, module, list or object (those are read, or mutated,
    in other ways)."""
    if isinstance(value, (*SIMPLE, enum.Enum)):
        return True
    return type(value) is tuple and depth < 2 and len(value) <= 16 and all(_plain(v, depth + 1) for v in value)


def _names_read(cls: type) -> Set[str]:
    """The names the code ``cls``'s forward runs reads (``co_names``, and strings: ``getattr(self, "p")``), over its
    MRO's forwards: a subclass's forward may call the one it overrides."""
    names: Set[str] = set()
    for c in cls.__mro__:
        if c in (nn.Module, object) or "forward" not in vars(c):
            continue
        for code in codes_of(c, unwrap=True):
            names.update(code.co_names)
            names.update(k for k in code.co_consts if type(k) is str and k.isidentifier())
    return names


def held_values(model: nn.Module, live: Iterable[str] = (), leave_out: FrozenSet[Tuple[str, str]] = frozenset()
                ) -> Held:
    """The plain values (:func:`_plain`) a capture of ``model`` read and its graph holds: the attributes, in the
    ``__dict__`` of each module whose code the capture traced through, that the code of those modules names.

    live: paths of the modules the graph calls whole (torch.fx's ``call_module`` nodes): they read their attributes
    at run time, as do their children.  leave_out: ``(path, attribute)`` pairs forward wrote while captured (the graph
    read them before and after the write: no one value it holds)."""
    live = tuple(live)
    traced = [(p, m) for p, m in model.named_modules()
              if not any(p == x or p.startswith(x + ".") for x in live if x)]
    names: Set[str] = set()
    for cls in {type(m) for _, m in traced}:
        names |= _names_read(cls)
    names.discard("training")  # (both modes are captured, or the flag is rewritten: capture/modes.py)
    out = []
    for path, m in traced:
        own = tuple((n, v) for n, v in vars(m).items()
                    if n in names and not n.startswith("_fxamp") and (path, n) not in leave_out and _plain(v))
        if own:
            out.append((path, own))
    return tuple(out)
