"""The op lists: which ops run in low precision, which in float32, which follow their inputs, and why.

This is data.  Every entry maps an op to an :class:`OpEntry` ``(category, reason)``; an op is
named the way it appears in a graph:

* ``torch.exp``, ``torch.nn.functional.softmax``, ``operator.add``  (``call_function`` targets)
* ``"Tensor.exp"``                                                  (``call_method`` targets)
* ``torch.ops.aten.exp`` (an ``OpOverloadPacket``)                  (``torch.export`` graphs)
* ``torch.nn.LayerNorm``                                             (``call_module`` classes)

Users change the lists without editing this file: :meth:`OpLists.with_overrides` returns new lists,
and ``fxamp.convert(..., overrides={...})`` does the same per call.  The categories:

* **safe**: run in the low-precision dtype (matmul, conv, linear, attention, RNNs).
* **neutral**: no numerical effect worth a cast; run in the dtype that arrives (torch's type
  promotion already takes the widest float for ``add``/``cat``/``where``…).
* **conditional**: decided per node from its arguments (``sum(dtype=...)``, ``scalar / x``…).
* **unsafe**: run in float32 (exp, log, pow, softmax, reductions, norms, losses).
* **unlisted**: on no list; functions follow their inputs (as autocast does), leaf modules run in
  float32 because their parameters cannot be cast from outside.

The anchors read for these decisions (PyTorch autocast CUDA/CPU, apex O1, TensorFlow, MXNet) and
their votes are in ``shared/reference/op_lists``; where fxamp departs from the consensus the reason
says so.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dtypes import StrEnum
from ..errors import warn_deprecated

__all__ = ["Category", "Source", "OpEntry", "OpLists", "DEFAULT_OP_LISTS", "op_key", "op_name", "as_entry",
           "is_inplace", "out_of_place", "keys_for"]


class Category(StrEnum):
    """Where an op sits; a ``str`` so ``"safe"`` and ``Category.SAFE`` are interchangeable."""

    SAFE = "safe"
    NEUTRAL = "neutral"
    CONDITIONAL = "conditional"
    UNSAFE = "unsafe"
    UNLISTED = "unlisted"


class Source(StrEnum):
    """Where a rule came from, as a field (the report and the lints read it, never the reason text)."""

    OP_LIST = "op list"  # fxamp's default lists
    OVERRIDE = "override"  # the user's overrides= / OpLists.with_overrides
    MODULE_OVERRIDE = "module override"  # the user's module_overrides=
    NODE_OVERRIDE = "node override"  # the user's node_overrides=
    DEFAULT = "default"  # on no list: the unlisted rule
    GRAPH = "graph"  # decided by the graph's structure (inputs, outputs, attributes, in-place ops)
    FLOAT64 = "float64"  # a float input is float64, which fxamp never casts: the op runs in float64


#: conditions a CONDITIONAL entry may name; the classifier implements each one.
CONDITIONS = ("dtype_arg", "softmax", "truediv", "follow_producer", "need_weights", "float32_users")


@dataclass(frozen=True)
class OpEntry:
    """One op's place in the lists.

    category:  where the op sits.
    reason:    why, in a sentence a user can read in the report.
    norm:      a normalisation layer: its parameters and math use ``Policy.norms``.
    condition: for CONDITIONAL entries, the rule that decides (one of ``CONDITIONS``).
    fallback:  for CONDITIONAL entries, the category used when the rule cannot decide.
    source:    who put the entry there (fxamp's lists, or the user's overrides).
    """

    category: Category
    reason: str
    norm: bool = False
    condition: Optional[str] = None
    fallback: Optional[Category] = None
    source: Source = Source.OP_LIST

    def __post_init__(self) -> None:
        """Names become members (``OpEntry("unsafe", "my reason")``), then checks."""
        object.__setattr__(self, "category", _category(self.category))
        object.__setattr__(self, "fallback", None if self.fallback is None else _category(self.fallback))
        object.__setattr__(self, "source", Source(self.source))
        if self.category is Category.CONDITIONAL:
            if self.condition not in CONDITIONS:
                raise ValueError(f"a conditional entry needs condition= one of {CONDITIONS}, not {self.condition!r}")
            if self.fallback is None:
                raise ValueError("a conditional entry needs a fallback category")

    @classmethod
    def of(cls, category: Union[str, Category], reason: str, *, norm: bool = False, condition: Optional[str] = None,
           fallback: Union[str, Category, None] = None, source: Union[str, Source] = Source.OP_LIST) -> "OpEntry":
        """Deprecated: the constructor takes names, ``OpEntry("unsafe", "my reason")``."""
        warn_deprecated("OpEntry.of(...)", "write OpEntry(...): the constructor takes the category's name")
        return cls(category, reason, norm=norm, condition=condition, fallback=fallback, source=source)


def _category(value: Union[str, Category]) -> Category:
    try:
        return Category(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"{value!r} is not a category; use one of {', '.join(c.value for c in Category)}"
        ) from None


OpKey = Union[Callable, str, type]


def op_key(target: Any) -> OpKey:
    """The list key of a graph target: aten overloads map to their packet, strings to ``Tensor.<name>``."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket
    if isinstance(target, str) and not target.startswith("Tensor."):
        return "Tensor." + target
    return target


_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem})


