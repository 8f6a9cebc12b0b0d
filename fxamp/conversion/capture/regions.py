"""What ``forward`` means beyond its ops, which a capture could drop without a word.

Both front ends run ``forward`` once (per mode) on stand-in values and record the tensor ops.
What is not a tensor op is not recorded by itself:

- ``with torch.no_grad():`` / ``torch.enable_grad()`` / ``torch.set_grad_enabled(...)`` /
  ``torch.inference_mode()`` and ``with torch.autocast(...):`` regions.  torch.export keeps them as
  higher-order-op regions (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``); torch.fx records
  nothing of them, so the fx front end refuses a model that has one (:func:`fx_region_error`) and
  ``capture``/``convert`` go to torch.export (from the example inputs, or at the first call);
- ``torch.utils.checkpoint.checkpoint(block, ...)``: both front ends trace through it.  The nodes
  the checkpointed callable made are marked (``meta[CHECKPOINT]``, one region per call, by
  :func:`mark_checkpoints`), and after the rewrite ``conversion/checkpointing.py`` runs each
  region as a checkpointed call of the rewritten block; a call whose block cannot be told apart
  (or ``checkpoint_sequential``) is noted and warned with its line as traced through;
- hooks on the root: no capture runs them; ``convert`` registers them on the converted module
  (``hooks.copy_root_hooks``);
- Python state changed in ``forward`` (``self.calls += 1``, a cache on ``self``) and ``print``:
  they run once, at capture; each is noted with its line (:func:`python_state_notes`).

Findings come from each module's ``forward`` source (``inspect`` + ``ast``); regions and
checkpoint calls count only when a captured node's stack trace passes through them (a branch
that did not run at capture is not a finding).
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import re
import sys
import sysconfig
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import TraceError
from .common import compiled_module, warn

__all__ = ["Finding", "CallInfo", "scan", "confirmed", "frames_of", "fx_region_error", "region_note",
           "region_state", "unreadable_region", "traced_region_error",
           "python_state_notes", "region_notes", "capture_notes", "mark_checkpoints",
           "traced_through_note", "CheckpointMark", "CHECKPOINT", "CHECKPOINT_CALLS"]

_GRAD = {"no_grad", "enable_grad", "set_grad_enabled", "inference_mode"}
_AUTOCAST = {"autocast"}
#: the names a checkpoint call goes by (``torch.utils.checkpoint.checkpoint``, ``checkpoint_sequential``)
CHECKPOINT_CALLS = {"checkpoint", "checkpoint_sequential"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
#: ``node.meta[CHECKPOINT]``: the :class:`CheckpointMark` of a node the checkpointed callable made
CHECKPOINT = "fxamp_checkpoint"
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


@dataclass(frozen=True)
class CallInfo:
    """What a ``checkpoint(...)`` call's source says: the callable, its arguments, its keywords."""

    name: str  # "checkpoint" or "checkpoint_sequential"
    callee: str  # the first argument as written ("self.block", "layer"), "" if not a plain name
    simple_args: bool  # the other arguments are names or constants: nothing is computed on the line
    kwargs: Tuple[Tuple[str, object], ...]  # keywords with literal values (use_reentrant=False, ...)
    opaque: Tuple[str, ...]  # keywords whose value is not a literal (context_fn=...)


@dataclass(frozen=True)
class CheckpointMark:
    """One checkpointed call: its region number, where it is written, the keywords to call checkpoint with."""

    region: int
    where: str  # region_note() of the call
    kwargs: Tuple[Tuple[str, object], ...]


@dataclass(frozen=True)
class Finding:
    """One construct in a ``forward``'s source: what, where (file, first and last line), the code."""

    kind: str  # "grad", "autocast", "checkpoint", "state", "print"
    file: str
    line: int
    end: int
    code: str  # the source line, stripped
    owner: str  # the class whose forward holds it
    body: Tuple[int, int] = (0, 0)  # a region's body lines; a call's own line range otherwise
    call: Optional[CallInfo] = None  # a checkpoint call's arguments

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _dotted(expr: ast.AST) -> str:
    if isinstance(expr, ast.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr}"
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Call):
        return _dotted(expr.func)
    return ""


