"""What a converted ``GraphModule`` is at run time: its class, which keeps conversion's set-up through deepcopy
and pickling, and the call that names the node an error came from."""

from __future__ import annotations

import copy
import re
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch.fx as fx

from ...errors import FxampError
from ...info import INFO_ATTR, hold_origins, origins_for_copy, watch_for_masters
from ..graph import MODULE, decision_of, keep_loaded_float32
from .held_values import BOUND, HELD, bind, check_values

__all__ = ["NodeErrors", "name_failing_nodes", "optional_inputs_given_none", "optional_inputs", "none_pattern", "hooked_inline_module", "indexing_message", "ConvertedGraphModule", "as_converted"]


_NODE_LINE = re.compile(r"\s*(\w+)\s*=")  # the generated forward assigns each node's value to its name


class NodeErrors:
    """How a converted ``GraphModule`` is called (its ``_wrapped_call``, which ``GraphModule.__call__``
    looks up on the instance): as before, but an error raised by one of its nodes keeps torch's own
    message, followed by the node's name and op, instead of torch.fx printing the generated code
    and its traceback to stderr first.  Holds nothing: it pickles and deep-copies as it is.
    """

    def __call__(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        hooked = hooked_inline_module(gm)
        if hooked is not None:
            raise FxampError(_hook_message(*hooked))
        check_values(gm, gm.__dict__.get(BOUND, ()))  # a plain value the graph holds, set to another since?
        try:
            # the class's __call__ resolved at each call (torch.fx's tracer patches nn.Module.__call__)
            return super(type(gm), gm).__call__(*args, **kwargs)
        except FxampError:
            raise  # fxamp's own errors (debug_overflow="raise") name their node already
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "eval_with_key" in f.filename]
            if not frames or getattr(e, "fxamp_node", None) is not None:
                raise  # not from this module's generated code, or an inner converted module named its node
            given = optional_inputs_given_none(gm, args, kwargs)
            if given:
                raise FxampError(_none_message(gm, given, e)) from e
            match = _NODE_LINE.match(frames[-1].line or "")
            name = match.group(1) if match else None
            node = next((n for n in gm.graph.nodes if n.name == name), None)
            if node is None:
                raise
            e.fxamp_node = node.name  # type: ignore[attr-defined]
            d = decision_of(node)
            where = f" ({d.op}{f' in module {d.module!r}' if d.module else ''})" if d is not None else ""
            said = f"[raised by the converted module's node {node.name!r}{where}]"
            if len(e.args) == 1 and isinstance(e.args[0], str) and not isinstance(e, KeyError):
                e.args = (f"{e.args[0]} {said}",)
            else:
                e.add_note(said)
            if "eval_with_key" in traceback.extract_tb(e.__traceback__)[-1].filename:
                raise e.with_traceback(None) from None  # raised by the generated line itself: nothing below it
            raise


def indexing_message(module: Any, index: Any) -> str:
    """Why ``amp[0]`` (a converted ``nn.Sequential``'s child, say) is not offered, and what to write instead."""
    name = type(module.__dict__.get("_fxamp_root", module)).__name__  # a LazyConverted: its original's class
    return (f"a converted {name} cannot be indexed ([{index!r}]): it runs its children inside its "
            f"graph, and a child called alone would run unconverted (under O2/O3 on its low-precision weights). "
            f"Index the original model (O0/O1 share its modules), read a child with amp.get_submodule('0'), or "
            f"convert the part you want: fxamp.convert(model[:-1], ...)")


