"""``fxamp.shard(model)``: FSDP2 (``fully_shard``) over a model converted in place, per block and at the root.

The unit FSDP2 all-gathers is a module that is *called*; a block converted by ``fxamp.convert_``
is one (its graph reads each parameter through its owner at every call), so ``fully_shard`` per
converted block sees the unsharded parameters it swaps in.  The design::

    shard(model)
      ├─ checks: converted in place (convert_), float32 storage (O0/O1), torch.distributed up,
      │  the mesh's size is the world's
      ├─ fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32))
      │  for every converted block (or the ``blocks=`` globs), then fully_shard(model) for the rest
      ├─ no cast cache (no_grad): FSDP2 refills a weight's unsharded tensor without a version bump
      └─ nothing else: each op's dtype is fxamp's graph cast, as in one process

Why ``param_dtype=None`` (all-gather in float32): a converted block holds parameters that
low-precision ops read (linear weights) and parameters that float32 ops read (norm weights);
FSDP2 casts a whole group to one ``param_dtype``, so a bfloat16 all-gather would round the norm
weights through bfloat16 before their float32 op (plain FSDP2 + bf16 policy without autocast:
7.3e-3 off the float32 loss at the first step, issue 29).  Keeping them float32 would cost one
more FSDP group per norm (an all-gather forward, one backward and a reduce-scatter each: small,
latency-bound messages).  So the all-gather carries float32 (twice the bytes of a bf16 one for
the linear weights; ``benchmarks/fsdp2.py`` measures it) and fxamp's casts round each weight
where a low-precision op reads it.  The sharded float32 parameters are the masters: a
:class:`fxamp.MixedPrecisionOptimizer` steps them directly (no second copy), agrees on
overflows across ranks and clips the true gradients across shards.

O2/O3 (low-precision storage beside float32 norms inside one block) is refused: ``fully_shard``
needs one parameter dtype per group.
"""

from __future__ import annotations

import fnmatch
import operator
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from .conversion.blocks import converted_modules, family_of
from .conversion.lazy import LazyConverted
from .conversion.rewrite import CACHE_NAME
from .conversion.runtime import WeightCastCache, cast_weights
from .dtypes import dtype_name
from .info import policy_of

__all__ = ["shard", "sharding_table"]


