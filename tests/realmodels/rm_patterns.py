"""Patterns of our own for the real-model suite (issue 37): small models written the way vision and language
libraries write these layers (items 1, 2, 10, 11, 12).  They are this suite's own code, so each pattern
stays when a library changes its own.  Sizes and inputs as in ``rm_models``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

B, S, V, D = 2, 8, 96, 32  # rm_models' batch, sequence, vocabulary and width


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class BNAct(nn.BatchNorm2d):
    """A BatchNorm subclass with its own forward (norm + activation), its training flag computed from
    ``self.training`` as vision libraries compute it (issue 37 item 1)."""

    def forward(self, x):
        use_batch_stats = True if self.training else (self.running_mean is None and self.running_var is None)
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   use_batch_stats, self.momentum, self.eps))


class ConvBNAct(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = BNAct(c)

    def forward(self, x):
        return x + self.bn(self.conv(x))


class BNActNet(nn.Module):
    """A conv-bn-relu stem in an nn.Sequential (glue for convert_: issue 37 item 2), a ModuleList of residual
    conv + BNAct blocks, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList([ConvBNAct(16) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block (conv-bn-relu-conv-bn, a downsampling shortcut where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class SeqResNet(nn.Module):
    """A conv-bn-relu stem in an nn.Sequential, then nn.Sequential stages of residual blocks (issue 37 items 2, 11)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.stages = nn.Sequential(nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16)),
                                    nn.Sequential(BasicBlock(16, 32, stride=2), BasicBlock(32, 32)))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def seq_resnet_channels_last() -> nn.Module:
    return SeqResNet().to(memory_format=torch.channels_last)


def channels_last_images(size: int) -> Callable:
    def inputs(seed: int) -> tuple:
        x = torch.randn(B, 3, size, size, generator=gen(seed)).contiguous(memory_format=torch.channels_last)
        return (x,), {}
    return inputs


class ViTBlock(nn.Module):
    """timm's pre-norm block: LayerNorm, qkv Linear and SDPA, LayerNorm, GELU MLP."""

    def __init__(self, dim: int = D, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class AttentionPool(nn.Module):
    """An attention-pooling head: a learned query attends over the tokens with nn.MultiheadAttention
    (which reads ``out_proj.weight`` itself rather than calling ``out_proj``: issue 37 item 12)."""

    def __init__(self, dim: int = D, heads: int = 4):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        y, _ = self.attn(self.query.expand(x.shape[0], -1, -1), x, x, need_weights=False)
        return self.norm(y[:, 0])


class SeqViT(nn.Module):
    """A ViT with its blocks in an nn.Sequential (timm's ``self.blocks``) and an attention-pooling head."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 16, D) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock() for _ in range(2)])
        self.norm = nn.LayerNorm(D)
        self.pool = AttentionPool()
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.pool(self.norm(self.blocks(x))))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with a causal mask buffer inverted in forward (issue 37 item 10), written as a model
    with a fixed context writes it: ``T`` read from the buffer, so torch.fx computes ``~self.mask[:T, :T]``
    while tracing and keeps the result as a constant of the graph."""

    def __init__(self, dim: int = D, heads: int = 4, block_size: int = S):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)))

    def forward(self, x):
        b, _, c = x.shape
        t = self.mask.size(0)
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MaskGPT(nn.Module):
    """A small GPT (nanoGPT's layout): embeddings, a ModuleList of blocks with mask buffers, a tied head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(S, D)
        self.h = nn.ModuleList([GPTBlock() for _ in range(2)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """DDPM's (and Stable Diffusion's) sinusoidal timestep embedding, computed in forward from integer steps."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm, SiLU, conv; the timestep's projection added per channel."""

    def __init__(self, cin: int, cout: int, tdim: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    """Self-attention over the pixels of a feature map, written out (softmax between two batched matmuls)."""

    def __init__(self, c: int):
        super().__init__()
        self.norm, self.qkv, self.proj = nn.GroupNorm(8, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, hh * ww).unbind(1)
        w = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        return x + self.proj((v @ w.transpose(1, 2)).reshape(b, c, hh, ww))


class UNet(nn.Module):
    """A small DDPM-style U-Net (issue 37's item: a model nobody here wrote, in the way diffusion code writes it):
    a timestep embedding made in forward, skips concatenated on the way up, nearest upsampling, an attention
    block at the lowest resolution; it predicts the noise (same shape as its input)."""

    def __init__(self, c: int = 16, tdim: int = 32):
        super().__init__()
        self.c = c
        self.time = nn.Sequential(nn.Linear(c, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList([ResBlock(c, c, tdim), ResBlock(c, 2 * c, tdim)])
        self.pool = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)
        self.mid = AttnBlock(2 * c)
        self.up = nn.ModuleList([ResBlock(4 * c, 2 * c, tdim), ResBlock(3 * c, c, tdim)])
        self.out_norm, self.out = nn.GroupNorm(8, c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, t):
        temb = self.time(timestep_embedding(t, self.c))
        h = self.inp(x)
        skips = []
        for block in self.down:
            h = block(h, temb)
            skips.append(h)
        h = F.interpolate(self.mid(self.pool(h)), scale_factor=2, mode="nearest")
        for block in self.up:
            h = block(torch.cat([h, skips.pop()], dim=1), temb)
        return self.out(F.silu(self.out_norm(h)))


def unet_inputs(size: int) -> Callable:
    def inputs(seed: int) -> tuple:
        g = gen(seed)
        return (torch.randn(B, 3, size, size, generator=g), torch.randint(0, 1000, (B,), generator=g)), {}
    return inputs


class DLRM(nn.Module):
    """A small DLRM (the recommender layout): a bottom MLP over dense features, summed EmbeddingBag lookups of
    sparse ones (indices and offsets), their pairwise dot products (a batched matmul), a top MLP to one logit."""

    TABLES = (50, 40, 30)

    def __init__(self, dense: int = 8, d: int = 16):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, d), nn.ReLU())
        self.emb = nn.ModuleList([nn.EmbeddingBag(n, d, mode="sum") for n in self.TABLES])
        k = len(self.TABLES) + 1
        self.top = nn.Sequential(nn.Linear(d + k * (k - 1) // 2, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, indices, offsets):
        x = self.bottom(dense)
        t = torch.stack([x] + [e(indices[i], offsets[i]) for i, e in enumerate(self.emb)], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        k = t.shape[1]
        li, lj = torch.tril_indices(k, k, offset=-1, device=z.device)
        return self.top(torch.cat([x, z[:, li, lj]], dim=1))


def dlrm_inputs(seed: int) -> tuple:
    g = gen(seed)
    bag = 4  # lookups per bag, summed
    indices = torch.randint(0, min(DLRM.TABLES), (len(DLRM.TABLES), B * bag), generator=g)
    offsets = torch.arange(0, B * bag, bag).expand(len(DLRM.TABLES), B).contiguous()
    return (torch.randn(B, 8, generator=g), indices, offsets), {}


class MRFBlock(nn.Module):
    """HiFi-GAN's residual block: weight-normed dilated 1-D convolutions (torch.nn.utils.parametrizations)."""

    def __init__(self, c: int, dilation: int):
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.conv1 = wn(nn.Conv1d(c, c, 3, padding=dilation, dilation=dilation))
        self.conv2 = wn(nn.Conv1d(c, c, 3, padding=1))

    def forward(self, x):
        return x + self.conv2(F.leaky_relu(self.conv1(F.leaky_relu(x, 0.1)), 0.1))


class WeightNormVocoder(nn.Module):
    """A vocoder's layout: a weight-normed input convolution, residual blocks, an upsampling transposed convolution
    and a tanh output; every weight a parametrization computes from ``original0``/``original1``."""

    def __init__(self, c: int = 16):
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.pre = wn(nn.Conv1d(8, c, 7, padding=3))
        self.blocks = nn.ModuleList([MRFBlock(c, d) for d in (1, 3)])
        self.up = wn(nn.ConvTranspose1d(c, c // 2, 4, stride=2, padding=1))
        self.post = wn(nn.Conv1d(c // 2, 1, 7, padding=3))

    def forward(self, mel):
        x = self.pre(mel)
        for block in self.blocks:
            x = block(x)
        return torch.tanh(self.post(F.leaky_relu(self.up(x), 0.1)))


def mel_inputs(seed: int) -> tuple:
    return (torch.randn(B, 8, 16, generator=gen(seed)),), {}


class SNDiscriminator(nn.Module):
    """An SN-GAN discriminator: spectral-normed convolutions (a power iteration per training call, its vectors
    buffers) in a ModuleList, a spectral-normed linear head."""

    def __init__(self, c: int = 16):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.convs = nn.ModuleList([sn(nn.Conv2d(3 if i == 0 else c, c, 3, stride=2, padding=1)) for i in range(3)])
        self.head = sn(nn.Linear(c, 1))

    def forward(self, x):
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.2)
        return self.head(x.sum((2, 3)))


class EMAQuantizer(nn.Module):
    """A VQ-VAE's quantizer: nearest code by distance, a straight-through output (``z + (q - z).detach()``), and a
    codebook that is an exponential moving average its training call updates in place under torch.no_grad()."""

    def __init__(self, n: int = 32, d: int = 16, decay: float = 0.9):
        super().__init__()
        self.decay = decay
        self.register_buffer("codebook", torch.randn(n, d, generator=gen(7)))
        self.register_buffer("cluster_size", torch.ones(n))
        self.register_buffer("embed_avg", self.codebook.clone())

    def forward(self, z):
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.codebook.t() + self.codebook.pow(2).sum(1)
        onehot = F.one_hot(dist.argmin(1), self.codebook.shape[0]).type(flat.dtype)
        q = (onehot @ self.codebook).view(b, h, w, d).permute(0, 3, 1, 2)
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
                self.codebook.copy_(self.embed_avg / self.cluster_size.clamp(min=1e-5).unsqueeze(1))
        return z + (q - z).detach(), F.mse_loss(z, q.detach())


class ConvRes(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        return x + self.c2(F.relu(self.c1(F.relu(x))))


class VQVAE(nn.Module):
    """A VQ-VAE returning its loss: reconstruction plus the commitment term."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.enc_res = nn.ModuleList([ConvRes(16), ConvRes(16)])
        self.vq = EMAQuantizer()
        self.dec_res = nn.ModuleList([ConvRes(16), ConvRes(16)])
        self.dec = nn.ConvTranspose2d(16, 3, 4, 2, 1)

    def forward(self, x):
        z = self.enc(x)
        for block in self.enc_res:
            z = block(z)
        q, commit = self.vq(z)
        for block in self.dec_res:
            q = block(q)
        return F.mse_loss(self.dec(q), x) + 0.25 * commit
