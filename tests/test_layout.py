"""The package's layout stays a pipeline: no import cycles, and no import from a lower stage to a higher one.

Imports are read with ``ast`` from every module of ``fxamp``, those inside functions included
(an import hidden in a function is still a dependency).  ``STAGES`` is the order of
``docs/DESIGN.md``; a module missing from it counts as a top-level feature (it may import
anything below, and nothing below may import it).  The conversion's stage folders (``STAGE_FOLDERS``)
are one stage each, every module in them included.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
from typing import Dict, List, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxamp"

#: lower numbers are lower stages; a module may import only modules of its own stage or lower.
#: The top level holds the vocabulary both wings share; each wing has its own order inside.
STAGES: Dict[str, int] = {
    "errors": 0, "dtypes": 0,
    "policy": 1,
    "info": 2,  # ConversionInfo: what conversion leaves on a module and training reads
    # the conversion wing, top to bottom: its vocabulary, the stage folders, then the entry points
    "conversion": 3, "conversion.op_lists": 3,
    "conversion.graph": 4, "conversion.options": 4, "conversion.passes": 4, "conversion.calls": 4,
    "conversion.storage": 4,  # the storage predicted before any graph (lazy and in-place conversion share it)
    "conversion.bytecode": 4,  # what a parent module's code does with its children, read before any graph
    "conversion.runtime": 5,  # what generated code calls
    "conversion.capture": 6,
    "conversion.classify": 7,
    "conversion.rewrite": 8,
    "conversion.pipeline": 9, "conversion.lazy": 9, "conversion.blocks": 9, "conversion.families": 9,
    "conversion.none_patterns": 9,
    "conversion.convert": 10,
    # old paths a saved model may name, kept for one release: at the top, and nothing imports them
    "conversion.recompute": 10, "conversion.float8": 10, "conversion.debug": 10,
    # the training wing
    "training": 3, "training.distributed": 3, "training.config": 3,
    "training.ownership": 3, "training.quant": 3, "training.calibrate": 3, "training.checkpoint": 3, "training.sharded_checkpoint": 3,
    "training.grad_watch": 3,  # tells an in-place write (torch's clip) to gradients still scaled
    "training.plan": 3,  # the step's tensor lists (buckets, gradient segments, runs, the plan)
    "training.native": 3,  # the lean step's CPU kernel (built with the C compiler, called through ctypes)
    "training.flat": 3,  # the lean step's flat buffers of a run's masters, and the stochastic rounding's hash
    "training.executors": 4,  # what the engine calls: the stage and its check, the executors, the inner step
    "training.kernels": 5,  # compile_step's kernels and their executor (Compiled)
    "training.lean": 5,  # per-tensor masters and state: modes, terms, counts, calibration, checkpoint (between steps)
    "training.lean_step": 5,  # the lean step over it: what the engine's executors enter and leave, its executors
    "training.step": 6,  # the step engine: stage -> check -> execute -> record, and the scaler's state machine
    "training.loss_scale": 7,  # LossScaler: the machine's configuration, scale_loss, state_dict (a step runs none)
    "training.iteration": 7,  # the verbs outside the step: zero_grad, clip_grad_norm_
    "training.optimizer": 8,  # the facade: masters, state_dict, the public verbs
    "training.optimizer_view": 8,  # the facade's base: what torch expects of an Optimizer, the read-outs, pickling
}
WINGS = ("conversion", "training")
#: the conversion's stage folders, in the order a conversion runs through them (runtime/ first: what every
#: later stage, and the generated code, may call); each folder is one stage in ``STAGES``
STAGE_FOLDERS = ("conversion.runtime", "conversion.capture", "conversion.classify", "conversion.rewrite")
#: modules kept at an old path for one release (aliases of moved names): nothing in fxamp imports them
OLD_PATHS = ("conversion.recompute", "conversion.float8", "conversion.debug")
TOP = 11  # reporting/, integrations/, api and other features built on both wings
ENTRY = {"__init__": 14, "__main__": 14, "cli": 13, "cli_model": 13, "lightning": 13, "api": 12, "sharding": 12}


def _folder(module: str) -> str:
    """The stage folder ``module`` is in (the folder itself included), else ``module``."""
    return next((f for f in STAGE_FOLDERS if module == f or module.startswith(f + ".")), module)


def _stage(module: str) -> int:
    module = _folder(module)
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
    assert {"conversion.graph", "dtypes"} <= graph["conversion.classify.categories"]
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
              if _stage(n) > _stage(m)]
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
    """``import fxamp.reporting.build`` gives the module ``build.py``, for every module."""
    for module in sorted(_imports()):
        name = "fxamp" if module == "__init__" else f"fxamp.{module}"
        if module in ("integrations.lightning", "lightning"):
            pytest.importorskip("lightning")
        if module == "integrations.hf":
            pytest.importorskip("transformers")
        imported = importlib.import_module(name)
        assert imported.__name__ == name, (module, imported)


def _shadowed(package: str, root: pathlib.Path) -> List[str]:
    """``package.child`` names (under ``root``) where the package's attribute ``child`` is not the submodule ``child``
    (a function re-exported under its module's name hides the module: ``pkg.child`` is then the function)."""
    found = []
    for path in sorted(root.iterdir()):
        child = path.stem if path.suffix == ".py" else path.name if (path / "__init__.py").exists() else None
        if child is None or child == "__init__":
            continue
        module = importlib.import_module(f"{package}.{child}")
        if getattr(sys.modules[package], child, None) is not module:
            found.append(f"{package}.{child}")
    return found


def test_no_package_attribute_shadows_a_submodule(tmp_path, monkeypatch):
    """``fxamp.reporting.build`` is the module ``build.py``, for every package and submodule: a name a package
    re-exports may not be one of its modules' names (``importlib`` finds the module either way; an attribute
    reader, ``mock.patch("fxamp.reporting.build.x")`` or a reader of the docs, does not)."""
    planted = tmp_path / "planted_pkg"  # the check sees a function re-exported under its module's name
    planted.mkdir()
    (planted / "__init__.py").write_text("from .tool import tool\n")
    (planted / "tool.py").write_text("def tool():\n    pass\n")
    (planted / "other.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _shadowed("planted_pkg", planted) == ["planted_pkg.tool"]
    found = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = "fxamp" + "".join(f".{p}" for p in init.parent.relative_to(PACKAGE).parts)
        if package.startswith("fxamp.integrations"):
            continue  # they import their frameworks when imported
        found += _shadowed(package, init.parent)
    assert not found, f"package attributes that hide their submodule: {found}"


def test_the_stage_folders_import_only_downward():
    """runtime/ <- capture/ <- classify/ <- rewrite/: a stage folder imports no later one, and runtime/ (what generated
    code calls) imports nothing of the conversion but its vocabulary (graph, op_lists)."""
    order = {f: i for i, f in enumerate(STAGE_FOLDERS)}
    graph = _imports()
    upward = [f"{m} imports {n}" for m, targets in graph.items() if _folder(m) in order
              for n in sorted(targets) if _folder(n) in order and order[_folder(n)] > order[_folder(m)]]
    assert not upward, "a stage folder imports a later stage:\n" + "\n".join(upward)
    vocabulary = {"conversion.graph", "conversion.op_lists"}
    runtime = [f"{m} imports {n}" for m, targets in graph.items() if _folder(m) == "conversion.runtime"
               for n in sorted(targets) if _wing(n) == "conversion" and _folder(n) != "conversion.runtime"
               and n not in vocabulary]
    assert not runtime, "runtime/ imports above the conversion's vocabulary:\n" + "\n".join(runtime)


def test_the_pipeline_runs_every_pass_of_the_stage_folders_from_its_stage_in_order():
    """One list, ``pipeline.PASSES``: each pass defined in the folder of its stage (classify/, rewrite/), the
    stages in order, and every pass a stage folder defines is on it (none run aside, none special-cased)."""
    from fxamp.conversion.passes import Pass, Stage
    from fxamp.conversion.pipeline import PASSES

    stages = list(Stage)
    assert [p.stage for p in PASSES] == sorted((p.stage for p in PASSES), key=stages.index)
    for p in PASSES:
        assert _folder(p.run.__module__.removeprefix("fxamp.")) == f"conversion.{p.stage.value}", p
    defined = set()
    for module in _imports():
        if _folder(module) in ("conversion.classify", "conversion.rewrite"):
            found = vars(importlib.import_module(f"fxamp.{module}")).values()
            defined |= {id(v) for v in found if isinstance(v, Pass)}
    assert defined == {id(p) for p in PASSES} and len(PASSES) == len(set(map(id, PASSES)))


def test_nothing_in_fxamp_imports_an_old_path():
    """The aliases at old module paths are for saved models and old imports; the package imports the new ones."""
    importers = [f"{m} imports {n}" for m, targets in _imports().items() for n in sorted(targets) if n in OLD_PATHS]
    assert not importers, importers


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


def test_no_training_class_is_over_310_lines():
    """A training class is one job (the facade binds masters, keeps ``state_dict`` and offers the public verbs; what
    torch expects of an Optimizer is its base's, ``optimizer_view.py``): past ~300 lines it holds two."""
    long = {f"{p.relative_to(PACKAGE)}:{node.name}": n for p in (PACKAGE / "training").rglob("*.py")
            for node in ast.walk(ast.parse(p.read_text(), str(p))) if isinstance(node, ast.ClassDef)
            and (n := node.end_lineno - node.lineno + 1) > 310}
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
    ours: Set[str] = set()  # and from fxamp
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                source = (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
                if source == "fxamp" or source.startswith("fxamp."):
                    ours.add((alias.asname or alias.name).split(".")[0])
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
        # a write is a read's twin: ``native._loaded = ...`` on a module imported from fxamp, or a patch by name
        # (``monkeypatch.setattr(native, "_loaded", ...)``, ``setattr("fxamp.training.native._loaded", ...)``)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in ours):
            found.append(f"{path.name}:{node.lineno} writes .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("setattr", "delattr")):
            strings = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            patched = [w for text in strings for w in text.split(".") if w in fxamp_private]
            if patched:
                found.append(f"{path.name}:{node.lineno} patches .{patched[-1]}")
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
    planted.write_text(f"from fxamp.training import native\nnative.{name} = 1\nmonkeypatch.setattr(native, '{name}', 1)\n"
                       f"monkeypatch.setattr('fxamp.training.native.{name}', 1)\n")  # ... and a write, two patches
    assert [r.split(" ", 1)[1] for r in _private_reads(planted, fxamp_private)] == [f"writes .{name}"] + [
        f"patches .{name}"] * 2
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


# -- the step's files: traced ----------------------------------------------------------------------------------

#: the fxamp files one step runs code in (docs/DESIGN.md, "Training: one step engine"): the facade hands the step
#: to the engine (the scaler's state machine is its module's), which stages, checks and executes through the
#: executors' module, and nothing else: three files (after a scaled backward too: the engine compares the gradients'
#: versions with grad_watch's record itself); a lean
#: step adds the lean step and its state codes (``native`` too where fxamp's CPU kernel steps a master; not the
#: workspace's per-tensor state, ``lean.py``, past calibration),
#: ``torch.distributed`` ``distributed`` and ``compile_step`` ``kernels``
STEP_FILES = {"training/optimizer.py", "training/step.py", "training/executors.py"}
LEAN_STEP_FILES = STEP_FILES | {"training/lean_step.py", "training/quant.py", "training/flat.py"}


def _traced_step(inner, segmented=False, dtype="bfloat16", clip=False, **options):
    """The (caller, callee) fxamp files of every call ``opt.step()`` makes, at a model's third step."""
    import sys

    import torch
    import torch.nn as nn

    import fxamp
    from fxamp.training import plan

    torch.manual_seed(0)
    model = fxamp.convert(nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 4)),
                          "O2", dtype=getattr(torch, dtype))
    opt = fxamp.MixedPrecisionOptimizer(inner(model.parameters()), model=model, release_grad_buffer=segmented,
                                        **options)
    x = torch.randn(4, 16, dtype=getattr(torch, dtype))
    calls = []

    def tracer(frame, event, arg):
        callee = frame.f_code.co_filename
        if event == "call" and callee.startswith(str(PACKAGE)):
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            calls.append((caller.removeprefix(str(PACKAGE) + "/"), callee.removeprefix(str(PACKAGE) + "/")))

    for i in range(3):
        opt.zero_grad()
        opt.backward(model(x).float().sum())
        if clip:
            opt.clip_grad_norm_(1e-3)  # (a segmented step's clip factor joins its unscaling: the multiplier)
        if i == 2:
            sys.settrace(tracer)
            try:
                opt.step()
            finally:
                sys.settrace(None)
        else:
            opt.step()
    assert (opt.plan.runs is not None) == segmented
    return calls


STEPS = {
    "O2 AdamW": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), False, {}, STEP_FILES),
    "O2 SGD momentum": (lambda ps: __import__("torch").optim.SGD(ps, lr=1e-3, momentum=0.9), False, {}, STEP_FILES),
    "O2 AdamW segmented": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), True, {}, STEP_FILES),
    # float16 under a scale other than 1 (static: this model's loss overflows a dynamic scale's 65536), so a scaled
    # backward, whose gradients' versions the engine compares with grad_watch's record before they are unscaled
    # (the watch's code runs only to warn)
    "O2 float16 AdamW": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), False,
                         {"dtype": "float16", "loss_scale": "static:128"}, STEP_FILES),
    "O2 float16 AdamW segmented": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), True,
                                   {"dtype": "float16", "loss_scale": "static:128"}, STEP_FILES),
    # clipped: the executors multiply by 1/scale times the clip factor, a function made below the engine
    "O2 float16 AdamW segmented, clipped": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), True,
                                            {"dtype": "float16", "loss_scale": "static:128", "clip": True},
                                            STEP_FILES),
    "kahan AdamW": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), False, {"masters": "kahan"},
                    LEAN_STEP_FILES),
    "kahan AdamW segmented": (lambda ps: __import__("torch").optim.AdamW(ps, lr=1e-3), True, {"masters": "kahan"},
                              LEAN_STEP_FILES),
}


