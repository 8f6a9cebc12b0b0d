"""A report as text: the table, JSON and CSV, and the small text helpers they share.

Reads records duck-typed (no import of :mod:`.records`, which imports this module).
"""

from __future__ import annotations

import csv
import io
import math
import textwrap
from dataclasses import asdict
from typing import Any, Dict, Iterable, List

from ..dtypes import short_name
from ..conversion.op_lists import Category

__all__ = ["CSV_COLUMNS", "NUMERICS_COLUMNS", "FLOAT8_COLUMNS", "JSON_VERSION", "table", "to_dict", "to_csv", "op_label", "unique",
           "arrow", "human", "flat_summary", "short_reason", "format_db"]

JSON_VERSION = 2  # 2: rows carry "numerics", the report "numerics_summary" and "gradients"
REASON_WIDTH = 30  # the default table's reason column: the reason's first clause, wrapped at words
#: the default table's column widths (node, op, reason, in→compute→out, casts), tried in turn until the
#: table fits in TABLE_WIDTH columns: long module paths and many input dtypes (a GPT-2 exported with
#: torch.export: ``bf16,fp32,bool→bf16→bf16``) get the narrower ones, most models the first
COLUMN_WIDTHS = ((20, 18, REASON_WIDTH, 26, 24), (18, 16, 26, 18, 22), (16, 14, 22, 16, 20))
TABLE_WIDTH = 120
CSV_COLUMNS = ["record", "node", "kind", "op", "module", "category", "resolved", "reason", "source", "input_dtypes",
               "compute", "output_dtype", "output_shape", "casts", "flops", "value"]
#: appended to CSV_COLUMNS when the report measured numerics
NUMERICS_COLUMNS = ["sqnr_db", "max_rel_error", "nonfinite", "overflow", "underflow", "culprit"]
#: appended when the policy runs float8 (a row per candidate matmul; the measured ones with numerics)
FLOAT8_COLUMNS = ["float8", "float8_reason", "float8_sqnr_db", "float8_input_amax", "float8_weight_amax",
                  "float8_scale", "float8_nan_rows"]
#: appended when the graph has float32 islands (conversion.rewrite.islands): one per node of an island
RECOMPUTE_COLUMNS = ["recompute_island", "recompute", "recompute_reason", "recompute_saved_dtype",
                     "recompute_bytes_saved", "recompute_chunked"]


def unique(items: Iterable[str]) -> List[str]:
    """The items in order, each once."""
    seen: List[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def tidy(op: str) -> str:
    return op.replace("torch.nn.functional.", "F.")


def op_label(row: Any) -> str:
    """What the table shows in its op column: ``qkv: F.linear``, ``parameter fc.weight``, ``input``."""
    if row.kind == "get_attr":
        return f"{row.op} {row.module}"
    if row.kind == "placeholder":
        return "input"
    if row.module and row.kind != "output":
        return f"{row.module}: {tidy(row.op)}"
    return tidy(row.op)


def short_op_label(row: Any) -> str:
    """The op column of the default table: the op's own name, after its module path (``qkv: linear``)."""
    if row.kind == "get_attr":
        return f"{'param' if row.op == 'parameter' else row.op} {row.module}"
    if row.kind == "placeholder":
        return "input"
    name = row.op.rsplit(".", 1)[-1] if row.op.startswith(("torch.", "operator.", "builtins.", "aten.")) else row.op
    return f"{row.module}: {name}" if row.module and row.kind != "output" else name


def arrow(a: str, b: str) -> str:
    return a if a == b else f"{a} → {b}"


def human(n: int) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"


def format_db(value: float) -> str:
    if value is None:
        return ""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if math.isnan(value):
        return "nan"
    return f"{value:.1f}"


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def wrap(text: str, width: int) -> str:
    """``text`` wrapped at spaces to ``width``; a longer name (a module path, a node name) breaks after a ``.``
    or ``_``, between its parts, never inside one."""
    lines: List[str] = []
    for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False):
        while len(line) > width:
            cut = line.rfind(".", 0, width)  # between the parts of a path first, else of a snake_case name
            if cut <= 0:
                cut = line.rfind("_", 0, width)
            if cut <= 0:
                break
            lines.append(line[:cut + 1])
            line = line[cut + 1:]
        lines.append(line)
    return "\n".join(lines) or text


