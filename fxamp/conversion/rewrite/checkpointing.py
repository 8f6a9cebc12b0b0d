"""Activation checkpointing kept: each block the user checkpointed runs as a checkpointed call again.

Both front ends trace through ``torch.utils.checkpoint.checkpoint(block, ...)``; capture marks the
nodes the block made (``capture/regions.py``, ``meta[CHECKPOINT]``, one region per call).  After the
rewrite, :func:`keep_checkpoints` moves each region, with the casts fxamp inserted inside it, into
a sub-``GraphModule`` and calls it through ``checkpoint``::

    h = linear(x)                                     h = linear(x)
    ws = cast_weights(cache, (w_pre, w_fc), bf16)     ws = cast_weights(cache, (w_pre,), bf16)
    y = gelu(linear(h.to(bf16), ws[1]))          ==>  out = checkpointed(self._fxamp_checkpoint_0, h, fc,
    return c(y)                                                           cache, use_reentrant=False)
                                                      y = out[0]
                                                      return c(y)

    # self._fxamp_checkpoint_0: fc.weight read, cast_weights(cache, (w_fc,), bf16), the cast, gelu, linear

What goes in with the block: the casts fxamp inserted for it, the reads of its parameters and its
own ``cast_weights`` call (split off the forward's single one), so its low-precision weight
copies are made inside it, as autocast makes them: not held from forward to backward (checkpoint
saves every tensor it is called with), and made again from the current float32 weights when
backward recomputes the block (in training a trained weight is always cast afresh; the weight
cache serves only frozen weights and no-grad calls, and checks each weight's version).  What it
is called with: activations, and the modules it reads parameters from or calls (objects, not
tensors: not saved).  The sub-module holds no parameter, so ``state_dict`` keeps its keys.
``checkpoint``'s ``preserve_rng_state`` (on by default) replays dropout identically.

A region that is not convex (a value leaves it and comes back) is not kept: it is noted, as when
capture could not mark a block.
"""

from __future__ import annotations

import operator
import warnings
from typing import Dict, List, Optional, Set

import torch.fx as fx
import torch.nn as nn

from ..capture.regions import CHECKPOINT, CheckpointMark, traced_through_note
from ..graph import CAST, region_in_order, rename_node
from ..passes import Pass, Stage
from ..runtime import cast_weights, checkpointed

__all__ = ["keep_checkpoints", "checkpoint_calls", "inline_checkpoints_", "BLOCK_NAME", "CHECKPOINTS"]

#: the sub-``GraphModule`` of the i-th checkpointed block is the child ``f"{BLOCK_NAME}_{i}"``
BLOCK_NAME = "_fxamp_checkpoint"

_OPS = ("call_function", "call_method", "call_module")


