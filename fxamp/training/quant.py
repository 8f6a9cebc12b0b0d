"""Optimizer state in fewer bytes: bfloat16, or 8 bits per element in blocks of 256 with a float32 absmax.

Between steps a compressed state tensor replaces the float32 one in ``optimizer.state[p]`` under
its own key (``exp_avg``), with the block scales beside it (``exp_avg.absmax``), so the inner
optimizer's own ``state_dict`` carries the compressed form.  The step decompresses into float32
(:func:`decompress`), the inner optimizer steps, and :func:`compress` writes the result back.

The 8-bit code is *logarithmic* ("dynamic", as bitsandbytes' dynamic map, here a formula instead
of a table): ``q = round(K * log2(|x| / absmax))`` per element of a block of 256, so every element
keeps about the same relative precision (about ±4 %) however far below the block's largest it is.
A linear code (``round(127 * x / absmax)``) would zero every element of Adam's second moment more
than 255× below its block's largest, and the update ``m / (sqrt(v) + eps)`` of such an element
would explode.  A second moment is never coded as zero (a small one decodes to the smallest code: a
smaller update, the safe side; a zero one too, and its first moment is zero, so is its update); a first
moment may underflow to zero (no update, also safe).

Only the state keys of torch's stock Adam, AdamW and SGD are compressed (:data:`SIGNED`,
:data:`UNSIGNED`); other optimizers keep float32 state (:func:`compressible`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor  # (imported by torch itself)

__all__ = ["BLOCK", "CHUNK", "ACCELERATOR_CHUNK", "chunk_for", "SIGNED", "UNSIGNED", "STOCK", "compressible",
           "compress", "decompress", "recompress", "slice_state", "store_slice", "quantize", "dequantize",
           "quantize_blocks", "dequantize_blocks", "table_on", "code_constants", "state_bytes", "update_error",
           "same_layout", "conform"]

#: elements per block sharing one float32 absmax (bitsandbytes' and torchao's block size)
BLOCK = 256
#: state keys that may be negative (a sign bit and 7 bits of log-magnitude) ...
SIGNED = ("exp_avg", "momentum_buffer")
#: ... and those that are not (8 bits of log-magnitude)
UNSIGNED = ("exp_avg_sq", "max_exp_avg_sq")
#: the optimizers whose state keys are known; another keeps float32 state
STOCK = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "SGD"))
#: codes per octave: signed 7 bits cover 2^-18, unsigned 8 bits 2^-25 below the block's absmax
_K_SIGNED, _K_UNSIGNED = 7.0, 10.0
_SUFFIX = ".absmax"


def compressible(optimizer: Any) -> bool:
    """Whether ``optimizer``'s state keys are known (the exact classes of :data:`STOCK`)."""
    return type(optimizer) in STOCK


#: elements per slice of the (de)quantization (and of the stochastic rounding): the temporaries of a large
#: tensor are this size, not the tensor's, and a slice is large enough that the passes, not their dispatch,
#: take the time; one slice per slice of the chunked step (:data:`fxamp.training.lean_step.PIECE`: 1 MiB of float32;
#: measured a few % faster than 256 KiB slices, which were 10% faster than 128 KiB); a multiple of :data:`BLOCK`
CHUNK = 1024 * BLOCK
#: the slice on an accelerator (64 MiB of float32): there each slice costs a few dozen kernel launches whatever its
#: size, and at :data:`CHUNK` GPT-2 small's lean step was 12x autocast's on an H200 (benchmarks/RESULTS.md)
ACCELERATOR_CHUNK = 2 ** 24


def chunk_for(device: torch.device) -> int:
    """Elements per slice of the (de)quantization and the stochastic rounding on ``device``."""
    return CHUNK if device.type == "cpu" else ACCELERATOR_CHUNK


