"""A custom torch.autograd.Function in forward (a straight-through estimator, a gradient reversal layer).  Traced,
torch.fx and torch.export record its forward's ops and drop its backward: the estimator's gradient became round's
zero, silently.  Every capture that runs such a forward now says so, naming the Function and the way to keep its
backward (the module that calls it kept a call, ``leaf_modules``); a branch that does not run it says nothing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.bytecode import function_calls


class STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


def quantize(x):  # (called through a module-level function: found too)
    return STE.apply(x)


class Block(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(16, 16), how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "ste":
            return quantize(h)
        if self.how == "grl":
            return GradReverse.apply(h)
        return F.gelu(h)  # (RWKV's CUDA-kernel Function, in a branch a CPU call does not take)


class Net(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.layers = nn.ModuleList([Block(how), Block("plain")])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def convert(model, path, **kw):
    if path == "in-place":
        return fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    return fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend=path, example_inputs=(torch.randn(8, 16),), **kw)


def _grad_cosine(amp, ref, x):
    ref(x).sum().backward()
    amp(x).float().sum().backward()
    got = dict(amp.named_parameters())["layers.0.fc.weight"].grad
    return float(F.cosine_similarity(got.flatten().float(), ref.layers[0].fc.weight.grad.flatten(), dim=0))


@pytest.mark.parametrize("how, name", [("ste", "STE"), ("grl", "GradReverse")])
@pytest.mark.parametrize("path", ["fx", "export", "in-place"])
def test_a_capture_that_runs_a_functions_forward_says_its_backward_is_not_kept(how, name, path):
    torch.manual_seed(0)
    model = Net(how)
    match = (rf"the capture traced the forward of the custom autograd Function {name} \({name}.apply at "
             rf".*test_autograd_functions.py:\d+\): the converted module's backward is autograd's of its ops, not "
             rf"{name}.backward.*leaf_modules=")
    with pytest.warns(UserWarning, match=match):
        amp = convert(model, path)
        amp(torch.randn(8, 16))  # (in place: captured at the first call)


@pytest.mark.parametrize("how", ["ste", "grl"])
def test_kept_a_call_the_functions_backward_reaches_the_layers_before_it(how):
    torch.manual_seed(0)
    model, x = Net(how), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept a call: nothing traced its forward
        warnings.filterwarnings("ignore", message=".*runs whole in float32")  # (the leaf: warned as any)
        amp = convert(model, "fx", leaf_modules=["layers.0"])
        assert _grad_cosine(amp, ref, x) > 0.99
    torch.manual_seed(0)
    traced = convert(Net(how), "fx")  # what the warning is about: the backward of the traced ops
    assert _grad_cosine(traced, copy.deepcopy(ref), x) < 0.5


def test_a_function_in_a_branch_the_call_does_not_take_is_not_named():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(Net("plain"), "fx")(torch.randn(8, 16))
    assert {cls.__name__ for cls, _ in function_calls(Block)} == {"STE", "GradReverse"}  # (what is watched)
    assert function_calls(Net) == () and function_calls(nn.Linear) == ()


class _Reversible(torch.autograd.Function):
    """Reformer's pattern: forward runs the layers under no_grad (backward recomputes them)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        with torch.no_grad():
            return x + layer(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RevNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(_Reversible.apply(x, self.layer))


def test_a_loss_without_grad_from_a_traced_no_grad_function_says_so():
    """The graph keeps the Function's no_grad region and not its backward: nothing before the head has a gradient;
    when the whole loss has none, the optimizer's refusal names this cause next to the usual ones."""
    torch.manual_seed(0)
    model = _RevNet()
    model.head.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(torch.randn(2, 8),))
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.layer.parameters(), lr=0.1), model=amp)
    with pytest.raises(ValueError, match="does not require grad.*custom autograd Function whose forward runs under"):
        opt.backward(amp(torch.randn(2, 8)).float().sum())


class _CarriedSTE(nn.Module):
    """RecurrentGemma's shape: a custom Function in a block that also keeps a tensor between calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.state = None

    def forward(self, x):
        if self.state is not None:
            x = x + self.state
        y = quantize(self.fc(x))
        self.state = y.detach()
        return y


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_capture_refused_after_its_trace_ran_a_function_says_only_why_it_was_refused(path):
    """The Function's note is about a converted module's backward: a capture refused (here for the tensor kept in
    self.state) converts nothing, so the user sees the refusal alone."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(fxamp.TraceError, match="keeps a tensor in self.state"):
            convert(nn.Sequential(_CarriedSTE()), path)
    assert not [w for w in caught if "custom autograd Function" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(UserWarning, match="custom autograd Function STE"):  # (the same Function, a capture that stands)
        convert(nn.Sequential(Block("ste")), path)
