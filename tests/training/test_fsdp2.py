"""FSDP2 (``fxamp.shard``) on 2 gloo processes against single-process fxamp on the same micro-batches.

One spawn runs every check; the reference runs here, in the test process, with each rank's
micro-batch backward-ed in turn (gradients summed in float32, then halved: FSDP2's average).
"""

import collections
import datetime
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from benchmarks.fsdp2 import Collectives
from fxamp.conversion.blocks import family_of
from fxamp.sharding import low_gathered
from tests.dtype_observer import OpDtypes

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD, STEPS, PLANTED = 2, 12, 5  # PLANTED: the float16 step at which rank 0 alone sees an inf (and 6 steps after it)
V, D, T = 64, 32, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 4, c // 4).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(c, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.lnf, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.temp = nn.Parameter(torch.ones(1))  # one element: rank 1's shard of it is empty

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x)) * self.temp
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


class NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.ln = nn.Linear(D, D), nn.BatchNorm1d(D), nn.LayerNorm(D)

    def forward(self, x):
        return x + torch.relu(self.ln(self.bn(self.fc(x))))


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock() for _ in range(2))
        self.head = nn.Linear(D, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


def _batch(kind, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "gpt":
        return (torch.randint(0, V, (2, T), generator=g),)
    return torch.randn(8, D, generator=g), torch.randint(0, 4, (8,), generator=g)


def _model(kind, dtype):
    torch.manual_seed(0)
    model = GPT() if kind == "gpt" else NormNet()
    return fxamp.convert_(model, "O1", dtype=dtype)


def _opt(model):
    return fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)


def _plant(model):
    """An inf in this rank's own gradient (its shard, when sharded), in a block's first linear."""
    g = model.blocks[0].fc.weight.grad if hasattr(model.blocks[0], "fc") else model.blocks[0].qkv.weight.grad
    local = g.to_local() if hasattr(g, "to_local") else g
    local.view(-1)[0] = float("inf")


def _sharded_run(kind, dtype, rank, gather_float32=()):
    model = fxamp.shard(_model(kind, dtype), gather_float32=gather_float32)
    opt = _opt(model)
    losses, stepped, norms = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*_batch(kind, rank, step))
        opt.backward(loss)
        if dtype == torch.float16 and step == PLANTED and rank == 0:
            _plant(model)
        norms.append(float(opt.clip_grad_norm_(1.0).full_tensor()))
        stepped.append(bool(opt.step()))
        losses.append(loss.item())
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    state = [v for p in model.parameters() for v in opt.optimizer.state[p].values() if v.dim()]
    held = sum(t.to_local().numel() for t in [*model.parameters(), *state])  # this rank's weights and AdamW state
    whole = sum(t.numel() for t in [*model.parameters(), *state])
    return {"losses": losses, "stepped": stepped, "norms": norms, "scale": opt.current_scale, "params": full,
            "held": held / whole}


def _reference(kind, dtype):
    """Single-process fxamp: each rank's micro-batch in turn, gradients averaged in float32."""
    model = _model(kind, dtype)
    opt = _opt(model)
    losses, stepped, norms = [[] for _ in range(WORLD)], [], []
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            loss = model(*_batch(kind, rank, step))
            opt.backward(loss / WORLD)
            losses[rank].append(loss.item())
        if dtype == torch.float16 and step == PLANTED:
            _plant(model)
        norms.append(float(opt.clip_grad_norm_(1.0)))
        stepped.append(bool(opt.step()))
    # (no comparison of weights: a bias before softmax or BatchNorm gets gradients of rounding noise only, which
    # Adam turns into steps of lr; the losses are what the weights compute)
    return {"losses": losses, "stepped": stepped, "norms": norms, "scale": opt.current_scale}


