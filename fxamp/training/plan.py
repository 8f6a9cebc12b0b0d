"""The step's tensor lists: per (device, dtype) a :class:`Bucket` of low-precision parameters, their float32
masters and the masters' gradient segments; the :class:`Plan` of a step (what it touches, as lists ready
for foreach calls, built once per layout of ``param_groups``); and where its overflow decision stays.

A segmented step's runs (:class:`Run`, :func:`cut_runs`) are the plan's too.  The step engine
(:mod:`fxamp.training.step`) builds the plan, keeps it and runs a step over it; the executors
(:mod:`fxamp.training.executors`) step its runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = ["CAT_NUMEL", "GRAD_SEGMENT_NUMEL", "RELEASE_MIN_BYTES", "DECIDE_ON", "Strides", "grad_strides",
           "flat_grads", "Run", "cut_runs", "Bucket", "Segments", "Plan", "decides_on", "plain"]

Strides = Optional[Tuple[Tuple[int, ...], ...]]


def grad_strides(masters: Sequence[torch.Tensor]) -> Strides:
    """The strides a fresh gradient of each master has (``empty_like``), or None when all are row-major."""
    strides = tuple(torch.empty_like(m, device="meta").stride() for m in masters)
    if all(s == torch.empty(m.shape, device="meta").stride() for s, m in zip(strides, masters)):
        return None
    return strides


def flat_grads(masters: Sequence[torch.Tensor], strides: Strides, flat: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """A float32 segment for ``masters``' gradients (``flat``'s first elements, or a new one), and a
    view of it per master laid out with ``strides`` (:func:`grad_strides`: None for row-major)."""
    numel = sum(m.numel() for m in masters)
    if flat is None:
        flat = torch.empty(numel, dtype=masters[0].dtype, device=masters[0].device)
    if strides is None:
        return flat, list(_unflatten_dense_tensors(flat.narrow(0, 0, numel), list(masters)))  # one C++ call
    views, offset = [], 0
    for m, stride in zip(masters, strides):
        views.append(flat.as_strided(m.shape, stride, flat.storage_offset() + offset))
        offset += m.numel()
    return flat, views



@dataclass(frozen=True)
class Run:
    """Masters of one param group stepped together: ``pairs`` (low, master) on one device, or
    ``own`` float32 parameters stepped directly (their gradients are unscaled in place beforehand).
    ``numel`` and ``strides`` (:func:`grad_strides`) are the masters', known when the run is planned."""

    group: int
    pairs: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()
    own: Tuple[torch.Tensor, ...] = ()
    numel: int = 0
    strides: Strides = None


def _run(group: int, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Run:
    masters = [m for _, m in pairs]
    return Run(group, pairs=tuple(pairs), numel=sum(m.numel() for m in masters), strides=grad_strides(masters))


def cut_runs(group: int, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], segment_numel: int) -> List[Run]:
    """``pairs`` (low, master) of one group and device, in order, as runs of at most ``segment_numel``
    elements (a larger master is a run of its own)."""
    runs: List[Run] = []
    run: List[Tuple[torch.Tensor, torch.Tensor]] = []
    total = 0
    for pair in pairs:
        n = pair[1].numel()
        if run and total + n > segment_numel:
            runs.append(_run(group, run))
            run, total = [], 0
        run.append(pair)
        total += n
    if run:
        runs.append(_run(group, run))
    return runs


# -- the plan: buckets of (low, master) pairs and their gradient segments ---------------------

#: On CPU, gradients of at most this many elements are gathered by ``torch.cat`` (one kernel per
#: trailing shape) into a low-precision staging tensor and converted to float32 by one kernel: a
#: copy per tensor is mostly dispatch for a small tensor (benchmarks/RESULTS.md, the 200-Linear
#: chain).  Larger ones are copied directly.
CAT_NUMEL = 1024