def shard(model: nn.Module, *, mesh: Optional[Any] = None, blocks: Optional[Sequence[str]] = None,
          reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` every converted block of ``model`` (converted by ``fxamp.convert_`` with O0/O1),
    then the root; return ``model`` (the same object, now an FSDP module).

    mesh:   a 1-D ``DeviceMesh`` over every rank (default: the world, on the model's device type).
    blocks: module path globs of the blocks to shard, each a converted block (default: every block
            ``convert_`` found; glue modules and the rest are sharded with the root).
    reshard_after_forward: FSDP2's, for the blocks (the root keeps its parameters: it runs backward first).
    """
    _check_model(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("fxamp.shard: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group(...) first (every rank calls shard)")
    world = dist.get_world_size()
    device_type = _device_type(model)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (world,))
    elif mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(f"fxamp.shard: the mesh has shape {tuple(mesh.shape)} but the world has {world} ranks; "
                         f"pass a 1-D mesh over every rank (or mesh=None)")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None,
                                     cast_forward_inputs=False)
    for _, module in converted_modules(model):
        module.__dict__[CACHE_NAME] = _Uncached()
    for _, block in _blocks(model, blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return model


class _Uncached(WeightCastCache):
    """A converted module's cast cache under FSDP2: none.  FSDP2 refills a parameter's unsharded tensor at
    each all-gather without bumping its version counter (and often at the same address), so a cached
    no_grad cast would outlive an optimizer step; every call casts, as training does."""

    def get(self, weight: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
        return weight.detach().to(dtype)

    def get_all(self, weights: Any, dtype: torch.dtype, keys: Any) -> Any:
        return tuple(w.detach().to(dtype) for w in weights)


def _check_converted(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxamp.shard takes an nn.Module, not {type(model).__name__}")
    if isinstance(model, (fx.GraphModule, LazyConverted)):
        raise ValueError(f"fxamp.shard: this {type(model).__name__} was converted whole (fxamp.convert), so its "
                         f"graph reads the weights itself and FSDP2 never sees a block's call; convert the "
                         f"original model in place instead: fxamp.convert_(model, 'O1', dtype=...)")
    policy = policy_of(model)
    if policy is None or not converted_modules(model):
        raise ValueError(f"fxamp.shard: this {type(model).__name__} was not converted by fxamp; call "
                         f"fxamp.convert_(model, 'O1', dtype=...) first")


def _check_model(model: nn.Module) -> None:
    _check_converted(model)
    policy = policy_of(model)
    if any(hasattr(m, "_get_fsdp_state") for m in model.modules()):
        raise ValueError(f"fxamp.shard: this {type(model).__name__} is already sharded (fully_shard ran on it)")
    low = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.dtype != torch.float32})
    if low:
        raise ValueError(f"fxamp.shard: policy {policy} stores parameters in {', '.join(low)} beside float32 "
                         f"ones, and fully_shard needs one dtype per group; convert with 'O1' (float32 storage: "
                         f"the shards are the masters, fxamp's casts give each op its dtype)")


def _blocks(model: nn.Module, patterns: Optional[Sequence[str]]) -> List[Any]:
    found = [(p, m) for p, m in converted_modules(model) if not family_of(m).glue]
    if patterns is None:
        return found
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"fxamp.shard: blocks= takes a list of module path globs, not {patterns!r}")
    chosen = []
    for pattern in patterns:
        hits = [(p, m) for p, m in found if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            raise ValueError(f"fxamp.shard: blocks={pattern!r} matches no converted block; the converted blocks: "
                             f"{', '.join(p for p, _ in found[:6])}{' ...' if len(found) > 6 else ''}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


def _device_type(model: nn.Module) -> str:
    types = {p.device.type for p in model.parameters()}
    if len(types) != 1:
        raise ValueError(f"fxamp.shard: the model's parameters are on {sorted(types)}; put them on one device type")
    return types.pop()


def sharding_table(model: nn.Module) -> str:
    """Per parameter of a model converted in place (and sharded or not): its stored (shard) dtype, the dtype
    FSDP2 all-gathers it in, the dtypes fxamp's graphs compute with it, the dtype its gradient is reduced in.

    "computes in" comes from the graphs captured so far (call the model once first); a parameter the
    model's own Python reads (outside converted modules) computes as written, in its stored dtype.
    """
    _check_converted(model)
    sharded = any(hasattr(m, "_get_fsdp_state") for m in model.modules())
    computes: Dict[str, Set[torch.dtype]] = {}
    for path, module in converted_modules(model):
        for variants in family_of(module).graphs.values():
            for graph in variants:
                for name, dtypes in _reads(graph.gm).items():
                    computes.setdefault(f"{path}.{name}" if path else name, set()).update(dtypes)
    inside = [p for p, _ in converted_modules(model)]
    rows = [("parameter", "stored", "all-gathered", "computes in", "gradient reduced in")]
    for name, p in model.named_parameters():
        stored = dtype_name(p.dtype)
        if name in computes:
            ops = ", ".join(sorted(stored if d is None else dtype_name(d) for d in computes[name]))
        elif any(name.startswith(c + ".") for c in inside):
            ops = "(not captured yet)"
        else:
            ops = f"{stored} (the model's own code)"
        rows.append((name, stored, stored if sharded else "-", ops, "float32" if sharded else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines[:1] + ["-+-".join("-" * w for w in widths)] + lines[1:])


def _reads(gm: fx.GraphModule) -> Dict[str, Set[Optional[torch.dtype]]]:
    """Parameter (path in the module) -> the dtypes its readers in ``gm`` cast it to (None: read as stored)."""
    out: Dict[str, Set[Optional[torch.dtype]]] = {}
    for node in gm.graph.nodes:
        name = None
        if node.op == "get_attr":  # a glue module's graph: its own parameter
            owner, _, attr = node.target.rpartition(".")
            holder = gm.get_submodule(owner) if owner else gm
            name = node.target if attr in getattr(holder, "_parameters", {}) else None
        elif node.op == "call_function" and node.target is operator.getitem:
            base = node.args[0]
            if (isinstance(base, fx.Node) and base.op == "call_function" and base.target is getattr
                    and base.args[1] == "_parameters" and isinstance(base.args[0], fx.Node)
                    and base.args[0].op == "get_attr"):
                name = f"{base.args[0].target}.{node.args[1]}"
        if name is None:
            continue
        dtypes = out.setdefault(name, set())
        for user in node.users:
            if user.target is cast_weights:
                dtypes.add(user.args[2])
            elif user.op == "call_method" and user.target == "to" and isinstance(user.args[-1], torch.dtype):
                dtypes.add(user.args[-1])
            else:
                dtypes.add(None)
    return out
