"""The new-user probe, the wrapper as a ``torch.optim.Optimizer``: schedulers, hooks, copies and the code users
write for any torch optimizer (``isinstance(opt, torch.optim.Optimizer)`` paths).

The oracle: the same loop on a float32 copy of the masters with the inner optimizer's own class and the same
scheduler, fed the gradients the wrapper saw divided by the scale; the masters are compared to a few float32
ulps (``close``), the learning rates and momenta exactly.
"""
from __future__ import annotations

import copy
import io
import math
import pickle
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.optim import lr_scheduler as S

import fxamp

from .cases_train import batch, close, fp32_of, loss_of, low_grads, low_match_masters, mlp
from .runner import Cases, bitwise

cases = Cases("wrapper")
BF16, FP16 = torch.bfloat16, torch.float16


def _hyper(opt: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """What a scheduler may write: each group's lr, momentum and betas."""
    return [{k: (tuple(float(b) for b in g[k]) if k == "betas" else float(g[k]))
             for k in ("lr", "momentum", "betas") if k in g} for g in opt.param_groups]


def _with_scheduler(make: Callable[[Any], torch.optim.Optimizer], sched: Callable[[torch.optim.Optimizer], Any],
                    steps: int = 5, dtype: torch.dtype = BF16, metrics: Optional[List[float]] = None) -> None:
    """``steps`` steps of the wrapper with ``sched`` built on the wrapper itself, against the same scheduler on the
    inner optimizer's class over a float32 copy: the same hyperparameters at every step, the same masters."""
    original = mlp()
    conv = fxamp.convert(original, "O2", dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(make(conv.parameters()), model=conv)
    assert isinstance(opt, torch.optim.Optimizer)
    ref = copy.deepcopy(original).float()
    ref.load_state_dict(fp32_of(opt))
    ref_opt = make(ref.parameters())
    s, ref_s = sched(opt), sched(ref_opt)
    assert _hyper(opt) == _hyper(ref_opt), f"at the start: {_hyper(opt)} against torch's {_hyper(ref_opt)}"
    for i in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        grads, scale = low_grads(conv), opt.current_scale
        for n, p in ref.named_parameters():
            p.grad = grads[n].float() / scale
        assert opt.step(), "a clean step was skipped"
        ref_opt.step()
        if metrics is not None:
            s.step(metrics[i])
            ref_s.step(metrics[i])
        else:
            s.step()
            ref_s.step()
        assert _hyper(opt) == _hyper(ref_opt), f"step {i}: {_hyper(opt)} against torch's {_hyper(ref_opt)}"
        close(opt.fp32_state_dict(), {k: v.detach() for k, v in ref.state_dict().items()}, rtol=1e-5, atol=1e-6)
        low_match_masters(conv, opt)


SGD_M = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731


@cases.add("works")
def cycliclr_cycling_momentum_on_sgd():
    _with_scheduler(SGD_M, lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=True,
                                                base_momentum=0.8, max_momentum=0.95))


@cases.add("works")
def cycliclr_triangular2_fp16():
    _with_scheduler(SGD_M, lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=1, mode="triangular2"),
                    dtype=FP16)


@cases.add("works")
def onecycle_cycling_adams_betas():
    _with_scheduler(ADAM, lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=8, cycle_momentum=True))


@cases.add("works")
def onecycle_on_sgd_momentum_three_phase():
    _with_scheduler(SGD_M, lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=8, three_phase=True))


@cases.add("works")
def polynomial_lr():
    _with_scheduler(ADAMW, lambda o: S.PolynomialLR(o, total_iters=4, power=2.0))


@cases.add("works")
def linear_warmup_then_cosine_sequential_lr():
    _with_scheduler(ADAMW, lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=2),
                                                        S.CosineAnnealingLR(o, T_max=3)], milestones=[2]))


@cases.add("works")
def linear_lr_warmup():
    _with_scheduler(ADAMW, lambda o: S.LinearLR(o, start_factor=0.25, total_iters=3))


@cases.add("works")
def reduce_on_plateau_mode_max():
    # an accuracy that stops rising: the lr halves after each step without a new maximum (patience 0)
    _with_scheduler(SGD_M, lambda o: S.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0),
                    metrics=[0.5, 0.6, 0.6, 0.55, 0.7])


@cases.add("works")
def chained_scheduler_exponential_and_multiplicative():
    _with_scheduler(ADAMW, lambda o: S.ChainedScheduler([S.ExponentialLR(o, gamma=0.9),
                                                          S.MultiplicativeLR(o, lambda e: 0.95)]))


