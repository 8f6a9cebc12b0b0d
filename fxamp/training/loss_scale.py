"""The loss scale and the whole stage machine of a step: the scale, the check, the decision (host- or
device-decided), the stages.

Float16 gradients underflow: the backward runs on ``loss * scale`` and the gradients are divided by
``scale`` (in float32) before the optimizer sees them; the kinds and the ``loss_scale=`` option are
:mod:`fxamp.training.config`'s (construction time: a step never visits it).

The scaler owns the whole iteration, as ``torch.amp.GradScaler`` does per optimizer: the scale,
the overflow decision and where each optimizer stands.  An optimizer ``attach()``-es once and
passes its :class:`ScalerClient` to the scaler's methods; it never reads the scaler's counters::

    client = scaler.attach()                          # READY
    loss = scaler.scale_loss(loss, client)            # -> SCALED (every client of this scaler)
    check = scaler.start_unscale(client)              # SCALED -> (unscaling)
    check.unscale_and_check_(grads)                   #   fused check + divide, per device (FoundInf)
    verdict, local = agree(check, device, sync)       #   the one decision: host bool or DeviceFlag
    scaler.finish_unscale(client, verdict)            # -> UNSCALED, the decision kept
    if scaler.start_step(client) is Stage.SCALED: ... # step() without unscale_(): unscale first
    found = scaler.found_inf(client)                  # step, or skip if found
    scaler.record(found, blame, client)               # -> STEPPED
    scaler.update()                                   # next generation: every client READY

A call out of this order raises :class:`OptimizerStateError` saying what to call instead.

The step engine (:class:`fxamp.training.step.Engine`) is the one caller of these methods during a step:
it stages, asks this module for the check and the decision, hands the step to an executor and records
the outcome here; :mod:`fxamp.training.distributed` joins only under an initialized ``torch.distributed``
(the all-reduce of the flag).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..dtypes import StrEnum
from ..errors import LossScaleError, OptimizerStateError
from .config import LossScaleConfig, LossScaleOption, ScaleKind, compute_dtype, config_for
from . import native
from .distributed import all_reduce_overflow, all_reduce_overflow_on_device

__all__ = ["LossScaler", "Stage", "ScalerClient", "scaler_for", "FoundInf", "DeviceFlag", "StepResult", "agree",
           "ranks_to_agree", "note_non_finite_", "fused_kernel_takes", "SUM_NUMEL"]


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


class DeviceFlag:
    """An overflow decision left on a CUDA device: a float32 0-dim ``flag`` (1.0: an inf/NaN was found).

    Copied to pinned host memory without waiting; ``bool()`` (True: overflowed) waits for that copy
    alone, which follows the check on the stream, not for work queued after it.  This is how a
    step is decided without stopping the host: the inner optimizer skips on the device (its fused
    kernel reads ``flag``) and the host learns the outcome later, when it needs it.
    """

    __slots__ = ("flag", "_host", "_event", "_value")

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag, self._event, self._value = flag, None, None  # (_event: a CUDA event; _value: the bool, once read)
        if _streams(flag.device):
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


class Stage(StrEnum):
    """Where one optimizer stands in the current iteration of its scaler."""

    READY = "ready"  # no scaled gradients since the last update (or zero_grad)
    SCALED = "scaled"  # a scaled backward ran: gradients hold loss * scale
    UNSCALED = "unscaled"  # unscaled and checked: the overflow decision is made
    STEPPED = "stepped"  # stepped (or skipped); a shared scaler waits for update()


class ScalerClient:
    """One optimizer's place in its scaler's iteration; made by :meth:`LossScaler.attach`, moved only by the scaler."""

    __slots__ = ("_unscaled_gen", "_stepped_gen", "_found")

    def __init__(self) -> None:
        self._unscaled_gen = -1  # generation of the last unscale, of the last step
        self._stepped_gen = -1
        self._found = False  # the overflow decision of the last unscale


class _AnyOf:
    """``bool()``: whether any of ``flags`` (bools and :class:`DeviceFlag`) is set; waits only when asked."""

    __slots__ = ("flags",)

    def __init__(self, flags: List[Any]) -> None:
        self.flags = flags

    def __bool__(self) -> bool:
        return any(bool(f) for f in self.flags)


def _streams(device: torch.device) -> bool:
    """Whether ``device`` is CUDA with a runtime (streams, pinned memory): not a fake tensor's "cuda" (tests)."""
    return device.type == "cuda" and torch.cuda.is_available()


