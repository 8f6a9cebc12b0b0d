"""Performance fixes of issue 13 ("close the gaps"), checked by what runs, not by timing.

Timings are too noisy on the shared CI machine; these tests count the ATen ops a forward runs
(a ``TorchDispatchMode``) or the allocations a step makes, which is what the fixes change.
"""

from __future__ import annotations

import copy
import io
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxamp
from fxamp.conversion.runtime import cast, cast_dense

pytestmark = pytest.mark.usefixtures("one_thread")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Encoder(nn.Module):
    def __init__(self, layers: int, d: int = 32, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
                                    for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# -- item 1: casts make dense copies, so F.linear folds into one addmm -----------------------------


def test_cast_of_a_transposed_tensor_is_contiguous():
    x = torch.randn(4, 3, 8).transpose(0, 1)
    for f in (cast, cast_dense):
        y = f(x, torch.bfloat16)
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        assert torch.equal(y, x.to(torch.bfloat16))


def test_cast_keeps_channels_last_and_leaves_same_dtype_alone():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = cast(x, torch.bfloat16)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    v = torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert cast(v, torch.bfloat16).is_contiguous(memory_format=torch.channels_last_3d)
    t = torch.randn(4, 3).t()
    assert cast(t, torch.float32) is t  # nothing to cast: no copy to make dense
    b = torch.randn(4, 3, dtype=torch.bfloat16).t()
    assert cast(b, torch.bfloat16) is b


def test_cast_of_a_transposed_tensor_keeps_its_gradient():
    x = torch.randn(4, 3, 8, requires_grad=True)
    y = cast(x.transpose(0, 1), torch.bfloat16)
    (y.float() * torch.arange(8.0)).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.arange(8.0).expand(4, 3, 8))


def _linear_ops(g, x):
    with torch.no_grad():
        g(x)  # fills the weight cache
        with _CountOps() as count:
            g(x)
    return count.ops


def test_o1_export_no_grad_linear_on_transposed_input_is_one_addmm():
    """The exported MultiheadAttention's in-projection reads ``x.transpose(1, 0)``.

    Cast to a strided copy, with the weight cache's bf16 weights (which do not require grad),
    ``F.linear`` went through ``at::matmul``'s unfolded path: the weight expanded per sequence
    position and a ``bmm`` that copies it that many times (40x autocast's time at BERT width).
    """
    torch.manual_seed(0)
    m = _Encoder(layers=1).eval()
    x = torch.randn(2, 16, 32)
    g = fxamp.convert(m, "O1", dtype=torch.bfloat16, example_inputs=(x,), frontend="export")
    ops = _linear_ops(g, x)
    assert ops["aten.bmm.default"] == 0, ops
    assert ops["aten.expand.default"] == 0, ops
    assert ops["aten.addmm.default"] == 4, ops  # in-projection, out-projection, linear1, linear2
    with torch.no_grad():
        ref, out = m(x), g(x).float()
    assert torch.allclose(out, ref, atol=0.1, rtol=0.1)


def test_o1_export_no_grad_every_layer_is_addmm():
    torch.manual_seed(0)
    m = _Encoder(layers=2).eval()
    x = torch.randn(2, 16, 32)
    g = fxamp.convert(m, "O1", dtype=torch.bfloat16, example_inputs=(x,), frontend="export")
    ops = _linear_ops(g, x)
    assert ops["aten.bmm.default"] == 0, ops
    assert ops["aten.addmm.default"] == 8, ops


# -- item 4: attention with dropout saves low-precision probabilities ------------------------------


