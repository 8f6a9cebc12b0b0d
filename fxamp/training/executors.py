"""What the engine calls to stage and execute a checked step; nothing here calls back into it.

The engine (:mod:`fxamp.training.step`) stages the gradients with one :class:`FoundInf` (the check's flag per
device): :func:`unscale` (the plain step: each bucket's low gradients copied into its float32 segments,
:func:`copy_in`, divided by the scale and checked on the way) or :func:`check_in_place` (a segmented step: the
low gradients checked where they are).  Then it hands the step to one :class:`Executor`, the one small protocol
every way of stepping implements: ``executor.step(optimizer, runs, multiplier)`` steps what it takes of ``runs``
(the masters updated, their low weights refreshed, every lean master's workspace left) and returns the runs it
left to the next executor::

    Plain        one inner step of every master at once (their float32 gradients bound by unscale()), inside
                 the lean workspace when there is one (:func:`run_step`), then every bucket refreshed
    Segmented    a run at a time (:func:`step_runs`): each run's low gradients copied into one reused float32
                 segment (:class:`Segments`) times the multiplier, the inner step on the run alone, its low
                 weights refreshed; each run offered first to the lean workspace's executors
                 (:meth:`Lean.executors`: ``lean_step.LeanKernel``, ``lean_step.LeanChunked``)
    Compiled     ``compile_step=True``'s (:class:`fxamp.training.kernels.Compiled`)

The inner optimizer itself is called in one place, :func:`step_inner`: on a CPU the masters of a stock
Adam/AdamW/SGD are stepped by torch's fused kernel (:data:`FUSED`, :func:`fusable`), a stock SGD's other
tensors by its foreach path (:class:`ForeachSGD`), so every path gives a master the same bits and a step's ops
do not grow with its tensors.  The lean step is called through :class:`Lean`: this module sits below
``lean_step``, which uses its :class:`FusedFor` (and ``lean``, which re-exports :func:`step_inner`).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from . import native
from .distributed import max_abs
from .plan import Bucket, Plan, Run, Strides

__all__ = ["Multiplier", "SUM_NUMEL", "FoundInf", "fused_kernel_takes", "note_non_finite_", "has_streams", "OnDevices",
           "multiplier_of",
           "unscale", "check_in_place", "unscale_masters", "unscale_pairs", "unscale_own", "allocate", "copy_in",
           "which_overflowed",
           "Executor", "Lean", "Plain", "Segmented", "step_runs", "part_of", "flat_grads", "Segments", "plain",
           "step_inner", "run_step", "refresh", "FUSED", "fusable", "FusedFor", "ForeachSGD"]

#: what a step multiplies the low-precision gradients by on a device (``1/scale``, times the clip factor), or
#: None for 1
Multiplier = Optional[Callable[[torch.device], torch.Tensor]]


class Executor(Protocol):
    """One way to step a checked step's masters."""

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        """Step what this executor takes of ``runs``: the inner optimizer's update of their masters, the low
        weights rounded from them; return the runs (or parts of runs) it left, in order."""


