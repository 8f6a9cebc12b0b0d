"""``MixedPrecisionOptimizer``: float32 master weights and loss scaling around any torch optimizer.

::

    model = fxamp.convert(Net(), policy="O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    for x, y in loader:
        opt.zero_grad()
        opt.backward(loss_fn(model(x), y))   # backward of loss * scale
        opt.clip_grad_norm_(1.0)             # optional: the masters' true gradients, clipped
        stepped = opt.step()                 # False: skipped, an inf/NaN gradient

For every float16/bfloat16 parameter the inner optimizer steps a float32 master instead; after a
step the low-precision parameters are refreshed from the masters (``torch._foreach_copy_``).
Float32 parameters (O1, or norms under O2) are stepped directly.  The step's stages are the
scaler's (:class:`fxamp.training.loss_scale.Stage`, kept by the :class:`fxamp.LossScaler` for each
optimizer attached to it)::

    READY --backward()--> SCALED --unscale_()--> UNSCALED --step()--> READY
                            \\________________step()________________/

``step()`` copies low-precision gradients into the masters' float32 ``.grad``, divides every
gradient by the scale and checks it for inf/NaN in one fused kernel per (device, dtype), agrees
on the result across ranks, then steps or skips (a skip changes no weight, master or optimizer
state) and updates the scale (see :class:`fxamp.LossScaler`).  At scale 1 (bfloat16's default)
there is nothing to divide: a float32 CPU gradient buffer is only read for the check.  On a GPU
with a fused inner optimizer the result is not read on the host: the flag goes to the optimizer's
kernel, which skips on the device, and the host learns the outcome at the next iteration's start
(see :meth:`MixedPrecisionOptimizer.step`).

On a large model the step is bound by memory traffic, not by Python: besides the inner step, the
wrapper reads the low-precision gradients and writes their float32 copies, reads those for the
check, and reads the masters to write the low-precision weights.  The copy and the refresh are
the price of float32 masters under an optimizer that steps float32 tensors only.

The per-step overhead is a handful of foreach calls, not a Python loop over parameters: the
tensor lists are built once per layout of ``param_groups`` (:class:`_Plan`), and the masters'
float32 gradients are views into a few flat segments, allocated at each ``unscale_()`` (a few
allocations, not one per parameter) and overwritten with the sum the low-precision gradients
accumulated; ``zero_grad()`` unbinds and frees them (from 16 MiB on), so they take no memory during
the forward and backward, where activations peak (``release_grad_buffer=False`` keeps them; on CPU
a low-precision staging copy of the small gradients is kept either way).

On a large model (16 MiB of float32 gradients or more) a ``step()`` not preceded by ``unscale_()``
is *segmented* (:mod:`fxamp.training.step`) when the inner optimizer is a stock per-parameter
torch optimizer (SGD, Adam, AdamW, ...) without step hooks: the low-precision gradients are
checked where they are, then the masters are stepped a run of 4 MiB of float32 gradients at a
time, so a float32 gradient for every master never exists and the step adds 4 MiB (or the
largest master's gradient, stepped whole), not 4 bytes per parameter, to the peak.  It is
bitwise the same step; the masters hold no ``.grad`` after it.  ``clip_grad_norm_()`` clips
without leaving it (norms from the low-precision gradients, the factor applied in ``step()``);
``unscale_()`` gives every master its float32 gradient at once (to read them), and the plain step.

In the plain step on CPU, the small masters the wrapper made (at most ``_CAT_NUMEL`` elements)
are stored as the rows of one float32 tensor per (param group, trailing shape) and stepped as
that tensor (:mod:`fxamp.training.packed_step`): a CPU optimizer dispatches every op per tensor, so 400
small masters cost 400 times the dispatch of one.  Bitwise the same step, invisible outside it.

With ``compile_step=True`` (a stock AdamW, Adam or SGD, and masters large enough for it to pay:
``fused_step.FUSED_MIN_TOTAL``) the masters of at least ``fused_step.FUSED_MIN_NUMEL`` elements
skip all of that: after the same in-place check, one kernel, compiled by ``torch.compile`` and
called for 16 masters at a time, reads the low-precision gradient and writes the master, the
optimizer state and the low-precision weight (:mod:`fxamp.training.kernels`); the smaller masters and
the float32 parameters take the segmented step.

The wrapped optimizer may be any object that behaves like one (``param_groups``, ``state``,
``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``), e.g. a Lookahead or LARC wrapper.
``fxamp.initialize`` (in :mod:`fxamp.api`) builds this wrapper for a model it converts.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .distributed import all_reduce_overflow, all_reduce_overflow_on_device, reduces_on_device
from ..dtypes import LOW
from ..errors import OptimizerStateError
from ..info import policy_of
from .loss_scale import DeviceFlag, FoundInf, LossScaleConfig, LossScaler, Stage
from .kernels import Kernels, fusable, skips_on_device, step_fused, worth_fusing
from .packed_step import Pack, step_with_packs
from ..policy import Policy
from .step import (Run, Strides, flat_grads, grad_strides, plan_runs, segment_numel_for, step_runs,
                             steps_per_parameter)

__all__ = ["MixedPrecisionOptimizer", "StepResult", "check_optimizer"]

#: the parameter dtypes that get float32 masters
_FORMAT = 1
_STATE_KEYS = ("optimizer", "masters", "scaler", "skipped_steps", "format")
#: what the wrapper uses of the optimizer it wraps (a duck-typed one needs them all)
_OPTIMIZER_ATTRS = ("param_groups", "state", "step", "zero_grad", "state_dict", "load_state_dict")


class _StateDictError(ValueError, KeyError):
    """A checkpoint in the wrong format; a KeyError too, as a missing key was before (numpy's AxisError does the same)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


LossScaleArg = Union[str, float, None, LossScaleConfig, LossScaler]


#: On CPU, gradients of at most this many elements are gathered by ``torch.cat`` (one kernel per
#: trailing shape) into a low-precision staging tensor and converted to float32 by one kernel: a
#: copy per tensor is mostly dispatch for a small tensor (benchmarks/RESULTS.md, the 200-Linear
#: chain).  Larger ones are copied directly.  The masters of the gathered ones that the wrapper made
#: are stored and stepped as one tensor per cat run (:mod:`fxamp.training.packed_step`).
_CAT_NUMEL = 1024


#: The masters' float32 gradients are allocated in segments of at most this many elements (16 MiB),
#: each tensor in one segment (a larger tensor is a segment of its own).  The segments live from
#: ``unscale_()`` to ``zero_grad()``; a single buffer of a real model's size (82 MB for 20 M
#: parameters) is above glibc's largest mmap threshold (32 MiB), so it would be mapped afresh and
#: page-faulted in at every step (43 ms of CPU per step at that size, measured), while segments of
#: this size are recycled by the heap (5 ms: the copy itself), as a plain optimizer's gradients are.
_SEGMENT_NUMEL = 4 * 1024 * 1024

#: ``zero_grad()`` frees the masters' gradients of a (device, dtype) only from this many bytes on:
#: below, re-creating the views costs more than the memory is worth (200 Linear(16, 16): 400 views,
#: 1.3 ms of a 9.4 ms O2 training step, for 218 KB).
_RELEASE_MIN_BYTES = 16 * 1024 * 1024


class _Bucket:
    """Low-precision parameters of one (device, dtype), their masters, and the masters' gradients.

    The masters' gradients are views into a few flat segments (``_SEGMENT_NUMEL``), laid out with
    the strides ``empty_like(master)`` gives, as a fresh gradient would have: allocated at
    ``unscale_()`` (:meth:`allocate`, a few allocations per step, not one per parameter), bound as
    the masters' ``.grad`` and overwritten from the low-precision gradients, checked for inf/NaN in
    one kernel over the segments instead of one per tensor (400 kernels on a 200-layer MLP), and
    dropped by ``zero_grad()`` (:meth:`release`), so they take no memory during the
    forward and backward, where activations peak.

    The pairs are reordered: first the groups of small gradients gathered with ``torch.cat``
    (``cats``: a slice of the lists and the stretch of ``staging`` it fills, see ``_CAT_NUMEL``),
    whose float32 copies start the first segment (``flats[0]``); then the others.
    """

    __slots__ = ("device", "lows", "masters", "grads", "flats", "segments", "cats", "staging", "ncat", "nbytes",
                 "packs")

    def __init__(self, lows: List[torch.Tensor], masters: List[torch.Tensor],
                 pack_groups: Optional[List[Optional[int]]] = None) -> None:
        self.device = lows[0].device
        groups, rest = _cat_groups(lows, masters, pack_groups)
        pairs = [pair for _, group in groups for pair in group] + rest
        self.lows = [low for low, _ in pairs]
        self.masters = [m for _, m in pairs]
        self.ncat = sum(len(group) for _, group in groups)
        self.segments = _segments(self.masters, self.ncat)
        self.nbytes = sum(m.numel() * m.element_size() for m in self.masters)
        self.flats: Optional[List[torch.Tensor]] = None  # allocated by allocate(), dropped by release()
        self.grads: Optional[List[torch.Tensor]] = None  # the masters' gradients: views of ``flats``
        nstaged = sum(m.numel() for m in self.masters[:self.ncat])
        self.staging = torch.empty(nstaged, dtype=self.lows[0].dtype, device=self.device)
        self.cats: List[Tuple[slice, torch.Tensor]] = []
        start = offset = 0
        for _, group in groups:  # cat along dim 0 fills ``out``: the group's stretch of staging, as one tensor
            masters_of_group = [m for _, m in group]
            n = sum(m.numel() for m in masters_of_group)
            rows = sum(m.shape[0] for m in masters_of_group)
            out = self.staging[offset:offset + n].view(rows, *masters_of_group[0].shape[1:])
            self.cats.append((slice(start, start + len(group)), out))
            start, offset = start + len(group), offset + n
        self.packs = self.pack([key for key, _ in groups])

    def pack(self, pack_groups: List[Optional[int]]) -> List[Pack]:
        """A :class:`~fxamp.training.packed_step.Pack` for each cat run with a param group (None: not packed),
        its gradient the run's stretch of the first segment, which ``copy_in`` fills."""
        packs, offset = [], 0
        for (run, out), group in zip(self.cats, pack_groups):
            if group is not None:
                packs.append(Pack(group, self.masters[run], _RunGrad(self, run, offset, out.shape)))
            offset += out.numel()
        return packs

    def allocate(self) -> None:
        """Allocate the masters' gradient segments and their views, unless they are still allocated."""
        if self.grads is None:
            self.flats, self.grads = _flat_grads(self.masters, self.segments)

    def release(self) -> None:
        """Drop the segments if they are large (``_RELEASE_MIN_BYTES``); unbind the masters' ``.grad``
        first, or the segments stay alive through them."""
        if self.nbytes >= _RELEASE_MIN_BYTES:
            self.flats = self.grads = None

    def copy_in(self, grads: List[torch.Tensor], check: Optional[Callable[[List[torch.Tensor]], None]] = None) -> None:
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
            if check is not None:
                check([self.flats[k]])


class _RunGrad:
    """A pack's gradient: its cat run's stretch of the bucket's first float32 segment, or None when a
    member's ``.grad`` is not its view there (missing, sparse, or replaced since ``unscale_()``).
    An object, not a closure, so a deep copy of the wrapper reads its own bucket."""

    __slots__ = ("bucket", "run", "offset", "shape")

    def __init__(self, bucket: _Bucket, run: slice, offset: int, shape: torch.Size) -> None:
        self.bucket, self.run, self.offset, self.shape = bucket, run, offset, shape

    def __call__(self) -> Optional[torch.Tensor]:
        b = self.bucket
        if b.grads is None:
            return None
        for m, g in zip(b.masters[self.run], b.grads[self.run]):
            if m.grad is not g:
                return None
        return b.flats[0][self.offset:self.offset + self.shape.numel()].view(self.shape)


_Pair = Tuple[torch.Tensor, torch.Tensor]


def _cat_groups(lows: List[torch.Tensor], masters: List[torch.Tensor],
                pack_groups: Optional[List[Optional[int]]] = None
                ) -> Tuple[List[Tuple[Optional[int], List[_Pair]]], List[_Pair]]:
    """Split (low, master) pairs into the groups ``torch.cat`` gathers along dim 0, each with its
    pack group, and the rest.

    A group: two or more small (``_CAT_NUMEL``) CPU tensors with contiguous gradients, the same
    shape but for dim 0, and the same ``pack_groups`` entry: the param group of a master that may
    be packed (one pack steps one group's hyperparameters), None for the others.
    """
    groups: Dict[Tuple[Any, ...], List[_Pair]] = {}
    rest = []
    for i, (low, m) in enumerate(zip(lows, masters)):
        if (low.device.type == "cpu" and 0 < m.dim() and m.numel() <= _CAT_NUMEL
                and m.is_contiguous() and torch.empty_like(m, device="meta").is_contiguous()):
            key = None if pack_groups is None else pack_groups[i]
            groups.setdefault((key, tuple(m.shape[1:])), []).append((low, m))
        else:
            rest.append((low, m))
    gathered = [(key, group) for (key, _), group in groups.items() if len(group) > 1]
    rest += [pair for group in groups.values() if len(group) == 1 for pair in group]
    return gathered, rest


def _segments(masters: List[torch.Tensor], ncat: int) -> List[Tuple[int, int, Strides]]:
    """``(first, end, strides)`` per gradient segment: runs of consecutive masters of at most
    ``_SEGMENT_NUMEL`` elements in all (or one larger master); the ``ncat`` staged ones start the first.
    ``strides``: :func:`~fxamp.training.step.grad_strides` of the segment's masters."""
    bounds = [0]
    total = sum(m.numel() for m in masters[:ncat])  # the staged ones start the first segment
    for i in range(ncat, len(masters)):
        n = masters[i].numel()
        if i > bounds[-1] and total + n > _SEGMENT_NUMEL:
            bounds.append(i)
            total = 0
        total += n
    if bounds[-1] < len(masters):
        bounds.append(len(masters))
    return [(first, end, grad_strides(masters[first:end])) for first, end in zip(bounds, bounds[1:])]


def _flat_grads(masters: List[torch.Tensor], segments: List[Tuple[int, int, Strides]]
                ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The segments, and a view of them per master laid out as ``empty_like(master)`` would be."""
    flats, views = [], []
    for first, end, strides in segments:
        flat, group_views = flat_grads(masters[first:end], strides)
        flats.append(flat)
        views.extend(group_views)
    return flats, views


_UNKNOWN = object()

#: device types on which a step's overflow decision stays on the device (tests add "cpu" to run it here)
_DECIDE_ON = ("cuda",)


class _Deferred:
    """A step decided on the device: its :class:`DeviceFlag`, whether the gradients checked were the
    low-precision ones (a segmented step), and whether the wrapper updates the scale when it settles."""

    __slots__ = ("verdict", "in_place", "update")

    def __init__(self, verdict: DeviceFlag, in_place: bool) -> None:
        self.verdict, self.in_place, self.update = verdict, in_place, False


class StepResult:
    """What ``step()`` returns when the overflow decision stayed on the GPU: truthy if it stepped.

    ``bool()`` waits for the check (not for the step): ignore it, and the host never waits.
    """

    __slots__ = ("_verdict",)

    def __init__(self, verdict: DeviceFlag) -> None:
        self._verdict = verdict

    def __bool__(self) -> bool:
        return not bool(self._verdict)

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepResult(stepped={bool(self)})" if self._verdict.ready() else "StepResult(pending)"


class _Plan:
    """What a step touches, as lists ready for foreach calls; valid while ``param_groups`` keep their layout.

    buckets: low-precision parameters and their masters, per (device, dtype) of the former
    own:     the float32 (or float64) parameters the inner optimizer steps directly, per (device, dtype)
    layout:  each group's ``params`` list and its length when the plan was built (see ``matches``)

    A group added to the inner optimizer, or a ``params`` list replaced or resized, is noticed at
    the next ``unscale_()``; a parameter swapped into a list in place is not (nor was it by the
    master pairing, which happens when a group is bound).
    """

    __slots__ = ("buckets", "own", "layout", "runs", "decide_on", "packs", "fuse")

    def __init__(self, buckets: List[_Bucket], own: List[List[torch.Tensor]],
                 layout: List[Tuple[List[torch.Tensor], int]]) -> None:
        self.buckets = buckets
        self.packs = [pack for b in buckets for pack in b.packs]  # small masters stepped as one tensor
        self.own = own
        self.layout = layout
        self.runs: Optional[List[Run]] = None  # a segmented step's runs, planned at the first one
        #: the device the overflow decision stays on (see MixedPrecisionOptimizer._decide), or None
        self.decide_on: Any = _UNKNOWN
        #: whether the step uses compile_step's kernels (see MixedPrecisionOptimizer._fuses), or None
        self.fuse: Optional[bool] = None

    def devices(self) -> set:
        return {b.device for b in self.buckets} | {p.device for params in self.own for p in params}

    def matches(self, groups: List[Dict[str, Any]]) -> bool:
        """Same groups holding the same lists of the same lengths (the lists are held, so ids are not reused)."""
        if len(groups) != len(self.layout):
            return False
        for group, (params, n) in zip(groups, self.layout):
            if group["params"] is not params or len(params) != n:
                return False
        return True


def _stock_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.zero_grad`` is ``Optimizer.zero_grad`` (no subclass or instance override)."""
    return type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in vars(optimizer)


def _unbind_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _bind_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        if p.grad is not g:
            p.grad = g


def _all_dense(grads: Sequence[Optional[torch.Tensor]]) -> bool:
    for g in grads:
        if g is None or g.is_sparse:
            return False
    return True


def _unscale_masters_(bucket: _Bucket, flags: FoundInf) -> int:
    """Put the unscaled low-precision gradients of ``bucket`` in its masters' ``.grad``; return how many.

    The masters' gradient tensors are overwritten, not accumulated into: the low-precision ones
    already hold the sum over every backward since zero_grad().  The check reads the float32
    copies before unscaling them (GradScaler's order), so it sees exactly the low-precision values.
    """
    grads = [p.grad for p in bucket.lows]
    bucket.allocate()
    _bind_grads(bucket.masters, bucket.grads)
    try:  # the usual case, every gradient dense: a few kernels, no per-parameter work
        bucket.copy_in(grads, flags.unscale_and_check_)
    except (TypeError, RuntimeError):  # a None gradient (TypeError) or a sparse one: pair by pair
        # (the segments checked so far are copied and checked again: the same values, the same verdict)
        return _unscale_pairs_(bucket, grads, flags)
    return len(grads)


def _unscale_pairs_(bucket: _Bucket, grads: List[Optional[torch.Tensor]], flags: FoundInf) -> int:
    """:func:`_unscale_masters_` when some parameter got no gradient (its master gets none) or a sparse one."""
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


def _unscale_own_(params: List[torch.Tensor], flags: FoundInf) -> int:
    """Unscale, in place, the gradients of float32 parameters stepped directly (one device and dtype).

    Sparse and missing gradients are looked for first, not caught as in _unscale_masters_: the
    kernel unscales in place, so failing part way would leave some gradients unscaled.
    """
    grads = [p.grad for p in params]
    if not _all_dense(grads):  # (values of sparse gradients: views, unscaled in place)
        grads = [g._values() if g.is_sparse else g for g in grads if g is not None]
    if grads:
        flags.unscale_and_check_(grads)
    return len(grads)


def _multiplier(flags: FoundInf, coef: Optional[torch.Tensor]) -> Optional[Callable[[torch.device], torch.Tensor]]:
    """What a segmented step multiplies the copied gradients by: ``1/scale`` times the clip factor, or None for 1."""
    if coef is None:
        return None if flags.unit else flags.inv_scale_on
    if flags.unit:
        return lambda device: coef.to(device)
    return lambda device: flags.inv_scale_on(device) * coef.to(device)


def check_optimizer(optimizer: Any) -> None:
    """Raise TypeError unless ``optimizer`` is a torch optimizer or has what the wrapper uses of one."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError("optimizer is already a MixedPrecisionOptimizer; wrap the torch optimizer once")
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    missing = [name for name in _OPTIMIZER_ATTRS if not hasattr(optimizer, name)]
    if missing:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}, or an object like one "
            f"(a Lookahead or LARC wrapper); it lacks {', '.join(missing)}"
        )
    groups = optimizer.param_groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise TypeError(
            f"{type(optimizer).__name__}.param_groups must be a list of dicts each with a 'params' list, as "
            f"torch.optim.Optimizer's (the wrapper swaps float32 masters into those lists)"
        )


class MixedPrecisionOptimizer:
    """Wrap ``optimizer`` (any ``torch.optim.Optimizer``, or an object like one) with float32 masters and loss scaling.

    loss_scale:    ``"auto"`` (dynamic for float16, none for bfloat16 — read from ``model``'s fxamp
                   policy, else from the parameters' dtypes; dynamic when all are float32 and no
                   policy says otherwise), ``"dynamic"``, a number (static), ``None``/``"none"``, a
                   :class:`LossScaleConfig`, or a :class:`LossScaler` shared with other optimizers.
    model:         the module the parameters belong to: names parameters in reports and errors,
                   and is the default for :meth:`fp32_state_dict`.
    sync_overflow: all-reduce the overflow decision over ``process_group`` when torch.distributed
                   is initialized, so every rank steps or skips together.
    release_grad_buffer: free the masters' float32 gradients at ``zero_grad()`` (the default), so
                   they exist only from ``unscale_()``/``step()`` to ``zero_grad()``, not while the
                   forward and backward build up activations; only from 16 MiB of them per
                   (device, dtype) on: re-creating hundreds of small views costs more than it
                   saves.  False keeps them allocated between steps (4 bytes per low-precision
                   parameter, no allocation per step) and never segments the step (below).
    compile_step:  step the masters of a stock ``torch.optim.AdamW``, ``Adam`` or ``SGD`` with a kernel
                   compiled by ``torch.compile`` that reads each low-precision gradient and writes the
                   low-precision weight in the same pass as the update (:mod:`fxamp.training.kernels`): no
                   float32 gradient at all, and about 28 instead of 40 bytes of memory traffic per
                   parameter for AdamW.  The first step compiles (10-30 s on 2 CPU cores; cached on
                   disk by inductor).  Only where it pays: when the masters the kernels would take
                   hold ``fused_step.FUSED_MIN_TOTAL`` elements (0.25 M for Adam/AdamW, 0.5 M for
                   SGD, 2-3 M for torch's fused ones, whose own step is already one pass),
                   else the step is the one without ``compile_step`` and nothing is compiled.
                   With Adam/AdamW the overflow decision stays on the device where it would without
                   (a fused inner optimizer on one CUDA device); SGD's is read on the host.  Not
                   bitwise the inner optimizer's step (a few float32 ulps on the masters).  Raises
                   ValueError for another optimizer or an option the kernels lack (amsgrad,
                   capturable, differentiable).

    The wrapper does not patch ``optimizer``: it replaces float16/bfloat16 parameters in its
    ``param_groups`` by float32 masters (moving any existing state), so LR schedulers built on
    ``optimizer`` (``opt.optimizer``) keep working.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        loss_scale: LossScaleArg = "auto",
        model: Optional[nn.Module] = None,
        sync_overflow: bool = True,
        process_group: Optional[Any] = None,
        release_grad_buffer: bool = True,
        compile_step: bool = False,
    ) -> None:
        check_optimizer(optimizer)
        if compile_step:
            why = fusable(optimizer)
            if why is not None:
                raise ValueError(f"compile_step=True: {why}; pass compile_step=False to step it as it is")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
        self.optimizer = optimizer
        self.model = model
        self.sync_overflow = bool(sync_overflow)
        self.process_group = process_group
        self.release_grad_buffer = bool(release_grad_buffer)
        self.compile_step = bool(compile_step)
        self._kernels: Optional[Kernels] = Kernels() if compile_step else None
        self._hooks_warned = False
        self._names: Dict[int, str] = {}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._lows: List[torch.Tensor] = []  # low-precision model parameters ...
        self._masters: List[torch.Tensor] = []  # ... and their float32 masters, stepped by the optimizer
        self._low_of: Dict[int, torch.Tensor] = {}  # id(master) -> low-precision parameter
        #: the masters this wrapper created, by id (those it may pack); held, so no id is reused
        self._made: Dict[int, torch.Tensor] = {}
        self._nparams = 0
        self._plan: Optional[_Plan] = None  # built at the first unscale_(), see _get_plan()
        for group in optimizer.param_groups:
            self._bind_group(group)
        self.scaler, self._owns_scaler = _resolve_scaler(loss_scale, model, list(self.master_params()) + self._lows)
        self._client = self.scaler.attach()  # this optimizer's stage, kept by the scaler
        self._skipped = 0  # steps skipped (skipped_steps) ...
        self._due: Optional[_Deferred] = None  # ... and the last step, if decided on the device and not yet counted
        self._deciding: Optional[_Deferred] = None  # this step's decision on the device, from unscale to step
        self._overflow: Optional[Tuple[List[torch.Tensor], torch.Tensor]] = None
        #: set by clip_grad_norm_() for a segmented step: the check's flags and the clip factor
        self._pending: Optional[Tuple[FoundInf, torch.Tensor]] = None

    # -- parameters ------------------------------------------------------------------------
    def _bind_group(self, group: Dict[str, Any]) -> None:
        """Swap float32 masters into ``group["params"]`` for its low-precision parameters."""
        params = group["params"]
        for j, p in enumerate(params):
            if p.dtype in LOW:
                master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                state = self.optimizer.state.pop(p, None)
                if state:
                    self.optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                        for k, v in state.items()
                    }
                params[j] = master
                self._made[id(master)] = master
                self._pair(p, master)
        self._nparams += len(params)

    def _pair(self, low: torch.Tensor, master: torch.Tensor) -> None:
        self._lows.append(low)
        self._masters.append(master)
        self._low_of[id(master)] = low
        self._plan = None

    def _get_plan(self) -> _Plan:
        """The step's tensor lists, rebuilt only when ``param_groups`` changed layout since the last step."""
        plan = self._plan
        if plan is None or not plan.matches(self.optimizer.param_groups):
            self._check_params()
            plan = self._plan = self._build_plan()
        return plan

    def _build_plan(self) -> _Plan:
        """Group the inner optimizer's parameters by device and dtype, in their order in ``param_groups``."""
        pairs: Dict[Tuple[torch.device, torch.dtype, torch.dtype],
                    Tuple[List[torch.Tensor], List[torch.Tensor], List[Optional[int]]]] = {}
        own: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        packing = steps_per_parameter(self.optimizer)
        for gi, group in enumerate(self.optimizer.param_groups):
            for master in group["params"]:
                low = self._low_of.get(id(master))
                if low is None:
                    own.setdefault((master.device, master.dtype), []).append(master)
                    continue
                lows, masters, pack_groups = pairs.setdefault((low.device, low.dtype, master.dtype), ([], [], []))
                lows.append(low)
                masters.append(master)
                # only masters the wrapper made are packed (an adopted one is the user's tensor)
                packable = packing and id(master) in self._made and master.requires_grad
                pack_groups.append(gi if packable else None)
        layout = [(g["params"], len(g["params"])) for g in self.optimizer.param_groups]
        return _Plan([_Bucket(*lists) for lists in pairs.values()], list(own.values()), layout)

    def adopt_masters(self, pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Make float32 parameters already in the optimizer the masters of low-precision ones; return how many.

        ``pairs``: ``(master, low)``, e.g. an original model's parameter and the converted
        module's copy of it (``fxamp.initialize`` does this).  Masters already paired are skipped.
        """
        low_of_master: Dict[int, torch.Tensor] = {}
        for master, low in pairs:
            if master.dtype in LOW or low.dtype not in LOW or master.shape != low.shape:
                raise ValueError(
                    f"adopt_masters() pairs a float32 master with a float16/bfloat16 parameter of the same "
                    f"shape; got {master.dtype} {tuple(master.shape)} and {low.dtype} {tuple(low.shape)}"
                )
            low_of_master[id(master)] = low
        adopted = 0
        for p in self.master_params():
            low = low_of_master.get(id(p))
            if low is not None and id(p) not in self._low_of:
                self._pair(low, p)
                adopted += 1
        return adopted

    def add_param_group(self, group: Dict[str, Any]) -> None:
        """Like ``Optimizer.add_param_group``, creating masters for float16/bfloat16 parameters.

        Add groups through the wrapper: one added to the inner optimizer directly is refused at the next step.
        """
        self.optimizer.add_param_group(group)
        before = self._nparams
        self._bind_group(self.optimizer.param_groups[-1])
        assert self._nparams == before + len(self.optimizer.param_groups[-1]["params"])

    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer steps: float32 masters and float32 parameters (clip these)."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by this optimizer because a gradient was inf/NaN."""
        self._settle()
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle()
        self._skipped = int(value)

    def _settle(self) -> None:
        """Learn the outcome of the last step if it was decided on the device: count a skip, find the
        culprits (their gradients are still there: called before zero_grad drops them), update the scale.

        Called by everything that reads the outcome or starts the next iteration, so the host waits
        for the check at most once per step, and only once the step's kernels are queued behind it.
        """
        due = self._due
        if due is None:
            return
        self._due = None
        if bool(due.verdict):
            self._skipped += 1
            self._overflow = self._which_overflowed(due.in_place)
        else:
            self._overflow = None
        if due.update:
            self.scaler.update()

    def _decides_on_device(self, plan: "_Plan") -> Optional[torch.device]:
        """The device on which this step's overflow decision stays (the host does not wait for it), or None.

        When the inner optimizer's step can skip on the device (torch's fused Adam, AdamW, SGD:
        ``_step_supports_amp_scaling``, the flag GradScaler passes them), all its parameters are on
        one CUDA device and the flag can be agreed on there (not distributed, or NCCL).  Elsewhere
        the decision is read on the host, as it always was.  A dynamic scale shared with other
        optimizers moves in the caller's ``update()``, which reads the flag then: after this step's
        kernels are queued, so the device still has work while the host waits.
        """
        if plan.decide_on is _UNKNOWN:
            plan.decide_on = None
            devices = plan.devices()
            if self._fuses(plan) and not skips_on_device(self.optimizer):
                return None
            if (getattr(self.optimizer, "_step_supports_amp_scaling", False) and len(devices) == 1
                    and next(iter(devices)).type in _DECIDE_ON):
                device = next(iter(devices))
                if not self.sync_overflow or reduces_on_device(device, self.process_group):
                    plan.decide_on = device
        return plan.decide_on

    @contextlib.contextmanager
    def _inner_skips(self, deciding: Optional[_Deferred]) -> Iterator[None]:
        """Hand the device's overflow flag to the inner optimizer's step, as GradScaler does (``found_inf``;
        ``grad_scale`` None: the gradients are unscaled already): its fused kernel skips on the device."""
        if deciding is None:
            yield
            return
        opt = self.optimizer
        opt.found_inf, opt.grad_scale = deciding.verdict.flag, None
        try:
            yield
        finally:
            del opt.found_inf, opt.grad_scale

    @property
    def compiled_step_active(self) -> bool:
        """Whether ``step()`` steps the masters with ``compile_step``'s compiled kernels: asked for, and
        the masters hold enough elements for them to pay (``fxamp.training.kernels.FUSED_MIN_TOTAL``)."""
        return self._fuses(self._get_plan())

    @property
    def current_scale(self) -> float:
        """The loss scale the next backward() multiplies by."""
        self._settle()
        return self.scaler.scale

    def _name(self, p: torch.Tensor) -> str:
        low = self._low_of.get(id(p))
        key = id(low) if low is not None else id(p)
        if key in self._names:
            return self._names[key]
        for i, group in enumerate(self.optimizer.param_groups):
            for j, q in enumerate(group["params"]):
                if q is p:
                    return f"group {i}, param {j}"
        return f"a parameter of shape {tuple(p.shape)}"  # pragma: no cover

    # -- state machine ---------------------------------------------------------------------
    @property
    def stage(self) -> str:
        """``"ready"``, ``"scaled"`` (after backward), ``"unscaled"`` or ``"stepped"`` (shared scaler, before update)."""
        self._settle()
        return self.scaler.stage(self._client).value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's parameters and of the masters; starts the iteration over.

        With ``set_to_none`` (the default) they become None, as with ``Optimizer.zero_grad``, and the
        masters' float32 gradient segments are freed (allocated again at the next unscale_()),
        unless ``release_grad_buffer=False``: then they are kept and bound again.  The
        inner optimizer's own ``zero_grad`` runs when ``set_to_none=False``, or when it is not
        ``torch.optim.Optimizer.zero_grad`` (a subclass or another kind of optimizer).
        """
        self._settle()
        self._pending = None
        self._deciding = None
        if set_to_none:
            if not _stock_zero_grad(self.optimizer):
                self.optimizer.zero_grad()  # (its default: a duck-typed one may take no set_to_none)
            _unbind_grads(list(self.master_params()))  # what Optimizer.zero_grad does, whatever the inner one did
            _unbind_grads(self._lows)
            if self.release_grad_buffer and self._plan is not None:
                for bucket in self._plan.buckets:
                    bucket.release()
        else:
            self.optimizer.zero_grad(set_to_none=False)
            grads = []
            for p in self._lows:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)
        self.scaler.restart(self._client, drop_scaled=self._owns_scaler)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * current_scale``, for a backward you run yourself (``opt.scale_loss(loss).backward()``)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the loss must be a tensor, not {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}; reduce it first "
                f"(loss.mean() or loss.sum()), or pass a reduction='mean' loss function"
            )
        if not loss.is_floating_point():
            raise TypeError(f"the loss must be a floating point tensor, not {loss.dtype}")
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: it was computed under torch.no_grad()/inference_mode, "
                "detached, or from parameters with requires_grad=False"
            )
        self._settle()
        return self.scaler.scale_loss(loss, self._client)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * scale).backward(**kwargs)``; call several times to accumulate gradients."""
        self.scale_loss(loss).backward(**kwargs)

    def unscale_(self) -> None:
        """Put true float32 gradients in the masters (and float32 parameters); decide whether this step overflowed.

        Optional: step() calls it when you did not.  At most once per step, after the last backward().
        The model's float16/bfloat16 parameters keep their scaled gradients; clip and inspect
        :meth:`master_params`, whose gradients are the true ones.
        """
        self._settle()
        self._check_params()
        flags = self.scaler.start_unscale(self._client)
        plan = self._get_plan()
        with torch.no_grad():
            checked = sum(_unscale_masters_(b, flags) for b in plan.buckets)
            checked += sum(_unscale_own_(params, flags) for params in plan.own)
            self._decide(flags, checked, plan)

    def _check_in_place(self, plan: _Plan) -> FoundInf:
        """``unscale_()`` for a segmented step: check the low-precision gradients where they are (the
        float32 parameters' are unscaled in place as usual); the masters get no gradient here."""
        flags = self.scaler.start_unscale(self._client)
        with torch.no_grad():
            checked = 0
            for bucket in plan.buckets:
                grads = [p.grad for p in bucket.lows if p.grad is not None]
                flags.check_(grads)
                checked += len(grads)
            checked += sum(_unscale_own_(params, flags) for params in plan.own)
            self._decide(flags, checked, plan, in_place=True)
        return flags

    def _decide(self, flags: FoundInf, checked: int, plan: "_Plan", in_place: bool = False) -> None:
        """Whether this step overflowed, agreed over ``process_group``; tell the scaler.

        On a device where the decision can stay (:meth:`_decides_on_device`) the host does not
        wait for it: the scaler is told "no overflow" for now, the inner optimizer gets the flag
        and skips on the device, and the outcome is counted when the next iteration starts
        (:meth:`_settle`).  Elsewhere the flag is read here (the host waits for the backward).
        """
        if not checked:
            raise OptimizerStateError(
                "no parameter of this optimizer has a gradient: the loss does not depend on them, "
                "or backward() ran on another model (if the optimizer was built on the original "
                "model's parameters, use fxamp.initialize(model, optimizer) to re-point it)"
            )
        device = self._decides_on_device(plan)
        if device is not None:
            flag = flags.flag_on(device)
            if self.sync_overflow:
                flag = all_reduce_overflow_on_device(flag, self.process_group)
            self._deciding = _Deferred(DeviceFlag(flag), in_place)
            self.scaler.finish_unscale(self._client, False)
            return
        local = flags.found()
        found = all_reduce_overflow(local, self.process_group) if self.sync_overflow else local
        found_inf = bool(found.item())
        if local.item():  # rare: note which tensors overflowed, before clipping can spread NaNs
            self._overflow = self._which_overflowed(in_place)
        else:  # clean here; on another rank, perhaps
            self._overflow = ([], torch.zeros(0, dtype=torch.bool)) if found_inf else None
        self.scaler.finish_unscale(self._client, found_inf)

    def _fuses(self, plan: _Plan) -> bool:
        """Whether steps use ``compile_step``'s kernels: asked for, and enough elements in the masters
        for them to be faster than the plain step (:func:`fxamp.training.kernels.worth_fusing`; decided once
        a plan).  Otherwise the step is the one without ``compile_step``, and nothing is compiled."""
        if self._kernels is None or not plan.buckets:
            return False
        if plan.fuse is None:
            plan.fuse = worth_fusing(self.optimizer, [m for b in plan.buckets for m in b.masters])
        return plan.fuse

    def _segmentable(self, plan: _Plan) -> bool:
        """Whether step() may step the masters a segment at a time (:mod:`fxamp.training.step`):
        the gradient buffer is released between steps, the inner optimizer steps each parameter on
        its own, the masters' gradients would take 16 MiB or more, and no gradient is sparse."""
        if self._fuses(plan):  # (no float32 gradient at all, at any size)
            if steps_per_parameter(self.optimizer):
                return all(p.grad is None or not p.grad.is_sparse for b in plan.buckets for p in b.lows)
            if not self._hooks_warned:  # step hooks must run once per step, around every parameter
                self._hooks_warned = True
                warnings.warn("compile_step=True: the optimizer has step hooks, which must see one "
                              "step of every parameter, so it is stepped as it is (not fused)",
                              RuntimeWarning, stacklevel=3)
            return False
        if not (self.release_grad_buffer and plan.buckets and steps_per_parameter(self.optimizer)):
            return False
        if sum(b.nbytes for b in plan.buckets) < _RELEASE_MIN_BYTES:
            return False
        return all(p.grad is None or not p.grad.is_sparse for b in plan.buckets for p in b.lows)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the true gradients to a total norm of ``max_norm``; returns that norm before clipping.

        What ``unscale_()`` then ``torch.nn.utils.clip_grad_norm_(opt.master_params(), ...)`` does,
        between the last ``backward()`` and ``step()``.  When the step would be segmented (see the
        module docstring) the norms are taken from the low-precision gradients where they are
        (float32 accumulation, divided by the scale) and the clip factor joins the unscaling inside
        ``step()``, so clipping allocates no float32 gradient for every master.  A non-finite norm
        means an overflow: it is returned as is, nothing is clipped, and ``step()`` skips.
        """
        self._settle()
        if self._pending is not None:  # the masters have no gradients to clip again
            raise OptimizerStateError(
                "clip_grad_norm_() already ran since the last backward(): call it once, between the last "
                "backward() and step()")
        self._check_params()
        plan = self._get_plan()
        stage = self.scaler.stage(self._client)
        if not (stage is Stage.SCALED and self._segmentable(plan)):
            if stage is not Stage.UNSCALED:
                self.unscale_()  # (says what is wrong when there was no backward)
            return torch.nn.utils.clip_grad_norm_(list(self.master_params()), max_norm, norm_type,
                                                  error_if_nonfinite)
        flags = self.scaler.start_unscale(self._client)
        on_device = self._decides_on_device(plan)
        norms: List[torch.Tensor] = []
        own: List[torch.Tensor] = []
        with torch.no_grad():
            checked = 0
            for bucket in plan.buckets:
                grads = [p.grad for p in bucket.lows if p.grad is not None]
                if not grads:
                    continue
                n = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
                n = n * flags.inv_scale_on(n.device)  # a norm scales with its tensor (the scale: a power of 2)
                if on_device is not None:  # exact, and the host does not wait
                    flags.check_(grads)
                elif not bool(torch.isfinite(n).all()):  # an inf/NaN, or finite values whose norm overflowed
                    flags.check_(grads)
                norms.append(n)
                checked += len(grads)
            for params in plan.own:
                checked += _unscale_own_(params, flags)  # unscaled in place, as unscale_() does
                grads = [p.grad._values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
                if grads:
                    norms.append(torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)))
                    own.extend(grads)
            self._decide(flags, checked, plan, in_place=True)
            device = norms[0].device
            total = torch.linalg.vector_norm(torch.cat([n.to(device) for n in norms]), norm_type)
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(
                    f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                    "clipped (with loss scaling an overflow is expected now and then: pass "
                    "error_if_nonfinite=False and let step() skip)")
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_ formula
            if own:
                torch._foreach_mul_(own, coef.to(own[0].device))
        self._pending = (flags, coef)
        return total

    def step(self, closure: None = None) -> Union[bool, StepResult]:
        """Step the inner optimizer unless a gradient is inf/NaN; refresh the low-precision weights; update the scale.

        Returns True if it stepped, False if it skipped.  Raises LossScaleError when dynamic
        scaling gives up (see :class:`LossScaler`); that step is skipped too.

        On a GPU, with a fused inner optimizer (``torch.optim.AdamW(..., fused=True)``, Adam, SGD),
        the host does not wait for the check: the flag stays on the device, the inner optimizer's
        kernel skips there (no weight, master or optimizer state changes, as GradScaler has fused
        optimizers do), and a :class:`StepResult` comes back, truthy if it stepped (``bool()``
        waits for the check).  The skip is counted (``skipped_steps``, ``overflowed_params()``)
        and the scale updated when the next iteration starts (``zero_grad()``, ``backward()``).
        """
        if closure is not None:
            raise OptimizerStateError(
                "step(closure) is not supported: the loss must be scaled; run the closure's forward and "
                "opt.backward(loss) yourself, then call step()"
            )
        self._settle()
        segmented: Optional[FoundInf] = None
        coef: Optional[torch.Tensor] = None
        if self.scaler.start_step(self._client) is Stage.SCALED:
            self._check_params()
            plan = self._get_plan()
            if self._segmentable(plan):
                segmented = self._check_in_place(plan)
            else:
                self.unscale_()
        elif self._pending is not None:  # clip_grad_norm_() checked in place and chose the factor
            (segmented, coef), plan = self._pending, self._get_plan()
        self._pending = None
        deciding, self._deciding = self._deciding, None
        found = self.scaler.found_inf(self._client)  # (False for now when deciding on the device)
        if found:
            self._skipped += 1
            blame = self.overflowed_params
        else:
            with self._inner_skips(deciding):
                if segmented is not None:
                    for pack in plan.packs:
                        pack.invalidate()  # (its members are stepped run by run)
                    if plan.runs is None:
                        plan.runs = plan_runs(self.optimizer.param_groups, lambda m: self._low_of.get(id(m)),
                                              segment_numel_for(plan.devices()))
                    scale_on = _multiplier(segmented, coef)
                    if self._fuses(plan):
                        step_fused(self.optimizer, plan.runs, scale_on, self._kernels,
                                   lambda runs: step_runs(self.optimizer, runs, scale_on),
                                   segment_numel=segment_numel_for(plan.devices()),
                                   found=None if deciding is None else deciding.verdict.flag)
                    else:
                        step_runs(self.optimizer, plan.runs, scale_on)
                else:
                    self._step_inner(deciding)
                    self._refresh()  # (a skip on the device left the masters as they were: the same rounding)
            blame = self.overflowed_params if deciding is not None else tuple
        if deciding is not None:
            self.scaler.record(deciding.verdict, blame, self._client)
            deciding.update = self._owns_scaler  # (a dynamic scale moves on the outcome: at _settle)
            self._due = deciding
            if self._owns_scaler:  # reading the scaler itself settles too (a shared one: the caller's update())
                self.scaler.defer(self._settle)
            return StepResult(deciding.verdict)
        self.scaler.record(found, blame, self._client)
        if self._owns_scaler:
            self.scaler.update()
        return not found

    def _step_inner(self, deciding: Optional[_Deferred]) -> None:
        """The inner optimizer's step, with the packed small masters (:mod:`fxamp.training.packed_step`) when it
        is still a stock per-parameter one and the decision is on the host."""
        packs = self._plan.packs if self._plan is not None else []
        if packs and deciding is None and steps_per_parameter(self.optimizer):
            step_with_packs(self.optimizer, packs)
            return
        for pack in packs:
            pack.invalidate()
        self.optimizer.step()

    def _refresh(self) -> None:
        """Round the masters into the low-precision parameters: one ``_foreach_copy_`` per (device, dtype)."""
        with torch.no_grad():
            if self._plan is not None:
                for bucket in self._plan.buckets:
                    torch._foreach_copy_(bucket.lows, bucket.masters)
            elif self._lows:
                torch._foreach_copy_(self._lows, self._masters)

    def _which_overflowed(self, in_place: bool = False) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """The parameters whose gradients were checked, and which of them hold an inf/NaN: the masters'
        gradients, or with ``in_place`` (a segmented step) their low-precision parameters'."""
        checked, grads = [], []
        for p in self.master_params():
            low = self._low_of.get(id(p))
            g = low.grad if in_place and low is not None else p.grad
            if g is not None:
                checked.append(p)
                grads.append(g)
        dense = [g._values() if g.is_sparse else g for g in grads]  # (uncoalesced values too)
        maxabs = torch.stack([n.float().cpu() for n in torch._foreach_norm(dense, math.inf)])
        return checked, ~torch.isfinite(maxabs)

    def _check_params(self) -> None:
        n = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if n != self._nparams:
            raise OptimizerStateError(
                f"the inner optimizer now holds {n} parameters, the wrapper knows {self._nparams}: a "
                f"param group was added to it directly; use opt.add_param_group(...) on the wrapper so "
                f"float16/bfloat16 parameters get float32 masters"
            )

    def overflowed_params(self) -> List[str]:
        """Names of the parameters whose gradients were inf/NaN at the latest skipped step ([] after a clean step).

        Computed only on overflow (one ``_foreach_norm``); on a distributed run, only this rank's.
        """
        self._settle()
        if self._overflow is None:
            return []
        params, bad = self._overflow
        return [self._name(p) for p, b in zip(params, bad.tolist()) if b]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, with the model's own ``state_dict``:

        optimizer:     the inner optimizer's state_dict (its state is the masters')
        masters:       the float32 masters, in the order their parameters appear in the optimizer
        scaler:        :meth:`LossScaler.state_dict`
        skipped_steps: this optimizer's skipped steps
        format:        version of this layout

        Tensors are references, as in ``torch.optim.Optimizer.state_dict``; save or deep-copy them.
        """
        self._settle()
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach() for m in self._masters],
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "format": _FORMAT,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and refresh the low-precision parameters from the loaded masters."""
        expected = (f"MixedPrecisionOptimizer.load_state_dict takes the dict MixedPrecisionOptimizer.state_dict() "
                    f"returned (keys {', '.join(_STATE_KEYS)})")
        if not isinstance(state, Mapping):
            raise TypeError(f"{expected}, not {type(state).__name__}; pass opt.state_dict(), or the entry "
                            f"of the checkpoint you saved it under")
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            hint = (" (this looks like the inner optimizer's state_dict: load it with opt.optimizer.load_state_dict)"
                    if {"state", "param_groups"} <= set(state) else "")
            raise _StateDictError(f"the state_dict lacks {missing}{hint}; {expected}")
        if state["format"] != _FORMAT:
            raise ValueError(f"the state_dict has format {state['format']!r}, this version of fxamp reads {_FORMAT}; "
                             f"{expected}")
        masters = state["masters"]
        if not isinstance(masters, (list, tuple)) or not all(torch.is_tensor(m) for m in masters):
            raise TypeError(f"state_dict['masters'] must be a list of tensors, not {type(masters).__name__}; {expected}")
        if len(masters) != len(self._masters):
            raise ValueError(f"the checkpoint has {len(masters)} float32 masters, this optimizer "
                             f"{len(self._masters)}; build it on the same model and policy")
        for i, (have, saved) in enumerate(zip(self._masters, masters)):
            if have.shape != saved.shape:
                raise ValueError(f"master {i} ({self._name(have)}) has shape {tuple(have.shape)}, the "
                                 f"checkpoint's {tuple(saved.shape)}; build the optimizer on the same model")
        self._settle()
        self.optimizer.load_state_dict(state["optimizer"])
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(self._masters, [m.to(h.device) for m, h in zip(masters, self._masters)])
        self._refresh()
        self.scaler.load_state_dict(state["scaler"])
        self._skipped = int(state["skipped_steps"])
        self.scaler.forget(self._client)
        self._overflow = None

    def fp32_state_dict(self, model: Optional[nn.Module] = None) -> "OrderedDict[str, torch.Tensor]":
        """``model.state_dict()`` in float32, low-precision parameters taken from the masters.

        Loads into the original, unconverted model.  ``model`` defaults to the one given at construction.
        """
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("fp32_state_dict() needs the model: pass it here or as MixedPrecisionOptimizer(..., model=model)")
        master_of = {id(low): m for low, m in zip(self._lows, self._masters)}
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for key, value in model.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                out[key] = value
            elif id(value) in master_of:
                out[key] = master_of[id(value)].detach()
            elif value.dtype in LOW:
                out[key] = value.detach().float()
            else:
                out[key] = value.detach()
        return out

    def __repr__(self) -> str:
        return (f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, {len(self._masters)} float32 masters, "
                f"{self._nparams - len(self._masters)} float32 params, {self.scaler})")


def _resolve_scaler(loss_scale: LossScaleArg, model: Optional[nn.Module],
                    params: Sequence[torch.Tensor]) -> Tuple[LossScaler, bool]:
    if isinstance(loss_scale, LossScaler):
        return loss_scale, False
    if isinstance(loss_scale, LossScaleConfig):
        return LossScaler(loss_scale), True
    if loss_scale is None or loss_scale == "none":
        return LossScaler(LossScaleConfig.none()), True
    if loss_scale == "dynamic":
        return LossScaler(LossScaleConfig.dynamic()), True
    if loss_scale == "auto":
        return LossScaler(_auto_config(model, params)), True
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaler(LossScaleConfig.static(float(loss_scale))), True
    raise ValueError(
        f"loss_scale={loss_scale!r} is not understood; use 'auto', 'dynamic', a number (static), None, "
        f"a LossScaleConfig, or a LossScaler shared with other optimizers"
    )


def _auto_config(model: Optional[nn.Module], params: Sequence[torch.Tensor]) -> LossScaleConfig:
    policy: Optional[Policy] = None
    if model is not None:
        policy = policy_of(model) or policy_of(getattr(model, "module", model))  # DDP keeps it in .module
    if policy is not None:
        low = policy.compute
    else:
        dtypes = {p.dtype for p in params}
        low = torch.float16 if torch.float16 in dtypes else torch.bfloat16 if torch.bfloat16 in dtypes else None
    if low in (torch.bfloat16, torch.float32):
        return LossScaleConfig.none()
    return LossScaleConfig.dynamic()
