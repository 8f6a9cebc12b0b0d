"""The casts a converted module's generated forward calls, its weight cache, and the guard on its storage dtypes.

They are plain functions over tensors: no global state, nothing patched, traceable by
``torch.compile``.  ``cast`` decides at run time, like autocast's own cast, whether a value is a
tensor it may cast, so conversion works without example inputs.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ...dtypes import CASTABLE

__all__ = ["cast", "cast_dense", "cast_weights", "call_module_cast", "checkpointed", "WeightCastCache",
           "StorageCheck", "STORAGE_CHECK_NAME", "check_storage", "refuse_dtype_change"]


def cast(x: Any, dtype: torch.dtype) -> Any:
    """``x.to(dtype)`` if ``x`` is a float16/bfloat16/float32 tensor of another dtype, else ``x`` unchanged.

    Containers torch passes between modules are cast element by element, keeping their type:
    lists and tuples (``torch.cat``'s argument, an LSTM's ``(h, c)``), named tuples and ``torch.return_types``,
    plain dicts, dataclasses (a model's output), and a ``PackedSequence``, of which only ``.data`` is cast (its
    ``batch_sizes`` and indices are integer tensors, and float64 is never cast anyway).
    """
    if isinstance(x, torch.Tensor):
        if x.dtype != dtype and x.dtype in CASTABLE:
            return _to(x, dtype)
        return x
    kind = type(x)
    if kind in (list, tuple):
        return kind(cast(v, dtype) for v in x)
    if isinstance(x, tuple) and hasattr(kind, "_fields"):  # a named tuple (PackedSequence too), field by field
        return x._replace(**{f: cast(v, dtype) for f, v in zip(kind._fields, x)})
    if isinstance(x, tuple) and hasattr(kind, "n_fields"):  # torch.return_types (x.max(dim=1)): a structseq
        return kind(tuple(cast(v, dtype) for v in x))
    if kind in (dict, OrderedDict):
        return kind((k, cast(v, dtype)) for k, v in x.items())
    if dataclasses.is_dataclass(x) and not isinstance(x, (type, dict)):
        # a model's own output dataclass (logits, loss), field by field; a copy, as for the containers above
        # (without running __init__/__post_init__ again); a dict (transformers' ModelOutput) is a pytree
        changed = {f.name: cast(getattr(x, f.name), dtype) for f in dataclasses.fields(x) if hasattr(x, f.name)}
        if all(v is getattr(x, k) for k, v in changed.items()):
            return x
        out = copy.copy(x)
        for k, v in changed.items():
            object.__setattr__(out, k, v)  # (a frozen dataclass too)
        return out
    return x


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, the copy made dense and row-major unless ``x`` is (dense) channels-last.

    The cast copies anyway, so choosing the copy's layout is free, and a strided copy can be very
    slow downstream: ``F.linear`` on a non-contiguous 3-D input (the transposed input of an
    exported ``nn.MultiheadAttention``) folds into one ``addmm`` only when the input is contiguous
    or the weight requires grad; otherwise ``at::matmul`` expands the weight to a batch of copies
    (one per sequence position) and calls ``bmm``, which materialises every copy: 2 s instead of
    15 ms for a 768 -> 2304 bfloat16 projection of 256 tokens with the no-grad weight cache's
    weights.  Channels-last activations keep their layout (convolutions want it).
    """
    if x.is_contiguous():
        return x.to(dtype)
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return x.to(dtype)
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return x.to(dtype)
    return x.to(dtype, memory_format=torch.contiguous_format)