def _self_attr(target: ast.AST, self_name: str) -> Optional[str]:
    """``attr`` when ``target`` writes ``self.attr`` (or an item of it), else None."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == self_name:
        return target.attr
    return None


def _scan_class(cls: type) -> List[Finding]:
    fwd = getattr(cls, "forward", None)
    try:
        return list(_scan_forward(fwd, cls.__name__))
    except TypeError:  # (a forward that cannot be a key: not memoized)
        return list(_scan_forward.__wrapped__(fwd, cls.__name__))


@functools.lru_cache(maxsize=512)
def _scan_forward(fwd: object, owner: str) -> Tuple[Finding, ...]:
    # memoized by the function (a forward redefined, in a notebook cell say, is a new one): a model's classes are
    # scanned once, not at every capture; the findings are frozen
    try:
        file = inspect.getsourcefile(fwd)
        lines, start = inspect.getsourcelines(fwd)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return ()  # no source (a builtin, a REPL class): nothing to scan
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        return ()
    return tuple(_scan_function(func, os.path.abspath(file or ""), lines, start - 1, owner, state=True))


def _scan_function(func: ast.AST, file: str, lines: Sequence[str], off: int, owner: str, *,
                   state: bool) -> List[Finding]:
    """The findings in one function's source: ``lines`` holds it, its line ``n`` is the file's ``n + off``.

    state: also ``self.<attr> = ...`` and ``print`` (a module's ``forward``; not a helper function,
    whose ``self`` may be anything).
    """
    self_name = func.args.args[0].arg if func.args.args else "self"
    out: List[Finding] = []

    def add(kind: str, node: ast.AST, body: Tuple[int, int], call: Optional[CallInfo] = None) -> None:
        line = node.lineno + off
        code = lines[node.lineno - 1].strip() if node.lineno - 1 < len(lines) else ""
        out.append(Finding(kind, file, line, (getattr(node, "end_lineno", None) or node.lineno) + off, code,
                           owner, (body[0] + off, body[1] + off), call))

    for dec in func.decorator_list:  # @torch.no_grad() on forward: the whole body is the region
        name = _dotted(dec).rsplit(".", 1)[-1]
        if name in _GRAD | _AUTOCAST:
            add("grad" if name in _GRAD else "autocast", dec, (func.body[0].lineno, func.end_lineno or 0))
    for node in ast.walk(func):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                name = _dotted(item.context_expr).rsplit(".", 1)[-1]
                if name in _GRAD | _AUTOCAST:
                    add("grad" if name in _GRAD else "autocast", node,
                        (node.body[0].lineno, node.end_lineno or node.lineno))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.rsplit(".", 1)[-1] in CHECKPOINT_CALLS:
                add("checkpoint", node, (node.lineno, node.end_lineno or node.lineno), _call_info(node, name))
            elif name == "print" and state:
                add("print", node, (node.lineno, node.lineno))
            elif state and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
                    and _self_attr(node.func.value, self_name) is not None:  # self.count.add_(1): in place
                add("state:" + _self_attr(node.func.value, self_name), node, (node.lineno, node.lineno))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and state:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                attr = _self_attr(t, self_name)
                if attr is not None:
                    add("state:" + attr, node, (node.lineno, node.end_lineno or node.lineno))
    return out


#: frames in these folders are torch's and fxamp's own, not the model's
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _functions_in(file: str) -> Tuple[ast.AST, ...]:
    """Every function defined in ``file`` (its source from ``linecache``: files, and notebook cells)."""
    return _functions_of("".join(linecache.getlines(file)))


@functools.lru_cache(maxsize=64)
def _functions_of(source: str) -> Tuple[ast.AST, ...]:
    # memoized by the text: a model's file (a Hugging Face modeling file: thousands of lines) is parsed once, not at
    # every capture; the trees are only read
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _called_functions(graphs: Sequence[fx.Graph], known: Iterable[Finding]) -> List[Finding]:
    """Regions and checkpoint calls in the functions a captured node's stack passes through that are
    not a module's ``forward`` (helpers called from ``forward``, a ``forward`` calling a method):
    the source scan of ``forward`` alone does not see them."""
    seen = {(f.file, f.line, f.kind) for f in known}
    live = _live_frames()
    places = {(file, line) for g in graphs for n in g.nodes for file, line in frames_of(n, live)
              if not file.startswith(_LIBRARY_DIRS) and not file.startswith(_OWN_DIR)}
    functions: Dict[Tuple[str, int], ast.AST] = {}
    parsed: Dict[str, Tuple[ast.AST, ...]] = {}
    for file, line in places:
        if file not in parsed:
            parsed[file] = _functions_in(file)
        around = [f for f in parsed[file] if f.lineno <= line <= (f.end_lineno or f.lineno)]
        if around:
            innermost = max(around, key=lambda f: f.lineno)
            functions[(file, innermost.lineno)] = innermost
    out: List[Finding] = []
    for (file, _), func in sorted(functions.items(), key=lambda kv: kv[0]):
        for f in _scan_function(func, file, linecache.getlines(file), 0, f"{func.name}()", state=False):
            if (f.file, f.line, f.kind) not in seen:
                seen.add((f.file, f.line, f.kind))
                out.append(f)
    return out


def _simple(expr: ast.AST) -> bool:
    """A name, a constant or an attribute of a name: evaluating it makes no graph node."""
    if isinstance(expr, ast.Starred):
        expr = expr.value
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, (ast.Name, ast.Constant))


def _call_info(node: ast.Call, name: str) -> CallInfo:
    callee = _dotted(node.args[0]) if node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)) else ""
    kwargs, opaque = [], []
    for kw in node.keywords:
        try:
            kwargs.append((kw.arg, ast.literal_eval(kw.value)))
        except (ValueError, TypeError, SyntaxError):
            opaque.append(kw.arg or "**")
    return CallInfo(name.rsplit(".", 1)[-1], callee, all(_simple(a) for a in node.args[1:]), tuple(kwargs),
                    tuple(opaque))


def scan(model: nn.Module, skip: Sequence[str] = (), graphs: Sequence[fx.Graph] = ()
         ) -> List[Tuple[str, Optional[nn.Module], Finding]]:
    """Every finding in the ``forward`` of ``model`` and its submodules outside torch, with the module's path.

    skip: module paths not traced into (leaf modules): they and their children are not scanned.
    graphs: captured graphs; the functions their nodes' stack traces pass through are scanned too
    (grad-mode and autocast regions, checkpoint calls), with path "" and module None.
    """
    found: List[Tuple[str, nn.Module, Finding]] = []
    cache: Dict[type, List[Finding]] = {}
    for path, m in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip if s):
            continue
        cls = type(m)
        if cls.__module__.startswith("torch.") or cls.__module__.startswith("fxamp."):
            continue
        if cls not in cache:
            cache[cls] = _scan_class(cls)
        found.extend((path, m, f) for f in cache[cls])
    if graphs:
        found.extend(("", None, f) for f in _called_functions(graphs, [f for _, _, f in found]))
    return found


def frames_of(node: fx.Node, live: Optional[set] = None) -> List[Tuple[str, int]]:
    """The (file, line) frames of a node's recorded stack trace, outermost first, from the captured code on:
    the frames still live around the capture (the caller's loop, a parent's ``checkpoint(layer, x)`` around
    a block captured at its first call, a ``no_grad`` around ``convert``) are not the model's code."""
    frames = [(_abspath(f), int(n)) for f, n in _FRAME.findall(node.meta.get("stack_trace") or "")]
    live = _live_frames() if live is None else live  # (a caller walking many nodes passes it once)
    start = 0
    while start < len(frames) and frames[start] in live:
        start += 1
    return frames[start:]


