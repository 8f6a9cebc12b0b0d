"""fxamp for Hugging Face's ``transformers.Trainer``: a converted model and ``(optimizer, scheduler)``.

::

    from fxamp.integrations import hf
    args = TrainingArguments(output_dir=..., learning_rate=2e-3, max_steps=300, ...)   # bf16/fp16 left False
    model, optimizers = hf.prepare(model, args, "O2", dtype="bf16", example_batch=batch)   # or in_place=True
    trainer = Trainer(model=model, args=args, optimizers=optimizers, train_dataset=..., ...)
    trainer.train()                          # resume_from_checkpoint=... works too

``prepare`` converts the model with :func:`fxamp.convert` and builds the optimizer the Trainer
would have built (AdamW from ``args``: learning rate, betas, epsilon, weight decay except biases
and norms) inside a :class:`fxamp.MixedPrecisionOptimizer` (float32 masters, loss scaling), and
the Trainer's learning-rate schedule on it (``args.lr_scheduler_type``, warmup, ``max_steps``).

How the Trainer's loop meets fxamp's, without patching either:

* backward: the Trainer calls ``loss.backward()`` (through accelerate), not ``opt.backward``.
  ``prepare`` registers a forward hook on the converted module (in place: the model): in training,
  the returned ``loss`` keeps its value (the Trainer logs the true loss) but backpropagates
  through ``opt.scale_loss(loss)``, so gradients arrive scaled (float16) and the optimizer knows
  a backward happened.
* step: ``optimizer.step()`` unscales, checks for inf/NaN, steps the float32 masters or skips,
  and updates the scale; ``model.zero_grad()`` clears the model's gradients.  A skipped step holds the
  Trainer's schedule back (``TrainerOptimizer.step_was_skipped``, which accelerate reads).
* clipping: the Trainer clips ``model.parameters()``' gradients.  With bfloat16 (scale 1) these
  are the true gradients, so ``args.max_grad_norm`` works as usual.  With float16 they hold
  ``loss * scale`` gradients: ``prepare`` refuses ``args.max_grad_norm > 0`` and takes
  ``max_grad_norm=`` itself, clipping the float32 masters after unscaling (inside ``step()``).
* checkpoints: ``optimizer.state_dict()`` holds the inner optimizer's state, the masters and the
  loss scale, so ``trainer.train(resume_from_checkpoint=...)`` resumes exactly.  The Trainer saves
  a non-``PreTrainedModel``'s ``state_dict()`` with safetensors, which refuses tied weights, so
  the converted module's ``state_dict()`` copies tied entries (GPT-2's ``lm_head.weight``).
* losses: the captured graph takes exactly the batch's keys, so the Trainer does not pass
  ``num_items_in_batch``; the loss is the model's plain mean.  (For GPT-2 the Trainer's own path
  divides by the number of labels before the shift: ``(T-1)/T`` of the mean, 1.6% at T=64.
  Compare evaluation losses computed the same way.)

In place: ``prepare(model, args, "O2", dtype="bf16", in_place=True)`` converts with ``fxamp.convert_`` (a model
``convert_`` already converted is taken as it is) and returns ``model`` itself, with the same optimizers and loss
hook; the Trainer's own loss keeps its ``num_items_in_batch``.  Without ``prepare``, a ``MixedPrecisionOptimizer``
built by hand never sees the Trainer's ``loss.backward()``: its ``step()`` refuses, naming ``prepare``.  The
optimizer ``prepare`` returns (:class:`TrainerOptimizer`), like every ``MixedPrecisionOptimizer``, is a
``torch.optim.Optimizer``: ``optimizers=(opt, None)`` lets the Trainer build its own schedule on it.  A
``PreTrainedModel`` converted in place saves with its own ``save_pretrained`` (and so ``Trainer.save_model``): the
float32 weights (the masters once trained), and float32 in ``config.json``, where transformers would write the
dtype of the model's first parameter (bfloat16 under O2): under O2/O3 the model's class becomes a subclass of the
same name whose ``save_pretrained`` corrects it (``fxamp.conversion.blocks.converted_root_class``).
:func:`save_pretrained` is that call, kept for code written against it.

Limits:

* leave ``args.bf16``/``args.fp16`` False: they turn on autocast, which fxamp replaces;
* the Trainer logs ``grad_norm`` of the model's gradients: ``loss * scale`` ones in float16
  (``optimizer.last_grad_norm`` is the masters' true norm when ``prepare`` clips);
* Hugging Face models defeat torch.fx: without ``example_batch=`` the model is a
  ``fxamp.conversion.lazy.LazyConverted`` that captures with ``torch.export`` from the Trainer's first batch (and
  again for a batch with other keys, e.g. at evaluation without ``labels``); its parameters exist
  at once, so the optimizer is built here as usual.  Its class shows the original ``forward``'s
  signature, so the Trainer finds ``labels`` and ``evaluate()`` reports ``eval_loss``;
* ``Trainer(model=model, ...)`` without ``optimizers=`` would step the low-precision weights with
  the Trainer's own AdamW: a RuntimeWarning says so once (when the optimizer built here has not
  been stepped for more than ``gradient_accumulation_steps`` training forwards).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

import fxamp
from fxamp.training.config import LossScaleOption

from . import resolve_dtype

__all__ = ["prepare", "TrainerOptimizer", "save_pretrained"]


class TrainerOptimizer(fxamp.MixedPrecisionOptimizer):
    """A ``MixedPrecisionOptimizer`` whose ``step()`` can clip the float32 masters' gradients first.

    For loops that call ``loss.backward()`` and ``optimizer.step()`` themselves (``transformers.Trainer``):
    ``max_grad_norm`` clips after unscaling, which the loop's own clipping of the model's
    float16 gradients cannot do.

    Like every ``MixedPrecisionOptimizer`` it is a ``torch.optim.Optimizer`` whose ``param_groups`` are the inner
    optimizer's, so ``Trainer(optimizers=(opt, None))`` builds its own schedule on it, and it carries
    accelerate's mark of an optimizer already prepared, so accelerate hands it back as it is (``trainer.optimizer``
    and the callbacks' ``optimizer`` are this object) and reads its ``step_was_skipped``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: Optional[float] = None,
                 **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.max_grad_norm = max_grad_norm
        self._last_norm: Optional[torch.Tensor] = None

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The masters' gradient norm before the latest clip (None when not clipping).

        Kept as a tensor until read: reading a GPU tensor waits for the device, which step() must not.
        """
        return None if self._last_norm is None else float(self._last_norm)

    def step(self, closure: None = None) -> Any:
        if self.max_grad_norm and self.stage == "scaled":  # (segmented on a large model: no fp32 gradient buffer)
            self._last_norm = self.clip_grad_norm_(self.max_grad_norm)
        return super().step(closure)


class _GradThroughScaled(torch.autograd.Function):
    """Returns ``loss`` unchanged; its gradient goes to ``scaled`` (``loss * scale``) instead."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, grad


