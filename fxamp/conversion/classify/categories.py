"""Decide, for every node of a captured graph, its category, the reason, and the dtype it computes in.

``classify`` is pure: it reads the graph, the policy and the op lists and returns one :class:`Decision`
per node; the pass :data:`CATEGORIES` (the first of ``pipeline.PASSES``) also records each as
``node.meta["fxamp"]``.  The rewrite and the report both read these records, so they can never disagree.
:data:`UNUSED_OVERRIDES` and :data:`FLOAT32_LEAVES` are the stage's notes on what the decisions mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import parametrize

from ...dtypes import CASTABLE, LOW, NOT_FLOAT, dtype_name
from ...errors import ConversionError
from ...policy import Policy
from ..graph import ATTR, RECEIVER, Decision, module_path_of
from ..capture.concrete import guard
from ..capture.constants import fit_scalar
from ..op_lists import (DEFAULT_OP_LISTS, Category, OpEntry, OpLists, Source, as_entry, is_inplace, op_key, op_name,
                        out_of_place)
from ..options import ConvertOptions, ModuleOverrides, NodeOverrides
from ..passes import Conversion, Pass, Stage, record
from .inference import DtypeInference
from .overrides import check_places, override_for, split_overrides

__all__ = ["classify", "unused_overrides", "float32_leaves", "FLOAT32_LEAF_SHARE", "ModuleOverrides", "NodeOverrides",
           "CATEGORIES", "UNUSED_OVERRIDES", "FLOAT32_LEAVES"]

#: the sources that are the user's choice for one place: no later rule of fxamp's changes them
_PINNED = (Source.MODULE_OVERRIDE, Source.NODE_OVERRIDE)


def unused_overrides(gm: fx.GraphModule, options: ConvertOptions) -> List[str]:
    """A note for each of the user's op ``overrides`` that no op of the graph looks up, so it changed nothing.

    Module and node overrides name places in one model (an unknown one is an error); op keys are
    general (one set may serve many models), so an unused one is a note, not an error.
    """
    if not options.override_keys:
        return []
    modules = dict(gm.named_modules())
    seen = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            seen.add(type(modules[str(node.target)]))
        elif node.op in ("call_function", "call_method"):
            seen.add(op_key(node.target))
            plain = out_of_place(node.op, node.target)  # an in-place op is classified as its plain form
            if plain is not None:
                seen.add(op_key(plain))
    return [f"overrides: {op_name(key)} matches no op of the captured graph, so it changes nothing (the model "
            f"has no such module or call, or the front end traced into the module); check the key in fxamp.report"
            for key in options.override_keys if key not in seen]


def classify(
    gm: fx.GraphModule,
    policy: Policy,
    op_lists: OpLists = DEFAULT_OP_LISTS,
    module_overrides: Optional[ModuleOverrides] = None,
    node_overrides: Optional[NodeOverrides] = None,
) -> Dict[fx.Node, Decision]:
    """One :class:`Decision` per node, in graph order.  A node override beats a module override,
    which beats the op lists (with their ``overrides``)."""
    check_places(gm, module_overrides or {}, node_overrides or {})
    overrides = {path: as_entry(value, f"module {path!r} overridden by the user", Source.MODULE_OVERRIDE)
                 for path, value in (module_overrides or {}).items()}
    by_node = {name: as_entry(value, f"node {name!r} overridden by the user", Source.NODE_OVERRIDE)
               for name, value in (node_overrides or {}).items()}
    modules = dict(gm.named_modules())
    decisions: Dict[fx.Node, Decision] = {}
    infer = DtypeInference(gm, modules, decisions)  # asked only about decided nodes (inputs come first)
    for node in gm.graph.nodes:
        d = _decide(node, policy, op_lists, overrides, by_node, modules, decisions, infer)
        if d.compute is not None and node.op != "output" and _has_float64_input(node, modules, infer):
            d = dataclasses.replace(d, compute=None, resolved=Category.NEUTRAL, source=Source.FLOAT64, reason=(
                f"float64 input: fxamp never casts float64, so it runs in float64 (as a {d.resolved.value} op "
                f"it would run in {dtype_name(d.compute)})"))
        decisions[node] = d
    # Conditions that look at consumers run once every node is decided.
    for node, d in decisions.items():
        if d.category is Category.CONDITIONAL and d.resolved is Category.UNSAFE and d.source not in _PINNED:
            entry = op_lists.lookup(node.target) if node.op != "call_module" else None
            if entry is not None and entry.condition == "softmax":
                decisions[node] = _softmax_between_low_ops(node, d, decisions, _float_inputs(gm, modules, decisions))
    _widen_for_float32_users(gm, policy, op_lists, decisions, _float_inputs(gm, modules, decisions))
    return decisions


def _widen_for_float32_users(gm: fx.GraphModule, policy: Policy, op_lists: OpLists,
                             decisions: Dict[fx.Node, Decision], float_inputs) -> None:
    """Let an addition whose every use computes in float32 compute in float32 too (``float32_users``).

    Walks the graph backwards, so a chain of additions ending in a norm (``tok + pos + type`` before a
    layer norm, a residual stream between norms) widens from its end.  Only where mixed precision
    keeps float32 ops (compute low, unsafe float32): O3 and O0 have nothing to widen into.
    """
    if policy.compute not in LOW or policy.unsafe != torch.float32:
        return
    nodes = list(gm.graph.nodes)
    for node in nodes:  # infer dtypes in graph order: asked last node first, the inference would recurse
        float_inputs(node)  # through the whole graph (RecursionError on a deep one)
    modules = dict(gm.named_modules())
    for node in reversed(nodes):
        d = decisions[node]
        if (d.category is not Category.CONDITIONAL or d.resolved is not Category.NEUTRAL or d.compute is not None
                or d.source in _PINNED or node.op not in ("call_function", "call_method", "call_module")
                or is_inplace(node.op, node.target)):
            continue
        module = modules[str(node.target)] if node.op == "call_module" else None
        entry = op_lists.lookup(type(module) if module is not None else node.target)
        # a leaf module (nn.Embedding) reads its own float table; its ids are no float input
        floats = any(p.is_floating_point() for p in module.parameters()) if module is not None else float_inputs(node)
        if entry is None or entry.condition != "float32_users" or not floats:
            continue
        lookup = "embedding" in d.op.lower()
        # a lookup widens only for ops float32 by their own list (a norm straight after, ModernBERT):
        # behind a widened sum (BERT, GPT-2) O2 keeps the table low, which those models can afford
        users = _consumers(node, _runs_float32_listed if lookup else _runs_float32, decisions, float_inputs)
        if users:
            what = ("looking up in float32 keeps the table's bits (O2 keeps the table float32, as autocast does)"
                    if lookup else "adding in float32 keeps the bits they would keep; an "
                    "addition saves nothing for backward, so casting its inputs costs no memory")
            decisions[node] = dataclasses.replace(
                d, compute=torch.float32, resolved=Category.UNSAFE,
                reason=(f"only float32 ops use it ({', '.join(u.name for u in users[:3])}"
                        f"{', …' if len(users) > 3 else ''}): {what}"))


def _has_float64_input(node: fx.Node, modules: Dict[str, nn.Module], infer: DtypeInference) -> bool:
    """Whether a float input of ``node`` (or a leaf module's own parameter or buffer) is certainly float64."""
    known = [infer(i) for i in node.all_input_nodes]
    if node.op == "call_module":
        m = modules[str(node.target)]
        known += [t.dtype for t in [*m.parameters(), *m.buffers()]]
    return any(isinstance(k, torch.dtype) and k.is_floating_point and k not in CASTABLE for k in known)


def _float_inputs(gm: fx.GraphModule, modules: Dict[str, nn.Module], decisions: Dict[fx.Node, Decision]):
    infer = DtypeInference(gm, modules, decisions)
    return lambda node: [i for i in node.all_input_nodes if infer(i) is not NOT_FLOAT]


def _softmax_between_low_ops(node: fx.Node, d: Decision, decisions: Mapping[fx.Node, Decision], float_inputs) -> Decision:
    """Let a softmax stay in low precision when a low-precision op feeds it and only low-precision ops use it."""
    producer = _low_producer(node.args[0] if node.args else None, decisions, float_inputs)
    consumers = _consumers(node, _runs_low, decisions, float_inputs)
    if producer is None or not consumers:
        return d
    why = (f"between low-precision {producer.name} and {', '.join(c.name for c in consumers)}: the kernel "
           "accumulates in float32 internally, a float32 round trip would only cost memory and two casts")
    return dataclasses.replace(d, reason=why, compute=None, resolved=Category.NEUTRAL)


def _single_input(node: fx.Node, float_inputs) -> Optional[fx.Node]:
    inputs = float_inputs(node)
    return inputs[0] if len(inputs) == 1 else None


def _low_producer(value: Any, decisions: Mapping[fx.Node, Decision], float_inputs) -> Optional[fx.Node]:
    """The safe op ``value`` comes from through single-input neutral ops (x / scale, masked_fill…), or None."""
    while isinstance(value, fx.Node):
        d = decisions.get(value)
        if d is None:
            return None
        if d.resolved is Category.SAFE:
            return value
        if d.resolved is not Category.NEUTRAL or value.op in ("placeholder", "get_attr"):
            return None
        value = _single_input(value, float_inputs)
    return None


def _consumers(node: fx.Node, wanted: Callable[[Decision], bool], decisions: Mapping[fx.Node, Decision],
               float_inputs) -> Tuple[fx.Node, ...]:
    """The ops ``wanted`` accepts that use ``node``, seen through single-input ops that follow their
    inputs (dropout, views); () if any use is something else (another op, the graph output)."""
    found = []
    for user in node.users:
        d = decisions.get(user)
        if d is None or user.op == "output":
            return ()
        if wanted(d):
            found.append(user)
        elif (d.resolved is Category.NEUTRAL and d.compute is None and d.source is not Source.FLOAT64
              and _single_input(user, float_inputs) is node):
            deeper = _consumers(user, wanted, decisions, float_inputs)
            if not deeper:
                return ()
            found.extend(deeper)
        else:
            return ()
    return tuple(found)


def _runs_low(d: Decision) -> bool:
    return d.resolved is Category.SAFE


def _runs_float32(d: Decision) -> bool:
    return d.compute == torch.float32


def _runs_float32_listed(d: Decision) -> bool:
    return d.compute == torch.float32 and d.category is not Category.CONDITIONAL


def _inplace(node: fx.Node, name: str, path: str, policy: Policy, override: Optional[OpEntry],
             op_lists: OpLists, infer: DtypeInference) -> Decision:
    """An in-place op: an unsafe one writing into an activation runs out of place in float32 and is
    written back (``rewrite.insert_casts``); any other runs in the dtype of the tensor it writes into."""
    plain = out_of_place(node.op, node.target)
    entry = override if override is not None else op_lists.lookup(plain) if plain is not None else None
    into = node.args[0] if node.args else None
    activation = isinstance(into, fx.Node) and into.op not in ("placeholder", "get_attr") and ATTR not in into.meta
    if entry is not None and entry.category is Category.UNSAFE and activation:
        compute = _compute_for(Category.UNSAFE, entry, policy)
        if compute in (infer(into), infer.if_castable(into)):
            how = f"{into.name} already is {dtype_name(compute)}, so it runs in place as written"
        else:
            how = (f"computed out of place in {dtype_name(compute)} and written back into {into.name} with copy_, "
                   "so it and its views change as before, rounded once to their dtype")
        return Decision.of(name, Category.UNSAFE, f"in place, unsafe ({entry.reason}): {how}", compute, norm=entry.norm,
                        source=entry.source, module=path)
    why = ("an unsafe op writing into a model input or parameter: " if entry is not None
           and entry.category is Category.UNSAFE else "")
    return Decision.of(name, Category.NEUTRAL,
                    f"in-place op: {why}runs in the dtype of the tensor it writes into (a cast would write into "
                    "a copy)", None, source=Source.GRAPH, module=path)


def _compute_for(category: Category, entry: OpEntry, policy: Policy) -> Optional[torch.dtype]:
    if category is Category.SAFE:
        return policy.compute
    if category is Category.UNSAFE:
        return policy.norms if entry.norm else policy.unsafe
    return None


def _decide(
    node: fx.Node,
    policy: Policy,
    op_lists: OpLists,
    overrides: Mapping[str, OpEntry],
    by_node: Mapping[str, OpEntry],
    modules: Dict[str, nn.Module],
    done: Mapping[fx.Node, Decision],
    infer: DtypeInference,
) -> Decision:
    path = module_path_of(node)
    if node.op == "placeholder":
        return Decision.of("input", Category.NEUTRAL, "model input: used as given", None, source=Source.GRAPH)
    if node.op == "get_attr":
        return Decision.of("get_attr", Category.NEUTRAL,
                        "parameter, buffer or constant: cast at each use as that use needs", None,
                        source=Source.GRAPH, module=path)
    if node.op == "call_function" and node.target is fit_scalar:
        return Decision.of(op_name(fit_scalar), Category.NEUTRAL,
                           "fill value fitted by fxamp: clamped at run time into the range of the dtype its op's "
                           "tensor has then (-3.4e38 does not fit float16)", None, source=Source.GRAPH, module=path)
    if node.op == "call_function" and node.target is guard:
        return Decision.of(op_name(guard), Category.NEUTRAL,
                           "branch guard fxamp inserted: checks at each call that the call takes the branch the "
                           "capture took (else another capture runs)", None, source=Source.GRAPH, module=path)
    if node.op == "call_method" and RECEIVER in node.meta:
        return Decision.of(f"{node.meta[RECEIVER]}.{node.target}", Category.NEUTRAL,
                           f"a method of the {node.meta[RECEIVER]} the call was given (a KV cache's update): runs as "
                           f"written at every call, on the dtypes it gets", None, source=Source.GRAPH, module=path)
    if node.op == "output":
        if policy.output is None:
            return Decision.of("output", Category.NEUTRAL, "outputs left in the dtype they were computed in "
                            "(Policy.output=None)", None, source=Source.GRAPH)
        return Decision.of("output", Category.NEUTRAL,
                        f"float16/bfloat16/float32 outputs come back in {dtype_name(policy.output)} (Policy.output)"
                        + (", so a loss computed outside the model runs in float32"
                           if policy.output == torch.float32 else "") + "; float64 outputs stay float64",
                        policy.output, source=Source.GRAPH)

    if node.op == "call_module":
        target: Any = type(modules[str(node.target)])
        name = f"{op_name(target)}"
    else:
        target = node.target
        name = op_name(op_key(target))

    found = override_for(node, by_node, overrides)  # the user's entry for this node, if any
    override = found.value if found is not None else None
    if is_inplace(node.op, node.target):
        return _inplace(node, name, path, policy, override, op_lists, infer)
    entry = override if override is not None else op_lists.lookup(target)
    if entry is None:
        if node.op == "call_module":
            return Decision.of(name, Category.UNLISTED,
                            "unlisted leaf module: runs in float32 with float32 parameters (its weights "
                            "cannot be cast from outside); override its class or path to change that",
                            torch.float32, source=Source.DEFAULT, module=path)
        return Decision.of(name, Category.UNLISTED,
                        "on no list: runs in the dtype of its inputs, as autocast does for unlisted ops; "
                        "add it with overrides= to change that", None, source=Source.DEFAULT, module=path)

    category = entry.category
    reason = entry.reason
    if category is Category.CONDITIONAL:
        resolved, why = _resolve_condition(entry, node, done)
        compute = _compute_for(resolved, entry, policy)
        return Decision.of(name, Category.CONDITIONAL, why, compute, norm=entry.norm, source=entry.source, module=path,
                        resolved=resolved)
    return Decision.of(name, category, reason, _compute_for(category, entry, policy), norm=entry.norm,
                    source=entry.source, module=path)


def _resolve_condition(entry: OpEntry, node: fx.Node, done: Mapping[fx.Node, Decision]) -> Tuple[Category, str]:
    cond = entry.condition
    if cond in ("dtype_arg", "softmax"):  # softmax's second rule needs consumers: see classify()
        dtype = node.kwargs.get("dtype")
        if dtype is None:
            dtype = next((a for a in node.args if isinstance(a, torch.dtype)), None)
        if dtype is not None:
            return Category.NEUTRAL, (f"dtype={dtype_name(dtype)} passed: the kernel reads its input as it "
                                      f"comes and accumulates in {dtype_name(dtype)}")
        return Category.UNSAFE, "no dtype= passed: exp/sum family runs in float32"
    if cond == "truediv":
        args = node.args
        if len(args) >= 2 and not isinstance(args[0], fx.Node) and isinstance(args[1], fx.Node):
            return Category.UNSAFE, "scalar / tensor is a reciprocal: float32"
        return Category.NEUTRAL, "tensor / tensor or tensor / scalar: follows its inputs"
    if cond == "follow_producer":
        producer = next((a for a in node.all_input_nodes), None)
        if producer is None or producer not in done:
            return entry.fallback, "smooth activation: follows its inputs"
        p = done[producer]
        how = dtype_name(p.compute) if p.compute is not None else "the dtype it receives"
        return Category.NEUTRAL, f"smooth activation: follows its producer {producer.name} ({p.category.value}, {how})"
    if cond == "float32_users":  # decided once every node is: see _widen_for_float32_users
        return entry.fallback, "follows its inputs (torch's type promotion computes in the widest)"
    if cond == "need_weights":
        # (F.multi_head_attention_forward's 16th positional parameter; the module's a keyword)
        given = node.args[15] if node.op == "call_function" and len(node.args) > 15 else node.kwargs.get("need_weights")
        if given is False:
            return Category.SAFE, "need_weights=False: projections + scaled_dot_product_attention"
        return entry.fallback, ("need_weights=True (the default): the attention softmax runs in low precision "
                                "too; pass need_weights=False or override to 'unsafe'")
    raise ConversionError(f"unknown condition {cond!r} in an op list entry")  # pragma: no cover


#: a float32 leaf holding more of the parameters than this is reported and warned about
FLOAT32_LEAF_SHARE = 0.10


def float32_leaves(gm: fx.GraphModule, decisions: Mapping[fx.Node, Decision]) -> List[str]:
    """Opaque leaf modules that run in float32 with a large share of the model's work.

    No inputs exist at convert time, so the share of FLOPs is estimated by the share of parameters;
    norms (float32 by design) and embedding lookups (parameters without FLOPs) are left out.
    """
    total = sum(p.numel() for p in gm.parameters())
    notes = []
    for node, d in decisions.items():
        if node.op != "call_module" or d.compute != torch.float32 or d.norm:
            continue
        m = gm.get_submodule(str(node.target))
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag, parametrize.ParametrizationList)):
            continue  # (lookups; a parametrization makes a weight, which the op reading it casts)
        share = sum(p.numel() for p in m.parameters()) / total if total else 0.0
        hooked = any(getattr(m, a) for a in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                                             "_backward_hooks"))  # torch.fx calls it so that its hooks run
        trace = ("let torch.fx trace into it (it has hooks, which then would run once, at capture: remove them "
                 "before converting, or register them on the converted root)" if hooked else
                 "let torch.fx trace into it (drop it from leaf_modules)")
        export = "" if hooked else ", or use frontend='export'"  # (which refuses hooks on submodules)
        override = f"overrides={{{type(m).__name__}: 'safe'}}"
        if isinstance(m, torch.jit.ScriptModule):  # compiled TorchScript: nothing traces into it, one class for all
            trace, export = "convert the eager module (before torch.jit.script) so that its ops are converted", ""
            override = f"module_overrides={{{str(node.target)!r}: 'safe'}}"
        if share > FLOAT32_LEAF_SHARE:
            notes.append(f"leaf module {node.target!r} ({type(m).__name__}) runs whole in float32 and holds "
                         f"{share:.0%} of the parameters, so about that share of the work gets no speed-up: "
                         f"{trace}, override its category ({override} if its math is safe in low precision)"
                         f"{export}")
    return notes


def _categories(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    """The first rule: every node's category from the op lists and the category overrides, recorded."""
    options = conversion.options
    decisions = classify(gm, conversion.policy, options.op_lists, split_overrides(options.module_overrides)[0],
                         split_overrides(options.node_overrides)[0])
    conversion.decisions.update(decisions)
    record(decisions)
    return []


def _enabled(conversion: Conversion) -> bool:
    return conversion.policy.enabled


CATEGORIES = Pass("categories", Stage.CLASSIFY, _categories)
UNUSED_OVERRIDES = Pass("unused overrides", Stage.CLASSIFY, lambda gm, c: unused_overrides(gm, c.options), warns=True)
FLOAT32_LEAVES = Pass("float32 leaves", Stage.CLASSIFY, lambda gm, c: float32_leaves(gm, c.decisions),
                      applies=_enabled, warns=True)
