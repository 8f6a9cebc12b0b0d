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

#: lower numbers are lower stages; a module may import only modules of its own stage or lower.
#: The top level holds the vocabulary both wings share; each wing has its own order inside.
STAGES: Dict[str, int] = {
    "errors": 0, "dtypes": 0,
    "policy": 1,
    "info": 2,  # ConversionInfo: what conversion leaves on a module and training reads
    # the conversion wing, top to bottom
    "conversion": 3, "conversion.op_lists": 3,
    "conversion.graph": 4, "conversion.options": 4,
    "conversion.inference": 5, "conversion.runtime": 5, "conversion.recompute": 5,
    "conversion.float8": 5,  # float8 matmuls (run by graphs, like runtime) and the choice of them
    "conversion.capture": 6,  # and every conversion.capture.* module
    "conversion.classify": 7,
    "conversion.rewrite": 8, "conversion.attention": 8, "conversion.debug": 8, "conversion.checkpointing": 8,
    "conversion.islands": 8,
    "conversion.calls": 4, "conversion.pipeline": 9, "conversion.lazy": 9, "conversion.blocks": 9,
    "conversion.families": 9,
    "conversion.convert": 10,
    # the training wing
    "training": 3, "training.distributed": 3, "training.config": 3, "training.loss_scale": 3,
    "training.ownership": 3, "training.quant": 3, "training.calibrate": 3, "training.checkpoint": 3, "training.sharded_checkpoint": 3,
    "training.plan": 3,  # the step's tensor lists (buckets, gradient segments, the plan)
    "training.inner": 3,  # which of torch's paths (fused, foreach) steps the masters
    "training.native": 3,  # the lean step's CPU kernel (built with the C compiler, called through ctypes)
    "training.flat": 3,  # the lean step's flat buffers of a run's masters, and the stochastic rounding's hash
    "training.lean": 4,
    "training.step": 4,
    "training.kernels": 5,
    "training.optimizer": 6,
}
WINGS = ("conversion", "training")
TOP = 11  # reporting/, integrations/, api and other features built on both wings
ENTRY = {"__init__": 14, "__main__": 14, "cli": 13, "cli_model": 13, "lightning": 13, "api": 12, "sharding": 12}


def _stage(module: str) -> int:
    if module.startswith("conversion.capture."):
        return STAGES["conversion.capture"]
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
    assert "conversion.graph" in graph["conversion.classify"] and "dtypes" in graph["conversion.classify"]
    assert "conversion.capture" in graph["conversion.convert"]
    assert {"conversion.capture.fx", "conversion.capture.export", "conversion.capture.modes"} <= \
        graph["conversion.capture"]
    assert "training.loss_scale" in graph["training.optimizer"]


def test_no_import_cycles():
    cycles = _cycles(_imports())
    assert not cycles, "import cycles in fxamp: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_points_up_the_pipeline():
    upward = [f"{m} (stage {_stage(m)}) imports {n} (stage {_stage(n)})"
              for m, targets in _imports().items() for n in sorted(targets)
              if _stage(n) > _stage(m)
              and not (m == "conversion.capture" and n.startswith("conversion.capture."))]
    assert not upward, "imports against the pipeline's direction:\n" + "\n".join(upward)