def is_inplace(op: str, target: Any) -> bool:
    """Whether a graph call (``node.op``, ``node.target``) writes into its first argument:
    ``x.exp_()``, ``torch.exp_(x)``, ``aten.exp_``, ``x += y``, ``x[i] = v``."""
    if op == "call_method":
        name = str(target)
        return name.endswith("_") and not name.startswith("__")
    if op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return target._schema.is_mutable  # the op schema: torch has no public accessor
        if target in _INPLACE_OPERATORS:
            return True
        return out_of_place(op, target) is not None
    return False


def out_of_place(op: str, target: Any) -> Any:
    """The out-of-place form of an in-place call's target (``"exp_"`` -> ``"exp"``, ``torch.exp_`` ->
    ``torch.exp``, ``aten.exp_.default`` -> ``aten.exp.default``), or None (not in place, or none exists)."""
    if op == "call_method":
        name = str(target)
        if name.endswith("_") and not name.startswith("__") and hasattr(torch.Tensor, name[:-1]):
            return name[:-1]
        return None
    if op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        if not (target._schema.is_mutable and name.endswith("_")) or target.namespace != "aten":
            return None
        packet = getattr(torch.ops.aten, name[:-1], None)
        signature = [(a.name, str(a.type)) for a in target._schema.arguments]
        for overload in packet.overloads() if packet is not None else ():
            candidate = getattr(packet, overload)
            if [(a.name, str(a.type)) for a in candidate._schema.arguments] == signature:
                return candidate  # same arguments (pow_.Scalar's twin is pow.Tensor_Scalar, not pow.Scalar)
        return None
    name = getattr(target, "__name__", "")
    if not name.endswith("_") or name.startswith("__"):
        return None
    for namespace in (torch, F):
        if getattr(namespace, name, None) is target:
            return getattr(namespace, name[:-1], None)
    return None


def op_name(key: Any) -> str:
    """A readable, qualified name for an op key (``torch.nn.functional.linear``, ``aten.addmm``…)."""
    if isinstance(key, str):
        return key
    if isinstance(key, torch._ops.OpOverload):
        return f"aten.{key.__name__}" if key.namespace == "aten" else str(key)
    if isinstance(key, torch._ops.OpOverloadPacket):
        return f"{key._qualified_op_name.replace('::', '.')}"
    if isinstance(key, type):
        mod = key.__module__
        if mod.startswith("torch.nn.modules"):
            mod = "torch.nn"
        return f"{mod}.{key.__qualname__}"
    name = getattr(key, "__name__", None) or repr(key)
    for prefix, namespace in (("torch.nn.functional", F), ("torch", torch), ("torch.special", torch.special),
                              ("torch.linalg", torch.linalg), ("torch.fft", torch.fft)):
        if getattr(namespace, name, None) is key:
            return f"{prefix}.{name}"
    mod = getattr(key, "__module__", None) or ""
    if mod == "_operator":
        mod = "operator"
    qual = getattr(key, "__qualname__", name)
    return f"{mod}.{qual}" if mod else qual


class OpLists(Mapping):
    """An immutable mapping from op keys to :class:`OpEntry`; ``with_overrides`` makes changed copies."""

    def __init__(self, entries: Mapping[OpKey, OpEntry]):
        self._entries: Mapping[OpKey, OpEntry] = MappingProxyType(dict(entries))

    def __getitem__(self, key: OpKey) -> OpEntry:
        return self._entries[key]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, target: Any) -> Optional[OpEntry]:
        """The entry of a graph target (function, method name, aten overload or module class), or None."""
        return self._entries.get(op_key(target))

    def with_overrides(self, overrides: Mapping[OpKey, Union[str, Category, OpEntry]]) -> "OpLists":
        """New lists with some entries replaced: ``{torch.exp: "neutral", nn.GELU: "unsafe"}``."""
        entries = dict(self._entries)
        for key, value in overrides.items():
            entries[_normalize_key(key)] = as_entry(value, f"overridden by the user for {op_name(key)}",
                                                    Source.OVERRIDE)
        return OpLists(entries)

    def __reduce__(self) -> Any:
        """Pickles as its entries (a mappingproxy does not pickle); the default lists as a reference."""
        if self is DEFAULT_OP_LISTS:
            return "DEFAULT_OP_LISTS"
        return (OpLists, (dict(self._entries),))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OpLists":
        return self  # immutable: copies share it


