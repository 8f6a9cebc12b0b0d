"""Classification: the op lists, conditional rules, in-place ops, unlisted ops, overrides, errors."""

import json
import operator
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.graph import decision_of
from fxamp.conversion.op_lists import DEFAULT_OP_LISTS, Category, OpEntry
from dtype_observer import OpDtypes
from zoo import build, inputs_for

CONSENSUS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "reference", "op_lists", "consensus.json")


def decisions(gm):
    return {n.name: decision_of(n) for n in gm.graph.nodes if decision_of(n)}


@pytest.mark.parametrize("op,category", [
    (torch.matmul, "safe"), (F.linear, "safe"), (F.conv2d, "safe"), (nn.LSTM, "safe"),
    (F.scaled_dot_product_attention, "safe"), (torch.ops.aten.addmm.default, "safe"),
    (torch.exp, "unsafe"), ("Tensor.pow", "unsafe"), (operator.pow, "unsafe"), (torch.square, "unsafe"),
    (nn.LayerNorm, "unsafe"), (F.cross_entropy, "unsafe"), (torch.mean, "unsafe"), (F.interpolate, "unsafe"),
    (torch.ops.aten.native_layer_norm.default, "unsafe"),
    (torch.softmax, "conditional"), ("Tensor.sum", "conditional"), (operator.truediv, "conditional"),
    (F.gelu, "conditional"), (nn.MultiheadAttention, "conditional"),
    (operator.add, "conditional"), ("Tensor.add", "conditional"), (torch.ops.aten.add.Tensor, "conditional"),
    (torch.sub, "conditional"), (torch.mul, "neutral"),
    (F.relu, "neutral"), (torch.cat, "neutral"), (nn.BatchNorm2d, "neutral"), (operator.getitem, "neutral"),
    ("Tensor.view", "neutral"), (F.embedding, "conditional"), (nn.Dropout, "neutral"),
])
def test_default_lists(op, category):
    entry = DEFAULT_OP_LISTS.lookup(op)
    assert entry is not None and entry.category.value == category
    assert len(entry.reason) > 20  # every entry says why


def test_every_entry_has_a_reason_and_norms_are_marked():
    for key, entry in DEFAULT_OP_LISTS.items():
        assert entry.reason, key
    assert DEFAULT_OP_LISTS[nn.LayerNorm].norm and DEFAULT_OP_LISTS[nn.BatchNorm2d].norm
    assert not DEFAULT_OP_LISTS[torch.exp].norm


@pytest.mark.skipif(not os.path.exists(CONSENSUS), reason="shared reference not present")
def test_agrees_with_the_consensus_except_where_documented():
    """fxamp's lists against ../shared/reference/op_lists/consensus.json.

    'promote' ops are neutral in fxamp because torch promotes natively, or unsafe where torch does not (their
    inputs must share one dtype: float32 for all); the only other deliberate departure is batch norm's norm
    flag (still neutral). Anything else is a bug in the lists."""
    from fxamp.conversion.op_lists import keys_for

    mismatches = []
    for record in json.load(open(CONSENSUS)):
        name = record["op"].replace("torch.nn.functional.", "F.").replace("torch.nn.", "nn.")
        keys = list(keys_for(name))
        if not keys:
            continue
        entry = DEFAULT_OP_LISTS.get(keys[0])
        ours = entry.category.value if entry else "unlisted"
        theirs = {"promote": "neutral"}.get(record["consensus"], record["consensus"])
        if ours == theirs:
            continue
        if ours == "conditional" and entry.fallback and entry.fallback.value == theirs:
            continue  # e.g. gelu: follows its producer; softmax modules vs functions
        if record["consensus"] in ("promote", "neutral") and ours == "unsafe" and "must share one dtype" in entry.reason:
            continue  # torch does not promote these (dot, cross, lerp, index_add...): one dtype, float32
        mismatches.append((record["op"], record["consensus"], ours))
    # Documented departures (see the reasons in op_lists.py):
    allowed = {
        ("nn.Softmax", "unsafe", "unsafe"),
        ("torch.nn.TransformerEncoderLayer", "conditional", "unsafe"),
        ("torch.nn.TransformerDecoderLayer", "conditional", "unsafe"),
        ("torch.nn.functional.affine_grid", "safe", "safe"),
    }
    unexpected = [m for m in mismatches if m not in allowed]
    assert not unexpected, unexpected


def test_conditional_truediv():
    class M(nn.Module):
        def forward(self, x):
            return 1.0 / x, x / 2.0, x / x

    d = decisions(fxamp.convert(M(), "O1"))
    assert d["truediv"].compute == torch.float32 and "reciprocal" in d["truediv"].reason
    assert d["truediv"].resolved is Category.UNSAFE
    assert d["truediv_1"].compute is None and d["truediv_2"].compute is None
    assert d["truediv_1"].resolved is Category.NEUTRAL and d["truediv_1"].category is Category.CONDITIONAL