def _wing(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_imports_only_itself_and_the_shared_top_level(wing):
    """Conversion never imports training and vice versa; only the entry points join them."""
    shared = {m for m in STAGES if "." not in m and m not in WINGS}
    crossing = [f"{m} imports {n}" for m, targets in _imports().items() if _wing(m) == wing
                for n in sorted(targets) if _wing(n) != wing and n not in shared]
    assert not crossing, f"the {wing} wing reaches outside itself:\n" + "\n".join(crossing)


def test_the_shared_top_level_imports_no_wing():
    graph = _imports()
    for module in (m for m in STAGES if "." not in m and m not in WINGS):
        assert not {_wing(n) for n in graph[module]} & {*WINGS, "reporting", "integrations"}, (module, graph[module])


def test_the_top_level_is_small():
    """The top level shows the wings; at most ten modules beside them."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 10, top
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == \
        {"conversion", "training", "reporting", "integrations"}


def test_every_module_is_listed_in_a_stage_or_is_a_top_feature():
    unknown = [m for m in _imports() if _stage(m) == TOP and _wing(m) not in ("reporting", "integrations")]
    assert not unknown, f"modules with no stage in STAGES: {unknown}"


def test_every_module_imports_by_its_dotted_name():
    """No function shadows a module: ``import fxamp.reporting.build`` works for every module."""
    import importlib

    for module in sorted(_imports()):
        name = "fxamp" if module == "__init__" else f"fxamp.{module}"
        if module in ("integrations.lightning", "lightning"):
            pytest.importorskip("lightning")
        if module == "integrations.hf":
            pytest.importorskip("transformers")
        imported = importlib.import_module(name)
        assert imported.__name__ == name, (module, imported)


@pytest.mark.parametrize("module", ["conversion.capture.fx", "conversion.capture.export",
                                    "conversion.capture.modes", "conversion.capture.common"])
def test_nothing_outside_capture_imports_its_private_names(module):
    for path in PACKAGE.rglob("*.py"):
        if _module_name(path).startswith("conversion.capture"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(module.split(".")[-1]):
                assert not any(a.name.startswith("_") for a in node.names), (path, ast.dump(node))


def test_no_module_is_over_650_lines():
    """A module a newcomer reads in one sitting: past ~650 lines it holds two jobs."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 650}
    assert not long, long


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.AST) -> Set[str]:
    """Private names a file defines: functions, classes, assigned names and attributes (``self._ws = ...``)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if _private(n)}


def _private_reads(path: pathlib.Path, fxamp_private: Set[str]) -> List[str]:
    """``x._name`` where fxamp defines ``_name`` and neither the test file nor a module it imports from outside
    fxamp owns it (``planted._linear``, ``torch._dynamo``, a test's own cache class); ``from fxamp... import _name``."""
    tree = ast.parse(path.read_text(), str(path))
    foreign: Set[str] = set()  # names bound to modules and objects imported from outside fxamp
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                source = (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
                if source == "fxamp" or source.startswith("fxamp."):
                    if _private(alias.name):
                        found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                else:
                    foreign.add((alias.asname or alias.name).split(".")[0])
    names = fxamp_private - _defined_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in names:
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Call, ast.Subscript)):
                base = base.func if isinstance(base, ast.Call) else base.value
            if not (isinstance(base, ast.Name) and base.id in foreign):
                found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    return found


def test_no_test_reads_a_private_attribute_of_fxamp(tmp_path):
    """Tests go through what a user can reach: a private attribute (``opt._ws``, ``native._build``) is the
    code's to rename.  torch's own private names (``Tensor._version``, ``nn.Module._modules``) are not fxamp's."""
    import torch
    import torch.nn as nn

    fxamp_private: Set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        fxamp_private |= _defined_names(ast.parse(path.read_text(), str(path)))
    fxamp_private -= set(dir(torch.Tensor)) | set(dir(nn.Module)) | set(dir(torch.optim.Optimizer))
    name = sorted(fxamp_private)[0]
    planted = tmp_path / "test_planted.py"  # the scan sees a read, through a call, and a private import
    planted.write_text(f"import fxamp, torch\nfrom fxamp.training import {name}\nopt = fxamp.f()\n"
                       f"opt.a().{name}\ntorch.{name}\n")
    assert [r.split(" ", 1)[1] for r in _private_reads(planted, fxamp_private)] == [f"imports {name}", f"reads .{name}"]
    tests = PACKAGE.parent / "tests"
    found = [r for p in sorted(tests.rglob("*.py")) for r in _private_reads(p, fxamp_private)]
    assert not found, "tests read private attributes of fxamp:\n" + "\n".join(found)


def test_the_front_door_is_small_and_every_name_resolves():
    """At most 25 public names (what a user types); each of ``__all__`` is there, without a warning."""
    import warnings

    import fxamp

    assert len(fxamp.__all__) <= 25, sorted(fxamp.__all__)
    assert len(set(fxamp.__all__)) == len(fxamp.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [name for name in fxamp.__all__ if getattr(fxamp, name, None) is None]
    assert not missing, f"names in fxamp.__all__ that do not resolve: {missing}"
