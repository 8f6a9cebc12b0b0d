"""Float8 matmuls: dynamic scaling, the casts, ``torch._scaled_mm`` forward and a backward of float8 GEMMs.

The numerics follow torchao.float8's recipes (same names, same scale formula, same dtypes per GEMM)::

    scale = finfo(f8).max / max(amax, 1e-12)      (float64 math, then float32; optionally 2**floor(log2))
    x_f8  = clamp(x * scale, ±finfo(f8).max).to(f8)                    dequantized: x_f8 / scale
    out   = _scaled_mm(x_f8, w_f8ᵀ, 1/scale_x, 1/scale_w, out_dtype=x.dtype)      (+ bias in x.dtype)

=====================  ==========================  ============================  ==========================
GEMM                   tensorwise                  rowwise                       rowwise_with_gw_hp
=====================  ==========================  ============================  ==========================
out = x @ wᵀ           e4m3 x, e4m3 w (1 scale)    e4m3, scale per row of x and  as rowwise
                                                   per row of w (over K)
grad_x = g @ w         e5m2 g, e4m3 w              e4m3 g per row, w per col     e4m3 g per row, w one scale
grad_w = gᵀ @ x        e5m2 g, e4m3 x              e4m3, per col of g and x      high precision (bf16 GEMM)
=====================  ==========================  ============================  ==========================

Tensorwise saves the float8 operands for backward (1 byte a value, and the backward casts are the
forward's); the rowwise recipes save the high-precision ones (their backward scales other axes).
``_scaled_mm`` wants its first operand row-major and its second column-major: the CPU kernel takes
any layout, a compiled graph does not, so both are made so here.

On a CPU, ``_scaled_mm`` runs emulated: its result equals the dequantized matmul exactly (in float32,
then rounded to the output dtype), so the tests here check the numerics a GPU runs, except the GEMM's
accumulation order.  It is slower than a float32 matmul there: float8 is for H100-class GPUs.

:func:`matmul_shape` says whether a graph node is a matmul this module can run (and its K, N),
:func:`cost_says` whether float8 pays at that shape (:data:`COST_TABLES`), :func:`choose` records the
choice per node (``Decision.float8``) and :func:`rewrite_float8` swaps the chosen nodes' targets.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..policy import Float8, Float8Cost, Float8Recipe
from .graph import DECISION, Decision, Float8Choice, covering, fetch_attr, module_path_of
from .op_lists import Category, Source, op_key

__all__ = ["E4M3", "E5M2", "EPS", "amax_to_scale", "to_float8", "float8_mm", "float8_linear", "float8_matmul",
           "float8_einsum", "float8_addmm", "Float8Matmul", "CostTable", "COST_TABLES", "device_kind", "torchao_default", "cost_says", "sqnr_db",
           "FORCE", "REFUSE", "PLAIN", "split_overrides", "choose", "rewrite_float8", "float8_notes", "matmul_shape"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: the smallest amax a scale is computed from (torchao's): an all-zero tensor gets a finite scale
EPS = 1e-12


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``finfo(dtype).max / max(amax, EPS)`` computed in float64, returned float32; rounded down to a power
    of two when ``pow2``.  Finite for every finite amax (0 included); an infinite amax gives 0 (and a NaN
    product downstream: an overflow stays visible)."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


@torch.no_grad()
def to_float8(x: torch.Tensor, dtype: torch.dtype, pow2: bool, dim: Optional[int] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x_f8, scale)``: ``x`` scaled by ``scale`` (one for the tensor, or one per slice along ``dim``: the amax
    is taken over ``dim``, keepdim) and cast with saturation; ``x_f8 / scale`` dequantizes it."""
    ax = x.abs()
    amax = ax.amax() if dim is None else ax.amax(dim=dim, keepdim=True)
    scale = amax_to_scale(amax, dtype, pow2)
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-limit, limit).to(dtype), scale


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values, laid out column-major (a no-op when they already are)."""
    return t.t().contiguous().t()


def float8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(a / scale_a) @ (b / scale_b)`` through ``torch._scaled_mm`` (a (M,K), b (K,N) in float8; scales a
    scalar each, or (M,1) and (1,N)); ``a`` is made row-major and ``b`` column-major.

    ``fast_accum``: the GPU GEMM accumulates in its faster, less precise mode (torchao's choice for the
    forward GEMM, not for the gradients'); a CPU ignores it (the emulated product is the same)."""
    if scale_a.dim() != scale_b.dim():  # one operand per row, the other per tensor: expand, as torchao does
        if scale_a.dim() == 0:
            scale_a = scale_a.expand(a.shape[0], 1).contiguous()
        else:
            scale_b = scale_b.expand(1, b.shape[1]).contiguous()
    return torch._scaled_mm(a.contiguous(), _col_major(b), scale_a=scale_a.reciprocal(),
                            scale_b=scale_b.reciprocal(), out_dtype=out_dtype, use_fast_accum=fast_accum)


