"""Storage decided before any graph (lazy and in place: ``storage.predict_storage``) follows the user's
``module_overrides``, and the report names a parameter stored low that only float32 ops read (``stored-low``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.storage import predict_storage
from fxamp.policy import Policy


class Block(nn.Module):
    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.pre_ln = nn.LayerNorm(16) if first else None
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        if self.first:  # RWKV's block 0 normalises the lookup: a norm in another module than the one looking up
            x = self.pre_ln(x)
        return x + self.fc(self.ln(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([Block(True), Block(False)])
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_predicted_storage_follows_module_overrides():
    policy = Policy.parse("O2", dtype=torch.bfloat16)
    default = predict_storage(LM(), policy)
    assert default["emb.weight"] == torch.bfloat16 and default["head.weight"] == torch.bfloat16
    chosen = predict_storage(LM(), policy, {"emb": "unsafe", "blocks.0": "unsafe", "blocks.1.ln": "safe"})
    assert chosen["emb.weight"] == torch.float32
    assert chosen["blocks.0.fc.weight"] == chosen["blocks.0.ln.weight"] == torch.float32  # (the whole subtree)
    assert chosen["blocks.1.ln.weight"] == torch.bfloat16 and chosen["blocks.1.fc.weight"] == torch.bfloat16
    assert chosen["head.weight"] == torch.bfloat16
    # a float8 choice is no category: it leaves the storage to the rest (it raised "not a category")
    float8 = predict_storage(LM(), policy, {"head": "no_float8", "emb": "unsafe"})
    assert float8["head.weight"] == torch.bfloat16 and float8["emb.weight"] == torch.float32


@pytest.mark.parametrize("path", ["lazy", "in-place"])
def test_an_unsafe_override_keeps_a_table_float32_on_the_paths_that_store_before_a_graph(path):
    model = LM()
    ref = model(IDS)
    amp = (fxamp.convert_(copy.deepcopy(model), "O2", dtype="bfloat16", module_overrides={"emb": "unsafe"})
           if path == "in-place" else
           fxamp.convert(copy.deepcopy(model), "O2", dtype="bfloat16", frontend="export", module_overrides={"emb": "unsafe"}))
    assert dict(amp.named_parameters())["emb.weight"].dtype == torch.float32
    assert dict(amp.named_parameters())["head.weight"].dtype == torch.bfloat16
    out = amp(IDS)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=0.05, rtol=0.05)


def test_the_report_names_a_table_stored_low_that_only_float32_ops_read():
    amp = fxamp.convert(LM(), "O2", dtype="bfloat16", frontend="export")  # lazy: storage predicted, table low
    amp(IDS)
    lints = [l for l in fxamp.report(amp).lints if l.kind == "stored-low"]
    assert len(lints) == 1 and "emb.weight is stored bfloat16" in lints[0].message, lints
    assert "module_overrides={'emb': 'unsafe'}" in lints[0].message
    fixed = fxamp.convert(LM(), "O2", dtype="bfloat16", frontend="export", module_overrides={"emb": "unsafe"})
    fixed(IDS)
    assert not [l for l in fxamp.report(fixed).lints if l.kind == "stored-low"]
    whole = fxamp.convert(LM(), "O2", dtype="bfloat16", example_inputs=(IDS,))  # its graph stores the table float32
    assert dict(whole.named_parameters())["emb.weight"].dtype == torch.float32
    assert not [l for l in fxamp.report(whole).lints if l.kind == "stored-low"]
