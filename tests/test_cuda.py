"""fxamp on a CUDA device: what the CPU suite checks, where the kernels are cuBLAS/cuDNN's.

Skipped without CUDA (CI has none); run on a GPU machine with ``python -m pytest tests/test_cuda.py``.
Dtypes of every safe/unsafe aten op, numerics against float32 and ``torch.autocast("cuda")``, the
optimizer wrapper's skip-on-overflow (nothing changes) and its segmented step (bitwise the plain
one), ``torch.compile`` and checkpoints.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from dtype_observer import OpDtypes
from zoo import build, inputs_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
LOW = (torch.float16, torch.bfloat16)
SAFE_ATEN = {"addmm", "mm", "bmm", "convolution", "cudnn_convolution", "baddbmm"}
UNSAFE_ATEN = {"_log_softmax", "native_layer_norm", "exp", "pow", "nll_loss_forward"}
MODELS = ("MLP", "ResNet", "Attention", "TokenModel", "TiedLM")


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean().clamp_min(1e-30))).item()


def first(out):
    return out[0] if isinstance(out, tuple) else out


def on_cuda(name: str):
    model = build(name).to(DEV).eval()
    return model, tuple(t.to(DEV) for t in inputs_for(name, batch=8))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_dtypes_and_numerics_against_autocast(name, dtype, policy):
    model, x = on_cuda(name)
    with torch.no_grad():
        ref = first(model(*x)).float()
        with torch.autocast(DEV, dtype=dtype):
            ac = first(model(*x)).float()
        amp = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype)
        with OpDtypes() as rec:
            out = first(amp(*x))
    assert out.device.type == DEV and out.dtype == torch.float32
    assert all(p.device.type == DEV for p in amp.parameters())
    for call in rec.of(*SAFE_ATEN):
        assert set(call.inputs) == {dtype}, (call.op, call.inputs)
    for call in rec.of(*UNSAFE_ATEN):
        assert call.inputs[0] == torch.float32, (call.op, call.inputs)
    assert rec.of(*SAFE_ATEN), "no safe op ran: the model is wrong"
    # as close to float32 as autocast is, give or take 3 dB (a different rounding of the same ops)
    assert sqnr(ref, out) > sqnr(ref, ac) - 3.0, (sqnr(ref, out), sqnr(ref, ac))


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_o2_training_tracks_float32(dtype):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)).to(DEV)
    model = fxamp.convert(copy.deepcopy(ref), "O2", dtype=dtype)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model)
    g = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(20):
        x = torch.randn(32, 64, device=DEV, generator=g)
        y = torch.randint(0, 10, (32,), device=DEV, generator=g)
        opt_ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x), y))
        assert opt.step()
    masters = list(opt.master_params())
    assert all(m.dtype == torch.float32 and m.device.type == DEV for m in masters)
    for p, m in zip(ref.parameters(), masters):
        assert torch.allclose(p, m, atol=2e-2, rtol=0), (p - m).abs().max()


def test_fp16_overflow_skips_and_changes_nothing():
    torch.manual_seed(0)
    model = fxamp.convert(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(DEV), "O2",
                          dtype=torch.float16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, fused=True), model=model)
    x = torch.randn(8, 32, device=DEV)
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    assert opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [m.clone() for m in opt.master_params()]
    state = copy.deepcopy(opt.optimizer.state_dict())
    scale = opt.current_scale
    opt.zero_grad()
    opt.backward(model(x).float().square().mean() * float("inf"))
    assert not opt.step()
    assert opt.skipped_steps == 1 and opt.current_scale == scale / 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params()))
    after = opt.optimizer.state_dict()["state"]
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(t, after[k][name]), (k, name)


def _train_o2(base: nn.Module, steps: int, fused: bool = True, **wrapper_kwargs):
    """An O2 bfloat16 copy of ``base`` trained ``steps`` steps by MixedPrecisionOptimizer(AdamW(fused=fused),
    **wrapper_kwargs) on the same random batches every call: (model, optimizer, what each step returned)."""
    model = fxamp.convert(copy.deepcopy(base), "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused),
                                        model=model, **wrapper_kwargs)
    g = torch.Generator(device=DEV).manual_seed(2)
    results = []
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(model(torch.randn(16, base[0].in_features, device=DEV, generator=g)).float().square().mean())
        results.append(opt.step())
    return model, opt, results


def test_segmented_step_is_bitwise_the_plain_step():
    """Masters' gradients of 32 MiB: step() segments them (release_grad_buffer=True), or not (False)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048)).to(DEV)
    (m1, o1, _), (m2, o2, _) = (_train_o2(base, 3, release_grad_buffer=release) for release in (True, False))
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(o1.master_params(), o2.master_params()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_compile_step_matches_the_inner_step(fused, fused_at_any_size, small_chunks):
    """compile_step=True on CUDA (inductor's Triton kernels): one step from the same state as the inner
    AdamW (fused or not), the masters within a few float32 ulps of their scale."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 256)).to(DEV)
    (m1, o1, r1), (m2, o2, r2) = (_train_o2(base, 1, fused, compile_step=c) for c in (False, True))
    assert bool(r1[0]) and bool(r2[0])
    for a, b in zip(o1.master_params(), o2.master_params()):
        eps = 8 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(b, a, rtol=eps, atol=eps * float(a.abs().max()))
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=2 ** -7, atol=0)


def test_compile_of_o2_matches_eager():
    torch.manual_seed(0)
    model, x = on_cuda("Attention")
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16)
    compiled = torch.compile(amp)
    with torch.no_grad():
        eager, out = first(amp(*x)), first(compiled(*x))
    assert out.dtype == eager.dtype == torch.float32
    assert sqnr(eager, out) > 35.0  # the same bf16 ops, fused differently


def test_state_dict_keys_and_save_load_round_trip():
    model, x = on_cuda("TiedLM")
    amp = fxamp.convert(copy.deepcopy(model), "O2", dtype=torch.bfloat16)
    assert list(amp.state_dict()) == list(model.state_dict())
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(first(loaded(*x)), first(amp(*x)))


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("width", [64, 2048], ids=["plain", "segmented"])
def test_the_host_never_waits_for_a_step(dtype, width):
    """With a fused inner optimizer, forward + backward + step() never synchronize with the GPU
    (``torch.cuda.set_sync_debug_mode("error")`` raises on any call that would), overflow or not;
    the outcome is counted at the next zero_grad()."""
    torch.manual_seed(0)
    model = fxamp.convert(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width),
                                        nn.Linear(width, width)).to(DEV), "O2", dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model)
    x = torch.randn(16, width, device=DEV)
    for i in range(4):
        opt.zero_grad()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x).float().square().mean()
            if i == 2:
                loss = loss * float("nan")
            opt.backward(loss)
            result = opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(result, fxamp.training.optimizer.StepResult)
        if i == 1:
            weights = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(opt.optimizer.state_dict()["state"])
        if i == 2:
            assert not result
            assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
            after = opt.optimizer.state_dict()["state"]
            assert all(torch.equal(t, after[k][n]) for k, v in state.items() for n, t in v.items())
            assert opt.overflowed_params()
    assert opt.skipped_steps == 1 and opt.scaler.overflows == 1


def test_a_shared_dynamic_scaler_reads_the_flag_in_update_only():
    """Two optimizers, one float16 LossScaler (as FxampPrecision shares it): step() does not wait;
    the caller's update() reads both flags and moves the scale."""
    torch.manual_seed(0)
    scaler = fxamp.training.loss_scale.LossScaler(fxamp.LossScaleConfig("dynamic", init_scale=2.0 ** 10))
    a = fxamp.convert(nn.Sequential(nn.Linear(32, 32), nn.GELU()).to(DEV), "O2", dtype=torch.float16)
    b = fxamp.convert(nn.Linear(32, 4).to(DEV), "O2", dtype=torch.float16)
    opts = [fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True), model=m,
                                          loss_scale=scaler) for m in (a, b)]
    x = torch.randn(8, 32, device=DEV)
    for i in range(3):
        for o in opts:
            o.zero_grad()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = b(a(x)).float().square().mean()
            if i == 1:
                loss = loss * float("inf")
            opts[0].backward(loss)
            results = [o.step() for o in opts]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        scale = scaler.scale
        overflowed = scaler.update()
        assert bool(overflowed) == (i == 1)
        assert all(bool(r) == (i != 1) for r in results)
        assert scaler.scale == (scale / 2 if i == 1 else scale)
    assert [o.skipped_steps for o in opts] == [1, 1]
