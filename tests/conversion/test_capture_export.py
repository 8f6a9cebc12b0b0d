"""The torch.export front end (fxamp/export.py) on plain torch models.

Models: ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` (torch.fx cannot trace their layers)
and a ResNet-style CNN with batch norm and dropout, each converted under O1 and O2 in float16 and
bfloat16 and checked by ``export_helpers.check_converted`` (SQNR against float32, gradients on every
parameter, a second input shape, eval determinism, live train-mode dropout, state_dict keys).
The rest pins the mechanics: train/eval switching, batch-norm statistics, names, calling
convention, output structure, and the errors for models neither front end can capture.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections import namedtuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.graph import attr_target
from export_helpers import check_converted, unlisted_aten_ops

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("one_thread")


DTYPES = [torch.float16, torch.bfloat16]
POLICIES = ["O1", "O2"]


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 conv-bn, a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A two-stage ResNet for 3-channel images of any size ≥ 4."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(self.dropout(x))


def encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return model, lambda b, s: ((torch.randn(b, s, 32),), {})


def decoder():
    layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    model = nn.TransformerDecoder(layer, 2)
    return model, lambda b, s: ((torch.randn(b, s, 32), torch.randn(b, s + 3, 32)), {})


def resnet():
    return ResNet(), lambda b, s: ((torch.randn(b, 3, s, s),), {})


MODELS = {"transformer_encoder": encoder, "transformer_decoder": decoder, "resnet": resnet}


#: each model under both policies and both dtypes, paired so that every (policy, dtype) pair runs on one or two
#: of the models (all 12 combinations: CI's 5-minute budget)
CASES = [(name, policy, dtype) for i, name in enumerate(MODELS)
         for policy, dtype in zip(POLICIES, DTYPES if i % 2 == 0 else DTYPES[::-1])]


@pytest.mark.parametrize("name,policy,dtype", CASES,
                         ids=[f"{n}-{p}-{str(d).removeprefix('torch.')}" for n, p, d in CASES])
def test_model(name, policy, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    # image sizes are static under dynamic='batch'; the second shape changes them
    amp = check_converted(model, inputs, policy, dtype, **({"dynamic": "all"} if name == "resnet" else {}))
    assert not unlisted_aten_ops(amp)


# ---------------------------------------------------------------------------------------------
# Front-end choice, notes, shapes
# ---------------------------------------------------------------------------------------------


class ShapeBranch(nn.Module):
    """A branch on a shape: torch.fx cannot trace it (its proxies have no sizes), torch.export can."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, src):
        if src.dim() == 3:
            src = src.flatten(0, 1).unflatten(0, src.shape[:2])
        return self.fc(src)


def test_auto_falls_back_to_export_and_says_why():
    layer = ShapeBranch()  # (nn.TransformerEncoderLayer, the example before, is now traced by torch.fx)
    amp = fxamp.convert(layer, "O1", example_inputs=(torch.randn(2, 5, 16),), dtype=torch.float16)
    assert fxamp.conversion_info(amp).frontend == "export"
    assert fxamp.conversion_info(amp).notes[0].startswith("torch.fx could not trace the model (")
    assert "captured with torch.export instead" in fxamp.conversion_info(amp).notes[0]
    assert any("input sizes, * = dynamic: src (*, *, 16)" in n for n in fxamp.conversion_info(amp).notes)


def test_forced_export_on_a_traceable_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    amp = fxamp.convert(model, "O1", example_inputs=(torch.randn(3, 4),), frontend="export")
    assert fxamp.conversion_info(amp).frontend == "export"
    assert "captured with torch.export (frontend='export')" in fxamp.conversion_info(amp).notes
    assert fxamp.conversion_info(fxamp.convert(model, "O1", example_inputs=(torch.randn(3, 4),))).frontend == "fx"
    # without inputs: captured at the first call (issue 12; tests/conversion/test_lazy.py)
    assert isinstance(fxamp.convert(model, "O1", frontend="export"), fxamp.conversion.lazy.LazyConverted)


def test_dynamic_none_freezes_shapes():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    amp = fxamp.convert(model, "O1", example_inputs=(torch.randn(3, 4),), frontend="export", dynamic="none")
    assert any(n.startswith("static shapes") and "(3, 4)" in n for n in fxamp.conversion_info(amp).notes)
    amp(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="to be equal to 3"):
        amp(torch.randn(5, 4))


