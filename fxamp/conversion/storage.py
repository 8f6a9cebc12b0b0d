"""The storage a model will have before any graph exists, and the float32 view a capture needs.

A lazily capturing module (:mod:`fxamp.conversion.lazy`) and a model converted in place
(:mod:`fxamp.conversion.blocks`) make their parameters before their first capture, so an
optimizer can be built on them: :func:`predict_storage` decides each tensor's storage dtype from
the module tree.  Every capture then runs the forward as written, for float32 tensors, within
:class:`float32_for_capture`.  Both entry points use this module; neither imports the other for it.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..dtypes import LOW
from ..policy import Policy
from .bytecode import codes_of, feeds_only
from .graph import covering, rebind, replace_tensors, tensor_slots
from .op_lists import Category, as_entry, Source

__all__ = ["predict_storage", "is_norm", "lookups_into_norms", "float32_for_capture"]

#: layers whose tensors feed low-precision ops (matmuls, convolutions, lookups)
_LOW_LAYERS: Tuple[type, ...] = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag,
                                 nn.MultiheadAttention, nn.RNNBase)
#: class names of other libraries' linear layers (Hugging Face GPT-2's ``Conv1D`` is a transposed linear)
_LOW_LAYER_NAMES = ("Conv1D",)
_NORMS: Tuple[type, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
                            nn.RMSNorm)


def is_norm(m: nn.Module) -> bool:
    return isinstance(m, _NORMS) or "norm" in type(m).__name__.lower()


def lookups_into_norms(model: nn.Module) -> Set[int]:
    """``id`` of each embedding layer whose every lookup its parent hands straight to a torch norm layer beside it,
    and to nothing else: ``self.norm(self.tok_embeddings(ids))`` (ModernBERT), or through a local that is
    otherwise only tested against None or asked for its shape (BLOOM's ``word_embeddings_layernorm``).

    Whole-model conversion computes such a lookup in float32 (only float32 ops use it: classify's
    ``float32_users``) and so keeps its table float32 under O2; this predicts the same from the parent's
    bytecode (:func:`~fxamp.conversion.bytecode.feeds_only`), where no module above the parent names it
    and the layer runs torch's own forward (a subclass that scales its lookup is traced through).
    """
    lookups: Dict[int, List[bool]] = collections.defaultdict(list)
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, m in modules.items():
        # (isinstance first: a TorchScript module's class answers .forward only on an instance)
        if not path or not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or type(m).forward not in (
                nn.Embedding.forward, nn.EmbeddingBag.forward):
            continue
        parent, _, name = path.rpartition(".")
        norms = [n for n, c in modules[parent]._modules.items() if isinstance(c, _NORMS)]
        verdicts = [feeds_only(code, name, norms) for code in codes_of(type(modules[parent]))] if norms else []
        above = [".".join(parent.split(".")[:i]) for i in range(parent.count(".") + 1)] if parent else []
        named_above = any(name in code.co_names for p in above for code in codes_of(type(modules[p])))
        lookups[id(m)].append(True in verdicts and False not in verdicts and not named_above)
    return {key for key, ok in lookups.items() if all(ok)}


def predict_storage(model: nn.Module, policy: Policy,
                    module_overrides: Optional[Mapping[str, Any]] = None) -> Dict[str, torch.dtype]:
    """The dtype each float32 parameter and buffer of ``model`` will be stored in, by name, without a graph.

    ``module_overrides`` (``convert``'s): a module the user made ``"unsafe"`` keeps its tensors float32,
    one made ``"safe"`` stores its parameters in ``policy.params``, whatever its class (the most specific
    path decides), as whole-model conversion stores the tensors of ops it overrides.

    Layers of :data:`_LOW_LAYERS` (and ``Conv1D``): ``policy.params``; normalisation layers (a norm
    class, or ``Norm`` in the class name): ``policy.norms``; other modules' parameters float32, or
    ``policy.params`` when unsafe ops run low too (O3); their buffers float32.  An embedding table
    only a norm reads (:func:`lookups_into_norms`) stays float32 where mixed precision keeps float32
    ops (O2), as whole-model conversion keeps it.  A tensor tied across modules follows the most
    specific owner: such a table, else a norm, else a layer (BERT's decoder bias).

    Why this is not :func:`~fxamp.conversion.rewrite.casts.store_params`, and what reconciles the two.
    ``store_params`` decides from a graph: a tensor is stored low only when every consumer in it
    runs low.  A lazily capturing module must make its parameters before any graph exists (an
    optimizer is built on them before the first call), and every later capture shares them, so
    the storage is predicted here from module classes and never re-decided.  The two may
    disagree: a ``Linear`` weight also read by an unsafe op, or a layer's bias mixed into the
    residual stream, is predicted low where ``store_params`` keeps it float32; a custom module's
    parameter that only a matmul reads stays float32 here.  Each capture is therefore rewritten
    with ``storage="keep"`` (``pipeline.rewrite_captured``): ``rewrite.cast_kept_storage`` casts a
    low tensor for every consumer that wants float32 and follows its inputs, and
    ``rewrite.insert_casts`` casts for every consumer with a compute dtype, so each op computes in
    the dtype ``convert`` would have given it; only where the tensor is stored (its memory, and the
    master an optimizer keeps for it) can differ.
    """
    # per tensor: (strength, dtype); a norm's claim beats a layer's, a layer's beats any other module's
    claims: Dict[int, Tuple[int, torch.dtype]] = {}
    names: Dict[int, List[str]] = collections.defaultdict(list)
    others = policy.params if policy.unsafe != torch.float32 else torch.float32
    widened = lookups_into_norms(model) if policy.compute in LOW and policy.unsafe == torch.float32 else set()
    chosen = _categories(module_overrides)
    for name, m, attr, t in tensor_slots(model):
        if t.dtype != torch.float32:
            continue
        by_user = covering(name.rpartition(".")[0], chosen)
        category = by_user[1] if by_user is not None else None
        if category is Category.UNSAFE:
            strength, dtype = 4, torch.float32
        elif category is Category.SAFE:
            strength, dtype = 4, policy.params if attr in m._parameters else torch.float32
        elif id(m) in widened:
            strength, dtype = 3, torch.float32
        elif is_norm(m):
            strength, dtype = 2, policy.norms
        elif isinstance(m, _LOW_LAYERS) or type(m).__name__ in _LOW_LAYER_NAMES:
            strength, dtype = 1, policy.params
        else:
            strength, dtype = 0, others if attr in m._parameters else torch.float32
        names[id(t)].append(name)
        if id(t) not in claims or claims[id(t)][0] < strength:
            claims[id(t)] = (strength, dtype)
    out: Dict[str, torch.dtype] = {}
    for key, (_, dtype) in claims.items():
        for name in names[key]:
            out[name] = dtype
    return out


def _categories(module_overrides: Optional[Mapping[str, Any]]) -> Dict[str, Category]:
    """The category of each module override (``"float8"``/``"no_float8"`` choose a matmul's kind, not storage)."""
    out: Dict[str, Category] = {}
    for path, value in (module_overrides or {}).items():
        try:
            out[path] = as_entry(value, "", Source.MODULE_OVERRIDE).category
        except ValueError:
            continue
    return out


class _Restore:
    """Puts the stored tensors back: in the model's modules, and in the graph modules named by ``also``."""

    def __init__(self, model: nn.Module, originals: Dict[int, torch.Tensor]):
        self.model = model
        self.originals = originals  # id(float32 stand-in) -> stored tensor
        self.graphs: List[nn.Module] = []

    def also(self, gm: nn.Module) -> None:
        self.graphs.append(gm)

    def __call__(self) -> None:
        for module in [self.model, *self.graphs]:
            replace_tensors(module, lambda name, t: self.originals.get(id(t)))


class float32_for_capture:
    """Within: every parameter and buffer of ``model`` named in ``stored_low`` is a float32 stand-in.

    The model's forward was written for float32 tensors (``F.linear(x, self.weight)`` with a float32
    ``x``): torch.export traces it with float32 tensors, and the rewrite then sees the stored dtypes
    and casts where needed.  Parameters' stand-ins are uninitialised (export traces with fake
    values); buffers' are real copies (a forward may read their values).
    """

    def __init__(self, model: nn.Module, stored_low: frozenset):
        self.model = model
        self.stored_low = stored_low

    def __enter__(self) -> _Restore:
        changed = rebind(self.model, dict.fromkeys(self.stored_low, torch.float32), values=False)
        self.restore = _Restore(self.model, {id(new): old for old, new in changed.values()})
        return self.restore

    def __exit__(self, *exc: Any) -> None:
        self.restore()
