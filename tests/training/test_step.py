"""The segmented step's parts on their own: planning the runs (fxamp.training.plan), the gradient segments and
the per-run step (fxamp.training.executors)."""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import MixedPrecisionOptimizer
from fxamp.training.lean import step_inner
from fxamp.training.executors import flat_grads, step_runs
from fxamp.training.plan import (ACCELERATOR_SEGMENT_NUMEL, SEGMENT_NUMEL, Run, cut_runs, grad_strides, plan_runs,
                                 segment_numel_for)

BF16, F32 = torch.bfloat16, torch.float32


def pairs_of(numels, device="cpu"):
    """(low, master) pairs: bfloat16 parameters and float32 masters of the given sizes."""
    out = []
    for n in numels:
        master = torch.zeros(n, device=device)
        out.append((master.to(BF16), master))
    return out


def low_of_pairs(*pair_lists):
    lows = {id(m): low for pairs in pair_lists for low, m in pairs}
    return lambda master: lows.get(id(master))


def masters_of(runs):
    return [m for r in runs for _, m in r.pairs]


# --------------------------------------------------------------------------- segment_numel_for

def test_segment_numel_for_cpu_and_accelerators():
    assert SEGMENT_NUMEL < ACCELERATOR_SEGMENT_NUMEL
    assert segment_numel_for({torch.device("cpu")}) == SEGMENT_NUMEL
    assert segment_numel_for(["cpu"]) == SEGMENT_NUMEL
    assert segment_numel_for(["cuda:0"]) == ACCELERATOR_SEGMENT_NUMEL
    assert segment_numel_for([torch.device("cuda", 1), torch.device("meta")]) == ACCELERATOR_SEGMENT_NUMEL
    assert segment_numel_for(["cuda:0", "cpu"]) == SEGMENT_NUMEL  # any CPU master: the CPU size


def test_segment_numel_for_reads_the_constants_at_call_time(monkeypatch):
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 7)
    monkeypatch.setattr("fxamp.training.plan.ACCELERATOR_SEGMENT_NUMEL", 11)
    assert segment_numel_for(["cpu"]) == 7 and segment_numel_for(["cuda"]) == 11


# --------------------------------------------------------------------------- cut_runs / plan_runs

def test_cut_runs_packs_greedily_in_order():
    pairs = pairs_of([30, 40, 30, 1, 50, 60, 100, 10])
    runs = cut_runs(3, pairs, 100)
    assert [[m.numel() for _, m in r.pairs] for r in runs] == [[30, 40, 30], [1, 50], [60], [100], [10]]
    assert all(r.group == 3 and r.own == () for r in runs)
    assert [r.numel for r in runs] == [100, 51, 60, 100, 10]
    assert [p for r in runs for p in r.pairs] == [tuple(p) for p in pairs]  # every pair once, order kept
    for r in runs:
        for low, m in r.pairs:
            assert low.dtype is BF16 and m.dtype is F32


def test_cut_runs_gives_a_larger_master_a_run_of_its_own():
    runs = cut_runs(0, pairs_of([10, 250, 20, 5, 300]), 64)
    assert [[m.numel() for _, m in r.pairs] for r in runs] == [[10], [250], [20, 5], [300]]
    for r in runs:
        assert r.numel <= 64 or len(r.pairs) == 1
    assert cut_runs(0, [], 64) == []


def test_plan_runs_one_group_and_device_per_run_own_first():
    g0_cpu, g0_meta, g1 = pairs_of([8, 8, 8, 40]), pairs_of([16, 16], "meta"), pairs_of([20, 20, 20])
    own0, own1 = torch.zeros(5), torch.zeros(3, 3)
    # group 0 interleaves devices and float32 parameters stepped directly
    params0 = [g0_cpu[0][1], own0, g0_meta[0][1], g0_cpu[1][1], g0_cpu[2][1], g0_meta[1][1], g0_cpu[3][1]]
    groups = [{"params": params0}, {"params": [g1[0][1], own1, g1[1][1], g1[2][1]]}]
    runs = plan_runs(groups, low_of_pairs(g0_cpu, g0_meta, g1), 32)
    assert [r.group for r in runs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert runs[0] == Run(0, own=(own0,)) and runs[4] == Run(1, own=(own1,))  # per group, its float32 params first
    assert [[(m.device.type, m.numel()) for _, m in r.pairs] for r in runs] == [
        [], [("cpu", 8)] * 3, [("cpu", 40)], [("meta", 16)] * 2, [], [("cpu", 20)], [("cpu", 20)], [("cpu", 20)]]
    paired = [r for r in runs if r.pairs]
    for r in paired:
        assert r.own == ()
        assert len({m.device for _, m in r.pairs}) == 1  # one device per run
        assert r.numel == sum(m.numel() for _, m in r.pairs)
        assert r.numel <= 32 or len(r.pairs) == 1
        assert all(low is low_of_pairs(g0_cpu, g0_meta, g1)(m) for low, m in r.pairs)
    # order kept within each (group, device)
    assert [m for r in paired if r.group == 0 for _, m in r.pairs if m.device.type == "cpu"] == [m for _, m in g0_cpu]
    assert [m for r in paired if r.group == 0 for _, m in r.pairs if m.device.type == "meta"] == [m for _, m in g0_meta]
    assert masters_of(r for r in paired if r.group == 1) == [m for _, m in g1]


def test_plan_runs_defaults_to_segment_numel(monkeypatch):
    pairs = pairs_of([6, 6, 6])
    groups = [{"params": [m for _, m in pairs]}]
    assert len(plan_runs(groups, low_of_pairs(pairs))) == 1  # 18 elements: far under SEGMENT_NUMEL
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 12)
    assert [r.numel for r in plan_runs(groups, low_of_pairs(pairs))] == [12, 6]
    assert plan_runs([{"params": []}], low_of_pairs(pairs)) == []


