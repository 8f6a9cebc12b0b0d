"""The executors of a step: how the masters of a checked step are updated and rounded into their low weights.

The engine (:mod:`fxamp.training.step`) checks a step, then hands it to one :class:`Executor`, the one small
protocol every way of stepping implements: ``executor.step(optimizer, runs, multiplier)`` steps what it takes
of ``runs`` (the masters updated, their low-precision weights refreshed, every lean master's workspace left)
and returns the runs it left to the next executor.  The five::

    Plain        the plain step: one inner step of every master at once (their float32 gradients bound
                 by unscale_()), inside the lean workspace when there is one (:func:`run_step`), then
                 every bucket's low weights refreshed (:func:`refresh`)
    Segmented    a run at a time (:func:`step_runs`): each run's low gradients copied into one reused
                 float32 segment times the multiplier, the inner step on the run alone, its low weights
                 refreshed; each run offered first to the two lean executors:
    LeanKernel   lean masters fxamp's CPU kernel steps from their low-precision gradients, where they are
                 (:meth:`fxamp.training.lean.Workspace.step_native`)
    LeanChunked  one large lean master a slice at a time (:meth:`fxamp.training.lean.Workspace.step_chunked`)
    Compiled     ``compile_step=True``: :mod:`fxamp.training.kernels`' one pass per master (the rest through
                 :func:`step_runs`)

The inner optimizer itself is called in one place, :func:`step_inner`: on a CPU the masters of a stock
Adam/AdamW/SGD are stepped by torch's fused kernel (:data:`FUSED`, :func:`fusable`), a stock SGD's other
tensors by its foreach path (:class:`ForeachSGD`), so every path gives a master the same bits and a step's
ops do not grow with its tensors.  The lean workspace is called through :class:`Lean` (what
:class:`fxamp.training.lean.Workspace` offers an executor): this module sits below ``lean``, which uses its
:class:`FusedFor` and re-exports :func:`step_inner`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch

from .plan import Plan, Run, Segments, plain

__all__ = ["Multiplier", "Executor", "Lean", "Fused", "Plain", "Segmented", "LeanKernel", "LeanChunked", "Compiled",
           "step_runs", "run_step", "step_inner", "refresh", "FUSED", "fusable", "FusedFor", "ForeachSGD"]

#: what a step multiplies the low-precision gradients by on a device (``1/scale``, times the clip factor), or
#: None for 1
Multiplier = Optional[Callable[[torch.device], torch.Tensor]]


class Executor(Protocol):
    """One way to step a checked step's masters."""

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        """Step what this executor takes of ``runs``: the inner optimizer's update of their masters, the low
        weights rounded from them; return the runs (or parts of runs) it left, in order."""


