"""Measured error per node (issue 11, part 1): ``fxamp.report(..., numerics=True)``."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch

import fxamp
import planted
from fxamp.reporting import NUMERICS_COLUMNS

pytestmark = pytest.mark.usefixtures("one_thread")

FRONTENDS = ["fx", "export"]


def _end_to_end(model, amp, batches):
    with torch.no_grad():
        return min(fxamp.reporting.numerics.sqnr(model(*b), amp(*b)) for b in batches)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_output_sqnr_matches_end_to_end(frontend, policy):
    model, batches = planted.Healthy().eval(), planted.batches(3)
    rep = fxamp.report(model, policy, example_inputs=batches, numerics=True, frontend=frontend, dtype=torch.float16)
    amp = fxamp.convert(model, policy, example_inputs=batches[0], frontend=frontend, dtype=torch.float16).eval()
    direct = _end_to_end(model, amp, batches)
    assert 50 < direct < 90
    assert rep["output"].numerics.sqnr_db == pytest.approx(direct, abs=0.1)
    assert rep.numerics_summary.output_sqnr_db == pytest.approx(direct, abs=0.1)
    assert rep.numerics_summary.batches == 3 and rep.numerics_summary.culprit is None
    # dtype columns stay; parameters and inputs carry no numbers
    assert rep["linear"].compute == "float16" and rep["x"].numerics is None
    norm = next(r for r in rep.rows if r.module == "norm" and r.is_op)
    assert rep["linear"].numerics.overflow == 0.0 and norm.numerics.overflow is None


def test_min_over_batches():
    model = planted.Healthy().eval()
    batches = planted.batches(3)
    per_batch = [fxamp.report(model, example_inputs=[b], numerics=True)["linear_1"].numerics.sqnr_db for b in batches]
    assert fxamp.report(model, example_inputs=batches, numerics=True)["linear_1"].numerics.sqnr_db == pytest.approx(min(per_batch))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name, culprit, column", [("Overflows", "mul_1", "overflow"),
                                                   ("Underflows", "mul", "underflow"),
                                                   ("Unlisted", "special_i0", "overflow")])
def test_worst_op_is_the_planted_culprit(frontend, name, culprit, column):
    rep = fxamp.report(getattr(planted, name)(), example_inputs=planted.batches(), numerics=True, frontend=frontend, dtype=torch.float16)
    s = rep.numerics_summary
    assert (s.worst, s.culprit) == (culprit, culprit)
    assert [r.node for r in rep.rows if r.numerics and r.numerics.culprit] == [culprit]
    assert getattr(rep[culprit].numerics, column) > 0
    upstream = [r for r in rep.rows if r.numerics and r.node in ("linear", "clamp")]
    assert all(r.numerics.sqnr_db > 60 for r in upstream)
    assert f"worst op: {culprit}" in rep.to_table()


def test_overflow_counts_nonfinite():
    rep = fxamp.report(planted.Overflows(), example_inputs=planted.batches(), numerics=True, dtype=torch.float16)
    n = rep["mul_1"].numerics
    assert n.sqnr_db == -math.inf and n.nonfinite > 0 and n.overflow >= n.nonfinite / (2 * 64)  # max over batches; counts add up
    assert rep["linear"].numerics.nonfinite == 0


def test_json_and_csv():
    rep = fxamp.report(planted.Underflows(), example_inputs=planted.batches(), numerics=True, dtype=torch.float16)
    data = json.loads(rep.to_json())
    assert data["version"] == 2
    assert data["numerics_summary"] == {"output_sqnr_db": pytest.approx(rep.numerics_summary.output_sqnr_db),
                                        "worst": "mul", "worst_sqnr_db": pytest.approx(rep["mul"].numerics.sqnr_db),
                                        "culprit": "mul", "batches": 2}
    row = next(r for r in data["rows"] if r["node"] == "mul")
    assert set(row["numerics"]) == {"sqnr_db", "max_rel_error", "nonfinite", "overflow", "underflow", "culprit"}
    assert row["numerics"]["underflow"] == 1.0 and row["numerics"]["culprit"] is True
    assert next(r for r in data["rows"] if r["node"] == "x")["numerics"] is None
    records = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert list(records[0])[-len(NUMERICS_COLUMNS):] == NUMERICS_COLUMNS
    mul = next(r for r in records if r["node"] == "mul" and r["record"] == "node")
    assert (float(mul["sqnr_db"]), mul["culprit"]) == (pytest.approx(rep["mul"].numerics.sqnr_db, abs=0.05), "1")
    assert any(r["node"] == "numerics.worst" and r["value"] == "mul" for r in records)
    # exact equality is +inf dB: JSON writes the string "inf"
    exact = json.loads(fxamp.report(planted.Healthy(), "O0", example_inputs=planted.batches(), numerics=True).to_json())
    assert exact["numerics_summary"]["output_sqnr_db"] == "inf"


def test_plain_report_unchanged():
    rep = fxamp.report(planted.Healthy(), example_inputs=planted.batches()[0])
    assert rep.numerics_summary is None and all(r.numerics is None for r in rep.rows)
    assert "SQNR" not in rep.to_table()
    header = list(csv.reader(io.StringIO(rep.to_csv())))[0]
    from fxamp.reporting.formats import CSV_COLUMNS, NUMERICS_COLUMNS

    assert header[len(CSV_COLUMNS) - 1] == "value" and not set(NUMERICS_COLUMNS) & set(header)


def test_bad_input():
    with pytest.raises(ValueError, match="numerics=True runs the model: pass example_inputs"):
        fxamp.report(planted.Healthy(), numerics=True)
    amp = fxamp.convert(planted.Healthy())
    with pytest.raises(ValueError, match="needs the original float32 model"):
        fxamp.report(amp, example_inputs=planted.batches()[0], numerics=True)


def test_cost():
    """Side by side costs a forward of each model plus a few comparisons per node: counted in dispatched
    ATen ops (about 5.5x a plain forward of the two), not in time, whose ratio depends on the CPU (on an
    AMX Xeon the matmuls are fast and the elementwise comparisons are not), and linear in the depth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fxamp.reporting.numerics import measure

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    ratios = []
    for depth in (4, 16):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                      for _ in range(depth)])
        batches = [(torch.randn(256, 64),)]
        amp = fxamp.convert(model, "O1")
        with Count() as plain, torch.no_grad():
            model(*batches[0]), amp(*batches[0])
        with Count() as side:
            measure(amp, model, batches, {}, torch.float16)
        ratios.append(side.n / plain.n)
    assert all(r < 6.5 for r in ratios), ratios
    assert ratios[1] <= ratios[0] * 1.05, ratios  # per node, not growing with the graph


def test_batches_from_an_iterable():
    model, batches = planted.Underflows(), planted.batches(3)
    from_list = fxamp.report(model, example_inputs=batches, numerics=True)
    from_gen = fxamp.report(model, example_inputs=(b for b in batches), numerics=True)
    assert from_gen.numerics_summary == from_list.numerics_summary and from_gen.numerics_summary.batches == 3
    with pytest.raises(TypeError, match="a list of such tuples"):
        fxamp.report(model, example_inputs={"x": batches[0][0]}, numerics=True)