def _normalize_key(key: Any) -> OpKey:
    if isinstance(key, str):
        return _string_key(key)
    if isinstance(key, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op_key(key)
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    if callable(key):
        return key
    raise TypeError(
        f"cannot use {key!r} as an op key; use a function (torch.exp), 'Tensor.<method>', "
        "an aten op (torch.ops.aten.exp) or an nn.Module class"
    )


def _string_key(key: str) -> str:
    """``'Tensor.<method>'`` of this torch; any other string is refused, naming the key it should be (a
    bare ``"linear"``, or the typo ``"lienar"``, means the function ``F.linear``: a key of its own)."""
    name = key[7:] if key.startswith("Tensor.") else key
    if key.startswith("Tensor.") and callable(getattr(torch.Tensor, name, None)):
        return key
    spellings = {n: [f"torch.{n}"] * callable(vars(torch).get(n)) + [f"F.{n} (torch.nn.functional.{n})"] *
                 callable(vars(F).get(n)) + [f"'Tensor.{n}'"] * callable(getattr(torch.Tensor, n, None))
                 for n in {*vars(torch), *vars(F), *dir(torch.Tensor)} if not n.startswith("_")}
    close = [name] if spellings.get(name) else difflib.get_close_matches(name, [n for n in spellings if spellings[n]], 1)
    what = f"torch.Tensor has no method {name!r}" if key.startswith("Tensor.") else \
        "strings name Tensor methods ('Tensor.<name>'), functions are passed as themselves"
    fix = (f": write {' or '.join(spellings[name])}" if close == [name] else
           f"; did you mean {' or '.join(spellings[close[0]])}?") if close else ""
    raise ValueError(f"op override key {key!r}: {what}{fix} (a module path such as 'encoder.layers.3' goes in "
                     f"module_overrides=)")


def as_entry(value: Union[str, Category, OpEntry], reason: str, source: Source) -> OpEntry:
    """A user's override value as an entry marked with its ``source`` (an OpEntry keeps its own reason)."""
    if isinstance(value, OpEntry):
        return dataclasses.replace(value, source=source)
    cat = _category(value)
    if cat is Category.CONDITIONAL:
        raise ValueError("override with an OpEntry to make an op conditional (it needs a condition and fallback)")
    return OpEntry(cat, reason, source=source)


# ---------------------------------------------------------------------------------------------
# The lists.  Names are resolved against the installed torch; a name this torch lacks is skipped.
# "x" expands to torch.x, Tensor.x, torch.nn.functional.x and aten.x where they exist.
# ---------------------------------------------------------------------------------------------

S, N, C, U = Category.SAFE, Category.NEUTRAL, Category.CONDITIONAL, Category.UNSAFE


def keys_for(name: str) -> Iterable[OpKey]:
    """The op keys a list name stands for in the installed torch (``"exp"``: torch.exp, Tensor.exp, aten.exp…)."""
    if name.startswith("nn."):
        obj = getattr(nn, name[3:], None)
        return [obj] if isinstance(obj, type) else []
    if name.startswith("operator."):
        return [getattr(operator, name[9:])]
    if name.startswith("Tensor."):
        return [name] if hasattr(torch.Tensor, name[7:]) else []
    if name.startswith("F."):
        obj = getattr(F, name[2:], None)
        return [obj] if obj is not None else []
    if name.startswith("aten."):
        return [getattr(torch.ops.aten, name[5:])] if hasattr(torch.ops.aten, name[5:]) else []
    if name.startswith("torch."):
        obj: Any = torch
        for part in name[6:].split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return []
        return [obj]
    # bare name: every spelling that exists
    keys: list = []
    for prefix in ("torch.", "Tensor.", "F.", "aten."):
        keys.extend(keys_for(prefix + name))
    return keys


def _build(groups: Iterable[Tuple[str, OpEntry]]) -> Dict[OpKey, OpEntry]:
    table: Dict[OpKey, OpEntry] = {}
    for names, entry in groups:
        for name in names.split():
            for key in keys_for(name):
                table.setdefault(key, entry)
    return table


_GROUPS = [
    # ---- safe: the tensor-core ops -----------------------------------------------------------
    ("matmul mm bmm baddbmm addmm addbmm addmv addr mv einsum chain_matmul torch.linalg.multi_dot "
     "torch.linalg.vecdot operator.matmul Tensor.__matmul__ aten._addmm_activation aten.linalg_multi_dot "
     "aten.linalg_vecdot",
     OpEntry(S, "matrix multiply: every AMP (autocast CUDA/CPU, apex, TF, MXNet 2) runs it in low "
                "precision with float32 accumulation inside the kernel")),
    ("linear aten.linear nn.Linear",
     OpEntry(S, "linear layer (a matmul): low precision, float32 accumulation in the kernel")),
    ("conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d aten.convolution "
     "aten._convolution aten.conv_tbc nn.Conv1d nn.Conv2d nn.Conv3d nn.ConvTranspose1d nn.ConvTranspose2d "
     "nn.ConvTranspose3d",
     OpEntry(S, "convolution: low precision with float32 accumulation (all anchors)")),
    ("scaled_dot_product_attention F.scaled_dot_product_attention aten._scaled_dot_product_flash_attention "
     "aten._scaled_dot_product_efficient_attention aten._scaled_dot_product_cudnn_attention "
     "aten._scaled_dot_product_flash_attention_for_cpu",
     OpEntry(S, "fused attention: the kernel keeps its softmax statistics in float32")),
    ("prelu F.prelu nn.PReLU aten._prelu_kernel",
     OpEntry(S, "autocast (CUDA and CPU) and apex list prelu as low precision")),
    ("nn.LSTM nn.GRU nn.RNN nn.LSTMCell nn.GRUCell nn.RNNCell lstm gru rnn_tanh rnn_relu lstm_cell "
     "gru_cell rnn_tanh_cell rnn_relu_cell",
     OpEntry(S, "recurrent layers are matmuls; CUDA autocast runs _cudnn_rnn in float16, apex too")),
    ("F.affine_grid affine_grid_generator",
     OpEntry(S, "affine_grid is a batched matmul (autocast reaches bmm)")),

    # ---- unsafe: float32 -----------------------------------------------------------------
    ("exp expm1 log log2 log10 log1p lgamma erfinv reciprocal rsqrt tan asin acos sinh "
     "cosh aten.special_erfcx polygamma mvlgamma",
     OpEntry(U, "exp/log/reciprocal family: overflows or loses precision in float16 (autocast, apex, "
                "MXNet force float32)")),
    ("pow float_power square operator.pow Tensor.__pow__ Tensor.__rpow__ aten.square F.lp_pool1d F.lp_pool2d "
     "F.lp_pool3d nn.LPPool1d nn.LPPool2d nn.LPPool3d",
     OpEntry(U, "pow in every form (x ** 2 and torch.square too): overflows in float16; all anchors "
                "force float32 and none exempts small exponents")),
    ("mean std var var_mean std_mean nanmean logsumexp logcumsumexp aten.mean aten.std aten.var",
     OpEntry(U, "reduction over many elements: float32 accumulation and result (TF, MXNet, apex; "
                "the consensus keeps mean float32 although CUDA's kernel accumulates in float32)")),
    ("softplus F.softplus nn.Softplus aten.softplus",
     OpEntry(U, "softplus = log(1 + exp(x)): the exp overflows in float16 (autocast, apex, MXNet)")),
    ("F.layer_norm layer_norm aten.native_layer_norm nn.LayerNorm",
     OpEntry(U, "layer norm: variance in float32; autocast CUDA and apex run it in float32",
             norm=True)),
    ("F.group_norm group_norm aten.native_group_norm nn.GroupNorm",
     OpEntry(U, "group norm: statistics in float32 (autocast CUDA, apex)", norm=True)),
    ("F.rms_norm rms_norm aten._fused_rms_norm nn.RMSNorm",
     OpEntry(U, "RMS norm: mean of squares overflows in float16 (autocast 2.13 lists it fp32)", norm=True)),
    ("F.local_response_norm nn.LocalResponseNorm",
     OpEntry(U, "local response norm sums squares: float32 (autocast, apex)")),
    ("F.normalize F.cosine_similarity F.pairwise_distance F.pdist cdist dist renorm nn.CosineSimilarity "
     "nn.PairwiseDistance aten._cdist_forward aten._pdist_forward aten.cosine_similarity aten.pairwise_distance "
     "aten.pdist _weight_norm aten._weight_norm_interface norm_except_dim",
     OpEntry(U, "vector norms (weight norm's too) and distances square and sum: float32 (autocast, apex)")),
    ("torch.nn.utils.parametrize.ParametrizationList",
     OpEntry(U, "a parametrization (weight_norm, spectral_norm, orthogonal) making a weight from its original "
                "tensors, called as a leaf: its norms, power iteration or matrix exponential run in float32 on "
                "float32 originals, as torch runs them; the op that reads the weight (a linear, a conv) casts it "
                "as it casts any weight")),
    ("F.interpolate F.upsample F.upsample_nearest F.upsample_bilinear F.grid_sample nn.Upsample "
     "nn.UpsamplingNearest2d nn.UpsamplingBilinear2d aten.upsample_nearest1d aten.upsample_nearest2d "
     "aten.upsample_nearest3d aten.upsample_bilinear2d aten.upsample_linear1d aten.upsample_bicubic2d "
     "aten.upsample_trilinear3d aten._upsample_nearest_exact2d aten.grid_sampler_2d aten.grid_sampler",
     OpEntry(U, "interpolation: autocast CUDA (since 2.5) and apex run it in float32; TF and MXNet "
                "call it neutral. We side with PyTorch: its fp16 backward accumulates in fp16")),
    ("F.gumbel_softmax trace quantile nanquantile polar cumulative_trapezoid trapezoid",
     OpEntry(U, "exp/sum-heavy or precision-sensitive: float32 (autocast CPU/CUDA)")),
    ("torch.linalg.inv torch.linalg.solve torch.linalg.svd torch.linalg.qr torch.linalg.eigh "
     "torch.linalg.eig torch.linalg.cholesky torch.linalg.det torch.linalg.slogdet torch.linalg.lstsq "
     "torch.linalg.pinv torch.linalg.matrix_exp matrix_exp aten.linalg_matrix_exp inverse det logdet slogdet "
     "cholesky svd qr "
     "aten.linalg_inv_ex aten.linalg_solve aten._linalg_svd aten.linalg_qr aten._linalg_eigh "
     "aten.linalg_cholesky_ex aten._linalg_det aten._linalg_slogdet aten.linalg_inv aten.linalg_svd aten.linalg_eig "
     "aten.linalg_eigh aten.linalg_cholesky aten.linalg_det aten.linalg_slogdet aten.linalg_lstsq aten.linalg_pinv "
     "aten.linalg_matrix_exp",
     OpEntry(U, "linear algebra decompositions: ill-conditioned in low precision and mostly without "
                "float16 kernels (autocast CPU, MXNet)")),
    ("torch.fft.fft torch.fft.ifft torch.fft.rfft torch.fft.irfft torch.fft.fft2 torch.fft.ifft2 "
     "torch.fft.rfft2 torch.fft.irfft2 torch.fft.fftn torch.fft.ifftn torch.fft.rfftn torch.fft.irfftn "
     "stft istft aten._fft_r2c aten._fft_c2r aten._fft_c2c aten.fft_fft aten.fft_ifft aten.fft_rfft aten.fft_irfft "
     "aten.fft_fft2 aten.fft_ifft2 aten.fft_rfft2 aten.fft_irfft2 aten.fft_fftn aten.fft_ifftn aten.fft_rfftn "
     "aten.fft_irfftn",
     OpEntry(U, "FFTs accumulate over the whole signal and need power-of-two sizes in float16: float32")),
    ("F.cross_entropy F.nll_loss F.binary_cross_entropy F.binary_cross_entropy_with_logits F.mse_loss "
     "F.l1_loss F.smooth_l1_loss F.huber_loss F.kl_div F.poisson_nll_loss F.gaussian_nll_loss "
     "F.cosine_embedding_loss F.hinge_embedding_loss F.margin_ranking_loss F.multilabel_margin_loss "
     "F.multilabel_soft_margin_loss F.multi_margin_loss F.soft_margin_loss F.triplet_margin_loss "
     "F.triplet_margin_with_distance_loss F.ctc_loss "
     "nn.CrossEntropyLoss nn.NLLLoss nn.BCELoss nn.BCEWithLogitsLoss nn.MSELoss nn.L1Loss nn.SmoothL1Loss "
     "nn.HuberLoss nn.KLDivLoss nn.PoissonNLLLoss nn.GaussianNLLLoss nn.CosineEmbeddingLoss "
     "nn.HingeEmbeddingLoss nn.MarginRankingLoss nn.MultiLabelMarginLoss nn.MultiLabelSoftMarginLoss "
     "nn.MultiMarginLoss nn.SoftMarginLoss nn.TripletMarginLoss nn.TripletMarginWithDistanceLoss nn.CTCLoss "
     "aten.nll_loss_forward aten.nll_loss aten.nll_loss2d_forward aten.cross_entropy_loss aten.mse_loss "
     "aten.l1_loss aten.smooth_l1_loss aten.huber_loss aten.kl_div aten.binary_cross_entropy "
     "aten.binary_cross_entropy_with_logits aten.soft_margin_loss aten.multilabel_margin_loss_forward "
     "aten.multi_margin_loss aten.ctc_loss aten._ctc_loss aten.poisson_nll_loss aten.margin_ranking_loss "
     "aten.hinge_embedding_loss aten.cosine_embedding_loss aten.triplet_margin_loss aten.multilabel_margin_loss",
     OpEntry(U, "loss function: logs, exps and a mean over the batch; every AMP runs losses in float32 "
                "(binary_cross_entropy is even banned from float16 by autocast and apex)")),
    ("nn.Softmax nn.LogSoftmax nn.Softmin nn.Softmax2d aten._log_softmax",
     OpEntry(U, "softmax module (no dtype argument): exp and a sum, float32 (all anchors but TF)")),
    ("nn.TransformerEncoderLayer nn.TransformerDecoderLayer nn.TransformerEncoder nn.TransformerDecoder "
     "nn.Transformer",
     OpEntry(U, "composite module with layer norms and softmax inside: when kept a leaf (leaf_modules=) it "
                "runs whole in float32; by default the fx front end traces into it and converts its linears "
                "and attention per op")),

    # ---- conditional ---------------------------------------------------------------------
    ("softmax F.softmin aten.softmax aten._softmax",
     OpEntry(C, "softmax: float32 unless the call passes dtype= (the kernel honours it), or unless it sits "
                "between low-precision ops (attention: scores from a matmul, probabilities into a matmul), "
                "where its kernel already accumulates in float32 and a float32 round trip would only cost "
                "memory and two casts (what CPU autocast and TF's infer list do)",
             condition="softmax", fallback=U)),
    ("log_softmax sum nansum prod cumsum cumprod norm torch.linalg.vector_norm "
     "torch.linalg.matrix_norm torch.linalg.norm aten.linalg_vector_norm aten.linalg_matrix_norm "
     "aten.linalg_norm aten.sum aten.prod aten.cumsum aten.cumprod aten.softmax aten.log_softmax",
     OpEntry(C, "exp/sum family: float32 unless the call passes dtype=, which the kernel honours "
                "(reads low precision, accumulates and returns in that dtype), as autocast does",
             condition="dtype_arg", fallback=U)),
    ("operator.truediv div true_divide divide Tensor.__truediv__ Tensor.__rtruediv__ aten.div",
     OpEntry(C, "scalar / tensor is a reciprocal (float32, autocast reaches reciprocal); "
                "tensor / tensor and tensor / scalar follow their inputs",
             condition="truediv", fallback=N)),
    ("gelu sigmoid tanh silu mish F.silu F.mish F.gelu F.sigmoid F.tanh F.hardswish F.hardsigmoid F.elu "
     "F.selu F.celu F.logsigmoid F.softsign F.tanhshrink nn.GELU nn.Sigmoid nn.Tanh nn.SiLU nn.Mish "
     "nn.Hardswish nn.Hardsigmoid nn.ELU nn.SELU nn.CELU nn.LogSigmoid nn.Softsign nn.Tanhshrink "
     "aten.gelu aten.sigmoid aten.tanh aten.silu aten.mish aten.elu aten.hardswish aten.hardsigmoid "
     "aten.log_sigmoid_forward aten.selu aten.celu aten.log_sigmoid",
     OpEntry(C, "smooth activation, bounded or linear at the tails: safe in low precision, so it "
                "follows its producer (low after a linear, float32 after a norm); only apex forced gelu "
                "to float32",
             condition="follow_producer", fallback=N)),
    ("nn.MultiheadAttention F.multi_head_attention_forward",
     OpEntry(C, "with need_weights=False it is linear projections + scaled_dot_product_attention (safe); "
                "with the default need_weights=True its explicit softmax also runs in low precision "
                "(fallback safe; override to 'unsafe' to keep it float32); the function (WavLM calls it "
                "with its own weights) is one node of torch.fx's graph: it runs whole, on its cast inputs",
             condition="need_weights", fallback=S)),
    ("add sub rsub operator.add operator.sub operator.iadd operator.isub Tensor.__add__ Tensor.__radd__ "
     "Tensor.__sub__ Tensor.__rsub__ Tensor.__iadd__",
     OpEntry(C, "sum or difference: follows its inputs (torch's type promotion computes in the widest), "
                "but computes in float32 when only float32 ops use the result (embeddings summed before a "
                "layer norm, a residual stream between norms): rounding it to low precision first would "
                "lose bits its users keep, and an addition saves nothing for backward, so casting its "
                "inputs instead costs no memory (autocast gets this from a float32 residual stream)",
             condition="float32_users", fallback=N)),

    # ---- neutral ---------------------------------------------------------------------------
    ("F.batch_norm batch_norm F.instance_norm instance_norm aten._native_batch_norm_legit "
     "aten._native_batch_norm_legit_functional aten._native_batch_norm_legit_no_training "
     "aten.native_batch_norm aten._batch_norm_with_update aten._batch_norm_no_update "
     "nn.BatchNorm1d nn.BatchNorm2d nn.BatchNorm3d nn.SyncBatchNorm nn.InstanceNorm1d nn.InstanceNorm2d "
     "nn.InstanceNorm3d",
     OpEntry(N, "batch norm kernels (cuDNN, CPU) take low-precision input with float32 weight and "
                "statistics and accumulate in float32, so the input needs no cast (autocast, apex, TF, "
                "MXNet agree); its parameters and running statistics stay float32 (norms rule)",
             norm=True)),
    ("mul addcmul addcdiv where maximum minimum fmax fmin atan2 remainder fmod hypot "
     "outer ger kron cat concat concatenate stack "
     "hstack vstack dstack "
     "operator.mul operator.imul operator.itruediv Tensor.__mul__ Tensor.__rmul__ "
     "Tensor.__imul__ aten.copy diff",
     OpEntry(N, "several float inputs: torch's type promotion already computes in the widest input "
                "dtype, so no cast is needed (apex and MXNet insert widest-type casts by hand; "
                "torch does it natively)")),
    ("dot vdot inner tensordot cross torch.linalg.cross F.bilinear nn.Bilinear lerp index_put index_copy "
     "index_add scatter_add scatter_reduce masked_scatter aten.bilinear aten.linalg_cross",
     OpEntry(U, "several float inputs that must share one dtype (torch does not promote them: a bfloat16 "
                "and a float32 input fail), so all are cast to one: float32 (CUDA autocast's widest-type "
                "list holds dot, tensordot, bilinear, cross, index_put, scatter_add)")),
    ("eq ne lt le gt ge isclose allclose equal isnan isinf isfinite isneginf isposinf signbit logical_and "
     "logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor operator.eq "
     "operator.ne operator.lt operator.le operator.gt operator.ge operator.and_ operator.or_ "
     "operator.invert operator.not_ operator.xor operator.floordiv operator.mod operator.lshift "
     "operator.rshift floor_divide aten.floordiv aten.__and__ aten.__or__ aten.__xor__ aten.__invert__ aten.__lshift__ "
     "aten.__rshift__",
     OpEntry(N, "comparison / logic / integer math: returns bool or int, nothing to cast")),
    ("relu relu_ relu6 F.relu6 F.leaky_relu leaky_relu hardtanh F.hardtanh threshold F.threshold "
     "softshrink hardshrink F.softshrink F.hardshrink F.glu glu rrelu F.rrelu "
     "nn.ReLU nn.ReLU6 nn.LeakyReLU nn.Hardtanh nn.Threshold nn.Softshrink nn.Hardshrink nn.GLU nn.RReLU "
     "aten.hardtanh aten.leaky_relu aten.threshold aten.glu",
     OpEntry(N, "piecewise-linear activation: exact in any dtype")),
    ("abs neg negative sign sgn floor ceil round trunc frac clamp clip clamp_min clamp_max sqrt sin cos "
     "atan erf erfc exp2 logit digamma nan_to_num real imag angle conj positive "
     "operator.neg operator.pos operator.abs aten.clamp aten.clamp_min aten.clamp_max",
     OpEntry(N, "elementwise op that is well conditioned in low precision (autocast leaves it unlisted; "
                "TF and MXNet list it as clear/neutral)")),
    ("max min amax amin aminmax argmax argmin topk sort argsort msort median nanmedian mode kthvalue "
     "unique unique_consecutive searchsorted bucketize count_nonzero any all cummax cummin histc "
     "aten.max aten.min aten.amax aten.amin aten.argmax aten.argmin aten.topk aten.sort",
     OpEntry(N, "selection / ordering: picks elements, no arithmetic to lose precision (MXNet's float32 "
                "topk/argsort only because it returns indices in the data dtype)")),
    ("reshape view view_as flatten unflatten squeeze unsqueeze permute transpose t T mT adjoint movedim "
     "moveaxis swapaxes swapdims expand expand_as broadcast_to repeat repeat_interleave tile contiguous "
     "chunk split tensor_split unbind narrow select index_select gather take take_along_dim "
     "masked_select masked_fill masked_fill_ scatter scatter_ index_fill tril triu diag diagonal "
     "diag_embed roll flip fliplr flipud rot90 clone detach detach_ zero_ fill_ zeros_like ones_like "
     "full_like empty_like rand_like randn_like new_zeros new_ones new_full new_empty new_tensor "
     "as_strided unfold F.unfold F.fold F.pad pad constant_pad_nd F.pixel_shuffle F.pixel_unshuffle "
     "pixel_shuffle pixel_unshuffle channel_shuffle F.one_hot aten.one_hot size dim numel nelement shape dtype device "
     "is_floating_point is_contiguous stride storage_offset item tolist element_size "
     "operator.getitem operator.setitem builtins.getattr getattr builtins.len aten.len "
     "aten.view aten._unsafe_view aten.reshape aten.permute aten.transpose aten.t aten.expand "
     "aten.squeeze aten.unsqueeze aten.slice aten.select aten.split aten.split_with_sizes aten.chunk "
     "aten.clone aten.alias aten.detach aten.lift_fresh_copy aten.index aten.index_select aten.gather "
     "aten.masked_fill aten.full_like aten.zeros_like aten.ones_like aten.sym_size aten.sym_numel "
     "aten.empty_like aten.arange aten.full aten.zeros aten.ones aten.scalar_tensor aten._assert_tensor_metadata "
     "aten.constant_pad_nd aten.flatten aten.unflatten aten.unbind aten.repeat aten.contiguous aten.tril "
     "aten.triu aten.flip aten.roll aten.diagonal aten.cat aten.stack aten.where aten.add aten.sub "
     "aten.mul aten.rsub aten.relu aten.neg aten.abs aten.sqrt aten.sin aten.cos aten.eq aten.ne aten.lt "
     "aten.le aten.gt aten.ge aten.logical_not aten.logical_and aten.logical_or aten.bitwise_not "
     "aten.unfold aten.new_zeros aten.new_ones aten.new_empty aten.expand_as "
     "aten.sym_stride aten.sym_storage_offset aten._local_scalar_dense aten.new_full aten.empty "
     "aten.view_as aten.masked_fill_ aten.fill_ aten.zero_ aten.index_put aten.index_put_ aten.erf "
     "aten.floor_divide aten.remainder aten.maximum aten.minimum aten.any aten.all aten.clamp aten.numpy_T "
     "aten.mT aten.mH aten.adjoint aten.matrix_H",
     OpEntry(N, "data movement, shape or metadata: no arithmetic, keeps the dtype it gets")),
    ("Tensor.float Tensor.half Tensor.bfloat16 Tensor.double Tensor.to Tensor.type Tensor.type_as "
     "Tensor.cpu Tensor.cuda aten._to_copy aten.to",
     OpEntry(N, "an explicit cast or move written by the user: respected as written")),
    ("F.embedding F.embedding_bag embedding_bag nn.Embedding nn.EmbeddingBag aten._embedding_bag aten.embedding",
     OpEntry(C, "embedding lookup is a gather with the table's dtype (a bag's sum or mean accumulates in float32 "
                "inside torch's kernel and rounds once, whatever the bag's size); when only float32 ops use it (a norm "
                "straight after, as in ModernBERT, or a float32 sum of embeddings) it looks up in float32, so "
                "O2 keeps that table float32 as autocast does (a low table loses bits no later op gets back)",
             condition="float32_users", fallback=N)),
    ("F.dropout F.dropout1d F.dropout2d F.dropout3d F.alpha_dropout F.feature_alpha_dropout dropout "
     "alpha_dropout feature_alpha_dropout aten.dropout aten.native_dropout aten.bernoulli aten.feature_dropout "
     "nn.Dropout nn.Dropout1d nn.Dropout2d nn.Dropout3d nn.AlphaDropout nn.FeatureAlphaDropout",
     OpEntry(N, "dropout: a mask and a scale, exact enough in any dtype")),
    ("F.max_pool1d F.max_pool2d F.max_pool3d F.max_pool1d_with_indices F.max_pool2d_with_indices "
     "F.max_pool3d_with_indices F.adaptive_max_pool1d F.adaptive_max_pool2d F.adaptive_max_pool3d "
     "F.avg_pool1d F.avg_pool2d F.avg_pool3d F.adaptive_avg_pool1d F.adaptive_avg_pool2d F.adaptive_avg_pool3d "
     "max_pool1d max_pool2d max_pool3d avg_pool1d adaptive_avg_pool1d adaptive_max_pool1d "
     "aten.max_pool2d_with_indices aten.max_pool3d_with_indices aten.avg_pool2d aten.avg_pool3d "
     "aten._adaptive_avg_pool2d aten._adaptive_avg_pool3d aten.adaptive_max_pool2d aten.max_pool2d "
     "aten.adaptive_avg_pool2d aten.adaptive_avg_pool3d aten.adaptive_max_pool3d aten.max_pool1d_with_indices "
     "nn.MaxPool1d nn.MaxPool2d nn.MaxPool3d nn.AvgPool1d nn.AvgPool2d nn.AvgPool3d nn.AdaptiveAvgPool1d "
     "nn.AdaptiveAvgPool2d nn.AdaptiveAvgPool3d nn.AdaptiveMaxPool1d nn.AdaptiveMaxPool2d nn.AdaptiveMaxPool3d",
     OpEntry(N, "pooling over a small window (kernels accumulate averages in float32): neutral on CUDA, "
                "TF and MXNet; only CPU autocast forces 3-D pools to float32")),
    ("nn.Identity nn.Flatten nn.Unflatten nn.PixelShuffle nn.PixelUnshuffle nn.ChannelShuffle "
     "nn.ZeroPad1d nn.ZeroPad2d nn.ZeroPad3d nn.ConstantPad1d nn.ConstantPad2d nn.ConstantPad3d "
     "nn.ReflectionPad1d nn.ReflectionPad2d nn.ReflectionPad3d nn.ReplicationPad1d nn.ReplicationPad2d "
     "nn.ReplicationPad3d nn.CircularPad1d nn.CircularPad2d nn.CircularPad3d nn.Fold nn.Unfold",
     OpEntry(N, "data movement module: keeps the dtype it gets")),
]

_DEFAULT = _build(_GROUPS)
_DEFAULT[getattr] = OpEntry(N, "attribute access (x.shape, x.dtype): no arithmetic")
# torch.export's regions for ``with torch.no_grad()`` / ``torch.autocast(...)`` inside forward: the region
# runs as the user wrote it (grad mode, autocast state) and, taking float32 inputs, computes what they meant
for _region in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
    _DEFAULT[getattr(torch.ops.higher_order, _region)] = OpEntry(U, (
        "a no_grad/set_grad_enabled/autocast region of forward: runs as written (its grad mode, its autocast "
        "state), its float inputs cast to float32 at the region boundary (an autocast(enabled=False) island "
        "is float32 on purpose)"))

#: The lists fxamp uses unless told otherwise.
DEFAULT_OP_LISTS = OpLists(_DEFAULT)


# ---------------------------------------------------------------------------------------------
# Output dtypes, for dropping casts that would do nothing.  These ops return one tensor whose
# dtype is the dtype they compute in (safe/unsafe) or the promotion of their float inputs
# (neutral); NON_FLOAT_OPS never return a float tensor.  Ops on neither list are "unknown" and
# keep their run-time checked casts.
# ---------------------------------------------------------------------------------------------

def _keys(names: str) -> frozenset:
    return frozenset(k for name in names.split() for k in keys_for(name))


SINGLE_TENSOR_OPS = _keys(
    "matmul mm bmm baddbmm addmm addbmm addmv addr mv einsum operator.matmul linear aten.linear nn.Linear "
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d aten.convolution nn.Conv1d "
    "nn.Conv2d nn.Conv3d nn.ConvTranspose1d nn.ConvTranspose2d nn.ConvTranspose3d "
    "scaled_dot_product_attention F.scaled_dot_product_attention prelu F.prelu nn.PReLU "
    "exp expm1 log log2 log10 log1p reciprocal rsqrt pow square operator.pow mean logsumexp "
    "softplus F.softplus nn.Softplus F.layer_norm layer_norm nn.LayerNorm F.group_norm group_norm nn.GroupNorm "
    "F.rms_norm rms_norm nn.RMSNorm F.normalize F.cosine_similarity F.interpolate nn.Upsample "
    "softmax log_softmax F.softmin sum prod cumsum cumprod nn.Softmax nn.LogSoftmax "
    "F.cross_entropy F.nll_loss F.mse_loss F.l1_loss F.smooth_l1_loss F.binary_cross_entropy_with_logits "
    "nn.CrossEntropyLoss nn.NLLLoss nn.MSELoss nn.L1Loss nn.SmoothL1Loss nn.BCEWithLogitsLoss "
    "gelu sigmoid tanh silu mish F.silu F.mish F.gelu F.sigmoid F.tanh F.elu F.selu F.hardswish "
    "nn.GELU nn.Sigmoid nn.Tanh nn.SiLU nn.Mish nn.ELU nn.SELU nn.Hardswish "
    "relu F.relu relu6 F.relu6 F.leaky_relu F.hardtanh nn.ReLU nn.ReLU6 nn.LeakyReLU nn.Hardtanh "
    "F.batch_norm nn.BatchNorm1d nn.BatchNorm2d nn.BatchNorm3d F.dropout nn.Dropout nn.Dropout1d nn.Dropout2d "
    "abs neg sqrt sin cos clamp clip erf operator.neg "
    "add sub mul rsub where maximum minimum cat stack operator.add operator.sub operator.mul "
    "operator.truediv div "
    "reshape view view_as flatten squeeze unsqueeze permute transpose expand expand_as repeat contiguous "
    "masked_fill tril triu roll flip clone detach F.pad F.max_pool2d F.avg_pool2d F.adaptive_avg_pool2d "
    "nn.MaxPool2d nn.AvgPool2d nn.AdaptiveAvgPool2d nn.Identity nn.Flatten F.embedding nn.Embedding"
)

NON_FLOAT_OPS = _keys(
    "size dim numel nelement argmax argmin eq ne lt le gt ge isnan isinf isfinite logical_and logical_or "
    "logical_not operator.eq operator.ne operator.lt operator.le operator.gt operator.ge operator.floordiv "
    "operator.mod aten.sym_size aten.sym_numel"
)

#: ops returning a tuple of tensors in their input's dtype (``getitem`` of them keeps that dtype)
SPLIT_OPS = _keys("chunk split tensor_split unbind aten.split aten.split_with_sizes aten.chunk aten.unbind")

#: ops whose result is the first input's values seen another way (a view, a transpose, a split, a
#: copy in the same dtype): a parameter read through them is really consumed by their users, so
#: ``store_params`` looks through them to decide its storage dtype
VIEW_OPS = _keys(
    "t transpose permute view view_as reshape reshape_as expand expand_as contiguous unsqueeze squeeze "
    "flatten unflatten narrow select movedim moveaxis swapaxes swapdims detach detach_ clone chunk split tensor_split "
    "unbind aten.alias aten.slice aten._unsafe_view aten.split_with_sizes aten.lift_fresh_copy aten.numpy_T "
    "aten.mT aten.mH aten.adjoint aten.matrix_H operator.getitem"
)
#: single-tensor ops whose result has their input's dtype, whatever it is: a boolean mask through
#: ``triu`` is still a mask, not a float input of the op it masks (dtype inference, fxamp/dtypes.py)
KEEP_DTYPE_OPS = VIEW_OPS | _keys("tril triu masked_fill roll flip diag diagonal repeat expand clone")

#: attributes that are views of a tensor (``w.T``)
VIEW_ATTRS = frozenset({"T", "mT", "H", "mH"})
