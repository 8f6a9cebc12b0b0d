"""``conversion/pipeline.py`` (``rewrite_captured``) and the options it reads (``conversion/options.py``)."""

import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.capture import capture
from fxamp.conversion.rewrite.debug import MONITOR_NAME
from fxamp.conversion.graph import attr_target, cast_of, decision_of
from fxamp.conversion.options import ConvertOptions, DebugOverflow, Dynamic, parse_option
from fxamp.conversion.classify.categories import FLOAT32_LEAF_SHARE
from fxamp.conversion.pipeline import rewrite_captured
from fxamp.policy import resolve_policy


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return torch.exp(self.norm(self.fc(x)))


def rewritten(policy="O2", options=ConvertOptions(), **kwargs):
    """A float32 copy of the model (the capture shares its children, which O2 re-binds), and the rewrite."""
    model = Net()
    reference = copy.deepcopy(model)
    return reference, rewrite_captured(capture(model), resolve_policy(policy, "float16"), options, **kwargs)


def test_decide_stores_low_and_attaches_the_info():
    model, gm = rewritten("O2", notes=["first"])
    assert gm.fc.weight.dtype == torch.float16 and gm.norm.weight.dtype == torch.float32
    info = fxamp.conversion_info(gm)
    assert info.policy == resolve_policy("O2", "float16") and info.frontend == "fx" and info.notes[0] == "first"
    decided = {n.name: decision_of(n).compute for n in gm.graph.nodes if decision_of(n) is not None}
    assert decided == {"x": None, "fc_weight": None, "fc_bias": None, "linear": torch.float16, "norm": torch.float32, "exp": torch.float32,
                       "output": torch.float32}
    assert fxamp.conversion_info(copy.deepcopy(gm)) == info  # kept through deepcopy
    torch.testing.assert_close(gm(torch.ones(2, 4)), model(torch.ones(2, 4)).detach(), rtol=2e-2, atol=2e-2)


def test_keep_leaves_storage_and_casts_instead():
    model = Net()
    model.fc.weight.data = model.fc.weight.data.half()  # storage made beforehand (a LazyConverted's)
    gm = rewrite_captured(capture(model), resolve_policy("O2", "float16"), storage="keep")
    assert gm.fc.bias.dtype == torch.float32  # not re-bound: the consumer gets a cast
    assert ("fc.bias", torch.float16) in {(attr_target(c[0]), c[1]) for c in map(cast_of, gm.graph.nodes) if c}
    with pytest.raises(ValueError, match="storage='maybe' is not 'decide' or 'keep'"):
        rewrite_captured(capture(Net()), resolve_policy("O1", "float16"), storage="maybe")
    with pytest.raises(TypeError, match="options must be a ConvertOptions"):
        rewrite_captured(capture(Net()), resolve_policy("O1", "float16"), {"weight_cache": False})


def test_o0_changes_nothing_and_is_bitwise():
    model, gm = rewritten("O0")
    assert not [n for n in gm.graph.nodes if cast_of(n)]
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), model(x))


def test_options_reach_the_passes():
    options = ConvertOptions(debug_overflow="raise", weight_cache=False,
                             module_overrides={"fc": "unsafe"})
    _, gm = rewritten("O1", options)
    assert hasattr(gm, MONITOR_NAME)
    assert decision_of(next(n for n in gm.graph.nodes if n.name == "linear")).compute == torch.float32
    assert "_fxamp_weight_cache" not in gm.code
    _, plain = rewritten("O1")
    assert not hasattr(plain, MONITOR_NAME)


