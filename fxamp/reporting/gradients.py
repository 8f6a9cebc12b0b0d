"""Gradients: how much of them float16 would lose without loss scaling, and the scale that saves them.

``report(model, policy, example_inputs=inputs, gradients=True)`` runs one forward and backward of the *float32* twin of
the converted graph (:class:`~.numerics.SideBySide`'s reference environment) on the first batch,
recording the gradient of every node's output (activation gradients, through tensor hooks) and of
every parameter.  For each it gives the fraction of values float16 would flush to zero (nonzero
but |g| < 2⁻²⁴), the fraction it would keep only as subnormals (2⁻²⁴ ≤ |g| < 2⁻¹⁴), and the
largest |g|.  The loss scale is what fxamp's dynamic scaler settles on: it starts at 2¹⁶
(``LossScaleConfig``'s initial scale) and halves on every overflow, so it ends at the largest
power of two ``s ≤ 2¹⁶`` with ``max|g|·s < 65504``.

The loss: ``loss_fn(output)`` if given; else the output's own loss (``output.loss``, a Hugging
Face ``ModelOutput``, or ``output["loss"]``); else the output itself when it is a 0-dim float tensor
(a ``forward`` that returns its loss); else the mean square of the float outputs,
``sum(out.float().pow(2).mean())`` — a stand-in whose gradients have the scale of the outputs.

:func:`plot_histogram` draws Micikevicius et al. (2017), Figure 3, for your model: the histogram
of log2|activation gradient| with float16's normal and subnormal ranges shaded and the histogram
shifted by the loss scale.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..conversion.graph import DECISION, attr_target
from .numerics import FP16_MAX, FP16_TINY, SideBySide, float_leaves

__all__ = ["GradStats", "GradientReport", "scan_gradients", "plot_histogram", "settled_scale", "default_loss",
           "FP16_MIN_SUBNORMAL", "SCALE_CAP"]

FP16_MIN_SUBNORMAL = 2.0 ** -24  #: the smallest positive float16; below half of it values flush to zero
SCALE_CAP = 2.0 ** 16  #: the dynamic scaler's initial scale (LossScaleConfig's default): it only backs off from here
_BINS = (-64, 24)  # log2 range of the histogram, one bin per power of two


@dataclass(frozen=True)
class GradStats:
    """One gradient (a parameter's, or a node output's) against float16's range.

    name:       parameter path or node name.
    numel:      number of values.
    zero:       fraction that float16 flushes to zero: nonzero, |g| < 2⁻²⁴.
    subnormal:  fraction float16 keeps only as a subnormal: 2⁻²⁴ ≤ |g| < 2⁻¹⁴.
    max_abs:    the largest |g|.
    zero_scaled: the fraction still flushed to zero with the report's loss scale.
    """

    name: str
    numel: int
    zero: float
    subnormal: float
    max_abs: float
    zero_scaled: float = 0.0


@dataclass(frozen=True)
class GradientReport:
    """The gradient scan: per parameter and per node, the loss, the settled loss scale and a histogram.

    loss:        the loss value the backward started from.
    loss_from:   where it came from (``loss_fn``, ``output.loss``, ``mean square of the outputs``).
    scale:       the loss scale fxamp's dynamic scaler would settle on (see the module docstring).
    params / activations: one :class:`GradStats` each, in model / graph order.
    counts:      histogram of log2|g| over all activation gradients, one bin per power of two from
                 ``bins[0]`` (zeros are left out; they are in ``zeros``).
    """

    loss: float
    loss_from: str
    scale: float
    params: Tuple[GradStats, ...]
    activations: Tuple[GradStats, ...]
    bins: Tuple[int, int]
    counts: Tuple[int, ...]
    zeros: int

    def totals(self, which: str = "activations") -> Tuple[float, float, float]:
        """(flushed to zero, subnormal, flushed to zero with the scale) as fractions of all values of ``which``."""
        stats = getattr(self, which)
        n = sum(s.numel for s in stats) or 1
        return (sum(s.zero * s.numel for s in stats) / n, sum(s.subnormal * s.numel for s in stats) / n,
                sum(s.zero_scaled * s.numel for s in stats) / n)

    def summary_lines(self) -> List[str]:
        lines = [f"gradients (one backward of the float32 model; loss = {self.loss_from} = {self.loss:.4g}):"]
        for which in ("params", "activations"):
            zero, sub, zero_scaled = self.totals(which)
            lines.append(f"  {which}: {100 * zero:.2f}% would flush to zero in float16 (|g| < 2^-24), "
                         f"{100 * sub:.2f}% subnormal (< 2^-14); with loss scale {self.scale:g}: "
                         f"{100 * zero_scaled:.2f}% flushed")
        worst = sorted(self.params + self.activations, key=lambda s: -s.zero)[:3]
        worst = [s for s in worst if s.zero > 0]
        if worst:
            lines.append("  most flushed: " + ", ".join(f"{s.name} {100 * s.zero:.1f}%" for s in worst))
        lines.append(f"  loss scale fxamp's dynamic scaler settles on: {self.scale:g} (2^{int(math.log2(self.scale))}; "
                     f"max |g| {max((s.max_abs for s in self.params + self.activations), default=0.0):.3g})")
        return lines

    def to_dict(self) -> Dict[str, Any]:
        return {"loss": self.loss, "loss_from": self.loss_from, "scale": self.scale,
                "params": [asdict(s) for s in self.params], "activations": [asdict(s) for s in self.activations],
                "histogram": {"log2_from": self.bins[0], "log2_to": self.bins[1], "counts": list(self.counts),
                              "zeros": self.zeros}}

    def plot(self, path: str) -> None:
        """Draw the histogram to ``path`` (PNG); see :func:`plot_histogram`."""
        plot_histogram(self, path)


def settled_scale(max_abs: float, cap: float = SCALE_CAP) -> float:
    """The largest power of two ``s <= cap`` with ``max_abs * s < 65504`` (at least 2⁻²⁴)."""
    if max_abs <= 0 or not math.isfinite(max_abs):
        return cap if max_abs <= 0 else 1.0
    exponent = min(math.floor(math.log2(cap)), math.floor(math.log2(FP16_MAX / max_abs)))
    while exponent > -24 and max_abs * 2.0 ** exponent >= FP16_MAX:
        exponent -= 1
    return 2.0 ** exponent


def default_loss(output: Any) -> Tuple[torch.Tensor, str]:
    """The model's own loss if it returns one (``output.loss``, or a 0-dim output), else the mean square of its
    float outputs."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss.float(), "output.loss"
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output.float(), "the output (a scalar: the model returns its loss)"  # squaring it would rescale it
    leaves = [t for t in float_leaves(output) if t.requires_grad]
    if not leaves:
        raise ValueError("the model's output has no float tensor that requires grad: pass loss_fn=callable(output)")
    return sum(t.float().pow(2).mean() for t in leaves), "mean square of the outputs"


