"""The step engine: plan runs -> check -> per run: unscale into a segment, step, refresh.

``MixedPrecisionOptimizer.step()`` (:mod:`fxamp.training.optimizer`) is this engine; the
optimizer keeps the masters and the public API, :mod:`fxamp.training.loss_scale` the scale, the
check and the stages.  A step's path through the files is optimizer -> step (this module) ->
loss_scale, and no other: a fourth only under an initialized ``torch.distributed``
(:mod:`fxamp.training.distributed`: the flag's all-reduce) or with ``compile_step``
(:mod:`fxamp.training.kernels`: the compiled executor of the runs).  One step, in order::

    plan     the step's tensor lists (Plan: per (device, dtype) a Bucket of low-precision
             parameters and their float32 masters; the float32 parameters stepped directly;
             the runs of a segmented step), built once per layout of ``param_groups``
    check    every gradient for inf/NaN (FoundInf, one fused kernel per device and dtype), the
             verdict agreed across ranks and read on the host or left on the device
             (:func:`fxamp.training.loss_scale.agree`: the one place that decides)
    per run  copy the run's low-precision gradients into a float32 segment divided by the
             scale, step the inner optimizer on the run's masters (or the compiled executor
             of :mod:`fxamp.training.kernels`), refresh the low weights (``torch._foreach_copy_``)

The runs take one of two shapes:

* **one run for every master** (the plain step): ``unscale_()`` gives every master its float32
  gradient at once, as views into a few flat segments of the Bucket (``GRAD_SEGMENT_NUMEL``;
  on CPU the small ones gathered by ``torch.cat`` first); the inner optimizer steps once, and
  each bucket's low weights are refreshed.  Any optimizer, hooks and all.
* **segmented** (:func:`step_runs`): on a large model (``RELEASE_MIN_BYTES`` of float32 gradients)
  with a stock per-parameter torch optimizer (:func:`steps_per_parameter`) and no ``unscale_()``
  before ``step()``, the low-precision gradients are checked where they are, then each run (one
  param group, one device, at most ``SEGMENT_NUMEL`` elements) is unscaled into one reused
  segment, stepped (every group's "params" list but the run's emptied for the call) and
  refreshed.  The step's peak holds one segment (4 MiB, or the largest master's gradient)
  instead of a float32 gradient for every master.  Bitwise the plain step: each parameter is
  updated from its own gradient and state with its group's hyperparameters
  (tests/training/test_optimizer.py).  After it the masters hold no ``.grad``.

``compile_step=True`` is a second executor for the runs (:meth:`fxamp.training.kernels.Kernels.step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.optim.optimizer as _torch_optimizer
from torch._utils import _unflatten_dense_tensors

from .distributed import max_abs
from .lean import run_step
from .loss_scale import DeviceFlag, FoundInf

__all__ = ["PER_PARAMETER", "SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "GRAD_SEGMENT_NUMEL", "CAT_NUMEL",
           "RELEASE_MIN_BYTES", "DECIDE_ON", "segment_numel_for", "Run", "Bucket", "Plan", "Check", "steps_per_parameter",
           "plan_runs", "cut_runs", "step_runs", "flat_grads", "grad_strides", "unscale", "check_in_place",
           "clip_in_place", "clip_factor", "step", "refresh", "which_overflowed"]

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


#: torch.optim classes whose step updates each parameter from its own gradient and state alone
#: (LBFGS needs a closure and all parameters; SparseAdam sparse gradients, which take the other path)
PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name))


def steps_per_parameter(optimizer: Any) -> bool:
    """Whether stepping ``optimizer`` on some parameters at a time is the same as one step on all.

    Only the exact classes of :data:`PER_PARAMETER` (a subclass may override ``step``), and only
    without step hooks, which would run once per run instead of once per step.
    """
    if type(optimizer) not in PER_PARAMETER:
        return False
    # torch keeps step hooks in these dicts (per instance, and global); it has no public query
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))
    return not any(hooks)


Strides = Optional[Tuple[Tuple[int, ...], ...]]


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
        return flat, list(_unflatten_dense_tensors(flat[:numel], list(masters)))  # one C++ call
    views, offset = [], 0
    for m, stride in zip(masters, strides):
        views.append(flat.as_strided(m.shape, stride, flat.storage_offset() + offset))
        offset += m.numel()
    return flat, views


def _run(group: int, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Run:
    masters = [m for _, m in pairs]
    return Run(group, pairs=tuple(pairs), numel=sum(m.numel() for m in masters), strides=grad_strides(masters))


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


def step_runs(optimizer: Any, runs: Sequence[Run], inv_scale_on: Optional[Callable[[torch.device], torch.Tensor]],
              ws: Any = None) -> None:
    """Step ``optimizer`` run by run (see the module docstring); ``inv_scale_on(device)`` is ``1/scale``
    there, or None when the scale is 1; ``ws``: the :class:`~fxamp.training.lean.Workspace` of lean
    masters, entered and left around each run.  Every group's ``params`` list is restored, even on error."""
    groups = optimizer.param_groups
    lists = [g["params"] for g in groups]
    buffers: Dict[torch.device, torch.Tensor] = {}  # one segment per device, reused by every run
    try:
        for run in runs:
            for gi, group in enumerate(groups):
                group["params"] = [] if gi != run.group else list(run.own) if run.own else [m for _, m in run.pairs]
            if run.own:
                optimizer.step()
                continue
            present = [i for i, (low, _) in enumerate(run.pairs) if low.grad is not None]
            if not present:
                for _, m in run.pairs:
                    m.grad = None  # not stepped, as a plain optimizer would not (none left by an unscale_())
                continue
            if ws is not None and ws.chunks(run, optimizer):  # a large lean master: a slice at a time
                ws.step_chunked(optimizer, run, inv_scale_on)
                continue
            strides = run.strides
            if len(present) < len(run.pairs):
                for low, m in run.pairs:
                    if low.grad is None:
                        m.grad = None
                strides = None if strides is None else tuple(strides[i] for i in present)
            lows = [run.pairs[i][0] for i in present]
            masters = [run.pairs[i][1] for i in present]
            device = masters[0].device
            if device not in buffers:
                buffers[device] = torch.empty(max(r.numel for r in runs if r.pairs and r.pairs[0][1].device == device
                                                  and not (ws is not None and ws.chunks(r, optimizer))),
                                              dtype=masters[0].dtype, device=device)
            with torch.no_grad():
                flat, views = flat_grads(masters, strides, buffers[device])
                torch._foreach_copy_(views, [low.grad for low in lows])
                if inv_scale_on is not None:
                    torch._foreach_mul_(views, inv_scale_on(flat.device))
            for m, v in zip(masters, views):
                m.grad = v
            try:
                run_step(optimizer, ws, masters, lambda: torch._foreach_copy_(lows, masters))
            finally:
                for m in masters:
                    m.grad = None
                del flat, views
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params


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


