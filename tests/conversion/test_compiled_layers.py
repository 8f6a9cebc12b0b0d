"""A model the user compiled (``torch.compile``, of a layer or of the whole) before converting it, and a model
converted in place whose first call runs under ``torch.compile``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _pair():
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _close(out, ref, x):
    with torch.no_grad():
        expected = ref(x)
    assert float((out.float() - expected).norm() / expected.norm()) < 0.02


def test_in_place_a_compiled_layer_stays_compiled_and_runs_converted():
    """The wrapper bound the original layer's __call__ when it was made: after convert_ replaced the layer, it ran the
    original forward on bfloat16 weights ('mat1 and mat2 must have the same dtype')."""
    model, ref = _pair()
    model.layers[0] = torch.compile(model.layers[0])
    keys = list(model.state_dict())
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert type(model.layers[0]).__name__ == "OptimizedModule" and list(model.state_dict()) == keys
    x = torch.randn(4, 16)
    _close(model(x), ref, x)
    assert model.layers[0]._orig_mod.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("where", ["root", "layer"])
def test_whole_model_conversion_says_it_traced_through_a_compile_wrapper(where):
    model, ref = _pair()
    if where == "root":
        model = torch.compile(model)
    else:
        model.layers[0] = torch.compile(model.layers[0])
    x = torch.randn(4, 16)
    named = "the model" if where == "root" else "'layers.0'"
    with pytest.warns(UserWarning, match=rf"torch.compile's wrapper on {named} was traced through .*: the converted "
                                         rf"module runs that code uncompiled. Compile the converted module instead"):
        amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x,))
    _close(amp(x), ref, x)


def test_a_block_captured_at_a_call_under_torch_compile_is_captured_outside_dynamo():
    """Dynamo traced fxamp's capture (torch.fx tracing and all) and warned of an lru_cache it met there ('Silent
    incorrectness is only a *potential* risk'); the capture now runs outside it, once, and the compiled model
    then runs as one graph."""
    model, ref = _pair()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    compiled = torch.compile(model)
    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = compiled(x)
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in seen]
    _close(out, ref, x)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
