"""Building the rows: read each node's ``Decision`` and casts from the converted graph, and the dtypes
and shapes a run observed (or what is certain statically), into a :class:`~.records.Report`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..conversion.convert import conversion_info, policy_of
from ..dtypes import LOW, NOT_FLOAT, dtype_name
from ..conversion.classify.inference import DtypeInference
from ..conversion.graph import CAST, DECISION, Decision, attr_target, fetch_attr
from ..conversion.op_lists import Category
from ..policy import PRESETS, Policy
from ..conversion.runtime.recompute import island_input
from ..conversion.runtime import call_module_cast
from .flops import estimate_flops
from .formats import unique
from .lints import find_lints
from .observe import Meta, Recorder, dtype_of_meta, leaves
from .records import AS_INPUT, RUNTIME, CastIn, Float8Cell, RecomputeCell, Report, Row, Summary

__all__ = ["build_report", "DtypeView", "describe_input", "policy_label"]


def build_report(gm: fx.GraphModule, model_name: str, inputs: Tuple[Any, ...], kwargs: Dict[str, Any],
           observed: Optional[Recorder]) -> Report:
    pol = policy_of(gm)
    modules = dict(gm.named_modules())
    decisions = {n: n.meta[DECISION] for n in gm.graph.nodes if DECISION in n.meta}
    static = DtypeInference(gm, modules, decisions)
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    view = DtypeView(gm, static, observed)

    rows: List[Row] = []
    islands: set = set()
    for node in gm.graph.nodes:
        d = decisions.get(node)
        if d is None:
            continue  # a cast, or a helper node fxamp inserted (the weight cache, a recomputed island's calls)
        row = _row(node, d, view, modules, params, buffers)
        if d.recompute is not None:
            row = dataclasses.replace(row, recompute=_recompute_cell(d.recompute, view, d.recompute.island not in islands))
            islands.add(d.recompute.island)
        rows.append(row)
    cast_nodes = [n for n in gm.graph.nodes if CAST in n.meta]
    ops = [r for r in rows if r.is_op]
    categories = {c.value: sum(r.category is c for r in ops) for c in Category}
    resolved = Counter(r.resolved.value for r in ops if r.category is Category.CONDITIONAL)
    flops = None if observed is None else sum(r.flops or 0 for r in ops)
    low = None if observed is None else sum(r.flops or 0 for r in ops if r.low_precision)
    noop = None if observed is None else sum(view.cast_effective(n) is False for n in cast_nodes)
    summary = Summary(
        ops=len(ops), categories=categories, resolved=dict(sorted(resolved.items())), casts=len(cast_nodes),
        weight_casts=sum(_is_attr(n.meta[CAST][0]) for n in cast_nodes), noop_casts=noop,
        flops=flops, low_flops=low,
    )
    lints = tuple(find_lints(gm, decisions, view, params, buffers))
    described = tuple(describe_input(v) for v in inputs) + tuple(f"{k}={describe_input(v)}" for k, v in kwargs.items())
    info = conversion_info(gm)
    return Report(model_name, policy_label(pol), info.frontend, described, tuple(rows), summary, lints, info.notes)


class DtypeView:
    """Dtypes of values: observed when the model ran, else what is certain statically."""

    def __init__(self, gm: fx.GraphModule, static: DtypeInference, observed: Optional[Recorder]):
        self.gm, self.static, self.observed = gm, static, observed

    def dtype(self, node: fx.Node) -> Optional[str]:
        """The dtype name of a node's value; ``runtime`` if unknown; None if it is not a float or int tensor."""
        if self.observed is not None:
            return dtype_of_meta(self.observed.results.get(node))
        if _is_attr(node):
            value = fetch_attr(self.gm, attr_target(node))
            return dtype_name(value.dtype) if isinstance(value, torch.Tensor) else None
        known = self.static(node)
        if known is NOT_FLOAT:
            return None
        return RUNTIME if known is None else dtype_name(known)

    def source(self, node: fx.Node) -> fx.Node:
        """The value a cast node casts, or a recomputed island reads (or the node itself)."""
        while CAST in node.meta or (node.op == "call_function" and node.target is island_input):
            node = node.meta[CAST][0] if CAST in node.meta else node.args[0]
        return node

    def cast_effective(self, cast: fx.Node) -> Optional[bool]:
        if self.observed is None or cast not in self.observed.results:
            return None
        before = self.dtype(cast.meta[CAST][0])
        after = self.dtype(cast)
        return before != after