# --------------------------------------------------------------------------- grad_strides / flat_grads

def test_grad_strides_none_for_row_major_else_empty_like():
    row = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(())]
    assert grad_strides(row) is None
    cl = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    t = torch.zeros(4, 6).t()  # a transposed (dense) master: empty_like keeps its strides
    assert grad_strides([row[0], cl, t]) == ((4, 1), (48, 1, 12, 3), (1, 6))


def test_flat_grads_views_tile_one_float32_buffer_in_order():
    masters = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2)]
    flat, views = flat_grads(masters, None)
    assert flat.dtype is F32 and flat.shape == (21,)
    assert [v.shape for v in views] == [m.shape for m in masters]
    assert [v.stride() for v in views] == [m.stride() for m in masters]
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert torch.equal(flat, torch.tensor([1.0] * 12 + [2.0] * 5 + [3.0] * 4))  # no gap, no overlap
    # a larger reused buffer: the views take its first elements
    buf = torch.full((40,), -1.0)
    same, views = flat_grads(masters, None, buf)
    assert same is buf
    for v in views:
        v.fill_(7.0)
    assert torch.equal(buf[:21], torch.full((21,), 7.0)) and torch.equal(buf[21:], torch.full((19,), -1.0))


def test_flat_grads_lays_out_views_with_the_masters_strides():
    masters = [torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last), torch.zeros(3, 2).t(), torch.zeros(4)]
    strides = grad_strides(masters)
    buf = torch.zeros(64)
    flat, views = flat_grads(masters, strides, buf)
    assert [v.stride() for v in views] == [torch.empty_like(m).stride() for m in masters]
    assert views[0].is_contiguous(memory_format=torch.channels_last)
    assert [v.storage_offset() for v in views] == [0, 24, 30]
    for v, m in zip(views, masters):
        v.copy_(torch.arange(m.numel(), dtype=F32).view(m.shape))
    # each view covers exactly its stretch of the buffer, whatever its layout
    assert torch.equal(buf[:24].sort().values, torch.arange(24, dtype=F32))
    assert torch.equal(buf[24:30].sort().values, torch.arange(6, dtype=F32))
    assert torch.equal(buf[30:34], torch.arange(4, dtype=F32)) and not buf[34:].any()


# --------------------------------------------------------------------------- step_runs

class Recorder:
    """An optimizer that records, per step(), which parameters each group held and their gradients."""

    def __init__(self, groups, fail_at=None):
        self.param_groups = groups
        self.calls = []
        self.fail_at = fail_at

    def step(self):
        if len(self.calls) == self.fail_at:
            raise RuntimeError("boom")
        self.calls.append([[(p, None if p.grad is None else p.grad.clone()) for p in g["params"]]
                           for g in self.param_groups])
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad)  # a visible update: master += grad


