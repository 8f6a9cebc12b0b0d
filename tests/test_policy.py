import pytest
import torch

import fxamp
from fxamp.policy import Policy, default_dtype, device_type_of, resolve_policy


@pytest.mark.parametrize("name,expected", [
    ("O0", "params=float32,compute=float32,unsafe=float32,norms=float32,output=float32"),
    ("O1", "params=float32,compute=float16,unsafe=float32,norms=float32,output=float32"),
    ("O2", "params=float16,compute=float16,unsafe=float32,norms=float32,output=float32"),
    ("O3", "params=float16,compute=float16,unsafe=float16,norms=float16,output=float32"),
])
def test_presets_print_and_parse_back(name, expected):
    policy = Policy.parse(name, torch.float16)
    assert str(policy) == expected
    assert Policy.parse(str(policy)) == policy
    assert resolve_policy(expected) == policy


def test_bfloat16_and_shorthands():
    assert Policy.parse("o2", "bf16") == Policy.parse("params=bfloat16,compute=bfloat16")
    assert resolve_policy("O1", torch.bfloat16).compute == torch.bfloat16
    assert resolve_policy("O3", "float16", keep_norms_fp32=True).norms == torch.float32
    assert Policy.parse("compute=bf16,output=keep").output is None
    assert "output=keep" in str(Policy.parse("compute=bf16,output=keep"))


def test_policy_parse_takes_every_string_convert_takes():
    # one parser: Policy.parse("O2") used to be "cannot parse 'O2'" although convert(model, "O2") works
    for text in ("O2", "o1", "O3", "O2,float8=rowwise", "O2,output=keep", "params=float32,compute=bf16"):
        assert Policy.parse(text) == resolve_policy(text)
    assert Policy.parse("O2") == Policy.parse("O2", torch.bfloat16)  # autocast's CPU default, as convert
    assert Policy.parse("O2", "float16") == Policy.parse("O2", torch.float16)
    assert Policy.parse("O2", device_type="cuda").params == torch.float16
    assert Policy.parse("O3", keep_norms_fp32=True).norms == torch.float32
    assert Policy.parse("O2,float8=rowwise") == Policy.parse("O2", "bf16").replace(float8="rowwise")
    with pytest.raises(ValueError, match="unknown policy 'O4'; use one of O0, O1, O2, O3"):
        Policy.parse("O4")
    with pytest.raises(ValueError, match="contradicts compute=bfloat16"):
        Policy.parse("compute=bfloat16", "float16")
    with pytest.raises(TypeError, match="policy must be a Policy or a string"):
        Policy.parse(2)


def test_policy_is_frozen():
    with pytest.raises(Exception):
        Policy.parse("O1").compute = torch.bfloat16


@pytest.mark.parametrize("bad,match", [
    ("O4", "unknown policy 'O4'; use one of O0, O1, O2, O3"),
    ("params=float16,compute=bfloat16", "mixes float16 and bfloat16"),
    ("params=float16,compute=float32", "compute=float32 but stores or runs something in float16"),
    ("compute=int8", "compute='int8' is not a dtype fxamp understands"),
    ("params=float32", "does not say compute="),
    ("compute=float16,speed=fast", "cannot parse 'speed=fast'"),
    ("compute=float16,compute=float16", "sets compute twice"),
])
def test_invalid_policies_name_the_bad_value(bad, match):
    with pytest.raises(ValueError, match=match):
        resolve_policy(bad)


def test_invalid_dtype_and_combinations():
    with pytest.raises(ValueError, match="not a low-precision dtype"):
        resolve_policy("O1", torch.float32)
    with pytest.raises(ValueError, match="float64 is not supported"):
        resolve_policy("O1", torch.float64)
    with pytest.raises(ValueError, match="keep_norms_fp32 only applies to O3"):
        resolve_policy("O2", keep_norms_fp32=True)
    with pytest.raises(ValueError, match="contradicts"):
        resolve_policy("params=float32,compute=float16", "bfloat16")
    with pytest.raises(TypeError, match="policy must be a Policy or a string"):
        resolve_policy(2)
    with pytest.raises(ValueError, match="unknown policy"):
        fxamp.convert(torch.nn.Linear(2, 2), "fast")


def test_a_preset_without_dtype_takes_autocasts_default_for_the_device():
    assert resolve_policy("O1").compute == torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert resolve_policy("O2", device_type="cuda").params == torch.float16  # autocast's CUDA default
    assert resolve_policy("O1", "float16").compute == torch.float16  # an explicit dtype wins
    assert default_dtype("cpu") == (torch.bfloat16, "dtype=bfloat16 (autocast's default on cpu; pass dtype= to choose)")
    assert default_dtype("meta") == (torch.float16, "dtype=float16 (autocast has no default on meta; pass dtype= "
                                                    "to choose)")
    assert device_type_of(torch.nn.Linear(2, 2)) == "cpu" and device_type_of(torch.nn.ReLU()) == "cpu"
    assert device_type_of(torch.nn.Linear(2, 2, device="meta")) == "meta"


# -- float8 ------------------------------------------------------------------------------------------

from fxamp.policy import Float8, Float8Cost, Float8Recipe  # noqa: E402