#: The masters' float32 gradients of the plain step are allocated in segments of at most this many
#: elements (16 MiB), each tensor in one segment (a larger tensor is a segment of its own).  The
#: segments live from ``unscale_()`` to ``zero_grad()``; a single buffer of a real model's size (82 MB
#: for 20 M parameters) is above glibc's largest mmap threshold (32 MiB), so it would be mapped afresh
#: and page-faulted in at every step (43 ms of CPU per step at that size, measured), while segments
#: of this size are recycled by the heap (5 ms: the copy itself), as a plain optimizer's gradients are.
GRAD_SEGMENT_NUMEL = 4 * 1024 * 1024

#: ``zero_grad()`` frees the masters' gradients of a (device, dtype) only from this many bytes on:
#: below, re-creating the views costs more than the memory is worth (200 Linear(16, 16): 400 views,
#: 1.3 ms of a 9.4 ms O2 training step, for 218 KB).  From this many bytes of masters on, a step
#: may be segmented.
RELEASE_MIN_BYTES = 16 * 1024 * 1024

#: device types on which a step's overflow decision stays on the device (tests add "cpu" to run it here)
DECIDE_ON = ("cuda",)

_Pair = Tuple[torch.Tensor, torch.Tensor]
_UNKNOWN = object()


class Bucket:
    """Low-precision parameters of one (device, dtype), their masters, and the masters' gradients.

    The masters' gradients are views into a few flat segments (``GRAD_SEGMENT_NUMEL``), laid out
    with the strides ``empty_like(master)`` gives, as a fresh gradient would have: allocated at
    ``unscale_()`` (:meth:`allocate`), bound as the masters' ``.grad`` and overwritten from the
    low-precision gradients, checked for inf/NaN in one kernel over the segments, and dropped by
    ``zero_grad()`` (:meth:`release`), so they take no memory during the forward and backward.

    The pairs are reordered: first the groups of small gradients gathered with ``torch.cat``
    (``cats``: a slice of the lists and the stretch of ``staging`` it fills, see ``CAT_NUMEL``),
    whose float32 copies start the first segment (``flats[0]``); then the others.
    """

    __slots__ = ("device", "lows", "masters", "grads", "flats", "segments", "cats", "staging", "ncat", "nbytes")

    def __init__(self, lows: List[torch.Tensor], masters: List[torch.Tensor]) -> None:
        self.device = lows[0].device
        groups, rest = _cat_groups(lows, masters)
        pairs = [pair for group in groups for pair in group] + rest
        self.lows = [low for low, _ in pairs]
        self.masters = [m for _, m in pairs]
        self.ncat = sum(len(group) for group in groups)
        self.segments = _segments(self.masters, self.ncat)
        self.nbytes = sum(m.numel() * m.element_size() for m in self.masters)
        self.flats: Optional[List[torch.Tensor]] = None  # allocated by allocate(), dropped by release()
        self.grads: Optional[List[torch.Tensor]] = None  # the masters' gradients: views of ``flats``
        nstaged = sum(m.numel() for m in self.masters[:self.ncat])
        self.staging = torch.empty(nstaged, dtype=self.lows[0].dtype, device=self.device)
        self.cats: List[Tuple[slice, torch.Tensor]] = []
        start = offset = 0
        for group in groups:  # cat along dim 0 fills ``out``: the group's stretch of staging, as one tensor
            n = sum(m.numel() for _, m in group)
            rows = sum(m.shape[0] for _, m in group)
            out = self.staging[offset:offset + n].view(rows, *group[0][1].shape[1:])
            self.cats.append((slice(start, start + len(group)), out))
            start, offset = start + len(group), offset + n

    def allocate(self) -> None:
        """Allocate the masters' gradient segments and their views, unless they are still allocated."""
        if self.grads is None:
            self.flats, self.grads = [], []
            for first, end, strides in self.segments:
                flat, views = flat_grads(self.masters[first:end], strides)
                self.flats.append(flat)
                self.grads.extend(views)

    def release(self) -> None:
        """Drop the segments if they are large (``RELEASE_MIN_BYTES``); the caller unbinds the
        masters' ``.grad`` first, or the segments stay alive through them."""
        if self.nbytes >= RELEASE_MIN_BYTES:
            self.flats = self.grads = None

    def copy_in(self, grads: List[torch.Tensor], check: Callable[[List[torch.Tensor]], None]) -> None:
        """Copy dense low-precision gradients, in the order of ``lows``, into the masters' ``grads``.

        Segment by segment, each passed to ``check`` right after it is written, while it is still
        in cache (a 16 MiB segment; checking all of an 82 MB buffer afterwards reads it from memory).
        """
        for k, (first, end, _) in enumerate(self.segments):
            if k == 0 and self.cats:
                for run, out in self.cats:
                    torch.cat(grads[run], out=out)
                self.flats[0][:self.staging.numel()].copy_(self.staging)
                first = self.ncat
            if first < end:  # one call for the segment's list, not one per tensor
                torch._foreach_copy_(self.grads[first:end], grads[first:end])
            check([self.flats[k]])


