"""What the front ends share: the :class:`Captured` result, the :class:`FrontEnd` protocol, and
finding the user's line in a traceback."""

from __future__ import annotations

import contextlib
import os
import sys
import types
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple, Type, Union

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import TraceError
from ..bytecode import codes_of, function_calls
from .carried_state import StateWatch, carried_candidates

__all__ = ["Captured", "FrontEnd", "LeafSpec", "UnsoundCapture", "user_frame", "user_line", "warn",
           "torchscript_error", "scripted_paths", "distributions_hint", "watched_trace"]

LeafSpec = Union[str, Type[nn.Module]]

_FXAMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class Captured:
    """A captured graph and how it was captured."""

    graph_module: fx.GraphModule
    frontend: str  # "fx" or "export"
    notes: List[str] = field(default_factory=list)  # what the front end decided, for the report
    only_mode: Optional[bool] = None  # the training mode the graph is right in when the modes differ; None: both
    fx_error: Optional[TraceError] = None  # torch.fx's error when torch.export ran as its fallback
    other_mode_error: Optional[BaseException] = None  # the other mode's capture failed with it (only_mode set)


class UnsoundCapture(TraceError):
    """The front end traced the model, but its graph would be wrong in any mode (forward wrote a buffer
    that torch.fx ran once at trace time): no capture of it may be kept, not even one mode's."""


class FrontEnd(Protocol):
    """One way of turning a module into a graph; ``fxamp.conversion.capture.capture`` drives it.

    The driver calls ``trace`` once per mode (``capture.modes.capture_in_both_modes``), turns any
    exception other than a ``TraceError`` into one with ``error``, then ``adopt`` (give the graph
    the original's module tree and names), makes the baked mode flags switchable, and ``finish``
    (the front end's last fix-ups; returns its notes).
    """

    name: str

    def lead_notes(self) -> List[str]: ...

    def trace(self) -> fx.GraphModule: ...

    def error(self, e: BaseException) -> TraceError: ...

    def adopt(self, gm: fx.GraphModule) -> None: ...

    def finish(self, gm: fx.GraphModule) -> List[str]: ...


def user_frame(e: BaseException, skip_torch_fx_only: bool = False) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame outside torch and fxamp (the user's line), or None.

    ``skip_torch_fx_only``: fall back to the innermost frame outside torch.fx and fxamp when no
    user frame exists (a failure inside torch.nn code is still worth naming).
    """
    frames = traceback.extract_tb(e.__traceback__)
    # (code fxamp or torch.fx generated and exec'd, "<string>", "<eval_with_key>.3", is nobody's line)
    outside = [f for f in frames if not f.filename.startswith((os.path.join(_TORCH_DIR, "fx"), _FXAMP_DIR,
                                                                 "<string>", "<eval_with_key>"))]
    user = [f for f in outside if not f.filename.startswith(_TORCH_DIR)]
    if user:
        return user[-1]
    if skip_torch_fx_only:
        return (outside or frames or [None])[-1]
    return None


def user_line(e: BaseException, short: bool = False) -> str:
    """``<file>:<line>: `<code>``` of :func:`user_frame` (torch.nn's line where no user frame exists), or "".
    ``short``: the file's name alone (a warning's line; an error names the whole path)."""
    frame = None if getattr(e, "raised_after_forward", False) else user_frame(e, skip_torch_fx_only=True)
    if frame is None:  # (an error raised after forward returned, fxamp's check of what it did, has no such line)
        return ""
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{os.path.basename(frame.filename) if short else frame.filename}:{frame.lineno}{code}"


def warn(message: str) -> None:
    """``warnings.warn`` pointing at the user's call (the first frame outside fxamp and contextlib, through which
    a ``with`` of fxamp's warns as it ends), prefixed ``fxamp:``."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(_FXAMP_DIR)
                                 or frame.f_code.co_filename == contextlib.__file__):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"fxamp: {message}", stacklevel=level)


_PLAIN = (bool, int, float, str, type(None))

#: a plain attribute forward changed while traced: (module path, name, before, after)
Written = Tuple[str, str, Any, Any]


def plain_attributes(model: nn.Module) -> Dict[Tuple[str, str], Any]:
    """Each module's own public attributes that hold plain Python values other than None, by (module path, name);
    ``training`` aside (captures switch it).  A library's private flags (``_hooks_installed``) and scratch values
    a forward fills in before reading them (None before the first call) are not state a graph drops."""
    return {(path, k): v for path, m in model.named_modules() for k, v in vars(m).items()
            if type(v) in _PLAIN and v is not None and k != "training" and not k.startswith("_")}


def changed_attributes(model: nn.Module, before: Dict[Tuple[str, str], Any]) -> List[Written]:
    """Those of :func:`plain_attributes` that tracing changed (a helper method's ``self.flag = ...`` too, which the
    source scan of forward cannot see).  Left as they are: torch.export puts them back itself, and a library may
    pair one with other state (hooks it installed)."""
    after = {key: vars(m).get(key[1]) for key, m in ((k, _module(model, k[0])) for k in before)}
    return [(path, name, old, after[(path, name)]) for (path, name), old in sorted(before.items())
            if type(after[(path, name)]) is not type(old) or after[(path, name)] != old]


