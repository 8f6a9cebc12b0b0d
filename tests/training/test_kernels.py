"""MixedPrecisionOptimizer(compile_step=True): the masters stepped by one compiled kernel each.

Each step is compared with the inner optimizer's own step from the same state and the same
low-precision gradients: masters and optimizer state to a few float32 ulps (the compiler fuses and
contracts multiply-adds; bitwise is not promised), the low-precision weights to one rounding step.
"""

import contextlib
import copy
import io
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import MixedPrecisionOptimizer
from fxamp.training import kernels as fused_step
from fxamp.training.plan import cut_runs

BF16, F16 = torch.bfloat16, torch.float16


class Net(nn.Module):
    """Low-precision linears and a conv around a float32 LayerNorm (stepped by the inner optimizer under O2)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 5)
        self.unused = nn.Linear(4, 4)  # no gradient: neither stepped nor given state

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.norm(self.fc1(h))))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, 5, (6,), generator=g)


@pytest.fixture(autouse=True)
def every_master_fused(request, monkeypatch):
    """The tiny test models' masters are all below FUSED_MIN_NUMEL and together far below FUSED_MIN_TOTAL:
    fuse them all (but in the tests of those thresholds)."""
    if "threshold" not in request.node.name:
        monkeypatch.setattr(fused_step, "FUSED_MIN_NUMEL", 0)
    if "total" not in request.node.name:
        request.getfixturevalue("fused_at_any_size")
    request.getfixturevalue("small_chunks")


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam-l2-maximize": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05, maximize=True),
    "adamw-tensor-lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(3e-3), eps=1e-6),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=1e-2, maximize=True),
}


def pair(make_opt, dtype=BF16, memory_format=torch.contiguous_format, **kw):
    """Two identical O2 models, the inner optimizer's step and the compiled one."""
    torch.manual_seed(0)
    base = Net().to(memory_format=memory_format)
    out = []
    for compile_step in (False, True):
        m = fxamp.convert(copy.deepcopy(base), "O2", dtype=dtype)
        out.append((m, MixedPrecisionOptimizer(make_opt(m.parameters()), model=m, compile_step=compile_step, **kw)))
    return out


def backward(model, opt, step, clip=None):
    opt.zero_grad()
    x, y = batch(step)
    opt.backward(F.cross_entropy(model(x).float(), y))
    if clip is not None:
        return opt.clip_grad_norm_(clip)


def assert_same_step(ref, fused, ulps=8):
    (m0, o0), (m1, o1) = ref, fused
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        if p0.dtype in (BF16, F16):  # one rounding step at most, where the masters straddle a boundary
            torch.testing.assert_close(p1, p0, rtol=2 * torch.finfo(p0.dtype).eps, atol=0, msg=name)
    for a, b in zip(o0.master_params(), o1.master_params()):
        close(b, a, ulps)
        s0, s1 = o0.optimizer.state.get(a, {}), o1.optimizer.state.get(b, {})
        assert s0.keys() == s1.keys()
        for k in s0:
            assert torch.is_tensor(s1[k]) and s1[k].dtype == s0[k].dtype and s1[k].shape == s0[k].shape, k
            close(s1[k], s0[k], ulps)


def close(actual, expected, ulps):
    """Within ``ulps`` float32 rounding steps of each element, or of the tensor's largest element (an
    element that is a difference of near-equal terms, as Adam's L2-decayed gradient can be, carries
    the rounding of the terms, not its own)."""
    eps = ulps * torch.finfo(torch.float32).eps
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps * float(expected.abs().max()))


def masters_of(kernels, args):
    """The masters a kernel call steps (``args[0]``: one, or a list padded with the scratch tensors of ``kernels``)."""
    if torch.is_tensor(args[0]):
        return [args[0]]
    pads = {id(t) for t in kernels.scratch()}
    return [m for m in args[0] if id(m) not in pads]