class Lean(Protocol):
    """What the engine and its executors call of the lean step (:class:`fxamp.training.lean_step.LeanStep`)."""

    def step_native(self, optimizer: Any, masters: Sequence[torch.Tensor], split: bool = True,
                    grads: Optional[Sequence[torch.Tensor]] = None, multiplier: Optional[torch.Tensor] = None,
                    group: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]: ...

    def enter(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None: ...

    def leave(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None: ...

    def chunks(self, run: Run, optimizer: Any) -> bool: ...

    def executors(self) -> Sequence[Executor]:
        """What a segmented step offers each run to first: :class:`fxamp.training.lean_step.LeanKernel`, then
        :class:`~fxamp.training.lean_step.LeanChunked`."""

    def stepped(self) -> None:
        """The engine's, after a step taken (not skipped)."""

# -- the check: one flag per device, read once --------------------------------------------------------

#: :meth:`FoundInf.check_` sums (on a CPU) gradients of this many elements on, the rest go to one kernel call: a check's
#: ops grow with its elements, not its tensors (bfloat16, 1 thread: sums 0.8x the kernel's time at 1 M, 2.7x at 4 K)
SUM_NUMEL = 2 ** 15


class FoundInf:
    """Divides gradients by the scale and notes any inf/NaN: one flag per device, read once at the end.

    ``inv_scale_on(device)`` gives ``1/scale`` there.  When the scale is 1 (``unit``) a single
    float32 CPU tensor is only read (a finite sum means finite elements), not read and rewritten.
    """

    __slots__ = ("inv_scale_on", "unit", "flags")

    def __init__(self, inv_scale_on: Callable[[torch.device], torch.Tensor], unit: bool = False) -> None:
        self.inv_scale_on, self.unit = inv_scale_on, unit
        self.flags: Dict[torch.device, torch.Tensor] = {}

    def unscale_and_check_(self, tensors: List[torch.Tensor]) -> None:
        """Divide dense ``tensors`` (one device and dtype) by the scale in place, noting any inf/NaN."""
        if not tensors:
            return
        t = tensors[0]
        device, flag = t.device, self.flag_on(t.device)
        if self.unit and len(tensors) == 1 and t.device.type == "cpu" and t.dtype == torch.float32 \
                and torch.isfinite(t.sum()):  # (on an accelerator this would wait for the device)
            return  # nothing to divide, nothing non-finite: an inf or NaN makes the sum inf or NaN
            # (a finite sum that overflows falls through to the exact kernel below)
        if not fused_kernel_takes(t):
            note_non_finite_(flag, tensors)
            torch._foreach_mul_(tensors, self.inv_scale_on(device))
            return
        # GradScaler's fused kernel: checks each value before multiplying it by 1/scale
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self.inv_scale_on(device))

    def check_(self, tensors: List[torch.Tensor]) -> None:
        """Note any inf/NaN in dense ``tensors`` (one device and dtype) without dividing them.

        On CPU the large ones (:data:`SUM_NUMEL`) are read first: by fxamp's kernel in one call (no op, whatever
        their number), else by their sums (an inf or NaN makes a sum inf or NaN); an inf or NaN, or a non-finite
        sum of finite values, sends them to the exact kernel (multiplying by 1) with the small ones.
        """
        if not tensors:
            return
        device = tensors[0].device
        if device.type == "cpu":  # (on an accelerator a read would wait for the device)
            large = [t for t in tensors if t.numel() >= SUM_NUMEL]
            finite = large and native.all_finite(large)
            if finite is None:
                finite = bool(torch.isfinite(torch.stack([t.sum() for t in large])).all())
            if finite:
                tensors = [t for t in tensors if t.numel() < SUM_NUMEL]
                if not tensors:
                    return
        if not fused_kernel_takes(tensors[0]):
            note_non_finite_(self.flag_on(device), tensors)
            return
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, self.flag_on(device), torch.ones((), device=device))

    def flag_on(self, device: torch.device) -> torch.Tensor:
        """The flag of ``device`` (0.0 until an inf/NaN is found there): float32, 0-dim, on ``device``."""
        flag = self.flags.get(device)
        if flag is None:
            flag = self.flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        return flag

    def found(self) -> torch.Tensor:
        """1.0 if any tensor held an inf/NaN, else 0.0: a float32 0-dim CPU tensor."""
        flags = [flag.to("cpu") for flag in self.flags.values()]
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


def fused_kernel_takes(t: torch.Tensor) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` has a kernel for ``t``: on CPU every
    floating dtype; on CUDA (and other accelerators) float16, float32 and float64, not bfloat16."""
    return t.device.type == "cpu" or t.dtype in (torch.float16, torch.float32, torch.float64)


def note_non_finite_(flag: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    """Set ``flag`` (a float32 0-dim tensor on the tensors' device) to 1 if any of ``tensors`` holds an
    inf or NaN, without waiting for the device.

    For dtypes the fused kernel lacks (bfloat16 on CUDA).  Exact: the 1-norms are summed in float64,
    where the sum of even a billion of the largest bfloat16/float16 values (3.4e38 each) is finite, so
    a norm is non-finite exactly when an element is.
    """
    try:
        norms = torch._foreach_norm(tensors, 1, dtype=torch.float64)
    except (TypeError, RuntimeError):  # pragma: no cover - torch without _foreach_norm's dtype
        norms = [t.abs().sum(dtype=torch.float64) for t in tensors]
    bad = torch.logical_not(torch.isfinite(torch.stack(list(norms)))).any().to(flag.dtype)
    torch.maximum(flag, bad, out=flag)


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` is CUDA with a runtime (streams, pinned memory): not a fake tensor's "cuda" (tests)."""
    return device.type == "cuda" and torch.cuda.is_available()


