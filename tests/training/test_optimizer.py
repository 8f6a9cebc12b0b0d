"""MixedPrecisionOptimizer: equivalence, GradScaler parity, skips, misuse, checkpoints, initialize."""

import copy
import io
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import LossScaleConfig, LossScaleError, MixedPrecisionOptimizer, OptimizerStateError
from fxamp.training.loss_scale import LossScaler

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
INF, NAN = float("inf"), float("nan")


class Net(nn.Module):
    """Tiny: a low-precision pair of linears around an fp32 norm (BatchNorm, so there are buffers)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def data(step, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_of(model, step):
    x, y = data(step)
    return F.cross_entropy(model(x), y)


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def poison(model, name, value, index=1):
    dict(model.named_parameters())[name].grad.view(-1)[index] = value


def train_step(model, opt, step, inject=None):
    opt.zero_grad()
    opt.backward(loss_of(model, step))
    if inject is not None:
        poison(model, *inject)
    return opt.step()


def snapshot(model, opt):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "masters": [m.detach().clone() for m in opt.master_params()],
        "state": copy.deepcopy(opt.optimizer.state_dict()["state"]),
    }


def assert_bitwise(a, b, path="x"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_bitwise(u, v, f"{path}[{i}]")
    else:
        assert a == b, path


def masters(opt):
    """The float32 masters, in the order they were paired."""
    return [m for _, m in opt.master_pairs()]


def lows(opt):
    """The low-precision parameters that have masters, in the same order."""
    return [low for low, _ in opt.master_pairs()]


def refreshed(opt):
    """Every low-precision parameter equals its master rounded."""
    return all(torch.equal(low, m.to(low.dtype)) for low, m in opt.master_pairs())


pytestmark = pytest.mark.usefixtures("one_thread")


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}


# -- equivalence ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sgd", "adamw", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("loss_scale", ["static:1", "none"])
def test_o0_with_scale_one_is_bitwise_the_plain_optimizer(name, loss_scale):
    ref = net()
    model = fxamp.convert(copy.deepcopy(ref), "O0")
    plain = OPTIMIZERS[name](ref.parameters())
    opt = MixedPrecisionOptimizer(OPTIMIZERS[name](model.parameters()), loss_scale=loss_scale, model=model)
    for step in range(6):
        plain.zero_grad()
        loss_of(ref, step).backward()
        plain.step()
        assert train_step(model, opt, step)
    assert_bitwise(dict(ref.named_parameters()), dict(model.named_parameters()))
    assert_bitwise(plain.state_dict()["state"], opt.optimizer.state_dict()["state"])


@pytest.mark.parametrize("growth,backoff", [(2.0, 0.5), (3.0, 0.7)])
def test_fp32_dynamic_matches_gradscaler_skips_scales_and_weights(growth, backoff):
    ref, mine = net(), net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff,
                                  growth_interval=3)
    plain = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    cfg = LossScaleConfig("dynamic", init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff,
                                  growth_interval=3, min_scale=0.0, max_scale=math.inf)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9), loss_scale=cfg)
    rng = random.Random(0)
    names = [n for n, _ in ref.named_parameters()]
    skips = 0
    for step in range(40):
        inject = (rng.choice(names), rng.choice([INF, -INF, NAN])) if rng.random() < 0.3 else None
        plain.zero_grad()
        scaler.scale(loss_of(ref, step)).backward()
        if inject:
            poison(ref, *inject)
        before = scaler.get_scale()
        scaler.step(plain)
        scaler.update()
        ref_skipped = scaler.get_scale() < before
        stepped = train_step(mine, opt, step, inject)
        assert (not stepped) == ref_skipped == (inject is not None), step
        assert opt.current_scale == scaler.get_scale(), step
        skips += not stepped
    assert opt.skipped_steps == skips > 5
    assert_bitwise(dict(ref.named_parameters()), dict(mine.named_parameters()))


# -- skipping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("name", ["sgd", "adamw", "adamw-foreach", "adam-fused"])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_nonfinite_gradient_skips_and_changes_nothing(dtype, name, bad):
    model = fxamp.convert(net(), "O2", dtype=dtype)
    opt = MixedPrecisionOptimizer(OPTIMIZERS[name](model.parameters()), model=model)
    for step in range(2):
        assert train_step(model, opt, step)
    assert opt.optimizer.state  # so there is optimizer state to protect
    for i, target in enumerate(["fc1.weight", "bn.bias"]):  # a float16/bfloat16 and a float32 parameter
        scale = opt.current_scale
        with torch.no_grad():
            before = snapshot(model, opt)
        assert train_step(model, opt, 10 + i, inject=(target, bad)) is False
        after = snapshot(model, opt)
        after["buffers"] = before["buffers"]  # the forward pass moved BatchNorm's running stats, as it should
        assert_bitwise(before, after)
        assert opt.overflowed_params() == [target]
        assert opt.current_scale == (scale / 2 if dtype == F16 else 1.0)
    assert opt.skipped_steps == 2 and opt.scaler.overflows == 2
    assert train_step(model, opt, 20) and opt.overflowed_params() == []


def test_random_injection_never_corrupts_a_weight():
    model = fxamp.convert(net(), "O2")
    cfg = LossScaleConfig("dynamic", init_scale=2.0**12, growth_interval=3)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3), loss_scale=cfg, model=model)
    rng = random.Random(1)
    names = [n for n, _ in model.named_parameters()]
    injected = stepped = 0
    first = loss_of(model, 0).item()
    scales = set()
    for step in range(300):
        inject = None
        if rng.random() < 0.15:
            inject = (rng.choice(names), rng.choice([INF, -INF, NAN]), rng.randrange(4))
            injected += 1
        opt.zero_grad()
        opt.backward(loss_of(model, step % 8))
        if inject:
            poison(model, *inject)
        if rng.random() < 0.5:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)  # spreads NaN over every grad: still skipped
        ok = opt.step()
        assert not (inject and ok)
        stepped += ok
        scales.add(opt.current_scale)
        assert all(torch.isfinite(p).all() for p in opt.master_params())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert refreshed(opt)
    assert opt.skipped_steps == 300 - stepped >= injected > 30
    assert len(scales) > 3
    assert loss_of(model, 0).item() < first


def test_overflow_storm_raises_naming_the_parameters():
    model = fxamp.convert(net(), "O2")
    cfg = LossScaleConfig("dynamic", init_scale=2.0, min_scale=1.0)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=cfg, model=model)
    assert train_step(model, opt, 0, inject=("fc2.bias", INF)) is False
    assert opt.current_scale == 1.0
    before = snapshot(model, opt)
    with pytest.raises(LossScaleError, match=r"gave up.*already min_scale=1.*diverging.*Non-finite gradients in: fc2.bias"):
        train_step(model, opt, 1, inject=("fc2.bias", NAN))
    after = snapshot(model, opt)
    after["buffers"] = before["buffers"]
    assert_bitwise(before, after)
    assert opt.overflowed_params() == ["fc2.bias"] and opt.skipped_steps == 2


def test_names_fall_back_to_group_and_index():
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD([{"params": model.fc1.parameters()},
                                                   {"params": model.fc2.parameters()}], lr=0.1))
    train_step(model, opt, 0, inject=("fc2.weight", INF))
    assert opt.overflowed_params() == ["group 1, param 0"]


# -- accumulation, several losses / optimizers, zero_grad --------------------------------------
def test_gradient_accumulation_unscales_the_sum():
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    opt.zero_grad()
    opt.backward(loss_of(model, 0))
    opt.backward(loss_of(model, 1))  # a second micro-batch, or a second loss
    assert opt.stage == "scaled"
    low = [p.grad.clone() for p in lows(opt)]
    opt.unscale_()
    inv = 1.0 / opt.current_scale
    for g, m in zip(low, masters(opt)):
        assert torch.equal(m.grad, g.float() * inv)
    assert opt.step() and refreshed(opt)


def test_accumulation_matches_one_batch_in_fp32():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # no BatchNorm: halves add up

    ref, mine = mlp(), mlp()
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1), loss_scale="dynamic")
    x, y = data(0)
    plain.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    plain.step()
    opt.zero_grad()
    for half in (slice(0, 8), slice(8, 16)):
        opt.backward(F.cross_entropy(mine(x[half]), y[half]) / 2)
    assert opt.step()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b)


def test_two_optimizers_share_one_scaler_like_gradscaler():
    model = fxamp.convert(net(), "O2")
    scaler = LossScaler(LossScaleConfig("dynamic", init_scale=2.0**8, growth_interval=2))
    a = MixedPrecisionOptimizer(torch.optim.Adam(model.fc1.parameters(), lr=1e-3), loss_scale=scaler, model=model)
    b = MixedPrecisionOptimizer(torch.optim.SGD([*model.bn.parameters(), *model.fc2.parameters()], lr=0.1),
                                loss_scale=scaler, model=model)

    def iteration(step, inject=None):
        a.zero_grad()
        b.zero_grad()
        a.backward(loss_of(model, step))
        b.backward(loss_of(model, step + 100))  # two losses, either wrapper can scale them
        if inject:
            poison(model, *inject)
        return a.step(), b.step()

    assert iteration(0) == (True, True)
    assert a.stage == b.stage == "stepped"
    with pytest.raises(OptimizerStateError, match=r"step\(\) was already called since the shared scaler's last update"):
        b.step()
    with pytest.raises(OptimizerStateError, match=r"backward\(\) after step\(\) but before the shared scaler's update"):
        a.backward(loss_of(model, 0))
    scaler.update()
    assert scaler.scale == 2.0**8
    iteration(1)
    scaler.update()
    assert scaler.scale == 2.0**9
    assert iteration(2, inject=("fc2.weight", INF)) == (True, False)  # each optimizer judges its own gradients
    assert scaler.update() is True and scaler.scale == 2.0**8
    assert (a.skipped_steps, b.skipped_steps, scaler.overflows) == (0, 1, 1)
    assert b.overflowed_params() == ["fc2.weight"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    train_step(model, opt, 0)
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():  # float16 ones and BatchNorm's float32 ones (stepped directly)
        assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())
    for m in opt.master_params():  # cleared too, as torch's zero_grad does (issue 10)
        assert (m.grad is None) if set_to_none else (m.grad is not None and not m.grad.any())
    opt.backward(loss_of(model, 1))
    opt.zero_grad(set_to_none=set_to_none)  # discards the iteration
    with pytest.raises(OptimizerStateError, match="without a backward pass"):
        opt.step()


def test_master_gradients_are_kept_rebound_and_overwritten():
    """The masters' float32 gradients are views of the step's segments; each unscale_() overwrites them."""
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    assert train_step(model, opt, 0)
    grads = [m.grad for m in masters(opt)]
    fc1 = masters(opt)[0]
    assert fc1 is dict(zip(map(id, lows(opt)), masters(opt)))[id(model.fc1.weight)]
    # a parameter without a gradient this step: its master has none either, and is not stepped
    opt.zero_grad()
    model.fc1.weight.requires_grad_(False)
    opt.backward(loss_of(model, 1))
    model.fc1.weight.requires_grad_(True)
    before = fc1.detach().clone()
    opt.unscale_()
    inv = 1.0 / opt.current_scale
    assert fc1.grad is None
    for low, m in opt.master_pairs()[1:]:
        assert torch.equal(m.grad, low.grad.float() * inv)
    assert opt.step() and torch.equal(fc1, before) and refreshed(opt)
    grads = [m.grad for m in masters(opt)]
    # the next step binds the segments' views again, holding this step's gradients; masters' grads
    # cleared behind the wrapper's back (the inner optimizer's zero_grad) are bound again too
    opt.backward(loss_of(model, 2))
    opt.optimizer.zero_grad()
    opt.unscale_()
    inv = 1.0 / opt.current_scale
    assert all(m.grad is g for m, g in zip(masters(opt)[1:], grads[1:]))  # no zero_grad() on the wrapper: kept
    assert masters(opt)[0].grad is not None
    opt.zero_grad()
    opt.backward(loss_of(model, 3))
    opt.optimizer.zero_grad()
    opt.unscale_()
    inv = 1.0 / opt.current_scale
    flats = {f.untyped_storage().data_ptr() for b in opt.plan.buckets for f in b.flats}
    assert all(m.grad.untyped_storage().data_ptr() in flats for m in masters(opt))
    for low, m in opt.master_pairs():
        assert torch.equal(m.grad, low.grad.float() * inv)
    assert opt.step() and not torch.equal(fc1, before) and refreshed(opt)


def test_clearing_master_gradients_between_steps_changes_nothing():
    def run(meddle):
        model = fxamp.convert(net(), "O2")
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
        for step in range(4):
            opt.zero_grad()
            if meddle and step % 2:
                opt.optimizer.zero_grad()  # every master's .grad None, as Optimizer.zero_grad leaves them
            opt.backward(loss_of(model, step))
            assert opt.step()
        return snapshot(model, opt)

    assert_bitwise(run(False), run(True))


def test_masters_of_mixed_dtypes_and_devices_of_one_optimizer():
    """float16 and bfloat16 parameters (two buckets), a float64 and a float32 one stepped directly."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(3).to(F16)), nn.Parameter(torch.randn(4).to(BF16)),
          nn.Parameter(torch.randn(5).to(F16)), nn.Parameter(torch.randn(2, dtype=torch.float64)),
          nn.Parameter(torch.randn(6))]
    opt = MixedPrecisionOptimizer(torch.optim.SGD(ps, lr=0.1), loss_scale="static:8")
    assert [len(b.lows) for b in opt.plan.buckets] == [2, 1]

    def loss():
        return sum(p.float().square().sum() for p in ps)

    opt.backward(loss())
    scaled = [p.grad.clone() for p in ps]
    masters = list(opt.master_params())
    opt.unscale_()
    for g, m in zip(scaled, masters):
        assert m.grad.dtype == m.dtype and torch.equal(m.grad, g.to(m.dtype) * torch.tensor(0.125).to(m.dtype))
    before = [m.detach().clone() for m in masters]
    assert opt.step() and refreshed(opt)
    for b, m in zip(before, masters):
        torch.testing.assert_close(m, b - 0.1 * 2 * b)
    opt.zero_grad()
    opt.backward(loss())
    ps[1].grad[0] = INF  # the bfloat16 bucket overflows: the whole step is skipped
    before = [m.detach().clone() for m in masters]
    assert opt.step() is False
    assert_bitwise(before, [m.detach() for m in masters])
    assert opt.overflowed_params() == ["group 0, param 1"]


