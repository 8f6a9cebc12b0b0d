"""Invariants every conversion path meets on every real model (issue 37, "the defence, not only the fixes").

Paths (:data:`PATHS`): ``fx`` (``convert(frontend="fx")``), ``export`` (``convert(frontend="export")`` with
the example inputs), ``lazy`` (``convert(frontend="export")`` without them: a ``LazyConverted``),
``in-place`` (``convert_``) and ``shard`` (``convert_`` O1 then ``fxamp.shard`` in a world of one process:
O0/O1 only, so its cases run O1).  A path that cannot take a model says so (NotApplicable: torch.fx cannot
trace it, no blocks), except where the model is written to be taken (``Entry.sequential_blocks``).

Checks, each a ``check_*`` with the signature of ``rm_checks``' ones:

- ``eval-buffers/<path>``: calls in eval mode under ``no_grad`` change no buffer, bitwise (after conversion
  from an eval-mode model, and again after ``train()`` then ``eval()``);
- ``eval-after-step/<path>``: one MixedPrecisionOptimizer step in train mode, then in eval mode the output's
  SQNR against float32 is at most 3 dB below torch.autocast's.  The float32 reference is the model as that
  step left it: the stepped weights (the masters, float32 already) and the running statistics of the same
  train-mode call run in float32.  So the check sees eval honoured after training, running statistics
  updated as float32's are, and the low-precision weights refreshed from the masters (an Adam step moves
  every weight by about lr = 3e-3, far more than bfloat16's rounding of these weights);
- ``layout/<mode>``: the optimizer mode (float32 masters; ``masters="kahan"``; ``"stochastic"`` with
  int8 state; ``"auto"``) trains the model with its weights stored channels_last (4-D) and transposed (2-D)
  exactly as with the same values stored contiguous: bitwise wherever float32 masters are bitwise there
  (else as close as float32 masters are);
- ``roundtrip/<kind>/<path>``: the user's float32 weights come back bitwise (before training: the
  original's; after a step: the masters) through ``fp32_state_dict`` into the unconverted model,
  ``torch.save``/``torch.load`` (of the converted model's ``state_dict``, with the optimizer's), Hugging
  Face ``save_pretrained``/``from_pretrained`` (in place; float32 weights and a float32 config) and
  ``torch.distributed.checkpoint`` (single process: the model and optimizer as DCP Stateful objects,
  resumed into fresh ones; one step after resuming is bitwise the uninterrupted run's).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import os
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

import fxamp
from export_helpers import main_output
from rm_checks import (AUTOCAST_MARGIN_DB, TRAIN_LR, NotApplicable, call_model, convert, draws_for, loss_of,
                       pooled_sqnr)
from rm_models import Entry, build

PATHS = ("fx", "export", "lazy", "in-place", "shard")

#: the policy of each path's cases: O2 where the weights are stored low (what the invariants guard),
#: O1 for shard (fxamp.shard takes O0/O1)
PATH_POLICY = {"fx": "O2", "export": "O2", "lazy": "O2", "in-place": "O2", "shard": "O1"}


# --------------------------------------------------------------------------- paths


def convert_by(entry: Entry, model: nn.Module, path: str, policy: str, dtype: torch.dtype) -> nn.Module:
    """``model`` converted along ``path`` (``model`` itself unchanged, but O1 shares its parameters)."""
    if path in ("in-place", "shard"):
        amp = convert(entry, model, policy, dtype, in_place=True)
        if path == "in-place":
            return amp
        try:
            return fxamp.shard(amp)
        except (ValueError, NotImplementedError) as exc:  # torch's own refusal (CLIP's logit_scale, channels_last)
            if ("fully_shard doesn't support scalar parameters" in str(exc)
                    or "FSDP does not support non-contiguous parameters" in str(exc)):
                raise NotApplicable(f"FSDP2 refuses it: {str(exc).splitlines()[0][:160]}") from exc
            raise
    options = dict(entry.convert_kwargs)
    if path == "fx":
        try:
            return fxamp.convert(model, policy, dtype=dtype, frontend="fx", **options)
        except fxamp.TraceError as exc:
            raise NotApplicable(f"torch.fx: {str(exc).splitlines()[0][:160]}") from exc
    if path == "export":
        args, kwargs = entry.inputs(0)
        return fxamp.convert(model, policy, dtype=dtype, frontend="export", example_inputs=args,
                             example_kwargs=kwargs, **options)
    if path == "lazy":
        return fxamp.convert(model, policy, dtype=dtype, frontend="export", **options)
    raise ValueError(f"unknown path {path!r}; valid: {PATHS}")


@contextlib.contextmanager
def world_for(path: str):
    """A gloo process group of one process around a ``shard`` case (FSDP2 needs one); nothing otherwise."""
    if path != "shard":
        yield
        return
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        raise NotApplicable("torch.distributed with gloo is not available")
    if dist.is_initialized():
        raise NotApplicable("a process group exists already in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s values (a DTensor of fxamp.shard's world of one: its whole value)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _buffers(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: _local(b).clone() for name, b in module.named_buffers()}


# --------------------------------------------------------------------------- (a) eval changes no buffer


def check_eval_buffers(entry: Entry, path: str, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """Eval calls under ``no_grad`` change no buffer, bitwise: converted from an eval-mode model, and again
    after ``train()`` then ``eval()`` on the converted model."""
    with world_for(path):
        amp = convert_by(entry, build(entry).eval(), path, policy, dtype)
        for when in ("converted in eval mode", "after train() then eval()"):
            if when.startswith("after"):
                amp.train()
            amp.eval()
            before = _buffers(amp)
            with torch.no_grad():
                for seed in (1, 2):
                    call_model(amp, entry.inputs(seed))
            after = _buffers(amp)
            changed = [n for n in before if n not in after or not torch.equal(before[n], after[n])]
            assert not changed, f"{path}: eval calls under no_grad changed buffers ({when}): {changed[:4]}"
    return {"buffers": len(before)}


# --------------------------------------------------------------------------- (b) eval after a train step


def eval_sqnr(entry: Entry, ref: nn.Module, amp: nn.Module, dtype: torch.dtype) -> Tuple[float, Optional[float]]:
    """(SQNR of ``amp``, SQNR of torch.autocast on ``ref``) against ``ref`` in eval mode, pooled over draws
    (autocast's None where it fails on this CPU)."""
    refs, outs, autos, auto_ok = [], [], [], True
    draws, seed = 1, 1
    while seed <= draws:
        inputs = entry.inputs(seed)
        with torch.no_grad():
            r = main_output(call_model(ref, inputs)).float()
            o = main_output(call_model(amp, inputs)).float()
            if auto_ok:
                try:
                    with torch.autocast("cpu", dtype=dtype):
                        autos.append(main_output(call_model(ref, inputs)).float())
                except RuntimeError:
                    auto_ok = False
        draws = draws_for(r.numel()) if seed == 1 else draws
        assert o.shape == r.shape and torch.isfinite(o).all(), f"output {tuple(o.shape)}, finite: {torch.isfinite(o).all()}"
        refs.append(r)
        outs.append(o)
        seed += 1
    return pooled_sqnr(refs, outs), (pooled_sqnr(refs, autos) if auto_ok else None)


def _masters_by_name(amp: nn.Module, opt: fxamp.MixedPrecisionOptimizer) -> Dict[str, torch.Tensor]:
    """Every parameter's float32 value by name (tied names each): its master, or itself where it has none."""
    master = {id(low): m for low, m in opt.master_pairs()}
    return {name: _local(master.get(id(p), p)).float() for name, p in amp.named_parameters(remove_duplicate=False)}


def check_eval_after_step(entry: Entry, path: str, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """One training step in train mode, then eval: SQNR within 3 dB of autocast's against the float32 model
    as that step left it (see the module)."""
    ref = build(entry)
    user = copy.deepcopy(ref).eval()  # the user's model: convert's masters start from its float32 weights
    with world_for(path):
        amp = convert_by(entry, user, path, policy, dtype)
        ref.train()
        amp.train()
        inputs = entry.inputs(2)
        with torch.no_grad():
            call_model(ref, inputs)  # float32's running statistics, from the same train-mode call
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=TRAIN_LR), model=amp)
        opt.zero_grad()
        opt.backward(loss_of(call_model(amp, inputs)))
        assert opt.step() is not False, "the step was skipped"
        values = _masters_by_name(amp, opt)
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        missing = sorted(set(ref_params) - set(values))
        assert not missing, f"parameters of the original not in the converted model: {missing[:4]}"
        with torch.no_grad():
            for name, p in ref_params.items():
                p.copy_(values[name])
        ref.eval()
        amp.eval()
        db, db_auto = eval_sqnr(entry, ref, amp, dtype)
    if db_auto is not None:
        assert db >= db_auto - AUTOCAST_MARGIN_DB, (
            f"{path}: after a train-mode step, eval SQNR {db:.1f} dB is more than {AUTOCAST_MARGIN_DB} dB below "
            f"torch.autocast's {db_auto:.1f} dB")
    else:
        assert db >= 25, f"{path}: after a train-mode step, eval SQNR {db:.1f} dB (autocast fails here)"
    return {"sqnr": db, "sqnr_autocast": db_auto}


