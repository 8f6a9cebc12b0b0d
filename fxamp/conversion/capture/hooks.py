"""Module hooks a capture would drop, and the refusal that names them.

A hook is Python around a module's call: its tensor math can be traced, its side effects (appending an
activation to a list, counting calls, logging, a backward hook's gradient record) cannot.  What each
front end does with a hook registered before the capture:

- the root's hooks: neither front end captures them (torch.fx traces ``forward``, not the call; torch.export
  runs a copy of the root without them, :func:`without_hooks`); ``convert`` registers them on the module it
  returns (:func:`copy_root_hooks`), outside any capture or input check, so they run once per call;
- a submodule's hooks: torch.fx keeps the module as a call (:func:`has_own_hooks`, its tracer's leaf
  rule), so they run at every call; torch.export would trace them in, their side effects run once, at
  capture: :func:`traced_hooks_error` refuses the capture instead; torch.fx with a call's values (``concrete.py``)
  computes each call's value by making it, which runs the hooks: :func:`hooks_run_by_values_error` refuses too;
- global hooks (``torch.nn.modules.module.register_module_forward_hook`` ...): both front ends trace
  through modules, which would run them once: refused too.

Hooks torch installs that are pure tensor math on the module's own tensors (``torch.nn.utils.weight_norm``/
``spectral_norm``'s pre-hooks) trace in faithfully, and transformers' output-capturing hooks act within the
model's own call: neither is counted.  (``torch.nn.utils.parametrize`` and accelerate's ``_hf_hook`` register no
module hook; fxamp's ``_BindInputs`` is on a converted module, which is never captured again.)
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import torch.nn as nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ...errors import TraceError

__all__ = ["has_own_hooks", "submodule_hooks", "global_hooks", "traced_hooks_error", "hooks_run_by_values_error",
           "without_hooks", "copy_root_hooks", "root_hooks_note", "user_hooks", "HOOK_TABLES", "HOOK_DICTS"]

#: (attribute of an nn.Module holding the hooks, what the error calls them)
_KINDS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
#: the same hooks registered for every module (torch.nn.modules.module's globals)
_GLOBAL = (("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
           ("_global_forward_hooks", "register_module_forward_hook"),
           ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
           ("_global_backward_hooks", "register_module_full_backward_hook"))
#: a module's four tables of forward / backward hooks: registering any module hook adds to one of them
HOOK_DICTS = tuple(attr for attr, _ in _KINDS)
#: those tables and their flags (what :func:`without_hooks` empties)
HOOK_TABLES = HOOK_DICTS + ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                            "_forward_hooks_always_called")
_PURE = (WeightNorm, SpectralNorm)  # recompute the weight from its parts (torch.export: weight norm's only)
#: libraries whose hooks belong to the model's own forward: transformers' output-capturing hooks (installed at a
#: call with output_attentions/output_hidden_states) record into a collector that call's forward returns, and
#: do nothing outside one; a capture of the model keeps what they record as outputs
_LIBRARIES = ("transformers.",)


def _expected(hook: Any) -> bool:
    return isinstance(hook, _PURE) or str(getattr(hook, "__module__", None) or "").startswith(_LIBRARIES)


def _kinds(m: nn.Module) -> List[str]:
    return [kind for attr, kind in _KINDS if any(not _expected(h) for h in getattr(m, attr, {}).values())]


def has_own_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has a hook of its own (not a pure one) that tracing through it would run only once."""
    return bool(_kinds(m))


def submodule_hooks(model: nn.Module) -> List[Tuple[str, List[str]]]:
    """(path, kinds) of each submodule of ``model`` (not the root) with hooks of its own."""
    found = ((path, _kinds(m)) for path, m in model.named_modules() if path)
    return [(path, kinds) for path, kinds in found if kinds]


def global_hooks() -> List[str]:
    """The registration functions of the global module hooks registered now."""
    g = nn.modules.module
    return [f"torch.nn.modules.module.{name}" for attr, name in _GLOBAL if getattr(g, attr)]


