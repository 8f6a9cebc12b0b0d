"""The step engine: one optimizer's step, top to bottom: stage -> check -> execute (and refresh) -> record.

The facade (:mod:`fxamp.training.optimizer`) hands a step to its :class:`Engine`, which calls down into
:mod:`fxamp.training.executors` (nothing there calls back): a step runs code in these three files
(``tests/test_layout.py`` traces it); lean masters add their step (``lean_step``, ``flat``, ``quant``, ``native``),
``torch.distributed`` :mod:`~fxamp.training.distributed`, ``compile_step`` :mod:`~fxamp.training.kernels`::

    stage    the gradients where the executor reads them, checked on the way (``executors.FoundInf``): every
             master's float32 gradient in its ``.grad`` (``executors.unscale``: the plain step), or the
             low-precision ones checked where they are (``executors.check_in_place``: a segmented step); over
             the plan (:mod:`fxamp.training.plan`), built once per layout of ``param_groups``
    check    the verdict (:func:`agree`, the one place that decides), agreed across ranks, read on the host
             or left on the device (:class:`DeviceFlag`); a skip changes no weight, master or state
    execute  one executor steps the masters and rounds them into the low weights: ``Plain``, or a run at a
             time (``Segmented``: one reused float32 segment; bitwise the plain step), or ``Compiled``
    record   the outcome told to the scaler's state machine (:class:`StageMachine`, the per-step half of
             ``loss_scale.LossScaler``), which moves the scale (decided on the device: at :meth:`Engine.settle`)

docs/DESIGN.md ("Training: one step engine") has the detail.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.optim.optimizer as _torch_optimizer
import warnings

from . import plan as planning
from .config import TINY, AnyOf, LossScaleConfig, ScaleKind, ScalerClient, Stage
from .distributed import all_reduce_overflow, all_reduce_overflow_on_device, reduces_on_device
from .executors import (Executor, FoundInf, Lean, OnDevices, Plain, Segmented, Segments, check_in_place, has_streams,
                        multiplier_of, unscale, which_overflowed)
from .grad_watch import ScaledGradWatch
from ..errors import LossScaleError, OptimizerStateError, moved_names as _moved_names
from ..info import take_loaded
from .plan import Plan

__all__ = ["PER_PARAMETER", "steps_per_parameter", "ranks_to_agree", "agree", "DeviceFlag", "StepResult", "StageMachine",
           "Check", "Engine"]

#: what left this module (docs/DESIGN.md: a step runs code in three files); the old names resolve with a warning
__getattr__ = _moved_names(__name__, {
    **dict.fromkeys(("SEGMENT_NUMEL", "ACCELERATOR_SEGMENT_NUMEL", "segment_numel_for", "plan_runs", "Run", "cut_runs",
                     "grad_strides"), "fxamp.training.plan"),
    **dict.fromkeys(("refresh", "step_runs", "flat_grads"), "fxamp.training.executors"),  # (unscale...: imported here)
    **dict.fromkeys(("clip_in_place", "clip_factor"), "fxamp.training.iteration")})

#: torch.optim classes whose step updates each parameter from its own gradient and state alone
#: (LBFGS needs a closure and all parameters; SparseAdam sparse gradients, which take the other path)
PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name))


def steps_per_parameter(optimizer: Any) -> bool:
    """Whether stepping ``optimizer`` on some parameters at a time is the same as one step on all: only the exact
    classes of :data:`PER_PARAMETER` (a subclass may override ``step``), without step hooks (once per run, not step)."""
    if type(optimizer) not in PER_PARAMETER:
        return False
    # torch keeps step hooks in these dicts (per instance, and global); it has no public query
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))
    return not any(hooks)


# -- check: the one decision, and its outcome ------------------------------------------------------

def ranks_to_agree(sync: bool) -> bool:
    """Whether a step with ``sync_overflow=sync`` agrees with other ranks: ``sync`` and an initialized
    ``torch.distributed`` (else :mod:`fxamp.training.distributed` has nothing to do: a step does not visit it)."""
    return sync and dist.is_available() and dist.is_initialized()


def agree(flags: FoundInf, device: Optional[torch.device], sync: bool, group: Optional[Any] = None
          ) -> Tuple[Union[bool, DeviceFlag], bool]:
    """The one place a step's overflow is decided: ``(verdict, local)``.

    ``device`` None: decided on the host, ``verdict`` a bool (the flags of every device read, and
    with ``sync`` the maximum over ``group``'s ranks), ``local`` whether this rank overflowed.
    Otherwise the flag stays on ``device`` (agreed there with ``sync``; :func:`reduces_on_device`
    must hold): ``verdict`` is a :class:`DeviceFlag` the host reads only when asked, ``local`` False.
    """
    sync = ranks_to_agree(sync)
    if device is not None:
        flag = flags.flag_on(device)
        return DeviceFlag(all_reduce_overflow_on_device(flag, group) if sync else flag), False
    local = flags.found()
    if not sync:
        found = bool(local.item())  # the step's one read of the check
        return found, found
    return bool(all_reduce_overflow(local, group).item()), bool(local.item())


class DeviceFlag:
    """An overflow decision left on a CUDA device: a float32 0-dim ``flag`` (1.0: an inf/NaN was found), copied to
    pinned host memory without waiting; ``bool()`` (True: overflowed) waits for that copy alone, not for work
    queued after it.  The inner optimizer skips on the device (its fused kernel reads ``flag``); the host learns
    the outcome when it needs it."""

    __slots__ = ("flag", "_host", "_event", "_value")

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag, self._event, self._value = flag, None, None  # (_event: a CUDA event; _value: the bool, once read)
        if has_streams(flag.device):
            self._host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flag.device))
        else:  # (a CPU flag: known at once; the tests run the deferred step this way)
            self._host = flag

    def ready(self) -> bool:
        """Whether the outcome is known without waiting."""
        return self._value is not None or self._event is None or self._event.query()

    def __bool__(self) -> bool:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = bool(self._host.item() != 0)
        return self._value

    def __repr__(self) -> str:
        return f"DeviceFlag({bool(self) if self.ready() else 'pending'})"


class StepResult:
    """What ``step()`` returns when the overflow decision stayed on the GPU: truthy if it stepped; ``bool()`` waits
    for the check (not for the step): ignore it, and the host never waits."""

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


# -- record: the scaler's state machine ---------------------------------------------------------------


class StageMachine:
    """The per-step half of :class:`fxamp.training.loss_scale.LossScaler` (its base): the scale, its update rule
    (LossScaler's docstring) and where each attached optimizer stands, moved by the engine in a step's order:
    ``start_step`` (SCALED: unscale first, or UNSCALED), ``start_unscale`` (a FoundInf), ``finish_unscale`` (->
    UNSCALED), ``found_inf``, ``record`` (-> STEPPED), ``update`` (the scale moved; every client READY).  What a
    step does not run (the config's checks, ``scale_loss``, ``state_dict``, reading) is LossScaler's, and so are
    the words of a call out of order (:attr:`MISUSE`)."""

    #: (verb, stage) -> why that call is refused there and what to call instead (LossScaler's)
    MISUSE: Mapping[Tuple[str, Stage], str] = {}

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self._scale = torch.full((), config.init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._good = 0  # the growth tracker's value, kept on the host (update() reads no tensor to move it)
        self._tolerance = config.hysteresis
        self._scale_moved()  # (_scale_value; _inv, _on: 1/scale and the scale per device, until the scale moves)
        self._overflows = 0  # overflowed updates so far (iterations whose steps were skipped) ...
        self._unresolved: List[List[Any]] = []  # ... and those whose flags are still on a device
        #: update() calls so far (one per training iteration)
        self.updates = 0
        # per iteration: bumped by update(); scale_loss() calls since; the steps' records
        self._generation = 0
        self._scaled = 0
        self._records: List[Tuple[bool, Callable[[], Sequence[str]]]] = []
        #: catch-ups of optimizers that left a device-decided step's update for later (see defer())
        self._behind: List[Callable[[], None]] = []

    def _scale_moved(self) -> None:
        self._scale_value = float(self._scale)
        self._inv = OnDevices(self._scale.double().reciprocal().float())  # computed in float64, as GradScaler does
        self._on = OnDevices(self._scale)

    def defer(self, catch_up: Callable[[], None]) -> None:
        """An optimizer decided a step on the device and will record its outcome (and update this scale) when its
        next iteration starts; ``catch_up()`` does that now, before the scaler answers what that update changes
        (``overflows``, ``scale``, ``state_dict``).  One entry per optimizer (a later call is then a no-op)."""
        if catch_up not in self._behind:
            self._behind.append(catch_up)

    def _fold(self, wait: bool) -> None:
        """Count the iterations whose device flags are known (all of them with ``wait``)."""
        keep = []
        for flags in self._unresolved:
            if wait or all(f.ready() for f in flags if isinstance(f, DeviceFlag)):
                self._overflows += any(bool(f) for f in flags)
            else:
                keep.append(flags)
        self._unresolved = keep

    def stage(self, client: ScalerClient) -> Stage:
        """Where ``client`` stands: STEPPED or UNSCALED this generation, else SCALED if a scaled backward ran."""
        if client.stepped_gen == self._generation:
            return Stage.STEPPED
        if client.unscaled_gen == self._generation:
            return Stage.UNSCALED
        return Stage.SCALED if self._scaled else Stage.READY

    def _require(self, client: ScalerClient, action: str) -> Stage:
        stage = self.stage(client)
        message = self.MISUSE.get((action, stage))
        if message is not None:
            raise OptimizerStateError(message)
        return stage

    def start_unscale(self, client: ScalerClient) -> FoundInf:
        """Check that ``client`` may unscale now (SCALED), and return the accumulator to unscale with."""
        self._require(client, "unscale")
        return FoundInf(self._inv, unit=self._scale_value == 1.0)

    def finish_unscale(self, client: ScalerClient, found_inf: bool) -> None:
        """``client`` unscaled; ``found_inf`` (agreed across ranks) decides its step.  -> UNSCALED."""
        client.found = bool(found_inf)
        client.unscaled_gen = self._generation

    def start_step(self, client: ScalerClient) -> Stage:
        """Check that ``client`` may step: returns SCALED (unscale first) or UNSCALED."""
        return self._require(client, "step")

    def found_inf(self, client: ScalerClient) -> bool:
        """The overflow decision of ``client``'s unscale this iteration."""
        if self.stage(client) is not Stage.UNSCALED:
            raise OptimizerStateError(f"found_inf() in stage {self.stage(client)}; unscale first (start_unscale)")
        return client.found

    def record(self, found_inf: Union[bool, DeviceFlag], blame: Callable[[], Sequence[str]] = tuple,
               client: Optional[ScalerClient] = None) -> None:
        """Report one optimizer's overflow decision for this iteration; ``blame()`` names the culprits.  A
        :class:`DeviceFlag` is counted when known (a dynamic scale waits in :meth:`update`).  ``client``: STEPPED."""
        self._records.append((found_inf if isinstance(found_inf, DeviceFlag) else bool(found_inf), blame))
        if client is not None:
            client.stepped_gen = self._generation

    def update(self) -> bool:
        """Move the scale by this iteration's records; True on overflow.  LossScaleError below ``min_scale``."""
        if not self._records:
            raise OptimizerStateError(
                "LossScaler.update() called but no optimizer stepped since the last update(); "
                "call opt.step() on every optimizer that shares this scaler first"
            )
        cfg = self.config
        records, self._records = self._records, []
        self._scaled = 0
        self._generation += 1
        self.updates += 1
        if cfg.kind is not ScaleKind.DYNAMIC and any(isinstance(f, DeviceFlag) for f, _ in records):
            flags = [f for f, _ in records]  # nothing moves on them: counted when known, not waited for
            self._unresolved.append(flags)
            self._fold(wait=False)
            return AnyOf(flags)
        found = any(bool(f) for f, _ in records)
        blames = [b for f, b in records if f]
        if found:
            self._overflows += 1
        if cfg.kind is not ScaleKind.DYNAMIC:
            return found
        backoff = 1.0
        if found:
            self._tolerance = max(self._tolerance - 1, 0)
            if self._tolerance == 0:
                if cfg.min_scale > 0 and self._scale_value <= cfg.min_scale:
                    names = [n for b in blames for n in b()]
                    raise LossScaleError(
                        f"dynamic loss scaling gave up: an overflow at scale {self._scale_value:g}, which is "
                        f"already min_scale={cfg.min_scale:g}, after {self.overflows} overflowed step(s) in "
                        f"{self.updates}: the model is diverging (or its loss is not finite). Non-finite "
                        f"gradients in: {_list_names(names)}. Lower the learning rate, check the data and "
                        f"the loss for inf/NaN, keep the offending layers in float32 (fxamp.convert(..., "
                        f"overrides=...)), or use bfloat16; min_scale=0 never gives up."
                    )
                backoff = cfg.backoff_factor
        # the growth tracker kept on the host by _amp_update_scale_'s rule (reset by an overflow or a growth, else one
        # more): the scale's tensors are touched, and the scale read, only when it may move
        was_growing = self._good + 1 == cfg.growth_interval and not found
        if found or was_growing:
            self._growth_tracker.fill_(self._good)
            torch._amp_update_scale_(self._scale, self._growth_tracker, torch.full((), float(found)),
                                     cfg.growth_factor, backoff, cfg.growth_interval)
            self._scale.clamp_(min=cfg.min_scale or TINY, max=cfg.max_scale)  # 0 never: 1/scale must stay finite
            self._scale_moved()
        self._good = 0 if found or was_growing else self._good + 1
        if was_growing:
            self._tolerance = cfg.hysteresis
        return found


def _list_names(names: Sequence[str], limit: int = 20) -> str:
    if not names:
        return "(none on this rank: another rank overflowed)"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# -- the engine -------------------------------------------------------------------------------------------

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
        """What a segmented step multiplies the copied gradients by (:func:`fxamp.training.executors.multiplier_of`)."""
        return multiplier_of(self.flags, self.coef)


class Engine:
    """The steps of one :class:`~fxamp.MixedPrecisionOptimizer`: its verbs' work and the state between them.

    optimizer:   the inner optimizer, stepping float32 masters and parameters
    scaler:      the ``LossScaler`` (``owns_scaler``: not shared, so the engine updates it each step)
    low_of:      id(master) -> its low-precision parameter (the facade's pairs, shared)
    ws:          the lean workspace (:class:`fxamp.training.lean.Workspace`: a written weight followed), or None;
                 ``lean``: its step (:class:`fxamp.training.lean_step.LeanStep`: what the executors enter and leave);
                 ``kernels``: ``compile_step``'s (:class:`fxamp.training.kernels.Kernels`, imported only then), or None
    names:       id(parameter) -> its name in the model (for errors and :meth:`overflowed`)
    sync_overflow, process_group, release_grad_buffer: the facade's options (it sets them here)
    """

    def __init__(self, optimizer: Any, scaler: StageMachine, owns_scaler: bool, low_of: Dict[int, torch.Tensor],
                 names: Dict[int, str], ws: Optional[Any], lean: Optional[Lean], kernels: Optional[Any], *,
                 sync_overflow: bool,
                 process_group: Optional[Any], release_grad_buffer: bool) -> None:
        self.optimizer, self.scaler, self.owns_scaler = optimizer, scaler, owns_scaler
        self.low_of_id, self.names, self.ws, self.lean, self.kernels = low_of, names, ws, lean, kernels
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
        """Before the gradients are unscaled: warn once if one was written while scaled (torch's clip on them): its
        version counter moved since the watch recorded it.  Compared here, so a step runs no code of the watch."""
        watch = self.watch
        if watch.pending:  # (after a scaled backward() only)
            seen, watch.seen, watch.pending = watch.seen, None, False
            changed = next((p for p, grad, version in seen or () if p.grad is grad and grad._version != version), None)
            if changed is not None and not watch.warned:
                watch.warn(self.name(changed), self.scaler.scale, stacklevel=4)  # (facade verb, then the user)

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
        """Masters follow the low-precision weights the user wrote since :meth:`note_weights` (a checkpoint loaded into
        the model, a re-initialisation, a DDP broadcast), or the step would round the old master into the weight: a
        float32 master takes the float32 value loaded (``fxamp.info.take_loaded``), else the weight widened, where
        the weight is no longer its rounding; a kahan term restarts at zero (``Workspace.follow``).  The optimizer
        state stays.  No op runs unless a weight's version counter or memory changed."""
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
        plan = self.kept  # the same groups holding the same lists of the same lengths (the lists are held: no id reused)
        if plan is None or len(groups) != len(plan.layout) or not all(
                g["params"] is params and len(params) == n for g, (params, n) in zip(groups, plan.layout)):
            plan = self.kept = Plan(groups, self.low_of)
        return plan

    def decide(self, flags: FoundInf, checked: int, plan: Plan, in_place: bool) -> Check:
        """Whether this step overflowed (:func:`agree`); tell the scaler, keep the step's :class:`Check` for ``step()``.
        Decided on the device (:meth:`decides_on`): the scaler is told "no overflow" for now, the inner optimizer
        skips on the device, the outcome is counted when the next iteration starts (:meth:`settle`)."""
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
        if self.lean is not None:
            self.lean.stepped()

    def executor(self, plan: Plan, check: Check, found: Optional[torch.Tensor]) -> Executor:
        """The plain step's :class:`~fxamp.training.executors.Plain`; a segmented one's (runs planned at its first
        step: :func:`fxamp.training.plan.plan_runs`) :class:`~fxamp.training.executors.Segmented`, or with
        ``compile_step``'s kernels their ``Compiled`` (:meth:`fxamp.training.kernels.Kernels.executor`)."""
        if not check.in_place:
            return Plain(plan, self.lean, steps_per_parameter(self.optimizer))
        if plan.runs is None:
            segment_numel = planning.segment_numel_for(plan.devices())
            plan.runs = planning.plan_runs(self.optimizer.param_groups, self.low_of, segment_numel)
            plan.segments = Segments(segment_numel)
        if self.fuses(plan):
            return self.kernels.executor(plan.segments.limit, found)
        return Segmented(self.lean, plan.segments)

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
        """Learn the outcome of a device-decided last step: count a skip, find the culprits (before zero_grad drops
        their gradients), update the scale.  Called by everything that reads the outcome or starts the next
        iteration: the host waits for the check at most once per step, once the step's kernels are queued."""
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
        elif not (self.release_grad_buffer and plan.buckets
                  and sum(b.nbytes for b in plan.buckets) >= planning.RELEASE_MIN_BYTES):
            return False
        return per_parameter and not any(p.grad is not None and p.grad.is_sparse for b in plan.buckets for p in b.lows)

    def fuses(self, plan: Plan) -> bool:
        """Whether steps use ``compile_step``'s kernels: asked for, and enough elements in the masters for them to
        be faster (:meth:`fxamp.training.kernels.Kernels.worth`; once a plan); else nothing is compiled."""
        if self.kernels is None or not plan.buckets:
            return False
        if plan.fuse is None:
            plan.fuse = self.kernels.worth([m for b in plan.buckets for m in b.masters])
        return plan.fuse

    def decides_on(self, plan: Plan) -> Optional[torch.device]:
        """The device on which this step's overflow decision stays (the host does not wait for it), or None;
        decided once per plan.  When the inner optimizer's step can skip on the device (torch's fused Adam,
        AdamW, SGD: ``_step_supports_amp_scaling``, the flag GradScaler passes them), all its parameters are on
        one device of a type in :data:`fxamp.training.plan.DECIDE_ON` and the flag can be agreed on there,
        unless ``compile_step``'s kernels read the decision on the host (their SGD).  Elsewhere: the host."""
        if plan.decide_on is planning.UNDECIDED:
            plan.decide_on = None
            devices = plan.devices()
            if self.fuses(plan) and not self.kernels.skips_on_device:
                return None
            device = next(iter(devices)) if len(devices) == 1 else None
            if (getattr(self.optimizer, "_step_supports_amp_scaling", False) and device is not None
                    and device.type in planning.DECIDE_ON and (not ranks_to_agree(self.sync_overflow)
                                                               or reduces_on_device(device, self.process_group))):
                plan.decide_on = device
        return plan.decide_on

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
