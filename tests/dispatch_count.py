"""Count what a block of code dispatches: every aten op (on a GPU, a kernel launch each, ~5 us) and the
host reads among them (``aten._local_scalar_dense``: ``.item()``, ``bool(tensor)``, ``float(tensor)``; on
a GPU each waits for the device).

::

    with DispatchCount() as count:
        opt.step()
    assert count.ops <= 52 and count.host_reads <= 2

A ``TorchDispatchMode`` sees the ops that reach the dispatcher from Python or C++ above it, once each:
a ``torch._foreach_*`` call over 100 tensors is one op, as it is one launch (or a few) on a GPU.
"""

import collections
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = torch.ops.aten._local_scalar_dense.default


class DispatchCount(TorchDispatchMode):
    """Counts each op dispatched inside the block (``by_op``: its name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # (metadata a tensor subclass answers through dispatch: prim.device, no kernel)
            self.by_op[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def host_reads(self) -> int:
        return self.by_op[str(HOST_READ)]

    def __repr__(self) -> str:
        return f"DispatchCount(ops={self.ops}, host_reads={self.host_reads}, {dict(self.by_op.most_common())})"


def count(step: Callable[[], object], prepare: Callable[[], object], warmup: int = 3) -> DispatchCount:
    """``prepare()`` then ``step()``, ``warmup`` times (state created, plans built), then once more counted
    (``step()`` alone)."""
    for _ in range(warmup):
        prepare()
        step()
    prepare()
    with DispatchCount() as counted:
        step()
    return counted


def mlp(tensors: int, width: int = 16, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A chain of ``tensors // 2`` Linear(width, width) layers: ``tensors`` parameter tensors (weight and bias)."""
    assert tensors % 2 == 0
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(tensors // 2)]).to(dtype)


def set_grads(params: Sequence[torch.Tensor], seed: int = 0) -> None:
    """Give each parameter a fresh random gradient of its dtype (a step without a forward and backward)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
