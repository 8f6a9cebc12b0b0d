"""The ``memory`` suite: bytes per parameter at the step and peak training memory, per regime (issue 28).

``python -m benchmarks.memory [--layers 2 --vocab 8192 --seq 64 --batch 2 --steps 6] [--device cuda]``

A GPT-2-small-width decoder (d768, 12 heads, :class:`benchmarks.models.DecoderLM`, GPT-2's std-0.02
initialisation) trained with AdamW (lr 6e-4, the first steps on one random batch) in:
fp32, ``torch.autocast`` (bf16), pure bf16 (``model.to(bf16)``; ``bf16 auto+auto``: with fxamp's lean auto
state, the no-cast limit of ``O2 auto+auto``), fxamp O2 with float32 masters and state, and O2 with lean
masters/state (kahan + bf16 state, stochastic + int8 state, auto + auto).

* ``B/param``: bytes of every live CPU tensor right after ``step()`` (weights, gradients still bound,
  masters or terms, optimizer state), less what existed before the model, per parameter: the issue's
  count "weight + master or compensation + gradient + optimizer state".
* ``peak MiB``: the state between steps (after ``zero_grad``) plus the highest transient of one step
  (:func:`benchmarks.real.step_peak_bytes`), as the real-size suite measures it.
* With ``--device cuda`` both are the CUDA allocator's counts (``memory_allocated``, and
  ``max_memory_allocated`` over one step), exact.
* ``step ms``: median of the timed steps (after the calibration steps of ``"auto"``); on CPU also ``CPU ms``,
  the process's CPU time per step (with ``--threads 1``, what a loaded shared machine does not inflate).
  A regime ``X no-recompute`` beside ``X`` adds a line: X's peak and step time over those without the recompute.

``--loss-inside`` puts the loss in the model's ``forward`` (``model(idx, labels)``, as Hugging Face models
compute it with ``labels=``, the logits cast up with ``.float()``), so fxamp converts it too: its
log-softmax is a float32 island that keeps the bfloat16 logits for backward (issue 40); the
``... no-recompute`` regimes turn that off (``recompute_islands=False``) for the step-time comparison.
Full size (GPT-2 small at 8 x 1024 tokens; a long run on a CPU)::

    python -m benchmarks.memory --loss-inside --layers 12 --vocab 50304 --seq 1024 --batch 8 --steps 2 \
        --regimes "autocast,bf16,bf16 auto+auto,O2,O2 no-recompute,O2 auto+auto,O2 auto+auto no-recompute"
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from benchmarks.models import DecoderLM, ResNet50
from benchmarks.real import cpu_flags, live_storage_bytes, step_peak_bytes

REGIMES = ["fp32", "autocast", "bf16", "O2", "O2 kahan+bf16", "O2 stochastic+int8", "O2 auto+auto",
           "bf16 optimi-kahan", "bf16 torchao-8bit", "bf16 auto+auto", "O2 no-recompute", "O2 auto+auto no-recompute"]
#: a regime's name ends with this: fxamp converts with recompute_islands=False
NO_RECOMPUTE = " no-recompute"
#: pure bfloat16 models stepped by other libraries' lean optimizers (rows skipped where they do not import)
_OTHERS = {"bf16 optimi-kahan": ("optimi", lambda mod, ps: mod.AdamW(ps, lr=6e-4, kahan_sum=True)),
           "bf16 torchao-8bit": ("torchao.optim", lambda mod, ps: mod.AdamW8bit(ps, lr=6e-4))}
_LEAN = {"O2 kahan+bf16": ("kahan", "bf16"), "O2 stochastic+int8": ("stochastic", "int8"),
         "O2 auto+auto": ("auto", "auto")}


class WithLoss(nn.Module):
    """``model(idx, labels)`` returns the loss: the cross-entropy of the logits cast up to float32."""

    def __init__(self, lm: nn.Module, vocab: int):
        super().__init__()
        self.lm, self.vocab = lm, vocab

    def forward(self, idx, labels):
        return F.cross_entropy(self.lm(idx).float().reshape(-1, self.vocab), labels.reshape(-1))


def build(regime: str, base: nn.Module, x: torch.Tensor, y: torch.Tensor, vocab: int
          ) -> Tuple[Callable[[], Any], Callable[[], None], Any]:
    """``(step, zero_grad, optimizer)`` for ``regime``; ``step`` runs forward, backward and the optimizer step."""
    inside = isinstance(base, WithLoss)

    def loss_of(model, inputs):
        if inside:
            return model(inputs, y)
        return F.cross_entropy(model(inputs).float().reshape(-1, vocab), y.reshape(-1))

    xb = x.to(torch.bfloat16) if x.is_floating_point() else x  # (pure bf16 takes bf16 images)

    if regime == "bf16 auto+auto":  # pure bf16 with O2 auto+auto's lean state: the no-cast limit of that regime
        m = copy.deepcopy(base).to(torch.bfloat16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=6e-4), model=m, seed=0,
                                            precision=fxamp.LeanConfig("auto", "auto", calibration_steps=2))

        def lean_step():
            opt.backward(loss_of(m, xb))
            opt.step()

        return lean_step, opt.zero_grad, opt
    if regime in ("fp32", "autocast", "bf16") or regime in _OTHERS:
        m = copy.deepcopy(base)
        if regime != "fp32" and regime != "autocast":
            m = m.to(torch.bfloat16)
        if regime in _OTHERS:
            import importlib

            module, make = _OTHERS[regime]
            opt = make(importlib.import_module(module), m.parameters())
        else:
            opt = torch.optim.AdamW(m.parameters(), lr=6e-4)

        def step():
            with torch.autocast(x.device.type, torch.bfloat16, enabled=regime == "autocast"):
                loss = loss_of(m, x if regime in ("fp32", "autocast") else xb)
            loss.backward()
            opt.step()

        return step, lambda: opt.zero_grad(set_to_none=True), opt
    recompute = not regime.endswith(NO_RECOMPUTE)
    masters, state = _LEAN.get(regime.removesuffix(NO_RECOMPUTE), ("fp32", "fp32"))
    amp = fxamp.convert(copy.deepcopy(base), "O2", dtype=torch.bfloat16, recompute_islands=recompute)
    opt = fxamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(amp.parameters(), lr=6e-4), model=amp, seed=0,
        precision=fxamp.LeanConfig(masters, state, calibration_steps=2))

    def step():
        opt.backward(loss_of(amp, x))
        opt.step()

    return step, opt.zero_grad, opt


def _live(device: torch.device) -> int:
    """Bytes of every live tensor on ``device``: the allocator's count on CUDA, a scan of the objects on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return live_storage_bytes()


