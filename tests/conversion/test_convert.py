"""convert() on a zoo of models, for O0–O3 × float16/bfloat16: the dtype every aten op ran in,
numerics against float32 and torch.autocast, backward, modes, state_dict, save/load, copies."""

from __future__ import annotations

import copy
import io
import operator

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.graph import attr_target, cast_of, decision_of
from fxamp.conversion.rewrite.casts import weight_cache_of
from dtype_observer import OpDtypes
from zoo import ZOO, build, inputs_for

LOW = (torch.float16, torch.bfloat16)
POLICIES = ("O1", "O2", "O3")
#: SQNR floors (dB) against float32: float16 keeps 11 significant bits (~66 dB at best), bfloat16 8 (~48 dB).
SQNR_FLOOR = {torch.float16: 45.0, torch.bfloat16: 30.0}

# aten ops that must run in the low dtype (safe) or in float32 (unsafe under O1/O2).
SAFE_ATEN = {"addmm", "mm", "bmm", "convolution", "baddbmm"}
UNSAFE_ATEN = {"_log_softmax", "native_layer_norm", "exp", "pow", "reciprocal", "nll_loss_forward"}


def first(out):
    return out[0] if isinstance(out, tuple) else out


def decisions(gm):
    return {n.name: decision_of(n) for n in gm.graph.nodes if decision_of(n)}


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean().clamp_min(1e-30))).item()


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("policy", POLICIES)
def test_zoo_dtypes_and_numerics(name, dtype, policy):
    model = build(name).eval()
    x = inputs_for(name)
    with torch.no_grad():
        ref = model(*x)
        amp = fxamp.convert(model, policy, dtype=dtype)
        with OpDtypes() as rec:
            out = amp(*x)

    # every floating output comes back in float32, integer outputs untouched
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert o.dtype == r.dtype == torch.float32
    assert sqnr(first(ref), first(out)) > SQNR_FLOOR[dtype]

    for call in rec.of(*SAFE_ATEN):
        assert set(call.inputs) == {dtype}, (call.op, call.inputs)
    unsafe_dtype = dtype if policy == "O3" else torch.float32
    for call in rec.of(*UNSAFE_ATEN):
        if call.op == "native_layer_norm":
            # input is cast; weight/bias follow Policy.norms (float32 in O1/O2, low in O3)
            assert call.inputs[0] == unsafe_dtype, call
            assert set(call.inputs[1:]) <= {unsafe_dtype}, call
        else:
            assert set(call.inputs) == {unsafe_dtype}, (call.op, call.inputs)
    for call in rec.of("native_batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit"):
        assert call.inputs[0] == dtype  # batch norm takes the low-precision activation as it comes ...
        expected_params = dtype if policy == "O3" else torch.float32
        assert set(call.inputs[1:]) == {expected_params}  # ... with float32 weight and statistics (O1/O2)
    assert rec.of(*SAFE_ATEN), "the model has no safe op? the zoo is wrong"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_o0_is_bitwise_identity(name):
    model = build(name)
    x = inputs_for(name)
    amp = fxamp.convert(model, "O0")
    torch.manual_seed(1)
    ref = model(*x)
    torch.manual_seed(1)
    out = amp(*x)
    for r, o in zip(ref if isinstance(ref, tuple) else (ref,), out if isinstance(out, tuple) else (out,)):
        assert torch.equal(r, o)
    assert "cast" not in amp.code


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_o1_matches_autocast_bitwise_on_linear_layers(dtype):
    # Both cast input, weight and bias to the low dtype and run addmm there: identical bits.
    model = build("MLP")
    x = inputs_for("MLP")[0]
    amp = fxamp.convert(model, "O1", dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    assert ref.dtype == dtype
    assert torch.equal(amp(x), ref.float())


def test_softmax_between_matmuls_stays_low_elsewhere_float32():
    """Attention's softmax reads a matmul and feeds a matmul: low precision (no fp32 round trip),
    like CPU autocast. A softmax whose result leaves the model or feeds a float32 op runs in float32."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = build("Attention")
            self.cls = nn.Linear(32, 4)

        def forward(self, x):
            h = self.att(x)
            return torch.softmax(self.cls(h), dim=-1), torch.log(torch.softmax(self.cls(h) * 2, dim=-1))

    model = Heads()
    x = inputs_for("Attention")[0]
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    with OpDtypes() as rec:
        probs, logp = amp(x)
    inputs = [c.inputs for c in rec.of("_softmax")]
    assert inputs == [(torch.bfloat16,), (torch.float32,), (torch.float32,)]
    d = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}
    assert "between low-precision matmul and matmul_1" in d["softmax"].reason  # the attention's
    assert d["softmax"].resolved is fxamp.conversion.op_lists.Category.NEUTRAL
    assert d["softmax_1"].resolved is d["softmax_2"].resolved is fxamp.conversion.op_lists.Category.UNSAFE
    with torch.no_grad():
        ref = model(x)
    assert sqnr(ref[0], probs) > SQNR_FLOOR[torch.bfloat16]
    # the op list can still force it: float32 everywhere
    strict = fxamp.convert(model, "O1", dtype=torch.bfloat16, overrides={torch.softmax: "unsafe"})
    with OpDtypes() as rec:
        strict(x)
    assert {c.inputs for c in rec.of("_softmax")} == {(torch.float32,)}


@pytest.mark.parametrize("make_mask", ["ones_like(dtype=bool).triu", "triu.to(bool)"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_causal_softmax_between_matmuls_stays_low(dtype, make_mask):
    """A causal mask made with ``ones_like(scores[0, 0], dtype=torch.bool).triu(1)`` (or converted with
    ``.to(torch.bool)``) is a mask, not a float input of the masked_fill: the softmax between the two
    matmuls stays low precision (it ran in float32 with two casts of the whole score matrix: GPT-2
    small's training 8% slower than autocast's under float16 on an H100)."""

    class Causal(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.h, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4).unbind(0)
            scores = torch.matmul(q, k.transpose(-2, -1)) * 0.125
            if make_mask == "triu.to(bool)":
                mask = torch.ones_like(scores[0, 0]).triu(1).to(torch.bool)
            else:
                mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            return self.proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, d))

    torch.manual_seed(0)
    model = Causal()
    x = torch.randn(2, 8, 32)
    amp = fxamp.convert(model, "O2", dtype=dtype)
    d = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}
    assert d["softmax"].resolved is fxamp.conversion.op_lists.Category.NEUTRAL, d["softmax"].reason
    with torch.no_grad(), OpDtypes() as rec:
        out = amp(x)
    assert [c.inputs for c in rec.of("_softmax")] == [(dtype,)]
    assert not [c for c in rec.casts() if c.outputs == (torch.float32,)][1:]  # only the output's cast
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=dtype):
            ac = model(x).float()
    assert sqnr(ref, out) > sqnr(ref, ac) - 3.0


class _Embeddings(nn.Module):
    """BERT-style: three lookups summed, a layer norm, a linear; plus a sum feeding a linear and a
    sum leaving the model (neither of which may widen)."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(16, d), nn.Embedding(2, d)
        self.norm, self.lin, self.lin2 = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.tok(ids) + self.pos(pos) + self.typ(torch.zeros_like(ids))
        normed = self.norm(h)
        y = self.lin(normed)
        return self.lin2(y + y), y + y, normed


def test_a_sum_only_float32_ops_use_computes_in_float32():
    """O2 stores the tables low; their sum feeds only a layer norm, so it adds in float32 (as
    autocast's float32 residual stream does) instead of rounding to bfloat16 twice first."""
    torch.manual_seed(0)
    model = _Embeddings().eval()
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16).eval()
    d = decisions(amp)
    assert d["add"].compute == d["add_1"].compute == torch.float32
    assert d["add"].resolved is fxamp.conversion.op_lists.Category.UNSAFE and "only float32 ops use it (norm)" in d["add_1"].reason
    assert d["add_2"].compute is None and d["add_3"].compute is None  # feeds a linear / leaves the model
    assert amp.tok.weight.dtype == torch.bfloat16  # the tables still stored low: no memory given back
    with OpDtypes() as rec:
        amp(ids)
    assert [c.inputs for c in rec.of("add")] == [(torch.float32, torch.float32)] * 2 + [(torch.bfloat16,) * 2] * 2
    narrow = fxamp.convert(model, "O2", dtype=torch.bfloat16, overrides={operator.add: "neutral"}).eval()
    assert decisions(narrow)["add_1"].compute is None  # the op lists decide: overridable
    with torch.no_grad():
        ref, wide_out, narrow_out = model(ids)[2], amp(ids)[2], narrow(ids)[2]
    # the layer norm's output carries the tables' rounding either way, and the sums' only when narrow
    assert sqnr(ref, wide_out) > sqnr(ref, narrow_out) + 2.5
    for policy in ("O0", "O3"):  # nothing float32 to widen into / no mixed precision
        assert all(x.compute in (None, torch.float32 if policy == "O0" else torch.bfloat16)
                   for n, x in decisions(fxamp.convert(model, policy, dtype=torch.bfloat16)).items()
                   if n.startswith("add"))


