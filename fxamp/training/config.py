"""What the optimizer wrapper reads at construction: how to scale the loss (:class:`ScaleKind`, the frozen
:class:`LossScaleConfig`, the parsing of ``loss_scale=``: :data:`LossScaleOption`, :func:`config_for`; the words of
the scaler's iteration, :class:`Stage` and :class:`ScalerClient`, compared and moved by the step), and
the precision of masters and state per tensor (:class:`MasterPrecision`, :class:`StatePrecision`, the
frozen :class:`LeanConfig`, :func:`resolve` of ``masters=``/``state=``/``precision=``; what they mean in a
step: :mod:`fxamp.training.lean`).

Float16 gradients underflow: backpropagating ``loss * scale`` keeps them representable, and the
gradients are divided by ``scale`` (in float32) before the optimizer sees them.  Three kinds:

* ``"dynamic"`` (the default for float16): the scale adapts, see :class:`fxamp.training.loss_scale.LossScaler`.
* ``"static"``: a fixed scale.
* ``"none"`` (the default for bfloat16 and float32): the scale is 1.

Whatever the kind, a step whose gradients hold an inf or NaN is skipped.

Construction time only: a :class:`fxamp.MixedPrecisionOptimizer` (or ``FxampPrecision``) reads its
``loss_scale=`` here once and builds a :class:`~fxamp.training.loss_scale.LossScaler`; a step never
visits this module (its files: :mod:`fxamp.training.step`'s docstring).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ..dtypes import DtypeEnum, StrEnum, spellings
from ..errors import warn_deprecated
from ..info import policy_of

__all__ = ["ScaleKind", "Stage", "ScalerClient", "AnyOf", "TINY", "LossScaleConfig", "LossScaleOption", "OPTIONS",
           "config_for", "compute_dtype",
           "MasterPrecision", "StatePrecision", "LeanConfig", "PRESETS", "resolve"]


class ScaleKind(StrEnum):
    """How the loss scale behaves; a ``str`` so ``"dynamic"`` and ``ScaleKind.DYNAMIC`` are interchangeable."""

    DYNAMIC = "dynamic"
    STATIC = "static"
    NONE = "none"


class Stage(StrEnum):
    """Where one optimizer stands in the current iteration of its scaler (the machine:
    :class:`fxamp.training.step.StageMachine`)."""

    READY = "ready"  # no scaled gradients since the last update (or zero_grad)
    SCALED = "scaled"  # a scaled backward ran: gradients hold loss * scale
    UNSCALED = "unscaled"  # unscaled and checked: the overflow decision is made
    STEPPED = "stepped"  # stepped (or skipped); a shared scaler waits for update()


class ScalerClient:
    """One optimizer's place in its scaler's iteration; made by ``LossScaler.attach``, moved only by the scaler."""

    __slots__ = ("unscaled_gen", "stepped_gen", "found")

    def __init__(self) -> None:
        self.unscaled_gen = -1  # generation of the last unscale, of the last step
        self.stepped_gen = -1
        self.found = False  # the overflow decision of the last unscale


class AnyOf(tuple):
    """What ``update()`` returns while some flags are on a device: ``bool()`` whether any of them (bools and
    ``step.DeviceFlag``) is set, waiting only when asked."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return any(bool(f) for f in self)


#: the smallest positive normal float32: with min_scale=0 the scale stops here, 1/scale is finite
TINY = float(torch.finfo(torch.float32).tiny)


_KINDS = ", ".join(repr(k.value) for k in ScaleKind)
#: the valid forms of ``loss_scale=``, as error messages name them
OPTIONS = ("'auto', 'dynamic', 'none', 'static:<scale>' (e.g. 'static:1024') or the scale itself (1024.0), a "
           "LossScaleConfig, or a LossScaler shared with other optimizers")

#: what ``loss_scale=`` takes (:func:`~fxamp.training.loss_scale.scaler_for`): a string shorthand
#: (``"auto"``, ``"dynamic"``, ``"none"``, ``"static:<scale>"``), a number (a static scale: apex's
#: ``loss_scale=128.0``, its one meaning), a config, or a shared scaler (``None`` is refused: :func:`config_for`)
LossScaleOption = Union[str, float, "LossScaleConfig", "LossScaler"]