def cast_dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast of a tensor whose dtype is known to differ from ``dtype``: :func:`cast` without its checks.

    For ``rewrite/casts.py``'s casts of values whose dtype it inferred (where it emits a plain
    ``x.to(dtype)``, which keeps a transposed input's strides; see :func:`_to`).
    """
    return _to(x, dtype)


class WeightCastCache(nn.Module):
    """Low-precision copies of float32 weights, reused while the weight is unchanged.

    Used only where no autograd graph is needed (``no_grad``/``inference_mode``, or a weight that
    does not require grad); training casts every forward, as autocast does.  An entry is reused
    only while the weight is the same object with the same storage and version counter, so an
    optimizer step, ``load_state_dict`` or any in-place write invalidates it.  Fused optimizers
    (``torch.optim.AdamW(fused=True)``, the Hugging Face Trainer's default) and writes through
    ``.data`` do not bump the version counter, so two more rules hold: a forward that records
    autograd for a weight (a training step's) clears the cache, and ``MixedPrecisionOptimizer``
    bumps the counters of what it stepped.  Left uncovered: a plain fused optimizer stepping after a
    ``no_grad`` forward that followed the training forward (call :meth:`clear` there, or after
    ``.data`` writes).

    It holds no parameters or buffers, so it adds nothing to ``state_dict``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._entries: Dict[Tuple[str, torch.dtype], Tuple[Any, int, int, torch.Tensor]] = {}
        self._batches: Dict[Tuple[Tuple[str, ...], torch.dtype], Tuple[Any, ...]] = {}

    def get(self, weight: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
        entry = self._entries.get((key, dtype))
        if entry is not None:
            ref, version, ptr, value = entry
            # Tensor._version: autograd's in-place write counter, which torch exposes no other way
            if ref() is weight and version == weight._version and ptr == weight.data_ptr():
                return value
        value = weight.detach().to(dtype)
        self._entries[(key, dtype)] = (weakref.ref(weight), weight._version, weight.data_ptr(), value)
        return value

    def get_all(self, weights: Tuple[torch.Tensor, ...], dtype: torch.dtype, keys: Tuple[str, ...]) -> Tuple[torch.Tensor, ...]:
        """``get`` for a whole forward's weights at once: one validity check pass, one lookup."""
        entry = self._batches.get((keys, dtype))
        if entry is not None:
            refs, versions, ptrs, values = entry
            if (all(r() is w for r, w in zip(refs, weights))
                    and versions == tuple(w._version for w in weights)
                    and ptrs == tuple(w.data_ptr() for w in weights)):
                return values
        values = tuple(self.get(w, dtype, k) for w, k in zip(weights, keys))
        self._batches[(keys, dtype)] = (tuple(weakref.ref(w) for w in weights), tuple(w._version for w in weights),
                                        tuple(w.data_ptr() for w in weights), values)
        return values

    def clear(self) -> None:
        """Forget every cached copy (after writing weights through ``.data``)."""
        self._entries.clear()
        self._batches.clear()

    def __len__(self) -> int:
        return len(self._entries)

    # the cache is derived data: copies and pickles start empty
    def __getstate__(self):
        state = super().__getstate__().copy()
        state["_entries"] = {}
        state["_batches"] = {}
        return state

    def __deepcopy__(self, memo):
        new = WeightCastCache()
        new.training = self.training
        return new

    def extra_repr(self) -> str:
        return f"entries={len(self._entries)}"


def cast_weights(
    cache: WeightCastCache, weights: Tuple[torch.Tensor, ...], dtype: torch.dtype, keys: Tuple[str, ...]
) -> Tuple[torch.Tensor, ...]:
    """Cast a forward's float32 weights for low-precision ops, all in one call.

    With autograd recording (training) a weight that requires grad is cast afresh, as autocast
    does; otherwise (``no_grad``, frozen weights) the cached copy is reused until the weight changes.
    """
    if torch.compiler.is_compiling():
        return tuple(w.to(dtype) for w in weights)
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        cache.clear()  # a training forward: these weights are about to be stepped (maybe by a fused kernel)
        trained = [i for i, w in enumerate(weights) if w.requires_grad]
        if len(trained) == len(weights):
            return _CastWeights.apply(dtype, *weights)
        out = [cache.get(w, dtype, k) for w, k in zip(weights, keys)]
        for i, low in zip(trained, _CastWeights.apply(dtype, *(weights[i] for i in trained))):
            out[i] = low
        return tuple(out)
    return cache.get_all(weights, dtype, keys)


class _CastWeights(torch.autograd.Function):
    """All of a forward's weight casts as one autograd node.

    One node instead of one ``ToCopyBackward`` per weight: the backward hands the low-precision
    gradients back and the autograd engine casts each to its weight's dtype (float32) in C++.
    """

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # unused weights keep grad None
        return tuple(w.to(dtype) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def checkpointed(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(block, *args, **kwargs)``: a block the user checkpointed.

    A function of its own so that torch.fx keeps it a call when it traces a converted module again
    (unpickling) instead of tracing through ``checkpoint``.
    """
    from torch.utils.checkpoint import checkpoint

    return checkpoint(block, *args, **kwargs)


def call_module_cast(module: nn.Module, dtype: torch.dtype, *args: Any,
                     _fxamp_cache: Optional[Tuple[WeightCastCache, str]] = None, **kwargs: Any) -> Any:
    """Run a leaf module with its float parameters and buffers (and float inputs) cast to ``dtype``.

    For leaf modules whose weights stay float32 (O1) but that run in low precision (RNNs,
    MultiheadAttention): the cast copies are differentiable, so gradients reach the float32
    parameters.  ``_fxamp_cache``, ``(cache, module path)``, is the converted module's weight
    cache: where no autograd graph is recorded for a tensor (``no_grad``, frozen weights) its copy
    is reused until it changes, as :func:`cast_weights` does for the other weights (an
    ``nn.MultiheadAttention`` in inference then runs PyTorch's fused fast path with no cast at all).
    A buffer the module writes in place is written back, as a graph's in-place op on a cast tensor is.
    """
    cache, path = (None, "") if _fxamp_cache is None or torch.compiler.is_compiling() else _fxamp_cache
    grad = torch.is_grad_enabled()
    if cache is not None and grad and any(p.requires_grad for p in module.parameters()):
        cache.clear()  # a training forward (see WeightCastCache)

    def low(name: str, t: torch.Tensor) -> torch.Tensor:
        if cache is None or t.dtype == dtype or t.dtype not in CASTABLE or (grad and t.requires_grad):
            return cast(t, dtype)
        return cache.get(t, dtype, f"{path}.{name}")

    tensors = {name: low(name, t) for name, t in module.named_parameters()}
    buffers = dict(module.named_buffers())
    tensors.update({name: low(name, t) for name, t in buffers.items()})
    done: Dict[int, Any] = {}

    def once(value: Any) -> Any:  # one input passed twice (query is key is value) is cast once, and stays one
        if id(value) not in done:
            done[id(value)] = cast(value, dtype)
        return done[id(value)]

    args = tuple(once(a) for a in args)
    kwargs = {k: once(v) for k, v in kwargs.items()}
    copies = [(b, tensors[name], tensors[name]._version) for name, b in buffers.items() if tensors[name] is not b]
    out = torch.func.functional_call(module, tensors, args, kwargs, tie_weights=True, strict=False)
    for buffer, low_copy, version in copies:  # written in place (the legacy spectral_norm's power iteration): kept
        if low_copy._version != version:
            with torch.no_grad():
                buffer.copy_(low_copy)
    return out


# ---------------------------------------------------------------------------------------------
# The storage dtypes a converted module keeps
# ---------------------------------------------------------------------------------------------


def refuse_dtype_change(fn: Any, dtypes: Tuple[torch.dtype, ...], policy: str) -> None:
    """Raise TypeError if ``fn``, a function ``nn.Module._apply`` maps over tensors, changes any of ``dtypes``.

    ``.half()``, ``.float()``, ``.to(torch.float64)`` and ``.to(device, dtype)`` reach a module only as
    such a function, so it is asked what it makes of an empty tensor of each stored dtype (``.to(device)``
    keeps them: allowed).  A function that fails on the probe is not a cast: allowed.
    """
    for dtype in dtypes:
        try:
            probe = fn(torch.empty(0, dtype=dtype))
        except Exception:  # e.g. a device this process cannot reach: not a dtype change either
            continue
        if isinstance(probe, torch.Tensor) and probe.dtype != dtype:
            old, new = (str(d).removeprefix("torch.") for d in (dtype, probe.dtype))
            raise TypeError(
                f"this would make a converted module's {old} tensors {new}, but its casts assume the storage "
                f"its policy chose ({policy}): convert the original model at the precision you want "
                f"(fxamp.convert(model, policy, dtype=...)) instead of .half()/.float()/.to(dtype); .to(device) is fine")


class StorageCheck(nn.Module):
    """The first child of a converted ``GraphModule``: refuses a dtype change of its tensors (``.half()``...).

    ``nn.Module._apply`` (behind ``.to()``, ``.half()``, ``.float()``, ``.cuda()``) visits children before
    parameters, so this refuses before any tensor changed.  A child module, not a hook: it survives
    deepcopy and pickling with the module, and nothing of torch is patched.  It holds no tensor.
    """

    def __init__(self, dtypes: Tuple[torch.dtype, ...], policy: str) -> None:
        super().__init__()
        self.dtypes = tuple(dtypes)
        self.policy = policy

    def _apply(self, fn: Any, recurse: bool = True) -> "StorageCheck":
        refuse_dtype_change(fn, self.dtypes, self.policy)
        return self

    def extra_repr(self) -> str:
        return "keeps " + ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)


#: the converted module's attribute holding its :class:`StorageCheck`
STORAGE_CHECK_NAME = "_fxamp_storage_check"


def check_storage(gm: nn.Module, dtypes: Tuple[torch.dtype, ...], policy: str) -> None:
    """Make a :class:`StorageCheck` the first child of ``gm`` (first: ``_apply`` visits it before any other)."""
    children = dict(gm._modules)
    children.pop(STORAGE_CHECK_NAME, None)
    gm._modules.clear()
    gm._modules[STORAGE_CHECK_NAME] = StorageCheck(dtypes, policy)
    gm._modules.update(children)