def test_bad_example_inputs():
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple of positional inputs such as \(x,\)"):
        fxamp.convert(model, example_inputs=torch.randn(2, 4), frontend="export")
    with pytest.raises(TypeError, match="example_kwargs must be a dict"):
        fxamp.convert(model, example_inputs=(torch.randn(2, 4),), example_kwargs=[1], frontend="export")


# ---------------------------------------------------------------------------------------------
# train() / eval()
# ---------------------------------------------------------------------------------------------


class Drops(nn.Module):
    """Dropout as a module, as a functional call at the root, and inside attention."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        x = self.drop(self.proj(x))
        x = F.dropout(x, 0.5, self.training)
        return self.attn(x, x, x, need_weights=False)[0]


def test_dropout_flags_are_read_from_the_owning_module():
    model = Drops()
    amp = fxamp.convert(model, "O0", example_inputs=(torch.randn(2, 3, 8),), frontend="export")
    g = amp.graph
    for node in g.find_nodes(op="call_function", target=aten.dropout.default):
        flag = node.args[2]
        assert flag.target is getattr and flag.args[1] == "training"
    owners = sorted(n.args[0].target for n in g.find_nodes(op="call_function", target=getattr))
    assert owners == ["_fxamp_mode", "attn", "drop"]  # root-level F.dropout reads the ModeFlag child
    (sdpa,) = g.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default)
    assert sdpa.args[4].args[0] == 0.5  # dropout_p = 0.5 * attn.training

    x = torch.randn(2, 3, 8)
    amp.eval()  # O0/O1 share the original's submodules: theirs follow, the root's flag is amp's own
    assert not model.attn.training and not model.drop.training and model.training
    model.eval()
    with torch.no_grad():
        assert torch.equal(amp(x), amp(x))
        torch.testing.assert_close(amp(x), model(x))  # eval-mode MultiheadAttention takes a fused path
    amp.train()
    assert not torch.equal(amp(x), amp(x))
    # one submodule in eval mode: only its dropout stops, as in the original
    amp.eval()
    amp.drop.train()
    model.eval()
    model.drop.train()
    torch.manual_seed(1)
    ref = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(amp(x), ref)  # the same dropout draws


class FunctionalDrops(nn.Module):
    """Dropout written as calls that read ``self.training``: torch.fx bakes the flag like export does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = F.dropout(self.fc(x), 0.5, self.training)
        q = x[:, None]
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0)[:, 0]


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_functional_dropout_switches_in_either_front_end(frontend, captured_in):
    model = getattr(FunctionalDrops(), captured_in)()
    amp = fxamp.convert(model, "O1", example_inputs=(torch.randn(2, 8),), frontend=frontend)
    assert fxamp.conversion_info(amp).frontend == frontend
    assert any(n.startswith("train()/eval() reach attention dropout x1, dropout x1") for n in
               fxamp.conversion_info(amp).notes)
    x = torch.randn(4, 8)
    amp.eval()
    model.eval()
    assert torch.equal(amp(x), amp(x))
    torch.testing.assert_close(amp(x), model(x), atol=1e-2, rtol=1e-2)
    amp.train()
    assert not torch.equal(amp(x), amp(x))