def test_a_deep_graph_converts():
    """1500 layers: the sum-widening pass walks the graph backwards, yet infers dtypes forwards (asked
    for the last node first, the inference recursed through the whole chain: RecursionError)."""

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1500)])
            self.norm = nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(self.layers(x) + x)

    amp = fxamp.convert(Deep(), "O2", dtype=torch.bfloat16)
    assert decisions(amp)["add"].compute == torch.float32
    assert amp(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("name", ["MLP", "ConvBN", "Attention", "TokenModel", "TiedLM"])
def test_backward_reaches_parameters(name, policy):
    model = build(name)
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16)
    out = first(amp(*inputs_for(name)))
    out.float().pow(2).mean().backward()
    for pname, p in amp.named_parameters():
        assert p.grad is not None, pname
        assert p.grad.dtype == p.dtype
        assert torch.isfinite(p.grad).all()
    if policy == "O1":
        # O1 shares the original's float32 parameters: their .grad is float32
        for pname, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32, pname


def test_o1_gradients_match_autocast():
    model = build("MLP")
    x = inputs_for("MLP")[0]
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    amp(x).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    loss.backward()
    for a, b in zip(ours, (p.grad for p in model.parameters())):
        assert torch.equal(a, b)


def test_o2_stores_safe_weights_low_and_norms_float32():
    model = build("ConvBN")
    amp = fxamp.convert(model, "O2", dtype=torch.float16)
    dtypes = {k: v.dtype for k, v in amp.state_dict().items()}
    assert dtypes["conv1.weight"] == dtypes["conv2.weight"] == dtypes["fc.weight"] == torch.float16
    assert dtypes["bn1.weight"] == dtypes["bn1.running_mean"] == dtypes["bn1.running_var"] == torch.float32
    assert dtypes["bn1.num_batches_tracked"] == torch.int64
    # the original is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_o2_layernorm_params_float32_embedding_low():
    amp = fxamp.convert(build("TokenModel"), "O2", dtype=torch.bfloat16)
    sd = amp.state_dict()
    assert sd["ln.weight"].dtype == torch.float32
    assert sd["tok.weight"].dtype == sd["fc.weight"].dtype == sd["head.weight"].dtype == torch.bfloat16


