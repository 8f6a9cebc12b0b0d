"""Training-loop traps fxamp must not let pass silently: a plain torch optimizer on low-precision
weights, two wrappers on one optimizer, masters read into another model, a model already in the
other low dtype, and ``.half()`` on a converted module."""

import copy
import linecache
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import OptimizerStateError

pytestmark = pytest.mark.usefixtures("one_thread")

NO_MASTERS = "no MixedPrecisionOptimizer keeps float32 masters"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.ln(self.fc(x))))


def net():
    torch.manual_seed(0)
    return Net()


def converted(policy="O2", frontend="auto"):
    return fxamp.convert(net(), policy, dtype=torch.bfloat16, frontend=frontend)


X = torch.randn(8, 16)


def loss_of(amp):
    return amp(X).square().mean()


@pytest.mark.parametrize("frontend", ["auto", "export"])  # export without inputs: a LazyConverted
def test_a_plain_torch_optimizer_on_low_weights_warns_once_with_the_fix(frontend):
    amp = converted(frontend=frontend)
    opt = torch.optim.AdamW(amp.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match=r"fxamp\.MixedPrecisionOptimizer\(torch\.optim\.AdamW\(amp\.parameters"
                                            r"\(\)\), model=amp\)") as record:
        loss_of(amp).backward()
    assert sum(NO_MASTERS in str(w.message) for w in record) == 1
    assert "bfloat16 parameters" in str(record[0].message)
    # attributed to the user's backward() line, not torch's autograd file
    assert record[0].filename == __file__ and ".backward()" in linecache.getline(__file__, record[0].lineno)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module: the next backward says nothing
        loss_of(amp).backward()


@pytest.mark.parametrize("how", ["wrapper", "initialize"])
def test_a_mixed_precision_optimizer_silences_it(how, recwarn):
    if how == "wrapper":
        amp = converted()
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), model=amp)
    else:
        model = net()
        amp, opt = fxamp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", dtype="bf16")
    before = amp.fc.weight.detach().clone()
    opt.backward(loss_of(amp))
    assert opt.step()
    assert not torch.equal(amp.fc.weight, before)
    assert not [w for w in recwarn if NO_MASTERS in str(w.message)]


def test_o1_has_no_low_weights_and_does_not_warn(recwarn):
    amp = converted("O1")
    loss_of(amp).backward()
    assert amp.fc.weight.grad.dtype == torch.float32
    assert not [w for w in recwarn if NO_MASTERS in str(w.message)]


def test_a_second_wrapper_on_the_same_optimizer_is_refused():
    amp = converted()
    inner = torch.optim.AdamW(amp.parameters(), lr=1e-3)
    first = fxamp.MixedPrecisionOptimizer(inner, model=amp)
    with pytest.raises(OptimizerStateError, match="already wrapped by a MixedPrecisionOptimizer.*keep using the first"):
        fxamp.MixedPrecisionOptimizer(inner, model=amp)
    with pytest.raises(OptimizerStateError, match="already wrapped"):
        fxamp.initialize(net(), inner, "O2", dtype="bf16")
    before = amp.fc.weight.detach().clone()
    first.backward(loss_of(amp))
    assert first.step() and not torch.equal(amp.fc.weight, before)  # the first one still steps
    # a new torch optimizer on the same model is a fresh start, not a second wrapper
    fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp)


def test_fp32_state_dict_refuses_a_model_the_masters_do_not_belong_to():
    amp, other = converted(), converted()
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), model=amp)
    with pytest.raises(ValueError, match="none of this Net's parameters is stepped by this optimizer"):
        opt.fp32_state_dict(net())
    with pytest.raises(ValueError, match="none of this .* parameters is stepped"):
        opt.fp32_state_dict(other)
    state = opt.fp32_state_dict(amp)
    assert state["fc.weight"].dtype == torch.float32
    assert torch.equal(state["fc.weight"], amp.fc.weight.float())  # the masters of amp's weights
    net().load_state_dict(state)


def test_fp32_state_dict_of_initialize_reads_the_original_or_the_converted_module():
    model = net()
    amp, opt = fxamp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", dtype="bf16")
    a, b = opt.fp32_state_dict(amp), opt.fp32_state_dict(model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("frontend", ["auto", "export"])  # export without inputs: a LazyConverted
@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copy_of_a_converted_module_still_warns_without_masters(frontend, copy_of):
    amp = converted(frontend=frontend)
    twin = copy.deepcopy(amp) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(amp))
    with pytest.warns(RuntimeWarning, match=NO_MASTERS):
        loss_of(twin).backward()
    with pytest.warns(RuntimeWarning, match=NO_MASTERS):  # the original's own check is untouched
        loss_of(amp).backward()
    third = copy.deepcopy(amp)
    fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(third.parameters()), model=third)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a copy with its own masters: quiet
        loss_of(third).backward()


@pytest.mark.parametrize("model_dtype, policy_dtype", [(torch.bfloat16, torch.float16),
                                                       (torch.float16, torch.bfloat16)])
