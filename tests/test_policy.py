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
    policy = Policy.from_preset(name)
    assert str(policy) == expected
    assert Policy.parse(str(policy)) == policy
    assert resolve_policy(expected) == policy


def test_bfloat16_and_shorthands():
    assert Policy.from_preset("o2", "bf16") == Policy.parse("params=bfloat16,compute=bfloat16")
    assert resolve_policy("O1", torch.bfloat16).compute == torch.bfloat16
    assert resolve_policy("O3", "float16", keep_norms_fp32=True).norms == torch.float32
    assert Policy.parse("compute=bf16,output=keep").output is None
    assert "output=keep" in str(Policy.parse("compute=bf16,output=keep"))


def test_policy_is_frozen():
    with pytest.raises(Exception):
        Policy.from_preset("O1").compute = torch.bfloat16


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
