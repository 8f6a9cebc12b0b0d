"""Float32 islands recomputed in backward (issue 40): bytes saved for backward, bitwise gradients, options,
the report, in-place conversion, activation checkpointing, torch.compile."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxamp
from fxamp.conversion.graph import DECISION
from fxamp.conversion.runtime.recompute import island_output

BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class LM(nn.Module):
    """The issue's GPT: the loss inside forward, as Hugging Face models compute it with ``labels=``.

    upcast: the loss reads ``logits.float()`` (Hugging Face's ``ForCausalLMLoss``); else the bfloat16 logits
    (the pure bfloat16 baseline then runs its loss in bfloat16; fxamp and autocast cast them up).
    """

    def __init__(self, vocab=8192, seq=64, d=128, layers=2, heads=2, upcast=True):
        super().__init__()
        self.upcast = upcast
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, labels):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = self.run(block, x)
        logits = self.head(self.ln(x))
        if self.upcast:
            logits = logits.float()
        shift, target = logits[:, :-1, :].contiguous(), labels[:, 1:].contiguous()
        return F.cross_entropy(shift.view(-1, shift.size(-1)), target.view(-1)), logits

    def run(self, block, x):
        return block(x)


class CheckpointedLM(LM):
    def run(self, block, x):
        return checkpoint(block, x, use_reentrant=False)


def saved_bytes(fn) -> int:
    """Bytes one forward saves for backward: unique storages (tensors a checkpoint keeps are inside its hooks)."""
    saved = {}
    keep = []

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out, keep
    return sum(saved.values())


def gradients(model, x, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", BF16, enabled=autocast):
        loss = model(x, x)[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    return torch.randint(0, 8192, (8, 64))


@pytest.mark.parametrize("upcast", [True, False])
def test_bytes_saved_for_backward_within_10_percent_of_pure_bf16(data, upcast):
    torch.manual_seed(0)
    model = LM(upcast=upcast)
    pure = copy.deepcopy(LM(upcast=False)).to(BF16)  # pure bf16, its loss in bf16
    pure.load_state_dict(model.state_dict())
    pure = pure.to(BF16)
    limit = 1.10 * saved_bytes(lambda: pure(data, data))
    with torch.autocast("cpu", BF16):
        autocast = saved_bytes(lambda: model(data, data))
    for policy in ("O1", "O2"):
        on = fxamp.convert(model, policy, dtype=BF16)
        off = fxamp.convert(model, policy, dtype=BF16, recompute_islands=False)
        assert saved_bytes(lambda: on(data, data)) <= limit, policy
        assert saved_bytes(lambda: off(data, data)) > 1.3 * limit  # the float32 log-probabilities, as autocast
        assert saved_bytes(lambda: off(data, data)) <= autocast


@pytest.mark.parametrize("upcast", [True, False])
def test_o1_gradients_stay_bitwise_autocast(data, upcast):
    torch.manual_seed(0)
    model = LM(upcast=upcast)
    ref = gradients(model, data, autocast=True)
    amp = fxamp.convert(model, "O1", dtype=BF16)
    assert any(n.target is island_output for n in amp.graph.nodes)
    assert same(gradients(amp, data), ref)


def test_o2_gradients_equal_without_recompute(data):
    torch.manual_seed(0)
    model = LM()
    on = fxamp.convert(model, "O2", dtype=BF16)
    off = fxamp.convert(model, "O2", dtype=BF16, recompute_islands=False)
    with pytest.warns(RuntimeWarning, match="MixedPrecisionOptimizer"):
        assert same(gradients(on, data), gradients(off, data))
    assert torch.equal(on(data, data)[1], off(data, data)[1])  # the float32 logits returned as well


def test_no_grad_and_eval_run_the_island_as_written(data):
    model = LM()
    amp = fxamp.convert(model, "O1", dtype=BF16)
    with torch.no_grad():
        a = amp(data, data)
    b = amp(data, data)
    assert torch.equal(a[0], b[0].detach()) and torch.equal(a[1], b[1].detach())


def test_the_report_shows_each_island_with_the_dtype_kept_and_the_bytes_saved(data):
    torch.manual_seed(0)
    model = LM(vocab=512, upcast=False)
    x = data % 512
    rep = fxamp.report(model, "O1", example_inputs=(x, x), dtype=BF16)
    cells = {r.node: r.recompute for r in rep.rows if r.recompute is not None}
    assert cells["cross_entropy"].chosen and cells["cross_entropy"].saved_dtype == "bfloat16"
    first = [c for c in cells.values() if c.first]
    assert len(first) == 1 and first[0].bytes_saved == 8 * 63 * 512 * 2  # float32 logits less their bf16 copy
    assert "  cross_entropy: recomputed, keeps bfloat16 for backward, 516kB less" in rep.to_table()
    assert "bf16 -516kB: recomputed in backward" in rep.to_table(wide=True)
    assert "recompute_bytes_saved" in rep.to_csv().splitlines()[0]
    assert rep.to_dict()["rows"][[r.node for r in rep.rows].index("cross_entropy")]["recompute"]["chosen"]
    off = fxamp.report(model, "O1", example_inputs=(x, x), dtype=BF16, recompute_islands=False)
    assert all(r.recompute is None for r in off.rows) and "float32 islands" not in off.to_table()


def test_node_overrides_decide_one_island(data):
    model = LM(vocab=512)
    x = data % 512
    amp = fxamp.convert(model, "O1", dtype=BF16, node_overrides={"cross_entropy": "no_recompute"})
    d = next(n.meta[DECISION] for n in amp.graph.nodes if n.name == "cross_entropy")
    assert not d.recompute.chosen and "override" in d.recompute.reason
    assert not any(n.target is island_output for n in amp.graph.nodes)
    plain = fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False)
    assert saved_bytes(lambda: amp(x, x)) == saved_bytes(lambda: plain(x, x))
    with pytest.raises(ValueError, match="recompute_islands=False turns recomputation off"):
        fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False, node_overrides={"cross_entropy": "recompute"})
    with pytest.raises(ValueError, match="the graph has no node 'nope'"):
        fxamp.convert(model, "O1", dtype=BF16, node_overrides={"nope": "recompute"})
    with pytest.raises(TypeError, match="recompute_islands must be True or False"):
        fxamp.convert(model, "O1", dtype=BF16, recompute_islands="yes")


def test_a_matmul_never_joins_an_island():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x).float()
            return torch.softmax(h @ h.transpose(-1, -2), -1).sum() + torch.log_softmax(h, -1).sum()

    model = M()
    amp = fxamp.convert(model, "O1", dtype=BF16)
    members = [n.name for n in amp.graph.nodes if DECISION in n.meta and n.meta[DECISION].recompute is not None]
    # the softmax reads a second upcast (of the matmul's bf16 result): it joins as a second entry
    assert {"float_1", "log_softmax", "softmax"} <= set(members) and not {"matmul", "linear"} & set(members)
    x = torch.randn(4, 16, 16)
    runs = []
    for m in (amp, fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False)):
        model.zero_grad(set_to_none=True)
        m(x).backward()
        runs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_pickle_and_deepcopy_keep_the_island(data):
    torch.manual_seed(0)
    model = LM(vocab=512)
    x = data % 512
    amp = fxamp.convert(model, "O1", dtype=BF16)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, copy.deepcopy(amp)):
        assert any(n.target is island_output for n in other.graph.nodes)
        assert same(gradients(other, x), gradients(amp, x))


class SoftmaxBlock(nn.Module):
    """A block with a float32 island inside: softmax over scores cast up from bfloat16, as written by hand."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        p = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        return x + self.out(p @ x)


class Stack(nn.Module):
    def __init__(self, d=32, n=2):
        super().__init__()
        self.layers = nn.ModuleList(SoftmaxBlock(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.filterwarnings("ignore:fxamp. the converted module's bfloat16 parameters")
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_an_island_inside_a_block_converted_in_place(policy):
    torch.manual_seed(0)
    base = Stack()
    x = torch.randn(4, 128, 32)
    runs = {}
    for on in (True, False):
        model = fxamp.convert_(copy.deepcopy(base), policy, dtype=BF16, recompute_islands=on)
        xs = x.to(BF16) if policy == "O2" else x
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(xs)  # captured at the first call
        graph = fxamp.conversion.blocks.family_of(model.layers[0]).graphs
        gm = next(iter(graph.values()))[0].gm
        assert any(n.target is island_output for n in gm.graph.nodes) is on
        bytes_ = saved_bytes(lambda: model(xs))
        model.zero_grad(set_to_none=True)
        out = model(xs)
        out.float().pow(2).mean().backward()
        runs[on] = (bytes_, out.detach(), [p.grad.clone() for p in model.parameters()])
    assert runs[True][0] < runs[False][0] - 4 * 128 * 128 * 2 * 2 * 0.9  # two blocks' float32 probabilities
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


def test_with_activation_checkpointing(data):
    torch.manual_seed(0)
    model = CheckpointedLM()
    on = fxamp.convert(model, "O1", dtype=BF16)
    off = fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False)
    assert any("activation checkpointing" in n for n in fxamp.conversion_info(on).notes)
    assert any(n.target is island_output for n in on.graph.nodes)
    assert saved_bytes(lambda: on(data, data)) < saved_bytes(lambda: off(data, data)) - 8 * 64 * 8192 * 2 * 0.9
    assert same(gradients(on, data), gradients(off, data))
    assert same(gradients(on, data), gradients(model, data, autocast=True))


def test_under_torch_compile_the_results_stay_bitwise():
    torch.manual_seed(0)
    model = LM(vocab=256, seq=16, d=32, layers=1)
    x = torch.randint(0, 256, (2, 16))
    results = []
    for on in (True, False):
        amp = fxamp.convert(model, "O1", dtype=BF16, recompute_islands=on)
        compiled = torch.compile(amp)
        results.append(gradients(compiled, x))
    assert same(*results)


def test_backward_frees_the_recomputed_tensors_without_the_garbage_collector():
    """A recursive closure in the program's interpreter once made a reference cycle that held each step's
    recomputed logits until the garbage collector ran (the benchmark's live bytes after a step doubled)."""
    import gc

    torch.manual_seed(0)
    model = LM(vocab=2048, seq=32, d=32, layers=1)
    x = torch.randint(0, 2048, (4, 32))
    amp = fxamp.convert(model, "O1", dtype=BF16)
    def logits_sized():
        return {id(o): o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.numel() >= 4 * 31 * 2048}

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        before = logits_sized()
        amp(x, x)[0].backward()
        grads = {id(p.grad) for p in amp.parameters() if p.grad is not None}
        big = [t for i, t in logits_sized().items() if i not in before and i not in grads]
    finally:
        if enabled:
            gc.enable()
    assert not big, [(t.shape, t.dtype) for t in big]


def test_double_backward_through_an_island_is_refused_not_wrong():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log_softmax(self.fc(x).float(), -1).sum()

    amp = fxamp.convert(M(), "O1", dtype=BF16)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice .* recompute_islands=False"):
        torch.autograd.grad(amp(x), x, create_graph=True)
    (g,) = torch.autograd.grad(fxamp.convert(M(), "O1", dtype=BF16, recompute_islands=False)(x), x, create_graph=True)
    assert g.requires_grad


# ---- row-chunked backward ------------------------------------------------------------------------------------

class Head(nn.Module):
    """Logits from a Linear, cast up, and a loss over them: the loss island, as Hugging Face's ForCausalLMLoss writes
    it (``logits.float()``, a view to rows, shifted labels with ignore_index) or with the logits shifted instead."""

    def __init__(self, d=16, vocab=64, reduction="mean", shift_logits=False, label_smoothing=0.0):
        super().__init__()
        self.fc = nn.Linear(d, vocab)
        self.vocab, self.reduction, self.shift_logits, self.smoothing = vocab, reduction, shift_logits, label_smoothing

    def forward(self, h, labels):
        logits = self.fc(h).float()
        if self.shift_logits:
            logits, labels = logits[:, :-1, :].contiguous(), labels[:, 1:].contiguous()
        return F.cross_entropy(logits.view(-1, self.vocab), labels.reshape(-1), ignore_index=-100,
                               reduction=self.reduction, label_smoothing=self.smoothing)


def head_data(dtype, b=3, s=7, d=16, vocab=64):
    """Odd row counts (3 x 7 = 21 rows) with ignore_index rows."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(b, s, d, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :3] = -100
    labels[2, -1] = -100
    return h if dtype is None else h.to(dtype), labels


def head_grads(model, h, labels, weights=None):
    model.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    out = model(h, labels)
    (out if out.dim() == 0 else (out * weights).sum()).backward()
    return out.detach(), [h.grad.clone()] + [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def spy_chunks(monkeypatch):
    """One entry per island backward that tried the row chunks (``recompute.chunked_grads``): True where it ran them
    (False: the run's shapes did not fit, and the island was recomputed whole)."""
    from fxamp.conversion.runtime import recompute

    runs = []
    real = recompute.chunked_grads

    def spy(program, plan, values, needs, grads):
        got = real(program, plan, values, needs, grads)
        runs.append(got is not None)
        return got

    monkeypatch.setattr(recompute, "chunked_grads", spy)
    return runs


@pytest.mark.filterwarnings("ignore:fxamp. the converted module's")
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("reduction,shift", [("mean", False), ("sum", False), ("none", False), ("mean", True)])
def test_chunked_backward_is_bitwise_the_whole_recompute_and_recompute_off(monkeypatch, spy_chunks, dtype, policy,
                                                                           reduction, shift):
    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    model = Head(reduction=reduction, shift_logits=shift)
    h, labels = head_data(dtype if policy == "O2" else None)
    weights = torch.rand(3 * (6 if shift else 7))
    off = fxamp.convert(model, policy, dtype=dtype, recompute_islands=False)
    on = fxamp.convert(model, policy, dtype=dtype)
    choice = next(n.meta[DECISION].recompute for n in on.graph.nodes if n.name == "cross_entropy")
    assert choice.chosen and choice.chunked and "chunks of rows" in choice.reason
    ref = head_grads(off, h, labels, weights)
    runs = {}
    for rows in (1, 5, 64):  # 21 (or 18) rows: chunks of 1 row, of 5 (not dividing them), all in one
        monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 64 * rows)
        runs[rows] = head_grads(on, h, labels, weights)
        assert same(runs[rows], ref), rows
    assert spy_chunks == [True] * 3
    monkeypatch.setattr(recompute, "row_plan", lambda program, n: "whole, for the test")  # the whole recompute
    assert same(head_grads(on, h, labels, weights), ref)
    if policy == "O1" and dtype == BF16:
        with torch.autocast("cpu", BF16):
            assert same(head_grads(model, h, labels, weights), ref)


def test_a_softmax_island_runs_in_row_chunks_bitwise(monkeypatch, spy_chunks):
    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    base = Stack(d=16)
    x = torch.randn(5, 12, 16)
    off, on = (fxamp.convert(base, "O1", dtype=BF16, recompute_islands=r) for r in (False, True))
    assert all(n.meta[DECISION].recompute.chunked for n in on.graph.nodes
               if DECISION in n.meta and n.meta[DECISION].recompute is not None)
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 12 * 12 * 2)  # 2 of the 5 rows (dim 0) a chunk
    runs = []
    for m in (off, on):
        m.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        m(xs).pow(2).sum().backward()
        runs.append([xs.grad] + [p.grad.clone() for p in base.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and spy_chunks == [True, True]


def test_a_loss_island_that_cannot_run_in_chunks_is_not_recomputed():
    """Label smoothing's mean divides two terms by the count in an order a chunk's sum cannot repeat: recomputed
    whole, the loss's backward would hold its float32 tensors and the kept logits at once, raising the peak."""
    model = Head(label_smoothing=0.1)
    h, labels = head_data(None)
    amp = fxamp.convert(model, "O1", dtype=BF16)
    choice = next(n.meta[DECISION].recompute for n in amp.graph.nodes if n.name == "cross_entropy")
    assert not choice.chosen and "cannot run in row chunks (cross_entropy with class weights, label smoothing" \
        in choice.reason
    assert not any(n.target is island_output for n in amp.graph.nodes)
    forced = fxamp.convert(model, "O1", dtype=BF16, node_overrides={"cross_entropy": "recompute"})
    choice = next(n.meta[DECISION].recompute for n in forced.graph.nodes if n.name == "cross_entropy")
    assert choice.chosen and not choice.chunked and "recomputes it whole" in choice.reason
    assert same(head_grads(forced, h, labels), head_grads(amp, h, labels))


def allocations(fn):
    """``(peak, largest)`` bytes of the CPU allocations ``fn`` makes and has not freed, from torch.profiler's
    memory events (a running sum of this call's allocations less their frees)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        stack.extend(e.children)
    live, now, peak, largest = {}, 0, 0, 0
    for _, ptr, size in sorted(events, key=lambda t: t[0]):
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            now, largest = now + size, max(largest, size)
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak, largest


@pytest.mark.parametrize("shift", [False, True])
def test_the_chunked_backward_holds_no_float32_tensor_of_the_logits_size(monkeypatch, shift):
    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    vocab = 512
    model = Head(d=16, vocab=vocab, shift_logits=shift)
    h, labels = head_data(None, b=4, s=64, vocab=vocab)
    full32 = 4 * 64 * vocab * 4
    monkeypatch.setattr(recompute, "CHUNK_BYTES", full32 // 16)
    peaks = {}
    for on in (True, False):
        amp = fxamp.convert(model, "O1", dtype=BF16, recompute_islands=on)
        loss = amp(h, labels)
        peaks[on] = allocations(loss.backward)
    (peak, largest), chunk = peaks[True], full32 // 16
    assert largest < full32  # the bfloat16 gradient of the logits (and a matmul's workspace for it); no float32 copy
    assert peaks[False][1] >= full32 and peaks[False][0] >= 1.9 * full32  # log-probabilities' and logits' gradients
    # the bf16 gradient (shifted: also the bf16 rows and the slice's gradient), the Linear's workspace, a few chunks
    assert peak <= (2 if shift else 1) * full32 // 2 + largest + 5 * chunk
    assert peak < 0.8 * peaks[False][0]


def test_the_report_says_which_islands_run_their_backward_in_row_chunks():
    torch.manual_seed(0)
    model = Head(vocab=512)
    h, labels = head_data(None, b=4, s=64, vocab=512)
    rep = fxamp.report(model, "O1", example_inputs=(h, labels), dtype=BF16)
    assert "recomputed, keeps bfloat16 for backward, 262kB less, forward and backward in row\n    chunks" in rep.to_table()
    assert "its forward and backward run in chunks of rows of ~4 MiB of float32" in rep.to_table(wide=True)
    header, *lines = rep.to_csv().splitlines()
    assert header.endswith("recompute_chunked") and any(line.endswith(",1") for line in lines)
    smooth = fxamp.report(Head(vocab=512, label_smoothing=0.1), "O1", example_inputs=(h, labels), dtype=BF16)
    assert "not recomputed: a loss whose backward cannot run in row chunks" in smooth.to_table()


def test_a_hugging_face_causal_lm_loss_runs_in_row_chunks_bitwise(monkeypatch, spy_chunks):
    """GPT-2 with ``labels=`` (its loss pads the labels with ignore_index and casts the logits up), O1: the loss's
    backward in chunks of 5 rows gives the gradients of the recompute off, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from fxamp.conversion.runtime import recompute

    class WithLabels(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0)  # no dropout: two runs draw no masks
            self.lm = transformers.GPT2LMHeadModel(cfg)

        def forward(self, idx, labels):
            return self.lm(input_ids=idx, labels=labels).loss

    torch.manual_seed(0)
    model = WithLabels()
    x = torch.randint(0, 128, (3, 7))
    labels = x.clone()
    labels[1, :2] = -100
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 128 * 5)
    runs = []
    for on in (True, False):
        amp = fxamp.convert(model, "O1", dtype=BF16, recompute_islands=on, example_inputs=(x, labels))
        amp.zero_grad(set_to_none=True)
        loss = amp(x, labels)
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert same(*runs) and True in spy_chunks


@pytest.mark.parametrize("dim", [0, -2, 1])
def test_a_softmax_over_dim_0_is_recomputed_whole(monkeypatch, spy_chunks, dim):
    """Chunks are rows of dim 0: a softmax over dim 0 mixes them (refused from the graph for dim=0, at run time
    for -2 of a 2-D input); dim 1 runs in chunks.  Bitwise the gradients without the recompute each way."""
    from fxamp.conversion.runtime import recompute

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            return torch.log_softmax(self.fc(x).float(), dim=dim)

    torch.manual_seed(0)
    model, x, w = M(), torch.randn(11, 8), torch.randn(11, 16)
    on = fxamp.convert(model, "O1", dtype=BF16)
    assert next(n.meta[DECISION].recompute for n in on.graph.nodes if n.name == "log_softmax").chunked == (dim != 0)
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 16 * 3)
    runs = []
    for m in (on, fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False)):
        model.zero_grad(set_to_none=True)
        (m(x) * w).sum().backward()
        runs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert spy_chunks == ([] if dim == 0 else [dim == 1])