def _pad_inner(*ts: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Pad dim 0 (the grad_weight GEMM's inner dim M, tokens) with zeros to a multiple of 16: GPU
    ``_scaled_mm`` takes no other; zero rows add nothing to the product."""
    extra = -ts[0].shape[0] % 16
    if not extra:
        return ts
    return tuple(torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) for t in ts)


class Float8Matmul(torch.autograd.Function):
    """``x @ w_t`` for a 2-D ``x`` (M,K) and ``w_t`` (K,N) in float8, forward and backward, by ``config``'s recipe.

    The output and both gradients come back in ``x``'s (and ``w_t``'s) dtype: float8 lives only inside.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, config: Float8) -> torch.Tensor:  # type: ignore[override]
        rowwise = config.recipe is not Float8Recipe.TENSORWISE
        x8, sx = to_float8(x, E4M3, config.power_of_two, dim=-1 if rowwise else None)
        w8, sw = to_float8(w_t, E4M3, config.power_of_two, dim=0 if rowwise else None)
        ctx.config = config
        ctx.dtypes = (x.dtype, w_t.dtype)
        if rowwise:
            ctx.save_for_backward(x, w_t)
        else:  # the backward's casts of x and w are these: keep one byte a value
            ctx.save_for_backward(x8, sx, w8, sw)
        return float8_mm(x8, sx, w8, sw, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        config: Float8 = ctx.config
        x_dtype, w_dtype = ctx.dtypes
        pow2 = config.power_of_two
        grad_x = grad_w_t = None
        if config.recipe is Float8Recipe.TENSORWISE:
            x8, sx, w8, sw = ctx.saved_tensors
            g8, sg = to_float8(grad, E5M2, pow2)
            if ctx.needs_input_grad[0]:
                grad_x = float8_mm(g8, sg, w8.t(), sw, x_dtype)
            if ctx.needs_input_grad[1]:
                g8_m, x8_m = _pad_inner(g8, x8)
                grad_w_t = float8_mm(g8_m.t(), sg, x8_m, sx, w_dtype).t()
            return grad_x, grad_w_t, None
        x, w_t = ctx.saved_tensors
        g8_rows, sg_rows = to_float8(grad, E4M3, pow2, dim=-1)  # per row of grad: grad_x's first operand
        if ctx.needs_input_grad[0]:
            if config.recipe is Float8Recipe.ROWWISE:
                w8, sw = to_float8(w_t, E4M3, pow2, dim=-1)  # per K: w_t.t()'s columns
                grad_x = float8_mm(g8_rows, sg_rows, w8.t(), sw.t(), x_dtype)
            else:  # rowwise_with_gw_hp: the weight per tensor
                w8, sw = to_float8(w_t, E4M3, pow2)
                grad_x = float8_mm(g8_rows, sg_rows, w8.t(), sw, x_dtype)
        if ctx.needs_input_grad[1]:
            if config.recipe is Float8Recipe.ROWWISE:
                g8_cols, sg_cols = to_float8(grad, E4M3, pow2, dim=0)  # per N: gradᵀ's rows
                x8, sx = to_float8(x, E4M3, pow2, dim=0)  # per K
                g8_cols, x8 = _pad_inner(g8_cols, x8)
                grad_w_t = float8_mm(g8_cols.t(), sg_cols.t(), x8, sx, w_dtype).t()
            else:
                grad_w_t = (grad.t().to(w_dtype) @ x.to(w_dtype)).t()
        return grad_x, grad_w_t, None


def _traced(fn: Any, *args: Any) -> Optional[fx.Proxy]:
    """While torch.fx traces a graph's code (unpickling a GraphModule re-traces it), a call of ``fn`` on a
    Proxy stays one call in the graph instead of being traced into."""
    proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
    return None if proxy is None else proxy.tracer.create_proxy("call_function", fn, args, {})


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  config: Union[str, Float8]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in float8 (x (..., K), weight (N, K)); the bias is added
    in the output's dtype, after the GEMM.  ``config``: a :class:`Float8` or its string (as graphs hold it)."""
    traced = _traced(float8_linear, x, weight, bias, config)
    if traced is not None:
        return traced
    config = Float8.parse(config)  # graphs hold its string: a few string ops, traced away by torch.compile
    out = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), config)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias.to(out.dtype)


