"""Capture: turn an ``nn.Module`` into a ``torch.fx.GraphModule`` the later stages can classify.

:func:`capture` is the only entry point.  It picks a front end (``fx.py``: ``torch.fx`` symbolic
tracing, no inputs needed; ``export.py``: ``torch.export``, from example inputs), captures in
both training and eval mode (``modes.py``), has the front end give the graph the original's module
tree and names, and makes the mode flags the capture baked in switchable again::

    capture(model)
      ├─ front end: FxFrontEnd, or ExportFrontEnd (forced, or when fx fails and inputs were given)
      ├─ modes.capture_modes(model, front.trace)            # once if no code reads self.training,
      │                                                     # else both modes: two graphs, keep one
      ├─ front.adopt(gm)                                     # original module tree, names
      ├─ modes.make_modes_switchable(gm, mode)               # dropout / batch-norm flags
      └─ front.finish(gm)                                    # front-end fix-ups, notes

Both front ends return a graph whose module tree, parameters and buffers are the original
model's, under the same names, so ``state_dict`` keys never change.  Neither captures the root's own
hooks (``hooks.py``): ``convert`` registers them on the module it returns.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union  # noqa: F401

import torch.fx as fx
import torch.nn as nn

from ...errors import TraceError
from ...info import conversion_info
from ..options import Dynamic
from ..runtime.held_values import hold
from .plain_reads import held_values
from .carried_state import undo_proxies
from .common import (Captured, FrontEnd, LeafSpec, shallow_copy, torchscript_error, watched_trace,
                     written_read_error)
from .concrete import ConcreteFxFrontEnd
from .export import ExportFrontEnd
from .fx import FxFrontEnd, identity_test_error
from .hooks import copy_root_hooks, root_hooks_note, traced_hooks_error, user_hooks, without_hooks
from .modes import OTHER_MODE_FAILED, capture_modes, make_modes_switchable, training_mode
from .regions import capture_notes, written_notes

__all__ = ["Captured", "LeafSpec", "capture", "capture_with_values", "training_mode", "traced_hooks_error",
           "torchscript_error", "copy_root_hooks", "root_hooks_note", "shallow_copy", "user_hooks", "without_hooks"]

FRONTENDS = ("auto", "fx", "export")


def capture(
    model: nn.Module,
    *,
    frontend: str = "auto",
    leaf_modules: Sequence[LeafSpec] = (),
    example_inputs: Optional[Tuple[Any, ...]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    dynamic: Dynamic = Dynamic.BATCH,
    dynamic_shapes: Any = None,
    fx_error: Optional[TraceError] = None,
    graph_per_mode: bool = False,
    at_call: bool = False,
    none_inputs: Sequence[str] = (),
) -> Captured:
    """Capture ``model`` as a graph.

    frontend: ``"fx"`` (symbolic tracing, no inputs needed), ``"export"`` (``torch.export``, needs
    example inputs) or ``"auto"``: fx first, export when fx fails and example inputs were given.
    fx_error: with ``"export"``: torch.fx's error when the caller already knows it fails (fxamp's
    lazily capturing module); notes and errors then read as for ``"auto"``'s fallback.
    graph_per_mode: the caller keeps a graph per mode when the two modes capture different graphs
    (``Captured.only_mode``): no warning then, and the note says so.
    at_call: the example inputs are a call's (fxamp's lazily capturing module): errors name the call's
    arguments, not ``example_kwargs``.
    none_inputs: torch.fx only: forward's inputs to trace as None (``labels=None``), every other one as a
    value (``if labels is not None:`` then takes the branch where labels are not given).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxamp converts nn.Module instances, not {type(model).__name__}")
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend={frontend!r} is not one of {', '.join(map(repr, FRONTENDS))}")
    if conversion_info(model) is not None:
        raise ValueError("this module was already converted by fxamp; convert the original model instead")
    has_inputs = example_inputs is not None or example_kwargs is not None

    def export(fallback_from: Optional[TraceError]) -> Captured:
        captured = _run(model, ExportFrontEnd(model, example_inputs, example_kwargs, dynamic=dynamic,
                                              dynamic_shapes=dynamic_shapes,
                                              leaf_modules=leaf_modules, fallback_from=fallback_from,
                                              at_call=at_call),
                        graph_per_mode=graph_per_mode)
        captured.fx_error = fallback_from
        return captured

    if frontend == "export":
        return export(fx_error)
    try:
        refused = identity_test_error(model)
        if refused is not None:
            raise refused
        captured = _run(model, FxFrontEnd(model, leaf_modules, none_inputs), graph_per_mode=graph_per_mode)
    except TraceError as e:
        if frontend == "auto" and has_inputs:
            return export(e)
        raise
    failed = captured.other_mode_error
    if frontend == "auto" and has_inputs and isinstance(failed, TraceError):
        # torch.fx takes one mode only (a buffer written in training mode: a VQ-VAE's codebook); its other mode
        # would be captured by torch.fx again at its first call, and fail again: torch.export may take both
        try:
            return export(failed)
        except TraceError:
            pass
    return captured