def wrap_dtypes(ins: List[str], compute: str, out: str, width: int) -> str:
    """``in1,in2→compute→out``, broken after a ``,`` or before ``→compute`` where it is wider than ``width``."""
    lines = [""]
    for i, name in enumerate(ins or ["·"]):
        piece = name + ("," if i < len(ins) - 1 else "")
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    tail = f"→{compute}→{out}"
    if len(lines[-1]) + len(tail) > width:
        lines.append(tail)
    else:
        lines[-1] += tail
    return "\n".join(lines)


def short_reason(reason: str, width: int = REASON_WIDTH) -> str:
    """The reason's first clause (up to ``:`` or ``;``), wrapped at word boundaries to ``width``.

    The full text is in ``--wide``, JSON and CSV; words are never cut.
    """
    head = reason
    for sep in (":", ";", " ("):
        cut = head.find(sep)
        if cut > 0:
            head = head[:cut]
    return wrap(head.strip(), width) or reason


def table(rep: Any, *, wide: bool = False) -> str:
    """The table (tabulate), then the summary and the dtype leaks; ``wide`` shows reasons and op paths in full."""
    from tabulate import tabulate

    numerics = any(r.numerics is not None for r in rep.rows)
    if wide:
        headers = ["node", "op", "category", "reason", "in dtypes", "compute", "out dtype", "casts inserted before"]
    else:
        headers = ["node", "op", "category", "reason", "in→compute→out", "casts before"]
    if numerics:
        headers += ["SQNR dB", "rel err", "inf/nan", "ovf/unf"]
    float8 = any(r.float8 is not None for r in rep.rows)
    if float8:
        headers += ["float8"]
    recompute = any(r.recompute is not None for r in rep.rows)
    if recompute and wide:
        headers += ["recompute"]

    def render(widths: Any) -> str:
        body = []
        for r in rep.rows:
            casts = ", ".join(str(c) for c in r.casts)
            ins = [short_name(d) for d in unique(r.input_dtypes)]
            if wide:
                cat = r.category.value if r.resolved is r.category else f"{r.category.value}→{r.resolved.value}"
                line = [r.node, op_label(r), cat, r.reason, ",".join(ins), short_name(r.compute),
                        short_name(r.output_dtype), casts]
            else:  # TABLE_WIDTH columns: short reasons, cells wrapped at spaces (never inside a word)
                node_w, op_w, reason_w, dtypes_w, casts_w = widths
                cat = r.category.value if r.resolved is r.category else f"{r.resolved.value}*"
                dtypes = wrap_dtypes(ins, short_name(r.compute), short_name(r.output_dtype), dtypes_w)
                line = [wrap(r.node, node_w), wrap(short_op_label(r), op_w), cat, short_reason(r.reason, reason_w),
                        dtypes, wrap(casts, casts_w)]  # (float32 islands: listed below the table, a column in wide)
            if numerics:
                line += _numerics_cells(r.numerics)
            if float8:
                line.append(float8_cell(r.float8, wide))
            if recompute and wide:
                line.append(recompute_cell(r.recompute, wide))
            body.append(line)
        return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True) if body else "(no rows)"

    for widths in COLUMN_WIDTHS[:1] if wide else COLUMN_WIDTHS:
        text = render(widths)
        if max(len(line) for line in text.splitlines()) <= TABLE_WIDTH:
            break
    lines = [header(rep), ""]
    lines.append(text)
    idle = next((c for r in rep.rows for c in r.casts if c.effective is False), None)
    if idle is not None:  # the legend shows a cast of this report's own dtype
        lines.append(f"(a→{short_name(idle.dtype)}): a run-time checked cast that changed nothing for these inputs")
    if not wide:
        lines.append("*: conditional, resolved for this node")
        lines.append("reasons shortened: --wide, JSON and CSV have them in full")
    if numerics:
        lines.append("◀ culprit: the first node where the error jumps (SQNR 20 dB or more below its inputs')")
    if float8:
        lines.append("float8: f8 runs in float8, bf16 stays bfloat16 (why: shape, cost, override; --wide says it "
                     "in full); dB: the float8 result against the bfloat16 one, measured with numerics")
        if any(r.float8 is not None and r.float8.measured is not None and r.float8.measured.spreads for r in rep.rows):
            lines.append("NaN→k/m rows: one NaN planted in one input row made k of the m output rows NaN (tensorwise: "
                         "one scale for the whole tensor, so one non-finite input spoils every row; rowwise keeps it "
                         "to its row)")
    if recompute:
        lines += ["", *island_lines(rep)]
    lines += ["", *summary_lines(rep)]
    if rep.lints:
        lines += ["", f"dtype leaks ({len(rep.lints)}):"]
        for lint in rep.lints:
            lines += [f"  {lint}"] if wide else textwrap.wrap(str(lint), 118, initial_indent="  ", subsequent_indent="    ",
                                                               break_long_words=False, break_on_hyphens=False)
    if getattr(rep, "gradients", None) is not None:
        lines += ["", *rep.gradients.summary_lines()]
    return "\n".join(lines)


