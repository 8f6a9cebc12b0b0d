"""What the model meant beyond its ops: grad-mode and autocast regions, activation checkpointing,
root hooks, Python state in forward (fxamp/conversion/capture/regions.py).

Each is either kept with its meaning, on the fx and the export front end and through lazy capture,
or noted in one line naming the source line.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxamp
from fxamp.errors import TraceError
from dtype_observer import OpDtypes

pytestmark = pytest.mark.usefixtures("one_thread")

BF16, F32 = torch.bfloat16, torch.float32


class Frozen(nn.Module):
    """A low-precision value flows into a no_grad region: nothing under it may be trained."""

    def __init__(self):
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        with torch.no_grad():
            y = self.a(h)
        return self.b(h) + y


class Island(nn.Module):
    """A float32 island (autocast off) between low-precision layers."""

    def __init__(self):
        super().__init__()
        self.pre, self.a, self.post = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        with torch.autocast("cpu", enabled=False):
            y = self.a(h).exp()
        return self.post(y)


def _paths(model, x):
    """The model converted by each capture path: fx's fallback to export, export, lazy capture."""
    return {
        "auto with inputs": lambda pol: fxamp.convert(model, pol, dtype=BF16, example_inputs=(x,)),
        "export": lambda pol: fxamp.convert(model, pol, dtype=BF16, example_inputs=(x,), frontend="export"),
        "lazy": lambda pol: fxamp.convert(model, pol, dtype=BF16),
    }


def test_the_fx_front_end_refuses_a_no_grad_region_naming_the_line_and_the_fix():
    with pytest.raises(TraceError, match=r"torch.fx cannot keep a grad-mode region .*`with torch.no_grad\(\):` at "
                                         r".*test_regions.py:\d+ \(Frozen\)\. What to do: use frontend='auto'"):
        fxamp.convert(Frozen(), "O1", dtype=BF16, frontend="fx")


