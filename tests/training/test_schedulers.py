"""torch's LR schedulers on the wrapper itself: ``StepLR(opt)``, ``opt`` a ``MixedPrecisionOptimizer`` (issue 37).

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's own objects, so a scheduler built on it writes the learning rates (and OneCycleLR's betas) the inner
optimizer steps with: every run here is bitwise the run of the same scheduler built on ``opt.optimizer``, skipped
float16 steps and lean masters included.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")

F16, BF16 = torch.float16, torch.bfloat16
LR = torch.optim.lr_scheduler
ORDER = "lr_scheduler.step()"  # (torch's "Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def make(dtype=F16, **wrapper):
    torch.manual_seed(0)
    model = fxamp.convert(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)), "O2",
                          dtype=dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    scale = "none" if dtype == BF16 else fxamp.LossScaleConfig("dynamic", init_scale=2.0**8, growth_interval=2)
    return model, fxamp.MixedPrecisionOptimizer(inner, model=model, loss_scale=scale, **wrapper)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


SCHEDULERS = {
    "StepLR": lambda o: LR.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: LR.LambdaLR(o, lambda s: 1.0 / (s + 1)),
    "OneCycleLR": lambda o: LR.OneCycleLR(o, max_lr=0.05, total_steps=10),  # (cycles the betas too)
    "CosineAnnealingLR": lambda o: LR.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "ReduceLROnPlateau": lambda o: LR.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: LR.SequentialLR(o, [LR.LinearLR(o, start_factor=0.1, total_iters=2),
                                                  LR.ExponentialLR(o, gamma=0.8)], milestones=[2]),
    "ChainedScheduler": lambda o: LR.ChainedScheduler([LR.ConstantLR(o, factor=0.5, total_iters=3),
                                                       LR.ExponentialLR(o, gamma=0.9)]),
}


def run(model, opt, sched, steps, overflow=()):
    """A plain loop; an inf loss (every gradient inf: the step skipped) at the steps in ``overflow``.  Returns the
    learning rates after each step and the steps' results, and the warnings torch gave about the order."""
    trace = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in steps:
            x, y = batch(step)
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            opt.backward(loss * float("inf") if step in overflow else loss)
            stepped = bool(opt.step())
            sched.step(loss.item() + step) if isinstance(sched, LR.ReduceLROnPlateau) else sched.step()
            trace.append((stepped, [(g["lr"], g["betas"]) for g in opt.param_groups]))
    return trace, [str(w.message) for w in seen if ORDER in str(w.message)]


def state_of(model, opt):
    """Everything that must be bitwise: the masters, the low weights, the inner state, the scale and skips."""
    return ([m.detach().clone() for m in opt.master_params()], [p.detach().clone() for p in model.parameters()],
            copy.deepcopy(opt.optimizer.state_dict()["state"]), opt.current_scale, opt.skipped_steps)


def assert_same(a, b):
    (ma, la, sa, *ra), (mb, lb, sb, *rb) = a, b
    assert ra == rb
    assert all(torch.equal(x, y) for x, y in zip(ma + la, mb + lb)) and len(ma) == len(mb) and len(la) == len(lb)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for n in sa[k]), k


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("dtype, wrapper", [(F16, {}), (BF16, {"masters": "kahan"})], ids=["fp16", "bf16-kahan"])
def test_a_scheduler_on_the_wrapper_trains_bitwise_as_one_on_the_inner_optimizer(name, dtype, wrapper):
    """float16 with a dynamic scale and a skipped step (an inf loss at step 1), or a lean ``masters="kahan"``."""
    steps, overflow = range(6), (1,) if dtype == F16 else ()
    runs = []
    for on_wrapper in (True, False):
        model, opt = make(dtype, **wrapper)
        sched = SCHEDULERS[name](opt if on_wrapper else opt.optimizer)
        assert sched.optimizer is (opt if on_wrapper else opt.optimizer)
        trace, told = run(model, opt, sched, steps, overflow)
        assert not told, told[0]  # (a step skipped after the first is no order warning either way)
        runs.append((trace, state_of(model, opt), sched.state_dict()))
    (trace, state, sd), (trace_inner, state_inner, sd_inner) = runs
    assert trace == trace_inner  # the same learning rates (and betas) at every step, the same steps skipped
    assert [stepped for stepped, _ in trace] == [step not in overflow for step in steps]
    assert len({str(lrs) for _, lrs in trace}) > 1 or name == "ReduceLROnPlateau"  # the schedule moved
    assert_same(state, state_inner)
    assert str(sd) == str(sd_inner)


