"""A buffer's value read in forward (``self.temperature.item()``: a temperature, a scale the training loop anneals).
torch.fx proxies parameters, not buffers: the read ran once, while tracing, and the graph held that number, so
setting the buffer later changed nothing, silently.  torch.fx now refuses such a capture; the default front end
captures it with torch.export, which keeps the read, and the converted model follows the buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("temperature", torch.tensor(1.0))

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.temperature.item(), -1)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Tempered(), Tempered()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_buffer_read_in_forward_is_followed_after_it_changes(policy):
    torch.manual_seed(0)
    model = Tempered()
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16)
    amp(_x())
    for module in (amp, model):
        module.temperature.fill_(0.25)  # (O2 owns its buffers: set on both)
    assert float((amp(_x()).float() - model(_x())).abs().max()) < 2e-2  # 0.58 when the graph held 1.0


def test_torch_fx_refuses_to_hold_a_buffers_value():
    with pytest.raises(TraceError, match=r"forward reads the value of buffer temperature \(\.item\(\) at .*"
                                         r"test_buffer_reads.py:\d+\).*torch.export, which keeps the read"):
        fxamp.convert(Tempered(), "O2", dtype=torch.bfloat16, frontend="fx")


def test_in_place_a_block_that_reads_a_buffer_follows_it():
    torch.manual_seed(0)
    model = Stack()
    torch.manual_seed(0)
    amp = fxamp.convert_(Stack(), "O2", dtype=torch.bfloat16)
    amp(_x())
    for m in (amp, model):
        m.blocks[1].temperature.fill_(0.25)
    assert float((amp(_x()).float() - model(_x())).abs().max()) < 2e-2
