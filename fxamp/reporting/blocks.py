"""The report of a model converted in place (``fxamp.convert_``): blocks and glue in one table.

Each family of blocks contributes the rows of each graph it captured (one per call signature),
once for the family, under the first instance's path (``model.layers.0.mlp``); the family's notes
say which instances share it.  Glue modules' rows are the same records, marked module-level: their
``source`` is ``module-level`` and their reason starts with ``module-level:``.  Families that have
not been called yet have no graph: the notes name them, as they name the calls a family runs as
written because no front end could capture them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import List

import torch.nn as nn

from ..conversion.blocks import converted_modules, family_of
from ..conversion.op_lists import Category
from ..info import conversion_info
from .build import build_report, policy_label
from .records import Report, Row, Summary

__all__ = ["blocks_report", "MODULE_LEVEL"]

#: the ``source`` of a glue module's rows
MODULE_LEVEL = "module-level"


def blocks_report(model: nn.Module) -> Report:
    """One report over every converted block and glue module of ``model`` (their captured graphs)."""
    info = conversion_info(model)
    rows: List[Row] = []
    notes = list(info.notes)
    lints = []
    casts = weight_casts = 0
    seen = set()
    for path, module in converted_modules(model):
        family = family_of(module)
        if id(family) in seen:
            continue
        seen.add(id(family))
        kind = "glue module" if family.glue else "block"
        shared = f" (shared by {', '.join(family.paths)})" if len(family.paths) > 1 else ""
        notes += [written.note for written in family.as_written.values()]  # calls no front end could capture
        if not family.graphs:
            if not family.as_written:
                notes.append(f"{kind} {path!r}{shared}: not called yet, no graph to report")
            continue
        for graph in [g for variants in family.graphs.values() for g in variants]:
            rep = build_report(graph.gm, type(module).__name__, (), {}, None)
            notes.append(f"{kind} {path!r}{shared}: {graph.frontend} graph for a call with {graph.description}")
            casts += rep.summary.casts
            weight_casts += rep.summary.weight_casts
            lints += [dataclasses.replace(lint, node=f"{path}/{lint.node}") for lint in rep.lints]
            for row in rep.rows:
                row = dataclasses.replace(row, node=f"{path}/{row.node}",
                                          module=f"{path}.{row.module}" if row.module else path)
                if family.glue:
                    row = dataclasses.replace(row, source=MODULE_LEVEL, reason=f"module-level: {row.reason}")
                rows.append(row)
    ops = [r for r in rows if r.is_op]
    categories = {c.value: sum(r.category is c for r in ops) for c in Category}
    resolved = Counter(r.resolved.value for r in ops if r.category is Category.CONDITIONAL)
    summary = Summary(ops=len(ops), categories=categories, resolved=dict(sorted(resolved.items())),
                      casts=casts, weight_casts=weight_casts, noop_casts=None, flops=None, low_flops=None)
    return Report(type(model).__name__, policy_label(info.policy), info.frontend, (), tuple(rows), summary,
                  tuple(lints), tuple(notes))