def _cat_groups(lows: List[torch.Tensor], masters: List[torch.Tensor]) -> Tuple[List[List[_Pair]], List[_Pair]]:
    """Split (low, master) pairs into the groups ``torch.cat`` gathers along dim 0, and the rest.

    A group: two or more small (``CAT_NUMEL``) CPU tensors with contiguous gradients and the same
    shape but for dim 0.
    """
    groups: Dict[Tuple[int, ...], List[_Pair]] = {}
    rest = []
    for low, m in zip(lows, masters):
        if (low.device.type == "cpu" and 0 < m.dim() and m.numel() <= CAT_NUMEL
                and m.is_contiguous() and torch.empty_like(m, device="meta").is_contiguous()):
            groups.setdefault(tuple(m.shape[1:]), []).append((low, m))
        else:
            rest.append((low, m))
    gathered = [group for group in groups.values() if len(group) > 1]
    rest += [pair for group in groups.values() if len(group) == 1 for pair in group]
    return gathered, rest


def _segments(masters: List[torch.Tensor], ncat: int) -> List[Tuple[int, int, Strides]]:
    """``(first, end, strides)`` per gradient segment: runs of consecutive masters of at most
    ``GRAD_SEGMENT_NUMEL`` elements in all (or one larger master); the ``ncat`` staged ones start
    the first.  ``strides``: :func:`grad_strides` of the segment's masters."""
    bounds = [0]
    total = sum(m.numel() for m in masters[:ncat])  # the staged ones start the first segment
    for i in range(ncat, len(masters)):
        n = masters[i].numel()
        if i > bounds[-1] and total + n > GRAD_SEGMENT_NUMEL:
            bounds.append(i)
            total = 0
        total += n
    if bounds[-1] < len(masters):
        bounds.append(len(masters))
    return [(first, end, grad_strides(masters[first:end])) for first, end in zip(bounds, bounds[1:])]


class Segments:
    """A segmented step's float32 gradient segment per device, and each run's views into it (``views``).

    Kept from one step to the next (with the plan), so a step creates no view per tensor: the ops of its
    runs grow with the elements they step, not with the number of tensors.  A segment holds at most
    ``limit`` elements (the step's segment size): a larger master, a run of its own, gets a gradient of
    its own each step (one allocation and one view per such run), which is not kept.
    """

    __slots__ = ("limit", "flats", "views")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.flats: Dict[torch.device, torch.Tensor] = {}
        self.views: Dict[int, List[torch.Tensor]] = {}  # a run's place in the plan's runs -> its views

    def views_for(self, key: Optional[int], masters: Sequence[torch.Tensor], strides: Strides, numel: int
                  ) -> List[torch.Tensor]:
        """Views of a segment for ``masters``' gradients laid out with ``strides``; ``key``: the run's place,
        to keep them (None: a run stepped in part, whose views are made afresh); ``numel``: the segment's size
        on that device (the largest run there within ``limit``)."""
        views = self.views.get(key) if key is not None else None
        if views is not None:
            return views
        device, total = masters[0].device, sum(m.numel() for m in masters)
        if total > self.limit:  # one large master: not kept
            return flat_grads(masters, strides)[1]
        flat = self.flats.get(device)
        if flat is None or flat.numel() < total:  # (a run "auto" calibrated out of a lean chunked step: larger)
            flat = self.flats[device] = torch.empty(max(numel, total), dtype=masters[0].dtype, device=device)
            self.views = {k: v for k, v in self.views.items() if v[0].device != device}  # views of the old one
        views = flat_grads(masters, strides, flat)[1]
        if key is not None:
            self.views[key] = views
        return views


