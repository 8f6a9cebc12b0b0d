"""The loss scale: :class:`LossScaler`, shared by one or several optimizers, and :func:`scaler_for`, the scaler of a
``loss_scale=`` option.

Float16 gradients underflow: the backward runs on ``loss * scale`` and the gradients are divided by
``scale`` (in float32) before the optimizer sees them; the kinds and the ``loss_scale=`` option are
:mod:`fxamp.training.config`'s (construction time: a step never visits it).

The scaler owns the whole iteration, as ``torch.amp.GradScaler`` does per optimizer: the scale,
the overflow decision and where each optimizer stands.  An optimizer ``attach()``-es once and
passes its :class:`~fxamp.training.config.ScalerClient` to the scaler's methods; it never reads the scaler's
counters::

    client = scaler.attach()                          # READY
    loss = scaler.scale_loss(loss, client)            # -> SCALED (every client of this scaler)
    check = scaler.start_unscale(client)              # SCALED -> (unscaling): a FoundInf
    check.unscale_and_check_(grads)                   #   fused check + divide, per device
    verdict, local = agree(check, device, sync)       #   the one decision: host bool or DeviceFlag
    scaler.finish_unscale(client, verdict)            # -> UNSCALED, the decision kept
    if scaler.start_step(client) is Stage.SCALED: ... # step() without unscale_(): unscale first
    found = scaler.found_inf(client)                  # step, or skip if found
    scaler.record(found, blame, client)               # -> STEPPED
    scaler.update()                                   # next generation: every client READY

A call out of this order raises :class:`OptimizerStateError` saying what to call instead (:data:`_MISUSE`).

What a step runs of this, the transitions from ``start_unscale`` to ``update``, is the scaler's base,
:class:`fxamp.training.step.StageMachine`, in the engine's module (a step runs code in the facade, the engine and
the executors only: docs/DESIGN.md); here is what a step does not run: the config's checks, ``scale_loss``,
reading the scale and the counts, ``state_dict``.  The check (:class:`~fxamp.training.executors.FoundInf`) and the
decision (:func:`~fxamp.training.step.agree`) moved with it; their old names here still resolve, with a
DeprecationWarning.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import moved_names as _moved_names
from .config import LossScaleConfig, LossScaleOption, ScaleKind, ScalerClient, Stage, compute_dtype, config_for
from .step import StageMachine

__all__ = ["LossScaler", "Stage", "ScalerClient", "scaler_for"]

#: the names that left this module for the step's (docs/DESIGN.md: a step runs code in three files)
_MOVED = {**{name: "fxamp.training.executors" for name in ("FoundInf", "note_non_finite_", "fused_kernel_takes",
                                                           "SUM_NUMEL")},
          **{name: "fxamp.training.step" for name in ("DeviceFlag", "StepResult", "agree", "ranks_to_agree")}}
__getattr__ = _moved_names(__name__, _MOVED)


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


class LossScaler(StageMachine):
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

    MISUSE = _MISUSE

    def __init__(self, config: Optional[LossScaleConfig] = None, *, owned: bool = False) -> None:
        if config is None:
            config = LossScaleConfig()
        if not isinstance(config, LossScaleConfig):
            raise TypeError(f"config must be a LossScaleConfig, not {type(config).__name__}; "
                            f"e.g. LossScaler(LossScaleConfig('static', 128.0))")
        super().__init__(config)  # the scale and the stages: StageMachine's
        self.owned = bool(owned)  # an optimizer's own (scaler_for), updated by its step(): not to be shared

    # -- reading ---------------------------------------------------------------------------
    @property
    def kind(self) -> ScaleKind:
        return self.config.kind

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
        return self._inv(torch.device(device))

    # -- the iteration ---------------------------------------------------------------------
    def attach(self) -> ScalerClient:
        """A new optimizer's place in this scaler's iterations (READY); pass it to the methods below."""
        return ScalerClient()

    def scale_loss(self, loss: torch.Tensor, client: Optional[ScalerClient] = None) -> torch.Tensor:
        """``loss * scale`` (``loss`` itself when the scale is 1); every client is SCALED afterwards.

        With ``client``: refused after its unscale or step this iteration (its gradients are final).
        """
        if client is not None:
            self._require(client, "backward")
        self._scaled += 1
        if self._scale_value == 1.0 and self.kind is not ScaleKind.DYNAMIC:
            return loss
        return loss * self._on(loss.device)

    def restart(self, client: ScalerClient, *, drop_scaled: bool) -> None:
        """``zero_grad``: forget ``client``'s unscale (not its step); ``drop_scaled``: its gradients were the only ones."""
        if self.stage(client) is Stage.STEPPED:
            return
        client.unscaled_gen = -1
        if drop_scaled:
            self._scaled = 0

    def forget(self, client: ScalerClient) -> None:
        """``client`` was reloaded from a checkpoint: it has neither unscaled nor stepped this iteration."""
        client.unscaled_gen = client.stepped_gen = -1
        client.found = False

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
