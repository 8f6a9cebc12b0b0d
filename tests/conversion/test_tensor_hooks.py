"""A tensor hook registered in forward (``h.register_hook(fn)``: a gradient scaled, recorded or clipped on its way
back).  torch.export runs forward on stand-in tensors and records their ops: the hook was registered on a stand-in
and the converted model's gradients silently lost it (2x here).  torch.export now refuses such a model, naming the
line; torch.fx cannot record a hook function and says so; the in-place conversion keeps the hook.  A block that
registers it only when gradients flow (``if h.requires_grad``) is captured in the call's grad mode: it was
captured under no_grad, the branch then failed at the training call."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError

V = 96
BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if h.requires_grad:  # (no hook on a tensor without gradients: torch refuses one)
            h.register_hook(lambda g: g * 0.5)
        return x + h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ids():
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))


def _model():
    torch.manual_seed(0)
    return Model()


def test_torch_export_refuses_a_tensor_hook_registered_in_forward():
    for kwargs in ({"example_inputs": (_ids(),)}, {}):  # captured now; lazily, at the first call
        with pytest.raises(TraceError, match=r"forward registers a tensor hook \(.*test_tensor_hooks.py:\d+") as info:
            amp = fxamp.convert(_model(), "O2", dtype=BF16, frontend="export", **kwargs)
            amp(_ids())
        assert "fxamp.convert_" in str(info.value)
    with pytest.raises(TraceError, match="torch.fx could not trace"):  # (the branch, and a function argument)
        fxamp.convert(_model(), "O2", dtype=BF16, frontend="fx")


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_in_place_conversion_keeps_a_hook_registered_when_gradients_flow(policy):
    reference = _model()
    reference(_ids()).sum().backward()
    amp = fxamp.convert_(_model(), policy, dtype=BF16)
    amp(_ids()).float().sum().backward()
    for ours, theirs in zip(amp.blocks, reference.blocks):  # halved by the hook, as in the model (2x without it)
        ratio = float(ours.fc.weight.grad.float().norm() / theirs.fc.weight.grad.norm())
        assert abs(ratio - 1) < 0.02, ratio
    with torch.no_grad():  # the other branch: no hook, no error
        assert amp.eval()(_ids()).shape == (2, 8, V)