@pytest.mark.parametrize("path", ["auto with inputs", "export", "lazy"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_no_grad_region_trains_nothing_under_it(path, policy):
    torch.manual_seed(0)
    model, x = Frozen(), torch.randn(4, 8)
    amp = _paths(model, x)[path](policy)
    out = amp(x)
    out.float().sum().backward()
    assert amp.a.weight.grad is None and amp.a.bias.grad is None
    assert amp.b.weight.grad is not None and amp.pre.weight.grad is not None
    with torch.no_grad():
        ref = model(x)
    assert torch.allclose(out.float(), ref, rtol=0.05, atol=0.05)
    if path != "lazy":
        assert any("`with torch.no_grad():` at" in n and "kept (wrap_with_set_grad_enabled)" in n
                   for n in fxamp.conversion_info(amp).notes)


@pytest.mark.parametrize("path", ["auto with inputs", "export", "lazy"])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_an_autocast_disabled_island_runs_in_float32(path, policy):
    torch.manual_seed(0)
    model, x = Island(), torch.randn(4, 8)
    amp = _paths(model, x)[path](policy)
    amp(x)  # a lazy module captures here
    with OpDtypes() as rec:
        out = amp(x)
    assert [c.inputs for c in rec.of("addmm")] == [(BF16,) * 3, (F32,) * 3, (BF16,) * 3]
    assert [c.inputs for c in rec.of("exp")] == [(F32,)]
    if policy == "O2" and path != "lazy":  # the island's weights stay float32 (lazy capture predicts storage)
        assert amp.a.weight.dtype == F32 and amp.pre.weight.dtype == BF16
    assert torch.allclose(out.float(), model(x), rtol=0.05, atol=0.05)


def test_an_island_note_names_the_line_and_fx_refuses_the_island():
    x = torch.randn(4, 8)
    amp = fxamp.convert(Island(), "O1", dtype=BF16, example_inputs=(x,))
    notes = fxamp.conversion_info(amp).notes
    assert notes[0].startswith("torch.fx could not trace the model (`with torch.autocast(\"cpu\", enabled=False):` at ")
    assert any("a float32 island: runs with autocast off; its float inputs are cast to float32" in n for n in notes)
    with pytest.raises(TraceError, match=r"torch.fx cannot keep an autocast region \(a float32 island would run in "
                                         r"low precision\): `with torch.autocast\(\"cpu\", enabled=False\):` at "):
        fxamp.convert(Island(), "O1", dtype=BF16, frontend="fx")


def test_an_enabled_autocast_region_in_forward_is_noted():
    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.a(x).float()

    amp = fxamp.convert(Autocast(), "O1", example_inputs=(torch.randn(4, 8),))
    assert any("runs under torch.autocast as written: fxamp's casts stop at its boundary" in n
               for n in fxamp.conversion_info(amp).notes)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_hooks_on_the_root_still_run(frontend):
    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(4, 8)
    calls = []
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.register_forward_hook(lambda m, args, out: calls.append(1) or out + 100)
    ref = model(x)
    calls.clear()
    amp = fxamp.convert(model, "O0", example_inputs=(x,), frontend=frontend)
    assert calls == []  # no capture ran them (was: torch.export traced them in, ran them once, here)
    for _ in range(3):
        assert torch.equal(amp(x), ref)  # O0: bitwise, the hooks included
    assert calls == [1, 1, 1]  # the hooks are the user's, called at each call (tests/conversion/test_root_hooks.py)
    assert any("2 hook(s) registered on the root Hooked are registered on the converted module" in n
               for n in fxamp.conversion_info(amp).notes)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        print("forward")
        return self.a(x)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_python_state_and_print_in_forward_are_noted_with_their_line(frontend, capsys):
    with pytest.warns(UserWarning, match=r"fxamp: forward sets self.calls at `self.calls \+= 1` at "
                                         r".*test_regions.py:\d+ \(Counting\): it ran once, at capture"):
        amp = fxamp.convert(Counting(), "O1", example_inputs=(torch.randn(4, 8),), frontend=frontend)
    notes = fxamp.conversion_info(amp).notes
    assert any(n.startswith("forward calls print at `print(\"forward\")` at ") for n in notes)
    capsys.readouterr()
    amp(torch.randn(4, 8))
    assert capsys.readouterr().out == ""  # what the note says: print does not run converted


def test_a_module_without_such_constructs_gets_no_notes_or_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp = fxamp.convert(Hooked(), "O1", dtype=BF16)
    # the one note left says how the modes were captured (capture/modes.py), nothing of regions
    assert [n for n in fxamp.conversion_info(amp).notes if not n.startswith("captured once, in training mode")] == []


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x):
        return checkpoint(self.b, self.a(x), use_reentrant=False)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_activation_checkpointing_is_kept_and_noted_with_its_line(frontend):
    """Kept, not traced through (tests/conversion/test_checkpointing.py measures what it saves)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxamp: activation checkpointing")  # not traced through
        amp = fxamp.convert(Checkpointed(), "O1", dtype=BF16, example_inputs=(torch.randn(4, 8),),
                            frontend=frontend)
    notes = [n for n in fxamp.conversion_info(amp).notes if "activation checkpointing" in n]
    assert len(notes) == 1 and notes[0].startswith(
        "activation checkpointing at `return checkpoint(self.b, self.a(x), use_reentrant=False)` at ")
    assert "(Checkpointed) kept: the converted block runs under torch.utils.checkpoint.checkpoint" in notes[0]


def test_hugging_face_gradient_checkpointing_is_noted_not_dropped_silently():
    """``gradient_checkpointing_enable()`` checkpoints inside each layer's ``__call__`` (no ``checkpoint(...)``
    call in any ``forward``): the capture traces through it, and says so once, naming a layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 96, (2, 8))
    with pytest.warns(UserWarning, match=r"gradient checkpointing is on \(2 module\(s\) with gradient_checkpointing="
                                         r"True, e.g. 'transformer.h.0'\) and was traced through \(export\)"):
        amp = fxamp.convert(model, "O1", dtype=BF16, example_kwargs={"input_ids": ids})
    assert any(n.startswith("gradient checkpointing is on") for n in _all_notes(amp))


def test_no_gradient_checkpointing_note_without_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    ids = torch.randint(0, 96, (2, 8))
    amp = fxamp.convert(transformers.GPT2LMHeadModel(config), "O1", dtype=BF16, example_kwargs={"input_ids": ids})
    assert not any("gradient checkpointing" in n for n in _all_notes(amp))


def _all_notes(amp):
    """The module's notes, and each held graph's (GPT-2 reads self.training: a graph per mode)."""
    graphs = amp.graph_modules() if isinstance(amp, fxamp.conversion.lazy.LazyConverted) else []
    return [*fxamp.conversion_info(amp).notes, *(n for g in graphs for n in fxamp.conversion_info(g).notes)]


def _frozen_half(layer, h):
    with torch.no_grad():
        return layer(h)


def _float32_island(layer, h):
    with torch.autocast("cpu", enabled=False):
        return layer(h).exp()


class HelperRegions(nn.Module):
    """The regions sit in plain functions that forward calls, not in forward's own source."""

    def __init__(self):
        super().__init__()
        self.pre, self.a, self.b, self.post = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.pre(x)
        y = _frozen_half(self.a, h)
        return self.post(_float32_island(self.b, h) + y)