@functools.lru_cache(maxsize=4096)
def _abspath(file: str) -> str:
    return os.path.abspath(file)


def _live_frames() -> set:
    frame, out = sys._getframe(1), set()
    while frame is not None:
        out.add((_abspath(frame.f_code.co_filename), frame.f_lineno))
        frame = frame.f_back
    return out


def _inside(frames: List[Tuple[str, int]], f: Finding) -> bool:
    """Whether a node with these frames was made inside the finding's body (a deeper call counts)."""
    for i, (file, line) in enumerate(frames):
        if file != f.file:
            continue
        if f.kind == "checkpoint":
            if f.line <= line <= f.end and i < len(frames) - 1:  # made by the checkpointed callable
                return True
        elif f.body[0] <= line <= f.body[1]:
            return True
    return False


def confirmed(findings: Iterable[Tuple[str, nn.Module, Finding]], graphs: Sequence[fx.Graph]
              ) -> List[Tuple[str, nn.Module, Finding]]:
    """The findings some captured node was made inside (the branch ran at capture)."""
    live = _live_frames()
    frames = [frames_of(n, live) for g in graphs for n in g.nodes]
    return [x for x in findings if any(_inside(fr, x[2]) for fr in frames)]


def region_note(path: str, f: Finding) -> str:
    return f"`{f.code}` at {f.where} ({f.owner}{' at ' + repr(path) if path else ''})"


