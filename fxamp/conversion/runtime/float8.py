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
The graph calls :func:`float8_linear`, :func:`float8_matmul`, :func:`float8_addmm` and :func:`float8_einsum`
(``rewrite/float8.py`` puts them there; which matmuls is ``classify/float8.py``'s choice); :data:`PLAIN` maps
each to the same call without float8, for a float32 reference run.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...policy import Float8, Float8Recipe

__all__ = ["E4M3", "E5M2", "EPS", "amax_to_scale", "to_float8", "float8_mm", "float8_linear", "float8_matmul",
           "float8_einsum", "float8_addmm", "Float8Matmul", "gemm_options", "GEMM_OPTIONS", "einsum_plan", "sqnr_db",
           "PLAIN"]


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
    """``x @ w_t`` for a 2-D ``x`` (M,K) and ``w_t`` (K,N) in float8, forward and backward, by ``recipe``'s
    GEMMs (a :class:`Float8Recipe`'s value) with power-of-two scales when ``pow2``.

    The output and both gradients come back in ``x``'s (and ``w_t``'s) dtype: float8 lives only inside.
    Its options are a string and a bool, not a :class:`Float8`: torch.compile traces the Function with
    constants it needs no rule for (an object built or stored on ``ctx`` in the compiled region can break
    the graph there, one graph per linear).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, recipe: str,  # type: ignore[override]
                pow2: bool) -> torch.Tensor:
        rowwise = recipe != _TENSORWISE
        x8, sx = to_float8(x, E4M3, pow2, dim=-1 if rowwise else None)
        w8, sw = to_float8(w_t, E4M3, pow2, dim=0 if rowwise else None)
        ctx.recipe, ctx.pow2 = recipe, pow2
        ctx.dtypes = (x.dtype, w_t.dtype)
        if rowwise:
            ctx.save_for_backward(x, w_t)
        else:  # the backward's casts of x and w are these: keep one byte a value
            ctx.save_for_backward(x8, sx, w8, sw)
        return float8_mm(x8, sx, w8, sw, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        recipe, pow2 = ctx.recipe, ctx.pow2
        x_dtype, w_dtype = ctx.dtypes
        grad_x = grad_w_t = None
        if recipe == _TENSORWISE:
            x8, sx, w8, sw = ctx.saved_tensors
            g8, sg = to_float8(grad, E5M2, pow2)
            if ctx.needs_input_grad[0]:
                grad_x = float8_mm(g8, sg, w8.t(), sw, x_dtype)
            if ctx.needs_input_grad[1]:
                g8_m, x8_m = _pad_inner(g8, x8)
                grad_w_t = float8_mm(g8_m.t(), sg, x8_m, sx, w_dtype).t()
            return grad_x, grad_w_t, None, None
        x, w_t = ctx.saved_tensors
        g8_rows, sg_rows = to_float8(grad, E4M3, pow2, dim=-1)  # per row of grad: grad_x's first operand
        if ctx.needs_input_grad[0]:
            if recipe == _ROWWISE:
                w8, sw = to_float8(w_t, E4M3, pow2, dim=-1)  # per K: w_t.t()'s columns
                grad_x = float8_mm(g8_rows, sg_rows, w8.t(), sw.t(), x_dtype)
            else:  # rowwise_with_gw_hp: the weight per tensor
                w8, sw = to_float8(w_t, E4M3, pow2)
                grad_x = float8_mm(g8_rows, sg_rows, w8.t(), sw, x_dtype)
        if ctx.needs_input_grad[1]:
            if recipe == _ROWWISE:
                g8_cols, sg_cols = to_float8(grad, E4M3, pow2, dim=0)  # per N: gradᵀ's rows
                x8, sx = to_float8(x, E4M3, pow2, dim=0)  # per K
                g8_cols, x8 = _pad_inner(g8_cols, x8)
                grad_w_t = float8_mm(g8_cols.t(), sg_cols.t(), x8, sx, w_dtype).t()
            else:
                grad_w_t = (grad.t().to(w_dtype) @ x.to(w_dtype)).t()
        return grad_x, grad_w_t, None, None


_TENSORWISE, _ROWWISE = Float8Recipe.TENSORWISE.value, Float8Recipe.ROWWISE.value
#: a graph's float8 string -> (recipe, pow2), filled where the graph is built or re-traced (:func:`gemm_options`), so
#: that a compiled graph reads a dict entry instead of tracing the string's parse (which built a :class:`Float8`)
GEMM_OPTIONS: Dict[str, Tuple[str, bool]] = {}


def gemm_options(config: Union[str, Float8]) -> Tuple[str, bool]:
    """``(recipe value, pow2)`` of ``config`` (a :class:`Float8` or its string): :class:`Float8Matmul`'s options."""
    if isinstance(config, Float8):
        return config.recipe.value, config.power_of_two
    options = GEMM_OPTIONS.get(config)
    if options is None:
        parsed = Float8.parse(config)
        options = GEMM_OPTIONS[config] = (parsed.recipe.value, parsed.power_of_two)
    return options


def _traced(fn: Any, *args: Any) -> Optional[fx.Proxy]:
    """While torch.fx traces a graph's code (unpickling a GraphModule re-traces it), a call of ``fn`` on a
    Proxy stays one call in the graph instead of being traced into."""
    proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
    if proxy is None:
        return None
    gemm_options(args[-1])  # (the graph's config, parsed now: a compiled call reads it from the table)
    return proxy.tracer.create_proxy("call_function", fn, args, {})


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  config: Union[str, Float8]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in float8 (x (..., K), weight (N, K)); the bias is added
    in the output's dtype, after the GEMM.  ``config``: a :class:`Float8` or its string (as graphs hold it)."""
    traced = _traced(float8_linear, x, weight, bias, config)
    if traced is not None:
        return traced
    out = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), *gemm_options(config))
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