def float8_matmul(a: torch.Tensor, b: torch.Tensor, config: Union[str, Float8]) -> torch.Tensor:
    """``a @ b`` for ``a`` (..., K) and a 2-D ``b`` (K, N) with the matmul in float8."""
    traced = _traced(float8_matmul, a, b, config)
    if traced is not None:
        return traced
    return float8_linear(a, b.t(), None, config)


def float8_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: Union[str, Float8]) -> torch.Tensor:
    """``torch.addmm(bias, a, b)`` (a (M, K), b (K, N); Hugging Face's Conv1D) with the matmul in float8."""
    traced = _traced(float8_addmm, bias, a, b, config)
    if traced is not None:
        return traced
    return float8_linear(a, b.t(), bias, config)


def float8_einsum(equation: str, a: torch.Tensor, b: torch.Tensor, config: Union[str, Float8]) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` for an equation :func:`einsum_plan` accepts, in float8."""
    traced = _traced(float8_einsum, equation, a, b, config)
    if traced is not None:
        return traced
    plan = einsum_plan(equation, a.dim(), b.dim())
    assert plan is not None, equation  # checked when the node was chosen
    a_perm, b_transposed, out_perm = plan
    out = float8_linear(a.permute(a_perm), b if b_transposed else b.t(), None, config)
    return out.permute(out_perm)


def einsum_plan(equation: str, a_dim: int, b_dim: int) -> Optional[Tuple[Tuple[int, ...], bool, Tuple[int, ...]]]:
    """For a two-operand einsum whose second operand is a 2-D matrix contracted over one index
    (``"bsk,kn->bsn"``, ``"bi,oi->bo"``), ``(a's permutation putting the contracted index last, whether b
    is (N, K), the permutation of the (…, N) result into the output's order)``; None for any other."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    sa, sb = parts
    if len(sa) != a_dim or len(sb) != b_dim or b_dim != 2 or len(set(sa)) != len(sa) or len(set(sb)) != 2:
        return None
    shared = [c for c in sb if c in sa]
    if len(shared) != 1 or shared[0] in out:
        return None
    k = shared[0]
    n = sb.replace(k, "")
    free = [c for c in sa if c != k]
    if n in sa or sorted(out) != sorted(free + [n]) or len(out) != len(free) + 1:
        return None
    a_perm = tuple(sa.index(c) for c in free) + (sa.index(k),)
    result = free + [n]  # the order of float8_linear's result
    out_perm = tuple(result.index(c) for c in out)
    return a_perm, sb.index(k) == 1, out_perm


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal to quantization noise ratio of ``value`` against ``reference``, in dB (inf when equal)."""
    ref = reference.double()
    noise = (ref - value.double()).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))


# -- the cost model -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostTable:
    """Measured speed-ups of float8 over bfloat16 for one device kind, one recipe, by matmul shape.

    device:   what measured it (``torch.cuda.get_device_name()``, or ``"cpu: <lscpu model>"``).
    tokens:   the GEMM's M (rows of the input) it was measured at.
    rows:     ``((K, N, speed-up), ...)``: bf16 time / float8 time of forward + backward, casts included.

    A shape is looked up at the nearest measured (K, N) in log space; float8 pays when its speed-up > 1.
    """

    device: str
    tokens: int
    rows: Tuple[Tuple[int, int, float], ...]

    def speedup(self, k: int, n: int) -> float:
        def dist(row: Tuple[int, int, float]) -> float:
            return abs(math.log2(row[0] / k)) + abs(math.log2(row[1] / n))

        return min(self.rows, key=dist)[2]


#: device kind (:func:`device_kind`) -> recipe -> table; where none was measured, :func:`torchao_default`
#: decides.  Measured with ``python -m benchmarks.float8_cost`` (benchmarks/RESULTS.md has the runs).  On a
#: CPU ``_scaled_mm`` runs emulated: it beats bfloat16 only where bfloat16 itself has no fast kernels.
COST_TABLES: Dict[str, Dict[Float8Recipe, CostTable]] = {
    # Intel Xeon (AVX-512, no AVX-512-BF16, no AMX), 1 thread, 2026-11-27: the mean of two noisy runs
    # (benchmarks/RESULTS.md has both); bfloat16 has no fast kernel there, so emulated float8 wins at 1024
    "cpu:no-bf16-kernels": {
        Float8Recipe.TENSORWISE: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                           ((64, 64, 0.30), (256, 256, 0.95), (1024, 1024, 1.34))),
        Float8Recipe.ROWWISE: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                        ((64, 64, 0.35), (256, 256, 0.62), (1024, 1024, 1.18))),
        Float8Recipe.ROWWISE_WITH_GW_HP: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                                   ((64, 64, 0.26), (256, 256, 0.72), (1024, 1024, 1.04))),
    },
    # NVIDIA H200, torch 2.11.0+cu130, M = 8192, eager, 2026-11-27 (benchmarks/gpu_checks.sh): fxamp's scaling
    # and casts are separate kernels in eager, so float8 loses to bfloat16's GEMM at every shape measured
    "cuda:NVIDIA H200": {
        Float8Recipe.TENSORWISE: CostTable("NVIDIA H200", 8192, ((1024, 1024, 0.33), (2048, 2048, 0.37),
                                                                 (4096, 1024, 0.32), (4096, 4096, 0.51),
                                                                 (8192, 8192, 0.76))),
        Float8Recipe.ROWWISE: CostTable("NVIDIA H200", 8192, ((1024, 1024, 0.20), (2048, 2048, 0.22),
                                                              (4096, 1024, 0.20), (4096, 4096, 0.35),
                                                              (8192, 8192, 0.54))),
        Float8Recipe.ROWWISE_WITH_GW_HP: CostTable("NVIDIA H200", 8192, ((1024, 1024, 0.27), (2048, 2048, 0.29),
                                                                         (4096, 1024, 0.27), (4096, 4096, 0.48),
                                                                         (8192, 8192, 0.67))),
    },
}


def device_kind(device: Optional[torch.device]) -> str:
    """The key of :data:`COST_TABLES` for a device: ``"cuda:<name>"``, or for a CPU its bfloat16 kernels
    (``"cpu:amx-bf16"``, ``"cpu:avx512-bf16"``, ``"cpu:no-bf16-kernels"``; ``"cpu"`` where unknown)."""
    if device is None or device.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
        except OSError:
            flags = None
        if flags is None:
            return "cpu"
        return ("cpu:amx-bf16" if "amx_bf16" in flags else "cpu:avx512-bf16" if "avx512_bf16" in flags
                else "cpu:no-bf16-kernels")
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def torchao_default(recipe: Float8Recipe, k: int, n: int) -> Tuple[bool, str]:
    """torchao's shape thresholds (``_auto_filter_for_recipe``, measured on an H100): whether float8 pays."""
    if recipe is Float8Recipe.TENSORWISE:
        pays = not (k <= 4096 and n <= 1024)
        rule = "tensorwise skips K <= 4096 and N <= 1024"
    else:  # torchao has no rule for rowwise_with_gw_hp: rowwise's
        pays = not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
        rule = "rowwise skips N <= 2048, K <= 1024, and N <= 4096 with K <= 2048"
    return pays, f"torchao's H100 thresholds ({rule})"


def cost_says(kind: str, recipe: Float8Recipe, k: int, n: int,
              tables: Mapping[str, Mapping[Float8Recipe, CostTable]] = COST_TABLES) -> Tuple[bool, str]:
    """Whether float8 pays for a (K, N) matmul on device ``kind``, and why (the table's row, or torchao's rule)."""
    table = tables.get(kind, {}).get(recipe)
    if table is None:
        pays, rule = torchao_default(recipe, k, n)
        emulated = ", where float8 runs emulated," if kind.startswith("cpu") else ""
        return pays, f"no cost table for {kind}{emulated} so {rule}"
    s = table.speedup(k, n)
    return s > 1.0, f"measured {s:.2f}x of bfloat16 near K={k}, N={n} on {table.device}"


# -- choosing the nodes -----------------------------------------------------------------------------

#: override values (``node_overrides``/``module_overrides``) that decide float8 rather than a category
FORCE = "float8"  # run these matmuls in float8 whatever the cost model says (still only where float8 can)
REFUSE = "no_float8"  # keep these matmuls in the policy's compute dtype (bfloat16)

_LINEAR = frozenset(op_key(t) for t in (F.linear, torch.ops.aten.linear.default))
_MATMUL = frozenset(op_key(t) for t in (torch.matmul, torch.mm, operator.matmul, "matmul", "mm",
                                         torch.ops.aten.mm.default, torch.ops.aten.matmul.default))
_ADDMM = frozenset(op_key(t) for t in (torch.addmm, "addmm", torch.ops.aten.addmm.default))
_EINSUM = frozenset(op_key(t) for t in (torch.einsum, torch.ops.aten.einsum.default))
#: GEMM dimensions float8 kernels take (cuBLASLt's _scaled_mm: K and N multiples of 16)
MULTIPLE = 16


def split_overrides(overrides: Optional[Mapping[str, Any]]) -> Tuple[Optional[Dict[str, Any]], Dict[str, str]]:
    """``(category overrides, float8 overrides)``: the values :data:`FORCE` and :data:`REFUSE` go to the second."""
    if not overrides:
        return (dict(overrides) if overrides is not None else None), {}
    valid = {c.value for c in Category} | {FORCE, REFUSE}
    for key, value in overrides.items():
        if isinstance(value, str) and not isinstance(value, Category) and value not in valid:
            raise ValueError(f"override {key!r}: {value!r} is neither a category ({', '.join(c.value for c in Category)}) "
                             f"nor {FORCE!r} / {REFUSE!r}")
    f8 = {k: v for k, v in overrides.items() if isinstance(v, str) and v in (FORCE, REFUSE)}
    rest = {k: v for k, v in overrides.items() if k not in f8}
    return (rest or None), f8


def _tensor_shape(gm: fx.GraphModule, value: Any) -> Optional[Tuple[int, ...]]:
    """The shape of a parameter, buffer or constant the graph reads (a get_attr), else None: float8 takes
    weights, not activations (their shapes could be read from torch.export's ``meta["val"]``, on purpose not)."""
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    t = fetch_attr(gm, str(value.target))
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _weight_device(gm: fx.GraphModule, value: Any) -> Optional[torch.device]:
    if isinstance(value, fx.Node) and value.op == "get_attr":
        t = fetch_attr(gm, str(value.target))
        return t.device if isinstance(t, torch.Tensor) else None
    return None


def matmul_shape(gm: fx.GraphModule, node: fx.Node) -> Tuple[Optional[str], Optional[Tuple[int, int]], Any]:
    """``(kind, (K, N), weight node)`` for a matmul float8 could run (kind "linear", "matmul", "addmm" or "einsum"),
    with (K, N) None when the second operand is no 2-D parameter or buffer; ``(None, None, None)`` for
    any other node."""
    if node.op not in ("call_function", "call_method"):
        return None, None, None
    key = op_key(node.target)
    if key in _LINEAR:
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        shape = _tensor_shape(gm, w)
        return "linear", ((shape[1], shape[0]) if shape is not None and len(shape) == 2 else None), w
    if key in _MATMUL:
        if len(node.args) != 2 or node.kwargs:
            return "matmul", None, None
        shape = _tensor_shape(gm, node.args[1])
        return "matmul", ((shape[0], shape[1]) if shape is not None and len(shape) == 2 else None), node.args[1]
    if key in _ADDMM:
        if len(node.args) != 3 or node.kwargs:  # beta= / alpha=: not a plain bias + matmul
            return "addmm", None, None
        shape = _tensor_shape(gm, node.args[2])
        return "addmm", ((shape[0], shape[1]) if shape is not None and len(shape) == 2 else None), node.args[2]
    if key in _EINSUM:
        eq, operands = _einsum_args(node)
        if eq is None or len(operands) != 2:
            return "einsum", None, None
        b_shape = _tensor_shape(gm, operands[1])
        a_dim = len(eq.split("->")[0].split(",")[0]) if "->" in eq else 0  # no "..." (einsum_plan refuses it)
        plan = einsum_plan(eq, a_dim, len(b_shape)) if b_shape is not None else None
        if plan is None:
            return "einsum", None, None
        k_at = 1 if plan[1] else 0
        return "einsum", (b_shape[k_at], b_shape[1 - k_at]), operands[1]
    return None, None, None


def _einsum_args(node: fx.Node) -> Tuple[Optional[str], List[Any]]:
    args = list(node.args)
    if not args or not isinstance(args[0], str):
        return None, []
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    return args[0], operands


def _check_device(device: Optional[torch.device], config: Float8) -> None:
    """A clear line for a device ``_scaled_mm`` cannot run on (before any graph runs)."""
    if device is None or device.type == "cpu":
        return
    if device.type == "cuda" and not torch.version.hip:
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"float8={config} needs a GPU with float8 matmuls (compute capability 8.9 or newer: "
                             f"Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. "
                             f"Drop float8 from the policy (plain 'O2' runs bfloat16)")
        return
    if device.type != "cuda":
        raise ValueError(f"float8={config}: torch._scaled_mm has no float8 matmul on {device.type!r}; "
                         f"float8 runs on CUDA (compute capability 8.9+) and, emulated, on CPU")


def choose(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], policy: Any,
           module_overrides: Mapping[str, str], node_overrides: Mapping[str, str]) -> None:
    """Give every safe matmul running in the policy's compute dtype a :class:`Float8Choice` (in ``decisions``).

    In order: a node override, then a module override (``"float8"`` / ``"no_float8"``); a matmul whose
    second operand is no 2-D parameter or buffer, or whose K or N is no multiple of 16, stays bfloat16
    (a forced one is an error); then the policy's ``cost`` (``always``, or the cost model).
    """
    config: Optional[Float8] = policy.float8
    if config is None:
        if module_overrides or node_overrides:
            where = next(iter({**module_overrides, **node_overrides}))
            raise ValueError(f"overrides: {where!r} asks for {({**module_overrides, **node_overrides})[where]!r}, "
                             f"but the policy runs no float8; add float8=<recipe> to it ('O2,float8=tensorwise')")
        return
    names = {n.name: n for n in gm.graph.nodes}
    for name in node_overrides:
        if name not in names:
            raise ValueError(f"node_overrides: the graph has no node {name!r} (names are fxamp.report's node column)")
    paths = {p for p, _ in gm.named_modules()}
    for path in module_overrides:
        if path not in paths:
            raise ValueError(f"module_overrides: {path!r} is not a submodule of the model")
    checked = set()
    for node, d in list(decisions.items()):
        kind, kn, weight = matmul_shape(gm, node)
        if kind is None or d.resolved is not Category.SAFE or d.compute != policy.compute:
            if node.name in node_overrides and kind is None:
                raise ValueError(f"node_overrides: {node.name!r} ({d.op}) is not a matmul, so "
                                 f"{node_overrides[node.name]!r} means nothing for it")
            continue
        device = _weight_device(gm, weight)
        if device not in checked:
            _check_device(device, config)
            checked.add(device)
        choice = _choose_one(node, kind, kn, config, device, module_overrides, node_overrides)
        decisions[node] = dataclasses.replace(d, float8=choice)


def _choose_one(node: fx.Node, kind: str, kn: Optional[Tuple[int, int]], config: Float8,
                device: Optional[torch.device], module_overrides: Mapping[str, str],
                node_overrides: Mapping[str, str]) -> Float8Choice:
    forced = None
    if node.name in node_overrides:
        forced = (node_overrides[node.name], Source.NODE_OVERRIDE, f"node {node.name!r}")
    else:
        cover = covering(module_path_of(node), module_overrides)
        if cover is not None:
            forced = (cover[1], Source.MODULE_OVERRIDE, f"module {cover[0]!r}")
    if forced is not None and forced[0] == REFUSE:
        return Float8Choice(False, f"no_float8 for {forced[2]} (override): runs in bfloat16", forced[1])
    bad = None
    if kn is None:
        bad = (f"its second operand is no 2-D parameter or buffer (a {kind} of two activations, a batched or "
               f"sliced weight, or an einsum that is no single matmul): float8 takes one 2-D weight")
    elif kn[0] % MULTIPLE or kn[1] % MULTIPLE:
        bad = f"K={kn[0]}, N={kn[1]}: float8 GEMMs need K and N multiples of {MULTIPLE}"
    if bad is not None:
        if forced is not None:
            raise ValueError(f"{'node_overrides' if forced[1] is Source.NODE_OVERRIDE else 'module_overrides'}: "
                             f"{forced[2]} asks for float8 at {node.name} ({node.format_node()}), but {bad}; "
                             f"drop the override, or pad the layer")
        return Float8Choice(False, f"kept in bfloat16: {bad}", Source.GRAPH)
    if forced is not None:
        return Float8Choice(True, f"float8 for {forced[2]} (override), whatever the cost", forced[1])
    if config.cost is Float8Cost.ALWAYS:
        return Float8Choice(True, f"float8 (cost=always; K={kn[0]}, N={kn[1]})", Source.DEFAULT)
    pays, why = cost_says(device_kind(device), config.recipe, kn[0], kn[1])
    if pays:
        return Float8Choice(True, f"float8: pays at K={kn[0]}, N={kn[1]} ({why})", Source.DEFAULT)
    return Float8Choice(False, f"{_COST_KEPT}K={kn[0]}, N={kn[1]} ({why}); {_FORCE}", Source.DEFAULT)


_COST_KEPT = "kept in bfloat16: too small to pay at "
_FORCE = "':always' or a node/module override 'float8' forces it"


def float8_notes(decisions: Mapping[fx.Node, Decision], config: Optional[Float8] = None) -> List[str]:
    """One line saying how many matmuls run in float8, which the cost model kept in bfloat16 (why, and how
    to force them: on a CPU it keeps them all) and which stayed in bfloat16 for their shape."""
    choices = [(n, d.float8) for n, d in decisions.items() if d.float8 is not None]
    if not choices:
        return []
    chosen = sum(c.chosen for _, c in choices)
    shape = [n.name for n, c in choices if not c.chosen and c.source is Source.GRAPH]
    cost = [(n, c) for n, c in choices if not c.chosen and c.reason.startswith(_COST_KEPT)]
    line = f"float8: {chosen} of {len(choices)} matmuls run in float8"
    if cost:
        always = f"'float8={dataclasses.replace(config, cost=Float8Cost.ALWAYS)}'" if config else "':always'"
        # "K=64, N=64 (why)" -> "K=64, N=64: why"
        why = cost[0][1].reason[len(_COST_KEPT):-len(_FORCE) - 2].replace(" (", ": ", 1)[:-1]
        line += (f"; the cost model kept {len(cost)} in bfloat16 as too small to pay ({cost[0][0].name} at {why}); "
                 f"{always} or a node/module override 'float8' forces them")
    if shape:
        line += (f"; kept in bfloat16 for their shape (see the report): {', '.join(shape[:5])}"
                 + (", …" if len(shape) > 5 else ""))
    return [line]


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: Any) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _plain_matmul(a: torch.Tensor, b: torch.Tensor, config: Any) -> torch.Tensor:
    return a @ b


def _plain_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: Any) -> torch.Tensor:
    return torch.addmm(bias, a, b)


def _plain_einsum(equation: str, a: torch.Tensor, b: torch.Tensor, config: Any) -> torch.Tensor:
    return torch.einsum(equation, a, b)


#: each float8 graph function -> the same call without float8 (a float32 reference runs these)
PLAIN = {float8_linear: _plain_linear, float8_matmul: _plain_matmul, float8_addmm: _plain_addmm,
         float8_einsum: _plain_einsum}


def rewrite_float8(gm: fx.GraphModule, decisions: Mapping[fx.Node, Decision], config: Float8) -> int:
    """Replace each chosen matmul (its inputs already cast to bfloat16) by its float8 form; returns how many::

        linear = F.linear(x, w, b)           ==>  linear = float8_linear(x, w, b, "tensorwise")
        matmul = x @ w                       ==>  matmul = float8_matmul(x, w, "tensorwise")
        addmm = addmm(b, x, w)               ==>  addmm = float8_addmm(b, x, w, "tensorwise")
        einsum = einsum("bi,ij->bj", x, w)   ==>  einsum = float8_einsum("bi,ij->bj", x, w, "tensorwise")
    """
    text = str(config)
    made = 0
    for node in gm.graph.nodes:
        d = node.meta.get(DECISION)
        if d is None or d.float8 is None or not d.float8.chosen:
            continue
        kind = matmul_shape(gm, node)[0]
        if kind == "linear":
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w = args[0], args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            b = args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            target, new_args = float8_linear, (x, w, b, text)
        elif kind == "matmul":
            target, new_args = float8_matmul, (node.args[0], node.args[1], text)
        elif kind == "addmm":
            target, new_args = float8_addmm, (*node.args, text)
        else:
            eq, (a, b) = _einsum_args(node)
            target, new_args = float8_einsum, (eq, a, b, text)
        # the same node (x.matmul(w) was a call_method): its name, meta, and the casts that point at it stay
        node.op, node.target, node.args, node.kwargs = "call_function", target, new_args, {}
        made += 1
    return made
