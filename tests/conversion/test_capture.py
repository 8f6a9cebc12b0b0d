"""Capture fixes of issue 10: mode flags passed to wrapped functions, dtype-derived constants,
label checks inside forward, torch.nn transformers traced by torch.fx, which dims are dynamic,
and a quiet stderr when export fails."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Losses that check label values inside forward (item 7)
# ---------------------------------------------------------------------------------------------


class CheckedLM(nn.Module):
    def __init__(self, vocab=10):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, vocab)

    def forward(self, ids, labels=None):
        logits = self.out(self.emb(ids))
        if labels is None:
            return logits
        if labels.max() >= self.vocab:
            raise ValueError("labels out of range")
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_label_check_in_forward_says_compute_the_loss_outside():
    ids = torch.randint(0, 10, (2, 5))
    with pytest.raises(fxamp.TraceError) as info:
        fxamp.convert(CheckedLM(), "O1", example_inputs=(ids,), example_kwargs={"labels": ids})
    text = str(info.value)
    assert "What to do: that line checks the values of labels=" in text or "example_kwargs include labels=" in text
    assert "Convert without labels= in example_kwargs" in text and "in float32" in text
    # the fix it names works
    amp = fxamp.convert(CheckedLM(), "O1", example_inputs=(ids,))
    loss = F.cross_entropy(amp(ids).float().flatten(0, 1), ids.flatten())
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------
# A failed export stays off stderr
# ---------------------------------------------------------------------------------------------


def test_failed_export_keeps_stderr_quiet(capfd):
    capfd.readouterr()
    with pytest.raises(fxamp.TraceError, match="could not capture Linear"):
        fxamp.convert(nn.Linear(8, 8), "O1", frontend="export", example_inputs=(torch.randn(2, 5),))
    ids = torch.randint(0, 10, (2, 5))
    with pytest.raises(fxamp.TraceError):
        fxamp.convert(CheckedLM(), "O1", frontend="export", example_inputs=(ids,), example_kwargs={"labels": ids})
    out, err = capfd.readouterr()
    assert err == "" and out == ""


# ---------------------------------------------------------------------------------------------
# Mode flags passed to wrapped functions (item 1)
# ---------------------------------------------------------------------------------------------


def drop_path(x, p: float, training: bool):
    if not training or p == 0.0:
        return x
    return x * torch.empty(x.shape[0], 1).bernoulli_(1 - p) / (1 - p)


def scaled_drop(x, p: float):
    if p == 0.0:
        return x
    return x * torch.empty(x.shape[0], 1).bernoulli_(1 - p) / (1 - p)


torch.fx.wrap("drop_path")
torch.fx.wrap("scaled_drop")


class DropPathBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + drop_path(self.fc(x), 0.5, self.training)


class InnerDrop(nn.Module):
    def forward(self, x):
        return scaled_drop(x, 0.5 if self.training else 0.0)  # a float, not a bool, follows the mode


class ScaledDropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = InnerDrop()

    def forward(self, x):
        return x + self.drop(self.fc(x))


def _drops(amp, x):
    return not torch.equal(amp(x), amp(x))


@pytest.mark.parametrize("start", ["eval", "train"])
def test_mode_flag_passed_to_a_wrapped_function_follows_train_eval(start):
    torch.manual_seed(0)
    model = DropPathBlock().train(start == "train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # provably right in both modes: nothing to warn about
        amp = fxamp.convert(model, "O0")
    assert "drop_path(linear, 0.5, True)" not in amp.code
    assert any("mode argument x1" in n for n in fxamp.conversion_info(amp).notes)
    x = torch.randn(8, 16)
    amp.eval(), model.eval()
    assert torch.equal(amp(x), model(x))
    amp.train()
    assert _drops(amp, x)
    torch.manual_seed(1)
    want = model.train()(x)
    torch.manual_seed(1)
    assert torch.equal(amp(x), want)


def test_a_float_that_follows_the_mode_is_selected_by_the_owners_flag():
    model = ScaledDropBlock().eval()
    amp = fxamp.convert(model, "O0")
    x = torch.randn(8, 16)
    assert torch.equal(amp.eval()(x), model(x))
    assert _drops(amp.train(), x)
    amp.drop.eval()  # the owner is the module that read self.training
    assert torch.equal(amp(x), model(x))


def test_export_mode_dependent_graph_holds_a_graph_per_mode():
    model = DropPathBlock().eval()
    x = torch.randn(8, 16)
    amp = fxamp.convert(model, "O0", frontend="export", example_inputs=(x,))
    assert any("different graphs" in n for n in fxamp.conversion_info(amp).notes)
    assert torch.equal(amp.eval()(x), model(x))
    assert _drops(amp.train(), x)  # the training graph, captured at this first call in training mode


# ---------------------------------------------------------------------------------------------
# Fill values derived from float32 (item 5)
# ---------------------------------------------------------------------------------------------


class FinfoAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        s = self.q(x) @ x.transpose(-1, -2)
        return s.masked_fill(~mask, torch.finfo(s.dtype).min).softmax(-1)


class LiteralAttn(nn.Module):
    """-1e9 written literally (fx traces it): overflows float16, not bfloat16."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        s = self.q(x) @ x.transpose(-1, -2)
        s = torch.where(mask, s, -1e9)
        return s.masked_fill(~mask, -1e9).clamp(min=-1e9).softmax(-1)