@pytest.mark.parametrize("text,recipe,pow2,cost", [
    ("tensorwise", Float8Recipe.TENSORWISE, False, Float8Cost.AUTO),
    ("rowwise", Float8Recipe.ROWWISE, True, Float8Cost.AUTO),  # torchao's rowwise default: power-of-two scales
    ("rowwise_with_gw_hp:always", Float8Recipe.ROWWISE_WITH_GW_HP, True, Float8Cost.ALWAYS),
    ("tensorwise:pow2:always", Float8Recipe.TENSORWISE, True, Float8Cost.ALWAYS),
    ("rowwise:nopow2", Float8Recipe.ROWWISE, False, Float8Cost.AUTO),
])
def test_float8_spellings_parse_and_print_back(text, recipe, pow2, cost):
    f8 = Float8.parse(text)
    assert (f8.recipe, f8.power_of_two, f8.cost) == (recipe, pow2, cost)
    assert str(f8) == text and Float8.parse(str(f8)) == f8
    assert Float8.parse(f"{recipe.value}:{'pow2' if pow2 else 'nopow2'}:{cost.value}") == f8  # defaults spelled out


def test_a_preset_takes_float8_after_it_and_the_policy_prints_and_parses_back():
    policy = resolve_policy("O2,float8=rowwise", "bf16")
    assert policy == Policy.parse("O2", "bf16").replace(float8="rowwise")
    assert str(policy).endswith(",output=float32,float8=rowwise")
    assert Policy.parse(str(policy)) == policy
    assert Policy(compute="bf16", float8=Float8()).float8 == Float8.parse("tensorwise")
    assert "float8" not in str(Policy.parse("O2", "bf16"))  # no float8: the string is as before
    assert resolve_policy("O1,float8=tensorwise", "bf16").params == torch.float32
    # without dtype=, float8 picks bfloat16 even where autocast's default is float16 (CUDA)
    assert resolve_policy("O2,float8=tensorwise", device_type="cuda").compute == torch.bfloat16


@pytest.mark.parametrize("text,dtype,match", [
    ("O2,float8=tensorwise", "float16", "there is no float8 recipe with float16"),
    ("O0,float8=tensorwise", "bf16", "needs compute=bfloat16, not float32"),
    ("O2,float8=int8", "bf16", "'int8' is not a float8 recipe; use one of 'tensorwise', 'rowwise'"),
    ("O2,float8=rowwise:fast", "bf16", "unknown flag 'fast'"),
    ("O2,float8=rowwise:pow2:nopow2", "bf16", "sets pow2 twice"),
    ("O2,float8=rowwise,float8=tensorwise", "bf16", "sets float8 twice"),
    ("O2,speed=fast", "bf16", "Policy has no field speed"),
    ("O2,rowwise", "bf16", "write key=value parts"),
])
def test_bad_float8_policies_are_one_clear_error(text, dtype, match):
    with pytest.raises(ValueError, match=match):
        resolve_policy(text, dtype)


def test_float8_fields_are_checked_at_construction():
    assert Float8("rowwise", cost="always") == Float8.parse("rowwise:always")  # a field, or its name
    assert Policy(params=torch.bfloat16, compute="bfloat16", float8="rowwise") == Policy.parse("O2,float8=rowwise")
    with pytest.raises(ValueError, match="Float8's recipe must be one of 'tensorwise', 'rowwise', "
                                         "'rowwise_with_gw_hp', not 'int8'"):
        Float8("int8")
    with pytest.raises(TypeError, match=r"Policy's float8 must be a Float8, its name \(such as 'rowwise'\) or None, "
                                        r"not 8"):
        Policy(compute="bf16", float8=8)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16", "torch.bfloat16", torch.bfloat16])
def test_the_constructor_takes_dtypes_or_their_names(spelling):
    """One factory (parse, for strings); the constructor takes the fields, each a dtype or its name (issue 38)."""
    assert Policy(params=spelling, compute=spelling) == Policy.parse("O2", "bf16") == Policy.parse("params=bf16,compute=bf16")
    with pytest.raises(TypeError, match=r"Policy's compute must be a torch.dtype or its name \(such as 'bf16'\), not 16"):
        Policy(compute=16)
    with pytest.raises(ValueError, match=r"compute='fp8' is not a dtype fxamp understands; use a torch dtype or one of "
                                         r"\['bf16', 'bfloat16'"):
        Policy(compute="fp8")


def test_the_older_factories_warn_and_name_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"Policy.of\(...\) is deprecated and kept for one release: write "
                                                r"Policy\(...\)"):
        assert Policy.of(compute="bf16") == Policy(compute=torch.bfloat16)
    with pytest.warns(DeprecationWarning, match=r"Policy.from_preset\(name, dtype\) is deprecated .*: write "
                                                r"Policy.parse\(name, dtype\)"):
        assert Policy.from_preset("O2") == Policy.parse("O2", torch.float16)  # its default stays float16


def test_keep_norms_fp32_with_a_policy_object_is_never_ignored():
    # issue 37 probe: convert(model, Policy.parse("O3"), keep_norms_fp32=True) ran the norms in bfloat16, silently
    o3 = Policy.parse("O3", "bf16")
    with pytest.raises(ValueError, match=r"keep_norms_fp32=True with a Policy whose norms=bfloat16: .*"
                                         r"policy\.replace\(norms='float32'\)"):
        resolve_policy(o3, keep_norms_fp32=True)
    kept = o3.replace(norms="float32")
    assert resolve_policy(kept, keep_norms_fp32=True) is kept