class Plan:
    """What a step touches, as lists ready for foreach calls; valid while ``param_groups`` keep their layout.

    buckets:   low-precision parameters and their masters, per (device, dtype) of the former
    own:       the float32 (or float64) parameters the inner optimizer steps directly, per (device, dtype)
    layout:    each group's ``params`` list and its length when the plan was built (see ``matches``)
    runs:      a segmented step's runs, planned at the first one
    segments:  their gradient segments (:class:`Segments`), kept from step to step
    decide_on: the device the overflow decision stays on, or None (see :func:`decides_on`)
    fuse:      whether the step uses ``compile_step``'s kernels (decided once, by the optimizer)

    A group added to the inner optimizer, or a ``params`` list replaced or resized, is noticed at
    the next ``unscale_()``; a parameter swapped into a list in place is not.
    """

    __slots__ = ("buckets", "own", "layout", "runs", "segments", "decide_on", "fuse")

    def __init__(self, groups: List[Dict[str, Any]], low_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Group the parameters of ``groups`` by device and dtype, in their order; ``low_of(master)``:
        its low-precision parameter, or None for a parameter stepped directly."""
        pairs: Dict[Tuple[Any, ...], Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        own: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for group in groups:
            for master in group["params"]:
                low = low_of(master)
                if low is None:
                    own.setdefault((master.device, master.dtype), []).append(master)
                else:
                    lows, masters = pairs.setdefault((low.device, low.dtype, master.dtype), ([], []))
                    lows.append(low)
                    masters.append(master)
        self.buckets = [Bucket(*lists) for lists in pairs.values()]
        self.own = list(own.values())
        self.layout = [(g["params"], len(g["params"])) for g in groups]
        self.runs: Optional[List[Run]] = None  # (planned by fxamp.training.step.plan_runs)
        self.segments: Optional[Segments] = None
        self.decide_on: Any = _UNKNOWN
        self.fuse: Optional[bool] = None

    def devices(self) -> set:
        return {b.device for b in self.buckets} | {p.device for params in self.own for p in params}

    def matches(self, groups: List[Dict[str, Any]]) -> bool:
        """Same groups holding the same lists of the same lengths (the lists are held, so ids are not reused)."""
        if len(groups) != len(self.layout):
            return False
        return all(group["params"] is params and len(params) == n for group, (params, n) in zip(groups, self.layout))

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def has_sparse_grad(self) -> bool:
        return any(p.grad is not None and p.grad.is_sparse for b in self.buckets for p in b.lows)


def decides_on(plan: Plan, optimizer: Any, host_only: bool, reduces_on_device: Callable[[torch.device], bool]
               ) -> Optional[torch.device]:
    """The device on which this step's overflow decision stays (the host does not wait for it), or None;
    decided once per plan.

    When the inner optimizer's step can skip on the device (torch's fused Adam, AdamW, SGD:
    ``_step_supports_amp_scaling``, the flag GradScaler passes them), all its parameters are on
    one device of a type in :data:`DECIDE_ON` and the flag can be agreed on there
    (``reduces_on_device``), unless the step's executor reads the decision on the host
    (``host_only``: ``compile_step``'s SGD kernels).  Elsewhere the decision is read on the host."""
    if plan.decide_on is _UNKNOWN:
        plan.decide_on = None
        devices = plan.devices()
        if host_only:
            return None
        if (getattr(optimizer, "_step_supports_amp_scaling", False) and len(devices) == 1
                and next(iter(devices)).type in DECIDE_ON):
            device = next(iter(devices))
            if reduces_on_device(device):
                plan.decide_on = device
    return plan.decide_on


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor or parameter, not a subclass such as DTensor (asked without ``t.data``,
    which is a detach: one dispatched op per master and step)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or type(t.data) is torch.Tensor