# --------------------------------------------------------------------------- (c) optimizer modes and layouts

#: MixedPrecisionOptimizer keywords of each mode; "auto" decides after 2 float32 steps, even for small tensors
MODES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "fp32": lambda: {},
    "kahan": lambda: {"masters": "kahan"},
    "stochastic-int8": lambda: {"masters": "stochastic", "state": "int8"},
    "auto": lambda: {"precision": fxamp.LeanConfig("auto", "auto", calibration_steps=2, small=0)},
}
LAYOUT_STEPS = 5
#: float32 masters, strided vs contiguous, where not bitwise: the largest loss difference (relative), from the
#: kernels alone (a channels_last bfloat16 conv sums in another order: 1e-3 on bn-act's 5 steps)
FP32_LAYOUT_TOL = 5e-3


def strided(model: nn.Module) -> int:
    """Store every 4-D parameter channels_last and every 2-D one transposed (same values); how many changed."""
    changed = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
            elif p.dim() == 2 and min(p.shape) > 1:
                p.data = p.data.t().contiguous().t()
            else:
                continue
            changed += 1
    return changed


def _train_layout(entry: Entry, mode: str, layout: str) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    model = build(entry)
    if layout == "strided" and not strided(model):
        raise NotApplicable("no 2-D or 4-D parameter to store otherwise")
    amp = convert(entry, model.eval(), "O2", torch.bfloat16)
    amp.train()
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=TRAIN_LR), model=amp, seed=0,
                                        **MODES[mode]())
    inputs = entry.inputs(2)
    losses = []
    for _ in range(LAYOUT_STEPS):
        opt.zero_grad()
        loss = loss_of(call_model(amp, inputs))
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().float().contiguous().clone() for k, v in opt.fp32_state_dict().items()
                    if isinstance(v, torch.Tensor) and v.is_floating_point()}


