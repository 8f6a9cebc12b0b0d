"""Two real processes (gloo, 127.0.0.1) under DistributedDataParallel: an inf on one rank skips both."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 4
POISONED = 2  # the step at which rank 0 alone sees an inf


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.ln(self.fc1(x))))


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank, sync):
    torch.manual_seed(0)  # same weights on both ranks
    model = fxamp.convert(Net(), "O2", dtype=torch.float16)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2), model=ddp,
                                        sync_overflow=sync)
    stepped, names = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)  # different data per rank
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        opt.backward(F.cross_entropy(ddp(x), y))  # DDP averages the gradients here
        if step == POISONED and rank == 0:
            model.fc2.weight.grad[0, 0] = float("inf")  # after the all-reduce: only rank 0 sees it
        stepped.append(opt.step())
        names.append(opt.overflowed_params())
    flat = torch.cat([p.detach().float().flatten() for p in [*model.parameters(), *opt.master_params()]])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return {"stepped": stepped, "names": names, "scale": opt.current_scale,
            "same_params": all(torch.equal(every[0], t) for t in every)}


def _worker(rank, world, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = {"synced": _train(rank, sync=True), "unsynced": _train(rank, sync=False)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_overflow_on_one_rank_skips_on_every_rank(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    expected = [step != POISONED for step in range(STEPS)]
    for r in (r0, r1):
        assert r["synced"]["stepped"] == expected
        assert r["synced"]["same_params"]
    assert r0["synced"]["scale"] == r1["synced"]["scale"] == 2.0**15
    assert r0["synced"]["names"][POISONED] == ["module.fc2.weight"]  # the rank that saw it names it
    assert r1["synced"]["names"][POISONED] == []
    # the control: without the all-reduce rank 1 steps while rank 0 skips, and the replicas drift apart
    assert r0["unsynced"]["stepped"] == expected and all(r1["unsynced"]["stepped"])
    assert not r0["unsynced"]["same_params"]
