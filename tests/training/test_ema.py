"""An exponential moving average of an O2 model's weights (docs/training.md, "Averages"): torch's ``AveragedModel``
over the converted model averages its bfloat16 storage, where an update under half an ulp is lost and the average
stalls; the recipe the docs give, a float32 average of the masters (``opt.fp32_state_dict()``), is the average
of the weights the optimizer holds, as an autocast user's ``AveragedModel`` of float32 weights is."""

import copy

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fxamp

DECAY = 0.999


def test_the_masters_average_moves_and_averaging_the_bfloat16_model_stalls():
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    amp = fxamp.convert(copy.deepcopy(original), "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), model=amp)
    theirs = AveragedModel(amp, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    ema = copy.deepcopy(original).requires_grad_(False)  # the recipe: a float32 copy of the unconverted model
    ours = {k: v for k, v in ema.state_dict().items() if v.is_floating_point()}
    exact = {k: v.double() for k, v in ours.items()}  # the same average in float64, from the masters
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(amp(x.bfloat16()).float(), y))
        opt.step()
        theirs.update_parameters(amp)
        with torch.no_grad():
            masters = opt.fp32_state_dict()
            torch._foreach_lerp_(list(ours.values()), [masters[k] for k in ours], 1 - DECAY)
            for k, v in exact.items():
                v += (masters[k].double() - v) * (1 - DECAY)

    start = dict(original.state_dict())
    averaged = dict(theirs.module.state_dict())
    for k, want in exact.items():
        moved = float((want - start[k].double()).norm())
        assert moved > 1e-3 * float(want.norm()), k  # the average moved
        assert float((ours[k].double() - want).norm()) < 1e-3 * moved, k  # the recipe: float32 rounding only
        if want.dim() > 1:  # the weights stored in bfloat16: their average stays near the start
            assert averaged[k].dtype == torch.bfloat16
            assert float((averaged[k].double() - want).norm()) > 0.5 * moved, k
