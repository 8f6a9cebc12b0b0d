"""``fxamp.shard(model)``: FSDP2 (``fully_shard``) over a model converted in place, per block and at the root.

The unit FSDP2 all-gathers is a module that is *called*; a block converted by ``fxamp.convert_``
is one (its graph reads each parameter through its owner at every call), so ``fully_shard`` per
converted block sees the unsharded parameters it swaps in.  The design::

    shard(model)
      ├─ checks: converted in place (convert_), float32 storage (O0/O1), torch.distributed up,
      │  the mesh's size is the world's
      ├─ low_gathered(model): the parameters only low-precision ops read (linear/conv weights and
      │  biases), each re-bound as a _LowGather: its float32 shard, all-gathered in the low dtype
      ├─ fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32))
      │  for every converted block (or the ``blocks=`` globs), then fully_shard(model) for the rest
      ├─ no cast cache (no_grad): FSDP2 refills a weight's unsharded tensor without a version bump
      └─ nothing else: each op's dtype is fxamp's graph cast, as in one process

One FSDP group per block, two all-gather dtypes in it.  ``MixedPrecisionPolicy`` casts a whole
group to one ``param_dtype``: bfloat16 would round the norm weights before their float32 op (plain
FSDP2 + bf16 policy without autocast: 7.3e-3 off the float32 loss at the first step, issue 29), and
a group of its own per norm costs an all-gather forward, one backward and a reduce-scatter each
(small, latency-bound messages).  So the policy keeps float32 (``param_dtype=None``) and the low
parameters use FSDP2's all-gather extension (``fsdp_pre_all_gather``/``fsdp_post_all_gather`` on
the shard, as torchao's float8 all-gather does), per parameter::

    step          low parameter (fc.weight)                     float32 parameter (ln.weight)
    shard         _LowGather(float32 shard): the master          float32 shard: the master
    all-gather    shard.to(bfloat16)  ─┐ one collective per group: FSDP2 sends mixed dtypes as bytes
                                       └─ float32 shard ─┘
    forward       _Gathered (float32 to autograd, bfloat16       float32 tensor → layer_norm in float32
                  data): fxamp's cast to bfloat16 returns the
                  data as gathered (the bits the cast of the
                  float32 weight gives: bitwise one process)
    backward      gradient of the cast: bfloat16, upcast to      float32
                  float32 by autograd (so the group's gradients are one dtype: FSDP2 refuses
                  mixed ones, "FSDP reduce-scatter expects uniform gradient dtype")
    reduce        reduce-scatter in float32 (reduce_dtype)

The all-gather carries bfloat16 for the weights matmuls read and float32 for the rest, in as many
collectives as a one-dtype policy; ``benchmarks/fsdp2.py`` measures the bytes.  Which parameters
are low is decided before the first call (see :func:`low_gathered`); a ``_Gathered`` parameter
that any op but that cast reads raises, naming it (``gather_float32=`` keeps it float32).  The
sharded float32 parameters are the masters: a :class:`fxamp.MixedPrecisionOptimizer` steps them
directly (no second copy; a ``_LowGather`` unwraps to its float32 shard for every op but FSDP2's
own, and pickles as it, so checkpoints hold plain tensors), agrees on overflows across ranks and
clips the true gradients across shards.

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
import torch.utils._pytree as pytree
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from .conversion.blocks import converted_modules, family_of, read_around
from .conversion.lazy import LazyConverted
from .conversion.rewrite.casts import CACHE_NAME
from .conversion.runtime import WeightCastCache, cast_weights
from .dtypes import LOW, dtype_name
from .info import policy_of

__all__ = ["shard", "sharding_table", "low_gathered"]


def shard(model: nn.Module, *, mesh: Optional[Any] = None, blocks: Optional[Sequence[str]] = None,
          reshard_after_forward: bool = True, gather_float32: Sequence[str] = ()) -> nn.Module:
    """``fully_shard`` every converted block of ``model`` (converted by ``fxamp.convert_`` with O0/O1),
    then the root; return ``model`` (the same object, now an FSDP module).

    mesh:   a 1-D ``DeviceMesh`` over every rank (default: the world, on the model's device type).
    blocks: module path globs of the blocks to shard, each a converted block (default: every block
            ``convert_`` found; glue modules and the rest are sharded with the root).
    reshard_after_forward: FSDP2's, for the blocks (the root keeps its parameters: it runs backward first).
    gather_float32: parameter name globs to all-gather in float32 even where fxamp's plan says only
            low-precision ops read them (default: none).
    """
    _check_model(model)
    if not isinstance(reshard_after_forward, bool):  # FSDP2's int (reshard to a smaller mesh) is not supported here
        raise TypeError(f"fxamp.shard: reshard_after_forward= takes True or False, not {reshard_after_forward!r} "
                        f"(resharding to a smaller world after forward is not supported with fxamp's low all-gather)")
    if isinstance(gather_float32, str) or not all(isinstance(g, str) for g in gather_float32):
        raise TypeError(f"fxamp.shard: gather_float32= takes a list of parameter name globs, not {gather_float32!r}")
    names = [n for n, _ in model.named_parameters()]
    for pattern in gather_float32:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"fxamp.shard: gather_float32={pattern!r} matches no parameter; the parameters: "
                             f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
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
    chosen = _blocks(model, blocks)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None,
                                     cast_forward_inputs=False)
    for _, module in converted_modules(model):
        module.__dict__[CACHE_NAME] = _Uncached()
    for name, dtype in low_gathered(model).items():
        if not any(fnmatch.fnmatchcase(name, g) for g in gather_float32):
            _wrap(model, name, dtype)
    for _, block in chosen:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return model


class _LowGather(torch.Tensor):
    """A float32 shard (the master: the optimizer steps it) that FSDP2 all-gathers in ``low``.

    FSDP2's all-gather extension: ``fsdp_pre_all_gather`` hands the collective this shard cast to
    ``low``; ``fsdp_post_all_gather`` wraps the gathered low tensor in a :class:`_Gathered` for the
    block's forward.  Every other op unwraps to the float32 shard (the optimizer's foreach kernels,
    clipping, state dicts): FSDP2's own padding, views and copies of it keep the wrapper (torchao's
    float8 all-gather keeps the same list).
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, low: torch.dtype, name: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, low: torch.dtype, name: str):
        self._tensor, self._low, self._name = tensor, low, name

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is _aten.detach.default:
            return _LowGather(first._tensor, first._low, first._name)
        args, kwargs = pytree.tree_map_only(_LowGather, lambda t: t._tensor, (args, kwargs))
        out = func(*args, **kwargs)
        if (not isinstance(first, _LowGather) or func not in _KEEP_SHARD
                or (func is _aten._to_copy.default and out.dtype != torch.float32)):
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: _LowGather(t, first._low, first._name), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._low, self._name)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _LowGather(inner["_tensor"], *meta)

    def __reduce_ex__(self, protocol: Any) -> Any:  # a checkpoint (torch.save, DCP) holds the plain float32 shard
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"_LowGather({self._name}: float32 shard, all-gathered in {dtype_name(self._low)})"

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> Any:
        low = self._tensor.to(self._low)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every rank's dim-0 shard to ceil(rows / world)
        if low.size(0) != rows:  # an uneven shard: pad as FSDP2 pads its own (all-gathered rows are trimmed)
            low = torch.cat([low, low.new_zeros(rows - low.size(0), *low.shape[1:])])
        return (low,), None

    def fsdp_post_all_gather(self, outputs: Any, metadata: Any, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None) -> Any:
        (data,) = outputs
        if out is not None:  # a later all-gather: FSDP2 refilled ``data`` in place, which ``out`` wraps
            return None
        return _Gathered(data, self._name), (data,)


