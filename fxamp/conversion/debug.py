"""Moved to :mod:`fxamp.conversion.rewrite.debug` (the overflow checks are a rewrite pass); kept for one release.

A module converted with ``debug_overflow=`` before the move pickled its monitor by this path:
:class:`OverflowMonitor` and :class:`OverflowInfo` load here silently.  The other names resolve with a
DeprecationWarning naming their module now.
"""

from ..errors import moved_names as _moved_names
from .rewrite.debug import OverflowInfo, OverflowMonitor

__all__ = ["OverflowMonitor", "OverflowInfo"]

__getattr__ = _moved_names(__name__, {name: "fxamp.conversion.rewrite.debug"
                                      for name in ("add_overflow_checks", "overflow_info", "MONITOR_NAME")})
