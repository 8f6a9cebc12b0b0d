"""The few functions a converted module's generated forward calls (the casts fxamp inserts).

They are plain functions over tensors: no global state, nothing patched, traceable by
``torch.compile``.  ``cast`` decides at run time, like autocast's own cast, whether a value is a
tensor it may cast, so conversion works without example inputs.
"""

from __future__ import annotations

import math
import re
import traceback
import weakref
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..dtypes import CASTABLE, LOW
from ..errors import FxampError
from ..info import watch_for_masters
from .graph import decision_of

__all__ = ["cast", "cast_dense", "cast_weights", "call_module_cast", "attention", "multi_head_attention",
           "StorageCheck", "check_storage", "refuse_dtype_change",
           "WeightCastCache", "NodeErrors", "name_failing_nodes", "ConvertedGraphModule", "as_converted",
           "checkpointed"]


def cast(x: Any, dtype: torch.dtype) -> Any:
    """``x.to(dtype)`` if ``x`` is a float16/bfloat16/float32 tensor of another dtype, else ``x`` unchanged.

    Containers torch passes between modules are cast element by element, keeping their type:
    lists and tuples (``torch.cat``'s argument, an LSTM's ``(h, c)``), named tuples, plain dicts,
    and a ``PackedSequence``, of which only ``.data`` is cast (its ``batch_sizes`` and indices are
    integer tensors, and float64 is never cast anyway).
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
    if kind in (dict, OrderedDict):
        return kind((k, cast(v, dtype)) for k, v in x.items())
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

    For ``rewrite.py``'s casts of values whose dtype it inferred (where it emits a plain
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
    tensors.update({name: low(name, t) for name, t in module.named_buffers()})
    done: Dict[int, Any] = {}

    def once(value: Any) -> Any:  # one input passed twice (query is key is value) is cast once, and stays one
        if id(value) not in done:
            done[id(value)] = cast(value, dtype)
        return done[id(value)]

    args = tuple(once(a) for a in args)
    kwargs = {k: once(v) for k, v in kwargs.items()}
    return torch.func.functional_call(module, tensors, args, kwargs, tie_weights=True, strict=False)


try:
    _SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
except (AttributeError, RuntimeError):  # pragma: no cover (older torch)
    _SAFE_SOFTMAX = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Any = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that saves low-precision probabilities when dropout is on (CPU).

    PyTorch's CPU SDPA with dropout takes its math path, which computes and saves the probabilities
    in float32.  Here, on CPU with float16/bfloat16 inputs and dropout on, attention is computed in
    the inputs' dtype: ``softmax(q·scale @ kᵀ + mask)`` (the softmax kernel accumulates in float32)
    → dropout → ``@ v``.  Otherwise (no dropout, float32, another device) it is SDPA itself.
    Placed by :func:`fxamp.conversion.attention.low_precision_attention`.
    """
    if (dropout_p == 0.0 or q.device.type != "cpu" or q.dtype not in LOW
            or k.dtype != q.dtype or v.dtype != q.dtype):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    L, S = q.size(-2), k.size(-2)
    s = (1.0 / math.sqrt(q.size(-1))) if scale is None else scale
    scores = (q * s) @ k.transpose(-2, -1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    # a fully masked row gives zeros, not NaN, as SDPA's math path (its _safe_softmax)
    # (the aten op, not torch._safe_softmax: torch.compile traces the former, breaks the graph on the latter)
    probs = _SAFE_SOFTMAX(scores, -1) if _SAFE_SOFTMAX is not None else torch.softmax(scores, dim=-1)
    return F.dropout(probs, dropout_p, training=True) @ v


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")
_MHA_DEFAULTS = (None, None, None, None, True, None, True, False)


def multi_head_attention(module: nn.MultiheadAttention, dtype: torch.dtype, *args: Any,
                         _fxamp_cache: Optional[Tuple[WeightCastCache, str]] = None, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` in ``dtype``, saving low-precision probabilities when dropout is on (CPU).

    ``nn.MultiheadAttention`` in training with dropout calls SDPA's CPU math path, which saves its
    probabilities in float32.  For the common form (batched inputs, packed same-size projections,
    no bias_k/bias_v/add_zero_attn, ``need_weights=False``, training, dropout > 0, on CPU) this is
    ``F.multi_head_attention_forward``'s own steps with :func:`attention` in their middle: the
    projections, the merged float mask, attention, the output projection.  Anything else is the
    module itself (through :func:`call_module_cast` when its parameters are not in ``dtype``, with
    the weight cache ``_fxamp_cache``).  Placed by :func:`fxamp.conversion.attention.low_precision_attention`
    (O1: instead of ``call_module_cast``).
    """
    bound = dict(zip(_MHA_ARGS, _MHA_DEFAULTS))
    bound.update(zip(_MHA_ARGS, args))
    bound.update(kwargs)
    m, query = module, bound["query"]
    if (bound["need_weights"] or not m.training or m.dropout == 0.0 or not m._qkv_same_embed_dim
            or m.bias_k is not None or m.bias_v is not None or m.add_zero_attn or query.dim() != 3
            or query.device.type != "cpu" or dtype not in LOW):
        if all(p.dtype == dtype for p in m.parameters()):
            return m(*args, **kwargs)
        return call_module_cast(m, dtype, *args, _fxamp_cache=_fxamp_cache, **kwargs)
    same = query is bound["key"] and bound["key"] is bound["value"]
    if same:  # (cast once: three casts of one tensor would be three copies)
        query = key = value = cast(query, dtype)
    else:
        query, key, value = (cast(bound[k], dtype) for k in ("query", "key", "value"))
    if not m.batch_first:  # (L, N, E) -> (N, L, E)
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    n, tgt, embed = query.shape
    src, heads = key.shape[1], m.num_heads
    head_dim = embed // heads
    w, b = cast(m.in_proj_weight, dtype), cast(m.in_proj_bias, dtype) if m.in_proj_bias is not None else None
    if same:
        q, k, v = F.linear(query, w, b).chunk(3, dim=-1)
    else:
        ws, bs = w.chunk(3), b.chunk(3) if b is not None else (None, None, None)
        q, k, v = (F.linear(t, wi, bi) for t, wi, bi in zip((query, key, value), ws, bs))
    q = q.reshape(n, tgt, heads, head_dim).transpose(1, 2)
    k = k.reshape(n, src, heads, head_dim).transpose(1, 2)
    v = v.reshape(n, src, heads, head_dim).transpose(1, 2)
    mask, causal = _mha_mask(bound["attn_mask"], bound["key_padding_mask"], bool(bound["is_causal"]),
                             n, heads, tgt, src, dtype)
    out = attention(q, k, v, mask, m.dropout, causal)
    out = out.transpose(1, 2).reshape(n, tgt, embed)
    out = F.linear(out, cast(m.out_proj.weight, dtype),
                   cast(m.out_proj.bias, dtype) if m.out_proj.bias is not None else None)
    return (out if m.batch_first else out.transpose(0, 1)), None


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nn.MultiheadAttention's masks: True (bool) means masked out; float masks are added."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _mha_mask(attn_mask: Any, key_padding_mask: Any, is_causal: bool, n: int, heads: int, tgt: int, src: int,
              dtype: torch.dtype) -> Tuple[Any, bool]:
    """The (mask, is_causal) ``F.multi_head_attention_forward`` hands SDPA with ``need_weights=False``."""
    if is_causal and key_padding_mask is None:
        return None, True  # the causal hint alone (a given attn_mask is the causal mask)
    mask = None
    if attn_mask is not None:
        mask = _float_mask(attn_mask, dtype)
        mask = mask.view(1, 1, tgt, src) if mask.dim() == 2 else mask.view(n, heads, tgt, src)
    if key_padding_mask is not None:
        pad = _float_mask(key_padding_mask, dtype).view(n, 1, 1, src)
        mask = pad if mask is None else mask + pad
    return mask, False



# ---------------------------------------------------------------------------------------------
# Run-time errors: torch's message, with the converted node named (no generated-code dump)
# ---------------------------------------------------------------------------------------------

_NODE_LINE = re.compile(r"\s*(\w+)\s*=")  # the generated forward assigns each node's value to its name


class NodeErrors:
    """How a converted ``GraphModule`` is called (its ``_wrapped_call``, which ``GraphModule.__call__``
    looks up on the instance): as before, but an error raised by one of its nodes keeps torch's own
    message, followed by the node's name and op, instead of torch.fx printing the generated code
    and its traceback to stderr first.  Holds nothing: it pickles and deep-copies as it is.
    """

    def __call__(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        try:
            # the class's __call__ resolved at each call (torch.fx's tracer patches nn.Module.__call__)
            return super(type(gm), gm).__call__(*args, **kwargs)
        except FxampError:
            raise  # fxamp's own errors (debug_overflow="raise") name their node already
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "eval_with_key" in f.filename]
            if not frames or getattr(e, "fxamp_node", None) is not None:
                raise  # not from this module's generated code, or an inner converted module named its node
            match = _NODE_LINE.match(frames[-1].line or "")
            name = match.group(1) if match else None
            node = next((n for n in gm.graph.nodes if n.name == name), None)
            if node is None:
                raise
            e.fxamp_node = node.name  # type: ignore[attr-defined]
            d = decision_of(node)
            where = f" ({d.op}{f' in module {d.module!r}' if d.module else ''})" if d is not None else ""
            said = f"[raised by the converted module's node {node.name!r}{where}]"
            if len(e.args) == 1 and isinstance(e.args[0], str) and not isinstance(e, KeyError):
                e.args = (f"{e.args[0]} {said}",)
            else:
                e.add_note(said)
            if "eval_with_key" in traceback.extract_tb(e.__traceback__)[-1].filename:
                raise e.with_traceback(None) from None  # raised by the generated line itself: nothing below it
            raise


def name_failing_nodes(gm: fx.GraphModule) -> None:
    """Make ``gm``'s run-time errors name their node (:class:`NodeErrors`), through deepcopy (and, for a
    :class:`ConvertedGraphModule`, pickling)."""
    gm._wrapped_call = NodeErrors()
    gm.meta.setdefault("_user_preserved_attributes", {})["_wrapped_call"] = gm._wrapped_call


def _rearm(gm: fx.GraphModule) -> None:
    """What a copy of a converted module needs again: its node-naming call and its first-gradient check
    (tensor hooks are not copied with the tensors; see :func:`fxamp.info.watch_for_masters`)."""
    name_failing_nodes(gm)
    watch_for_masters(gm.parameters())


class ConvertedGraphModule(fx.GraphModule):
    """The class of a converted module captured by torch.fx: a ``GraphModule`` whose copies keep what
    conversion set up on it.

    ``GraphModule`` rebuilds a plain ``GraphModule`` from its generated code when unpickled (the
    node-naming call, a class attribute there, is lost) and neither deepcopy nor pickling copies
    tensor hooks (the check that warns when no ``MixedPrecisionOptimizer`` keeps masters).  Both are
    set up again on the copy.  (A module captured by torch.export keeps torch's own class.)
    """

    def __reduce__(self) -> Any:
        rebuild, args = super().__reduce__()
        return (_unpickle_converted, (rebuild, args))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ConvertedGraphModule":
        copied = super().__deepcopy__(memo)
        _rearm(copied)
        return copied


def as_converted(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a :class:`ConvertedGraphModule` (same attributes, same graph), if it is a plain
    ``GraphModule``; a subclass (torch.export's) is returned as it is."""
    if isinstance(gm, ConvertedGraphModule) or type(gm).__mro__[1] is not fx.GraphModule:
        return gm
    converted = ConvertedGraphModule.__new__(ConvertedGraphModule)
    vars(converted).update(vars(gm))
    converted.graph = gm.graph  # the graph's owner, and the generated forward on the new class
    type(converted).__name__ = type(gm).__name__
    return converted


def _unpickle_converted(rebuild: Any, args: Tuple[Any, ...]) -> ConvertedGraphModule:
    plain = rebuild(*args)
    converted = as_converted(plain)
    _rearm(converted)
    return converted


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