class _Gathered(torch.Tensor):
    """A block's unsharded parameter, all-gathered in a low dtype: float32 to autograd and to FSDP2, the low
    tensor underneath.

    fxamp's cast to that dtype (the only reader :func:`shard` predicted) returns the low data as it came
    from the all-gather, and its gradient comes back float32 like every other parameter's of the group
    (FSDP2 reduce-scatters one gradient dtype per group).  Any other read would see rounded values where
    fxamp's plan promised float32, so it is refused, naming the parameter; only a block's capture (a
    trace: its values are examples) reads it as written.  (``torch.compile`` traces too: there a misread
    would not be refused.)"""

    @staticmethod
    def __new__(cls, data: torch.Tensor, name: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=torch.float32,
            layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, name: str):
        self._data, self._name = data, name

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args else None
        if isinstance(this, _Gathered) and func in _KEEP_GATHERED:
            rest = pytree.tree_map_only(_Gathered, lambda t: t._data, (args[1:], kwargs))
            return _Gathered(func(this._data, *rest[0], **rest[1]), this._name)
        if isinstance(this, _Gathered) and func is _aten._to_copy.default and _casts_to(kwargs, this._data):
            return this._data.view(this._data.shape)  # a fresh alias: each cast is its own autograd output
        if func in _ALLOCATE and isinstance(this, _Gathered):  # reads no value (gradient buffers): float32
            this = torch.empty_strided(this.shape, this.stride(), dtype=torch.float32, device=this.device)
            return func(this, *args[1:], **kwargs)
        if torch.compiler.is_compiling() or is_fx_symbolic_tracing():  # a block's capture (torch.export, or
            # torch.fx with the call's values) traces its forward as written: the values are examples only
            args, kwargs = pytree.tree_map_only(_Gathered, lambda t: t._data.float(), (args, kwargs))
            return func(*args, **kwargs)
        read = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, _Gathered))
        name, low = read._name, dtype_name(read._data.dtype)
        raise RuntimeError(
            f"fxamp.shard all-gathers {name} in {low} (predicted: only {low} ops read it), but {func} reads it "
            f"as float32; shard "
            f"with gather_float32=[{name!r}] (or call the model once before fxamp.shard: the plan then comes "
            f"from its graphs)")

    def __tensor_flatten__(self):
        return ["_data"], self._name

    @staticmethod
    def __tensor_unflatten__(inner, name, outer_size, outer_stride):
        return _Gathered(inner["_data"], name)

    def __repr__(self) -> str:
        return f"_Gathered({self._name}: {dtype_name(self._data.dtype)} all-gathered)"


