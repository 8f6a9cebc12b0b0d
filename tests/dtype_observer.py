"""Record the dtype every aten op actually ran in, with a TorchDispatchMode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Call:
    op: str                      # aten packet name, e.g. "addmm"
    inputs: Tuple[torch.dtype, ...]   # dtypes of floating tensor inputs
    outputs: Tuple[torch.dtype, ...]  # dtypes of floating tensor outputs
    kwargs: dict
    layouts: Tuple[bool, ...] = ()  # _scaled_mm only: (first operand row-major, second column-major)
    shapes: Tuple[Tuple[int, ...], ...] = ()  # _scaled_mm only: its two operands' shapes


class OpDtypes(TorchDispatchMode):
    """``with OpDtypes() as rec: model(x)``, then ``rec.calls``."""

    def __init__(self):
        super().__init__()
        self.calls: List[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        floats = lambda tree: tuple(t.dtype for t in tree_leaves(tree)
                                    if isinstance(t, torch.Tensor) and t.is_floating_point())
        scaled = func.overloadpacket.__name__ == "_scaled_mm"
        layouts = (args[0].is_contiguous(), args[1].t().is_contiguous()) if scaled else ()
        shapes = (tuple(args[0].shape), tuple(args[1].shape)) if scaled else ()
        self.calls.append(Call(func.overloadpacket.__name__, floats((args, kwargs)), floats(out), kwargs, layouts,
                               shapes))
        return out

    def of(self, *ops: str) -> List[Call]:
        return [c for c in self.calls if c.op in ops]

    def casts(self) -> List[Call]:
        """Calls that changed a float dtype (the cast kernels)."""
        return [c for c in self.calls if c.op in ("_to_copy", "to", "copy_") and c.inputs[:1] != c.outputs[:1]]