def test_step_runs_steps_each_run_alone_with_its_unscaled_gradients():
    a, b = pairs_of([4, 4, 4]), pairs_of([6])
    own = torch.zeros(3)
    own.grad = torch.full((3,), 2.0)
    for k, (low, _) in enumerate(a + b):
        low.grad = torch.full_like(low, 8.0 * (k + 1))
    lists = [[m for _, m in a] + [own], [m for _, m in b]]
    opt = Recorder([{"params": lists[0]}, {"params": lists[1]}])
    runs = plan_runs(opt.param_groups, low_of_pairs(a, b), 8)
    assert len(runs) == 4  # own, [4, 4], [4], [6]
    step_runs(opt, runs, lambda device: torch.tensor(0.25, device=device))
    assert opt.param_groups[0]["params"] is lists[0] and opt.param_groups[1]["params"] is lists[1]
    assert len(opt.calls) == 4
    for call, run in zip(opt.calls, runs):
        held = [[p for p, _ in g] for g in call]
        want = list(run.own) or [m for _, m in run.pairs]
        assert held[run.group] == want and all(not h for i, h in enumerate(held) if i != run.group)
    # own: stepped with its gradient as it is (unscaled beforehand by the check, not here)
    assert torch.equal(own, torch.full((3,), 2.0))
    for k, (low, m) in enumerate(a + b):
        assert torch.equal(m, torch.full_like(m, 2.0 * (k + 1)))  # 8 (k + 1) * 0.25, in float32
        assert m.grad is None  # the segment is unbound after its run
        assert low.dtype is BF16 and torch.equal(low, m.to(BF16))  # refreshed
    grads = [g for call in opt.calls[1:] for p, g in call[runs[1].group] + call[1]]
    assert all(g.dtype is F32 for g in grads)


def test_step_runs_skips_parameters_without_gradients():
    pairs = pairs_of([4, 4, 4, 4])
    pairs[1][0].grad = torch.ones(4, dtype=BF16)
    pairs[3][0].grad = torch.ones(4, dtype=BF16) * 3
    for _, m in pairs:
        m.grad = torch.full((4,), 99.0)  # a stale one: dropped, never stepped
    opt = Recorder([{"params": [m for _, m in pairs]}])
    step_runs(opt, plan_runs(opt.param_groups, low_of_pairs(pairs), 8), None)
    # the run's masters are all in the group; those whose parameter got no gradient have none
    (m0, m1, m2, m3) = [m for _, m in pairs]
    assert [[(p, g is not None) for p, g in call[0]] for call in opt.calls] == [
        [(m0, False), (m1, True)], [(m2, False), (m3, True)]]
    assert [float(m.sum()) for _, m in pairs] == [0.0, 4.0, 0.0, 12.0]
    assert all(m.grad is None for _, m in pairs)


def test_step_runs_restores_the_groups_on_error():
    pairs = pairs_of([4, 4])
    for low, _ in pairs:
        low.grad = torch.ones(4, dtype=BF16)
    params = [m for _, m in pairs]
    opt = Recorder([{"params": params}], fail_at=1)
    with pytest.raises(RuntimeError, match="boom"):
        step_runs(opt, plan_runs(opt.param_groups, low_of_pairs(pairs), 4), None)
    assert opt.param_groups[0]["params"] is params and params == [m for _, m in pairs]
    assert all(m.grad is None for _, m in pairs)
    assert float(pairs[0][1].sum()) == 4.0 and float(pairs[1][1].sum()) == 0.0  # the first run only


# --------------------------------------------------------------------------- per-run step == one step on all

INNERS = {
    "SGD-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}


def _wrapped(make_inner):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(BF16)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-2}]
    return model, MixedPrecisionOptimizer(make_inner(groups), loss_scale="none")


def _backward(model, i, scale=1.0, opt=None):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 16, generator=g).to(BF16), torch.randint(0, 8, (8,), generator=g)
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x).float(), y) * scale
    loss.backward() if opt is None else opt.backward(loss)


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_step_runs_is_bitwise_one_step_on_all_masters(inner):
    (seg_model, seg), (ref_model, ref) = _wrapped(INNERS[inner]), _wrapped(INNERS[inner])
    low_of = low_of_pairs(seg.master_pairs())
    runs = plan_runs(seg.param_groups, low_of, 300)
    assert [(r.group, r.numel) for r in runs] == [(0, 512), (0, 32), (1, 264)]  # a larger master alone
    for i in range(3):
        _backward(seg_model, i, scale=1024.0)  # scaled by a power of 2, unscaled in the run's segment
        step_runs(seg.optimizer, runs, lambda device: torch.tensor(1 / 1024.0, device=device))
        _backward(ref_model, i)
        for low, m in ref.master_pairs():
            m.grad = low.grad.float()
        step_inner(ref.optimizer, [m for _, m in ref.master_pairs()])  # (the masters of an Adam(W): fused)
        with torch.no_grad():
            for low, m in ref.master_pairs():
                low.copy_(m)
    for (sl, sm), (rl, rm) in zip(seg.master_pairs(), ref.master_pairs()):
        assert sl.dtype is BF16 and torch.equal(sl, rl) and torch.equal(sm, rm)
    assert not torch.equal(seg.master_pairs()[0][1], _wrapped(INNERS[inner])[1].master_pairs()[0][1])  # it moved
    s, r = seg.optimizer.state_dict(), ref.optimizer.state_dict()
    assert s["param_groups"] == r["param_groups"] and s["state"].keys() == r["state"].keys()
    for k in s["state"]:
        for name, value in s["state"][k].items():
            assert torch.equal(value, r["state"][k][name]), (k, name)


