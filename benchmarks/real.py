"""Real-size suite: a GPT-2-small-width decoder, a BERT-base-width encoder and a ResNet-50.

For each model: a training step (AdamW) and an inference forward, in these variants

  fp32            float32 eager
  autocast        ``torch.autocast(device, dtype)`` around the forward (+ ``GradScaler`` for float16)
  pure bf16       ``model.to(dtype)`` with a plain AdamW: no casts at all (the no-cast limit, ``vs_limit``;
                  "pure fp16" under float16, unscaled: a timing limit, not a way to train)
  fxamp O1        ``fxamp.convert(m, "O1")`` (float32 parameters, plain AdamW; + MixedPrecisionOptimizer
                  for its loss scaling under float16)
  fxamp O2        ``fxamp.convert(m, "O2")`` + ``fxamp.MixedPrecisionOptimizer`` (float32 masters)
  fxamp O2 (compiled step)  the same with ``compile_step=True`` (training rows only: the masters are
                  stepped by one compiled kernel that reads the bfloat16 gradient and writes the
                  bfloat16 weight, :mod:`fxamp.training.kernels`)
  compile(...)    ``torch.compile`` of the autocast model and of the O2 module (``--compile`` only;
                  training rows of the decoder and the ResNet: a cold compile takes a minute here);
                  the O2 one steps with ``compile_step=True`` (who compiles the model compiles the
                  step too; autocast's fused AdamW is already one kernel over float32 tensors)

and the peak memory of one training step per variant (``peak_mib``): the bytes of every live tensor
storage after ``zero_grad(set_to_none=True)`` (parameters, buffers, optimizer state, master weights,
caches: found by scanning the garbage collector's objects, as the difference to before the variant
was built) plus the highest total of bytes allocated during the step (forward, backward, optimizer
step) as the CPU allocator reports it to ``torch.profiler`` (``profile_memory=True``).

The encoder is inference only, converted twice: as a user would (``fxamp.convert(m, policy)``: the
fx front end writes each ``nn.TransformerEncoderLayer`` out and runs its ``nn.MultiheadAttention``
as a module, which in eval under ``no_grad`` takes PyTorch's fused attention kernel), and with
``frontend="export"`` (torch.export decomposes the attention into projections and
``scaled_dot_product_attention``: on CPU its flash kernel, 2.4x slower than the fused path's
matmul-softmax-matmul at 128 tokens on a Zen 5 core, but with float32 scores).
"""

from __future__ import annotations

import copy
import gc
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from benchmarks.models import DecoderLM, Encoder, ResNet50

FP32, AUTOCAST, LIMIT, O1, O2 = "fp32", "autocast", "pure bf16", "fxamp O1", "fxamp O2"
C_AUTOCAST, C_O2 = "compile(autocast)", "compile(fxamp O2)"
#: diagnostics for profile_real (not in the suite): O2 with the plain, unsegmented optimizer step
O2_PLAIN = "fxamp O2 (plain step)"
O2_COMPILED_STEP = "fxamp O2 (compiled step)"
#: diagnostics for profile_real: O2 with lean masters and state chosen per tensor (masters="auto", state="auto",
#: calibrated in the first 2 steps, which profile_real's warm-up steps take), or fixed ones
O2_LEAN = "fxamp O2 (lean auto)"
O2_LEAN_MODES = {O2_LEAN: ("auto", "auto"), "fxamp O2 (lean stochastic+int8)": ("stochastic", "int8"),
                 "fxamp O2 (lean kahan+bf16)": ("kahan", "bf16")}
VARIANTS = (FP32, AUTOCAST, LIMIT, O1, O2)
#: the training rows (step time and peak memory) add the compiled master step
TRAIN_VARIANTS = VARIANTS + (O2_COMPILED_STEP,)


# --------------------------------------------------------------------------------------------
# cases


class Case:
    def __init__(self, name: str, build: Callable[[], nn.Module], make_x: Callable[[], torch.Tensor],
                 make_y: Callable[[], torch.Tensor], train: bool, export: bool, compile_train: bool):
        self.name, self.build, self.make_x, self.make_y = name, build, make_x, make_y
        self.train, self.export, self.compile_train = train, export, compile_train


