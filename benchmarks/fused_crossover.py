"""Where ``compile_step`` starts to pay: ``python -m benchmarks.fused_crossover [--device cuda]``.

The measurement behind ``fxamp.training.kernels.FUSED_MIN_TOTAL``: for AdamW and SGD (momentum), masters of
growing total size (low-precision parameters with gradients set, no model), the wrapper's step
with the compiled kernels against its plain step, both forced (the threshold is lifted for the
compiled side), medians of interleaved rounds.  A ratio under 1.00 means the kernels pay at that
size; the threshold belongs where the ratio crosses 1 on the machine that matters.  The first
step of each kind compiles (seconds to a minute, once; inductor caches it on disk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from tabulate import tabulate

import fxamp
from benchmarks.real import cpu_flags
from benchmarks.run import _cpu_name
from fxamp.training import kernels as fused_step

#: (masters, elements each): 0.5 M to 16 M elements in all
SIZES: Tuple[Tuple[int, int], ...] = ((4, 4096), (16, 4096), (4, 32768), (16, 32768), (8, 131072), (16, 131072),
                                      (32, 131072), (16, 1048576))
#: the inner optimizers, as torch builds them by default (on CPU: a loop over the tensors) and with
#: foreach / fused implementations, which make the plain step faster and move the crossover
KINDS: Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW(foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "AdamW(fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "SGD(foreach)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "SGD(fused)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
}


def _wrapper_step(make: Callable, count: int, numel: int, compiled: bool, dtype: torch.dtype,
                  device: torch.device) -> Callable[[], None]:
    g = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g).to(device, dtype)) for _ in range(count)]
    grads = [(torch.randn(numel, generator=g) * 1e-3).to(device, dtype) for _ in range(count)]
    opt = fxamp.MixedPrecisionOptimizer(make(params), compile_step=compiled)  # (loss scale "auto")
    token = torch.zeros((), device=device, requires_grad=True)

    def step() -> None:
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.scale_loss(token)  # (marks that scaled gradients exist: they were set above)
        opt.step()

    step()  # the compile, for the compiled side
    assert opt.compiled_step_active is compiled
    return step


def _median_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_crossover", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is taken over them)")
    p.add_argument("--reps", type=int, default=5, help="steps timed per variant in a round")
    p.add_argument("--only", nargs="+", choices=tuple(KINDS), default=list(KINDS), help="these optimizers only")
    p.add_argument("--max-numel", type=float, default=float("inf"), help="skip sizes of more elements in all")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fused_crossover: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    current = dict(fused_step.FUSED_MIN_TOTAL)
    fused_step.FUSED_MIN_TOTAL = dict.fromkeys(current, 0)  # the compiled side always fuses
    rows = []
    for kind in args.only:
        make = KINDS[kind]
        for count, numel in (size for size in SIZES if size[0] * size[1] <= args.max_numel):
            plain = _wrapper_step(make, count, numel, False, dtype, device)
            compiled = _wrapper_step(make, count, numel, True, dtype, device)
            medians: Dict[str, List[float]] = {"plain": [], "compiled": []}
            for r in range(args.rounds):
                order = (("plain", plain), ("compiled", compiled))
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    medians[name].append(_median_ms(fn, device, args.reps))
            a, b = statistics.median(medians["plain"]), statistics.median(medians["compiled"])
            rows.append([kind, f"{count} x {numel}", f"{count * numel / 1e6:.2f} M", f"{a:.3f}", f"{b:.3f}",
                         f"{b / a:.2f}x"])
            print(f"  {kind} {count} x {numel} done", file=sys.stderr)
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:  # (the CPU's name and its low-precision flags: the crossover moves with them)
        machine = _cpu_name() + ", " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu_flags().items())
    print(f"fused_crossover: {machine}; {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); FUSED_MIN_TOTAL now: "
          + ", ".join(f"{k} {v / 2 ** 20:g} Mi elements" for k, v in current.items()))
    print(tabulate(rows, headers=["optimizer", "masters", "elements", "plain ms", "compiled ms", "compiled/plain"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
