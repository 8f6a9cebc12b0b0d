"""``OptimizerView``: what torch and the tools around it expect of a ``torch.optim.Optimizer``, over a wrapped one.

:class:`~fxamp.training.optimizer.MixedPrecisionOptimizer` (the facade: masters, ``state_dict``, the public verbs)
is this class's subclass.  Here is what it shows the outside as an optimizer, without a second copy of anything:
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects (``Optimizer.__init__`` is not
run), so ``StepLR(opt)`` (any torch LR scheduler) writes its learning rates where the inner optimizer reads them;
accelerate's mark; the read-outs of the masters (``master_params``, ``precision_table``, ``precision_of``) and of
the step engine (``plan``, ``kernels``, ``step_was_skipped``, ``skipped_steps``, ``current_scale``,
``compiled_step_active``, ``stage``), and the options kept on it; pickling and ``repr``.

Nothing ``opt.step()`` runs lives here (``tests/test_layout.py`` traces a step's files): ``step()``, the hooks run
around it, ``zero_grad``, ``backward`` and ``unscale_`` are the facade's.  The view reads what the facade binds
(``_engine``, ``scaler``, the masters' lists and maps), which it sets in its ``__init__``.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import torch

from . import lean
from . import plan as planning
from .ownership import mark_master

if TYPE_CHECKING:
    from .kernels import Kernels  # (imported by the facade's __init__ with compile_step=True only: torch.compile's)

__all__ = ["OptimizerView"]

#: the module of torch's ``get_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.state_dict``), whose
#: first read of an optimizer is ``optim.state`` (then it may step it to make state, and reads torch's layout)
_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"

#: torch.optim.Optimizer's per-instance hook tables (``register_step_pre_hook``...), which the wrapper runs itself
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")

#: what torch's LR schedulers set on the optimizer they take (``LRScheduler.__init__``: ``step``, a bound wrapper
#: that counts calls, and the flag it sets); not pickled, as torch's ``Optimizer.__getstate__`` drops them too
_SCHEDULER_ATTRS = ("step", "_opt_called")


def _on_engine(name: str) -> property:
    """A constructor option the facade keeps on its engine, which reads it at every step (settable, as before)."""
    return property(lambda self: getattr(self._engine, name), lambda self, value: setattr(self._engine, name, value))


class OptimizerView(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are ``optimizer``'s own.

    Its hook tables (``register_step_pre_hook``...) are torch's, empty at first; the subclass runs them around
    its verbs.  Not built on its own: :class:`~fxamp.training.optimizer.MixedPrecisionOptimizer` is the class.
    """

    #: accelerate (``transformers.Trainer``) hands an optimizer with this mark back as it is, rather than wrapping it
    #: in its ``AcceleratedOptimizer``, which would round-trip the state through ``load_state_dict`` at ``prepare`` and
    #: hide this object from the Trainer's callbacks; accelerate then asks it ``step_was_skipped`` (below)
    _is_accelerate_prepared = True

    def __init__(self, optimizer: Any) -> None:
        # (not Optimizer.__init__: it would copy the groups, and a scheduler's learning rate would miss the inner one)
        for name in _HOOKS:
            setattr(self, name, OrderedDict())
        self._skipped = False
        self.optimizer = optimizer

    # -- what torch reads of an optimizer --------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's own list: a learning rate set here (an LR scheduler) is the one it steps with."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (the masters'); refused to torch's ``get_state_dict``/``set_state_dict``."""
        frame = inspect.currentframe()
        caller = None if frame is None or frame.f_back is None else frame.f_back.f_globals.get("__name__")
        if caller == _DCP_STATE_DICT:
            # they read this first, then may step the optimizer at learning rate 0 to make state and expect torch's
            # state_dict layout keyed by the model's parameters, which the masters are not: refuse before anything
            raise TypeError("torch's get_state_dict/set_state_dict cannot take a MixedPrecisionOptimizer (the masters "
                            "are not the model's parameters, and the loss scale would be lost); use "
                            "fxamp.sharded_state_dict(model, opt), or give DCP the optimizer itself: "
                            "dcp.save({'optim': opt})")
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:
        """The inner optimizer's ``defaults`` (OneCycleLR reads them), or {} for one without."""
        return getattr(self.optimizer, "defaults", {})

    # -- read-outs of the masters and their precision ----------------------------------------
    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer steps: float32 masters and float32 parameters (clip these)."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def precision_table(self) -> str:
        """Per tensor: its master and state precision, bytes per parameter and why (measured under ``"auto"``)."""
        from .calibrate import table

        ws, names = self._ws, self._engine.name
        rows = [(names(m), self._low_of.get(id(m), m), None if ws is None or id(m) not in ws.choices
                 else ws.choices[id(m)], lean.state_keys(self.optimizer)) for m in self.master_params()]
        if ws is None:  # every master float32, as configured
            rows = [(n, p, lean.Choice() if id(p) != id(m) else None, k)
                    for (n, p, _, k), m in zip(rows, self.master_params())]
        return table(rows)

    def precision_of(self, master: torch.Tensor) -> Optional[lean.Choice]:
        """A master's per-tensor precision (``masters=``, ``state=``; what ``"auto"`` measured and chose, why, and
        its Kahan term): a row of :meth:`precision_table`. None for a float32 parameter or when every master is."""
        return None if self._ws is None else self._ws.choices.get(id(master))

    # -- read-outs of the step engine, and the options kept on it ---------------------------
    @property
    def plan(self) -> planning.Plan:
        """What the next step touches (:class:`fxamp.training.plan.Plan`: its buckets of masters and
        their float32 gradient segments, its runs once a step was segmented); read it, do not change it."""
        return self._engine.plan()

    @property
    def kernels(self) -> Optional[Kernels]:
        """``compile_step``'s :class:`~fxamp.training.kernels.Kernels` (what it compiled and keeps); None without it."""
        return self._engine.kernels

    @property
    def step_was_skipped(self) -> bool:
        """Whether the latest ``step()`` was skipped (an inf/NaN gradient, decided on the host): what accelerate asks
        the optimizers it holds (``Accelerator.optimizer_step_was_skipped``), so the Trainer's schedule then waits."""
        return self._skipped

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by this optimizer because a gradient was inf/NaN."""
        self._engine.settle()
        return self._engine.skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._engine.settle()
        self._engine.skipped = int(value)

    @property
    def compiled_step_active(self) -> bool:
        """Whether ``step()`` steps the masters with ``compile_step``'s compiled kernels: asked for, and
        the masters hold enough elements for them to pay (``fxamp.training.kernels.FUSED_MIN_TOTAL``)."""
        return self._engine.fuses(self._engine.plan())

    @property
    def current_scale(self) -> float:
        """The loss scale the next backward() multiplies by."""
        self._engine.settle()
        return self.scaler.scale

    @property
    def stage(self) -> str:
        """``"ready"``, ``"scaled"`` (after backward), ``"unscaled"`` or ``"stepped"`` (shared scaler, before update)."""
        self._engine.settle()
        return self.scaler.stage(self._engine.client).value

    sync_overflow = _on_engine("sync_overflow")
    process_group = _on_engine("process_group")
    release_grad_buffer = _on_engine("release_grad_buffer")

    # -- copies ----------------------------------------------------------------------------
    # pickling and deepcopy keep the wrapper's whole state (torch.optim.Optimizer's would keep only its three fields),
    # but not the hooks nor what an LR scheduler set on it (a bound wrapper of step): torch's drops those too
    def __getstate__(self) -> Dict[str, Any]:
        if self._ws is not None:  # (its flat buffers are freed between steps, its state keyed by the masters' ids)
            raise TypeError(f"a MixedPrecisionOptimizer with lean precision ({self.precision}) cannot be copied or "
                            f"pickled: save opt.state_dict() with the model's and load both into a new wrapper")
        return {k: v for k, v in self.__dict__.items() if k not in _HOOKS and k not in _SCHEDULER_ATTRS}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _HOOKS:
            setattr(self, name, OrderedDict())
        self.__dict__.setdefault("_skipped", False)  # (a wrapper pickled before it had step_was_skipped)
        # a copy's tensors are new objects: what is kept by id() is keyed again (the engine's maps are these same
        # dicts), the pairs marked again (a parameter's copy drops its attributes: the model's first-gradient check
        # would warn, and the copied master's mark refuses a second wrapper), the weights noted as they are
        self._low_of.clear()
        self._low_of.update((id(master), low) for low, master in zip(self._lows, self._masters))
        if self.model is not None:
            self._names.clear()
            for name, p in self.model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._engine.kept = None  # (planned again; a wrapper pickled before the engine left its plan out kept it)
        self._engine.stamps.clear()
        self._engine.watch.forget()
        for low, master in zip(self._lows, self._masters):
            mark_master(low, master)
            self._engine.note(master, low)

    def __repr__(self) -> str:
        return (f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, {len(self._masters)} float32 masters, "
                f"{self._engine.nparams - len(self._masters)} float32 params, {self.scaler}"
                + ("" if self._ws is None else f", {self.precision}") + ")")
