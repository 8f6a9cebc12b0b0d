"""``fxamp.convert_`` on patterns of models nobody here wrote (issue 37): vision stems and stages, causal
masks held as buffers, attention-pooling heads, blocks no front end can capture.

Each model is small and of our own, written as the public libraries write theirs; each check is against the
float32 original (outputs, running statistics, which buffers a call changes) or against the whole-model
conversion.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.blocks import converted_modules, family_of, find_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

C, D, T = 8, 16, 8


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def buffers(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def same_buffers(model, before):
    return {n for n, b in model.named_buffers() if not torch.equal(b, before[n])}


def families(model, glue=None):
    found = {id(family_of(m)): family_of(m) for _, m in converted_modules(model)}.values()
    return [f for f in found if glue is None or f.glue is glue]


# -- item 2: a batch norm outside the blocks ------------------------------------------------------------------

class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return x + F.relu(self.conv(x))


class StemNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(2))
        self.head = nn.Linear(C, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def images(seed, b=2):
    return torch.randn(b, 3, 6, 6, generator=torch.Generator().manual_seed(seed)) * 2 + 1


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("eval_first", [True, False], ids=["eval-then-convert", "convert-then-eval"])
def test_a_batch_norm_outside_the_blocks_follows_train_and_eval(policy, eval_first):
    """A stem's BatchNorm2d (glue) normalises with its running statistics in eval mode and changes no buffer
    there, the first call (which captures) included; in training mode it updates them as the original does."""
    torch.manual_seed(0)
    ref = StemNet()
    for seed in (1, 2):  # running statistics away from their initial 0 and 1
        ref(images(seed))
    model = copy.deepcopy(ref)
    if eval_first:
        model.eval()
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    model.eval()
    ref.eval()
    before = buffers(model)
    with torch.no_grad():
        for seed in (3, 4):
            assert rel(model(images(seed)), ref(images(seed))) < 0.02
    assert same_buffers(model, before) == set()  # (before: batch statistics, each call moved the running ones)
    model.train()
    ref.train()
    for seed in (5, 6):
        model(images(seed))
        ref(images(seed))
    bn, ref_bn = model.stem[1], ref.stem[1]
    assert torch.allclose(bn.running_mean, ref_bn.running_mean, atol=0.02, rtol=0.02)
    assert torch.allclose(bn.running_var, ref_bn.running_var, atol=0.02, rtol=0.02)
    assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == 4


def test_a_capture_never_changes_the_blocks_buffers():
    """torch.fx with the call's values runs the forward to capture it: on copies of the buffers, so a batch
    norm's statistics move once per training call (the graph's), not twice, and not at all in eval."""
    torch.manual_seed(0)
    ref = StemNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    model(images(1))
    ref(images(1))
    assert torch.allclose(model.stem[1].running_mean, ref.stem[1].running_mean, atol=0.01)
    assert int(model.stem[1].num_batches_tracked) == 1


class ShapedNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(D, D), nn.BatchNorm1d(D)

    def forward(self, x):
        h = self.bn(self.fc(x).reshape(-1, D))
        return x + h.view(*x.shape[:-1], -1)  # a shape unpacked: captured with the call's values


class Stack(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_an_eval_call_that_captures_a_block_with_its_values_changes_no_buffer():
    """The capture runs the block's forward in training mode on the call's values: its batch norm runs on
    copies of the statistics, not on the block's own."""
    torch.manual_seed(0)
    ref = Stack(ShapedNormBlock(), ShapedNormBlock())
    ref(torch.randn(2, 3, D) * 3 + 1)
    ref.eval()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    before = buffers(model)
    x = torch.randn(2, 3, D)
    with torch.no_grad():
        assert rel(model(x), ref(x)) < 0.02
    assert same_buffers(model, before) == set()


# -- item 10: a causal mask buffer, inverted in forward ------------------------------------------------------

