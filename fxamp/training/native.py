"""The lean step's CPU kernel (``lean_kernel.c``): built once per machine with the system's C compiler, loaded
with ctypes, and called on tensors' data pointers.

Why a kernel of our own: a lean master with 8-bit state costs, in eager PyTorch, a dozen passes over each
element (decode, the update, re-code, stochastic rounding), about 4x pure bfloat16's AdamW step on a CPU;
``torch.compile`` of the same function ran slower than eager there (benchmarks/RESULTS.md). One pass in C,
vectorized by the compiler, is about as fast as the bfloat16 step itself. It also codes the 8-bit state of a run's
float32 masters (:func:`decode`, :func:`encode_magnitudes`, :func:`encode_codes`: bitwise the eager code, with no op
dispatched but one log2), so such a step's ops stay as few as with float32 state.

Where no C compiler works (or ``FXAMP_NATIVE=0``), :func:`kernel` is None and the eager path steps every
master, with a note (:func:`unavailable_reason`). The library is cached under ``$FXAMP_CACHE`` (default
``~/.cache/fxamp``; the temporary directory where that cannot be written), keyed by the source, the flags and
the CPU's feature flags (``-march=native`` code runs only where it was built for).
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from . import quant

__all__ = ["build", "kernel", "unavailable_reason", "lean_adam", "round_stochastic_", "decode", "encode_magnitudes",
           "encode_codes", "all_finite", "eligible", "hyperparameters", "adam_step"]

_SOURCE = Path(__file__).with_name("lean_kernel.c")
#: every operation one IEEE float32 operation (no fused multiply-add contraction, no fast-math; the libm calls,
#: sqrtf and fmaf, correctly rounded) and a table lookup reads the same entry however it is done: the same bits on every
#: x86 CPU, whatever vector width and instructions ``-march`` lets the compiler use (tests/training/test_native.py
#: compares a baseline x86-64 build with this CPU's)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
#: OpenMP, where torch's CPU build uses it: the kernel's blocks then run on torch's own OpenMP threads (the
#: libgomp torch loaded: the same soname); without it (another parallel backend, or a compiler without
#: OpenMP) the kernel runs on one thread
_OPENMP = ["-fopenmp"]
#: the kernel's functions, by the optimizer state's mode
_SYMBOLS = {"int8": "fxamp_lean_adam_int8", "bf16": "fxamp_lean_adam_bf16"}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return sys.platform


def _torch_uses_openmp() -> bool:
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def _cache_dirs() -> "list[Path]":
    """Where the library may be built: ``$FXAMP_CACHE`` or ``~/.cache/fxamp``, then the temporary directory."""
    first = Path(os.environ.get("FXAMP_CACHE") or Path.home() / ".cache" / "fxamp")
    return [first, Path(tempfile.gettempdir()) / f"fxamp-{os.getuid() if hasattr(os, 'getuid') else 'user'}"]


def build(arch: str = "native") -> Any:
    """Build (or find in the cache) and load the kernel now, as the environment says (``CC``, ``FXAMP_CACHE``,
    ``FXAMP_NATIVE``), without the once-per-process memo of :func:`kernel`: its ctypes functions by state mode,
    or a string saying why there are none. An image can call it ahead, to fill the cache. ``arch``: the
    compiler's ``-march`` (:func:`kernel` builds for this CPU, ``"native"``; ``"x86-64"`` runs on any x86-64 CPU,
    with the same bits, slower)."""
    if os.environ.get("FXAMP_NATIVE", "1") == "0":
        return "FXAMP_NATIVE=0"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    source = _SOURCE.read_bytes()
    flags = [*_FLAGS, f"-march={arch}"]
    key = hashlib.sha256(source + " ".join([compiler, *flags, *_OPENMP, str(_torch_uses_openmp())]).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    target, error = None, ""
    for folder in _cache_dirs():
        target = folder / f"lean_kernel-{key}.so"
        if target.exists():
            break
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # built beside the target and renamed into place: a concurrent process never loads a half-written file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            run = None
            for extra in ([_OPENMP, []] if _torch_uses_openmp() else [[]]):
                run = subprocess.run([compiler, *flags, *extra, str(_SOURCE), "-o", tmp, "-lm"],
                                     capture_output=True, text=True, timeout=120)
                if run.returncode == 0:
                    break
            if run.returncode != 0:
                os.unlink(tmp)
                last = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit status {run.returncode}"
                return f"{compiler} failed: {last}"
            os.replace(tmp, target)
            break
        except (OSError, subprocess.SubprocessError) as e:  # (an unwritable cache: the next folder)
            error = f"could not build the kernel: {e}"
    else:
        return error
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return f"could not load {target}: {e}"
    p = ctypes.c_void_p
    f = ctypes.c_float
    fns = {}
    for mode, symbol in _SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = [ctypes.c_int64, p, p, p, f, p, p, p, p, ctypes.c_uint64, ctypes.c_int64, p, p, f, f, f, f, f,
                       ctypes.c_int, f, f, f, f, f, f, f, ctypes.c_int]
        fn.restype = None
        fns[mode] = fn
    fn = lib.fxamp_round_stochastic
    fn.argtypes = [ctypes.c_int64, p, p, p, p]
    fn.restype = None
    fns["round"] = fn
    i64, ptrs = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_size_t)
    for name, argtypes in (("decode", [ctypes.c_int64, i64, i64, ptrs, ptrs, p, p]),
                           ("encode_magnitudes", [ctypes.c_int64, i64, i64, i64, p, ptrs, ptrs, ctypes.c_int, p]),
                           ("encode_codes", [ctypes.c_int64, i64, i64, i64, p, p, ptrs, ptrs, ctypes.c_int, f, f])):
        fn = getattr(lib, "fxamp_" + name)
        fn.argtypes = argtypes
        fn.restype = None
        fns[name] = fn
    fn = lib.fxamp_all_finite
    fn.argtypes = [ctypes.c_int64, i64, ptrs, ctypes.c_int, ctypes.c_uint32]
    fn.restype = ctypes.c_int
    fns["all_finite"] = fn
    return fns


@functools.lru_cache(maxsize=None)
def _loaded() -> Any:
    return build()


def _state() -> Any:
    # FXAMP_NATIVE=0 is read at each call, the build once per process: a run (a reference run of the eager path, a
    # test) switches the kernel off and on again without a new process; an optimizer built meanwhile steps eagerly
    return "FXAMP_NATIVE=0" if os.environ.get("FXAMP_NATIVE", "1") == "0" else _loaded()


def kernel() -> Optional[Dict[str, Any]]:
    """The kernel's ctypes functions by state mode (``"int8"``, ``"bf16"``), or None where it cannot be built
    here or ``FXAMP_NATIVE=0`` (:func:`unavailable_reason`)."""
    fn = _state()
    return None if isinstance(fn, str) else fn


def unavailable_reason() -> Optional[str]:
    """Why :func:`kernel` is None (None when it is there)."""
    fn = _state()
    return fn if isinstance(fn, str) else None


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def lean_adam(low: torch.Tensor, term: Optional[torch.Tensor], grad: torch.Tensor, m: torch.Tensor,
              m_absmax: Optional[torch.Tensor], v: torch.Tensor, v_absmax: Optional[torch.Tensor], key: Optional[int],
              tables: "tuple[torch.Tensor, torch.Tensor]", *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, decoupled: bool, step: float, codes: "tuple[float, float, float, float]",
              base: int = 0, grad_mul: float = 1.0) -> None:
    """One Adam (``decoupled``: AdamW) step of ``low`` (bfloat16, contiguous CPU) from ``grad`` (float32, or
    bfloat16: widened in the kernel) times ``grad_mul`` (1/scale: a float32 multiply, as the engine's unscale), its
    moments ``m`` and ``v`` updated in place: 8-bit codes (int8, uint8) with per-block absmax, or bfloat16 (the
    absmax None).  The weight is kept with Kahan's ``term``, or (``term`` None) rounded stochastically with noise
    hashed from ``key`` and the element's index (``base``: the index of ``low``'s first element in its tensor).
    ``step``: the step count after this step; ``tables`` and ``codes``: :func:`fxamp.training.quant.code_constants`."""
    fns = kernel()
    if fns is None:
        raise RuntimeError(f"the lean CPU kernel is not available: {unavailable_reason()}")
    int8 = m.dtype == torch.int8 and v.dtype == torch.uint8 and m_absmax is not None and v_absmax is not None \
        and m_absmax.dtype == v_absmax.dtype == torch.float32
    bf16 = m.dtype == v.dtype == torch.bfloat16 and m_absmax is None and v_absmax is None
    if not (int8 or bf16) or low.dtype != torch.bfloat16 or grad.dtype not in (torch.float32, torch.bfloat16) \
            or (term is not None and term.dtype != torch.bfloat16):
        raise TypeError("lean_adam takes bfloat16 weights and term, a float32 or bfloat16 gradient, and int8 and "
                        "uint8 codes with float32 absmax, or bfloat16 moments without")
    if (term is None) == (key is None):
        raise ValueError("lean_adam takes a Kahan term or a stochastic rounding key, one of them")
    for t in (low, term, grad, m, m_absmax, v, v_absmax):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError("lean_adam takes contiguous CPU tensors")
    n = low.numel()
    blocks = -(-n // 256)
    if not (grad.numel() == m.numel() == v.numel() == n) or (term is not None and term.numel() != n) \
            or (int8 and (m_absmax.numel() != blocks or v_absmax.numel() != blocks)):
        raise ValueError("lean_adam: tensors of mismatched sizes")
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = (1.0 - beta2 ** step) ** 0.5
    fns["int8" if int8 else "bf16"](
       n, _ptr(low), _ptr(term), _ptr(grad), grad_mul, _ptr(m), _ptr(m_absmax), _ptr(v), _ptr(v_absmax),
       (key or 0) % 2 ** 64, base, _ptr(tables[0]), _ptr(tables[1]), beta2, 1.0 - beta1, 1.0 - beta2, eps,
       weight_decay, int(decoupled), 1.0 - lr * weight_decay, lr / bc1, bc2_sqrt, *codes,
       int(grad.dtype == torch.bfloat16))


def round_stochastic_(x: torch.Tensor, segments: "list[tuple[int, int, int]]") -> bool:
    """:func:`fxamp.training.flat.round_stochastic_` by the kernel (``x``: a contiguous float32 CPU tensor; the same
    bits, in one pass, no op dispatched): False, doing nothing, where the kernel is not here."""
    fns = kernel()
    if fns is None:
        return False
    k = len(segments)
    counts, keys, firsts = ((ctypes.c_int64 * k)(*[s[0] for s in segments]),
                            (ctypes.c_uint64 * k)(*[s[1] % 2 ** 64 for s in segments]),
                            (ctypes.c_int64 * k)(*[s[2] for s in segments]))
    fns["round"](k, x.data_ptr(), counts, keys, firsts)
    return True


def _array(kind: Any, values: "list[int]") -> Any:
    """``values`` as a ctypes array of ``kind`` (c_int64 or c_size_t), filled from an ``array.array`` in one copy (4x
    faster than the ctypes constructor's per-element conversion at 200 values)."""
    return (kind * len(values)).from_buffer(array.array("q" if kind is ctypes.c_int64 else "Q", values))


def decode(codes: "list[torch.Tensor]", absmax: "list[torch.Tensor]", table: torch.Tensor, out: torch.Tensor,
           offsets: "list[int]") -> None:
    """8-bit codes (each master's own int8/uint8 tensor, contiguous) and their block scales into float32 ``out`` (1-D,
    contiguous) at ``offsets``: ``table[code] * absmax``, bitwise :func:`fxamp.training.quant.dequantize`'s."""
    fns = kernel()
    assert fns is not None and table.is_contiguous() and table.dtype == out.dtype == torch.float32
    fns["decode"](len(codes), _array(ctypes.c_int64, [c.numel() for c in codes]), _array(ctypes.c_int64, offsets),
                  _array(ctypes.c_size_t, [c.data_ptr() for c in codes]),
                  _array(ctypes.c_size_t, [a.data_ptr() for a in absmax]), table.data_ptr(), out.data_ptr())


def encode_magnitudes(x: torch.Tensor, offsets: "list[int]", absmax: "list[torch.Tensor]", codes: "list[torch.Tensor]",
                      signed: bool, blocks: torch.Tensor, block_offsets: "list[int]") -> None:
    """The first pass of coding the float32 values of ``x`` (1-D, contiguous) at ``offsets`` into 8 bits, in place:
    each block's absmax into ``absmax`` (each master's own float32 tensor; ``codes``: its codes, holding the signs
    meanwhile), then what torch's ``log2_`` takes before :func:`encode_codes`: the magnitudes over ``x`` and the
    absmax into ``blocks`` at ``block_offsets``, raised as :func:`fxamp.training.quant.quantize` raises them."""
    fns = kernel()
    assert fns is not None and x.dtype == blocks.dtype == torch.float32 and x.is_contiguous() and blocks.is_contiguous()
    fns["encode_magnitudes"](len(codes), _array(ctypes.c_int64, [c.numel() for c in codes]),
                             _array(ctypes.c_int64, offsets), _array(ctypes.c_int64, block_offsets), x.data_ptr(),
                             _array(ctypes.c_size_t, [a.data_ptr() for a in absmax]),
                             _array(ctypes.c_size_t, [c.data_ptr() for c in codes]), int(signed), blocks.data_ptr())


def encode_codes(x: torch.Tensor, offsets: "list[int]", absmax: "list[torch.Tensor]", codes: "list[torch.Tensor]",
                 signed: bool, blocks: torch.Tensor, block_offsets: "list[int]", k: float, top: float) -> None:
    """The second pass, from the log2 of :func:`encode_magnitudes`' ``x`` and ``blocks``: each master's codes into
    ``codes``, bitwise :func:`fxamp.training.quant.quantize`'s (``k``, ``top``: the code's constants)."""
    fns = kernel()
    assert fns is not None
    fns["encode_codes"](len(codes), _array(ctypes.c_int64, [c.numel() for c in codes]), _array(ctypes.c_int64, offsets),
                        _array(ctypes.c_int64, block_offsets), x.data_ptr(), blocks.data_ptr(),
                        _array(ctypes.c_size_t, [a.data_ptr() for a in absmax]),
                        _array(ctypes.c_size_t, [c.data_ptr() for c in codes]), int(signed), k, top)


#: per dtype :func:`all_finite` reads: its bits, and an infinity's (the smallest non-finite magnitude)
_EXPONENT = {torch.float32: (32, 0x7F800000), torch.bfloat16: (16, 0x7F80), torch.float16: (16, 0x7C00)}


def all_finite(tensors: "list[torch.Tensor]") -> Optional[bool]:
    """Whether every element of ``tensors`` is finite, read by one kernel call (no op dispatched, no copy, nothing
    written); None where the kernel cannot read them (no kernel here; a tensor not a plain contiguous CPU one of
    one float32/bfloat16/float16 dtype)."""
    fns = kernel()
    kind = _EXPONENT.get(tensors[0].dtype) if tensors else None
    if fns is None or kind is None or not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
                                              and t.dtype == tensors[0].dtype and t.is_contiguous() for t in tensors):
        return None
    return bool(fns["all_finite"](len(tensors), _array(ctypes.c_int64, [t.numel() for t in tensors]),
                                  _array(ctypes.c_size_t, [t.data_ptr() for t in tensors]), *kind))


