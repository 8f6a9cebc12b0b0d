"""Issue 11 on the real-model suite: ``fxamp.report(..., numerics=True)`` measures the final output's
SQNR as the end-to-end SQNR measured directly (to 0.1 dB), on architectures nobody here wrote."""

from __future__ import annotations

import math

import pytest
import torch

import fxamp
import rm_checks
from rm_models import REGISTRY, available, build

pytestmark = pytest.mark.usefixtures("one_thread")

#: (model, policy); the first two run by default, the rest with the slow set
CASES = [("gpt2", "O1"), ("conv-bn-relu", "O2"), ("bert", "O2"), ("t5", "O1"),
         ("nn.TransformerEncoder-in-model", "O1"), ("nn.LSTM", "O2")]


@pytest.mark.parametrize("name,policy", [pytest.param(n, p, marks=() if i < 2 else pytest.mark.slow)
                                         for i, (n, p) in enumerate(CASES)])
def test_report_output_sqnr_matches_end_to_end(name, policy):
    entry = REGISTRY[name]
    why = available(entry)
    if why:
        pytest.skip(why)
    dtype = torch.bfloat16
    model = build(entry).eval()
    args, kwargs = entry.inputs(0)
    rep = fxamp.report(model, policy, example_inputs=args, dtype=dtype, example_kwargs=kwargs, numerics=True,
                       frontend=entry.frontend, **entry.convert_kwargs)
    amp = rm_checks.convert(entry, model, policy, dtype).eval()
    with torch.no_grad():
        direct = fxamp.reporting.numerics.sqnr(model(*args, **kwargs), amp(*args, **kwargs))
    measured = rep.numerics_summary.output_sqnr_db
    assert math.isfinite(direct) and direct > 10, direct
    assert measured == pytest.approx(direct, abs=0.1), (measured, direct)