def sync(ref, fused):
    """Give the compiled side the reference's weights, masters and state (its checkpoint)."""
    (m0, o0), (m1, o1) = ref, fused
    buf = io.BytesIO()
    torch.save({"model": m0.state_dict(), "opt": o0.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    m1.load_state_dict(ck["model"])
    o1.load_state_dict(ck["opt"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_step_matches_the_inner_optimizer(name):
    """Three steps (first step's state creation, bias correction and momentum after it), each from the
    same state: the compiled side is re-synced from the reference's checkpoint before each, so a
    rounding difference never compounds, and the kernels read state that load_state_dict replaced."""
    ref, fused = pair(OPTIMIZERS[name])
    for step in range(3):
        if step:
            sync(ref, fused)
        for m, o in (ref, fused):
            backward(m, o, step)
            assert o.step() is True
        assert_same_step(ref, fused)
    # the parameter without a gradient was not stepped and got no state, as torch does
    for m, o in (ref, fused):
        master = next(p for p in o.master_params() if p.shape == m.unused.weight.shape)
        assert not o.optimizer.state.get(master)


def test_state_dict_is_the_inner_optimizers_format():
    ref, fused = pair(OPTIMIZERS["adamw"])
    for m, o in (ref, fused):
        backward(m, o, 0)
        o.step()
    sd0, sd1 = ref[1].optimizer.state_dict(), fused[1].optimizer.state_dict()
    assert sd0["param_groups"] == sd1["param_groups"]
    assert sd0["state"].keys() == sd1["state"].keys()
    for k in sd0["state"]:
        assert sd0["state"][k].keys() == sd1["state"][k].keys()
        assert sd1["state"][k]["step"].dtype == sd0["state"][k]["step"].dtype
        assert float(sd1["state"][k]["step"]) == float(sd0["state"][k]["step"]) == 1.0


def test_float16_loss_scale_and_clipping():
    """The kernel divides by the loss scale and applies clip_grad_norm_'s factor (read from the
    float16 gradients in place), as the inner optimizer's step on unscaled, clipped float32 gradients."""
    ref, fused = pair(OPTIMIZERS["adamw"], dtype=F16, loss_scale="static:4096")
    norms = []
    for m, o in (ref, fused):
        norms.append(backward(m, o, 0, clip=0.05))
        assert o.step() is True
    torch.testing.assert_close(norms[1], norms[0])
    assert float(norms[0]) > 0.05  # the clip did something
    assert_same_step(ref, fused)


def test_overflow_skips_and_changes_nothing():
    _, (m, o) = pair(OPTIMIZERS["adamw"], dtype=F16, loss_scale="dynamic")
    backward(m, o, 0)
    o.step()
    before = copy.deepcopy((m.state_dict(), o.state_dict()))
    backward(m, o, 1)
    m.fc1.weight.grad.view(-1)[3] = float("inf")
    assert o.step() is False
    after = (m.state_dict(), o.state_dict())
    for k, v in before[0].items():
        assert torch.equal(after[0][k], v), k
    for a, b in zip(before[1]["masters"], after[1]["masters"]):
        assert torch.equal(a, b)
    for pid, st in before[1]["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(after[1]["optimizer"]["state"][pid][k], v), k


def test_channels_last_masters():
    """A conv weight in channels_last: the kernel steps it in its own layout (not a flat view)."""
    ref, fused = pair(OPTIMIZERS["adamw"], memory_format=torch.channels_last)
    conv = fused[0].conv.weight
    assert not conv.is_contiguous() and conv.is_contiguous(memory_format=torch.channels_last)
    for m, o in (ref, fused):
        backward(m, o, 0)
        o.step()
    assert fused[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert_same_step(ref, fused)


def test_a_gradient_laid_out_otherwise_than_its_master():
    """A compiled convolution may hand back a channels_last gradient for a contiguous weight: the kernel
    reads it where it is (no fallback to the three-pass step)."""
    calls = []
    real = fused_step.Kernels.__call__

    def counting(self, name):
        fn = real(self, name)
        return lambda *args: (calls.append(args[1].stride() if torch.is_tensor(args[1]) else None), fn(*args))

    ref, fused = pair(OPTIMIZERS["adamw"])
    for m, o in (ref, fused):
        backward(m, o, 0)
        m.conv.weight.grad = m.conv.weight.grad.contiguous(memory_format=torch.channels_last)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_step.Kernels, "__call__", counting)
        for _, o in (ref, fused):
            o.step()
    cl = fused[0].conv.weight.grad
    assert cl.stride() in calls and not cl.is_contiguous()  # read in its own layout
    assert fused[0].conv.weight.is_contiguous()
    assert_same_step(ref, fused)


def test_training_converges_like_the_inner_step():
    ref, fused = pair(OPTIMIZERS["adamw"])
    losses = {0: [], 1: []}
    for step in range(30):
        for i, (m, o) in enumerate((ref, fused)):
            opt_loss = F.cross_entropy(m(batch(0)[0]).float(), batch(0)[1])
            o.zero_grad()
            o.backward(opt_loss)
            o.step()
            losses[i].append(float(opt_loss))
    assert losses[1][-1] < 0.5 * losses[1][0]
    assert abs(losses[1][-1] - losses[0][-1]) < 0.05 * losses[0][0]


def test_unsupported_optimizers_are_refused():
    m = fxamp.convert(Net(), "O2", dtype=BF16)
    for opt, what in ((torch.optim.RMSprop(m.parameters()), "RMSprop"),
                      (torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad")):
        with pytest.raises(ValueError, match=what):
            MixedPrecisionOptimizer(opt, model=m, compile_step=True)


def test_initialize_passes_it_on():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp, wrapper = fxamp.initialize(model, opt, "O2", dtype=BF16, compile_step=True)
    assert wrapper.compile_step
    backward(amp, wrapper, 0)
    assert wrapper.step() is True
    # the original module holds the masters, the converted one their rounding
    torch.testing.assert_close(amp.fc1.weight.float(), model.fc1.weight.detach(), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("total", [None, 0], ids=["default total", "total 0"])
def test_initialize_verbose_says_whether_the_total_lets_the_kernels_step(monkeypatch, capsys, total):
    if total is not None:
        monkeypatch.setattr(fused_step, "FUSED_MIN_TOTAL", dict.fromkeys(fused_step.FUSED_MIN_TOTAL, total))
    model = Net()
    fxamp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype=BF16, compile_step=True,
                     verbose=True)
    line = next(x for x in capsys.readouterr().out.splitlines() if "compile_step" in x)
    if total is None:  # this model's masters are far below the default
        assert line.endswith("True (not used: the masters are too small for the compiled kernels to pay, "
                             "see fxamp.training.kernels.FUSED_MIN_TOTAL)"), line
    else:
        assert line.split(":", 1)[1].strip() == "True", line


def test_a_compiler_failure_falls_back_to_the_same_update_eagerly(monkeypatch):
    """What torch.compile raises when it cannot compile (inductor without a C++ compiler: a
    BackendCompilerFailed; the recompile limit) makes that call run eagerly, after one warning; the
    kernel's own errors are raised."""
    def broken(fn, **kw):
        def call(*a):
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")
        return call

    monkeypatch.setattr(fused_step.torch, "compile", broken)
    ref, fused = pair(OPTIMIZERS["sgd-nesterov"])
    for step in range(2):
        if step:
            sync(ref, fused)
        for m, o in (ref, fused):
            backward(m, o, step)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o.step()
        assert any("could not compile" in str(w.message) for w in caught) == (step == 0)
        assert_same_step(ref, fused)


def test_threshold_small_masters_take_the_inner_optimizer(monkeypatch):
    """Below FUSED_MIN_NUMEL a kernel call costs more than it saves: those masters are stepped by the
    inner optimizer (bitwise its step), the large ones by the kernel (one call each)."""
    calls = []
    real = fused_step.Kernels.__call__

    def counting(self, name):
        fn = real(self, name)

        def call(*args):
            calls.extend(masters_of(self, args))
            return fn(*args)

        return call

    monkeypatch.setattr(fused_step.Kernels, "__call__", counting)
    monkeypatch.setattr(fused_step, "FUSED_MIN_NUMEL", 8 * 4 * 4 * 32)  # fc1.weight and larger
    ref, fused = pair(OPTIMIZERS["adamw"])
    for m, o in (ref, fused):
        backward(m, o, 0)
        o.step()
    assert [m.numel() for m in calls] == [8 * 4 * 4 * 32]
    assert_same_step(ref, fused)
    for (name, p0), p1 in zip(ref[0].named_parameters(), fused[0].parameters()):
        if name != "fc1.weight":
            assert torch.equal(p0, p1), name


def low_numel(model):
    """Elements of ``model``'s low-precision parameters (the masters' sizes) of two or more."""
    return sum(p.numel() for p in model.parameters() if p.dtype in (BF16, F16) and p.numel() >= 2)


@pytest.mark.parametrize("name, kind", [("adamw-loop", "adam"), ("sgd-loop", "sgd"), ("sgd-nesterov", "sgd_fused"),
                                        ("adamw-fused", "adam_fused"), ("adamw", "adam_fused")])
def test_below_the_total_the_step_is_the_one_without_compile_step(monkeypatch, name, kind):
    """When the masters the kernels would take hold fewer than FUSED_MIN_TOTAL elements (of the
    optimizer's kind, and ``_fused`` where the step without compile_step runs torch's fused kernel: an
    optimizer built fused, or on a CPU a default Adam/AdamW/SGD, whose masters the engine steps fused), the
    fused path's fixed costs outweigh what it saves: compile_step=True steps exactly as
    compile_step=False (bitwise, over steps) and compiles nothing; from that many elements on, the kernels
    step.  ``fused=False``: the for-loop's threshold."""
    make = {"adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
            "adamw-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=False),
            "sgd-loop": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, fused=False)}.get(name) \
        or OPTIMIZERS[name]
    numel = low_numel(pair(make)[1][0])
    for other in set(fused_step.FUSED_MIN_TOTAL) - {kind}:  # only this kind's threshold decides
        monkeypatch.setitem(fused_step.FUSED_MIN_TOTAL, other, 0)
    monkeypatch.setitem(fused_step.FUSED_MIN_TOTAL, kind, numel + 1)
    ref, fused = pair(make)
    for step in range(3):
        for m, o in (ref, fused):
            backward(m, o, step)
            assert o.step() is True
    assert fused[1].kernels.compiled == () and fused[1].compiled_step_active is False
    for (name, p0), p1 in zip(ref[0].named_parameters(), fused[0].parameters()):
        assert torch.equal(p0, p1), name
    for a, b in zip(ref[1].master_params(), fused[1].master_params()):
        assert torch.equal(a, b)
        s0, s1 = ref[1].optimizer.state.get(a, {}), fused[1].optimizer.state.get(b, {})
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0 if torch.is_tensor(s0[k]))

    monkeypatch.setitem(fused_step.FUSED_MIN_TOTAL, kind, numel)
    ref, fused = pair(make)
    for m, o in (ref, fused):
        backward(m, o, 0)
        assert o.step() is True
    assert fused[1].kernels.compiled and fused[1].compiled_step_active is True  # the kernels stepped
    assert_same_step(ref, fused)


def test_param_groups_schedulers_and_accumulation():
    """Two param groups with their own lr and weight decay, an LR scheduler between steps, and two
    accumulated backwards per step: every step as the inner optimizer's."""
    def make(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2], "lr": 1e-2, "weight_decay": 0.0},
                                  {"params": params[2:], "lr": 3e-3, "weight_decay": 0.2}])

    ref, fused = pair(make)
    scheds = [torch.optim.lr_scheduler.StepLR(o.optimizer, step_size=1, gamma=0.5) for _, o in (ref, fused)]
    for step in range(3):
        if step:
            sync(ref, fused)
        for (m, o), sched in zip((ref, fused), scheds):
            o.zero_grad()
            for micro in range(2):
                x, y = batch(10 * step + micro)
                o.backward(F.cross_entropy(m(x).float(), y))
            assert o.step() is True
            sched.step()
        assert_same_step(ref, fused)
    assert [g["lr"] for g in fused[1].param_groups] == pytest.approx([1e-2 / 8, 3e-3 / 8])


def test_small_masters_are_gathered_into_few_inner_steps(monkeypatch):
    """Masters under the threshold, from every run of a group, are stepped by one inner step per
    segment, not one per run (each inner step is ~0.2 ms of Python): here fc1.weight (4096 elements)
    is fused and cuts the masters into three runs of at most 4096 elements; the small masters before
    and after it take one inner step together, and the float32 layer norm one."""
    calls = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (calls.append(1), real_step(self, *a, **k))[1])
    monkeypatch.setattr(fused_step, "FUSED_MIN_NUMEL", 4096)
    monkeypatch.setattr(fxamp.training.plan, "segment_numel_for", lambda devices: 4096)
    ref, fused = pair(OPTIMIZERS["adamw"])
    for m, o in (ref, fused):
        backward(m, o, 0)
        calls.clear()
        o.step()
    assert len(calls) == 2
    assert_same_step(ref, fused)
    for (name, p0), p1 in zip(ref[0].named_parameters(), fused[0].parameters()):
        if name != "fc1.weight":
            assert torch.equal(p0, p1), name
    cut = cut_runs(0, [(None, torch.empty(n)) for n in (3, 4, 9, 1, 2)], 7)
    assert [len(r.pairs) for r in cut] == [2, 1, 2] and [r.numel for r in cut] == [7, 9, 3]


def test_the_scalars_are_computed_once_per_group_and_device(monkeypatch):
    """The fused masters of every run of a group share one computation of the scalars a step (it
    was ~0.2 ms of small ops per run, 2-4 ms a step on a GPT or ResNet): runs of one master each
    here, two groups, and the step still matches the inner optimizer's."""
    rows, kernels = [], []
    real_rows = fused_step.adam_rows
    monkeypatch.setattr(fused_step, "adam_rows", lambda *a: (rows.append(len(a[1])), real_rows(*a))[1])
    real_call = fused_step.Kernels.__call__

    def counting(self, name):
        kernel = real_call(self, name)
        return lambda *args: (kernels.extend(masters_of(self, args)), kernel(*args))[1]

    monkeypatch.setattr(fused_step.Kernels, "__call__", counting)
    monkeypatch.setattr(fxamp.training.plan, "segment_numel_for", lambda devices: 1)  # a run per master

    def two_groups(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 3e-3}], lr=1e-2)

    ref, fused = pair(two_groups)
    lows = [p for p in fused[0].parameters() if p.dtype == BF16]
    for step in range(2):
        sync(ref, fused)
        for m, o in (ref, fused):
            backward(m, o, step)
        rows.clear(), kernels.clear()
        stepped = sum(p.grad is not None for p in lows)
        for m, o in (ref, fused):
            o.step()
        assert stepped >= 5 and len(rows) == 2 and sum(rows) == len(kernels) == stepped
        assert_same_step(ref, fused)


