"""Numerics fixes of issue 10: float64 is never cast, RNNs take a PackedSequence, in-place unsafe
ops run in float32, and O2 storage looks through views to a weight's real consumers."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import fxamp
from fxamp.conversion.graph import decision_of
from fxamp.conversion.op_lists import Source
from fxamp.conversion.runtime import cast
from dtype_observer import OpDtypes

pytestmark = pytest.mark.usefixtures("one_thread")

LOW = (torch.float16, torch.bfloat16)
#: SQNR floors (dB) against float32 for a one-layer RNN over 5 steps
RNN_FLOOR = {torch.float16: 40.0, torch.bfloat16: 25.0}


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean().clamp_min(1e-30))).item()


# -- PackedSequence and other containers ----------------------------------------------------------

class Recurrent(nn.Module):
    def __init__(self, cls, batch_first):
        super().__init__()
        self.rnn = cls(8, 16, batch_first=batch_first)
        self.head = nn.Linear(16, 4)

    def forward(self, packed, h0):
        out, h = self.rnn(packed, h0)
        return out, self.head(out.data), h


def _packed(batch_first):
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8) if batch_first else torch.randn(5, 3, 8)
    return pack_padded_sequence(x, torch.tensor([5, 2, 4]), batch_first=batch_first, enforce_sorted=False)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_rnn_takes_a_packed_sequence(cls, batch_first, dtype, policy):
    torch.manual_seed(0)
    model = Recurrent(cls, batch_first).eval()
    packed = _packed(batch_first)
    h0 = torch.zeros(1, 3, 16)
    h0 = (h0, torch.zeros(1, 3, 16)) if cls is nn.LSTM else h0
    with torch.no_grad():
        ref = model(packed, h0)
        amp = fxamp.convert(model, policy, dtype=dtype)
        out = amp(packed, h0)
        with torch.autocast("cpu", dtype=dtype):
            auto = model(packed, h0)
    seq, head, h = out
    # the output PackedSequence comes back float32 (Policy.output), its integer parts untouched
    assert type(seq) is PackedSequence and seq.data.dtype == torch.float32
    for name in ("batch_sizes", "sorted_indices", "unsorted_indices"):
        assert torch.equal(getattr(seq, name), getattr(ref[0], name))
    assert head.dtype == torch.float32
    hs = h if isinstance(h, tuple) else (h,)
    assert all(t.dtype == torch.float32 for t in hs)
    assert sqnr(ref[0].data, seq.data) > RNN_FLOOR[dtype]
    assert sqnr(ref[1], head) > RNN_FLOOR[dtype]
    # no worse than torch.autocast (which on CPU may leave the RNN in float32) by more than 6 dB
    assert sqnr(ref[1], head) > min(sqnr(ref[1], auto[1].float()), 60.0) - 6


def test_cast_keeps_container_types():
    Pair = collections.namedtuple("Pair", "a b")
    x, i = torch.randn(2), torch.arange(2)
    out = cast({"p": Pair(x, i), "l": [x], "d": x.double()}, torch.float16)
    assert type(out) is dict and type(out["p"]) is Pair and type(out["l"]) is list
    assert out["p"].a.dtype == torch.float16 and out["p"].b is i and out["l"][0].dtype == torch.float16
    assert out["d"].dtype == torch.float64  # never cast
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 1]))
    low = cast(packed, torch.bfloat16)
    assert type(low) is PackedSequence and low.data.dtype == torch.bfloat16
    assert low.batch_sizes is packed.batch_sizes and low.sorted_indices is packed.sorted_indices


# -- O2 storage looks through views ----------------------------------------------------------------

@torch.library.custom_op("fxamp_test::mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A stand-in for a mixture-of-experts grouped matmul fallback: an op on no list."""
    return a @ b


@_grouped_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


class CustomMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 8) / 4)

    def forward(self, x):
        h = self.fc(x)
        return _grouped_mm(h.to(self.w.dtype), self.w.t().t())  # export bakes the dtype: float32


class ViewsToSafeOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16) / 4)

    def forward(self, x):
        a, b = self.w.t().split(4, dim=1)
        return torch.cat([x @ a, x @ b.contiguous()], -1) + x @ self.w.T[:, :8]


def test_o2_keeps_a_weight_float32_when_its_views_end_in_an_unlisted_op():
    torch.manual_seed(0)
    model, x = CustomMatmul().eval(), torch.randn(4, 16)
    amp = fxamp.convert(model, "O2", frontend="export", example_inputs=(x,), dtype=torch.float16)
    assert amp.w.dtype == torch.float32 and amp.fc.weight.dtype == torch.float16
    with torch.no_grad():
        assert sqnr(model(x), amp(torch.randn(4, 16).copy_(x))) > 45.0


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_o2_stores_a_weight_low_when_its_views_all_end_in_safe_ops(frontend):
    torch.manual_seed(0)
    model, x = ViewsToSafeOps().eval(), torch.randn(4, 16)
    amp = fxamp.convert(model, "O2", frontend=frontend, example_inputs=(x,), dtype=torch.float16)
    assert amp.w.dtype == torch.float16
    with torch.no_grad():
        assert sqnr(model(x), amp(x)) > 45.0


# -- float64 is never cast -----------------------------------------------------------------------------

class DoubleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.norm(self.fc1(x)))), dim=-1)


