"""``convert()``: trace → classify → rewrite, returning a plain ``GraphModule`` that runs mixed precision."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .capture import (LeafSpec, capture, copy_root_hooks, root_hooks_note, torchscript_error, traced_hooks_error,
                      user_hooks)
from .graph import replace_tensors, tensor_slots
from ..dtypes import LOW, dtype_name
from ..errors import TraceError
from ..info import ConversionInfo, conversion_info, policy_of
from .blocks import convert_blocks
from .lazy import LazyConverted, with_range_fallback
from .none_patterns import with_none_patterns
from .op_lists import Category, OpEntry, OpKey, OpLists
from .options import ConvertOptions, DebugOverflow, Dynamic, ModuleOverrides, NodeOverrides
from .pipeline import rewrite_captured
from .runtime.graph_module import optional_inputs
from ..policy import Policy, default_dtype, device_type_of, resolve_policy
from .rewrite.casts import CACHE_NAME

__all__ = ["convert", "convert_", "policy_of", "clear_cast_cache", "ConversionInfo", "conversion_info", "ConvertOptions",
           "DebugOverflow", "Dynamic"]


def _outside_inference_mode(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Run a conversion outside ``torch.inference_mode``: the low-precision copies O2/O3 make (and any tensor
    made at conversion) would otherwise be inference tensors, which a later training step refuses to save
    for backward ("Inference tensors cannot be saved for backward")."""
    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> nn.Module:
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return outside