@functools.lru_cache(maxsize=4)
def _fp32_layouts(name: str) -> Tuple[float, bool]:
    """(largest relative loss difference, weights bitwise) of float32 masters, contiguous vs strided."""
    from rm_models import REGISTRY
    entry = REGISTRY[name]
    (la, wa), (lb, wb) = (_train_layout(entry, "fp32", layout) for layout in ("contiguous", "strided"))
    return _loss_dev(la, lb), la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)


def _loss_dev(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) / max(abs(v) for v in a)


def check_layout(entry: Entry, mode: str, policy: str = "O2", dtype: torch.dtype = torch.bfloat16) -> Dict[str, Any]:
    """``mode`` trains the strided copy as it trains the contiguous model (see the module)."""
    fp32_dev, fp32_bitwise = _fp32_layouts(entry.name)
    if mode == "fp32":  # float32 masters step by value: only the kernels' order (a channels_last conv) may differ
        assert fp32_bitwise or fp32_dev <= FP32_LAYOUT_TOL, (
            f"float32 masters: loss differs by {fp32_dev:.3g} of its largest between layouts")
        return {"layout_dev": fp32_dev, "fp32_bitwise": fp32_bitwise}
    la, wa = _train_layout(entry, mode, "contiguous")
    lb, wb = _train_layout(entry, mode, "strided")
    assert all(math.isfinite(v) for v in la + lb), f"non-finite losses {la} / {lb}"
    dev = _loss_dev(la, lb)
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    summary = f"losses {la} contiguous vs {lb} strided"
    if fp32_bitwise:
        assert dev == 0 and not differ, (
            f"{mode}: training differs with channels_last/transposed weights where float32 masters are bitwise "
            f"the same (loss dev {dev:.3g}, weights differ: {differ[:3]}): {summary}")
    else:
        # float32 masters already step other weights (a channels_last conv's backward sums in another order; its
        # losses may still print equal): 8-bit state and stochastic rounding move such ulp differences by a step's
        # quantum, so the floor is the size of one (conv-bn-relu: 1.7e-4 after 5 steps); how far a realisation of the
        # stochastic stream carries them is chance: bn-act-layout's stochastic-int8 measured 2.3x float32's
        # (2026-11-29, the hashed stream). Equal gradients give bitwise equal steps in every layout
        # (tests/training/test_lean.py::test_every_mode_steps_channels_last_and_transposed_weights_by_their_values)
        assert dev <= max(3 * fp32_dev, 1e-3), (
            f"{mode}: loss differs by {dev:.3g} of its largest between layouts, float32 masters by {fp32_dev:.3g}: "
            f"{summary}")
    return {"layout_dev": dev, "fp32_bitwise": fp32_bitwise}


