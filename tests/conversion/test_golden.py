"""Golden graphs: how many casts convert() inserts, and where (source → dtype → consumer)."""

import pytest
import torch

import fxamp
import operator

from fxamp.conversion.graph import attr_target, cast_of
from fxamp.conversion.runtime import cast, cast_weights
from zoo import build


def label(node):
    """A weight by its get_attr-style name (fc1_weight), anything else by its node name."""
    target = attr_target(node)
    return target.replace(".", "_") if target else node.name


def casts(gm):
    return [(label(cast_of(n)[0]), str(cast_of(n)[1]).removeprefix("torch."),
             next(iter(n.users)).name) for n in gm.graph.nodes if cast_of(n) is not None]


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target or n.target == target)


GOLDEN = {
    ("MLP", "O1"): [
        ("x", "float16", "linear"),
        ("fc1_weight", "float16", "linear"), ("fc1_bias", "float16", "linear"),
        ("fc2_weight", "float16", "linear_1"), ("fc2_bias", "float16", "linear_1"),
        ("fc3_weight", "float16", "linear_2"), ("fc3_bias", "float16", "linear_2"),
        ("linear_2", "float32", "output"),
    ],
    ("MLP", "O2"): [("x", "float16", "linear"), ("linear_2", "float32", "output")],
    ("MLP", "O3"): [("x", "float16", "linear"), ("linear_2", "float32", "output")],
    ("Attention", "O1"): [
        ("x", "float16", "linear"), ("qkv_weight", "float16", "linear"), ("qkv_bias", "float16", "linear"),
        # no cast around the softmax: it sits between two matmuls (see test_convert)
        ("proj_weight", "float16", "linear_1"), ("proj_bias", "float16", "linear_1"),
        # the residual sum feeds only the float32 LayerNorm, so it adds in float32 (x: a checked
        # no-op cast for a float32 input; promotion already widened it before)
        ("x", "float32", "add"), ("linear_1", "float32", "add"),
    ],
    ("ConvBN", "O2"): [("x", "float16", "conv2d"), ("linear", "float32", "output")],  # BN takes fp16 as is
    ("TokenModel", "O2"): [
        # token + position lookups (tables stored low) summed in float32 for the LayerNorm
        ("embedding", "float32", "add"), ("embedding_1", "float32", "add"), ("ln", "float16", "linear"), ("add_1", "float16", "linear_1"),
        ("linear_1", "float32", "output"),
    ],
    ("TiedLM", "O1"): [
        ("embedding", "float16", "linear"), ("fc_weight", "float16", "linear"), ("fc_bias", "float16", "linear"),
        ("emb_weight", "float16", "linear_1"),       # the tied matrix: cast once, for the head
        ("linear_1", "float32", "output"),
    ],
    ("ExplicitSum", "O1"): [
        ("x", "float16", "linear"), ("fc_weight", "float16", "linear"), ("fc_bias", "float16", "linear"),
        ("linear", "float32", "pow_1"),              # one float32 copy serves pow; sum(dtype=) reads fp16
    ],
}


@pytest.mark.parametrize("name,policy", sorted(GOLDEN))
def test_golden_casts(name, policy):
    gm = fxamp.convert(build(name), policy, dtype=torch.float16)
    assert casts(gm) == GOLDEN[(name, policy)]


def test_o0_inserts_nothing():
    for name in ("MLP", "Attention", "ConvBN"):
        gm = fxamp.convert(build(name), "O0")
        assert casts(gm) == [] and count(gm, cast) == 0


def test_known_dtypes_use_plain_to_and_unknown_use_checked_cast():
    gm = fxamp.convert(build("MLP"), "O1")
    kinds = {label(cast_of(n)[0]): (n.op, n.target) for n in gm.graph.nodes if cast_of(n) is not None}
    assert kinds["x"] == ("call_function", cast)                # an input: checked at run time
    assert kinds["fc1_weight"] == ("call_function", operator.getitem)  # an item of the one cast_weights call
    (batch,) = [n for n in gm.graph.nodes if n.target is cast_weights]
    assert [label(w) for w in batch.args[1]] == ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "fc3_weight", "fc3_bias"]
    assert kinds["linear_2"] == ("call_method", "to")            # known float16: a plain .to()


def test_one_cast_per_value_and_dtype():
    class TwoUses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + self.b(x) + torch.exp(x) + torch.log(x.abs())

    gm = fxamp.convert(TwoUses(), "O1", dtype=torch.float16)
    sources = [(s, d) for s, d, _ in casts(gm)]
    assert len(sources) == len(set(sources))
    assert sources.count(("x", "float16")) == 1


def test_parameters_are_read_through_owner_dicts():
    """No getattr chain per tensor: each owner module is fetched once, each tensor is a dict lookup."""
    gm = fxamp.convert(build("ResNet"), "O2", dtype=torch.float16)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "." in str(n.target)]
    assert "._parameters" in gm.code and "._modules" in gm.code
    reads = {attr_target(n) for n in gm.graph.nodes if attr_target(n)}
    assert "blocks.0.conv1.weight" in reads and "blocks.1.bn2.running_var" not in reads  # BN stays a module call
    # reads are live: replacing a parameter or a submodule after conversion is seen
    x = torch.randn(2, 3, 6, 6)
    gm.eval()
    before = gm(x)
    gm.head.weight = torch.nn.Parameter(torch.zeros_like(gm.head.weight))
    gm.head.bias = torch.nn.Parameter(torch.zeros_like(gm.head.bias))
    assert torch.equal(gm(x), torch.zeros_like(before))
    gm.head = torch.nn.Linear(8, 4).half()
    with torch.no_grad():
        gm.head.weight.fill_(0)
        gm.head.bias.fill_(1)
    assert torch.equal(gm(x), torch.ones_like(before))