@contextlib.contextmanager
def watched_trace(model: nn.Module, keeps_calls: bool = True, bakes_reads: bool = False) -> Iterator[List[str]]:
    """Around a trace of ``model``, what the graph cannot hold, found in the calls the trace makes
    (``sys.setprofile``, only for a model whose code names such a call): notes on each custom
    ``torch.autograd.Function`` whose forward ran (its ops are in the graph, its backward is not;
    :func:`function_calls`), and the refusals below.

    ``keeps_calls=False`` (torch.export, which runs forward on stand-in tensors and records their ops only): a tensor
    hook the model's code registers (``h.register_hook(fn)``) runs on a stand-in, so the graph has none, and the
    converted model's gradients would silently differ: the capture is refused.  (torch.fx fails on the call: a
    function is no graph argument; the in-place capture keeps it.)

    ``bakes_reads=True`` (torch.fx, which proxies parameters, not buffers): a buffer's value read in forward
    (``self.temperature.item()``, ``.tolist()``) runs at capture and the graph holds that number, so a later change
    of the buffer would silently not be seen: the capture is refused (the default front end then captures with
    torch.export, which keeps the read)."""
    # (every class of each module's MRO: a block's capture traces it as a subclass with a forward of its own)
    classes = {c for m in model.modules() for c in type(m).__mro__ if issubclass(c, nn.Module) and c is not nn.Module}
    calls = {cls.forward.__code__: (cls, where) for c in classes for cls, where in function_calls(c)
             if isinstance(getattr(cls.forward, "__code__", None), types.CodeType)}
    codes = {code for c in classes for code in codes_of(c, unwrap=True)}
    hooking = set() if keeps_calls else {code for code in codes if "register_hook" in code.co_names}
    reading = {code for code in codes if {"item", "tolist"} & set(code.co_names)} if bakes_reads else set()
    stored = carried_candidates(codes)
    watch = StateWatch(stored, codes) if stored else None  # (tensors forward keeps in attributes: carried_state.py)
    notes: List[str] = []
    if (not calls and not hooking and not reading and watch is None) or sys.getprofile() is not None:
        yield notes  # (nothing to watch, or a user's profiler, which is left be)
        return
    tensors = {id(t): name for name, t in model.named_buffers()} if reading else {}
    ran: Dict[type, str] = {}
    hooks: List[str] = []
    reads: List[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and frame.f_code in reading and getattr(arg, "__name__", None) in ("item", "tolist"):
            name = tensors.get(id(getattr(arg, "__self__", None)))
            if name is not None:
                reads.append(f"{name} (.{arg.__name__}() at {frame.f_code.co_filename}:{frame.f_lineno})")
        if event != "call":
            return
        if watch is not None:
            watch.see(frame)
        if frame.f_code in calls:
            cls, where = calls[frame.f_code]
            ran.setdefault(cls, where)
        elif frame.f_code is _REGISTER_HOOK and frame.f_back is not None and frame.f_back.f_code in hooking:
            hooks.append(f"{frame.f_back.f_code.co_filename}:{frame.f_back.f_lineno}")

    sys.setprofile(profile)
    try:
        yield notes
    finally:
        sys.setprofile(None)
    if reads:
        raise UnsoundCapture(
            f"forward reads the value of buffer {reads[0]}: torch.fx runs the read once, while tracing, and the "
            f"graph would hold that number, so a later change of the buffer would not be seen. Capture it with "
            f"torch.export, which keeps the read: pass example_inputs=(...), or leave frontend= at 'auto' (fxamp "
            f"then captures it at its first call)", short=f"forward reads the value of buffer {reads[0].split()[0]}")
    carried = watch.error() if watch is not None else None
    if carried is not None:
        raise carried
    if hooks:
        raise TraceError(
            f"forward registers a tensor hook ({hooks[0]}: `.register_hook(...)`), which torch.export cannot keep: "
            f"it records the ops of forward, not the hook, so the converted model's gradients would differ from "
            f"the model's (torch.fx cannot record a hook function either). Convert in place with fxamp.convert_ "
            f"(the block that registers it keeps the hook), or register the hook outside forward",
            short=f"a tensor hook registered at {hooks[0]}")
    # (only for a capture that stands: one refused above, or failed, is no converted module to warn about)
    for cls, where in ran.items():
        note = (f"the capture traced the forward of the custom autograd Function {cls.__name__} ({cls.__name__}"
                f".apply at {where}): the converted module's backward is autograd's of its ops, not "
                f"{cls.__name__}.backward, which is right only where that is their derivative (BLOOM's "
                f"GeLUFunction) and wrong where it is not (a straight-through estimator's gradient becomes "
                f"round's zero). To keep its backward, keep the module that calls it out of the capture: "
                f"frontend='fx' with leaf_modules=[its path], or, in place, blocks= globs that leave it out (it "
                f"then runs as written)")
        notes.append(note)
        warn(note)


#: the code torch runs for ``Tensor.register_hook`` (a Python method: a profiler sees its calls)
_REGISTER_HOOK = torch.Tensor.register_hook.__code__


def compiled_module(m: nn.Module) -> Optional[nn.Module]:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, or None (by name: torch._dynamo is not
    imported for the check)."""
    inner = getattr(m, "_orig_mod", None) if type(m).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, nn.Module) else None


def shallow_copy(model: nn.Module) -> nn.Module:
    """A module of ``model``'s class whose ``__dict__`` is a copy of its own (the same children, tensors and hook
    tables): ``copy.copy`` without ``__reduce_ex__``, which a parametrized module (``ParametrizedConv2d`` of
    torch.nn.utils.parametrizations.weight_norm) refuses ("Serialization of parametrized modules...")."""
    root = type(model).__new__(type(model))
    root.__dict__ = dict(model.__dict__)
    return root


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def written_read_error(model: nn.Module, trace: Any, gm: fx.GraphModule, written: Written,
                       log: List[Written]) -> Optional[TraceError]:
    """A capture that changed a plain attribute, captured again with the attribute at its new value: None when the
    two graphs are the same (a counter, ``self.calls += 1``: the graph drops the count, which the warning says),
    else the error refusing the first graph, which would run at every call as the first call did (RWKV's eval
    rescales its weights in place and sets ``layers_are_rescaled``: the graph rescaled again at every call).
    ``log`` is the front end's record of changes, which the second capture must not add to."""
    path, name, old, new = written
    owner, kept = _module(model, path), len(log)
    had = vars(owner).get(name)
    vars(owner)[name] = new
    try:
        again: Optional[str] = None if _structure(trace()) == _structure(gm) else ""
    except Exception as e:  # (TraceError or torch's own: the call at the new value does not even capture)
        again = f" (at {new!r}, capture fails: {getattr(e, 'short', '') or type(e).__name__})"
    finally:
        vars(owner)[name] = had
        del log[kept:]
    if again is None:
        return None
    where = f"{path}.{name}" if path else name
    return TraceError(
        f"{type(model).__name__}'s forward sets {where} ({old!r} -> {new!r}), and its graph depends on that value: "
        f"the graph captured at {where}={old!r} is not the one at {new!r}{again}, so the converted "
        f"module would run every call as the first one ran. What to do: convert the model in place "
        f"(fxamp.convert_), where the module that sets {name} runs as written, or keep that state outside forward",
        short=f"forward sets {where}, which its graph depends on", module_path=path)