# --------------------------------------------------------------------------- (d) round trips

ROUNDTRIPS = ("fp32_state_dict", "torch.save", "save_pretrained", "dcp")


def _float_state(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return {k: _local(v) for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str,
          whose: str = "the user's float32 weights") -> None:
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: keys missing {missing[:4]}"
    wrong_dtype = [(k, str(got[k].dtype)) for k in want if got[k].dtype != want[k].dtype]
    assert not wrong_dtype, f"{what}: dtypes changed {wrong_dtype[:3]} (want {next(iter(want.values())).dtype})"
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    if differ:
        k = differ[0]
        rel = ((got[k].double() - want[k].double()).norm() / want[k].double().norm().clamp_min(1e-30)).item()
        raise AssertionError(f"{what}: {len(differ)} of {len(want)} tensors differ from {whose}, "
                             f"e.g. {k} (relative {rel:.3g}): {differ[:4]}")


def _fresh(entry: Entry, path: str) -> Tuple[nn.Module, fxamp.MixedPrecisionOptimizer]:
    """A converted model of other weights (seed 1) and its optimizer: where a checkpoint is loaded."""
    amp = convert_by(entry, build(entry, seed=1).eval(), path, "O2", torch.bfloat16)
    return amp, fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=TRAIN_LR), model=amp)



def _step(amp: nn.Module, opt: fxamp.MixedPrecisionOptimizer, inputs) -> float:
    amp.train()
    opt.zero_grad()
    loss = loss_of(call_model(amp, inputs))
    opt.backward(loss)
    opt.step()
    return loss.item()


def _through(kind: str, entry: Entry, path: str, amp: nn.Module, opt: fxamp.MixedPrecisionOptimizer,
             where: str) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Optional[Tuple[nn.Module, Any]]]:
    """What the user gets back through ``kind``: float32 weights by what they went through (each must be the
    user's), and the resumed model and optimizer where a checkpoint resumes training."""
    if kind == "fp32_state_dict":
        plain = build(entry, seed=1)
        plain.load_state_dict(opt.fp32_state_dict())
        return {"fp32_state_dict into the unconverted model": _float_state(plain.state_dict())}, None
    if kind == "torch.save":
        buf = io.BytesIO()
        torch.save({"model": amp.state_dict(), "optimizer": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        amp2, opt2 = _fresh(entry, path)
        amp2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optimizer"])
        got = {"torch.load into a fresh converted model and optimizer: fp32_state_dict":
               _float_state(opt2.fp32_state_dict())}
        if path == "in-place":  # its state_dict is documented float32: the unconverted model takes it as it is
            plain = build(entry, seed=1)
            plain.load_state_dict(saved["model"])
            got["the in-place model's state_dict, torch.load into the unconverted model"] = (
                _float_state(plain.state_dict()))
        return got, (amp2, opt2)
    if kind == "save_pretrained":
        from fxamp.integrations import hf
        # the model's own call (Trainer.save_model's) and fxamp's: float32 in config.json both, where transformers
        # would write the first parameter's dtype (a bfloat16 one under O2), so the default from_pretrained
        # (dtype="auto", the config's) gives float32 back
        plain = os.path.join(where, "plain")
        amp.save_pretrained(plain)
        hf.save_pretrained(amp, where)
        for folder in (plain, where):
            with open(os.path.join(folder, "config.json")) as f:
                config = json.load(f)
            saved_dtype = config.get("dtype", config.get("torch_dtype"))
            assert saved_dtype in (None, "float32"), f"save_pretrained wrote dtype {saved_dtype!r} in {folder}"
        loaded = type(amp).from_pretrained(where)  # convert_ keeps the model's class (a same-named subclass under O2)
        loaded_plain = type(amp).from_pretrained(plain)
        return {"fxamp.integrations.hf.save_pretrained, from_pretrained": _float_state(loaded.state_dict()),
                "model.save_pretrained, from_pretrained": _float_state(loaded_plain.state_dict())}, None
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp
        try:
            with warnings.catch_warnings():  # one process without a process group: what this check means
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save({"model": amp, "optim": opt}, checkpoint_id=where)
                amp2, opt2 = _fresh(entry, path)
                dcp.load({"model": amp2, "optim": opt2}, checkpoint_id=where)
        except Exception as exc:  # a refusal in one line pointing to fxamp's own DCP route is a fine answer
            if "sharded_state_dict" in str(exc):
                raise NotApplicable(f"refused: {str(exc).splitlines()[0][:160]}") from exc
            raise
        return {"dcp.load into a fresh converted model and optimizer: fp32_state_dict":
                _float_state(opt2.fp32_state_dict())}, (amp2, opt2)
    raise ValueError(f"unknown round trip {kind!r}; valid: {ROUNDTRIPS}")


def check_roundtrip(entry: Entry, kind: str, path: str, policy: str = "O2",
                    dtype: torch.dtype = torch.bfloat16) -> Dict[str, Any]:
    """The user's float32 weights come back bitwise through ``kind``, before and after a step (see the module)."""
    model = build(entry).eval()  # the user's model, kept: convert's masters start from its float32 weights
    if kind == "save_pretrained" and (path != "in-place" or not hasattr(model, "save_pretrained")):
        raise NotApplicable("save_pretrained: Hugging Face models converted in place only")
    user = {k: v.clone() for k, v in _float_state(model.state_dict()).items()}
    amp = convert_by(entry, model, path, policy, dtype)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=TRAIN_LR), model=amp)
    inputs = entry.inputs(2)
    with tempfile.TemporaryDirectory() as tmp:
        for what, got in _through(kind, entry, path, amp, opt, os.path.join(tmp, "untrained"))[0].items():
            _same(got, user, f"{path}, before training: {what}")
        _step(amp, opt, inputs)
        want = dict(user)  # buffers: as the train-mode call left them in the converted model
        params = dict(model.named_parameters(remove_duplicate=False))
        want.update({k: v.to(want[k].dtype) for k, v in _float_state(amp.state_dict()).items()
                     if k in want and k not in params})
        want.update({k: v for k, v in _masters_by_name(amp, opt).items() if k in want})
        gots, resumed = _through(kind, entry, path, amp, opt, os.path.join(tmp, "trained"))
        for what, got in gots.items():
            _same(got, want, f"{path}, after a step (the masters): {what}")
        if resumed is not None:  # one more step from the checkpoint is the uninterrupted run's step
            amp2, opt2 = resumed
            a, b = _step(amp, opt, inputs), _step(amp2, opt2, inputs)
            assert a == b, f"{kind} ({path}): the resumed run's next loss {b!r} != the uninterrupted run's {a!r}"
            _same(_float_state(opt2.fp32_state_dict()), _float_state(opt.fp32_state_dict()),
                  f"{kind} ({path}): one step after resuming", "the uninterrupted run's")
    return {"tensors": len(user)}