class OnDevices:
    """A float32 0-dim CPU ``value`` (the scale, or ``1/scale``) and its copy on each device,
    made at its first use there: to CUDA from pinned memory, so the host does not wait for the stream to reach the
    copy (a copy from pageable memory would: a hidden synchronization).  The scaler makes a new one when its scale
    moves; do not modify what it gives."""

    __slots__ = ("value", "copies")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value
        self.copies: Dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        t = self.copies.get(device)
        if t is None:
            if has_streams(device):  # (a fresh pinned buffer: nothing reuses it while the copy is in flight)
                t = self.value.pin_memory().to(device, non_blocking=True)
            else:
                t = self.value.to(device)
            self.copies[device] = t
        return t


def multiplier_of(flags: FoundInf, coef: Optional[torch.Tensor]) -> Multiplier:
    """What a segmented step multiplies the copied gradients by: ``1/scale`` (``flags``') times the clip factor
    ``coef`` (None: no clip), or None for 1.  Made here, so an executor calling it calls nothing above it."""
    if coef is None:
        return None if flags.unit else flags.inv_scale_on
    if flags.unit:
        return lambda device: coef.to(device)
    return lambda device: flags.inv_scale_on(device) * coef.to(device)


# -- the stage: the gradients where the executor reads them, checked ------------------------------------

def unscale(plan: Plan, flags: FoundInf) -> int:
    """Put the unscaled gradients of every master in its ``.grad`` (the plain step) and unscale the
    float32 parameters' in place, checking each for inf/NaN; return how many gradients were checked."""
    return sum(unscale_masters(b, flags) for b in plan.buckets) + sum(unscale_own(ps, flags) for ps in plan.own)


def check_in_place(plan: Plan, flags: FoundInf) -> int:
    """The check of a segmented step: the low-precision gradients where they are (the float32
    parameters' unscaled in place as usual); the masters get no gradient here."""
    checked = 0
    for bucket in plan.buckets:
        grads = [p.grad for p in bucket.lows if p.grad is not None]
        flags.check_(grads)
        checked += len(grads)
    return checked + sum(unscale_own(ps, flags) for ps in plan.own)


def unscale_masters(bucket: Bucket, flags: FoundInf) -> int:
    """Put the unscaled low-precision gradients of ``bucket`` in its masters' ``.grad``; return how many.

    The masters' gradient tensors are overwritten, not accumulated into: the low-precision ones
    already hold the sum over every backward since zero_grad().  The check reads the float32
    copies before unscaling them (GradScaler's order), so it sees exactly the low-precision values.
    """
    grads = [p.grad for p in bucket.lows]
    allocate(bucket)
    for m, g in zip(bucket.masters, bucket.grads):
        if m.grad is not g:
            m.grad = g
    try:  # the usual case, every gradient dense: a few kernels, no per-parameter work
        copy_in(bucket, grads, flags.unscale_and_check_)
    except (TypeError, RuntimeError):  # a None gradient (TypeError) or a sparse one: pair by pair
        # (the segments checked so far are copied and checked again: the same values, the same verdict)
        return unscale_pairs(bucket, grads, flags)
    return len(grads)


def unscale_pairs(bucket: Bucket, grads: List[Optional[torch.Tensor]], flags: FoundInf) -> int:
    """:func:`unscale_masters` when some parameter got no gradient (its master gets none) or a sparse one."""
    dst, src, values = [], [], []
    for master, buf, g in zip(bucket.masters, bucket.grads, grads):
        if g is None:
            master.grad = None  # not stepped, as the plain optimizer would not step it
        elif g.is_sparse:
            master.grad = g.coalesce().float()
            values.append(master.grad._values())  # the values of a sparse tensor: a view, unscaled in place
        else:  # bound to ``buf`` already
            dst.append(buf)
            src.append(g)
    if dst:
        torch._foreach_copy_(dst, src)  # raises what copy_in() ran into, if that was something else
    if dst or values:
        flags.unscale_and_check_(dst + values)
    return len(dst) + len(values)


def unscale_own(params: List[torch.Tensor], flags: FoundInf) -> int:
    """Unscale, in place, the gradients of float32 (or complex) parameters stepped directly (one device and dtype).

    Sparse and missing gradients are looked for first, not caught as in unscale_masters: the
    kernel unscales in place, so failing part way would leave some gradients unscaled.
    """
    grads = [p.grad for p in params]
    if not all(g is not None and not g.is_sparse for g in grads):  # (values of sparse gradients: views)
        grads = [g._values() if g.is_sparse else g for g in grads if g is not None]
    # (complex parameters, a spectral layer's (FNO): their real and imaginary parts, as a real view)
    grads = [torch.view_as_real(g) if g.is_complex() else g for g in grads]
    if grads:
        flags.unscale_and_check_(grads)
    return len(grads)


