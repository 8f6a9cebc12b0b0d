"""Tokens/s of a GPT trained under bfloat16 O2, fxamp float8 and torchao float8, side by side in one run.

    python -m benchmarks.float8_gpt [--size small|medium|tiny] [--steps N] [--compile] [--device cuda]

The model is a GPT written with ``nn.Linear`` (so torchao's ``convert_to_float8_training`` swaps every
projection, as fxamp's rewrite takes every one): GPT-2 small (12 layers, width 768) or medium (24,
1024), vocabulary 50304, context 1024. Variants, each from the same weights on the same batches:

* ``bf16 O2``: ``fxamp.initialize(model, AdamW, "O2", dtype="bf16")``;
* ``fxamp float8 <recipe>``: ``"O2,float8=<recipe>"`` (the cost model decides: torchao's thresholds
  on a GPU without a committed table) and ``"...:always"`` (every linear);
* ``torchao float8 <recipe>``: ``convert_to_float8_training`` (every ``nn.Linear``) under
  ``torch.autocast(bfloat16)``, float32 AdamW (torchao's documented single-GPU recipe); skipped
  when torchao is not installed.

It prints tokens/s (median step time after warm-up) and the final training loss of each. With
``--compile`` each model's forward (and torchao's) is compiled: torchao's speed comes from
inductor fusing its casts, and so would fxamp's. Run it on an H100 for the numbers that matter
(``--size small --compile``); ``--size tiny`` is the CPU smoke run (a test runs it).
Run on an H200 on 2026-11-27: benchmarks/RESULTS.md ("NVIDIA H200").
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from examples.float8_gpt import GPT  # the example's model: what is timed here is what it trains

SIZES = {"tiny": (2, 64, 4, 128, 64), "small": (12, 768, 12, 50304, 1024), "medium": (24, 1024, 16, 50304, 1024)}


@dataclass
class Result:
    name: str
    tokens_per_s: float
    final_loss: float


def _fxamp_step(policy: str, model: nn.Module, lr: float, compile_: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp, opt = fxamp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), policy, dtype="bf16")
    run = torch.compile(amp) if compile_ else amp

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        return loss.item()
    return step


def _torchao_step(recipe: str, model: nn.Module, lr: float, compile_: bool, device: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if device == "cpu":  # no float8 GEMM kernels there: torchao's emulation
        import dataclasses
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config)
    run = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--variants", default=None, help="comma-separated substrings: run only the variants naming one")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="after timing, profile one more step of each variant and print its TOP kernels")
    args = parser.parse_args(argv)
    layers, d, heads, vocab, block = SIZES[args.size]
    device = args.device
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, block + 1), generator=gen) for _ in range(args.steps)]
    variants: Dict[str, Callable[[nn.Module], Callable[[torch.Tensor, torch.Tensor], float]]] = {
        "bf16 O2": lambda m: _fxamp_step("O2", m, args.lr, args.compile),
        f"fxamp float8 {args.recipe}": lambda m: _fxamp_step(f"O2,float8={args.recipe}", m, args.lr, args.compile),
        f"fxamp float8 {args.recipe}:always": lambda m: _fxamp_step(f"O2,float8={args.recipe}:always", m, args.lr,
                                                                    args.compile),
    }
    try:
        import torchao.float8  # noqa: F401
        variants[f"torchao float8 {args.recipe}"] = lambda m: _torchao_step(args.recipe, m, args.lr, args.compile,
                                                                            device)
    except ImportError:
        print("torchao is not installed: its row is skipped (pip install --no-deps torchao)")
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if any(w in k for w in keep)}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}; torch {torch.__version__}; GPT {args.size} (layers {layers}, width {d}); batch "
          f"{args.batch} x {block}; {args.steps} steps ({args.warmup} warm-up); compile {args.compile}")
    results: List[Result] = []
    for label, make in variants.items():
        torch.manual_seed(0)
        model = GPT(layers, d, heads, vocab, block).to(device)
        step = make(model)
        times, loss = [], float("nan")
        for i, batch in enumerate(batches):
            batch = batch.to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = step(batch[:, :-1], batch[:, 1:])  # .item() synchronises
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        tokens = args.batch * block
        results.append(Result(label, tokens / statistics.median(times), loss))
        graphs = _dynamo_graphs() if args.compile else ""
        r = results[-1]  # each row as it is measured: a run cut short by a time limit keeps the rows it has
        if len(results) == 1:
            print(f"\n{'variant':<36} {'tokens/s':>12} {'vs bf16 O2':>11} {'final loss':>11}")
        print(f"{r.name:<36} {r.tokens_per_s:>12.0f} {r.tokens_per_s / results[0].tokens_per_s:>10.2f}x "
              f"{r.final_loss:>11.4f}{graphs}", flush=True)
        if args.profile:
            _profile(step, batches[-1].to(device), device, args.profile, label)
        del model, step
    return 0


def _dynamo_graphs() -> str:
    """What torch.compile made of the variant just run: its graphs and graph breaks (reasons), then reset: a
    compiled float8 model cut into a graph per linear runs at the host's pace, not the GPU's."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    counters.clear()
    return f"  ({graphs} graphs; graph breaks: {breaks or 'none'})"


def _profile(step, batch: torch.Tensor, device: str, top: int, label: str) -> None:
    """One step under ``torch.profiler``: which kernels surround the GEMMs (issue 39 reads it from a GPU run)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(batch[:, :-1], batch[:, 1:])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ka = prof.key_averages()
    print(f"\n## profile of one step: {label}")
    print(ka.table(sort_by=key, row_limit=top, max_name_column_width=70))


if __name__ == "__main__":
    raise SystemExit(main())