# --------------------------------------------------------------------------- registry


def checks() -> Dict[str, Callable[..., Dict[str, Any]]]:
    """Every invariant check by name, each called as ``fn(entry, policy, dtype)``."""
    out: Dict[str, Callable[..., Dict[str, Any]]] = {}
    for path in PATHS:
        out[f"eval-buffers/{path}"] = functools.partial(check_eval_buffers_at, path)
        out[f"eval-after-step/{path}"] = functools.partial(check_eval_after_step_at, path)
    for mode in MODES:
        out[f"layout/{mode}"] = functools.partial(check_layout_at, mode)
    for kind in ROUNDTRIPS:
        for path in (("in-place",) if kind == "save_pretrained" else ("export", "in-place")):
            out[f"roundtrip/{kind}/{path}"] = functools.partial(check_roundtrip_at, kind, path)
    return out


@contextlib.contextmanager
def _export_limits(path: str):
    """torch.export's refusal of a model (a packed sequence) on the paths that use it: n/a, not a failure."""
    try:
        yield
    except fxamp.TraceError as exc:
        if path in ("export", "lazy") and str(exc).startswith("torch.export could not capture"):
            raise NotApplicable(f"torch.export: {str(exc).splitlines()[0][:160]}") from exc
        raise


def check_eval_buffers_at(path, entry, policy, dtype):
    with _export_limits(path):
        return check_eval_buffers(entry, path, policy, dtype)


def check_eval_after_step_at(path, entry, policy, dtype):
    with _export_limits(path):
        return check_eval_after_step(entry, path, policy, dtype)


def check_layout_at(mode, entry, policy, dtype):
    return check_layout(entry, mode, policy, dtype)


def check_roundtrip_at(kind, path, entry, policy, dtype):
    with _export_limits(path):
        return check_roundtrip(entry, kind, path, policy, dtype)


def cases(entry: Entry) -> List[Tuple[str, str, str]]:
    """(check, policy, dtype) of the invariants for one model (bfloat16; each path's policy)."""
    out = []
    for name in checks():
        path = name.rsplit("/", 1)[1]
        policy = PATH_POLICY.get(path, "O2")
        if name.startswith("roundtrip/save_pretrained") and entry.needs != "transformers":
            continue
        out.append((name, policy, "bfloat16"))
    return out
