"""The lean step's CPU kernel (fxamp/training/lean_kernel.c, loaded by fxamp.training.native): one pass per
element for a bfloat16 lean master (stochastic or kahan) with 8-bit Adam state, against the eager path it
replaces (dequantize, torch's fused AdamW, quantize, stochastic rounding or the Kahan split)."""

import hashlib
import math
import platform

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.training import flat, lean, lean_step, native, quant
from fxamp.training.config import LeanConfig

pytestmark = pytest.mark.skipif(native.kernel() is None, reason=f"no CPU kernel here: {native.unavailable_reason()}")

TABLES, CODES = quant.code_constants()


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).bfloat16()
    grad = torch.randn(n, generator=g) * 1e-3
    m = torch.randn(n, generator=g) * 1e-4
    v = (torch.randn(n, generator=g) * 1e-4) ** 2
    m[:700], v[:700], grad[:700] = 0, 0, 0  # two all-zero blocks and a partial one: an embedding's untouched rows
    return w, grad, m, v


def _eager(w, term, grad, m, v, step, noise_key, opt_cls, **hp):
    """The eager lean step of one tensor: float32 value, torch's fused Adam(W), 8-bit codes, the weight's rounding."""
    p = nn.Parameter(w.float() + (term.float() if term is not None else 0))
    p.grad = grad.clone()
    opt = opt_cls([p], fused=True, **hp)
    cm, am = quant.quantize(m, True)
    cv, av = quant.quantize(v, False)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": quant.dequantize(cm, am, True),
                    "exp_avg_sq": quant.dequantize(cv, av, False)}
    opt.step()
    new_w = torch.empty_like(w)
    new_term = p.detach().clone()  # stochastic: the float32 value the kernel's rounding must land beside
    if term is None:
        lean.stochastic_round(p.detach(), new_w, noise_key)  # (any key: the kernel hashes its own noise)
    else:
        new_w.copy_(p.detach())
        new_term = (p.detach() - new_w.float()).to(torch.bfloat16)
    cm, am = quant.quantize(opt.state[p]["exp_avg"], True)
    cv, av = quant.quantize(opt.state[p]["exp_avg_sq"], False)
    return new_w, new_term, (cm, am, cv, av)


@pytest.mark.parametrize("kahan", [False, True], ids=["stochastic", "kahan"])
@pytest.mark.parametrize("opt_cls,wd", [(torch.optim.AdamW, 0.01), (torch.optim.Adam, 0.01), (torch.optim.AdamW, 0.0)],
                         ids=["adamw", "adam-l2", "no-decay"])