@dataclass(frozen=True)
class LossScaleConfig:
    """How to scale the loss; validated at construction.

    ``LossScaleConfig()`` is dynamic scaling with the defaults of ``torch.amp.GradScaler`` plus a
    floor, a ceiling and DeepSpeed's hysteresis.  The fields other than ``kind`` and
    ``init_scale`` matter only to dynamic scaling.  The constructor takes ``kind`` as a
    :class:`ScaleKind` or its string; :meth:`parse` reads the string form (``"static:1024"``).
    """

    kind: ScaleKind = ScaleKind.DYNAMIC
    #: the first scale, a float; None (the default) picks 2**16 for dynamic, 1 for none (static needs one)
    init_scale: Optional[float] = None
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
        """Normalise (``kind``'s string, ``init_scale`` None or an int), then validate."""
        try:
            kind = ScaleKind(self.kind)
        except ValueError:
            raise ValueError(f"kind={self.kind!r} is not a loss scale kind; use one of {_KINDS}") from None
        init = self.init_scale
        if init is None:
            if kind is ScaleKind.STATIC:
                raise ValueError("a static loss scale needs init_scale=<the scale>, e.g. LossScaleConfig('static', 128.0)")
            init = 2.0**16 if kind is ScaleKind.DYNAMIC else 1.0
        if isinstance(init, int) and not isinstance(init, bool):
            init = float(init)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "init_scale", init)
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
        """Deprecated: the constructor normalises, ``LossScaleConfig("static", 128)``."""
        warn_deprecated("LossScaleConfig.of(...)", "write LossScaleConfig(...): the constructor takes the kind's name")
        return cls(kind, init_scale, **fields)

    @classmethod
    def parse(cls, text: str) -> "LossScaleConfig":
        """The string shorthand: ``"dynamic"``, ``"none"`` or ``"static:<scale>"`` (``"static:1024"``)."""
        name, _, value = text.partition(":")
        if name == "static" and value:
            try:
                return cls(ScaleKind.STATIC, float(value))
            except ValueError:
                pass
        elif not value and name in ("dynamic", "none"):
            return cls(name)
        raise ValueError(f"loss_scale={text!r} is not understood; use {OPTIONS}")

    @classmethod
    def dynamic(cls, **fields: Any) -> "LossScaleConfig":
        """Deprecated: ``LossScaleConfig("dynamic", **fields)``."""
        warn_deprecated("LossScaleConfig.dynamic(...)", 'write LossScaleConfig("dynamic", ...): the constructor takes '
                        "the kind's name")
        return cls(ScaleKind.DYNAMIC, **fields)

    @classmethod
    def static(cls, scale: float) -> "LossScaleConfig":
        """Deprecated: ``LossScaleConfig("static", scale)``."""
        warn_deprecated("LossScaleConfig.static(scale)", 'write LossScaleConfig("static", scale)')
        return cls(ScaleKind.STATIC, init_scale=scale)

    @classmethod
    def none(cls) -> "LossScaleConfig":
        """Deprecated: ``LossScaleConfig("none")``."""
        warn_deprecated("LossScaleConfig.none()", 'write LossScaleConfig("none")')
        return cls(ScaleKind.NONE)

    def __str__(self) -> str:
        if self.kind is not ScaleKind.DYNAMIC:
            return f"{self.kind}" if self.kind is ScaleKind.NONE else f"static({self.init_scale:g})"
        return (f"dynamic(init_scale={self.init_scale:.8g}, growth_factor={self.growth_factor:g}, "
                f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
                f"min_scale={self.min_scale:.8g}, max_scale={self.max_scale:.8g}, hysteresis={self.hysteresis})")


