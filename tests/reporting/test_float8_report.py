"""The float8 column of the report, and autotune's float8 step: measured error, not shape, keeps a matmul in bfloat16."""

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.reporting import FLOAT8_COLUMNS, autotune
from fxamp.reporting.float8 import measure_float8

pytestmark = pytest.mark.usefixtures("one_thread")


class MLP(nn.Module):
    def __init__(self, planted: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        if planted:  # a massive activation on a feature b does not read: one scale for its input flushes the rest
            with torch.no_grad():
                self.a.bias[0] = 1e6
                self.b.weight[:, 0] = 0

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _report(model, policy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxamp.report(model, policy, example_inputs=[(torch.randn(16, 32),), (torch.randn(16, 32),)], **kw)


def test_the_column_shows_the_choice_and_with_numerics_the_float8_error_and_scales():
    torch.manual_seed(0)
    rep = _report(MLP(planted=True), "O2,float8=tensorwise:always", numerics=True)
    cells = {r.node: r.float8 for r in rep.rows if r.float8 is not None}
    assert set(cells) == {"linear", "linear_1", "linear_2"} and all(c.chosen for c in cells.values())
    planted, healthy = cells["linear_1"].measured, cells["linear_2"].measured
    assert planted.sqnr_db < 5 and healthy.sqnr_db > 25  # e4m3 keeps ~28 dB on a healthy matmul
    assert planted.input_amax[1] == pytest.approx(1e6, rel=1e-2)  # the outlier, rounded to bfloat16
    assert planted.scale[0] == pytest.approx(448 / planted.input_amax[1])
    text = str(rep)
    assert "float8" in text.splitlines()[6] and "f8 0." in text  # header column; the planted node's dB
    csv = rep.to_csv().splitlines()
    assert csv[0].endswith(",".join(FLOAT8_COLUMNS))
    assert rep.to_dict()["rows"][[r.node for r in rep.rows].index("linear_1")]["float8"]["chosen"] is True


def test_without_numerics_the_column_gives_the_reason_and_other_policies_have_none():
    rep = _report(MLP(), "O2,float8=tensorwise")
    assert {r.float8.source for r in rep.rows if r.float8} == {"default"}
    assert all(not r.float8.chosen and r.float8.measured is None for r in rep.rows if r.float8)
    assert "bf16 (cost)" in str(rep)
    plain = _report(MLP(), "O2")
    assert all(r.float8 is None for r in plain.rows) and "float8" not in plain.to_csv().splitlines()[0]


def test_the_numerics_reference_of_a_float8_node_is_the_float32_matmul_not_float8():
    torch.manual_seed(1)
    rep = _report(MLP(), "O2,float8=tensorwise:always", numerics=True)
    plain = _report(MLP(), "O2", numerics=True)
    # float8 costs ~20 dB more than bfloat16 against the same float32 reference
    assert rep["linear_2"].numerics.sqnr_db < plain["linear_2"].numerics.sqnr_db - 10


def test_measure_float8_takes_every_candidate_chosen_or_not():
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = fxamp.convert(MLP(), "O2,float8=rowwise", node_overrides={"linear": "float8"})
    measured = measure_float8(amp, [(torch.randn(8, 32),)])
    assert set(measured) == {"linear", "linear_1", "linear_2"}
    assert all(20 < m.sqnr_db < 40 for m in measured.values())
    assert measured["linear"].input_amax[0] < measured["linear"].input_amax[1]  # rowwise: one amax per row


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_autotune_keeps_exactly_the_planted_node_in_bfloat16(recipe):
    torch.manual_seed(3)
    batches = [(torch.randn(16, 32),), (torch.randn(16, 32),)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp, overrides, result = autotune(MLP(planted=True), f"O2,float8={recipe}:always", example_inputs=batches, return_result=True)
    assert overrides["node_overrides"] == {"linear_1": "no_float8"}
    assert result.float8_refused == ("linear_1",) and result.chosen == ()
    chosen = {n.name for n in amp.graph.nodes if n.meta.get("fxamp") and n.meta["fxamp"].float8
              and n.meta["fxamp"].float8.chosen}
    assert chosen == {"linear", "linear_2"}


def test_autotunes_float8_overrides_save_load_and_convert_the_same(tmp_path):
    torch.manual_seed(3)
    model = MLP(planted=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp, overrides = autotune(model, "O2,float8=tensorwise:always", example_inputs=[(torch.randn(16, 32),)])
        fxamp.save_overrides(overrides, str(tmp_path / "o.json"))
        again = fxamp.convert(model, "O2,float8=tensorwise:always", **fxamp.load_overrides(str(tmp_path / "o.json")))
    x = torch.randn(4, 32)
    assert torch.equal(again(x), amp(x))


def test_autotune_changes_nothing_on_a_healthy_mlp():
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp, overrides, result = autotune(MLP(), "O2,float8=tensorwise:always", example_inputs=[(torch.randn(16, 32),)],
                                          return_result=True)
    assert overrides == {"module_overrides": {}, "node_overrides": {}, "overrides": {}}
    assert result.float8_refused == () and result.score_before >= 15.0


@pytest.mark.parametrize("recipe,rows", [("tensorwise", 16), ("rowwise", 1)])
def test_the_column_shows_how_far_one_nan_spreads_under_each_recipe(recipe, rows):
    # issue 37: under tensorwise one NaN in one input row made every output row NaN, and the column said nothing
    torch.manual_seed(5)
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = fxamp.report(MLP(), f"O2,float8={recipe}:always", example_inputs=[(x,)], numerics=True)
    measured = {r.node: r.float8.measured for r in rep.rows if r.float8 is not None}
    assert {n: m.nan_rows for n, m in measured.items()} == {n: (rows, 16) for n in ("linear", "linear_1", "linear_2")}
    text = str(rep)
    assert (f"f8 -infdB NaN→16/16 rows" in text) is (recipe == "tensorwise")
    assert ("NaN→k/m rows: one NaN planted in one input row made k of the m output rows NaN (tensorwise" in text) \
        is (recipe == "tensorwise")
    assert rep.to_dict()["rows"][[r.node for r in rep.rows].index("linear")]["float8"]["measured"]["nan_rows"] == \
        [rows, 16]
    csv = rep.to_csv().splitlines()
    assert csv[0].endswith(",float8_scale,float8_nan_rows")
    assert next(line for line in csv if line.startswith("node,linear,")).endswith(f",{rows} 16")
    # on clean inputs the measurement is the same: the column shows the risk before a NaN ever arrives
    clean = _report(MLP(), f"O2,float8={recipe}:always", numerics=True)
    assert {r.float8.measured.nan_rows for r in clean.rows if r.float8 is not None} == {(rows, 16)}