def test_the_kernel_is_the_eager_lean_step_up_to_float32_rounding(kahan, opt_cls, wd):
    """Same update (torch's fused Adam(W) arithmetic and coefficients), same codes but within ~1e-6 of a code
    boundary (a series log2): Kahan's weight and term equal but for a last-bit rounding, a stochastically
    rounded weight one of the two bfloat16 neighbours of the same float32 value (the noise is the kernel's own
    hash, the eager path's too, of a float32 value that may differ in its last bit); codes equal but for a few in
    ten thousand, one code apart."""
    n = 5 * 256 + 100
    w, grad, m, v = _state(n)
    term = (torch.randn(n) * 1e-5).bfloat16() if kahan else None
    hp = dict(lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    ref_w, ref_term, (cm_r, am_r, cv_r, av_r) = _eager(w, term, grad, m, v, 7, 5,
                                                      opt_cls, **hp)
    cm, am = quant.quantize(m, True)
    cv, av = quant.quantize(v, False)
    low, t = w.clone(), None if term is None else term.clone()
    native.lean_adam(low, t, grad, cm, am, cv, av, None if kahan else 12345, TABLES, lr=6e-4, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=opt_cls is torch.optim.AdamW, step=7,
                          codes=CODES)
    if not kahan:  # a neighbour of the float32 value: below it and above it by less than one bfloat16 ulp
        value = ref_term
        ulp = value.abs() * 2 ** -7
        assert bool(((low.float() - value).abs() < ulp).all())
        assert 0.2 < float((low.float() > value).float().mean()) < 0.8  # rounded up and down
    if kahan:  # weight + term (~16 significant bits): the same value but for a last-bit rounding of the update
        got, want = low.float() + t.float(), ref_w.float() + ref_term.float()
        assert bool(((got - want).abs() <= 2 ** -15 * want.abs()).all()) and int((got != want).sum()) <= 0.01 * n
    for got, want in ((cm, cm_r), (cv, cv_r)):
        diff = (got.int() - want.int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 3
    torch.testing.assert_close(am, am_r, rtol=1e-6, atol=0)
    torch.testing.assert_close(av, av_r, rtol=1e-5, atol=0)
    if opt_cls is torch.optim.AdamW:  # (Adam's L2 decay adds the weight to the zero gradients)
        assert am[:2].tolist() == [0.0, 0.0] and bool((quant.dequantize(cm, am, True)[:700] == 0).all())


@pytest.mark.parametrize("kahan", [False, True], ids=["stochastic", "kahan"])
def test_bfloat16_state_is_the_eager_steps_rounding_to_nearest(kahan):
    """``state="bf16"``: the moments decoded by widening and stored rounded to nearest even, as
    ``Tensor.to(torch.bfloat16)`` does: equal to the eager step's but where its float32 update differs in the
    last bit (a few in ten thousand, one bfloat16 ulp)."""
    n = 3 * 256 + 17
    w, grad, m, v = _state(n, seed=3)
    m16, v16 = m.bfloat16(), v.bfloat16()
    term = (torch.randn(n) * 1e-5).bfloat16() if kahan else None
    p = nn.Parameter(w.float() + (term.float() if kahan else 0))
    p.grad = grad.clone()
    opt = torch.optim.AdamW([p], fused=True, lr=1e-3, weight_decay=0.01)
    opt.state[p] = {"step": torch.tensor(4.0), "exp_avg": m16.float(), "exp_avg_sq": v16.float()}
    opt.step()
    low, t = w.clone(), None if term is None else term.clone()
    native.lean_adam(low, t, grad, m16, None, v16, None, None if kahan else 3, TABLES, lr=1e-3, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, step=5, codes=CODES)
    for got, want in ((m16, opt.state[p]["exp_avg"].bfloat16()), (v16, opt.state[p]["exp_avg_sq"].bfloat16())):
        assert int((got != want).sum()) <= 3 and bool(((got.float() - want.float()).abs()
                                                      <= want.float().abs() * 2 ** -7).all())
    value = p.detach()
    if kahan:
        assert bool(((low.float() + t.float() - value).abs() <= 2 ** -15 * value.abs()).all())
    else:
        assert bool(((low.float() - value).abs() < value.abs() * 2 ** -7).all())


def _zero_state(n):
    return (torch.zeros(n, dtype=torch.int8), torch.zeros(-(-n // 256)), torch.zeros(n, dtype=torch.uint8),
            torch.zeros(-(-n // 256)))


@pytest.mark.parametrize("base", [0, 1000, 2 ** 32 - 1000])
def test_the_kernel_and_the_eager_path_round_with_the_same_noise(base):
    """With beta1 = beta2 = 0 and no eps, Adam's step from gradient 1 moves every weight by lr exactly: 1 - 2^-9,
    halfway between two bfloat16 values; the kernel's stochastic rounding of it is lean.stochastic_round's, bit for
    bit (one hash of the key and the element's place), so a master stepped by either path is rounded alike."""
    n = 5000
    low = torch.ones(n, dtype=torch.bfloat16)
    cm, am, cv, av = _zero_state(n)
    key = flat.key(3, 5, 7)
    native.lean_adam(low, None, torch.ones(n), cm, am, cv, av, key, TABLES, lr=2 ** -9, beta1=0.0, beta2=0.0,
                     eps=0.0, weight_decay=0.0, decoupled=True, step=1, codes=CODES, base=base)
    eager = torch.empty_like(low)
    lean.stochastic_round(torch.full((n,), 1.0 - 2 ** -9), eager, key, first=base)
    assert set(low.float().unique().tolist()) == {1.0 - 2 ** -8, 1.0}
    assert torch.equal(low.view(torch.int16), eager.view(torch.int16))


def test_the_kernels_stochastic_rounding_is_unbiased_and_a_pure_function_of_key_and_place():
    """Adam's first step from zero state moves each weight by lr (m / sqrt(v) = 1): 1.0 - 2^-9 lies halfway
    between the bfloat16 neighbours 1 - 2^-8 and 1.0, so each is drawn half the time."""
    n = 20000

    def run(key, lo=0, hi=n):
        low = torch.ones(n, dtype=torch.bfloat16)
        cm, am, cv, av = _zero_state(n)
        sl, bl = slice(lo, hi), slice(lo // 256, -(-hi // 256))
        native.lean_adam(low[sl], None, torch.ones(hi - lo), cm[sl], am[bl], cv[sl], av[bl], key, TABLES,
                              lr=2 ** -9, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0, decoupled=True, step=1,
                              codes=CODES, base=lo)
        return low

    low = run(7)
    assert set(low.float().unique().tolist()) == {1.0 - 2 ** -8, 1.0}
    assert abs(float(low.float().mean()) - (1.0 - 2 ** -9)) < 1e-4
    assert torch.equal(low, run(7)) and float((low != run(8)).float().mean()) > 0.4
    # a slice stepped alone (its place given as base) draws what it draws within the whole tensor
    part = torch.ones(n, dtype=torch.bfloat16)
    part[:512], part[512:] = run(7, 0, 512)[:512], run(7, 512, n)[512:]
    assert torch.equal(part, low)


def test_the_kernels_rounding_keeps_inf_and_nan_and_a_weight_without_update():
    n = 256
    w, grad, m, v = _state(n)
    w[:3] = torch.tensor([math.inf, -math.inf, math.nan])
    cm, am = quant.quantize(m, True)
    cv, av = quant.quantize(v, False)
    low = w.clone()
    native.lean_adam(low, None, grad, cm, am, cv, av, 99, TABLES, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, decoupled=True, step=1, codes=CODES)
    assert low[0].item() == math.inf and low[1].item() == -math.inf and math.isnan(low[2].item())
    assert torch.equal(low[3:], w[3:])  # lr 0: a bfloat16 value plus less than one ulp of noise is itself


def test_bad_tensors_are_refused_in_one_line():
    w, grad, m, v = _state(512)
    cm, am = quant.quantize(m, True)
    cv, av = quant.quantize(v, False)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, step=1, codes=CODES)
    with pytest.raises(ValueError, match="mismatched sizes"):
        native.lean_adam(w, None, grad[:256], cm, am, cv, av, 1, TABLES, **kw)
    with pytest.raises(ValueError, match="contiguous CPU"):
        native.lean_adam(w.view(2, 256).t(), None, grad, cm, am, cv, av, 1, TABLES, **kw)
    with pytest.raises(ValueError, match="a Kahan term or a stochastic rounding key"):
        native.lean_adam(w, None, grad, cm, am, cv, av, None, TABLES, **kw)


def test_an_unwritable_cache_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a file where the cache folder should be: mkdir fails
    monkeypatch.setenv("FXAMP_CACHE", str(blocked / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    fn = native.build()
    assert isinstance(fn, dict) and list((tmp_path / "tmp").glob("fxamp-*/lean_kernel-*.so"))


def test_without_a_compiler_the_eager_path_steps_and_the_table_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("FXAMP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert native.build().startswith("/bin/false failed")
    monkeypatch.setenv("FXAMP_NATIVE", "0")
    assert native.build() == "FXAMP_NATIVE=0" == native.unavailable_reason() and native.kernel() is None
    calls = []
    monkeypatch.setattr(native, "lean_adam", lambda *a, **k: calls.append(1))
    amp, opt = _trained("stochastic", steps=3)
    assert not calls and "stepped eagerly (FXAMP_NATIVE=0)" in opt.precision_table()


def _trained(masters, steps=30, seed=0, state="int8"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512))
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=3e-3), model=amp, seed=1,
                                        precision=LeanConfig(masters, state))
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 512, (8, 17), generator=g) for _ in range(4)]  # learnt by heart: the loss falls
    losses = []
    for i in range(steps):
        d = data[i % 4]
        opt.zero_grad()
        loss = F.cross_entropy(amp(d[:, :-1]).float().flatten(0, 1), d[:, 1:].flatten())
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    opt.losses = losses
    return amp, opt


@pytest.mark.parametrize("masters,state", [("stochastic", "int8"), ("kahan", "int8"), ("kahan", "bf16")])
def test_training_with_the_kernel_tracks_the_eager_path(masters, state, monkeypatch):
    calls = []
    real = native.lean_adam
    monkeypatch.setattr(native, "lean_adam", lambda *a, **k: (calls.append(1), real(*a, **k)))
    _, fast = _trained(masters, state=state)
    assert calls  # (the first step makes the lean state eagerly; the kernel steps the rest)
    assert "stepped by fxamp's CPU kernel" in fast.precision_table()
    monkeypatch.setenv("FXAMP_NATIVE", "0")
    _, eager = _trained(masters, state=state)
    assert eager.losses[-1] < 0.6 * eager.losses[0]
    assert abs(fast.losses[-1] - eager.losses[-1]) < 0.02 * eager.losses[-1]


def test_codes_a_loader_cast_to_float_step_as_the_codes_do():
    """Optimizer.load_state_dict casts state to the parameter's dtype (float32 for a lean master's placeholder);
    Lightning's restore leaves it so until the step: the kernel must step the codes, not their float bytes."""
    n = 3 * 256
    w, grad, m, v = _state(n)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False}
    runs = []
    for cast in (False, True):
        cm, am = quant.quantize(m, True)
        cv, av = quant.quantize(v, False)
        state = {"step": torch.tensor(3.0), "exp_avg": cm, "exp_avg.absmax": am, "exp_avg_sq": cv,
                 "exp_avg_sq.absmax": av}
        if cast:
            state = {k: t.float() for k, t in state.items()}
        low = w.clone()
        hyper = native.hyperparameters(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), group)
        native.adam_step(state, low, None, grad, 5, "int8", hyper, step=4.0)
        runs.append((low, state["exp_avg"], state["exp_avg_sq"]))
    assert runs[1][1].dtype == torch.int8 and runs[1][2].dtype == torch.uint8
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(TypeError, match="int8 and uint8 codes with float32 absmax, or bfloat16 moments"):
        native.lean_adam(w, None, grad, cm.float(), am, cv, av, 1, TABLES, lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, decoupled=True, step=1, codes=CODES)


def test_the_bits_do_not_depend_on_the_thread_count():
    """The kernel's blocks are split among torch's OpenMP threads: each block is computed alone, so one thread
    and two give the same weights, codes and absmax."""
    n = 4 * 65536 + 300
    w, grad, m, v = _state(n, seed=1)
    threads = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            cm, am = quant.quantize(m, True)
            cv, av = quant.quantize(v, False)
            low = w.clone()
            native.lean_adam(low, None, grad, cm, am, cv, av, 2, TABLES, lr=1e-3, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.01, decoupled=True, step=2, codes=CODES)
            out.append((low, cm, am, cv, av))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("state", ["int8", "bf16"])
@pytest.mark.parametrize("kahan", [False, True], ids=["stochastic", "kahan"])
def test_a_bfloat16_gradient_times_its_multiplier_is_the_widened_unscaled_one(state, kahan):
    """The kernel reads a segmented step's bfloat16 gradient where it is, times 1/scale: the same bits as the
    float32 gradient the engine's unscale makes (widened, then one float32 multiply)."""
    n = 5 * 256 + 17
    w, grad, m, v = _state(n, seed=2)
    g16 = (grad * 3e4).bfloat16()
    inv = torch.tensor(2.0 ** -15) / 0.7  # (not a power of two: the multiply rounds)
    term = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-5).bfloat16()
    out = []
    for g, mul in ((g16, float(inv)), (g16.float() * inv, 1.0)):
        low, t = w.clone(), term.clone() if kahan else None
        if state == "int8":
            (cm, am), (cv, av) = quant.quantize(m, True), quant.quantize(v, False)
        else:
            cm, am, cv, av = m.bfloat16(), None, v.bfloat16(), None
        native.lean_adam(low, t, g, cm, am, cv, av, None if kahan else 7, TABLES, lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01, decoupled=True, step=4, codes=CODES, grad_mul=mul)
        out.append([x for x in (low, t, cm, am, cv, av) if x is not None])
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("masters,state", [("stochastic", "int8"), ("kahan", "bf16")])
def test_a_segmented_step_feeds_the_kernel_the_bfloat16_gradients_bitwise_the_plain_step(masters, state,
                                                                                          monkeypatch):
    """Segmented (a large model), the kernel's masters get no float32 gradient: it reads the bfloat16 ones, times
    1/scale; the weights and state are those of the plain step, which unscales into float32."""
    monkeypatch.setattr(lean_step, "PIECE", 1024)  # (the 64x64 weight would be sliced on the eager path)
    dtypes = {True: [], False: []}
    real = native.lean_adam
    out = []
    for release in (True, False):
        monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0 if release else 1 << 40)
        monkeypatch.setattr(native, "lean_adam", lambda *a, **k: (dtypes[release].append(a[2].dtype), real(*a, **k)))
        torch.manual_seed(0)
        amp = fxamp.convert(nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 4)),
                            "O2", dtype=torch.bfloat16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp, seed=3,
                                            release_grad_buffer=release, loss_scale="static:3000",
                                            precision=LeanConfig(masters, state))
        for step in range(4):
            opt.zero_grad()
            opt.backward(amp(torch.randn(16, 8, generator=torch.Generator().manual_seed(step))).float().square().mean())
            opt.step()
        assert (opt.plan.runs is not None) == release
        state_tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        out.append([p.detach().clone() for p in amp.parameters()] + state_tensors)
    assert dtypes[True] and set(dtypes[True]) == {torch.bfloat16} and set(dtypes[False]) == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(*out))