def fx_region_error(model: nn.Module, path: str, f: Finding) -> TraceError:
    """torch.fx records nothing of a grad-mode or autocast region: refuse, naming the line and the fix."""
    what = ("a grad-mode region (its parameters would be trained)" if f.kind == "grad" else
            "an autocast region (a float32 island would run in low precision)")
    short = f"`{f.code}` at {f.where} is not recorded by torch.fx"
    return TraceError(
        f"torch.fx cannot keep {what}: {region_note(path, f)}. What to do: use frontend='auto' (the default) or "
        f"'export', with or without example_inputs=(...): torch.export then captures the model (at the first "
        f"call when no inputs are given) and keeps the region", short=short, module_path=path)


def region_state() -> Tuple[bool, bool, int]:
    """(grad enabled, inference mode, autocast nesting level): what entering a grad-mode or autocast region
    changes, read while forward runs.  It needs no source, so it also sees regions in a class made by
    ``exec``, generated code or a notebook fed from a pipe, which :func:`scan` cannot read.  The nesting
    level counts every ``torch.autocast`` block, ``enabled=False`` ones too (the state they set may be
    the state already there).  Reading it takes one increment and one decrement of that level."""
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), level - 1


#: torch's own code that changes the grad mode around what it runs: an autograd Function's forward (a
#: reentrant ``checkpoint``, a user's custom Function) runs under no_grad; that is no region of the model's
_GRAD_CHANGING_FILES = (os.path.join("torch", "autograd", "function.py"), _CHECKPOINT_FILE)


def unreadable_region(start: Tuple[bool, bool, int], outermost: types.CodeType) -> Optional[str]:
    """``"grad"`` or ``"autocast"`` when forward now runs inside such a region entered since ``start``
    (:func:`region_state` when the trace began) that the source scan cannot have seen: some frame of
    the model's code on the stack, below the ``outermost`` code (the tracer's ``trace``), has no source
    to read.  None otherwise: no region, a region in code whose source :func:`scan` reads (it is found
    there, with its line), or torch's own grad mode around an autograd Function's forward."""
    now = region_state()
    kind = "grad" if now[:2] != start[:2] else "autocast" if now[2] != start[2] else None
    if kind is None:
        return None
    unreadable = False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not outermost:
        name = frame.f_code.co_filename
        file = _abspath(name)
        if file.endswith(_GRAD_CHANGING_FILES):
            return None
        if not file.startswith(_LIBRARY_DIRS) and not file.startswith(_OWN_DIR) and not linecache.getlines(name):
            unreadable = True
        frame = frame.f_back
    return kind if unreadable else None