COMPUTE = ("native_layer_norm", "native_layer_norm_backward", "addmm", "mm", "bmm", "_log_softmax",
           "_log_softmax_backward_data", "gelu", "gelu_backward", "embedding_dense_backward", "nll_loss_forward",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _op_dtypes(model, rank):
    """How many times each compute op ran with which dtypes, forward and backward (after a first call: the
    capture traces with example values)."""
    model(*_batch("gpt", rank, 1))
    with OpDtypes() as rec:
        model(*_batch("gpt", rank, 0)).backward()
    return collections.Counter((c.op, c.inputs, c.outputs) for c in rec.calls if c.op in COMPUTE)


def _accumulated(rank, sync_each):
    """Two micro-batches per step, the first without a reduce-scatter (set_requires_gradient_sync)."""
    model = fxamp.shard(_model("gpt", torch.bfloat16))
    opt = _opt(model)
    losses = []
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            model.set_requires_gradient_sync(sync_each or micro == 1)
            loss = model(*_batch("gpt", rank, 10 * step + micro))
            opt.backward(loss / 2)
            losses.append(loss.item())
        opt.step()
    return losses


def _dcp_fresh(shard):
    model = _model("gpt", torch.float16)
    model = fxamp.shard(model) if shard else model
    scale = fxamp.LossScaleConfig("dynamic", init_scale=2.0**10, growth_interval=2)  # the scale moves
    return model, fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model,
                                                loss_scale=scale)


def _dcp_train(model, opt, rank, steps):
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(*_batch("gpt", rank, step))
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _full(model, opt):
    """Every weight and AdamW state tensor in full, by name; the scale."""
    out = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"{n}.{k}": v.full_tensor().clone() for k, v in opt.optimizer.state[p].items() if k != "step"})
    return out, opt.current_scale


def _dcp(rank, path):
    """Save after 3 steps, run 3 more; a fresh model and optimizer load the checkpoint and run the same 3."""
    import torch.distributed.checkpoint as dcp
    model, opt = _dcp_fresh(shard=True)
    _dcp_train(model, opt, rank, range(3))
    dcp.save(fxamp.sharded_state_dict(model, opt), checkpoint_id=path)
    saved = _full(model, opt)
    continued = _dcp_train(model, opt, rank, range(3, 6))
    model2, opt2 = _dcp_fresh(shard=True)
    state = fxamp.sharded_state_dict(model2, opt2)
    dcp.load(state, checkpoint_id=path)
    fxamp.load_sharded_state_dict(model2, opt2, state)
    loaded = _full(model2, opt2)
    resumed = _dcp_train(model2, opt2, rank, range(3, 6))
    return {"saved": saved, "loaded": loaded, "continued": continued, "resumed": resumed,
            "end": [_full(model, opt), _full(model2, opt2)]}


def _dcp_idiom(rank, path):
    """DCP's own idiom: the model and the optimizer themselves (``Stateful``), loaded by fresh objects."""
    import torch.distributed.checkpoint as dcp
    model, opt = _dcp_fresh(shard=True)
    _dcp_train(model, opt, rank, range(3))
    dcp.save({"model": model, "optim": opt}, checkpoint_id=path)
    continued = _dcp_train(model, opt, rank, range(3, 6))
    model2, opt2 = _dcp_fresh(shard=True)
    dcp.load({"model": model2, "optim": opt2}, checkpoint_id=path)
    resumed = _dcp_train(model2, opt2, rank, range(3, 6))
    return {"continued": continued, "resumed": resumed, "end": [_full(model, opt), _full(model2, opt2)]}


def _no_grad_after_steps(rank):
    """A no_grad forward (the weight-cast cache's case) after each step, and the same forward with autograd."""
    model = fxamp.shard(_model("gpt", torch.bfloat16))
    opt = _opt(model)
    out = []
    for step in range(3):
        with torch.no_grad():
            evaluated = model(*_batch("gpt", rank, 0)).item()
        loss = model(*_batch("gpt", rank, 0))
        out.append((evaluated, loss.item()))
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return out


