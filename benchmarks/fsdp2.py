"""FSDP2 on 2 gloo ranks (CPU): fxamp's plan against FSDP2's own mixed precision: ``python -m benchmarks.fsdp2``.

``--backend nccl --world N`` runs it on N GPUs instead (one rank each; peak MiB is then the CUDA allocator's).

A GPT (``--layers`` blocks of width ``--d``, vocabulary 1024, 64 tokens, batch 4 per rank, AdamW lr 1e-3), each
recipe in fresh processes, the same weights and per-rank batches (4 per rank, in turn: learnt by heart, so the
loss moves), ``--steps`` steps:

fxamp            ``fxamp.convert_(model, "O1", dtype=bf16)`` + ``fxamp.shard(model)`` (float32 shards; the
                 weights only bfloat16 ops read all-gathered in bfloat16, the rest in float32; fxamp's per-op
                 casts) + ``fxamp.MixedPrecisionOptimizer``
fxamp f32 gather the same with ``fxamp.shard(model, gather_float32=["*"])``: every all-gather in float32
fsdp2+autocast   ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))`` per
                 block and at the root, forward under ``torch.autocast("cpu", bf16)`` (torchtitan's recipe)
fsdp2 bf16       the same policy without autocast (every op of the model in bfloat16: the silent-bf16 case)
fsdp2 fp32       no mixed precision: the reference loss

Per recipe: the loss at the last step (mean over ranks), its distance from fp32's, median step time
(steps 3..N), per-rank peak resident memory over the process's resident memory before the model was
built (``ru_maxrss``: coarse), per-rank persistent state (parameter shards + AdamW state, exact), and the
all-gather bytes and collectives of one step (step 2, untimed), counted by a dispatch mode that sees
each ``c10d`` all-gather and reduce-scatter FSDP2 issues (bytes of the whole gathered buffer).
Record ``lscpu`` beside the numbers (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

V, T, B, WORLD = 1024, 64, 4, 2
RECIPES = ("fxamp", "fxamp f32 gather", "fsdp2+autocast", "fsdp2 bf16", "fsdp2 fp32")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, 4, c // 4).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


def _run(rank, recipe, d, layers, steps, port, out, backend="gloo", world=WORLD):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import fxamp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = GPT(d, layers).to(device)
    bf16 = recipe in ("fsdp2+autocast", "fsdp2 bf16")
    if recipe.startswith("fxamp"):
        fxamp.shard(fxamp.convert_(model, "O1", dtype=torch.bfloat16),
                    gather_float32=["*"] if recipe == "fxamp f32 gather" else ())
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fx = recipe.startswith("fxamp")
    opt = fxamp.MixedPrecisionOptimizer(inner, model=model) if fx else inner
    times, losses, calls = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step % 4)  # 4 batches per rank, learnt by heart
        ids = torch.randint(0, V, (B, T), generator=g).to(device)
        start = time.perf_counter()
        with Collectives(calls) if step == 1 else contextlib.nullcontext():
            opt.zero_grad()
            with torch.autocast(device.type, torch.bfloat16, enabled=recipe == "fsdp2+autocast"):
                loss = model(ids)
            (opt.backward(loss) if fx else loss.backward())
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state = sum(p.to_local().numel() * 4 for p in model.parameters())
    state += sum(v.to_local().numel() * v.element_size() for s in inner.state.values() for v in s.values()
                 if hasattr(v, "to_local"))
    ag_bytes = sum(b for kind, b in calls if kind == "all-gather")
    collectives = len(calls)
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"  # exact on a GPU
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024)  # KiB -> MiB
    torch.save({"losses": losses, "time": statistics.median(times[2:]), "peak": peak, "state": state,
                "ag": ag_bytes, "collectives": collectives}, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


class Collectives(TorchDispatchMode):
    """Appends (kind, bytes of the whole buffer) for each c10d all-gather and reduce-scatter dispatched within."""

    def __init__(self, calls=None):
        super().__init__()
        self.calls = [] if calls is None else calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        kind = "all-gather" if "allgather" in name else "reduce-scatter" if "reduce_scatter" in name else None
        if name.startswith("c10d::") and kind:
            whole = max((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), key=torch.Tensor.numel)
            self.calls.append((kind, whole.numel() * whole.element_size()))
        return func(*args, **(kwargs or {}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="at least 3: the step time is the median after two")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: one rank per GPU, on CUDA (peak MiB is then the allocator's)")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks (nccl: at most the GPUs there are)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first two steps capture and warm up; the time is "
                     f"the median of the rest)")
    rows = {}
    for recipe in RECIPES:
        with tempfile.TemporaryDirectory() as out, socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_run, args=(recipe, args.d, args.layers, args.steps, port, out, args.backend, args.world),
                     nprocs=args.world, join=True)
            rows[recipe] = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(args.world)]
    ref = [statistics.mean(r["losses"][i] for r in rows["fsdp2 fp32"]) for i in range(args.steps)]
    print(f"GPT d{args.d} x{args.layers} layers, vocabulary {V}, {T} tokens x {B} per rank, {args.world} {args.backend} ranks, "
          f"{args.steps} AdamW steps")
    print("| recipe | loss at step 1 - fp32's | loss at step N | - fp32's | step ms (median) | peak MiB/rank | "
          "state MiB/rank | all-gather MiB/step | collectives/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for recipe, ranks in rows.items():
        loss = [statistics.mean(r["losses"][i] for r in ranks) for i in range(args.steps)]
        print(f"| {recipe} | {loss[0] - ref[0]:+.1e} | {loss[-1]:.4f} | {loss[-1] - ref[-1]:+.1e} | "
              f"{1e3 * max(r['time'] for r in ranks):.1f} | {max(r['peak'] for r in ranks):.0f} | "
              f"{max(r['state'] for r in ranks) / 2**20:.2f} | {ranks[0]['ag'] / 2**20:.2f} | "
              f"{ranks[0]['collectives']} |")


if __name__ == "__main__":
    main()
