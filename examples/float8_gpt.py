"""Train a character GPT in bfloat16 O2 and with float8 matmuls (tensorwise, rowwise); compare the losses.

    python examples/float8_gpt.py [--quick] [--steps N] [--seed S] [--threads T]

The corpus is ``pydoc_data.topics`` (~0.47 M characters shipped with CPython), 90/10 into training
and validation text. The model is a GPT written here (pre-norm blocks, ``F.scaled_dot_product_attention``,
a GELU MLP, an untied head; width 128, 4 heads, 4 layers, 64-character context): every linear has K
and N multiples of 16, so each one can run in float8. Every variant starts from the same weights and
sees the same batches, through ``fxamp.initialize`` (float32 masters, AdamW). The float8 variants use
``":always"``: on a CPU the cost model would keep these small matmuls in bfloat16 (float8 runs
there through ``torch._scaled_mm``'s emulated path, for its numerics, not its speed). They keep the
output head (the logits) in bfloat16 with ``module_overrides={"head": "no_float8"}``, as torchao's
and Transformer Engine's users do by hand; ``--head-float8`` runs it in float8 too.

The table gives each variant's final validation loss (nats per character, the same validation
batches for all) and its distance from bfloat16 O2's; the run fails (exit 1) when a float8 variant
lands more than ``LOSS_MARGIN`` (relative) from it. The step times are this CPU's, where float8 is
emulated: they say nothing about a GPU.

Measured (seed 0, 300 steps, one thread, an Intel Xeon without bfloat16 kernels, 2026-11-27; validation
loss, and its distance from bfloat16 O2's 2.0976):

    variant                head in bfloat16     head in float8 (--head-float8)
    float8 tensorwise      2.1223 (+1.18%)      2.1463 (+2.32%: misses the 2% margin)
    float8 rowwise         2.1318 (+1.63%)      2.1141 (+0.78%)

With ``--seed 1`` (head in bfloat16): bfloat16 O2 2.1120, tensorwise 2.1057 (-0.30%), rowwise 2.1090
(-0.14%): the seeds do not separate the head's effect from run-to-run noise (docs/float8.md). A run
takes about 5-10 minutes here (bfloat16 has no fast kernel on this CPU); ``--quick`` a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

#: how far a float8 variant's final validation loss may land from bfloat16 O2's (relative)
LOSS_MARGIN = 0.02
VOCAB = 128  # the corpus's characters, padded to a multiple of 16 (the head's N)


@dataclass(frozen=True)
class Setup:
    steps: int = 300
    batch: int = 16
    block: int = 64
    width: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 2e-3
    eval_batches: int = 4
    seed: int = 0


QUICK = Setup(steps=15, batch=8, block=32, width=64, layers=2, heads=2, lr=3e-3, eval_batches=2)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # torch.fx traces it: no unpacking of shapes
        parts = self.qkv(self.ln1(x)).split(self.d, dim=-1)
        q, k, v = (parts[i].unflatten(-1, (self.heads, self.d // self.heads)).transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(-2))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT with ``layers`` blocks of width ``d``; ``benchmarks/float8_gpt.py`` times this same model."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, block: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(block, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def corpus() -> Tuple[torch.Tensor, torch.Tensor]:
    """Character ids of ``pydoc_data.topics``: (training, validation)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: min(i, VOCAB - 1) for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text])
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def batch(ids: torch.Tensor, s: Setup, gen: torch.Generator, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - s.block - 1, (size,), generator=gen)
    x = torch.stack([ids[i:i + s.block] for i in starts])
    y = torch.stack([ids[i + 1:i + s.block + 1] for i in starts])
    return x, y


@dataclass
class Result:
    name: str
    final_loss: float
    float8_nodes: int = 0
    step_ms: float = 0.0


def train(policy: str, s: Setup, train_ids: torch.Tensor, val_ids: torch.Tensor, head_float8: bool = False) -> Result:
    torch.manual_seed(s.seed)
    model = GPT(s.layers, s.width, s.heads, VOCAB, s.block)
    keep = {"module_overrides": {"head": "no_float8"}} if "float8" in policy and not head_float8 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp, opt = fxamp.initialize(model, torch.optim.AdamW(model.parameters(), lr=s.lr), policy, dtype="bf16",
                                    **keep)
    gen = torch.Generator().manual_seed(s.seed + 1)
    start = time.perf_counter()
    for _ in range(s.steps):
        x, y = batch(train_ids, s, gen, s.batch)
        loss = F.cross_entropy(amp(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    step_ms = 1e3 * (time.perf_counter() - start) / s.steps
    nodes = sum(1 for n in amp.graph.nodes
                if (d := n.meta.get("fxamp")) is not None and d.float8 is not None and d.float8.chosen)
    val_gen = torch.Generator().manual_seed(10_000)
    losses = []
    with torch.no_grad():
        for _ in range(s.eval_batches):
            x, y = batch(val_ids, s, val_gen, 4 * s.batch)
            losses.append(F.cross_entropy(amp(x).flatten(0, 1).float(), y.flatten()).item())
    return Result(policy, sum(losses) / len(losses), nodes, step_ms)


def check(results: List[Result]) -> List[str]:
    """The float8 variants farther than LOSS_MARGIN from the first (bfloat16 O2) result."""
    ref = results[0].final_loss
    misses = []
    for r in results[1:]:
        gap = abs(r.final_loss - ref) / ref
        if not gap <= LOSS_MARGIN:
            misses.append(f"{r.name}: final loss {r.final_loss:.4f} is {100 * gap:.1f}% from bfloat16 O2's {ref:.4f}")
    return misses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (15 steps, width 64, 2 layers)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (tiny float8 GEMMs: 1 is fastest)")
    parser.add_argument("--head-float8", action="store_true", help="run the output head in float8 too")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # a test calling main() keeps its own


def run(args: argparse.Namespace) -> int:
    s = QUICK if args.quick else Setup()
    s = Setup(**{**s.__dict__, "seed": args.seed, **({"steps": args.steps} if args.steps else {})})
    train_ids, val_ids = corpus()
    print(f"corpus: pydoc_data.topics, {len(train_ids)} training characters; GPT width {s.width}, {s.layers} layers, "
          f"{s.steps} steps of {s.batch}x{s.block}")
    results = [train(p, s, train_ids, val_ids, args.head_float8)
               for p in ("O2", "O2,float8=tensorwise:always", "O2,float8=rowwise:always")]
    ref = results[0].final_loss
    print(f"\n{'variant':<30} {'float8 matmuls':>14} {'val loss':>9} {'vs bf16 O2':>11} {'ms/step (CPU)':>14}")
    for r in results:
        print(f"{r.name:<30} {r.float8_nodes:>14} {r.final_loss:>9.4f} {100 * (r.final_loss - ref) / ref:>+10.2f}% "
              f"{r.step_ms:>14.1f}")
    misses = check(results)
    for line in misses:
        print(f"MISSED: {line}")
    if not misses:
        print(f"\nall float8 variants within {100 * LOSS_MARGIN:.0f}% of bfloat16 O2's validation loss")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
