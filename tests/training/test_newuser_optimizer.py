"""Unusual inputs a new user tried on the optimizer wrapper (issue 37, last criterion)."""
import pytest
import torch
import torch.nn as nn

import fxamp


def test_an_optimizer_class_instead_of_an_optimizer_is_refused_with_the_spelling():
    amp = fxamp.convert(nn.Linear(4, 4), "O2", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"not the class AdamW: build it first, e\.g\. AdamW\(model\.parameters\(\)\)"):
        fxamp.MixedPrecisionOptimizer(torch.optim.AdamW, model=amp)


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_lbfgs_is_refused_at_construction_with_what_to_do():
    amp = fxamp.convert(_mlp(), "O2", dtype=torch.bfloat16)
    inner = torch.optim.LBFGS(amp.parameters())
    held = list(inner.param_groups[0]["params"])
    with pytest.raises(TypeError, match=r"LBFGS cannot be wrapped: its step\(closure\).*without the wrapper"):
        fxamp.MixedPrecisionOptimizer(inner, model=amp)
    assert all(a is b for a, b in zip(inner.param_groups[0]["params"], held))


def test_a_parameter_twice_in_one_group_is_refused_before_anything_changes():
    amp = fxamp.convert(_mlp(), "O2", dtype=torch.bfloat16)
    w = amp.get_submodule("0").weight
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own: it would step it twice
        inner = torch.optim.SGD([w, w], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(torch.bfloat16 \(8, 4\)\) is already "
                                         r"held by the optimizer: pass each parameter once"):
        fxamp.MixedPrecisionOptimizer(inner, model=amp)
    assert inner.param_groups[0]["params"][0] is w, "a refused constructor changed the torch optimizer"


def test_add_param_group_of_a_weight_already_mastered_is_refused_and_changes_nothing():
    amp = fxamp.convert(_mlp(), "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp)
    with pytest.raises(ValueError, match=r"is already held by the optimizer"):
        opt.add_param_group({"params": [amp.get_submodule("0").weight], "lr": 0.5})
    assert len(opt.param_groups) == 1 and len(opt.master_pairs()) == 4


@pytest.mark.parametrize("how", ["frozen", "left_out"])
def test_fp32_state_dict_gives_the_original_float32_of_a_weight_the_optimizer_does_not_step(how):
    original = _mlp()
    if how == "frozen":
        original[0].requires_grad_(False)
    amp = fxamp.convert(original, "O2", dtype=torch.bfloat16)
    params = amp.get_submodule("2").parameters() if how == "left_out" else \
        (p for p in amp.parameters() if p.requires_grad)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1), model=amp)
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    assert opt.step()
    sd = opt.fp32_state_dict()
    assert torch.equal(sd["0.weight"], original[0].weight.detach()), "the float32 original, not its rounding widened"
    # once the weight no longer holds the original's rounding (loaded since), its widened value is all there is
    with torch.no_grad():
        amp.get_submodule("0").weight.add_(1)
    assert torch.equal(opt.fp32_state_dict()["0.weight"], amp.get_submodule("0").weight.detach().float())


def _stepped(masters=None):
    torch.manual_seed(0)
    original = _mlp()
    amp = fxamp.convert(original, "O2", dtype=torch.bfloat16)
    kw = {} if masters is None else {"masters": masters}
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp, **kw)
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    assert opt.step()
    opt.zero_grad()
    return amp, opt


@pytest.mark.parametrize("masters", [None, "kahan", "stochastic"])
def test_weights_loaded_into_the_model_after_the_wrapper_are_what_the_next_step_starts_from(masters):
    amp, opt = _stepped(masters)
    torch.manual_seed(1)
    pretrained = _mlp()
    amp.load_state_dict(pretrained.state_dict())  # after the optimizer was built, as torch users do
    loaded = {k: v.clone() for k, v in amp.state_dict().items()}
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean() * 0)  # a zero step: SGD moves nothing
    assert opt.step()
    for k, v in amp.state_dict().items():  # (before: the old masters' rounding was written back over them)
        assert torch.equal(v, loaded[k]), f"{k}: the step wrote the old master back over the loaded weight"
    # a float32 master takes the float32 value loaded (issue 37), a lean one the loaded weight
    exact = pretrained.state_dict()["0.weight"] if masters is None else loaded["0.weight"].float()
    assert torch.equal(opt.fp32_state_dict()["0.weight"], exact)


