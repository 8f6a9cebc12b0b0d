"""The dtype-leak lint: float32 values that feed low-precision work, each with what to do about it."""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch
import torch.fx as fx

from ..dtypes import dtype_name
from ..graph import CAST, Decision, attr_target
from ..op_lists import Source
from .records import LOW_NAMES, Lint

__all__ = ["find_lints"]

#: sources that mean the user chose this decision: a lint would only repeat their choice back
_USER_CHOSEN = (Source.OVERRIDE, Source.MODULE_OVERRIDE)


def find_lints(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], view: Any, params: set,
           buffers: set) -> Iterable[Lint]:
    """Float32 values that feed low-precision work.

    * ``param-promotion``: an op that follows its inputs mixes a low-precision value with a
      float32 parameter or buffer, so it (and the branch after it) runs in float32.
    * ``cast-down``: an activation computed in float32 is cast to low precision for its consumers:
      a cast each forward and a float32 copy alive meanwhile.  Not raised where the user chose
      float32 (``Decision.source`` is an override).
    """
    for node in gm.graph.nodes:
        d = decisions.get(node)
        if d is None or not node.op.startswith("call_") or (attr_target(node) is not None) or d.compute is not None:
            continue
        sources = [view.source(n) for n in node.all_input_nodes]
        dts = {s: view.dtype(s) for s in sources}
        low = [s for s, dt in dts.items() if dt in LOW_NAMES]
        attrs = [s for s, dt in dts.items() if dt == "float32" and (attr_target(s) is not None)]
        if low and attrs:
            names = ", ".join(attr_target(a) for a in attrs)
            kinds = "parameter" if all(attr_target(a) in params for a in attrs) else "parameter/buffer"
            plural = "s" if len(attrs) > 1 else ""
            yield Lint("param-promotion", node.name,
                       f"float32 {kinds}{plural} {names} meet{'' if plural else 's'} {dts[low[0]]} {attr_target(low[0]) or low[0].name} "
                       f"in {d.op}, which therefore runs in float32, and so does what follows; store it in "
                       f"low precision (O2 does) or cast it where it is used")

    for cast in gm.graph.nodes:
        if CAST not in cast.meta:
            continue
        src, dtype = cast.meta[CAST]
        if dtype_name(dtype) not in LOW_NAMES or src.op == "placeholder" or (attr_target(src) is not None):
            continue
        if view.dtype(src) != "float32" or view.cast_effective(cast) is False:
            continue
        d = decisions.get(view.source(src))
        users = ", ".join(u.name for u in cast.users)
        if d is not None and d.compute == torch.float32:
            if d.source in _USER_CHOSEN:
                continue  # the user put it in float32 (overrides= / module_overrides=): nothing to tell them
            why = f"{d.op} runs in float32 ({d.resolved.value})"
            fix = "expected after a float32 op; if its consumers tolerate it, let it run in low precision " \
                  "(overrides= / module_overrides=)"
        else:
            culprits = [view.source(n) for n in src.all_input_nodes if view.dtype(view.source(n)) == "float32"]
            names = ", ".join((attr_target(c) or c.name) for c in culprits) or "its inputs"
            why = f"{src.name} came out float32 because {names} {'is' if len(culprits) == 1 else 'are'} float32"
            fix = "keep that value in low precision upstream to save the cast and the float32 copy"
        yield Lint("cast-down", src.name, f"float32 output is cast to {dtype_name(dtype)} for {users}: {why}; {fix}")
