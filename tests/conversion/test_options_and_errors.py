"""What a user asked for is used, said or refused: the default dtype (and the note that names it), options
of the wrong type, op overrides that match nothing, and run-time errors that name the converted node."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import fxamp

BF = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))


CPU_NOTE = "dtype=bfloat16 (autocast's default on cpu; pass dtype= to choose)"


def test_a_cpu_model_defaults_to_bfloat16_and_says_so():
    model, x = _net(), torch.randn(2, 8)
    amp = fxamp.convert(model, "O1")
    assert fxamp.info.policy_of(amp).compute == torch.bfloat16
    assert fxamp.conversion_info(amp).notes[0] == CPU_NOTE
    with torch.no_grad():
        with torch.autocast("cpu"):  # autocast's own default on CPU: the same numbers
            expected = model(x)
        assert torch.allclose(amp(x), expected.float(), atol=1e-2)
    assert CPU_NOTE in str(fxamp.report(model, example_inputs=(x,)))  # and the report shows the note


def test_an_explicit_dtype_or_policy_wins_and_needs_no_note():
    model = _net()
    for amp in (fxamp.convert(model, "O2", dtype=torch.float16), fxamp.convert(model, "compute=float16"),
                fxamp.convert(model, fxamp.Policy.parse("O1", "float16"))):
        assert fxamp.info.policy_of(amp).compute == torch.float16
        assert not any("autocast's default" in n for n in fxamp.conversion_info(amp).notes)
    o0_notes = fxamp.conversion_info(fxamp.convert(model, "O0")).notes  # nothing runs in low precision
    assert not any("autocast's default" in n for n in o0_notes)


def test_a_lazily_capturing_module_says_which_dtype_it_chose():
    amp = fxamp.convert(_net(), "O2", frontend="export")
    assert isinstance(amp, fxamp.conversion.lazy.LazyConverted)
    assert fxamp.conversion_info(amp).notes[0] == CPU_NOTE
    assert dict(amp.named_parameters())["0.weight"].dtype == torch.bfloat16


def test_options_of_the_wrong_type_are_refused():
    with pytest.raises(TypeError, match="weight_cache must be True or False, not 'no'"):
        fxamp.convert(_net(), "O1", weight_cache="no")
    with pytest.raises(TypeError, match=r"overrides must be a mapping such as \{torch.exp: 'neutral'.*not list"):
        fxamp.convert(_net(), "O1", overrides=[nn.GELU])
    with pytest.raises(TypeError, match="module_overrides must be a mapping .* not list"):
        fxamp.convert(_net(), "O1", module_overrides=["0"])


def test_an_op_override_that_matches_nothing_is_said():
    with pytest.warns(UserWarning, match="overrides: torch.nn.Conv2d matches no op of the captured graph"):
        amp = fxamp.convert(_net(), "O1", dtype=torch.float16, overrides={nn.Conv2d: "unsafe", nn.GELU: "unsafe"})
    notes = fxamp.conversion_info(amp).notes
    assert [n for n in notes if n.startswith("overrides:")] == [
        "overrides: torch.nn.Conv2d matches no op of the captured graph, so it changes nothing (the model has no "
        "such module or call, or the front end traced into the module); check the key in fxamp.report"]
    gelu = next(r for r in fxamp.report(amp).rows if r.op.endswith("GELU"))
    assert gelu.compute == "float32"  # the override that matched was used


@pytest.mark.parametrize("bad,match", [
    (torch.randn(2, 5), r"^mat1 and mat2 shapes cannot be multiplied \(2x5 and 8x8\) \[raised by the converted "
                        r"module's node 'linear' \(torch.nn.functional.linear in module '0'\)\]$"),
    (torch.ones(2, 8, dtype=torch.long), r"^mat1 and mat2 must have the same dtype, but got Long and BFloat16 "
                                          r"\[raised by the converted module's node 'linear'"),
])
def test_a_run_time_error_is_torchs_message_with_the_node_named(bad, match, capfd):
    amp = fxamp.convert(_net(), "O1", dtype=torch.bfloat16)
    for module in (amp, copy.deepcopy(amp)):
        with pytest.raises(RuntimeError, match=match):
            module(bad)
    unpickled = pickle.loads(pickle.dumps(amp))  # rebuilt from its code: the node named, its decision not kept
    with pytest.raises(RuntimeError, match=match.split(r"'linear'")[0] + "'linear'"):
        unpickled(bad)
    assert capfd.readouterr().err == ""  # no dump of the generated code before it


def test_an_error_inside_a_leaf_module_keeps_its_traceback_and_names_the_node():
    class Picky(nn.Module):
        def forward(self, x):
            raise ValueError("Picky wants 3 features")

    model = nn.Sequential(nn.Linear(8, 8), Picky())
    amp = fxamp.convert(model, "O1", dtype=torch.float16, leaf_modules=[Picky])
    with pytest.raises(ValueError, match=r"^Picky wants 3 features \[raised by the converted module's node '_1'") as e:
        amp(torch.randn(2, 8))
    assert any("Picky wants 3 features" in str(entry.statement) for entry in e.traceback)  # where it was raised


class _FrozenHeadBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.trained = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.frozen(x)
        return self.trained(x) + y


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_FrozenHeadBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_convert_in_place_keeps_a_blocks_no_grad_region_instead_of_refusing_it():
    # it was refused, naming "made attributes its instances do not have (submod_1)": torch.export's name for the
    # region's body; the body is now a graph input every instance shares, so the block converts and the region holds
    torch.manual_seed(0)
    ref = _Stack()
    model = fxamp.convert_(copy.deepcopy(ref), "O1")
    x = torch.randn(2, 8)
    out = model(x)
    out.sum().backward()
    for block in model.blocks:
        assert block.frozen.weight.grad is None and block.frozen.bias.grad is None  # the region's layer stays frozen
        assert block.trained.weight.grad is not None
    torch.testing.assert_close(out, ref(x), rtol=0.05, atol=0.05)

@pytest.mark.parametrize("leaf, said", [("norm", r"\['norm'\]"), (nn.LayerNorm, r"\[LayerNorm\]")])
def test_leaf_modules_given_one_path_or_class_alone_says_to_write_a_list(leaf, said):
    # issue 37 probe: leaf_modules="norm" was read letter by letter ("'n' is not a submodule path")
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(TypeError, match=r"leaf_modules takes a list of module classes or paths, not .* alone: "
                                        r"write leaf_modules=" + said):
        fxamp.convert(model, "O1", leaf_modules=leaf)


class _Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("register", ["forward", "forward_pre", "full_backward"])
def test_a_hook_registered_after_conversion_on_an_inlined_module_is_refused(register):
    # issue 37 probe: a feature-extraction hook put on amp.fc1 after convert never ran (fc1's F.linear is inline)
    model = _Features()
    amp = fxamp.convert(model, "O1", dtype=BF)
    x = torch.randn(2, 8)
    handle = getattr(amp.fc1, f"register_{register}_hook")(lambda *a: None)
    with pytest.raises(fxamp.FxampError, match=r"a hook was registered on 'fc1' \(Linear\) after fxamp\.convert.*"
                                               r"would never run: register hooks before converting"):
        amp(x)
    handle.remove()
    assert amp(x).shape == (2, 4)
    seen = []
    amp.act.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # a module the graph calls: runs
    amp(x)
    assert seen == [(2, 16)]


def test_a_hook_registered_before_conversion_runs():
    model = _Features()
    seen = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    amp = fxamp.convert(model, "O1", dtype=BF)
    amp(torch.randn(2, 8))
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("kwargs", [{}, {"frontend": "export"}])
def test_indexing_a_converted_sequential_says_what_to_write(kwargs):
    # issue 37 probe: amp[0] raised Python's "'Sequential' object is not subscriptable" (the class keeps the name)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    amp = fxamp.convert(model, "O2", dtype=BF, **kwargs)
    with pytest.raises(TypeError, match=r"a converted Sequential cannot be indexed \(\[-1\]\): it runs its children "
                                        r"inside its graph.*amp\.get_submodule\('0'\)"):
        amp[-1]
    assert amp.get_submodule("2").weight.dtype == BF


def test_a_hook_registered_after_an_export_capture_is_refused():
    # issue 37 probe: torch.export inlines every module; a hook put on one after conversion never ran
    model = _Features()
    x = torch.randn(2, 8)
    amp = fxamp.convert(model, "O2", dtype=BF, frontend="export", example_inputs=(x,))
    amp.act.register_forward_hook(lambda *a: None)
    with pytest.raises(fxamp.FxampError, match=r"a hook was registered on 'act' \(GELU\) after fxamp\.convert"):
        amp(x)
