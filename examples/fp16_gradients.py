"""Why float16 training needs loss scaling, on your own model: Micikevicius et al. (2017), Figure 3.

    python examples/fp16_gradients.py [--quick] [--out examples/out/] [--steps N] [--seed S]

A small per-token MLP learns a dense regression whose targets are small (around 1e-4) and
whose loss is a mean over every output value, as dense-prediction losses are: its gradients are
tiny.  The script

1. asks ``fxamp.report(..., gradients=True)`` where the gradients fall against float16's range:
   the fraction float16 would flush to zero without loss scaling, per parameter and node, the
   scale fxamp's dynamic scaler settles on, and a PNG of the histogram of log2|gradient| (the
   paper's Figure 3) with float16's normal and subnormal ranges and the scale's shift;
2. trains the same model from the same weights on the same batches in float32, in fxamp O2
   float16 *without* loss scaling (``loss_scale="none"``), and in fxamp O2 float16 with fxamp's
   dynamic loss scaling (``fxamp.MixedPrecisionOptimizer``), and prints a table.

Unscaled, every gradient value underflows to zero and the float16 model does not learn at all;
scaled by 2^16, it follows float32.  The run fails (exit 1) unless float32 at least halves its loss,
unscaled float16 keeps 95% of it, and scaled float16 lands within ``SCALED_MARGIN`` of float32.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
from tabulate import tabulate

import fxamp

SCALED_MARGIN = 0.10  # scaled float16 vs float32: relative final loss
LEARNED = 0.5  # float32 must at least halve its loss
STUCK = 0.95  # unscaled float16 keeps at least 95% of its first loss: its gradients are all zero
TOKENS, FEATURES, HIDDEN, OUT = 64, 16, 64, 16


class TokenMLP(nn.Module):
    """A per-token MLP (dense prediction): (batch, tokens, FEATURES) -> (batch, tokens, OUT)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            self.head.weight.zero_()  # start at zero, as output layers often do
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_data(n_batches: int, batch: int, seed: int):
    """Targets from a fixed random teacher, scaled to around 1e-4."""
    g = torch.Generator().manual_seed(seed + 1000)
    teacher = torch.randn(FEATURES, OUT, generator=g) / FEATURES ** 0.5
    data = []
    for _ in range(n_batches):
        x = torch.randn(batch, TOKENS, FEATURES, generator=g)
        data.append((x, 1e-4 * torch.tanh(x @ teacher)))
    return data


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()  # a mean over every value: gradients of order 1/numel


@dataclass
class Run:
    name: str
    curve: List[float] = field(default_factory=list)
    final: float = float("nan")
    scale: str = "-"
    skipped: int = 0
    zero_grads: float = 0.0  # fraction of parameter-gradient values exactly zero, last step
    model: Optional[nn.Module] = None


def train(name: str, model: nn.Module, data, steps: int, *, policy: Optional[str], loss_scale: str) -> Run:
    run = Run(name)
    if policy is None:
        net = model
        opt = torch.optim.Adam(net.parameters(), lr=3e-4)
    else:
        net = fxamp.convert(model, policy, dtype=torch.float16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.Adam(net.parameters(), lr=3e-4), model=net,
                                            loss_scale=loss_scale)
    for step in range(steps):
        x, y = data[step % len(data)]
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        if policy is None:
            loss.backward()
            opt.step()
        else:
            opt.backward(loss)
            opt.step()
        run.curve.append(float(loss.detach()))
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    run.zero_grads = sum(int((g == 0).sum()) for g in grads) / max(sum(g.numel() for g in grads), 1)
    with torch.no_grad():
        run.final = sum(float(loss_fn(net(x), y)) for x, y in data) / len(data)
    if policy is not None:
        run.scale = f"{opt.current_scale:g}" if opt.current_scale is not None else "none"
        run.skipped = opt.skipped_steps
    run.model = net
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (the test runs this)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    steps = args.steps or (100 if args.quick else 600)
    torch.manual_seed(args.seed)
    data = make_data(8, 8 if args.quick else 32, args.seed)
    model = TokenMLP()

    runs = [train("float32", _copy(model), data, steps, policy=None, loss_scale="none"),
            train("fxamp O2 float16, no loss scaling", _copy(model), data, steps, policy="O2", loss_scale="none"),
            train("fxamp O2 float16, dynamic loss scaling", _copy(model), data, steps, policy="O2",
                  loss_scale="dynamic")]

    # where the gradients of the (float32-trained) model fall against float16's range
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "fp16_gradients.png")
    x, y = data[0]
    options = dict(gradients=True, loss_fn=lambda out: loss_fn(out, y))
    try:
        rep = fxamp.report(runs[0].model, "O2", example_inputs=(x,), plot=png, **options)
    except ImportError as e:  # matplotlib is optional
        print(f"note: {e}")
        rep, png = fxamp.report(runs[0].model, "O2", example_inputs=(x,), **options), None
    print("\n".join(rep.gradients.summary_lines()))
    if png:
        print(f"histogram of log2|gradient|: {png}")
    print()
    print(tabulate([[r.name, f"{r.curve[0]:.3g}", f"{r.final:.3g}", f"{r.final / runs[0].final:.2f}x",
                     f"{100 * r.zero_grads:.1f}%", r.scale, r.skipped] for r in runs],
                   headers=["run", "first loss", "final loss", "vs float32", "zero grads", "loss scale", "skipped"],
                   tablefmt="github"))
    ref, unscaled, scaled = runs
    learned = ref.final <= LEARNED * ref.curve[0]
    stuck = unscaled.final >= STUCK * unscaled.curve[0]
    close = abs(scaled.final - ref.final) <= SCALED_MARGIN * ref.final
    ok = learned and stuck and close
    print(f"\n{'ok' if ok else 'FAILED'}: float32 learned (loss x{ref.final / ref.curve[0]:.2f}); float16 without "
          f"loss scaling did not (x{unscaled.final / unscaled.curve[0]:.2f}); with fxamp's dynamic loss scaling it "
          f"lands at {scaled.final / ref.final:.2f}x float32's loss")
    return 0 if ok else 1


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    sys.exit(main())
