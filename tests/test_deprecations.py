"""The spellings this release deprecates still work, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import fxamp


#: the previous release's fxamp.__all__ (49 names): every one still resolves
OLD_ALL = ("convert", "convert_", "release_originals", "LazyConverted", "policy_of", "conversion_info", "ConversionInfo",
           "clear_cast_cache", "ConvertOptions", "DebugOverflow", "Dynamic", "classify", "Decision", "Policy", "Float8",
           "Float8Recipe", "Float8Cost", "Category", "OpEntry", "OpLists", "DEFAULT_OP_LISTS", "FxampError",
           "TraceError", "ConversionError", "LossScaleError", "OptimizerStateError", "MixedPrecisionOptimizer",
           "LeanConfig", "MasterPrecision", "StatePrecision", "initialize", "shard", "sharding_table",
           "sharded_state_dict", "load_sharded_state_dict", "LossScaler", "LossScaleConfig", "ScaleKind", "report",
           "compare", "Report", "Row", "PolicyDiff", "sqnr", "autotune", "save_overrides", "load_overrides",
           "overflow_info", "OverflowInfo")


@pytest.mark.parametrize("name", sorted(set(OLD_ALL) - set(fxamp.__all__)))
def test_a_name_that_left_the_top_level_still_resolves_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match=re.escape(f"fxamp.{name} is deprecated and kept for one release: "
                                                          f"write 'from fxamp.")) as caught:
        old = getattr(fxamp, name)
    module = re.search(r"write 'from (\S+) import " + re.escape(name) + "'", str(caught[0].message)).group(1)
    assert old is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'fxamp' has no attribute 'LossScalar'"):
        fxamp.LossScalar
    assert not hasattr(fxamp, "no_such_name")


# -- one argument order: (model, policy, *, example_inputs=...), as convert ------------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _rows(rep):
    return [(r.node, r.category, r.compute) for r in rep.rows]


def test_report_takes_the_policy_second_and_still_reads_the_old_order_with_a_warning():
    model, x = _mlp(), torch.randn(2, 8)
    new = fxamp.report(model, "O2", example_inputs=(x,))
    assert {r.compute for r in new.rows if r.category == "safe"} == {"bfloat16"}  # O2 read as the policy
    with pytest.warns(DeprecationWarning, match=re.escape("fxamp.report(model, example_inputs, policy) is deprecated "
                                                          "and kept for one release: write fxamp.report(model, "
                                                          "policy, example_inputs=...)")):
        old = fxamp.report(model, (x,), "O2")
    assert _rows(old) == _rows(new)
    with pytest.warns(DeprecationWarning, match="fxamp.report"):
        assert _rows(fxamp.report(model, x)) == _rows(fxamp.report(model, example_inputs=x))  # default O1
    with pytest.raises(TypeError, match="fxamp.report got inputs twice"):
        fxamp.report(model, (x,), "O2", example_inputs=(x,))
    with pytest.raises(TypeError, match=r"fxamp.report takes \(model, policy, \*, example_inputs=...\): pass the "
                                        r"inputs by keyword"):
        fxamp.report(model, "O2", (x,))


def test_compare_and_autotune_take_the_order_of_convert():
    model, x = _mlp(), torch.randn(2, 8)
    new = fxamp.compare(model, ("O1", "O3"), example_inputs=(x,))
    with pytest.warns(DeprecationWarning, match=re.escape("fxamp.compare(model, example_inputs, policies)")):
        old = fxamp.compare(model, (x,), ("O1", "O3"))
    assert str(old) == str(new) and new.rows
    batches = [(torch.randn(2, 8),)]
    _, overrides = fxamp.autotune(model, "O2", example_inputs=batches, dtype="fp16")
    with pytest.warns(DeprecationWarning, match=re.escape("fxamp.autotune(model, example_inputs, policy)")):
        assert fxamp.autotune(model, batches, "O2", dtype="fp16")[1] == overrides
    with pytest.warns(DeprecationWarning, match=re.escape("autotune(inputs=...) is deprecated")):
        assert fxamp.autotune(model, "O2", inputs=batches, dtype="fp16")[1] == overrides


def test_op_entry_takes_names_and_of_warns():
    from fxamp.conversion.op_lists import Category, OpEntry, Source

    entry = OpEntry("conditional", "my reason", condition="softmax", fallback="unsafe", source="override")
    assert (entry.category, entry.fallback, entry.source) == (Category.CONDITIONAL, Category.UNSAFE, Source.OVERRIDE)
    with pytest.raises(ValueError, match="'sure' is not a category; use one of safe, neutral"):
        OpEntry("sure", "my reason")
    with pytest.warns(DeprecationWarning, match=re.escape("OpEntry.of(...) is deprecated and kept for one release: "
                                                          "write OpEntry(...)")):
        assert OpEntry.of("unsafe", "my reason") == OpEntry(Category.UNSAFE, "my reason")


# -- the conversion's modules that became stage folders (issue 38) -------------------------------------------------

#: (old module, name) -> the module it is imported from now
OLD_CONVERSION_PATHS = {
    ("fxamp.conversion.classify", "classify"): "fxamp.conversion.classify.categories",
    ("fxamp.conversion.classify", "annotate"): "fxamp.conversion.pipeline",
    ("fxamp.conversion.classify", "unused_overrides"): "fxamp.conversion.classify.categories",
    ("fxamp.conversion.classify", "NodeOverrides"): "fxamp.conversion.options",
    ("fxamp.conversion.rewrite", "insert_casts"): "fxamp.conversion.rewrite.casts",
    ("fxamp.conversion.rewrite", "weight_cache_of"): "fxamp.conversion.rewrite.casts",
    ("fxamp.conversion.float8", "choose"): "fxamp.conversion.classify.float8",
    ("fxamp.conversion.float8", "COST_TABLES"): "fxamp.conversion.classify.float8",
    ("fxamp.conversion.float8", "REFUSE"): "fxamp.conversion.classify.overrides",
    ("fxamp.conversion.float8", "rewrite_float8"): "fxamp.conversion.rewrite.float8",
    ("fxamp.conversion.debug", "overflow_info"): "fxamp.conversion.rewrite.debug",
}


@pytest.mark.parametrize("old, name", sorted(OLD_CONVERSION_PATHS))
def test_a_conversion_name_at_its_old_module_resolves_with_a_warning_naming_the_new_one(old, name):
    new = OLD_CONVERSION_PATHS[old, name]
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old}.{name} is deprecated and kept for one release: "
                                                          f"write 'from {new} import {name}'")):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old, new, names", [
    ("fxamp.conversion.runtime", "fxamp.conversion.runtime.casts", ("cast", "cast_weights", "StorageCheck")),
    ("fxamp.conversion.recompute", "fxamp.conversion.runtime.recompute", ("island_on", "island_output", "Ref")),
    ("fxamp.conversion.float8", "fxamp.conversion.runtime.float8", ("float8_linear", "float8_einsum", "PLAIN")),
    ("fxamp.conversion.debug", "fxamp.conversion.rewrite.debug", ("OverflowMonitor", "OverflowInfo")),
])
def test_what_a_saved_graph_names_at_an_old_path_resolves_silently(old, new, names):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = [getattr(importlib.import_module(old), name) for name in names]
    assert values == [getattr(importlib.import_module(new), name) for name in names]


def test_an_unknown_name_at_an_old_conversion_path_is_an_attribute_error():
    for old in ("fxamp.conversion.classify", "fxamp.conversion.rewrite", "fxamp.conversion.float8", "fxamp.conversion.debug"):
        with pytest.raises(AttributeError, match=f"module '{re.escape(old)}' has no attribute 'nope'"):
            getattr(importlib.import_module(old), "nope")
