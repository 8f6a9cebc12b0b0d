"""The runner's own outcomes, one case each way (the probe's tests would pass vacuously if the runner misjudged)."""
import torch.nn as nn

import fxamp

from .runner import Cases, like_autocast

cases = Cases("selftest")


@cases.add("works")
def linear_o1_like_autocast():
    import torch

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    like_autocast(model, fxamp.convert(model, "O1", dtype=torch.bfloat16), torch.randn(3, 8))


@cases.add("refused")
def unknown_policy_is_refused():
    fxamp.convert(nn.Linear(2, 2), "O7")