def _row(node: fx.Node, d: Decision, view: DtypeView, modules: Dict[str, nn.Module], params: set, buffers: set) -> Row:
    observed = view.observed
    resolved = d.resolved
    inputs = [n for n in node.all_input_nodes if DECISION in view.source(n).meta or _is_attr(n)]
    inputs = [n for n in inputs if not isinstance(_maybe_fetch(view.gm, n), nn.Module)]
    input_dtypes = tuple(dt for dt in (view.dtype(view.source(n)) for n in inputs) if dt is not None)
    casts = tuple(CastIn(n.name, _label(n.meta[CAST][0]), dtype_name(n.meta[CAST][1]), view.cast_effective(n))
                  for n in node.all_input_nodes if CAST in n.meta)
    if node.op == "call_function" and node.target is call_module_cast:
        casts += (CastIn(node.name, f"{d.module}.*", dtype_name(node.args[1]), None),)

    out = view.dtype(node) if node.op != "output" else _output_dtype(node, view)
    if node.op == "output" and d.compute is None:
        out = _output_dtype(node, view)

    if d.compute is not None:
        compute = dtype_name(d.compute)
        seen = _observed_compute(node, observed) if observed is not None and node.op != "output" else None
        if seen is not None and seen not in ("float16", "bfloat16", "float32"):
            compute = seen  # float64 passed through the checked casts untouched: it ran in float64
    elif node.op == "placeholder" or _is_attr(node):
        compute = "-"
    elif out in (None, "-") or (out != RUNTIME and not _is_float(out)):
        compute = "-"  # it makes no float tensor (a shape, an int, a mask)
    elif observed is None:
        compute = AS_INPUT
    else:
        compute = _observed_compute(node, observed) or "-"

    shape = None
    flops = None
    if _is_attr(node):
        value = _maybe_fetch(view.gm, node)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    if observed is not None:
        res = observed.results.get(node)
        shape = res.shape if isinstance(res, Meta) else shape
        if node.op.startswith("call_") and not _is_attr(node):
            flops = estimate_flops(node, d, observed, modules)

    kind = "call_module" if node.op == "call_function" and node.target is call_module_cast else \
        "get_attr" if _is_attr(node) else node.op
    module = d.module
    if _is_attr(node):
        module = attr_target(node)
        what = "parameter" if module in params else "buffer" if module in buffers else "constant"
        op = what
    else:
        op = d.op
    float8 = None if d.float8 is None else Float8Cell(d.float8.chosen, d.float8.reason, d.float8.source.value)
    return Row(node.name, kind, op, module, d.category, resolved, d.reason, d.source.value, input_dtypes, compute,
               out or "-", shape, casts, flops, float8=float8)


def _recompute_cell(choice: Any, view: DtypeView, first: bool) -> RecomputeCell:
    """The node's island choice; with a run's shapes, the bytes it saves (float32 upcasts less the kept inputs)."""
    saved = None
    if choice.chosen and choice.saved is not None and view.observed is not None:
        nodes = {n.name: n for n in view.gm.graph.nodes}
        shapes = [getattr(view.observed.results.get(nodes.get(e)), "shape", None) for e in choice.entries]
        if shapes and all(s is not None for s in shapes):
            per = 4 - torch.empty((), dtype=choice.saved).element_size()
            saved = sum(per * int(torch.Size(s).numel()) for s in shapes)
    return RecomputeCell(choice.island, choice.chosen, choice.reason, choice.source.value,
                         None if choice.saved is None else dtype_name(choice.saved), saved, first, choice.chunked,
                         choice.forward_chunked)


def policy_label(pol: Policy) -> str:
    """``O1 (params=float32,compute=float16,...)`` when the policy is a preset, else its string form."""
    for preset in PRESETS:
        for low in LOW:
            for keep in (False, True):
                try:
                    if Policy.parse(preset, low, keep_norms_fp32=keep) == pol:
                        name = preset + (" keep_norms_fp32" if keep and preset == "O3" else "")
                        return f"{name} ({pol})" if preset != "O0" else f"O0 ({pol})"
                except ValueError:  # pragma: no cover
                    continue
    return str(pol)


def _is_float(name: str) -> bool:
    return any(part.startswith(("float", "bfloat")) for part in name.split("|"))


def _output_dtype(node: fx.Node, view: DtypeView) -> str:
    dts = [view.dtype(n) for n in node.all_input_nodes]
    dts = [d for d in dts if d is not None]
    return "|".join(unique(dts)) if dts else "-"


def _observed_compute(node: fx.Node, rec: Recorder) -> Optional[str]:
    """For an op that follows its inputs: the promotion of its float inputs (else its float output)."""
    args, kwargs = rec.args.get(node, ((), {}))
    floats = [m.dtype for m in leaves((args, kwargs)) if m.dtype.is_floating_point]
    if floats:
        out = floats[0]
        for f in floats[1:]:
            out = torch.promote_types(out, f)
        return dtype_name(out)
    res = [m.dtype for m in leaves(rec.results.get(node)) if m.dtype.is_floating_point]
    return dtype_name(res[0]) if res else None


def _is_attr(node: fx.Node) -> bool:
    """A read of a parameter, buffer or constant (a get_attr, or one convert lowered to a dict lookup)."""
    return attr_target(node) is not None


def _label(node: fx.Node) -> str:
    return attr_target(node) or node.name


def _maybe_fetch(gm: fx.GraphModule, node: fx.Node) -> Any:
    if not _is_attr(node):
        return None
    try:
        return fetch_attr(gm, attr_target(node))
    except AttributeError:
        return None


def describe_input(value: Any) -> str:
    """``2,8,32:float32`` for a tensor, else the value's type name."""
    if isinstance(value, torch.Tensor):
        return f"{','.join(map(str, value.shape))}:{dtype_name(value.dtype)}"
    return type(value).__name__
