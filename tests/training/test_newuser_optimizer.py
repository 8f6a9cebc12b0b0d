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
