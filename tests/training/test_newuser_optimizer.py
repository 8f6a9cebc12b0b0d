"""Unusual inputs a new user tried on the optimizer wrapper (issue 37, last criterion)."""
import pytest
import torch
import torch.nn as nn

import fxamp


def test_an_optimizer_class_instead_of_an_optimizer_is_refused_with_the_spelling():
    amp = fxamp.convert(nn.Linear(4, 4), "O2", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"not the class AdamW: build it first, e\.g\. AdamW\(model\.parameters\(\)\)"):
        fxamp.MixedPrecisionOptimizer(torch.optim.AdamW, model=amp)
