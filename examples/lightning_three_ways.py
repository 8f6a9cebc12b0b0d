"""One Lightning model, three precisions: 32-true, Lightning's bf16-mixed (autocast), fxamp O2 (the plugin).

    python examples/lightning_three_ways.py [--quick] [--epochs N] [--seed S]

The LightningModule is the same in all three runs (an MLP on scikit-learn's digits, AdamW); only
the Trainer line changes::

    Trainer(precision="32-true")
    Trainer(precision="bf16-mixed")
    Trainer(plugins=[FxampPrecision("O2", dtype="bf16")])     # from fxamp.lightning import FxampPrecision

The table gives, per run: the final validation loss (and its difference from 32-true's), memory,
and the median time of a training step.

How memory is measured (CPU: there is no allocator peak counter like CUDA's
``torch.cuda.max_memory_allocated``, so tensors are counted, by unique storage):

* activations: bytes of the tensors autograd saves for backward during one training forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded; under autocast these
  include the bfloat16 weight copies made at each forward;
* parameters: the model's parameters (bfloat16 under fxamp O2, except the norms);
* optimizer: the optimizer's state plus, under fxamp, the float32 master weights;
* gradients: the model's and, under fxamp, the masters' (measured before the optimizer step);
* peak: the sum of the four, the most that is alive at once between backward and the step.

At this size the weights dominate: fxamp O2 keeps bfloat16 weights plus float32 masters (6 bytes
a weight instead of 4) and bfloat16 plus float32 gradients, so its total is the largest; what O2
saves is activation memory, which grows with batch and depth while the weights do not.

The step-time column measures this CPU's kernels more than fxamp: without AMX or AVX-512-BF16
(``lscpu`` flags ``amx_bf16``, ``avx512_bf16``) PyTorch has no fast bfloat16 matmuls, so the
column says little about mixed precision; the script prints so when it finds neither.  On a model
this small, dispatch overhead dominates the step time whatever the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import lightning as L

from fxamp.lightning import FxampPrecision

VARIANTS = ("32-true", "bf16-mixed", "fxamp O2 bf16")


class DigitsMLP(L.LightningModule):
    """64 → 256 → LayerNorm → 256 → 10, AdamW; the network is ``self.net`` (what the plugin converts)."""

    def __init__(self, width: int = 256, lr: float = 1e-3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.LayerNorm(width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
        self.lr = lr

    def training_step(self, batch, i):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, i):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(seed: int, batch_size: int = 64):
    """Digits scaled to [0, 1], a fixed 1400/397 split; the training order depends on ``seed`` only."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    train = torch.utils.data.TensorDataset(x[:1400], y[:1400])
    val = torch.utils.data.TensorDataset(x[1400:], y[1400:])
    return (torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True,
                                        generator=torch.Generator().manual_seed(seed)),
            torch.utils.data.DataLoader(val, batch_size=512))


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


class Meter(L.Callback):
    """Step times, and the memory of one training step (see the module docstring)."""

    def __init__(self, measure_at: int = 3):
        self.measure_at = measure_at
        self.times: List[float] = []
        self.memory: Dict[str, int] = {}
        self._t0 = 0.0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._saved: List[torch.Tensor] = []

    def on_train_batch_start(self, trainer, module, batch, i):
        self._t0 = time.perf_counter()
        if trainer.global_step == self.measure_at:
            self._saved = []
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved.append(t)
        return t

    def on_before_backward(self, trainer, module, loss):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            params = {p.untyped_storage().data_ptr() for p in module.parameters()}
            self.memory["activations"] = _bytes(t for t in self._saved if t.untyped_storage().data_ptr() not in params)
            self._saved = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step != self.measure_at:
            return
        model_params = list(module.parameters())
        ids = {id(p) for p in model_params}
        extra = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in ids]  # fxamp's masters
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        self.memory["parameters"] = _bytes(model_params)
        self.memory["optimizer"] = _bytes(state + extra)
        self.memory["gradients"] = _bytes([p.grad for p in model_params] + [p.grad for p in extra])

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.times.append(time.perf_counter() - self._t0)


@dataclass
class Result:
    name: str
    val_loss: float
    memory: Dict[str, int]
    step_ms: float


def run(variant: str, epochs: int, seed: int) -> Result:
    L.seed_everything(seed, verbose=False)
    model = DigitsMLP()
    meter = Meter()
    kw = dict(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[meter])
    if variant.startswith("fxamp"):
        trainer = L.Trainer(plugins=[FxampPrecision("O2", dtype="bf16")], **kw)
    else:
        trainer = L.Trainer(precision=variant, **kw)
    trainer.fit(model, *data(seed))
    times = meter.times[len(meter.times) // 10:]  # drop the warm-up
    return Result(variant, trainer.callback_metrics["val_loss"].item(), meter.memory, 1e3 * statistics.median(times))


def has_fast_bf16() -> bool:
    """True when the CPU advertises bfloat16 matmul instructions (AMX or AVX-512-BF16, from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def table(results: List[Result]) -> str:
    ref = results[0]
    rows = []
    for r in results:
        m = r.memory
        peak = sum(m.get(k, 0) for k in ("activations", "parameters", "optimizer", "gradients"))
        rows.append([r.name, f"{r.val_loss:.4f}", f"{(r.val_loss - ref.val_loss) / ref.val_loss:+.1%}",
                     *(f"{m.get(k, 0) / 1024:.0f}" for k in ("activations", "parameters", "optimizer", "gradients")),
                     f"{peak / 1024:.0f}", f"{r.step_ms:.2f}"])
    return tabulate(rows, headers=["run", "val loss", "vs 32-true", "activations KiB", "params KiB",
                                   "optimizer KiB", "grads KiB", "peak KiB", "step ms"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, for the test (a few seconds)")
    parser.add_argument("--epochs", type=int, default=None, help="default 8, or 2 with --quick")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    epochs = args.epochs or (2 if args.quick else 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster and steadier
    try:
        results = [run(v, epochs, args.seed) for v in VARIANTS]
    finally:
        torch.set_num_threads(threads)
    print(f"digits MLP, {epochs} epochs, batch 64, AdamW, seed {args.seed}, torch {torch.__version__}, 1 thread")
    print(table(results))
    print("memory: tensor bytes counted by storage (activations: saved for backward in one training step), "
          "not an allocator peak; see the module docstring")
    if not has_fast_bf16():
        print("note: this CPU has neither AMX nor AVX-512-BF16 (lscpu flags amx_bf16, avx512_bf16): PyTorch emulates "
              "bfloat16 matmuls here, so the step-time column is not meaningful for mixed precision")
    else:
        print("note: this CPU has bfloat16 matmul instructions, but on a model this small dispatch overhead, not "
              "matmul speed, decides the step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
