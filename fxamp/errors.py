"""The exception types fxamp raises; each message says what went wrong and what to do instead."""

from __future__ import annotations

__all__ = ["FxampError", "TraceError", "ConversionError", "LossScaleError", "OptimizerStateError"]


class FxampError(RuntimeError):
    """Base class of every fxamp error."""


class TraceError(FxampError):
    """The model could not be captured as a graph (by torch.fx or torch.export)."""


class ConversionError(FxampError):
    """The graph was captured but could not be rewritten (a bad override, an unsupported construct)."""


class LossScaleError(FxampError):
    """Dynamic loss scaling gave up: the scale fell below ``min_scale`` (the model is diverging)."""


class OptimizerStateError(FxampError):
    """The mixed precision optimizer was used out of order (step without backward, unscale twice…)."""
