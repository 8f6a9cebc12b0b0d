"""Float32 islands recomputed in backward from their low-precision inputs (a pass over a converted graph).

A float32 op that reads an exact upcast of a low-precision value (the loss's log-softmax over bfloat16
logits, a norm or softmax whose input was cast up) keeps float32 tensors for backward that carry no
more information than the low-precision value they came from: the loss's log-probabilities cost 4
bytes per logit.  :func:`recompute_islands` finds each such island (an upcast and the float32
elementwise/reduction ops that follow it, never a matmul), decides whether recomputing it pays, and
makes backward keep the island's inputs instead (``conversion/runtime/recompute.py`` runs it)::

    logits = linear(h, w)                        logits = linear(h, w)
    f = logits.float()                           on = island_on(logits)
    ce = cross_entropy(f.view(-1, V), y)   ==>   x = island_input(logits, on); y2 = island_input(y, on)
    return ce, f                                 f = x.float(); ce = cross_entropy(f.view(-1, V), y2)
                                                 out = island_output(on, PROGRAM, (logits, y), (f, ce))
                                                 return out[1], out[0]

The island's ops stay in the graph, their decisions too (``Decision.recompute`` holds the choice, on
every node of the island, for the report).  The recomputed values are the same numbers, so the
gradients are the same bit for bit.  Decided per island: it must contain an op that saves a float32
tensor (views, adds and sums save none), at most :data:`MAX_OPS` ops, no random or in-place op, no
op of a checkpointed block (checkpoint recomputes those already), its upcast read nowhere else
(another reader would keep the float32 copy anyway), and where the capture knows the shape (torch.export)
at least :data:`MIN_NUMEL` elements; ``node_overrides``/``module_overrides`` values ``"recompute"`` and
``"no_recompute"`` decide one island; ``convert(recompute_islands=False)`` turns the pass off.

A loss island (an upcast, views of it, one cross-entropy: ``runtime.recompute.deferred_upcast``) runs its
forward in row chunks too: its casts to float32 become ``island_upcast`` (the low-precision value itself
while the island recomputes) and its loss ``island_loss`` (each chunk cast up; the same loss bit for bit),
so forward never holds the float32 logits and log-probabilities (8 bytes a logit, the step's peak at GPT-2
small's 8 x 1024 tokens).  The override value ``"whole_forward"`` keeps one island's forward as written.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

from ...dtypes import LOW, dtype_name
from ..capture.regions import CHECKPOINT
from ..graph import CAST, DECISION, IslandChoice, module_path_of, region_in_order
from ..classify.inference import DtypeInference
from ..op_lists import Category, Source
from ..options import NO_RECOMPUTE, WHOLE_FORWARD, ConvertOptions, DebugOverflow
from ..passes import Pass, Stage
from ..runtime.recompute import (CHUNK_BYTES, Ref, RowPlan, deferred_upcast, island_input, island_loss, island_on,
                                 island_output, island_upcast, resolve, row_plan)
from ..runtime import cast, cast_dense

__all__ = ["recompute_islands", "MAX_OPS", "MIN_NUMEL", "ISLANDS"]

#: an island holds at most this many ops: the recompute stays a few passes over one tensor
MAX_OPS = 32
#: where the capture knows the upcast's shape, fewer elements than this do not pay for a recompute
MIN_NUMEL = 1 << 16

_OPS = ("call_function", "call_method")
#: ops that save no float tensor of their input for backward (so an island of only these gains nothing)
_FREE = frozenset({"view", "reshape", "getitem", "contiguous", "permute", "transpose", "flatten", "squeeze",
                   "unsqueeze", "expand", "expand_as", "view_as", "size", "dim", "numel", "getattr", "float", "to",
                   "type", "cast", "cast_dense", "_to_copy", "add", "sub", "neg", "sum", "mean", "clone", "detach",
                   "chunk", "split", "unbind", "narrow", "select", "slice", "t", "iadd", "isub", "alias",
                   "unsafe_view", "_unsafe_view", "split_with_sizes"})
#: never in an island: matrix products (the point is to recompute cheap ops), random ops (a replay would differ)
_NEVER = ("matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "conv", "einsum", "attention", "dropout", "rand",
          "bernoulli", "multinomial", "normal", "uniform", "exponential", "embedding", "copy_", "set_")
#: losses: an island holding one that cannot run its backward in row chunks is not recomputed (see _choose)
_LOSSES = frozenset({"cross_entropy", "nll_loss", "cross_entropy_loss", "nll_loss_nd", "nll_loss_forward",
                     "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "mse_loss", "l1_loss",
                     "smooth_l1_loss", "huber_loss", "poisson_nll_loss", "gaussian_nll_loss"})
_LITERALS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout,
             type(Ellipsis))
_FXAMP_OK = (cast, cast_dense)
#: autograd called in forward (a force field's forces, -dE/dx with create_graph=True): an island runs its forward
#: without a graph and its backward is no differentiable op, so a graph calling one gets no island
_AUTOGRAD = (torch.autograd.grad, torch.autograd.backward)


def recompute_islands(gm: fx.GraphModule, options: ConvertOptions) -> List[str]:
    """Find, decide and rewrite every float32 island of ``gm`` (after the casts are inserted); returns notes.

    The pipeline lints and recompiles after its last pass.
    """
    if not options.recompute_islands:
        return []
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _AUTOGRAD
             or n.op == "call_method" and n.target == "backward"]
    if calls:
        return [f"no float32 island is recomputed: forward calls autograd ({_name(calls[0])}), which needs the "
                f"graph an island's forward does not build"]
    decisions = {n: n.meta[DECISION] for n in graph.nodes if DECISION in n.meta}
    static = DtypeInference(gm, dict(gm.named_modules()), decisions)
    _check_overrides(gm, options)
    claimed: Set[fx.Node] = set()
    islands: List[Tuple[List[fx.Node], List[fx.Node], IslandChoice]] = []
    for node in list(graph.nodes):
        if node in claimed or not _upcast(node, static) or not _admissible(node, decisions):
            continue
        members, entries = _grow(graph, node, static, decisions, claimed)
        if all(_name(m) in _FREE for m in members):
            continue  # views, casts, adds and sums save no float32 tensor: no island to speak of
        claimed.update(members)
        islands.append((members, entries, _choose(graph, members, entries, static, options)))
    islands = _apart(graph, islands)
    for members, _, choice in islands:
        for m in members:
            if DECISION in m.meta:
                m.meta[DECISION] = dataclasses.replace(m.meta[DECISION], recompute=choice)
    chosen = [(m, e, c) for m, e, c in islands if c.chosen]
    for members, entries, choice in chosen:  # all found first: a rewrite changes the graph the search reads
        _rewrite(graph, members, entries, choice.forward_chunked)
    if not chosen:
        return []
    saved = sorted({dtype_name(c.saved) for _, _, c in islands if c.chosen and c.saved is not None})
    return [f"recomputed float32 islands: {len(chosen)} of {len(islands)} keep their {'/'.join(saved)} inputs for "
            f"backward instead of the float32 tensors their ops save, and recompute in backward (same gradients; "
            f"recompute_islands=False turns this off)"]


def _apart(graph: fx.Graph, islands: List[Tuple[List[fx.Node], List[fx.Node], IslandChoice]]
           ) -> List[Tuple[List[fx.Node], List[fx.Node], IslandChoice]]:
    """The islands, each chosen one whose ops interleave with an earlier chosen island's declined.

    A rewrite moves what runs between its island's first and last op (:func:`_rewrite`); two chosen islands
    whose spans overlap (a recurrence written as a Python loop, RWKV's scan: step t's island reaches into step
    t+1's) would each move the other's ops out of order.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    taken: List[Tuple[int, int, str]] = []
    out = []
    for members, entries, choice in islands:
        if choice.chosen:
            lo, hi = min(order[m] for m in members), max(order[m] for m in members)
            other = next((name for a, b, name in taken if a <= hi and lo <= b), None)
            if other is None:
                taken.append((lo, hi, choice.island))
            else:
                choice = dataclasses.replace(choice, chosen=False, saved=None, chunked=False, forward_chunked=False,
                                             reason=f"its ops interleave with {other}'s, which is recomputed: "
                                                    f"one of two overlapping islands can be rewritten")
        out.append((members, entries, choice))
    return out


def _upcast(node: fx.Node, static: DtypeInference) -> bool:
    """A cast to float32 of a value known to be float16/bfloat16: the exact upcast an island starts from."""
    if node.op not in _OPS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if low_dtype(node.args[0], static) is None:
        return False
    if CAST in node.meta:
        return node.meta[CAST][1] == torch.float32
    if node.op == "call_method":
        if node.target == "float":
            return True
        if node.target == "to":
            dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
            rest = [a for a in node.args[1:] if isinstance(a, fx.Node)]
            return dtypes == [torch.float32] and not rest
        return False
    if node.target in (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default):
        return torch.float32 in (*node.args[1:2], node.kwargs.get("dtype"))
    return False


#: ops whose result has their first argument's dtype (a slice, a view, a copy)
_MOVES = frozenset({"getitem", "view", "reshape", "contiguous", "permute", "transpose", "flatten", "squeeze",
                    "unsqueeze", "expand", "narrow", "select", "slice", "t", "clone", "view_as", "expand_as"})


def low_dtype(node: fx.Node, static: DtypeInference) -> Optional[torch.dtype]:
    """The low-precision dtype ``node``'s value certainly has, through slices and views of a known value."""
    while True:
        known = static(node)
        if known in LOW:
            return known
        if known is not None or node.op not in _OPS or _name(node) not in _MOVES or not node.args \
                or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _literal(a: Any) -> bool:
    """Whether ``a`` can be written into an island's program in the generated code."""
    if isinstance(a, (fx.Node, *_LITERALS)):
        return True
    if isinstance(a, (tuple, list)) and not hasattr(type(a), "_fields"):
        return all(_literal(v) for v in a)
    if isinstance(a, slice):
        return all(_literal(v) for v in (a.start, a.stop, a.step))
    return False


def _target_name(node: fx.Node) -> Optional[str]:
    """The name the program calls ``node``'s op by, or None if it cannot name it."""
    if node.op == "call_method":
        return str(node.target)
    try:
        name = _get_qualified_name(node.target)
        return name if resolve(name) is node.target else None
    except Exception:  # an op with no importable name: not in an island
        return None


def _admissible(node: fx.Node, decisions: Dict[fx.Node, Any]) -> bool:
    """An op an island can hold: float32 or dtype-following, no matmul, random or in-place op, writable as data."""
    if node.op not in _OPS or node.meta.get(CHECKPOINT) is not None:
        return False
    d = decisions.get(node)
    if d is not None and (d.compute in LOW or d.resolved is Category.SAFE):
        return False
    name = _name(node).lower()
    if any(word in name for word in _NEVER) or (name.endswith("_") and not name.startswith("__")):
        return False
    if node.kwargs.get("inplace") is True:
        return False
    module = getattr(node.target, "__module__", "") or ""
    if node.op == "call_function" and module.startswith("fxamp") and node.target not in _FXAMP_OK:
        return False
    return _literal(tuple(node.args)) and _literal(tuple(node.kwargs.values())) and _target_name(node) is not None


def _grow(graph: fx.Graph, start: fx.Node, static: DtypeInference, decisions: Dict[fx.Node, Any],
          claimed: Set[fx.Node]) -> Tuple[List[fx.Node], List[fx.Node]]:
    """The island from ``start``: every later op that reads it (or reads what joined it) and can join.

    One pass in graph order: a node that reads the island joins if it is admissible and reads no
    node that could not join (``tainted``), so the island stays convex.  Another upcast it reads
    joins as a second entry (``cast(a) * cast(b)``).
    """
    members, entries = [start], [start]
    inside: Set[fx.Node] = {start}
    tainted: Set[fx.Node] = set()
    node = start.next
    while node.op != "root":
        ins = node.all_input_nodes
        if any(i in inside or i in tainted for i in ins):
            extra = [i for i in ins if i not in inside and i not in claimed and i not in tainted
                     and _upcast(i, static) and _admissible(i, decisions)]
            if (node not in claimed and _admissible(node, decisions) and not any(i in tainted for i in ins)
                    and len(members) + len(extra) < MAX_OPS):
                members += extra + [node]
                entries += extra
                inside.update(extra + [node])
            else:
                tainted.add(node)
        node = node.next
    return members, entries


def _override(members: List[fx.Node], options: ConvertOptions) -> Optional[Tuple[str, Source, str]]:
    """``(value, source, where)`` of the override that decides this island, or None."""
    names = {m.name for m in members}
    for kind, key, value in options.island_overrides:
        if kind == "node" and key in names:
            return value, Source.NODE_OVERRIDE, f"node {key!r}"
    best = None
    for kind, key, value in options.island_overrides:
        if kind != "module":
            continue
        for m in members:
            path = module_path_of(m)
            if (key == "" or path == key or path.startswith(key + ".")) and (best is None or len(key) > len(best[0])):
                best = (key, value)
    return None if best is None else (best[1], Source.MODULE_OVERRIDE, f"module {best[0]!r}")


def _choose(graph: fx.Graph, members: List[fx.Node], entries: List[fx.Node], static: DtypeInference,
            options: ConvertOptions) -> IslandChoice:
    name = f"island_{members[0].name}"
    low = low_dtype(entries[0].args[0], static)
    what = dict(island=name, entries=tuple(e.name for e in entries))
    forced = _override(members, options)
    if forced is not None and forced[0] == NO_RECOMPUTE:
        return IslandChoice(chosen=False, reason=f"no_recompute for {forced[2]} (override)", source=forced[1], **what)
    source = Source.DEFAULT if forced is None else forced[1]
    whole_forward = None
    if forced is not None and forced[0] == WHOLE_FORWARD:  # (the rule decides the recompute itself)
        whole_forward, forced = forced[2], None
    inside = set(members)
    why = None
    saving = [m for m in members if _name(m) not in _FREE]
    if any(u not in inside and u.op != "output" for e in entries for u in e.users):
        why = "its float32 upcast is read outside the island too, which keeps it for backward anyway"
    else:
        val = entries[0].args[0].meta.get("val")
        numel = val.numel() if isinstance(val, torch.Tensor) else None  # (a symbolic size is no int)
        if isinstance(numel, int) and numel < MIN_NUMEL and forced is None:
            why = f"{numel} elements: too few to pay for a recompute (fewer than {MIN_NUMEL})"
    program, _, externals = _program(graph, members)
    plan = row_plan(program, len(externals))
    chunked = isinstance(plan, RowPlan)
    if why is None and not chunked and forced is None and any(_name(m) in _LOSSES for m in members):
        why = (f"a loss whose backward cannot run in row chunks ({plan}): recomputed whole, it would hold its "
               f"float32 tensors again on top of the kept input where backward starts, at the step's peak")
    if why is not None:
        return IslandChoice(chosen=False, reason=why, source=source, **what)
    ops = ", ".join(dict.fromkeys(_name(m) for m in saving))
    by = f" ({forced[2]}, override)" if forced is not None else ""
    forward = chunked and whole_forward is None and isinstance(deferred_upcast(program, len(externals)), tuple)
    how = (f"; its {'forward and ' if forward else ''}backward run{'' if forward else 's'} in chunks of rows of "
           f"~{CHUNK_BYTES >> 20} MiB of float32" if chunked else f"; its backward recomputes it whole ({plan})")
    if whole_forward is not None:
        how += f" (its forward whole: whole_forward for {whole_forward}, override)"
    return IslandChoice(chosen=True, saved=low, source=source, chunked=chunked, forward_chunked=forward, **what,
                        reason=f"recomputed in backward from its {dtype_name(low)} input{by}, which backward "
                               f"keeps instead of the float32 tensors {ops} would save{how}")


def _check_overrides(gm: fx.GraphModule, options: ConvertOptions) -> None:
    names = {n.name for n in gm.graph.nodes}
    for kind, key, value in options.island_overrides:
        if kind == "node" and key not in names:
            raise ValueError(f"node_overrides: the graph has no node {key!r} for {value!r} (names are "
                             f"fxamp.report's node column)")


def _program(graph: fx.Graph, members: List[fx.Node]) -> Tuple[Tuple[Any, ...], List[fx.Node], List[fx.Node]]:
    """``(the island's program, its members in graph order, the values it reads from outside)``.

    The program is ``(steps, outputs)`` (``conversion/runtime/recompute.py``): each member as ``(kind, op name,
    args, kwargs)`` with a :class:`Ref` for each value it reads (the outside values first, then the
    members in order), and the members read after the island.
    """
    _, members, externals = region_in_order(graph, members)
    inside = set(members)
    index: Dict[fx.Node, int] = {x: i for i, x in enumerate(externals)}
    index.update({m: len(externals) + j for j, m in enumerate(members)})

    def encode(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return Ref(index[a])
        if isinstance(a, (tuple, list)):
            return type(a)(encode(v) for v in a)
        if isinstance(a, slice):
            return slice(encode(a.start), encode(a.stop), encode(a.step))
        return a

    steps = tuple(("m" if m.op == "call_method" else "f", _target_name(m), encode(tuple(m.args)),
                   tuple((k, encode(v)) for k, v in m.kwargs.items())) for m in members)
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    return (steps, tuple(index[o] for o in outputs)), members, externals


def _rewrite(graph: fx.Graph, members: List[fx.Node], entries: List[fx.Node], forward_chunked: bool) -> None:
    """Route one island through ``island_on`` / ``island_input`` / ``island_output`` (the module docstring); with
    ``forward_chunked``, its upcast and loss through ``island_upcast`` / ``island_loss`` too."""
    program, members, externals = _program(graph, members)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(members)
    first, last = members[0], members[-1]
    # what the island reads must exist before its first op: move those computed later (none reads the island)
    needed: Set[fx.Node] = set()
    todo = list(externals)
    while todo:
        n = todo.pop()
        if n in needed or order[n] < order[first] or n.op == "placeholder":
            continue
        needed.add(n)
        todo.extend(n.all_input_nodes)
    for n in sorted(needed, key=order.__getitem__):
        first.prepend(n)
    later = [n for n in graph.nodes if order[first] < order[n] < order[last] and n not in inside and n not in needed]

    with graph.inserting_before(first):
        on = graph.call_function(island_on, tuple(e.args[0] for e in entries))
        detached = {x: graph.call_function(island_input, (x, on)) for x in externals}
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    for m in members:
        for x in m.all_input_nodes:
            if x in detached:
                m.replace_input_with(x, detached[x])
    if forward_chunked:  # (the program, read above, keeps the ops as written: backward runs those)
        casts, at = deferred_upcast(program, len(externals))
        for up in (members[i - len(externals)] for i in casts):
            up.op, up.target, up.args, up.kwargs = "call_function", island_upcast, (up.args[0], on, CAST in up.meta), {}
        loss = members[at - len(externals)]
        loss.target, loss.args = island_loss, (on, _target_name(loss), *loss.args)
    with graph.inserting_after(last):
        exit_node = graph.call_function(island_output, (on, program, tuple(externals), tuple(outputs)))
    after = exit_node
    for k, o in enumerate(outputs):
        with graph.inserting_after(after):
            after = graph.call_function(operator.getitem, (exit_node, k))
        after.meta = {key: v for key, v in o.meta.items() if key not in (DECISION, CAST)}
        o.replace_all_uses_with(after, delete_user_cb=lambda u: u not in inside and u is not exit_node)
    for n in later:  # what ran between the island's ops and reads its outputs now runs after it
        after.append(n)
        after = n


#: after the casts; off under debug_overflow (its checks watch every op's gradient: the ops run as written)
ISLANDS = Pass("islands", Stage.REWRITE, lambda gm, c: recompute_islands(gm, c.options),
               applies=lambda c: c.policy.enabled and c.options.debug_overflow is DebugOverflow.OFF)