def flat_pair(lengths, make_opt):
    """Two wrappers over bfloat16 parameters of ``lengths`` (over 1024 elements: masters not packed into
    one storage), the inner optimizer's step and the compiled one: (parameters, wrapper) each."""
    torch.manual_seed(0)
    values = [torch.randn(n) for n in lengths]
    sides = []
    for compile_step in (False, True):
        lows = [nn.Parameter(v.to(BF16)) for v in values]
        scale = fxamp.LossScaleConfig("dynamic", init_scale=4.0)
        sides.append((lows, MixedPrecisionOptimizer(make_opt(lows), loss_scale=scale, compile_step=compile_step)))
    return sides


def flat_steps(lengths, count):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(n, generator=g).to(BF16) for n in lengths] for _ in range(count)]


def flat_step(side, grads):
    """A step from gradients set as a backward of a loss scaled by 4 would leave them."""
    lows, opt = side
    opt.scale_loss(torch.zeros((), requires_grad=True))  # scaled gradients exist from here
    for p, g in zip(lows, grads):
        p.grad = g * 4.0
    assert opt.step() is True


def assert_same_flat_step(ref, fused):
    (lows0, opt0), (lows1, opt1) = ref, fused
    for a, b in zip(opt0.master_params(), opt1.master_params()):
        close(b, a, 8)
        for key in opt0.optimizer.state[a]:
            close(opt1.optimizer.state[b][key], opt0.optimizer.state[a][key], 8)
    for low, master in zip(lows1, opt1.master_params()):  # the rounding of its master, as the inner step leaves it
        assert torch.equal(low, master.to(BF16))


