"""Tiny example models for ``fxamp report`` (each builds with no arguments)::

    fxamp report examples/models.py:TinyTransformerBlock --input 2,8,32
    fxamp report examples/models.py:TinyCNN --input 2,3,16,16
    fxamp report examples/models.py:TinyMLP --input 4,64 --policy O2
    fxamp report examples/models.py:TinyLM --input 2,16:int64
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMLP(nn.Module):
    """64 → 128 → 128 → 10 with ReLU, and log-probabilities out."""

    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.head(x), dim=-1)


class TinyCNN(nn.Module):
    """Two conv-BatchNorm-ReLU stages, global average pooling and a linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class TinyTransformerBlock(nn.Module):
    """A pre-norm transformer block: attention and a GELU MLP, each scaled by a learned LayerScale."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))  # LayerScale (CaiT): a float32 parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.gamma * self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """Token ids in, next-token log-probabilities out: embedding, one block, tied output head."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = TinyTransformerBlock(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.block(self.embed(ids)))
        return F.log_softmax(F.linear(h, self.embed.weight), dim=-1)


MODELS = (TinyMLP, TinyCNN, TinyTransformerBlock, TinyLM)
