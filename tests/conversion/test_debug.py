"""Overflow attribution in training (issue 11, part 4): ``convert(..., debug_overflow="record")``."""

from __future__ import annotations

import pytest
import torch

import fxamp
import planted
from fxamp.conversion.rewrite.debug import MONITOR_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_names_first_forward_node(frontend):
    model, (x,) = planted.Overflows(), planted.batches(1)[0]
    amp = fxamp.convert(model, "O1", debug_overflow="record", example_inputs=(x,), frontend=frontend, dtype=torch.float16)
    out = amp(x)
    assert not torch.isfinite(out).all()
    info = fxamp.overflow_info(amp)
    assert info.forward == "mul_1 (operator.mul in energy)" if frontend == "fx" else info.forward.startswith("mul_1 (")
    assert info.forward_call == 1
    assert set(amp.state_dict()) == set(model.state_dict())


def test_names_first_backward_node():
    model, (x,) = planted.Healthy(), planted.batches(1)[0]
    amp = fxamp.convert(model, "O1", debug_overflow="record", dtype=torch.float16)
    amp(x)
    amp(x)
    out = amp(x)
    assert fxamp.overflow_info(amp).forward is None
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    ((out * weights).sum() * 1e7).backward()  # finite in float32 (softmax), past 65504 at the float16 head
    info = fxamp.overflow_info(amp)
    assert info.backward == "linear_1 (torch.nn.functional.linear in head)" and info.backward_call == 3
    assert "first inf/NaN in the backward: gradient of linear_1" in str(info)


def test_raise_mode():
    amp = fxamp.convert(planted.Overflows(), "O1", debug_overflow="raise", dtype=torch.float16)
    with pytest.raises(fxamp.FxampError, match=r"the output of mul_1 \(operator.mul in energy\) has inf/NaN"):
        amp(planted.batches(1)[0][0])


def test_off_by_default_costs_nothing():
    amp = fxamp.convert(planted.Healthy(), "O1")
    assert MONITOR_NAME not in amp.code and not hasattr(amp, MONITOR_NAME)
    with pytest.raises(ValueError, match="convert it with fxamp.convert\\(model, ..., debug_overflow='record'\\)"):
        fxamp.overflow_info(amp)
    dbg = fxamp.convert(planted.Healthy(), "O1", debug_overflow="record")
    x = planted.batches(1)[0][0]
    with torch.no_grad():
        assert torch.equal(dbg(x), amp(x))
