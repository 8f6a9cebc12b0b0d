"""Convert a small model with fxamp and show what it did: the decisions, the casts, the numbers.

    python examples/quickstart.py [--policy O2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import fxamp


class Block(nn.Module):
    """A tiny transformer-style block: attention written with matmul + softmax, LayerNorm, a GELU MLP."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="O1")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Block()
    amp = fxamp.convert(model, args.policy, dtype=args.dtype)
    print(f"policy {args.policy}: {fxamp.conversion_info(amp).policy}\n")

    rows = [(n.name, d.op, d.category.value, "as input" if d.compute is None else str(d.compute)[6:], d.reason[:70])
            for n in amp.graph.nodes if (d := n.meta.get("fxamp")) and n.op.startswith("call")]
    print(tabulate(rows, headers=["node", "op", "category", "compute", "reason"]))
    casts = [n for n in amp.graph.nodes if "fxamp_cast" in n.meta]
    print(f"\n{len(casts)} casts inserted:")
    for n in casts:
        src, dtype = n.meta["fxamp_cast"]
        print(f"  {src.name} -> {str(dtype)[6:]} before {next(iter(n.users)).name}")

    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        ref, out = model(x), amp(x)
    err = (out - ref).abs().max().item()
    print(f"\noutput {tuple(out.shape)} {out.dtype}; max |fxamp - fp32| = {err:.2e}")
    print("\ngenerated forward:\n" + amp.code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
