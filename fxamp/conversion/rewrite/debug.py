"""Overflow attribution: which node's output first became inf/NaN, in the forward and in the backward.

``fxamp.convert(model, "O1", debug_overflow="record")`` runs :func:`add_overflow_checks` on the
converted graph: after every original node it inserts a call of the ``_fxamp_overflow`` monitor
(an :class:`OverflowMonitor` submodule, with no parameters or buffers, so ``state_dict`` keys do
not change)::

    linear = torch._C._nn.linear(cast, getitem_2, getitem_3)
    _fxamp_overflow = self._fxamp_overflow(linear, 'linear')      # inserted
    to = linear.to(torch.float32)

The monitor checks the value with ``torch.isfinite`` and, if it requires grad, registers a tensor
hook that checks its gradient in the backward.  :func:`overflow_info` returns the first forward
node and the first backward node (in the order the backward reached them) whose value was not
finite; ``debug_overflow="raise"`` raises :class:`~fxamp.errors.FxampError` there instead.
Without ``debug_overflow`` nothing is inserted: no cost.  Each check synchronises with the device;
use it to debug, not to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import FxampError
from ..graph import DECISION, attr_target
from ..options import DebugOverflow
from ..passes import Conversion, Pass, Stage

__all__ = ["OverflowMonitor", "OverflowInfo", "add_overflow_checks", "overflow_info", "MONITOR_NAME",
           "OVERFLOW_CHECKS"]

MONITOR_NAME = "_fxamp_overflow"


@dataclass(frozen=True)
class OverflowInfo:
    """The first non-finite values seen since the monitor was created or reset.

    forward:       the first node (in graph order) whose output had an inf/NaN, as ``name (op in module)``.
    forward_call:  which forward call (1-based) it happened in.
    backward:      the first node whose output's gradient had an inf/NaN, in the order the backward reached them.
    backward_call: which backward (counted by forward calls) it happened in.
    """

    forward: Optional[str]
    forward_call: Optional[int]
    backward: Optional[str]
    backward_call: Optional[int]

    def __str__(self) -> str:
        parts = []
        parts.append(f"first inf/NaN in the forward: {self.forward} (call {self.forward_call})" if self.forward
                     else "no inf/NaN in the forward")
        parts.append(f"first inf/NaN in the backward: gradient of {self.backward} (call {self.backward_call})"
                     if self.backward else "no inf/NaN in the backward")
        return "; ".join(parts)


class OverflowMonitor(nn.Module):
    """Called after every node of a debug graph: records (or raises at) the first inf/NaN, forward and backward."""

    def __init__(self, labels: Optional[dict] = None, raise_on_overflow: bool = False, first: str = ""):
        super().__init__()
        self.labels = dict(labels or {})
        self.raise_on_overflow = raise_on_overflow
        self.first = first  # the first checked node: its call starts a forward
        self.reset()

    def reset(self) -> None:
        """Forget what was seen."""
        self.calls = 0
        self.forward_node: Optional[str] = None
        self.forward_call: Optional[int] = None
        self.backward_node: Optional[str] = None
        self.backward_call: Optional[int] = None

    def forward(self, value: Any, name: str) -> None:
        if name == self.first:
            self.calls += 1
        for t in _float_tensors(value):
            if self.forward_node is None and not bool(torch.isfinite(t).all()):
                self.forward_node, self.forward_call = self.labels.get(name, name), self.calls
                if self.raise_on_overflow:
                    raise FxampError(f"debug_overflow: the output of {self.forward_node} has inf/NaN values "
                                     f"(forward call {self.calls}); run it in float32 with "
                                     f"module_overrides=/overrides=, or try fxamp.autotune")
            if t.requires_grad:
                t.register_hook(self._hook(name, self.calls))
        return None

    def _hook(self, name: str, call: int):
        def hook(grad: torch.Tensor) -> None:
            if self.backward_node is None and not bool(torch.isfinite(grad).all()):
                self.backward_node, self.backward_call = self.labels.get(name, name), call
                if self.raise_on_overflow:
                    raise FxampError(f"debug_overflow: the gradient of {self.backward_node} has inf/NaN values "
                                     f"(backward of forward call {call}); with loss scaling this is the scaler's "
                                     f"job (it skips the step), otherwise run it in float32")
        return hook

    def info(self) -> OverflowInfo:
        return OverflowInfo(self.forward_node, self.forward_call, self.backward_node, self.backward_call)


def _float_tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_tensors(v)]
    return []


def add_overflow_checks(gm: fx.GraphModule, *, raise_on_overflow: bool = False) -> fx.GraphModule:
    """Insert a monitor call after every original node of a converted graph (in place); returns ``gm``."""
    if MONITOR_NAME in dict(gm.named_children()):
        raise ValueError("this module already has overflow checks")
    nodes = [n for n in gm.graph.nodes if DECISION in n.meta and n.op != "output" and attr_target(n) is None
             and n.op != "get_attr"]
    labels = {}
    for n in nodes:
        d = n.meta[DECISION]
        labels[n.name] = f"{n.name} ({d.op}{f' in {d.module}' if d.module else ''})"
    monitor = OverflowMonitor(labels, raise_on_overflow)
    gm.add_module(MONITOR_NAME, monitor)
    for n in nodes:
        anchor = n
        if n.op == "placeholder":  # keep placeholders together at the top
            anchor = max((p for p in gm.graph.nodes if p.op == "placeholder"), key=_position(gm))
        with gm.graph.inserting_after(anchor):
            gm.graph.call_module(MONITOR_NAME, (n, n.name))
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == MONITOR_NAME]
    monitor.first = calls[0].args[1] if calls else ""
    gm.graph.lint()
    gm.recompile()
    return gm


def _position(gm: fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: order[n]


def overflow_info(module: nn.Module) -> OverflowInfo:
    """Where inf/NaN first appeared in a module converted with ``debug_overflow="record"``."""
    monitor = getattr(module, MONITOR_NAME, None)
    if not isinstance(monitor, OverflowMonitor):
        raise ValueError("this module has no overflow checks: convert it with fxamp.convert(model, ..., "
                         "debug_overflow='record')")
    return monitor.info()


def _overflow_checks(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    add_overflow_checks(gm, raise_on_overflow=conversion.options.debug_overflow is DebugOverflow.RAISE)
    return []


#: opt-in (``convert(debug_overflow=...)``), whatever the policy: a check after each node
OVERFLOW_CHECKS = Pass("overflow checks", Stage.REWRITE, _overflow_checks,
                       applies=lambda c: c.options.debug_overflow is not DebugOverflow.OFF)
