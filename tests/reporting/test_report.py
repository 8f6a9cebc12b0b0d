"""fxamp.report: golden rows, table columns, JSON schema, CSV, FLOPs, lints, policy diffs."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.graph import cast_of, decision_of
from fxamp.reporting import CSV_COLUMNS, Row
from fxamp.reporting.formats import RECOMPUTE_COLUMNS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import models  # noqa: E402  examples/models.py

from dtype_observer import OpDtypes  # noqa: E402


def _mlp_input():
    return torch.randn(2, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def mlp_report():
    torch.manual_seed(0)
    return fxamp.report(models.TinyMLP(), example_inputs=_mlp_input(), dtype=torch.float16)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return models.TinyTransformerBlock()


@pytest.fixture(scope="module")
def block_input():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------
# golden rows
# ---------------------------------------------------------------------------------------------

# (node, op, module, category, resolved, input dtypes, compute, output dtype, casts, flops)
GOLDEN_MLP_O1 = [
    ("linear", "torch.nn.functional.linear", "fc1", "safe", "safe", ("float32", "float32", "float32"),
     "float16", "float16", ("x→fp16", "fc1.weight→fp16", "fc1.bias→fp16"), 2 * 2 * 64 * 128),
    ("relu", "torch.nn.functional.relu", "", "neutral", "neutral", ("float16",), "float16", "float16", (), 2 * 128),
    ("linear_1", "torch.nn.functional.linear", "fc2", "safe", "safe", ("float16", "float32", "float32"),
     "float16", "float16", ("fc2.weight→fp16", "fc2.bias→fp16"), 2 * 2 * 128 * 128),
    ("relu_1", "torch.nn.functional.relu", "", "neutral", "neutral", ("float16",), "float16", "float16", (), 2 * 128),
    ("linear_2", "torch.nn.functional.linear", "head", "safe", "safe", ("float16", "float32", "float32"),
     "float16", "float16", ("head.weight→fp16", "head.bias→fp16"), 2 * 2 * 128 * 10),
    ("log_softmax", "torch.nn.functional.log_softmax", "", "conditional", "unsafe", ("float16",), "float32",
     "float32", ("linear_2→fp32",), 2 * 10),
]


def _golden(row: Row):
    return (row.node, row.op, row.module, row.category.value, row.resolved.value, row.input_dtypes, row.compute,
            row.output_dtype, tuple(str(c) for c in row.casts), row.flops)


def test_golden_mlp_o1(mlp_report):
    ops = [r for r in mlp_report.rows if r.is_op]
    assert [_golden(r) for r in ops] == GOLDEN_MLP_O1
    x = mlp_report["x"]
    assert (x.kind, x.op, x.output_dtype, x.output_shape, x.compute) == ("placeholder", "input", "float32", (2, 64), "-")
    w = mlp_report["fc1_weight"]
    assert (w.kind, w.op, w.module, w.output_dtype, w.output_shape) == ("get_attr", "parameter", "fc1.weight",
                                                                         "float32", (128, 64))
    out = mlp_report["output"]
    assert (out.kind, out.compute, out.output_dtype, out.output_shape) == ("output", "float32", "float32", (2, 10))


def test_golden_mlp_summary(mlp_report):
    s = mlp_report.summary
    assert s.ops == 6
    assert dict(s.categories) == {"safe": 3, "neutral": 2, "conditional": 1, "unsafe": 0, "unlisted": 0}
    assert dict(s.resolved) == {"unsafe": 1}
    assert (s.casts, s.weight_casts, s.noop_casts) == (8, 6, 0)
    low = 2 * 2 * 64 * 128 + 2 * 2 * 128 * 128 + 2 * 2 * 128 * 10 + 2 * 2 * 128
    assert (s.flops, s.low_flops) == (low + 20, low)
    assert s.low_share == pytest.approx(low / (low + 20))


def test_static_report_without_inputs():
    rep = fxamp.report(models.TinyMLP(), dtype=torch.float16)
    assert rep.inputs == ()
    assert rep["x"].output_dtype == "runtime"
    assert rep["linear"].input_dtypes == ("runtime", "float32", "float32")
    assert rep["linear"].compute == "float16"  # fixed by the decision, known without running
    assert rep["relu"].compute == "as input"
    assert rep["log_softmax"].output_dtype == "float32"
    assert rep["fc1_weight"].output_shape == (128, 64)
    assert all(r.flops is None for r in rep.rows)
    assert rep.summary.flops is None and rep.summary.low_share is None and rep.summary.noop_casts is None
    assert "unknown without example inputs" in str(rep)
    # the same categories and casts as with inputs: both come from the converted graph
    with_inputs = fxamp.report(models.TinyMLP(), example_inputs=_mlp_input(), dtype=torch.float16)
    assert [(r.node, r.category, r.resolved, len(r.casts)) for r in rep.rows] == \
        [(r.node, r.category, r.resolved, len(r.casts)) for r in with_inputs.rows]


def test_table_columns_and_summary(mlp_report):
    text = str(mlp_report)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("node "))
    assert header.split() == ["node", "op", "category", "reason", "in→compute→out", "casts", "before"]
    # the log-softmax over the fp16 logits is a float32 island (issue 40): listed below the table
    assert any(line.startswith("  log_softmax: recomputed, keeps float16 for backward") for line in lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("linear "))
    for cell in ('fc1: linear', "safe", "linear layer", "fp32→fp16→fp16", "x→fp16, fc1.weight→fp16,"):
        assert cell in lines[at]
    assert lines[at + 1].split() == ["fc1.bias→fp16"]  # wrapped at a space
    assert "unsafe*" in next(line for line in lines if line.startswith("log_softmax"))
    assert "ops: 6 — safe 3, neutral 2, conditional 1 (→ unsafe 1)" in text
    assert "casts inserted: 8 (6 of parameters/buffers, 2 of activations)" in text
    assert "low-precision FLOPs: 100.0% of 103.96 kFLOP" in text
    assert text.startswith("fxamp report: TinyMLP  policy O1 (params=float32,compute=float16")
    wide = mlp_report.to_table(wide=True)
    assert "parameter, buffer or constant: cast at each use as that use needs" in wide
    assert "conditional→unsafe" in next(line for line in wide.splitlines() if line.startswith("log_softmax"))


@pytest.mark.parametrize("name, shape", [("TinyMLP", (2, 64)), ("TinyCNN", (2, 3, 16, 16))])
def test_default_table_fits_120_columns_and_never_cuts_words(name, shape):
    rep = fxamp.report(getattr(models, name)(), example_inputs=torch.randn(shape))
    text = rep.to_table()
    assert max(len(line) for line in text.splitlines()) <= 120
    words = {w.strip(":;,()") for w in " ".join(r.reason for r in rep.rows).split()}
    start = text.index("----")
    body = text[start:text.index("\n\n", start)].splitlines()
    spans = [m.span() for m in re.finditer(r"-+", body[0])]
    a, b = spans[3]  # the reason column
    for line in body[1:]:
        if line.startswith(("*:", "reasons shortened", "(")):
            break
        assert all(w.strip(":;,()") in words for w in line[a:b].split()), line
    assert "…" not in text


# ---------------------------------------------------------------------------------------------
# the report is what convert does
# ---------------------------------------------------------------------------------------------


def test_report_agrees_with_what_runs():
    torch.manual_seed(0)
    model = models.TinyMLP()
    rep = fxamp.report(model, example_inputs=_mlp_input(), dtype=torch.float16)
    with OpDtypes() as rec:
        fxamp.convert(model, "O1", dtype=torch.float16)(_mlp_input())
    matmuls = rec.of("addmm", "mm", "linear")
    assert len(matmuls) == sum(r.op.endswith("linear") for r in rep.rows) == 3
    assert all(set(c.inputs) == {torch.float16} for c in matmuls)
    (ls,) = rec.of("_log_softmax")
    assert ls.inputs == (torch.float32,) and rep["log_softmax"].compute == "float32"


def test_report_matches_decisions_of_convert(block):
    gm = fxamp.convert(block, "O2")
    decisions = [decision_of(n) for n in gm.graph.nodes if decision_of(n)]
    rep = fxamp.report(block, policy="O2")
    assert [(r.category, r.reason) for r in rep.rows] == [(d.category, d.reason) for d in decisions]
    assert rep.summary.casts == sum(cast_of(n) is not None for n in gm.graph.nodes)


def test_model_is_not_changed():
    torch.manual_seed(0)
    model = models.TinyCNN().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rep = fxamp.report(model, example_inputs=torch.randn(2, 3, 8, 8), policy="O2", dtype=torch.float16)
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in model.state_dict().items())
    assert rep["conv1_weight"].output_dtype == "float16"  # O2 stores it low, in its own copy
    assert model.conv1.weight.dtype == torch.float32


def test_report_of_a_converted_module():
    gm = fxamp.convert(models.TinyMLP(), "O2", dtype="bfloat16")
    rep = fxamp.report(gm, example_inputs=_mlp_input())
    assert rep.policy.startswith("O2 (params=bfloat16")
    assert rep["fc1_weight"].output_dtype == "bfloat16"
    assert [str(c) for c in rep["linear"].casts] == ["x→bf16"]  # the weights are stored in bfloat16
    with pytest.raises(ValueError, match="already converted"):
        fxamp.report(gm, example_inputs=_mlp_input(), policy="O1")


# ---------------------------------------------------------------------------------------------
# FLOPs, lints, diff
# ---------------------------------------------------------------------------------------------


def test_flops_conv_and_attention(block, block_input):
    torch.manual_seed(0)
    cnn = fxamp.report(models.TinyCNN(), example_inputs=torch.randn(2, 3, 8, 8), dtype=torch.float16)
    convs = [r for r in cnn.rows if r.op.endswith("conv2d")]
    assert [r.flops for r in convs] == [2 * (2 * 8 * 8 * 8) * 3 * 9, 2 * (2 * 16 * 4 * 4) * 8 * 9]
    rep = fxamp.report(block, example_inputs=block_input, dtype=torch.float16)
    sdpa = rep["scaled_dot_product_attention"]
    b, h, t, e = 2, 4, 8, 8
    assert sdpa.flops == 2 * b * h * t * t * (e + e) + 3 * b * h * t * t
    assert sdpa.compute == "float16" and sdpa.low_precision
    o0 = fxamp.report(models.TinyMLP(), example_inputs=_mlp_input(), policy="O0")
    assert o0.summary.low_share == 0.0 and o0.summary.casts == 0


def test_dtype_leak_lint(block, block_input):
    rep = fxamp.report(block, example_inputs=block_input)
    found = {(lint.kind, lint.node) for lint in rep.lints}
    assert found == {("param-promotion", "mul"), ("cast-down", "norm1"), ("cast-down", "norm2")}
    promo = next(lint for lint in rep.lints if lint.kind == "param-promotion")
    assert "gamma" in promo.message and "float32" in promo.message
    assert rep["mul"].compute == "float32"  # the branch the parameter promoted
    assert "dtype leaks (3):" in str(rep)
    # O2 keeps gamma (a layer scale, multiplied into the activations) float32, as autocast does, so the
    # promotion stays; O3 stores it in float16: none left.  The same lints are found without inputs.
    assert {lint.kind for lint in fxamp.report(block, example_inputs=block_input, policy="O2").lints} == {"cast-down",
                                                                                         "param-promotion"}
    assert "param-promotion" not in {lint.kind for lint in fxamp.report(block, example_inputs=block_input, policy="O3").lints}
    assert {(lint.kind, lint.node) for lint in fxamp.report(block).lints} == found


def test_diff_between_policies(block, block_input):
    diff = fxamp.compare(block, ("O1", "O2"), example_inputs=block_input, dtype=torch.float16)
    changed = {r.node: r for r in diff.rows}
    assert changed["qkv_weight"].output_a == "float32" and changed["qkv_weight"].output_b == "float16"
    assert "norm1" not in changed and "x" not in changed
    assert "mul" not in changed  # gamma stays float32 under O2 (it enters the activations directly)
    o3 = {r.node: r for r in fxamp.compare(block, ("O1", "O3"), example_inputs=block_input, dtype=torch.float16).rows}
    assert (o3["mul"].compute_a, o3["mul"].compute_b) == ("float32", "float16")
    assert diff.summary_b.casts < diff.summary_a.casts
    text = str(diff)
    assert "fp32 → fp16" in text and "A: O1" in text and "B: O2" in text
    assert json.loads(diff.to_json())["rows"]
    a = fxamp.report(block, example_inputs=block_input, dtype=torch.float16)
    assert not a.diff(a).rows
    with pytest.raises(ValueError, match="different graphs"):
        a.diff(fxamp.report(models.TinyMLP(), dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------

_DTYPE_LIST = {"type": "array", "items": {"type": "string"}}
_OPT_INT = {"type": ["integer", "null"]}
_CAST = {"type": "object", "required": ["node", "source", "dtype", "effective"],
         "properties": {"node": {"type": "string"}, "source": {"type": "string"}, "dtype": {"type": "string"},
                        "effective": {"type": ["boolean", "null"]}}}
_CATS = ["safe", "neutral", "conditional", "unsafe", "unlisted"]
REPORT_SCHEMA = {
    "type": "object",
    "required": ["version", "model", "policy", "frontend", "inputs", "rows", "summary", "lints", "notes"],
    "properties": {
        "version": {"type": "integer"},
        "model": {"type": "string"},
        "policy": {"type": "string"},
        "frontend": {"type": "string"},
        "inputs": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "array", "items": {"type": "string"}},
        "rows": {"type": "array", "items": {
            "type": "object",
            "required": ["node", "kind", "op", "module", "category", "resolved", "reason", "source", "input_dtypes",
                         "compute", "output_dtype", "output_shape", "casts", "flops"],
            "properties": {
                "node": {"type": "string"}, "kind": {"type": "string"}, "op": {"type": "string"},
                "module": {"type": "string"}, "category": {"enum": _CATS}, "resolved": {"enum": _CATS},
                "reason": {"type": "string"}, "source": {"type": "string"}, "input_dtypes": _DTYPE_LIST,
                "compute": {"type": "string"}, "output_dtype": {"type": "string"},
                "output_shape": {"type": ["array", "null"], "items": {"type": "integer"}},
                "casts": {"type": "array", "items": _CAST}, "flops": _OPT_INT,
            }}},
        "summary": {"type": "object",
                    "required": ["ops", "categories", "resolved", "casts", "weight_casts", "noop_casts", "flops",
                                 "low_flops", "low_share"],
                    "properties": {"ops": {"type": "integer"}, "casts": {"type": "integer"},
                                   "weight_casts": {"type": "integer"}, "noop_casts": _OPT_INT, "flops": _OPT_INT,
                                   "low_flops": _OPT_INT, "low_share": {"type": ["number", "null"]},
                                   "categories": {"type": "object", "required": _CATS},
                                   "resolved": {"type": "object"}}},
        "lints": {"type": "array", "items": {"type": "object", "required": ["kind", "node", "message"],
                                             "properties": {"kind": {"enum": ["param-promotion", "cast-down"]},
                                                            "node": {"type": "string"},
                                                            "message": {"type": "string"}}}},
    },
}

_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
               "number": (int, float), "integer": int}


def _validate(value, schema, path="$"):
    """The subset of JSON Schema used above: type, enum, required, properties, items."""
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(isinstance(value, _JSON_TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        assert ok, f"{path}: {value!r} is not {types}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _validate(item, schema["items"], f"{path}[{i}]")


@pytest.mark.parametrize("with_inputs", [True, False])
def test_json_schema(block, block_input, with_inputs):
    rep = fxamp.report(block, example_inputs=block_input if with_inputs else None, dtype=torch.float16)
    data = json.loads(rep.to_json())
    _validate(data, REPORT_SCHEMA)
    assert len(data["rows"]) == len(rep)
    assert data["inputs"] == (["2,8,32:float32"] if with_inputs else [])
    row = next(r for r in data["rows"] if r["node"] == "linear")
    assert row["casts"][1] == {"node": row["casts"][1]["node"], "source": "qkv.weight", "dtype": "float16",
                               "effective": True if with_inputs else None}
    assert data["summary"]["categories"]["safe"] == 5


def test_json_schema_rejects_garbage():
    with pytest.raises(AssertionError):
        _validate({"version": 1}, REPORT_SCHEMA)


def test_csv(mlp_report):
    records = list(csv.DictReader(io.StringIO(mlp_report.to_csv())))
    assert list(records[0]) == CSV_COLUMNS + RECOMPUTE_COLUMNS  # (a float32 island: its log-softmax)
    nodes = [r for r in records if r["record"] == "node"]
    assert [r["node"] for r in nodes] == [r.node for r in mlp_report.rows]
    linear = next(r for r in nodes if r["node"] == "linear")
    assert (linear["category"], linear["compute"], linear["output_dtype"], linear["output_shape"]) == \
        ("safe", "float16", "float16", "2x128")
    assert linear["casts"] == "x->float16 fc1.weight->float16 fc1.bias->float16"
    summary = {r["node"]: r["value"] for r in records if r["record"] == "summary"}
    assert summary["ops"] == "6" and summary["casts"] == "8" and summary["category.safe"] == "3"


def test_only_and_lookup(mlp_report):
    only = mlp_report.only("conditional", "unsafe")
    assert [r.node for r in only] == ["log_softmax"]
    assert only.summary == mlp_report.summary
    with pytest.raises(ValueError, match="not a category"):
        mlp_report.only("risky")
    with pytest.raises(KeyError, match="no node 'nope'"):
        mlp_report["nope"]


# ---------------------------------------------------------------------------------------------
# options, leaf modules, errors
# ---------------------------------------------------------------------------------------------


def test_bfloat16_and_overrides():
    rep = fxamp.report(models.TinyMLP(), example_inputs=_mlp_input(), policy="O1", dtype="bfloat16",
                       overrides={torch.nn.functional.relu: "unsafe"})
    assert rep["linear"].compute == "bfloat16"
    relu = rep["relu"]
    assert (relu.category.value, relu.compute, relu.source) == ("unsafe", "float32", "override")


def test_leaf_modules_run_whole():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(8, 8, batch_first=True)
            self.mlp = models.TinyMLP(8, 8, 4)

        def forward(self, x):
            h, _ = self.rnn(x)
            return self.mlp(h)

    rep = fxamp.report(Net(), example_inputs=torch.randn(2, 3, 8), leaf_modules=["mlp"], dtype=torch.float16)
    rnn = next(r for r in rep.rows if r.module == "rnn")
    assert (rnn.kind, rnn.category.value, rnn.compute) == ("call_module", "safe", "float16")
    assert [str(c) for c in rnn.casts] == ["rnn.*→fp16"]  # weights cast inside call_module_cast
    mlp = rep["mlp"]
    assert (mlp.category.value, mlp.compute, mlp.output_dtype) == ("unlisted", "float32", "float32")
    assert mlp.flops >= 2 * 6 * (8 * 8 + 8 * 8 + 4 * 8)  # built of linears: not just its output size


def test_example_kwargs_and_input_count():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, shift: float = 0.0):
            return self.fc(x) + shift

    rep = fxamp.report(Two(), example_inputs=torch.randn(2, 4), dtype=torch.float16)
    assert rep["linear"].compute == "float16"
    with pytest.raises(ValueError, match="forward takes 2 inputs .*3 example inputs"):
        fxamp.report(Two(), example_inputs=(torch.randn(2, 4), torch.randn(1), torch.randn(1)), dtype=torch.float16)


def test_run_failure_names_the_node():
    with pytest.raises(fxamp.FxampError, match=r"failed at node linear \(torch.nn.functional.linear in fc1\).*"
                                               r"mat1 and mat2 shapes cannot be multiplied"):
        fxamp.report(models.TinyMLP(), example_inputs=torch.randn(2, 63))


@pytest.mark.parametrize("name", [m.__name__ for m in models.MODELS])
def test_each_example_model(name):
    cls = getattr(models, name)
    x = torch.randint(0, 2, (2, 6)) if name == "TinyLM" else {
        "TinyMLP": torch.randn(2, 64), "TinyCNN": torch.randn(2, 3, 8, 8),
        "TinyTransformerBlock": torch.randn(2, 6, 32)}[name]
    model = cls()
    assert model(x).dtype == torch.float32  # runnable as it is
    rep = fxamp.report(model, example_inputs=x, dtype=torch.float16)
    assert rep.summary.low_share > 0.9
    assert all(r.compute in ("float16", "float32", "-") for r in rep.rows if r.is_op)


def test_the_idle_cast_legend_shows_a_cast_of_this_report():
    """The legend of ``(a→dtype)`` names the dtype of a cast the table shows, not a fixed float16."""
    from models import TinyTransformerBlock

    text = str(fxamp.report(TinyTransformerBlock(), example_inputs=(torch.randn(2, 8, 32),), dtype=torch.bfloat16))
    assert "(x→fp32)" in text  # the input cast in front of norm1: already float32
    assert "(a→fp32): a run-time checked cast that changed nothing for these inputs" in text
    assert "a→fp16" not in text


class _Block(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.a, self.b = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.a(x)
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            y = checkpoint(self.b, h, use_reentrant=False)
        else:
            y = self.b(h)
        return y.softmax(-1)


def test_a_checkpointed_block_is_reported_op_by_op_as_without_checkpointing():
    """The report inlines kept checkpoints (in its own copy): the same rows as the unchecked model."""
    def table(rep):  # by node: a parameter read may stand elsewhere in the inlined graph
        return {r.node: (r.op, r.module, r.resolved.value, r.input_dtypes, r.compute, r.output_dtype,
                         tuple(str(c) for c in r.casts)) for r in rep.rows}

    x = torch.randn(2, 8)
    plain = fxamp.report(_Block(False), example_inputs=(x,), dtype=torch.bfloat16)
    kept = fxamp.report(_Block(True), example_inputs=(x,), dtype=torch.bfloat16)
    assert any("activation checkpointing at" in n and "kept" in n for n in kept.notes)
    assert table(kept) == table(plain)
    amp = fxamp.convert(_Block(True), "O1", dtype=torch.bfloat16)
    assert table(fxamp.report(amp)) == table(fxamp.report(fxamp.convert(_Block(False), "O1", dtype=torch.bfloat16)))
    out = amp(x)  # the converted module itself still checkpoints: the report inlined a copy
    assert "checkpointed" in amp.code and torch.isfinite(out).all()