@pytest.mark.parametrize("loss_scale", ["none", "dynamic"])
def test_sparse_gradients(loss_scale):
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, i):
            return self.fc(self.emb(i))

    torch.manual_seed(0)
    model = fxamp.convert(Bag(), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=loss_scale, model=model)
    i = torch.tensor([[1, 2, 2], [7, 1, 0]])
    emb = masters(opt)[0]
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(i).float().square().mean())
        assert model.emb.weight.grad.is_sparse
        if step == 2:
            model.emb.weight.grad._values()[0, 0] = NAN
        scaled = model.emb.weight.grad.coalesce().float()
        before = emb.detach().clone()
        opt.unscale_()
        assert emb.grad.is_sparse and emb.grad.dtype == F32
        unscaled = torch.sparse_coo_tensor(scaled._indices(), scaled._values() * opt.scaler.inv_scale(), scaled.shape,
                                           check_invariants=True)
        if step < 2:
            assert opt.step() and refreshed(opt)
            assert torch.equal(emb, before.add(unscaled, alpha=-0.1))
        else:
            assert opt.step() is False and torch.equal(emb, before)
            assert opt.overflowed_params() == ["emb.weight"]


def test_small_gradients_gathered_by_cat_match_direct_copies(monkeypatch):
    """Small gradients are gathered with torch.cat (by trailing shape), large and 0-dim ones copied one by one."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.wide = nn.Linear(16, 300)  # 4800 weights: copied directly
            self.temperature = nn.Parameter(torch.tensor(0.5))  # 0-dim

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.wide(x) * self.temperature

    def train(cat_numel):
        monkeypatch.setattr("fxamp.training.plan.CAT_NUMEL", cat_numel)
        torch.manual_seed(0)
        # O3: the 0-dim temperature, multiplied into the activations, is stored low too (O2 keeps it float32)
        model = fxamp.convert(Mixed(), "O3")
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            opt.unscale_()
            inv = 1.0 / opt.current_scale
            for low, m in opt.master_pairs():
                assert torch.equal(m.grad, low.grad.float() * inv)
            assert opt.step() and refreshed(opt)
        return opt, snapshot(model, opt)

    opt, gathered = train(1024)
    (bucket,) = opt.plan.buckets
    assert [out.shape for _, out in bucket.cats] == [(48, 16), (348,)] and bucket.ncat == 7  # + wide.bias
    assert len(bucket.lows) == 9
    _, direct = train(0)
    assert_bitwise(gathered, direct)


def test_master_gradients_have_the_masters_strides():
    """As ``empty_like(master)``: channels_last weights get channels_last gradients (fused kernels want that)."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    model = fxamp.convert(conv, "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(x).float().square().mean())
        assert opt.step() and refreshed(opt)
    for m in masters(opt):
        assert m.grad.shape == m.shape and m.grad.stride() == m.stride()
    assert masters(opt)[0].is_contiguous(memory_format=torch.channels_last)