class Plan:
    """What a step touches, as lists ready for foreach calls; valid while ``param_groups`` keep their layout.

    buckets:   low-precision parameters and their masters, per (device, dtype) of the former
    own:       the float32 (or float64) parameters the inner optimizer steps directly, per (device, dtype)
    layout:    each group's ``params`` list and its length when the plan was built (see ``matches``)
    runs:      a segmented step's runs, planned at the first one
    decide_on: the device the overflow decision stays on, or None (see :func:`decides_on`)
    fuse:      whether the step uses ``compile_step``'s kernels (decided once, by the optimizer)

    A group added to the inner optimizer, or a ``params`` list replaced or resized, is noticed at
    the next ``unscale_()``; a parameter swapped into a list in place is not.
    """

    __slots__ = ("buckets", "own", "layout", "runs", "decide_on", "fuse")

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
        self.runs: Optional[List[Run]] = None
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


class Check:
    """One step's check, from ``unscale_()`` (or the check of a segmented step) to ``step()``.

    flags:    the :class:`FoundInf` the gradients were checked (and unscaled) with
    in_place: the low-precision gradients were checked where they are: a segmented step
    coef:     the clip factor ``clip_grad_norm_()`` chose for a segmented step, or None
    verdict:  the agreed decision: a bool read on the host, or a :class:`DeviceFlag` left on the device
    update:   whether the optimizer updates the scale when a device-decided step settles
    """

    __slots__ = ("flags", "in_place", "coef", "verdict", "update")

    def __init__(self, flags: FoundInf, in_place: bool, verdict: Union[bool, DeviceFlag]) -> None:
        self.flags, self.in_place, self.verdict = flags, in_place, verdict
        self.coef: Optional[torch.Tensor] = None
        self.update = False

    @property
    def on_device(self) -> bool:
        return isinstance(self.verdict, DeviceFlag)

    def multiplier(self) -> Optional[Callable[[torch.device], torch.Tensor]]:
        """What a segmented step multiplies the copied gradients by: ``1/scale`` times the clip factor, or None for 1."""
        flags, coef = self.flags, self.coef
        if coef is None:
            return None if flags.unit else flags.inv_scale_on
        if flags.unit:
            return lambda device: coef.to(device)
        return lambda device: flags.inv_scale_on(device) * coef.to(device)


