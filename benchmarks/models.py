"""The models the benchmarks run: every one traces with ``torch.fx.symbolic_trace``.

Sizes are arguments, so the same definitions serve the CPU suite (tiny matrices: low precision
math has no fast kernels on AVX2 CPUs) and the GPU throughput runs (GPT-2-small and
ResNet-50 sizes).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LinearChain", "TransformerBlock", "SmallCNN", "GPT", "ResNet50", "SyntheticGraph", "DecoderLM", "Encoder"]


class LinearChain(nn.Module):
    """``n`` × (Linear(d, d) → ReLU): dispatch-bound, almost no math per op."""

    def __init__(self, n: int = 200, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class SelfAttention(nn.Module):
    """Multi-head self attention written out (the "math" path: scores, softmax, dropout, @ v).

    Written out rather than ``F.scaled_dot_product_attention`` so attention dropout is a module
    (switched by ``.train()``/``.eval()`` after tracing) and the saved probabilities are visible.
    """

    def __init__(self, d: int, heads: int, dropout: float, causal: bool = False):
        super().__init__()
        assert d % heads == 0
        self.heads = heads
        self.head_dim = d // heads
        self.causal = causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            # ones_like, not ones(s, s): fx traces it without knowing s
            mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        return self.proj(out)


class TransformerBlock(nn.Module):
    """A pre-norm transformer encoder block (LayerNorm → attention → residual, LayerNorm → MLP → residual)."""

    def __init__(self, d: int = 64, heads: int = 4, ff: int = 256, dropout: float = 0.1, causal: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, dropout, causal)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class SmallCNN(nn.Module):
    """4 × (conv3x3 → BatchNorm → ReLU), global average pool, linear head."""

    def __init__(self, channels: int = 16, classes: int = 10, depth: int = 4):
        super().__init__()
        layers = []
        c_in = 3
        for _ in range(depth):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
            c_in = channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, ``layers`` causal blocks, final norm, tied LM head.

    ``GPT()`` is GPT-2-small sized (d=768, 12 layers, 12 heads, vocab 50257, 124 M parameters).
    """

    def __init__(self, vocab: int = 50257, seq: int = 1024, d: int = 768, layers: int = 12, heads: int = 12,
                 dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads, 4 * d, dropout, causal=True) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50 (bottleneck blocks 3-4-6-3, 25.6 M parameters); ``width`` scales every stage for small runs."""

    def __init__(self, classes: int = 1000, width: int = 64, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages = []
        c_in = width
        for i, n in enumerate(blocks):
            w = width * 2 ** i
            for j in range(n):
                stages.append(Bottleneck(c_in, w, stride=2 if (j == 0 and i > 0) else 1))
                c_in = w * Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SyntheticGraph(nn.Module):
    """A graph of exactly ``nodes`` torch.fx nodes, for convert() timing.

    Blocks of (Linear → ReLU → residual add → LayerNorm), 4 nodes each, then ReLUs to make up the
    count; ``torch.fx.symbolic_trace`` adds the input and the output node.
    """

    def __init__(self, nodes: int, d: int = 8):
        super().__init__()
        if nodes < 3:
            raise ValueError(f"nodes={nodes} is too small; a graph needs an input, an op and an output")
        blocks, self.tail = divmod(nodes - 2, 4)
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))

    def forward(self, x):
        for linear, norm in zip(self.linears, self.norms):
            x = norm(x + F.relu(linear(x)))
        for _ in range(self.tail):
            x = F.relu(x)
        return x


class SDPABlock(nn.Module):
    """A pre-norm GPT-2 block whose attention is ``F.scaled_dot_product_attention(is_causal=True)``.

    No dropout (``dropout_p`` would be read from ``self.training`` at trace time and baked in).
    """

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class DecoderLM(nn.Module):
    """A GPT-2-small-width decoder (d768, 12 heads by default) with SDPA attention and a tied LM head.

    Traces with ``torch.fx.symbolic_trace``; fewer layers and a smaller vocabulary than GPT-2 keep
    a CPU training step around a second.
    """

    def __init__(self, vocab: int = 8192, seq: int = 128, d: int = 768, layers: int = 2, heads: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(SDPABlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)


class Encoder(nn.Module):
    """A BERT-base-width encoder: ``layers`` × ``nn.TransformerEncoderLayer`` (d768, 12 heads, ff 3072, GELU).

    ``fxamp.convert(m, "O1")`` writes each layer out (fxamp's fx front end; torch.fx alone keeps
    ``nn.TransformerEncoderLayer`` whole); ``frontend="export"`` with ``example_inputs=(x,)``
    captures it with torch.export instead.  Input: float embeddings (batch, seq, d).
    """

    def __init__(self, d: int = 768, heads: int = 12, ff: int = 3072, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu",
                                                               batch_first=True) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)