def quantize(x: torch.Tensor, signed: bool, out: Optional[torch.Tensor] = None,
             absmax_out: Optional[torch.Tensor] = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """``x`` (float32) as 8-bit log codes per block of :data:`BLOCK` (int8 signed, uint8 unsigned) and the blocks'
    absmax; written into ``out`` (codes, ``x``'s number of elements) and ``absmax_out`` where given."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    nblocks = -(-n // BLOCK)
    codes = torch.empty(n, dtype=torch.int8 if signed else torch.uint8, device=x.device) if out is None else out
    absmax = torch.empty(nblocks, dtype=torch.float32, device=x.device) if absmax_out is None else absmax_out
    codes_flat = codes.view(-1)
    top, k = (127, _K_SIGNED) if signed else (255, _K_UNSIGNED)
    chunk = chunk_for(x.device)
    # (narrow, not t[a:b]: Python indexing of an accelerator's tensor wants its runtime, a fake one's too)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        part = _part(flat, start, m)
        full = m - m % BLOCK
        b0 = start // BLOCK
        if full:
            quantize_blocks(_part(part, 0, full).view(-1, BLOCK), signed, _part(codes_flat, start, full).view(-1, BLOCK),
                            _part(absmax, b0, full // BLOCK))
        if full < m:  # the last, partial block
            tail = part.narrow(0, full, m - full)
            q = tail.abs() if signed else tail
            amax = torch.amax(q, dim=0, keepdim=True, out=absmax.narrow(0, nblocks - 1, 1))
            q = _log2_magnitude(q, signed)
            _code_(q, amax, top, k, tail, signed)
            _store(codes_flat.narrow(0, start + full, m - full), _integral(q, signed))
    return codes.view(x.shape), absmax


def quantize_blocks(blocks: torch.Tensor, signed: bool, codes: torch.Tensor, absmax: torch.Tensor,
                    column: Optional[torch.Tensor] = None) -> None:
    """Whole blocks (``blocks``: float32, ``(n, BLOCK)``) coded as :func:`quantize` codes them, into ``codes`` (int8 or
    uint8, the same shape) and ``absmax`` (``(n,)``; ``column``: its ``(n, 1)`` view, where the caller keeps one: a
    flat's buffers are coded in one set of ops, their shaped views made once)."""
    top, k = (127, _K_SIGNED) if signed else (255, _K_UNSIGNED)
    q = blocks.abs() if signed else blocks  # (an unsigned state is non-negative: its own magnitude)
    torch.amax(q, dim=1, out=absmax)
    q = _log2_magnitude(q, signed)
    _code_(q, absmax.view(-1, 1) if column is None else column, top, k, blocks, signed)
    _store(codes, _integral(q, signed))


_TINY = torch.finfo(torch.float32).tiny
#: the smallest positive float32 (a subnormal): what a zero is raised to before its log2
_SMALLEST = 2.0 ** -149


def _log2_magnitude(q: torch.Tensor, owned: bool) -> torch.Tensor:
    """log2 of the magnitudes ``q`` (in place where ``owned``), a zero taken as the smallest subnormal.

    log2(0) is a slow path of the CPU kernel: 40x a normal value's (an Adam state with many zeros, such as an
    embedding's rows no batch touched, spent a quarter of the lean step there). The code is the same: -149 is
    below every block's range as -inf is (the range reaches 2^-25.5 under the block's absmax; an all-zero block's
    bias is -inf), except in a block whose absmax is under ~2^-123 (the bias takes it as at least 2^-126): there
    a zero takes a code above the lowest, which decodes to ~1e-45."""
    q = q.clamp_min_(_SMALLEST) if owned else q.clamp_min(_SMALLEST)
    return q.log2_()


def _code_(q: torch.Tensor, amax: torch.Tensor, top: int, k: float, x: torch.Tensor, signed: bool) -> None:
    """``q`` (log2 |x|) -> codes in place, as float: ``round(top + k log2(|x| / absmax))`` clamped, with ``x``'s
    sign; an unsigned code is at least 1.

    Computed as ``(top + 1/2 - k log2 absmax) + k log2 |x|``: the first term once per block, the rest one
    multiply-add over the elements (no division pass); the rounding is the truncation of the conversion to an
    integer type that follows (:func:`_integral`), of a value made non-negative by the clamp: a round half up,
    with no rounding pass."""
    bias = amax.clamp_min(_TINY).log2_().mul_(-k).add_(top + 0.5)  # (per block: a few hundred elements)
    bias.masked_fill_(amax == 0, -math.inf)  # an all-zero block: every element the lowest code
    torch.add(bias, q, alpha=k, out=q)  # (|x| = 0 was raised to 2^-149: below the range, clamped)
    if signed:  # code 0 (zero) below the range; times sign(x) is copysign(q, x) here (q >= 0), in two fast
        q.clamp_(0, top).mul_(torch.sign(x))  # passes instead of one slow one
    else:  # a second moment never decodes to zero (the update m / sqrt(v) of a small one would explode): at
        q.clamp_(1, top)  # least code 1, a zero too (its first moment is zero, so is its update; a zero block
        # has absmax 0 and decodes to zeros)


def _part(t: torch.Tensor, start: int, m: int) -> torch.Tensor:
    """Elements ``start`` to ``start + m`` of 1-D ``t``: ``t`` itself when that is all of it (a view less to make: on
    an accelerator each op the step dispatches costs about a launch's time on the host)."""
    return t if start == 0 and m == t.numel() else t.narrow(0, start, m)


def _store(codes: torch.Tensor, q: torch.Tensor) -> None:
    """``codes.copy_(q)``, converted to the codes' integer type in the copy; as a ``_foreach_copy_`` of one tensor
    (the same kernel), which a fake accelerator's tensor also runs (the step's op count in tests, on a CPU)."""
    torch._foreach_copy_([codes], [q])


def _integral(q: torch.Tensor, signed: bool) -> torch.Tensor:
    """Codes held as float (``code + fraction``, the sign applied after), ready to copy into int8/uint8, which
    truncates toward zero: the code; through int16 for uint8 on a CPU (float -> uint8 is a slow conversion there;
    elsewhere the copy converts them directly, the same truncation, an op less)."""
    return q if signed or q.device.type != "cpu" else q.to(torch.int16)


def _table(signed: bool, device: torch.device) -> torch.Tensor:
    """The 256 float32 values of the codes, indexed by the code's byte read as uint8 (code 0 is zero)."""
    top, k = (127, _K_SIGNED) if signed else (255, _K_UNSIGNED)
    mags = torch.arange(256, dtype=torch.float32, device=device)
    table = torch.exp2((mags - top) / k)
    table[0] = 0.0
    if signed:  # int8 codes -128..127, read through uint8 (two's complement): 128.. are negative
        table = torch.cat([table[:128], -torch.flip(table[1:129], [0])])
    return table


#: the tables of the unsigned and the signed code, on the CPU (built once: they are constants)
_TABLES = (_table(False, torch.device("cpu")), _table(True, torch.device("cpu")))


def code_constants() -> "tuple[tuple[torch.Tensor, torch.Tensor], tuple[float, float, float, float]]":
    """What a kernel needs to read and write these codes: the CPU tables ``(signed, unsigned)`` indexed by the
    code's byte, and ``(k_signed, top_signed, k_unsigned, top_unsigned)`` (:mod:`fxamp.training.native`)."""
    return (_TABLES[1], _TABLES[0]), (_K_SIGNED, 127.0, _K_UNSIGNED, 255.0)


@functools.lru_cache(maxsize=None)
def _table_on(signed: bool, device: torch.device) -> torch.Tensor:
    """:data:`_TABLES`' table on ``device``, copied there once (a copy per call would wait for the device)."""
    return _TABLES[signed].to(device)


def table_on(signed: bool, like: torch.Tensor) -> torch.Tensor:
    """The 256 float32 values of the codes (by the code's byte read as uint8) on ``like``'s device."""
    if like.device.type == "cpu":
        return _TABLES[signed]
    return _TABLES[signed].to(like.device) if isinstance(like, FakeTensor) else _table_on(signed, like.device)


def dequantize_blocks(codes: torch.Tensor, signed: bool, out: torch.Tensor, blocks: torch.Tensor,
                      column: torch.Tensor) -> None:
    """Whole blocks' codes (``codes``: 1-D, read as uint8) decoded as :func:`dequantize` decodes them into ``out``
    (float32, 1-D; ``blocks``: its ``(n, BLOCK)`` view), times the blocks' absmax (``column``: ``(n, 1)``)."""
    torch.index_select(table_on(signed, codes), 0, codes.to(torch.int32), out=out)
    blocks.mul_(column)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Float32 values of :func:`quantize`'s codes (code 0 is zero): a lookup in a 256-entry table, times the
    block's absmax; written into ``out`` (float32, ``codes``' number of elements) where given."""
    flat = codes.reshape(-1).view(torch.uint8)
    n = flat.numel()
    dst = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out.view(-1)
    table = table_on(signed, codes)
    chunk = chunk_for(codes.device)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        part = _part(dst, start, m)
        torch.index_select(table, 0, _part(flat, start, m).to(torch.int32), out=part)
        b0, full = start // BLOCK, m - m % BLOCK
        if full:
            _part(part, 0, full).view(-1, BLOCK).mul_(_part(absmax, b0, full // BLOCK).view(-1, 1))
        if full < m:
            part.narrow(0, full, m - full).mul_(absmax.narrow(0, b0 + full // BLOCK, 1))
    return dst.view(codes.shape) if out is None else out


def compress(state: Dict[str, Any], mode: str) -> None:
    """Replace ``state``'s float32 moment tensors by their ``mode`` form ("bf16" or "int8"), in place."""
    for key in SIGNED + UNSIGNED:
        value = state.get(key)
        if not torch.is_tensor(value) or value.dtype != torch.float32:
            continue
        if mode == "bf16":
            state[key] = value.to(torch.bfloat16)
        else:
            state[key], state[key + _SUFFIX] = quantize(value, key in SIGNED)


def decompress(state: Dict[str, Any]) -> None:
    """Undo :func:`compress`: float32 moments in ``state``, in place."""
    for key in SIGNED + UNSIGNED:
        value = state.get(key)
        if not torch.is_tensor(value):
            continue
        absmax: Optional[torch.Tensor] = state.pop(key + _SUFFIX, None)
        if absmax is not None:  # (codes cast to float by a loader that knew nothing of them: integers still)
            state[key] = dequantize(value.to(torch.int8 if key in SIGNED else torch.uint8), absmax.float(),
                                    key in SIGNED)
        elif value.dtype != torch.float32:
            state[key] = value.float()


def recompress(state: Dict[str, Any], mode: str) -> None:
    """After ``Optimizer.load_state_dict``, which casts state to the parameter's dtype (the codes too): back
    to ``mode``'s dtypes, exactly (the values were bfloat16 values, or integer codes, when saved)."""
    for key in SIGNED + UNSIGNED:
        value = state.get(key)
        if not torch.is_tensor(value):
            continue
        if key + _SUFFIX in state:
            state[key] = value.to(torch.int8 if key in SIGNED else torch.uint8)
            state[key + _SUFFIX] = state[key + _SUFFIX].float()
        elif mode == "bf16" and value.dtype != torch.bfloat16:
            state[key] = value.to(torch.bfloat16)


def state_bytes(mode: str, numel: int, keys: int) -> float:
    """Bytes per element of ``keys`` state tensors in ``mode``."""
    per = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}[mode]
    return per * keys if numel else 0.0