@pytest.mark.parametrize("duck_shapes", [False, True])
def test_masters_are_stepped_a_chunk_a_call_by_one_graph(monkeypatch, duck_shapes):
    """18 masters, some of equal lengths: five calls a step of CHUNK (4 here, ``small_chunks``: the same loop as
    16's, a quarter of the code to compile cold), the last padded with scratch tensors, all one graph for every
    length (dynamo's default, one symbol for equal lengths, would compile each pattern of equal lengths again:
    the duck_shapes case shows the test can tell), and the same update as the inner optimizer's, step after
    step."""
    calls = []
    real_call = fused_step.Kernels.__call__

    def counting(self, name):
        kernel = real_call(self, name)
        return lambda *args: (calls.append((name, len(masters_of(self, args)))), kernel(*args))[1]

    monkeypatch.setattr(fused_step.Kernels, "__call__", counting)
    if duck_shapes:
        monkeypatch.setattr(fused_step, "DistinctLengths", contextlib.nullcontext)
    # a code object of its own, so the graphs counted are this test's (dynamo caches per code object)
    real = fused_step.KERNELS["sgd_momentum_many"]
    fresh = types.FunctionType(real.__code__.replace(co_name=f"_sgd_momentum_many_{duck_shapes}"), real.__globals__)
    monkeypatch.setitem(fused_step.KERNELS, "sgd_momentum_many", fresh)
    assert fused_step.CHUNK == 4
    lengths = [n + 1000 for n in [40, 40, 44, 44, 48, 52, 52, 52, 56, 60, 64, 68, 72, 76, 80, 84, 46, 90]]
    ref, fused = flat_pair(lengths, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True))
    for grads in flat_steps(lengths, 3):
        calls.clear()
        flat_step(ref, grads), flat_step(fused, grads)
        assert calls == [("sgd_momentum_many", 4)] * 4 + [("sgd_momentum_many", 2)]
        assert_same_flat_step(ref, fused)
    graphs = torch._dynamo.eval_frame._debug_get_cache_entry_list(fresh.__code__)
    assert len(graphs) > 1 if duck_shapes else len(graphs) == 1, len(graphs)


