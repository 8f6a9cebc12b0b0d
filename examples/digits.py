"""Train a small MLP on scikit-learn's digits in float32, torch.autocast and fxamp O1/O2; compare.

    python examples/digits.py [--quick] [--out examples/out/] [--epochs N] [--seed S]

Every variant starts from the same weights and sees the same batches.  The table gives each
one's final training loss (the whole training set, evaluated once training ends), test accuracy,
skipped steps and final loss scale; the PNG plots the loss curves.  The run fails (exit 1) when
an fxamp variant's final loss is more than ``LOSS_MARGIN`` (relative) from float32's or its test
accuracy more than ``ACC_MARGIN`` below it.

The margins are measured, not hoped for: over seeds 0-3, at 5 epochs (``--quick``, loss ≈ 0.22)
fxamp O2 lands within 1.3% of float32's loss and 0.002 of its accuracy, at 10 epochs (the default,
loss ≈ 0.07) within 1.9% and 0.002.  Train much longer and the loss heads for zero: relative
differences then reflect diverging trajectories, not precision (torch.autocast bfloat16 drifts
by 9-48% from float32 at 15-20 epochs, fxamp by as much), so compare accuracy there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import fxamp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script or loaded by path
from loss_curves import plot_loss_curves  # noqa: E402

#: how far an fxamp variant may land from float32: relative final loss, absolute test accuracy
LOSS_MARGIN = 0.02
ACC_MARGIN = 0.01


class MLP(nn.Module):
    """64 → 64 → LayerNorm → 64 → 10: small enough for this CPU's slow float16/bfloat16 kernels."""

    def __init__(self, d: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = F.relu(self.norm(self.fc1(x)))
        return self.head(F.relu(self.fc2(x)))


def load(seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 × 8×8 images, shipped with scikit-learn), scaled to [0, 1], split 75/25 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    as_t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return as_t(xtr, torch.float32), as_t(ytr, torch.long), as_t(xte, torch.float32), as_t(yte, torch.long)


@dataclass
class Result:
    name: str
    curve: List[float] = field(default_factory=list)  # training loss per step
    final_loss: float = float("nan")
    accuracy: float = float("nan")
    skipped: int = 0
    scale: Optional[float] = None
    seconds: float = 0.0
    fxamp: bool = False


def variants(lr: float):
    """name -> a builder: fresh float32 MLP -> (model, step(x, y) -> loss, stats() -> (skipped, scale), forward)."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)

    def plain(model, autocast_dtype=None, scaler=None):
        opt = adamw(model.parameters())

        def step(x, y):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss

        def stats():
            return (0, scaler.get_scale()) if scaler is not None else (0, None)

        return model, step, stats, (lambda x: _autocast_eval(model, x, autocast_dtype))

    def fx(model, policy, dtype):
        amp, opt = fxamp.initialize(model, adamw(model.parameters()), policy, dtype=dtype)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(amp(x), y)
            opt.backward(loss)
            opt.step()
            return loss

        return amp, step, (lambda: (opt.skipped_steps, opt.current_scale)), amp

    return {
        "float32": lambda m: plain(m),
        "autocast bfloat16": lambda m: plain(m, torch.bfloat16),
        "autocast float16 + GradScaler": lambda m: plain(m, torch.float16, torch.amp.GradScaler("cpu")),
        "fxamp O1 float16": lambda m: fx(m, "O1", torch.float16),
        "fxamp O1 bfloat16": lambda m: fx(m, "O1", torch.bfloat16),
        "fxamp O2 float16": lambda m: fx(m, "O2", torch.float16),
        "fxamp O2 bfloat16": lambda m: fx(m, "O2", torch.bfloat16),
    }


def _autocast_eval(model, x, dtype):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        return model(x).float()


def train_all(epochs: int, seed: int = 0, batch: int = 64, lr: float = 1e-3, only: Optional[List[str]] = None,
              log: Callable[[str], None] = print) -> List[Result]:
    """Train every variant for ``epochs`` epochs from the same initial weights and batch order."""
    xtr, ytr, xte, yte = load(seed)
    torch.manual_seed(seed)
    init = MLP().state_dict()
    order = torch.Generator().manual_seed(seed)
    batches = [torch.randperm(len(xtr), generator=order).split(batch) for _ in range(epochs)]
    results = []
    for name, build in variants(lr).items():
        if only and name not in only:
            continue
        model = MLP()
        model.load_state_dict(init)
        model, step, stats, forward = build(model)
        res = Result(name, fxamp=name.startswith("fxamp"))
        start = time.perf_counter()
        for epoch in batches:
            res.curve.extend(step(xtr[idx], ytr[idx]).item() for idx in epoch)
        res.seconds = time.perf_counter() - start
        with torch.no_grad():
            res.final_loss = F.cross_entropy(forward(xtr).float(), ytr).item()
            res.accuracy = (forward(xte).argmax(-1) == yte).float().mean().item()
        res.skipped, res.scale = stats()
        log(f"  {name:32s} loss {res.final_loss:.4f}  test accuracy {res.accuracy:.4f}  ({res.seconds:.1f}s)")
        results.append(res)
    return results


def check(results: List[Result]) -> List[str]:
    """The fxamp variants that land outside the margins, with why."""
    ref = next(r for r in results if r.name == "float32")
    bad = []
    for r in results:
        if not r.fxamp:
            continue
        rel = abs(r.final_loss - ref.final_loss) / ref.final_loss
        if rel > LOSS_MARGIN:
            bad.append(f"{r.name}: final loss {r.final_loss:.4f} is {rel:.1%} from float32's {ref.final_loss:.4f}")
        if r.accuracy < ref.accuracy - ACC_MARGIN:
            bad.append(f"{r.name}: test accuracy {r.accuracy:.4f} < float32's {ref.accuracy:.4f} - {ACC_MARGIN}")
    return bad


def table(results: List[Result]) -> str:
    ref = next(r for r in results if r.name == "float32")
    rows = [(r.name, f"{r.final_loss:.4f}", f"{(r.final_loss - ref.final_loss) / ref.final_loss:+.2%}",
             f"{r.accuracy:.4f}", r.skipped if r.fxamp else "", "" if r.scale is None else f"{r.scale:g}",
             f"{r.seconds:.1f}") for r in results]
    return tabulate(rows, headers=["variant", "final loss", "vs fp32", "test acc", "skipped", "loss scale", "s"],
                    disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few epochs, for the test (a few seconds)")
    parser.add_argument("--epochs", type=int, default=None, help="default 10, or 5 with --quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    epochs = args.epochs or (5 if args.quick else 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and the numbers do not depend on the machine
    try:
        print(f"digits, MLP 64-64-64-10, AdamW, {epochs} epochs, seed {args.seed}")
        results = train_all(epochs, seed=args.seed)
    finally:
        torch.set_num_threads(threads)
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    png = plot_loss_curves(results, os.path.join(args.out, "digits_loss.png"), title="digits MLP",
                           ylabel="training loss", log=True)
    if png:
        print(f"\nloss curves: {png}")
    bad = check(results)
    print(f"\nmargins: final loss within {LOSS_MARGIN:.0%} of float32's, test accuracy at most "
          f"{ACC_MARGIN} below: {'all fxamp variants within' if not bad else 'FAILED'}")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