def _numerics_cells(n: Any) -> List[str]:
    if n is None:
        return ["", "", "", ""]
    sqnr = format_db(n.sqnr_db) + (" ◀" if n.culprit else "")
    rel = "" if n.max_rel_error is None else f"{n.max_rel_error:.2g}"
    flows = "" if n.overflow is None else f"{100 * n.overflow:.0f}%/{100 * n.underflow:.0f}%"
    return [sqnr, rel, str(n.nonfinite) if n.nonfinite else "", flows]


def float8_cell(cell: Any, wide: bool = False) -> str:
    """``f8 28.1dB``, ``bf16 (shape)``, ``bf16 (cost) 27.9dB``…; ``wide`` adds the reason."""
    if cell is None:
        return ""
    text = "f8" if cell.chosen else "bf16 (" + {"graph": "shape", "default": "cost"}.get(cell.source, "override") + ")"
    if cell.measured is not None:
        text += f" {format_db(cell.measured.sqnr_db)}dB"
        if cell.measured.spreads:
            text += " NaN→{}/{} rows".format(*cell.measured.nan_rows)
    return f"{text}: {cell.reason}" if wide else text


def recompute_cell(cell: Any, wide: bool = False) -> str:
    """``bf16 -8.39MB`` on an island's first row, ``↑`` on its other rows, ``no``; ``wide`` adds the reason."""
    if cell is None:
        return ""
    if not cell.first:
        return "↑"
    text = "no" if not cell.chosen else short_name(cell.saved_dtype) + (
        "" if cell.bytes_saved is None else " -" + _bytes(cell.bytes_saved))
    return f"{text}: {cell.reason}" if wide else text


def island_lines(rep: Any) -> List[str]:
    """One line per float32 island (``conversion.rewrite.islands``): recomputed or not, and why."""
    islands: Dict[str, List[Any]] = {}
    for r in rep.rows:
        if r.recompute is not None:
            islands.setdefault(r.recompute.island, []).append(r)
    lines = [f"float32 islands ({len(islands)}; recomputed: backward keeps their low-precision inputs, not float32):"]
    for name, rows in islands.items():
        c = rows[0].recompute
        nodes = rows[0].node + ("" if len(rows) == 1 else f" to {rows[-1].node} ({len(rows)} ops)")
        what = (f"recomputed, keeps {c.saved_dtype} for backward" + ("" if c.bytes_saved is None else
                                                                     f", {_bytes(c.bytes_saved)} less")
                + (", forward and backward in row chunks" if c.forward_chunked else
                   ", backward in row chunks" if c.chunked else ", backward whole") if c.chosen else
                f"not recomputed: {c.reason}")
        lines += textwrap.wrap(f"{nodes}: {what}", TABLE_WIDTH - 2, initial_indent="  ", subsequent_indent="    ",
                               break_long_words=False)
    return lines


