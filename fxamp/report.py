"""What a converted model runs in which dtype, and why: one typed record per graph node.

``report(model, example_inputs)`` calls :func:`fxamp.convert` and reads the converted graph
itself: every original node carries its :class:`~fxamp.classify.Decision` in
``node.meta["fxamp"]`` and every inserted cast carries ``node.meta["fxamp_cast"]``, so the report
and the conversion cannot disagree.  With example inputs the converted module runs once (on a
copy of the model, under ``no_grad``) and each node's dtypes and shapes are recorded; without,
the report shows what is known before running and says ``runtime`` for the rest::

    >>> r = fxamp.report(model, torch.randn(2, 8, 32))
    >>> print(r)                       # table, summary, dtype leaks
    >>> r.to_json(); r.to_csv()
    >>> print(r.diff(fxamp.report(model, torch.randn(2, 8, 32), policy="O2")))
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import math
import operator
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .convert import conversion_info, convert, policy_of
from .dtypes import LOW, NOT_FLOAT, DtypeInference, dtype_name, short_name
from .errors import FxampError
from .graph import CAST, DECISION, Decision, attr_target, fetch_attr
from .lazy import LazyConverted
from .op_lists import Category
from .policy import PRESETS, Policy
from .runtime import call_module_cast

__all__ = ["Report", "Row", "CastIn", "Lint", "Summary", "PolicyDiff", "DiffRow", "report", "compare"]

RUNTIME = "runtime"  #: a dtype known only when the model runs
AS_INPUT = "as input"  #: compute=None: the op runs in the dtype its inputs arrive in
_LOW = tuple(dtype_name(d) for d in LOW)
_REASON_WIDTH = 56
_JSON_VERSION = 1


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CastIn:
    """A cast fxamp inserted in front of a node.

    node:      the cast node's name in the converted graph.
    source:    what it casts (a node name, or a parameter path such as ``fc.weight``).
    dtype:     the dtype it casts to.
    effective: whether it changed the dtype when the model ran (None: not run).
    """

    node: str
    source: str
    dtype: str
    effective: Optional[bool] = None

    def __str__(self) -> str:
        text = f"{self.source}→{short_name(self.dtype)}"
        return f"({text})" if self.effective is False else text


@dataclass(frozen=True)
class Row:
    """One original node of the converted graph: what it is, where it sits, what dtypes it sees.

    node:         node name in the converted graph.
    kind:         ``placeholder``, ``get_attr``, ``call_function``, ``call_method``, ``call_module``, ``output``.
    op:           qualified op name (``torch.nn.functional.linear``, ``Tensor.sum``, ``torch.nn.LayerNorm``);
                  ``input`` for placeholders; ``parameter``/``buffer``/``constant`` for get_attr.
    module:       module path the node belongs to (``""`` for the root); for get_attr, the attribute path.
    category:     safe / neutral / conditional / unsafe / unlisted.
    resolved:     for conditional nodes, the category the condition resolved to; else ``category``.
    reason:       the rule that decided, in words.
    source:       where the rule came from (``op list``, ``override``, ``module override``, ``default``, ``graph``).
    input_dtypes: dtype of each tensor input as it arrives (before fxamp's casts); ``runtime`` if unknown.
    compute:      dtype its float inputs are cast to; for ops that follow their inputs, the dtype
                  observed (``as input`` without example inputs); ``-`` when it has no float input.
    output_dtype: dtype of its result (``runtime`` if unknown, ``-`` if not a tensor, ``a|b`` for mixed tuples).
    output_shape: shape of its tensor result when the model ran, else None.
    casts:        casts fxamp inserted in front of it (shared casts appear in every consumer's row).
    flops:        estimated floating point operations (None without example inputs).
    """

    node: str
    kind: str
    op: str
    module: str
    category: Category
    resolved: Category
    reason: str
    source: str
    input_dtypes: Tuple[str, ...]
    compute: str
    output_dtype: str
    output_shape: Optional[Tuple[int, ...]]
    casts: Tuple[CastIn, ...]
    flops: Optional[int]

    @property
    def is_op(self) -> bool:
        """True for call_function / call_method / call_module nodes (not inputs, attributes or the output)."""
        return self.kind.startswith("call_")

    @property
    def low_precision(self) -> bool:
        """Whether the node computes in float16 or bfloat16."""
        return self.compute in _LOW

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["category"] = self.category.value
        d["resolved"] = self.resolved.value
        d["input_dtypes"] = list(self.input_dtypes)
        d["output_shape"] = None if self.output_shape is None else list(self.output_shape)
        d["casts"] = [asdict(c) for c in self.casts]
        return d


@dataclass(frozen=True)
class Lint:
    """A dtype leak: a float32 value where low precision was meant, and the node to look at.

    kind: ``param-promotion`` (a float32 parameter or buffer promotes a low-precision branch) or
          ``cast-down`` (a float32 activation is cast back down for a low-precision op).
    """

    kind: str
    node: str
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.node}: {self.message}"


@dataclass(frozen=True)
class Summary:
    """Totals over the whole model (filters such as :meth:`Report.only` do not change them).

    ops:              number of op nodes (call_function / call_method / call_module).
    categories:       op nodes per category; ``conditional`` ops are also counted by resolution.
    resolved:         conditional op nodes per category they resolved to.
    casts:            cast nodes fxamp inserted (each (value, dtype) cast once, however many use it).
    weight_casts:     of those, casts of parameters and buffers.
    noop_casts:       casts that changed nothing for the example inputs (None without inputs).
    flops:            estimated FLOPs of one forward (None without example inputs).
    low_flops:        the FLOPs of nodes that computed in float16/bfloat16.
    """

    ops: int
    categories: Mapping[str, int]
    resolved: Mapping[str, int]
    casts: int
    weight_casts: int
    noop_casts: Optional[int]
    flops: Optional[int]
    low_flops: Optional[int]

    @property
    def low_share(self) -> Optional[float]:
        """Share of the estimated FLOPs that ran in low precision (None without example inputs)."""
        if self.flops is None or self.low_flops is None:
            return None
        return self.low_flops / self.flops if self.flops else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["categories"] = dict(self.categories)
        d["resolved"] = dict(self.resolved)
        d["low_share"] = self.low_share
        return d


@dataclass(frozen=True)
class Report:
    """Per-node records of a converted model; ``str()`` is the table, summary and leaks.

    model:    the model's class name.
    policy:   the policy, as its string form (``params=float32,compute=float16,...``).
    frontend: how the graph was captured (``fx`` or ``export``).
    inputs:   the example inputs as ``shape:dtype`` strings (empty without inputs).
    rows:     one :class:`Row` per original graph node, in graph order.
    summary:  totals over all nodes.
    lints:    dtype leaks found.
    notes:    what the front end decided (e.g. a fallback to torch.export).
    """

    model: str
    policy: str
    frontend: str
    inputs: Tuple[str, ...]
    rows: Tuple[Row, ...]
    summary: Summary
    lints: Tuple[Lint, ...]
    notes: Tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.to_table()

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, node: str) -> Row:
        """The row of a node, by name."""
        for row in self.rows:
            if row.node == node:
                return row
        raise KeyError(f"no node {node!r} in the report of {self.model}; nodes: "
                       f"{', '.join(r.node for r in self.rows[:8])}{', ...' if len(self.rows) > 8 else ''}")

    def only(self, *categories: Union[str, Category]) -> "Report":
        """The same report with only the rows of these categories (the summary still covers every node)."""
        wanted = {_category(c) for c in categories}
        return _replace(self, rows=tuple(r for r in self.rows if r.category in wanted))

    # -- formats ---------------------------------------------------------------------------
    def to_table(self, *, wide: bool = False) -> str:
        """The table (tabulate), then the summary and the dtype leaks; ``wide`` keeps reasons whole."""
        from tabulate import tabulate

        headers = ["node", "op", "category", "reason", "in dtypes", "compute", "out dtype", "casts inserted before"]
        body = []
        for r in self.rows:
            cat = r.category.value if r.resolved is r.category else f"{r.category.value}→{r.resolved.value}"
            reason = r.reason if wide else _clip(r.reason, _REASON_WIDTH)
            body.append([r.node, _op_label(r), cat, reason, ", ".join(short_name(d) for d in _unique(r.input_dtypes)),
                         short_name(r.compute), short_name(r.output_dtype), ", ".join(str(c) for c in r.casts)])
        lines = [self._header(), ""]
        lines.append(tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)
                     if body else "(no rows)")
        if any(c.effective is False for r in self.rows for c in r.casts):
            lines.append("(a→fp16): a run-time checked cast that changed nothing for these inputs")
        lines += ["", *self._summary_lines()]
        if self.lints:
            lines += ["", f"dtype leaks ({len(self.lints)}):"]
            lines += [f"  {lint}" for lint in self.lints]
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: ``{"version", "model", "policy", ..., "rows": [...], "summary": {...}, "lints": [...]}``."""
        return {
            "version": _JSON_VERSION,
            "model": self.model,
            "policy": self.policy,
            "frontend": self.frontend,
            "inputs": list(self.inputs),
            "rows": [r.to_dict() for r in self.rows],
            "summary": self.summary.to_dict(),
            "lints": [asdict(lint) for lint in self.lints],
            "notes": list(self.notes),
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The report as JSON (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def to_csv(self) -> str:
        """One CSV line per node (``record=node``), then the summary (``record=summary``) and leaks (``record=lint``)."""
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for r in self.rows:
            w.writerow(["node", r.node, r.kind, r.op, r.module, r.category.value, r.resolved.value, r.reason,
                        r.source, " ".join(r.input_dtypes), r.compute, r.output_dtype,
                        "" if r.output_shape is None else "x".join(map(str, r.output_shape)),
                        " ".join(f"{c.source}->{c.dtype}" for c in r.casts),
                        "" if r.flops is None else r.flops, ""])
        blank = [""] * (len(CSV_COLUMNS) - 3)
        for key, value in _flat_summary(self.summary).items():
            w.writerow(["summary", key, *blank, "" if value is None else value])
        for lint in self.lints:
            w.writerow(["lint", lint.node, "", lint.kind, "", "", "", lint.message, *[""] * (len(CSV_COLUMNS) - 8)])
        return out.getvalue()

    # -- comparison ------------------------------------------------------------------------
    def diff(self, other: "Report") -> "PolicyDiff":
        """The nodes whose category, compute or output dtype differ between this report and ``other``.

        Both reports must be of the same model: rows are matched by node name, and nodes a rewrite
        renamed (a leaf module run through ``call_module_cast``) by op and module, in graph order.
        """
        pairs = _match_rows(self.rows, other.rows)
        if pairs is None:
            raise ValueError(f"cannot compare reports of different graphs ({self.model}, {len(self.rows)} nodes vs "
                             f"{other.model}, {len(other.rows)} nodes); report the same model under both policies")
        changed = []
        for a, b in pairs:
            if (a.resolved, a.compute, a.output_dtype) != (b.resolved, b.compute, b.output_dtype) or \
                    len(a.casts) != len(b.casts):
                changed.append(DiffRow(a.node, _op_label(a), a.resolved.value, b.resolved.value, a.compute,
                                       b.compute, a.output_dtype, b.output_dtype, len(a.casts), len(b.casts)))
        return PolicyDiff(self.model, self.policy, other.policy, tuple(changed), self.summary, other.summary)

    # -- helpers ---------------------------------------------------------------------------
    def _header(self) -> str:
        inputs = ", ".join(self.inputs) if self.inputs else "none (dtypes that depend on the inputs show as runtime)"
        text = f"fxamp report: {self.model}  policy {self.policy}  frontend {self.frontend}\ninputs: {inputs}"
        for note in self.notes:
            text += f"\nnote: {note}"
        return text

    def _summary_lines(self) -> List[str]:
        s = self.summary
        parts = []
        for k, v in s.categories.items():
            if v and k == Category.CONDITIONAL.value and s.resolved:
                parts.append(f"{k} {v} (→ {', '.join(f'{r} {n}' for r, n in s.resolved.items())})")
            elif v:
                parts.append(f"{k} {v}")
        lines = [f"ops: {s.ops} — {', '.join(parts)}" if s.ops else "ops: 0"]
        casts = f"casts inserted: {s.casts} ({s.weight_casts} of parameters/buffers, {s.casts - s.weight_casts} of activations"
        if s.noop_casts:
            casts += f"; {s.noop_casts} changed nothing for these inputs"
        lines.append(casts + ")")
        if s.flops is None:
            lines.append("low-precision FLOPs: unknown without example inputs (pass --input / example_inputs)")
        else:
            lines.append(f"low-precision FLOPs: {100 * s.low_share:.1f}% of {_human(s.flops)} (estimated from shapes)")
        return lines


def _match_rows(mine: Sequence[Row], theirs: Sequence[Row]) -> Optional[List[Tuple[Row, Row]]]:
    by_name = {r.node: r for r in theirs}
    paired: Dict[int, Row] = {}
    used = set()
    for i, a in enumerate(mine):
        b = by_name.get(a.node)
        if b is not None and (b.op, b.module) == (a.op, a.module):
            paired[i] = b
            used.add(b.node)
    rest = [b for b in theirs if b.node not in used]
    for i, a in enumerate(mine):
        if i in paired:
            continue
        j = next((k for k, b in enumerate(rest) if (b.op, b.module) == (a.op, a.module)), None)
        if j is None:
            return None
        paired[i] = rest.pop(j)
    if rest:
        return None
    return [(a, paired[i]) for i, a in enumerate(mine)]


CSV_COLUMNS = ["record", "node", "kind", "op", "module", "category", "resolved", "reason", "source", "input_dtypes",
               "compute", "output_dtype", "output_shape", "casts", "flops", "value"]


@dataclass(frozen=True)
class DiffRow:
    """One node whose dtypes change between two policies."""

    node: str
    op: str
    category_a: str
    category_b: str
    compute_a: str
    compute_b: str
    output_a: str
    output_b: str
    casts_a: int
    casts_b: int


@dataclass(frozen=True)
class PolicyDiff:
    """Which nodes change category or dtype between two policies on the same model."""

    model: str
    policy_a: str
    policy_b: str
    rows: Tuple[DiffRow, ...]
    summary_a: Summary
    summary_b: Summary

    def __str__(self) -> str:
        from tabulate import tabulate

        head = f"fxamp compare: {self.model}\n  A: {self.policy_a}\n  B: {self.policy_b}\n"
        if not self.rows:
            return head + "\nno node changes category or dtype"
        body = [[r.node, r.op, _arrow(r.category_a, r.category_b), _arrow(short_name(r.compute_a), short_name(r.compute_b)),
                 _arrow(short_name(r.output_a), short_name(r.output_b)), _arrow(str(r.casts_a), str(r.casts_b))]
                for r in self.rows]
        table = tabulate(body, headers=["node", "op", "category", "compute", "out dtype", "casts inserted before"],
                         tablefmt="simple", disable_numparse=True)
        a, b = self.summary_a, self.summary_b
        tail = [f"{len(self.rows)} nodes change", f"casts inserted: {a.casts} → {b.casts}"]
        if a.low_share is not None and b.low_share is not None:
            tail.append(f"low-precision FLOPs: {100 * a.low_share:.1f}% → {100 * b.low_share:.1f}%")
        return head + "\n" + table + "\n\n" + "\n".join(tail)

    def to_dict(self) -> Dict[str, Any]:
        return {"version": _JSON_VERSION, "model": self.model, "policy_a": self.policy_a, "policy_b": self.policy_b,
                "rows": [asdict(r) for r in self.rows], "summary_a": self.summary_a.to_dict(),
                "summary_b": self.summary_b.to_dict()}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def report(
    model: nn.Module,
    example_inputs: Any = None,
    policy: Union[str, Policy, None] = None,
    *,
    dtype: Union[str, torch.dtype, None] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    **convert_options: Any,
) -> Report:
    """Convert ``model`` as :func:`fxamp.convert` would and report every node's category, reason and dtypes.

    example_inputs: a tensor or a tuple of them; when given, a copy of the converted model runs
                    once under ``no_grad`` to observe dtypes, shapes and FLOPs.
    policy, dtype:  as for ``convert`` (default ``"O1"``).  A module that ``convert`` already
                    returned is reported as it is (then pass no policy or options).
    convert_options: the other keyword options of ``convert`` (``overrides``, ``module_overrides``,
                    ``leaf_modules``, ``keep_norms_fp32``, ``frontend``, ``op_lists``, ``dynamic``…).
    """
    inputs = _as_tuple(example_inputs)
    if isinstance(model, LazyConverted):
        model = model.graph_module  # the graph its latest call ran (an error before its first call)
    if policy_of(model) is not None:
        if policy is not None or dtype is not None or convert_options or example_kwargs:
            raise ValueError("this module was already converted by fxamp: report it without policy, dtype or "
                             "convert options, or report the original model")
        gm = model
        if inputs is not None or example_kwargs:
            gm = copy.deepcopy(model)
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxamp.report takes an nn.Module, not {type(model).__name__}")
        # Running the model would update its BatchNorm statistics (O1 shares them): run a copy.
        source = copy.deepcopy(model) if (inputs is not None or example_kwargs) else model
        gm = convert(source, "O1" if policy is None else policy, dtype=dtype, example_inputs=inputs,
                     example_kwargs=example_kwargs, **convert_options)
    observed = _observe(gm, inputs, example_kwargs or {}) if (inputs is not None or example_kwargs) else None
    return _build(gm, type(model).__name__, inputs or (), example_kwargs or {}, observed)


def compare(
    model: nn.Module,
    example_inputs: Any = None,
    policies: Tuple[Union[str, Policy], Union[str, Policy]] = ("O1", "O2"),
    *,
    dtype: Union[str, torch.dtype, None] = None,
    **convert_options: Any,
) -> PolicyDiff:
    """Report ``model`` under two policies and return the nodes that change category or dtype."""
    if len(policies) != 2:
        raise ValueError(f"compare takes two policies, such as ('O1', 'O2'), not {policies!r}")
    a, b = (report(model, example_inputs, p, dtype=dtype, **convert_options) for p in policies)
    return a.diff(b)


# ---------------------------------------------------------------------------------------------
# observing a run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Meta:
    dtype: torch.dtype
    shape: Tuple[int, ...]


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Meta(value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return tuple(_meta(v) for v in value.values())
    return None


class _Recorder(fx.Interpreter):
    """Runs the converted graph node by node and keeps each node's argument and result metadata."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.args: Dict[fx.Node, Any] = {}
        self.results: Dict[fx.Node, Any] = {}
        self.current: Optional[fx.Node] = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        if n.op != "placeholder":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.args[n] = (_meta(args), {k: _meta(v) for k, v in kwargs.items()})
        result = super().run_node(n)
        self.results[n] = _meta(result)
        return result


def _observe(gm: fx.GraphModule, inputs: Optional[Tuple[Any, ...]], kwargs: Dict[str, Any]) -> _Recorder:
    rec = _Recorder(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = list(inputs or ())
    variadic = any(str(n.target).startswith("*") for n in placeholders)
    if len(args) > len(placeholders) and not variadic:
        raise ValueError(f"the model's forward takes {len(placeholders)} input{'s' if len(placeholders) != 1 else ''} "
                         f"({', '.join(str(p.target) for p in placeholders)}); {len(args)} example inputs were given")
    for n in placeholders[len(args):]:
        if str(n.target).startswith("*"):
            break  # *args / **kwargs: take what is left (nothing)
        if n.name in kwargs or n.target in kwargs:
            args.append(kwargs.get(n.target, kwargs.get(n.name)))
        elif n.args:
            args.append(n.args[0])  # the default value
        else:
            raise ValueError(f"the model's forward takes {len(placeholders)} inputs ("
                             f"{', '.join(p.target for p in placeholders)}); {len(inputs or ())} example inputs "
                             f"were given")
    with torch.no_grad():
        try:
            rec.run(*args)
        except Exception as e:
            node = rec.current
            where = ""
            if node is not None:
                d = node.meta.get(DECISION)
                what = f"{d.op}{f' in {d.module}' if d.module else ''}" if d is not None else str(node.target)
                where = f" at node {node.name} ({what})"
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise FxampError(f"running the converted model on the example inputs failed{where}: "
                             f"{type(e).__name__}: {first}; check the example inputs' shapes and dtypes") from e
    return rec


# ---------------------------------------------------------------------------------------------
# building the rows
# ---------------------------------------------------------------------------------------------


def _build(gm: fx.GraphModule, model_name: str, inputs: Tuple[Any, ...], kwargs: Dict[str, Any],
           observed: Optional[_Recorder]) -> Report:
    pol = policy_of(gm)
    modules = dict(gm.named_modules())
    decisions = {n: n.meta[DECISION] for n in gm.graph.nodes if DECISION in n.meta}
    static = DtypeInference(gm, modules, decisions)
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    view = _View(gm, static, observed)

    rows: List[Row] = []
    for node in gm.graph.nodes:
        d = decisions.get(node)
        if d is None:
            continue  # a cast, or a helper node fxamp inserted (the weight cache)
        rows.append(_row(node, d, view, modules, params, buffers))
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
    lints = tuple(_lints(gm, decisions, view, params, buffers))
    described = tuple(_describe_input(v) for v in inputs) + tuple(f"{k}={_describe_input(v)}" for k, v in kwargs.items())
    info = conversion_info(gm)
    return Report(model_name, _policy_label(pol), info.frontend, described, tuple(rows), summary, lints, info.notes)


class _View:
    """Dtypes of values: observed when the model ran, else what is certain statically."""

    def __init__(self, gm: fx.GraphModule, static: DtypeInference, observed: Optional[_Recorder]):
        self.gm, self.static, self.observed = gm, static, observed

    def dtype(self, node: fx.Node) -> Optional[str]:
        """The dtype name of a node's value; ``runtime`` if unknown; None if it is not a float or int tensor."""
        if self.observed is not None:
            return _dtype_of_meta(self.observed.results.get(node))
        if _is_attr(node):
            value = fetch_attr(self.gm, attr_target(node))
            return dtype_name(value.dtype) if isinstance(value, torch.Tensor) else None
        known = self.static(node)
        if known is NOT_FLOAT:
            return None
        return RUNTIME if known is None else dtype_name(known)

    def source(self, node: fx.Node) -> fx.Node:
        """The value a cast node casts (or the node itself)."""
        while CAST in node.meta:
            node = node.meta[CAST][0]
        return node

    def cast_effective(self, cast: fx.Node) -> Optional[bool]:
        if self.observed is None or cast not in self.observed.results:
            return None
        before = self.dtype(cast.meta[CAST][0])
        after = self.dtype(cast)
        return before != after


def _row(node: fx.Node, d: Decision, view: _View, modules: Dict[str, nn.Module], params: set, buffers: set) -> Row:
    observed = view.observed
    resolved = _resolved(d)
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
        shape = res.shape if isinstance(res, _Meta) else shape
        if node.op.startswith("call_") and not _is_attr(node):
            flops = _flops(node, d, observed, modules)

    kind = "call_module" if node.op == "call_function" and node.target is call_module_cast else \
        "get_attr" if _is_attr(node) else node.op
    module = d.module
    if _is_attr(node):
        module = attr_target(node)
        what = "parameter" if module in params else "buffer" if module in buffers else "constant"
        op = what
    else:
        op = d.op
    return Row(node.name, kind, op, module, d.category, resolved, d.reason, d.source, input_dtypes, compute,
               out or "-", shape, casts, flops)


def _policy_label(pol: Policy) -> str:
    """``O1 (params=float32,compute=float16,...)`` when the policy is a preset, else its string form."""
    for preset in PRESETS:
        for low in (torch.float16, torch.bfloat16):
            for keep in (False, True):
                try:
                    if Policy.from_preset(preset, low, keep_norms_fp32=keep) == pol:
                        name = preset + (" keep_norms_fp32" if keep and preset == "O3" else "")
                        return f"{name} ({pol})" if preset != "O0" else f"O0 ({pol})"
                except ValueError:  # pragma: no cover
                    continue
    return str(pol)


def _is_float(name: str) -> bool:
    return any(part.startswith(("float", "bfloat")) for part in name.split("|"))


def _output_dtype(node: fx.Node, view: _View) -> str:
    dts = [view.dtype(n) for n in node.all_input_nodes]
    dts = [d for d in dts if d is not None]
    return "|".join(_unique(dts)) if dts else "-"


def _observed_compute(node: fx.Node, rec: _Recorder) -> Optional[str]:
    """For an op that follows its inputs: the promotion of its float inputs (else its float output)."""
    args, kwargs = rec.args.get(node, ((), {}))
    floats = [m.dtype for m in _leaves((args, kwargs)) if m.dtype.is_floating_point]
    if floats:
        out = floats[0]
        for f in floats[1:]:
            out = torch.promote_types(out, f)
        return dtype_name(out)
    res = [m.dtype for m in _leaves(rec.results.get(node)) if m.dtype.is_floating_point]
    return dtype_name(res[0]) if res else None


def _resolved(d: Decision) -> Category:
    return d.resolved


# ---------------------------------------------------------------------------------------------
# dtype-leak lint
# ---------------------------------------------------------------------------------------------


def _lints(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], view: _View, params: set,
           buffers: set) -> Iterable[Lint]:
    """Float32 values that feed low-precision work.

    * ``param-promotion``: an op that follows its inputs mixes a low-precision value with a
      float32 parameter or buffer, so it (and the branch after it) runs in float32.
    * ``cast-down``: an activation computed in float32 is cast to low precision for its consumers:
      a cast each forward and a float32 copy alive meanwhile.
    """
    for node in gm.graph.nodes:
        d = decisions.get(node)
        if d is None or not node.op.startswith("call_") or _is_attr(node) or d.compute is not None:
            continue
        sources = [view.source(n) for n in node.all_input_nodes]
        dts = {s: view.dtype(s) for s in sources}
        low = [s for s, dt in dts.items() if dt in _LOW]
        attrs = [s for s, dt in dts.items() if dt == "float32" and _is_attr(s)]
        if low and attrs:
            names = ", ".join(attr_target(a) for a in attrs)
            kinds = "parameter" if all(attr_target(a) in params for a in attrs) else "parameter/buffer"
            plural = "s" if len(attrs) > 1 else ""
            yield Lint("param-promotion", node.name,
                       f"float32 {kinds}{plural} {names} meet{'' if plural else 's'} {dts[low[0]]} {_label(low[0])} "
                       f"in {d.op}, which therefore runs in float32, and so does what follows; store it in "
                       f"low precision (O2 does) or cast it where it is used")

    for cast in gm.graph.nodes:
        if CAST not in cast.meta:
            continue
        src, dtype = cast.meta[CAST]
        if dtype_name(dtype) not in _LOW or src.op == "placeholder" or _is_attr(src):
            continue
        if view.dtype(src) != "float32" or view.cast_effective(cast) is False:
            continue
        d = decisions.get(view.source(src))
        users = ", ".join(u.name for u in cast.users)
        if d is not None and d.compute == torch.float32:
            why = f"{d.op} runs in float32 ({_resolved(d).value})"
            fix = "expected after a float32 op; if its consumers tolerate it, let it run in low precision " \
                  "(overrides= / module_overrides=)"
        else:
            culprits = [view.source(n) for n in src.all_input_nodes if view.dtype(view.source(n)) == "float32"]
            names = ", ".join(_label(c) for c in culprits) or "its inputs"
            why = f"{src.name} came out float32 because {names} {'is' if len(culprits) == 1 else 'are'} float32"
            fix = "keep that value in low precision upstream to save the cast and the float32 copy"
        yield Lint("cast-down", src.name, f"float32 output is cast to {dtype_name(dtype)} for {users}: {why}; {fix}")


# ---------------------------------------------------------------------------------------------
# FLOPs, from shapes
# ---------------------------------------------------------------------------------------------

_MATMUL = {"matmul", "mm", "bmm", "mv", "dot", "vdot"}


def _base_name(op: str) -> str:
    name = op.rsplit(".", 1)[-1]
    return name.strip("_") if name.startswith("__") else name.lstrip("_")


def _flops(node: fx.Node, d: Decision, rec: _Recorder, modules: Dict[str, nn.Module]) -> int:
    args, kwargs = rec.args.get(node, ((), {}))
    result = rec.results.get(node)
    tensors = [a if isinstance(a, _Meta) else None for a in args]
    out = [m for m in _leaves(result)]
    out_numel = sum(_numel(m.shape) for m in out)
    name = _base_name(d.op)

    def arg(i: int, key: str = "") -> Optional[_Meta]:
        if key and isinstance(kwargs.get(key), _Meta):
            return kwargs[key]
        return tensors[i] if i < len(tensors) else None

    try:
        module = None
        if node.op == "call_module":
            module = modules.get(str(node.target))
        elif node.op == "call_function" and node.target is call_module_cast:
            module = modules.get(d.module)
            args = args[2:]
            tensors = tensors[2:]
        if module is not None:
            return _module_flops(module, tensors, out_numel)
        if name in ("linear", "matmul", "mm", "bmm", "mv", "dot", "vdot") or node.target is operator.matmul:
            a = arg(0, "input")
            return 2 * max(out_numel, 1) * a.shape[-1]
        if name in ("addmm", "baddbmm", "addbmm", "addmv"):
            a = arg(1)
            return 2 * max(out_numel, 1) * a.shape[-1]
        if name == "einsum":
            return _einsum_flops(node, args)
        if name.startswith("conv_transpose"):
            x, w = arg(0, "input"), arg(1, "weight")
            return 2 * _numel(x.shape) * _numel(w.shape[1:])
        if name.startswith("conv") or name == "convolution":
            x, w = arg(0, "input"), arg(1, "weight")
            if name == "convolution" and len(node.args) > 6 and node.args[6] is True:  # aten: transposed
                return 2 * _numel(x.shape) * _numel(w.shape[1:])
            return 2 * out_numel * _numel(w.shape[1:])
        if "scaled_dot_product" in name:
            q, k, v = arg(0, "query"), arg(1, "key"), arg(2, "value")
            lq, s = q.shape[-2], k.shape[-2]
            batch = _numel(q.shape[:-2])
            return 2 * batch * lq * s * (q.shape[-1] + v.shape[-1]) + 3 * batch * lq * s
    except (AttributeError, IndexError, TypeError):
        pass
    return out_numel


def _module_flops(module: nn.Module, tensors: List[Optional[_Meta]], out_numel: int) -> int:
    x = tensors[0] if tensors else None
    if isinstance(module, nn.Linear):
        return 2 * out_numel * module.in_features
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and x is not None:
        return 2 * _numel(x.shape) * _numel(module.weight.shape[1:])
    if isinstance(module, nn.modules.conv._ConvNd):
        return 2 * out_numel * _numel(module.weight.shape[1:])
    if isinstance(module, nn.MultiheadAttention) and x is not None:
        k = tensors[1] if len(tensors) > 1 and tensors[1] is not None else x
        e = module.embed_dim
        s = k.shape[1] if module.batch_first and len(k.shape) == 3 else k.shape[0]
        q_tokens = _numel(x.shape) // e
        k_tokens = _numel(k.shape) // (module.kdim or e)
        return 2 * q_tokens * e * e * 2 + 2 * k_tokens * e * e * 2 + 4 * q_tokens * s * e
    if isinstance(module, nn.RNNBase) and x is not None:
        gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
        tokens = _numel(x.shape) // module.input_size
        dirs = 2 if module.bidirectional else 1
        h = module.hidden_size
        return 2 * gates * h * (module.input_size + h) * tokens * module.num_layers * dirs
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if linears and x is not None and len(x.shape) >= 1 and x.shape[-1]:
        # an opaque module built of linears (an unlisted leaf): 2 * weights * tokens, roughly
        tokens = _numel(x.shape) // x.shape[-1]
        return 2 * tokens * sum(m.weight.numel() for m in linears) + out_numel
    return out_numel


def _einsum_flops(node: fx.Node, args: Sequence[Any]) -> int:
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else None
    operands = [a for a in _leaves(args)]
    if equation is None:
        raise TypeError("einsum without an equation string")
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: Dict[str, int] = {}
    for spec, meta in zip(lhs, operands):
        letters = [c for c in spec if c.isalpha()]
        for c, n in zip(letters, meta.shape[-len(letters):] if letters else ()):
            sizes[c] = n
    return 2 * _numel(tuple(sizes.values()))


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _leaves(tree: Any) -> List[_Meta]:
    if isinstance(tree, _Meta):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [m for t in tree for m in _leaves(t)]
    if isinstance(tree, dict):
        return [m for t in tree.values() for m in _leaves(t)]
    return []


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if len(shape) else 1


def _unique(items: Iterable[str]) -> List[str]:
    seen: List[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _dtype_of_meta(meta: Any) -> Optional[str]:
    leaves = _leaves(meta)
    if not leaves:
        return None
    return "|".join(_unique(dtype_name(m.dtype) for m in leaves))


def _is_attr(node: fx.Node) -> bool:
    """A read of a parameter, buffer or constant (a get_attr, or one convert lowered to a dict lookup)."""
    return attr_target(node) is not None


def _label(node: fx.Node) -> str:
    return attr_target(node) or node.name


def _op_label(row: Row) -> str:
    if row.kind == "get_attr":
        return f"{row.op} {row.module}"
    if row.kind == "placeholder":
        return "input"
    if row.module and row.kind != "output":
        return f"{row.module}: {_tidy(row.op)}"
    return _tidy(row.op)


def _tidy(op: str) -> str:
    return op.replace("torch.nn.functional.", "F.")


def _arrow(a: str, b: str) -> str:
    return a if a == b else f"{a} → {b}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def _human(n: int) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"


def _category(value: Union[str, Category]) -> Category:
    try:
        return Category(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a category; use one of {', '.join(c.value for c in Category)}") from None


def _replace(rep: Report, **changes: Any) -> Report:
    return dataclasses.replace(rep, **changes)


def _maybe_fetch(gm: fx.GraphModule, node: fx.Node) -> Any:
    if not _is_attr(node):
        return None
    try:
        return fetch_attr(gm, attr_target(node))
    except AttributeError:
        return None


def _as_tuple(example_inputs: Any) -> Optional[Tuple[Any, ...]]:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    return (example_inputs,)


def _describe_input(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{','.join(map(str, value.shape))}:{dtype_name(value.dtype)}"
    return type(value).__name__


def _flat_summary(s: Summary) -> Dict[str, Any]:
    flat: Dict[str, Any] = {"ops": s.ops}
    flat.update({f"category.{k}": v for k, v in s.categories.items()})
    flat.update({f"resolved.{k}": v for k, v in s.resolved.items()})
    flat.update({"casts": s.casts, "weight_casts": s.weight_casts, "noop_casts": s.noop_casts, "flops": s.flops,
                 "low_flops": s.low_flops, "low_share": s.low_share})
    return flat
