"""``MixedPrecisionOptimizer``: float32 master weights and loss scaling around any torch optimizer.

::

    model = fxamp.convert(Net(), policy="O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    for x, y in loader:
        opt.zero_grad()
        opt.backward(loss_fn(model(x), y))   # backward of loss * scale
        opt.unscale_()                       # optional, e.g. before clipping
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
        stepped = opt.step()                 # False: skipped, an inf/NaN gradient

For every float16/bfloat16 parameter the inner optimizer steps a float32 master instead; after a
step the low-precision parameters are refreshed from the masters (one ``torch._foreach_copy_``).
Float32 parameters (O1, or norms under O2) are stepped directly.  Per step::

    READY --backward()--> SCALED --unscale_()--> UNSCALED --step()--> READY
                            \\________________step()________________/

``step()`` copies low-precision gradients into the masters' float32 ``.grad``, divides every
gradient by the scale and checks it for inf/NaN in one fused kernel per (device, dtype), agrees
on the result across ranks, then steps or skips (a skip changes no weight, master or optimizer
state) and updates the scale (see :class:`fxamp.LossScaler`).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .convert import convert, policy_of
from .distributed import all_reduce_overflow
from .errors import OptimizerStateError
from .loss_scale import LossScaleConfig, LossScaler, unscale_and_check_
from .policy import Policy

__all__ = ["MixedPrecisionOptimizer", "initialize"]

_LOW = (torch.float16, torch.bfloat16)
_FORMAT = 1


class _Stage(str, enum.Enum):
    READY = "ready"  # no scaled gradients since the last step
    SCALED = "scaled"  # backward() ran: gradients hold loss * scale
    UNSCALED = "unscaled"  # unscale_() ran: masters hold true gradients, overflow decided
    STEPPED = "stepped"  # step() ran; a shared scaler waits for scaler.update()


LossScaleArg = Union[str, float, None, LossScaleConfig, LossScaler]


class MixedPrecisionOptimizer:
    """Wrap ``optimizer`` (any ``torch.optim.Optimizer``) with float32 masters and loss scaling.

    loss_scale:    ``"auto"`` (dynamic for float16, none for bfloat16 — read from ``model``'s fxamp
                   policy, else from the parameters' dtypes; dynamic when all are float32 and no
                   policy says otherwise), ``"dynamic"``, a number (static), ``None``/``"none"``, a
                   :class:`LossScaleConfig`, or a :class:`LossScaler` shared with other optimizers.
    model:         the module the parameters belong to: names parameters in reports and errors,
                   and is the default for :meth:`fp32_state_dict`.
    sync_overflow: all-reduce the overflow decision over ``process_group`` when torch.distributed
                   is initialized, so every rank steps or skips together.

    The wrapper does not patch ``optimizer``: it replaces float16/bfloat16 parameters in its
    ``param_groups`` by float32 masters (moving any existing state), so LR schedulers built on
    ``optimizer`` (``opt.optimizer``) keep working.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scale: LossScaleArg = "auto",
        model: Optional[nn.Module] = None,
        sync_overflow: bool = True,
        process_group: Optional[Any] = None,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("optimizer is already a MixedPrecisionOptimizer; wrap the torch optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
        self.optimizer = optimizer
        self.model = model
        self.sync_overflow = bool(sync_overflow)
        self.process_group = process_group
        self._names: Dict[int, str] = {}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._lows: List[torch.Tensor] = []  # low-precision model parameters ...
        self._masters: List[torch.Tensor] = []  # ... and their float32 masters, stepped by the optimizer
        self._low_of: Dict[int, torch.Tensor] = {}  # id(master) -> low-precision parameter
        self._nparams = 0
        for group in optimizer.param_groups:
            self._bind_group(group)
        self.scaler, self._owns_scaler = _resolve_scaler(loss_scale, model, list(self.master_params()) + self._lows)
        #: steps skipped by this optimizer because a gradient was inf/NaN
        self.skipped_steps = 0
        self._unscaled_gen = -1
        self._stepped_gen = -1
        self._found = False
        self._overflow: Optional[Tuple[List[torch.Tensor], torch.Tensor]] = None

    # -- parameters ------------------------------------------------------------------------
    def _bind_group(self, group: Dict[str, Any]) -> None:
        """Swap float32 masters into ``group["params"]`` for its low-precision parameters."""
        params = group["params"]
        for j, p in enumerate(params):
            if p.dtype in _LOW:
                master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                state = self.optimizer.state.pop(p, None)
                if state:
                    self.optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                        for k, v in state.items()
                    }
                params[j] = master
                self._pair(p, master)
        self._nparams += len(params)

    def _pair(self, low: torch.Tensor, master: torch.Tensor) -> None:
        self._lows.append(low)
        self._masters.append(master)
        self._low_of[id(master)] = low

    def _adopt(self, low_of_master: Dict[int, torch.Tensor]) -> None:
        """Make float32 parameters already in the optimizer the masters of given low-precision ones (initialize)."""
        for p in self.master_params():
            low = low_of_master.get(id(p))
            if low is not None and id(p) not in self._low_of:
                self._pair(low, p)

    def add_param_group(self, group: Dict[str, Any]) -> None:
        """Like ``Optimizer.add_param_group``, creating masters for float16/bfloat16 parameters.

        Add groups through the wrapper: one added to the inner optimizer directly is refused at the next step.
        """
        self.optimizer.add_param_group(group)
        before = self._nparams
        self._bind_group(self.optimizer.param_groups[-1])
        assert self._nparams == before + len(self.optimizer.param_groups[-1]["params"])

    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer steps: float32 masters and float32 parameters (clip these)."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def current_scale(self) -> float:
        """The loss scale the next backward() multiplies by."""
        return self.scaler.scale

    def _name(self, p: torch.Tensor) -> str:
        low = self._low_of.get(id(p))
        key = id(low) if low is not None else id(p)
        if key in self._names:
            return self._names[key]
        for i, group in enumerate(self.optimizer.param_groups):
            for j, q in enumerate(group["params"]):
                if q is p:
                    return f"group {i}, param {j}"
        return f"a parameter of shape {tuple(p.shape)}"  # pragma: no cover

    # -- state machine ---------------------------------------------------------------------
    @property
    def stage(self) -> str:
        """``"ready"``, ``"scaled"`` (after backward), ``"unscaled"`` or ``"stepped"`` (shared scaler, before update)."""
        return self._stage().value

    def _stage(self) -> _Stage:
        gen = self.scaler._generation
        if self._stepped_gen == gen:
            return _Stage.STEPPED
        if self._unscaled_gen == gen:
            return _Stage.UNSCALED
        if self.scaler._scaled:
            return _Stage.SCALED
        return _Stage.READY

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's parameters and of the masters; starts the iteration over."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            for p in self._lows:
                p.grad = None
        else:
            grads = []
            for p in self._lows:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)
        if self._stage() is not _Stage.STEPPED:
            self._unscaled_gen = -1
            if self._owns_scaler:
                self.scaler._scaled = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * current_scale``, for a backward you run yourself (``opt.scale_loss(loss).backward()``)."""
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
                "detached, or from parameters with requires_grad=False"
            )
        stage = self._stage()
        if stage is _Stage.UNSCALED:
            raise OptimizerStateError(
                "backward() after unscale_(): the gradients were already unscaled for this step; "
                "call step() (or zero_grad()) first, and unscale_() only after the last backward()"
            )
        if stage is _Stage.STEPPED:
            raise OptimizerStateError(
                "backward() after step() but before the shared scaler's update(); call scaler.update() "
                "once every optimizer sharing it has stepped"
            )
        return self.scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * scale).backward(**kwargs)``; call several times to accumulate gradients."""
        self.scale_loss(loss).backward(**kwargs)

    def unscale_(self) -> None:
        """Put true float32 gradients in the masters (and float32 parameters); decide whether this step overflowed.

        Optional: step() calls it when you did not.  At most once per step, after the last backward().
        The model's float16/bfloat16 parameters keep their scaled gradients; clip and inspect
        :meth:`master_params`, whose gradients are the true ones.
        """
        self._check_params()
        stage = self._stage()
        if stage is _Stage.UNSCALED:
            raise OptimizerStateError(
                "unscale_() has already been called since the last step(); call it at most once per "
                "step, after the last backward()"
            )
        if stage is _Stage.STEPPED:
            raise OptimizerStateError("unscale_() after step(); call it between backward() and step()")
        if stage is _Stage.READY:
            raise OptimizerStateError(
                "unscale_() before any backward(); call opt.backward(loss) (or opt.scale_loss(loss).backward()) first"
            )
        dst, src, checked = [], [], []
        for low, master in zip(self._lows, self._masters):
            g = low.grad
            if g is None:
                master.grad = None
                continue
            if g.is_sparse:
                master.grad = g.coalesce().float()
            else:
                if master.grad is None or master.grad.is_sparse or master.grad.shape != master.shape:
                    master.grad = torch.empty_like(master)
                dst.append(master.grad)
                src.append(g)
        with torch.no_grad():
            if dst:
                torch._foreach_copy_(dst, src)
            for p in self.master_params():
                if p.grad is not None:
                    checked.append(p)
            if not checked:
                raise OptimizerStateError(
                    "no parameter of this optimizer has a gradient: the loss does not depend on them, "
                    "or backward() ran on another model (if the optimizer was built on the original "
                    "model's parameters, use fxamp.initialize(model, optimizer) to re-point it)"
                )
            grads = [p.grad for p in checked]
            local = unscale_and_check_(grads, self.scaler.inv_scale())
            found = all_reduce_overflow(local, self.process_group) if self.sync_overflow else local
            self._found = bool(found.item())
            if local.item():  # rare: note which tensors overflowed, before clipping can spread NaNs
                dense = [g._values() if g.is_sparse else g for g in grads]
                maxabs = torch.stack([n.float().cpu() for n in torch._foreach_norm(dense, math.inf)])
                self._overflow = (checked, ~torch.isfinite(maxabs))
            else:  # clean here; on another rank, perhaps
                self._overflow = ([], torch.zeros(0, dtype=torch.bool)) if self._found else None
        self._unscaled_gen = self.scaler._generation

    def step(self, closure: None = None) -> bool:
        """Step the inner optimizer unless a gradient is inf/NaN; refresh the low-precision weights; update the scale.

        Returns True if it stepped, False if it skipped.  Raises LossScaleError when dynamic
        scaling gives up (see :class:`LossScaler`); that step is skipped too.
        """
        if closure is not None:
            raise OptimizerStateError(
                "step(closure) is not supported: the loss must be scaled; run the closure's forward and "
                "opt.backward(loss) yourself, then call step()"
            )
        stage = self._stage()
        if stage is _Stage.READY:
            raise OptimizerStateError(
                "step() without a backward pass since the last step; call opt.backward(loss) "
                "(or opt.scale_loss(loss).backward()) before opt.step()"
            )
        if stage is _Stage.STEPPED:
            raise OptimizerStateError(
                "step() was already called since the shared scaler's last update(); call scaler.update() "
                "once per iteration, after every optimizer sharing it has stepped"
            )
        if stage is _Stage.SCALED:
            self.unscale_()
        found = self._found
        if found:
            self.skipped_steps += 1
            blame = self.overflowed_params
        else:
            self.optimizer.step()
            self._refresh()
            blame = tuple
        self.scaler.record(found, blame)
        self._stepped_gen = self.scaler._generation
        if self._owns_scaler:
            self.scaler.update()
        return not found

    def _refresh(self) -> None:
        if self._lows:
            with torch.no_grad():
                torch._foreach_copy_(self._lows, self._masters)

    def _check_params(self) -> None:
        n = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if n != self._nparams:
            raise OptimizerStateError(
                f"the inner optimizer now holds {n} parameters, the wrapper knows {self._nparams}: a "
                f"param group was added to it directly; use opt.add_param_group(...) on the wrapper so "
                f"float16/bfloat16 parameters get float32 masters"
            )

    def overflowed_params(self) -> List[str]:
        """Names of the parameters whose gradients were inf/NaN at the latest skipped step ([] after a clean step).

        Computed only on overflow (one ``_foreach_norm``); on a distributed run, only this rank's.
        """
        if self._overflow is None:
            return []
        params, bad = self._overflow
        return [self._name(p) for p, b in zip(params, bad.tolist()) if b]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, with the model's own ``state_dict``:

        optimizer:     the inner optimizer's state_dict (its state is the masters')
        masters:       the float32 masters, in the order their parameters appear in the optimizer
        scaler:        :meth:`LossScaler.state_dict`
        skipped_steps: this optimizer's skipped steps
        format:        version of this layout

        Tensors are references, as in ``torch.optim.Optimizer.state_dict``; save or deep-copy them.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach() for m in self._masters],
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "format": _FORMAT,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and refresh the low-precision parameters from the loaded masters."""
        missing = {"optimizer", "masters", "scaler", "skipped_steps", "format"} - set(state)
        if missing:
            raise KeyError(f"state_dict lacks {sorted(missing)}; pass what MixedPrecisionOptimizer.state_dict() returned")
        masters = state["masters"]
        if len(masters) != len(self._masters):
            raise ValueError(f"the checkpoint has {len(masters)} float32 masters, this optimizer "
                             f"{len(self._masters)}; build it on the same model and policy")
        for i, (have, saved) in enumerate(zip(self._masters, masters)):
            if have.shape != saved.shape:
                raise ValueError(f"master {i} ({self._name(have)}) has shape {tuple(have.shape)}, the "
                                 f"checkpoint's {tuple(saved.shape)}; build the optimizer on the same model")
        self.optimizer.load_state_dict(state["optimizer"])
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(self._masters, [m.to(h.device) for m, h in zip(masters, self._masters)])
        self._refresh()
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state["skipped_steps"])
        self._unscaled_gen = self._stepped_gen = -1
        self._overflow = None

    def fp32_state_dict(self, model: Optional[nn.Module] = None) -> "OrderedDict[str, torch.Tensor]":
        """``model.state_dict()`` in float32, low-precision parameters taken from the masters.

        Loads into the original, unconverted model.  ``model`` defaults to the one given at construction.
        """
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("fp32_state_dict() needs the model: pass it here or as MixedPrecisionOptimizer(..., model=model)")
        master_of = {id(low): m for low, m in zip(self._lows, self._masters)}
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for key, value in model.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                out[key] = value
            elif id(value) in master_of:
                out[key] = master_of[id(value)].detach()
            elif value.dtype in _LOW:
                out[key] = value.detach().float()
            else:
                out[key] = value.detach()
        return out

    def __repr__(self) -> str:
        return (f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, {len(self._masters)} float32 masters, "
                f"{self._nparams - len(self._masters)} float32 params, {self.scaler})")


def _resolve_scaler(loss_scale: LossScaleArg, model: Optional[nn.Module],
                    params: Sequence[torch.Tensor]) -> Tuple[LossScaler, bool]:
    if isinstance(loss_scale, LossScaler):
        return loss_scale, False
    if isinstance(loss_scale, LossScaleConfig):
        return LossScaler(loss_scale), True
    if loss_scale is None or loss_scale == "none":
        return LossScaler(LossScaleConfig.none()), True
    if loss_scale == "dynamic":
        return LossScaler(LossScaleConfig.dynamic()), True
    if loss_scale == "auto":
        return LossScaler(_auto_config(model, params)), True
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaler(LossScaleConfig.static(float(loss_scale))), True
    raise ValueError(
        f"loss_scale={loss_scale!r} is not understood; use 'auto', 'dynamic', a number (static), None, "
        f"a LossScaleConfig, or a LossScaler shared with other optimizers"
    )


def _auto_config(model: Optional[nn.Module], params: Sequence[torch.Tensor]) -> LossScaleConfig:
    policy: Optional[Policy] = None
    if model is not None:
        policy = policy_of(model) or policy_of(getattr(model, "module", model))  # DDP keeps it in .module
    if policy is not None:
        low = policy.compute
    else:
        dtypes = {p.dtype for p in params}
        low = torch.float16 if torch.float16 in dtypes else torch.bfloat16 if torch.bfloat16 in dtypes else None
    if low in (torch.bfloat16, torch.float32):
        return LossScaleConfig.none()
    return LossScaleConfig.dynamic()


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Union[str, Policy] = "O1",
    *,
    dtype: Union[str, torch.dtype, None] = None,
    loss_scale: LossScaleArg = "auto",
    sync_overflow: bool = True,
    process_group: Optional[Any] = None,
    verbose: bool = False,
    **convert_kwargs: Any,
) -> Tuple[nn.Module, MixedPrecisionOptimizer]:
    """apex-style one call: ``model, opt = fxamp.initialize(model, opt, policy="O2")``.

    Converts ``model`` (``convert_kwargs`` go to :func:`fxamp.convert`) and wraps ``optimizer``,
    which was built on the original model's parameters.  Under O0/O1 the converted module shares
    them.  Under O2/O3 the original float32 parameters become the masters of the converted
    module's low-precision ones (matched by name), and the converted module's float32 parameters
    (norms) are re-bound to the original's; the inner optimizer and its state stay as they are.
    Afterwards train the returned module; the original module holds the float32 masters.
    ``verbose`` prints the options in force, as ``amp.initialize`` did.
    """
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError("initialize() takes the torch optimizer, not a MixedPrecisionOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, not {type(model).__name__}")
    name_of: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), name)
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in name_of:
                raise ValueError(
                    f"the optimizer's group {i}, param {j} (shape {tuple(p.shape)}, {p.dtype}) is not a "
                    f"parameter of the model; build the optimizer on model.parameters(), or convert the "
                    f"model yourself and wrap an optimizer built on the converted module's parameters"
                )
            if p.dtype in _LOW:
                raise ValueError(
                    f"the optimizer's parameter {name_of[id(p)]!r} is already {p.dtype}; initialize() expects "
                    f"the float32 model (call model.float() first) or use MixedPrecisionOptimizer directly"
                )
    converted = convert(model, policy, dtype=dtype, **convert_kwargs)
    conv_named: Dict[str, List[str]] = {}
    conv_params: Dict[str, torch.Tensor] = {}
    for name, p in converted.named_parameters(remove_duplicate=False):
        conv_params[name] = p
        conv_named.setdefault(id(p), []).append(name)  # type: ignore[arg-type]
    low_of_master: Dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            c = conv_params.get(name_of[id(p)])
            if c is None or c is p:
                continue  # shared (O0/O1), or unused by the traced graph
            if c.shape != p.shape:  # pragma: no cover - convert keeps shapes
                raise ValueError(f"{name_of[id(p)]!r} changed shape in conversion: {tuple(p.shape)} -> {tuple(c.shape)}")
            if c.dtype in _LOW:
                low_of_master[id(p)] = c
            else:  # a float32 copy (norms under O2): share the original's, as O1 does
                for alias in conv_named[id(c)]:  # type: ignore[index]
                    _set_param(converted, alias, p)
    opt = MixedPrecisionOptimizer(optimizer, loss_scale=loss_scale, model=converted,
                                  sync_overflow=sync_overflow, process_group=process_group)
    opt._adopt(low_of_master)
    if verbose:
        print(_options_text(converted, opt))
    return converted, opt


def _set_param(root: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner, _, attr = dotted.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    setattr(module, attr, value)


def _options_text(model: nn.Module, opt: MixedPrecisionOptimizer) -> str:
    pol = policy_of(model)
    lines = [
        "fxamp.initialize: options in force",
        f"  policy        : {pol}",
        f"  loss_scale    : {opt.scaler.config}",
        f"  masters       : {len(opt._masters)} float32 masters for low-precision parameters",
        f"  float32 params: {opt._nparams - len(opt._masters)} stepped directly",
        f"  optimizer     : {type(opt.optimizer).__name__}",
        f"  sync_overflow : {opt.sync_overflow}",
    ]
    return "\n".join(lines)