class StochasticDepth(nn.Module):
    """A branch on ``self.training`` that is not a dropout call: the two modes capture different graphs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(self.fc(x))
        if self.training:
            y = y * torch.empty_like(y[:, :1]).bernoulli_(0.5) / 0.5
        return x + y


def test_mode_dependent_branches_get_a_graph_per_mode_with_torch_fx():
    model = StochasticDepth().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "the graph follows eval mode" any more
        amp = fxamp.convert(model, "O1", example_inputs=(torch.randn(2, 8),), frontend="fx").eval()
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    assert any("torch.fx captured the eval mode graph now" in n for n in fxamp.conversion_info(amp).notes)
    notes = " ".join(fxamp.conversion_info(amp.graph_module).notes)
    assert "training and eval mode capture different graphs" in notes
    x = torch.randn(4, 8)
    torch.testing.assert_close(amp(x), model(x), atol=1e-2, rtol=1e-2)
    model.train()
    amp.train()
    torch.manual_seed(3)
    out = amp(x)
    torch.manual_seed(3)
    torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)  # the training graph: its branch, same draws


def test_mode_dependent_branches_get_a_graph_per_mode_with_torch_export():
    model = StochasticDepth().eval()
    amp = fxamp.convert(model, "O1", dtype=torch.float16, example_inputs=(torch.randn(2, 8),),
                        frontend="export").eval()
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    lead = fxamp.conversion_info(amp).notes[0]
    assert "fxamp holds a graph per mode" in lead
    notes = " ".join(fxamp.conversion_info(amp.graph_modules()[0]).notes)
    assert "`y = y * torch.empty_like(y[:, :1]).bernoulli_(0.5) / 0.5`" in notes  # export records source lines
    x = torch.randn(4, 8)
    torch.testing.assert_close(amp(x), model(x), atol=1e-2, rtol=1e-2)
    model.train()
    amp.train()
    torch.manual_seed(3)
    out = amp(x)
    torch.manual_seed(3)
    torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)  # the training graph: its branch, same draws


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_o0_export_matches_the_original_bitwise(mode):
    """Capture alone changes nothing: same outputs (same dropout draws), same statistics updates."""
    torch.manual_seed(0)
    model = ResNet()
    twin = copy.deepcopy(model)
    amp = fxamp.convert(model, "O0", example_inputs=(torch.randn(2, 3, 8, 8),), frontend="export", dynamic="all")
    getattr(amp, mode)()
    getattr(twin, mode)()
    x = torch.randn(4, 3, 10, 10)
    torch.manual_seed(5)
    out = amp(x)
    torch.manual_seed(5)
    ref = twin(x)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_batch_norm_runs_the_original_module():
    model = ResNet()
    amp = fxamp.convert(model, "O1", example_inputs=(torch.randn(2, 3, 8, 8),), frontend="export")
    g = amp.graph
    assert not g.find_nodes(op="call_function", target=aten.batch_norm.default)
    assert not g.find_nodes(op="call_function", target=aten.add_.Tensor)  # num_batches_tracked += 1
    calls = sorted(n.target for n in g.find_nodes(op="call_module"))
    assert calls == ["layer1.bn1", "layer1.bn2", "layer2.bn1", "layer2.bn2", "layer2.shortcut.1", "stem.1"]
    bn = model.layer1.bn1
    amp.train()
    before, count = bn.running_mean.clone(), bn.num_batches_tracked.item()
    amp(torch.randn(2, 3, 8, 8))
    assert not torch.equal(bn.running_mean, before) and bn.num_batches_tracked.item() == count + 1
    amp.eval()
    before = bn.running_mean.clone()
    amp(torch.randn(2, 3, 8, 8))
    assert torch.equal(bn.running_mean, before) and bn.num_batches_tracked.item() == count + 1


def test_capture_leaves_the_model_alone():
    model = Drops().eval()
    model.drop.train()
    modes = {n: m.training for n, m in model.named_modules()}
    forward = model.forward
    fxamp.convert(model, "O2", example_inputs=(torch.randn(2, 3, 8),), frontend="export")
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert model.forward == forward and "forward" not in model.__dict__
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Names, constants, checks
# ---------------------------------------------------------------------------------------------


class Tied(nn.Module):
    """Tied weights, a non-persistent buffer, a tensor constant made in forward, a float dtype cast."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, ids):
        h = self.embed(ids).to(torch.float32)  # export asserts the float dtype here
        return self.head(h * self.scale) + torch.tensor(1.0)


def test_names_constants_and_relaxed_asserts():
    model = Tied()
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(torch.randint(0, 16, (2, 5)),),
                        frontend="export")
    assert list(amp.state_dict()) == list(model.state_dict()) == ["embed.weight", "head.weight"]
    targets = {attr_target(n) for n in amp.graph.nodes if attr_target(n)}  # get_attr, or lowered by convert
    assert "embed.weight" in targets and "head.weight" not in targets  # one name per tied tensor
    assert "scale" in targets and "_fxamp_constant_0" in targets
    assert dict(amp.named_buffers()).keys() == {"scale", "_fxamp_constant_0"}
    asserts = amp.graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default)
    assert asserts and all(n.kwargs.get("dtype") is None for n in asserts)
    assert any("_assert_tensor_metadata" in n for n in fxamp.conversion_info(amp).notes)
    amp.graph.lint()
    out = amp(torch.randint(0, 16, (3, 7)))  # the embedding table is bfloat16 now: the assert must not fire
    assert out.dtype == torch.float32 and out.shape == (3, 7, 16)
    assert amp.embed.weight.dtype == torch.bfloat16 and amp.embed.weight is amp.head.weight


