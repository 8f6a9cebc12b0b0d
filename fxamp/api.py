"""``initialize()``: convert a model and wrap its optimizer in one call, as ``apex.amp.initialize`` did.

The one module that knows both halves: :mod:`fxamp.convert` (the graph rewrite) and
:mod:`fxamp.training.optimizer` (the training wrapper), which do not import each other.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from .conversion.convert import convert, policy_of
from .training.config import LossScaleOption
from .training.config import LeanConfig
from .training.optimizer import MixedPrecisionOptimizer, check_optimizer
from .dtypes import LOW
from .policy import Policy

__all__ = ["initialize"]

def initialize(
    model: nn.Module,
    optimizer: Any,
    policy: Union[str, Policy] = "O1",
    *,
    dtype: Union[str, torch.dtype, None] = None,
    loss_scale: LossScaleOption = "auto",
    sync_overflow: bool = True,
    process_group: Optional[Any] = None,
    verbose: bool = False,
    compile_step: bool = False,
    masters: str = "fp32",
    state: str = "fp32",
    **convert_kwargs: Any,
) -> Tuple[nn.Module, MixedPrecisionOptimizer]:
    """apex-style one call: ``model, opt = fxamp.initialize(model, opt, policy="O2")``.

    Converts ``model`` (``convert_kwargs`` go to :func:`fxamp.convert`) and wraps ``optimizer``,
    which was built on the original model's parameters.  Under O0/O1 the converted module shares
    them.  Under O2/O3 the original float32 parameters become the masters of the converted
    module's low-precision ones (matched by name), and the converted module's float32 parameters
    (norms) are re-bound to the original's; the inner optimizer and its state stay as they are.
    Afterwards train the returned module; the original module holds the float32 masters.
    ``verbose`` prints the options in force, as ``amp.initialize`` did.  ``compile_step`` goes to
    :class:`MixedPrecisionOptimizer` (the masters stepped by one compiled kernel: O2/O3 with AdamW,
    Adam or SGD).  ``masters``/``state``: per-tensor precision, as :class:`MixedPrecisionOptimizer`'s (a
    lean master leaves the original's parameter an empty placeholder: its value is the converted weight's).
    """
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError("initialize() takes the torch optimizer, not a MixedPrecisionOptimizer")
    check_optimizer(optimizer)
    lean = LeanConfig(masters, state)  # (a bad mode raises before anything is converted)
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
            if p.dtype in LOW:
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
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (original float32 parameter, its low-precision copy)
    for group in optimizer.param_groups:
        for p in group["params"]:
            c = conv_params.get(name_of[id(p)])
            if c is None or c is p:
                continue  # shared (O0/O1), or unused by the traced graph
            if c.shape != p.shape:  # pragma: no cover - convert keeps shapes
                raise ValueError(f"{name_of[id(p)]!r} changed shape in conversion: {tuple(p.shape)} -> {tuple(c.shape)}")
            if c.dtype in LOW:
                pairs.append((p, c))
            else:  # a float32 copy (norms under O2): share the original's, as O1 does
                for alias in conv_named[id(c)]:  # type: ignore[index]
                    _set_param(converted, alias, p)
    opt = MixedPrecisionOptimizer(optimizer, loss_scale=loss_scale, model=converted,
                                  sync_overflow=sync_overflow, process_group=process_group,
                                  compile_step=compile_step, precision=lean)
    adopted = opt.adopt_masters(pairs)
    if verbose:
        print(_options_text(converted, opt, adopted))
    return converted, opt


def _set_param(root: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner, _, attr = dotted.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    setattr(module, attr, value)


def _compile_step_note(opt: MixedPrecisionOptimizer) -> str:
    if not opt.compile_step or opt.compiled_step_active:
        return ""
    return " (not used: the masters are too small for the compiled kernels to pay, see fxamp.training.kernels.FUSED_MIN_TOTAL)"


def _options_text(model: nn.Module, opt: MixedPrecisionOptimizer, masters: int) -> str:
    stepped = sum(len(group["params"]) for group in opt.param_groups)
    lines = [
        "fxamp.initialize: options in force",
        f"  policy        : {policy_of(model)}",
        f"  loss_scale    : {opt.scaler.config}",
        f"  masters       : {masters} float32 masters for low-precision parameters",
        f"  float32 params: {stepped - masters} stepped directly",
        f"  optimizer     : {type(opt.optimizer).__name__}",
        f"  sync_overflow : {opt.sync_overflow}",
        f"  compile_step  : {opt.compile_step}" + _compile_step_note(opt),
    ]
    return "\n".join(lines)
