"""``conversion/capture/modes.py``: capture in both modes, and make the baked ``training`` flags switchable."""

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxamp.conversion.capture import capture
from fxamp.conversion.capture.modes import ModeFlag, capture_in_both_modes, make_modes_switchable, training_mode


class RootDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, self.training)


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x + 1


def test_training_mode_sets_and_restores_each_modules_own_flag():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train()
    model[1].eval()
    with training_mode(model, False):
        assert not any(m.training for m in model.modules())
    assert model.training and model[0].training and not model[1].training


def test_identical_modes_keep_the_training_capture():
    model = RootDropout().eval()
    seen = []

    def trace():
        seen.append(model.training)
        return fx.symbolic_trace(model)

    gm, mode, notes = capture_in_both_modes(model, trace)
    assert seen == [False, True] and mode is True and notes == []
    assert not model.training  # the model's own mode is back


def test_a_failing_other_mode_keeps_the_capture_that_worked():
    model = RootDropout().train()

    def trace():
        if not model.training:
            raise RuntimeError("no eval")
        return fx.symbolic_trace(model)

    with pytest.warns(UserWarning, match=r"captured in training mode only \(eval mode failed: RuntimeError\)"):
        gm, mode, notes = capture_in_both_modes(model, trace)
    assert mode is True and len(notes) == 1


def test_a_failing_other_mode_is_no_warning_where_the_caller_keeps_a_graph_per_mode(recwarn):
    # the caller captures that mode at its first use: "train()/eval() switch its dropout" would be untrue
    model = RootDropout().train()

    def trace():
        if not model.training:
            raise RuntimeError("no eval")
        return fx.symbolic_trace(model)

    gm, mode, notes = capture_in_both_modes(model, trace, graph_per_mode=True)
    assert mode is True and not [w for w in recwarn if "fxamp" in str(w.message)]
    assert notes == ["captured in training mode (eval mode failed: RuntimeError): a graph per mode, the eval "
                     "mode's is captured at its first call"]


