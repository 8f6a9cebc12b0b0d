"""Lean step time (issue 28): where a lean step's time goes, against pure bf16's and O2's step.

``python -m benchmarks.lean_step [--layers 2 --vocab 8192 --rounds 5] [--model resnet --batch 4 --px 64]``

1. A GPT-2-small-width decoder (as :mod:`benchmarks.memory`; the issue's size: ``--layers 4 --seq 256``), or
   ResNet-50 (``--model resnet``), AdamW: forward+backward and ``step()`` timed apart for pure bf16, O2, and
   the lean modes, the regimes interleaved step by step (a loaded CPU's drift hits every regime alike);
   medians of ``--rounds`` steps, wall-clock and this thread's CPU time.
2. The parts of a lean step per million elements, on one slice (:data:`fxamp.training.lean_step.PIECE`, 1 MiB of
   float32) at a time, the minimum of 25 runs: AdamW (bfloat16 as pure bf16 steps it; float32 as O2 does; fused,
   as a lean master is stepped), 8-bit codes in and out, bf16 state in and out, stochastic rounding, the
   weight and gradient widened.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from benchmarks.models import DecoderLM, ResNet50
from benchmarks.real import cpu_flags
from fxamp.training import lean, lean_step, native, quant

LEAN = {"O2": ("fp32", "fp32"), "O2 kahan+bf16": ("kahan", "bf16"), "O2 stochastic+int8": ("stochastic", "int8"),
        "O2 auto+auto": ("auto", "auto")}


def _steps(base: nn.Module, regime: str, x, y):
    """``(forward+backward, step, zero_grad)`` of ``regime``."""
    def loss(out):
        return F.cross_entropy(out.float().flatten(0, -2), y.flatten())

    if regime == "bf16":
        m = copy.deepcopy(base).to(torch.bfloat16)
        opt = torch.optim.AdamW(m.parameters(), lr=6e-4)
        xb = x.to(torch.bfloat16) if x.is_floating_point() else x
        return (lambda: loss(m(xb)).backward()), opt.step, (lambda: opt.zero_grad(set_to_none=True))
    amp = fxamp.convert(copy.deepcopy(base), "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=6e-4), model=amp, seed=0,
                                        precision=fxamp.LeanConfig(*LEAN[regime], calibration_steps=2))
    return (lambda: opt.backward(loss(amp(x)))), opt.step, opt.zero_grad


def step_table(layers: int, vocab: int, rounds: int, seq: int = 64, batch: int = 2, model: str = "gpt",
               px: int = 64) -> str:
    torch.manual_seed(0)
    if model == "resnet":
        base = ResNet50()
        x, y = torch.randn(batch, 3, px, px), torch.randint(0, 1000, (batch,))
        what = f"ResNet-50 b{batch} {px}px"
    else:
        base = DecoderLM(vocab=vocab, seq=seq, d=768, layers=layers, heads=12)
        for m in base.modules():  # GPT-2's initialisation, as benchmarks.memory
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
        what = f"GPT d768 L{layers} vocab {vocab} b{batch} s{seq}"
    built = {r: _steps(base, r, x, y) for r in ["bf16", *LEAN]}
    for fb, step, zero in built.values():
        for _ in range(3):  # state exists; "auto" has calibrated
            zero(), fb(), step()
    times = {r: ([], []) for r in built}
    # CPU time (this thread's; one thread): less moved by other processes' load than wall-clock time
    cpu = {r: ([], []) for r in built}
    for _ in range(rounds):
        for r, (fb, step, zero) in built.items():
            zero()
            t0, c0 = time.perf_counter(), time.thread_time()
            fb()
            t1, c1 = time.perf_counter(), time.thread_time()
            step()
            cpu[r][0].append(c1 - c0)
            cpu[r][1].append(time.thread_time() - c1)
            times[r][0].append(t1 - t0)
            times[r][1].append(time.perf_counter() - t1)
    total = {r: statistics.median([a + b for a, b in zip(*t)]) for r, t in times.items()}
    total_cpu = {r: statistics.median([a + b for a, b in zip(*t)]) for r, t in cpu.items()}
    lines = [f"# {what}, {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters, AdamW; medians of "
             f"{rounds} interleaved steps",
             "| regime | fwd+bwd ms | step() ms | total ms | total vs pure bf16 | total vs O2 "
             "| CPU: step() ms | CPU: total vs pure bf16 | CPU: total vs O2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, (a, b) in times.items():
        lines.append(f"| {r} | {1e3 * statistics.median(a):.0f} | {1e3 * statistics.median(b):.0f} | "
                     f"{1e3 * total[r]:.0f} | {total[r] / total['bf16']:.2f} | {total[r] / total['O2']:.2f} | "
                     f"{1e3 * statistics.median(cpu[r][1]):.0f} | {total_cpu[r] / total_cpu['bf16']:.2f} | "
                     f"{total_cpu[r] / total_cpu['O2']:.2f} |")
    return "\n".join(lines)


def parts_table() -> str:
    n = lean_step.PIECE

    def per_million(f, runs=25):
        f()
        best = min(_time(f) for _ in range(runs))
        return 1e3 * best * (2 ** 20 / n)

    def adam(dtype, fused=None):
        p = nn.Parameter(torch.randn(n, dtype=dtype) * 0.02)
        p.grad = torch.randn(n, dtype=dtype) * 1e-3
        opt = torch.optim.AdamW([p], lr=6e-4, fused=fused)
        opt.step()
        return opt.step

    torch.manual_seed(0)
    m = torch.randn(n) * 1e-3
    v = m * m
    cm, am = quant.quantize(m, True)
    cv, av = quant.quantize(v, False)
    w, value = torch.randn(n).bfloat16(), torch.randn(n)
    rows = [("AdamW step, bfloat16 (pure bf16's step)", adam(torch.bfloat16)),
            ("AdamW step, float32, for-loop (torch's default on a CPU)", adam(torch.float32)),
            ("AdamW step, float32, fused=True (O2's masters; the eager lean step's inner step)",
             adam(torch.float32, True)),
            ("int8 decode, both moments", lambda: (quant.dequantize(cm, am, True), quant.dequantize(cv, av, False))),
            ("int8 encode, both moments", lambda: (quant.quantize(m, True, out=cm, absmax_out=am),
                                                   quant.quantize(v, False, out=cv, absmax_out=av))),
            ("bf16 state in and out, both moments", lambda: (m.bfloat16().float(), v.bfloat16().float())),
            ("stochastic rounding into the weight", lambda: lean.stochastic_round(value, w, 12345)),
            ("weight and gradient to float32", lambda: (w.float(), w.float()))]
    if native.kernel() is not None:  # what replaces all of the above but pure bf16's row for 8-bit lean masters
        wk, gk = w.clone(), torch.randn(n) * 1e-3
        group = {"lr": 6e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
        state = {"step": torch.tensor(3.0), "exp_avg": cm.clone(), "exp_avg.absmax": am.clone(),
                 "exp_avg_sq": cv.clone(), "exp_avg_sq.absmax": av.clone()}
        hyper = native.hyperparameters(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), group)
        rows.append(("the CPU kernel: all of the lean step above (stochastic + int8, its noise hashed)",
                     lambda: native.adam_step(state, wk, None, gk, 12345, "int8", hyper, step=4.0)))
        g16 = gk.bfloat16()
        rows.append(("the CPU kernel, reading the bfloat16 gradient (a segmented step's)",
                     lambda: native.adam_step(state, wk, None, g16, 12345, "int8", hyper, step=4.0)))
    lines = [f"# per part, ms per million elements ({n}-element slices, minimum of 25 runs)",
             "| part | ms / M elements |", "|---|---|"]
    lines += [f"| {name} | {per_million(f):.2f} |" for name, f in rows]
    return "\n".join(lines)


def _time(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=None, help="default 2 (GPT), 4 (ResNet-50)")
    ap.add_argument("--model", choices=("gpt", "resnet"), default="gpt")
    ap.add_argument("--px", type=int, default=64, help="ResNet-50's image size")
    ap.add_argument("--parts-only", action="store_true", help="only the per-part table (seconds, not minutes)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"# torch {torch.__version__}; threads {torch.get_num_threads()}; CPU flags {cpu_flags()}")
    if not a.parts_only:
        batch = a.batch if a.batch is not None else (4 if a.model == "resnet" else 2)
        print(step_table(a.layers, a.vocab, a.rounds, a.seq, batch, a.model, a.px))
    print(parts_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
