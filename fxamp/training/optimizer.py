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
scaler's (``config.Stage``, kept by its ``LossScaler`` for each optimizer attached to it)::

    READY --backward()--> SCALED --unscale_()--> UNSCALED --step()--> READY
                            \\________________step()________________/

A skip changes no weight, master or optimizer state.  On a GPU with a fused inner optimizer the
verdict is not read on the host: its kernel skips on the device, and the host learns the outcome
at the next iteration's start (see :meth:`MixedPrecisionOptimizer.step`).

This class is the facade: it binds the masters, keeps ``state_dict`` and offers the public verbs; every
verb of a step is its :class:`~fxamp.training.step.Engine`'s (:mod:`fxamp.training.step`: stage -> check ->
execute -> record), which hands the checked step to an executor (:mod:`fxamp.training.executors`).
The plain step is one run of every master (after ``unscale_()``, whose float32 gradients are views
into a few flat segments, freed by ``zero_grad()`` from 16 MiB on unless ``release_grad_buffer=False``);
on a large model with a stock per-parameter torch optimizer, a ``step()`` not preceded by
``unscale_()`` is *segmented*: runs of at most 4 MiB of float32 gradients, so a float32 gradient for
every master never exists, bitwise the same step (the masters hold no ``.grad`` after it).
``clip_grad_norm_()`` clips without leaving it (norms from the low-precision gradients, the factor
applied in ``step()``).  With ``compile_step=True`` (a stock AdamW, Adam or SGD, and masters large
enough for it to pay: ``kernels.FUSED_MIN_TOTAL``) the runs are stepped by a compiled executor
(:mod:`fxamp.training.kernels`) that reads the low-precision gradient and writes the master, the
optimizer state and the low-precision weight in one pass.

The wrapped optimizer may be any object that behaves like one (``param_groups``, ``state``,
``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``), e.g. a Lookahead or LARC wrapper.
The wrapper is a ``torch.optim.Optimizer`` itself, without a second copy of the groups: its base,
:class:`~fxamp.training.optimizer_view.OptimizerView`, shows the inner optimizer's own ``param_groups``, ``state``
and ``defaults``, so ``StepLR(opt)`` (any torch LR scheduler) writes its learning rates where the inner optimizer
reads them.
``fxamp.initialize`` (in :mod:`fxamp.api`) builds this wrapper for a model it converts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from . import checkpoint, iteration, lean, lean_step
from .config import LeanConfig, LossScaleOption, resolve as resolve_lean
from ..dtypes import LOW
from ..errors import OptimizerStateError
from ..info import take_loaded, take_origin
from .loss_scale import scaler_for
from .optimizer_view import OptimizerView
from .ownership import (mark_master, master_state, note_frozen_originals, originals_held, refuse_unheld_model,
                        refuse_wrapped)
from .step import Engine, StepResult

if TYPE_CHECKING:
    from .kernels import Kernels  # (imported by __init__ with compile_step=True only: it brings torch.compile's)

__all__ = ["MixedPrecisionOptimizer", "StepResult", "check_optimizer"]

#: what the wrapper uses of the optimizer it wraps (a duck-typed one needs them all)
_OPTIMIZER_ATTRS = ("param_groups", "state", "step", "zero_grad", "state_dict", "load_state_dict")