def test_deepcopy():
    model = ResNet()
    amp = fxamp.convert(model, "O2", example_inputs=(torch.randn(2, 3, 8, 8),), frontend="export").eval()
    twin = copy.deepcopy(amp)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(twin(x), amp(x))


# ---------------------------------------------------------------------------------------------
# Calling convention and output structure
# ---------------------------------------------------------------------------------------------

Pair = namedtuple("Pair", "value index")


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale: float = 1.0, extra=None):
        y = self.fc(x) * scale
        if mask is not None:
            y = y * mask
        if extra is not None:
            y = y + extra
        return {"out": y, "pair": Pair(y.sum(-1), y.argmax(-1)), "list": [y, x.shape[0]]}


def test_output_structure_and_dtypes():
    model = Structured()
    x = torch.randn(2, 4)
    amp = fxamp.convert(model, "O1", example_inputs=(x,), frontend="export")
    out = amp(torch.randn(5, 4))
    assert set(out) == {"out", "pair", "list"} and isinstance(out["pair"], Pair)
    assert out["out"].dtype == out["pair"].value.dtype == out["list"][0].dtype == torch.float32
    assert out["pair"].index.dtype == torch.int64 and out["list"][1] == 5


def test_calling_convention_follows_the_original_signature():
    model = Structured()
    x, m = torch.randn(2, 4), torch.ones(2, 4)
    amp = fxamp.convert(model, "O1", example_inputs=(x,), example_kwargs={"mask": m, "scale": 2.0},
                        frontend="export")
    y, mask = torch.randn(3, 4), torch.rand(3, 4)
    want = model(y, mask, 2.0)["out"]
    for got in (amp(y, mask=mask, scale=2.0), amp(x=y, mask=mask, scale=2.0), amp(y, mask, 2.0, None)):
        torch.testing.assert_close(got["out"], want, atol=1e-2, rtol=1e-2)
    # other inputs than the example's: each captured once more on the same parameters (lazy.RangeFallback), and
    # computed as the original does (scale left out is forward's 1.0, not the example's 2.0; issue 37)
    calls = [lambda m: m(y, mask), lambda m: m(y, mask=mask, scale=2.0, extra=y), lambda m: m(y),
             lambda m: m(y, mask, scale=3.0)]
    for call in calls + calls:
        torch.testing.assert_close(call(amp)["out"], call(model)["out"], atol=1e-2, rtol=1e-2)
    assert fxamp.conversion.lazy.range_fallback(amp)._fxamp_captures == 4
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        amp(y, mask, bogus=1)
    # with dynamic_shapes= (no second capture), each is refused in one line naming the inputs
    auto = torch.export.Dim.AUTO
    amp = fxamp.convert(model, "O1", example_inputs=(x,), example_kwargs={"mask": m, "scale": 2.0},
                        frontend="export", dynamic_shapes={"x": {0: auto}, "mask": {0: auto}, "scale": None})
    torch.testing.assert_close(amp(y, mask, 2.0)["out"], want, atol=1e-2, rtol=1e-2)
    with pytest.raises(TypeError, match=r"captured by torch.export for the inputs \(x, mask, scale\): got extra"):
        amp(y, mask=mask, scale=2.0, extra=y)
    with pytest.raises(TypeError, match="scale=1.0 where the capture had 2.0; mask missing"):
        amp(y)
    with pytest.raises(TypeError, match="scale=3.0 where the capture had 2.0. A graph from torch.export"):
        amp(y, mask, scale=3.0)
    # captured from keywords only: positional calls work too
    amp = fxamp.convert(model, "O1", example_kwargs={"x": x}, frontend="export")
    torch.testing.assert_close(amp(y)["out"], model(y)["out"], atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# What neither front end captures
# ---------------------------------------------------------------------------------------------


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inp(x))


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_data_dependent_control_flow_is_named(frontend):
    with pytest.raises(fxamp.TraceError) as info:
        fxamp.convert(Gated(), example_inputs=(torch.randn(2, 8),), frontend=frontend)
    text = str(info.value)
    assert "could not capture Gate (module at 'gate'): data-dependent control flow at " in text
    assert re.search(r"test_capture_export\.py:\d+: `if x\.sum\(\) > 0:`", text)
    assert "leaf_modules=['gate']" in text and "convert its submodules separately" in text
    assert "fxamp.convert_(model): each layer is captured at its own call" in text  # (Longformer, LED: in place works)
    assert info.value.module_path == "gate"
    assert info.value.__cause__ is not None  # the torch.export error, chained
    assert text.startswith("torch.export could not capture Gate")  # the failure to fix comes first
    if frontend == "auto":
        assert "(torch.export ran because torch.fx could not trace the model (" in text