def test_follow_producer_reason_names_the_producer():
    amp = fxamp.convert(build("TokenModel"), "O1")
    gelu = decisions(amp)["gelu"]
    assert gelu.category is Category.CONDITIONAL and "linear" in gelu.reason and gelu.compute is None


def test_mha_need_weights_condition():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.a(x, x, x, need_weights=False)[0] + self.a(x, x, x)[0]

    d = decisions(fxamp.convert(M(), "O1"))
    assert "need_weights=False" in d["call_module_cast"].reason
    assert "need_weights=True" in d["call_module_cast_1"].reason


def test_inplace_ops_write_into_their_tensor():
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            y.relu_()
            y.exp_()
            x.exp_()  # into the caller's tensor: as written
            return y

    amp = fxamp.convert(M(), "O1")
    d = decisions(amp)
    assert d["relu_"].category is Category.NEUTRAL and d["relu_"].compute is None
    assert d["exp_"].category is Category.UNSAFE and "written back into mul" in d["exp_"].reason  # see test_numerics_fixes
    assert d["exp__1"].category is Category.NEUTRAL and "model input" in d["exp__1"].reason
    x = torch.randn(3)
    assert torch.equal(amp(x.clone()), (x * 2).relu().exp())


def test_unlisted_function_follows_inputs_and_unlisted_module_runs_float32():
    class Custom(nn.Module):  # a user leaf module with a weight
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.custom = Custom()

        def forward(self, x):
            return self.custom(torch.special.i0(self.fc(x)))

    amp = fxamp.convert(M(), "O2", leaf_modules=[Custom], dtype=torch.float16)
    d = decisions(amp)
    assert d["special_i0"].category is Category.UNLISTED and d["special_i0"].compute is None
    assert d["custom"].category is Category.UNLISTED and d["custom"].compute == torch.float32
    assert amp.custom.w.dtype == torch.float32  # its weight cannot be cast from outside: kept float32
    with OpDtypes() as rec:
        amp(torch.randn(2, 4))
    assert rec.of("i0")[0].inputs == (torch.float16,)
    assert rec.of("mul")[0].inputs == (torch.float32, torch.float32)


def test_op_overrides_by_function_class_and_method():
    model = build("TokenModel")
    amp = fxamp.convert(model, "O1", overrides={F.gelu: "unsafe", nn.LayerNorm: "neutral", "Tensor.size": "neutral"})
    d = decisions(amp)
    assert d["gelu"].category is Category.UNSAFE and d["gelu"].source == "override"
    assert d["ln"].category is Category.NEUTRAL
    with OpDtypes() as rec:
        amp(inputs_for("TokenModel")[0])
    assert rec.of("gelu")[0].inputs == (torch.float32,)
    # the default lists are untouched
    assert DEFAULT_OP_LISTS.lookup(F.gelu).category is Category.CONDITIONAL


def test_module_path_overrides():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x):
            return self.b(self.a(x))

    amp = fxamp.convert(Net(), "O1", module_overrides={"b": "unsafe"}, dtype=torch.float16)
    d = decisions(amp)
    assert d["linear"].category is Category.SAFE
    assert d["linear_1"].category is Category.UNSAFE and d["linear_1"].source == "module override"
    with OpDtypes() as rec:
        amp(torch.randn(2, 8))
    first, second = rec.of("addmm")
    assert first.inputs[0] == torch.float16 and second.inputs == (torch.float32,) * 3