def _some_blocks(rank):
    """Only blocks.1 its own group (blocks.0 goes with the root), kept unsharded after forward: 3 steps."""
    model = fxamp.shard(_model("gpt", torch.bfloat16), blocks=["blocks.1"], reshard_after_forward=False)
    groups = [n for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state")]
    opt = _opt(model)
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = model(*_batch("gpt", rank, step))
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        losses.append(loss.item())
    return groups, losses


def _refusals(rank):
    """Bad input on every rank: one line each, the model left as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    out = []
    model = _model("gpt", torch.bfloat16)
    for bad in (lambda: fxamp.shard(model, mesh=init_device_mesh("cpu", (1, WORLD))),
                lambda: fxamp.shard(model, blocks=["nothing.*"])):
        try:
            bad()
        except ValueError as e:
            out.append(str(e))
    out.append(any(type(m).__name__.startswith("FSDP") for m in model.modules())
               or any(type(p) is not nn.Parameter for p in model.parameters()))  # sharded, or a parameter re-bound
    return out


def _collectives(rank, gather_float32):
    """The collectives of one training step (the second: the first captures), bitwise the loss and gradients."""
    model = fxamp.shard(_model("gpt", torch.bfloat16), gather_float32=gather_float32)
    model(*_batch("gpt", rank, 0)).backward()
    with Collectives() as rec:
        loss = model(*_batch("gpt", rank, 1))
        loss.backward()
    return rec.calls, loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


class Scaled(nn.Module):
    """A linear layer whose weight a float32 op reads too (its mean square scales the output)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):  # (*x.shape: torch.fx fails, fxamp captures with the call's values)
        return x + (self.fc(x) * self.fc.weight.pow(2).mean()).view(*x.shape)


class ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Scaled() for _ in range(2))
        self.head = nn.Linear(D, 5)  # 5 rows: uneven shards (3 and 2 rows), all-gathered in bfloat16

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _scaled():
    torch.manual_seed(0)
    return fxamp.convert_(ScaledNet(), "O1", dtype=torch.bfloat16)


def _misread(rank):
    """A weight predicted low (a Linear's) that a float32 op reads too: refused at the first forward; kept
    float32 when the model ran once before shard (the plan from its graphs) or by gather_float32=."""
    x = _batch("norms", rank, 0)[0]
    out = {}
    try:
        fxamp.shard(_scaled())(x)
    except RuntimeError as e:
        out["refused"] = str(e)
    called = _scaled()
    called(x)
    called = fxamp.shard(called)
    out["called"] = called(x).item()
    out["table"] = fxamp.sharding.sharding_table(called)
    kept = fxamp.shard(_scaled(), gather_float32=["blocks.*.fc.weight"])
    out["kept"] = kept(x).item()
    out["front ends"] = _front_ends(kept)  # captured under sharding, through bfloat16-gathered fc.bias
    return out


def _front_ends(model):
    return [graph.frontend for variants in family_of(model.blocks[0]).graphs.values() for graph in variants]


def _worker(rank, port, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        result = {f"{kind}-{dtype}": _sharded_run(kind, dtype, rank)
                  for kind in ("gpt", "norms") for dtype in (torch.bfloat16, torch.float16)}
        result["float32 gather"] = _sharded_run("gpt", torch.bfloat16, rank, gather_float32=["*"])
        result["collectives"] = [_collectives(rank, g) for g in ([], ["*"])]
        result["misread"] = _misread(rank)
        sharded = fxamp.shard(_model("gpt", torch.bfloat16))
        result["dtypes"] = _op_dtypes(sharded, rank)
        result["table"] = fxamp.sharding.sharding_table(sharded)
        result["accumulated"] = _accumulated(rank, sync_each=False)
        result["synced each"] = _accumulated(rank, sync_each=True)
        result["refusals"] = _refusals(rank)
        result["no_grad"] = _no_grad_after_steps(rank)
        result["some blocks"] = _some_blocks(rank)
        result["dcp"] = _dcp(rank, os.path.join(out_dir, "dcp"))
        result["dcp idiom"] = _dcp_idiom(rank, os.path.join(out_dir, "dcp-idiom"))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)] + [out / "dcp"]


