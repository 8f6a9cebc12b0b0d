"""Agreeing on overflows across ranks: one all-reduce of a flag per step.

Under ``DistributedDataParallel`` gradients are already averaged, so an inf on one rank reaches
every rank; but an inf injected after the all-reduce, or gradients that each rank holds only a
shard of (FSDP, ZeRO, tensor parallelism), would let one rank step while another skips and the
replicas drift apart.  :class:`fxamp.MixedPrecisionOptimizer` therefore takes the maximum of the
overflow flag over the process group before deciding.

FSDP2: ``fxamp.shard`` (``fxamp/sharding.py``) keeps float32 shards, so every parameter is stepped
directly (no master copies); each rank checks its own shard (:func:`max_abs`: an empty one is
clean), and this all-reduce makes the skip decision global (docs/training.md, "More than one
process: FSDP2").

A step visits this module (a file beyond those the engine names, :mod:`fxamp.training.step`) only when
``torch.distributed`` is initialized and ``sync_overflow`` is on
(:func:`fxamp.training.step.ranks_to_agree`).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.distributed as dist

__all__ = ["all_reduce_overflow", "all_reduce_overflow_on_device", "is_distributed", "local_tensor", "max_abs",
           "reduces_on_device"]


def is_distributed(group: Optional[Any] = None) -> bool:
    """True when torch.distributed is initialized and ``group`` (default: the world) has several ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_overflow(found_inf: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Max of a 0-dim float overflow flag over the ranks of ``group`` (the flag itself when not distributed).

    The flag travels on the backend's device (CUDA for NCCL, CPU otherwise) and comes back on CPU.
    """
    if not is_distributed(group):
        return found_inf
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    flag = found_inf.detach().to(device=device, dtype=torch.float32).clone()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.to("cpu")


def reduces_on_device(device: torch.device, group: Optional[Any] = None) -> bool:
    """Whether the flag of a tensor on ``device`` can be agreed on without leaving it (and without
    the host waiting): not distributed, or an NCCL group and a CUDA device."""
    if not is_distributed(group):
        return True
    return device.type == "cuda" and dist.get_backend(group) == "nccl"


def all_reduce_overflow_on_device(flag: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Max of a 0-dim float32 CUDA flag over ``group``, left on the device (``reduces_on_device``
    must hold): NCCL runs it on the stream, so the host does not wait."""
    if not is_distributed(group):
        return flag
    out = flag.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out



def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (an FSDP2 parameter's or gradient's), else ``t`` itself."""
    to_local = getattr(type(t), "to_local", None)
    return t.to_local() if to_local is not None else t


def max_abs(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude in each tensor (this rank's shard of a ``DTensor``), as float32 on the CPU;
    0 for an empty one (FSDP2 leaves a rank an empty shard of a tensor smaller than the world)."""
    local = [local_tensor(t) for t in tensors]
    full = [i for i, t in enumerate(local) if t.numel()]
    out = torch.zeros(len(local))
    if full:
        out[full] = torch.stack([n.float().cpu() for n in torch._foreach_norm([local[i] for i in full], math.inf)])
    return out