def check_optimizer(optimizer: Any) -> None:
    """Raise TypeError unless ``optimizer`` is a torch optimizer or like one; OptimizerStateError if already wrapped."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError("optimizer is already a MixedPrecisionOptimizer; wrap the torch optimizer once")
    if isinstance(optimizer, type):  # `MixedPrecisionOptimizer(torch.optim.AdamW, ...)`: the class, not one built
        raise TypeError(f"optimizer must be an optimizer instance, not the class {optimizer.__name__}: build it "
                        f"first, e.g. {optimizer.__name__}(model.parameters())")
    if isinstance(optimizer, torch.optim.LBFGS):  # its step() re-evaluates the loss through a closure, unscaled
        raise TypeError("torch.optim.LBFGS cannot be wrapped: its step(closure) runs the forward and backward "
                        "several times, which the wrapper cannot scale or check; step LBFGS on float32 weights "
                        "(fxamp.convert(model, 'O1') with bfloat16 needs no loss scale), without the wrapper")
    if isinstance(optimizer, torch.optim.Optimizer):
        return refuse_wrapped(optimizer)  # a second wrapper would step the first one's masters, which get no gradient
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
    refuse_wrapped(optimizer)


def _kernels_for(optimizer: Any) -> Kernels:
    """``compile_step=True``'s kernels for ``optimizer``, or ValueError saying why it cannot be fused.  torch.compile's
    modules (torch._dynamo) are imported here, not by ``import fxamp``."""
    from .kernels import Kernels, fusable

    why = fusable(optimizer)
    if why is not None:
        raise ValueError(f"compile_step=True: {why}; pass compile_step=False to step it as it is")
    return Kernels(optimizer)


def _refuse_duplicates(groups: List[Dict[str, Any]], held: Iterable[torch.Tensor] = ()) -> None:
    """Raise unless each low-precision parameter of ``groups`` appears once, and in none of ``held``: each would
    get its own master (torch only warns of a duplicate in one group, and cannot see one whose first
    appearance the wrapper already replaced by its master)."""
    seen = {id(p) for p in held}
    for i, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            if p.dtype in LOW and id(p) in seen:
                raise ValueError(f"param_groups[{i}]['params'][{j}] ({p.dtype} {tuple(p.shape)}) is already held by "
                                 f"the optimizer: pass each parameter once (two float32 masters of one weight "
                                 f"would each step it)")
            seen.add(id(p))


def _check_model(model: Any, optimizer: Any) -> None:
    """Raise unless ``model`` is an ``nn.Module`` whose parameters ``optimizer`` holds (its policy would pick the
    loss scale of a model not stepped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
    refuse_unheld_model(model, optimizer)


def _master_for(p: torch.Tensor, optimizer: Any) -> nn.Parameter:
    """A float32 master for the low-precision parameter ``p``, taking over its state in ``optimizer`` (in float32)."""
    # the float32 tensor conversion rounded p from, if alive: its exact values; taken as it is when
    # conversion alone held it (convert_), else copied (the user's original model holds it)
    origin, owned = take_origin(p)
    if origin is None:
        value = p.detach().float()
    else:
        value = origin.detach().to(p.device, torch.float32, copy=not owned)
    master = nn.Parameter(value, requires_grad=p.requires_grad)
    state = optimizer.state.pop(p, None)
    if state:
        optimizer.state[master] = {
            k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
            for k, v in state.items()
        }
    return master


def _check_loss(loss: Any) -> None:
    """Raise unless ``loss`` is a floating point scalar tensor that requires grad (what ``scale_loss`` scales)."""
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
            "detached, or from parameters with requires_grad=False; or a converted model traced a custom autograd "
            "Function whose forward runs under no_grad (Reformer's reversible layers: the conversion warned, naming "
            "it), whose backward a graph cannot keep: convert in place (fxamp.convert_) or keep its module out"
        )