class CausalAttention(nn.Module):
    """nanoGPT's and minGPT's attention: a bool mask buffer, inverted and sliced to a size read off it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        n = self.mask.size(0)
        q, k, v = self.qkv(x).split(D, 2)
        att = (q @ k.transpose(1, 2)) / math.sqrt(D)
        att = att.masked_fill(~self.mask[:n, :n], float("-inf"))
        return self.proj(F.softmax(att, -1) @ v)


class GPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(D), CausalAttention()

    def forward(self, x):
        return x + self.attn(self.ln(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(3))
        self.head = nn.Linear(D, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_mask_buffer_inverted_in_forward_is_each_blocks_own(policy):
    """torch.fx folds ``~self.mask`` into a constant of the traced instance; the graph reads each block's own
    mask instead: blocks whose masks differ (a local window in one) share one graph and compute their own."""
    torch.manual_seed(0)
    ref = GPT()
    ref.blocks[1].attn.mask &= torch.ones(T, T, dtype=torch.bool).triu(-1)  # a window of 2 in block 1 only
    model = copy.deepcopy(ref)
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    assert rel(out, ref(ids)) < 0.02
    (family,) = families(model, glue=False)
    assert family.captures == 1 and len(family.paths) == 3
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    opt.backward(out.square().mean())
    assert all(p.grad is not None for p in model.blocks.parameters())


class FrozenBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.frozen = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():  # torch.export keeps the region as a graph of its own (a higher-order op's body)
            gate = self.frozen(x)
        return x + self.fc(x) * gate


def test_a_no_grad_region_in_a_block_is_one_graph_every_instance_runs():
    torch.manual_seed(0)
    ref = Stack(FrozenBranch(), FrozenBranch())
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = torch.randn(2, 3, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # converted, not run as written
        out = model(x)
    assert rel(out, ref(x)) < 0.02
    out.sum().backward()
    assert model.blocks[1].frozen.weight.grad is None and model.blocks[1].fc.weight.grad is not None  # the frozen layer stays
    (family,) = families(model, glue=False)
    assert family.captures == 1 and not family.as_written


class SizeOneBlock(nn.Module):
    """Branches on a size that can be 1; its no_grad region makes torch.fx (and torch.fx with the call's values)
    refuse it, so torch.export captures it, assuming sizes 0 and 1 away (no guard records the branch)."""

    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))
        h = self.fc(x) * g
        return h * 100.0 if x.size(0) == 1 else h


def _autocast_close(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * max([1.0, *want.abs().flatten().tolist()]),
                               rtol=0.02)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_block_torch_export_captured_runs_the_branch_of_size_one_and_zero(policy):
    """Issue 37: the family ran its export graph's code for a batch of 1 with no input check: the other branch,
    silently (10^4 off through two blocks).  A call outside the family's captured range now captures again."""
    torch.manual_seed(0)
    ref = Stack(SizeOneBlock(), SizeOneBlock())
    model = copy.deepcopy(ref)
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    family = family_of(model.blocks[0])
    with torch.no_grad():
        for n in (3, 1, 0, 4, 1):
            x = torch.randn(n, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = ref(x)  # the original's branch for this size, at autocast's precision
            got = model(x)
            _autocast_close(got, want)
            if n == 1:
                assert got.abs().max() > 100  # the size-1 branch, twice (x10^4)
    graphs = [g for variants in family.graphs.values() for g in variants]
    assert len(graphs) == 3 and {g.frontend for g in graphs} == {"export"}  # sizes >= 2, 1 and 0
    assert family.captures == 3


def test_a_block_torch_export_captured_captures_once_for_sizes_three_five_seven():
    torch.manual_seed(0)
    model = Stack(SizeOneBlock(), SizeOneBlock())
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    with torch.no_grad():
        for n in (3, 5, 7):
            model(torch.randn(n, 4))
    assert family_of(model.blocks[0]).captures == 1


class NarrowBranch(SizeOneBlock):
    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))
        h = self.fc(x) * g
        return h * 100.0 if x.size(0) > 2 else h  # export holds its capture for sizes > 2 (or <= 2) only