@pytest.mark.parametrize("kind", ["gpt", "norms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_training_matches_one_process(ranks, kind, dtype):
    ref = _reference(kind, dtype)
    expected = [not (dtype == torch.float16 and s == PLANTED) for s in range(STEPS)]
    assert ref["stepped"] == expected
    for rank, got in enumerate(ranks[:WORLD]):
        run = got[f"{kind}-{dtype}"]
        assert run["stepped"] == expected  # every rank skips the planted step, and only it
        assert run["scale"] == ref["scale"]
        assert 0.45 < run["held"] < 0.55  # each rank holds about half the weights and optimizer state
        first = ref["losses"][rank][0]
        assert abs(run["losses"][0] - first) <= 2e-6 * abs(first)
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][rank])) <= 5e-4
        # clip_grad_norm_ returns the true norm across shards: at the first step (same weights) to float32's
        # last bit; later the runs' weights part by float32 rounding of the gradients' sum
        assert abs(run["norms"][0] - ref["norms"][0]) <= 1e-6 * ref["norms"][0]
        for a, b, s in zip(run["norms"], ref["norms"], expected):
            assert (abs(a - b) <= 1e-2 * b) if s else not (math.isfinite(a) or math.isfinite(b))
    for name, p in ranks[0][f"{kind}-{dtype}"]["params"].items():
        assert torch.equal(p, ranks[1][f"{kind}-{dtype}"]["params"][name])  # the replicas agree


def test_every_op_computes_in_its_one_process_dtype_under_sharding(ranks):
    for rank, got in enumerate(ranks[:WORLD]):
        assert got["dtypes"] == _op_dtypes(_model("gpt", torch.bfloat16), rank)  # op by op, count by count
        norms = [k for k in got["dtypes"] if k[0].startswith("native_layer_norm")]
        assert len(norms) == 2 and all(set(k[1]) == {torch.float32} for k in norms)  # weights unrounded
        assert {k[1] for k in got["dtypes"] if k[0] == "mm"} == {(torch.bfloat16,) * 2}
        assert [k[1:] for k in got["dtypes"] if k[0] == "_log_softmax"] == [((torch.float32,), (torch.float32,))]


def test_sharding_table_says_per_parameter_what_is_stored_gathered_computed_reduced(ranks):
    rows = {line.split(" | ")[0].strip(): [c.strip() for c in line.split(" | ")[1:]]
            for line in ranks[0]["table"].splitlines()[2:]}
    assert rows["blocks.1.ln2.weight"] == ["float32", "float32", "float32", "float32"]  # never rounded
    assert rows["blocks.0.fc.weight"] == ["float32", "bfloat16", "bfloat16", "float32"]
    assert rows["blocks.0.fc.bias"] == ["float32", "bfloat16", "bfloat16", "float32"]
    assert rows["head.weight"] == ["float32", "bfloat16", "bfloat16", "float32"]
    assert rows["wte.weight"] == ["float32", "float32", "float32", "float32"]  # the embedding runs in float32
    assert rows["temp"] == ["float32", "float32", "float32 (the model's own code)", "float32"]
    assert len(rows) == len(list(GPT().parameters()))


def test_low_gather_is_bitwise_the_float32_gather(ranks):
    """bfloat16 all-gathers of the weights fxamp's graph casts to bfloat16 anyway: the same bits, so the same run."""
    for got in ranks[:WORLD]:
        low, full = got["gpt-torch.bfloat16"], got["float32 gather"]
        assert low["losses"] == full["losses"] and low["norms"] == full["norms"]
        assert all(torch.equal(low["params"][n], full["params"][n]) for n in full["params"])
        (_, low_loss, low_grads), (_, full_loss, full_grads) = got["collectives"]
        assert low_loss == full_loss and all(torch.equal(low_grads[n], full_grads[n]) for n in full_grads)


def test_low_gather_halves_the_weights_bytes_in_as_many_collectives(ranks):
    model = _model("gpt", torch.bfloat16)
    low = low_gathered(model)
    assert set(low) == {n for n, _ in model.named_parameters() if n.startswith("blocks.") and ".ln" not in n} | {
        "head.weight"} and set(low.values()) == {torch.bfloat16}
    # a block gathers in forward and again in backward (reshard_after_forward), the root once; 2 bytes saved each
    saved = 2 * sum(p.numel() * (2 if n.startswith("blocks.") else 1) for n, p in model.named_parameters() if n in low)
    for got in ranks[:WORLD]:
        (low_calls, _, _), (full_calls, _, _) = got["collectives"]
        kinds = collections.Counter(k for k, _ in low_calls)
        assert kinds == collections.Counter(k for k, _ in full_calls) == {"all-gather": 5, "reduce-scatter": 3}
        bytes_of = lambda calls, kind: sum(b for k, b in calls if k == kind)
        assert bytes_of(low_calls, "reduce-scatter") == bytes_of(full_calls, "reduce-scatter")  # float32 gradients
        assert bytes_of(low_calls, "all-gather") == bytes_of(full_calls, "all-gather") - saved