def cases(size: str, device: torch.device = torch.device("cpu")) -> List[Case]:
    """The suite's models and inputs on ``device``: ``tiny`` (smoke tests), ``real`` (on CUDA, the full
    GPT-2 small, ResNet-50 at 224 px and BERT-base; on a 2-core CPU, narrower depths and inputs)."""
    if size == "tiny":
        v, seq, d, layers, heads, b = 64, 16, 32, 1, 4, 2
        rb, px, width, blocks, classes = 2, 32, 4, (1, 1, 1, 1), 10
        ed, eh, eff, el, eb, es = 32, 4, 64, 1, 2, 16
    elif device.type == "cuda":  # full size: GPT-2 small (124 M), ResNet-50, BERT-base
        v, seq, d, layers, heads, b = 50257, 1024, 768, 12, 12, 8
        rb, px, width, blocks, classes = 64, 224, 64, (3, 4, 6, 3), 1000
        ed, eh, eff, el, eb, es = 768, 12, 3072, 12, 16, 512
    else:
        v, seq, d, layers, heads, b = 8192, 128, 768, 2, 12, 2
        rb, px, width, blocks, classes = 4, 64, 64, (3, 4, 6, 3), 1000
        ed, eh, eff, el, eb, es = 768, 12, 3072, 2, 2, 128
    dev = device
    return [
        Case(f"GPT d{d} h{heads} L{layers} vocab{v} b{b} s{seq}",
             lambda: DecoderLM(vocab=v, seq=seq, d=d, layers=layers, heads=heads).to(dev),
             lambda: torch.randint(0, v, (b, seq), device=dev), lambda: torch.randint(0, v, (b, seq), device=dev),
             train=True, export=False, compile_train=True),
        Case(f"ResNet-50{'' if size != 'tiny' else ' layout (tiny)'} b{rb} {px}px",
             lambda: ResNet50(classes=classes, width=width, blocks=blocks).to(dev),
             lambda: torch.randn(rb, 3, px, px, device=dev), lambda: torch.randint(0, classes, (rb,), device=dev),
             train=True, export=False, compile_train=True),
    ] + [  # the encoder as converted by default, then with frontend="export"
        Case(f"BERT-width encoder d{ed} h{eh} L{el} b{eb} s{es}" + (" (export)" if export else ""),
             lambda: Encoder(d=ed, heads=eh, ff=eff, layers=el).to(dev),
             lambda: torch.randn(eb, es, ed, device=dev), lambda: torch.zeros(0, device=dev),
             train=False, export=export, compile_train=False)
        for export in (False, True)
    ]


def gpt_math_case(size: str, device: torch.device) -> Case:
    """The throughput benchmark's GPT-2 small (attention written out, dropout 0.1) as a case (profiling)."""
    from benchmarks.models import GPT

    v, seq, d, layers, heads, b = (64, 16, 32, 1, 4, 2) if size == "tiny" else (50257, 1024, 768, 12, 12, 8)
    return Case(f"GPT-2 math attention d{d} L{layers} b{b} s{seq}",
                lambda: GPT(vocab=v, seq=seq, d=d, layers=layers, heads=heads).to(device),
                lambda: torch.randint(0, v, (b, seq), device=device),
                lambda: torch.randint(0, v, (b, seq), device=device),
                train=True, export=False, compile_train=False)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, -2), y.flatten())


def _fused_adamw_works(device: str = "cpu") -> bool:
    """Whether ``AdamW(fused=True)`` steps float32 and low-precision parameters on ``device`` here
    (CPU: it does in torch 2.13; CUDA: since torch 2.0)."""
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            p = nn.Parameter(torch.zeros(4, dtype=dtype, device=device))
            p.grad = torch.ones(4, dtype=dtype)
            torch.optim.AdamW([p], lr=1e-4, fused=True).step()
        return True
    except (RuntimeError, ValueError, TypeError):  # pragma: no cover
        return False


#: the fastest AdamW implementation available, the same for every variant (a fair comparison):
#: fused (one kernel per step; on this CPU 5x faster than foreach at 22 M parameters), else foreach
ADAMW_KWARGS: Dict[str, bool] = {"fused": True} if _fused_adamw_works() else {"foreach": True}
ADAMW_DESC = "AdamW(" + ", ".join(f"{k}={v}" for k, v in ADAMW_KWARGS.items()) + ")"


def _adamw(params, kwargs: Optional[Dict[str, bool]] = None) -> torch.optim.Optimizer:
    params = list(params)
    if kwargs is None:
        kwargs = ADAMW_KWARGS
        if params and params[0].device.type == "cuda":
            kwargs = {"fused": True}  # CUDA has had fused AdamW for every floating dtype since torch 2.0
    return torch.optim.AdamW(params, lr=1e-4, **kwargs)


