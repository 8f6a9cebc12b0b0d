"""classify → rewrite over a captured graph: what ``convert()``, the lazily capturing module and the block
families share.

:data:`PASSES` is the conversion after capture, in the order it runs: the classify stage's rules (they
decide: one :class:`~fxamp.conversion.graph.Decision` per node, in ``node.meta["fxamp"]``), then the
rewrite stage's passes (they change the graph as decided).  ``rewrite_captured`` runs each that applies,
lints and recompiles once, and attaches the :class:`~fxamp.info.ConversionInfo` with every pass's notes.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Sequence, Tuple

import torch.fx as fx

from ..info import INFO_ATTR, ConversionInfo
from ..policy import Policy
from .capture import Captured
from .classify.categories import CATEGORIES, FLOAT32_LEAVES, UNUSED_OVERRIDES
from .classify.float8 import FLOAT8_CHOICE
from .graph import Decision
from .options import ConvertOptions
from .passes import Conversion, Pass, Stage
from .rewrite.attention import ATTENTION
from .rewrite.casts import ATTRIBUTE_READS, CASTS, STORAGE
from .rewrite.checkpointing import CHECKPOINTS
from .rewrite.debug import OVERFLOW_CHECKS
from .rewrite.float8 import FLOAT8
from .rewrite.islands import ISLANDS
from .runtime import as_converted, name_failing_nodes

__all__ = ["PASSES", "annotate", "rewrite_captured"]

#: every pass after capture, in the order it runs (each says when it applies: ``Pass.applies``)
PASSES: Tuple[Pass, ...] = (
    CATEGORIES,         # classify: each node's category and compute dtype (op lists, overrides)
    FLOAT8_CHOICE,      # classify: which safe matmuls run in float8 (a policy with float8=)
    FLOAT32_LEAVES,     # classify: a note (and warning) for a large leaf module left in float32
    UNUSED_OVERRIDES,   # classify: a note (and warning) for an op override that matched nothing
    STORAGE,            # rewrite: O2/O3 parameter storage, decided or kept
    ATTRIBUTE_READS,    # rewrite: parameter reads through the module's own dict
    CASTS,              # rewrite: a cast per (value, dtype), one weight-cast call per forward
    FLOAT8,             # rewrite: chosen matmuls call their float8 form (their inputs are bfloat16 now)
    ATTENTION,          # rewrite: SDPA with dropout saves low-precision probabilities
    ISLANDS,            # rewrite: float32 islands recomputed in backward (off under debug_overflow)
    OVERFLOW_CHECKS,    # rewrite: debug_overflow's check after every node
    CHECKPOINTS,        # rewrite: each checkpointed block takes its casts and checks along
)


def _run(gm: fx.GraphModule, conversion: Conversion, stages: Sequence[Stage]) -> Tuple[List[str], List[str]]:
    """Run the passes of ``stages`` that apply; ``(notes, the notes to warn about)``."""
    notes: List[str] = []
    warn: List[str] = []
    for p in PASSES:
        if p.stage in stages and p.applies(conversion):
            said = list(p.run(gm, conversion))
            notes += said
            warn += said if p.warns else []
    return notes, warn


def annotate(gm: fx.GraphModule, policy: Policy, options: ConvertOptions = ConvertOptions()) -> Dict[fx.Node, Decision]:
    """The classify stage alone: each node's decision, recorded in ``node.meta["fxamp"]`` (read it back with
    ``graph.decision_of``) and returned; the graph is not changed."""
    conversion = Conversion(policy, options)
    _run(gm, conversion, (Stage.CLASSIFY,))
    return conversion.decisions


def rewrite_captured(captured: Captured, policy: Policy, options: ConvertOptions = ConvertOptions(), *,
                     storage: str = "decide", notes: Sequence[str] = ()) -> fx.GraphModule:
    """Classify and rewrite a captured graph in place (:data:`PASSES`); returns its graph module, its
    ConversionInfo attached.

    options: the op lists, overrides, weight cache, overflow checks (``options.debug_overflow``) and
    recomputed float32 islands (``options.recompute_islands``); ``options.dynamic`` was the capture's business.
    storage: ``"decide"``: O2/O3 re-bind parameters to the dtype their consumers run in
    (``store_params``); ``"keep"``: the parameters already have their dtypes (a lazily capturing
    module made them before any graph existed), and consumers that want another dtype get a cast.
    notes: put before the capture's own notes.
    """
    conversion = Conversion(policy, options, storage, captured.frontend)
    gm = as_converted(captured.graph_module)  # (its copies keep what conversion sets up below)
    said, warn = _run(gm, conversion, tuple(Stage))
    for note in warn:
        warnings.warn(f"fxamp: {note}", stacklevel=3)
    gm.graph.lint()
    gm.recompile()
    info = ConversionInfo(policy, captured.frontend, tuple(notes) + tuple(captured.notes) + tuple(said))
    # pickling keeps instance attributes; GraphModule's deepcopy keeps the ones listed in meta
    setattr(gm, INFO_ATTR, info)
    gm.meta.setdefault("_user_preserved_attributes", {})[INFO_ATTR] = info
    name_failing_nodes(gm)  # torch's message, the node named; not torch.fx's dump of the generated code
    return gm