#: ``gm.__dict__`` key: ((path, module), ...) of the modules torch.fx capture inlined (``graph.MODULE``), and
#: their hook dicts, found once
_INLINED = "_fxamp_inlined_modules"
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked_inline_module(gm: fx.GraphModule) -> Optional[Tuple[str, Any]]:
    """(path, module) of a module the graph runs inline that got a hook after capture, which would never run.

    torch.fx inlines Linear/conv/embedding calls (``graph.MODULE``) of modules with no hooks; torch.export
    inlines every module, the hooks it found at capture traced in.  Runs at every call: one sum over those
    modules' hook dicts (registering a hook adds to its dict), against the count when first checked."""
    found = gm.__dict__.get(_INLINED)
    if found is None:
        paths = list(dict.fromkeys(n.meta[MODULE][0] for n in gm.graph.nodes if MODULE in n.meta))
        if getattr(getattr(gm, INFO_ATTR, None), "frontend", None) == "export":
            paths = [p for p, _ in gm.named_modules() if p and not p.split(".")[0].startswith("_fxamp")]
        modules = []
        for path in paths:
            try:
                modules.append((path, gm.get_submodule(path)))
            except AttributeError:  # a module the tree no longer has: nothing to hook
                pass
        dicts = tuple(getattr(m, d) for _, m in modules for d in _HOOK_DICTS)
        counts = tuple(tuple(len(getattr(m, d)) for d in _HOOK_DICTS) for _, m in modules)
        found = gm.__dict__[_INLINED] = (tuple(modules), dicts, sum(map(len, dicts)), counts)
    modules, dicts, total, counts = found
    if sum(map(len, dicts)) <= total:
        return None
    return next(((path, m) for (path, m), before in zip(modules, counts)
                 if any(len(getattr(m, d)) > n for d, n in zip(_HOOK_DICTS, before))), None)


def _hook_message(path: str, m: Any) -> str:
    return (f"a hook was registered on {path!r} ({type(m).__name__}) after fxamp.convert, but the converted graph runs "
            f"its op inline (on cast weights), so the hook would never run: register hooks before converting "
            f"(torch.fx keeps a module that has hooks whole; torch.export traces them in), or remove it "
            f"(handle.remove()) to call this module")


