"""The package's layout stays a pipeline: no import cycles, and no import from a lower stage to a higher one.

Imports are read with ``ast`` from every module of ``fxamp``, those inside functions included
(an import hidden in a function is still a dependency).  ``STAGES`` is the order of
``docs/DESIGN.md``; a module missing from it counts as a top-level feature (it may import
anything below, and nothing below may import it).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxamp"

#: lower numbers are lower stages; a module may import only modules of its own stage or lower
STAGES: Dict[str, int] = {
    "errors": 0, "op_lists": 0,
    "graph": 1,
    "dtypes": 2,
    "policy": 3, "runtime": 3,
    "info": 4, "loss_scale": 4, "distributed": 4, "segmented_step": 4, "packed_step": 4,
    "fused_step": 4,
    "capture": 5,  # and every capture.* module
    "optim": 5,
    "classify": 6,
    "rewrite": 7, "attention": 7,
    "debug": 7,  # an opt-in rewrite pass
    "pipeline": 8, "lazy": 8,
    "convert": 9,
}
TOP = 10  # api, report, integrations and other features built on the pipeline
ENTRY = {"__init__": 12, "__main__": 12, "cli": 11}


def _stage(module: str) -> int:
    if module.startswith("capture."):
        return STAGES["capture"]
    return ENTRY.get(module, STAGES.get(module, TOP))


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, name: str) -> str:
    """The fxamp-relative module a ``from ...name import`` names ('' for fxamp itself)."""
    base = importer.split(".") if importer != "__init__" else []
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports() -> Dict[str, Set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.ImportFrom):
                base = None
                if node.level == 0:
                    if node.module and (node.module == "fxamp" or node.module.startswith("fxamp.")):
                        base = node.module.removeprefix("fxamp").lstrip(".")
                else:
                    base = _resolve(module, is_package, node.level, node.module or "")
                if base is not None:
                    # ``from .pkg import sub`` depends on the submodule; ``from .mod import name`` on the module
                    subs = [f"{base}.{a.name}" if base else a.name for a in node.names]
                    targets = [t for t in subs if t in modules]
                    if len(targets) < len(subs):
                        targets.append(base)
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("fxamp").lstrip(".") for a in node.names
                           if a.name == "fxamp" or a.name.startswith("fxamp.")]
            for t in targets:
                if t in modules and t != module:
                    graph[module].add(t)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_import_reader_sees_function_level_and_relative_imports():
    graph = _imports()
    assert "graph" in graph["classify"] and "dtypes" in graph["classify"]
    assert "capture" in graph["convert"]
    assert {"capture.fx", "capture.export", "capture.modes"} <= graph["capture"]


def test_no_import_cycles():
    cycles = _cycles(_imports())
    assert not cycles, "import cycles in fxamp: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_points_up_the_pipeline():
    upward = [f"{m} (stage {_stage(m)}) imports {n} (stage {_stage(n)})"
              for m, targets in _imports().items() for n in sorted(targets)
              if _stage(n) > _stage(m) and not (m == "capture" and n.startswith("capture."))]
    assert not upward, "imports against the pipeline's direction:\n" + "\n".join(upward)


def test_training_half_does_not_import_the_conversion_half():
    graph = _imports()
    for module in ("optim", "segmented_step", "packed_step", "loss_scale", "distributed"):
        reach, todo = set(), [module]
        while todo:
            for n in graph[todo.pop()]:
                if n not in reach:
                    reach.add(n)
                    todo.append(n)
        assert not reach & {"convert", "classify", "rewrite", "capture"}, (module, sorted(reach))


@pytest.mark.parametrize("module", ["capture.fx", "capture.export", "capture.modes", "capture.common"])
def test_nothing_outside_capture_imports_its_private_names(module):
    for path in PACKAGE.rglob("*.py"):
        if _module_name(path).startswith("capture"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(module.split(".")[-1]):
                assert not any(a.name.startswith("_") for a in node.names), (path, ast.dump(node))