def eligible(optimizer: Any, group: Dict[str, Any], low: torch.Tensor, state: Dict[str, Any], mode: str) -> bool:
    """Whether the kernel can step ``low``'s lean master under ``group``, its state in ``mode`` (``"int8"`` or
    ``"bf16"``): a stock Adam/AdamW without amsgrad, maximize, differentiable or capturable; a bfloat16 CPU
    weight (of any strides: :func:`adam_step`; a plain tensor, not a subclass: the caller's check,
    ``executors.plain``); its state already made (the first step, which makes it, is the
    eager path's); the kernel built here."""
    made = (all(k in state for k in ("exp_avg.absmax", "exp_avg_sq.absmax")) if mode == "int8" else
            mode == "bf16" and not any(k.endswith(".absmax") for k in state))
    return (made and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and low.dtype == torch.bfloat16
            and low.device.type == "cpu"
            and all(torch.is_tensor(state.get(k)) for k in ("step", "exp_avg", "exp_avg_sq"))
            and not any(group.get(k) for k in ("amsgrad", "maximize", "differentiable", "capturable"))
            and getattr(optimizer, "found_inf", None) is None and kernel() is not None)


def hyperparameters(optimizer: Any, group: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`adam_step`'s hyperparameters of ``group`` (read once per group and step: a tensor lr is a host read)."""
    beta1, beta2 = (float(b) for b in group["betas"])
    return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)))


