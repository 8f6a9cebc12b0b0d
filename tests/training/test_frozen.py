"""Frozen parameters of a model converted in place (a base model under LoRA): no optimizer takes their float32
originals as masters, so they stay held for ``state_dict``; the optimizer names that memory once, and
``fxamp.release_originals`` lets it go (``fxamp/training/ownership.py``: ``note_frozen_originals``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.info import held_origins

D = 32


class LoRALinear(nn.Module):
    """PEFT's layout: a frozen base layer plus a trainable low-rank update (B starts at zero)."""

    def __init__(self, d: int = D, r: int = 4):
        super().__init__()
        self.base_layer = nn.Linear(d, d)
        self.lora_A = nn.Linear(d, r, bias=False)
        self.lora_B = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + 2.0 * self.lora_B(self.lora_A(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = LoRALinear()
        self.mlp = nn.Linear(D, D)

    def forward(self, x):
        return x + self.mlp(torch.relu(self.proj(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def lora(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def trainable(model: nn.Module):
    return [p for p in model.parameters() if p.requires_grad]


def test_a_frozen_base_converted_in_place_is_named_once_and_released_on_request():
    torch.manual_seed(0)
    original = lora(Net())
    model = lora(copy.deepcopy(original))
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.bfloat16]
    with pytest.warns(UserWarning, match=r"(?s)10 frozen parameters of the model \(requires_grad=False\) hold their "
                                         r"float32 originals.*fxamp\.release_originals\(model\) frees that memory"):
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(trainable(model), lr=1e-2), model=model)
    assert held_origins(frozen) == len(frozen) == 10  # bases, MLPs and the head; the masters took the adapters'
    # kept until then: state_dict gives the frozen weights back exactly
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in original.state_dict().items() if "lora_" not in k)
    assert fxamp.release_originals(model) == 10 and held_origins(frozen) == 0
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # now bfloat16 values widened, masters exact
    assert torch.equal(sd["layers.0.proj.base_layer.weight"], model.layers[0].proj.base_layer.weight.float())
    x = torch.randn(8, D)
    for _ in range(3):  # training goes on: only the adapters move
        opt.zero_grad()
        opt.backward(model(x).float().square().mean())
        opt.step()
    assert torch.equal(model.state_dict()["layers.0.proj.base_layer.weight"], sd["layers.0.proj.base_layer.weight"])
    assert not torch.equal(opt.fp32_state_dict()["layers.0.proj.lora_B.weight"], sd["layers.0.proj.lora_B.weight"])


def test_no_note_where_nothing_frozen_is_held_or_it_is_a_small_share():
    torch.manual_seed(0)
    x = torch.randn(8, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # whole-model conversion holds no original: the user's model keeps them
        amp = fxamp.convert(lora(Net()), "O2", dtype=torch.bfloat16)
        fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(trainable(amp), lr=1e-2), model=amp)
        # everything trainable: the masters take every original
        model = fxamp.convert_(Net(), "O2", dtype=torch.bfloat16)
        fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
        # a frozen head only, under a tenth of the model's memory
        model = Net()
        model.head.requires_grad_(False)
        fxamp.convert_(model, "O2", dtype=torch.bfloat16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(trainable(model), lr=1e-2), model=model)
        opt.backward(model(x).float().sum())
        opt.step()