class EvalOnlyDataBranch(nn.Module):
    """torch.fx traces it in training mode only: eval mode branches on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if not self.training and bool(x.sum() > 0):
            y = y * 2
        return y


def test_fx_convert_of_a_model_eval_mode_cannot_trace_refuses_the_eval_call_not_runs_the_training_graph(recwarn):
    import fxamp
    from fxamp.conversion.lazy import LazyConverted
    amp = fxamp.convert(EvalOnlyDataBranch().train(), "O1", dtype=torch.bfloat16, frontend="fx")
    assert isinstance(amp, LazyConverted)
    assert not [w for w in recwarn if "fxamp" in str(w.message)]  # (was: "train()/eval() switch its dropout")
    x = torch.ones(2, 4)
    amp(x)
    with pytest.raises(fxamp.TraceError, match=r"torch.fx could not trace EvalOnlyDataBranch .*x.sum\(\) > 0"):
        amp.eval()(x)  # the training graph would silently skip the eval branch's y * 2


def test_convert_in_place_of_a_torch_transformer_encoder_switches_modes_without_a_warning(recwarn):
    import fxamp
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ref = copy.deepcopy(model)
    amp = fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8)
    amp.train()(x)
    with torch.no_grad():
        out = amp.eval()(x)  # the eval graph torch.fx cannot take (the fast-path checks) is captured on its own
        want = ref.eval()(x)
    assert not [w for w in recwarn if "fxamp" in str(w.message)]  # (was: "captured in training mode only ...")
    assert out.dtype == torch.float32 and (out - want).norm() / want.norm() < 2e-2


def test_a_mode_dependent_branch_keeps_the_current_mode_and_says_so():
    with pytest.warns(UserWarning, match="training and eval mode capture different graphs"):
        captured = capture(Branchy().eval())
    assert captured.only_mode is False
    x = torch.ones(2)
    assert torch.equal(captured.graph_module(x), x + 1)
    assert any("follows eval mode" in n for n in captured.notes)


def test_root_level_dropout_reads_a_mode_flag_child():
    captured = capture(RootDropout())
    gm = captured.graph_module
    assert isinstance(gm.get_submodule("_fxamp_mode"), ModeFlag)
    (dropout,) = gm.graph.find_nodes(op="call_function", target=F.dropout)
    flag = dropout.args[2] if len(dropout.args) > 2 else dropout.kwargs["training"]
    assert (flag.target, flag.args[0].target, flag.args[1]) == (getattr, "_fxamp_mode", "training")
    assert any("dropout x1" in n for n in captured.notes)
    x = torch.randn(8, 4)
    gm.eval()
    assert torch.equal(gm(x), gm.fc(x))  # eval: dropout off
    gm.train()
    assert (gm(x) == 0).any()  # training: dropout on again


def test_make_modes_switchable_turns_a_baked_flag_into_the_owners_flag():
    model = nn.Sequential(nn.Linear(4, 4))
    graph = fx.Graph()
    x = graph.placeholder("x")
    drop = graph.call_function(F.dropout, (x, 0.5, True))
    graph.output(drop)
    gm = fx.GraphModule(model, graph)
    notes = make_modes_switchable(gm, True)
    assert notes == ["train()/eval() reach dropout x1: each reads its module's training flag at run time"]
    assert drop.args[2].target is getattr
    assert make_modes_switchable(gm, True) == []  # nothing baked is left
    gm.recompile()
    gm.eval()
    inp = torch.randn(3, 4)
    assert torch.equal(gm(inp), inp)


def test_export_batch_norm_becomes_the_original_module():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    captured = capture(model, frontend="export", example_inputs=(torch.randn(2, 3, 8, 8),))
    gm = captured.graph_module
    calls = [n.target for n in gm.graph.find_nodes(op="call_module")]
    assert calls == ["1"] and gm.get_submodule("1") is model[1]
    before = int(model[1].num_batches_tracked)
    gm.train()(torch.randn(2, 3, 8, 8))
    assert int(model[1].num_batches_tracked) == before + 1
    gm.eval()(torch.randn(2, 3, 8, 8))
    assert int(model[1].num_batches_tracked) == before + 1


class PicksDropout(nn.Module):
    """The Hugging Face attention pattern: the mode only picks a dropout probability."""

    def __init__(self, p):
        super().__init__()
        self.fc, self.attention_dropout = nn.Linear(8, 8), p

    def forward(self, x):
        p = 0.0 if not self.training else self.attention_dropout
        h = self.fc(x).unsqueeze(1)
        return F.scaled_dot_product_attention(h, h, h, dropout_p=p).squeeze(1)


@pytest.mark.parametrize("p, captures", [(0.0, 1), (0.1, 2)])
def test_a_read_that_picks_equal_values_in_both_modes_captures_once(p, captures, monkeypatch):
    from fxamp.conversion.capture.modes import mode_reader
    import fxamp

    model = PicksDropout(p)
    assert (mode_reader(model) is None) == (captures == 1)
    seen = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: seen.append(model.training) or real(*a, **k))
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(4, 8),), frontend="export")
    assert len(seen) == captures
    notes = fxamp.conversion_info(amp).notes
    assert any(n.startswith("captured once" if captures == 1 else "captured in training and in eval mode")
               for n in notes)
    amp.eval()
    x = torch.randn(4, 8)
    assert torch.equal(amp(x), amp(x))  # eval: no dropout either way
    torch.testing.assert_close(amp(x).float(), model.eval()(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("source", ["self.training and 0.1 or 0.0", "0.1 if self.training else 0.0"])
def test_a_read_that_can_differ_still_captures_both_modes(source):
    from fxamp.conversion.capture.modes import mode_reader

    namespace = {"F": F, "nn": nn}
    exec(f"class M(nn.Module):\n    def forward(self, x):\n        return F.dropout(x, {source})\n", namespace)
    assert mode_reader(namespace["M"]()) is not None  # (no source for exec'd code, or values that differ)


class GuardedRead(nn.Module):
    """``self.gradient_checkpointing and self.training``: only matters when checkpointing is on."""

    def __init__(self):
        super().__init__()
        self.fc, self.gradient_checkpointing = nn.Linear(8, 8), False

    def forward(self, x):
        if getattr(self, "gradient_checkpointing", False) and self.training:
            return self.fc(x) * 2
        return self.fc(x)


def test_a_read_guarded_by_a_falsy_flag_does_not_count_until_the_flag_is_on():
    from fxamp.conversion.capture.modes import mode_reader

    model = GuardedRead()
    assert mode_reader(model) is None
    model.gradient_checkpointing = True
    assert mode_reader(model) == "<root> (GuardedRead)"


# ---------------------------------------------------------------------------------------------
# A graph per mode with torch.fx (issue 37): timm's drop_path(x, p, self.training), no example inputs
# ---------------------------------------------------------------------------------------------


def _drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    mask = x.new_empty((x.shape[0], 1)).bernoulli_(1 - p)  # timm's stochastic depth
    return x * mask / (1 - p)


class DropPathNet(nn.Module):
    """A residual block with stochastic depth: a dropped row of the output is exactly its input."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return x + _drop_path(self.fc(self.norm(x)), 0.5, self.training)


