"""The loss-curve plot both training examples save: each variant's curve, and its difference from float32."""

from __future__ import annotations

from typing import Optional, Sequence


def plot_loss_curves(results: Sequence, path: str, *, title: str, ylabel: str, log: bool = False) -> Optional[str]:
    """Save the curves of ``results`` (each with ``name``, ``curve``, ``fxamp``) to ``path``.

    Returns the path, or None (with a note) when matplotlib is missing: the plot is optional.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("note: matplotlib is not installed; skipping the loss-curve plot (pip install matplotlib)")
        return None

    def smooth(values, k=10):
        return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]

    ref = smooth(next(r for r in results if r.name == "float32").curve)
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        style = "-" if r.fxamp else "--"
        curve = smooth(r.curve)
        ax.plot(curve, label=r.name, linestyle=style, linewidth=1)
        dx.plot([(c - f) / f for c, f in zip(curve, ref)], label=r.name, linestyle=style, linewidth=1)
    ax.set(xlabel="step", ylabel=f"{ylabel} (mean of 10 steps)", title=title)
    if log:
        ax.set_yscale("log")
    dx.set(xlabel="step", ylabel="relative difference from float32", title="loss vs float32")
    dx.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