def _structure(gm: fx.GraphModule) -> List[Tuple[str, str, str]]:
    """Each node's op, target and arguments (earlier nodes by position): equal for two captures of the same code."""
    index: Dict[fx.Node, int] = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a]}")  # type: ignore[arg-type,return-value]
        out.append((node.op, str(node.target), repr(args)))
    return out


def scripted_paths(model: nn.Module) -> List[str]:
    """Paths of the outermost TorchScript modules (``torch.jit.script``/``trace``) in ``model`` (``""``: the root)."""
    scripted = [path for path, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    return [p for p in scripted if not any(q != p and (not q or p.startswith(q + ".")) for q in scripted)]


def torchscript_error(model: nn.Module, why: Optional[str]) -> Optional[TraceError]:
    """The refusal of a model holding TorchScript modules (``torch.jit.script``): torch.export cannot capture them
    (it fails on their parameters, which TorchScript holds as plain tensors), torch.fx calls them whole."""
    scripted = scripted_paths(model)
    if not scripted:
        return None
    lead = f"{why}; " if why else ""
    where = ", ".join(repr(p) if p else "the model itself" for p in scripted[:4])
    return TraceError(
        f"{lead}torch.export cannot capture TorchScript modules ({where}{' and more' if len(scripted) > 4 else ''}). "
        f"Convert the eager module before torch.jit.script, or convert with frontend='fx', which calls a "
        f"TorchScript submodule whole, in float32 (module_overrides={{{scripted[0]!r}: 'safe'}} runs it in the "
        f"low dtype)", short=f"TorchScript module {scripted[0] or 'at the root'}", module_path=scripted[0])


def distributions_hint(e: BaseException) -> str:
    """The fix when the data-dependent branch is torch.distributions' argument validation (a policy's
    ``Categorical(logits=...)``, a mixture's ``Normal(mu, sigma)``: a check of the values against the
    distribution's support), or ''."""
    tb = e.__traceback__
    while tb is not None:
        if "torch/distributions/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return ("What to do: the branch is torch.distributions' check of its arguments' values "
                    "(validate_args), which no graph can hold: build the distribution with validate_args=False in "
                    "forward, or call torch.distributions.Distribution.set_default_validate_args(False) before "
                    "converting (the checks are off for every distribution then).")
        tb = tb.tb_next
    return ""