def config_for(loss_scale: Union[str, LossScaleConfig], low: Optional[torch.dtype]) -> LossScaleConfig:
    """The config of a ``loss_scale=`` option other than a shared scaler.

    ``"auto"``: none when ``low`` (the compute dtype: :func:`compute_dtype`) is bfloat16 or float32,
    else dynamic; ``"dynamic"``, ``"none"``, ``"static:<scale>"``
    (:meth:`LossScaleConfig.parse`); a number, a static scale (as apex's ``loss_scale=128.0``); a
    :class:`LossScaleConfig` as it is.  ``None`` (apex's and older fxamp's spelling of ``"none"``, which
    GradScaler reads otherwise) raises TypeError naming the form to write, as does any other type.
    """
    if isinstance(loss_scale, LossScaleConfig):
        return loss_scale
    if loss_scale is None:
        raise TypeError("loss_scale=None is not accepted: write loss_scale='none' (no scaling; non-finite "
                        f"gradients still skip the step). Valid forms: {OPTIONS}")
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
        scale = float(loss_scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss_scale={loss_scale!r}: a number is a static loss scale, finite and > 0 "
                             f"(e.g. 128.0); or use {OPTIONS}")
        return LossScaleConfig(ScaleKind.STATIC, scale)
    if not isinstance(loss_scale, str):
        raise TypeError(f"loss_scale={loss_scale!r} ({type(loss_scale).__name__}) is not accepted; use {OPTIONS}")
    if loss_scale == "auto":
        return LossScaleConfig(ScaleKind.NONE if low in (torch.bfloat16, torch.float32) else ScaleKind.DYNAMIC)
    return LossScaleConfig.parse(loss_scale)


