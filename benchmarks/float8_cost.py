"""Measure float8's speed-up over bfloat16 per matmul shape: the rows of ``fxamp.conversion.classify.float8.COST_TABLES``.

    python -m benchmarks.float8_cost [--device cpu|cuda] [--tokens M] [--shapes 1024x1024,4096x4096] [--repeat R]
                                     [--compile | --eager]

For each (K, N) it times one forward and backward of ``F.linear`` on a (M, K) bfloat16 input and an
(N, K) bfloat16 weight, then the same through fxamp's float8 linear (scaling and casts included)
for each recipe, medians of interleaved rounds, and prints the ratio table (bf16 time / float8
time: above 1 float8 pays) and a ``COST_TABLES`` entry to paste into ``fxamp/conversion/classify/float8.py``
for this device kind.  On a CPU ``torch._scaled_mm`` runs emulated, so every ratio is below 1.
On CUDA each variant is compiled by default (``--eager`` to measure eager): a float8 linear pays only
when its amax, scale and saturating cast fuse into one kernel per operand, which eager cannot do, so
the table users train with is the compiled one.
Record the machine (``lscpu`` model and flags, or the GPU name) with the numbers.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

from fxamp.conversion.classify.float8 import device_kind
from fxamp.conversion.runtime.float8 import float8_linear
from fxamp.policy import Float8, Float8Recipe


def _timer(device: str) -> Callable[[], float]:
    if device == "cuda":
        def now() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
        return now
    return time.perf_counter


def measure(device: str, tokens: int, k: int, n: int, repeat: int, compiled: bool = False) -> List[float]:
    """``[bf16 seconds, tensorwise, rowwise, rowwise_with_gw_hp]`` for one fwd+bwd at (M, K) x (N, K);
    ``compiled``: each variant through ``torch.compile`` (one compiled function per variant and shape)."""
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    configs = [Float8(r) for r in Float8Recipe]
    fns = [F.linear] + [functools.partial(float8_linear, bias=None, config=c) for c in configs]
    if compiled:
        # each shape from a clean slate: the variants share one code object (functools.partial's), so without a reset
        # the third shape reached dynamo's recompile limit (8) and ran eager, and later shapes compiled dynamic
        torch._dynamo.reset()
        fns = [torch.compile(f, dynamic=False) for f in fns]
    runs = [lambda f=f: f(x, w) for f in fns]
    now = _timer(device)
    times: List[List[float]] = [[] for _ in runs]
    for _ in range(2):  # warm up
        for run in runs:
            run().backward(g)
    for _ in range(repeat):  # interleaved rounds: a busy machine slows every variant alike
        for i, run in enumerate(runs):
            start = now()
            run().backward(g)
            times[i].append(now() - start)
    return [statistics.median(t) for t in times]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="M (default: 256 on CPU, 8192 on CUDA)")
    parser.add_argument("--shapes", default=None, help="KxN,KxN,... (default: a sweep for the device)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile", dest="compiled", action="store_true", default=None,
                      help="time each variant under torch.compile (the default on CUDA)")
    mode.add_argument("--eager", dest="compiled", action="store_false", help="time eager (the default on a CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    compiled = cuda if args.compiled is None else args.compiled
    tokens = args.tokens or (8192 if cuda else 256)
    default = "1024x1024,2048x2048,4096x1024,4096x4096,8192x8192" if cuda else "64x64,256x256,1024x1024"
    shapes: List[Tuple[int, int]] = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default).split(",")]
    name = torch.cuda.get_device_name() if cuda else f"cpu: {platform.processor() or platform.machine()}"
    how = "compiled" if compiled else "eager"
    print(f"device {name}; torch {torch.__version__}; M={tokens}; {how} fwd+bwd medians of {args.repeat}")
    print(f"{'K':>6} {'N':>6} {'bf16 ms':>9} " + " ".join(f"{r.value:>20}" for r in Float8Recipe))
    rows = []
    for k, n in shapes:
        t = measure(args.device, tokens, k, n, args.repeat, compiled)
        ratios = [t[0] / v for v in t[1:]]
        rows.append((k, n, ratios))
        print(f"{k:>6} {n:>6} {1e3 * t[0]:>9.3f} " + " ".join(f"{r:>19.2f}x" for r in ratios))
    kind = device_kind(torch.device(args.device))
    print(f"\nCOST_TABLES[{kind!r}] = {{")
    for i, recipe in enumerate(Float8Recipe):
        body = ", ".join(f"({k}, {n}, {r[i]:.2f})" for k, n, r in rows)
        print(f"    Float8Recipe.{recipe.name}: CostTable({name + ', ' + how!r}, {tokens}, ({body},)),")
    print("}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
