"""A step decided on the device: the host never waits for the overflow check (GPU: tests/test_cuda.py).

With a fused inner optimizer on one CUDA device, ``MixedPrecisionOptimizer`` hands the overflow
flag to the optimizer's kernel (which skips there) and settles the bookkeeping when the next
iteration starts.  Here the same code runs on CPU (``fxamp.training.plan.DECIDE_ON`` patched to include
it; torch's CPU fused AdamW honours ``found_inf`` too) and is compared with the host-decided step:
the same weights, masters, optimizer state and scale, bit for bit, through clean steps, planted
overflows, clipping and the segmented step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.training.optimizer import StepResult


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr("fxamp.training.plan.DECIDE_ON", ("cuda", "cpu"))


def _model(dtype, big=False):
    torch.manual_seed(0)
    d = 1024 if big else 32  # big: 16 MiB of float32 gradients or more, the step is segmented
    base = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d), nn.Linear(d, 8))
    return fxamp.convert(base, "O2", dtype=dtype)


def _run(dtype, steps, *, big=False, clip=None, poison=(), fused=True, shared=False, deferred_expected=None,
         compile_step=False, make=None):
    """Train ``steps`` steps; the steps in ``poison`` get a NaN loss.  Returns (model, opt, results, scales)."""
    model = _model(dtype, big)
    inner = (make or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=fused)))(model.parameters())
    kwargs = {"loss_scale": fxamp.training.loss_scale.LossScaler(fxamp.LossScaleConfig("dynamic", init_scale=2.0 ** 8))} if shared else {}
    opt = fxamp.MixedPrecisionOptimizer(inner, model=model, compile_step=compile_step, **kwargs)
    g = torch.Generator().manual_seed(1)
    results, scales = [], []
    for i in range(steps):
        x = torch.randn(16, 1024 if big else 32, generator=g)
        opt.zero_grad()
        scales.append(opt.current_scale)
        loss = model(x).float().square().mean()
        if i in poison:
            loss = loss * float("nan")
        opt.backward(loss)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        r = opt.step()
        if deferred_expected is not None:
            assert isinstance(r, StepResult) is deferred_expected, type(r)
        if shared:
            opt.scaler.update()
        results.append(bool(r))
    return model, opt, results, scales


def _same(a, b):
    (ma, oa, ra, sa), (mb, ob, rb, sb) = a, b
    assert ra == rb and sa == sb
    for x, y in zip(ma.state_dict().values(), mb.state_dict().values()):
        assert torch.equal(x, y)
    for x, y in zip(oa.master_params(), ob.master_params()):
        assert torch.equal(x, y)
    sda, sdb = oa.optimizer.state_dict()["state"], ob.optimizer.state_dict()["state"]
    for k in sda:
        for name in sda[k]:
            assert torch.equal(sda[k][name], sdb[k][name]), (k, name)
    assert oa.skipped_steps == ob.skipped_steps
    assert oa.scaler.overflows == ob.scaler.overflows
    assert oa.current_scale == ob.current_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("big", [False, True], ids=["plain", "segmented"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["", "clip"])
def test_same_steps_as_deciding_on_the_host(monkeypatch, dtype, big, clip):
    poison = (2, 3)  # two overflows in a row: under float16 the dynamic scale backs off twice
    host = _run(dtype, 6, big=big, clip=clip, poison=poison, deferred_expected=False)
    monkeypatch.setattr("fxamp.training.plan.DECIDE_ON", ("cuda", "cpu"))
    device = _run(dtype, 6, big=big, clip=clip, poison=poison, deferred_expected=True)
    _same(host, device)
    assert device[2] == [True, True, False, False, True, True]
    assert device[1].skipped_steps == 2
    if dtype == torch.float16:
        assert device[3][4] == device[3][2] / 4  # the scale moved on the outcomes, at the next zero_grad


def test_a_skip_changes_nothing_and_is_reported(on_device):
    model = _model(torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    x = torch.randn(4, 32)
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    assert opt.step() == True  # noqa: E712 - a StepResult compares equal to the bool it stands for
    weights = copy.deepcopy(model.state_dict())
    masters = [m.clone() for m in opt.master_params()]
    state = copy.deepcopy(opt.optimizer.state_dict())
    opt.zero_grad()
    opt.backward(model(x).float().sum() * float("inf"))
    r = opt.step()
    assert isinstance(r, StepResult) and not r and r == False  # noqa: E712
    assert opt.skipped_steps == 1 and opt.scaler.overflows == 1
    assert opt.overflowed_params()  # named while the gradients are still there
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params()))
    after = opt.optimizer.state_dict()["state"]
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(t, after[k][name]), (k, name)
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    assert opt.step() and opt.overflowed_params() == []


def test_state_dict_after_a_deferred_skip_counts_it(on_device):
    model = _model(torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    opt.backward(model(torch.randn(4, 32)).float().sum() * float("nan"))
    opt.step()
    assert opt.state_dict()["skipped_steps"] == 1


def test_decided_on_the_host_with_a_non_fused_optimizer(on_device):
    """A non-fused optimizer cannot skip on the device."""
    _run(torch.float16, 3, poison=(1,), fused=False, deferred_expected=False)


def test_a_shared_dynamic_scaler_moves_in_the_callers_update(monkeypatch):
    """Shared (``loss_scale=scaler``, the caller runs ``update()``, as FxampPrecision does): decided on
    the device too; update() reads the flag, after the step's kernels are queued.  The same steps."""
    host = _run(torch.float16, 6, poison=(2, 3), shared=True, deferred_expected=False)
    monkeypatch.setattr("fxamp.training.plan.DECIDE_ON", ("cuda", "cpu"))
    device = _run(torch.float16, 6, poison=(2, 3), shared=True, deferred_expected=True)
    _same(host, device)
    assert device[1].scaler.overflows == 2 and device[3][4] == device[3][2] / 4