def test_the_suggested_leaf_module_works():
    amp = fxamp.convert(Gated(), example_inputs=(torch.randn(2, 8),), leaf_modules=["gate"])
    assert fxamp.conversion_info(amp).frontend == "fx"
    assert amp(torch.randn(3, 8)).shape == (3, 8)


def test_leaf_modules_cannot_be_kept_by_export():
    with pytest.raises(fxamp.TraceError, match=r"cannot keep leaf_modules=\['gate'\] opaque"):
        fxamp.convert(Gated(), example_inputs=(torch.randn(2, 8),), leaf_modules=["gate"], frontend="export")


# ---------------------------------------------------------------------------------------------
# Op lists
# ---------------------------------------------------------------------------------------------


def test_aten_ops_share_their_torch_functions_entries():
    """Every listed torch / F function with an aten op of the same name: the aten op has the same entry."""
    lists = fxamp.conversion.op_lists.DEFAULT_OP_LISTS
    checked, differ = 0, []
    for key, entry in lists.items():
        if isinstance(key, (type, str, torch._ops.OpOverloadPacket)):
            continue
        name = getattr(key, "__name__", None)
        if isinstance(name, str) and hasattr(aten, name):
            checked += 1
            if lists.lookup(getattr(aten, name)) != entry:
                differ.append(name)
    assert checked > 150 and not differ
    for fn, op in [(F.linear, aten.linear.default), (F.layer_norm, aten.layer_norm.default),
                   (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default),
                   (F.cross_entropy, aten.cross_entropy_loss.default), (F.dropout, aten.dropout.default),
                   (F.dropout2d, aten.feature_dropout.default), (F.batch_norm, aten.batch_norm.default)]:
        assert lists.lookup(fn).category == lists.lookup(op).category, fn.__name__


@pytest.mark.parametrize("which", ["encoder layer", "attention"])
def test_o0_fast_path_modules_bitwise_except_export_under_no_grad(which):
    """The README's one exception to "O0 is bitwise": in eval under no_grad these modules take torch's
    fused fast path eagerly, which an exported graph cannot call (the default front end can)."""
    torch.manual_seed(0)
    if which == "encoder layer":
        model = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    else:
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.MultiheadAttention(16, 4, batch_first=True)

            def forward(self, x):
                return self.a(x, x, x)[0]
        model = Attn()
    model.eval()
    x = torch.randn(2, 5, 16)
    fx_o0 = fxamp.convert(model, "O0", example_inputs=(x,)).eval()
    export_o0 = fxamp.convert(model, "O0", frontend="export", example_inputs=(x,)).eval()
    assert torch.equal(fx_o0(x), model(x)) and torch.equal(export_o0(x), model(x))  # with grad: bitwise
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(fx_o0(x), ref)
        assert torch.allclose(export_o0(x), ref, rtol=1e-5, atol=1e-6)


def test_a_no_grad_region_in_forward_is_kept_and_noted_by_the_export_front_end():
    """The region stays a region (nothing under it is trained) and the conversion says so.

    Tested on a model of our own: whether a given Hugging Face model's export holds such a region
    is that library's detail and moves with its releases.
    """
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                y = self.a(x)
            return self.b(x) + y

    amp = fxamp.convert(Frozen(), "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(2, 8),),
                        frontend="export")
    notes = fxamp.conversion_info(amp).notes
    assert any(n.startswith("region `with torch.no_grad():` at ") and "kept (wrap_with_set_grad_enabled): runs in "
               "its grad mode" in n for n in notes)
    amp(torch.randn(2, 8)).sum().backward()
    assert amp.a.weight.grad is None and amp.a.bias.grad is None
    assert amp.b.weight.grad is not None
