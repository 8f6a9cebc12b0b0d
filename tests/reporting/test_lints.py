"""Every dtype-leak lint says what to do, or does not fire (issue 11, part 5): GPT-2 through torch.export."""

from __future__ import annotations

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpt2_kv_cache_values_are_not_flagged():
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    rep = fxamp.report(model, example_inputs=(ids,))
    assert rep.frontend == "export" and rep.lints
    for lint in rep.lints:
        assert "overrides=" in lint.message or "store it in low precision" in lint.message, lint
        assert not lint.node.startswith("cat") and "detach_" not in lint.message and "_fxamp_constant" not in lint.message
    # the float32 producer is named, through the views between it and the cast
    first = rep.lints[0]
    assert first.kind == "cast-down" and "it comes from layer_norm (aten.layer_norm, unsafe)" in first.message
    assert "let layer_norm run in low precision" in first.message


def test_user_chosen_float32_is_not_flagged():
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import models

    block, x = models.TinyTransformerBlock(), torch.randn(2, 8, 32)
    assert {lint.node for lint in fxamp.report(block, example_inputs=x).lints if lint.kind == "cast-down"} == {"norm1", "norm2"}
    chosen = fxamp.report(block, example_inputs=x, module_overrides={"norm1": "unsafe"})
    assert {lint.node for lint in chosen.lints if lint.kind == "cast-down"} == {"norm2"}


def test_gpt2_export_table_fits_120_columns():
    """Long module paths and attention's three input dtypes made the default table 134 columns wide:
    narrower column widths are tried until it fits, wrapping cells at spaces, dots and commas."""
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    rep = fxamp.report(model, example_inputs=(ids,), policy="O1", dtype=torch.bfloat16)
    text = rep.to_table()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "…" not in text
    sdpa = text.splitlines().index(next(line for line in text.splitlines() if line.startswith("scaled_dot")))
    assert "bf16,fp32,bool" in text.splitlines()[sdpa] and "→bf16→bf16" in text.splitlines()[sdpa + 1]


def test_wrap_dtypes():
    from fxamp.reporting.formats import wrap_dtypes

    assert wrap_dtypes(["fp32"], "bf16", "bf16", 16) == "fp32→bf16→bf16"
    assert wrap_dtypes([], "-", "fp32", 16) == "·→-→fp32"
    assert wrap_dtypes(["bf16", "fp32", "bool"], "bf16", "bf16", 16) == "bf16,fp32,bool\n→bf16→bf16"
    assert wrap_dtypes(["bf16", "fp32", "bool", "i64"], "fp32", "fp32", 12) == "bf16,fp32,\nbool,i64\n→fp32→fp32"


def test_a_root_level_float32_op_is_pointed_at_node_overrides():
    """No module path covers an op in the model's own forward alone: the lint names node_overrides, and
    once the user chooses it there the lint is silent."""
    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(torch.exp(self.fc(x)))

    x = torch.randn(2, 8)
    (lint,) = [lint for lint in fxamp.report(Root(), example_inputs=x).lints if lint.kind == "cast-down"]
    assert lint.node == "exp" and "(overrides= / node_overrides=)" in lint.message
    assert not [lint for lint in fxamp.report(Root(), example_inputs=x, node_overrides={"exp": "unsafe"}).lints
                if lint.kind == "cast-down"]