# -- check --------------------------------------------------------------------------------------

def unscale(plan: Plan, flags: FoundInf) -> int:
    """Put the unscaled gradients of every master in its ``.grad`` (the plain step) and unscale the
    float32 parameters' in place, checking each for inf/NaN; return how many gradients were checked."""
    return sum(_unscale_masters(b, flags) for b in plan.buckets) + sum(_unscale_own(ps, flags) for ps in plan.own)


def check_in_place(plan: Plan, flags: FoundInf) -> int:
    """The check of a segmented step: the low-precision gradients where they are (the float32
    parameters' unscaled in place as usual); the masters get no gradient here."""
    checked = 0
    for bucket in plan.buckets:
        grads = [p.grad for p in bucket.lows if p.grad is not None]
        flags.check_(grads)
        checked += len(grads)
    return checked + sum(_unscale_own(ps, flags) for ps in plan.own)


def clip_in_place(plan: Plan, flags: FoundInf, norm_type: float, exact: bool
                  ) -> Tuple[int, List[torch.Tensor], List[torch.Tensor]]:
    """:func:`check_in_place` that also takes the norms of the true gradients (the low-precision
    ones in float32, divided by the scale); return how many were checked, the norms, and the float32
    parameters' gradients (to clip with :func:`clip_factor` once the check is decided).  ``exact``:
    check every low-precision gradient (the host does not read the norms), not only when a norm
    is non-finite."""
    norms: List[torch.Tensor] = []
    own: List[torch.Tensor] = []
    checked = 0
    for bucket in plan.buckets:
        grads = [p.grad for p in bucket.lows if p.grad is not None]
        if not grads:
            continue
        n = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
        n = n * flags.inv_scale_on(n.device)  # a norm scales with its tensor (the scale: a power of 2)
        if exact or not bool(torch.isfinite(n).all()):  # an inf/NaN, or finite values whose norm overflowed
            flags.check_(grads)
        norms.append(n)
        checked += len(grads)
    for params in plan.own:
        checked += _unscale_own(params, flags)  # unscaled in place, as unscale_() does
        grads = [p.grad._values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
        if grads:
            norms.append(torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)))
            own.extend(grads)
    return checked, norms, own