class TensorFillAttn(nn.Module):
    """The mask value as a tensor made in forward (GPT-Neo's, ImageGPT's): torch.export lifts it into a float32
    constant, which the bfloat16 or float16 ``where`` would turn into -inf (a fully masked row: NaN)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        s = self.q(x) @ x.transpose(-1, -2)
        return torch.where(mask, s, torch.tensor(torch.finfo(s.dtype).min)).softmax(-1)


class TensorLiteralAttn(nn.Module):
    """``torch.tensor(-1e9)`` written literally: torch.fx makes it a constant (float16 would round it to -inf)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        s = self.q(x) @ x.transpose(-1, -2)
        return torch.where(mask, s, torch.tensor(-1e9)).softmax(-1)


def _mask_inputs():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 8), torch.rand(2, 4, 4) > 0.5
    mask[0, 0] = False  # a fully masked row: uniform in float32, must stay so
    return x, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
@pytest.mark.parametrize("model_cls", [FinfoAttn, LiteralAttn, TensorFillAttn, TensorLiteralAttn])
def test_fill_values_fit_the_low_precision_dtype(model_cls, policy, dtype):
    x, mask = _mask_inputs()
    model = model_cls()
    amp = fxamp.convert(model, policy, dtype=dtype, example_inputs=(x, mask))
    want = model(x, mask)
    got = amp(x, mask)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    assert any("fill value(s) beyond float16's range" in n for n in fxamp.conversion_info(amp).notes)
    expected_frontend = "fx" if "Literal" in model_cls.__name__ else "export"  # fx cannot call finfo on a proxy dtype
    assert fxamp.conversion_info(amp).frontend == expected_frontend
    o0 = fxamp.convert(model, "O0", example_inputs=(x, mask))
    assert torch.equal(o0(x, mask), want)  # float32: the value is unchanged
    rows = [r for r in fxamp.report(model, policy, example_inputs=(x, mask), dtype=dtype).rows
            if r.op.endswith("fit_scalar")]
    assert rows and all(r.category == "neutral" and r.reason.startswith("fill value fitted by fxamp") for r in rows)


