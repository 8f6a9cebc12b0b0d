"""The step engine: plan runs -> check -> per run: unscale into a segment, step, refresh.

``MixedPrecisionOptimizer.step()`` (:mod:`fxamp.training.optimizer`) is this engine; the
optimizer keeps the masters and the public API, :mod:`fxamp.training.loss_scale` the scale, the
check and the stages.  A step's path through the files is optimizer -> step (this module) ->
loss_scale, and no other: a fourth only under an initialized ``torch.distributed``
(:mod:`fxamp.training.distributed`: the flag's all-reduce) or with ``compile_step``
(:mod:`fxamp.training.kernels`: the compiled executor of the runs).  One step, in order::

    plan     the step's tensor lists (:mod:`fxamp.training.plan`'s Plan: per (device, dtype) a
             Bucket of low-precision parameters and their float32 masters; the float32 parameters
             stepped directly; the runs of a segmented step), built once per layout of ``param_groups``
    check    every gradient for inf/NaN (FoundInf, one fused kernel per device and dtype), the
             verdict agreed across ranks and read on the host or left on the device
             (:func:`fxamp.training.loss_scale.agree`: the one place that decides)
    per run  copy the run's low-precision gradients into a float32 segment divided by the
             scale, step the inner optimizer on the run's masters (on a CPU a stock Adam/AdamW/SGD
             steps them with ``fused=True``: :func:`fxamp.training.lean.step_inner`; or the
             compiled executor of :mod:`fxamp.training.kernels`), refresh the low weights
             (``torch._foreach_copy_``)

The runs take one of two shapes:

* **one run for every master** (the plain step): ``unscale_()`` gives every master its float32
  gradient at once, as views into a few flat segments of the Bucket (``GRAD_SEGMENT_NUMEL``;
  on CPU the small ones gathered by ``torch.cat`` first); the inner optimizer steps once, and
  each bucket's low weights are refreshed.  Any optimizer, hooks and all.
* **segmented** (:func:`step_runs`): on a large model (``RELEASE_MIN_BYTES`` of float32 gradients)
  with a stock per-parameter torch optimizer (:func:`steps_per_parameter`) and no ``unscale_()``
  before ``step()``, the low-precision gradients are checked where they are, then each run (one
  param group, one device, at most ``SEGMENT_NUMEL`` elements) is unscaled into one reused
  segment (kept by the plan with each run's views: :class:`~fxamp.training.plan.Segments`, so a
  step's ops grow with its runs, not its tensors), stepped (every group's "params" list but the
  run's emptied for the call) and refreshed.  The step's peak holds one segment (4 MiB, or the
  largest master's gradient) instead of a float32 gradient for every master.  A lean master that fxamp's CPU kernel steps
  (:meth:`fxamp.training.lean.Workspace.step_native`) takes no segment: the kernel reads its
  low-precision gradient where it is, times 1/scale.  Bitwise the plain step: each parameter is
  updated from its own gradient and state with its group's hyperparameters
  (tests/training/test_optimizer.py).  After it the masters hold no ``.grad``.

``compile_step=True`` is a second executor for the runs (:meth:`fxamp.training.kernels.Kernels.step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.optim.optimizer as _torch_optimizer

from .distributed import max_abs
from .lean import run_step
from .loss_scale import DeviceFlag, FoundInf
from .plan import Bucket, Plan, Segments, Strides, flat_grads, grad_strides

__all__ = ["PER_PARAMETER", "SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "segment_numel_for", "Run", "Check",
           "steps_per_parameter", "plan_runs", "cut_runs", "step_runs", "unscale", "check_in_place",
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
              ws: Any = None, segments: Optional[Segments] = None) -> None:
    """Step ``optimizer`` run by run (see the module docstring); ``inv_scale_on(device)`` is ``1/scale``
    there, or None when the scale is 1; ``ws``: the :class:`~fxamp.training.lean.Workspace` of lean
    masters, entered and left around each run; ``segments``: the plan's, kept between steps with each
    run's views (``runs`` then are the plan's runs), else one segment per device for this call alone.
    Every group's ``params`` list is restored, even on error."""
    groups = optimizer.param_groups
    lists = [g["params"] for g in groups]
    keep = segments is not None
    if segments is None:  # one segment per device, reused by every run of this call
        segments = Segments(max((r.numel for r in runs), default=0))
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
            present = [i for i, (low, _) in enumerate(run.pairs) if low.grad is not None]
            if not present:
                for _, m in run.pairs:
                    m.grad = None  # not stepped, as a plain optimizer would not (none left by an unscale_())
                continue
            strides = run.strides
            key = index if keep and len(present) == len(run.pairs) else None  # views kept for a whole run only
            if len(present) < len(run.pairs):
                for low, m in run.pairs:
                    if low.grad is None:
                        m.grad = None
                strides = None if strides is None else tuple(strides[i] for i in present)
            lows = [run.pairs[i][0] for i in present]
            masters = [run.pairs[i][1] for i in present]
            device = masters[0].device
            if ws is not None:  # lean masters the CPU kernel steps from their low-precision gradients: no segment
                done = {id(m) for m in ws.step_native(optimizer, masters, grads=[low.grad for low in lows],
                                                      multiplier=None if inv_scale_on is None else inv_scale_on(device),
                                                      group=groups[run.group])}
                if done:
                    rest = [i for i, m in enumerate(masters) if id(m) not in done]
                    if not rest:
                        continue
                    lows, masters = [lows[i] for i in rest], [masters[i] for i in rest]
                    strides = None if strides is None else tuple(strides[i] for i in rest)
                    key = None
                if ws.chunks(run, optimizer):  # a large lean master: a slice at a time
                    ws.step_chunked(optimizer, run, inv_scale_on)
                    continue
            with torch.no_grad():
                views = segments.views_for(key, masters, strides, size_on(device))
                torch._foreach_copy_(views, [low.grad for low in lows])
                if inv_scale_on is not None:
                    torch._foreach_mul_(views, inv_scale_on(device))
            for m, v in zip(masters, views):
                m.grad = v
            try:
                run_step(optimizer, ws, masters, lambda: torch._foreach_copy_(lows, masters), kernel=False)
            finally:
                for m in masters:
                    m.grad = None
                del views
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params


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
            plan.segments = Segments(segment_numel)
        scale_on = check.multiplier()
        if executor is None:
            step_runs(optimizer, plan.runs, scale_on, ws, plan.segments)
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
