"""DtypeInference: what dtype each value of a captured graph certainly has (a dtype, NOT_FLOAT, or unknown)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import fxamp
from fxamp.conversion.pipeline import annotate
from fxamp.conversion.graph import cast_of
from fxamp.conversion.classify.inference import DtypeInference
from fxamp.conversion.options import ConvertOptions
from fxamp.dtypes import NOT_FLOAT
from fxamp.policy import resolve_policy


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        n = x.size(0)
        mask = x.to(torch.bool)
        half = x.half()
        wide = x.to(torch.float64)
        low = x.to(dtype=torch.bfloat16)
        return n, mask, half, wide, low, self.w * 2, self.steps + 1, x + 1


def _inferred(model: nn.Module):
    gm = fx.symbolic_trace(model)
    decisions = annotate(gm, resolve_policy("O1", "bfloat16"), ConvertOptions())
    infer = DtypeInference(gm, dict(gm.named_modules()), decisions)
    return {n.name: n for n in gm.graph.nodes}, infer


def test_explicit_dtypes_shapes_masks_and_attributes():
    nodes, infer = _inferred(Probe())
    assert infer(nodes["size"]) is NOT_FLOAT and nodes["size"] in infer.scalars  # a shape, not a tensor
    assert infer(nodes["to"]) is NOT_FLOAT  # a bool mask
    assert infer(nodes["half"]) == torch.float16
    assert infer(nodes["to_1"]) == torch.float64  # never cast: the classifier leaves float64 alone
    assert infer(nodes["to_2"]) == torch.bfloat16  # dtype= as a keyword
    assert infer(nodes["w"]) == torch.float32  # a float parameter
    assert infer(nodes["_tensor_constant0"]) is NOT_FLOAT  # an integer tensor (the buffer's sum, made at trace)
    assert infer(nodes["x"]) is None  # an input: unknown until run time


def test_a_checked_cast_of_an_unknown_value_is_known_only_if_castable():
    """``cast(x, bf16)`` leaves a float64 ``x`` float64: unknown to ``__call__``, bf16 to ``if_castable``."""
    amp = fxamp.convert(nn.Sequential(nn.Linear(4, 4)), "O1", dtype=torch.bfloat16)
    decisions = {n: n.meta["fxamp"] for n in amp.graph.nodes if "fxamp" in n.meta}
    infer = DtypeInference(amp, dict(amp.named_modules()), decisions)
    casts = [n for n in amp.graph.nodes if cast_of(n) is not None]
    of_input = next(n for n in casts if cast_of(n)[0].op == "placeholder")
    assert cast_of(of_input)[1] == torch.bfloat16
    assert infer(of_input) is None
    assert infer.if_castable(of_input) == torch.bfloat16
    of_known = [n for n in casts if infer(cast_of(n)[0]) == torch.float32]  # the weights: float32, known
    assert of_known and all(infer(n) == cast_of(n)[1] for n in of_known)


class _LearnedScale(nn.Module):
    """CLIP's ``logit_scale.exp() * logits``: a 0-dim float32 tensor times low-precision activations."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, labels):
        logits = self.fc(x) * self.logit_scale.exp()
        return logits, nn.functional.cross_entropy(logits, labels)


def test_a_low_tensor_times_a_float32_scalar_tensor_is_not_known_float32():
    # issue 37 probe: promotion was read as float32, but a 0-dim float32 tensor leaves bfloat16 as it is, so the
    # output's cast to float32 and the loss's upcast were dropped: a bfloat16 output, a bfloat16 cross entropy
    model = _LearnedScale()
    x, y = torch.randn(3, 8), torch.tensor([0, 1, 3])
    for policy in ("O1", "O2"):
        logits, loss = fxamp.convert(model, policy, dtype=torch.bfloat16)(x, y)
        assert logits.dtype == torch.float32 and loss.dtype == torch.float32
        with torch.no_grad():
            ref = nn.functional.cross_entropy(logits.detach(), y)  # the loss of these logits, in float32
        assert abs(float(loss) - float(ref)) < 1e-5