class _LossHook:
    """The forward hook ``prepare`` registers: in training, the returned loss keeps its value but backpropagates
    through ``opt.scale_loss(loss)``.

    A copy of the model (deepcopy, pickling: ``torch.save(model)``) gets an inert hook: ``opt`` steps the
    model's own parameters, not the copy's, and the optimizer does not pickle with the model."""

    def __init__(self, opt: Optional[fxamp.MixedPrecisionOptimizer], accumulation: int) -> None:
        self.opt = opt
        self.accumulation = accumulation
        # training forwards that found the loss of an earlier one still unstepped: more than the
        # Trainer's gradient accumulation means another optimizer steps the model (optimizers= forgotten)
        self.unstepped = 0

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        opt = self.opt
        if opt is None or not (module.training and torch.is_grad_enabled()):
            return output
        loss, put = _find_loss(output)
        if loss is None or not loss.requires_grad:
            return output
        self.unstepped = self.unstepped + 1 if opt.stage == "scaled" else 0
        if self.unstepped == self.accumulation:  # once: the count only grows from here
            warnings.warn(_FORGOTTEN, RuntimeWarning, stacklevel=2)
        return put(_GradThroughScaled.apply(loss, opt.scale_loss(loss)))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_LossHook":
        return _LossHook(None, self.accumulation)

    def __reduce__(self) -> Any:
        return _LossHook, (None, self.accumulation)


_FORGOTTEN = ("fxamp: the optimizer hf.prepare() built is not being stepped, so another optimizer updates the "
              "model's low-precision weights in place, without float32 masters or loss scaling; pass "
              "Trainer(..., optimizers=optimizers) with the (optimizer, scheduler) prepare() returned")


def _find_loss(output: Any) -> Tuple[Optional[torch.Tensor], Callable[[torch.Tensor], Any]]:
    """The loss in a model's output (``ModelOutput``/dict ``"loss"``, a tuple's first item, a scalar) and how to put it back."""
    if isinstance(output, torch.Tensor):
        return (output, lambda new: new) if output.dim() == 0 else (None, lambda new: output)
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            def put(new: torch.Tensor) -> Any:
                output["loss"] = new  # the output object is this call's own
                return output
            return loss, put
        return None, lambda new: output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        return output[0], lambda new: (new,) + tuple(output[1:])
    return None, lambda new: output


