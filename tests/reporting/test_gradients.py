"""Gradients against float16's range (issue 11, part 2): ``fxamp.report(..., gradients=True)``."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import fxamp
import planted
from fxamp.reporting.gradients import FP16_MIN_SUBNORMAL, settled_scale

pytestmark = pytest.mark.usefixtures("one_thread")


def test_settled_scale():
    assert settled_scale(1.0) == 2.0 ** 15  # 65536 * 1.0 overflows 65504
    assert settled_scale(1e-3) == 2.0 ** 16  # capped at the initial scale
    assert settled_scale(3.0) == 2.0 ** 14
    assert settled_scale(0.0) == 2.0 ** 16


def test_underflow_fractions_match_the_float32_gradients():
    torch.manual_seed(0)
    model = planted.Healthy()
    x = torch.randn(8, 16) * 1e-3

    def loss_fn(out):
        return out.float().pow(2).mean() * 1e-3

    rep = fxamp.report(model, example_inputs=(x,), gradients=True, loss_fn=loss_fn)
    g = rep.gradients
    # the same backward in plain PyTorch
    ref = planted.Healthy()
    loss_fn(ref(x)).backward()
    w = ref.fc.weight.grad.abs().flatten()
    expect = float(((w > 0) & (w < FP16_MIN_SUBNORMAL)).float().mean())
    fc = next(s for s in g.params if s.name == "fc.weight")
    assert fc.zero == pytest.approx(expect) and fc.zero > 0.5
    assert fc.max_abs == pytest.approx(float(w.max()))
    assert g.loss == pytest.approx(float(loss_fn(ref(x)).detach()), rel=1e-5) and g.loss_from == "loss_fn(output)"
    every = max(s.max_abs for s in g.params + g.activations)
    assert g.scale == settled_scale(every) == 2.0 ** 16
    assert {s.name for s in g.activations} >= {"linear", "norm", "act", "linear_1", "softmax"}
    assert g.totals("activations")[2] < 0.01 < g.totals("activations")[0]  # the scale rescues them
    assert sum(g.counts) + g.zeros == sum(s.numel for s in g.activations)
    text = rep.to_table()
    assert "would flush to zero in float16" in text and "loss scale fxamp's dynamic scaler settles on: 65536" in text
    data = json.loads(rep.to_json())
    assert data["gradients"]["scale"] == 65536.0 and data["gradients"]["params"][0]["name"] == "fc.weight"
    assert model.fc.weight.grad is None  # the user's model is untouched


def test_default_loss_is_mean_square_or_own_loss():
    model, x = planted.Healthy(), torch.randn(4, 16)
    rep = fxamp.report(model, example_inputs=(x,), gradients=True)
    assert rep.gradients.loss_from == "mean square of the outputs"
    assert rep.gradients.loss == pytest.approx(float(model(x).pow(2).mean()), rel=1e-5)


class _ReturnsItsLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def test_a_scalar_output_is_the_loss_not_squared():
    torch.manual_seed(0)
    model, x, y = _ReturnsItsLoss(), torch.randn(4, 16), torch.randn(4, 16)
    g = fxamp.report(model, example_inputs=(x, y), gradients=True).gradients
    assert g.loss_from == "the output (a scalar: the model returns its loss)"
    assert g.loss == pytest.approx(float(model(x, y)), rel=1e-5)
    model(x, y).backward()  # the gradients of the loss itself, not of mean(loss ** 2)
    fc = next(s for s in g.params if s.name == "fc.weight")
    assert fc.max_abs == pytest.approx(float(model.fc.weight.grad.abs().max()), rel=1e-5)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "grads.png"
    fxamp.report(planted.Healthy(), example_inputs=(torch.randn(8, 16) * 1e-3,), gradients=True, plot=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        fxamp.report(planted.Healthy(), example_inputs=(torch.randn(2, 16),), gradients=True, plot=str(tmp_path / "g.png"))


def test_bad_input():
    with pytest.raises(ValueError, match="gradients=True runs the model: pass example_inputs"):
        fxamp.report(planted.Healthy(), gradients=True)
    with pytest.raises(ValueError, match="loss_fn= and plot= go with gradients=True"):
        fxamp.report(planted.Healthy(), example_inputs=(torch.randn(2, 16),), loss_fn=lambda o: o.sum())
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor"):
        fxamp.report(planted.Healthy(), example_inputs=(torch.randn(2, 16),), gradients=True, loss_fn=lambda o: o)