def _per_mode(policy, mode, seed=0):
    import copy
    import warnings

    import fxamp

    torch.manual_seed(seed)
    model = getattr(DropPathNet(), mode)()
    with warnings.catch_warnings(record=True) as caught:  # (not "error": a capture would fail over to export)
        warnings.simplefilter("always")
        amp = fxamp.convert(copy.deepcopy(model), policy, dtype=torch.bfloat16)
    assert not [w for w in caught if "different graphs" in str(w.message)]  # it warned "the graph follows ..."
    assert fxamp.conversion_info(amp).frontend == "fx"
    return model, amp


def _dropped_rows(out, x):
    return (out == x).all(1)


def test_fx_converted_in_eval_then_train_gives_stochastic_depth():
    import fxamp

    model, amp = _per_mode("O1", "eval")
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    info = fxamp.conversion_info(amp)
    assert info.frontend == "fx" and "torch.fx captured the eval mode graph now" in info.notes[0]
    x = torch.randn(4096, 8)
    with torch.no_grad():
        assert not _dropped_rows(amp(x), x).any()  # eval: the block runs whole
        model.train()
        amp.train()
        torch.manual_seed(7)
        out = amp(x)
        torch.manual_seed(7)
        ref = model(x)
    drops = _dropped_rows(out, x)
    assert 0.45 < drops.float().mean() < 0.55  # the original's rate, p = 0.5
    assert torch.equal(drops, _dropped_rows(ref, x))  # the same seed draws the same masks
    kept = ~drops
    assert fxamp.reporting.numerics.sqnr(ref[kept], out[kept]) > 25  # kept rows scaled by 1 / (1 - p), as the original
    assert len(amp.graph_modules()) == 2
    assert [fxamp.conversion_info(gm).frontend for gm in amp.graph_modules()] == ["fx", "fx"]


def test_fx_per_mode_graphs_share_the_o2_storage():
    from fxamp.conversion.graph import attr_target

    model, amp = _per_mode("O2", "train")
    x = torch.randn(16, 8)
    amp(x)
    amp.eval()(x)
    train_gm, eval_gm = amp.graph_modules()
    assert amp.fc.weight.dtype == torch.bfloat16 and amp.norm.weight.dtype == torch.float32
    params = dict(amp.named_parameters())
    for gm in (train_gm, eval_gm):
        read = {attr_target(n) for n in gm.graph.nodes if attr_target(n) in params}
        assert read == {"fc.weight", "fc.bias"}  # inlined: read as graph values
        assert all(gm.get_parameter(name) is params[name] for name in read)  # one set of tensors
        (norm,) = gm.graph.find_nodes(op="call_module", target="norm")  # a leaf: its module is amp's own
        assert gm.get_submodule("norm") is amp.norm
    assert list(amp.state_dict()) == list(model.state_dict())


def test_fx_per_mode_training_step_then_eval_matches_float32():
    import fxamp

    model, amp = _per_mode("O2", "train")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.5), model=amp)
    before = amp.fc.weight.clone()
    x = torch.randn(64, 8)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(amp(x).square().mean())
        opt.step()
    assert not torch.equal(amp.fc.weight, before)
    model.load_state_dict(opt.fp32_state_dict(amp))  # the float32 model, trained as far
    model.eval()
    amp.eval()
    with torch.no_grad():
        out = amp(x)
        assert torch.equal(amp(x), out)  # stochastic depth off
        assert fxamp.reporting.numerics.sqnr(model(x), out) > 25


