"""TorchScript submodules (``torch.jit.script`` / ``torch.jit.trace``) inside an eager model.  torch.fx recorded a
scripted submodule as its C++ object's ``forward``, a call classified as a tensor method: O2 fed it bfloat16 next to
its float32 weights, and the call failed inside the TorchScript interpreter.  It is now an opaque leaf, called whole
in float32 (its category overridable by path), torch.export and the in-place conversion refuse TorchScript with what
to do, and the in-place conversion keeps a scripted glue module as written."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError

V = 96
BF16 = torch.bfloat16


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class WithScripted(nn.Module):
    def __init__(self, traced: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.mid = torch.jit.trace(MLP(), torch.randn(2, 8, 32)) if traced else torch.jit.script(MLP())
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Stack(nn.Module):
    def __init__(self, scripted_blocks: bool):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        make = torch.jit.script if scripted_blocks else (lambda m: m)
        self.blocks = nn.ModuleList([make(Block()) for _ in range(2)])
        self.head = nn.Linear(32, V) if scripted_blocks else torch.jit.script(nn.Sequential(nn.LayerNorm(32),
                                                                                              nn.Linear(32, V)))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ids(seed=0):
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))


def _sqnr(ref, out):
    return float(20 * torch.log10(ref.norm() / (ref - out.float()).norm()))


@pytest.mark.parametrize("traced", [False, True], ids=["script", "trace"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_torchscript_submodule_is_called_whole_in_float32(policy, traced):
    torch.manual_seed(0)
    model = WithScripted(traced)
    ref = model(_ids())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = fxamp.convert(model, policy, dtype=BF16)
    said = [str(w.message) for w in caught if "'mid'" in str(w.message)]
    assert said and "before torch.jit.script" in said[0], said  # 40% of the parameters: named, with what to do
    assert "module_overrides={'mid': 'safe'}" in said[0]  # (by path: every scripted module is one class)
    assert amp.mid.fc1.weight.dtype == torch.float32 and amp.head.weight.dtype == (BF16 if policy == "O2" else
                                                                                   torch.float32)
    assert [n.op for n in amp.graph.nodes if "mid" in str(n.target)] == ["call_module"]
    out = amp(_ids())
    assert _sqnr(ref, out) > 40
    out.float().sum().backward()  # gradients reach the scripted module's float32 weights
    assert amp.mid.fc1.weight.grad is not None and amp.mid.fc1.weight.grad.dtype == torch.float32


def test_overriding_the_scripted_module_by_path_runs_it_in_the_low_dtype_and_leaves_the_original_alone():
    torch.manual_seed(0)
    model = WithScripted()
    ref = model(_ids())
    amp = fxamp.convert(model, "O2", dtype=BF16, module_overrides={"mid": "safe"})
    assert amp.mid.fc1.weight.dtype == BF16
    assert model.mid.fc1.weight.dtype == torch.float32  # the user's model is not changed
    assert _sqnr(ref, amp(_ids())) > 30


def test_torch_export_refuses_torchscript_with_what_to_do():
    model = WithScripted()
    for kwargs in ({"example_inputs": (_ids(),)}, {}):  # captured now, and lazily at the first call
        with pytest.raises(TraceError, match=r"torch.export cannot capture TorchScript modules \('mid'\)") as info:
            fxamp.convert(model, "O2", dtype=BF16, frontend="export", **kwargs)
        assert "before torch.jit.script" in str(info.value) and "frontend='fx'" in str(info.value)


def test_in_place_conversion_refuses_scripted_blocks_and_keeps_a_scripted_glue_module_as_written():
    with pytest.raises(ValueError, match=r"TorchScript modules \('blocks.0', 'blocks.1'\)"):
        fxamp.convert_(Stack(scripted_blocks=True), "O2", dtype=BF16)
    with pytest.raises(ValueError, match=r"names TorchScript modules \('blocks.0'"):
        fxamp.convert_(Stack(scripted_blocks=True), "O2", dtype=BF16, blocks=["blocks.*"])
    torch.manual_seed(0)
    ref = Stack(scripted_blocks=False)(_ids())
    torch.manual_seed(0)
    model = Stack(scripted_blocks=False)
    amp = fxamp.convert_(model, "O2", dtype=BF16)
    assert amp.blocks[0].fc.weight.dtype == BF16 and amp.head[1].weight.dtype == torch.float32
    assert _sqnr(ref, amp(_ids())) > 30
