"""Activation checkpointing kept through conversion (fxamp/conversion/checkpointing.py, capture/regions.py).

A block the user wrapped in ``torch.utils.checkpoint.checkpoint`` runs as a checkpointed call of the
rewritten block, on the fx and export front ends and through lazy capture: it saves no more for
backward than autocast + checkpointing, and computes bitwise what the same conversion without
checkpointing computes (dropout included).
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    """pre -> checkpointed block (twice, one call per layer) -> head; ``ckpt=False``: the same without it."""

    def __init__(self, ckpt: bool = True, p: float = 0.0):
        super().__init__()
        self.ckpt = ckpt
        self.pre, self.head = nn.Linear(16, 32), nn.Linear(32, 8)
        self.layers = nn.ModuleList([Block(p), Block(p)])

    def forward(self, x):
        h = self.pre(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.ckpt else layer(h)
        return self.head(h)


class ArgOnTheLine(nn.Module):
    """The callable is a submodule and an argument is computed on the same line."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), Block()

    def forward(self, x):
        return checkpoint(self.b, self.a(x), use_reentrant=False).sum(-1)


def _saved_bytes(fn) -> int:
    """Bytes of the unique storages autograd saves for backward while ``fn()`` runs (outside checkpoints)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), s.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.float().sum().backward()
    return sum(storages.values())


def _convert(model, path, policy="O1", x=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path == "fx":
            return fxamp.convert(model, policy, dtype=BF16, frontend="fx")
        if path == "export":
            return fxamp.convert(model, policy, dtype=BF16, example_inputs=(x,), frontend="export")
        amp = fxamp.convert(model, policy, dtype=BF16, frontend="export")  # lazy: captured at the first call
        amp(x)
        return amp


PATHS = ["fx", "export", "lazy"]


@pytest.mark.parametrize("path", PATHS)
def test_a_checkpointed_block_saves_no_more_than_autocast_with_checkpointing(path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=BF16):
        autocast = _saved_bytes(lambda: model(x))
    plain = copy.deepcopy(model)
    plain.ckpt = False
    with torch.autocast("cpu", dtype=BF16):
        unkept = _saved_bytes(lambda: plain(x))
    amp = _convert(model, path, x=x)
    converted = _saved_bytes(lambda: amp(x))
    assert autocast < unkept * 0.6  # the model's checkpointing matters: the measure can tell
    assert converted <= autocast * 1.05, (converted, autocast)
    graph = amp.graph_module if path == "lazy" else amp  # a lazy capture's notes are its graph module's
    notes = [n for n in fxamp.conversion_info(graph).notes if "activation checkpointing" in n]
    assert len(notes) == 1 and "kept (2 calls): the converted block runs under torch.utils.checkpoint" in notes[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_outputs_and_gradients_are_bitwise_those_without_checkpointing_dropout_included(path, policy):
    torch.manual_seed(0)
    model, x = Net(p=0.3), torch.randn(8, 16)
    plain = copy.deepcopy(model)
    plain.ckpt = False
    amp, ref = _convert(model, path, policy, x), _convert(plain, path, policy, x)
    for m in (amp, ref):
        m.train()
    results = []
    for m in (amp, ref):
        torch.manual_seed(1)  # the same dropout masks; the recomputation must replay them
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.float().square().sum().backward()
        results.append((out, xi.grad, [p.grad.clone() for p in m.parameters()]))
        m.zero_grad()
    (out, gx, grads), (out_ref, gx_ref, grads_ref) = results
    assert out.dtype == out_ref.dtype and torch.equal(out, out_ref)
    assert torch.equal(gx, gx_ref)
    assert len(grads) == len(grads_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    with torch.no_grad():  # the dropout really ran: another seed gives another output
        torch.manual_seed(2)
        assert not torch.equal(amp(x), out.detach())


def test_a_block_after_an_argument_computed_on_its_line_is_checkpointed_alone():
    torch.manual_seed(0)
    model, x = ArgOnTheLine(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=BF16):
        autocast = _saved_bytes(lambda: model(x))
    for path in ("fx", "export"):
        amp = _convert(model, path, x=x)
        assert _saved_bytes(lambda: amp(x)) <= autocast * 1.05
        with torch.autocast("cpu", dtype=BF16):
            want = model(x)
        torch.testing.assert_close(amp(x).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_o2_state_dict_keys_stay_and_a_pickled_module_still_checkpoints():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    amp = _convert(model, "fx", "O2")
    assert list(amp.state_dict()) == list(model.state_dict())
    again = pickle.loads(pickle.dumps(amp))
    assert _saved_bytes(lambda: again(x)) == _saved_bytes(lambda: amp(x))
    assert torch.equal(again(x), amp(x))


class OpaqueKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = Block()

    def forward(self, x):
        return checkpoint(self.b, x, use_reentrant=False, context_fn=self.contexts)

    def contexts(self):
        return torch.utils.checkpoint.noop_context_fn()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_checkpoint_call_that_cannot_be_kept_is_noted_with_its_line(frontend):
    with pytest.warns(UserWarning, match=r"fxamp: activation checkpointing at `return checkpoint\(self.b, x, "
                                         r"use_reentrant=False, context_fn=self.contexts\)` at "
                                         r".*test_checkpointing.py:\d+ \(OpaqueKeyword\) was traced through "
                                         r"\(" + frontend + r"\): the converted block's activations are saved "
                                         r"for backward \(its keyword\(s\) context_fn are not literals"):
        amp = fxamp.convert(OpaqueKeyword(), "O1", dtype=BF16, example_inputs=(torch.randn(4, 32),),
                            frontend=frontend)
    assert any("was traced through" in n for n in fxamp.conversion_info(amp).notes)


def _run_checkpointed(layer, h):
    return checkpoint(layer, h, use_reentrant=False)


class HelperNet(Net):
    """The checkpoint call sits in a function forward calls, not in forward's own source."""

    def forward(self, x):
        h = self.pre(x)
        for layer in self.layers:
            h = _run_checkpointed(layer, h) if self.ckpt else layer(h)
        return self.head(h)


def test_a_checkpoint_call_in_a_helper_function_is_kept_on_the_fx_front_end():
    torch.manual_seed(0)
    model, x = HelperNet(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=BF16):
        autocast = _saved_bytes(lambda: model(x))
    amp = _convert(model, "fx", x=x)
    assert _saved_bytes(lambda: amp(x)) <= autocast * 1.05
    notes = [n for n in fxamp.conversion_info(amp).notes if "activation checkpointing" in n]
    assert len(notes) == 1 and "(_run_checkpointed())" in notes[0] and "kept (2 calls)" in notes[0]