class Lean(Protocol):
    """What an executor calls of the lean workspace (:class:`fxamp.training.lean.Workspace`)."""

    def step_native(self, optimizer: Any, masters: Sequence[torch.Tensor], split: bool = True,
                    grads: Optional[Sequence[torch.Tensor]] = None, multiplier: Optional[torch.Tensor] = None,
                    group: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]: ...

    def enter(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None: ...

    def leave(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None: ...

    def chunks(self, run: Run, optimizer: Any) -> bool: ...

    def step_chunked(self, optimizer: Any, run: Run, inv_scale_on: Multiplier) -> None: ...


class Fused(Protocol):
    """What :class:`Compiled` calls of ``compile_step``'s :class:`fxamp.training.kernels.Kernels`."""

    def step(self, runs: Sequence[Run], scale_on: Multiplier, fallback: Callable[[Sequence[Run]], None], *,
             segment_numel: int, found: Optional[torch.Tensor] = None) -> None: ...


# -- the executors -----------------------------------------------------------------------------------

class Plain:
    """The plain step: every master holds its float32 gradient (``unscale_()``); one inner step of all of them
    (:func:`run_step`, the lean ones inside the workspace, some by the CPU kernel), then :func:`refresh`.
    ``runs``: not read (the plain step is one run of every master of ``plan``); the multiplier was applied
    by ``unscale_()``."""

    __slots__ = ("plan", "ws", "split")

    def __init__(self, plan: Plan, ws: Optional[Lean] = None, split: bool = True) -> None:
        self.plan, self.ws, self.split = plan, ws, split

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        run_step(optimizer, self.ws, [m for b in self.plan.buckets for m in b.masters], partial(refresh, self.plan),
                 self.split)
        return []


class Segmented:
    """A run at a time (see :mod:`fxamp.training.step`): per run, every group's ``params`` list but the run's
    emptied; its float32 parameters stepped; its masters with a gradient offered to :class:`LeanKernel` and
    :class:`LeanChunked` (with a workspace ``ws``), the rest unscaled into one reused segment (``segments``:
    the plan's, kept between steps with each run's views, ``runs`` then the plan's; else one for this call),
    stepped (:func:`run_step`) and refreshed.  Every group's ``params`` list is restored, even on error."""

    __slots__ = ("ws", "segments", "lean")

    def __init__(self, ws: Optional[Lean] = None, segments: Optional[Segments] = None) -> None:
        self.ws, self.segments = ws, segments
        self.lean = () if ws is None else (LeanKernel(ws), LeanChunked(ws))

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        groups = optimizer.param_groups
        lists = [g["params"] for g in groups]
        segments, keep = self.segments, self.segments is not None
        if segments is None:  # one segment per device, reused by every run of this call
            segments = Segments(max((r.numel for r in runs), default=0))
        ws = self.ws
        sizes: Dict[torch.device, int] = {}

        def size_on(device: torch.device) -> int:  # the largest run there that takes the segment
            if device not in sizes:
                sizes[device] = max((r.numel for r in runs if r.pairs and r.pairs[0][1].device == device
                                     and r.numel <= segments.limit and not (ws is not None and ws.chunks(r, optimizer))),
                                    default=0)
            return sizes[device]

        try:
            for index, run in enumerate(runs):
                for gi, group in enumerate(groups):
                    group["params"] = [] if gi != run.group else list(run.own) if run.own else [m for _, m in run.pairs]
                if run.own:
                    optimizer.step()
                    continue
                part = _with_grads(run)
                if part is None:
                    continue
                key = index if keep and part is run else None  # views kept for a whole run only
                rest = self._offer(optimizer, part, multiplier)
                if rest is None:
                    continue
                if rest is not part:
                    key = None
                _through_segment(optimizer, ws, rest, segments, key, size_on(rest.pairs[0][1].device), multiplier)
        finally:
            for group, params in zip(groups, lists):
                group["params"] = params
        return []

    def _offer(self, optimizer: Any, run: Run, multiplier: Multiplier) -> Optional[Run]:
        """What the lean executors leave of ``run`` (None: they took it all).  What :class:`LeanKernel` left of
        a run it took part of goes to the segment: a run of several masters is never chunked."""
        for executor in self.lean:
            left = executor.step(optimizer, [run], multiplier)
            if not left or left[0] is not run:
                return left[0] if left else None
        return run


class LeanKernel:
    """Lean masters the CPU kernel takes (:meth:`fxamp.training.lean.Workspace.step_native`), stepped from their
    low-precision gradients where they are, times the multiplier: no float32 gradient.  The rest are left."""

    __slots__ = ("ws",)

    def __init__(self, ws: Lean) -> None:
        self.ws = ws

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        left = []
        for run in runs:
            masters = [m for _, m in run.pairs]
            device = masters[0].device
            done = {id(m) for m in self.ws.step_native(optimizer, masters, grads=[low.grad for low, _ in run.pairs],
                                                       multiplier=None if multiplier is None else multiplier(device),
                                                       group=optimizer.param_groups[run.group])}
            if not done:
                left.append(run)
            elif len(done) < len(masters):
                left.append(_part(run, [i for i, m in enumerate(masters) if id(m) not in done]))
        return left


class LeanChunked:
    """A run of one large lean master (:meth:`fxamp.training.lean.Workspace.chunks`) stepped a slice at a time
    (:meth:`~fxamp.training.lean.Workspace.step_chunked`); other runs are left.  Every group but the run's holds no
    parameter during the call (:class:`Segmented` empties them)."""

    __slots__ = ("ws",)

    def __init__(self, ws: Lean) -> None:
        self.ws = ws

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        left = []
        for run in runs:
            if self.ws.chunks(run, optimizer):
                self.ws.step_chunked(optimizer, run, multiplier)
            else:
                left.append(run)
        return left


class Compiled:
    """``compile_step=True``: the runs' masters stepped by :meth:`fxamp.training.kernels.Kernels.step`, one pass
    from the low-precision gradient to the low weight; what its kernels do not take through :func:`step_runs`.
    ``found``: the overflow flag of a step decided on the device (the kernels skip there)."""

    __slots__ = ("kernels", "segment_numel", "found")

    def __init__(self, kernels: Fused, segment_numel: int, found: Optional[torch.Tensor] = None) -> None:
        self.kernels, self.segment_numel, self.found = kernels, segment_numel, found

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        self.kernels.step(runs, multiplier, partial(step_runs, optimizer, inv_scale_on=multiplier),
                          segment_numel=self.segment_numel, found=self.found)
        return []


def step_runs(optimizer: Any, runs: Sequence[Run], inv_scale_on: Multiplier, ws: Optional[Lean] = None,
              segments: Optional[Segments] = None) -> None:
    """Step ``optimizer`` run by run (:class:`Segmented`); ``inv_scale_on(device)`` is ``1/scale`` there, or None
    when the scale is 1; ``ws``: the workspace of lean masters; ``segments``: the plan's, kept between steps
    (``runs`` then are the plan's runs), else one segment per device for this call alone."""
    Segmented(ws, segments).step(optimizer, runs, inv_scale_on)


def _with_grads(run: Run) -> Optional[Run]:
    """``run`` itself when every low-precision parameter of it has a gradient; else the part that has one (the
    other masters get no ``.grad``: not stepped, as a plain optimizer would not), or None when none has."""
    present = [i for i, (low, _) in enumerate(run.pairs) if low.grad is not None]
    if len(present) == len(run.pairs):
        return run
    for low, m in run.pairs:
        if low.grad is None:
            m.grad = None  # (none left by an unscale_())
    return _part(run, present) if present else None


def _part(run: Run, keep: Sequence[int]) -> Run:
    """The pairs ``keep`` (indices) of ``run``, with their strides."""
    pairs = tuple(run.pairs[i] for i in keep)
    strides = None if run.strides is None else tuple(run.strides[i] for i in keep)
    return Run(run.group, pairs=pairs, numel=sum(m.numel() for _, m in pairs), strides=strides)


def _through_segment(optimizer: Any, ws: Optional[Lean], run: Run, segments: Segments, key: Optional[int],
                     numel: int, multiplier: Multiplier) -> None:
    """Step ``run``'s masters from float32 gradients in ``segments`` (views kept under ``key``; ``numel``: the
    segment's size on the device): the low-precision gradients copied there times the multiplier, bound as the
    masters' ``.grad`` for the inner step, unbound after."""
    lows = [low for low, _ in run.pairs]
    masters = [m for _, m in run.pairs]
    with torch.no_grad():
        views = segments.views_for(key, masters, run.strides, numel)
        torch._foreach_copy_(views, [low.grad for low in lows])
        if multiplier is not None:
            torch._foreach_mul_(views, multiplier(masters[0].device))
    for m, v in zip(masters, views):
        m.grad = v
    try:
        run_step(optimizer, ws, masters, partial(torch._foreach_copy_, lows, masters), kernel=False)
    finally:
        for m in masters:
            m.grad = None
        del views


# -- the inner step: which of torch's paths steps the masters ------------------------------------

class ForeachSGD:
    """A stock SGD's groups that left ``foreach`` to torch step with ``foreach=True`` inside the block (restored
    after): the foreach path runs the same float32 operations on each tensor as the for-loop, in the same order
    (``buf.mul_(momentum).add_(grad, alpha=1 - dampening)``, ``param.add_(buf, alpha=-lr)``): bitwise the same
    step, in a few calls for all of a group's tensors.  A group that chose (``foreach=False``, ``fused``), is
    ``differentiable`` or holds a tensor subclass is left alone."""

    def __init__(self, optimizer: Any) -> None:
        self.groups = [] if type(optimizer) is not torch.optim.SGD else [
            g for g in optimizer.param_groups if g.get("foreach") is None and not g.get("fused")
            and not g.get("differentiable", False) and all(plain(p) for p in g["params"])]

    def __enter__(self) -> None:
        for g in self.groups:
            g["foreach"] = True

    def __exit__(self, *exc: Any) -> None:
        for g in self.groups:
            g["foreach"] = None


#: the stock optimizers whose masters (float32 or lean) are stepped by torch's fused kernel on a CPU (``fused=True``
#: for the call: one pass over value, gradient and both moments instead of the for-loop's eight; the same update up
#: to float32 rounding; SGD's: bitwise its for-loop, in one pass instead of three), wherever a master is stepped, so
#: every path gives it the same bits (:func:`step_inner`)
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fusable(optimizer: Any, group: Dict[str, Any], master: torch.Tensor) -> bool:
    """Whether ``master`` (a master of ``group``: float32 or lean) is stepped by :data:`FUSED`'s kernel: a stock
    Adam/AdamW/SGD, a plain (not distributed) CPU tensor without a sparse gradient, a group that is not
    ``differentiable`` and was not built with ``fused=False`` (the user's way to keep the for-loop).  Not on CUDA:
    torch's fused kernel there wants ``state["step"]`` on the device, which an optimizer made without
    ``fused=True`` keeps on the CPU (its foreach path steps every master in one call there anyway)."""
    return (type(optimizer) in FUSED and master.device.type == "cpu" and plain(master)
            and not group.get("differentiable", False) and group.get("fused") is not False
            and not (master.grad is not None and master.grad.is_sparse))


class FusedFor:
    """``groups`` step with ``fused=True`` (and ``foreach=False``) inside the block; their flags restored after."""

    def __init__(self, groups: Sequence[Dict[str, Any]]) -> None:
        self.groups = list(groups)
        self.saved = [(g.get("fused"), g.get("foreach")) for g in self.groups]

    def __enter__(self) -> None:
        for g in self.groups:
            g["fused"], g["foreach"] = True, False

    def __exit__(self, *exc: Any) -> None:
        for g, (fused, foreach) in zip(self.groups, self.saved):
            g["fused"], g["foreach"] = fused, foreach


def step_inner(optimizer: Any, masters: Sequence[torch.Tensor], split: bool = True,
               skip: Sequence[torch.Tensor] = ()) -> None:
    """``optimizer.step()`` on the groups as they stand (``masters``: fxamp's float32 masters among them, lean
    ones entered), the masters that :func:`fusable` says so by torch's fused kernel: a second call of ``step()``
    with only them in the groups and ``fused=True`` (the groups' lists and flags restored after, even on error);
    the user's own parameters as the optimizer was built.  Not unless ``split`` (the engine's
    :func:`~fxamp.training.step.steps_per_parameter`: step hooks must run once per step, and such an optimizer is
    never segmented either).  ``skip``: stepped already (:meth:`fxamp.training.lean.Workspace.step_native`)."""
    groups = optimizer.param_groups
    skip_ids = {id(m) for m in skip}
    ids = {id(m) for m in masters} - skip_ids
    fused = [[p for p in g["params"] if id(p) in ids and fusable(optimizer, g, p)] for g in groups] if split else []
    if not skip_ids and not any(fused):
        with ForeachSGD(optimizer):
            optimizer.step()
        return
    lists = [g["params"] for g in groups]
    try:
        ids = {id(p) for ps in fused for p in ps}
        rest = [[p for p in ps if id(p) not in ids and id(p) not in skip_ids] for ps in lists]
        if any(rest):
            for g, ps in zip(groups, rest):
                g["params"] = ps
            with ForeachSGD(optimizer):
                optimizer.step()
        if any(fused):
            for g, ps in zip(groups, fused):
                g["params"] = ps
            with FusedFor([g for g, ps in zip(groups, fused) if ps]):
                optimizer.step()
    finally:
        for g, ps in zip(groups, lists):
            g["params"] = ps


def run_step(optimizer: Any, ws: Optional[Lean], masters: List[torch.Tensor], round_in: Callable[[], None],
             split: bool = True, kernel: bool = True) -> None:
    """``optimizer.step()``, then ``round_in()`` (the low weights from the masters), inside ``ws``'s float32
    workspace when there is one (every executor's inner step but the compiled one's);
    ``split``: whether its masters may take a second, fused ``step()`` (:func:`step_inner`);
    ``kernel``: whether the CPU kernel may take some (False: a segmented step offered them to it already)."""
    native_done: List[torch.Tensor] = []
    if ws is not None:
        if kernel:
            native_done = ws.step_native(optimizer, masters, split)
        ws.enter(masters, native_done)
    step_inner(optimizer, masters, split, native_done)
    with torch.no_grad():
        round_in()
    if ws is not None:
        ws.leave(masters, native_done)


def refresh(plan: Plan) -> None:
    """Round the masters into the low-precision parameters: one ``_foreach_copy_`` per (device, dtype)."""
    with torch.no_grad():
        for bucket in plan.buckets:
            torch._foreach_copy_(bucket.lows, bucket.masters)