def test_o3_keep_norms_fp32():
    amp = fxamp.convert(build("ConvBN"), "O3", dtype=torch.float16, keep_norms_fp32=True)
    sd = amp.state_dict()
    assert sd["bn1.weight"].dtype == torch.float32 and sd["conv1.weight"].dtype == torch.float16
    amp3 = fxamp.convert(build("ConvBN"), "O3", dtype=torch.float16)
    assert amp3.state_dict()["bn1.weight"].dtype == torch.float16


def test_tied_weights_stay_tied_and_cast_once():
    model = build("TiedLM")
    amp = fxamp.convert(model, "O2", dtype=torch.float16)
    assert amp.head.weight is amp.emb.weight
    assert amp.head.weight.dtype == torch.float16
    o1 = fxamp.convert(model, "O1", dtype=torch.float16)
    weight_casts = [n for n in o1.graph.nodes if cast_of(n) is not None
                    and attr_target(cast_of(n)[0]) == "emb.weight"]
    assert len(weight_casts) == 1  # one cast serves the embedding-side and the head-side use


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_train_eval_dropout_and_batchnorm(policy):
    model = build("ConvBN")
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16)
    x = inputs_for("ConvBN")[0]
    amp.train()
    before = amp.bn1.running_mean.clone()
    amp(x)
    assert not torch.equal(before, amp.bn1.running_mean), "running statistics must update in train()"
    assert amp.bn1.running_mean.dtype == torch.float32
    amp.eval()
    frozen = amp.bn1.running_mean.clone()
    a, b = amp(x), amp(x)
    assert torch.equal(a, b) and torch.equal(frozen, amp.bn1.running_mean)

    att = fxamp.convert(fxamp_attention_with_dropout(), policy, dtype=torch.bfloat16)
    y = inputs_for("Attention")[0]
    att.train()
    assert not torch.equal(att(y), att(y))
    att.eval()
    assert torch.equal(att(y), att(y))