class Scan(nn.Module):
    """RWKV's CPU time-mixing recurrence (transformers' ``rwkv_linear_attention_cpu``), a Python loop over time:
    each step's float32 ops read the step before, so the islands starting at successive upcasts overlap."""

    def __init__(self, d: int = 16, steps: int = 6):
        super().__init__()
        self.steps = steps  # (torch.fx cannot loop over a traced size)
        self.key, self.value = nn.Linear(d, d), nn.Linear(d, d)
        self.time_decay, self.time_first = nn.Parameter(torch.randn(d) * 0.1), nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        key, value = self.key(x), self.value(x)
        outs = []
        num = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den = torch.zeros_like(key[:, 0], dtype=torch.float32)
        mx = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
        decay = -torch.exp(self.time_decay)
        for t in range(self.steps):
            k, v = key[:, t].float(), value[:, t]
            m = torch.maximum(mx, k + self.time_first)
            e1, e2 = torch.exp(mx - m), torch.exp(k + self.time_first - m)
            outs.append(((e1 * num + e2 * v) / (e1 * den + e2)).to(key.dtype))
            m2 = torch.maximum(mx + decay, k)
            e1, e2 = torch.exp(mx + decay - m2), torch.exp(k - m2)
            num, den, mx = e1 * num + e2 * v, e1 * den + e2, m2
        return torch.stack(outs, 1)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_islands_that_overlap_are_rewritten_one_at_a_time(frontend):
    """Each chosen island's rewrite moves what runs between its first and last op: two chosen islands that
    overlap (a recurrence over time) put the graph out of order ("used before it has been defined").  An
    island overlapping a chosen one is declined, with its reason in the report; the results are recompute off's."""
    torch.manual_seed(0)
    model, x = Scan(), torch.randn(2, 6, 16)
    kw = dict(dtype="bfloat16", frontend=frontend, example_inputs=(x,))
    amp = fxamp.convert(copy.deepcopy(model), "O2", **kw)
    off = fxamp.convert(copy.deepcopy(model), "O2", recompute_islands=False, **kw)
    choices = {n.meta[DECISION].recompute for n in amp.graph.nodes
               if DECISION in n.meta and n.meta[DECISION].recompute is not None}
    chosen = [c for c in choices if c.chosen]
    declined = [c for c in choices if "interleave" in c.reason]
    assert chosen, sorted(c.reason for c in choices)
    if frontend == "export":  # (torch.fx's graph of it has islands that do not overlap)
        assert declined, sorted(c.reason for c in choices)
    out, ref = amp(x), off(x)
    assert torch.equal(out, ref)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    for (name, a), b in zip(amp.named_parameters(), off.parameters()):
        # (time_first is read at every step: its gradient's terms may be summed in another order)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