def traced_region_error(model: nn.Module, node: fx.Node, kind: str) -> TraceError:
    """torch.fx made ``node`` inside a grad-mode or autocast region (``kind``) that the source scan did not
    see, its source being unreadable: refuse, naming the module whose forward ran it and the fix."""
    what = ("a grad-mode region (no_grad, inference_mode: its parameters would be trained)" if kind == "grad"
            else "an autocast region (enabled=False too: a float32 island would run in low precision)")
    paths = [p for p in _module_paths(node) if p]
    if node.op == "call_module" and paths and paths[-1] == node.target:
        paths.pop()  # a leaf module's call: the region is in the forward that called it
    path = paths[-1] if paths else ""
    owner = dict(model.named_modules()).get(path, model)
    frames = [f for f in frames_of(node) if not f[0].startswith(_LIBRARY_DIRS) and not f[0].startswith(_OWN_DIR)]
    where = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    return TraceError(
        f"torch.fx cannot keep {what}: op {node.name!r}{where} in the forward of {type(owner).__name__} "
        f"({'at ' + repr(path) if path else 'the root'}) ran inside one, in code whose source cannot be read "
        f"(a class made by exec, generated code). What to do: use frontend='auto' (the default) or 'export', "
        f"with or without example_inputs=(...): torch.export then captures the model (at the first call when "
        f"no inputs are given) and keeps the region",
        short=f"op {node.name!r} ran inside {what.split(' (')[0]}, which torch.fx does not record",
        module_path=path)


def python_state_notes(found: Iterable[Tuple[str, nn.Module, Finding]], frontend: str) -> List[str]:
    """One note per ``self.<attr> = ...`` (not a parameter, buffer or submodule) and ``print`` in forward."""
    notes = []
    for path, m, f in found:
        if f.kind.startswith("state:"):
            attr = f.kind.split(":", 1)[1]
            value = getattr(m, attr, None)
            if isinstance(value, (torch.Tensor, nn.Module)):
                continue  # a buffer, parameter or submodule: a tensor update is an op, captured as such
            notes.append(f"forward sets self.{attr} at {region_note(path, f)}: it ran once, at capture "
                         f"({frontend}); the converted module does not run it. Keep that state outside "
                         f"the model's forward, or keep the module opaque (leaf_modules=)")
        elif f.kind == "print":
            notes.append(f"forward calls print at {region_note(path, f)}: it ran at capture ({frontend}), "
                         f"not at each call of the converted module")
    for note in notes:
        warn(note)
    return notes


def written_notes(written: Iterable[Tuple[str, str, Any, Any]], noted: Sequence[str], frontend: str) -> List[str]:
    """One note (and warning) per plain attribute forward changed while traced that the source scan did not note
    (set in a method forward calls: RWKV's ``_rescale_layers`` sets ``layers_are_rescaled``): the graph runs as if
    it still held its old value."""
    notes = []
    for path, name, old, new in written:
        if any(f"forward sets self.{name} at" in n and (not path or path in n) for n in noted):
            continue  # (the scan named its line)
        where = f"{path}.{name}" if path else name
        notes.append(f"forward sets {where} ({old!r} -> {new!r}) in code it calls: it ran once, at capture "
                     f"({frontend}); the converted module does not run it, so every call runs as "
                     f"if {where} were still {old!r}. Keep that state outside the model's forward, or convert the "
                     f"model in place (fxamp.convert_), where the module that sets it runs as written")
    for note in notes:
        warn(note)
    return notes