def test_weights_written_back_unchanged_keep_their_float32_masters():
    amp, opt = _stepped()
    masters = {k: v.clone() for k, v in opt.fp32_state_dict().items()}
    w = amp.get_submodule("0").weight
    keep = w.detach().clone()
    with torch.no_grad():
        w.zero_()
        w.copy_(keep)  # an EMA swap and back: the version counter moved, the values did not
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean() * 0)
    assert opt.step()
    for k, v in opt.fp32_state_dict().items():
        assert torch.equal(v, masters[k]), f"{k}: the master was replaced by its rounding"


@pytest.mark.filterwarnings("ignore:fxamp. the converted module")  # (the first-gradient warning: right here too)
def test_an_optimizer_built_on_the_model_before_conversion_is_refused_at_the_first_step():
    original = _mlp()
    inner = torch.optim.AdamW(original.parameters())
    amp = fxamp.convert(original, "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(inner, model=amp)  # (fxamp.initialize adopts them here: not refused yet)
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    before = {k: v.clone() for k, v in original.state_dict().items()}
    with pytest.raises(fxamp.OptimizerStateError,
                       match=r"holds the float32 parameters of the model before conversion \(those of 0\.weight, "
                             r"0\.bias, 2\.weight\.\.\.\): its step would train them.*fxamp\.initialize"):
        opt.step()
    for k, v in original.state_dict().items():
        assert torch.equal(v, before[k]), "a refused step changed a weight"


def test_initialize_with_the_optimizer_built_before_conversion_still_steps():
    original = _mlp()
    amp, opt = fxamp.initialize(original, torch.optim.SGD(original.parameters(), lr=0.1), "O2")
    w0 = amp.get_submodule("0").weight.clone()
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    assert opt.step()
    assert not torch.equal(amp.get_submodule("0").weight, w0)


def test_another_wrappers_own_scaler_is_refused_a_built_one_is_shared():
    from fxamp import LossScaleConfig
    from fxamp.training.loss_scale import LossScaler

    amp = fxamp.convert(_mlp(), "O2", dtype=torch.float16)
    mats = [p for p in amp.parameters() if p.dim() == 2]
    rest = [p for p in amp.parameters() if p.dim() != 2]
    a = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(mats, lr=0.1), model=amp)
    inner = torch.optim.SGD(rest, lr=0.1)
    with pytest.raises(ValueError, match=r"another MixedPrecisionOptimizer's own scaler \(its \.scaler\).*"
                                         r"scaler\.update\(\) once after every optimizer's step\(\)"):
        fxamp.MixedPrecisionOptimizer(inner, model=amp, loss_scale=a.scaler)
    shared = LossScaler(LossScaleConfig(init_scale=256.0))  # (2**16 may overflow float16 gradients: a skip)
    a = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(mats, lr=0.1), model=amp, loss_scale=shared)
    b = fxamp.MixedPrecisionOptimizer(inner, model=amp, loss_scale=shared)
    a.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    assert a.step() and b.step()
    shared.update()