def traced_hooks_error(model: nn.Module, frontend: str, why: Optional[str] = None) -> Optional[TraceError]:
    """The refusal of a capture by ``frontend`` that would trace hooks in (run them once), or None."""
    found = global_hooks()
    if found:
        return TraceError(
            f"{', '.join(found)} registered a global module hook: {frontend} traces through modules, so it would "
            f"run once, at capture, never at a call of the converted module. Remove it (handle.remove()) while "
            f"converting: registered again after, it runs around the converted module and the modules it calls",
            short="a global module hook is registered")
    if frontend != "torch.export":
        return None
    lead = f"{why}; " if why else ""
    legacy = [path for path, m in model.named_modules()
              if path and any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values())]
    if legacy:  # (torch.fx and convert_ keep the layer as a call: its hook runs at every call, as written)
        return TraceError(
            f"{lead}torch.export cannot keep the legacy torch.nn.utils.spectral_norm on {legacy[0]!r}"
            f"{f' and {len(legacy) - 1} more' if len(legacy) > 1 else ''}: its hook updates weight_u and weight_v in "
            f"place at a training call and reads the layer's mode, which the graph drops (an eval call computed "
            f"another weight, unconverted too). Use its replacement, torch.nn.utils.parametrizations.spectral_norm, "
            f"or convert with frontend='fx' or in place (fxamp.convert_), which keep the layer as a call",
            short=f"legacy spectral_norm on {legacy[0]!r}", module_path=legacy[0])
    hooked = submodule_hooks(model)
    if not hooked:
        return None
    listed = ", ".join(f"{path!r} ({', '.join(kinds)})" for path, kinds in hooked[:4])
    more = f" and {len(hooked) - 4} more" if len(hooked) > 4 else ""
    return TraceError(
        f"{lead}torch.export would trace the hooks on {listed}{more} into the graph: their tensor math would stay, "
        f"their Python side effects (a list appended to, a count, a log, a gradient record) would run once, at "
        f"capture, never at a call. Remove them before converting and register them on the converted model's "
        f"root, or convert with frontend='fx' (it keeps a hooked module as a call), or convert in place "
        f"with fxamp.convert_ (a block only torch.export could capture runs as written, its hooks included)",
        short=f"hooks on {hooked[0][0]!r} ({', '.join(hooked[0][1])})", module_path=hooked[0][0])


def hooks_run_by_values_error(model: nn.Module) -> Optional[TraceError]:
    """The refusal of a trace that runs ``model`` on a call's values (``concrete.py``) while a submodule has hooks of
    its own, or None.  The trace keeps the module as a call, but computes its value by calling it: its hooks would
    run once more, at capture, a side effect the user's code never made.  (The block then runs as written.)"""
    hooked = submodule_hooks(model)
    if not hooked:
        return None
    path, kinds = hooked[0]
    return TraceError(
        f"torch.fx with the call's values would run the hooks on {path!r} ({', '.join(kinds)}) once more, at "
        f"capture, to compute the values the trace branches on", short=f"hooks on {path!r} ({', '.join(kinds)})",
        module_path=path)


def without_hooks(root: nn.Module) -> nn.Module:
    """Give ``root`` (a copy whose ``__dict__`` is its own, never the user's module) empty hook tables: what
    captures it runs no hook of the original's, and a hook registered on or removed from the original later
    does not reach it.  Returns ``root``."""
    for table in HOOK_TABLES:
        if table in root.__dict__:
            root.__dict__[table] = OrderedDict()
    return root


def copy_root_hooks(model: nn.Module, module: nn.Module) -> None:
    """Register ``model``'s forward / backward hooks on ``module``, the converted module: no capture ran them
    (see the module docstring).  Pre-hooks go ahead of ``module``'s own (torch.export's input binding and
    checks), in their order, so they see and rewrite the call's arguments as on the original; forward hooks
    after its own.  They are the user's callables; they now receive ``module``."""
    for hook_id, hook in reversed(list(model._forward_pre_hooks.items())):  # each prepended: the first ends up first
        module.register_forward_pre_hook(hook, prepend=True,
                                         with_kwargs=hook_id in model._forward_pre_hooks_with_kwargs)
    for hook_id, hook in model._forward_hooks.items():
        module.register_forward_hook(hook, with_kwargs=hook_id in model._forward_hooks_with_kwargs,
                                     always_call=hook_id in model._forward_hooks_always_called)
    for hook in model._backward_pre_hooks.values():
        module.register_full_backward_pre_hook(hook)
    for hook in model._backward_hooks.values():
        module.register_full_backward_hook(hook)


def root_hooks_note(model: nn.Module) -> List[str]:
    """The note of :func:`copy_root_hooks`: how many, how they run, and what the user's handles still do."""
    count = sum(len(getattr(model, attr)) for attr, _ in _KINDS)
    if not count:
        return []
    return [f"{count} hook(s) registered on the root {type(model).__name__} are registered on the converted "
            f"module too: they run around the converted forward, once per call, and receive the converted module. "
            f"A handle from the original's register_*_hook removes the hook from the original only: the converted "
            f"module keeps calling it (remove it before converting, or register it on the converted module)"]


def user_hooks(model: nn.Module) -> List[Any]:
    """The forward / backward hooks of ``model``'s modules that are the user's objects, not the model's: a copy
    of the model must call these very objects (a counter's method, a recorder), not copies whose side effects
    nobody sees.  A module, a module's method, or a ``functools.partial`` over either or with a module among
    its arguments belongs to the model: a copy calls its own copy of it."""
    def owned_by_model(hook: Any) -> bool:
        if isinstance(hook, functools.partial):
            return owned_by_model(hook.func) or any(isinstance(a, nn.Module)
                                                    for a in (*hook.args, *hook.keywords.values()))
        return isinstance(hook, nn.Module) or isinstance(getattr(hook, "__self__", None), nn.Module)

    return [hook for m in model.modules() for attr, _ in _KINDS for hook in getattr(m, attr).values()
            if not owned_by_model(hook)]
