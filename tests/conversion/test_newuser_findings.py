"""Unusual inputs a new user tried (issue 37, last criterion): each a crash or a poorly said error once."""
import copy
import re

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.reporting.numerics import sqnr

BF = torch.bfloat16


class _Tabular(nn.Module):
    """A tabular net whose first layer is a batch norm of the raw float32 features."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.norm(x))


class _Stem(nn.Module):
    """A conv stem with its batch norm outside the blocks (convert_'s glue), before a ModuleList of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1) for _ in range(2)])

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return x.mean((2, 3))


def _sqnr_vs_float32(model, amp, x):
    with torch.no_grad():
        return sqnr(model(x), amp(x))


def test_o3_batch_norm_of_a_float32_input_runs_low():
    # O3 stores the norm's weights in bfloat16; its float32 input once reached the kernel as it was:
    # "mixed dtype (CPU): expect parameter to have scalar type of Float"
    torch.manual_seed(0)
    model = _Tabular().eval()
    x = torch.randn(8, 6)
    amp = fxamp.convert(copy.deepcopy(model), "O3", dtype=BF).eval()
    assert amp.norm.weight.dtype == BF
    assert _sqnr_vs_float32(model, amp, x) > 25


def test_o3_convert_inplace_glue_batch_norm_runs():
    torch.manual_seed(0)
    model = _Stem().eval()
    x = torch.randn(2, 3, 6, 6)
    amp = fxamp.convert_(copy.deepcopy(model), "O3", dtype=BF).eval()
    assert amp.stem[1].weight.dtype == BF
    assert _sqnr_vs_float32(model, amp, x) > 20


def test_a_model_class_instead_of_a_model_is_refused_naming_the_call():
    with pytest.raises(TypeError, match=r"not the class _Tabular: pass _Tabular\(\.\.\.\)"):
        fxamp.convert(_Tabular, "O1")
    with pytest.raises(TypeError, match=r"not the class _Tabular"):
        fxamp.convert_(_Tabular, "O1")


def test_an_uninitialized_lazy_module_is_refused_in_one_line():
    # it used to fail deep in torch ("Attempted to use an uninitialized parameter in <method 'numel' ...")
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0.weight' is uninitialized .* run the model once"):
        fxamp.convert(model, "O2", dtype=BF)
    model(torch.randn(2, 5))  # initialized now: converts
    amp = fxamp.convert(model, "O2", dtype=BF)
    assert amp(torch.randn(2, 5)).shape == (2, 2)


class _ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.shape[0] > 2 else self.b(x)


def _second_graph_note(amp):
    (note,) = [n for n in fxamp.conversion_info(amp).notes if n.startswith("captured a second graph")]
    return note


def test_export_batch_range_guard_captures_the_other_side_of_the_branch():
    """Issue 37: a call outside the range was refused; it now captures a second graph for its side."""
    torch.manual_seed(0)
    model = _ShapeBranch()
    amp = fxamp.convert(model, "O1", dtype=BF, example_inputs=(torch.randn(4, 4),), frontend="export")
    with torch.no_grad():
        for n in (2, 3, 2):
            x = torch.randn(n, 4)
            assert sqnr(model(x), amp(x)) > 25  # self.b at 2, self.a at 3
    assert re.search(r"input 'x' has size 2 in dim 0, but this capture holds only for sizes >= 3 there: .*a Python "
                     r"branch on `x\.shape\[0\]`", _second_graph_note(amp))


def test_export_batch_range_guard_under_the_users_dynamic_shapes_says_what_to_do():
    from torch.export import Dim

    amp = fxamp.convert(_ShapeBranch(), "O1", dtype=BF, example_inputs=(torch.randn(4, 4),), frontend="export",
                        dynamic_shapes={"x": {0: Dim.AUTO}})
    with pytest.raises(RuntimeError, match=r"input 'x' has size 2 in dim 0, but this capture holds only for sizes "
                                           r">= 3 there: .*a Python branch on `x\.shape\[0\]`.*"
                                           r"or widen that dim's range in dynamic_shapes="):
        amp(torch.randn(2, 4))
    with torch.no_grad():  # inside the range it runs
        assert amp(torch.randn(3, 4)).shape == (3, 4)


class _LengthBranch(nn.Module):
    """Branches on dim 1 (the length) of a keyword input, which dynamic='batch' keeps dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *, y=None):
        h = self.fc(x)
        return h + y.sum(1) if y.shape[1] < 6 else h - y.mean(1)


def test_export_range_guard_on_a_keyword_input_names_it_and_its_dim():
    torch.manual_seed(0)
    model = _LengthBranch()
    amp = fxamp.convert(model, "O1", dtype=BF, example_inputs=(torch.randn(4, 4),),
                        example_kwargs={"y": torch.randn(4, 3, 4)}, frontend="export")
    with torch.no_grad():
        for n in (7, 5):
            x, y = torch.randn(2, 4), torch.randn(2, n, 4)
            assert sqnr(model(x, y=y), amp(x, y=y)) > 25
    assert "input 'y' has size 7 in dim 1, but this capture holds only for sizes 2 to 5 there" in _second_graph_note(amp)


def test_lazy_module_captures_again_for_a_keyword_input_outside_the_range():
    torch.manual_seed(0)
    model = _LengthBranch()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF, frontend="export")
    x = torch.randn(2, 4)
    for n in (3, 7, 5, 6):
        y = torch.randn(2, n, 4)
        with torch.no_grad():
            assert sqnr(model(x, y=y), amp(x, y=y)) > 25
    assert len(amp.graph_modules()) == 2


def _drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    mask = x.new_empty((x.shape[0], 1)).bernoulli_(1 - p)  # timm's stochastic depth
    return x * mask / (1 - p)


class _DropPathBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + _drop_path(self.fc(x), 0.5, self.training)


def test_mode_difference_note_names_the_users_line_not_torch_fx():
    # it named torch/fx/proxy.py's `user_stack_summary = CapturedTraceback.extract().summary()`
    amp = fxamp.convert(_DropPathBlock().eval(), "O1", dtype=BF)
    (note,) = [n for n in fxamp.conversion_info(amp.graph_module).notes if "capture different graphs" in n]
    assert re.search(r"test_newuser_findings\.py\", line \d+, in _drop_path: `mask = x\.new_empty", note)


def test_fx_drop_path_converted_in_training_is_off_in_eval():
    import warnings

    torch.manual_seed(0)
    model = _DropPathBlock().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF).eval()
    x = torch.randn(16, 4)
    with torch.no_grad():
        assert torch.equal(amp(x), amp(x))
        assert sqnr(model.eval()(x), amp(x)) > 25


def test_lazy_capture_again_for_a_batch_size_outside_the_branch_range():
    torch.manual_seed(0)
    model = _ShapeBranch().eval()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF, frontend="export")
    for n in (4, 2, 5, 1, 3, 2):  # each side of the branch captured once, then reused
        x = torch.randn(n, 4)
        with torch.no_grad():
            assert sqnr(model(x), amp(x)) > 25


class _Counts(nn.Module):
    """``self.count += 1`` on a registered buffer: torch.fx would run it once, while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.fc(x)


class _CountsInTraining(_Counts):
    def forward(self, x):
        if self.training:
            self.count += 1
        return self.fc(x)


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("path", ["auto", "export", "lazy"])
@pytest.mark.parametrize("cls", [_Counts, _CountsInTraining])
def test_a_buffer_counter_counts_as_the_originals_does(cls, path, policy):
    # torch.fx refuses the write; without inputs fxamp captures with torch.export at the first call
    x = torch.randn(2, 4)
    kwargs = {"auto": {}, "export": {"example_inputs": (x,)}, "lazy": {"frontend": "export"}}[path]
    model = cls().train()
    amp = fxamp.convert(copy.deepcopy(model), policy, dtype=BF, **kwargs)
    for mode, step in (("train", 1), ("eval", 1 if cls is _Counts else 0), ("train", 1)):
        getattr(amp, mode)()
        getattr(model, mode)()
        before = amp.count.item()
        with torch.no_grad():
            amp(x)
            model(x)
        assert amp.count.item() == before + step == model.count.item(), mode


@pytest.mark.parametrize("cls", [_Counts, _CountsInTraining])
def test_torch_fx_refuses_a_buffer_counter_naming_its_line(cls):
    model = cls().train()
    with pytest.raises(fxamp.TraceError, match=r"writes the buffer\(s\) count in place \(`self\.count \+= 1` at "
                                               r".*test_newuser_findings\.py:\d+ .*Capture it with torch\.export"):
        fxamp.convert(model, "O1", dtype=BF, frontend="fx")
    assert model.count.item() == 0  # the trace's write undone
