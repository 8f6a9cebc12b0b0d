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


class Rescaled(nn.Module):
    """RWKV's inference trick: the first eval call scales a weight in place and records it in a Python flag;
    train() scales it back at the next call.  A graph keeps the scaling but not the flag."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.rescaled = False

    def forward(self, x):
        if self.training == self.rescaled:
            with torch.no_grad():
                self.lin.weight.mul_(2.0 if self.training else 0.5)
            self.rescaled = not self.training
        return self.lin(x) * (2.0 if self.rescaled else 1.0)



class Flagged(Rescaled):
    """The flag set in a method forward calls (RWKV's ``_rescale_layers``), where the scan of forward cannot see it."""

    def forward(self, x):
        if self.training == self.rescaled:
            self.rescale()
        return self.lin(x) * (2.0 if self.rescaled else 1.0)

    def rescale(self):
        with torch.no_grad():
            self.lin.weight.mul_(2.0 if self.training else 0.5)
        self.rescaled = not self.training


class Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.seen = nn.Linear(8, 8), 0

    def forward(self, x):
        self.count(x)
        return self.lin(x)

    def count(self, x):  # (no ``self.seen = `` in forward: the scan of its source cannot see it)
        self.seen = self.seen + 1


@pytest.mark.parametrize("model, frontend", [(Flagged().eval(), "export"), (Helper(), "fx"), (Helper(), "export")])
def test_a_python_attribute_set_in_code_forward_calls_is_named(model, frontend):
    # RWKV's eval sets layers_are_rescaled in _rescale_layers: nothing said so, and torch.export put it back silently
    name, old, new = ("rescaled", False, True) if isinstance(model, Flagged) else ("seen", 0, 1)
    kw = dict(example_inputs=(torch.randn(2, 8),)) if frontend == "export" else {}
    with pytest.warns(UserWarning, match=rf"forward sets {name} \({old} -> {new}\) in code it calls: it ran once, "
                                         rf"at capture .*every call runs as if {name} were still {old}.*convert_"):
        fxamp.convert(model, "O1", dtype="bfloat16", frontend=frontend, **kw)


@pytest.mark.xfail(strict=True, reason="a graph keeps the in-place rescale but not the Python flag that gates it: "
                                       "every eval call of the captured graph rescales again (named at capture by "
                                       "the warning above; refusing would refuse every counter too); left, with "
                                       "RWKV's rescale_every")
def test_a_one_shot_rescale_gated_by_a_python_flag_runs_once():
    torch.manual_seed(0)
    model, x = Rescaled(), torch.randn(2, 8)
    ref = copy.deepcopy(model)
    amp = fxamp.convert(model, "O1", dtype="bfloat16", example_inputs=(x,), frontend="export")
    for mode in ("eval", "eval", "train", "eval"):
        getattr(ref, mode)()
        getattr(amp, mode)()
        with torch.no_grad():
            torch.testing.assert_close(amp(x), ref(x), atol=0.05, rtol=0.02)

def test_in_place_the_module_that_sets_it_runs_as_written():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = Rescaled()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    ref = copy.deepcopy(model)
    amp = fxamp.convert_(model, "O1", dtype="bfloat16")
    for mode in ("eval", "eval", "train", "eval"):
        getattr(ref, mode)()
        getattr(amp, mode)()
        with torch.no_grad():
            torch.testing.assert_close(amp(x), ref(x), atol=0.05, rtol=0.02)
