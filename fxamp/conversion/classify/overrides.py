"""The user's overrides per place: which values decide what, the places checked, and the one rule of precedence.

``module_overrides`` name module paths and ``node_overrides`` node names (the report's node column).  A
value is a category (``categories.py`` reads it) or one of float8's, :data:`FORCE` / :data:`REFUSE`
(``float8.py`` reads those; ``"recompute"``/``"no_recompute"`` left for the islands when the options were
built).  Whatever the value decides, one rule says which override a node follows (:func:`override_for`):
its own node override, else the module override of the longest path that covers it.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch.fx as fx

from ..graph import covering, module_path_of
from ..op_lists import Category, Source

__all__ = ["FORCE", "REFUSE", "split_overrides", "check_places", "Override", "override_for"]

#: override values (``node_overrides``/``module_overrides``) that decide float8 rather than a category
FORCE = "float8"  # run these matmuls in float8 whatever the cost model says (still only where float8 can)
REFUSE = "no_float8"  # keep these matmuls in the policy's compute dtype (bfloat16)


def split_overrides(overrides: Optional[Mapping[str, Any]]) -> Tuple[Optional[Dict[str, Any]], Dict[str, str]]:
    """``(category overrides, float8 overrides)``: the values :data:`FORCE` and :data:`REFUSE` go to the second."""
    if not overrides:
        return (dict(overrides) if overrides is not None else None), {}
    valid = {c.value for c in Category} | {FORCE, REFUSE}
    for key, value in overrides.items():
        if isinstance(value, str) and not isinstance(value, Category) and value not in valid:
            raise ValueError(f"override {key!r}: {value!r} is neither a category ({', '.join(c.value for c in Category)}) "
                             f"nor {FORCE!r} / {REFUSE!r}")
    f8 = {k: v for k, v in overrides.items() if isinstance(v, str) and v in (FORCE, REFUSE)}
    rest = {k: v for k, v in overrides.items() if k not in f8}
    return (rest or None), f8


def check_places(gm: fx.GraphModule, module_overrides: Mapping[Any, Any], node_overrides: Mapping[Any, Any]) -> None:
    """Raise a one-line error for a key that names no place of ``gm``: a module path it lacks, a node name it
    lacks (with the closest ones), or a node that is no op (an input, a parameter read, the output)."""
    paths = {name for name, _ in gm.named_modules()}
    for path in module_overrides:
        if not isinstance(path, str):
            raise TypeError(f"module_overrides keys are module paths such as 'encoder.layers.3', not {path!r}")
        if path not in paths:
            close = sorted(p for p in paths if p and (p.startswith(path) or path.startswith(p)))[:5]
            raise ValueError(f"module_overrides: {path!r} is not a submodule of the model"
                             + (f"; did you mean one of {close}?" if close else ""))
    names = {n.name: n for n in gm.graph.nodes}
    for name in node_overrides:
        if not isinstance(name, str):
            raise TypeError(f"node_overrides keys are node names as fxamp.report shows them (e.g. 'add_1'), "
                            f"not {name!r}")
        node = names.get(name)
        if node is None:
            close = difflib.get_close_matches(name, list(names), n=5)
            raise ValueError(f"node_overrides: the graph has no node {name!r}"
                             + (f"; did you mean one of {close}?" if close else "")
                             + " (names are those of fxamp.report's node column, for the same front end)")
        if node.op in ("placeholder", "get_attr", "output"):
            raise ValueError(f"node_overrides: {name!r} is a graph {node.op}, not an op; override the ops that use it")


class Override(NamedTuple):
    """The override a node follows: its value, where it came from (``Source.NODE_OVERRIDE`` or
    ``Source.MODULE_OVERRIDE``) and the place, as a message names it (``"node 'add_1'"``, ``"module 'enc.0'"``)."""

    value: Any
    source: Source
    where: str


def override_for(node: fx.Node, node_overrides: Mapping[str, Any],
                 module_overrides: Mapping[str, Any]) -> Optional[Override]:
    """The override ``node`` follows: its node override, else the module override covering its module path
    (the longest prefix, on a dot: ``graph.covering``); None when neither names it."""
    if node.name in node_overrides:
        return Override(node_overrides[node.name], Source.NODE_OVERRIDE, f"node {node.name!r}")
    cover = covering(module_path_of(node), module_overrides)
    if cover is None:
        return None
    return Override(cover[1], Source.MODULE_OVERRIDE, f"module {cover[0]!r}")
