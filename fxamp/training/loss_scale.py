"""Loss scaling: a frozen :class:`LossScaleConfig` and the :class:`LossScaler` state machine.

Float16 gradients underflow: backpropagating ``loss * scale`` keeps them representable, and the
gradients are divided by ``scale`` (in float32) before the optimizer sees them.  Three kinds:

* ``"dynamic"`` (the default for float16): the scale adapts, see :class:`LossScaler`.
* ``"static"``: a fixed scale.
* ``"none"`` (the default for bfloat16 and float32): the scale is 1.

Whatever the kind, a step whose gradients hold an inf or NaN is skipped.

The scaler owns the whole iteration, as ``torch.amp.GradScaler`` does per optimizer: the scale,
the overflow decision and where each optimizer stands.  An optimizer ``attach()``-es once and
passes its :class:`ScalerClient` to the scaler's methods; it never reads the scaler's counters::

    client = scaler.attach()                          # READY
    loss = scaler.scale_loss(loss, client)            # -> SCALED (every client of this scaler)
    check = scaler.start_unscale(client)              # SCALED -> (unscaling)
    check.unscale_and_check_(grads)                   #   fused check + divide, per device
    scaler.finish_unscale(client, check.found())      # -> UNSCALED, the decision kept
    if scaler.start_step(client) is Stage.SCALED: ... # step() without unscale_(): unscale first
    found = scaler.found_inf(client)                  # step, or skip if found
    scaler.record(found, blame, client)               # -> STEPPED
    scaler.update()                                   # next generation: every client READY

A call out of this order raises :class:`OptimizerStateError` saying what to call instead.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..errors import LossScaleError, OptimizerStateError
from ..info import policy_of
from .check import DeviceFlag, FoundInf

__all__ = ["ScaleKind", "LossScaleConfig", "LossScaleOption", "LossScaler", "Stage", "ScalerClient", "scaler_for"]


class ScaleKind(str, enum.Enum):
    """How the loss scale behaves; a ``str`` so ``"dynamic"`` and ``ScaleKind.DYNAMIC`` are interchangeable."""

    DYNAMIC = "dynamic"
    STATIC = "static"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


_KINDS = ", ".join(repr(k.value) for k in ScaleKind)
_OPTIONS = ("'auto', 'dynamic', 'none', 'static:<scale>' (e.g. 'static:1024'), a LossScaleConfig, or a "
            "LossScaler shared with other optimizers")

#: what ``loss_scale=`` takes (:func:`scaler_for`): a string shorthand, a config, or a shared scaler
LossScaleOption = Union[str, "LossScaleConfig", "LossScaler"]


@dataclass(frozen=True)
class LossScaleConfig:
    """How to scale the loss; validated at construction.

    ``LossScaleConfig()`` is dynamic scaling with the defaults of ``torch.amp.GradScaler`` plus a
    floor, a ceiling and DeepSpeed's hysteresis.  The fields other than ``kind`` and
    ``init_scale`` matter only to dynamic scaling.
    """

    kind: ScaleKind = ScaleKind.DYNAMIC
    #: the first scale (:meth:`of`, :meth:`none` and :meth:`static` pick it for the other kinds)
    init_scale: float = 2.0**16
    #: multiply the scale by this after ``growth_interval`` clean steps in a row
    growth_factor: float = 2.0
    #: multiply the scale by this on an overflow (once ``hysteresis`` overflows are used up)
    backoff_factor: float = 0.5
    #: clean steps in a row before the scale grows
    growth_interval: int = 2000
    #: an overflow at this scale raises LossScaleError: the model is diverging (0: never; the
    #: scale then stops at the smallest normal float32, whose inverse is still finite)
    min_scale: float = 1.0
    #: the scale never grows past this
    max_scale: float = 2.0**24
    #: overflows tolerated (skipped, scale kept) before backing off; refilled when the scale grows
    hysteresis: int = 1

    def __post_init__(self) -> None:
        """Validate only (normalising is :meth:`of`'s): a frozen config is never written after construction."""
        kind, init = self.kind, self.init_scale
        if not isinstance(kind, ScaleKind):
            raise TypeError(f"kind={kind!r} must be a ScaleKind; LossScaleConfig.of(kind={kind!r}) takes its string")
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init) or init <= 0:
            raise ValueError(f"init_scale={init!r} must be a finite number > 0")
        if kind is ScaleKind.NONE and init != 1.0:
            raise ValueError(f"init_scale={init!r} with kind='none'; the 'none' scale is 1 (use kind='static')")
        if not self.growth_factor > 1.0 or not math.isfinite(self.growth_factor):
            raise ValueError(f"growth_factor={self.growth_factor!r} must be a finite number > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={self.backoff_factor!r} must be in (0, 1)")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0.0 <= self.min_scale <= self.max_scale:
            raise ValueError(f"min_scale={self.min_scale!r} and max_scale={self.max_scale!r} need 0 <= min_scale <= max_scale")
        if kind is ScaleKind.DYNAMIC and not self.min_scale <= init <= self.max_scale:
            raise ValueError(
                f"init_scale={init!r} is outside [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}]"
            )

    @classmethod
    def of(cls, kind: Union[str, ScaleKind] = ScaleKind.DYNAMIC, init_scale: Optional[float] = None,
           **fields: Any) -> "LossScaleConfig":
        """The validated constructor with normalising: ``kind`` a :class:`ScaleKind` or its string;
        ``init_scale`` None picks 2**16 (dynamic) or 1 (none), and is required for static."""
        try:
            kind = ScaleKind(kind)
        except ValueError:
            raise ValueError(f"kind={kind!r} is not a loss scale kind; use one of {_KINDS}") from None
        if init_scale is None:
            if kind is ScaleKind.STATIC:
                raise ValueError("a static loss scale needs init_scale=<the scale>, e.g. LossScaleConfig.static(128.0)")
            init_scale = 2.0**16 if kind is ScaleKind.DYNAMIC else 1.0
        if isinstance(init_scale, int) and not isinstance(init_scale, bool):
            init_scale = float(init_scale)
        return cls(kind=kind, init_scale=init_scale, **fields)

    @classmethod
    def parse(cls, text: str) -> "LossScaleConfig":
        """The string shorthand: ``"dynamic"``, ``"none"`` or ``"static:<scale>"`` (``"static:1024"``)."""
        name, _, value = text.partition(":")
        if name == "static" and value:
            try:
                return cls.static(float(value))
            except ValueError:
                pass
        elif not value and name in ("dynamic", "none"):
            return cls.of(name)
        raise ValueError(f"loss_scale={text!r} is not understood; use {_OPTIONS}")

    @classmethod
    def dynamic(cls, **fields: Any) -> "LossScaleConfig":
        """Dynamic scaling; ``fields`` override the defaults (``init_scale=2**12, hysteresis=2``…)."""
        return cls.of(ScaleKind.DYNAMIC, **fields)

    @classmethod
    def static(cls, scale: float) -> "LossScaleConfig":
        """A fixed scale."""
        return cls.of(ScaleKind.STATIC, init_scale=scale)

    @classmethod
    def none(cls) -> "LossScaleConfig":
        """No scaling (scale 1); non-finite gradients still skip the step."""
        return cls.of(ScaleKind.NONE)

    def __str__(self) -> str:
        if self.kind is not ScaleKind.DYNAMIC:
            return f"{self.kind}" if self.kind is ScaleKind.NONE else f"static({self.init_scale:g})"
        return (f"dynamic(init_scale={self.init_scale:.8g}, growth_factor={self.growth_factor:g}, "
                f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
                f"min_scale={self.min_scale:.8g}, max_scale={self.max_scale:.8g}, hysteresis={self.hysteresis})")