def test_step_twice_is_still_refused(on_device):
    model = _model(torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    opt.backward(model(torch.randn(4, 32)).float().sum())
    opt.step()
    with pytest.raises(fxamp.OptimizerStateError, match="without a backward"):
        opt.step()


@pytest.mark.parametrize("read", ["overflows", "scale", "state_dict"])
def test_reading_the_owned_scaler_straight_after_a_deferred_step_is_not_behind(on_device, read):
    """opt.scaler answers as if the step had been decided on the host: the deferred update runs first."""
    model = _model(torch.float16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    before = opt.scaler.scale
    opt.backward(model(torch.randn(4, 32)).float().sum() * float("nan"))
    assert isinstance(opt.step(), StepResult)
    if read == "overflows":
        assert opt.scaler.overflows == 1
    elif read == "scale":
        assert opt.scaler.scale == before / 2
    else:
        state = opt.scaler.state_dict()
        assert state["overflows"] == 1 and state["scale"] == before / 2 and state["updates"] == 1
    assert opt.skipped_steps == 1 and opt.current_scale == before / 2  # settled once, not twice


def test_a_loop_that_never_reads_the_scaler_does_not_pile_up_catch_ups(on_device):
    """Each deferred step registers its catch-up with the owned scaler; steps that settle by
    themselves (zero_grad) must not leave one entry per step behind (a leak over a long run)."""
    model = _model(torch.float16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    x = torch.randn(4, 32)
    for _ in range(5):
        opt.zero_grad()
        opt.backward(model(x).float().sum())
        assert isinstance(opt.step(), StepResult)
    assert opt.scaler.catch_ups == 1  # (counted without draining the list)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["", "clip"])
def test_compile_step_skips_on_the_device_as_on_the_host(monkeypatch, dtype, clip, fused_at_any_size, small_chunks):
    """compile_step=True with a fused AdamW: the Adam kernel takes the device's flag (and the fallback
    steps of the small and float32 parameters the fused inner optimizer's), bit for bit the
    host-decided compiled step through two planted overflows; skipped steps advance no step count."""
    from fxamp.training import kernels as fused_step

    monkeypatch.setattr(fused_step, "FUSED_MIN_NUMEL", 1000)  # the 32 x 32 weights fused, biases not
    poison = (2, 3)
    host = _run(dtype, 6, clip=clip, poison=poison, deferred_expected=False, compile_step=True)
    monkeypatch.setattr("fxamp.training.plan.DECIDE_ON", ("cuda", "cpu"))
    device = _run(dtype, 6, clip=clip, poison=poison, deferred_expected=True, compile_step=True)
    _same(host, device)
    assert device[2] == [True, True, False, False, True, True]
    steps = {float(st["step"]) for st in device[1].optimizer.state.values()}
    assert steps == {4.0}


def test_compile_step_with_sgd_decides_on_the_host(on_device, fused_at_any_size, small_chunks):
    """SGD's kernel has no flag (its first momentum step cannot be told from a skipped one)."""
    _run(torch.float16, 3, poison=(1,), compile_step=True, deferred_expected=False,
         make=lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True))