def adamw_desc(device: torch.device) -> str:
    return "AdamW(fused=True)" if device.type == "cuda" else ADAMW_DESC


def limit_name(dtype: torch.dtype) -> str:
    """The pure-low-precision variant's row name: "pure bf16" or "pure fp16"."""
    return "pure fp16" if dtype == torch.float16 else LIMIT


def _convert(base: nn.Module, policy: str, dtype: torch.dtype, case: Case, x: torch.Tensor) -> nn.Module:
    kw = dict(example_inputs=(x,), frontend="export") if case.export else {}
    return fxamp.convert(copy.deepcopy(base), policy, dtype=dtype, **kw)


# --------------------------------------------------------------------------------------------
# one variant: (step or forward, the objects it owns)


def train_step(variant: str, base: nn.Module, case: Case, x, y, dtype,
               adamw: Optional[Dict[str, bool]] = None) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(one training step, zero_grad) for a variant, on its own copy of ``base`` (in train mode);
    ``adamw``: AdamW's implementation flags (default: the fastest, :data:`ADAMW_KWARGS`, fused on CUDA)."""
    device_type = x.device.type
    if variant in (FP32, AUTOCAST, C_AUTOCAST):
        m = copy.deepcopy(base).train()
        opt = _adamw(m.parameters(), adamw)
        fwd = torch.compile(m) if variant == C_AUTOCAST else m
        use_ac = variant != FP32
        if use_ac and dtype == torch.float16:  # float16 needs loss scaling: autocast's is GradScaler
            scaler = torch.amp.GradScaler(device_type)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device_type, dtype=dtype):
                    out = fwd(x)
                scaler.scale(_loss(out, y)).backward()
                scaler.step(opt)
                scaler.update()

            return step, lambda: opt.zero_grad(set_to_none=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype, enabled=use_ac):
                out = fwd(x)
            _loss(out, y).backward()
            opt.step()

        return step, lambda: opt.zero_grad(set_to_none=True)
    if variant == LIMIT:
        m = copy.deepcopy(base).train().to(dtype)
        opt = _adamw(m.parameters(), adamw)
        xl = x.to(dtype) if x.is_floating_point() else x

        def step():
            opt.zero_grad(set_to_none=True)
            _loss(m(xl), y).backward()
            opt.step()

        return step, lambda: opt.zero_grad(set_to_none=True)
    if variant == O1:
        g = _convert(base, "O1", dtype, case, x).train()
        if dtype == torch.float16:  # float16 needs loss scaling: fxamp's is the optimizer wrapper
            w1 = fxamp.MixedPrecisionOptimizer(_adamw(g.parameters(), adamw), model=g)

            def step():
                w1.zero_grad(set_to_none=True)
                w1.backward(_loss(g(x), y))
                w1.step()

            return step, lambda: w1.zero_grad(set_to_none=True)
        opt = _adamw(g.parameters(), adamw)

        def step():
            opt.zero_grad(set_to_none=True)
            _loss(g(x), y).backward()
            opt.step()

        return step, lambda: opt.zero_grad(set_to_none=True)
    if variant in (O2, C_O2, O2_PLAIN, O2_COMPILED_STEP) or variant in O2_LEAN_MODES:
        g = _convert(base, "O2", dtype, case, x).train()
        lean = {}
        if variant in O2_LEAN_MODES:
            lean = {"precision": fxamp.LeanConfig(*O2_LEAN_MODES[variant], calibration_steps=2)}
        w = fxamp.MixedPrecisionOptimizer(_adamw(g.parameters(), adamw), model=g, release_grad_buffer=variant != O2_PLAIN,
                                          compile_step=variant in (O2_COMPILED_STEP, C_O2), **lean)
        fwd = torch.compile(g) if variant == C_O2 else g

        def step():
            w.zero_grad(set_to_none=True)
            w.backward(_loss(fwd(x), y))
            w.step()

        step.optimizer = w  # (the note says when compile_step's kernels are not used)
        return step, lambda: w.zero_grad(set_to_none=True)
    raise ValueError(variant)