@cases.add("works")
def swalr_and_averaged_model():
    # SWALR on the wrapper anneals the lr as on a plain optimizer; AveragedModel of the converted model averages
    # the low-precision weights the model holds: its average is the mean of those weights (in their dtype)
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    swa = torch.optim.swa_utils.AveragedModel(conv)
    sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=2)
    ref_p = nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.SGD([ref_p], lr=0.1)
    ref_sched = torch.optim.swa_utils.SWALR(ref_opt, swa_lr=0.02, anneal_epochs=2)
    seen = []
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
        ref_opt.step()
        swa.update_parameters(conv)
        seen.append({k: v.detach().clone() for k, v in conv.state_dict(keep_vars=True).items()})
        sched.step()
        ref_sched.step()
        assert _hyper(opt) == _hyper(ref_opt), f"{_hyper(opt)} against torch's {_hyper(ref_opt)}"
    averaged = dict(swa.module.named_parameters())
    for name, p in conv.named_parameters():
        got = averaged[name]
        assert got.dtype == p.dtype, f"{name}: averaged in {got.dtype}, the model holds {p.dtype}"
        # SWA's running mean (n_averaged) in the weight's own dtype: within a few of its ulps of the exact mean
        exact = torch.stack([s[name].detach().double() for s in seen]).mean(0)
        ulp = exact.abs().clamp_min(1e-6) * (2.0 ** -6)
        assert ((got.double() - exact).abs() <= 3 * ulp).all(), f"{name}: not the mean of the weights"
    x = torch.randn(3, 8)
    assert swa(x).dtype == torch.float32


@cases.add("works")
def add_param_group_after_some_steps_with_a_scheduler():
    # a head unfrozen after two steps, added as its own group with its own lr: the scheduler built before on the
    # wrapper goes on; the new group's master steps as torch's would from the weights it had
    original = mlp()
    for p in original[3].parameters():
        p.requires_grad_(False)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(
        torch.optim.AdamW([p for p in conv.parameters() if p.requires_grad], lr=1e-2), model=conv)
    sched = S.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
        sched.step()
    head = [p for n, p in conv.named_parameters() if n.startswith("3.")]
    for p in head:
        p.requires_grad_(True)
    opt.add_param_group({"params": head, "lr": 0.05})
    assert len(opt.param_groups) == 2 and opt.param_groups is opt.optimizer.param_groups
    before = fp32_of(opt)
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()))
    grads = low_grads(conv)
    assert opt.step()
    ref = {k: before[k].clone().requires_grad_(True) for k in ("3.weight", "3.bias")}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=0.05)
    for k, p in ref.items():
        p.grad = grads[k].float()
    ref_opt.step()
    close({k: opt.fp32_state_dict()[k] for k in ref}, {k: v.detach() for k, v in ref.items()})
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01 * 0.5 ** 3, 0.05 * 0.5], _hyper(opt)
    low_match_masters(conv, opt)


def _generic_loop(opt: torch.optim.Optimizer, model: nn.Module, steps: int = 2) -> None:
    """What a helper written for any torch optimizer does."""
    assert isinstance(opt, torch.optim.Optimizer)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss_of(model, *batch()).backward()
        opt.step()


@cases.add("either")
def generic_torch_loop_set_to_none_false_bf16():
    # loss.backward() and opt.step() as for any optimizer: a bfloat16 step without a loss scale, or refused saying
    # to route the loss through opt.backward/opt.scale_loss
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    start = fp32_of(opt)
    torch.manual_seed(1)
    _generic_loop(opt, conv)
    # it moved, masters and weights agree, and the gradients are zeroed (not None) as set_to_none=False asks
    assert not all(torch.equal(a, b) for a, b in zip(start.values(), opt.fp32_state_dict().values()))
    low_match_masters(conv, opt)
    opt.zero_grad(set_to_none=False)
    for n, p in conv.named_parameters():
        assert p.grad is not None and not p.grad.any(), f"{n}: grad {p.grad}"


@cases.add("works")
def lr_set_to_zero_for_every_group_changes_no_bit():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9), model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = copy.deepcopy((dict(conv.state_dict()), fp32_of(opt)))
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    bitwise((dict(conv.state_dict()), fp32_of(opt)), before, "after a step at lr 0")