def _bytes(n: int) -> str:
    """``16.4kB``, ``8.39MB``, ``1.65GB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n}B"


def header(rep: Any) -> str:
    inputs = ", ".join(rep.inputs) if rep.inputs else "none (dtypes that depend on the inputs show as runtime)"
    text = f"fxamp report: {rep.model}  policy {rep.policy}\ninputs: {inputs}  frontend {rep.frontend}"
    for note in rep.notes:
        text += "\n" + textwrap.fill(f"note: {note}", 120, subsequent_indent="  ", break_long_words=False,
                                     break_on_hyphens=False)
    return text


def summary_lines(rep: Any) -> List[str]:
    s = rep.summary
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
        lines.append(f"low-precision FLOPs: {100 * s.low_share:.1f}% of {human(s.flops)} (estimated from shapes)")
    if getattr(rep, "numerics_summary", None) is not None:
        lines += rep.numerics_summary.lines()
    return lines


def to_dict(rep: Any) -> Dict[str, Any]:
    """A JSON-ready dict: ``{"version", "model", "policy", ..., "rows": [...], "summary": {...}, "lints": [...]}``."""
    return {
        "version": JSON_VERSION,
        "model": rep.model,
        "policy": rep.policy,
        "frontend": rep.frontend,
        "inputs": list(rep.inputs),
        "rows": [r.to_dict() for r in rep.rows],
        "summary": rep.summary.to_dict(),
        "lints": [asdict(lint) for lint in rep.lints],
        "notes": list(rep.notes),
        "numerics_summary": None if rep.numerics_summary is None else rep.numerics_summary.to_dict(),
        "gradients": None if rep.gradients is None else rep.gradients.to_dict(),
    }


def to_csv(rep: Any) -> str:
    """One CSV line per node (``record=node``), then the summary (``record=summary``) and leaks (``record=lint``).

    With numerics, the columns of :data:`NUMERICS_COLUMNS` follow :data:`CSV_COLUMNS`.
    """
    numerics = any(r.numerics is not None for r in rep.rows)
    float8 = any(r.float8 is not None for r in rep.rows)
    recompute = any(r.recompute is not None for r in rep.rows)
    columns = CSV_COLUMNS + (NUMERICS_COLUMNS if numerics else []) + (FLOAT8_COLUMNS if float8 else []) + \
        (RECOMPUTE_COLUMNS if recompute else [])
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(columns)
    for r in rep.rows:
        line = ["node", r.node, r.kind, r.op, r.module, r.category.value, r.resolved.value, r.reason,
                r.source, " ".join(r.input_dtypes), r.compute, r.output_dtype,
                "" if r.output_shape is None else "x".join(map(str, r.output_shape)),
                " ".join(f"{c.source}->{c.dtype}" for c in r.casts),
                "" if r.flops is None else r.flops, ""]
        if numerics:
            n = r.numerics
            line += ["", "", "", "", "", ""] if n is None else [
                format_db(n.sqnr_db), "" if n.max_rel_error is None else repr(n.max_rel_error), n.nonfinite,
                "" if n.overflow is None else repr(n.overflow), "" if n.underflow is None else repr(n.underflow),
                int(n.culprit)]
        if float8:
            c = r.float8
            m = None if c is None else c.measured
            line += [""] * len(FLOAT8_COLUMNS) if c is None else [
                int(c.chosen), c.reason, "" if m is None else format_db(m.sqnr_db),
                *(("",) * 4 if m is None else (" ".join(map(repr, v)) for v in (m.input_amax, m.weight_amax, m.scale,
                                                                                 m.nan_rows)))]
        if recompute:
            c = r.recompute
            line += [""] * len(RECOMPUTE_COLUMNS) if c is None else [
                c.island, int(c.chosen), c.reason, c.saved_dtype or "", "" if c.bytes_saved is None else c.bytes_saved,
                int(c.chunked)]
        w.writerow(line)
    pad = [""] * (len(columns) - len(CSV_COLUMNS))
    blank = [""] * (len(CSV_COLUMNS) - 3)
    for key, value in flat_summary(rep.summary).items():
        w.writerow(["summary", key, *blank, "" if value is None else value, *pad])
    if rep.numerics_summary is not None:
        for key, value in rep.numerics_summary.to_dict().items():
            w.writerow(["summary", f"numerics.{key}", *blank, "" if value is None else value, *pad])
    for lint in rep.lints:
        w.writerow(["lint", lint.node, "", lint.kind, "", "", "", lint.message, *[""] * (len(columns) - 8)])
    return out.getvalue()


def flat_summary(s: Any) -> Dict[str, Any]:
    flat: Dict[str, Any] = {"ops": s.ops}
    flat.update({f"category.{k}": v for k, v in s.categories.items()})
    flat.update({f"resolved.{k}": v for k, v in s.resolved.items()})
    flat.update({"casts": s.casts, "weight_casts": s.weight_casts, "noop_casts": s.noop_casts, "flops": s.flops,
                 "low_flops": s.low_flops, "low_share": s.low_share})
    return flat