def test_a_weight_a_float32_op_reads_is_never_gathered_low(ranks):
    one = _scaled()
    expected = [one(_batch("norms", rank, 0)[0]).item() for rank in range(WORLD)]
    for rank, got in enumerate(ranks[:WORLD]):
        run = got["misread"]
        assert ("fxamp.shard all-gathers blocks.0.fc.weight in bfloat16 (predicted: only bfloat16 ops read it), but "
                "aten.pow.Tensor_Scalar reads it as float32; shard with gather_float32=['blocks.0.fc.weight']"
                in run["refused"])
        assert run["called"] == run["kept"] == expected[rank]
        assert run["front ends"] == _front_ends(one) == ["fx"]  # torch.fx with the call's values, as in one process
        rows = {line.split(" | ")[0].strip(): [c.strip() for c in line.split(" | ")[1:]]
                for line in run["table"].splitlines()[2:]}
        assert rows["blocks.0.fc.weight"] == ["float32", "float32", "bfloat16, float32", "float32"]
        assert rows["blocks.0.fc.bias"] == ["float32", "bfloat16", "bfloat16", "float32"]
        assert rows["head.weight"] == ["float32", "bfloat16", "bfloat16", "float32"]


def test_accumulation_without_sync_is_the_synced_result(ranks):
    for got in ranks[:WORLD]:
        assert got["accumulated"] == got["synced each"]  # reduce-scatter once per step: the same float32 sum


def test_blocks_chosen_by_glob(ranks):
    ref = _reference("gpt", torch.bfloat16)
    for rank, got in enumerate(ranks[:WORLD]):
        groups, losses = got["some blocks"]
        assert groups == ["", "blocks.1"]
        assert max(abs(a - b) for a, b in zip(losses, ref["losses"][rank])) <= 5e-4


def test_no_grad_forward_after_a_step_reads_the_new_weights(ranks):
    for got in ranks[:WORLD]:
        evaluated, trained = zip(*got["no_grad"])
        assert evaluated == trained and len(set(trained)) == 3  # no cast cached across FSDP2's all-gathers


def test_bad_input_is_refused_in_one_line_on_every_rank(ranks):
    for got in ranks[:WORLD]:
        mesh, blocks, sharded = got["refusals"]
        assert "the mesh has shape (1, 2) but the world has 2 ranks" in mesh
        assert "blocks='nothing.*' matches no converted block; the converted blocks: blocks.0, blocks.1" in blocks
        assert not sharded


def test_bad_input_is_refused_before_torch_distributed():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ValueError, match=r"was not converted by fxamp; call fxamp.convert_\(model, 'O1'"):
        fxamp.shard(Plain())
    with pytest.raises(ValueError, match="was converted whole .fxamp.convert.*fxamp.convert_"):
        fxamp.shard(fxamp.convert(Plain(), "O1"))
    o2 = fxamp.convert_(GPT(), "O2", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stores parameters in bfloat16 beside float32 ones.*convert with 'O1'"):
        fxamp.shard(o2)
    o1 = _model("gpt", torch.bfloat16)
    with pytest.raises(ValueError, match="masters='stochastic' apply to float16/bfloat16 parameters"):
        fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(o1.parameters()), model=o1, masters="stochastic")
    with pytest.raises(ValueError, match="whose parameters are their own masters.*save opt.state_dict.. instead"):
        fxamp.sharded_state_dict(o2, _opt(o2))
    with pytest.raises(TypeError, match="gather_float32= takes a list of parameter name globs, not 'head.weight'"):
        fxamp.shard(o1, gather_float32="head.weight")
    with pytest.raises(ValueError, match=r"gather_float32='heads.\*' matches no parameter; the parameters: temp, wte"):
        fxamp.shard(o1, gather_float32=["heads.*"])
    with pytest.raises(TypeError, match="reshard_after_forward= takes True or False, not 8"):
        fxamp.shard(o1, reshard_after_forward=8)
    assert all(type(p) is nn.Parameter for p in o1.parameters())  # nothing re-bound
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        fxamp.shard(_model("gpt", torch.bfloat16))