def update_error(state: Dict[str, Any], mode: str) -> float:
    """Relative L2 error of Adam's direction ``m / sqrt(v)`` (or SGD's momentum) after a round trip through ``mode``."""
    m = state.get("exp_avg", state.get("momentum_buffer"))
    if not torch.is_tensor(m) or m.dtype != torch.float32:
        return 0.0
    trip = {k: v for k, v in state.items() if k in SIGNED + UNSIGNED and torch.is_tensor(v)}
    compress(trip, mode)
    decompress(trip)
    v = state.get("exp_avg_sq")
    if torch.is_tensor(v) and v.dtype == torch.float32:
        exact = m / (v.sqrt() + 1e-8)
        approx = trip["exp_avg"] / (trip["exp_avg_sq"].sqrt() + 1e-8)
    else:
        exact, approx = m, trip.get("momentum_buffer", m)
    denom = float(torch.linalg.vector_norm(exact))
    return 0.0 if denom == 0 or not math.isfinite(denom) else float(torch.linalg.vector_norm(approx - exact)) / denom


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) hold their elements in the same memory order (size-1 dims aside)."""
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def conform(state: Dict[str, Any], like: torch.Tensor, row_major: bool = False) -> None:
    """Lay out ``state``'s floating-point per-element tensors as ``like`` (row-major with ``row_major``), in place.

    torch's fused CPU Adam and fxamp's kernel read a parameter, its gradient and its moments as flat arrays in
    memory order, so they must share one order: a channels_last moment beside a row-major value is read
    permuted, silently (torch 2.13).  Moments made by the optimizer follow the value they were made from; those
    decoded here (:func:`dequantize`: row-major, the 8-bit blocks' order) or loaded may not.  The 8-bit codes are
    row-major by construction and left alone."""
    for key, value in state.items():
        if not (torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0 and value.shape == like.shape
                and not key.endswith(_SUFFIX)):
            continue
        if row_major:
            if not value.is_contiguous():
                state[key] = value.contiguous()
        elif not same_layout(value, like):
            state[key] = torch.empty_like(like, dtype=value.dtype).copy_(value)


def slice_state(state: Dict[str, Any], sl: slice, n: int,
                buffers: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """The float32 state of elements ``sl`` of a tensor of ``n`` elements whose state is ``state`` (compressed
    or not): moments decompressed for the slice only (``sl`` starts at a multiple of :data:`BLOCK`); into
    ``buffers[key]`` where given (allocated at the first, largest slice and reused by the next ones)."""
    out: Dict[str, Any] = {}
    buffers = {} if buffers is None else buffers
    for key, value in state.items():
        if key.endswith(_SUFFIX):
            continue
        if not torch.is_tensor(value) or value.dim() == 0 or value.numel() != n:
            out[key] = value.clone() if torch.is_tensor(value) else value  # ("step": each slice steps its own copy)
            continue
        part = value.reshape(-1)[sl]
        if part.dtype == torch.float32:
            out[key] = part  # (float32 state: stepped where it is)
            continue
        if key not in buffers:
            buffers[key] = torch.empty(part.numel(), dtype=torch.float32, device=part.device)
        dst = buffers[key][:part.numel()]
        absmax = state.get(key + _SUFFIX)
        if absmax is not None:
            blocks = absmax[sl.start // BLOCK:(sl.start + part.numel() - 1) // BLOCK + 1]
            out[key] = dequantize(part.to(torch.int8 if key in SIGNED else torch.uint8), blocks.float(), key in SIGNED,
                                  out=dst)
        else:
            out[key] = dst.copy_(part)
    return out


def store_slice(full: Dict[str, Any], piece: Dict[str, Any], sl: slice, n: int, shape: torch.Size, mode: str) -> None:
    """Write a slice's stepped float32 state ``piece`` into ``full`` in ``mode``: into its tensors where they have
    the mode's dtype and shape (the old state, each slice read before it is written), else into new ones."""
    for key, value in piece.items():
        if not torch.is_tensor(value) or value.dim() == 0 or value.numel() != min(sl.stop, n) - sl.start:
            full[key] = value  # ("step": the last slice's, the same in every slice)
            continue
        compressed = mode != "fp32" and key in SIGNED + UNSIGNED
        dtype = value.dtype if not compressed else torch.bfloat16 if mode == "bf16" else \
            torch.int8 if key in SIGNED else torch.uint8
        if key not in full or full[key].dtype != dtype or full[key].shape != shape:  # (else: written in place)
            full[key] = torch.empty(shape, dtype=dtype, device=value.device)
        if compressed and mode == "int8" and (key + _SUFFIX not in full or full[key + _SUFFIX].numel() != -(-n // BLOCK)):
            full[key + _SUFFIX] = torch.empty(-(-n // BLOCK), dtype=torch.float32, device=value.device)
        dst = full[key].view(-1)[sl]
        if compressed and mode == "int8":
            b0 = sl.start // BLOCK
            quantize(value, key in SIGNED, out=dst, absmax_out=full[key + _SUFFIX][b0:b0 + -(-dst.numel() // BLOCK)])
        else:
            dst.copy_(value.view(-1))
