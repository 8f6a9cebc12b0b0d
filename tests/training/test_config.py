"""fxamp.training.config on its own: config_for over every loss_scale= form, LossScaleConfig(...)/parse, compute_dtype."""

import dataclasses

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import LossScaleConfig
from fxamp.training.config import OPTIONS, ScaleKind, compute_dtype, config_for
from fxamp.training.loss_scale import LossScaler, scaler_for

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
VALID = (r"'auto', 'dynamic', 'none', 'static:<scale>' \(e\.g\. 'static:1024'\) or the scale itself \(1024\.0\), "
         r"a LossScaleConfig, or a LossScaler")


# --------------------------------------------------------------------------- config_for: accepted forms

@pytest.mark.parametrize("low, kind", [(F16, ScaleKind.DYNAMIC), (None, ScaleKind.DYNAMIC),
                                       (BF16, ScaleKind.NONE), (F32, ScaleKind.NONE)])
def test_auto_scales_only_for_float16_or_unknown(low, kind):
    cfg = config_for("auto", low)
    assert cfg.kind is kind
    assert cfg == (LossScaleConfig("dynamic") if kind is ScaleKind.DYNAMIC else LossScaleConfig("none"))
    assert cfg.init_scale == (2.0**16 if kind is ScaleKind.DYNAMIC else 1.0)


@pytest.mark.parametrize("low", [F16, BF16, F32, None])
def test_named_forms_ignore_the_compute_dtype(low):
    assert config_for("dynamic", low) == LossScaleConfig()
    assert config_for("none", low) == LossScaleConfig("none")
    static = config_for("static:1024", low)
    assert static.kind is ScaleKind.STATIC and static.init_scale == 1024.0 and isinstance(static.init_scale, float)
    assert config_for("static:0.5", low).init_scale == 0.5
    assert str(static) == "static(1024)"


def test_a_config_is_returned_as_it_is():
    cfg = LossScaleConfig("dynamic", init_scale=2.0**10, hysteresis=3)
    assert config_for(cfg, BF16) is cfg  # not replaced by "auto"'s none for bfloat16
    none = LossScaleConfig("none")
    assert config_for(none, F16) is none


def test_a_shared_scaler_is_shared_not_parsed():
    """config_for takes everything but a shared scaler; scaler_for hands that one back as it is, unowned."""
    shared = LossScaler(LossScaleConfig("static", 64.0))
    scaler, owned = scaler_for(shared)
    assert scaler is shared and owned is False
    with pytest.raises(TypeError, match=r"\(LossScaler\) is not accepted; use " + VALID):
        config_for(shared, F16)
    own, owned = scaler_for("static:8")
    assert owned is True and own is not shared and own.scale == 8.0


# --------------------------------------------------------------------------- config_for: refused forms

@pytest.mark.parametrize("option, match", [
    (None, r"^loss_scale=None is not accepted: write loss_scale='none' \(no scaling; non-finite gradients still "
           r"skip the step\)\. Valid forms: " + VALID),
    (True, r"^loss_scale=True \(bool\) is not accepted; use " + VALID),
    (False, r"^loss_scale=False \(bool\) is not accepted"),
    (b"none", r"^loss_scale=b'none' \(bytes\) is not accepted"),
    (ScaleKind.DYNAMIC, None),  # a ScaleKind is a str: parsed as its value
])
def test_non_strings_are_refused_naming_the_form_to_write(option, match):
    if match is None:
        assert config_for(option, F16) == LossScaleConfig("dynamic")
        return
    with pytest.raises(TypeError, match=match):
        config_for(option, F16)


@pytest.mark.parametrize("number", [128, 1024.0, 0.25])
def test_a_number_is_a_static_scale(number):
    assert config_for(number, F16) == LossScaleConfig("static", float(number))
    assert config_for(number, torch.bfloat16).kind == ScaleKind.STATIC  # (not "auto"'s none for bfloat16)


@pytest.mark.parametrize("number", [0, -1.0, float("inf"), float("nan")])
def test_a_number_that_is_no_scale_is_refused(number):
    with pytest.raises(ValueError, match=r"^loss_scale=" + repr(number) + r": a number is a static loss scale, "
                                         r"finite and > 0 \(e\.g\. 128\.0\); or use " + VALID):
        config_for(number, F16)


@pytest.mark.parametrize("text", ["static:", "static:abc", "static:-1", "static:0", "static:inf", "static:nan",
                                  "bogus", "", "Dynamic", "dynamic:2", "none:1", "auto:1", "static", " none"])
def test_bad_strings_are_refused_quoting_the_text(text):
    with pytest.raises(ValueError, match=r"^loss_scale=" + repr(text).replace("\\", "\\\\") +
                       r" is not understood; use " + VALID):
        config_for(text, F16)


def test_options_text_lists_every_form():
    for word in ("'auto'", "'dynamic'", "'none'", "'static:<scale>'", "LossScaleConfig", "LossScaler"):
        assert word in OPTIONS


# --------------------------------------------------------------------------- LossScaleConfig(...) / parse