@cases.add("either")
def opt_state_of_a_model_parameter():
    # a user reads opt.state[p]["exp_avg"] for a parameter p of their model: its master's state, or a clear refusal
    # saying the state is the masters' (never an empty dict slipped into the inner optimizer's state)
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    p = conv.get_parameter("0.weight")
    n = len(opt.optimizer.state)
    try:
        got = opt.state[p]["exp_avg"]
    finally:
        assert len(opt.optimizer.state) == n, "reading opt.state[p] put an entry in the inner optimizer's state"
    master = dict((id(low), m) for low, m in opt.master_pairs())[id(p)]
    bitwise(got, opt.optimizer.state[master]["exp_avg"], "exp_avg")


@cases.add("works")
def step_pre_and_post_hooks_on_the_wrapper_then_removed():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    pre.remove()
    post.remove()
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    assert calls == [("pre", True), ("post", True)], calls


@cases.add("works")
def global_optimizer_step_post_hook_once_per_step():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    # torch's global hooks run around every torch optimizer's step: the inner one steps the masters (over the
    # wrapper's own param_groups), once per step taken and not on a skip
    seen = []
    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append(o.param_groups is opt.param_groups))
    try:
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()) * float("nan"))
        assert opt.step() is False
    finally:
        handle.remove()
    assert seen == [True], seen


def _continue(conv: nn.Module, opt: Any, sched: Any, data: List[Any]) -> List[float]:
    lrs = []
    for x, y in data:
        opt.zero_grad()
        opt.backward(loss_of(conv, x, y))
        assert opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _trained_with_a_scheduler(dtype: torch.dtype = FP16):
    torch.manual_seed(0)
    conv = fxamp.convert(mlp(), "O2", dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    sched = S.StepLR(opt, step_size=1, gamma=0.5)
    _continue(conv, opt, sched, [batch() for _ in range(2)])
    return conv, opt, sched


def _same_future(a, b) -> None:
    """Both (model, opt, sched) go on alike: the same lrs, masters, weights and scale, bit for bit."""
    data = [batch() for _ in range(2)]
    la, lb = _continue(*a, data), _continue(*b, data)
    assert la == lb, f"lr {la} against {lb}"
    bitwise(fp32_of(a[1]), fp32_of(b[1]), "masters")
    bitwise(dict(a[0].state_dict()), dict(b[0].state_dict()), "weights")
    assert a[1].current_scale == b[1].current_scale


@cases.add("works")
def pickle_model_optimizer_and_scheduler_together():
    a = _trained_with_a_scheduler()
    b = pickle.loads(pickle.dumps(_trained_with_a_scheduler()))
    assert b[2].optimizer is b[1], "the loaded scheduler drives another optimizer than the loaded wrapper"
    _same_future(a, b)


@cases.add("works")
def torch_save_model_optimizer_and_scheduler_together():
    a = _trained_with_a_scheduler()
    buf = io.BytesIO()
    torch.save(_trained_with_a_scheduler(), buf)
    buf.seek(0)
    b = torch.load(buf, weights_only=False)
    _same_future(a, b)


@cases.add("works")
def deepcopy_of_model_optimizer_and_scheduler():
    a = _trained_with_a_scheduler()
    original = _trained_with_a_scheduler()
    b = copy.deepcopy(original)
    _same_future(a, b)
    # the original goes on as if its copy had never stepped
    c = _trained_with_a_scheduler()
    _same_future(c, original)


@cases.add("works")
def deepcopy_of_the_wrapper_alone_is_independent():
    conv, opt, sched = _trained_with_a_scheduler(BF16)
    twin = copy.deepcopy(opt)
    before = fp32_of(twin)
    _continue(conv, opt, sched, [batch()])
    bitwise(fp32_of(twin), before, "the copy's masters after the original stepped")
    assert twin.param_groups is twin.optimizer.param_groups


@cases.add("works")
def scheduler_state_dict_resume_on_a_fresh_wrapper():
    # the usual resume: model, optimizer and scheduler state_dicts into freshly built ones
    a = _trained_with_a_scheduler()
    conv, opt, sched = _trained_with_a_scheduler()
    saved = {"model": conv.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.manual_seed(5)
    conv2 = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt2 = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv2.parameters(), lr=1e-2), model=conv2)
    sched2 = S.StepLR(opt2, step_size=1, gamma=0.5)
    conv2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    _same_future(a, (conv2, opt2, sched2))


