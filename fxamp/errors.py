"""The exception types fxamp raises; each message says what went wrong and what to do instead."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Mapping, Optional

__all__ = ["FxampError", "TraceError", "ConversionError", "LossScaleError", "OptimizerStateError", "DEPRECATED",
           "warn_deprecated", "moved_names"]

#: the words of every deprecation fxamp warns of (the test suite turns warnings with them into errors)
DEPRECATED = "is deprecated and kept for one release"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """A DeprecationWarning that ``old`` (a name, a call) goes after this release, saying what to write: ``new``.

    ``stacklevel`` 3 points at the caller of the function that warns (the user's line).
    """
    warnings.warn(f"{old} {DEPRECATED}: {new}", DeprecationWarning, stacklevel=stacklevel)


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` (PEP 562) of ``module`` for the names that left it: ``moved`` maps each to the
    module it lives in now, from which it resolves with a DeprecationWarning saying what to import."""

    def __getattr__(name: str) -> Any:
        new = moved.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name}", f"write 'from {new} import {name}'")  # (stacklevel 3: the user's line)
        return getattr(importlib.import_module(new), name)

    return __getattr__


class FxampError(RuntimeError):
    """Base class of every fxamp error."""


class TraceError(FxampError):
    """The model could not be captured as a graph (by torch.fx or torch.export).

    short:       the front end's own error in one line (``"TypeError: ..."``).
    module_path: the module it failed in ("" for the root or when unknown).
    original:    the exception the front end raised (also ``__cause__`` where raised ``from`` it).
    """

    def __init__(self, message: str, *, short: str = "", module_path: str = "",
                 original: Optional[BaseException] = None):
        super().__init__(message)
        self.short = short
        self.module_path = module_path
        self.original = original


class ConversionError(FxampError):
    """The graph was captured but could not be rewritten (a bad override, an unsupported construct)."""


class LossScaleError(FxampError):
    """Dynamic loss scaling gave up: the scale fell below ``min_scale`` (the model is diverging)."""


class OptimizerStateError(FxampError):
    """The mixed precision optimizer was used out of order (step without backward, unscale twice…)."""
