"""Which input dims a torch.export capture keeps dynamic: decided by what the model does with them.

A ``(batch, samples)`` waveform keeps its length dynamic; a dim the model fixes (a Python loop over
the positions, a size of 1 in the example) is named static in the shape note and refused with that
reason at a call; a lazily capturing module captures again for a new size of a dim kept static.
"""

import pytest
import torch
import torch.nn as nn

import fxamp
from dtype_observer import OpDtypes
from fxamp.conversion.lazy import range_fallback


class ConvAudio(nn.Module):
    """Raw audio ``(batch, samples)``: a strided Conv1d over ``(batch, 1, samples)``, pooled."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, stride=2)
        self.fc = nn.Linear(8, 4)

    def forward(self, wave):
        return self.fc(torch.relu(self.conv(wave.unsqueeze(1))).mean(-1))


class LoopOverPositions(nn.Module):
    """A recurrence written as a Python loop: torch.export unrolls it, fixing the sequence length."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.fc(x[:, t]) + h)
        return h


class TinyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


def _shape_note(amp):
    return next(n for n in fxamp.conversion_info(amp).notes if "input sizes" in n)


def _close(got, want):
    assert got.dtype == torch.float32  # O1 returns the output in float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_waveform_length_stays_dynamic_and_a_second_clip_length_runs():
    torch.manual_seed(0)
    model = ConvAudio()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export",
                        example_inputs=(torch.randn(2, 64),))
    note = _shape_note(amp)
    assert "wave (*, *)" in note and "static" not in note.split("input sizes")[1]
    for shape in [(2, 64), (3, 40), (1, 57)]:  # (a batch of 1 runs a second graph: test_size_one_...)
        wave = torch.randn(*shape)
        with OpDtypes() as rec:
            got = amp(wave)
        _close(got, model(wave))
        convs = rec.of("convolution")
        # the conv ran in bf16 (the last one: a batch of 1 captures first, which traces in float32)
        assert convs and set(convs[-1].inputs) == {torch.bfloat16}


def test_loop_over_positions_is_named_static_and_another_length_is_refused_with_the_reason():
    torch.manual_seed(0)
    model = LoopOverPositions()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export",
                        example_inputs=(torch.randn(2, 5, 8),))
    note = _shape_note(amp)
    assert "x (*, 5, 8)" in note
    assert "dim 1 of x is static: the model specialised it (its code depends on the size being 5: a Python " \
           "loop or range over it" in note
    x = torch.randn(3, 5, 8)  # the batch stayed dynamic
    _close(amp(x), model(x))
    with pytest.raises(RuntimeError, match=r"input 'x' has size 6 in dim 1, which the capture asked dynamic but the "
                                           r"model fixed at 5 \(.*\)\. What to do: call with size 5.*frontend='export' "
                                           r"and no example inputs"):
        amp(torch.randn(2, 6, 8))


def test_a_size_of_one_in_the_example_is_named_static_with_that_reason():
    model = ConvAudio()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(1, 64),))
    assert "dim 0 of wave is static: the model specialised it (the example has size 1 there, and torch.export " \
           "specialises sizes 0 and 1: capture with a size of at least 2)" in _shape_note(amp)
    with pytest.raises(RuntimeError, match="input 'wave' has size 2 in dim 0, which the capture asked dynamic"):
        amp(torch.randn(2, 64))


def test_lazy_module_captures_again_for_a_new_length_the_model_fixed():
    torch.manual_seed(0)
    model = LoopOverPositions()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export")
    for shape in [(2, 5, 8), (3, 5, 8), (2, 6, 8), (4, 5, 8)]:
        x = torch.randn(*shape)
        _close(amp(x), model(x))
    signatures = fxamp.conversion_info(amp).signatures
    assert len(amp.graph_modules()) == 2 and len(signatures) == 2  # lengths 5 and 6; batch sizes shared
    assert signatures == ("(x=fp32[*,5,8])", "(x=fp32[*,6,8])")  # * only for the dims left dynamic


def test_lazy_module_captures_again_for_a_new_image_size():
    torch.manual_seed(0)
    model = TinyConvNet()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export")
    for shape in [(2, 3, 8, 8), (3, 3, 8, 8), (2, 3, 6, 10)]:
        x = torch.randn(*shape)
        _close(amp(x), model(x))
    assert len(amp.graph_modules()) == 2
    assert fxamp.conversion_info(amp).signatures == ("(x=fp32[*,3,8,8])", "(x=fp32[*,3,6,10])")


def test_lazy_module_keeps_one_capture_for_waveforms_of_any_length():
    torch.manual_seed(0)
    model = ConvAudio()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export")
    for shape in [(2, 64), (3, 40), (2, 33)]:
        wave = torch.randn(*shape)
        _close(amp(wave), model(wave))
    assert len(amp.graph_modules()) == 1