@cases.add("works")
def lr_as_a_tensor_under_a_scheduler():
    # torch accepts a tensor lr (for capturable/compiled steps); a scheduler writes into it in place
    _with_scheduler(lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2)),
                    lambda o: S.StepLR(o, step_size=1, gamma=0.5), steps=3)


@cases.add("works")
def wrapper_repr_and_torch_optimizer_api_surface():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    assert "AdamW" in repr(opt) or "MixedPrecisionOptimizer" in repr(opt), repr(opt)
    assert opt.defaults["lr"] == 1e-2
    assert math.isclose(opt.param_groups[0]["lr"], 1e-2)


@cases.add("works")
def opt_state_of_a_model_parameter_under_lean_state_then_a_checkpoint():
    # reading opt.state[p] put an entry keyed by p (no group holds it) in the inner state: state_dict() then
    # failed with torch's KeyError; it reads the master's 8-bit state now, and the checkpoint resumes bitwise
    def build():
        torch.manual_seed(0)
        conv = fxamp.convert(mlp(), "O2")
        return conv, fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv,
                                                   masters="stochastic", state="int8")

    conv, opt = build()
    data = [batch() for _ in range(3)]
    for x, y in data[:2]:
        opt.zero_grad()
        opt.backward(loss_of(conv, x, y))
        assert opt.step()
    for p in conv.parameters():
        assert "exp_avg" in opt.state[p], "no state read for a model parameter"
    saved = copy.deepcopy((conv.state_dict(), opt.state_dict()))
    conv2, opt2 = build()
    conv2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    for c, o in ((conv, opt), (conv2, opt2)):
        o.zero_grad()
        o.backward(loss_of(c, *data[2]))
        assert o.step()
    bitwise(dict(conv2.state_dict()), dict(conv.state_dict()), "the resumed weights")


@cases.add("works")
def add_param_group_after_steps_under_lean_masters():
    original = mlp()
    for p in original[3].parameters():
        p.requires_grad_(False)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(
        torch.optim.AdamW([p for p in conv.parameters() if p.requires_grad], lr=1e-2), model=conv,
        masters="kahan", state="int8")
    for _ in range(2):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
    head = [p for n, p in conv.named_parameters() if n.startswith("3.")]
    before = [p.detach().clone() for p in head]
    for p in head:
        p.requires_grad_(True)
    opt.add_param_group({"params": head, "lr": 0.05})
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()))
    grads = [p.grad.float() for p in head]
    assert opt.step()
    # AdamW's first step on the head: -lr * sign(grad) (and weight decay), within a bfloat16 ulp of the weight
    for p, b, g in zip(head, before, grads):
        want = b.float() * (1 - 0.05 * 0.01) - 0.05 * torch.sign(g)
        ulp = want.abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((p.float() - want).abs() <= ulp + 1e-3).all(), "the added group's first step is not AdamW's"


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _update_bn_case(policy: str, frontend: str) -> None:
    def case() -> None:
        # swa_utils.update_bn sets each BatchNorm's momentum to None for a cumulative mean over the loader: the
        # converted graph must read it (a baked 0.1 would give an exponential average, silently)
        torch.manual_seed(0)
        model = _bn_model()
        data = [torch.randn(4, 3, 8, 8) + i for i in range(3)]
        kw = {"frontend": "export", "example_inputs": (data[0],)} if frontend == "export" else {}
        ref, swa = (torch.optim.swa_utils.AveragedModel(m) for m in (copy.deepcopy(model),
                                                                     fxamp.convert(model, policy, **kw)))
        torch.optim.swa_utils.update_bn(data, ref)
        torch.optim.swa_utils.update_bn(data, swa)
        want, got = dict(ref.module.named_buffers()), dict(swa.module.named_buffers())
        for k in ("1.running_mean", "1.running_var"):
            err = (got[k].float() - want[k]).abs().max().item()
            assert err <= 0.02 * want[k].abs().max().item(), f"{k}: {err:.3g} from the cumulative mean"

    cases.add("works", name=f"swa_update_bn_{policy}_{frontend}")(case)


_update_bn_case("O2", "fx")
_update_bn_case("O1", "export")


@cases.add("works")
def cycliclr_cycling_adams_beta1():
    # CyclicLR on an optimizer with betas cycles beta1 (torch reads the wrapper's defaults to tell)
    _with_scheduler(ADAM, lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2, cycle_momentum=True,
                                               base_momentum=0.8, max_momentum=0.9))