@pytest.mark.parametrize("path", ["in place, per block", "lazy"])
def test_a_tensor_fill_value_fits_in_blocks_and_lazily(path):
    """The block and lazy paths capture the same way (a block's constants then become its graph's inputs): a
    fully masked row stays finite, as in float32 (it was NaN: -inf in every row of the second block)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([TensorFillAttn(), TensorFillAttn()])

        def forward(self, x, mask):
            for block in self.blocks:
                x = x + block(x, mask) @ x
            return x

    x, mask = _mask_inputs()
    model = Net()
    want = model(x, mask)
    for policy in ("O1", "O2", "O3"):
        for dtype in (torch.bfloat16, torch.float16):
            if path == "lazy":
                amp = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype)
            else:
                amp = fxamp.convert_(copy.deepcopy(model), policy, dtype=dtype, blocks=["blocks.*"])
            got = amp(x, mask)
            assert torch.isfinite(got).all(), (policy, dtype)
            torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_o2_keeps_a_constant_float32_that_only_float32_ops_read():
    """A tensor made in forward (``torch.tensor(0.1234567)``) reaches its float32 consumer through export's
    ``lift_fresh_copy`` and ``detach_``: O2 stores it as that consumer needs (float32), as autocast computes it."""

    class Stat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).float().pow(2).mean() * torch.tensor(0.1234567)

    torch.manual_seed(0)
    model, x = Stat(), torch.randn(4, 8)
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x,), frontend="export")
    (name, constant), = [(n, b) for n, b in amp.named_buffers() if n.startswith("_fxamp_constant")]
    assert constant.dtype == torch.float32 and constant.item() == torch.tensor(0.1234567).item(), name
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    with torch.no_grad():
        assert torch.equal(amp(x), want)


# ---------------------------------------------------------------------------------------------
# Which dims are dynamic (item 9)
# ---------------------------------------------------------------------------------------------


class TinyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids, feats):
        return self.fc(self.emb(ids)) + feats


def _shape_note(amp):
    return next(n for n in fxamp.conversion_info(amp).notes if "input sizes" in n)


def test_dynamic_batch_keeps_batch_and_sequence_and_static_image_sizes():
    x = torch.randn(2, 3, 8, 8)
    amp = fxamp.convert(TinyConvNet(), "O1", frontend="export", example_inputs=(x,))
    assert _shape_note(amp).endswith("x (*, 3, 8, 8)")
    assert amp(torch.randn(3, 3, 8, 8)).shape == (3, 4)
    with pytest.raises(RuntimeError, match=r"input 'x' has size 6 in dim 2, which the capture kept static.*"
                                           r"convert with dynamic='all'"):
        amp(torch.randn(3, 3, 6, 8))
    amp = fxamp.convert(TinyConvNet(), "O1", frontend="export", example_inputs=(x,), dynamic="all")
    assert _shape_note(amp).startswith("every dim dynamic") and "x (*, 3, *, *)" in _shape_note(amp)
    assert amp(torch.randn(3, 3, 6, 10)).shape == (3, 4)
    ids, feats = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 8)
    amp = fxamp.convert(TokenNet(), "O1", frontend="export", example_inputs=(ids, feats))
    assert "ids (*, *), feats (*, *, 8)" in _shape_note(amp)
    assert amp(torch.randint(0, 10, (3, 7)), torch.randn(3, 7, 8)).shape == (3, 7, 8)
    dim = torch.export.Dim.AUTO
    amp = fxamp.convert(TokenNet(), "O1", frontend="export", example_inputs=(ids, feats),
                        dynamic_shapes={"ids": {0: dim}, "feats": {0: dim}})
    assert "ids (*, 5), feats (*, 5, 8)" in _shape_note(amp)
    with pytest.raises(ValueError, match="dynamic='some' is not one of 'batch', 'all', 'none'"):
        fxamp.convert(TinyConvNet(), "O1", frontend="export", example_inputs=(x,), dynamic="some")
    with pytest.raises(TypeError, match="dynamic=True is no longer accepted: write dynamic='batch'"):
        fxamp.convert(TinyConvNet(), "O1", frontend="export", example_inputs=(x,), dynamic=True)


def test_swin_converts_in_seconds():
    transformers = pytest.importorskip("transformers")
    import time

    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                  window_size=2, drop_path_rate=0.0)
    model = transformers.SwinModel(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    start = time.perf_counter()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    assert time.perf_counter() - start < 15  # minutes with dynamic image sizes
    assert "pixel_values (*, 3, 32, 32)" in _shape_note(amp)
    y = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(amp(y).last_hidden_state.float(), model(y).last_hidden_state, atol=0.1, rtol=0.1)


# ---------------------------------------------------------------------------------------------
# torch.nn transformers traced by torch.fx (item 8)
# ---------------------------------------------------------------------------------------------


def _encoder(dropout=0.0, **kw):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True, **kw)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_transformer_encoder_runs_its_math_in_low_precision_without_example_inputs():
    from dtype_observer import OpDtypes

    model = _encoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float32 leaf to warn about, modes agree
        amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    assert fxamp.conversion_info(amp).frontend == "fx"
    x = torch.randn(2, 5, 32)
    with OpDtypes() as rec:
        amp(x)
    matmuls = rec.of("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                     "scaled_dot_product_attention")
    assert len(matmuls) >= 10 and all(c.inputs and set(c.inputs) == {torch.bfloat16} for c in matmuls)
    assert {c.inputs[0] for c in rec.of("native_layer_norm")} == {torch.float32}
    torch.testing.assert_close(amp(x).float(), model(x), atol=5e-2, rtol=5e-2)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    again = pickle.loads(pickle.dumps(amp))  # FX re-traces the generated code: the mask helpers stay calls
    assert torch.equal(again(x, mask=mask), amp(x, mask=mask))


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_transformers_o0_match_the_original_bitwise(norm_first):
    torch.manual_seed(0)
    model = nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    amp = fxamp.convert(model, "O0")
    src, tgt = torch.randn(2, 5, 32), torch.randn(2, 4, 32)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    for mode in (True, False):
        model.train(mode), amp.train(mode)
        assert torch.equal(amp(src, tgt), model(src, tgt))
        kw = dict(src_key_padding_mask=padding, tgt_mask=causal, tgt_is_causal=True)
        assert torch.equal(amp(src, tgt, **kw), model(src, tgt, **kw))
    encoder = _encoder()
    amp = fxamp.convert(encoder, "O0").eval()
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.equal(amp(src, mask=mask), encoder.eval()(src, mask=mask))


def test_encoder_layer_dropout_follows_train_eval():
    model = _encoder(dropout=0.1).layers[0]
    amp = fxamp.convert(model, "O0")
    x = torch.randn(2, 5, 32)
    torch.manual_seed(3)
    got = amp(x)
    torch.manual_seed(3)
    assert torch.equal(got, model(x))  # the same dropout draws
    assert torch.equal(amp.eval()(x), model.eval()(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class MostlyOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.block = Block()

    def forward(self, x):
        return self.block(self.inp(x))


def test_an_opaque_leaf_holding_most_parameters_warns():
    with pytest.warns(UserWarning, match=r"leaf module 'block' \(Block\) runs whole in float32 and holds 80%"):
        amp = fxamp.convert(MostlyOpaque(), "O1", leaf_modules=[Block])
    assert any("holds 80% of the parameters" in n for n in fxamp.conversion_info(amp).notes)
    with pytest.warns(UserWarning, match=r"leaf module 'encoder' \(TransformerEncoder\)"):
        fxamp.convert(_wrapped_encoder(), "O1", leaf_modules=[nn.TransformerEncoder])


def _wrapped_encoder():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = _encoder()

        def forward(self, x):
            return self.encoder(x)

    return Wrapped()


def test_finfo_of_a_traced_dtype_says_to_give_example_inputs():
    with pytest.raises(fxamp.TraceError, match=r"torch.finfo\(x.dtype\) needs a real dtype.*with example_inputs"):
        fxamp.convert(FinfoAttn(), "O1", dtype=torch.bfloat16, frontend="fx")


def test_finfo_of_a_traced_dtype_captures_at_the_first_call_without_inputs():
    torch.manual_seed(0)
    model = FinfoAttn()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16)
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    x, mask = _mask_inputs()
    torch.testing.assert_close(amp(x, mask), model(x, mask), atol=2e-2, rtol=0)


def _nested_encoder(norm: bool = False, nested: bool = True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32) if norm else None, enable_nested_tensor=nested)


def _padding(left_aligned: bool = True, float_mask: bool = False):
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, -2:] = True
    pad[2, -4:] = True
    if not left_aligned:
        pad[0, 0] = True  # a padded token first: not left-aligned, so torch's mask check refuses the fast path
    if float_mask:
        return torch.zeros(pad.shape).masked_fill(pad, float("-inf")), pad
    return pad, pad


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ["nested", "nested, final norm", "nested, float mask", "grad enabled", "training",
                                  "not left-aligned", "attention mask too", "nested tensors off"])
def test_transformer_encoder_padded_outputs_are_the_originals(case):
    """In eval with no autograd graph, nn.TransformerEncoder computes the real tokens of a padded batch
    on nested tensors and returns zeros (or the final norm of zeros) at the padded positions; the
    converted module does too, exactly there, and only when torch would (every other case computes
    values there, as the original does)."""
    model = _nested_encoder(norm="norm" in case, nested=case != "nested tensors off")
    x = torch.randn(3, 6, 32)
    mask, pad = _padding(left_aligned=case != "not left-aligned", float_mask="float" in case)
    kw = dict(src_key_padding_mask=mask)
    if case == "attention mask too":
        kw["mask"] = torch.zeros(6, 6, dtype=torch.bool)
    nested = case.startswith("nested,") or case == "nested"
    results = {}
    for policy in ("O0", "O1"):
        amp = fxamp.convert(model, policy, dtype=torch.bfloat16)
        model.train(case == "training"), amp.train(case == "training")
        with torch.set_grad_enabled(case == "grad enabled"):
            want, got = model(x, **kw), amp(x, **kw)
        results[policy] = got
        if nested:
            assert torch.equal(got[pad], want[pad])  # zeros, or the final norm's bias
        else:
            assert got[pad].abs().max() > 0.1  # computed values, as the original's
    torch.testing.assert_close(results["O0"], want, atol=1e-5, rtol=1e-5)  # the reference path, to rounding
    torch.testing.assert_close(results["O1"][~pad], want[~pad], atol=5e-2, rtol=5e-2)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_encoder_padding_survives_pickling():
    model = _nested_encoder().eval()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16).eval()
    x = torch.randn(3, 6, 32)
    mask, pad = _padding()
    again = pickle.loads(pickle.dumps(amp))  # FX re-traces the generated code: the run-time check stays a call
    with torch.no_grad():
        out = again(x, src_key_padding_mask=mask)
        assert torch.equal(out, amp(x, src_key_padding_mask=mask))
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))


# -- modules a forward makes as it runs -------------------------------------------------------------------------

#: like transformers' ACT2FN: each lookup makes a new module (Mamba's ``ACT2FN[activation](out)``)
_ACTIVATIONS = {"silu": nn.SiLU, "gelu": nn.GELU}


class MadeAtCallTime(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = nn.Sequential(self.fc1, _ACTIVATIONS["silu"]())(x)  # a container of its own layers, made here
        return x + self.fc2(h) + _ACTIVATIONS["gelu"]()(x)


class MadeWithWeights(nn.Module):
    def forward(self, x):
        return nn.Linear(16, 4)(x)  # new weights at every call


def test_a_module_made_as_forward_runs_is_traced_through_by_torch_fx_and_in_place():
    """torch.fx names every module called by its place under the root; one made at call time has none
    (``NameError: module is not installed as a submodule``): holding no tensor of its own, it is its ops."""
    torch.manual_seed(0)
    model = MadeAtCallTime()
    x = torch.randn(4, 16)
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="fx")
    ops = {str(n.target) for n in amp.graph.nodes if n.op == "call_function"}
    assert any("silu" in op for op in ops) and any("gelu" in op for op in ops), ops
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = model(x)
    assert torch.equal(amp(x), auto.float())  # the same ops in the same dtypes as autocast's
    stack = nn.Sequential(MadeAtCallTime(), MadeAtCallTime())
    ref = copy.deepcopy(stack)
    fxamp.convert_(stack, "O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # captured: no block runs as written
        out = stack(x)
    assert (out - ref(x)).norm() / ref(x).norm() < 0.02


def test_a_module_with_weights_made_as_forward_runs_is_refused_in_one_line():
    with pytest.raises(fxamp.TraceError, match=r"makes a Linear as it runs, with tensors of its own \(weight, bias\)"):
        fxamp.convert(MadeWithWeights(), "O1", dtype=torch.bfloat16, frontend="fx")


# ---------------------------------------------------------------------------------------------
# Each node's stack trace, as torch.fx records it
# ---------------------------------------------------------------------------------------------


class _Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = x * 2
        return _helper_function(self.fc(y))


def _helper_function(h):
    return F.gelu(h) + h.sum(-1, keepdim=True)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Helper()
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(self.inner(x)).softmax(-1)


def _frames(trace: str):
    """Frames of a stack trace outside torch.fx's tracer and fxamp's (where each records it, one call apart)."""
    import re

    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\n]*)\n([^\n]*)', trace)
    return [f for f in frames if "/torch/fx/" not in f[0] and "/fxamp/" not in f[0]]


def test_the_stack_traces_fxamp_records_are_torch_fxs():
    """fxamp records each node's stack trace from the live frames (torch.fx's recording symbolized and formatted the
    whole stack at every node: half of an in-place capture's time); the regions, the checkpoint calls and the
    messages read these traces, so they must hold what torch.fx's hold: the same frames and lines."""
    from fxamp.conversion.capture.fx import FxTracer

    ours = FxTracer()
    ours.stack_traces = True
    theirs = FxTracer()
    theirs.record_stack_traces = True
    graphs = [tracer.trace(_Outer()) for tracer in (ours, theirs)]
    pairs = list(zip(graphs[0].nodes, graphs[1].nodes))
    assert len(pairs) > 8 and all(a.name == b.name for a, b in pairs)
    for a, b in pairs:
        assert _frames(a.stack_trace or "") == _frames(b.stack_trace or ""), a.name
    names = [f[2] for a, _ in pairs for f in _frames(a.stack_trace or "")]
    assert "_helper_function" in names and any(f[3].strip() == "y = x * 2" for a, _ in pairs
                                                for f in _frames(a.stack_trace or ""))