def test_regions_in_functions_forward_calls_are_seen_on_every_path():
    with pytest.raises(TraceError, match=r"torch.fx cannot keep a grad-mode region .*`with torch.no_grad\(\):` at "
                                         r".*test_regions.py:\d+ \(_frozen_half\(\)\)"):
        fxamp.convert(HelperRegions(), "O1", dtype=BF16, frontend="fx")
    torch.manual_seed(0)
    model, x = HelperRegions(), torch.randn(4, 8)
    amp = fxamp.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    notes = fxamp.conversion_info(amp).notes
    assert notes[0].startswith("torch.fx could not trace the model (`with torch.no_grad():` at ")
    # torch.export's stack traces skip the helper's frame: the regions are kept, the note is general
    assert any(n.startswith("higher-order op regions (wrap_with_autocast, wrap_with_set_grad_enabled) kept")
               for n in notes)
    for converted in (amp, fxamp.convert(model, "O1", dtype=BF16)):  # and lazily captured
        converted(x)  # (a lazy module captures here)
        with OpDtypes() as rec:
            out = converted(x)
        assert [c.inputs for c in rec.of("exp")] == [(F32,)]
        out.float().sum().backward()
        assert converted.a.weight.grad is None and converted.b.weight.grad is not None
        model.zero_grad(set_to_none=True)


# Frozen and Island again, as classes whose source cannot be read (made by exec, as generated code or a
# notebook fed from a pipe): the source scan finds nothing, so only what forward does while traced can tell
_UNREADABLE = '''
class ExecFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        with torch.no_grad():
            y = self.a(h)
        return self.b(h) + y


class ExecIsland(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.a, self.post = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        with torch.autocast("cpu", enabled=False):
            y = self.a(h).exp()
        return self.post(y)


class ExecPlain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x).relu()
'''


def _unreadable(name):
    namespace = {"torch": torch, "nn": nn}
    exec(_UNREADABLE, namespace)
    return namespace[name]()


@pytest.mark.parametrize("grad_mode", [True, False])
def test_fx_refuses_a_region_in_code_whose_source_cannot_be_read(grad_mode):
    """The region is seen while forward runs, not in its source; converting under no_grad changes nothing."""
    with torch.set_grad_enabled(grad_mode):
        with pytest.raises(TraceError, match=r"torch.fx cannot keep a grad-mode region \(no_grad, inference_mode: "
                                             r"its parameters would be trained\): op 'a' in the forward of ExecFrozen "
                                             r"\(the root\) ran inside one, in code whose source cannot be read .* "
                                             r"What to do: use frontend='auto'"):
            fxamp.convert(_unreadable("ExecFrozen"), "O1", dtype=BF16, frontend="fx")
        with pytest.raises(TraceError, match=r"torch.fx cannot keep an autocast region \(enabled=False too: a float32 "
                                             r"island would run in low precision\): op 'a' in the forward of "
                                             r"ExecIsland"):
            fxamp.convert(_unreadable("ExecIsland"), "O1", dtype=BF16, frontend="fx")


@pytest.mark.parametrize("path", ["auto without inputs", "auto with inputs", "export", "lazy"])
def test_a_region_in_code_whose_source_cannot_be_read_is_kept(path):
    """torch.export keeps the regions: the frozen layer gets no gradient, the island runs in float32."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for name in ("ExecFrozen", "ExecIsland"):
        model = _unreadable(name)
        convert = {**_paths(model, x), "auto without inputs": lambda pol: fxamp.convert(model, pol, dtype=BF16)}
        amp = convert[path]("O1")
        amp(x)  # (a lazy module captures here)
        with OpDtypes() as rec:
            out = amp(x)
        out.float().sum().backward()
        if name == "ExecFrozen":
            assert amp.a.weight.grad is None and amp.a.bias.grad is None
            assert amp.b.weight.grad is not None and amp.pre.weight.grad is not None
        else:
            assert [c.inputs for c in rec.of("exp")] == [(F32,)]
            assert [c.inputs for c in rec.of("addmm")] == [(BF16,) * 3, (F32,) * 3, (BF16,) * 3]


def test_code_whose_source_cannot_be_read_without_regions_still_goes_through_fx():
    amp = fxamp.convert(_unreadable("ExecPlain"), "O1", dtype=BF16, frontend="fx")
    assert fxamp.conversion_info(amp).frontend == "fx"


def test_a_reentrant_checkpoint_is_no_region_of_the_model():
    """torch runs an autograd Function's forward under no_grad: that grad mode is torch's, not a region."""

    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(self.a, x, use_reentrant=True)

    amp = fxamp.convert(Reentrant(), "O1", dtype=BF16, frontend="fx")
    assert fxamp.conversion_info(amp).frontend == "fx"


def test_convert_in_place_never_trains_a_frozen_layer_of_code_whose_source_cannot_be_read():
    """fxamp.convert_: the block's fx captures see the region; it is kept or the block is refused in one line."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            block = type(_unreadable("ExecFrozen"))  # (one class: each exec makes another)
            self.blocks = nn.ModuleList([block() for _ in range(2)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = fxamp.convert_(Net(), "O1", dtype=BF16)
    try:
        out = model(torch.randn(4, 8))
    except TraceError as e:  # refused (today: torch.export's region is a submodule a block graph cannot hold)
        assert "\n" not in str(e) and "blocks.0" in str(e)
        return
    out.float().sum().backward()
    assert all(block.a.weight.grad is None for block in model.blocks)