def _decay_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """The Trainer's grouping: weight decay on everything but biases and norm weights (by name)."""
    import re

    forbidden = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)|(?:^|\.)ln_")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if forbidden.search(name.lower()) or p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def prepare(
    model: nn.Module,
    args: Any,
    policy: Union[str, "fxamp.Policy"] = "O2",
    dtype: Union[str, torch.dtype] = "bf16",
    *,
    example_batch: Optional[Mapping[str, Any]] = None,
    optimizer: Optional[Callable[[List[Dict[str, Any]]], torch.optim.Optimizer]] = None,
    scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
    loss_scale: LossScaleOption = "auto",
    max_grad_norm: Optional[float] = None,
    num_training_steps: Optional[int] = None,
    compile_step: bool = False,
    masters: str = "fp32",
    state: str = "fp32",
    in_place: bool = False,
    **convert_kwargs: Any,
) -> Tuple[nn.Module, Tuple[TrainerOptimizer, Any]]:
    """Convert ``model`` and build ``(optimizer, scheduler)`` for ``Trainer(model=..., optimizers=...)``.

    args:           the ``TrainingArguments`` the Trainer gets (learning rate, AdamW settings,
                    schedule, ``max_steps``); ``bf16``/``fp16`` must stay False.
    example_batch:  a collated batch (``input_ids``, ``labels``...) to capture with ``torch.export``
                    now; without it a model torch.fx cannot trace captures at its first call.
    optimizer:      ``param_groups -> torch optimizer``; default AdamW from ``args``.
    scheduler:      ``optimizer -> LR scheduler``, given the wrapper (a ``torch.optim.Optimizer``); default
                    ``transformers.get_scheduler`` from ``args``, on the wrapper too.
    loss_scale:     as :class:`fxamp.MixedPrecisionOptimizer`'s (``"auto"``, ``"dynamic"``, ``"none"``,
                    ``"static:<scale>"`` or a number, a ``LossScaleConfig`` or a shared ``LossScaler``).
    max_grad_norm:  clip the float32 masters inside ``step()``; required instead of
                    ``args.max_grad_norm`` for float16.
    compile_step:   step the float32 masters with compiled kernels, 16 masters a call, on models
                    large enough for them to pay (:class:`fxamp.MixedPrecisionOptimizer`'s
                    ``compile_step``; AdamW, Adam, SGD).
    masters, state: per-tensor precision of the masters and the optimizer state, as
                    :class:`fxamp.MixedPrecisionOptimizer`'s (``"auto"``, ``"kahan"``, ``"int8"``...).
    in_place:       convert with :func:`fxamp.convert_` (block by block: ``model`` itself is returned, still a
                    ``PreTrainedModel``, which the Trainer saves with ``save_pretrained``); a model already
                    converted in place is taken as it is (then ``convert_kwargs`` must be empty).
    convert_kwargs: passed on to :func:`fxamp.convert` (or ``fxamp.convert_``).
    """
    if isinstance(args, Mapping) or not hasattr(args, "learning_rate"):
        raise TypeError(f"hf.prepare() takes the transformers.TrainingArguments the Trainer gets, not "
                        f"{type(args).__name__}: prepare(model, TrainingArguments(output_dir=..., ...), ...)")
    low = resolve_dtype(dtype)
    lean = fxamp.LeanConfig(masters, state)  # (a bad mode raises before the model is converted)
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        raise ValueError("TrainingArguments(bf16=True/fp16=True) turns on torch.autocast, which fxamp replaces; "
                         "leave both False and pass dtype= to prepare()")
    trainer_clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
    if low == torch.float16 and trainer_clip > 0:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={trainer_clip:g}) would clip the model's loss-scaled float16 "
            f"gradients; set max_grad_norm=0 there and pass prepare(..., max_grad_norm={trainer_clip:g}), which "
            f"clips the float32 masters after unscaling")
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be True or False, not {in_place!r}")
    in_place = in_place or _converted_in_place(model, low, convert_kwargs)
    if in_place:
        if example_batch is not None:
            raise ValueError("prepare(in_place=True) takes no example_batch=: a model converted in place captures "
                             "each block family at its first call; drop it")
        amp = model if fxamp.conversion_info(model) is not None else fxamp.convert_(model, policy, dtype=low,
                                                                                     **convert_kwargs)
    else:
        if example_batch is not None:
            convert_kwargs.setdefault("example_inputs", ())
            convert_kwargs.setdefault("example_kwargs", dict(example_batch))
        # without example_batch, a model torch.fx cannot trace captures at its first call; convert's own
        # TraceError (leaf_modules=, frontend="fx") already says what to do
        amp = fxamp.convert(model, policy, dtype=low, **convert_kwargs)
        amp.accepts_loss_kwargs = False  # the captured graph takes exactly the batch's keys (no num_items_in_batch)

    groups = _decay_groups(amp, float(getattr(args, "weight_decay", 0.0)))
    if optimizer is None:
        inner = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon)
    else:
        inner = optimizer(groups)
    opt = TrainerOptimizer(inner, max_grad_norm=max_grad_norm, loss_scale=loss_scale, model=amp,
                           compile_step=compile_step, precision=lean)
    if scheduler is not None:
        sched = scheduler(opt)
    else:
        from transformers import get_scheduler

        steps = num_training_steps if num_training_steps is not None else int(getattr(args, "max_steps", -1))
        if steps is None or steps <= 0:
            raise ValueError("prepare() builds the learning-rate schedule before the Trainer knows the number of steps: "
                             "set TrainingArguments(max_steps=...) or pass num_training_steps= (or scheduler=)")
        sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(steps),
                              num_training_steps=steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    amp.register_forward_hook(_LossHook(opt, max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))))
    tied = [] if in_place else _tied_aliases(amp)  # (in place: save_pretrained handles tied weights itself)
    if tied:
        amp.register_state_dict_post_hook(_Untie(tied))
    return amp, (opt, sched)