def _cached_on(cache: Dict[torch.device, torch.Tensor], device: torch.device,
               make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[device]``, else a copy of the CPU tensor ``make()`` put there: to CUDA from pinned memory,
    so the host does not wait for the stream to reach the copy (a copy from pageable memory would:
    a hidden synchronization).  The caller clears ``cache`` when the value moves."""
    t = cache.get(device)
    if t is None:
        t = make()
        if _streams(device):  # (a fresh pinned buffer: nothing reuses it while the copy is in flight)
            t = t.pin_memory().to(device, non_blocking=True)
        else:
            t = t.to(device)
        cache[device] = t
    return t


#: the smallest positive normal float32: with min_scale=0 the scale stops here, 1/scale is finite
_TINY = float(torch.finfo(torch.float32).tiny)


_MISUSE = {
    ("backward", Stage.UNSCALED): (
        "backward() after unscale_(): the gradients were already unscaled for this step; "
        "call step() (or zero_grad()) first, and unscale_() only after the last backward()"),
    ("backward", Stage.STEPPED): (
        "backward() after step() but before the shared scaler's update(); call scaler.update() "
        "once every optimizer sharing it has stepped"),
    ("unscale", Stage.UNSCALED): (
        "unscale_() has already been called since the last step(); call it at most once per "
        "step, after the last backward()"),
    ("unscale", Stage.STEPPED): "unscale_() after step(); call it between backward() and step()",
    ("unscale", Stage.READY): (
        "unscale_() before any backward(); call opt.backward(loss) (or opt.scale_loss(loss).backward()) first"),
    ("step", Stage.READY): (
        "step() without a backward pass since the last step; call opt.backward(loss) "
        "(or opt.scale_loss(loss).backward()) before opt.step(); a loop that calls loss.backward() itself "
        "(transformers.Trainer) needs its loss routed through opt.scale_loss: build the model and optimizers "
        "with fxamp.integrations.hf.prepare(model, args, ..., in_place=True for a model fxamp.convert_ converted)"),
    ("step", Stage.STEPPED): (
        "step() was already called since the shared scaler's last update(); call scaler.update() "
        "once per iteration, after every optimizer sharing it has stepped"),
}


class LossScaler:
    """The loss scale and its update rule, shared by one or several optimizers.

    Dynamic scaling, per optimizer step (``hysteresis=1`` is exactly ``torch.amp.GradScaler``)::

        scale, good, tolerance = init_scale, 0, hysteresis
        on each step:
            found_inf = any gradient is inf/NaN   (all-reduced across ranks)
            if found_inf:
                skip the step                      # no weight, master or optimizer state changes
                good = 0
                tolerance = max(tolerance - 1, 0)
                if tolerance == 0:                 # hysteresis used up: back off
                    if min_scale > 0 and scale <= min_scale:
                        raise LossScaleError       # an overflow storm: the model is diverging
                    scale = max(scale * backoff_factor, min_scale or TINY)  # TINY: the smallest normal float32
            else:
                step
                good += 1
                if good == growth_interval:
                    scale = min(scale * growth_factor, max_scale)   # kept if not finite
                    good = 0
                    tolerance = hysteresis         # as DeepSpeed: refilled only when the scale grows

    ``scale`` is a float32 value and is updated by ``torch._amp_update_scale_``, so it moves
    bit for bit like GradScaler's.  Static and ``none`` scales never change; they still skip
    steps with non-finite gradients.

    An optimizer that owns its scaler calls :meth:`update` at the end of its ``step()``.  When
    several optimizers share one scaler (``loss_scale=scaler``), each ``step()`` records its
    overflow flag and the caller calls :meth:`update` once per iteration, after every step, as
    with GradScaler::

        scaler = fxamp.training.loss_scale.LossScaler()
        opt_a = fxamp.MixedPrecisionOptimizer(adam, loss_scale=scaler)
        opt_b = fxamp.MixedPrecisionOptimizer(sgd, loss_scale=scaler)
        opt_a.backward(loss_a + loss_b)
        opt_a.step(); opt_b.step()
        scaler.update()        # backs off if either overflowed
    """

    def __init__(self, config: Optional[LossScaleConfig] = None, *, owned: bool = False) -> None:
        if config is None:
            config = LossScaleConfig()
        if not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, not {type(config).__name__}; "
                            f"e.g. LossScaler(LossScaleConfig('static', 128.0))")
        self.config = config
        self.owned = bool(owned)  # an optimizer's own (scaler_for), updated by its step(): not to be shared
        self._scale = torch.full((), config.init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._good = 0  # the growth tracker's value, kept on the host (update() reads no tensor to move it)
        self._tolerance = config.hysteresis
        self._scale_value = float(self._scale)
        self._inv: Dict[torch.device, torch.Tensor] = {}  # inv_scale() per device, until the scale moves
        self._on: Dict[torch.device, torch.Tensor] = {}  # the scale per device, until it moves
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

    # -- reading ---------------------------------------------------------------------------
    @property
    def kind(self) -> ScaleKind:
        return self.config.kind

    def defer(self, catch_up: Callable[[], None]) -> None:
        """An optimizer decided a step on the device and will record its outcome (and update this
        scale) when its next iteration starts; ``catch_up()`` does that now.  The scaler runs it before
        it answers what that update changes (:attr:`overflows`, :attr:`scale`, :meth:`state_dict`), so
        reading them straight after ``step()`` is never one step behind.  One entry per optimizer: a
        training loop that never reads them must not grow the list step by step (the wrapper settles
        at its next iteration anyway; a later call of its catch-up is then a no-op)."""
        if catch_up not in self._behind:
            self._behind.append(catch_up)

    @property
    def catch_ups(self) -> int:
        """Optimizers whose device-decided step this scaler has yet to fold in (see :meth:`defer`); reading
        this does not fold them in."""
        return len(self._behind)

    def _catch_up(self) -> None:
        while self._behind:
            self._behind.pop(0)()

    @property
    def overflows(self) -> int:
        """Overflowed updates so far (iterations whose steps were skipped); waits for flags left on a device."""
        self._catch_up()
        self._fold(wait=True)
        return self._overflows

    @overflows.setter
    def overflows(self, value: int) -> None:
        self._overflows = int(value)
        self._unresolved = []

    def _fold(self, wait: bool) -> None:
        """Count the iterations whose device flags are known (all of them with ``wait``)."""
        keep = []
        for flags in self._unresolved:
            if wait or all(f.ready() for f in flags if isinstance(f, DeviceFlag)):
                self._overflows += any(bool(f) for f in flags)
            else:
                keep.append(flags)
        self._unresolved = keep

    @property
    def scale(self) -> float:
        """The current loss scale."""
        self._catch_up()
        return self._scale_value

    @property
    def generation(self) -> int:
        """update() calls since this scaler was built (not restored by load_state_dict: it orders stages)."""
        return self._generation

    def inv_scale(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``1 / scale`` as a float32 0-dim tensor, computed in float64 as GradScaler does.

        Without ``device``: a new CPU tensor.  With it: one cached there until the scale moves; do not modify it.
        """
        if device is None:
            return self._scale.double().reciprocal().float()
        return self._inv_scale_on(torch.device(device))

    def _inv_scale_on(self, device: torch.device) -> torch.Tensor:
        return _cached_on(self._inv, device, self.inv_scale)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        return _cached_on(self._on, device, lambda: self._scale)

    def _scale_moved(self) -> None:
        self._scale_value = float(self._scale)
        self._inv.clear()
        self._on.clear()

    # -- the iteration ---------------------------------------------------------------------
    def attach(self) -> ScalerClient:
        """A new optimizer's place in this scaler's iterations (READY); pass it to the methods below."""
        return ScalerClient()

    def stage(self, client: ScalerClient) -> Stage:
        """Where ``client`` stands: STEPPED or UNSCALED this generation, else SCALED if a scaled backward ran."""
        if client._stepped_gen == self._generation:
            return Stage.STEPPED
        if client._unscaled_gen == self._generation:
            return Stage.UNSCALED
        return Stage.SCALED if self._scaled else Stage.READY

    def _require(self, client: ScalerClient, action: str) -> Stage:
        stage = self.stage(client)
        message = _MISUSE.get((action, stage))
        if message is not None:
            raise OptimizerStateError(message)
        return stage

    def scale_loss(self, loss: torch.Tensor, client: Optional[ScalerClient] = None) -> torch.Tensor:
        """``loss * scale`` (``loss`` itself when the scale is 1); every client is SCALED afterwards.

        With ``client``: refused after its unscale or step this iteration (its gradients are final).
        """
        if client is not None:
            self._require(client, "backward")
        self._scaled += 1
        if self._scale_value == 1.0 and self.kind is not ScaleKind.DYNAMIC:
            return loss
        return loss * self._scale_on(loss.device)

    def start_unscale(self, client: ScalerClient) -> FoundInf:
        """Check that ``client`` may unscale now (SCALED), and return the accumulator to unscale with."""
        self._require(client, "unscale")
        return FoundInf(self._inv_scale_on, unit=self._scale_value == 1.0)

    def finish_unscale(self, client: ScalerClient, found_inf: bool) -> None:
        """``client`` unscaled; ``found_inf`` (agreed across ranks) decides its step.  -> UNSCALED."""
        client._found = bool(found_inf)
        client._unscaled_gen = self._generation

    def start_step(self, client: ScalerClient) -> Stage:
        """Check that ``client`` may step: returns SCALED (unscale first) or UNSCALED."""
        return self._require(client, "step")

    def found_inf(self, client: ScalerClient) -> bool:
        """The overflow decision of ``client``'s unscale this iteration."""
        if self.stage(client) is not Stage.UNSCALED:
            raise OptimizerStateError(f"found_inf() in stage {self.stage(client)}; unscale first (start_unscale)")
        return client._found

    def restart(self, client: ScalerClient, *, drop_scaled: bool) -> None:
        """``zero_grad``: forget ``client``'s unscale (not its step); ``drop_scaled``: its gradients were the only ones."""
        if self.stage(client) is Stage.STEPPED:
            return
        client._unscaled_gen = -1
        if drop_scaled:
            self._scaled = 0

    def forget(self, client: ScalerClient) -> None:
        """``client`` was reloaded from a checkpoint: it has neither unscaled nor stepped this iteration."""
        client._unscaled_gen = client._stepped_gen = -1
        client._found = False

    def record(self, found_inf: Union[bool, DeviceFlag], blame: Callable[[], Sequence[str]] = tuple,
               client: Optional[ScalerClient] = None) -> None:
        """Report one optimizer's overflow decision for this iteration; ``blame()`` names the culprits.

        ``found_inf`` may be a :class:`DeviceFlag` still on its device: a static or ``none`` scale
        counts it when it is known; a dynamic one waits for it in :meth:`update`.
        With ``client``: it is STEPPED until :meth:`update`.
        """
        self._records.append((found_inf if isinstance(found_inf, DeviceFlag) else bool(found_inf), blame))
        if client is not None:
            client._stepped_gen = self._generation

    def update(self) -> bool:
        """Move the scale by this iteration's records (see the class docstring); return True on overflow.

        Raises LossScaleError when the dynamic scale would fall below ``min_scale``.
        """
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
            return _AnyOf(flags)
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
            self._scale.clamp_(min=cfg.min_scale or _TINY, max=cfg.max_scale)  # 0 never: 1/scale must stay finite
            self._scale_moved()
        self._good = 0 if found or was_growing else self._good + 1
        if was_growing:
            self._tolerance = cfg.hysteresis
        return found

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state, every key plain Python:

        kind:           "dynamic", "static" or "none" (checked on load)
        scale:          the current loss scale (float)
        growth_tracker: clean steps in a row since the last overflow or growth
        tolerance:      overflows still tolerated before backing off (hysteresis)
        overflows:      overflowed iterations so far
        updates:        iterations so far
        """
        self._catch_up()
        return {
            "kind": self.kind.value,
            "scale": self._scale_value,
            "growth_tracker": self._good,
            "tolerance": self._tolerance,
            "overflows": self.overflows,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the config (factors, interval…) stays the one this scaler was built with."""
        self.check_state_dict(state)
        self._scale.fill_(state["scale"])
        self._scale_moved()
        self._good, self._tolerance = int(state["growth_tracker"]), int(state["tolerance"])
        self.overflows, self.updates = int(state["overflows"]), int(state["updates"])

    def check_state_dict(self, state: Any) -> None:
        """Raise unless :meth:`load_state_dict` takes ``state`` (a checkpoint's loader asks before changing anything)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"LossScaler.load_state_dict takes the dict LossScaler.state_dict() returned, "
                            f"not {type(state).__name__}")
        if missing := {"kind", "scale", "growth_tracker", "tolerance", "overflows", "updates"} - set(state):
            raise KeyError(f"loss scaler state_dict lacks {sorted(missing)}; pass what LossScaler.state_dict() returned")
        if state["kind"] != self.kind.value:
            raise ValueError(f"the checkpoint's loss scale is {state['kind']!r} but this scaler's is "
                             f"{self.kind.value!r}; build the scaler with the same kind")

    def __repr__(self) -> str:
        return f"LossScaler({self.config}, scale={self._scale_value:g}, overflows={self.overflows})"


def _list_names(names: Sequence[str], limit: int = 20) -> str:
    if not names:
        return "(none on this rank: another rank overflowed)"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

def scaler_for(loss_scale: LossScaleOption, model: Optional[torch.nn.Module] = None,
               params: Sequence[torch.Tensor] = ()) -> Tuple[LossScaler, bool]:
    """The scaler of a ``loss_scale=`` option, and whether the optimizer owns it (not a shared one).

    A :class:`LossScaler` is shared as it is; anything else is :func:`fxamp.training.config.config_for`'s
    (``"auto"`` reads the compute dtype of ``model``'s fxamp policy, else of ``params``:
    :func:`~fxamp.training.config.compute_dtype`).
    """
    if isinstance(loss_scale, LossScaler):
        if loss_scale.owned:
            raise ValueError("loss_scale= is another MixedPrecisionOptimizer's own scaler (its .scaler), updated by its step(); "
                             "share a LossScaler() you build as loss_scale= of each, then scaler.update() once after every optimizer's step()")
        return loss_scale, False
    return LossScaler(config_for(loss_scale, compute_dtype(model, params)), owned=True), True