@_outside_inference_mode
def convert(
    model: nn.Module,
    policy: Union[str, Policy] = "O1",
    *,
    dtype: Union[str, torch.dtype, None] = None,
    keep_norms_fp32: bool = False,
    overrides: Optional[Mapping[OpKey, Union[str, Category, OpEntry]]] = None,
    module_overrides: Optional[ModuleOverrides] = None,
    node_overrides: Optional[NodeOverrides] = None,
    op_lists: Optional[OpLists] = None,
    leaf_modules: Sequence[LeafSpec] = (),
    example_inputs: Optional[Tuple[Any, ...]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    frontend: str = "auto",
    dynamic: Union[str, Dynamic] = Dynamic.BATCH,
    dynamic_shapes: Any = None,
    weight_cache: bool = True,
    debug_overflow: Union[str, DebugOverflow] = DebugOverflow.OFF,
    recompute_islands: bool = True,
) -> nn.Module:
    """Return a copy of ``model`` whose forward runs mixed precision through explicit casts.

    policy:           ``"O0"``..``"O3"``, a ``"params=...,compute=..."`` string, or a :class:`Policy`.
    dtype:            the low-precision dtype of a preset: float16 or bfloat16; by default autocast's for the
                      model's device (bfloat16 on CPU, float16 on CUDA), said in ``conversion_info(...).notes``.
    keep_norms_fp32:  O3 only: keep normalisation layers in float32 (apex's keep_batchnorm_fp32).
    overrides:        change op categories: ``{torch.exp: "neutral", nn.GELU: "unsafe", "Tensor.sum": ...}``.
    module_overrides: change every op under a module path: ``{"encoder.layers.3": "unsafe"}``.
    node_overrides:   change one op, by its node name as ``fxamp.report`` shows it (``{"add_1": "unsafe"}``):
                      for an op in the model's own ``forward``, which no module path covers alone.
                      Names belong to one capture: check them in the report of the same front end.
    op_lists:         replace the default op lists altogether (``overrides`` apply on top).
    leaf_modules:     module classes or paths that torch.fx must not trace into (a float32 leaf holding
                      more than 10% of the parameters is noted and warned about).
    example_inputs / example_kwargs: let fxamp fall back to ``torch.export`` (or force it with
                      ``frontend="export"``).
    dynamic:          export only, a :class:`~fxamp.conversion.options.Dynamic`: ``"batch"`` keeps batch and sequence sizes free
                      (image sizes stay static), ``"all"`` every dim, ``"none"`` none; ``dynamic_shapes``
                      goes to ``torch.export`` as given.
    weight_cache:     reuse low-precision weight copies (leaf modules' too) across no-grad calls until a weight changes.
    debug_overflow:   a :class:`~fxamp.conversion.options.DebugOverflow`: ``"off"``; ``"record"`` the first node whose output
                      (forward) or gradient (backward) has inf/NaN (``fxamp.overflow_info(amp)``);
                      ``"raise"`` there.  See ``fxamp.conversion.rewrite.debug``.
    recompute_islands: float32 ops reading exact upcasts of low-precision values (the loss's log-softmax,
                      norms, softmax) keep the low-precision input for backward and recompute in backward,
                      with the same gradients (``fxamp.conversion.rewrite.islands``); per node, ``node_overrides``/
                      ``module_overrides`` take ``"recompute"``/``"no_recompute"``.  False: off.

    The keywords from ``overrides`` to ``recompute_islands`` are checked and bundled into one
    :class:`~fxamp.conversion.options.ConvertOptions` that the capture and the rewrite (now, or at each lazy capture) read.

    Returns a ``GraphModule``; or, when torch.fx cannot trace ``model`` and no example inputs were
    given (or ``frontend="export"`` without them), a :class:`fxamp.conversion.lazy.LazyConverted` that captures with
    ``torch.export`` at its first call and again for each new call signature; its parameters exist
    at once, in their storage dtypes, so an optimizer can be built before the first call.  A
    ``LazyConverted`` also when the training and eval captures differ (stochastic depth), with either
    front end: it holds the graph captured now for the current mode and captures the other mode at its
    first call in that mode (torch.fx: with no inputs; torch.export: from that call's, with the
    ``dynamic_shapes`` given, if any), so ``train()``/``eval()`` switch the whole computation.  A
    ``LazyConverted`` also for a torch.export capture of a model with hooks on its root: they run around
    its call, once, whichever capture the call runs.  The root's hooks (captured by no front end) are
    registered on the module returned.

    The model passed in is never changed.  O0/O1 modules share its parameters (they stay float32);
    O2/O3 modules own low-precision copies, under the same ``state_dict`` keys.
    """
    pol, chosen = _resolve(model, policy, dtype, keep_norms_fp32, "convert")
    options = ConvertOptions(op_lists=op_lists, overrides=overrides, module_overrides=module_overrides,
                             node_overrides=node_overrides, weight_cache=weight_cache,
                             debug_overflow=debug_overflow, dynamic=dynamic,
                             recompute_islands=recompute_islands)
    if isinstance(model, torch.jit.ScriptModule):  # torch.fx and torch.export read Python code, not TorchScript
        raise TypeError(f"fxamp.convert cannot capture a TorchScript module ({type(model).__name__}, from "
                        f"torch.jit.script/trace): convert the Python nn.Module it was made from instead")
    _refuse_other_low_dtype(model, pol)
    has_inputs = example_inputs is not None or example_kwargs is not None
    changes_storage = pol.params != torch.float32 or pol.norms != torch.float32
    source = _copy_tree(model) if changes_storage else model

    def owned(module: nn.Module) -> nn.Module:  # O0/O1 share the original's tensors on purpose
        return _own_storage(module, model) if changes_storage else module

    if frontend == "export" and not has_inputs:
        _refuse_traced_hooks(model)
        return owned(LazyConverted(source, pol, options, owns_model=changes_storage, notes=chosen))
    try:
        captured = capture(source, frontend=frontend, leaf_modules=leaf_modules, example_inputs=example_inputs,
                           example_kwargs=example_kwargs, dynamic=options.dynamic, dynamic_shapes=dynamic_shapes,
                           graph_per_mode=True)
    except TraceError as e:
        if frontend != "auto" or has_inputs or leaf_modules:
            raise  # export was tried already, or cannot help (leaf_modules)
        _refuse_traced_hooks(model, f"torch.fx could not trace the model ({e.short})")
        return owned(LazyConverted(source, pol, options, owns_model=changes_storage, fx_error=e, notes=chosen))
    hook_note = root_hooks_note(source)  # (no capture ran the root's hooks: the module returned holds them)
    # The modes capture different graphs (stochastic depth, a branch on self.training): one graph would be wrong
    # in the other mode, so hold a graph per mode, as the lazy path does (its captures with the dynamic_shapes
    # given, if any).  Or the root has hooks and torch.export captured: they must run once per call, around
    # every input check, but the graph module retries a call outside its range on another capture
    # (RangeFallback) after its pre-hooks ran; a LazyConverted runs them around its own retries.
    if captured.only_mode is not None or (hook_note and captured.frontend == "export"):
        fx_graphs = captured.frontend == "fx"  # (a torch.fx graph takes any call: no example inputs kept)
        if captured.only_mode is None:
            lead = _HOOKED_NOTE
        else:
            lead = (_PER_MODE_NOTE_FX if fx_graphs else _PER_MODE_NOTE).format(
                mode="training" if captured.only_mode else "eval")
        amp = LazyConverted(source, pol, options, owns_model=changes_storage, fx_error=captured.fx_error,
                            lead_note=lead, notes=chosen, frontend=captured.frontend, leaf_modules=leaf_modules,
                            dynamic_shapes=None if fx_graphs else dynamic_shapes)
        amp.adopt_capture(captured, () if fx_graphs else tuple(example_inputs or ()),
                          {} if fx_graphs else dict(example_kwargs or {}))
        return owned(amp)
    gm = owned(rewrite_captured(captured, pol, options, notes=(*chosen, *hook_note)))
    copy_root_hooks(source, gm)
    if captured.frontend == "fx" and optional_inputs(gm):
        # torch.fx traced each input that defaults to None as given (`if labels is not None:` took that branch):
        # a call that leaves one None captures its own graph, once, on the same tensors (owned: a tensor only
        # that graph reads is a copy too, never the original's)
        gm = with_none_patterns(gm, owned(source), pol, options, owns_model=changes_storage, leaf_modules=leaf_modules)
    if captured.frontend == "export" and dynamic_shapes is None:
        # torch.export's capture holds for a range of sizes (from 2, where Dim.AUTO starts): a call outside it
        # (the last batch of 1) captures again, as a lazy module does, on the same tensors
        gm = with_range_fallback(gm, source, pol, options, owns_model=changes_storage)
    return gm


@_outside_inference_mode
def convert_(
    model: nn.Module,
    policy: Union[str, Policy] = "O1",
    *,
    blocks: Optional[Sequence[str]] = None,
    dtype: Union[str, torch.dtype, None] = None,
    keep_norms_fp32: bool = False,
    overrides: Optional[Mapping[OpKey, Union[str, Category, OpEntry]]] = None,
    module_overrides: Optional[ModuleOverrides] = None,
    op_lists: Optional[OpLists] = None,
    weight_cache: bool = True,
    debug_overflow: Union[str, DebugOverflow] = DebugOverflow.OFF,
    keep_originals: bool = True,
    recompute_islands: bool = True,
) -> nn.Module:
    """Convert ``model`` in place, block by block, and return it (the same object): see ``blocks.py``.

    blocks: module path globs of the blocks (``["model.layers.*"]``); by default the repeated children of
            every ``nn.ModuleList``.  Each block is replaced by a converted module of a subclass of its class,
            holding the same children, parameters, attributes and hooks; one capture (torch.fx, at the first
            call) per block class, structure and call signature serves every instance.  Linear, embedding,
            convolution and norm modules outside blocks get module-level decisions (the glue); the rest of
            the model (its Python: ``generate``, caches, losses) runs as written.
    The other keywords are ``convert``'s (``module_overrides`` paths are the model's: each block's graph
    gets the ones inside it, and instances with different ones stop sharing a graph); ``node_overrides``,
    ``leaf_modules``, ``frontend`` and example inputs have no meaning here (each block is captured at its
    first call, with torch.fx, then torch.fx on the call's values, then torch.export).  ``model``'s object, class, methods, ``config`` and hooks stay;
    ``state_dict`` keys do not change; under O2/O3 the converted modules' tensors are re-bound to their
    storage dtypes at once (predicted from the module tree, as for a ``LazyConverted``).
    keep_originals: under O2/O3, hold the float32 tensors those re-bound parameters replace until a
            ``MixedPrecisionOptimizer`` takes them as its masters: the fine-tuning starts from the exact
            float32 weights, with no second float32 copy (memory: the model plus its low-precision copy
            until then).  False for inference: they are freed now (``fxamp.release_originals(model)``
            frees them later).
    """
    if not isinstance(keep_originals, bool):
        raise TypeError(f"keep_originals must be True or False, not {keep_originals!r}")
    pol, chosen = _resolve(model, policy, dtype, keep_norms_fp32, "convert_")
    options = ConvertOptions(op_lists=op_lists, overrides=overrides, module_overrides=module_overrides,
                             weight_cache=weight_cache, debug_overflow=debug_overflow,
                             recompute_islands=recompute_islands)
    _refuse_other_low_dtype(model, pol)
    return convert_blocks(model, pol, options, blocks, notes=chosen, keep_originals=keep_originals)



def _resolve(model: nn.Module, policy: Union[str, Policy], dtype: Union[str, torch.dtype, None],
             keep_norms_fp32: bool, entry: str) -> Tuple[Policy, Tuple[str, ...]]:
    """The policy for ``model``'s device, and the note saying which dtype a preset without ``dtype=`` chose
    (autocast's per-device default)."""
    if isinstance(model, type) and issubclass(model, nn.Module):  # `convert(Net, ...)`: the class, not a model
        raise TypeError(f"fxamp.{entry} takes an nn.Module instance, not the class {model.__name__}: "
                        f"pass {model.__name__}(...)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxamp.{entry} takes an nn.Module, not {type(model).__name__}")
    lazy = next((n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)), None)
    if lazy is not None:  # a LazyLinear/LazyConv before its first call: its shapes are not known yet
        raise ValueError(f"fxamp.{entry}: parameter {lazy!r} is uninitialized (a lazy module, e.g. nn.LazyLinear): "
                         f"run the model once on an example input before converting it")
    device_type = device_type_of(model)
    pol = resolve_policy(policy, dtype, keep_norms_fp32=keep_norms_fp32, device_type=device_type)
    chosen = (default_dtype(device_type)[1],) if dtype is None and isinstance(policy, str) and "=" not in policy \
        and pol.enabled else ()
    return pol, chosen


