"""The step's tensor lists, built once per layout of ``param_groups``: per (device, dtype) a :class:`Bucket` of
low-precision parameters, their float32 masters and the layout of the masters' gradient segments; the
:class:`Plan` of a step (what it touches, as lists ready for foreach calls); a segmented step's runs
(:class:`Run`, :func:`plan_runs`, :func:`cut_runs`) and their segment size (:func:`segment_numel_for`).

Planning only: a step (its third, say) runs no code here.  The step engine (:mod:`fxamp.training.step`) builds
the plan at the first step of a layout, keeps it and runs each step over it; what a step does with a bucket
(``allocate``, ``copy_in``) and with a run (``Segments``) is :mod:`fxamp.training.executors`'.  The constants
are read where they are (tests patch them here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["CAT_NUMEL", "GRAD_SEGMENT_NUMEL", "RELEASE_MIN_BYTES", "DECIDE_ON", "UNDECIDED", "Strides", "grad_strides",
           "Run", "cut_runs", "SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "segment_numel_for", "plan_runs", "Bucket",
           "Plan"]

Strides = Optional[Tuple[Tuple[int, ...], ...]]


def grad_strides(masters: Sequence[torch.Tensor]) -> Strides:
    """The strides a fresh gradient of each master has (``empty_like``), or None when all are row-major."""
    strides = tuple(torch.empty_like(m, device="meta").stride() for m in masters)
    if all(s == torch.empty(m.shape, device="meta").stride() for s, m in zip(strides, masters)):
        return None
    return strides


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


#: float32 elements per segment (4 MiB): one segment per device is allocated per step and reused by
#: every run, so this is all the step adds to the memory of the low-precision gradients; a few
#: dozen inner steps for a 25 M-parameter model (each costs ~0.1 ms of Python)
SEGMENT_NUMEL = 1024 * 1024


#: float32 elements per segment on an accelerator (128 MiB): there the caching allocator recycles any
#: size and each run costs kernel launches and Python (~0.3 ms), not cache misses; a GPT-2 small
#: (124 M parameters) is stepped in 5 runs, and a 7 B model's step still adds 128 MiB, not 28 GiB
ACCELERATOR_SEGMENT_NUMEL = 32 * 1024 * 1024


def segment_numel_for(devices) -> int:
    """The segment size for masters on ``devices``: :data:`SEGMENT_NUMEL` if any is the CPU, else
    :data:`ACCELERATOR_SEGMENT_NUMEL`."""
    return SEGMENT_NUMEL if any(torch.device(d).type == "cpu" for d in devices) else ACCELERATOR_SEGMENT_NUMEL


def plan_runs(groups: Sequence[Dict[str, Any]], low_of: Callable[[torch.Tensor], Optional[torch.Tensor]],
              segment_numel: Optional[int] = None) -> List[Run]:
    """The runs of a step, in the order of ``param_groups``: per group, its float32 parameters, then
    its paired masters cut into runs of one device and at most ``segment_numel`` elements (a larger
    master is a run of its own); ``segment_numel`` defaults to :data:`SEGMENT_NUMEL`."""
    segment_numel = SEGMENT_NUMEL if segment_numel is None else segment_numel
    runs: List[Run] = []
    for gi, group in enumerate(groups):
        own: List[torch.Tensor] = []
        by_device: Dict[torch.device, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        for master in group["params"]:
            low = low_of(master)
            if low is None:
                own.append(master)
            else:
                by_device.setdefault(master.device, []).append((low, master))
        if own:
            runs.append(Run(gi, own=tuple(own)))
        for pairs in by_device.values():
            runs.extend(cut_runs(gi, pairs, segment_numel))
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
#: :attr:`Plan.decide_on` until the engine decided it (``step.Engine.decides_on``)
UNDECIDED = object()


class Bucket:
    """Low-precision parameters of one (device, dtype), their masters, and the masters' gradients.

    The masters' gradients are views into a few flat segments (``GRAD_SEGMENT_NUMEL``), laid out
    with the strides ``empty_like(master)`` gives, as a fresh gradient would have: allocated at
    ``unscale_()`` (``executors.allocate``), bound as the masters' ``.grad`` and overwritten from the
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
        self.flats: Optional[List[torch.Tensor]] = None  # allocated by executors.allocate(), dropped by release()
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

    def release(self) -> None:
        """Drop the segments if they are large (``RELEASE_MIN_BYTES``); the caller unbinds the
        masters' ``.grad`` first, or the segments stay alive through them."""
        if self.nbytes >= RELEASE_MIN_BYTES:
            self.flats = self.grads = None


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


class Plan:
    """What a step touches, as lists ready for foreach calls; valid while ``param_groups`` keep their layout.

    buckets:   low-precision parameters and their masters, per (device, dtype) of the former
    own:       the float32 (or float64) parameters the inner optimizer steps directly, per (device, dtype)
    layout:    each group's ``params`` list and its length when the plan was built (the engine's ``Engine.plan`` compares)
    runs:      a segmented step's runs, planned at the first one
    segments:  their gradient segments (``executors.Segments``), kept from step to step
    decide_on: the device the overflow decision stays on, or None (``step.Engine.decides_on``; :data:`UNDECIDED` until then)
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
        self.runs: Optional[List[Run]] = None  # (planned by plan_runs at the first segmented step)
        self.segments: Any = None  # (executors.Segments)
        self.decide_on: Any = UNDECIDED
        self.fuse: Optional[bool] = None

    def devices(self) -> set:
        """The devices of the masters and parameters (read when the step decides where it decides, once)."""
        return {b.device for b in self.buckets} | {p.device for params in self.own for p in params}