def forward(variant: str, base: nn.Module, case: Case, x, dtype) -> Callable[[], torch.Tensor]:
    """A no-grad, eval-mode forward returning float32, for a variant."""
    if variant in (FP32, AUTOCAST):
        m = copy.deepcopy(base).eval()
        use_ac = variant == AUTOCAST

        def f():
            with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=use_ac):
                return m(x).float()

        return f
    if variant == LIMIT:
        m = copy.deepcopy(base).eval().to(dtype)

        def f():
            with torch.no_grad():
                return m(x.to(dtype) if x.is_floating_point() else x).float()

        return f
    if variant in (O1, O2):
        g = _convert(base.eval(), variant[-2:], dtype, case, x)
        if not case.export:
            g.eval()

        def f():
            with torch.no_grad():
                return g(x).float()

        return f
    raise ValueError(variant)


# --------------------------------------------------------------------------------------------
# memory


def live_storage_bytes() -> int:
    """Bytes of the unique CPU storages of every tensor the garbage collector can see."""
    seen, total = set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # type(): no __class__ lookups
            try:  # fake/functional tensors left over from torch.compile have no data
                st = o.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += st.nbytes()
    return total


def step_peak_bytes(fn: Callable[[], Any]) -> int:
    """Highest total of bytes allocated and not yet freed while ``fn`` runs.

    From the CPU allocator's reports to ``torch.profiler`` (``profile_memory=True``): a running sum of
    this session's allocations, less the frees of blocks allocated in it (matched by address).  The
    reports' own ``total_allocated`` is not used: it carries over blocks from earlier profiling
    sessions.  A block allocated before ``fn`` and freed inside it is not subtracted (overcounts,
    never undercounts).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        stack.extend(e.children)
    events.sort(key=lambda t: t[0])
    live: Dict[int, int] = {}
    now = peak = 0
    for _, ptr, size in events:
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            now += size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak


def train_peak(variant: str, base: nn.Module, case: Case, x, y, dtype) -> Dict[str, float]:
    """Peak bytes of one training step of ``variant`` built alone: persistent state + the step's peak.

    On CUDA both come from the caching allocator (``memory_allocated``, ``max_memory_allocated``).
    """
    if x.device.type == "cuda":
        return _cuda_train_peak(variant, base, case, x, y, dtype)
    gc.collect()
    # what lives now is out of the collector's sight until the end (each collect below walks only what the
    # variant made: 160 -> a few ms at tiny sizes); its storages are counted on neither side of the difference
    gc.freeze()
    try:
        before = live_storage_bytes()
        step, zero = train_step(variant, base, case, x, y, dtype)
        step()
        step()  # optimizer state exists, caches are warm
        zero()
        gc.collect()
        state = live_storage_bytes() - before
        transient = step_peak_bytes(step)
        del step, zero
        gc.collect()
    finally:
        gc.unfreeze()
    return {"state_bytes": state, "step_peak_bytes": transient, "peak_bytes": state + transient}


def _cuda_train_peak(variant: str, base: nn.Module, case: Case, x, y, dtype) -> Dict[str, float]:
    dev = x.device
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    step, zero = train_step(variant, base, case, x, y, dtype)
    step()
    step()
    zero()
    gc.collect()
    torch.cuda.synchronize(dev)
    state = torch.cuda.memory_allocated(dev) - before
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del step, zero
    gc.collect()
    torch.cuda.empty_cache()
    return {"state_bytes": state, "step_peak_bytes": peak - state, "peak_bytes": peak}


# --------------------------------------------------------------------------------------------
# the matmul probe: does this CPU have fast low-precision kernels?


def matmul_probe(dtype: torch.dtype, threads: int, sizes=(1024, 2048)) -> Dict[str, Any]:
    import statistics
    import time

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: Dict[str, Any] = {"threads": threads}
    try:
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            res = {}
            for dt in (torch.float32, dtype):
                p, q = a.to(dt), b.to(dt)
                p @ q
                ts = []
                for _ in range(5 if n <= 1024 else 3):
                    t0 = time.perf_counter()
                    p @ q
                    ts.append(time.perf_counter() - t0)
                    if ts[-1] > 2.0:  # a slow fallback: one sample is enough to know
                        break
                res[dt] = statistics.median(ts)
            out[f"matmul{n}_fp32_ms"] = res[torch.float32] * 1e3
            out[f"matmul{n}_low_ms"] = res[dtype] * 1e3
            out[f"matmul{n}_low_vs_fp32"] = res[dtype] / res[torch.float32]
            if res[dtype] > 2.0:
                break
    finally:
        torch.set_num_threads(old)
    return out


def cpu_flags() -> Dict[str, bool]:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:  # pragma: no cover
        pass
    return {k: k in flags for k in ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")}


def print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