def _sqnr(ref, out):
    ref, out = ref.double(), out.double()
    return (20 * torch.log10(ref.norm() / (out - ref).norm())).item()


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_runtime_attention_matches_float32_sdpa(mask):
    from fxamp.conversion.runtime import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(16, 16) > 0.3
        kw["attn_mask"][:, 0] = True
    elif mask == "float":
        kw["attn_mask"] = torch.randn(16, 16)
    causal = mask == "causal"
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, kw.get("attn_mask"), 0.0, causal)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    # a dropout probability so small nothing is dropped: the low-precision path, comparable to dropout 0
    out = attention(*low, kw.get("attn_mask"), 1e-12, causal, None)
    assert out.dtype == torch.bfloat16
    assert _sqnr(ref, out.float()) > 30
    out.float().sum().backward()
    qf = q.clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(qf, k, v, kw.get("attn_mask"), 0.0, causal).sum().backward()
    assert _sqnr(qf.grad, low[0].grad.float()) > 20


def test_runtime_attention_without_dropout_is_sdpa():
    from fxamp.conversion.runtime import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(attention(q, k, v, None, 0.0, True, None), ref)


def test_encoder_layer_with_dropout_saves_low_precision_probabilities():
    from benchmarks.run import saved_bytes

    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True).train()
    x = torch.randn(4, 32, 64)
    fp32, _ = saved_bytes(m, m, x)
    for policy in ("O1", "O2"):
        g = fxamp.convert(m, policy, dtype=torch.bfloat16, example_inputs=(x,), frontend="export")
        from fxamp.conversion.runtime import attention

        assert sum(n.target is attention for n in g.graph.nodes) == 1
        acts, _ = saved_bytes(g, g, x)
        assert acts <= 0.60 * fp32, (policy, acts / fp32)
        g(x).float().sum().backward()  # trains
        assert all(p.grad is not None for p in g.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", ["self batch_first", "self seq_first", "cross", "key padding", "float mask",
                                  "causal", "causal + padding"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_runtime_multi_head_attention_matches_the_module(case, policy):
    """runtime.multi_head_attention (placed for nn.MultiheadAttention leaves with dropout) against the
    float32 module, with a dropout so small nothing is dropped: outputs and gradients."""
    from fxamp.conversion.runtime import multi_head_attention

    torch.manual_seed(0)
    batch_first = case != "self seq_first"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, dropout=1e-12, batch_first=batch_first)

        def forward(self, x, mem, kpm, mask, causal: bool):
            kv = mem if case == "cross" else x
            return self.attn(x, kv, kv, key_padding_mask=kpm, attn_mask=mask, need_weights=False,
                             is_causal=causal)[0]

    model = Block().train()
    shape = (2, 10, 32) if batch_first else (10, 2, 32)
    x, mem = torch.randn(*shape), torch.randn(*((2, 7, 32) if batch_first else (7, 2, 32)))
    src = 7 if case == "cross" else 10
    kpm = torch.zeros(2, src, dtype=torch.bool)
    kpm[1, -3:] = True
    kpm = kpm if "padding" in case else None
    causal = case.startswith("causal")
    mask = (nn.Transformer.generate_square_subsequent_mask(10) if causal
            else torch.randn(10, src) if case == "float mask" else None)
    args = (x, mem, kpm, mask, causal)
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16).train()
    assert sum(n.target is multi_head_attention for n in amp.graph.nodes) == 1
    ref = model(*args)
    out = amp(*args)
    assert out.dtype == torch.float32 and _sqnr(ref, out) > 30
    ref.square().sum().backward()
    out.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), amp.parameters()):
        assert _sqnr(p.grad, q.grad.float()) > 20, name


