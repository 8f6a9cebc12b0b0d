"""Loading the command line's MODEL (``path/to/file.py:Name`` or ``package.module:Name``, optionally
``Name(key=literal, ...)``) and the two errors of :mod:`fxamp.cli`, which re-exports them.

Kept apart from ``cli`` so that each stays a readable size; it imports nothing of fxamp.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["UsageError", "ModelError", "load_model", "one_line"]


class UsageError(Exception):
    """The command line is wrong (exit code 2)."""


class ModelError(Exception):
    """The model could not be loaded, built, traced, converted or run (exit code 1)."""


def one_line(text: str) -> str:
    """``text`` on one line: the command line's errors are one line each."""
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def load_model(spec: str) -> Tuple[Any, str]:
    """Load ``path/to/file.py:Name`` or ``package.module:Name`` and return ``(module instance, Name)``.

    ``Name(key=literal, ...)`` builds a class or calls a function with keyword arguments (Python
    literals only, read with ``ast.literal_eval``).  ``sys.path`` is as it was afterwards.
    """
    import torch.nn as nn

    head, paren, rest = spec.partition("(")
    where, sep, name = head.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"MODEL {spec!r} must be path/to/file.py:Name or package.module:Name")
    call_kwargs = _parse_call(spec, name, paren + rest) if paren else None
    saved_path = list(sys.path)
    try:
        if where.endswith(".py") or "/" in where or os.sep in where:
            namespace = _load_file(where)
        else:
            namespace = _import(where)
        return _build(namespace, where, name, call_kwargs, nn.Module)
    finally:
        sys.path[:] = saved_path  # the model's directory (or the working directory) is on it only while loading


def _parse_call(spec: str, name: str, text: str) -> Dict[str, Any]:
    """``(d=64, act="gelu")`` → ``{"d": 64, "act": "gelu"}``: keyword arguments whose values are literals."""
    usage = (f"MODEL {spec!r}: arguments are written Name(key=value, ...) with Python literals as values, "
             f"e.g. {name}(d=64, act='gelu')")
    try:
        call = ast.parse(f"_{text}", mode="eval").body
    except SyntaxError:
        raise UsageError(usage) from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id != "_":
        raise UsageError(usage)
    if call.args or any(k.arg is None for k in call.keywords):
        raise UsageError(f"{usage} (keyword arguments only)")
    kwargs: Dict[str, Any] = {}
    for k in call.keywords:
        try:
            kwargs[k.arg] = ast.literal_eval(k.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise UsageError(f"{usage}; {k.arg}={ast.unparse(k.value)} is not a literal") from None
    return kwargs


def _build(namespace: Any, where: str, name: str, call_kwargs: Optional[Dict[str, Any]],
           module_type: type) -> Tuple[Any, str]:
    """``namespace.<name>``: a module instance, or the result of building the class or calling the function."""
    obj: Any = namespace
    for part in name.split("."):
        if not hasattr(obj, part):
            candidates = _candidates(namespace)
            hint = f"; it defines {', '.join(candidates)}" if candidates else ""
            raise ModelError(f"{where} has no attribute {name!r}{hint}")
        obj = getattr(obj, part)
    if isinstance(obj, module_type):
        if call_kwargs is not None:
            raise ModelError(f"{name} in {where} is a module instance, not a class or function: it takes no arguments")
        return obj, name
    if isinstance(obj, type) and issubclass(obj, module_type) or callable(obj) and not isinstance(obj, type):
        shown = f"{name}({', '.join(f'{k}={v!r}' for k, v in (call_kwargs or {}).items())})"
        try:
            built = obj(**(call_kwargs or {}))
        except Exception as e:
            hint = ("MODEL must build with no arguments: give them as Name(key=value, ...) or point at a function "
                    "that builds it" if call_kwargs is None else "check the arguments")
            raise ModelError(f"could not build {shown}: {type(e).__name__}: {one_line(str(e))}; {hint}") from e
        if not isinstance(built, module_type):
            raise ModelError(f"{shown} returned an object of type {type(built).__name__}, not an nn.Module")
        return built, name
    raise ModelError(f"{name!r} in {where} is an object of type {type(obj).__name__}, not an nn.Module subclass, a module instance "
                     f"or a function returning a module")


def _load_file(path: str) -> Any:
    if os.path.isdir(path):
        raise ModelError(f"{path!r} is a directory: MODEL is path/to/file.py:Name (a Python file in it) or "
                         f"package.module:Name (with the package's parent directory as the working directory)")
    if not os.path.isfile(path):
        raise ModelError(f"no such file: {path!r}")
    directory = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"_fxamp_model_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so dataclasses, pickling and torch.fx find the module
    sys.path.insert(0, directory)  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ModelError(f"error while running {path}: {type(e).__name__}: {one_line(str(e))}") from e
    finally:
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
    return module


def _import(name: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ModelError(f"no module named {e.name!r} (MODEL {name}:...; for a file, write path/to/file.py:Name)") from e
        raise ModelError(f"error while importing {name}: {type(e).__name__}: {one_line(str(e))}") from e
    except Exception as e:
        raise ModelError(f"error while importing {name}: {type(e).__name__}: {one_line(str(e))}") from e


def _candidates(namespace: Any) -> List[str]:
    import torch.nn as nn

    own = getattr(namespace, "__name__", None)
    found = []
    for key, value in vars(namespace).items():
        if key.startswith("_"):
            continue
        if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == own:
            found.append(key)
    return found[:10]