def test_the_optimizers_segmented_step_follows_plan_runs(monkeypatch):
    """MixedPrecisionOptimizer.step() on a segmentable step plans its runs with plan_runs at
    segment_numel_for's size (the public constant, patched small) and steps as the plain step does."""
    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)  # segment this tiny model
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 300)
    (seg_model, seg), (ref_model, ref) = _wrapped(INNERS["AdamW"]), _wrapped(INNERS["AdamW"])
    ref.release_grad_buffer = False  # the plain step: a float32 gradient for every master
    for i in range(2):
        _backward(seg_model, i, opt=seg)
        seg.step()
        _backward(ref_model, i, opt=ref)
        ref.step()
    want = plan_runs(seg.param_groups, low_of_pairs(seg.master_pairs()), 300)
    got = seg.plan.runs
    assert got is not None and ref.plan.runs is None
    assert [(r.group, r.numel, masters_of([r])) for r in got] == [(r.group, r.numel, masters_of([r])) for r in want]
    assert all(m.grad is None for m in seg.master_params())
    for (sl, sm), (rl, rm) in zip(seg.master_pairs(), ref.master_pairs()):
        assert torch.equal(sl, rl) and torch.equal(sm, rm)


@pytest.mark.parametrize("segmented", [False, True])
def test_float32_masters_of_a_stock_adamw_are_stepped_by_its_fused_kernel_on_a_cpu(segmented, monkeypatch):
    """O2's float32 masters (fxamp's own tensors) of a for-loop AdamW take torch's fused CPU kernel for the step
    (one pass instead of eight), plain or segmented; the user's float32 parameters are stepped as the optimizer was
    built; ``fused=False`` keeps the for-loop everywhere. The update is the for-loop's up to float32 rounding."""
    if segmented:
        monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
        monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 700)
    out = {}
    for fused in (None, False):
        torch.manual_seed(0)
        amp = fxamp.convert(nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 4)), "O2", dtype=BF16)
        inner = torch.optim.AdamW(amp.parameters(), lr=1e-2, fused=fused)
        opt = MixedPrecisionOptimizer(inner, model=amp, release_grad_buffer=segmented)
        own = {id(p) for p in amp.parameters() if p.dtype == torch.float32}  # the LayerNorm's: stepped directly
        seen, real = [], inner.step

        def spy():  # (not a step hook: an optimizer with hooks is stepped once per step, as it is)
            seen.extend((g["fused"], id(p) in own) for g in inner.param_groups for p in g["params"])
            real()

        monkeypatch.setattr(inner, "step", spy)
        for i in range(3):
            opt.zero_grad()
            opt.backward(amp(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).float().square().mean())
            opt.step()
        assert (opt.plan.runs is not None) == segmented
        masters = [f for f, is_own in seen if not is_own]
        assert len(masters) == 3 * 4 and all(f is (True if fused is None else False) for f in masters)
        assert sum(is_own for _, is_own in seen) == 3 * 2 and all(f is fused for f, is_own in seen if is_own)
        assert inner.param_groups[0]["fused"] is fused and inner.param_groups[0]["foreach"] is None
        out[fused] = [m.detach().clone() for _, m in opt.master_pairs()]
    for a, b in zip(out[None], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_names_that_left_the_scaler_and_the_engine_resolve_at_their_old_paths_with_a_warning():
    """A step runs code in three files (tests/test_layout.py): the check and the staging moved to the executors, the
    decision to the engine, the planning to plan, clipping to iteration; their old names still resolve, warning."""
    from fxamp.training import executors, iteration, loss_scale, plan, step

    for module, name, home in ((loss_scale, "FoundInf", executors), (loss_scale, "note_non_finite_", executors),
                               (loss_scale, "DeviceFlag", step), (loss_scale, "agree", step),
                               (loss_scale, "StepResult", step), (step, "SEGMENT_NUMEL", plan),
                               (step, "plan_runs", plan), (step, "step_runs", executors), (step, "flat_grads", executors),
                               (step, "clip_factor", iteration)):
        with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{name} is deprecated and kept for one release: "
                                                    f"write 'from {home.__name__} import {name}'"):
            assert getattr(module, name) is getattr(home, name)