def test_a_block_captured_for_a_narrower_range_captures_again_outside_it():
    torch.manual_seed(0)
    ref = Stack(NarrowBranch())
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    with torch.no_grad():
        for n in (4, 2, 6, 2):
            x = torch.randn(n, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = ref(x)
            _autocast_close(model(x), want)
    assert family_of(model.blocks[0]).captures == 2  # sizes > 2, then 2 (a variant of the same range class)


# -- item 11: blocks in an nn.Sequential ---------------------------------------------------------------------

class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C)
        self.c2, self.b2 = nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    """torchvision's layout: a stem, stages that are Sequentials of residual blocks, an MLP head in a Sequential."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU())
        self.layer1 = nn.Sequential(Residual(), Residual())
        self.layer2 = nn.Sequential(Residual(), Residual())
        self.head = nn.Sequential(nn.Linear(C, C), nn.ReLU(), nn.Linear(C, 4))

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


class ViTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """timm's layout: ``self.blocks = nn.Sequential(*blocks)``."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(12, D)
        self.blocks = nn.Sequential(*[ViTBlock() for _ in range(3)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.patch(x))).mean(1))


def test_blocks_in_a_sequential_are_found_and_the_sequential_still_runs_them():
    torch.manual_seed(0)
    assert find_blocks(ResNet()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert find_blocks(ViT()) == ["blocks.0", "blocks.1", "blocks.2"]  # (the MLP's Linear layers are glue)
    for ref, x in ((ResNet(), images(1)), (ViT(), torch.randn(2, 5, 12))):
        model = copy.deepcopy(ref)
        fxamp.convert_(model, "O1", dtype=torch.bfloat16)
        whole = fxamp.convert(copy.deepcopy(ref), "O1", dtype=torch.bfloat16)
        for mode in (True, False):
            for m in (model, whole, ref):
                m.train(mode)
            out = model(x)
            assert rel(out, ref(x)) < 0.02, (type(ref).__name__, mode)
            if isinstance(ref, ViT):
                assert torch.equal(out, whole(x))  # the whole-model conversion's decisions, bitwise
        (family,) = families(model, glue=False)
        assert family.captures == 1  # one capture serves every block of every stage
        assert type(model.blocks if isinstance(ref, ViT) else model.layer1).__name__ == "Sequential"


# -- item 12: nn.MultiheadAttention outside the blocks --------------------------------------------------------

class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class PoolNet(nn.Module):
    """An attention-pooling head (CLIP's, SigLIP's): nn.MultiheadAttention reads ``out_proj.weight`` itself; the
    logits reuse the input projection's weight, read by a method of the root that forward calls. Reads of a
    weight's shape, and methods forward never calls, read no values."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(2))
        self.query = nn.Parameter(torch.randn(1, 1, D))
        self.pool = nn.MultiheadAttention(D, 4, batch_first=True)
        self.extra = nn.Linear(D, D)

    def forward(self, x):
        x = self.extra(self.inp(x))[..., :self.extra.weight.shape[0]]
        for block in self.blocks:
            x = block(x)
        pooled = self.pool(self.query.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0][:, 0]
        return self.logits(pooled)

    def logits(self, pooled):
        return F.linear(pooled, self.inp.weight)

    def reset(self):
        self.extra.weight.data.zero_()


def test_a_weight_code_reads_directly_keeps_the_dtype_that_code_expects_under_o2():
    torch.manual_seed(0)
    ref = PoolNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert model.pool.out_proj.weight.dtype == torch.float32 and model.inp.weight.dtype == torch.float32
    assert model.blocks[0].fc.weight.dtype == model.extra.weight.dtype == torch.bfloat16  # (only graphs read them)
    note = next(n for n in fxamp.conversion_info(model).notes if n.startswith("kept float32"))
    assert "inp.weight" in note and "pool.out_proj.weight" in note and "blocks" not in note
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    x = torch.randn(2, 5, D)
    out = model(x)
    assert rel(out, ref(x)) < 0.02
    opt.backward(out.square().mean())
    opt.step()


# -- item 13: a block no front end can capture ----------------------------------------------------------------

class Tape:
    """An object a block is given (a cache, a logger): torch.export cannot take it."""

    def __init__(self):
        self.seen = 0


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(D, D), nn.BatchNorm1d(D)

    def forward(self, x, tape):
        tape.seen += 1
        h = self.bn(self.fc(x))
        if bool((h.abs() > 1e4).any()):  # a branch on tensor data: no torch.fx trace can take it
            h = h.clamp(-1e4, 1e4)
        return x + h


class BranchyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Branchy() for _ in range(2))
        self.head = nn.Linear(D, 4)

    def forward(self, x, tape):
        for block in self.blocks:
            x = block(x, tape)
        return self.head(x)


def test_a_block_no_front_end_can_capture_runs_as_written_and_is_named_once():
    """It runs its class's own forward in float32: under O2 on float32 values of its stored bfloat16 weights,
    whose gradients reach them (the optimizer steps them); its buffers update as the original's."""
    torch.manual_seed(0)
    ref = BranchyNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert model.blocks[0].fc.weight.dtype == torch.bfloat16
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    x = torch.randn(4, D)
    with pytest.warns(RuntimeWarning, match=r"block 'blocks.0' \(Branchy\) and the 1 other\(s\) of its family "
                                            r"run\(s\) as written \(unconverted, float32\)") as caught:
        out = model(x, Tape())
    # the line no front end could take, named in the model's code
    assert "at test_blocks_patterns.py:" in str(caught[0].message) and "`if bool((h.abs() > 1e4).any()):" in \
        str(caught[0].message), caught[0].message
    assert rel(out, ref(x, Tape())) < 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named once
        tape = Tape()
        again = model(x, tape)
    assert tape.seen == 2 and rel(again, ref(x, Tape())) < 0.02
    assert torch.allclose(model.blocks[1].bn.running_mean, ref.blocks[1].bn.running_mean, atol=0.01)
    assert int(model.blocks[1].bn.num_batches_tracked) == 2
    assert model.blocks[0].fc.weight.dtype == torch.bfloat16  # stored as converted, after the call too
    before = model.blocks[0].fc.weight.detach().clone()
    opt.backward(again.square().mean())
    assert model.blocks[0].fc.weight.grad.dtype == torch.bfloat16
    opt.step()
    assert not torch.equal(model.blocks[0].fc.weight, before)
    assert model.state_dict()["blocks.0.fc.weight"].dtype == torch.float32
    assert any("'blocks.0' (Branchy)" in n and "as written" in n for n in fxamp.report(model).notes)


class Windowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, size):
        h, w = size
        return x + self.fc(x).view(x.shape[0], h, w, D).flip(1).flatten(1, 2)


class WindowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Windowed() for _ in range(2))

    def forward(self, x, size):
        for block in self.blocks:
            x = block(x, size)
        return x


def test_a_size_argument_is_a_constant_of_the_call():
    """A ``torch.Size`` (a shape passed on, Swin's ``input_resolution``) is a shape, not an object: the block is
    captured, once per size."""
    torch.manual_seed(0)
    ref = WindowNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for h, w in ((2, 3), (3, 2), (2, 3)):
            x = torch.randn(2, h * w, D)
            assert rel(model(x, torch.Size([h, w])), ref(x, torch.Size([h, w]))) < 0.02
    (family,) = families(model)
    assert family.captures == 2 and not family.as_written


def _sharded_gpt_losses(rank, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(_gpt_losses(rank), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _gpt_losses(rank=None):
    """Three AdamW steps of the mask-buffer GPT converted in place: sharded on two ranks (``rank``), or in
    one process on both ranks' batches (FSDP2 averages the gradients)."""
    torch.manual_seed(0)
    model = fxamp.convert_(GPT(), "O1", dtype=torch.bfloat16)
    if rank is not None:
        model = fxamp.shard(model)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    losses = []
    for step in range(3):
        batches = [torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(100 * r + step))
                   for r in ([rank] if rank is not None else [0, 1])]
        loss = sum(F.cross_entropy(model(b).flatten(0, 1), b.roll(-1, 1).flatten()) for b in batches) / len(batches)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_shard_takes_the_gpt_with_a_mask_buffer(tmp_path):
    """``fxamp.shard`` builds on ``convert_``: the same GPT, on two gloo ranks, trains as in one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_gpt_losses, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    sharded = [(a + b) / 2 for a, b in zip(*ranks)]
    assert sharded == pytest.approx(_gpt_losses(), rel=1e-4)


class _SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, h):
        return h + self.q(self.norm(h))


class _SharedDepth(nn.Module):
    """One block's weights shared across depth (ALBERT, universal transformers): ``ModuleList([block] * 3)``."""

    def __init__(self) -> None:
        super().__init__()
        block = _SharedBlock()
        self.layers = nn.ModuleList([block] * 3)
        self.head = nn.Linear(8, 2)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_one_block_repeated_in_a_module_list_is_found_and_converted_once(policy):
    # issue 37 probe: children() lists a repeated module once, so no block was found ("no nn.ModuleList ...")
    model = _SharedDepth()
    ref = copy.deepcopy(model)
    assert find_blocks(model) == ["layers.0"]
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    assert model.layers[0] is model.layers[1] is model.layers[2]
    x = torch.randn(3, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=0.05, rtol=0.05)


class _Stages(nn.Module):
    """Stages of layers as a list of lists (PoolFormer's ``encoder.block``): each stage a ModuleList, no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.ModuleList([_SharedBlock()]), nn.ModuleList([_SharedBlock(), _SharedBlock()])])
        self.head = nn.Linear(8, 2)

    def forward(self, h):
        for stage in self.stages:
            for layer in stage:
                h = layer(h)
        return self.head(h)


def test_a_list_of_lists_of_layers_converts_the_layers():
    # a ModuleList of ModuleLists was taken as two blocks that nothing calls: their layers ran as written on
    # bfloat16 weights under O2 ("Input type (float) and bias type (c10::BFloat16) should be the same")
    model = _Stages()
    ref = copy.deepcopy(model)
    assert find_blocks(model) == ["stages.0.0", "stages.1.0", "stages.1.1"]
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=0.05, rtol=0.05)


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, h):
        return h + torch.tanh(self.mix(self.norm(h)))


class _Hybrid(nn.Module):
    """A hybrid stack, one layer of each class in a small config (Jamba's attention and Mamba layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_SharedBlock(), _Mixer()])
        self.head = nn.Linear(8, 2)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_stack_of_layers_of_several_classes_converts_each():
    # one of each class: convert_ found "no blocks" (it took only classes a list holds two or more of)
    model = _Hybrid()
    ref = copy.deepcopy(model)
    assert find_blocks(model) == ["layers.0", "layers.1"]
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert [p for p, _ in converted_modules(model)] == ["layers.0", "layers.1", "head"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=0.05, rtol=0.05)


class LocalBlock(nn.Module):
    """LongT5's local attention, shortened: the sequence padded to a multiple of the block length with a pad list
    built from the rank and changed in place, then split into blocks."""

    def __init__(self, block_len=3):
        super().__init__()
        self.block_len = block_len
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        h = self.proj(self.norm(x))
        pad = [(0, 0)] * h.ndim
        pad[1] = (0, -h.shape[1] % self.block_len)
        h = F.pad(h, sum(pad[::-1], ()))
        blocks = h.reshape(h.shape[0], h.shape[1] // self.block_len, self.block_len, D)
        mixed = blocks.softmax(dim=2).mean(dim=2, keepdim=True).expand_as(blocks)
        return x + mixed.reshape(h.shape)[:, :x.shape[1]]


def test_a_block_that_changes_a_list_it_built_converts_in_place():
    """convert_ captures the block with the concrete front end: the list's reads after its change stay after it
    (LongT5 in place failed at its first call), for lengths that pad and lengths that do not."""
    torch.manual_seed(0)
    model = nn.Sequential(LocalBlock(), LocalBlock())
    amp = fxamp.convert_(copy.deepcopy(model), "O2", dtype=torch.bfloat16)
    for n in (8, 9, 7):
        x = torch.randn(2, n, D)
        assert rel(amp(x), model(x)) < 2e-2, n