class MixedPrecisionOptimizer(OptimizerView):
    """Wrap ``optimizer`` (any ``torch.optim.Optimizer``, or an object like one) with float32 masters and loss scaling.

    loss_scale:    a :data:`~fxamp.training.config.LossScaleOption` (:func:`~fxamp.training.loss_scale.scaler_for`):
                   ``"auto"`` (dynamic for float16, none for bfloat16 — read from ``model``'s fxamp
                   policy, else from the parameters' dtypes; dynamic when all are float32 and no
                   policy says otherwise), ``"dynamic"``, ``"none"``, ``"static:<scale>"``, a
                   :class:`LossScaleConfig`, or a :class:`LossScaler` shared with other optimizers
                   (a number is a static scale: ``128.0`` is ``"static:128"``; ``None`` is refused: write ``"none"``).
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
                   low-precision weight in the same pass as the update (:mod:`fxamp.training.kernels`,
                   which says when it pays: ``FUSED_MIN_TOTAL``; below it nothing is compiled).  Not
                   bitwise the inner optimizer's step (a few float32 ulps on the masters).  Raises
                   ValueError for another optimizer or an option the kernels lack (amsgrad,
                   capturable, differentiable) or lean masters/state.
    masters, state: per-tensor precision (:mod:`fxamp.training.lean`): masters ``"fp32"`` (the default),
                   ``"kahan"``, ``"stochastic"`` or ``"auto"``; state ``"fp32"``, ``"bf16"``, ``"int8"`` or
                   ``"auto"`` (measured during the first steps: :mod:`fxamp.training.calibrate`).
                   ``precision``: a preset (``"lean"``: auto and auto; ``"fp32"``) or a :class:`LeanConfig` instead
                   (refused beside ``masters=`` or ``state=``, which it would override).
                   ``seed``: of the stochastic rounding (an int, or a torch.Generator to draw it from; default 0,
                   the same on every rank, so DDP replicas round alike).

    The wrapper does not patch ``optimizer``: it replaces float16/bfloat16 parameters in its
    ``param_groups`` by float32 masters (moving any existing state).  What torch expects of an optimizer
    (``param_groups``, ``state`` and ``defaults``, ``optimizer``'s own; the read-outs; pickling) is its base's,
    :class:`~fxamp.training.optimizer_view.OptimizerView`: a torch LR scheduler takes either, ``StepLR(opt)`` or
    ``StepLR(opt.optimizer)``, with the same numbers.  Its step hooks (``register_step_pre_hook``...) run
    around the wrapper's ``step()``, its state_dict hooks around its ``state_dict()``/``load_state_dict()``.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        loss_scale: LossScaleOption = "auto",
        model: Optional[nn.Module] = None,
        sync_overflow: bool = True,
        process_group: Optional[Any] = None,
        release_grad_buffer: bool = True,
        compile_step: bool = False,
        masters: Optional[str] = None,
        state: Optional[str] = None,
        precision: Optional[Union[str, LeanConfig]] = None,
        seed: Union[int, torch.Generator, None] = None,
    ) -> None:
        check_optimizer(optimizer)
        _refuse_duplicates(optimizer.param_groups)
        config = resolve_lean(masters, state, precision)
        lean.check_params(optimizer, config, model=model)  # (before anything changes)
        if compile_step and config.lean:
            raise ValueError(f"compile_step=True steps float32 masters and state; {config} is lean: pass one or the other")
        kernels = _kernels_for(optimizer) if compile_step else None
        if model is not None:
            _check_model(model, optimizer)
        super().__init__(optimizer)
        self.model = model
        self.compile_step = bool(compile_step)
        self._names: Dict[int, str] = {}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._lows: List[torch.Tensor] = []  # low-precision model parameters ...
        self._masters: List[torch.Tensor] = []  # ... and their float32 masters, stepped by the optimizer
        self._low_of: Dict[int, torch.Tensor] = {}  # id(master) -> low-precision parameter
        master_state(optimizer, self._lows, self._masters)  # (opt.state[p] of a model's parameter: its master's)
        self.precision = config
        self._ws = lean.Workspace(optimizer, config, lean.seed_from(seed)) if config.lean else None
        self.scaler, owns_scaler = scaler_for(loss_scale, model, list(self.master_params()))  # before binding: a bad loss_scale changes nothing
        #: the step engine (:class:`fxamp.training.step.Engine`): every verb of a step is its
        self._engine = Engine(optimizer, self.scaler, owns_scaler, self._low_of, self._names, self._ws,
                              None if self._ws is None else lean_step.LeanStep(self._ws), kernels,
                              sync_overflow=bool(sync_overflow), process_group=process_group,
                              release_grad_buffer=bool(release_grad_buffer))
        for group in optimizer.param_groups:
            self._bind_group(group)
        #: ``model``'s low-precision weights whose float32 originals ``optimizer`` holds (built before conversion):
        #: refused at the first step unless they became masters by then (:meth:`adopt_masters`, ``fxamp.initialize``)
        self._originals = [] if model is None else originals_held(model, optimizer, self._lows)
        if model is not None:
            note_frozen_originals(model)

    # -- parameters ------------------------------------------------------------------------
    def _bind_group(self, group: Dict[str, Any]) -> None:
        """Swap float32 masters into ``group["params"]`` for its low-precision parameters."""
        params = group["params"]
        for j, p in enumerate(params):
            if p.dtype in LOW:
                params[j] = _master_for(p, self.optimizer)
                self._pair(p, params[j])
        self._engine.nparams += len(params)

    def _pair(self, low: torch.Tensor, master: torch.Tensor) -> None:
        self._lows.append(low)
        self._masters.append(master)
        self._low_of[id(master)] = low
        self._engine.kept = None  # (planned again at the next step)
        mark_master(low, master, self._ws)
        if self._ws is not None:
            self._ws.add(low, master, len(self._masters) - 1, self._names.get(id(low), "a parameter"))
        self._engine.note(master, low)  # (a weight written after this is followed at the next step)

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
        try:
            _refuse_duplicates(self.optimizer.param_groups[-1:], self._lows)
            lean.check_params(self.optimizer, self.precision, groups=self.optimizer.param_groups[-1:])
        except (TypeError, ValueError):
            self.optimizer.param_groups.pop()  # nothing changed
            raise
        before = self._engine.nparams
        self._bind_group(self.optimizer.param_groups[-1])
        assert self._engine.nparams == before + len(self.optimizer.param_groups[-1]["params"])

    def master_pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(low-precision parameter, its float32 master)`` for every master, in the order they were
        paired (the order of :meth:`state_dict`'s ``masters``).  A lean master (``masters="kahan"`` or
        ``"stochastic"``) is a placeholder between steps: its value is :meth:`fp32_state_dict`'s."""
        return list(zip(self._lows, self._masters))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's parameters and of the masters; starts the iteration over.

        With ``set_to_none`` (the default) they become None, as with ``Optimizer.zero_grad``, and the
        masters' float32 gradient segments are freed (allocated again at the next unscale_()),
        unless ``release_grad_buffer=False``: then they are kept and bound again.  The
        inner optimizer's own ``zero_grad`` runs when ``set_to_none=False``, or when it is not
        ``torch.optim.Optimizer.zero_grad`` (a subclass or another kind of optimizer).
        """
        self._engine.watch.forget()
        iteration.zero_grad(self._engine, set_to_none, self._lows)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * current_scale``, for a backward you run yourself (``opt.scale_loss(loss).backward()``)."""
        _check_loss(loss)
        self._engine.settle()
        self._engine.watch.forget()  # (a backward run by the caller changes the gradients: no check this step)
        return self.scaler.scale_loss(loss, self._engine.client)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * scale).backward(**kwargs)``; call several times to accumulate gradients."""
        scaled = self.scale_loss(loss)
        scaled.backward(**kwargs)
        # the gradients' versions now, to tell torch's clip of them before step() (training/grad_watch.py): not at a
        # scale of 1 (true gradients), nor with a shared scaler (another wrapper's backward may add to them)
        if scaled is not loss and self._engine.owns_scaler and self.scaler.scale != 1.0:
            low_of = self._low_of
            self._engine.watch.record(self._lows + [p for g in self.optimizer.param_groups for p in g["params"]
                                             if id(p) not in low_of])

    def unscale_(self) -> None:
        """Put true float32 gradients in the masters (and float32 parameters); decide whether this step overflowed.

        Optional: step() calls it when you did not.  At most once per step, after the last backward().
        The model's float16/bfloat16 parameters keep their scaled gradients; clip and inspect
        :meth:`master_params`, whose gradients are the true ones.
        """
        self._engine.unscale_()

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
        return iteration.clip_grad_norm_(self._engine, max_norm, norm_type, error_if_nonfinite)

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
        if self._originals:
            self._refuse_originals()
        # torch.optim.Optimizer's step hooks, as its own step runs them (args: the optimizer, then step's own)
        args: Tuple[Any, ...] = (self,)
        kwargs: Dict[str, Any] = {}
        for hook in tuple(self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        result = self._engine.step()
        self._skipped = result is False  # (a device-decided step's StepResult: not known here, not skipped)
        for hook in tuple(self._optimizer_step_post_hooks.values()):
            hook(self, args, kwargs)
        return result

    def _refuse_originals(self) -> None:
        paired = {id(low) for low in self._lows}
        left = [self._engine.name(low) for low in self._originals if id(low) not in paired]
        if left:
            raise OptimizerStateError(
                f"this {type(self.optimizer).__name__} holds the float32 parameters of the model before conversion "
                f"(those of {', '.join(left[:3])}{'...' if len(left) > 3 else ''}): its step would train them, "
                f"not the converted model's {self._originals[0].dtype} weights; build the optimizer on the "
                f"converted module's parameters, or use fxamp.initialize(model, optimizer), which makes them the masters")
        self._originals = []

    def overflowed_params(self) -> List[str]:
        """Names of the parameters whose gradients were inf/NaN at the latest skipped step ([] after a clean step).

        Computed only on overflow (one ``_foreach_norm``); on a distributed run, only this rank's.
        """
        return self._engine.overflowed()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, with the model's own ``state_dict`` (layout: :mod:`fxamp.training.checkpoint`)."""
        self._engine.settle()
        for hook in tuple(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        state = checkpoint.save(self)
        for hook in tuple(self._optimizer_state_dict_post_hooks.values()):
            changed = hook(self, state)
            state = state if changed is None else changed
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and refresh the low-precision parameters from the loaded masters.
        Also what ``torch.distributed.checkpoint`` calls: ``dcp.load({"optim": opt}, ...)`` resumes bitwise."""
        for hook in tuple(self._optimizer_load_state_dict_pre_hooks.values()):
            changed = hook(self, state_dict)
            state_dict = state_dict if changed is None else changed
        checkpoint.load(self, state_dict)
        master_state(self.optimizer, self._lows, self._masters)  # (torch's load_state_dict made a new defaultdict)
        for _, low in self._engine.pairs():  # the loaded masters win over a float32 model checkpoint loaded before
            take_loaded(low)
        self._engine.note_weights()
        for hook in tuple(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def fp32_state_dict(self, model: Optional[nn.Module] = None) -> "OrderedDict[str, torch.Tensor]":
        """``model.state_dict()`` in float32, low-precision parameters taken from the masters: loads into the
        original, unconverted model.  ``model`` defaults to the one given at construction; one it does not step is refused."""
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("fp32_state_dict() needs the model: pass it here or as MixedPrecisionOptimizer(..., model=model)")
        return checkpoint.fp32_state_dict(self, model)
