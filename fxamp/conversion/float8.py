"""Moved: float8 now has a module in each stage it works in.  This path is kept for one release.

``runtime/float8.py`` holds what a graph calls (its functions load here silently: graphs converted
before the move, and their ``torch.save`` pickles, name them by this path); the choice of the matmuls
and the cost tables are ``classify/float8.py`` (the override values ``classify/overrides.py``), the
rewrite ``rewrite/float8.py``.  Any other name of the old module resolves with a DeprecationWarning
naming its module now.
"""

import types as _types

from ..errors import moved_names as _moved_names
from .runtime.float8 import (E4M3, E5M2, EPS, PLAIN, Float8Matmul, amax_to_scale, einsum_plan, float8_addmm,
                             float8_einsum, float8_linear, float8_matmul, float8_mm, sqnr_db, to_float8)

__all__ = ["E4M3", "E5M2", "EPS", "amax_to_scale", "to_float8", "float8_mm", "float8_linear", "float8_matmul",
           "float8_einsum", "float8_addmm", "Float8Matmul", "einsum_plan", "sqnr_db", "PLAIN"]

_CLASSIFY = "fxamp.conversion.classify.float8"
#: the old module's other names and the module each is imported from now
_MOVED = _types.MappingProxyType({
    **{name: _CLASSIFY for name in ("CostTable", "COST_TABLES", "device_kind", "torchao_default", "cost_says",
                                    "MULTIPLE", "matmul_shape", "choose", "float8_notes")},
    **{name: "fxamp.conversion.classify.overrides" for name in ("FORCE", "REFUSE", "split_overrides")},
    "rewrite_float8": "fxamp.conversion.rewrite.float8",
})

__getattr__ = _moved_names(__name__, _MOVED)
