"""Real-size training steps timed 1 and 10 steps per synchronized block: ``python -m benchmarks.steps_per_block [float16]``.

The suite synchronizes around every timed step, so each starts from an idle GPU and the host's
time to queue its first kernels counts; a training loop that never synchronizes hides it.  This
times autocast, pure low precision and fxamp O1/O2 (benchmarks/real.py's variants, fused AdamW;
bfloat16 unless the first argument names another dtype) both ways,
7 rounds after 3 warm-up steps, and prints each median and its ratio to autocast's.  CUDA only.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks import real as R

VARIANTS = (R.AUTOCAST, R.LIMIT, R.O1, R.O2)


def main() -> int:
    if not torch.cuda.is_available():
        print("error: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
    for which in (1, 0):  # ResNet-50, then GPT-2 small
        case = R.cases("real", dev)[which]
        torch.manual_seed(0)
        base = case.build()
        x, y = case.make_x(), case.make_y()
        steps = {v: R.train_step(v, base, case, x, y, dtype)[0] for v in VARIANTS}
        times = {v: {1: [], 10: []} for v in steps}
        for f in steps.values():
            for _ in range(3):
                f()
        for _ in range(7):
            for v, f in steps.items():
                for n in (1, 10):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        f()
                    torch.cuda.synchronize()
                    times[v][n].append((time.perf_counter() - t0) / n)
        ac = {n: statistics.median(times[R.AUTOCAST][n]) for n in (1, 10)}
        for v in steps:
            m = {n: statistics.median(times[v][n]) for n in (1, 10)}
            name = R.limit_name(dtype) if v == R.LIMIT else v
            print(f"{case.name[:24]} {name:10} " + " ".join(
                f"{n} step(s)/block {m[n] * 1e3:6.1f} ms {m[n] / ac[n]:.3f}x" for n in (1, 10)), flush=True)
        del steps, base
    return 0


if __name__ == "__main__":
    sys.exit(main())
