"""Step float32 masters a segment at a time, so their gradients never exist all at once.

``MixedPrecisionOptimizer.step()`` without ``unscale_()`` before it, on an inner optimizer whose
update of a parameter reads only that parameter's gradient and state (:func:`steps_per_parameter`),
runs::

    check every low-precision gradient for inf/NaN        (FoundInf.check_: nothing is written)
    for each run of masters (one param group, one device, at most SEGMENT_NUMEL elements):
        copy the run's low-precision gradients into the float32 segment, divide them by the scale
        bind them as the masters' .grad and step the inner optimizer on this run alone
        (every group's "params" list but the run's is emptied for the call)
        round the run's masters into the low-precision parameters; unbind the segment's views

so the step's peak holds the low-precision weights and gradients, the masters, the optimizer
state and one segment (4 MiB, or the largest master's gradient: a tensor is stepped whole),
instead of a float32 gradient for every master as well (4 bytes per parameter: as much as the
low-precision weights and gradients together).  It is the same step:
each parameter is updated from its own gradient and state with its group's hyperparameters
(bitwise the same as stepping all at once: tests/training/test_optimizer.py).  After such a step the masters
hold no ``.grad``; call ``unscale_()`` before ``step()`` to clip or read them (then every master
gets its float32 gradient at once, and the step is the plain one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.optim.optimizer as _torch_optimizer
from torch._utils import _unflatten_dense_tensors

__all__ = ["PER_PARAMETER", "SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "segment_numel_for", "Run",
           "steps_per_parameter", "plan_runs", "cut_runs", "step_runs", "flat_grads",
           "grad_strides"]

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


def step_runs(optimizer: Any, runs: Sequence[Run], inv_scale_on: Optional[Callable[[torch.device], torch.Tensor]]
              ) -> None:
    """Step ``optimizer`` run by run (see the module docstring); ``inv_scale_on(device)`` is ``1/scale``
    there, or None when the scale is 1.  Every group's ``params`` list is restored, even on error."""
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
                buffers[device] = torch.empty(max(r.numel for r in runs if r.pairs and r.pairs[0][1].device == device),
                                              dtype=masters[0].dtype, device=device)
            with torch.no_grad():
                flat, views = flat_grads(masters, strides, buffers[device])
                torch._foreach_copy_(views, [low.grad for low in lows])
                if inv_scale_on is not None:
                    torch._foreach_mul_(views, inv_scale_on(flat.device))
            for m, v in zip(masters, views):
                m.grad = v
            try:
                optimizer.step()
                with torch.no_grad():
                    torch._foreach_copy_(lows, masters)
            finally:
                for m in masters:
                    m.grad = None
                del flat, views
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params