class SizeOneBranch(nn.Module):
    """Python control flow on a size that can be 1: ``x.shape[0] == 1`` is False for every size export keeps
    dynamic (``Dim.AUTO`` starts at 2), so the capture records the other branch and no guard."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h * 100.0 if x.shape[0] == 1 else h


def _second_graph_notes(amp):
    return [n for n in fxamp.conversion_info(amp).notes if n.startswith("captured a second graph")]


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_size_one_on_a_dim_captured_from_two_captures_again_and_runs_the_branch_of_size_one(policy):
    """Issue 37: a batch of 1 passed torch's own check and ran the graph of ``x.shape[0] >= 2`` (100x off); then
    it was refused, so the last partial batch of an epoch failed.  It now runs a graph captured for it, on the
    same parameters (O2's bfloat16 ones included), with one note."""
    torch.manual_seed(0)
    model = SizeOneBranch()
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(3, 4),))
    keys = list(amp.state_dict())
    with torch.no_grad():
        for n in (1, 0, 5, 1, 2):
            x = torch.randn(n, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = model(x).float()  # the original's branch for this size, at autocast's precision
            got = amp(x).float()
            torch.testing.assert_close(got, want, atol=0.02 * max([1.0, *want.abs().flatten().tolist()]), rtol=0.02)
            if n == 1:
                assert got.abs().max() > 20  # the size-1 branch (x100), not the other's
    notes = _second_graph_notes(amp)
    assert len(notes) == 2 and "x=fp32[1,4]" in notes[0] and "x=fp32[0,4]" in notes[1]  # once per graph
    assert "torch.export captured that dim for sizes >= 2" in notes[0]
    lazy = range_fallback(amp)
    assert len(lazy.graph_modules()) == 2  # sizes 1 and 0; sizes 5 and 2 ran the first graph
    assert [id(t) for t in lazy.parameters()] == [id(t) for t in amp.parameters()]  # one set of parameters
    assert amp.fc.weight.dtype == (torch.bfloat16 if policy == "O2" else torch.float32)
    assert list(amp.state_dict()) == keys


def test_a_batch_of_one_trains_the_same_parameters_at_o2():
    torch.manual_seed(0)
    model = SizeOneBranch()
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(3, 4),))
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp)
    before = amp.fc.weight.detach().clone()
    for n in (3, 1):
        opt.zero_grad()
        opt.backward(amp(torch.randn(n, 4)).float().pow(2).mean())
        assert amp.fc.weight.grad is not None
        opt.step()
    assert not torch.equal(amp.fc.weight.detach(), before)
    assert amp.fc.weight.dtype == torch.bfloat16


def test_a_copy_keeps_the_second_graphs_fallback_on_its_own_parameters():
    import copy

    torch.manual_seed(0)
    model = SizeOneBranch()
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(3, 4),))
    twin = copy.deepcopy(amp)
    assert [id(t) for t in range_fallback(twin).parameters()] == [id(t) for t in twin.parameters()]
    x = torch.randn(1, 4)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), amp(x), atol=0, rtol=0)


def test_size_one_outside_the_users_dynamic_shapes_is_refused_naming_them():
    from torch.export import Dim

    torch.manual_seed(0)
    model = SizeOneBranch()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(3, 4),),
                        dynamic_shapes={"x": {0: Dim.AUTO}})
    for n in (1, 0):
        with pytest.raises(RuntimeError, match=rf"^input 'x' has size {n} in dim 0, but your dynamic_shapes= declared "
                                               rf"that dim for sizes >= 2 .* What to do: call with sizes of at least "
                                               rf"2 in dim 0, or convert without dynamic_shapes="):
            amp(torch.randn(n, 4))
    x = torch.randn(5, 4)
    with torch.no_grad():
        _close(amp(x), model(x))  # a size in the range runs


def test_a_lazy_module_captures_again_for_sizes_zero_and_one():
    torch.manual_seed(0)
    model = SizeOneBranch()
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export")
    with torch.no_grad():
        for n in (3, 1, 4, 0, 1):
            x = torch.randn(n, 4)
            torch.testing.assert_close(amp(x), model(x), atol=0.5, rtol=0.05)  # (100x off on the wrong branch)
    assert len(amp.graph_modules()) == 3  # sizes >= 2, 1 and 0


def test_the_size_check_costs_nothing_measurable():
    """The binding hook checks each dynamic dim's lower bound at every call: a few integer compares."""
    import time

    from fxamp.conversion.capture.shapes import check_range

    x = torch.randn(8, 4)
    ranges = {0: (2, None), 1: (2, None)}
    start = time.perf_counter()
    for _ in range(10000):
        check_range("x", x, ranges, "batch")
    per_call = (time.perf_counter() - start) / 10000
    assert per_call < 25e-6  # (measured 1.6 us per input on a loaded 2-core machine; a converted MLP's call: ~1 ms)


def test_the_checks_find_an_input_torch_fx_renamed():
    """``nn.Sequential``'s parameter ``input`` is the placeholder ``input_1``: the sizes are checked all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export", example_inputs=(torch.randn(3, 4),))
    x = torch.randn(1, 4)
    with torch.no_grad():
        _close(amp(x), model(x))
    assert "input 'input' has size 1 in dim 0, but torch.export captured" in _second_graph_notes(amp)[0]
    fixed = fxamp.convert(nn.Sequential(nn.Linear(4, 4)), "O1", dtype=torch.bfloat16, frontend="export",
                          example_inputs=(torch.randn(3, 4),), dynamic="none")
    with pytest.raises(RuntimeError, match=r"^input 'input' has size 5 in dim 0, which the capture kept static"):
        fixed(torch.randn(5, 4))