def allocate(bucket: Bucket) -> None:
    """Allocate ``bucket``'s gradient segments and their views (:class:`~fxamp.training.plan.Bucket`: from
    ``unscale_()`` to ``zero_grad()``), unless they are still allocated."""
    if bucket.grads is None:
        bucket.flats, bucket.grads = [], []
        for first, end, strides in bucket.segments:
            flat, views = flat_grads(bucket.masters[first:end], strides)
            bucket.flats.append(flat)
            bucket.grads.extend(views)


def copy_in(bucket: Bucket, grads: List[torch.Tensor], check: Callable[[List[torch.Tensor]], None]) -> None:
    """Copy dense low-precision gradients, in the order of ``bucket.lows``, into its masters' ``grads``.

    Segment by segment, each passed to ``check`` right after it is written, while it is still
    in cache (a 16 MiB segment; checking all of an 82 MB buffer afterwards reads it from memory).
    """
    for k, (first, end, _) in enumerate(bucket.segments):
        if k == 0 and bucket.cats:
            for run, out in bucket.cats:
                torch.cat(grads[run], out=out)
            bucket.flats[0][:bucket.staging.numel()].copy_(bucket.staging)
            first = bucket.ncat
        if first < end:  # one call for the segment's list, not one per tensor
            torch._foreach_copy_(bucket.grads[first:end], grads[first:end])
        check([bucket.flats[k]])


def which_overflowed(params: Iterator[torch.Tensor], low_of: Callable[[torch.Tensor], Optional[torch.Tensor]],
                     in_place: bool) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The parameters whose gradients were checked, and which of them hold an inf/NaN: the masters'
    gradients, or with ``in_place`` (a segmented step) their low-precision parameters'."""
    checked, grads = [], []
    for p in params:
        low = low_of(p)
        g = low.grad if in_place and low is not None else p.grad
        if g is not None:
            checked.append(p)
            grads.append(g)
    maxabs = max_abs([g._values() if g.is_sparse else g for g in grads])  # (uncoalesced values too)
    return checked, ~torch.isfinite(maxabs)



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
    emptied; its float32 parameters stepped; its masters with a gradient offered to the workspace's executors
    (with a workspace ``ws``: :meth:`Lean.executors`), the rest unscaled into one reused segment (``segments``:
    the plan's, kept between steps with each run's views, ``runs`` then the plan's; else one for this call),
    stepped (:func:`run_step`) and refreshed.  Every group's ``params`` list is restored, even on error."""

    __slots__ = ("ws", "segments", "lean")

    def __init__(self, ws: Optional[Lean] = None, segments: Optional[Segments] = None) -> None:
        self.ws, self.segments = ws, segments
        self.lean = () if ws is None else ws.executors()

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
            if keep:
                segments.release()
        return []

    def _offer(self, optimizer: Any, run: Run, multiplier: Multiplier) -> Optional[Run]:
        """What the lean executors leave of ``run`` (None: they took it all).  What ``lean_step.LeanKernel`` left of
        a run it took part of goes to the segment: a run of several masters is never chunked."""
        for executor in self.lean:
            left = executor.step(optimizer, [run], multiplier)
            if not left or left[0] is not run:
                return left[0] if left else None
        return run

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
    return part_of(run, present) if present else None


def part_of(run: Run, keep: Sequence[int]) -> Run:
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


# -- a segmented step's runs: one reused segment per device -------------------------------------------

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

    def release(self) -> None:
        """Give an accelerator's segments' memory back between steps (their views stay, holding none until the
        next :meth:`views_for`): a segment is 128 MiB of float32 there (``ACCELERATOR_SEGMENT_NUMEL``), ~1 byte
        a parameter at GPT-2 small that the H200's allocator counted after every step; its caching allocator
        hands the same block back at the next step.  A CPU's (4 MiB) is kept: malloc would fault its pages in
        again."""
        for flat in self.flats.values():
            if flat.device.type != "cpu":
                flat.untyped_storage().resize_(0)

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
        else:
            storage, nbytes = flat.untyped_storage(), flat.numel() * flat.element_size()
            if storage.nbytes() < nbytes:  # (released after the last step: the kept views see the new memory)
                storage.resize_(nbytes)
        views = flat_grads(masters, strides, flat)[1]
        if key is not None:
            self.views[key] = views
        return views


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor or parameter, not a subclass such as DTensor (asked without ``t.data``,
    which is a detach: one dispatched op per master and step)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or type(t.data) is torch.Tensor


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
    never segmented either).  ``skip``: stepped already (:meth:`fxamp.training.lean_step.LeanStep.step_native`)."""
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
