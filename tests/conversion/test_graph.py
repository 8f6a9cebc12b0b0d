"""``conversion/graph.py``: the Decision record, the meta keys' readers and the shared graph helpers."""

import dataclasses
import pickle

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxamp
from fxamp.conversion.graph import (CAST, DECISION, Decision, attr_target, canonical_names, cast_of,
                                    clean_export_path, decision_of, dedupe_get_attrs, fetch_attr,
                                    mirror_module_tree, module_path_of, node_arg, rebind, rename_node,
                                    replace_node_arg, replace_tensors, tensor_slots)
from fxamp.conversion.op_lists import Category, Source


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


def test_decision_of_fills_resolved_and_the_constructor_only_checks():
    d = Decision.of("torch.exp", Category.UNSAFE, "why", torch.float32)
    assert d.resolved is Category.UNSAFE and d.source is Source.OP_LIST
    c = Decision.of("softmax", Category.CONDITIONAL, "why", None, resolved=Category.NEUTRAL)
    assert c.resolved is Category.NEUTRAL
    with pytest.raises(TypeError, match="Decision's resolved must be a Category, not None"):
        Decision("torch.exp", Category.UNSAFE, "why", torch.float32)
    with pytest.raises(TypeError, match="Decision's source must be a Source, not 'op list'"):
        Decision("x", Category.SAFE, "why", None, source="op list", resolved=Category.SAFE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.compute = None
    assert pickle.loads(pickle.dumps(d)) == d


def test_decision_of_and_cast_of_read_what_convert_wrote():
    amp = fxamp.convert(Tied(), "O1")
    nodes = {n.name: n for n in amp.graph.nodes}
    assert decision_of(nodes["x"]).op == "input" and decision_of(nodes["x"]) is nodes["x"].meta[DECISION]
    casts = [n for n in amp.graph.nodes if cast_of(n) is not None]
    assert casts and all(cast_of(n) is n.meta[CAST] for n in casts)
    assert {attr_target(cast_of(n)[0]) for n in casts} >= {"a.weight", "a.bias", "b.bias"}
    assert cast_of(nodes["x"]) is None


def test_fetch_attr_attr_target_and_module_path():
    gm = fx.symbolic_trace(Tied())
    assert fetch_attr(gm, "a.weight") is gm.a.weight
    (scale,) = gm.graph.find_nodes(op="get_attr")
    assert attr_target(scale) == "scale" and attr_target(next(iter(gm.graph.nodes))) is None
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [module_path_of(n) for n in calls] == ["a", "b"]
    assert clean_export_path("L['self'].encoder.layers[3]") == "encoder.layers.3"


def test_node_arg_and_replace_node_arg_by_position_or_keyword():
    graph = fx.Graph()
    x = graph.placeholder("x")
    pos = graph.call_function(torch.sum, (x, 1))
    kw = graph.call_function(torch.sum, (x,), {"dim": 1})
    assert node_arg(pos, 1, "dim", None) == 1 and node_arg(kw, 1, "dim", None) == 1
    assert node_arg(kw, 2, "keepdim", False) is False
    replace_node_arg(pos, 1, "dim", 0)
    replace_node_arg(kw, 1, "dim", 0)
    assert pos.args == (x, 0) and kw.kwargs == {"dim": 0}


def test_canonical_names_dedupe_and_rename():
    model = Tied()
    names = canonical_names(model)
    assert names[id(model.a.weight)] == "a.weight" and names[id(model.scale)] == "scale"
    graph = fx.Graph()
    first, second = graph.get_attr("scale"), graph.get_attr("scale")
    graph.output(graph.call_function(torch.add, (first, second)))
    dedupe_get_attrs(graph)
    assert len(graph.find_nodes(op="get_attr")) == 1
    (add,) = graph.find_nodes(op="call_function", target=torch.add)
    assert add.args == (first, first)
    old = graph.call_function(torch.neg, (first,))
    assert old.name == "neg"
    graph.erase_node(old)
    new = graph.call_function(torch.neg, (first,))
    assert new.name == "neg_1"  # fx never frees an erased node's name
    rename_node(graph, new, "neg")
    assert new.name == "neg"


def test_mirror_module_tree_keeps_the_originals_children_and_state_dict_keys():
    model = Tied()
    model.register_buffer("unused", torch.zeros(1), persistent=False)
    gm = fx.symbolic_trace(model)
    gm.register_buffer("_tensor_constant0", torch.ones(1))
    mirror_module_tree(gm, model)
    assert gm.a is model.a and gm.b is model.b
    assert list(gm.state_dict()) == list(model.state_dict())
    assert "_tensor_constant0" in dict(gm.named_buffers()) and "unused" in dict(gm.named_buffers())


def test_tensor_slots_reach_every_registration_of_a_tied_tensor():
    slots = [(name, attr) for name, _, attr, _ in tensor_slots(Tied())]
    assert slots == [("scale", "scale"), ("a.weight", "weight"), ("a.bias", "bias"), ("b.weight", "weight"),
                     ("b.bias", "bias")]


def test_rebind_copies_once_per_tied_tensor_and_keeps_grad_flags():
    model = Tied()
    model.a.bias.requires_grad_(False)
    before = model.a.weight.detach().clone()
    changed = rebind(model, {"a.weight": torch.float16, "b.weight": torch.float16, "a.bias": torch.bfloat16,
                             "scale": torch.float32})
    assert set(changed) == {"a.weight", "b.weight", "a.bias"}  # scale already float32: left alone
    assert model.a.weight is model.b.weight and model.a.weight.dtype == torch.float16
    assert isinstance(model.a.weight, nn.Parameter) and model.a.weight.requires_grad
    assert model.a.bias.dtype == torch.bfloat16 and not model.a.bias.requires_grad
    assert torch.equal(model.a.weight.float(), before.half().float())
    old, new = changed["a.weight"]
    assert old.dtype == torch.float32 and new is model.a.weight


def test_rebind_without_values_and_replace_tensors_puts_the_originals_back():
    model = Tied()
    stored = model.a.weight
    changed = rebind(model, {"a.weight": torch.float64, "scale": torch.float64}, values=False)
    assert model.a.weight.dtype == torch.float64 and model.b.weight is model.a.weight
    assert torch.equal(model.scale, torch.ones(3, dtype=torch.float64))  # buffers keep their values
    originals = {id(new): old for old, new in changed.values()}
    back = replace_tensors(model, lambda name, t: originals.get(id(t)))
    assert set(back) == {"a.weight", "b.weight", "scale"} and model.a.weight is stored