def _fixed(n):
    """A step's inputs from integer arithmetic alone (no random stream or transcendental a torch release may
    change): weights, a float32 gradient, 8-bit codes and their block scales, bfloat16 moments."""
    i = torch.arange(n, dtype=torch.int64)

    def u(a, b):  # in [-0.5, 0.5), float64: its products below round once into float32
        return ((i * a + b) % 2 ** 32).double() / 2 ** 32 - 0.5

    blocks = -(-n // 256)
    j = torch.arange(blocks, dtype=torch.int64)
    w = (u(2654435761, 1) * 0.04).bfloat16()
    grad = (u(2246822519, 2) * 2e-3).float()
    cm = ((i * 40503 + 3) % 256).to(torch.uint8).view(torch.int8)
    cv = ((i * 69069 + 5) % 256).to(torch.uint8)
    am = (((j * 7 + 1) % 13 + 1).double() * 1e-4).float()
    av = (((j * 5 + 2) % 11 + 1).double() * 1e-8).float()
    m16, v16 = (u(3266489917, 4) * 2e-4).bfloat16(), (u(668265263, 5).abs() * 1e-8).bfloat16()
    term = (u(374761393, 6) * 1e-5).bfloat16()
    grad[:300], cm[:300], cv[:300], am[:1] = 0, 0, 0, 0.0  # an all-zero block, and a partial one
    return w, grad, (cm, am, cv, av), (m16, v16), term


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(bytes(t.contiguous().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def _fixed_steps(n=5 * 256 + 83):
    """Digests of the kernel's step of :func:`_fixed`'s inputs: 8-bit or bfloat16 state, stochastic or kahan,
    AdamW; and the 8-bit stochastic step from the bfloat16 gradient times a multiplier, as Adam with L2 decay."""
    out = {}
    for state in ("int8", "bf16"):
        for kahan in (False, True):
            for g16 in ((False, True) if state == "int8" and not kahan else (False,)):
                w, grad, (cm, am, cv, av), (m16, v16), term = _fixed(n)
                moments = (cm, am, cv, av) if state == "int8" else (m16, None, v16, None)
                g, mul = ((grad * 3e4).bfloat16(), 1 / 3e4) if g16 else (grad, 1.0)
                native.lean_adam(w, term if kahan else None, g, *moments, None if kahan else 0x9E3779B97F4A7C15,
                                 TABLES, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                 decoupled=not g16, step=3, codes=CODES, base=1000, grad_mul=mul)
                kept = [w, *(t for t in moments if t is not None)] + ([term] if kahan else [])
                out[f"{state} {'kahan' if kahan else 'stochastic'}{' bf16 grad' if g16 else ''}"] = _digest(kept)
    return out


#: :func:`_fixed_steps` as the kernel computed it before its decode was done in registers (issue 39): any change of
#: the kernel's bits shows here
FIXED_STEPS = {"int8 stochastic": "2bbd3280a83d4549", "int8 stochastic bf16 grad": "f66979d0b246613e",
               "int8 kahan": "06b36aba3a425f37", "bf16 stochastic": "f009537ed3d7e7c1",
               "bf16 kahan": "a0269074e311db53"}


def test_the_kernels_bits_are_pinned():
    """The lean tests compare the kernel with the eager path up to float32 rounding; this pins its own bits: a
    faster kernel must step a fixed input to the same weights, terms, codes and scales."""
    assert _fixed_steps() == FIXED_STEPS


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 CPU's baseline build")
def test_the_bits_do_not_depend_on_the_instruction_set(monkeypatch):
    """``-march=native`` lets the compiler choose the vector width and, with AVX-512 VBMI, the decode's lookup in
    registers; a baseline x86-64 build (SSE2, scalar lookups) steps to the same bits."""
    baseline = native.build(arch="x86-64")
    assert not isinstance(baseline, str), baseline
    ours = _fixed_steps()
    monkeypatch.setattr(native, "kernel", lambda: baseline)
    assert _fixed_steps() == ours


def test_the_kernels_rounding_pass_is_the_eager_arithmetics_up_to_2_to_the_32(monkeypatch):
    """:func:`fxamp.training.flat.round_stochastic_` by the kernel (a block's places in 32-bit lanes where they share
    their high bits) and by torch's int32 arithmetic: the same bits, up to the eager path's last place, 2^32 - 1
    (places across 2^32: the kernel's step against its rounding pass, above)."""
    n = 3000
    x = torch.linspace(-2.0, 2.0, n) + 1e-3
    x[5], x[6] = float("nan"), float("inf")
    segments = [(1000, flat.key(1, 2, 3), 2 ** 32 - 1000), (n - 1000, flat.key(4, 5, 6), 17)]
    by_kernel = x.clone()
    flat.round_stochastic_(by_kernel, segments)
    monkeypatch.setenv("FXAMP_NATIVE", "0")
    eager = x.clone()
    flat.round_stochastic_(eager, segments)
    assert torch.equal(by_kernel.view(torch.int32), eager.view(torch.int32))
    assert not torch.equal(by_kernel, x)  # (rounded: the low 16 bits dropped)
