"""The classify stage: one :class:`~fxamp.conversion.graph.Decision` per node of a captured graph.

Its rules run as the first passes of ``pipeline.PASSES``, in this order: ``categories`` (each node's
category and compute dtype, from the op lists and the user's overrides, over ``inference``'s known
dtypes), ``float8`` (which safe matmuls run in float8: the cost tables and the choice), then the
stage's notes (overrides that matched nothing, float32 leaves).  ``overrides`` holds the one rule of
which override a node follows.  Nothing here changes the graph: ``rewrite/`` does, from the decisions.

This package was the module ``fxamp.conversion.classify``: its names still resolve here for one release,
with a DeprecationWarning naming their module now.
"""

import types as _types

from ...errors import moved_names as _moved_names

#: the old module's names and the module each is imported from now
_MOVED = _types.MappingProxyType({
    "classify": "fxamp.conversion.classify.categories",
    "unused_overrides": "fxamp.conversion.classify.categories",
    "annotate": "fxamp.conversion.pipeline",
    "ModuleOverrides": "fxamp.conversion.options",
    "NodeOverrides": "fxamp.conversion.options",
})

__getattr__ = _moved_names(__name__, _MOVED)
