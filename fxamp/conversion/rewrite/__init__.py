"""The rewrite stage: passes that change the graph as the decisions say, in the order ``pipeline.PASSES`` runs them.

``casts`` (parameter storage for O2/O3, parameter reads, the casts), ``float8`` (chosen matmuls call
their float8 form), ``attention`` (SDPA with dropout in the low dtype), ``islands`` (float32 islands
recomputed in backward), ``debug`` (the opt-in overflow checks), ``checkpointing`` (each block the user
checkpointed keeps running under ``torch.utils.checkpoint``, its casts inside).  What the rewritten
graph calls lives in ``runtime/``.

This package was the module ``fxamp.conversion.rewrite``: its names still resolve here for one release,
with a DeprecationWarning naming their module now.
"""

import importlib as _importlib
import types as _types

from ...errors import warn_deprecated as _warn_deprecated

#: the old module's names and the module each is imported from now
_MOVED = _types.MappingProxyType({name: "fxamp.conversion.rewrite.casts" for name in (
    "store_params", "cast_kept_storage", "insert_casts", "lower_attribute_reads", "CACHE_NAME", "weight_cache_of")})


def __getattr__(name: str):
    """``fxamp.conversion.rewrite.<a name of the old module>``: the object, with a DeprecationWarning."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warn_deprecated(f"{__name__}.{name}", f"write 'from {module} import {name}'")
    return getattr(_importlib.import_module(module), name)
