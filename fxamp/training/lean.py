"""Masters and optimizer state chosen per tensor: the float32 :class:`Workspace` of a step (the options,
:class:`~fxamp.training.config.LeanConfig`, are read at construction in :mod:`fxamp.training.config`).

A low-precision parameter's master is one of (:class:`MasterPrecision`):

* ``"fp32"``: a float32 master kept between steps (4 bytes per element);
* ``"kahan"``: no master; a compensation term in the weight's dtype beside it (2 bytes), so
  weight + term carry ~16 significant bits and updates far below the weight's half-ulp add up;
* ``"stochastic"``: no master, no term; the new float32 value is rounded into the bfloat16 weight
  stochastically (unbiased), with noise hashed from (seed, tensor, count) and each element's row-major index
  (:func:`fxamp.training.flat.round_stochastic_`, the CPU kernel's hash), so a step is bitwise resumable from a
  checkpoint and independent of the order, run or slice tensors are stepped in.

Its optimizer state is one of (:class:`StatePrecision`) ``"fp32"``, ``"bf16"`` or ``"int8"``
(:mod:`fxamp.training.quant`; stock Adam/AdamW/SGD only).  ``"auto"`` for either is decided from
measurement (:mod:`fxamp.training.calibrate`).

The step is unchanged for the inner optimizer: around each ``optimizer.step()`` of an executor
(:mod:`fxamp.training.executors`), the lean step (:class:`fxamp.training.lean_step.LeanStep`, over this
module's :class:`Workspace`) rebuilds each lean master's float32 value (weight, plus term) and decompresses its
state, the optimizer steps float32 tensors as ever, the engine rounds the masters into the weights, and the lean
step splits the value back (the term, or the stochastic rounding) and compresses the state.  Between steps a lean
master is a placeholder (a float32 zero expanded to its shape: no memory), so the inner optimizer keeps its
identity as a state key.  Any torch optimizer works: it sees float32 tensors only.  On a CPU a stock
Adam/AdamW/SGD steps the masters, float32 and lean, with ``fused=True`` (:func:`step_inner`, :data:`FUSED`:
torch's one-pass kernel; on every path, so a segmented step and a plain one give the same bits); a bfloat16
lean master with bfloat16 or 8-bit state under a stock Adam/AdamW, fxamp's kernel
(:mod:`fxamp.training.native`).

This module holds what lasts between steps: each master's :class:`Choice` (modes, reason, measurements, kahan's
term, the rounding's count), the seed and step count, the switch of modes (:meth:`Workspace.set_modes`), a master's
float32 value (:meth:`Workspace.value`), the calibration's measurements and decision, the checkpoint's part.  A
step past calibration runs none of its code (``tests/test_layout.py`` traces it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from . import quant
from ..errors import moved_names as _moved_names
from .flat import round_stochastic_
from .config import LeanConfig
from .executors import FUSED, fusable, run_step, step_inner  # (re-exported: imported from here before)

__all__ = ["Choice", "Workspace", "stochastic_round", "placeholder", "run_step", "step_inner", "FUSED", "fusable",
           "check_params", "seed_from", "state_keys"]

#: the step-time names that left this module for the lean step's; the old names resolve with a warning
__getattr__ = _moved_names(__name__, dict.fromkeys(("LeanKernel", "LeanChunked", "PIECE", "ACCELERATOR_PIECE",
                                                    "piece_for"), "fxamp.training.lean_step"))


@dataclass
class Choice:
    """One master's modes and why (the table of :meth:`~fxamp.MixedPrecisionOptimizer.precision_table`)."""

    master: str = "fp32"
    state: str = "fp32"
    reason: str = "as configured"
    lost: Optional[float] = None  # fraction of the update mass plain rounding loses (measured)
    state_error: Optional[float] = None  # relative error of the update direction with int8 state (measured)
    term: Optional[torch.Tensor] = field(default=None, repr=False)  # kahan's compensation
    count: int = 0  # stochastic roundings done (the stream's position)





def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of ``like``'s shape and device holding no memory (a zero, expanded)."""
    return torch.zeros((), dtype=torch.float32, device=like.device).expand(like.shape)