def _same(a, b):
    (ta, sa), (tb, sb) = a, b
    return sa == sb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_dcp_checkpoint_resumes_bitwise_on_2_ranks(ranks):
    for got in ranks[:WORLD]:
        run = got["dcp"]
        assert run["saved"][1] == 2.0**11  # (grew once: the scaler's state is in the checkpoint)
        assert _same(run["saved"], run["loaded"])
        assert run["resumed"] == run["continued"]
        assert _same(*run["end"])


def test_dcp_of_the_model_and_optimizer_themselves_resumes_bitwise_on_2_ranks(ranks):
    """Issue 37 item 8: ``dcp.save({"model": model, "optim": opt})``, fresh objects ``dcp.load`` it: the same
    losses, weights, AdamW state and loss scale as the run that went on (tests/training/test_dcp.py: 1 process)."""
    for got in ranks[:WORLD]:
        run = got["dcp idiom"]
        assert run["resumed"] == run["continued"]
        assert _same(*run["end"]) and run["end"][0][1] > 2.0**10


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (DCP's note: one process)
def test_dcp_checkpoint_of_2_ranks_loads_on_1(ranks):
    import torch.distributed.checkpoint as dcp

    model, opt = _dcp_fresh(shard=False)
    state = fxamp.sharded_state_dict(model, opt)
    dcp.load(state, checkpoint_id=str(ranks[WORLD]))
    fxamp.load_sharded_state_dict(model, opt, state)
    weights, scale = ranks[0]["dcp"]["saved"]
    assert scale == opt.current_scale
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n])
        for k, v in opt.optimizer.state[p].items():
            if k != "step":
                assert torch.equal(v, weights[f"{n}.{k}"]), (n, k)


def test_sharding_table_of_a_model_not_sharded_nor_called_yet():
    table = fxamp.sharding.sharding_table(_model("gpt", torch.bfloat16))
    row = next(line for line in table.splitlines() if line.startswith("blocks.0.ln1.weight "))
    assert [c.strip() for c in row.split(" | ")[1:]] == ["float32", "-", "(not captured yet)", "-"]
    with pytest.raises(ValueError, match="was not converted by fxamp"):
        fxamp.sharding.sharding_table(GPT())


class Nested(nn.Module):
    """A block whose linear layers sit one module deeper (its graph reads them through ``_modules``)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class NestedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Nested() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_the_plan_from_graphs_is_the_prediction_for_nested_layers():
    model = fxamp.convert_(NestedNet(), "O1", dtype=torch.bfloat16)
    predicted = low_gathered(model)
    assert set(predicted) == {f"blocks.{i}.mlp.{j}.{k}" for i in (0, 1) for j in (0, 2) for k in ("weight", "bias")}
    model(torch.randn(4, D))
    assert low_gathered(model) == predicted  # from the captured graphs now
    rows = {line.split(" | ")[0].strip(): line.split(" | ")[3].strip() for line in
            fxamp.sharding.sharding_table(model).splitlines()[2:]}
    assert rows["blocks.1.mlp.2.weight"] == "bfloat16" and rows["blocks.1.ln.weight"] == "float32"


class _Clipped(nn.Module):
    """A WGAN critic's habit: forward clips the head's weight in place, reading it directly, not through the head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        with torch.no_grad():
            self.head.weight.clamp_(-0.05, 0.05)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("called", [False, True])
def test_a_weight_the_models_own_code_reads_is_never_predicted_low(called):
    """Gathered low, the head's weight refused the clamp_ at the first call ('all-gathers head.weight in bfloat16
    ... but aten.clamp_.default reads it as float32'): before and after the head's first capture."""
    torch.manual_seed(0)
    model = fxamp.convert_(_Clipped(), "O1", dtype=torch.bfloat16)
    if called:
        model(torch.randn(2, D))
    low = low_gathered(model)
    assert "head.weight" not in low
    assert {f"blocks.{i}.0.{n}" for i in range(2) for n in ("weight", "bias")} <= set(low)