def test_default_front_end_encoder_layer_saves_low_precision_probabilities():
    """nn.TransformerEncoderLayer through the default front end keeps nn.MultiheadAttention whole: it
    calls runtime.multi_head_attention in training (low-precision probabilities), the module in eval."""
    from benchmarks.run import saved_bytes
    from fxamp.conversion.runtime import multi_head_attention

    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True).train()
    x = torch.randn(4, 32, 64)
    fp32, _ = saved_bytes(m, m, x)
    for policy in ("O1", "O2"):
        g = fxamp.convert(m, policy, dtype=torch.bfloat16).train()
        assert sum(n.target is multi_head_attention for n in g.graph.nodes) == 1
        acts, _ = saved_bytes(g, g, x)
        assert acts <= 0.55 * fp32, (policy, acts / fp32)
        g(x).float().sum().backward()
        assert all(p.grad is not None for p in g.parameters() if p.requires_grad)
        buf = io.BytesIO()  # FX re-traces a pickled graph: the runtime call must stay a call
        torch.save(g, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert sum(n.target is multi_head_attention for n in loaded.graph.nodes) == 1
        torch.manual_seed(1)
        before = g(x)
        torch.manual_seed(1)
        assert torch.equal(loaded(x), before)
        g.eval()
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = m.eval()(x)
            assert _sqnr(m(x), g(x)) > _sqnr(m(x), auto.float()) - 3  # eval: the module itself
        m.train()


def test_encoder_layer_in_eval_runs_sdpa():
    """The export front end keeps the train/eval switch live (``dropout_p = 0.1 * training``): in eval
    the runtime function sees dropout 0 and runs SDPA's fused kernel."""
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True).eval()
    x = torch.randn(2, 8, 32)
    g = fxamp.convert(m, "O1", dtype=torch.bfloat16, example_inputs=(x,), frontend="export")
    with torch.no_grad(), _CountOps() as count:
        g(x)
    assert count.ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 1, count.ops
    assert not any("softmax" in op for op in count.ops), count.ops


def test_call_module_cast_casts_a_repeated_input_once():
    """An input passed as query, key and value is cast once and stays one tensor: nn.MultiheadAttention
    takes its packed self-attention projection, and only one low-precision copy exists."""
    from fxamp.conversion.runtime import call_module_cast

    class Same(nn.Module):
        def forward(self, a, b, c=None):
            return (a is b) and (b is c) and a.dtype == torch.bfloat16

    x = torch.randn(2, 3)
    assert call_module_cast(Same(), torch.bfloat16, x, x, c=x)


class _Leaves(nn.Module):
    """An attention layer and an LSTM: leaf modules O1 runs in low precision through call_module_cast."""

    def __init__(self, d: int = 32, dropout: float = 0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, dropout=dropout, batch_first=True)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        h, _ = self.lstm(a + x)
        return self.head(h)


class _CountCasts(_CountOps):
    """Also the shapes of the tensors each ``aten._to_copy`` casts."""

    def __init__(self):
        super().__init__()
        self.cast_shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.cast_shapes.append(tuple(args[0].shape))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_leaf_module_weights_are_cached_in_inference(dropout):
    """O1 leaf modules (nn.MultiheadAttention, RNNs) reuse their low-precision weights across no_grad
    calls, as the other weights do: the second call casts only its input, the results are bitwise
    those of a conversion without the cache, and an in-place weight update is seen.  In eval the
    attention layer then takes PyTorch's fused inference path (no float32 weight in sight); with
    dropout it is routed through runtime.multi_head_attention, which hands the cache on."""
    torch.manual_seed(0)
    m = _Leaves(dropout=dropout).eval()
    x = torch.randn(2, 8, 32)
    amp = fxamp.convert(m, "O1", dtype=torch.bfloat16)
    uncached = fxamp.convert(m, "O1", dtype=torch.bfloat16, weight_cache=False)
    assert "_fxamp_cache" in amp.code and "_fxamp_cache" not in uncached.code
    assert ("multi_head_attention" in amp.code) == (dropout > 0)
    with torch.no_grad():
        first = amp(x)
        with _CountCasts() as count:
            second = amp(x)
        with _CountCasts() as plain:
            reference = uncached(x)
    assert torch.equal(first, second) and torch.equal(second, reference)
    weights = {tuple(p.shape) for p in m.parameters()}
    assert count.cast_shapes and not weights & set(count.cast_shapes), count.cast_shapes  # activations only
    assert len(plain.cast_shapes) == len(count.cast_shapes) + len(list(m.parameters()))  # without: every weight
    assert count.ops["aten._native_multi_head_attention.default"] == 1, count.ops
    with torch.no_grad():
        m.attn.in_proj_weight.mul_(0.5)  # in place: O1 shares the original's parameters
        m.lstm.weight_hh_l0.add_(0.01)
        updated = amp(x)
        fresh = fxamp.convert(m, "O1", dtype=torch.bfloat16, weight_cache=False)(x)
    assert torch.equal(updated, fresh) and not torch.equal(updated, second)