def test_param_group_added_after_steps_is_stepped():
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.fc1.parameters(), lr=0.1), model=model)
    assert train_step(model, opt, 0)
    fc2 = model.fc2.weight.detach().clone()
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.5})
    assert train_step(model, opt, 1) and refreshed(opt)
    assert len(masters(opt)) == 4 and not torch.equal(model.fc2.weight, fc2)


def test_an_inner_zero_grad_override_is_honoured():
    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(Counting(model.parameters(), lr=0.1), model=model)
    for step in range(2):
        assert train_step(model, opt, step)
    assert calls == [True, True]
    assert any(p.grad is not None for p in model.parameters())  # the last step's gradients
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_unused_parameters_are_not_stepped():
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    fc1 = model.fc1.weight.detach().clone()
    opt.zero_grad()
    model.fc1.weight.requires_grad_(False)
    opt.backward(loss_of(model, 0))
    model.fc1.weight.requires_grad_(True)
    assert opt.step()
    assert torch.equal(model.fc1.weight, fc1) and model.fc1.weight not in opt.optimizer.state


# -- misuse -----------------------------------------------------------------------------------
@pytest.fixture
def o2():
    model = fxamp.convert(net(), "O2")
    return model, MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


def test_step_without_backward(o2):
    model, opt = o2
    with pytest.raises(OptimizerStateError, match=r"step\(\) without a backward pass since the last step; "
                                                  r"call opt.backward\(loss\)"):
        opt.step()
    train_step(model, opt, 0)
    with pytest.raises(OptimizerStateError, match="without a backward pass"):
        opt.step()