class HalfDouble(nn.Module):
    """A float32 front (runs mixed precision) and a float64 head (left alone)."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(16, 32)
        self.head = nn.Linear(32, 8).double()
        self.norm = nn.LayerNorm(8).double()

    def forward(self, x):
        h = torch.relu(self.front(x))
        return h, self.norm(self.head(h.double()))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_float64_model_is_not_cast(policy, dtype, frontend):
    torch.manual_seed(0)
    model, x = DoubleMLP().double().eval(), torch.randn(4, 16, dtype=torch.float64)
    amp = fxamp.convert(model, policy, dtype=dtype, frontend=frontend, example_inputs=(x,))
    with torch.no_grad(), OpDtypes() as rec:
        out = amp(x)
    # nothing was cast, so the result is the float64 model's, bit for bit
    assert out.dtype == torch.float64 and torch.equal(out, model(x))
    assert not rec.casts()
    assert all(p.dtype == torch.float64 for p in amp.parameters())
    decisions = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}
    linears = [d for d in decisions.values() if d.op.endswith("linear") or d.op.endswith("Linear")]
    assert linears and all(d.compute is None and d.source is Source.FLOAT64 for d in linears)
    assert "float64" in linears[0].reason


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_mixed_float32_float64_model_casts_only_the_float32_part(policy):
    torch.manual_seed(0)
    model, x = HalfDouble().eval(), torch.randn(4, 16)
    amp = fxamp.convert(model, policy, dtype=torch.float16)
    with torch.no_grad():
        ref_h, ref_y = model(x)
        with OpDtypes() as rec:
            h, y = amp(x)
    assert h.dtype == torch.float32 and y.dtype == torch.float64  # Policy.output: float32, float64 stays
    assert amp.head.weight.dtype == amp.norm.weight.dtype == torch.float64
    assert amp.front.weight.dtype == (torch.float16 if policy != "O1" else torch.float32)
    matmuls = [c.inputs for c in rec.of("addmm")]
    assert matmuls == [(torch.float16,) * 3, (torch.float64,) * 3]
    assert [c.inputs[0] for c in rec.of("native_layer_norm")] == [torch.float64]
    assert sqnr(ref_y, y) > 45.0


@pytest.mark.parametrize("policy", ["O1", "O3"])
def test_float64_input_through_parameterless_ops_stays_float64(policy):
    """A float64 input whose dtype the fx front end cannot know: the run-time casts leave it alone."""

    class Gram(nn.Module):
        def forward(self, x):
            return torch.exp(x @ x.transpose(-1, -2)).sum(-1), x.float() @ x.float().t()

    x = torch.randn(3, 4, dtype=torch.float64)
    gram, low = fxamp.convert(Gram(), policy)(x)
    ref_gram, ref_low = Gram()(x)
    assert gram.dtype == torch.float64 and torch.equal(gram, ref_gram)
    assert low.dtype == torch.float32 and sqnr(ref_low, low) > 45.0  # x.float() is castable: low precision


# -- in-place unsafe ops ------------------------------------------------------------------------------

class ExpInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        first = y[:, :4]  # a view taken before the write sees it
        y.exp_()
        return y, first * 1


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_inplace_unsafe_op_on_a_low_precision_activation_runs_in_float32_and_writes_back(dtype):
    torch.manual_seed(0)
    model, x = ExpInPlace().eval(), torch.randn(4, 16)
    amp = fxamp.convert(model, "O1", dtype=dtype)
    d = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}["exp_"]
    assert d.compute == torch.float32 and d.resolved.value == "unsafe"
    assert "computed out of place in float32 and written back into linear" in d.reason
    with torch.no_grad(), OpDtypes() as rec:
        y, first = amp(x)
    assert [c.inputs for c in rec.of("exp", "exp_")] == [(torch.float32,)]
    assert [(c.inputs[0], c.inputs[1]) for c in rec.of("copy_")] == [(dtype, torch.float32)]  # the write back
    with torch.no_grad():  # what it computes: exp in float32 of the low-precision linear, rounded once
        low = nn.functional.linear(x.to(dtype), model.fc.weight.to(dtype), model.fc.bias.to(dtype))
        expected = low.float().exp().to(dtype).float()
        ref, _ = model(x)
    assert y.dtype == torch.float32 and torch.equal(y, expected)
    assert torch.equal(first, expected[:, :4])  # the alias saw the write
    assert sqnr(ref, y) > RNN_FLOOR[dtype]


def test_inplace_op_already_in_its_dtype_stays_in_place():
    """O3 runs unsafe ops low, and a float32 activation under O1 needs no round trip: exp_ as written."""
    torch.manual_seed(0)
    model, x = ExpInPlace().eval(), torch.randn(4, 16)
    for policy, dtype in (("O3", torch.float16), ("O1", torch.float16)):
        amp = fxamp.convert(model, policy, dtype=dtype,
                            overrides={nn.functional.linear: "unsafe"} if policy == "O1" else None)
        assert "copy_" not in amp.code and ".exp_()" in amp.code
        reason = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}["exp_"].reason
        assert "runs in place as written" in reason


def test_report_shows_float64_where_it_ran_although_the_decision_said_low():
    """A float64 input known only at run time passes the checked casts untouched: the report says float64."""

    class MatSoftmax(nn.Module):
        def forward(self, a, b):
            return (a @ b).softmax(-1)

    a, b = torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    rep = fxamp.report(MatSoftmax(), example_inputs=(a, b), policy="O1")
    rows = {r.node: r for r in rep.rows}
    assert rows["matmul"].compute == "float64"
    assert rep.summary.low_share == 0.0


class LinearWeightToUnlistedOp(nn.Module):
    """A Linear's weight (predicted low by a lazily capturing module) reaching an unlisted op through a view."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        return _grouped_mm(h.to(self.proj.weight.dtype), self.proj.weight.t())


def test_lazy_o2_casts_kept_low_storage_for_an_unlisted_op_reached_through_a_view():
    torch.manual_seed(0)
    model, x = LinearWeightToUnlistedOp().eval(), torch.randn(4, 16)
    amp = fxamp.convert(model, "O2", frontend="export", dtype=torch.float16)  # no inputs: storage predicted, kept at capture
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted) and amp.proj.weight.dtype == torch.float16
    with torch.no_grad():
        assert sqnr(model(x), amp(x)) > 30.0