def test_the_constructor_picks_the_scale_per_kind_and_normalises():
    dyn = LossScaleConfig()
    assert dyn == LossScaleConfig() and dyn.kind is ScaleKind.DYNAMIC and dyn.init_scale == 2.0**16
    none = LossScaleConfig("none")
    assert none.kind is ScaleKind.NONE and none.init_scale == 1.0 and str(none) == "none"
    st = LossScaleConfig(ScaleKind.STATIC, 512)
    assert st.kind is ScaleKind.STATIC and st.init_scale == 512.0 and type(st.init_scale) is float
    assert LossScaleConfig("dynamic", 1024, hysteresis=2) == LossScaleConfig(
        kind=ScaleKind.DYNAMIC, init_scale=1024.0, hysteresis=2)
    # the string and the enum are one kind
    assert LossScaleConfig("static", 2.0) == LossScaleConfig("static", 2.0)
    assert ScaleKind("static") is ScaleKind.STATIC and str(ScaleKind.NONE) == "none"


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("adaptive",), {}, ValueError, r"kind='adaptive' is not a loss scale kind; use one of 'dynamic', 'static', 'none'"),
    (("static",), {}, ValueError, r"a static loss scale needs init_scale=<the scale>"),
    (("none", 2.0), {}, ValueError, r"init_scale=2\.0 with kind='none'; the 'none' scale is 1"),
    (("static", True), {}, ValueError, r"init_scale=True must be a finite number > 0"),
    (("static", -1.0), {}, ValueError, r"init_scale=-1\.0 must be a finite number > 0"),
    (("static", "8"), {}, ValueError, r"init_scale='8' must be a finite number > 0"),
    (("dynamic",), dict(init_scale=0.5), ValueError, r"init_scale=0\.5 is outside \[min_scale, max_scale\]"),
    (("dynamic",), dict(hysteresis=True), ValueError, r"hysteresis=True must be an int >= 1"),
    (("dynamic",), dict(backoff_factor=0.0), ValueError, r"backoff_factor=0\.0 must be in \(0, 1\)"),
    (("dynamic",), dict(growth_factor=float("inf")), ValueError, r"growth_factor=inf must be a finite number > 1"),
    (("dynamic",), dict(min_scale=-1.0), ValueError, r"need 0 <= min_scale <= max_scale"),
    (("dynamic",), dict(bogus=1), TypeError, r"bogus"),
])
def test_the_constructor_validates(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScaleConfig(*args, **kwargs)


def test_static_scale_need_not_lie_in_the_dynamic_range():
    """min_scale/max_scale bound only a dynamic scale."""
    assert LossScaleConfig("static", 0.5).init_scale == 0.5
    assert LossScaleConfig("static", 2.0**30).init_scale == 2.0**30


def test_the_constructor_takes_the_kind_by_name_and_the_named_constructors_warn():
    """One factory, parse (for the string form); the constructor takes the fields, the kind by name (issue 38)."""
    cfg = LossScaleConfig(kind="static", init_scale=4)
    assert cfg == LossScaleConfig(ScaleKind.STATIC, 4.0) and cfg.kind is ScaleKind.STATIC and type(cfg.init_scale) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kind = ScaleKind.NONE
    with pytest.warns(DeprecationWarning, match=r"LossScaleConfig.of\(...\) is deprecated and kept for one release: "
                                                r"write LossScaleConfig\(...\)"):
        assert LossScaleConfig.of("static", 4) == cfg
    for call, old, new in ((lambda: LossScaleConfig.static(4), r"static\(scale\)", r'"static", scale'),
                           (lambda: LossScaleConfig.dynamic(init_scale=8.0), r"dynamic\(...\)", r'"dynamic", ...'),
                           (lambda: LossScaleConfig.none(), r"none\(\)", r'"none"')):
        with pytest.warns(DeprecationWarning, match=rf"LossScaleConfig.{old} is deprecated .*: write LossScaleConfig\({new}\)"):
            assert call() in (cfg, LossScaleConfig("dynamic", init_scale=8.0), LossScaleConfig("none"))


def test_parse_round_trips_the_shorthands():
    assert LossScaleConfig.parse("static:1e3") == LossScaleConfig("static", 1000.0)
    assert LossScaleConfig.parse("dynamic") == LossScaleConfig("dynamic")
    assert LossScaleConfig.parse("none") == LossScaleConfig("none")
    with pytest.raises(ValueError, match=r"loss_scale='auto' is not understood"):
        LossScaleConfig.parse("auto")  # "auto" needs the compute dtype: config_for's


# --------------------------------------------------------------------------- compute_dtype

def _params(*dtypes):
    return [torch.zeros(2, dtype=d) for d in dtypes]


@pytest.mark.parametrize("dtypes, want", [
    ((F16,), F16), ((BF16,), BF16), ((F32,), None), ((), None),
    ((F32, BF16), BF16), ((BF16, F16, F32), F16),  # float16 wins: it is the one that needs a scale
    ((torch.float64,), None),
])
def test_compute_dtype_from_params(dtypes, want):
    assert compute_dtype(None, _params(*dtypes)) is want
    assert compute_dtype(nn.Linear(2, 2), _params(*dtypes)) is want  # an unconverted model: the params decide


def test_compute_dtype_reads_the_models_policy_first():
    """O1 keeps float32 parameters but computes in bfloat16: "auto" follows the policy, not the parameters."""
    torch.manual_seed(0)
    amp = fxamp.convert(nn.Sequential(nn.Linear(4, 4)), "O1", dtype="bf16", example_inputs=(torch.randn(2, 4),))
    params = list(amp.parameters())
    assert {p.dtype for p in params} == {F32}
    assert compute_dtype(None, params) is None
    assert compute_dtype(amp, params) is BF16
    assert compute_dtype(amp, _params(F16)) is BF16  # the policy beats float16 parameters

    class Wrapper(nn.Module):  # DDP keeps the converted model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert compute_dtype(Wrapper(amp), []) is BF16
    # and so "auto" through scaler_for: no scaling for a bfloat16 policy, dynamic for float16 parameters
    assert scaler_for("auto", amp, params)[0].config == LossScaleConfig("none")
    assert scaler_for("auto", None, _params(F16))[0].config == LossScaleConfig("dynamic")