def fxamp_attention_with_dropout():
    from zoo import Attention

    torch.manual_seed(0)
    return Attention(p=0.5)


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_state_dict_keys_and_fp32_loading(policy):
    model = build("TokenModel")
    amp = fxamp.convert(model, policy, dtype=torch.float16)
    assert list(amp.state_dict().keys()) == list(model.state_dict().keys())
    other = build("TokenModel", seed=3)
    amp.load_state_dict(other.state_dict())  # a float32 checkpoint loads (copy_ casts)
    ids = inputs_for("TokenModel")[0]
    expected = fxamp.convert(other, policy, dtype=torch.float16)(ids)
    assert torch.equal(amp(ids), expected)
    if policy == "O1":
        fresh = build("TokenModel", seed=5)
        fresh.load_state_dict(amp.state_dict())
        assert torch.equal(fresh(ids), other(ids))


def test_unused_parameters_and_buffers_keep_their_keys():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return self.fc(x)

    m = WithUnused()
    amp = fxamp.convert(m, "O2")
    assert list(amp.state_dict()) == list(m.state_dict())
    assert isinstance(amp.fc, nn.Linear) and isinstance(amp.spare, nn.Linear)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_save_load_and_deepcopy(policy, tmp_path):
    model = build("ConvBN").eval()
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16).eval()
    x = inputs_for("ConvBN")[0]
    expected = amp(x)
    path = tmp_path / "amp.pt"
    torch.save(amp, path)
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded(x), expected)
    assert fxamp.info.policy_of(loaded) == fxamp.info.policy_of(amp)
    clone = copy.deepcopy(amp)
    assert torch.equal(clone(x), expected)
    assert fxamp.conversion_info(clone) == fxamp.conversion_info(amp)
    assert clone.conv1.weight is not amp.conv1.weight
    buf = io.BytesIO()
    torch.save(amp.state_dict(), buf)
    buf.seek(0)
    clone.load_state_dict(torch.load(buf))
    assert torch.equal(clone(x), expected)


def test_torch_compile():
    model = build("MLP")
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    x = inputs_for("MLP")[0]
    compiled = torch.compile(amp)
    torch.testing.assert_close(compiled(x), amp(x), rtol=2e-2, atol=2e-2)
    compiled(x).sum().backward()
    assert model.fc1.weight.grad is not None


def test_model_passed_in_is_not_mutated():
    model = build("ConvBN")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = set(vars(model))
    for policy in ("O0", "O1", "O2", "O3"):
        amp = fxamp.convert(model, policy, dtype=torch.float16)
        amp(inputs_for("ConvBN")[0])  # train mode: updates *amp's* statistics in O2/O3
    assert set(vars(model)) == attrs
    for k, v in model.state_dict().items():
        if "running" not in k and "num_batches" not in k:  # O0/O1 share buffers by design
            assert torch.equal(v, before[k]) and v.dtype == before[k].dtype, k


def test_integer_and_float64_tensors_are_never_cast():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, ids, d):
            return self.fc(x), torch.exp(ids.float()) + ids.sum(), torch.exp(d), ids * 2

    amp = fxamp.convert(Mixed(), "O1")
    x, ids, d = torch.randn(2, 4), torch.arange(4), torch.randn(3, dtype=torch.float64)
    with OpDtypes() as rec:
        a, b, c, e = amp(x, ids, d)
    assert e.dtype == torch.int64 and torch.equal(e, ids * 2)
    assert c.dtype == torch.float64  # outputs: float64 not cast down either
    assert torch.equal(c, torch.exp(d))
    assert not [k for k in rec.casts() if torch.float64 in k.inputs]


def test_mixed_cat_promotes_to_widest():
    amp = fxamp.convert(build("MixedCat"), "O1", dtype=torch.float16)
    with OpDtypes() as rec:
        amp(inputs_for("MixedCat")[0])
    (cat,) = rec.of("cat")
    assert cat.outputs == (torch.float32,)


