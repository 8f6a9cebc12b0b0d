"""One rule decides which override a node follows, for a category and for float8 alike (issue 38).

``classify/overrides.py``: a node's own ``node_overrides`` entry, else the ``module_overrides`` entry of the
longest module path covering it (on a dot; ``""`` covers every module).  The categories and the float8
choice both read it, and both check the keys the same way.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.classify.overrides import override_for
from fxamp.conversion.graph import decision_of
from fxamp.conversion.op_lists import Source


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        self.encoder = nn.Linear(32, 32)

    def forward(self, x):
        return self.encoder(self.enc(x))


def _convert(policy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float8 emulated on a CPU, masters
        return fxamp.convert(Encoder(), policy, leaf_modules=(), **kw)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_a_node_override_beats_the_longest_covering_module_override_which_beats_a_shorter_one():
    gm = _convert("O1")  # linear (enc.0), linear_1 (enc.1), linear_2 (encoder)
    modules = {"": "root", "enc": "enc", "enc.1": "enc.1"}
    by_node = {"linear": "node"}
    assert override_for(_node(gm, "linear"), by_node, modules) == ("node", Source.NODE_OVERRIDE, "node 'linear'")
    assert override_for(_node(gm, "linear_1"), by_node, modules) == ("enc.1", Source.MODULE_OVERRIDE, "module 'enc.1'")
    # "enc" covers "enc.0", not "encoder": only "" covers it
    assert override_for(_node(gm, "linear_2"), {}, modules) == ("root", Source.MODULE_OVERRIDE, "module ''")
    assert override_for(_node(gm, "linear_2"), {}, {"enc": "enc"}) is None


def test_categories_and_float8_follow_the_same_precedence():
    amp = _convert("O2,float8=tensorwise:always", module_overrides={"enc": "unsafe", "encoder": "no_float8"},
                   node_overrides={"linear_1": "safe"})
    enc0, enc1, encoder = (decision_of(_node(amp, name)) for name in ("linear", "linear_1", "linear_2"))
    assert enc0.compute == torch.float32 and enc0.source is Source.MODULE_OVERRIDE  # module "enc"
    assert enc1.compute == torch.bfloat16 and enc1.source is Source.NODE_OVERRIDE  # its node beats "enc"
    assert enc1.float8.chosen  # cost=always: no float8 override covers it
    assert not encoder.float8.chosen and encoder.float8.source is Source.MODULE_OVERRIDE  # "enc" does not cover it
    assert "no_float8 for module 'encoder' (override)" in encoder.float8.reason


@pytest.mark.parametrize("value", ["no_float8", "unsafe"])
def test_a_misspelt_node_says_the_close_names_for_a_float8_value_as_for_a_category(value):
    with pytest.raises(ValueError, match=r"node_overrides: the graph has no node 'linear_3'; did you mean one of "
                                         r"\['linear_2', 'linear_1', 'linear'\]"):
        _convert("O2,float8=tensorwise:always", node_overrides={"linear_3": value})


@pytest.mark.parametrize("value", ["float8", "safe"])
def test_a_module_path_the_model_lacks_says_the_close_paths_for_a_float8_value_as_for_a_category(value):
    with pytest.raises(ValueError, match=r"module_overrides: 'enc.2' is not a submodule of the model; did you mean "
                                         r"one of \['enc'\]"):
        _convert("O2,float8=tensorwise:always", module_overrides={"enc.2": value})