def region_notes(model: nn.Module, gm: fx.GraphModule, subgraphs: Sequence[nn.Module]) -> List[str]:
    """torch.export's higher-order-op regions, one note each: which line, and how it runs converted."""
    hops = sorted({str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if not hops:
        return []
    graphs = [gm.graph] + [m.graph for m in subgraphs if isinstance(m, fx.GraphModule)]
    found = [x for x in confirmed(scan(model, graphs=graphs), graphs) if x[2].kind in ("grad", "autocast")]
    notes = []
    for path, _, f in found:
        if f.kind == "grad":
            how = "runs in its grad mode (nothing under torch.no_grad() is trained)"
        elif re.search(r"enabled\s*=\s*False", f.code):
            how = "a float32 island: runs with autocast off"
        else:
            how = ("runs under torch.autocast as written: fxamp's casts stop at its boundary and autocast "
                   "picks the dtypes inside")
        notes.append(f"region {region_note(path, f)} kept ({', '.join(hops)}): {how}; its float inputs are "
                     f"cast to float32 at the region boundary")
    if not notes:  # a region the source scan does not see (a helper function's, a library's)
        notes.append("higher-order op regions (" + ", ".join(hops) + ") kept: each runs as written, its float "
                     "inputs cast to float32 at the region boundary")
    return notes


def traced_through_note(where: str, frontend: str, why: str) -> str:
    """The note (and warning text) for a checkpoint call whose block runs without checkpointing."""
    return (f"activation checkpointing at {where} was traced through ({frontend}): the converted block's "
            f"activations are saved for backward ({why}). What to do: convert the checkpointed block "
            f"separately and checkpoint the converted block")


def _module_paths(node: fx.Node) -> List[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) for v in stack.values() if isinstance(v, tuple) and v]


def _call_frame(frames: List[Tuple[str, int]], f: Finding) -> Optional[int]:
    """The index of the frame on the call's lines that called deeper, or None."""
    for i, (file, line) in enumerate(frames[:-1]):
        if file == f.file and f.line <= line <= f.end:
            return i
    return None


def _callee_path(path: str, m: Optional[nn.Module], callee: str) -> Optional[str]:
    """The module path of ``self.a.b`` (the checkpointed callable) when it is a submodule, else None."""
    parts = callee.split(".")
    if m is None or len(parts) < 2 or parts[0] != "self":
        return None
    value: object = m
    for part in parts[1:]:
        value = getattr(value, part, None)
    if not isinstance(value, nn.Module):
        return None
    return ".".join(p for p in [path, *parts[1:]] if p)


def mark_checkpoints(found: Iterable[Tuple[str, nn.Module, Finding]], gm: fx.GraphModule, frontend: str,
                     first_region: int = 0) -> List[str]:
    """Mark the nodes each ``checkpoint(...)`` call's callable made (``meta[CHECKPOINT]``); notes for the rest.

    A node is the callable's when its stack trace passes through the call's line and goes deeper:
    through ``torch/utils/checkpoint.py`` (the fx front end records every frame), inside the
    callable's module (``self.block``: its ``nn_module_stack``), or anywhere deeper when the other
    arguments compute nothing (``checkpoint(layer, h)``).  Consecutive nodes of one call are one
    region; a loop's calls of different modules are one region each.
    """
    notes: List[str] = []
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    region = first_region
    for path, m, f in found:
        where = region_note(path, f)
        info = f.call
        if info is None or info.name != "checkpoint" or info.opaque:
            why = ("checkpoint_sequential is not kept" if info is not None and info.name != "checkpoint" else
                   f"its keyword(s) {', '.join(info.opaque)} are not literals fxamp can pass on" if info else "")
            notes.append(traced_through_note(where, frontend, why or "its call could not be read"))
            continue
        target = _callee_path(path, m, info.callee)
        kwargs = dict(info.kwargs)
        kwargs.setdefault("use_reentrant", False)
        runs: List[List[fx.Node]] = []
        open_run, run_key = False, None
        ambiguous = False
        live = _live_frames()
        for node in ops:
            frames = frames_of(node, live)
            i = _call_frame(frames, f)
            if i is None:
                if node.meta.get("stack_trace"):
                    open_run = False  # an op of the model between two calls: the next call is a new region
                continue
            deeper = frames[i + 1:]
            if any(file.endswith(_CHECKPOINT_FILE) for file, _ in deeper):
                inside = deeper[0][0].endswith(_CHECKPOINT_FILE)
            elif target is not None:
                inside = target in _module_paths(node)
            elif info.simple_args:
                inside = True
            else:
                ambiguous = True
                break
            if not inside:
                open_run = False
                continue
            below = [p for p in _module_paths(node) if p and not (path == p or path.startswith(p + "."))]
            top = target or (below[0] if below else None)
            if not open_run or (top and run_key and top != run_key):  # a loop's next call: another module
                runs.append([])
                open_run, run_key = True, top
            elif run_key is None:
                run_key = top
            runs[-1].append(node)
        if ambiguous or not runs:
            notes.append(traced_through_note(
                where, frontend, "its block's ops could not be told apart from those computing its arguments: "
                "pass the arguments as plain names" if ambiguous else "no op of its block was captured"))
            continue
        for run in runs:
            for node in run:
                node.meta[CHECKPOINT] = CheckpointMark(region, where, tuple(kwargs.items()))
            region += 1
    return notes


def capture_notes(model: nn.Module, gm: fx.GraphModule, frontend: str, skip: Sequence[str] = ()) -> List[str]:
    """Notes (and warnings) for what ran once at capture (Python state, ``print``); checkpoint calls marked.

    A checkpoint call whose block cannot be marked is noted and warned here; the marked ones are
    kept or noted after the rewrite (``conversion/checkpointing.py``).
    """
    graphs = [gm.graph] + [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]
    found = scan(model, skip, graphs)
    notes = python_state_notes(found, frontend)
    calls = confirmed([x for x in found if x[2].kind == "checkpoint"], graphs)
    for note in mark_checkpoints(calls, gm, frontend):
        notes.append(note)
        warn(note)
    framework = framework_checkpointing_note(model, frontend)
    if framework is not None:
        notes.append(framework)
        warn(framework)
    compiled = [repr(p) if p else "the model" for p, m in model.named_modules() if compiled_module(m) is not None]
    if compiled:  # (a speed the user asked for, dropped: say so)
        note = (f"torch.compile's wrapper on {', '.join(compiled[:3])}{' and more' if len(compiled) > 3 else ''} was "
                f"traced through ({frontend}): the converted module runs that code uncompiled. Compile the converted "
                f"module instead (torch.compile(amp)), or convert in place (fxamp.convert_), which keeps a compiled "
                f"layer compiled")
        notes.append(note)
        warn(note)
    return notes


def _checkpoints_when_flagged(module: nn.Module, root: bool) -> bool:
    """Whether a module's ``gradient_checkpointing`` flag makes a capture trace through a checkpoint: a layer
    that checkpoints around its own forward (Hugging Face's ``GradientCheckpointingLayer``, whose subclasses
    keep it: a block converted in place is one, so as the captured root it is not traced through), or a
    forward that calls the
    framework's checkpoint function on its children. Other flagged modules (T5's attention reads the
    flag for its position bias) do not checkpoint."""
    if any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__):
        return not root
    try:
        return "_gradient_checkpointing_func" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True  # no source: assume it does


def framework_checkpointing_note(model: nn.Module, frontend: str) -> Optional[str]:
    """The note for checkpointing switched on by a framework flag (Hugging Face's
    ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing = True`` on the model and its
    layers, whose ``__call__`` then checkpoints through a ``functools.partial``): the source scan
    sees no ``checkpoint(...)`` call, and the capture traces through it."""
    on = [name for name, m in model.named_modules()
          if getattr(m, "gradient_checkpointing", None) is True and _checkpoints_when_flagged(m, root=not name)]
    if not on:
        return None
    layers = [n for n in on if not any(o != n and o.startswith(n + ".") for o in on)] or on
    return (f"gradient checkpointing is on ({len(layers)} module(s) with gradient_checkpointing=True, e.g. "
            f"{layers[0]!r}) and was traced through ({frontend}): the converted model saves every layer's "
            f"activations for backward. What to do: checkpoint blocks with torch.utils.checkpoint.checkpoint "
            f"in forward (fxamp keeps those calls), or train this model unconverted under torch.autocast")