def adam_step(state: Dict[str, Any], low: torch.Tensor, term: Optional[torch.Tensor], grad: torch.Tensor,
              key: Optional[int], mode: str, hyper: Dict[str, Any], step: float, grad_mul: float = 1.0) -> None:
    """Step ``low`` with the kernel from ``grad`` (float32 or bfloat16, row-major) times ``grad_mul`` and
    ``state`` (``mode``: "int8" or "bf16"; updated in place but for ``state["step"]``, which the caller
    advances); ``hyper``: :func:`hyperparameters`; ``step``: the count after this step; ``key``: the stochastic
    rounding's (None with a Kahan ``term``).  Every tensor in row-major order (an element's index, which the
    stochastic rounding's noise is hashed from, is its row-major one): a weight with other strides (channels_last,
    a transpose) is stepped in a row-major copy, copied back after.  No view is made (the kernel takes pointers):
    a step of many masters dispatches nothing per master."""
    quant.recompress(state, mode)  # (a loader may have cast the state to the parameter's dtype: exact values)
    quant.conform(state, low, row_major=True)
    absmax = (lambda k: state[k + ".absmax"]) if mode == "int8" else (lambda k: None)
    tables, codes = quant.code_constants()
    weight = low if low.is_contiguous() else low.contiguous()
    lean_adam(weight, term, grad, state["exp_avg"], absmax("exp_avg"), state["exp_avg_sq"], absmax("exp_avg_sq"),
              key, tables, step=step, codes=codes, grad_mul=grad_mul, **hyper)
    if weight is not low:
        low.copy_(weight)
