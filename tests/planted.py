"""Tiny models made to break in float16, each with one planted culprit (and a healthy one)."""

import torch
import torch.nn as nn


class SumOfSquares(nn.Module):
    def forward(self, x):
        return (x * x).sum(-1, keepdim=True)  # x*x runs in float16 (neutral) and overflows past 65504


class Shrink(nn.Module):
    def forward(self, x):
        return x * 1e-7  # float16 keeps ~1e-7 only as a subnormal: a few bits left


class Bessel(nn.Module):
    def forward(self, x):
        return torch.special.i0(x)  # on no list: follows its input (float16) and overflows for |x| > 13


def _linear(i, o, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(i, o)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g) / i ** 0.5)
        lin.bias.zero_()
    return lin


class Overflows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _linear(16, 16, 0)
        self.energy = SumOfSquares()
        self.head = _linear(16, 8, 1)

    def forward(self, x):
        h = self.fc(x) * 200.0
        return torch.cat([self.head(h), self.energy(h) / 1000.0], -1)


class Underflows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _linear(16, 16, 0)
        self.shrink = Shrink()
        self.head = _linear(16, 8, 1)

    def forward(self, x):
        return self.head(self.shrink(self.fc(x)) * 1e7)


class Unlisted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _linear(16, 16, 0)
        self.bessel = Bessel()
        self.head = _linear(16, 8, 1)

    def forward(self, x):
        return self.head(self.bessel(self.fc(x).clamp(-2.5, 2.5) * 6.0) / 1e5)


class TwoCulprits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _linear(16, 16, 0)
        self.energy = SumOfSquares()
        self.shrink = Shrink()
        self.head = _linear(16, 8, 1)

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([self.head(self.shrink(h) * 1e7), self.energy(h * 200.0) / 1e6], -1)


class Healthy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _linear(16, 32, 0)
        self.norm = nn.LayerNorm(32)
        self.act = nn.GELU()
        self.head = _linear(32, 8, 1)

    def forward(self, x):
        return self.head(self.act(self.norm(self.fc(x)))).softmax(-1)


def batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g),) for _ in range(n)]
