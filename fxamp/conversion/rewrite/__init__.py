"""The rewrite stage: passes that change the graph as the decisions say, in the order ``pipeline.PASSES`` runs them.

``casts`` (parameter storage for O2/O3, parameter reads, the casts), ``float8`` (chosen matmuls call
their float8 form), ``attention`` (SDPA with dropout in the low dtype), ``islands`` (float32 islands
recomputed in backward), ``debug`` (the opt-in overflow checks), ``checkpointing`` (each block the user
checkpointed keeps running under ``torch.utils.checkpoint``, its casts inside).  What the rewritten
graph calls lives in ``runtime/``.

This package was the module ``fxamp.conversion.rewrite``: its names still resolve here for one release,
with a DeprecationWarning naming their module now.
"""

import types as _types

from ...errors import moved_names as _moved_names

#: the old module's names and the module each is imported from now
_MOVED = _types.MappingProxyType({name: "fxamp.conversion.rewrite.casts" for name in (
    "store_params", "cast_kept_storage", "insert_casts", "lower_attribute_reads", "CACHE_NAME", "weight_cache_of")})

__getattr__ = _moved_names(__name__, _MOVED)