def test_fx_per_mode_state_dict_round_trip_copy_save_and_report():
    import copy
    import io

    import fxamp

    model, amp = _per_mode("O2", "train", seed=0)
    _, other = _per_mode("O2", "train", seed=1)
    other.load_state_dict(amp.state_dict())
    x = torch.randn(32, 8)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copies = [other, copy.deepcopy(amp), loaded]
    assert all(list(c.state_dict()) == list(model.state_dict()) for c in copies)
    for mode in ("train", "eval"):
        getattr(amp, mode)()
        torch.manual_seed(3)
        want = amp(x)
        for c in copies:
            getattr(c, mode)()
            torch.manual_seed(3)
            assert torch.equal(c(x), want), mode  # each copy captures its graphs with torch.fx again
    rows = fxamp.report(copy.deepcopy(amp)).rows  # a copy's graph: the current mode's, captured when read
    assert any(r.op == "torch.nn.functional.linear" and r.compute == "bfloat16" for r in rows)
    assert "frontend fx" in str(fxamp.report(model.train(), "O1", dtype=torch.bfloat16))


def test_fx_per_mode_under_torch_compile_follows_the_mode():
    """dynamo's guards see the mode's graph (aot_eager: what is tested is the guard and the retrace, not inductor's
    code; tests/conversion/test_convert.py compiles a converted module with inductor)."""
    model, amp = _per_mode("O1", "eval")
    compiled = torch.compile(amp, backend="aot_eager")
    x = torch.randn(256, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
        amp.train()
        assert _dropped_rows(compiled(x), x).any()  # recompiled for training mode: stochastic depth on


def test_convert_inplace_blocks_with_drop_path_hold_a_graph_per_mode_without_a_warning():
    import warnings

    import fxamp

    torch.manual_seed(0)
    model = nn.Sequential(DropPathNet(), DropPathNet()).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxamp.convert_(model, "O1", dtype=torch.bfloat16, blocks=["*"])
        x = torch.randn(256, 8)
        with torch.no_grad():
            assert _dropped_rows(model[0](x), x).any()  # training: stochastic depth
            model.eval()
            assert not _dropped_rows(model[0](x), x).any() and torch.equal(model(x), model(x))
    assert not [w for w in caught if "different graphs" in str(w.message)]  # "the graph follows training mode"
    assert str(fxamp.report(model)).count("fx graph for a call") == 2  # a graph per mode, each by torch.fx


def test_export_with_dynamic_shapes_holds_a_graph_per_mode_captured_with_those_shapes(recwarn):
    """Issue 37: ``convert(..., dynamic_shapes=...)`` kept the training graph for both modes, with a warning:
    eval ran stochastic depth.  Now the eval graph is captured at its first call, with the same shapes."""
    import fxamp
    from torch.export import Dim

    torch.manual_seed(0)
    model = DropPathNet()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=torch.bfloat16, frontend="export",
                        example_inputs=(torch.randn(4, 8),), dynamic_shapes={"x": {0: Dim("batch", min=1, max=512)}})
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    assert not [w for w in recwarn if "different graphs" in str(w.message)]
    x = torch.randn(256, 8)
    with torch.no_grad():
        torch.manual_seed(7)
        out = amp(x)  # training: the graph captured from the example inputs
        torch.manual_seed(7)
        ref = model(x)
        drops = _dropped_rows(out, x)
        assert 0.3 < drops.float().mean() < 0.7 and torch.equal(drops, _dropped_rows(ref, x))
        assert fxamp.reporting.numerics.sqnr(ref[~drops], out[~drops]) > 25
        model.eval()
        amp.eval()
        for n in (256, 1):  # (a batch of 1: in dynamic_shapes' range, which the eval capture keeps too)
            x = torch.randn(n, 8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = model(x).float()
            want = model(x)
            got = amp(x)
            assert not _dropped_rows(got, x).any()  # eval: the block runs whole
            assert (got - want).abs().max() <= 2 * (auto - want).abs().max() + 1e-6
    assert len(amp.graph_modules()) == 2
    assert all(str(gm.range_constraints).endswith("VR[1, 512]}") for gm in amp.graph_modules())
