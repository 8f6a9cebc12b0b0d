"""A step of constant cost (issue 39): the ops ``step()`` dispatches (kernel launches on a GPU) do not grow with
the number of parameter tensors and stay within 4x GradScaler + fused AdamW's; at most 2 host reads a step.

Counted with :mod:`dispatch_count` around ``opt.step()`` after warm-up, on MLPs of 18 and 66 parameter tensors
(the plain step), and on parameters of a fixed total size cut into 16 or 64 tensors (the segmented step: its
ops grow with the runs, i.e. with the bytes, not with the tensors).
"""

import pytest
import torch
import torch.nn as nn

import fxamp
from dispatch_count import count, mlp, set_grads
from fxamp import MixedPrecisionOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
SIZES = (18, 66)


def _gradscaler_fused_adamw(tensors):
    model = mlp(tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 16)

    def prepare():
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()

    def step():
        scaler.step(opt)
        scaler.update()

    return count(step, prepare)


@pytest.fixture(scope="module")
def limit():
    """4x the ops of GradScaler + torch's fused AdamW (float32), itself constant in the number of tensors."""
    reference = [_gradscaler_fused_adamw(n) for n in SIZES]
    assert reference[0].ops == reference[1].ops and reference[0].host_reads == 0, reference
    return 4 * reference[0].ops


INNERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, weight_decay=1e-4),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3),
}


def _o2_step(tensors, inner, loss_scale):
    model = fxamp.convert(mlp(tensors), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(INNERS[inner](model.parameters()), model=model, loss_scale=loss_scale)
    x = torch.randn(4, 16, dtype=BF16)

    def prepare():
        opt.zero_grad()
        opt.backward(model(x).float().sum())

    return count(lambda: opt.step(), prepare)


@pytest.mark.parametrize("loss_scale", ["dynamic", "none"])
@pytest.mark.parametrize("inner", list(INNERS))
def test_the_o2_step_costs_the_same_at_18_and_66_tensors(inner, loss_scale, limit):
    small, large = (_o2_step(n, inner, loss_scale) for n in SIZES)
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= limit, small
    assert small.host_reads <= 2, small


def _segmented_step(tensors, inner, monkeypatch, total=2 ** 14, segment=2 ** 12):
    """bfloat16 parameters of ``total`` elements in ``tensors`` tensors, stepped in runs of ``segment`` elements."""
    from fxamp.training import step as S

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr(S, "SEGMENT_NUMEL", segment)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(total // tensors).to(BF16)) for _ in range(tensors)]
    opt = MixedPrecisionOptimizer(INNERS[inner](params), loss_scale="dynamic")
    token = torch.zeros((), requires_grad=True)

    def prepare():
        set_grads(params)
        opt.scale_loss(token)  # (the gradients are set: this marks them scaled)

    counted = count(lambda: opt.step(), prepare)
    assert opt.plan.runs is not None and len(opt.plan.runs) == total // segment  # it was segmented
    return counted


@pytest.mark.parametrize("inner", ["AdamW", "SGD-momentum"])
def test_the_segmented_step_costs_the_same_at_16_and_64_tensors_of_the_same_size(inner, monkeypatch, limit):
    small, large = (_segmented_step(n, inner, monkeypatch) for n in (16, 64))
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= 4 * 16, small  # 4 runs: a few ops each
    assert small.host_reads <= 2, small