class _ForceField(nn.Module):
    """An energy model whose forward returns forces, -dE/dpos, with create_graph=True (SchNet, NequIP, MACE)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, pos):
        pos = pos.detach().requires_grad_(True)
        energy = self.mlp(pos).sum()
        return -torch.autograd.grad(energy, pos, create_graph=True)[0]


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_forward_that_calls_autograd_gets_no_island_and_trains_through_its_forces(policy):
    """The energy's float32 sum was an island: run without a graph, torch.autograd.grad in forward then found
    nothing to differentiate ("element 0 of tensors does not require grad").  A graph calling autograd gets no
    island (noted); the forces and the double backward of a loss on them match float32's."""
    torch.manual_seed(0)
    model = _ForceField()
    pos = torch.randn(2, 16, 3, generator=torch.Generator().manual_seed(1))
    forces = model(pos)
    forces.pow(2).sum().backward()
    ref = model.mlp[0].weight.grad.clone()
    model.zero_grad()  # (O1 shares the model's parameters)
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16)
    assert any("forward calls autograd (grad)" in n for n in fxamp.conversion_info(amp).notes)
    ours = amp(pos)
    assert float((ours.float() - forces).norm() / forces.norm()) < 2e-2
    ours.float().pow(2).sum().backward()
    g = amp.mlp[0].weight.grad.float()
    assert float((g - ref).norm() / ref.norm()) < 5e-2