def capture_with_values(model: nn.Module, values: Sequence[Any]) -> Captured:
    """Capture ``model`` with torch.fx while running it on ``values`` (one per input of its forward):
    shapes may be unpacked and branched on, the branches guarded (``concrete.py``; for blocks)."""
    if conversion_info(model) is not None:
        raise ValueError("this module was already converted by fxamp; convert the original model instead")
    return _run(model, ConcreteFxFrontEnd(model, values), graph_per_mode=True)


def _run(model: nn.Module, front: FrontEnd, graph_per_mode: bool = False) -> Captured:
    traced_functions: List[str] = []

    def trace() -> fx.GraphModule:
        log = getattr(front, "written", [])
        seen = len(log)
        # (undo_proxies: a proxy or fake tensor the trace left in an attribute is put back, refused or not; around
        # written_read_error's second trace too, which writes the same attributes)
        with undo_proxies(model):
            with watched_trace(model, keeps_calls=front.name != "export", bakes_reads=front.name == "fx") as notes:
                gm = front.trace()
            traced_functions.extend(n for n in notes if n not in traced_functions)
            for written in log[seen:]:
                error = written_read_error(model, front.trace, gm, written, log)
                if error is not None:  # (refused: the user's model keeps the values it had)
                    for path, name, old, _ in log[seen:]:
                        vars(model.get_submodule(path))[name] = old
                    raise error
        return gm

    try:
        gm, mode, mode_notes, only_mode = capture_modes(model, trace, graph_per_mode=graph_per_mode)
    except TraceError:
        raise
    except Exception as e:  # torch.export raises many types; all mean "could not capture"
        raise front.error(e) from e
    other_mode_error = gm.meta.pop(OTHER_MODE_FAILED, None)  # (not kept in the graph: pickling would carry it)
    front.adopt(gm)
    mode_notes += make_modes_switchable(gm, mode)
    finish_notes = front.finish(gm)
    finish_notes += capture_notes(model, gm, front.name, getattr(front, "opaque", ()))
    finish_notes += written_notes(getattr(front, "written", ()), finish_notes, front.name) + traced_functions
    # the numbers and flags forward read, now constants of the graph: each call checks they still hold (not those
    # forward wrote: the graph read them before and after the write, and the written notes say so)
    hold(gm, held_values(model, live=[str(n.target) for n in gm.graph.find_nodes(op="call_module")],
                         leave_out=frozenset((w[0], w[1]) for w in getattr(front, "written", ()))))
    gm.graph.lint()
    gm.recompile()
    return Captured(gm, front.name, front.lead_notes() + finish_notes + mode_notes, only_mode=only_mode,
                    other_mode_error=other_mode_error)
