"""``FxampPrecision``: fxamp as a PyTorch Lightning precision plugin.

::

    from fxamp.lightning import FxampPrecision
    trainer = Trainer(plugins=[FxampPrecision("O2", dtype="bf16")])      # or dtype="16": float16
    trainer.fit(model)                                                   # validate/test/predict too

What it does, at the hooks Lightning's own ``MixedPrecision`` plugin uses:

* ``convert_module``: replaces the LightningModule's networks by ``fxamp.convert(child, policy,
  dtype=...)`` (every direct child module with parameters, or the ones named by ``modules=``).
  The state_dict keys stay the same, so checkpoints and ``load_from_checkpoint`` keep working.
  No autocast: ``forward_context`` is a no-op and inputs are not cast (converted modules take
  and return float32).
* ``connect``: wraps each optimizer from ``configure_optimizers`` in a
  ``fxamp.MixedPrecisionOptimizer`` (float32 masters, loss scaling); Lightning keeps the torch
  optimizer, so LR schedulers, ``self.optimizers()`` and LR monitors see what they expect.
* ``pre_backward`` scales the loss; ``optimizer_step`` runs the closure, unscales (so
  ``gradient_clip_val`` and ``on_before_optimizer_step`` see true float32 gradients in the
  masters, which is what the optimizer's ``param_groups`` hold), clips, and steps or skips on
  inf/NaN, as ``MixedPrecision`` does with a ``GradScaler``.
* ``state_dict`` holds the loss scaler and the float32 masters, so resuming is exact.

Limits: the model's float16/bfloat16 parameters hold the (scaled) low-precision gradients; read
gradients from the optimizer's parameters.  With several optimizers (manual optimization) they
share one loss scale: call ``manual_backward`` before each optimizer's ``step``.  LBFGS and other
closure-driven optimizers are not supported.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError("fxamp.lightning needs PyTorch Lightning: pip install 'fxamp[lightning]' "
                      "(or pip install lightning)") from e

import fxamp
from fxamp.training.config import LossScaleOption, config_for

from . import resolve_dtype

__all__ = ["FxampPrecision"]


class FxampPrecision(Precision):
    """Train a LightningModule's networks with fxamp: explicit casts, float32 masters, loss scaling.

    policy:         ``"O1"``..``"O3"`` or a policy string, as for :func:`fxamp.convert`.
    dtype:          ``"bf16"`` (default; no loss scaling) or ``"16"``/float16 (dynamic loss scaling).
    modules:        names (dotted paths) of the submodules to convert; default: every direct child
                    module that has parameters (the items of a ModuleList/ModuleDict).
    loss_scale:     ``"auto"`` (dynamic for float16, none for bfloat16), ``"dynamic"``, ``"none"``,
                    ``"static:<scale>"``, a :class:`fxamp.LossScaleConfig`, or a :class:`fxamp.training.loss_scale.LossScaler`
                    to share (a number is a static scale; ``None`` is refused: write ``"none"``).
    example_inputs: ``{"net": (x,)}``: example inputs for modules torch.fx cannot trace (used by
                    ``fxamp.convert``'s ``torch.export`` front end).
    compile_step:   step the float32 masters with compiled kernels, 16 masters a call, on models
                    large enough for them to pay (:class:`fxamp.MixedPrecisionOptimizer`'s
                    ``compile_step``; AdamW, Adam, SGD).
    masters, state: per-tensor precision of the masters and optimizer state, as
                    :class:`fxamp.MixedPrecisionOptimizer`'s (``"fp32"``, ``"kahan"``/``"stochastic"``,
                    ``"bf16"``/``"int8"``, ``"auto"``); checked here.
    convert_kwargs: passed on to :func:`fxamp.convert` (``overrides=``, ``leaf_modules=``...).
    """

    def __init__(
        self,
        policy: Union[str, "fxamp.Policy"] = "O2",
        dtype: Union[str, int, torch.dtype] = "bf16",
        *,
        modules: Optional[Sequence[str]] = None,
        loss_scale: LossScaleOption = "auto",
        example_inputs: Optional[Mapping[str, Tuple[Any, ...]]] = None,
        compile_step: bool = False,
        masters: str = "fp32",
        state: str = "fp32",
        **convert_kwargs: Any,
    ) -> None:
        self.lean = fxamp.LeanConfig(masters, state)  # (a bad mode raises here, before fit)
        self.policy = policy
        self.dtype = resolve_dtype(dtype)
        self.precision = "bf16-mixed" if self.dtype == torch.bfloat16 else "16-mixed"  # Lightning's vocabulary
        self.modules = None if modules is None else [str(m) for m in modules]
        self.example_inputs = dict(example_inputs or {})
        self.convert_kwargs = convert_kwargs
        self.compile_step = bool(compile_step)
        #: one loss scale for every optimizer of the LightningModule (as MixedPrecision's GradScaler)
        self.scaler = loss_scale if isinstance(loss_scale, fxamp.training.loss_scale.LossScaler) else \
            fxamp.training.loss_scale.LossScaler(config_for(loss_scale, self.dtype))
        self._wrappers: List[fxamp.MixedPrecisionOptimizer] = []

    @property
    def optimizers(self) -> List["fxamp.MixedPrecisionOptimizer"]:
        """The ``MixedPrecisionOptimizer`` of each optimizer Lightning set up (``connect``), in
        ``configure_optimizers()``'s order; [] before ``fit``.  A new list: the plugin keeps its own."""
        return list(self._wrappers)

    # -- the model ---------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replace the networks of ``module`` by their fxamp conversions (once; later calls keep them)."""
        for name in self._targets(module):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            child = getattr(parent, attr)
            if fxamp.conversion_info(child) is not None:
                continue  # converted by an earlier fit/validate/test/predict
            kwargs = dict(self.convert_kwargs)
            if name in self.example_inputs:
                kwargs["example_inputs"] = tuple(self.example_inputs[name])
            try:
                converted = fxamp.convert(child, self.policy, dtype=self.dtype, **kwargs)
            except fxamp.TraceError as e:
                raise fxamp.TraceError(
                    f"FxampPrecision could not convert {type(module).__name__}.{name}: {e}\n"
                    f"Pass FxampPrecision(..., example_inputs={{{name!r}: (example_input,)}}) so fxamp can "
                    f"capture it with torch.export, name the traceable parts with modules=[...], or pass "
                    f"leaf_modules=[...]"
                ) from e
            setattr(parent, attr, converted)
        return module

    def _targets(self, module: nn.Module) -> List[str]:
        if self.modules is not None:
            for name in self.modules:
                try:
                    module.get_submodule(name)
                except AttributeError:
                    children = [n for n, _ in module.named_children()]
                    raise ValueError(f"FxampPrecision(modules=[{name!r}]): {type(module).__name__} has no submodule "
                                     f"{name!r}; its children are {children}") from None
            names = list(self.modules)
        else:
            names = _networks(module)
            if not names and any(True for _ in module.parameters(recurse=False)):
                raise ValueError(f"{type(module).__name__} holds its parameters itself, not in child modules; "
                                 f"FxampPrecision converts child modules: move the layers into one (self.net = ...)")
        owner: Dict[int, str] = {}
        for name in names:
            for p in module.get_submodule(name).parameters():
                if owner.setdefault(id(p), name) != name:
                    raise ValueError(
                        f"{owner[id(p)]!r} and {name!r} share a parameter (tied weights); converting them "
                        f"separately would untie it: name their common parent in FxampPrecision(modules=[...])")
        return names

    # -- optimizers --------------------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: List[torch.optim.Optimizer],
                lr_schedulers: List[Any]) -> Tuple[nn.Module, List[torch.optim.Optimizer], List[Any]]:
        """Give each optimizer float32 masters (a ``MixedPrecisionOptimizer``); Lightning keeps the torch one."""
        wrappers = []
        for opt in optimizers:
            inner = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
            if isinstance(inner, torch.optim.LBFGS):
                raise TypeError("FxampPrecision does not support LBFGS (its step re-evaluates the loss "
                                "itself, unscaled); use precision='32-true' for it")
            known = self._wrapper_of(inner, self._wrappers)
            wrappers.append(known if known is not None else
                            fxamp.MixedPrecisionOptimizer(inner, loss_scale=self.scaler, model=model,
                                                          compile_step=self.compile_step, precision=self.lean))
        self._wrappers = wrappers
        return model, optimizers, lr_schedulers

    @staticmethod
    def _wrapper_of(optimizer: Any, wrappers: Sequence["fxamp.MixedPrecisionOptimizer"]):
        inner = getattr(optimizer, "_optimizer", optimizer)
        for w in wrappers:
            if w.optimizer is inner:
                return w
        return None

    def wrapper(self, optimizer: Any) -> "fxamp.MixedPrecisionOptimizer":
        """The ``MixedPrecisionOptimizer`` around ``optimizer`` (a torch or Lightning optimizer)."""
        w = self._wrapper_of(optimizer, self._wrappers)
        if w is None:
            raise RuntimeError(f"{type(optimizer).__name__} is not one of the optimizers FxampPrecision set up; "
                               f"return every optimizer from configure_optimizers()")
        return w

    def main_params(self, optimizer: torch.optim.Optimizer):
        """The float32 tensors the optimizer steps (masters and float32 parameters): clip and inspect these."""
        return self.wrapper(optimizer).master_params()

    # -- backward and step -------------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def _unscale(self, optimizer: Any) -> None:
        w = self.wrapper(optimizer)
        if w.stage == "scaled":
            w.unscale_()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._unscale(optimizer)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure (forward, backward), unscale, clip, then step or skip on inf/NaN; update the scale."""
        w = self.wrapper(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step (as MixedPrecision)
        self._unscale(optimizer)  # before clipping and on_before_optimizer_step: true float32 gradients
        self._after_closure(model, optimizer)
        w.step()  # skips on inf/NaN (w.skipped_steps counts)
        self.scaler.update()
        w.zero_grad()  # the model's low-precision gradients were copied into the masters; clear them
        return closure_result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the float32 masters' gradients, unscaled first (manual optimization may call this before step)."""
        if clip_val > 0:
            self._unscale(optimizer)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The loss scaler and, per optimizer, its float32 masters and skipped steps.

        The optimizers' own state is saved by Lightning (``optimizer_states``), not repeated here.
        """
        optimizers = []
        for w in self._wrappers:
            state = w.state_dict()
            state.pop("optimizer")
            state.pop("stateful", None)  # (which of "optimizer"'s entries are real: it goes with them)
            state.pop("scaler")
            optimizers.append(state)
        return {"scaler": self.scaler.state_dict(), "optimizers": optimizers}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the scale, then each optimizer's masters (refreshing the model's weights)."""
        self.scaler.load_state_dict(state_dict["scaler"])
        saved = state_dict.get("optimizers", [])
        if not self._wrappers:
            return  # validate/test/predict from a checkpoint: no optimizer, nothing more to restore
        if len(saved) != len(self._wrappers):
            raise ValueError(f"the checkpoint has fxamp state for {len(saved)} optimizer(s), this run "
                             f"{len(self._wrappers)}; configure_optimizers() must return the same optimizers")
        for w, state in zip(self._wrappers, saved):
            # the inner optimizer's state is restored by Lightning right after this; keep the current one
            w.load_state_dict({**state, "optimizer": w.optimizer.state_dict(), "stateful": None,
                               "scaler": self.scaler.state_dict()})

    def __repr__(self) -> str:
        return f"FxampPrecision(policy={self.policy!r}, dtype={self.dtype}, scaler={self.scaler})"


def _networks(module: nn.Module, prefix: str = "") -> List[str]:
    """Direct children with parameters; the items of ModuleList/ModuleDict containers (they have no forward)."""
    names = []
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names += _networks(child, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names