def clip_factor(norms: List[torch.Tensor], own: List[torch.Tensor], max_norm: float, norm_type: float,
                error_if_nonfinite: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The total norm of :func:`clip_in_place`'s ``norms`` and torch's clip factor, which clips ``own``
    here (the masters' gradients are clipped by :func:`step`)."""
    total = torch.linalg.vector_norm(torch.cat([n.to(norms[0].device) for n in norms]), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
            "clipped (with loss scaling an overflow is expected now and then: pass "
            "error_if_nonfinite=False and let step() skip)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_ formula
    if own:
        torch._foreach_mul_(own, coef.to(own[0].device))
    return total, coef


def _unscale_masters(bucket: Bucket, flags: FoundInf) -> int:
    """Put the unscaled low-precision gradients of ``bucket`` in its masters' ``.grad``; return how many.

    The masters' gradient tensors are overwritten, not accumulated into: the low-precision ones
    already hold the sum over every backward since zero_grad().  The check reads the float32
    copies before unscaling them (GradScaler's order), so it sees exactly the low-precision values.
    """
    grads = [p.grad for p in bucket.lows]
    bucket.allocate()
    for m, g in zip(bucket.masters, bucket.grads):
        if m.grad is not g:
            m.grad = g
    try:  # the usual case, every gradient dense: a few kernels, no per-parameter work
        bucket.copy_in(grads, flags.unscale_and_check_)
    except (TypeError, RuntimeError):  # a None gradient (TypeError) or a sparse one: pair by pair
        # (the segments checked so far are copied and checked again: the same values, the same verdict)
        return _unscale_pairs(bucket, grads, flags)
    return len(grads)


def _unscale_pairs(bucket: Bucket, grads: List[Optional[torch.Tensor]], flags: FoundInf) -> int:
    """:func:`_unscale_masters` when some parameter got no gradient (its master gets none) or a sparse one."""
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


def _unscale_own(params: List[torch.Tensor], flags: FoundInf) -> int:
    """Unscale, in place, the gradients of float32 parameters stepped directly (one device and dtype).

    Sparse and missing gradients are looked for first, not caught as in _unscale_masters: the
    kernel unscales in place, so failing part way would leave some gradients unscaled.
    """
    grads = [p.grad for p in params]
    if not all(g is not None and not g.is_sparse for g in grads):  # (values of sparse gradients: views)
        grads = [g._values() if g.is_sparse else g for g in grads if g is not None]
    if grads:
        flags.unscale_and_check_(grads)
    return len(grads)


# -- per run: unscale, step, refresh --------------------------------------------------------------

def step(optimizer: Any, plan: Plan, check: Check, low_of: Callable[[torch.Tensor], Optional[torch.Tensor]],
         executor: Optional[Callable[..., None]] = None, ws: Any = None) -> None:
    """Step the inner optimizer on a checked, clean (or device-decided) step, and refresh the low weights.

    Plain (``check.in_place`` False): the masters hold their float32 gradients, one ``optimizer.step()``.
    Segmented: the runs of :func:`plan_runs`, through :func:`step_runs`, or ``executor``
    (:meth:`fxamp.training.kernels.Kernels.step`) with ``step_runs`` for what it does not take.  ``ws``:
    lean masters' workspace.  A device-decided step hands the flag to the inner optimizer, as
    GradScaler does (``found_inf``; ``grad_scale`` None): its fused kernel skips."""
    found = check.verdict.flag if check.on_device else None
    if found is not None:
        optimizer.found_inf, optimizer.grad_scale = found, None
    try:
        if not check.in_place:  # (a skip on the device left the masters as they were: the same rounding)
            return run_step(optimizer, ws, [m for b in plan.buckets for m in b.masters], lambda: refresh(plan),
                            steps_per_parameter(optimizer))
        segment_numel = segment_numel_for(plan.devices())
        if plan.runs is None:
            plan.runs = plan_runs(optimizer.param_groups, low_of, segment_numel)
        scale_on = check.multiplier()
        if executor is None:
            step_runs(optimizer, plan.runs, scale_on, ws)
        else:
            executor(plan.runs, scale_on, lambda runs: step_runs(optimizer, runs, scale_on),
                     segment_numel=segment_numel, found=found)
    finally:
        if found is not None:
            del optimizer.found_inf, optimizer.grad_scale


def refresh(plan: Plan) -> None:
    """Round the masters into the low-precision parameters: one ``_foreach_copy_`` per (device, dtype)."""
    with torch.no_grad():
        for bucket in plan.buckets:
            torch._foreach_copy_(bucket.lows, bucket.masters)


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
