"""``fxamp/dtypes.py``: the one dtype vocabulary (sets, names, parsing)."""

import pytest
import torch

from fxamp.dtypes import CASTABLE, LOW, NAMES, dtype_name, parse_dtype, short_name


def test_sets():
    assert LOW == (torch.float16, torch.bfloat16)
    assert CASTABLE == (torch.float32, torch.float16, torch.bfloat16)
    assert torch.float64 not in CASTABLE and set(LOW) < set(CASTABLE)
    assert set(NAMES.values()) == set(CASTABLE)


@pytest.mark.parametrize("text,dtype", [
    ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16), (" HALF ", torch.float16),
    ("torch.bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float", torch.float32),
    (torch.float32, torch.float32),
])
def test_parse_dtype_accepts_every_name(text, dtype):
    assert parse_dtype(text) is dtype


def test_parse_dtype_errors_name_the_option_and_the_valid_values():
    with pytest.raises(ValueError, match=r"compute='fp8' is not a dtype fxamp understands; use a torch dtype "
                                         r"or one of \['bf16', 'bfloat16', 'float', 'float16'"):
        parse_dtype("fp8", what="compute")
    with pytest.raises(ValueError, match=r"dtype=torch.float64 is not supported; use one of float32, float16, "
                                         r"bfloat16"):
        parse_dtype(torch.float64)
    with pytest.raises(ValueError, match=r"low='float32' is not a dtype.*\['bf16', 'bfloat16', 'float16', 'fp16', "
                                         r"'half'\]"):
        parse_dtype("float32", what="low", allowed=LOW)
    with pytest.raises(ValueError, match="is not a dtype fxamp understands"):
        parse_dtype(3)


def test_names():
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name("float16") == "float16"
    assert short_name(torch.float16) == "fp16" and short_name(torch.int64) == "i64"
    assert short_name("float16|float32") == "fp16|fp32"
    assert short_name(torch.complex64) == "complex64"  # no short name: the long one


@pytest.mark.parametrize("spellings,dtype", [
    (("bf16", "bfloat16", torch.bfloat16, "bf16-mixed"), torch.bfloat16),
    (("16", 16, "fp16", "float16", "half", torch.float16, "16-mixed"), torch.float16),
])
def test_every_dtype_option_reads_the_one_vocabulary(spellings, dtype):
    """Policy fields, presets' dtype=, masters=/state=, Lightning's and hf.prepare's dtype= all take each spelling."""
    from fxamp.integrations import resolve_dtype
    from fxamp.policy import Policy

    for spelling in spellings:
        assert resolve_dtype(spelling) is dtype  # Lightning's and hf.prepare's dtype=, with Lightning's own names
    for spelling in [s for s in spellings if isinstance(s, torch.dtype) or s in NAMES]:
        assert Policy.parse("O2", spelling).compute is dtype
        assert Policy.parse(f"compute={dtype_name(spelling)}").compute is dtype
    with pytest.raises(ValueError, match=r"dtype='fp8' is not a low-precision dtype fxamp trains in; use 'bf16'"):
        resolve_dtype("fp8")


def test_precision_enums_take_the_dtype_names_of_their_values():
    from fxamp.dtypes import dtype_member, spellings
    from fxamp.training.config import MasterPrecision, StatePrecision

    assert dtype_member(StatePrecision, "bfloat16") is StatePrecision.BF16
    assert dtype_member(MasterPrecision, torch.float32) is MasterPrecision.FP32
    assert dtype_member(MasterPrecision, "bf16") is None and dtype_member(StatePrecision, "int4") is None
    assert spellings(StatePrecision) == "'fp32' (float32), 'bf16' (bfloat16), 'int8', 'auto'"


def _str_enums():
    import enum
    import importlib
    import pathlib

    import fxamp

    root = pathlib.Path(fxamp.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(("fxamp",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if name.endswith(("integrations.lightning", "integrations.hf", "fxamp.lightning", "__main__")):
            continue  # import their framework; they define no enum
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, str) and issubclass(value, enum.Enum) and \
                    value.__module__ == name:
                found[f"{name}.{value.__name__}"] = value
    return found


def test_every_string_enum_takes_its_strings_and_dtype_valued_ones_every_dtype_spelling():
    enums = _str_enums()
    assert len(enums) >= 10, sorted(enums)
    for name, kind in enums.items():
        for member in kind:
            assert kind(member.value) is member and member == member.value, name
            dtype = NAMES.get({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(member.value, ""))
            if dtype is not None:  # a dtype by its short name: every other name of it too
                for spelling in [k for k, d in NAMES.items() if d is dtype] + [dtype, str(dtype)]:
                    assert kind(spelling) is member, (name, spelling)