@pytest.mark.parametrize("case", list(STEPS))
def test_a_step_runs_code_in_the_files_the_design_names_and_the_engine_is_its_hub(case, monkeypatch):
    """``sys.settrace`` over ``opt.step()``: the fxamp files it runs code in are the facade, the engine and what the
    engine calls (``STEP_FILES``); the facade is entered once and hands over, and nothing below the engine calls
    back into it (no lambda from an executor or the plan into ``step.py``)."""
    inner, segmented, options, allowed = STEPS[case]
    if segmented:
        monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)  # (this model's gradients are small)
    calls = _traced_step(inner, segmented, **options)
    files = {callee for _, callee in calls}
    assert files <= allowed, f"{case}: a step now runs code in {sorted(files - allowed)} too"
    assert {"training/optimizer.py", "training/step.py", "training/executors.py"} <= files
    assert [callee for _, callee in calls].count("training/optimizer.py") == 1, calls  # the facade's step(), once
    into_engine = {caller for caller, callee in calls if callee == "training/step.py"}
    assert into_engine <= {"training/optimizer.py", "training/step.py"}, into_engine


def test_the_engine_holds_no_reference_back_to_its_facade():
    """The facade holds its engine, never the other way: a dropped optimizer (and its float32 masters) is freed at
    once, without waiting for the cycle collector."""
    import gc
    import weakref

    import torch
    import torch.nn as nn

    import fxamp

    model = fxamp.convert(nn.Linear(8, 8), "O2", dtype=torch.bfloat16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    opt.zero_grad()
    opt.backward(model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum())
    opt.step()
    dropped, master = weakref.ref(opt), weakref.ref(opt.master_pairs()[0][1])
    enabled = gc.isenabled()
    gc.disable()
    try:
        del opt
        assert dropped() is None and master() is None
    finally:
        if enabled:
            gc.enable()
