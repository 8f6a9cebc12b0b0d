"""``conversion/rewrite.py`` pass by pass: storage (O2/O3), kept storage, lowered reads, the casts."""

import operator

import pytest
import torch
import torch.nn as nn

from fxamp.conversion.capture import capture
from fxamp.conversion.pipeline import annotate
from fxamp.conversion.graph import ATTR, attr_target, cast_of
from fxamp.conversion.rewrite.casts import (CACHE_NAME, cast_kept_storage, insert_casts, lower_attribute_reads,
                                      store_params)
from fxamp.conversion.runtime import cast, cast_weights
from fxamp.policy import resolve_policy

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


class ExpLinear(nn.Module):
    """``y = exp(linear(x))``: the graph of rewrite.py's docstring."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.fc(x))


class SharedWeight(nn.Module):
    """fc.weight feeds a matmul and an unsafe op; fc2 only matmuls; head is tied to fc2."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.fc2.weight

    def forward(self, x):
        return self.head(self.fc2(self.fc(x))) + torch.exp(self.fc.weight).sum()


def classified(model, policy):
    gm = capture(model).graph_module
    pol = resolve_policy(policy, None if "=" in policy else "float16")  # presets: the float16 they were written for
    return gm, annotate(gm, pol), pol


def cast_table(gm):
    """(source, dtype, first consumer, how) for every cast node."""
    rows = []
    for n in gm.graph.nodes:
        c = cast_of(n)
        if c is not None:
            how = n.target if n.op == "call_function" else n.target  # a function, or the method name "to"
            rows.append((attr_target(c[0]) or c[0].name, c[1], next(iter(n.users)).name, how))
    return rows


def test_o1_golden_graph_casts_input_weights_and_unsafe_input():
    gm, decisions, pol = classified(ExpLinear(), "O1")
    assert store_params(gm, decisions, pol) == {}  # O1 keeps float32 storage
    assert lower_attribute_reads(gm) == 2
    made = insert_casts(gm, decisions, pol)
    gm.recompile()
    assert made == 4
    assert cast_table(gm) == [
        ("x", F16, "linear", cast),  # x's dtype is known only at run time: the checked cast
        ("fc.weight", F16, "linear", operator.getitem),  # an item of the one cast_weights call
        ("fc.bias", F16, "linear", operator.getitem),
        ("linear", F32, "exp", "to"),  # known float16: a plain .to()
    ]
    batches = gm.graph.find_nodes(op="call_function", target=cast_weights)
    assert len(batches) == 1 and batches[0].args[3] == ("fc.weight", "fc.bias")
    assert hasattr(gm, CACHE_NAME)
    x = torch.randn(3, 4)
    fc = gm.fc
    expected = torch.exp(torch.nn.functional.linear(x.half(), fc.weight.half(), fc.bias.half()).float())
    assert torch.equal(gm(x), expected)  # exactly the float16 linear, then exp in float32


def test_o1_numerics_match_float32_within_half_precision():
    torch.manual_seed(0)
    model = ExpLinear()
    gm, decisions, pol = classified(model, "O1")
    lower_attribute_reads(gm)
    insert_casts(gm, decisions, pol)
    gm.recompile()
    x = torch.randn(8, 4)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-2, atol=1e-2)


def test_weight_cache_off_casts_each_weight_with_a_plain_to():
    gm, decisions, pol = classified(ExpLinear(), "O1")
    lower_attribute_reads(gm)
    assert insert_casts(gm, decisions, pol, weight_cache=False) == 4
    assert not gm.graph.find_nodes(op="call_function", target=cast_weights)
    assert not hasattr(gm, CACHE_NAME)
    weight_casts = [n for n in gm.graph.nodes if cast_of(n) and attr_target(cast_of(n)[0])]
    assert [(n.op, n.target) for n in weight_casts] == [("call_method", "to")] * 2


def test_store_params_keeps_a_tensor_any_float32_consumer_reads_and_ties_stay_tied():
    model = SharedWeight()
    gm, decisions, pol = classified(model, "O2")
    changed = store_params(gm, decisions, pol)
    # fc.weight also feeds exp (unsafe, float32): float32; the tied fc2/head weight: float16, one tensor
    assert changed == {"fc.bias": F16, "fc2.weight": F16, "head.weight": F16}
    assert gm.fc.weight.dtype == F32 and gm.fc2.weight is gm.head.weight
    assert isinstance(gm.fc2.weight, nn.Parameter) and gm.fc2.weight.requires_grad
    assert model.fc2.weight is gm.fc2.weight  # the capture shares the model's children (convert copies for O2)
    assert store_params(*classified(SharedWeight(), "O1")) == {}


def test_cast_kept_storage_casts_low_storage_for_a_float32_consumer():
    class Unlisted(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.copysign(x, self.w)  # on no list: follows its inputs

    gm, decisions, pol = classified(Unlisted(), "params=bfloat16,compute=bfloat16")
    gm.w = nn.Parameter(gm.w.detach().bfloat16())  # storage given (as a LazyConverted makes it)
    assert cast_kept_storage(gm, decisions, pol) == 1
    (to,) = [n for n in gm.graph.nodes if cast_of(n)]
    assert (to.op, to.target, to.args[1]) == ("call_method", "to", F32)
    assert [u.name for u in to.users] == ["copysign"]
    gm.recompile()
    assert gm(torch.randn(2, 4)).dtype == F32


def test_lower_attribute_reads_reads_tensors_through_the_owners_tables():
    gm, _, _ = classified(SharedWeight(), "O1")
    assert lower_attribute_reads(gm) == 3  # fc.weight (read twice, one node), fc.bias, fc2.weight via head
    gm.recompile()
    assert not [n for n in gm.graph.find_nodes(op="get_attr") if "." in str(n.target)]
    reads = {n.meta[ATTR] for n in gm.graph.nodes if ATTR in n.meta}
    assert reads == {"fc.weight", "fc.bias", "fc2.weight"}
    assert "._parameters" in gm.code
    gm.fc2.weight = nn.Parameter(torch.zeros(4, 4))  # reads stay live: a replaced parameter is seen
    assert torch.equal(gm(torch.ones(1, 4)), torch.exp(gm.fc.weight).sum().expand(1, 4))


def test_unsafe_inplace_on_a_low_activation_runs_out_of_place_and_writes_back():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            y.exp_()
            return y

    gm, decisions, pol = classified(InPlace(), "O1")
    lower_attribute_reads(gm)
    insert_casts(gm, decisions, pol)
    gm.recompile()
    methods = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert methods == ["to", "exp", "copy_", "to"]  # to(f32), exp out of place, written back; output cast
    (exp,) = [n for n in gm.graph.nodes if n.target == "exp"]
    assert cast_of(exp.args[0]) == (exp.args[0].args[0], F32)
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    (copy_,) = [n for n in gm.graph.nodes if n.target == "copy_"]
    assert copy_.args[0].name == "linear" and exp.name == "exp_"  # into the float16 y; exp keeps the name
    out = gm(x)
    assert out.dtype == F32  # Policy.output
    torch.testing.assert_close(out, torch.exp(gm.fc(x)), rtol=1e-2, atol=1e-2)