def test_unscale_twice_and_out_of_order(o2):
    model, opt = o2
    with pytest.raises(OptimizerStateError, match=r"unscale_\(\) before any backward\(\)"):
        opt.unscale_()
    opt.backward(loss_of(model, 0))
    opt.unscale_()
    with pytest.raises(OptimizerStateError, match=r"unscale_\(\) has already been called since the last step\(\); "
                                                  r"call it at most once per step"):
        opt.unscale_()
    with pytest.raises(OptimizerStateError, match=r"backward\(\) after unscale_\(\)"):
        opt.backward(loss_of(model, 1))
    assert opt.step()
    opt.backward(loss_of(model, 1))
    opt.unscale_()  # allowed again in the next iteration


def test_bad_losses(o2):
    model, opt = o2
    x, y = data(0)
    with pytest.raises(ValueError, match=r"the loss must be a scalar, got a tensor of shape \(16,\); reduce it first"):
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
    with pytest.raises(ValueError, match="does not require grad"):
        with torch.no_grad():
            opt.backward(F.cross_entropy(model(x), y))
    with pytest.raises(TypeError, match="the loss must be a tensor, not float"):
        opt.backward(1.0)
    with pytest.raises(OptimizerStateError, match=r"step\(closure\) is not supported"):
        opt.step(lambda: 0.0)


def test_backward_through_another_model(o2):
    model, opt = o2
    opt.backward(loss_of(net(), 0))
    with pytest.raises(OptimizerStateError, match="no parameter of this optimizer has a gradient.*fxamp.initialize"):
        opt.step()


def test_param_group_added_behind_the_wrappers_back(o2):
    model, opt = o2
    extra = nn.Parameter(torch.zeros(3, dtype=F16))
    opt.optimizer.add_param_group({"params": [extra]})
    opt.backward(loss_of(model, 0))
    with pytest.raises(OptimizerStateError, match=r"a param group was added to it directly; use opt.add_param_group"):
        opt.step()
    model2 = fxamp.convert(net(), "O2")
    opt2 = MixedPrecisionOptimizer(torch.optim.SGD(model2.fc1.parameters(), lr=0.1), model=model2)
    opt2.add_param_group({"params": list(model2.fc2.parameters()), "lr": 0.01})
    assert len(masters(opt2)) == 4 and all(p.dtype == F32 for p in opt2.master_params())
    assert train_step(model2, opt2, 0) and refreshed(opt2)


def test_bad_arguments():
    model = fxamp.convert(net(), "O2")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"loss_scale='fast' is not understood; use 'auto', 'dynamic', 'none', 'static:<scale>'"):
        MixedPrecisionOptimizer(sgd, loss_scale="fast")
    opt = MixedPrecisionOptimizer(sgd)
    with pytest.raises(TypeError, match="already a MixedPrecisionOptimizer"):
        MixedPrecisionOptimizer(opt)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, not list"):
        MixedPrecisionOptimizer([1])
    with pytest.raises(ValueError, match=r"fp32_state_dict\(\) needs the model"):
        opt.fp32_state_dict()


def test_initialize_refuses_a_parameter_not_in_the_model():
    orig = net()
    stray = nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([*orig.parameters(), stray])
    with pytest.raises(ValueError, match=r"group 0, param 6 \(shape \(3,\), torch.float32\) is not a parameter of "
                                         r"the model; build the optimizer on model.parameters\(\)"):
        fxamp.initialize(orig, adam, "O2")


# -- one type per loss_scale= option ------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    (None, r"loss_scale=None is not accepted: write loss_scale='none' \(no scaling; .*Valid forms: 'auto', "),
    (True, r"loss_scale=True \(bool\) is not accepted; use 'auto', 'dynamic', 'none', 'static:<scale>'"),
    (torch.tensor(8.0), r"loss_scale=tensor\(8\.\) \(Tensor\) is not accepted; use 'auto', .* a LossScaler"),
])
def test_the_old_spellings_of_loss_scale_are_refused(value, message):
    """``None`` was ``"none"``: refused, naming the form to write (by the wrapper, fxamp.initialize and what
    they share, config_for); so are a bool and a tensor."""
    model = fxamp.convert(net(), "O2")
    with pytest.raises(TypeError, match=message):
        MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=value, model=model)
    orig = net()
    with pytest.raises(TypeError, match=message):
        fxamp.initialize(orig, torch.optim.SGD(orig.parameters(), lr=0.1), "O2", loss_scale=value)


@pytest.mark.parametrize("text, kind, scale", [("static:128", "static", 128.0), ("static:0.5", "static", 0.5),
                                              ("none", "none", 1.0), ("dynamic", "dynamic", 2.0 ** 16)])
def test_what_the_refusals_say_to_write_is_accepted(text, kind, scale):
    opt = MixedPrecisionOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), loss_scale=text)
    assert opt.scaler.kind == kind and opt.scaler.scale == scale