def test_a_large_float32_leaf_is_noted_and_warned_about():
    class Leafy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.custom = nn.Bilinear(4, 4, 4)

        def forward(self, x):
            return self.custom(self.fc(x), x)

    model = Leafy()
    with pytest.warns(UserWarning, match=r"leaf module 'custom' \(Bilinear\) runs whole in float32 and holds"):
        gm = rewrite_captured(capture(model, leaf_modules=[nn.Bilinear]), resolve_policy("O1", "float16"),
                              ConvertOptions(overrides={nn.Bilinear: "unsafe"}))
    assert any("leaf module 'custom'" in n for n in fxamp.conversion_info(gm).notes)
    assert 0 < FLOAT32_LEAF_SHARE < 1


def test_convert_options_normalises_convert_keywords_and_build_warns():
    options = ConvertOptions(debug_overflow="record", dynamic="all", overrides={torch.exp: "neutral"},
                             node_overrides={})
    assert options.debug_overflow is DebugOverflow.RECORD and options.dynamic is Dynamic.ALL
    assert options.op_lists.lookup(torch.exp).category is fxamp.conversion.op_lists.Category.NEUTRAL
    assert options.override_keys == (torch.exp,)
    assert options.node_overrides is None  # empty: none
    assert ConvertOptions() == ConvertOptions(op_lists=None)
    assert copy.deepcopy(options) is options
    plain = ConvertOptions(module_overrides={"fc": "safe"})
    assert pickle.loads(pickle.dumps(plain)) == plain
    assert dataclasses.replace(options, dynamic="none").op_lists is options.op_lists  # overrides applied once
    with pytest.raises(ValueError, match="debug_overflow='loud' is not one of 'off', 'record', 'raise'"):
        ConvertOptions(debug_overflow="loud")
    with pytest.raises(TypeError, match="op_lists must be an fxamp.conversion.op_lists.OpLists, not dict"):
        ConvertOptions(op_lists={})
    with pytest.raises(TypeError, match="weight_cache must be True or False, not 'yes'"):
        ConvertOptions(weight_cache="yes")
    with pytest.raises(TypeError, match="module_overrides must be a mapping"):
        ConvertOptions(module_overrides=["fc"])
    with pytest.warns(DeprecationWarning, match=r"ConvertOptions.build\(...\) is deprecated and kept for one release: "
                                                r"write ConvertOptions\(...\)"):
        assert ConvertOptions.build(dynamic="all", overrides={torch.exp: "neutral"}) == \
            ConvertOptions(dynamic="all", overrides={torch.exp: "neutral"})


@pytest.mark.parametrize("kind,value,exc,match", [
    (DebugOverflow, True, TypeError, "debug_overflow=True is no longer accepted: write debug_overflow='record' "
                                     r"\(one of 'off', 'record', 'raise'\)"),
    (DebugOverflow, False, TypeError, "write debug_overflow='off'"),
    (DebugOverflow, "yes", ValueError, "debug_overflow='yes' is not one of 'off', 'record', 'raise'"),
    (Dynamic, True, TypeError, "dynamic=True is no longer accepted: write dynamic='batch'"),
    (Dynamic, False, TypeError, "write dynamic='none'"),
    (Dynamic, 2, ValueError, "dynamic=2 is not one of 'batch', 'all', 'none'"),
])
def test_parse_option_refuses_bools_and_unknown_values(kind, value, exc, match):
    with pytest.raises(exc, match=match):
        parse_option(kind, value, what=kind is Dynamic and "dynamic" or "debug_overflow")


def test_parse_option_accepts_members_and_their_strings():
    assert parse_option(Dynamic, "none", what="dynamic") is Dynamic.NONE
    assert parse_option(DebugOverflow, DebugOverflow.RAISE, what="x") is DebugOverflow.RAISE
    assert str(Dynamic.BATCH) == "batch" and DebugOverflow.OFF == "off"


def test_convert_refuses_old_bool_options():
    with pytest.raises(TypeError, match="debug_overflow=True is no longer accepted"):
        fxamp.convert(Net(), "O1", debug_overflow=True)
    with pytest.raises(ValueError, match="debug_overflow='yes' is not one of"):
        fxamp.convert(Net(), "O1", debug_overflow="yes")