class _GradRecorder(SideBySide):
    """The float32 twin with hooks on every node's output: records activation gradients by node name."""

    def __init__(self, gm: fx.GraphModule, reference: nn.Module):
        super().__init__(gm, reference)
        self.grads: Dict[str, List[torch.Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = fx.Interpreter.run_node(self, n)
        ref = self.reference_value(n, out)
        self.ref_env[n] = ref
        if n.op == "output":
            self.reference = ref
        if DECISION in n.meta and n.op.startswith("call_") and attr_target(n) is None:
            for i, t in enumerate(float_leaves(ref)):
                if t.requires_grad:
                    t.register_hook(self._hook(n.name))
        for dead in self.user_to_last_uses.get(n, []):
            self.ref_env.pop(dead, None)
        return out

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.grads.setdefault(name, []).append(grad.detach().float().flatten())
        return hook


def scan_gradients(gm: fx.GraphModule, reference: nn.Module, args: List[Any],
                   loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> GradientReport:
    """One forward and backward of the float32 twin of ``gm`` (``reference`` is the float32 model it came from)."""
    for p in reference.parameters():
        p.grad = None
    rec = _GradRecorder(gm, reference)
    with torch.enable_grad():
        rec.run(*args)
        output = gm.graph.process_outputs(rec.reference)
        if loss_fn is not None:
            loss, source = loss_fn(output), "loss_fn(output)"
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor, not {type(loss).__name__}"
                                 f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}")
        else:
            loss, source = default_loss(output)
        loss.float().backward()
    params = [(name, p.grad.detach().float().flatten()) for name, p in reference.named_parameters()
              if p.grad is not None]
    acts = [(name, torch.cat(gs)) for name, gs in rec.grads.items()]
    every = [g for _, g in params + acts]
    max_abs = max((float(g.abs().max()) for g in every if g.numel()), default=0.0)
    scale = settled_scale(max_abs)
    return GradientReport(float(loss.detach()), source, scale, tuple(_stats(n, g, scale) for n, g in params),
                          tuple(_stats(n, g, scale) for n, g in acts), _BINS, *_histogram([g for _, g in acts]))


def _stats(name: str, g: torch.Tensor, scale: float) -> GradStats:
    a = g.abs()
    n = max(a.numel(), 1)
    nonzero = a > 0
    zero = int((nonzero & (a < FP16_MIN_SUBNORMAL)).sum()) / n
    sub = int(((a >= FP16_MIN_SUBNORMAL) & (a < FP16_TINY)).sum()) / n
    zero_scaled = int((nonzero & (a * scale < FP16_MIN_SUBNORMAL)).sum()) / n
    return GradStats(name, a.numel(), zero, sub, float(a.max()) if a.numel() else 0.0, zero_scaled)


def _histogram(grads: List[torch.Tensor]) -> Tuple[Tuple[int, ...], int]:
    lo, hi = _BINS
    if not grads:
        return tuple([0] * (hi - lo)), 0
    a = torch.cat(grads).abs()
    zeros = int((a == 0).sum())
    logs = torch.log2(a[a > 0].double()).floor().clamp(lo, hi - 1)
    counts = torch.bincount((logs - lo).long(), minlength=hi - lo)
    return tuple(int(c) for c in counts), zeros


def plot_histogram(rep: GradientReport, path: str, title: Optional[str] = None) -> None:
    """Micikevicius et al. (2017), Figure 3: log2|activation gradient| with float16's range and the scale's shift."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting the gradient histogram needs matplotlib: pip install matplotlib "
                          "(or pip install 'fxamp[examples]')") from e
    lo, hi = rep.bins
    total = sum(rep.counts) + rep.zeros or 1
    xs = list(range(lo, hi))
    frac = [c / total for c in rep.counts]
    shift = int(round(math.log2(rep.scale)))
    used = [x for x, c in zip(xs, rep.counts) if c]
    left = min(min(used, default=-30) - 2, -27)
    right = max(max(used, default=0) + shift + 2, 17)
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax.axvspan(-24, -14, color="#f4d03f", alpha=0.35, label="float16 subnormal (2^-24 .. 2^-14)")
    ax.axvspan(-14, 16, color="#58d68d", alpha=0.25, label="float16 normal (2^-14 .. 65504)")
    ax.axvspan(left, -24, color="#ec7063", alpha=0.18, label="flushed to zero in float16 (< 2^-24)")
    ax.bar([x + 0.5 for x in xs], frac, width=1.0, color="#2e4053", alpha=0.85, label="activation gradients")
    if shift:
        ax.step([x + shift for x in xs] + [hi + shift], frac + [0.0], where="post", color="#c0392b", lw=1.6,
                ls="--", label=f"× loss scale 2^{shift}")
    zero, sub, zero_scaled = rep.totals("activations")
    ax.set_xlim(left, right)
    ax.set_yscale("log")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("fraction of values")
    ax.set_title(title or f"Activation gradients: {100 * zero:.1f}% flush to zero in float16 unscaled, "
                          f"{100 * zero_scaled:.2f}% with loss scale 2^{shift}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    ax.grid(alpha=0.3, which="both", axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