@pytest.mark.parametrize("value", [128, 128.0, 2.0 ** 12, 0.5])
def test_a_number_is_a_static_loss_scale(value):
    """apex users write ``loss_scale=128.0``: a number has one meaning, a static scale (``"static:128"``)."""
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=value, model=model)
    assert opt.scaler.config == LossScaleConfig("static", float(value)) == LossScaleConfig.parse(f"static:{value}")
    assert train_step(model, opt, 0) and opt.scaler.scale == float(value)  # static: never grows
    orig = net()
    _, opt = fxamp.initialize(orig, torch.optim.SGD(orig.parameters(), lr=0.1), "O2", loss_scale=value)
    assert opt.scaler.config == LossScaleConfig("static", float(value))


# -- the auto loss scale ----------------------------------------------------------------------
@pytest.mark.parametrize("policy,dtype,kind", [
    ("O2", F16, "dynamic"), ("O2", BF16, "none"), ("O1", F16, "dynamic"), ("O1", BF16, "none"),
    ("O0", F16, "none"), ("O3", F16, "dynamic"),
])
def test_auto_loss_scale_follows_the_policy(policy, dtype, kind):
    model = fxamp.convert(net(), policy, dtype=dtype)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert opt.scaler.kind == kind
    assert train_step(model, opt, 0) and refreshed(opt)
    no_model = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if policy in ("O2", "O3"):  # without the model, the parameters' dtype decides
        assert no_model.scaler.kind == kind


# -- masters, existing state, checkpoints ------------------------------------------------------
def test_existing_state_moves_to_float32_masters():
    model = fxamp.convert(net(), "O2", dtype=BF16)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_of(model, 0).backward()
    adam.step()  # a plain bfloat16 step before wrapping
    old = {id(p): {k: v.clone() for k, v in s.items()} for p, s in adam.state.items()}
    lows = [p for p in model.parameters() if p.dtype == BF16]
    opt = MixedPrecisionOptimizer(adam, model=model)
    assert len(masters(opt)) == len(lows) == 4
    for low, master in opt.master_pairs():
        state = adam.state[master]
        assert low not in adam.state and state["exp_avg"].dtype == F32
        assert torch.equal(state["exp_avg"], old[id(low)]["exp_avg"].float())
        assert torch.equal(master, low.float())
    train_step(model, opt, 1)
    assert refreshed(opt)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_resume_mid_training_is_bitwise(dtype):
    cfg = LossScaleConfig("dynamic", init_scale=2.0**10, growth_interval=3) if dtype == F16 else "none"

    def make(seed):
        model = fxamp.convert(net(seed), "O2", dtype=dtype)
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=cfg, model=model)
        return model, opt

    def train(model, opt, steps):
        for s in steps:
            train_step(model, opt, s, inject=("fc1.bias", NAN) if s in (4, 9) else None)

    model, opt = make(0)
    train(model, opt, range(0, 7))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, range(7, 15))
    model2, opt2 = make(1)
    buf.seek(0)
    ckpt = torch.load(buf)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, range(7, 15))
    assert_bitwise(snapshot(model, opt), snapshot(model2, opt2))
    assert opt.scaler.state_dict() == opt2.scaler.state_dict()
    assert opt.skipped_steps == opt2.skipped_steps == 2


def test_load_state_dict_checks_the_layout(o2):
    model, opt = o2
    state = opt.state_dict()
    small = fxamp.convert(net(), "O2")
    other = MixedPrecisionOptimizer(torch.optim.SGD(small.fc1.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="the checkpoint has 4 float32 masters, this optimizer 2"):
        other.load_state_dict(state)
    with pytest.raises(KeyError, match="lacks"):
        opt.load_state_dict({"optimizer": {}})


def test_fp32_state_dict_loads_into_the_original_model():
    orig = net()
    model = fxamp.convert(orig, "O2")
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    for step in range(3):
        train_step(model, opt, step)
    sd = opt.fp32_state_dict()
    assert list(sd) == list(orig.state_dict())
    assert all(v.dtype in (F32, torch.int64) for v in sd.values())
    for low, master in opt.master_pairs():
        key = next(k for k, p in model.named_parameters() if p is low)
        assert torch.equal(sd[key], master)
    fresh = Net()
    fresh.load_state_dict(sd)  # strict
    model.eval(), fresh.eval()
    x, _ = data(0)
    torch.testing.assert_close(fresh(x), model(x), atol=2e-2, rtol=2e-2)


# -- initialize -------------------------------------------------------------------------------
def test_initialize_o2_makes_the_original_parameters_the_masters(capsys):
    orig = net()
    adam = torch.optim.AdamW(orig.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
    params = list(orig.parameters())
    model, opt = fxamp.initialize(orig, adam, "O2", verbose=True, dtype=torch.float16)
    out = capsys.readouterr().out
    assert "policy        : params=float16,compute=float16" in out and "dynamic(init_scale=65536" in out
    assert opt.optimizer is adam and list(opt.master_params()) == params
    assert model.fc1.weight.dtype == F16 and model.bn.weight is orig.bn.weight  # float32 ones are shared
    for step in range(4):
        train_step(model, opt, step)
        sched.step()
    assert adam.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert torch.equal(model.fc1.weight, orig.fc1.weight.to(F16)) and refreshed(opt)
    sd = opt.fp32_state_dict()
    assert torch.equal(sd["bn.running_mean"], model.bn.running_mean)  # buffers: the trained module's
    assert not torch.equal(sd["bn.running_mean"], orig.bn.running_mean)
    sd = {k: v for k, v in sd.items() if not k.startswith("bn.running") and k != "bn.num_batches_tracked"}
    assert_bitwise(sd, {k: v.detach() for k, v in orig.state_dict().items() if k in sd})


@pytest.mark.parametrize("dtype,kind", [(F16, "dynamic"), (BF16, "none")])
def test_initialize_o1_shares_everything(dtype, kind):
    orig = net()
    sgd = torch.optim.SGD(orig.parameters(), lr=0.1)
    model, opt = fxamp.initialize(orig, sgd, "O1", dtype=dtype)
    assert all(a is b for a, b in zip(model.parameters(), orig.parameters()))
    assert masters(opt) == [] and opt.scaler.kind == kind
    assert train_step(model, opt, 0)


def test_initialize_then_resume_into_a_fresh_initialize():
    def make(seed):
        orig = net(seed)
        return fxamp.initialize(orig, torch.optim.Adam(orig.parameters(), lr=1e-2), "O2")

    model, opt = make(0)
    for s in range(3):
        train_step(model, opt, s)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for s in range(3, 6):
        train_step(model, opt, s)
    model2, opt2 = make(1)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for s in range(3, 6):
        train_step(model2, opt2, s)
    assert_bitwise(snapshot(model, opt), snapshot(model2, opt2))


def test_initialize_keeps_tied_weights_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.ln = nn.LayerNorm(8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, i):
            return self.out(self.ln(self.emb(i)))

    torch.manual_seed(0)
    orig = Tied()
    # a lookup only a norm uses would run float32 and keep the tied table float32: stored low on purpose here
    model, opt = fxamp.initialize(orig, torch.optim.AdamW(orig.parameters(), lr=1e-2), "O2", dtype=torch.float16,
                                  overrides={F.embedding: "neutral"})
    assert model.emb.weight is model.out.weight and model.emb.weight.dtype == F16
    assert len(masters(opt)) == 1
    i = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(i).reshape(-1, 10), i.reshape(-1)))
        assert opt.step()
    sd = opt.fp32_state_dict()
    assert torch.equal(sd["emb.weight"], orig.emb.weight) and torch.equal(sd["out.weight"], orig.emb.weight)
    Tied().load_state_dict(sd)


