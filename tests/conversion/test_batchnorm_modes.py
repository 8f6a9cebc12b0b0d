"""BatchNorm subclasses with their own ``forward`` (how vision libraries write norm + activation
layers) follow ``train()``/``eval()`` after every whole-model conversion (issue 37, item 1).

The flag they pass to ``F.batch_norm`` is computed from ``self.training``: the capture must rebind it
to the module's mode (only a literal that is the same in both modes, as weight standardisation's
``training=True`` in ``test_realarch.py``, stays), and a call of the original module may stand in for
``aten.batch_norm`` only when the module's forward is torch's own (else its activation ran twice).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from export_helpers import sqnr

BF16 = torch.bfloat16


class BNAct(nn.BatchNorm2d):
    """The issue's layer, as written there."""

    def forward(self, x):
        use_batch_stats = True if self.training else (self.running_mean is None and self.running_var is None)
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   use_batch_stats, self.momentum, self.eps))


class TimmBNAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: torch's BatchNorm forward copied, the counter included, then an activation."""

    def __init__(self, num_features, **kwargs):
        super().__init__(num_features, **kwargs)
        self.act = nn.SiLU()

    def forward(self, x):
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if self.training:
            bn_training = True
        else:
            bn_training = (self.running_mean is None) and (self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, bn_training, factor, self.eps)
        return self.act(x)


class SyncBNAct(nn.SyncBatchNorm):
    """A ``SyncBatchNorm`` subclass with the same forward (what a converted-to-sync timm model holds)."""

    def forward(self, x):
        use_batch_stats = True if self.training else (self.running_mean is None and self.running_var is None)
        return F.silu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   use_batch_stats, self.momentum, self.eps))


class SuperBNAct(nn.BatchNorm2d):
    """A subclass that runs torch's forward, then its activation."""

    def forward(self, x):
        return F.silu(super().forward(x))


LAYERS = {"bnact": BNAct, "timm": TimmBNAct, "sync": SyncBNAct, "super": SuperBNAct}


def _net(layer: type, track_running_stats: bool = True) -> nn.Module:
    """Two conv + norm layers, with running statistics far from a batch's (eval must read them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), layer(8, track_running_stats=track_running_stats),
                          nn.Conv2d(8, 8, 3, padding=1), layer(8, track_running_stats=track_running_stats))
    if track_running_stats:
        with torch.no_grad():
            for bn in (model[1], model[3]):
                bn.running_mean.uniform_(-1.0, 1.0)
                bn.running_var.uniform_(0.5, 2.0)
    return model


#: what torch.fx refuses, with the reason
FX_REFUSES = {"timm": r"writes the buffer\(s\) 1\.num_batches_tracked, 3\.num_batches_tracked in place .*"
                      r"Capture it with torch\.export",
              "super": "torch.fx could not trace SuperBNAct"}


def _convert(model: nn.Module, path: str, policy: str, x: torch.Tensor, layer: str = "") -> nn.Module:
    if path == "fx" and layer in FX_REFUSES:
        before = _buffers(model)
        with pytest.raises(fxamp.TraceError, match=FX_REFUSES[layer]):
            _convert(model, path, policy, x)
        assert all(torch.equal(v, before[k]) for k, v in model.named_buffers())  # the trace's write undone
        path = "auto"  # fxamp then captures with torch.export at the first call
    kwargs = {"fx": {"frontend": "fx"}, "export": {"frontend": "export", "example_inputs": (x,)},
              "lazy": {"frontend": "export"}, "auto": {}}[path]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no optimizer: the first-gradient warning is not what this checks
        return fxamp.convert(model, policy, dtype=BF16, **kwargs)


def _buffers(m: nn.Module) -> dict:
    return {k: v.clone() for k, v in m.named_buffers()}


def _eval_checks(model: nn.Module, amp: nn.Module, x: torch.Tensor) -> None:
    """Eval output close to float32's eval output; an eval call under no_grad changes no buffer (bitwise)."""
    model.eval()
    amp.eval()
    with torch.no_grad():
        ref = model(x)
        before = _buffers(amp)
        out = amp(x)
    assert sqnr(ref, out) > 25, f"eval output {sqnr(ref, out):.1f} dB from float32's: batch statistics in eval?"
    changed = [k for k, v in amp.named_buffers() if not torch.equal(v, before[k])]
    assert changed == [], f"an eval call changed {changed}"


PATHS = ["fx", "export", "lazy"]


@pytest.mark.parametrize("policy", ["O1"])  # (the mode flag is the capture's, not the policy's: O2 below)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_batch_norm_subclass_converted_in_eval_mode_runs_its_running_statistics(layer, path, policy):
    model = _net(LAYERS[layer]).eval()
    x = torch.randn(4, 3, 8, 8)
    amp = _convert(model, path, policy, x, layer)
    _eval_checks(model, amp, x)


@pytest.mark.parametrize("policy", ["O2"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_batch_norm_subclass_converted_in_training_mode_updates_statistics_then_follows_eval(layer, path, policy):
    model = _net(LAYERS[layer]).train()
    ref_model = _net(LAYERS[layer]).train()  # the float32 original, stepped beside the conversion
    x = torch.randn(4, 3, 8, 8)
    amp = _convert(model, path, policy, x, layer).train()
    for _ in range(2):
        amp(x).float().sum().backward()
        ref_model(x)
    for (name, got), want in zip(amp.named_buffers(), ref_model.buffers()):
        if name.endswith("num_batches_tracked"):
            assert torch.equal(got, want), f"{name}: {int(got)} batches, the original counted {int(want)}"
        else:  # bf16 convolutions feed the statistics: close, not equal
            assert (got.float() - want).abs().max() < 0.05 * want.abs().max(), name
    _eval_checks(ref_model, amp, x)


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("path", PATHS)
def test_without_running_statistics_a_subclass_normalises_by_the_batch_in_eval_too(path, policy):
    model = _net(BNAct, track_running_stats=False).eval()
    x = torch.randn(4, 3, 8, 8)
    amp = _convert(model, path, policy, x)
    _eval_checks(model, amp, x)  # the original's eval: batch statistics, as running_mean is None
    with torch.no_grad():
        batch = F.relu(F.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, True))
        assert not torch.allclose(batch, F.relu(model[0](x)), atol=1e-2)  # (normalising does something)


class Block(nn.Module):
    def __init__(self, layer: type):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), layer(8)

    def forward(self, x):
        return x + self.bn(self.conv(x))


class Blocks(nn.Module):
    def __init__(self, layer: type):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([Block(layer) for _ in range(2)])

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_convert_in_place_blocks_holding_a_subclass_follow_eval(layer, mode):
    """fxamp.convert_: the subclass inside each block follows eval(); its block captures with torch.export
    where a trace with the call's values would have run the running-statistics update (timm, super)."""
    torch.manual_seed(0)
    model, ref = Blocks(LAYERS[layer]), Blocks(LAYERS[layer])
    with torch.no_grad():
        for block in model.blocks:
            block.bn.running_mean.uniform_(-1.0, 1.0)
            block.bn.running_var.uniform_(0.5, 2.0)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxamp.convert_(model.train(mode == "train"), "O2", dtype=BF16)
        if mode == "train":
            model(x).float().sum().backward()
            ref.train()(x)
            for (name, got), want in zip(model.named_buffers(), ref.buffers()):
                assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max(), name
    _eval_checks(ref, model, x)
