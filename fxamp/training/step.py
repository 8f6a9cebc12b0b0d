"""The step engine: one optimizer's step, top to bottom: stage -> check -> execute (and refresh) -> record.

``MixedPrecisionOptimizer`` (:mod:`fxamp.training.optimizer`, the facade: masters, ``state_dict``, the public
verbs) hands every verb of a step to its :class:`Engine`; the scaler (:mod:`fxamp.training.loss_scale`) keeps
the scale, the stages and the overflow decision; the engine hands the checked step to one executor
(:mod:`fxamp.training.executors`, the :class:`~fxamp.training.executors.Executor` protocol).  One step::

    stage    the gradients where the executor reads them: the plain step puts every master's float32
             gradient in its ``.grad`` (:func:`unscale`: copied from the low-precision one into the plan's
             segments, divided by the scale, checked on the way); a segmented one checks the low-precision
             gradients where they are (:func:`check_in_place`).  The plan (:mod:`fxamp.training.plan`: per
             (device, dtype) a Bucket of low-precision parameters and their masters, the float32 parameters
             stepped directly, a segmented step's runs) is built once per layout of ``param_groups``
    check    the verdict: the flags of every device agreed across ranks, read on the host or left on the
             device (:func:`fxamp.training.loss_scale.agree`: the one place that decides); a skip changes
             no weight, master or optimizer state
    execute  the executor steps the masters and rounds them into the low weights (the refresh: inside the
             executor, since a lean master's workspace is left after its rounding): :class:`Plain`, or a
             run at a time (:class:`Segmented`, which offers each run to :class:`LeanKernel` and
             :class:`LeanChunked` first), or ``compile_step``'s :class:`Compiled`
    record   the outcome told to the scaler, which moves the scale (or, decided on the device, when the
             next iteration starts: :meth:`Engine.settle`)

A step runs code in the facade, this module, ``executors``, ``plan`` and ``loss_scale``; with lean masters
also ``lean`` (the workspace) and ``quant`` (its state codes), ``native`` for the CPU kernel; a further one
only under an initialized ``torch.distributed`` (:mod:`fxamp.training.distributed`: the flag's all-reduce)
or with ``compile_step`` (:mod:`fxamp.training.kernels`).  ``tests/test_layout.py`` traces a step to hold it there.

The runs take one of two shapes:

* **one run for every master** (the plain step): ``unscale_()`` gives every master its float32
  gradient at once, as views into a few flat segments of the Bucket (``GRAD_SEGMENT_NUMEL``;
  on CPU the small ones gathered by ``torch.cat`` first); the inner optimizer steps once, and
  each bucket's low weights are refreshed.  Any optimizer, hooks and all.
* **segmented** (:class:`~fxamp.training.executors.Segmented`): on a large model (``RELEASE_MIN_BYTES`` of
  float32 gradients) with a stock per-parameter torch optimizer (:func:`steps_per_parameter`) and no
  ``unscale_()`` before ``step()``, the low-precision gradients are checked where they are, then each run
  (one param group, one device, at most ``SEGMENT_NUMEL`` elements: :func:`plan_runs`) is unscaled into one
  reused segment (kept by the plan with each run's views: :class:`~fxamp.training.plan.Segments`, so a
  step's ops grow with its runs, not its tensors), stepped (every group's "params" list but the run's
  emptied for the call) and refreshed.  The step's peak holds one segment (4 MiB, or the largest master's
  gradient) instead of a float32 gradient for every master.  A lean master that fxamp's CPU kernel steps
  takes no segment: the kernel reads its low-precision gradient where it is, times 1/scale.  Bitwise the
  plain step: each parameter is updated from its own gradient and state with its group's hyperparameters
  (tests/training/test_optimizer.py).  After it the masters hold no ``.grad``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.optim.optimizer as _torch_optimizer

from . import plan as planning
from .distributed import max_abs, reduces_on_device
from .executors import Compiled, Executor, Lean, Plain, Segmented, refresh, step_runs
from .grad_watch import ScaledGradWatch
from ..errors import OptimizerStateError
from ..info import take_loaded
from .loss_scale import DeviceFlag, FoundInf, LossScaler, Stage, StepResult, agree, ranks_to_agree
from .plan import Bucket, Plan, Run, Segments, cut_runs, flat_grads, grad_strides

__all__ = ["PER_PARAMETER", "SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "segment_numel_for", "Run", "Check",
           "Engine", "steps_per_parameter", "plan_runs", "cut_runs", "step_runs", "unscale", "check_in_place",
           "clip_in_place", "clip_factor", "refresh", "which_overflowed", "flat_grads", "grad_strides"]

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


class Engine:
    """The steps of one :class:`~fxamp.MixedPrecisionOptimizer`: its verbs' work and the state between them.

    optimizer:   the inner optimizer, stepping float32 masters and parameters
    scaler:      the :class:`LossScaler` (``owns_scaler``: not shared, so the engine updates it each step)
    low_of:      id(master) -> its low-precision parameter (the facade's pairs, shared)
    ws:          the lean workspace, or None; ``kernels``: ``compile_step``'s (:class:`fxamp.training.kernels.Kernels`,
                 imported only then), or None
    names:       id(parameter) -> its name in the model (for errors and :meth:`overflowed`)
    sync_overflow, process_group, release_grad_buffer: the facade's options (it sets them here)
    """

    def __init__(self, optimizer: Any, scaler: LossScaler, owns_scaler: bool, low_of: Dict[int, torch.Tensor],
                 names: Dict[int, str], ws: Optional[Lean], kernels: Optional[Any], *, sync_overflow: bool,
                 process_group: Optional[Any], release_grad_buffer: bool) -> None:
        self.optimizer, self.scaler, self.owns_scaler = optimizer, scaler, owns_scaler
        self.low_of_id, self.names, self.ws, self.kernels = low_of, names, ws, kernels
        self.sync_overflow, self.process_group = sync_overflow, process_group
        self.release_grad_buffer = release_grad_buffer
        self.client = scaler.attach()  # this optimizer's stage, kept by the scaler
        self.nparams = 0  # parameters bound by the facade (a group added behind its back is refused)
        self.kept: Optional[Plan] = None  # the plan, kept while param_groups keep their layout (see plan())
        self.check: Optional[Check] = None  # this step's check, from unscale_() (or clip) to step()
        self.due: Optional[Check] = None  # the last step, if decided on the device and not yet counted
        self.skipped = 0  # steps skipped
        #: the parameters checked at the latest overflow, and which of them held an inf/NaN
        self.overflow: Optional[Tuple[List[torch.Tensor], torch.Tensor]] = None
        self.hooks_warned = False
        #: id(master) -> its low-precision weight's stamp (version, memory) as the wrapper last left it
        self.stamps: Dict[int, Tuple[int, int]] = {}
        #: the gradients' versions after a scaled backward(): warns of torch's clip on them (grad_watch.py)
        self.watch = ScaledGradWatch()

    # -- a step, in the order it runs ----------------------------------------------------------------
    def step(self) -> Union[bool, StepResult]:
        """stage -> check -> execute -> record (see the module docstring); True stepped, False skipped, or a
        :class:`StepResult` when the decision stayed on the device."""
        self.check_grads()
        self.settle()
        self.follow_weights()
        if self.scaler.start_step(self.client) is Stage.SCALED:  # stage (unless unscale_() did)
            plan = self.plan()
            if self.segmentable(plan):
                flags = self.scaler.start_unscale(self.client)
                with torch.no_grad():
                    self.decide(flags, check_in_place(plan, flags), plan, in_place=True)
            else:
                self.unscale_()
        check, self.check = self.check, None
        found = self.scaler.found_inf(self.client)  # check (False for now when deciding on the device)
        if found:
            self.skipped += 1
        else:
            self.execute(self.kept, check)
        blame = self.overflowed if found or check.on_device else tuple
        self.note_weights()
        return self.record(check, found, blame)

    # -- the weights between steps: the user may write them ---------------------------------------------
    def pairs(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``(master, low-precision weight)`` of every master in ``param_groups``."""
        low_of = self.low_of_id
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                low = low_of.get(id(p))
                if low is not None:
                    yield p, low

    def check_grads(self) -> None:
        """Before the gradients are unscaled: warn once if they were written while scaled (torch's clip on them)."""
        if self.watch.pending:  # (after a scaled backward() only: a step at a scale of 1 runs no code of the watch)
            self.watch.check(self.name, lambda: self.scaler.scale, stacklevel=4)  # (facade verb, then the user)

    def __getstate__(self) -> Dict[str, Any]:  # a copy plans again: a pickle would bring the plan's views back as
        return {**self.__dict__, "kept": None}  # separate tensors (the facade re-keys the ids: its __setstate__)

    def note(self, master: torch.Tensor, low: torch.Tensor) -> None:
        """Remember ``low`` as the wrapper leaves it (its version counter and memory: what a write changes)."""
        self.stamps[id(master)] = (low._version, low.data_ptr())

    def note_weights(self) -> None:
        """:meth:`note` every master's weight (after a step's refresh, a load, a construction)."""
        for master, low in self.pairs():
            self.note(master, low)

    def follow_weights(self) -> None:
        """Masters follow the low-precision weights the user wrote since :meth:`note_weights` (a checkpoint
        loaded into the model after the wrapper was built, a re-initialisation, a DDP broadcast): without
        this the step would round the old master into the weight, undoing the load.  A float32 master takes
        the float32 value loaded (a float32 checkpoint: ``fxamp.info.take_loaded``), else the new weight widened;
        a kahan term restarts at zero (:meth:`fxamp.training.lean.Workspace.follow`);
        only where the weight is no longer the master's rounding (a weight written back as it was keeps its
        master).  The optimizer state stays, as a torch optimizer's does.  No op runs unless a weight's
        version counter or memory changed: a Python loop over the masters."""
        changed = []
        for master, low in self.pairs():
            old = self.stamps.get(id(master))
            if old is not None and old != (low._version, low.data_ptr()):
                changed.append((master, low))
        with torch.no_grad():
            for master, low in changed:
                loaded = take_loaded(low)  # a float32 checkpoint loaded into the model: its exact values win
                if self.ws is not None and self.ws.lean(master):
                    self.ws.follow(master)
                elif loaded is not None:
                    master.detach().copy_(loaded)
                elif not torch.equal(master.detach().to(low.dtype), low.detach()):
                    master.detach().copy_(low.detach())
                self.note(master, low)

    def unscale_(self) -> None:
        """The plain step's stage: every master's float32 gradient in its ``.grad``, unscaled and checked."""
        self.check_grads()
        self.settle()
        flags = self.scaler.start_unscale(self.client)
        plan = self.plan()
        with torch.no_grad():
            self.decide(flags, unscale(plan, flags), plan, in_place=False)

    def plan(self) -> Plan:
        """The step's tensor lists, rebuilt only when ``param_groups`` changed layout since the last step."""
        groups = self.optimizer.param_groups
        n = sum(len(g["params"]) for g in groups)
        if n != self.nparams:
            raise OptimizerStateError(
                f"the inner optimizer now holds {n} parameters, the wrapper knows {self.nparams}: a "
                f"param group was added to it directly; use opt.add_param_group(...) on the wrapper so "
                f"float16/bfloat16 parameters get float32 masters"
            )
        plan = self.kept
        if plan is None or not plan.matches(groups):
            plan = self.kept = Plan(groups, self.low_of)
        return plan

    def decide(self, flags: FoundInf, checked: int, plan: Plan, in_place: bool) -> Check:
        """Whether this step overflowed (:func:`~fxamp.training.loss_scale.agree`); tell the scaler, keep the
        step's :class:`Check` for ``step()``.  Where the decision stays on the device
        (:func:`fxamp.training.plan.decides_on`) the host does not wait: the scaler is told "no overflow"
        for now, the inner optimizer gets the flag and skips on the device, and the outcome is counted
        when the next iteration starts (:meth:`settle`).  Elsewhere the flag is read here."""
        if not checked:
            raise OptimizerStateError(
                "no parameter of this optimizer has a gradient: the loss does not depend on them, "
                "or backward() ran on another model (if the optimizer was built on the original "
                "model's parameters, use fxamp.initialize(model, optimizer) to re-point it)"
            )
        verdict, local = agree(flags, self.decides_on(plan), self.sync_overflow, self.process_group)
        check = self.check = Check(flags, in_place, verdict)
        if check.on_device:
            self.scaler.finish_unscale(self.client, False)
            return check
        if local:  # rare: note which tensors overflowed, before clipping can spread NaNs
            self.overflow = which_overflowed(self.params(), self.low_of, in_place)
        else:  # clean here; on another rank, perhaps
            self.overflow = ([], torch.zeros(0, dtype=torch.bool)) if verdict else None
        self.scaler.finish_unscale(self.client, verdict)
        return check

    def execute(self, plan: Plan, check: Check) -> None:
        """Step a clean (or device-decided) step through its executor.  A device-decided step hands the flag
        to the inner optimizer, as GradScaler does (``found_inf``; ``grad_scale`` None): its fused kernel skips
        (the masters left as they were: the same rounding)."""
        optimizer = self.optimizer
        found = check.verdict.flag if check.on_device else None
        if found is not None:
            optimizer.found_inf, optimizer.grad_scale = found, None
        executor = self.executor(plan, check, found)
        try:
            executor.step(optimizer, plan.runs if check.in_place else (), check.multiplier())
        finally:
            if found is not None:
                del optimizer.found_inf, optimizer.grad_scale
        # a fused inner step writes without bumping version counters: a converted module's weight cache
        # (fxamp.conversion.runtime.WeightCastCache) must see the float32 weights it stepped change
        torch.autograd.graph.increment_version([p for g in optimizer.param_groups for p in g["params"]])
        if self.ws is not None:
            self.ws.stepped()

    def executor(self, plan: Plan, check: Check, found: Optional[torch.Tensor]) -> Executor:
        """The plain step's :class:`Plain`; a segmented one's (runs planned at its first step: :func:`plan_runs`)
        :class:`Segmented`, or with ``compile_step``'s kernels :class:`Compiled`."""
        if not check.in_place:
            return Plain(plan, self.ws, steps_per_parameter(self.optimizer))
        if plan.runs is None:
            segment_numel = segment_numel_for(plan.devices())
            plan.runs = plan_runs(self.optimizer.param_groups, self.low_of, segment_numel)
            plan.segments = Segments(segment_numel)
        if self.fuses(plan):
            return Compiled(self.kernels, plan.segments.limit, found)
        return Segmented(self.ws, plan.segments)

    def record(self, check: Check, found: bool, blame: Callable[[], Sequence[str]]) -> Union[bool, StepResult]:
        """Tell the scaler the outcome; update the scale when this optimizer owns it.  A device-decided step
        is recorded as pending and settles when the next iteration starts."""
        if check.on_device:
            self.scaler.record(check.verdict, blame, self.client)
            check.update = self.owns_scaler  # (a dynamic scale moves on the outcome: at settle())
            self.due = check
            if self.owns_scaler:  # reading the scaler itself settles too (a shared one: the caller's update())
                self.scaler.defer(self.settle)
            return StepResult(check.verdict)
        self.scaler.record(found, blame, self.client)
        if self.owns_scaler:
            self.scaler.update()
        return not found

    def settle(self) -> None:
        """Learn the outcome of the last step if it was decided on the device: count a skip, find the
        culprits (their gradients are still there: called before zero_grad drops them), update the scale.

        Called by everything that reads the outcome or starts the next iteration, so the host waits
        for the check at most once per step, and only once the step's kernels are queued behind it.
        """
        due = self.due
        if due is None:
            return
        self.due = None
        if bool(due.verdict):
            self.skipped += 1
            self.overflow = which_overflowed(self.params(), self.low_of, due.in_place)
        else:
            self.overflow = None
        if due.update:
            self.scaler.update()

    def zero_grad(self, set_to_none: bool, lows: Sequence[torch.Tensor]) -> None:
        """:meth:`fxamp.MixedPrecisionOptimizer.zero_grad`: the iteration starts over (``lows``: the low-precision
        parameters whose gradients are cleared too)."""
        self.settle()
        self.check = None
        optimizer = self.optimizer
        if set_to_none:
            if not _stock_zero_grad(optimizer):
                optimizer.zero_grad()  # (its default: a duck-typed one may take no set_to_none)
            for p in [*self.params(), *lows]:  # what Optimizer.zero_grad does, whatever the inner one did
                p.grad = None
            if self.release_grad_buffer and self.kept is not None:
                for bucket in self.kept.buckets:
                    bucket.release()
        else:
            optimizer.zero_grad(set_to_none=False)
            grads = []
            for p in lows:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)
        self.scaler.restart(self.client, drop_scaled=self.owns_scaler)

    # -- clipping: a stage of its own between backward() and step() ------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """:meth:`fxamp.MixedPrecisionOptimizer.clip_grad_norm_`: without leaving a segmented step, the norms
        from the low-precision gradients and the clip factor joined to the unscaling inside ``step()``."""
        self.check_grads()
        self.settle()
        if self.check is not None and self.check.coef is not None:  # the masters have no gradients to clip again
            raise OptimizerStateError(
                "clip_grad_norm_() already ran since the last backward(): call it once, between the last "
                "backward() and step()")
        plan = self.plan()
        stage = self.scaler.stage(self.client)
        if not (stage is Stage.SCALED and self.segmentable(plan)):
            if stage is not Stage.UNSCALED:
                self.unscale_()  # (says what is wrong when there was no backward)
            return torch.nn.utils.clip_grad_norm_(list(self.params()), max_norm, norm_type, error_if_nonfinite)
        flags = self.scaler.start_unscale(self.client)
        exact = self.decides_on(plan) is not None  # (exact, and the host does not wait)
        with torch.no_grad():
            checked, norms, own = clip_in_place(plan, flags, norm_type, exact)
            check = self.decide(flags, checked, plan, in_place=True)
            total, check.coef = clip_factor(norms, own, max_norm, norm_type, error_if_nonfinite)
        return total

    # -- what the stages ask ----------------------------------------------------------------------------
    def segmentable(self, plan: Plan) -> bool:
        """Whether step() may step the masters a segment at a time: the gradient buffer is released between
        steps, the inner optimizer steps each parameter on its own, the masters' gradients would take 16 MiB
        or more, and no gradient is sparse (with ``compile_step``'s kernels at any size: no float32 gradient
        at all)."""
        per_parameter = steps_per_parameter(self.optimizer)
        if self.fuses(plan):
            if not per_parameter and not self.hooks_warned:  # step hooks must run once per step
                self.hooks_warned = True
                warnings.warn("compile_step=True: the optimizer has step hooks, which must see one "
                              "step of every parameter, so it is stepped as it is (not fused)",
                              RuntimeWarning, stacklevel=4)
        elif not (self.release_grad_buffer and plan.buckets and plan.nbytes() >= planning.RELEASE_MIN_BYTES):
            return False
        return per_parameter and not plan.has_sparse_grad()

    def fuses(self, plan: Plan) -> bool:
        """Whether steps use ``compile_step``'s kernels: asked for, and enough elements in the masters
        for them to be faster than the plain step (:meth:`fxamp.training.kernels.Kernels.worth`; decided once
        a plan).  Otherwise the step is the one without ``compile_step``, and nothing is compiled."""
        if self.kernels is None or not plan.buckets:
            return False
        if plan.fuse is None:
            plan.fuse = self.kernels.worth([m for b in plan.buckets for m in b.masters])
        return plan.fuse

    def decides_on(self, plan: Plan) -> Optional[torch.device]:
        """The device the overflow decision stays on, or None (:func:`fxamp.training.plan.decides_on`)."""
        host_only = self.fuses(plan) and not self.kernels.skips_on_device
        return planning.decides_on(plan, self.optimizer, host_only, lambda d: not ranks_to_agree(self.sync_overflow)
                                   or reduces_on_device(d, self.process_group))

    def low_of(self, master: torch.Tensor) -> Optional[torch.Tensor]:
        """The low-precision parameter of ``master``, or None for a parameter stepped directly."""
        return self.low_of_id.get(id(master))

    def params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer steps: float32 masters and float32 parameters."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def overflowed(self) -> List[str]:
        """:meth:`fxamp.MixedPrecisionOptimizer.overflowed_params`: the names of the parameters whose gradients
        held an inf/NaN at the latest skipped step."""
        self.settle()
        if self.overflow is None:
            return []
        params, bad = self.overflow
        return [self.name(p) for p, b in zip(params, bad.tolist()) if b]

    def name(self, p: torch.Tensor) -> str:
        """``p``'s name in the model (a master's: its low-precision parameter's), else its place in the groups."""
        low = self.low_of_id.get(id(p))
        key = id(low) if low is not None else id(p)
        if key in self.names:
            return self.names[key]
        for i, group in enumerate(self.optimizer.param_groups):
            for j, q in enumerate(group["params"]):
                if q is p:
                    return f"group {i}, param {j}"
        return f"a parameter of shape {tuple(p.shape)}"  # pragma: no cover

    def restore(self, skipped: int) -> None:
        """A checkpoint was loaded: its count of skipped steps; this optimizer has neither unscaled nor stepped
        this iteration, and no overflow is known."""
        self.settle()
        self.skipped = int(skipped)
        self.scaler.forget(self.client)
        self.overflow = None


def _stock_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.zero_grad`` is ``Optimizer.zero_grad`` (no subclass or instance override)."""
    return type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in vars(optimizer)


# -- stage: the gradients where the executor reads them, checked -------------------------------------

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

