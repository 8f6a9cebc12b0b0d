"""A run's lean masters moved together (fxamp.training.flat): the same numbers as the per-tensor math, and no memory
held between steps."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.training import flat, native, quant

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (300, 256, 1000, 17, 64 * 48, 1)  # partial last blocks, a whole one, a single element


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 20), nn.Linear(20, 4)).to(torch.bfloat16)


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_kahan_through_foreach_calls_is_the_per_tensor_math_bitwise(inner, monkeypatch):
    """Kahan's value (weight + term, in float32), the inner step, the weight's round-to-nearest and the new term
    (value - weight), written per tensor with plain torch: the flat path's weights and terms, bit for bit (the
    ``_foreach`` ops are elementwise the per-tensor ops)."""
    monkeypatch.setenv("FXAMP_NATIVE", "0")  # (the eager path for Adam too)
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, fused=True)}[inner]
    model, ref = _model(), _model()
    opt = fxamp.MixedPrecisionOptimizer(make(model.parameters()), masters="kahan", state="fp32", loss_scale="none")
    lows = list(ref.parameters())
    terms = [torch.zeros_like(p) for p in lows]
    values = [nn.Parameter(p.float()) for p in lows]
    ref_opt = make(values)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x).float(), torch.ones(8, 4)))
        opt.step()
        ref.zero_grad()
        F.mse_loss(ref(x).float(), torch.ones(8, 4)).backward()
        with torch.no_grad():
            for v, low, term in zip(values, lows, terms):
                v.copy_(low.float() + term.float())
                v.grad = low.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for v, low, term in zip(values, lows, terms):
                low.copy_(v)
                term.copy_(v - low.float())
    got = [opt.precision_of(m).term for _, m in opt.master_pairs()]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, terms)) and any(bool(t.any()) for t in got)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "eager"])
@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_a_flat_codes_every_master_as_its_own_compression_and_decodes_it_back(mode, kernel, monkeypatch):
    """One (de)quantization pass over a flat of masters (each padded to whole 8-bit blocks; on a CPU fxamp's kernel
    reading and writing each state's own codes) gives every master the codes and scales quant.compress gives it
    alone, and decodes to quant.decompress's values, bitwise."""
    if kernel and native.kernel() is None:
        pytest.skip(f"no CPU kernel here: {native.unavailable_reason()}")
    if not kernel:
        monkeypatch.setenv("FXAMP_NATIVE", "0")
    g = torch.Generator().manual_seed(0)
    masters = [torch.zeros(n) for n in SIZES]
    states, alone = [], []
    for n in SIZES:
        m = torch.randn(n, generator=g) * 1e-3
        v = torch.rand(n, generator=g) * 1e-6
        m[: n // 3] = 0  # (zeros: the lowest code; a zero block)
        states.append({"step": torch.tensor(3.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()})
        alone.append({"step": torch.tensor(3.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()})
    for st in alone:
        quant.compress(st, mode)
    fl, saved = flat.Flat(masters), {}
    flat.encode(fl, mode, states, saved)
    for st, ref in zip(states, alone):
        assert set(st) == set(ref)
        assert all(torch.equal(st[k], ref[k]) and st[k].dtype == ref[k].dtype for k in ref if k != "step")
    flat.decode(fl, mode, states, saved)
    for st, ref in zip(states, alone):
        quant.decompress(ref)
        assert all(torch.equal(st[k], ref[k]) for k in ("exp_avg", "exp_avg_sq"))
    flat.encode(fl, mode, states, saved)  # written over what decode took (no new tensors)
    assert all(st["exp_avg"] is saved[(id(st), "exp_avg")] for st in states)


@pytest.mark.parametrize("path", ["kernel", "eager, one slice", "eager, slices"])
def test_a_flats_8bit_code_is_the_eager_code_bitwise_at_its_edges(path, monkeypatch):
    """A flat's coding, by the CPU kernel (two passes around torch's own log2, the multiply-add fused as torch.add's)
    or by eager ops (on kept views of the whole flat where it is one slice, else a slice at a time), against
    quant.quantize's eager ops per tensor, bitwise, where a code could tip: values on the codes' boundaries,
    magnitudes 30 octaves apart in a block, subnormals, zeros and all-zero blocks, negative zeros, a block of one
    subnormal value, tensors of partial blocks and one of several slices (quant.CHUNK)."""
    if path == "kernel" and native.kernel() is None:
        pytest.skip(f"no CPU kernel here: {native.unavailable_reason()}")
    if path != "kernel":
        monkeypatch.setenv("FXAMP_NATIVE", "0")
    g = torch.Generator().manual_seed(1)
    sizes = [300, 256, 1000, 17, 1] + ([3 * quant.CHUNK // 2 + 5] if path != "eager, one slice" else [])
    states, alone = [], []
    for n in sizes:
        m = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 5, (n,), generator=g).float())
        v = torch.rand(n, generator=g) * torch.exp2(torch.randint(-60, 0, (n,), generator=g).float())
        m[: n // 5] = 0
        v[n // 7: n // 7 + n // 9] = 0
        if n >= 1000:
            m[300], m[301], v[302], m[303] = 2.0 ** -140, -2.0 ** -130, 2.0 ** -145, -0.0
            m[512:768] = 2.0 ** -127  # a block of one subnormal value
        if n >= 1024:  # within 64 float32 ulps of the codes' boundaries (where a rounding more or less tips a
            # code: one in fifty here, were the multiply-add not fused as torch's is)
            for x, top, k, low in ((m, 127, 7, 0), (v, 255, 10, 1)):
                at = torch.exp2((torch.randint(low, top, (255,), generator=g).float() - top - 0.5) / k)
                x[769:1024] = (at.view(torch.int32) + torch.randint(-64, 64, (255,), generator=g,
                                                                    dtype=torch.int32)).view(torch.float32)
                x[768] = 1.0  # (the block's absmax)
        states.append({"exp_avg": m.clone(), "exp_avg_sq": v.clone()})
        alone.append({"exp_avg": m.clone(), "exp_avg_sq": v.clone()})
    for st in alone:
        quant.compress(st, "int8")
    fl, saved = flat.Flat([torch.zeros(n) for n in sizes]), {}
    flat.encode(fl, "int8", states, saved)
    for st, ref in zip(states, alone):
        assert all(torch.equal(st[k], ref[k]) and st[k].dtype == ref[k].dtype for k in ref)
    flat.decode(fl, "int8", states, saved)
    for st, ref in zip(states, alone):
        quant.decompress(ref)
        assert all(torch.equal(st[k], ref[k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("masters,state", [("kahan", "int8"), ("stochastic", "bf16"), ("fp32", "int8")])
def test_the_flat_buffers_hold_no_memory_between_steps(masters, state, monkeypatch):
    """The flats' views are kept from step to step; their storage is given back after each (a lean master keeps
    no float32 copy between steps, nor its state a float32 form)."""
    monkeypatch.setenv("FXAMP_NATIVE", "0")  # (the kernel would take them all)
    seen = []
    real = flat.Flat.take

    def take(self, role, dtype=torch.float32):
        seen.append(self)
        return real(self, role, dtype)

    monkeypatch.setattr(flat.Flat, "take", take)
    model = _model()
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), masters=masters, state=state)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(torch.randn(8, 16).to(torch.bfloat16)).float().square().mean())
        opt.step()
        assert seen and all(buf.untyped_storage().nbytes() == 0 for f in seen for buf, _ in f.buffers.values())
    assert len({id(f) for f in seen}) <= 2  # (values and state: made once, reused)