def test_a_model_already_in_the_other_low_dtype_is_refused_at_convert(model_dtype, policy_dtype):
    with pytest.raises(ValueError, match=rf"already {str(model_dtype)[6:]} \('fc.weight'\) but the policy computes "
                                         rf"in {str(policy_dtype)[6:]}; convert the float32 model"):
        fxamp.convert(net().to(model_dtype), "O2", dtype=policy_dtype)
    amp = fxamp.convert(net().to(model_dtype), "O2", dtype=model_dtype)  # the same low dtype: fine
    assert amp(X).dtype == torch.float32


@pytest.mark.parametrize("frontend", ["auto", "export"])
@pytest.mark.parametrize("change", ["half", "double", "float", "to_float64"])
def test_a_dtype_change_of_a_converted_module_is_refused_and_changes_nothing(frontend, change):
    amp = converted(frontend=frontend)
    expected = amp(X)
    for target in (amp, copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        with pytest.raises(TypeError, match=r"convert the original model at the precision you want"):
            target.to(torch.float64) if change == "to_float64" else getattr(target, change)()
        assert target.fc.weight.dtype == torch.bfloat16 and target.ln.weight.dtype == torch.float32
        torch.testing.assert_close(target(X), expected, rtol=0, atol=0)
    amp.to(torch.device("cpu"))  # a device move is fine
    torch.testing.assert_close(amp(X), expected, rtol=0, atol=0)


def test_o1_float_is_allowed_its_weights_are_float32():
    amp = converted("O1")
    expected = amp(X)
    amp.float()
    torch.testing.assert_close(amp(X), expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="float32 tensors float16"):
        amp.half()


def test_a_model_whose_parameters_the_optimizer_does_not_hold_is_refused():
    """model= picks the loss scale (from its policy) and names parameters: a float16 model the optimizer does not
    step would get no loss scaling. Refused before anything changes; a partial overlap is fine."""
    a, b = converted(), fxamp.convert(net(), "O2", dtype=torch.float16)
    inner = torch.optim.AdamW(a.parameters(), lr=1e-3)
    before = list(inner.param_groups[0]["params"])
    with pytest.raises(ValueError, match=r"model= is a \w+ none of whose 6 parameters this AdamW holds \(it was built "
                                         r"on another module's\): its weights would get no masters, a float16 model no "
                                         r"loss scaling; build the optimizer on model.parameters\(\), or pass as model="):
        fxamp.MixedPrecisionOptimizer(inner, model=b)
    assert all(p is q for p, q in zip(inner.param_groups[0]["params"], before, strict=True))
    # the head alone (the rest frozen), or b's parameters beside a's: b's policy picks the loss scale
    head = [p for name, p in b.named_parameters() if name.startswith("out.")]
    for params in (head, [*converted().parameters(), *b.parameters()]):
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-3), model=b)
        assert opt.scaler.state_dict()["kind"] == "dynamic"
    # fxamp.initialize: the optimizer holds the float32 original's parameters, the model their float16 roundings
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    amp, opt = fxamp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", dtype="fp16")
    assert all(p.dtype == torch.float16 for p in amp.parameters()) and len(opt.master_pairs()) == 4


SCALED_CLIP = (r"the gradients of fc\.weight \(and maybe others\) changed between backward\(\) and step\(\) while "
               r"multiplied by the loss scale \(1024\); torch's clip_grad_norm_ on the model clips scaled gradients.*"
               r"use opt\.clip_grad_norm_\(max_norm\), or call opt\.unscale_\(\) first")


def _fp16_iteration(clip, *, dtype=torch.float16, loss_scale=1024.0, backwards=1):
    """One iteration of a float16 O2 model: ``backwards`` backward() calls, ``clip(model, opt)``, step(); twice."""
    amp = fxamp.convert(net(), "O2", dtype=dtype)
    scale = {} if loss_scale is None else {"loss_scale": loss_scale}
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp, **scale)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        for _ in range(backwards):
            opt.backward(amp(x).float().pow(2).mean())
        clip(amp, opt)
        opt.step()


def test_torch_clip_on_the_models_scaled_gradients_warns_once_at_the_users_step():
    """issue 37: torch's clip_grad_norm_(model.parameters()) between backward() and step() under a loss scale clips
    the scaled gradients (the step ~scale times too small), silently; fxamp says so once, at the user's line."""
    with pytest.warns(RuntimeWarning, match=SCALED_CLIP) as caught:
        _fp16_iteration(lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    ours = [w for w in caught if "changed between backward() and step()" in str(w.message)]
    assert len(ours) == 1  # once per optimizer, not at every step
    assert ours[0].filename == __file__ and linecache.getline(__file__, ours[0].lineno).strip() == "opt.step()"


@pytest.mark.parametrize("how", ["opt.clip_grad_norm_", "unscale_ then clip the masters", "accumulation",
                                 "bfloat16's default scale of 1"])
def test_no_scaled_clip_warning_where_the_gradients_are_handled_right(how):
    run = {
        "opt.clip_grad_norm_": lambda: _fp16_iteration(lambda m, o: o.clip_grad_norm_(1.0)),
        "unscale_ then clip the masters": lambda: _fp16_iteration(
            lambda m, o: (o.unscale_(), torch.nn.utils.clip_grad_norm_(o.master_params(), 1.0))),
        "accumulation": lambda: _fp16_iteration(lambda m, o: None, backwards=3),
        "bfloat16's default scale of 1": lambda: _fp16_iteration(
            lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), dtype=torch.bfloat16, loss_scale=None),
    }[how]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run()