def _copy_tree(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose registered parameters and buffers are still the original's tensors.

    O2/O3 re-bind most of them to low-precision copies made from the original directly; a full deep
    copy first would hold a second float32 model while those are made (peak 2.5x the model instead of
    1.5x for bfloat16).  :func:`_own_storage` copies whatever is still shared once the storage is chosen.
    The hooks that are the user's objects (``capture.user_hooks``) are not copied either.
    """
    memo: Dict[int, Any] = {id(t): t for _, _, _, t in tensor_slots(model)}
    memo.update((id(hook), hook) for hook in user_hooks(model))  # a counter's hook counts for the user, not a copy
    # a tensor a hook computes from parameters and sets as a plain attribute (torch.nn.utils.prune's ``weight``,
    # the legacy weight_norm's): not a leaf, which deepcopy refuses; the hook computes it again at every call
    memo.update((id(v), v) for m in model.modules() for v in vars(m).values()
                if isinstance(v, torch.Tensor) and v.grad_fn is not None)
    copied = copy.deepcopy(model, memo=memo)
    # a TorchScript module copies itself in C++, past the memo, and clones its tensors with autograd: its
    # parameters came back non-leaf (CloneBackward), which no optimizer takes; they are detached here (the
    # clone's memory is the copy's own already)
    for _, owner, attr, t in list(tensor_slots(copied)):
        if isinstance(owner, torch.jit.ScriptModule) and t.grad_fn is not None:
            detached = t.detach()
            setattr(owner, attr, nn.Parameter(detached, t.requires_grad) if attr in owner._parameters else detached)
    return copied


def _own_storage(module: nn.Module, original: nn.Module) -> nn.Module:
    """Copy the parameters and buffers ``module`` still shares with ``original`` (those that stayed float32,
    such as norms' under O2): training the converted module updates them in place, and the model passed
    in must never change.  A deep copy of each keeps a parameter's class and attributes, as a deep copy of
    the model did; tied tensors stay tied."""
    theirs = {id(t) for _, _, _, t in tensor_slots(original)}
    memo: Dict[int, Any] = {}
    replace_tensors(module, lambda _name, t: copy.deepcopy(t, memo) if id(t) in theirs else None)
    return module


_PER_MODE_NOTE = ("training and eval mode capture different graphs, so fxamp holds a graph per mode (a "
                  "fxamp.conversion.lazy.LazyConverted): the {mode} mode graph was captured from the example inputs; the other "
                  "mode's is captured with torch.export at its first call, as is each new call signature")
_HOOKED_NOTE = ("the root's hooks run around each call of the converted module, so fxamp holds the graph torch.export "
                "captured from the example inputs in a fxamp.conversion.lazy.LazyConverted: a call outside the range "
                "that capture holds for, or with a new call signature, is captured at that call, the hooks run once")
_PER_MODE_NOTE_FX = ("training and eval mode capture different graphs, so fxamp holds a graph per mode (a "
                     "fxamp.conversion.lazy.LazyConverted): torch.fx captured the {mode} mode graph now, and captures "
                     "the other mode's at its first call; both share one set of parameters")


def _refuse_traced_hooks(model: nn.Module, why: Optional[str] = None) -> None:
    """Refuse now, not at the first call, a model whose hooks the lazy torch.export capture would trace in, or that
    holds TorchScript modules, which it cannot capture."""
    refused = traced_hooks_error(model, "torch.export", why) or torchscript_error(model, why)
    if refused is not None:
        raise refused


def _refuse_other_low_dtype(model: nn.Module, policy: Policy) -> None:
    """A model already in one low dtype converted to compute in the other (a bfloat16 model with a float16
    policy): every op would cast the stored weights, and float16 cannot hold bfloat16's range."""
    if not policy.enabled:
        return
    low = policy.compute if policy.compute != torch.float32 else policy.params
    for name, p in model.named_parameters():
        if p.dtype in LOW and p.dtype != low:
            raise ValueError(
                f"fxamp.convert: the model's parameters are already {dtype_name(p.dtype)} ({name!r}) but the "
                f"policy computes in {dtype_name(low)}; convert the float32 model (model.float() first) with "
                f"dtype={dtype_name(low)}, or keep {dtype_name(p.dtype)} with dtype={dtype_name(p.dtype)}")


def clear_cast_cache(module: nn.Module) -> None:
    """Drop cached low-precision weight copies (needed only after writing weights through ``.data``)."""
    cache = getattr(module, CACHE_NAME, None)  # a LazyConverted's clears every capture's cache
    if cache is not None:
        cache.clear()