def _trained(dtype, groups=1, **kw):
    amp = fxamp.convert(_mlp(), "O2", dtype=dtype)
    ps = list(amp.parameters())
    inner = torch.optim.AdamW(ps if groups == 1 else [{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
    opt = fxamp.MixedPrecisionOptimizer(inner, model=amp, **kw)
    opt.backward(amp(torch.randn(3, 4)).float().pow(2).mean())
    opt.step()
    return amp, opt


def _everything(opt):
    sd = opt.optimizer.state_dict()
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()}
    return ({k: v.detach().clone() for k, v in opt.fp32_state_dict().items()}, {"state": state}, opt.current_scale,
            [opt.precision_of(m) and opt.precision_of(m).master for m in opt.master_params()])


def _same(a, b):
    fa, oa, sa, ma = a
    fb, ob, sb, mb = b
    assert all(torch.equal(fa[k], fb[k]) for k in fa) and sa == sb and ma == mb
    assert all(torch.equal(x, y) if torch.is_tensor(x) else x == y
               for i in oa["state"] for x, y in zip(oa["state"][i].values(), ob["state"][i].values()))


def test_a_checkpoint_of_another_loss_scale_kind_is_refused_before_the_masters_change():
    _, a = _trained(torch.float16)
    _, b = _trained(torch.bfloat16)
    before = _everything(b)
    with pytest.raises(ValueError, match=r"the checkpoint's loss scale is 'dynamic' but this scaler's is 'none'"):
        b.load_state_dict(a.state_dict())
    _same(_everything(b), before)  # (before: the masters and the inner state were loaded, then the scaler refused)


def test_a_checkpoint_of_other_param_groups_is_refused_in_fxamps_words_before_a_lean_mode_switches():
    _, a = _trained(torch.bfloat16, masters="kahan", state="int8")
    _, b = _trained(torch.bfloat16, groups=2, masters="stochastic", state="bf16")
    before = _everything(b)
    with pytest.raises(ValueError, match=r"the checkpoint's optimizer has param groups of \[6\] parameters, this "
                                         r"one \[2, 4\]; build the optimizer with the same param groups"):
        b.load_state_dict(a.state_dict())
    _same(_everything(b), before)  # (before: torch's "different number of parameter groups", modes switched)


def _stepped_adamw(dtype=torch.bfloat16):
    amp = fxamp.convert(_mlp(), "O2", dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp)
    opt.backward(amp(torch.randn(3, 4)).float().square().mean())
    assert opt.step()
    return amp, opt


def _state_of(opt, amp, name):
    """What a user writes for any torch optimizer: ``opt.state[p]`` for their model's parameter ``p``."""
    p = amp.get_parameter(name)
    master = {id(low): m for low, m in opt.master_pairs()}[id(p)]
    return opt.state[p], opt.optimizer.state[master]


def test_opt_state_of_a_model_parameter_is_its_masters_and_adds_no_entry():
    # the inner optimizer's state is keyed by the float32 masters: opt.state[p] inserted an empty dict for the
    # low-precision p (a defaultdict) and answered {}; it reads the master's entry now, the same object
    amp, opt = _stepped_adamw()
    n = len(opt.optimizer.state)
    got, masters = _state_of(opt, amp, "0.weight")
    assert got is masters and got["exp_avg"].dtype == torch.float32 and got["exp_avg"].shape == (8, 4)
    assert len(opt.optimizer.state) == n and opt.state is opt.optimizer.state
    ln = amp.get_parameter("1.weight")  # a float32 norm weight under O2: its own entry, as torch's
    assert ln.dtype == torch.float32 and opt.state[ln] is opt.optimizer.state[ln]


def test_opt_state_of_a_model_parameter_after_load_state_dict_and_a_pickle():
    import pickle

    amp, opt = _stepped_adamw()
    amp2, opt2 = _stepped_adamw()
    opt2.load_state_dict(opt.state_dict())  # (torch's load_state_dict builds a new state dict)
    got, masters = _state_of(opt2, amp2, "2.weight")
    assert got is masters and torch.equal(got["exp_avg"], _state_of(opt, amp, "2.weight")[1]["exp_avg"])
    amp3, opt3 = pickle.loads(pickle.dumps((amp, opt)))
    got, masters = _state_of(opt3, amp3, "0.bias")
    assert got is masters and "exp_avg_sq" in got


def test_reading_opt_state_of_a_model_parameter_leaves_a_lean_checkpoint_whole():
    # the empty entry opt.state[p] inserted, keyed by a tensor no group holds, made state_dict() a KeyError
    amp, opt = _stepped_adamw()
    lean_amp = fxamp.convert(_mlp(), "O2", dtype=torch.bfloat16)
    lean = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(lean_amp.parameters(), lr=1e-2), model=lean_amp,
                                         masters="stochastic", state="int8")
    lean.backward(lean_amp(torch.randn(3, 4)).float().square().mean())
    assert lean.step()
    got = lean.state[lean_amp.get_parameter("0.weight")]
    assert got["exp_avg"].dtype == torch.int8 and got["exp_avg"].shape == (8, 4)
    saved = lean.state_dict()
    assert len(saved["optimizer"]["state"]) == len(lean.optimizer.state) == 6  # (4 masters, 2 float32 norms)