# -- issue 10 ---------------------------------------------------------------------------------
def test_load_state_dict_says_what_it_expected(o2):
    model, opt = o2
    with pytest.raises(TypeError, match=r"takes the dict MixedPrecisionOptimizer.state_dict\(\) returned "
                                        r"\(keys optimizer, masters, scaler, skipped_steps, format\), not NoneType"):
        opt.load_state_dict(None)
    with pytest.raises(TypeError, match="not list"):
        opt.load_state_dict([])
    inner = opt.optimizer.state_dict()
    with pytest.raises(ValueError, match=r"lacks \['format', 'masters'.*looks like the inner optimizer's state_dict: "
                                         r"load it with opt.optimizer.load_state_dict"):
        opt.load_state_dict(inner)
    state = opt.state_dict()
    with pytest.raises(ValueError, match="format 99, this version of fxamp reads 1"):
        opt.load_state_dict({**state, "format": 99})
    with pytest.raises(TypeError, match=r"state_dict\['masters'\] must be a list of tensors, not NoneType"):
        opt.load_state_dict({**state, "masters": None})
    opt.load_state_dict(state)


def test_zero_grad_clears_the_masters_and_frees_their_buffer(monkeypatch):
    """The masters' gradients live from unscale_() to zero_grad(): views of one segment here, allocated once a step."""

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)  # this model's gradients are small: kept by default
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    for step in range(3):
        opt.zero_grad()
        assert all(p.grad is None for p in opt.master_params())
        assert opt.plan is None or all(b.flats is None and b.grads is None for b in opt.plan.buckets)
        opt.backward(loss_of(model, step))
        opt.unscale_()
        inv = 1.0 / opt.current_scale
        for low, m in opt.master_pairs():
            assert torch.equal(m.grad, low.grad.float() * inv)  # this step's gradients
        (bucket,) = opt.plan.buckets
        assert len(bucket.flats) == 1  # one allocation for the step, not one per parameter
        storages = {m.grad.untyped_storage().data_ptr() for m in masters(opt)}
        assert storages == {bucket.flats[0].untyped_storage().data_ptr()}
        assert opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in opt.master_params())


@pytest.mark.parametrize("how", ["release_grad_buffer=False", "small"])
def test_small_or_kept_master_gradient_buffers_stay(how, monkeypatch):
    """release_grad_buffer=False, or gradients under RELEASE_MIN_BYTES: one buffer bound again each step."""

    if how != "small":
        monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                                  release_grad_buffer=how == "small")
    ptrs = None
    for step in range(3):
        opt.zero_grad()
        assert all(p.grad is None for p in opt.master_params())
        opt.backward(loss_of(model, step))
        opt.unscale_()
        now = [m.grad.data_ptr() for m in masters(opt)]
        assert ptrs is None or now == ptrs  # the same buffer, bound again: no allocation per step
        ptrs = now
        assert opt.step()


def test_master_gradient_segments_split_large_models():
    """Masters are packed into segments of at most GRAD_SEGMENT_NUMEL elements (one larger tensor alone)."""
    from fxamp.training import plan as P

    old = P.GRAD_SEGMENT_NUMEL
    P.GRAD_SEGMENT_NUMEL = 3000
    try:
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(40, 50), nn.ReLU(), nn.Linear(50, 100), nn.ReLU(), nn.Linear(100, 3))
        model = fxamp.convert(copy.deepcopy(ref), "O2", dtype=torch.bfloat16)
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        x = torch.randn(8, 40)
        opt.zero_grad()
        opt.backward(model(x).float().square().mean())
        opt.unscale_()
        (bucket,) = opt.plan.buckets
        sizes = [f.numel() for f in bucket.flats]
        assert sum(sizes) == sum(m.numel() for m in masters(opt))
        assert len(sizes) > 1 and all(n <= 3000 or n == 5000 for n in sizes), sizes  # 5000: the 100x50 weight
        for low, m in opt.master_pairs():
            assert torch.equal(m.grad, low.grad.float())
            assert any(m.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in bucket.flats)
        assert opt.step()
    finally:
        P.GRAD_SEGMENT_NUMEL = old