def _term(full: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Kahan's term of ``low`` for its value ``full``, row-major whatever their strides (as 8-bit state and kernel)."""
    return (full - low.float()).to(low.dtype, memory_format=torch.contiguous_format)


def stochastic_round(x: torch.Tensor, out: torch.Tensor, key: int, first: int = 0) -> None:
    """Round float32 ``x`` into bfloat16 ``out`` stochastically: up with probability the dropped bits' fraction.

    Row-major element i takes the noise of element ``first + i`` of the master whose rounding key is ``key``
    (:func:`fxamp.training.flat.key`; :func:`fxamp.training.flat.round_stochastic_` says how), whatever the
    strides of ``x`` and ``out``; ``x`` is left as it was."""
    work = x.detach().reshape(-1).clone()
    round_stochastic_(work, [(work.numel(), key, first)])
    out.copy_(work.view(out.shape))


class Workspace:
    """Per master: its :class:`Choice`; the seed, the step count, the calibration (see the module docstring).
    The step's work over it: :class:`fxamp.training.lean_step.LeanStep`."""

    def __init__(self, optimizer: Any, config: LeanConfig, seed: int) -> None:
        self.optimizer = optimizer
        self.config = config
        self.auto = config.auto  # (the config is frozen: read once here, not per master and step)
        self.seed = int(seed)
        self.choices: Dict[int, Choice] = {}  # id(master) -> choice
        self.index: Dict[int, int] = {}  # id(master) -> its place in the wrapper's masters
        self.low_of: Dict[int, torch.Tensor] = {}
        self.steps = 0  # steps taken (advanced by the step: lean_step.LeanStep.stepped)
        #: the first ``config.calibration_steps`` of ``"auto"``: float32 modes, measured (plain data, not a property:
        #: every step reads it, and a step runs no code here); ended by :meth:`calibrated`, set again by :meth:`restore`
        self.calibrating = self.auto and config.calibration_steps > 0

    # -- modes ---------------------------------------------------------------------------------
    def add(self, low: torch.Tensor, master: torch.Tensor, index: int, name: str) -> None:
        """Give a new master its modes (the configured ones; float32 while ``"auto"`` calibrates)."""
        masters, state = self.config.masters.value, self.config.state.value
        check_modes(self.optimizer, low, masters, state, name)
        choice = Choice(reason="as configured" if not self.config.auto else "calibrating")
        self.choices[id(master)] = choice
        self.index[id(master)] = index
        self.low_of[id(master)] = low
        target = (masters if masters != "auto" else "fp32", state if state != "auto" else "fp32")
        self.set_modes(master, *target)

    def set_modes(self, master: torch.Tensor, masters: str, state: str) -> None:
        """Switch ``master`` to ``masters``/``state`` between steps, keeping its value and state."""
        choice, low = self.choices[id(master)], self.low_of[id(master)]
        with torch.no_grad():
            if masters != choice.master:
                if choice.master == "fp32":  # the float32 master becomes the weight (already its rounding) + term
                    full = master.detach()
                    if masters == "kahan":
                        choice.term = _term(full, low)
                    master.data = placeholder(master)
                elif masters == "fp32":
                    master.data = self.value(master)
                    choice.term = None
                else:  # kahan <-> stochastic: the term joins the weight, or starts at zero
                    full = self.value(master)
                    low.copy_(full)
                    choice.term = _term(full, low) if masters == "kahan" else None
                choice.master = masters
            if state != choice.state:
                entry = self.optimizer.state.get(master)
                if entry:
                    quant.decompress(entry)
                    if state != "fp32":
                        quant.compress(entry, state)
                choice.state = state

    def value(self, master: torch.Tensor, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The float32 value of ``master`` (a new tensor for a lean one: weight + term), laid out as ``like`` (its
        gradient: the inner optimizer's fused kernel reads both in memory order), else row-major."""
        choice, low = self.choices[id(master)], self.low_of[id(master)]
        if choice.master == "fp32":
            return master.detach()
        dense = like is not None and like.layout == torch.strided and like.shape == low.shape
        full = torch.empty_like(like, dtype=torch.float32) if dense else \
            torch.empty(low.shape, dtype=torch.float32, device=low.device)
        full.copy_(low)
        if choice.term is not None:
            full.add_(choice.term)  # (float32 arithmetic: the term's values are exact in it)
        return full

    def follow(self, master: torch.Tensor) -> None:
        """The user wrote ``master``'s weight since the last step (:meth:`fxamp.training.step.Engine.follow_weights`):
        its value is now the weight's, so kahan's term restarts at zero where the weight is no longer the
        rounding of weight + term (a stochastic master is its weight already)."""
        choice, low = self.choices[id(master)], self.low_of[id(master)]
        if choice.term is not None and not torch.equal(self.value(master).to(low.dtype), low.detach()):
            choice.term.zero_()

    def lean(self, master: torch.Tensor) -> bool:
        choice = self.choices.get(id(master))
        return choice is not None and choice.master != "fp32"


    # -- auto ----------------------------------------------------------------------------------
    def measure(self, master: torch.Tensor, old: torch.Tensor, choice: Choice) -> None:
        """Calibration, after a step (the step's :meth:`~fxamp.training.lean_step.LeanStep.leave`): how ``master``
        moved from ``old``, its value before: the update mass plain rounding loses, 8-bit state's error."""
        from .calibrate import lost_fraction  # (only while calibrating)

        lost = lost_fraction(old, master.detach(), self.low_of[id(master)].dtype)
        choice.lost = lost if choice.lost is None else max(choice.lost, lost)
        entry = self.optimizer.state.get(master)
        if entry:
            err = quant.update_error(entry, "int8")
            choice.state_error = err if choice.state_error is None else max(choice.state_error, err)

    def calibrated(self) -> None:
        """The last calibration step done (:meth:`~fxamp.training.lean_step.LeanStep.stepped`): decide every
        ``"auto"``."""
        from .calibrate import decide

        self.calibrating = False
        decide(self)

    def restore(self, seed: int, steps: int) -> None:
        """A checkpoint's seed and step count (its modes loaded): calibration goes on if it had not ended."""
        self.seed, self.steps = int(seed), int(steps)
        self.calibrating = self.auto and self.steps < self.config.calibration_steps

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, masters: List[torch.Tensor]) -> Dict[str, Any]:
        choices = [self.choices[id(m)] for m in masters]
        return {"seed": self.seed, "steps": self.steps,
                "modes": [(c.master, c.state, c.reason, c.lost, c.state_error, c.count) for c in choices]}

    def saved_master(self, master: torch.Tensor) -> torch.Tensor:
        """What ``state_dict()["masters"]`` holds for ``master``: the float32 master, kahan's term, or nothing."""
        choice = self.choices[id(master)]
        if choice.master == "fp32":
            return master.detach()
        if choice.master == "kahan":
            return choice.term
        return torch.empty(0, dtype=self.low_of[id(master)].dtype)





def check_modes(optimizer: Any, low: torch.Tensor, masters: str, state: str, name: str) -> None:
    """Raise ValueError if ``masters``/``state`` cannot apply to ``low`` under ``optimizer``."""
    if masters == "stochastic" and low.dtype != torch.bfloat16:
        raise ValueError(f"masters='stochastic' rounds into bfloat16 weights; {name} is {low.dtype}: "
                         f"pass masters='kahan' or 'fp32' for float16")
    if state in ("bf16", "int8") and not quant.compressible(optimizer):
        raise ValueError(f"state={state!r} compresses the state of torch.optim.Adam, AdamW or SGD (their keys are "
                         f"known); {type(optimizer).__name__} keeps float32 state: pass state='fp32' (or 'auto', "
                         f"which keeps it float32 for this optimizer)")


def check_params(optimizer: Any, config: LeanConfig, groups: Optional[Sequence[Dict[str, Any]]] = None,
                 model: Optional[Any] = None) -> None:
    """Raise before anything changes: a non-float parameter, or a mode a parameter of ``groups`` (default:
    ``optimizer``'s) cannot take; an explicit lean mode when neither the optimizer nor ``model`` has a
    float16/bfloat16 parameter (``fxamp.initialize`` wraps the float32 optimizer, then adopts masters)."""
    low = 0
    for i, group in enumerate(optimizer.param_groups if groups is None else groups):
        for j, p in enumerate(group["params"]):
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"the optimizer's group {i}, param {j} is {p.dtype}: MixedPrecisionOptimizer steps "
                                f"floating-point parameters only; leave it out of the optimizer")
            if p.dtype in (torch.float16, torch.bfloat16):
                low += 1
                check_modes(optimizer, p, config.masters.value, config.state.value, f"group {i}, param {j}")
    asked = [f"{name}={mode.value!r}" for name, mode in (("masters", config.masters), ("state", config.state))
             if mode.value not in ("fp32", "auto")]
    if model is not None and not low:
        low = sum(1 for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16))
    if groups is None and asked and not low:  # (an explicit lean mode with nothing to apply it to: refused)
        raise ValueError(f"{' and '.join(asked)} apply to float16/bfloat16 parameters and this optimizer has none "
                         f"(a float32 model, or O0/O1, whose float32 weights are their own masters): convert with "
                         f"O2/O3 for lean masters and state, or leave masters and state at 'fp32'")


def seed_from(seed: Union[int, torch.Generator, None]) -> int:
    """The stochastic rounding's seed: ``seed``, or drawn from a generator; None is 0, the same on every
    rank, so data-parallel replicas (which see the same averaged gradients) round alike and stay equal."""
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, (int, torch.Generator))):
        raise TypeError(f"seed must be an int or a torch.Generator, not {type(seed).__name__}")
    if seed is None:
        return 0
    if isinstance(seed, int):
        return seed
    return int(torch.randint(0, 2 ** 62, (1,), generator=seed))


def state_keys(optimizer: Any) -> int:
    """State tensors per element of a parameter: Adam/AdamW 2, SGD 1 with momentum (0 without), else 2."""
    if type(optimizer) is torch.optim.SGD:
        return int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    return 2