def test_leaf_module_weights_are_cast_afresh_in_training():
    """With autograd recording, leaf module weights are cast at every call (the cache is not used), so
    the gradients reach the float32 parameters, equal to a conversion without the cache."""
    torch.manual_seed(0)
    m = _Leaves()
    x = torch.randn(2, 8, 32)
    grads = []
    for cache in (True, False):
        model = copy.deepcopy(m)
        amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, weight_cache=cache)
        with torch.no_grad():
            amp(x)  # fills the cache
        amp(x).float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(g is not None and g.dtype == torch.float32 for g in grads[0].values())
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_leaf_module_cache_under_torch_compile():
    """torch.compile traces the cached leaf-module call (it casts plainly while compiling): training
    reaches the float32 weights and eval under no_grad agrees with the eager module.  (aot_eager: dynamo and
    AOTAutograd trace fxamp's runtime, which is what is tested; the LSTM's graph breaks would make inductor
    compile a dozen small graphs, tens of seconds in a fresh environment, for nothing fxamp does.)"""
    torch.manual_seed(0)
    m = _Leaves()
    x = torch.randn(2, 8, 32)
    amp = fxamp.convert(m, "O1", dtype=torch.bfloat16)
    compiled = torch.compile(amp, backend="aot_eager")
    compiled(x).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())
    m.eval()
    with torch.no_grad():
        got, want = compiled(x), amp(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("how", ["plain fused AdamW", "MixedPrecisionOptimizer over fused AdamW"])
def test_the_weight_cache_sees_a_fused_optimizer_step(how):
    """Fused optimizers write the weights without bumping their version counters: a no_grad forward after
    a training step must not reuse the copies cast before it (it did: silently stale eval outputs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    inner = torch.optim.AdamW(amp.parameters(), lr=0.1, fused=True)
    opt = inner if how.startswith("plain") else fxamp.MixedPrecisionOptimizer(inner, model=amp)
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = amp(x)
    for _ in range(2):
        opt.zero_grad()
        loss = amp(x).float().sum()
        loss.backward() if opt is inner else opt.backward(loss)
        opt.step()
    with torch.no_grad():
        after = amp(x)
        expected = fxamp.convert(model, "O1", dtype=torch.bfloat16)(x)  # a fresh conversion of the stepped weights
    assert not torch.equal(after, before) and torch.equal(after, expected)
    if opt is not inner:  # the wrapper bumps what it stepped: a no_grad forward between backward and step
        opt.zero_grad()
        opt.backward(amp(x).float().sum())
        with torch.no_grad():
            amp(x)  # (metrics between backward and step) cached: the weights before the step
        opt.step()
        with torch.no_grad():
            assert torch.equal(amp(x), fxamp.convert(model, "O1", dtype=torch.bfloat16)(x))


def test_cast_of_a_return_types_and_a_dataclass_keeps_their_type():
    # issue 37 probe: x.max(dim=1)'s torch.return_types and a model's own output dataclass came back bfloat16
    # from a float32-output graph (cast left them as they were)
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Out:
        logits: torch.Tensor
        n: int

    low = torch.randn(3, 4).bfloat16()
    top = cast(low.max(dim=1), torch.float32)
    assert type(top).__name__ == "max" and top.values.dtype == torch.float32 and top.indices.dtype == torch.int64
    out = Out(low, 3)
    got = cast(out, torch.float32)
    assert type(got) is Out and got.logits.dtype == torch.float32 and got.n == 3 and out.logits.dtype == torch.bfloat16
    assert cast(Out(low.float(), 3), torch.float32).logits.dtype == torch.float32


def test_a_model_returning_max_values_gives_float32():
    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x).max(dim=1)

    out = fxamp.convert(Top(), "O1", dtype=torch.bfloat16)(torch.randn(3, 8))
    assert out.values.dtype == torch.float32 and out.indices.dtype == torch.int64
