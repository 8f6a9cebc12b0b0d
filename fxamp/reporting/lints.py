"""The dtype-leak lints: float32 values that feed low-precision work, low-precision storage only float32 work
reads, each with what to do about it."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch
import torch.fx as fx

from ..dtypes import dtype_name
from ..conversion.graph import CAST, Decision, attr_target
from ..conversion.op_lists import Source
from ..conversion.runtime.recompute import island_output
from .records import LOW_NAMES, Lint

__all__ = ["find_lints"]

#: sources that mean the user chose this decision: a lint would only repeat their choice back
_USER_CHOSEN = (Source.OVERRIDE, Source.MODULE_OVERRIDE, Source.NODE_OVERRIDE)


def find_lints(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], view: Any, params: set,
           buffers: set) -> Iterable[Lint]:
    """Float32 values that feed low-precision work.

    * ``param-promotion``: an op that follows its inputs mixes a low-precision value with a
      float32 parameter or buffer, so it (and the branch after it) runs in float32.
    * ``cast-down``: an activation computed in float32 is cast to low precision for its consumers:
      a cast each forward and a float32 copy alive meanwhile.  Not raised where the user chose
      float32 (``Decision.source`` is an override), nor where the value was made in float32 by the
      model itself (a KV cache, an input): each lint says what to do, or does not fire.
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
                       f"in {d.op}, which therefore runs in float32, and so does what follows (as under "
                       f"autocast); to run it low, cast it where it is used, or store every parameter low (O3; "
                       f"O2 keeps tensors that enter the activations directly in float32)")

    stored = set(gm.state_dict(keep_vars=True))
    for cast in gm.graph.nodes:
        if CAST not in cast.meta:
            continue
        src, dtype = cast.meta[CAST]
        if dtype_name(dtype) not in LOW_NAMES or src.op == "placeholder" or (attr_target(src) is not None):
            continue
        if view.dtype(src) != "float32" or view.cast_effective(cast) is False:
            continue
        readers = _readers(cast)
        users = ", ".join(u.name for u in readers)
        ops, attrs = _origins(src, decisions, view)
        attrs = [a for a in attrs if attr_target(a) in stored]  # not constants the model makes (an empty cache)
        ops = [o for o in ops if decisions[o].source not in _USER_CHOSEN]  # the user chose float32 there
        if ops:
            d = decisions[ops[0]]
            names = ", ".join(o.name for o in ops)
            why = (f"{d.op} runs in float32 ({d.resolved.value})" if ops == [src] else
                   f"it comes from {names} ({d.op}, {d.resolved.value}), which runs in float32")
            fix = (f"expected after a float32 op; if {users} tolerate{'s' if len(readers) == 1 else ''} it, let "
                   f"{ops[0].name} run in low precision (overrides= / "
                   f"{'module_overrides=' if d.module else 'node_overrides='})")  # (at the root no path covers it)
        elif attrs:
            names = ", ".join(attr_target(a) for a in attrs)
            why = f"it comes from float32 parameter/buffer {names}"
            fix = ("store it in low precision (O2 does for the tensors of low-precision ops, O3 for all) or cast it "
                   "where it is used")
        else:
            continue  # made in float32 by the model itself (a KV cache, a float32 input): nothing to act on
        yield Lint("cast-down", src.name, f"float32 output is cast to {dtype_name(dtype)} for {users}: {why}; {fix}")

    yield from _stored_low_read_float32(gm, view)


def _stored_low_read_float32(gm: fx.GraphModule, view: Any) -> Iterable[Lint]:
    """``stored-low``: a parameter stored in low precision that every reader casts up to float32 first: rounded
    for nothing, and cast whole at every call.  Convert and its lazy and in-place paths store a tensor before
    any graph exists where a model's graphs differ by mode or are captured per block (``storage.predict_storage``):
    a table only a norm in another module reads (RWKV's) is predicted low there."""
    upcasts: Dict[fx.Node, List[fx.Node]] = {}
    for cast in gm.graph.nodes:
        if CAST in cast.meta and cast.meta[CAST][1] == torch.float32 and attr_target(cast.meta[CAST][0]) is not None:
            upcasts.setdefault(cast.meta[CAST][0], []).append(cast)
    for src, casts in upcasts.items():
        stored = view.dtype(src)
        if stored not in LOW_NAMES or any(u not in casts for u in _readers(src)):
            continue
        name = attr_target(src)
        module = name.rpartition(".")[0]
        yield Lint("stored-low", src.name,
                   f"{name} is stored {stored}, but every op that reads it computes in float32: it was rounded for "
                   f"nothing and is cast up whole at every call; to store it float32, make its module unsafe "
                   f"(module_overrides={{{module!r}: 'unsafe'}}, its path in the model)")


def _readers(node: fx.Node) -> List[fx.Node]:
    """The nodes that read ``node``'s value, through a recomputed island's output (``conversion.rewrite.islands``)."""
    out: List[fx.Node] = []
    for u in node.users:
        if u.op == "call_function" and u.target is island_output and node in u.args[3]:
            k = list(u.args[3]).index(node)
            out += [r for g in u.users if g.args[1] == k for r in g.users]
        else:
            out.append(u)
    return out


def _origins(node: fx.Node, decisions: Dict[fx.Node, Decision], view: Any) -> Tuple[List[fx.Node], List[fx.Node]]:
    """Where a float32 value comes from, through ops that follow their inputs' dtype (views, adds, ...).

    Returns (ops that compute in float32 by decision, float32 parameters/buffers).  Values the model
    makes in float32 itself (factory ops, a cache, inputs) are neither: no lint can help with them.
    """
    ops: List[fx.Node] = []
    attrs: List[fx.Node] = []
    seen = set()
    stack = [view.source(node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if attr_target(n) is not None:
            attrs.append(n)
            continue
        d = decisions.get(n)
        if d is None or n.op == "placeholder":
            continue
        if d.compute == torch.float32:
            ops.append(n)
            continue
        if d.compute is None:
            stack.extend(view.source(i) for i in reversed(n.all_input_nodes) if view.dtype(view.source(i)) == "float32")
    return ops, attrs
