"""What a forward writes besides its result: a tensor it made from constants, a tensor it was given, a list it was
given.  Each is kept on every path (whole-model torch.fx and torch.export, lazy, in place), or the path refuses
it: never dropped, never run twice."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x, state):
        y = self.lin(x + state[0])
        if self.kind == "list":  # the caller's list gets a new tensor
            state[0] = state[0] + 1.0
        elif self.kind == "setitem":  # RWKV's ``state[0][:, :, self.layer_id] = ...``
            state[0][:] = state[0] + 1.0
        else:
            state[0].add_(1.0)
        return y


class Model(nn.Module):
    """Each block reads the state the one before it left: block 0 adds 0, block 1 adds 1."""

    def __init__(self, kind: str):
        super().__init__()
        self.blocks = nn.ModuleList([Block(kind), Block(kind)])

    def forward(self, x):
        state = [torch.zeros(8)]
        for block in self.blocks:
            x = block(x, state)
        return x, state[0]


def convert(model, path):
    if path == "in-place":
        return fxamp.convert_(model, "O2", dtype="bfloat16")
    kw = dict(example_inputs=(torch.randn(2, 8),)) if path == "export" else {}
    return fxamp.convert(model, "O2", dtype="bfloat16", frontend={"fx": "fx", "lazy": "export"}.get(path, path), **kw)


@pytest.mark.parametrize("kind", ["list", "setitem", "add_"])
@pytest.mark.parametrize("path", ["auto", "export", "lazy", "in-place"])
def test_every_call_keeps_what_forward_writes(kind, path):
    torch.manual_seed(0)
    model, x = Model(kind).eval(), torch.randn(2, 8)
    ref, ref_state = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (in place, "list" runs as written: tested below)
        amp = convert(copy.deepcopy(model), path)
        for _ in range(3):  # the first call captures: it must not write twice
            with torch.no_grad():
                out, state = amp(x)
            assert torch.equal(state, ref_state), (state, ref_state)
            torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ["setitem", "add_"])
def test_torch_fx_refuses_a_write_into_a_constant_it_read(kind):
    """torch.fx makes ``torch.zeros(8)`` a constant and runs the untraced ``state[0].add_(1)`` once, at trace time:
    both blocks would read 2.  frontend='fx' refuses, naming the line; 'auto' captures with torch.export."""
    with pytest.raises(fxamp.TraceError, match=r"writes in place into a tensor it made from constants .*"
                                               r"test_writes.py:\d+: `y = self.lin\(x \+ state\[0\]\)`"):
        fxamp.convert(Model(kind), "O2", dtype="bfloat16", frontend="fx")


class KeywordModel(Model):
    def forward(self, x):
        state = [torch.zeros(8)]
        for block in self.blocks:
            x = block(x, state=state)
        return x, state[0]


@pytest.mark.parametrize("model, given", [(Model("list"), "argument 1"), (KeywordModel("list"), "'state'")])
def test_a_block_that_changes_a_list_it_is_given_runs_as_written_and_says_why(model, given):
    amp = fxamp.convert_(copy.deepcopy(model), "O2", dtype="bfloat16")
    with pytest.warns(RuntimeWarning, match=rf"run\(s\) as written .*changes the list it is given as {given}"):
        _, state = amp(torch.randn(2, 8))
    assert torch.equal(state, torch.full((8,), 2.0))
