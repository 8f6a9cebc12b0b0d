"""Copies of the wrapper: ``copy.deepcopy``, ``torch.save``/``torch.load`` and ``pickle`` of ``(model, opt)``.

A copy is a new set of tensors: the wrapper keys its pairs by ``id()`` and its step plan holds views into
gradient segments (which a plain pickle writes as separate tensors), so a copy re-keys the pairs, makes its plan
again and marks its pairs again.  A copy then trains on bitwise as the original does.  A wrapper with lean
precision is refused in one line (its workspace frees buffers between steps and keys its state by identity).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")

F16, BF16 = torch.float16, torch.bfloat16


def make(dtype=F16, **wrapper):
    torch.manual_seed(0)
    model = fxamp.convert(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)), "O2",
                          dtype=dtype)
    scale = "none" if dtype == BF16 else fxamp.LossScaleConfig("dynamic", init_scale=2.0**8, growth_interval=2)
    return model, fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                                loss_scale=scale, **wrapper)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def backward(model, opt, step, overflow=()):
    x, y = batch(step)
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    opt.backward(loss * float("inf") if step in overflow else loss)


def train(model, opt, steps, overflow=()):
    for step in steps:
        backward(model, opt, step, overflow)
        opt.step()


def state_of(model, opt):
    inner = opt.optimizer.state_dict()["state"]
    return ([m.detach().clone() for m in opt.master_params()], [p.detach().clone() for p in model.parameters()],
            [v.clone() for k in sorted(inner) for v in inner[k].values()], opt.current_scale, opt.skipped_steps)


def assert_same(a, b):
    assert a[3:] == b[3:]
    for xs, ys in zip(a[:3], b[:3]):
        assert len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _torch_save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "torch.save": _torch_save, "pickle": lambda o: pickle.loads(pickle.dumps(o))}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_copy_of_the_model_and_wrapper_trains_on_bitwise(how, dtype):
    """``pickle`` of ``(model, opt)`` trained on wrongly before: the plan's gradient views came back as separate
    tensors, so the copy stepped stale gradients.  A skipped float16 step after the copy included."""
    overflow = (3,) if dtype == F16 else ()
    model, opt = make(dtype)
    train(model, opt, range(6), overflow)
    expected = state_of(model, opt)

    model, opt = make(dtype)
    train(model, opt, range(2))
    copied, copt = COPIES[how]((model, opt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the copy's pairs are marked: no "no MixedPrecisionOptimizer" warning)
        train(copied, copt, range(2, 6), overflow)
    assert_same(state_of(copied, copt), expected)
    train(model, opt, range(2, 6), overflow)  # the original is untouched by its copy's steps
    assert_same(state_of(model, opt), expected)


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_taken_between_backward_and_step_has_no_gradients_to_step(how):
    """torch's copies of a parameter drop its ``.grad``: the copy's step is refused in one line, not a silent no-op."""
    model, opt = make()
    train(model, opt, range(2))
    backward(model, opt, 2)
    copied, copt = COPIES[how]((model, opt))
    assert copt.stage == "scaled" and all(p.grad is None for p in copied.parameters())
    with pytest.raises(fxamp.OptimizerStateError, match=r"no parameter of this optimizer has a gradient"):
        copt.step()
    assert opt.step()


def test_a_copy_refuses_a_second_wrapper_on_its_inner_optimizer():
    model, opt = make()
    train(model, opt, range(1))
    _, copt = copy.deepcopy((model, opt))
    with pytest.raises(fxamp.OptimizerStateError, match=r"already wrapped by a MixedPrecisionOptimizer"):
        fxamp.MixedPrecisionOptimizer(copt.optimizer)


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("wrapper", [{"masters": "kahan"}, {"state": "int8"}, {"precision": "lean"}])
def test_a_wrapper_with_lean_precision_refuses_to_be_copied_in_one_line(how, wrapper):
    """It raised a KeyError (deepcopy), a storage error (torch.save) or corrupted the heap (pickle) before."""
    model, opt = make(BF16, **wrapper)
    train(model, opt, range(2))
    before = state_of(model, opt)
    with pytest.raises(TypeError, match=r"^a MixedPrecisionOptimizer with lean precision \(.*\) cannot be copied or "
                                        r"pickled: save opt.state_dict\(\) with the model's and load both into a new "
                                        r"wrapper$"):
        COPIES[how]((model, opt))
    assert_same(state_of(model, opt), before)
    train(model, opt, range(2, 3))  # (and it trains on)
