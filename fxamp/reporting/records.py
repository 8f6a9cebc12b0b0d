"""The report's records: one :class:`Row` per graph node, the :class:`Summary`, the dtype-leak
:class:`Lint`, the measured :class:`NodeNumerics`, and the :class:`Report` that holds them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..dtypes import LOW, dtype_name, short_name
from ..conversion.op_lists import Category
from . import formats
from .diff import PolicyDiff, diff_reports

__all__ = ["RUNTIME", "AS_INPUT", "LOW_NAMES", "CastIn", "Row", "Lint", "Summary", "NodeNumerics",
           "NumericsSummary", "Report", "as_category", "Float8Measure", "Float8Cell", "RecomputeCell"]

RUNTIME = "runtime"  #: a dtype known only when the model runs
AS_INPUT = "as input"  #: compute=None: the op runs in the dtype its inputs arrive in
LOW_NAMES = tuple(dtype_name(d) for d in LOW)


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
class NodeNumerics:
    """A node's output in the converted model against the float32 model's, on the same inputs.

    Aggregated over input batches: the worst batch for each field.

    sqnr_db:       20·log10(‖ref‖ / ‖ref − out‖) in dB; +inf when equal (the minimum over batches).
    max_rel_error: max |ref − out| / max |ref|: the error relative to the tensor's scale (finite elements).
    nonfinite:     inf/NaN values in ``out`` where ``ref`` was finite (summed over batches).
    overflow:      float16 only: fraction of float32 values with |x| > 65504 (None otherwise).
    underflow:     float16 only: fraction of nonzero float32 values with |x| < 2⁻¹⁴ (subnormal or zero).
    culprit:       the first node where the error drops sharply: the likely cause.
    """

    sqnr_db: float
    max_rel_error: Optional[float]
    nonfinite: int
    overflow: Optional[float] = None
    underflow: Optional[float] = None
    culprit: bool = False

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["sqnr_db"] = _json_float(self.sqnr_db)
        return d


@dataclass(frozen=True)
class Float8Measure:
    """One float8 candidate matmul's measured numbers (the worst over the batches; :mod:`.float8`).

    sqnr_db:      SQNR of the float8 result against the bfloat16 one on the same inputs, in dB.
    input_amax:   (smallest, largest) amax over the input's scaling groups (one per tensor, or per row).
    weight_amax:  (smallest, largest) amax over the weight's scaling groups.
    scale:        (smallest, largest) scale over both operands' groups (float8 = value * scale).
    nan_rows:     (output rows NaN, output rows) once one NaN is planted in the input's first row (its own
                  non-finite values zeroed): 1 under the rowwise recipes (a scale per row), every row under
                  tensorwise (the tensor's one scale turns NaN).
    """

    sqnr_db: float
    input_amax: Tuple[float, float]
    weight_amax: Tuple[float, float]
    scale: Tuple[float, float]
    nan_rows: Tuple[int, int]

    @property
    def spreads(self) -> bool:
        """One non-finite input row reaches other output rows (tensorwise scaling)."""
        return self.nan_rows[0] > 1

    def merged(self, other: "Float8Measure") -> "Float8Measure":
        """The worst of two batches: the lower SQNR, the wider ranges, the larger share of rows a NaN reaches."""
        def span(a: Tuple[float, float], b: Tuple[float, float]) -> Tuple[float, float]:
            return min(a[0], b[0]), max(a[1], b[1])
        rows = max(self.nan_rows, other.nan_rows, key=lambda r: (r[0] / max(r[1], 1), r[0]))
        return Float8Measure(min(self.sqnr_db, other.sqnr_db), span(self.input_amax, other.input_amax),
                             span(self.weight_amax, other.weight_amax), span(self.scale, other.scale), rows)

    def to_dict(self) -> Dict[str, Any]:
        return {"sqnr_db": _json_float(self.sqnr_db), "input_amax": list(self.input_amax),
                "weight_amax": list(self.weight_amax), "scale": list(self.scale), "nan_rows": list(self.nan_rows)}


@dataclass(frozen=True)
class Float8Cell:
    """The float8 column of a matmul a float8 policy could run in float8.

    chosen:   it runs in float8 (else in bfloat16).
    reason:   why (shape, cost model, override): the node's ``Decision.float8``.
    source:   where the choice came from (``default`` cost model, ``graph`` shape, an override).
    measured: its :class:`Float8Measure` (``report(..., numerics=True)``), else None.
    """

    chosen: bool
    reason: str
    source: str
    measured: Optional[Float8Measure] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"chosen": self.chosen, "reason": self.reason, "source": self.source,
                "measured": None if self.measured is None else self.measured.to_dict()}


@dataclass(frozen=True)
class RecomputeCell:
    """The recompute column of a node in a float32 island (``conversion.rewrite.islands``).

    island:      the island's name (every node of it shows the same choice).
    chosen:      the island keeps its low-precision input for backward and recomputes there.
    reason:      why (the rule, or an override): the node's ``Decision.recompute``.
    source:      where the choice came from (``default``, or an override).
    saved_dtype: the dtype kept for backward in place of float32 (chosen islands), else None.
    bytes_saved: float32 bytes of the upcast values less the kept ones, from the shapes a run observed; else None.
    first:       the island's first row in the table (where the table prints the cell).
    chunked:     its backward runs in chunks of rows (one chunk's float32 tensors at a time), else whole.
    forward_chunked: its forward too (a loss's upcast deferred to the chunks), else whole.
    """

    island: str
    chosen: bool
    reason: str
    source: str
    saved_dtype: Optional[str] = None
    bytes_saved: Optional[int] = None
    first: bool = True
    chunked: bool = False
    forward_chunked: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NumericsSummary:
    """What the side-by-side run found: the output's SQNR, the worst op and the culprit.

    output_sqnr_db: SQNR of the model's output (the minimum over batches and output tensors).
    worst:          the op node with the lowest SQNR (first such in graph order), or None.
    worst_sqnr_db:  its SQNR.
    culprit:        the first node where the error drops sharply, or None.
    batches:        how many input batches were compared.
    """

    output_sqnr_db: float
    worst: Optional[str]
    worst_sqnr_db: Optional[float]
    culprit: Optional[str]
    batches: int

    def lines(self) -> List[str]:
        fmt = formats.format_db
        text = [f"numerics over {self.batches} batch{'es' if self.batches != 1 else ''}: output SQNR "
                f"{fmt(self.output_sqnr_db)} dB against float32"]
        if self.worst is not None:
            text.append(f"worst op: {self.worst} ({fmt(self.worst_sqnr_db)} dB)"
                        + (f"; error starts at {self.culprit}" if self.culprit and self.culprit != self.worst else ""))
        return text

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["output_sqnr_db"] = _json_float(self.output_sqnr_db)
        d["worst_sqnr_db"] = _json_float(self.worst_sqnr_db)
        return d


def _json_float(x: Optional[float]) -> Any:
    """JSON has no inf: +inf dB (exactly equal) is written as the string ``"inf"``."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


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
    numerics:     measured error against float32 (``report(..., numerics=True)``), else None.
    float8:       a :class:`Float8Cell` for a matmul a float8 policy could run in float8, else None.
    recompute:    a :class:`RecomputeCell` for a node of a float32 island, else None.
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
    numerics: Optional[NodeNumerics] = None
    float8: Optional[Float8Cell] = None
    recompute: Optional[RecomputeCell] = None

    @property
    def is_op(self) -> bool:
        """True for call_function / call_method / call_module nodes (not inputs, attributes or the output)."""
        return self.kind.startswith("call_")

    @property
    def low_precision(self) -> bool:
        """Whether the node computes in float16 or bfloat16."""
        return self.compute in LOW_NAMES

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["category"] = self.category.value
        d["resolved"] = self.resolved.value
        d["source"] = str(self.source)
        d["input_dtypes"] = list(self.input_dtypes)
        d["output_shape"] = None if self.output_shape is None else list(self.output_shape)
        d["casts"] = [asdict(c) for c in self.casts]
        d["numerics"] = None if self.numerics is None else self.numerics.to_dict()
        d["float8"] = None if self.float8 is None else self.float8.to_dict()
        d["recompute"] = None if self.recompute is None else self.recompute.to_dict()
        return d


@dataclass(frozen=True)
class Lint:
    """A dtype leak: a float32 value where low precision was meant, the node to look at, and what to do.

    kind: ``param-promotion`` (a float32 parameter or buffer promotes a low-precision branch),
          ``cast-down`` (a float32 activation is cast back down for a low-precision op) or ``stored-low``
          (a parameter stored in low precision that only float32 ops read, each casting it up).
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
    numerics_summary: the side-by-side run against float32 (``numerics=True``), else None.
    gradients: the gradient scan (``gradients=True``): a :class:`fxamp.reporting.gradients.GradientReport`.
    """

    model: str
    policy: str
    frontend: str
    inputs: Tuple[str, ...]
    rows: Tuple[Row, ...]
    summary: Summary
    lints: Tuple[Lint, ...]
    notes: Tuple[str, ...] = ()
    numerics_summary: Optional[NumericsSummary] = None
    gradients: Any = None

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
        wanted = {as_category(c) for c in categories}
        return dataclasses.replace(self, rows=tuple(r for r in self.rows if r.category in wanted))

    def to_table(self, *, wide: bool = False) -> str:
        """The table, then the summary and the dtype leaks; the default fits ~120 columns, ``wide`` keeps reasons whole."""
        return formats.table(self, wide=wide)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: ``{"version", "model", "policy", ..., "rows": [...], "summary": {...}, "lints": [...]}``."""
        return formats.to_dict(self)

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The report as JSON (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def to_csv(self) -> str:
        """One CSV line per node (``record=node``), then the summary (``record=summary``) and leaks (``record=lint``)."""
        return formats.to_csv(self)

    def diff(self, other: "Report") -> PolicyDiff:
        """The nodes whose category, compute or output dtype differ between this report and ``other``."""
        return diff_reports(self, other)


def as_category(value: Union[str, Category]) -> Category:
    try:
        return Category(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a category; use one of {', '.join(c.value for c in Category)}") from None