def keep_checkpoints(gm: fx.GraphModule, frontend: str) -> List[str]:
    """Run every marked region of ``gm`` as a checkpointed call; returns one note per region (kept or not)."""
    regions: Dict[int, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        mark = node.meta.get(CHECKPOINT)
        if isinstance(mark, CheckpointMark) and node.op in _OPS:
            regions.setdefault(mark.region, []).append(node)
    notes: List[str] = []
    kept: Dict[str, int] = {}
    mark_kwargs = {}
    for number in sorted(regions):
        nodes = regions[number]
        mark = nodes[0].meta[CHECKPOINT]
        mark_kwargs[mark.where] = mark.kwargs
        why = _keep(gm, nodes, mark)
        if why is None:
            kept[mark.where] = kept.get(mark.where, 0) + 1
        else:
            for node in nodes:
                node.meta.pop(CHECKPOINT, None)
            note = traced_through_note(mark.where, frontend, why)
            warnings.warn(f"fxamp: {note}", stacklevel=4)
            notes.append(note)
    for where, count in kept.items():
        calls = f" ({count} calls)" if count > 1 else ""
        notes.append(f"activation checkpointing at {where} kept{calls}: the converted block runs under "
                     f"torch.utils.checkpoint.checkpoint({', '.join(f'{k}={v!r}' for k, v in mark_kwargs[where])}); "
                     f"its weight casts are made inside it, and again when backward recomputes it")
    if regions:
        gm.graph.lint()
        gm.recompile()
    return notes


def _region(graph: fx.Graph, marked: List[fx.Node]) -> Set[fx.Node]:
    """The marked nodes, and the nodes fxamp inserted (no stack trace: casts, parameter reads) whose
    every user is in the region.  One pass from the end: a node's users come after it."""
    region = set(marked)
    for node in reversed(list(graph.nodes)):
        if node in region or node.op not in _OPS or node.meta.get("stack_trace"):
            continue
        if node.users and all(u in region for u in node.users):
            region.add(node)
    return region


def _split_weight_casts(graph: fx.Graph, region: Set[fx.Node]) -> None:
    """Give the region a ``cast_weights`` call of its own for the weights only it uses.

    A forward casts all its weights in one call; the block's copies are made inside the block
    instead, as autocast makes them there: not held from forward to backward, cast again (from
    the current float32 weight) when backward recomputes the block.
    """
    for batch in list(graph.find_nodes(op="call_function", target=cast_weights)):
        users = list(batch.users)
        if len(batch.args) != 4 or not all(u.target is operator.getitem for u in users):
            continue
        cache, weights, dtype, keys = batch.args
        mine = sorted({int(u.args[1]) for u in users if u in region})
        if not mine:
            continue
        rest = [i for i in range(len(weights)) if i not in mine]
        with graph.inserting_before(batch):
            own = graph.call_function(cast_weights, (cache, tuple(weights[i] for i in mine), dtype,
                                                     tuple(keys[i] for i in mine)))
        for u in users:
            index = int(u.args[1])
            u.args = (own, mine.index(index)) if index in mine else (batch, rest.index(index))
        if rest:
            batch.args = (cache, tuple(weights[i] for i in rest), dtype, tuple(keys[i] for i in rest))
        else:
            graph.erase_node(batch)


def _convex(region: Set[fx.Node]) -> bool:
    """No path leaves the region and comes back into it."""
    seen: Set[fx.Node] = set()
    todo = [u for n in region for u in n.users if u not in region]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user in region:
                return False
            todo.append(user)
    return True


def _keep(gm: fx.GraphModule, marked: List[fx.Node], mark: CheckpointMark) -> Optional[str]:
    """Move the region into a checkpointed call; None when done, else why it was not."""
    graph = gm.graph
    _split_weight_casts(graph, _region(graph, marked))  # the same computation, in two calls
    region = _region(graph, marked)
    if not _convex(region):
        return "a value leaves its block and comes back into it"
    # the block's inputs (values from outside, then the modules it calls) and outputs (values used after it)
    order, nodes, inputs = region_in_order(graph, region)
    first, last = nodes[0], nodes[-1]
    modules = list(dict.fromkeys(str(n.target) for n in nodes if n.op == "call_module"))
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    try:
        block = _block(graph, nodes, inputs, modules, outputs)
    except Exception as e:  # a node fx cannot copy: the graph is unchanged, the block runs unkept
        return f"its block could not be rebuilt: {type(e).__name__}: {e}"
    name, i = f"{BLOCK_NAME}_{mark.region}", 0
    while hasattr(gm, name):
        i += 1
        name = f"{BLOCK_NAME}_{mark.region}_{i}"
    gm.add_module(name, block)

    # the outside nodes between its first and last node: those it needs go before it, the rest after
    span = [n for n in graph.nodes if order[first] <= order[n] <= order[last] and n not in region]
    needed: Set[fx.Node] = set()
    todo = list(inputs)
    while todo:
        node = todo.pop()
        if node in needed or order[node] < order[first]:
            continue
        needed.add(node)
        todo.extend(node.all_input_nodes)
    for node in span:
        if node in needed and node.op != "placeholder":  # (a placeholder is bound at the call, wherever it is)
            first.prepend(node)

    # the call, its outputs, then the outside nodes that came after the block's first node
    with graph.inserting_before(last.next):  # in this order, after the block's last node
        module_nodes = [graph.get_attr(target) for target in modules]
        block_node = graph.get_attr(name)
        call = graph.call_function(checkpointed, (block_node, *inputs, *module_nodes), dict(mark.kwargs))
    after = call
    results = {}
    for k, out in enumerate(outputs):
        with graph.inserting_after(after):
            after = graph.call_function(operator.getitem, (call, k))
        after.meta = {key: v for key, v in out.meta.items() if key != CHECKPOINT}
        results[out] = after
    for node in span:
        if node not in needed and node.op != "placeholder":
            after.append(node)
            after = node
    for out, value in results.items():
        out.replace_all_uses_with(value, delete_user_cb=lambda user: user not in region)
    for node in reversed(nodes):
        graph.erase_node(node)
    return None


def _block(graph: fx.Graph, nodes: List[fx.Node], inputs: List[fx.Node], modules: List[str],
           outputs: List[fx.Node]) -> fx.GraphModule:
    """The region as a graph module of its own: inputs and modules become placeholders, a module call a
    call of its placeholder; it holds no parameter and no module."""
    sub = fx.Graph()
    sub._tracer_cls = graph._tracer_cls  # unpickling traces its code again with fxamp's tracer
    sub._tracer_extras = getattr(graph, "_tracer_extras", None)
    env: Dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
        env[value].meta = {k: v for k, v in value.meta.items() if k != CHECKPOINT}
    called = {target: sub.placeholder(target.replace(".", "_") + "_module") for target in modules}
    for node in nodes:
        if node.op == "call_module":
            new = sub.create_node("call_method", "__call__",
                                  (called[str(node.target)], *fx.map_arg(node.args, env.__getitem__)),
                                  fx.map_arg(node.kwargs, env.__getitem__), name=node.name)
            new.meta = dict(node.meta)
        else:
            new = sub.node_copy(node, env.__getitem__)
        new.meta.pop(CHECKPOINT, None)
        env[node] = new
    sub.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(nn.Module(), sub, class_name="CheckpointedBlock")


def checkpoint_calls(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes of ``gm`` that call a checkpointed block."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is checkpointed]


def inline_checkpoints_(gm: fx.GraphModule) -> int:
    """Put each checkpointed block's ops back in ``gm``'s own graph, in place; returns how many blocks.

    The report's view of a converted module: every op in one graph, with its decision and the casts
    in front of it (checkpointing changes what backward keeps, not what forward computes).  Call it
    on a copy: the module then no longer checkpoints.
    """
    graph = gm.graph
    calls = checkpoint_calls(gm)
    attrs = {a for call in calls for a in call.args if isinstance(a, fx.Node) and a.op == "get_attr"}
    for call in calls:
        block_node, args = call.args[0], call.args[1:]
        block = gm.get_submodule(str(block_node.target))
        placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
        env: Dict[fx.Node, fx.Node] = dict(zip(placeholders, args))
        module_of = {p: str(a.target) for p, a in zip(placeholders, args) if a.op == "get_attr" and _is_module(gm, a)}
        names = {n.name for n in graph.nodes}
        result = None
        with graph.inserting_before(call):
            for node in block.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    result = fx.map_arg(node.args[0], env.__getitem__)
                    break
                if node.op == "call_method" and node.target == "__call__" and node.args[0] in module_of:
                    new = graph.call_module(module_of[node.args[0]], fx.map_arg(node.args[1:], env.__getitem__),
                                            fx.map_arg(node.kwargs, env.__getitem__))
                    new.meta = dict(node.meta)
                else:
                    new = graph.node_copy(node, env.__getitem__)
                if new.name != node.name and node.name not in names:
                    rename_node(graph, new, node.name)  # the name it had before keep_checkpoints moved it
                names.add(new.name)
                env[node] = new
        for user in list(call.users):  # out = checkpointed(...); y = out[k]
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(call)
    for node in attrs:
        if not node.users:
            graph.erase_node(node)  # the blocks, and the modules only they were called with
    by_name = {n.name: n for n in graph.nodes}
    for node in graph.nodes:  # a cast whose source moved into a block (and now back): point it at the copy
        if CAST in node.meta and node.meta[CAST][0].name in by_name:
            source, dtype = node.meta[CAST]
            node.meta[CAST] = (by_name[source.name], dtype)
    if calls:
        graph.lint()
        gm.recompile()
    return len(calls)


def _is_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    try:
        return isinstance(gm.get_submodule(str(node.target)), nn.Module)
    except AttributeError:
        return False


#: the last pass: each checkpointed block takes its casts (and overflow checks) along
CHECKPOINTS = Pass("checkpoints", Stage.REWRITE, lambda gm, c: keep_checkpoints(gm, c.frontend))
