"""Which modules' own code reads ``self.training`` (:func:`mode_reader`): a model none of whose code
reads it computes the same graph in both modes, so ``modes.capture_modes`` captures it once.

Classes are read at the bytecode level (``co_names``), and, where a read may give the same result in
both modes on the instance, at the source level (``ast``); a read whose source cannot be read counts.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch.nn as nn

__all__ = ["mode_reader"]


#: torch.nn's layers whose reads of ``self.training`` a single capture handles: their dropout and
#: batch-norm flags are rewritten by :func:`make_modes_switchable`
_MODE_HANDLED_MODULES = ("torch.nn.modules.dropout", "torch.nn.modules.batchnorm")


def _reads_training(code: types.CodeType) -> bool:
    """Whether ``code`` (or a function nested in it) reads an attribute called ``training``."""
    if "training" in code.co_names or "training" in code.co_consts:  # .training, getattr(m, "training")
        return True
    return any(isinstance(c, types.CodeType) and _reads_training(c) for c in code.co_consts)


def _functions(value: Any) -> Iterator[Any]:
    """The functions of a function, method, property or staticmethod found in a class namespace,
    and the functions a decorator wrapped (``__wrapped__``)."""
    for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
        depth = 0
        while f is not None and depth < 8:
            if isinstance(getattr(f, "__code__", None), types.CodeType):
                yield f
            f, depth = getattr(f, "__wrapped__", None), depth + 1


def _codes(value: Any) -> Iterator[types.CodeType]:
    """The code objects of :func:`_functions`."""
    for f in _functions(value):
        yield f.__code__


def _runs_in_forward(name: str) -> bool:
    """Methods that may run in a forward: not ``train``/``eval`` (they set the flag), not set-up dunders."""
    return name not in ("train", "eval") and (not name.startswith("__") or name == "__call__")


#: what a class's code does with ``self.training``: nothing (False), something a capture cannot tell
#: (True), or only things that give the same result in both modes on an instance whose plain values
#: allow it, as checks: ``("pick", a, b)``: ``a if self.training else b`` (the Hugging Face attention
#: pattern ``0.0 if not self.training else self.attention_dropout``): the two values are equal;
#: ``("off", (e, ...))``: ``e and self.training`` (``getattr(self, "gradient_checkpointing", False) and
#: self.training``): one of the other operands is falsy.  Each value a constant, ``self.<attr>[.<attr>]``
#: or ``getattr(self, "<attr>", <constant>)``, read on the instance.
_Reads = Any  # bool or Tuple[Tuple[Any, ...], ...]


def _value_pairs(cls: type) -> _Reads:
    """The checks of ``cls``'s reads of ``self.training`` (see ``_Reads``), True when any read is
    something else (a branch, a flag passed on, a read whose source is not available)."""
    checks: List[Tuple[Any, ...]] = []
    for name, value in vars(cls).items():
        if not _runs_in_forward(name):
            continue
        for func in _functions(value):
            if not _reads_training(func.__code__):
                continue
            found = _checks_in(func)
            if found is None:
                return True
            checks.extend(found)
    return tuple(checks) if checks else False


def _checks_in(func: Any) -> Optional[List[Tuple[Any, ...]]]:
    found = _checks_of(func.__code__)  # (a wrapper's own, not __wrapped__'s)
    return None if found is None else list(found)


@functools.lru_cache(maxsize=512)
def _checks_of(code: types.CodeType) -> Optional[Tuple[Tuple[Any, ...], ...]]:
    # memoized by the code object (immutable; a redefined method has a new one): a class is read once, not at
    # every capture
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return None
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None or not fn.args.args or "training" in code.co_consts:  # getattr(m, "training")
        return None
    self_name = fn.args.args[0].arg
    parent = {id(child): node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    checks: List[Tuple[Any, ...]] = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Attribute) and node.attr == "training"):
            continue
        if not (isinstance(node.value, ast.Name) and node.value.id == self_name and isinstance(node.ctx, ast.Load)):
            return None
        test, negated = node, False
        up = parent.get(id(test))
        if isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.Not):
            test, negated, up = up, True, parent.get(id(up))
        if isinstance(up, ast.IfExp) and up.test is test and all(_plain(e, self_name) for e in (up.body, up.orelse)):
            checks.append(("pick", up.orelse, up.body) if negated else ("pick", up.body, up.orelse))
        elif isinstance(up, ast.BoolOp) and isinstance(up.op, ast.And):
            others = tuple(e for e in up.values if e is not test and _plain(e, self_name))
            if not others:
                return None
            checks.append(("off", others))
        else:
            return None
    return tuple(checks) or None  # (the bytecode reads it, the source shows no read: do not guess)


def _plain(expr: ast.expr, self_name: str) -> bool:
    """A constant, ``self.<attr>`` or ``getattr(self, "<attr>", <constant>)``: a value read without running code."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, (ast.USub, ast.UAdd)):
        expr = expr.operand
    if isinstance(expr, ast.Call):
        return (isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and not expr.keywords
                and len(expr.args) in (2, 3) and isinstance(expr.args[0], ast.Name) and expr.args[0].id == self_name
                and isinstance(expr.args[1], ast.Constant) and isinstance(expr.args[1].value, str)
                and all(isinstance(a, ast.Constant) for a in expr.args[2:]))
    return isinstance(expr, ast.Constant) or _attribute_chain(expr, self_name) is not None