def test_explicit_sum_dtype_is_respected():
    amp = fxamp.convert(build("ExplicitSum"), "O1", dtype=torch.float16)
    node = next(n for n in amp.graph.nodes if n.op == "call_method" and n.target == "sum")
    assert decision_of(node).category is fxamp.conversion.op_lists.Category.CONDITIONAL
    assert "dtype=float32" in decision_of(node).reason
    with OpDtypes() as rec:
        amp(inputs_for("ExplicitSum")[0])
    (s,) = [c for c in rec.of("sum") if c.kwargs.get("dtype") == torch.float32]
    assert s.inputs == (torch.float16,) and s.outputs == (torch.float32,)  # read low, accumulate fp32
    (p,) = rec.of("pow")
    assert p.inputs == (torch.float32,)
    (r,) = rec.of("reciprocal")
    assert r.inputs == (torch.float32,)


def test_loss_inside_forward_runs_in_float32():
    amp = fxamp.convert(build("LossInside"), "O2", dtype=torch.bfloat16)
    x, y = inputs_for("LossInside")
    with OpDtypes() as rec:
        loss, logits = amp(x, y)
    assert loss.dtype == torch.float32
    assert {c.inputs for c in rec.of("_log_softmax", "nll_loss_forward")} == {(torch.float32,)}
    loss.backward()


def test_shape_arithmetic_is_left_alone():
    amp = fxamp.convert(build("ShapeArith"), "O1", dtype=torch.bfloat16)
    x = inputs_for("ShapeArith")[0]
    out = amp(x)
    assert out.shape == (4, 10)
    out2 = amp(torch.randn(7, 3, 6, 6))  # another batch size: nothing was frozen
    assert out2.shape == (7, 10)


def test_inference_weight_cache_is_never_stale():
    model = build("MLP")
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    x = inputs_for("MLP")[0]
    with torch.no_grad():
        a = amp(x)
        assert len(weight_cache_of(amp)) == 6
        with OpDtypes() as rec:
            b = amp(x)
        assert torch.equal(a, b)
        weight_casts = [c for c in rec.casts() if c.inputs and c.inputs[0] == torch.float32 and c.outputs == (torch.bfloat16,)]
        assert len(weight_casts) == 1  # only the input: the 6 weight copies were reused
        model.fc1.weight.mul_(2)  # an in-place change bumps the version: the copy is refreshed
        c = amp(x)
    assert not torch.equal(a, c)
    fresh = fxamp.convert(model, "O1", dtype=torch.bfloat16, weight_cache=False)
    with torch.no_grad():
        assert torch.equal(c, fresh(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # an optimizer step also invalidates
    amp(x).sum().backward()
    opt.step()
    with torch.no_grad():
        assert torch.equal(amp(x), fresh(x))


def test_output_dtype_is_configurable():
    model = build("MLP")
    x = inputs_for("MLP")[0]
    keep = fxamp.convert(model, "params=float32,compute=bfloat16,output=keep")
    assert keep(x).dtype == torch.bfloat16
    low = fxamp.convert(model, fxamp.Policy.parse("compute=bfloat16,output=bfloat16"))
    assert low(x).dtype == torch.bfloat16
    assert torch.equal(low(x), keep(x))


def test_o2_keeps_tensors_read_by_unlisted_ops_float32():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

        def forward(self, x):
            angles = torch.outer(torch.arange(x.size(0), dtype=torch.float32), self.inv_freq)
            return self.fc(x) + torch.logaddexp(angles, self.inv_freq).sum()

    amp = fxamp.convert(Rotary(), "O2", dtype=torch.bfloat16)
    assert fxamp.conversion.op_lists.DEFAULT_OP_LISTS.lookup(torch.logaddexp) is None
    assert amp.inv_freq.dtype == torch.float32  # read by logaddexp, which no list knows
    assert amp.fc.weight.dtype == torch.bfloat16


def test_tensor_constants_made_while_tracing_are_kept_out_of_state_dict():
    class Const(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            return self.fc(x) * torch.special.i0(self.scale)  # evaluated at trace time: a tensor constant

    m = Const()
    amp = fxamp.convert(m, "O1")
    assert list(amp.state_dict()) == list(m.state_dict())
    x = torch.randn(2, 4)
    torch.testing.assert_close(amp(x), m(x), rtol=1e-2, atol=1e-2)
