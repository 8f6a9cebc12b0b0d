"""Which nodes change category or dtype between two reports of the same model (two policies)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..dtypes import short_name
from .formats import JSON_VERSION, arrow, op_label

__all__ = ["DiffRow", "PolicyDiff", "diff_reports"]


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
    summary_a: Any  # records.Summary
    summary_b: Any

    def __str__(self) -> str:
        from tabulate import tabulate

        head = f"fxamp compare: {self.model}\n  A: {self.policy_a}\n  B: {self.policy_b}\n"
        if not self.rows:
            return head + "\nno node changes category or dtype"
        body = [[r.node, r.op, arrow(r.category_a, r.category_b), arrow(short_name(r.compute_a), short_name(r.compute_b)),
                 arrow(short_name(r.output_a), short_name(r.output_b)), arrow(str(r.casts_a), str(r.casts_b))]
                for r in self.rows]
        table = tabulate(body, headers=["node", "op", "category", "compute", "out dtype", "casts inserted before"],
                         tablefmt="simple", disable_numparse=True)
        a, b = self.summary_a, self.summary_b
        tail = [f"{len(self.rows)} nodes change", f"casts inserted: {a.casts} → {b.casts}"]
        if a.low_share is not None and b.low_share is not None:
            tail.append(f"low-precision FLOPs: {100 * a.low_share:.1f}% → {100 * b.low_share:.1f}%")
        return head + "\n" + table + "\n\n" + "\n".join(tail)

    def to_dict(self) -> Dict[str, Any]:
        return {"version": JSON_VERSION, "model": self.model, "policy_a": self.policy_a, "policy_b": self.policy_b,
                "rows": [asdict(r) for r in self.rows], "summary_a": self.summary_a.to_dict(),
                "summary_b": self.summary_b.to_dict()}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


def diff_reports(a: Any, b: Any) -> PolicyDiff:
    """The nodes whose category, compute or output dtype differ between reports ``a`` and ``b``.

    Both reports must be of the same model: rows are matched by node name, and nodes a rewrite
    renamed (a leaf module run through ``call_module_cast``) by op and module, in graph order.
    """
    pairs = _match_rows(a.rows, b.rows)
    if pairs is None:
        raise ValueError(f"cannot compare reports of different graphs ({a.model}, {len(a.rows)} nodes vs "
                         f"{b.model}, {len(b.rows)} nodes); report the same model under both policies")
    changed = []
    for x, y in pairs:
        if (x.resolved, x.compute, x.output_dtype) != (y.resolved, y.compute, y.output_dtype) or \
                len(x.casts) != len(y.casts):
            changed.append(DiffRow(x.node, op_label(x), x.resolved.value, y.resolved.value, x.compute,
                                   y.compute, x.output_dtype, y.output_dtype, len(x.casts), len(y.casts)))
    return PolicyDiff(a.model, a.policy, b.policy, tuple(changed), a.summary, b.summary)


def _match_rows(mine: Sequence[Any], theirs: Sequence[Any]) -> Optional[List[Tuple[Any, Any]]]:
    by_name = {r.node: r for r in theirs}
    paired: Dict[int, Any] = {}
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