def _casts_to(kwargs: Dict[str, Any], data: torch.Tensor) -> bool:
    """``_to_copy(**kwargs)`` is ``.to(data.dtype)``: nothing else changes (device, layout, format)."""
    same = {"dtype": data.dtype, "device": data.device, "layout": data.layout, "memory_format": torch.preserve_format}
    return kwargs.get("dtype") == data.dtype and all(
        v is None or v is False or (k in same and v == same[k]) for k, v in kwargs.items())


_aten = torch.ops.aten
#: FSDP2 pads, views, splits and copies a shard: these keep the wrapper (the list torchao's float8 keeps)
_KEEP_SHARD = {_aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
               _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten._pin_memory.default,
               _aten.split.Tensor, _aten.clone.default, _aten.alias.default}
#: FSDP2 makes the unsharded parameter with these (and nn.Parameter detaches)
_KEEP_GATHERED = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten.as_strided.default}
_ALLOCATE = {_aten.empty_like.default, _aten.zeros_like.default, _aten.new_empty.default,
             _aten.new_empty_strided.default, _aten.new_zeros.default}


class _Uncached(WeightCastCache):
    """A converted module's cast cache under FSDP2: none.  FSDP2 refills a parameter's unsharded tensor at
    each all-gather without bumping its version counter (and often at the same address), so a cached
    no_grad cast would outlive an optimizer step; every call casts, as training does."""

    def get(self, weight: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
        return weight.detach().to(dtype)

    def get_all(self, weights: Any, dtype: torch.dtype, keys: Any) -> Any:
        return tuple(w.detach().to(dtype) for w in weights)


def low_gathered(model: nn.Module) -> Dict[str, torch.dtype]:
    """The parameters of a model converted in place (not sharded yet) that only low-precision ops read, by name,
    with that dtype: the ones :func:`shard` all-gathers low.

    A converted module captured already answers from its graphs: every reader casts the parameter to the
    policy's compute dtype.  One not captured yet (``shard`` runs before the first call) answers from the
    parameter's owner: the weight and bias of a linear or convolution layer (``Conv1D`` too), whose one op
    the policy runs low.  A parameter tied across modules must qualify in each; one read outside converted
    modules (the model's own code, around a glue module too: ``blocks.read_around``) never does.  A wrong
    prediction is caught at the first forward: the all-gathered parameter refuses every read but that cast.
    """
    policy = policy_of(model)
    if policy is None or policy.compute not in LOW:
        return {}
    converted = converted_modules(model)
    computes: Dict[str, Set[Optional[torch.dtype]]] = {}
    captured: Set[str] = set()
    for path, module in converted:
        for variants in family_of(module).graphs.values():
            for graph in variants:
                captured.add(path)
                for name, dtypes in _reads(graph.gm).items():
                    computes.setdefault(f"{path}.{name}" if path else name, set()).update(dtypes)
    # (the model's own code reads these directly, not by calling their module: WGAN's weight.clamp_)
    around = set(read_around(model, [path for path, module in converted if family_of(module).glue]))
    verdicts: Dict[int, List[bool]] = {}
    names: Dict[int, str] = {}
    for owner_path, owner in model.named_modules(remove_duplicate=False):
        for attr, p in owner._parameters.items():
            if p is None or p.dtype != torch.float32:
                continue
            name = f"{owner_path}.{attr}" if owner_path else attr
            names.setdefault(id(p), name)
            inside = [c for c, _ in converted if not c or owner_path == c or owner_path.startswith(c + ".")]
            if not inside or name in around:
                ok = False
            elif max(inside, key=len) in captured:
                ok = computes.get(name) == {policy.compute}
            else:
                ok = isinstance(owner, _LOW_OWNERS) or type(owner).__name__ == "Conv1D"
            verdicts.setdefault(id(p), []).append(ok)
    return {names[key]: policy.compute for key, oks in verdicts.items() if all(oks)}


#: layers whose parameters only their one matmul or convolution reads (the policy runs it in its compute dtype)
_LOW_OWNERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


def _wrap(model: nn.Module, name: str, low: torch.dtype) -> None:
    """Re-bind parameter ``name`` (everywhere it is tied) as a :class:`_LowGather` around the same float32 data."""
    old = model.get_parameter(name)
    new = nn.Parameter(_LowGather(old.detach(), low, name), requires_grad=old.requires_grad)
    for owner in model.modules():
        for attr, p in owner._parameters.items():
            if p is old:
                owner._parameters[attr] = new


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
    complex_ = sorted({n for n, p in model.named_parameters() if p.is_complex()})
    if complex_:  # (never cast: no policy makes them float32)
        raise ValueError(f"fxamp.shard: {type(model).__name__} has complex parameters ({', '.join(complex_[:3])}"
                         f"{' ...' if len(complex_) > 3 else ''}) beside float32 ones, and fully_shard needs one dtype "
                         f"per group; fxamp.shard does not shard them yet: train such a model with DDP")
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
        local = p.to_local() if sharded and hasattr(p, "to_local") else p  # (unsharded between forward and backward)
        gathered = (dtype_name(local._low) if isinstance(local, _LowGather)
                    else dtype_name(local._data.dtype) if isinstance(local, _Gathered) else stored)
        rows.append((name, stored, gathered if sharded else "-", ops, "float32" if sharded else "-"))
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
            owner = _attribute_of(node.args[0], "_parameters")
            path = _module_path(owner) if owner is not None else None
            if path is not None:
                name = f"{path}.{node.args[1]}"
        elif node.op == "call_module":  # a leaf module the graph calls (a norm): its parameters, as stored
            prefix = f"{node.target}."
            for attr, _ in gm.get_submodule(node.target).named_parameters():
                out.setdefault(prefix + attr, set()).add(None)
            continue
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


def _attribute_of(node: Any, attr: str) -> Optional[fx.Node]:
    """``X`` when ``node`` is ``getattr(X, attr)``, else None."""
    if (isinstance(node, fx.Node) and node.op == "call_function" and node.target is getattr
            and node.args[1] == attr and isinstance(node.args[0], fx.Node)):
        return node.args[0]
    return None


def _module_path(node: fx.Node) -> Optional[str]:
    """The module path a graph node reads: ``get_attr(path)``, or ``path._modules[name]`` chained."""
    if node.op == "get_attr":
        return node.target
    if node.op == "call_function" and node.target is operator.getitem:
        parent = _attribute_of(node.args[0], "_modules")
        path = _module_path(parent) if parent is not None else None
        return None if path is None else f"{path}.{node.args[1]}"
    return None