@pytest.mark.parametrize("name", ["StepLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"])
def test_a_scheduler_on_the_wrapper_resumes_from_its_state_dict_bitwise(name):
    """The scheduler's ``state_dict`` (with the wrapper's and the model's) resumes into fresh objects bitwise."""
    model, opt = make()
    sched = SCHEDULERS[name](opt)
    whole, _ = run(model, opt, sched, range(6), overflow=(4,))
    expected = state_of(model, opt)

    model, opt = make()
    sched = SCHEDULERS[name](opt)
    first, _ = run(model, opt, sched, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model, opt = make()
    sched = SCHEDULERS[name](opt)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    rest, told = run(model, opt, sched, range(3, 6), overflow=(4,))
    assert not told, told[0]
    assert first + rest == whole
    assert_same(state_of(model, opt), expected)


def test_a_skipped_first_step_gives_no_order_warning_on_the_wrapper():
    """torch's scheduler counts calls of the ``step`` of the optimizer it was built on.  Built on the wrapper, a step
    skipped for an overflow is still the wrapper's ``step()`` called, in the right order: no warning.  Built on
    ``opt.optimizer``, a skipped first step never calls the inner ``step()``, so torch warns, wrongly, that the
    scheduler stepped first (as it does with ``torch.amp.GradScaler``).  Either way the schedule advances at a
    skipped step, as torch's does with GradScaler (``hf.prepare``'s Trainer path holds it back instead)."""
    for on_wrapper in (True, False):
        model, opt = make()
        sched = LR.StepLR(opt if on_wrapper else opt.optimizer, step_size=1, gamma=0.5)
        trace, told = run(model, opt, sched, range(3), overflow=(0,))
        assert [stepped for stepped, _ in trace] == [False, True, True]
        assert [lrs[0][0] for _, lrs in trace] == [5e-3, 2.5e-3, 1.25e-3]
        assert bool(told) == (not on_wrapper), told


def test_a_scheduler_stepped_before_the_wrapper_warns_as_torch_does():
    model, opt = make()
    sched = LR.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"):
        sched.step()
    run(model, opt, sched, range(1))


def test_the_wrapper_is_an_optimizer_over_the_inner_optimizers_own_objects():
    model, opt = make()
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    assert opt.defaults is opt.optimizer.defaults
    sched = LR.StepLR(opt, step_size=1, gamma=0.1)
    assert opt.optimizer.param_groups[0]["initial_lr"] == 1e-2
    run(model, opt, sched, range(1))
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert repr(opt).startswith("MixedPrecisionOptimizer(AdamW, 4 float32 masters, 2 float32 params")


def _torch_save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


@pytest.mark.parametrize("copy_of", [copy.deepcopy, _torch_save], ids=["deepcopy", "torch.save"])
def test_a_wrapper_with_a_scheduler_copies_without_it(copy_of):
    """A scheduler sets a counting ``step`` on the optimizer it takes (an unpicklable closure); the wrapper's copies
    leave it and its hooks behind, as torch's ``Optimizer.__getstate__`` does, and keep the rest."""
    model, opt = make()
    sched = LR.StepLR(opt, step_size=1, gamma=0.5)
    opt.register_step_post_hook(lambda *a: None)
    run(model, opt, sched, range(2))
    copied = copy_of((model, opt))
    cmodel, copt = copied
    assert "step" not in vars(copt) and not copt._optimizer_step_post_hooks
    assert copt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 2.5e-3
    assert copt.current_scale == opt.current_scale and copt.skipped_steps == opt.skipped_steps
    csched = LR.StepLR(copt, step_size=1, gamma=0.5)
    csched.load_state_dict(sched.state_dict())
    trace, told = run(cmodel, copt, csched, range(2, 4))
    ref, _ = run(model, opt, sched, range(2, 4))
    assert trace == ref and not told
    assert_same(state_of(cmodel, copt), state_of(model, opt))


def test_torchs_optimizer_hooks_run_around_the_wrappers_step_and_state_dict():
    model, opt = make()
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o.stage)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.stage)))
    opt.register_state_dict_pre_hook(lambda o: calls.append("save"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "mine"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    sched = LR.StepLR(opt, step_size=1, gamma=0.5)
    run(model, opt, sched, range(2), overflow=(1,))  # a skipped step runs them too: the wrapper's step() was called
    assert calls == [("pre", "scaled"), ("post", "ready")] * 2
    state = opt.state_dict()
    assert state["mine"] == 1 and calls[-1] == "save"
    opt.load_state_dict(state_dict=state)  # (torch's keyword)
    assert calls[-1] == "loaded"