def compute_dtype(model: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
    """What ``"auto"`` scales for: the compute dtype of ``model``'s fxamp policy, else float16 or bfloat16
    if one of ``params`` is; None when unknown (all float32, no policy)."""
    policy = None
    if model is not None:
        policy = policy_of(model) or policy_of(getattr(model, "module", model))  # DDP keeps it in .module
    if policy is not None:
        return policy.compute
    dtypes = {p.dtype for p in params}
    return torch.float16 if torch.float16 in dtypes else torch.bfloat16 if torch.bfloat16 in dtypes else None


# -- masters and state per tensor ----------------------------------------------------------------

class MasterPrecision(DtypeEnum):
    """What keeps a low-precision weight's full value between steps (``"float32"``, ``torch.float32``: fp32)."""

    FP32 = "fp32"
    KAHAN = "kahan"
    STOCHASTIC = "stochastic"
    AUTO = "auto"


class StatePrecision(DtypeEnum):
    """How the optimizer state of a low-precision weight is stored between steps (``"bfloat16"``: bf16)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    AUTO = "auto"


#: named presets: ``MixedPrecisionOptimizer(opt, precision="lean")``.  Not the policies' names: ``"O2"`` is a
#: conversion policy (``fxamp.convert(model, "O2")``), and an optimizer precision is a different thing.
PRESETS = {"fp32": ("fp32", "fp32"), "lean": ("auto", "auto")}
#: the presets' former names, which read as policies; accepted for one release with a DeprecationWarning
_OLD_PRESETS = {"O2": "fp32", "O2-lean": "lean"}


def _enum(cls, value: Any, option: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{option}={value!r} is not a valid mode; valid: {spellings(cls)}") from None


@dataclass(frozen=True)
class LeanConfig:
    """The masters and state of a :class:`~fxamp.MixedPrecisionOptimizer`; validated at construction.

    masters:           :class:`MasterPrecision` for every low-precision parameter
    state:             :class:`StatePrecision` for their optimizer state
    calibration_steps: with ``"auto"``, the first steps run with float32 masters and state and measure
                       (:mod:`fxamp.training.calibrate`); the choice is made after the last of them
    small:             with ``"auto"``, tensors under this many elements keep float32 where rounding bites,
                       and float32 state (:data:`fxamp.training.calibrate.SMALL`)
    """

    masters: MasterPrecision = MasterPrecision.FP32
    state: StatePrecision = StatePrecision.FP32
    calibration_steps: int = 4
    small: int = 65536

    def __post_init__(self) -> None:
        """Names become members (``"bfloat16"``: ``StatePrecision.BF16``), then checks."""
        object.__setattr__(self, "masters", _enum(MasterPrecision, self.masters, "masters"))
        object.__setattr__(self, "state", _enum(StatePrecision, self.state, "state"))
        if not isinstance(self.calibration_steps, int) or self.calibration_steps < 1:
            raise ValueError(f"calibration_steps={self.calibration_steps!r}: a positive int")
        if not isinstance(self.small, int) or self.small < 0:
            raise ValueError(f"small={self.small!r}: a non-negative int")

    @classmethod
    def parse(cls, text: Union[str, "LeanConfig"]) -> "LeanConfig":
        """A preset (``"lean"``, :data:`PRESETS`) or the string form ``str()`` prints (``"masters=auto,state=int8"``)."""
        if isinstance(text, LeanConfig):
            return text
        if not isinstance(text, str):
            raise TypeError(f"precision must be a preset name ({', '.join(map(repr, PRESETS))}) or a LeanConfig, "
                            f"not {type(text).__name__}")
        if text in _OLD_PRESETS:
            warn_deprecated(f"precision={text!r}", f"write precision={_OLD_PRESETS[text]!r} (the optimizer's presets are "
                            f"not named after the conversion policies)")
            text = _OLD_PRESETS[text]
        if text in PRESETS:
            return cls(*PRESETS[text])
        parts = dict(p.strip().partition("=")[::2] for p in text.split(",") if p.strip())
        if "=" not in text or not set(parts) <= {"masters", "state"}:
            raise ValueError(f"precision={text!r} is not a preset; valid: {', '.join(map(repr, PRESETS))}, or "
                             f"'masters=<mode>,state=<mode>'")
        return cls(**parts)

    @classmethod
    def of(cls, masters: Union[str, MasterPrecision] = "fp32", state: Union[str, StatePrecision] = "fp32",
           calibration_steps: int = 4, small: int = 65536) -> "LeanConfig":
        """Deprecated: the constructor takes names, ``LeanConfig("auto", "int8")``."""
        warn_deprecated("LeanConfig.of(...)", "write LeanConfig(...): the constructor takes the modes' names")
        return cls(masters, state, calibration_steps, small)

    @classmethod
    def preset(cls, name: str) -> "LeanConfig":
        """Deprecated: ``LeanConfig.parse(name)``."""
        warn_deprecated("LeanConfig.preset(name)", "write LeanConfig.parse(name)")
        return cls.parse(name)

    @property
    def lean(self) -> bool:
        return self.masters is not MasterPrecision.FP32 or self.state is not StatePrecision.FP32

    @property
    def auto(self) -> bool:
        return self.masters is MasterPrecision.AUTO or self.state is StatePrecision.AUTO

    def __str__(self) -> str:
        return f"masters={self.masters},state={self.state}"


def resolve(masters: Union[str, MasterPrecision, None], state: Union[str, StatePrecision, None],
            precision: Optional[Union[str, LeanConfig]]) -> LeanConfig:
    """The :class:`LeanConfig` of ``MixedPrecisionOptimizer(masters=, state=, precision=)`` (None: not given;
    ``precision`` sets both, so beside ``masters`` or ``state`` it is refused: one would be ignored)."""
    if precision is None:
        return LeanConfig("fp32" if masters is None else masters, "fp32" if state is None else state)
    if not isinstance(precision, (str, LeanConfig)):
        raise TypeError(f"precision must be a preset name ({', '.join(map(repr, PRESETS))}) or a LeanConfig, "
                        f"not {type(precision).__name__}")
    config = precision if isinstance(precision, LeanConfig) else LeanConfig.parse(precision)
    if masters is not None or state is not None:
        given = " and ".join(f"{k}={v!r}" for k, v in (("masters", masters), ("state", state)) if v is not None)
        want = [str(config.masters if masters is None else masters), str(config.state if state is None else state)]
        raise ValueError(f"precision={precision!r} sets masters and state ({config}), so {given} beside it would be "
                         f"ignored: pass one or the other, e.g. masters={want[0]!r}, state={want[1]!r} without precision")
    return config