def test_a_parameter_given_new_storage_is_stepped_there():
    """The kernels' arguments are planned once and kept while the tensors are the same: a master and a
    low-precision weight whose ``.data`` is replaced (the same object, new storage: what ``Module.to``
    does) are stepped in their new storage, and the old one is left alone."""
    lengths = [1100 + n for n in range(20)]
    ref, fused = flat_pair(lengths, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    steps = flat_steps(lengths, 2)
    flat_step(ref, steps[0]), flat_step(fused, steps[0])
    old = []
    for p in list(fused[1].master_params()) + fused[0]:
        old.append((p, p.data, p.data.clone()))
        p.data = p.data.clone()
    flat_step(ref, steps[1]), flat_step(fused, steps[1])
    assert_same_flat_step(ref, fused)
    for p, storage, before in old:
        assert torch.equal(storage, before) and not torch.equal(p.data, before)


def test_a_loaded_checkpoint_frees_the_state_it_replaced():
    """The kept plan holds views of the optimizer state: after ``load_state_dict`` replaced that state,
    the next step plans again and lets the old storage go (else resuming would hold two states)."""
    lengths = [1100 + n for n in range(20)]
    ref, fused = flat_pair(lengths, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    steps = flat_steps(lengths, 2)
    flat_step(ref, steps[0]), flat_step(fused, steps[0])
    old = {fused[1].optimizer.state[m]["momentum_buffer"].data_ptr() for m in fused[1].master_params()}
    buf = io.BytesIO()
    torch.save(ref[1].state_dict(), buf)  # (a checkpoint: state_dict() itself shares the reference's tensors)
    buf.seek(0)
    fused[1].load_state_dict(torch.load(buf))
    flat_step(ref, steps[1]), flat_step(fused, steps[1])
    assert_same_flat_step(ref, fused)
    kept = fused[1].kernels.kept_tensors()
    assert kept and not old & {t.data_ptr() for t in kept}


def test_step_hooks_turn_fusing_off():
    """A step hook must see one step of every parameter: with one, the wrapper steps the inner optimizer
    as it is (bitwise the plain step) and says so once."""
    ref, fused = pair(OPTIMIZERS["adamw"])
    seen = []
    for _, o in (ref, fused):
        o.optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(opt))
    for step in range(2):
        for m, o in (ref, fused):
            backward(m, o, step)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o.step()
            if o is fused[1]:
                assert any("step hooks" in str(w.message) for w in caught) == (step == 0)
    assert len(seen) == 4
    assert_same_step(ref, fused, ulps=0)


def test_errors_that_are_not_the_compilers_are_raised(monkeypatch):
    def failing(fn, **kw):
        def call(*a):
            raise RuntimeError("out of memory")
        return call

    monkeypatch.setattr(fused_step.torch, "compile", failing)
    _, (m, o) = pair(OPTIMIZERS["adamw"])
    backward(m, o, 0)
    with pytest.raises(RuntimeError, match="out of memory"):
        o.step()


def test_import_fxamp_leaves_the_compiler_alone():
    """``import fxamp`` does not import torch._dynamo (~1.5 s); the compiled step's module comes with the
    first ``compile_step=True``, and only then (a torch optimizer's constructor imports torch._dynamo itself)."""
    code = ("import sys, torch, fxamp\n"
            "assert 'torch._dynamo' not in sys.modules and 'fxamp.training.kernels' not in sys.modules\n"
            "opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))\n"
            "assert 'fxamp.training.kernels' not in sys.modules and opt.kernels is None\n"
            "opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1),\n"
            "                                    compile_step=True)\n"
            "assert 'fxamp.training.kernels' in sys.modules and opt.kernels.compiled == ()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's fxamp
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
