"""Complex parameters (a Fourier neural operator's spectral weights, complex64): MixedPrecisionOptimizer refused
them ("steps floating-point parameters only"), so such a model could not train with it at all.  They are stepped
directly, as float32 parameters are: conversion leaves them complex64, their gradients are unscaled and checked
for inf/NaN through a real view, and an overflowing step changes none of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp


class SpectralConv1d(nn.Module):
    def __init__(self, channels: int, modes: int):
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x):  # (B, C, N)
        x_ft = torch.fft.rfft(x)
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[..., :self.modes] = torch.einsum("bix,iox->box", x_ft[..., :self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


class FNO1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(2, 16)
        self.spectral = SpectralConv1d(16, 6)
        self.skip = nn.Conv1d(16, 16, 1)
        self.proj = nn.Linear(16, 1)

    def forward(self, x):  # (B, N, 2)
        h = self.lift(x).transpose(1, 2)
        h = F.gelu(self.spectral(h) + self.skip(h))
        return self.proj(h.transpose(1, 2))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 32, 2, generator=g), torch.randn(4, 32, 1, generator=g)


def _train(policy, steps=15, **options):
    torch.manual_seed(0)
    model = FNO1d()
    x, y = _data()
    if policy is None:
        opt, run = torch.optim.AdamW(model.parameters(), lr=3e-3), model
    else:
        run = fxamp.convert(model, policy, dtype=torch.bfloat16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(run.parameters(), lr=3e-3), model=run, **options)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(run(x).float(), y)
        opt.zero_grad()
        opt.backward(loss) if policy is not None else loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, run, opt


@pytest.mark.parametrize("policy,options", [("O1", {}), ("O2", {}), ("O2", {"masters": "stochastic", "state": "int8"})])
def test_complex_parameters_are_stepped_directly_as_float32_ones(policy, options):
    reference, _, _ = _train(None)
    losses, run, opt = _train(policy, **options)
    assert run.spectral.weight.dtype == torch.complex64
    assert losses[-1] < 0.9 * losses[0]  # (it trains: the default dynamic scale's 65536 was divided out)
    assert abs(losses[-1] - reference[-1]) < 0.02 * reference[-1], (losses[-1], reference[-1])
    x, y = _data()
    opt.zero_grad()
    opt.backward(F.mse_loss(run(x).float(), y))
    assert float(opt.clip_grad_norm_(1e-3)) > 1e-3  # (the norm over the complex gradients too, and clipped)
    grads = [p.grad for group in opt.optimizer.param_groups for p in group["params"] if p.grad is not None]
    assert any(g.is_complex() for g in grads)
    assert float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) < 1.01e-3
    assert opt.step()


def test_an_overflow_in_a_complex_gradient_skips_the_step_and_changes_nothing():
    _, run, opt = _train("O2", steps=2)
    x, y = _data()
    before = [p.detach().clone() for p in run.parameters()]
    state = {k: v.clone() for k, v in opt.optimizer.state[run.spectral.weight].items() if torch.is_tensor(v)}
    opt.zero_grad()
    opt.backward(F.mse_loss(run(x).float(), y))
    run.spectral.weight.grad[0, 0, 0] = complex(float("inf"), 0.0)
    assert not opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, run.parameters()))
    assert all(torch.equal(v, opt.optimizer.state[run.spectral.weight][k]) for k, v in state.items())


class Stacked(nn.Module):
    """FNO1d's layer as blocks, for the in-place conversion fxamp.shard takes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FNO1d(), FNO1d()])

    def forward(self, x):
        return self.layers[1](torch.cat([self.layers[0](x), x[..., :1]], -1))


def test_shard_refuses_complex_parameters_with_what_to_do():
    """FSDP2 all-gathers one dtype per group; the complex parameters are named, and DDP is the way (the message
    used to say 'convert with O1', which the model already was)."""
    amp = fxamp.convert_(Stacked(), "O1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"complex parameters \(layers.0.spectral.weight, layers.1.spectral.weight\).*"
                                         r"train such a model with DDP"):
        fxamp.shard(amp)