class Stage(str, enum.Enum):
    """Where one optimizer stands in the current iteration of its scaler."""

    READY = "ready"  # no scaled gradients since the last update (or zero_grad)
    SCALED = "scaled"  # a scaled backward ran: gradients hold loss * scale
    UNSCALED = "unscaled"  # unscaled and checked: the overflow decision is made
    STEPPED = "stepped"  # stepped (or skipped); a shared scaler waits for update()

    def __str__(self) -> str:
        return self.value


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


def _cached_on(cache: Dict[torch.device, torch.Tensor], device: torch.device,
               make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[device]``, else a copy of the CPU tensor ``make()`` put there: to CUDA from pinned memory,
    so the host does not wait for the stream to reach the copy (a copy from pageable memory would:
    a hidden synchronization).  The caller clears ``cache`` when the value moves."""
    t = cache.get(device)
    if t is None:
        t = make()
        if device.type == "cuda":  # (a fresh pinned buffer: nothing reuses it while the copy is in flight)
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
        "(or opt.scale_loss(loss).backward()) before opt.step()"),
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

        scaler = fxamp.LossScaler()
        opt_a = fxamp.MixedPrecisionOptimizer(adam, loss_scale=scaler)
        opt_b = fxamp.MixedPrecisionOptimizer(sgd, loss_scale=scaler)
        opt_a.backward(loss_a + loss_b)
        opt_a.step(); opt_b.step()
        scaler.update()        # backs off if either overflowed
    """

    def __init__(self, config: Optional[LossScaleConfig] = None) -> None:
        if config is None:
            config = LossScaleConfig()
        if not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, not {type(config).__name__}; "
                            f"e.g. LossScaler(LossScaleConfig.static(128.0))")
        self.config = config
        self._scale = torch.full((), config.init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
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
        was_growing = int(self._growth_tracker) + 1 == cfg.growth_interval and not found
        torch._amp_update_scale_(
            self._scale, self._growth_tracker, torch.full((), float(found)),
            cfg.growth_factor, backoff, cfg.growth_interval,
        )
        self._scale.clamp_(min=cfg.min_scale or _TINY, max=cfg.max_scale)  # 0 never: 1/scale must stay finite
        if was_growing:
            self._tolerance = cfg.hysteresis
        self._scale_moved()
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
            "growth_tracker": int(self._growth_tracker),
            "tolerance": self._tolerance,
            "overflows": self.overflows,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the config (factors, interval…) stays the one this scaler was built with."""
        if not isinstance(state, Mapping):
            raise TypeError(f"LossScaler.load_state_dict takes the dict LossScaler.state_dict() returned, "
                            f"not {type(state).__name__}")
        missing = {"kind", "scale", "growth_tracker", "tolerance", "overflows", "updates"} - set(state)
        if missing:
            raise KeyError(f"loss scaler state_dict lacks {sorted(missing)}; pass what LossScaler.state_dict() returned")
        if state["kind"] != self.kind.value:
            raise ValueError(f"the checkpoint's loss scale is {state['kind']!r} but this scaler's is "
                             f"{self.kind.value!r}; build the scaler with the same kind")
        self._scale.fill_(state["scale"])
        self._scale_moved()
        self._growth_tracker.fill_(state["growth_tracker"])
        self._tolerance = int(state["tolerance"])
        self.overflows = int(state["overflows"])
        self.updates = int(state["updates"])

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

    ``"auto"``: dynamic for float16, none for bfloat16 and float32 (the compute dtype of ``model``'s
    fxamp policy, else float16 or bfloat16 if one of ``params`` is; dynamic when unknown); ``"dynamic"``, ``"none"``, ``"static:<scale>"``
    (:meth:`LossScaleConfig.parse`); a :class:`LossScaleConfig`; a :class:`LossScaler` to share.
    ``None`` and a number are the older spellings of ``"none"`` and ``"static:<number>"``.
    """
    if isinstance(loss_scale, LossScaler):
        return loss_scale, False
    if isinstance(loss_scale, LossScaleConfig):
        return LossScaler(loss_scale), True
    if loss_scale is None:
        return LossScaler(LossScaleConfig.none()), True
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaler(LossScaleConfig.static(float(loss_scale))), True
    if not isinstance(loss_scale, str):
        raise TypeError(f"loss_scale={loss_scale!r} ({type(loss_scale).__name__}) is not understood; use {_OPTIONS}")
    if loss_scale == "auto":
        low = _low_dtype(model, params)
        auto = LossScaleConfig.none() if low in (torch.bfloat16, torch.float32) else LossScaleConfig.dynamic()
        return LossScaler(auto), True
    return LossScaler(LossScaleConfig.parse(loss_scale)), True


def _low_dtype(model: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
    policy = None
    if model is not None:
        policy = policy_of(model) or policy_of(getattr(model, "module", model))  # DDP keeps it in .module
    if policy is not None:
        return policy.compute
    dtypes = {p.dtype for p in params}
    return torch.float16 if torch.float16 in dtypes else torch.bfloat16 if torch.bfloat16 in dtypes else None