def _attribute_chain(expr: ast.expr, self_name: str) -> Optional[List[str]]:
    """``["a", "b"]`` for ``self.a.b``, else None."""
    names: List[str] = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if names and isinstance(expr, ast.Name) and expr.id == self_name:
        return names[::-1]
    return None


_MISSING_VALUE = object()


def _value(m: nn.Module, expr: ast.expr) -> Any:
    if isinstance(expr, ast.Call):  # getattr(self, "name"[, default])
        default = expr.args[2].value if len(expr.args) == 3 else _MISSING_VALUE  # type: ignore[attr-defined]
        v = getattr(m, expr.args[1].value, default)  # type: ignore[attr-defined]
    elif isinstance(expr, ast.Attribute):  # self.a.b
        v = m
        for name in _chain_names(expr):
            v = getattr(v, name, _MISSING_VALUE)
    else:
        return ast.literal_eval(expr)
    return v if isinstance(v, (bool, int, float, type(None))) else _MISSING_VALUE


def _chain_names(expr: ast.expr) -> List[str]:
    names: List[str] = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    return names[::-1]


def _same_in_both_modes(m: nn.Module, checks: Tuple[Tuple[Any, ...], ...]) -> bool:
    """Whether every check holds on ``m`` (``attention_dropout`` 0.0: both picks 0.0; no gradient checkpointing)."""
    for check in checks:
        if check[0] == "pick":
            a, b = _value(m, check[1]), _value(m, check[2])
            if a is _MISSING_VALUE or b is _MISSING_VALUE or type(a) is not type(b) and not (
                    {type(a), type(b)} <= {int, float}) or a != b:
                return False
        elif not any(v is not _MISSING_VALUE and not v for v in (_value(m, e) for e in check[1])):
            return False
    return True


def mode_reader(model: nn.Module) -> Optional[str]:
    """The first module (``"path (Class)"``) whose own code reads ``training``, or None.

    torch.nn's dropout and batch-norm layers are left out (their flags are rewritten on any
    capture), as is ``nn.Module`` itself (``train()``/``eval()`` only set the flag).  Every other
    class in each module's MRO is read at the bytecode level, with the module's forward hooks:
    a model none of whose code reads the flag computes the same graph in both modes.  A read that
    that gives the same result in both modes on the instance (``0.0 if not self.training else
    self.attention_dropout`` with ``attention_dropout == 0.0``; ``self.gradient_checkpointing and
    self.training`` with checkpointing off) does not count.
    """
    seen: Dict[type, _Reads] = {}
    for path, m in model.named_modules():
        classes = [c for c in type(m).__mro__ if c not in (nn.Module, object)]
        if type(m).__module__ in _MODE_HANDLED_MODULES:
            classes = []
        for cls in classes:
            if cls not in seen:
                seen[cls] = _value_pairs(cls)
            reads = seen[cls]
            if reads is True or (reads and not _same_in_both_modes(m, reads)):
                return f"{path or '<root>'} ({type(m).__name__})"
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        if any(_reads_training(code) for h in hooks for code in _codes(h)):
            return f"{path or '<root>'} ({type(m).__name__}, a forward hook)"
    return None
