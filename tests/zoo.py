"""Small models that exercise every kind of decision convert() makes (tiny: dims ≤ 32)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class ResBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(), ResBlock())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    """Self-attention written out: matmul + softmax, with a residual LayerNorm and dropout."""

    def __init__(self, d=32, heads=4, p=0.0):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, t, self.h, d // self.h).transpose(1, 2)
        k = k.view(b, t, self.h, d // self.h).transpose(1, 2)
        v = v.view(b, t, self.h, d // self.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        att = self.drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.ln(x + self.proj(y))


class TokenModel(nn.Module):
    """Embedding + LayerNorm on integer token ids; a GELU MLP; a head."""

    def __init__(self, vocab=50, d=32, maxlen=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(maxlen, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.ln(self.tok(ids) + self.pos(pos))
        h = h + F.gelu(self.fc(h))
        return self.head(h)


class TiedLM(nn.Module):
    """A language model whose output head shares the embedding matrix."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.emb(ids))))


class LossInside(nn.Module):
    """Computes its loss inside forward (labels are int64)."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x, y):
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits


class MixedCat(nn.Module):
    """torch.cat of a low-precision linear output with the float32 input: promotes to float32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.cat([self.fc(x), x], dim=-1))


class ExplicitSum(nn.Module):
    """sum(dtype=float32) reads low precision and accumulates in float32; x ** 2 and 1 / x are unsafe."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        s = h.sum(dim=-1, dtype=torch.float32)
        sq = (h ** 2).mean(dim=-1)
        r = 1.0 / (sq + 1.0)
        return s + r + torch.exp(-sq)


class ShapeArith(nn.Module):
    """Shape arithmetic on x.size(): ints flow through the graph and must never be cast."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 8)

    def forward(self, x):
        n = x.size(0)
        h = self.conv(x)
        h = h.view(n, -1)
        pad = h.new_zeros(n, 2)
        return torch.cat([self.fc(h), pad], dim=1) * (x.size(1) / 3)


def inputs_for(name: str, batch: int = 4):
    """Example inputs (a tuple) for a zoo model."""
    g = torch.Generator().manual_seed(0)
    if name in ("MLP", "MixedCat", "ExplicitSum"):
        return (torch.randn(batch, 16, generator=g),)
    if name in ("ConvBN", "ResNet", "ShapeArith"):
        return (torch.randn(batch, 3, 6, 6, generator=g),)
    if name == "Attention":
        return (torch.randn(batch, 6, 32, generator=g),)
    if name == "TokenModel":
        return (torch.randint(0, 50, (batch, 8), generator=g),)
    if name == "TiedLM":
        return (torch.randint(0, 40, (batch, 8), generator=g),)
    if name == "LossInside":
        return (torch.randn(batch, 16, generator=g), torch.randint(0, 8, (batch,), generator=g))
    raise KeyError(name)


ZOO = {cls.__name__: cls for cls in (MLP, ConvBN, ResNet, Attention, TokenModel, TiedLM, LossInside,
                                     MixedCat, ExplicitSum, ShapeArith)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ZOO[name]()