class Lookahead:
    """A Lookahead-style wrapper (not a torch.optim.Optimizer): slow weights pulled toward fast ones every k steps."""

    def __init__(self, base, k=2, alpha=0.5):
        self.base, self.k, self.alpha, self.steps = base, k, alpha, 0
        self.slow = {}

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def state(self):
        return self.base.state

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        self.base.step()
        self.steps += 1
        if self.steps % self.k:
            return
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.slow.setdefault(p, p.detach().clone())
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)

    def state_dict(self):
        return {"base": self.base.state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        self.base.load_state_dict(state["base"])
        self.steps = state["steps"]


def test_a_duck_typed_optimizer_steps_the_masters():
    def run(make):
        model = fxamp.convert(net(), "O2", dtype=BF16)
        opt = MixedPrecisionOptimizer(make(model), model=model)
        for step in range(4):
            assert train_step(model, opt, step)
        assert refreshed(opt)
        return opt, [m.detach().clone() for m in opt.master_params()]

    opt, wrapped = run(lambda m: Lookahead(torch.optim.SGD(m.parameters(), lr=0.1)))
    assert isinstance(opt.optimizer, Lookahead) and opt.optimizer.steps == 4
    assert all(p.dtype == F32 for p in opt.master_params()) and len(opt.optimizer.slow) == 6
    _, plain = run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert not torch.equal(wrapped[0], plain[0])  # Lookahead did pull the weights
    state = opt.state_dict()
    assert state["optimizer"]["steps"] == 4
    opt.load_state_dict(state)


def test_an_object_that_is_not_an_optimizer_is_refused_naming_what_it_lacks():
    class Half:
        param_groups = []

        def step(self):
            pass

    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, not Half, or an object like one .*"
                                        "it lacks state, zero_grad, state_dict, load_state_dict"):
        MixedPrecisionOptimizer(Half())
    bad = Lookahead(torch.optim.SGD(net().parameters(), lr=0.1))
    bad.base.param_groups = ({"params": []},)
    with pytest.raises(TypeError, match="param_groups must be a list of dicts each with a 'params' list"):
        MixedPrecisionOptimizer(bad)


def test_min_scale_zero_keeps_skipping_without_giving_up():
    model = fxamp.convert(net(), "O2")
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                  loss_scale=LossScaleConfig("dynamic", init_scale=2.0**-124, min_scale=0.0))
    for step in range(6):  # an inf every step: the scale stops at the smallest normal float32
        assert not train_step(model, opt, step, inject=("fc2.weight", INF))
    assert opt.current_scale == torch.finfo(torch.float32).tiny and opt.skipped_steps == 6
    assert train_step(model, opt, 6) and refreshed(opt)


@pytest.mark.parametrize("module", ["optimizer", "optimizer_view"])
def test_optim_leans_on_public_methods_only(module):
    """The facade and its base do not import convert, and read no other object's underscore attributes (torch's
    aside)."""
    import ast
    import importlib
    import inspect

    optim_module = importlib.import_module(f"fxamp.training.{module}")
    tree = ast.parse(inspect.getsource(optim_module))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "convert" not in imported and "api" not in imported
    private = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            owner = n.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "torch"):
                continue
            if n.attr == "_values":  # Tensor._values(): a sparse tensor's values, uncoalesced ones too
                continue
            private.add(ast.unparse(n))
    assert private == set()


def test_scale_one_checks_by_reading_only_and_stays_exact():
    """bfloat16's default scale is 1: the float32 buffer is summed, not rewritten; a sum that
    overflows on finite gradients falls back to the exact check and does not skip the step."""
    model = fxamp.convert(net(), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model)
    assert opt.scaler.kind == "none" and opt.current_scale == 1.0
    opt.zero_grad()
    opt.backward(loss_of(model, 0))
    for i in range(4):
        poison(model, "fc1.weight", 3e38, index=i)  # finite in bfloat16; the float32 sum is inf
    opt.unscale_()
    for low, m in opt.master_pairs():
        assert torch.equal(m.grad, low.grad.float())
    assert opt.overflowed_params() == [] and opt.step()
    assert not train_step(model, opt, 1, inject=("fc2.bias", NAN)) and opt.overflowed_params() == ["fc2.bias"]
    assert not train_step(model, opt, 2, inject=("fc1.weight", -INF))


# --------------------------------------------------------------------------- segmented step

class _Wide(nn.Module):
    """Linears of several sizes around a float32 LayerNorm, and a layer left out of the loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 32)
        self.fc3, self.unused = nn.Linear(32, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.norm(self.fc1(x)))))


def _segmented_pair(monkeypatch, make_inner, dtype, segment=700):
    """(segmented, plain) wrappers on identical O2 models; the segmented one cut into runs of <= segment."""

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", segment)
    out = []
    for release in (True, False):  # release_grad_buffer=False: the plain step, every master's gradient at once
        torch.manual_seed(0)
        model = fxamp.convert(_Wide(), "O2", dtype=dtype)
        named = dict(model.named_parameters())
        groups = [{"params": [named[n] for n in named if n.startswith(("fc1", "norm"))], "lr": 3e-2},
                  {"params": [named[n] for n in named if not n.startswith(("fc1", "norm"))], "weight_decay": 0.1}]
        out.append((model, MixedPrecisionOptimizer(make_inner(groups), model=model, release_grad_buffer=release)))
    return out


INNERS = {
    "AdamW-fused": lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True),
    "AdamW-foreach": lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True),
    "SGD-momentum": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9),
    "RMSprop": lambda g: torch.optim.RMSprop(g, lr=1e-3),
}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("inner", list(INNERS))
def test_segmented_step_is_bitwise_the_plain_step(inner, dtype, monkeypatch):
    """step() without unscale_() steps the masters a run at a time (one param group, <= SEGMENT_NUMEL
    elements): the same weights, masters and optimizer state as one step over all of them, with two
    groups of different hyperparameters, float32 norm parameters stepped directly, a layer with no
    gradient, float16's loss scale, and a skipped step."""
    from fxamp.training import executors as E
    from fxamp.training import plan as P

    (seg_model, seg), (ref_model, ref) = _segmented_pair(monkeypatch, INNERS[inner], dtype)
    sizes = []
    real_flat = E.flat_grads
    monkeypatch.setattr(E, "flat_grads",  # (the segment's views are made once, kept by the plan)
                        lambda masters, strides, flat=None: (flat is None or sizes.append(flat.numel()),  # (a run's reused segment)
                                                                 real_flat(masters, strides, flat))[1])
    for step in range(4):
        inject = ("fc2.weight", INF) if step == 2 else None
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((seg_model, seg), (ref_model, ref)):
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            if inject:
                dict(model.named_parameters())[inject[0]].grad.view(-1)[1] = inject[1]
            assert opt.step() == (inject is None)
        assert seg.overflowed_params() == ref.overflowed_params() == (["fc2.weight"] if inject else [])
        assert_bitwise(snapshot(seg_model, seg), snapshot(ref_model, ref))
        assert seg.current_scale == ref.current_scale
        assert all(m.grad is None for m in masters(seg))  # the segment was unbound run by run
        assert all(m.grad is not None for m, low in (pair[::-1] for pair in ref.master_pairs()) if low.grad is not None)
    runs = seg.plan.runs
    assert len(runs) >= 4 and {r.group for r in runs} == {0, 1} and any(r.own for r in runs)
    assert sizes and max(sizes) <= max(P.SEGMENT_NUMEL, max(m.numel() for m in masters(seg)))
    assert all(m.grad is None for m in seg_model.unused.parameters())  # no gradient: never stepped
    assert torch.equal(seg_model.unused.weight, ref_model.unused.weight)


