"""``conversion/capture/modes.py``: capture in both modes, and make the baked ``training`` flags switchable."""

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
