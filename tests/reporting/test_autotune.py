"""Accuracy-driven fallback (issue 11, part 3): ``fxamp.autotune`` finds exactly the planted culprits."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fxamp
from fxamp.conversion.graph import decision_of
import planted

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name, culprits", [("Overflows", {"energy"}), ("Underflows", {"shrink"}),
                                            ("Unlisted", {"bessel"}), ("TwoCulprits", {"energy", "shrink"})])
def test_finds_exactly_the_culprits(frontend, name, culprits):
    model, batches = getattr(planted, name)(), planted.batches()
    amp, overrides, result = fxamp.autotune(model, example_inputs=batches, min_sqnr_db=30.0, frontend=frontend, return_result=True, dtype=torch.float16)
    assert overrides == {"module_overrides": {c: "unsafe" for c in culprits}, "node_overrides": {}, "overrides": {}}
    assert set(result.chosen) == culprits and result.score_before < 30 <= result.score_after
    # the culprits are ranked first, and the search is logarithmic in the candidates
    assert set(result.units[:len(culprits)]) == culprits
    assert result.evaluations <= 3 + math.ceil(math.log2(len(result.units))) + len(culprits)
    with torch.no_grad():
        assert min(fxamp.reporting.numerics.sqnr(model(*b), amp(*b)) for b in batches) >= 30
    # plain data that convert accepts as it is
    again = fxamp.convert(model, "O1", example_inputs=batches[0], frontend=frontend, dtype=torch.float16, **overrides)
    with torch.no_grad():
        assert torch.equal(again(*batches[0]), amp(*batches[0]))


def test_healthy_model_changes_nothing():
    model, batches = planted.Healthy(), planted.batches()
    amp, overrides, result = fxamp.autotune(model, example_inputs=batches, return_result=True)
    assert overrides == {"module_overrides": {}, "node_overrides": {}, "overrides": {}} and result.evaluations == 1
    with torch.no_grad():
        assert torch.equal(amp(*batches[0]), fxamp.convert(model, "O1")(*batches[0]))


def test_metric_and_tolerance():
    model, batches = planted.Underflows(), planted.batches()

    def max_abs(ref, out):
        return float((ref - out).abs().max())

    _, overrides = fxamp.autotune(model, example_inputs=batches, metric=max_abs, tolerance=1e-2, dtype=torch.float16)
    assert overrides["module_overrides"] == {"shrink": "unsafe"}
    with pytest.raises(ValueError, match="metric= needs tolerance="):
        fxamp.autotune(model, example_inputs=batches, metric=max_abs, dtype=torch.float16)


def test_one_criterion_never_one_ignored():
    model, batches = planted.Underflows(), planted.batches()
    with pytest.raises(ValueError, match=r"one criterion: min_sqnr_db=40 or metric= with tolerance=, not both"):
        fxamp.autotune(model, example_inputs=batches, min_sqnr_db=40, metric=lambda r, o: 0.0, tolerance=1e-2)
    with pytest.raises(ValueError, match=r"tolerance=0.01 bounds metric=, which was not given"):
        fxamp.autotune(model, example_inputs=batches, tolerance=1e-2)


def test_a_metric_may_return_a_one_element_tensor():
    model, batches = planted.Underflows(), planted.batches()
    _, overrides = fxamp.autotune(model, example_inputs=batches, metric=lambda r, o: (r - o).abs().max(), tolerance=1e-2, dtype=torch.float16)
    assert overrides["module_overrides"] == {"shrink": "unsafe"}
    with pytest.raises(TypeError, match=r"metric must return a number .* not a tensor of shape \(4, 8\)"):
        fxamp.autotune(model, example_inputs=batches, metric=lambda r, o: (r - o).abs(), tolerance=1e-2, dtype=torch.float16)


def test_root_level_op_is_overridden_by_itself():
    """An op in the model's own forward is a unit of its own (node_overrides): the square that overflows
    moves to float32, the scaling by 200 (the same op, operator.mul) stays in low precision."""
    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = planted._linear(16, 16, 0)

        def forward(self, x):
            h = self.fc(x) * 200.0
            return torch.cat([h / 1000.0, (h * h).sum(-1, keepdim=True) / 1e6], -1)

    amp, overrides = fxamp.autotune(Root(), example_inputs=planted.batches(), dtype=torch.float16)
    assert overrides == {"module_overrides": {}, "node_overrides": {"mul_1": "unsafe"}, "overrides": {}}
    decisions = {n.name: decision_of(n) for n in amp.graph.nodes if decision_of(n)}
    assert decisions["mul"].category.value == "neutral" and decisions["mul"].compute is None  # follows fc: float16
    assert decisions["mul_1"].compute == torch.float32 and decisions["mul_1"].source.value == "node override"


def test_json_round_trip(tmp_path, capsys):
    model, batches = planted.TwoCulprits(), planted.batches()
    amp, overrides = fxamp.autotune(model, example_inputs=batches, verbose=True, dtype=torch.float16)
    out = capsys.readouterr().out
    assert "2 units to float32" in out and '"energy": "unsafe"' in out
    path = tmp_path / "overrides.json"
    fxamp.save_overrides(overrides, str(path))
    assert json.loads(path.read_text()) == {"version": 2, "module_overrides": {"energy": "unsafe", "shrink": "unsafe"},
                                            "node_overrides": {}, "overrides": {}}
    assert fxamp.load_overrides(str(path)) == overrides
    import operator
    fxamp.save_overrides({"overrides": {operator.mul: "unsafe", torch.ops.aten.exp: "neutral", "Tensor.sum": "safe"}},
                         str(path))
    assert fxamp.load_overrides(str(path))["overrides"] == {operator.mul: "unsafe", torch.ops.aten.exp: "neutral",
                                                            "Tensor.sum": "safe"}
    path.write_text('{"overrides": {"nope.op": "unsafe"}}')
    with pytest.raises(ValueError, match="unknown op 'nope.op'"):
        fxamp.load_overrides(str(path))
    path.write_text("[1]")
    with pytest.raises(ValueError, match="expected an object with 'module_overrides', 'node_overrides' and"):
        fxamp.load_overrides(str(path))
    path.write_text('{"version": 1, "module_overrides": {"energy": "unsafe"}, "overrides": {}}')  # older files
    assert fxamp.load_overrides(str(path)) == {"module_overrides": {"energy": "unsafe"}, "node_overrides": {},
                                               "overrides": {}}


def test_unreachable_tolerance_is_an_error():
    with pytest.raises(fxamp.FxampError, match="even with every low-precision op in float32"):
        fxamp.autotune(planted.Underflows(), example_inputs=planted.batches(), metric=lambda r, o: 1.0, tolerance=0.5)


def test_autotune_keeps_more_in_low_precision_than_the_fallbacks_a_user_would_try_by_hand():
    """By hand, a user moves the whole model to float32, or every module the report flags, one at a
    time, converting again each time.  Autotune meets the same tolerance and keeps the matmuls low."""
    model, batches = planted.TwoCulprits(), planted.batches()
    amp, overrides, result = fxamp.autotune(model, example_inputs=batches, min_sqnr_db=30.0, return_result=True, dtype=torch.float16)

    def low_share(**options):
        return fxamp.report(model, "O1", example_inputs=batches[0], dtype=torch.float16, **options).summary.low_share

    def output_sqnr(**options):
        converted = fxamp.convert(model, "O1", dtype=torch.float16, **options)
        with torch.no_grad():
            return min(fxamp.reporting.numerics.sqnr(model(*b), converted(*b)) for b in batches)

    everything = {"module_overrides": {"": "unsafe"}}  # the blunt fix: the whole model in float32
    assert output_sqnr(**everything) >= 30 and low_share(**everything) == 0.0
    # one module at a time, in the report's order: fixing only the worst op is not enough
    worst = fxamp.report(model, "O1", example_inputs=batches, numerics=True, dtype=torch.float16).numerics_summary.worst
    assert worst is not None
    one_by_one = {"module_overrides": {next(iter(result.chosen)): "unsafe"}}
    assert output_sqnr(**one_by_one) < 30
    # autotune: the tolerance holds, both linear layers stay in low precision
    assert output_sqnr(**overrides) >= 30
    assert low_share(**overrides) > 0.9
    assert fxamp.report(model, "O1", example_inputs=batches[0], dtype=torch.float16, **overrides)["linear"].compute == "float16"
