"""Moved to :mod:`fxamp.conversion.rewrite.debug` (the overflow checks are a rewrite pass); kept for one release.

A module converted with ``debug_overflow=`` before the move pickled its monitor by this path:
:class:`OverflowMonitor` and :class:`OverflowInfo` load here silently.  The other names resolve with a
DeprecationWarning naming their module now.
"""

import importlib as _importlib

from ..errors import warn_deprecated as _warn_deprecated
from .rewrite.debug import OverflowInfo, OverflowMonitor

__all__ = ["OverflowMonitor", "OverflowInfo"]

_NEW = "fxamp.conversion.rewrite.debug"


def __getattr__(name: str):
    """``fxamp.conversion.debug.<name>``: the object from its module now, with a DeprecationWarning."""
    if name not in ("add_overflow_checks", "overflow_info", "MONITOR_NAME"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warn_deprecated(f"{__name__}.{name}", f"write 'from {_NEW} import {name}'")
    return getattr(_importlib.import_module(_NEW), name)
