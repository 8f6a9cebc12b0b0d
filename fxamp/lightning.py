"""``from fxamp.lightning import FxampPrecision``: the PyTorch Lightning plugin, see :mod:`fxamp.integrations.lightning`."""

from .integrations.lightning import FxampPrecision

__all__ = ["FxampPrecision"]