#: ``ConversionInfo.frontend`` of a model ``fxamp.convert_`` converted (``fxamp.conversion.blocks``)
_IN_PLACE = "blocks"


def _converted_in_place(model: nn.Module, low: torch.dtype, convert_kwargs: Mapping[str, Any]
                        ) -> bool:
    """Whether ``model`` is already converted in place: ``prepare`` then takes it as it is, if nothing asks for
    another conversion (a dtype it was not converted to, conversion options)."""
    info = fxamp.conversion_info(model)
    if info is None or info.frontend != _IN_PLACE:
        return False
    if info.policy.compute != low:
        raise ValueError(f"prepare(dtype={str(low)[6:]}) of a model fxamp.convert_ converted to "
                         f"{str(info.policy.compute)[6:]}: pass dtype={str(info.policy.compute)[6:]!r}, or "
                         f"prepare the unconverted model")
    if convert_kwargs:
        raise ValueError(f"prepare() of a model already converted in place takes no conversion options "
                         f"({', '.join(sorted(convert_kwargs))}): pass them to fxamp.convert_, or prepare the "
                         f"unconverted model with in_place=True")
    return True


def _tied_aliases(model: nn.Module) -> List[str]:
    """Names of parameters that repeat an earlier one (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)."""
    seen, aliases = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.append(name)
        seen.add(id(p))
    return aliases


class _Untie:
    """A state_dict hook that copies tied entries of ``state_dict()``: the Trainer saves a non-``PreTrainedModel``
    with safetensors, which refuses tensors sharing memory.  Loading writes the same values into the one parameter
    twice.  (A class, not a closure: the model still pickles.)"""

    def __init__(self, aliases: List[str]) -> None:
        self.aliases = aliases

    def __call__(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in self.aliases:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):  # keep_vars=True: leave it
                state_dict[prefix + name] = value.clone()


def save_pretrained(model: nn.Module, save_directory: Any, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` for a model converted in place (``fxamp.convert_``),
    with ``config.json``'s ``dtype`` that of the weights it wrote (float32), so ``from_pretrained`` gives the
    float32 model back.  The model's own ``save_pretrained`` does the same since ``convert_`` gives an O2/O3
    model's root a subclass that corrects ``config.json``; this call checks it again.

    transformers records ``model.dtype``, the dtype of the model's first floating parameter: under O2 that
    is its bfloat16 storage (an embedding), while the weights written are float32 (the masters, or the
    originals before training: the converted model's ``state_dict``), and ``from_pretrained``'s default
    ``dtype="auto"`` would load them rounded to bfloat16.  ``push_to_hub=True`` is refused: upload the
    folder after saving."""
    if kwargs.get("push_to_hub"):
        raise ValueError("fxamp.integrations.hf.save_pretrained(push_to_hub=True) would upload config.json before "
                         "its dtype is corrected: save, then upload the folder (huggingface_hub.upload_folder)")
    model.save_pretrained(save_directory, **kwargs)
    state = kwargs.get("state_dict")
    saved = next((v.dtype for v in (model.state_dict() if state is None else state).values()
                  if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    name = str(saved).removeprefix("torch.")
    if saved is not None and str(model.config.dtype).removeprefix("torch.") != name:
        model.config.dtype = name  # (as transformers itself writes it)
        if kwargs.get("is_main_process", True):
            model.config.save_pretrained(save_directory)