def test_segmented_step_only_where_it_is_the_same_step(monkeypatch):
    """The plain step (every master's gradient at once) after unscale_() (to clip), with a step hook,
    an optimizer subclass or release_grad_buffer=False."""

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)

    class MyAdamW(torch.optim.AdamW):
        pass

    def run(make, *, unscale=False, release=True):
        torch.manual_seed(0)
        model = fxamp.convert(_Wide(), "O2", dtype=BF16)
        opt = MixedPrecisionOptimizer(make(model.parameters()), model=model, release_grad_buffer=release)
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 8)).float().sum())
        if unscale:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
        assert opt.step()
        return any(m.grad is not None for m in masters(opt))  # True: the plain step ran

    assert not run(lambda p: torch.optim.AdamW(p))
    assert run(lambda p: torch.optim.AdamW(p), unscale=True)
    assert run(lambda p: torch.optim.AdamW(p), release=False)
    assert run(lambda p: MyAdamW(p))
    hooked = []

    def with_hook(p):
        inner = torch.optim.AdamW(p)
        inner.register_step_post_hook(lambda *a: hooked.append(1))
        return inner

    assert run(with_hook) and hooked == [1]  # the hook ran once, for the one step


def test_segmented_step_keeps_lr_schedulers_working(monkeypatch):

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    torch.manual_seed(0)
    model = fxamp.convert(_Wide(), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model=model)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(torch.randn(4, 8)).float().sum())
            assert opt.step()
            sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.125 and opt.plan.runs is not None


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clips / does not
def test_clip_grad_norm_in_a_segmented_step_is_torch_clip_on_the_masters(dtype, max_norm, monkeypatch):
    """opt.clip_grad_norm_() on a segmentable step takes the norms from the low-precision gradients in
    place and clips inside step(): the same norm, weights and state as unscale_() + torch's clip on
    the masters, with no float32 gradient for the masters; an overflow returns a non-finite norm and skips."""
    (seg_model, seg), (ref_model, ref) = _segmented_pair(monkeypatch, INNERS["AdamW-fused"], dtype)
    for step in range(4):
        inject = step == 2
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        seg.zero_grad()
        seg.backward(seg_model(x).float().square().mean())
        ref.zero_grad()
        ref.backward(ref_model(x).float().square().mean())
        if inject:
            for model in (seg_model, ref_model):
                model.fc2.weight.grad.view(-1)[1] = INF
        n_seg = seg.clip_grad_norm_(max_norm)
        assert all(m.grad is None for m in masters(seg))  # nothing float32 allocated for the masters
        with pytest.raises(OptimizerStateError, match="already ran"):
            seg.clip_grad_norm_(max_norm)  # a second clip would see no master gradients
        ref.unscale_()
        n_ref = torch.nn.utils.clip_grad_norm_(list(ref.master_params()), max_norm)
        if inject:
            assert not torch.isfinite(n_seg) and not torch.isfinite(n_ref)
        else:
            assert torch.allclose(n_seg, n_ref, rtol=1e-6), (n_seg, n_ref)
        assert seg.step() == ref.step() == (not inject)
        assert seg.overflowed_params() == ref.overflowed_params()
        for a, b in zip(seg.master_params(), ref.master_params()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
        for low, master in seg.master_pairs():
            assert torch.equal(low, master.to(low.dtype))  # refreshed from the masters
        assert seg.current_scale == ref.current_scale


def test_clip_grad_norm_without_segments_is_torch_clip(monkeypatch):
    """release_grad_buffer=False (no segmented step): unscale_() and torch's clip on the masters;
    after unscale_() it is torch's clip alone; before any backward it says so."""
    torch.manual_seed(0)
    model = fxamp.convert(_Wide(), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, release_grad_buffer=False)
    with pytest.raises(Exception, match="backward"):
        opt.clip_grad_norm_(1.0)
    opt.backward(model(torch.randn(4, 8)).float().sum())
    total = opt.clip_grad_norm_(1e-3)
    grads = [m.grad for m in opt.master_params() if m.grad is not None]
    assert torch.isfinite(total) and total > 1e-3
    assert torch.allclose(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])), torch.tensor(1e-3), rtol=1e-3)
    assert opt.step()


def test_segmented_step_with_channels_last_masters_is_the_plain_step(monkeypatch):
    """A segmented run lays its masters' gradients out as empty_like(master) (channels_last here),
    in the reused segment, and steps as the plain step does, bitwise."""
    from fxamp.training import executors as E

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 300)
    strides = []
    real_flat = E.flat_grads  # (the segment's views: made by the plan's Segments)
    monkeypatch.setattr(E, "flat_grads", lambda masters, st, flat=None: (flat is None or strides.append(st), real_flat(masters, st, flat))[1])
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    out = []
    for release in (True, False):
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
        model = fxamp.convert(conv, "O2", dtype=BF16)
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model,
                                      release_grad_buffer=release)
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            assert opt.step()
        out.append((model, opt))
    (seg_model, seg), (ref_model, ref) = out
    assert seg.plan.runs is not None and any(st is not None for st in strides)  # the strided layout was used
    assert_bitwise(snapshot(seg_model, seg), snapshot(ref_model, ref))