def _transient(step: Callable[[], Any], device: torch.device) -> int:
    """The highest bytes one ``step()`` holds over what was live before it."""
    if device.type != "cuda":
        return step_peak_bytes(step)
    start = _live(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def measure(regime: str, base: nn.Module, x, y, vocab: int, steps: int) -> Dict[str, Any]:
    nparams = sum(p.numel() for p in base.parameters())
    device = x.device
    gc.collect()
    gc.freeze()  # (what lives now is not walked by the collects below, nor counted on either side: real.train_peak)
    try:
        return _measure(regime, base, x, y, vocab, steps, nparams, device)
    finally:
        gc.unfreeze()


def _measure(regime: str, base: nn.Module, x, y, vocab: int, steps: int, nparams: int, device) -> Dict[str, Any]:
    before = _live(device)
    step, zero, opt = build(regime, base, x, y, vocab)
    for _ in range(3):  # state exists; auto has calibrated (2 steps)
        zero()
        step()
    at_step = _live(device) - before
    times: List[float] = []
    cpu: List[float] = []
    for _ in range(steps):
        zero()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    zero()
    gc.collect()
    between = _live(device) - before
    transient = _transient(step, device)
    row = {"regime": regime, "bytes_per_param": at_step / nparams, "peak_mib": (between + transient) / 2 ** 20,
           "step_ms": 1e3 * statistics.median(times), "cpu_ms": 1e3 * statistics.median(cpu)}
    if isinstance(opt, fxamp.MixedPrecisionOptimizer) and opt.precision.lean:
        row["table"] = opt.precision_table()
    del step, zero, opt
    gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "resnet"), default="gpt")
    ap.add_argument("--px", type=int, default=64, help="ResNet-50's image size")
    ap.add_argument("--d", type=int, default=768, help="width (GPT-2 small's by default; heads: d / 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--tables", action="store_true", help="print the per-tensor table of each lean regime")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: robust to a shared, loaded CPU)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: bytes are then the CUDA allocator's, exactly")
    ap.add_argument("--loss-inside", action="store_true",
                    help="GPT: the loss inside forward (model(idx, labels)), so fxamp converts it (issue 40)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model == "resnet":
        base, classes = ResNet50(), 1000
        x, y = torch.randn(a.batch, 3, a.px, a.px), torch.randint(0, 1000, (a.batch,))
        what = f"ResNet-50 b{a.batch} {a.px}px"
    else:
        base, classes = DecoderLM(vocab=a.vocab, seq=a.seq, d=a.d, layers=a.layers, heads=max(1, a.d // 64)), a.vocab
        for m in base.modules():  # GPT-2's initialisation (std 0.02): what "auto" measures depends on the weights' size
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        x = torch.randint(0, a.vocab, (a.batch, a.seq))
        y = torch.randint(0, a.vocab, (a.batch, a.seq))
        what = f"GPT d{a.d} L{a.layers} vocab {a.vocab} b{a.batch} s{a.seq}"
        if a.loss_inside:
            base, what = WithLoss(base, a.vocab), what + ", loss inside forward"
    device = torch.device(a.device)
    base, x, y = base.to(device), x.to(device), y.to(device)
    flags = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU flags {cpu_flags()}"
    print(f"# {what}, AdamW, "
          f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f} M params; torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}; {flags}")
    rows = []
    for r in a.regimes.split(","):
        try:
            rows.append(measure(r.strip(), base, x, y, classes, a.steps))
            got = rows[-1]  # (printed as it comes: a full-size run takes an hour on a shared CPU)
            print(f"# {got['regime']}: peak {got['peak_mib']:.0f} MiB, {got['bytes_per_param']:.2f} B/param, "
                  f"CPU {got['cpu_ms']:.0f} ms", flush=True)
        except ImportError as e:  # optimi / torchao not installed
            print(f"# {r.strip()}: skipped ({e})")
    auto = next((r for r in rows if r["regime"] == "autocast"), None)
    from tabulate import tabulate

    on_cpu = device.type == "cpu"
    body = [[r["regime"], f"{r['bytes_per_param']:.2f}", f"{r['peak_mib']:.0f}",
             "" if auto is None else f"{r['peak_mib'] / auto['peak_mib']:.2f}", f"{r['step_ms']:.0f}",
             "" if auto is None else f"{r['step_ms'] / auto['step_ms']:.2f}"]
            + ([f"{r['cpu_ms']:.0f}", "" if auto is None else f"{r['cpu_ms'] / auto['cpu_ms']:.2f}"] if on_cpu else [])
            for r in rows]
    print(tabulate(body, headers=["regime", "B/param", "peak MiB", "peak vs autocast", "step ms", "step vs autocast"]
                   + (["CPU ms", "CPU vs autocast"] if on_cpu else []), tablefmt="github", disable_numparse=True))
    by_name = {r["regime"]: r for r in rows}
    for r in rows:  # the recompute against the same regime without it (issue 40's step-time target: <= 1.03x)
        off = by_name.get(r["regime"] + NO_RECOMPUTE)
        if off is not None:
            print(f"# {r['regime']} vs {off['regime']}: peak {r['peak_mib'] / off['peak_mib']:.2f}x, step "
                  f"{r['step_ms'] / off['step_ms']:.2f}x" + (f", CPU {r['cpu_ms'] / off['cpu_ms']:.2f}x" if on_cpu else ""))
    if a.tables:
        for r in rows:
            if "table" in r:
                print(f"\n## {r['regime']}\n{r['table']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