def optional_inputs_given_none(gm: fx.GraphModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[str]:
    """The inputs of ``gm`` whose default is None, which the graph computes with, and which this call leaves None.

    torch.fx traces every argument as a value: ``if labels is not None:`` takes the given branch, so the
    graph has no path for None (a torch.export capture of a None input uses it nowhere)."""
    return list(none_pattern(optional_inputs(gm), args, kwargs))


def optional_inputs(gm: fx.GraphModule) -> Tuple[Tuple[int, str], ...]:
    """(position, name) of each input of ``gm`` (a torch.fx capture) whose default is None and which the graph
    computes with: the inputs whose None takes another path through forward (``labels=None``).  None
    if forward takes ``*args`` (positions do not name the inputs).  An input a graph traced as None is read
    only by its check (torch.fx's ``_assert_is_none``): None takes no other path there."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if any(str(p.target).startswith("*") for p in placeholders):
        return ()
    return tuple((i, str(p.target)) for i, p in enumerate(placeholders) if p.args and p.args[0] is None and
                 any(getattr(u.target, "__name__", None) != "_assert_is_none" for u in p.users))


def none_pattern(optional: Tuple[Tuple[int, str], ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[str, ...]:
    """The names among ``optional`` (:func:`optional_inputs`) that this call leaves None, given as None or not
    given: the key of the torch.fx graph that takes the call (runs at every call: no signature binding)."""
    n = len(args)
    return tuple(name for i, name in optional if (args[i] if i < n else kwargs.get(name)) is None)


def _none_message(gm: fx.GraphModule, names: List[str], e: BaseException) -> str:
    listed = ", ".join(f"{n}=None" for n in names)
    first = names[0]
    said = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return (f"this converted {type(gm).__name__} was captured by torch.fx, which traces every argument as a value "
            f"(`if {first} is not None:` took the branch where it is given), and this call has {listed}: the graph "
            f"has no path for None (it failed: {type(e).__name__}: {said}). Pass {first}, or convert with "
            f"frontend='export' (fxamp then captures each call signature, {first} given or not, at its first call)")


def name_failing_nodes(gm: fx.GraphModule) -> None:
    """Make ``gm``'s run-time errors name their node (:class:`NodeErrors`), through deepcopy (and, for a
    :class:`ConvertedGraphModule`, pickling).  A copy keeps the call it had (a subclass: ``lazy.RangeFallback``)."""
    call = gm.__dict__.get("_wrapped_call")
    gm._wrapped_call = call if isinstance(call, NodeErrors) else NodeErrors()
    gm.meta.setdefault("_user_preserved_attributes", {})["_wrapped_call"] = gm._wrapped_call
    hooked_inline_module(gm)  # counts the hooks there now, the capture's: one registered later is refused
    # the plain values the capture read, on this module's own submodules (a copy's: its own): a change is refused
    gm.__dict__[BOUND] = bind(gm, gm.__dict__.get(HELD, ()))


def _rearm(gm: fx.GraphModule) -> None:
    """What a copy of a converted module needs again: its node-naming call and its first-gradient check
    (tensor hooks are not copied with the tensors; see :func:`fxamp.info.watch_for_masters`)."""
    name_failing_nodes(gm)
    watch_for_masters(gm.parameters())


_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called")


class ConvertedGraphModule(fx.GraphModule):
    """The class of a converted module captured by torch.fx: a ``GraphModule`` whose copies keep what
    conversion set up on it.

    ``GraphModule`` rebuilds a plain ``GraphModule`` from its generated code when unpickled (the
    node-naming call, a class attribute there, is lost) and neither deepcopy nor pickling copies
    tensor hooks (the check that warns when no ``MixedPrecisionOptimizer`` keeps masters).  Both are
    set up again on the copy.  Under O2/O3 a copy also takes its low-precision parameters' float32 values
    along (the originals, or the masters' values at the time of the copy, a Kahan pair's included:
    ``fxamp.info.origins_for_copy``), which a ``MixedPrecisionOptimizer`` built on the copy takes as its
    masters, as it does on the module itself.  (A module captured by torch.export gets a class that is both
    this and torch's own: :func:`as_converted`.)
    """

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(indexing_message(self, index))

    def __reduce__(self) -> Any:
        rebuild, args = super().__reduce__()
        return (_unpickle_converted, (rebuild, args, origins_for_copy(self.parameters())))

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        keep_loaded_float32(self, state_dict, prefix)  # a float32 value loaded is kept for the master
        super()._load_from_state_dict(state_dict, prefix, *args)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ConvertedGraphModule":
        pairs = origins_for_copy(self.parameters())
        copied = super().__deepcopy__(memo)
        # GraphModule's deepcopy keeps its state_dict hooks only: a torch.export module's input checks (torch's,
        # and fxamp's that binds inputs by name and refuses sizes outside the captured range) are forward
        # pre-hooks, and a copy without them would run any size silently on the graph of another
        for attr in _FORWARD_HOOKS:
            if self.__dict__.get(attr):
                copied.__dict__[attr] = copy.deepcopy(self.__dict__[attr], memo)
        for attr in ("range_constraints", "validate_inputs"):  # what torch's input check reads (shared: read-only)
            if attr in self.__dict__:
                copied.__dict__[attr] = self.__dict__[attr]
        hold_origins(copy.deepcopy(pairs, memo))  # (the parameters are in memo: the pairs name the copy's)
        _rearm(copied)
        return copied


def as_converted(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a :class:`ConvertedGraphModule` (same attributes, same graph).  torch.export's module (a
    subclass of ``GraphModule`` with its input checks) becomes one of a class that is both, so that its deep
    copies keep what conversion set up too (it does not pickle, as torch's own does not)."""
    if isinstance(gm, ConvertedGraphModule):
        return gm
    # the class GraphModule.__new__ made this instance's own class from (GraphModuleImpl) is the one to extend
    base = type(gm).__mro__[1]
    cls = ConvertedGraphModule if base is fx.GraphModule else type(
        base.__name__, (ConvertedGraphModule, base), {"__module__": __name__, "__doc__": ConvertedGraphModule.__doc__})
    converted = cls.__new__(cls)
    vars(converted).update(vars(gm))
    converted.graph = gm.graph  # the graph's owner, and the generated forward on the new class
    type(converted).__name__ = type(gm).__name__
    return converted


def _unpickle_converted(rebuild: Any, args: Tuple[Any, ...], origins: Tuple[Any, ...] = ()) -> ConvertedGraphModule:
    plain = rebuild(*args)
    converted = as_converted(plain)
    call = args[0].get("_wrapped_call") if args and isinstance(args[0], dict) else None
    if isinstance(call, NodeErrors):  # torch.fx's rebuild keeps its class's call: a subclass's (none_patterns.py) is ours
        converted.__dict__["_wrapped_call"] = call
    hold_origins(origins)  # (one pickle: its low tensors are the unpickled module's parameters)
    _rearm(converted)
    return converted