class RootOps(nn.Module):
    """Ops in the model's own forward: no module path covers one of them alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x) * 2.0  # mul
        return self.head(h * h)  # mul_1, then linear_1


def test_node_overrides_change_one_root_level_op():
    amp = fxamp.convert(RootOps(), "O1", node_overrides={"mul_1": "unsafe", "linear_1": "unsafe"},
                        module_overrides={"head": "safe"}, dtype=torch.float16)  # a node override beats a module override
    d = decisions(amp)
    assert d["mul"].category is Category.NEUTRAL and d["mul"].source == "op list"
    assert d["mul_1"].category is Category.UNSAFE and d["mul_1"].source == "node override"
    assert d["linear_1"].category is Category.UNSAFE and d["linear_1"].source == "node override"
    with OpDtypes() as rec:
        amp(torch.randn(2, 8))
    muls = rec.of("mul")
    assert [c.inputs[0] for c in muls] == [torch.float16, torch.float32]  # the other mul stays low
    assert rec.of("addmm")[1].inputs == (torch.float32,) * 3
    rep = fxamp.report(RootOps(), example_inputs=torch.randn(2, 8), node_overrides={"mul_1": "unsafe"}, dtype=torch.float16)
    row = next(r for r in rep.rows if r.node == "mul_1")
    assert row.source == "node override" and row.compute == "float32"


def test_node_overrides_are_checked():
    with pytest.raises(ValueError, match=r"no node 'mul_2'; did you mean one of \['mul_1', 'mul'"):
        fxamp.convert(RootOps(), "O1", node_overrides={"mul_2": "unsafe"})
    with pytest.raises(ValueError, match="'x' is a graph placeholder, not an op"):
        fxamp.convert(RootOps(), "O1", node_overrides={"x": "unsafe"})
    with pytest.raises(TypeError, match="node_overrides keys are node names"):
        fxamp.convert(RootOps(), "O1", node_overrides={operator.mul: "unsafe"})


def test_node_overrides_reach_a_lazy_conversion():
    """frontend="export" without example inputs captures at the first call: the names are checked there."""
    amp = fxamp.convert(RootOps(), "O1", frontend="export", node_overrides={"mul_1": "unsafe"}, dtype=torch.float16)
    x = torch.randn(2, 8)
    amp(x)  # captures (running the model in float32 once)
    with OpDtypes() as rec:
        amp(x)
    assert [c.inputs[0] for c in rec.of("mul")] == [torch.float16, torch.float32]
    bad = fxamp.convert(RootOps(), "O1", frontend="export", node_overrides={"nope": "unsafe"}, dtype=torch.float16)
    with pytest.raises(ValueError, match="no node 'nope'"):
        bad(x)


def test_with_overrides_makes_new_lists():
    lists = DEFAULT_OP_LISTS.with_overrides({torch.exp: "neutral"})
    assert lists.lookup(torch.exp).category is Category.NEUTRAL
    assert DEFAULT_OP_LISTS.lookup(torch.exp).category is Category.UNSAFE
    custom = lists.with_overrides({torch.tanh: OpEntry("unsafe", "my reason")})
    assert custom.lookup(torch.tanh).reason == "my reason"
    amp = fxamp.convert(build("TiedLM"), "O1", op_lists=custom)
    assert decisions(amp)["tanh"].reason == "my reason"


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"overrides": {torch.exp: "fast"}}, ValueError, "'fast' is not a category; use one of safe, neutral"),
    ({"overrides": {"exp": "safe"}}, ValueError, r"strings name Tensor methods \('Tensor.<name>'\), functions are "
                                                 r"passed as themselves: write torch.exp or 'Tensor.exp'"),
    # a function's bare name, or a typo of it, is told the function to pass (the old error only said 'Tensor.<name>')
    ({"overrides": {"linear": "safe"}}, ValueError, r"'linear': .*: write F.linear \(torch.nn.functional.linear\)"),
    ({"overrides": {"lienar": "safe"}}, ValueError, r"'lienar': .*; did you mean F.linear \(torch.nn.functional.linear\)\?"),
    ({"overrides": {"Tensor.lienar": "safe"}}, ValueError, r"torch.Tensor has no method 'lienar'; did you mean F.linear"),
    ({"overrides": {"encoder.layers.3": "safe"}}, ValueError, r"themselves \(a module path .* goes in module_overrides=\)"),
    ({"overrides": {3: "safe"}}, TypeError, "cannot use 3 as an op key"),
    ({"overrides": {torch.exp: "conditional"}}, ValueError, "override with an OpEntry"),
    ({"module_overrides": {"fc9": "safe"}}, ValueError, "'fc9' is not a submodule of the model"),
    ({"leaf_modules": ["nope"]}, ValueError, "leaf_modules: 'nope' is not a submodule path"),
    ({"leaf_modules": [3]}, TypeError, "leaf_modules takes nn.Module classes or module paths"),
    ({"frontend": "jit"}, ValueError, "frontend='jit' is not one of"),
    ({"op_lists": {}}, TypeError, "op_lists must be an fxamp.conversion.op_lists.OpLists"),
])
def test_bad_options_say_what_to_do(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fxamp.convert(build("MLP"), "O1", **kwargs)


def test_not_a_module_and_already_converted():
    with pytest.raises(TypeError, match="takes an nn.Module"):
        fxamp.convert(lambda x: x)
    amp = fxamp.convert(build("MLP"))
    with pytest.raises(ValueError, match="already converted"):
        fxamp.convert(amp)


def test_untraceable_model_names_module_line_and_fix():
    class Inner(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.inner = Inner()

        def forward(self, x):
            return self.inner(self.fc(x))

    lazy = fxamp.convert(Outer())  # no inputs: torch.export is tried at the first call ...
    with pytest.raises(fxamp.TraceError, match="could not capture Inner"):
        lazy(torch.randn(2, 4))
    with pytest.raises(fxamp.TraceError) as info:
        lazy.graph  # ... and torch.fx's error is kept
    text = str(info.value)
    assert "Inner (module at 'inner')" in text
    assert "test_classify.py" in text and "if x.sum() > 0:" in text
    assert "leaf_modules=['inner']" in text and "example_inputs=" in text
    assert isinstance(info.value.__cause__, Exception)  # chained to torch.fx's error
    amp = fxamp.convert(Outer(), "O1", leaf_modules=["inner"])  # the suggested fix works
    assert amp(torch.randn(2, 4)).dtype == torch.float32
