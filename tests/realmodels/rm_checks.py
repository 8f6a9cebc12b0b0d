"""The checks every real model goes through, shared by the tests and ``coverage_table.py``.

Each ``check_*`` raises ``AssertionError`` (or whatever fxamp raised) on failure and returns a dict
of what it measured.  SQNR is ``20·log10(‖ref‖/‖ref − out‖)`` of the main output (``logits``, else
the first floating leaf) against the float32 original, in eval mode, pooled over enough input
draws to compare at least ``MIN_COMPARED`` values.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import sys
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import fxamp  # noqa: E402
from export_helpers import MIN_SQNR, float_leaves, main_output, sqnr  # noqa: E402
from rm_models import Entry, build  # noqa: E402

#: fxamp may be at most this many dB below torch.autocast's SQNR on the same model and inputs
AUTOCAST_MARGIN_DB = 3.0
#: the numerics check compares at least this many output values (pooled over input draws) ...
MIN_COMPARED = 256
#: ... but draws at most this many inputs
MAX_DRAWS = 64
#: training: |loss_fxamp − loss_fp32| at every step, relative to float32's largest loss
TRAIN_TOL = {torch.bfloat16: 0.05, torch.float16: 0.02}
TRAIN_STEPS = 4
TRAIN_LR = 3e-3


class NotApplicable(Exception):
    """The check cannot apply to this model (the tests skip, the coverage table says n/a)."""


#: the keywords of fxamp.convert that fxamp.convert_ takes too
_IN_PLACE_KWARGS = ("keep_norms_fp32", "overrides", "module_overrides", "op_lists", "weight_cache", "recompute_islands")


def convert(entry: Entry, model: nn.Module, policy: str, dtype: torch.dtype, *, in_place: bool = False,
            **extra: Any) -> nn.Module:
    """``fxamp.convert`` with the entry's inputs and options; ``in_place``: ``fxamp.convert_`` of a copy (the
    checks keep ``model`` as the float32 reference), NotApplicable for a model without blocks (a failure for
    one whose blocks sit in nn.Sequentials: ``Entry.sequential_blocks``)."""
    if in_place:
        options = {k: v for k, v in {**entry.convert_kwargs, **extra}.items() if k in _IN_PLACE_KWARGS}
        copied = copy.deepcopy(model)
        try:
            return fxamp.convert_(copied, policy, dtype=dtype, **options)
        except ValueError as exc:
            if "no blocks" in str(exc) or "found no blocks" in str(exc):
                if entry.sequential_blocks:  # written to be taken: its repeated layers sit in nn.Sequentials
                    raise AssertionError(f"convert_ found no blocks, but {entry.name} repeats its layers in "
                                         f"nn.Sequentials (issue 37 item 11): {exc}") from exc
                raise NotApplicable(f"in place: {exc}") from exc
            raise
    args, kwargs = entry.inputs(0)
    return fxamp.convert(model, policy, dtype=dtype, example_inputs=args, example_kwargs=kwargs,
                         frontend=entry.frontend, **{**entry.convert_kwargs, **extra})


def call_model(model: nn.Module, inputs) -> Any:
    args, kwargs = inputs
    return model(*args, **kwargs)


def _leaves_equal(a: Any, b: Any) -> List[str]:
    """Names (leaf indices) of floating leaves that differ bitwise; structure mismatches too."""
    la, lb = float_leaves(a), float_leaves(b)
    if len(la) != len(lb):
        return [f"{len(la)} floating outputs vs {len(lb)}"]
    bad = []
    for i, (x, y) in enumerate(zip(la, lb)):
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append(f"leaf {i}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            bad.append(f"leaf {i}: max |diff| {diff:.3g}")
    return bad


def check_o0(entry: Entry) -> Dict[str, Any]:
    """O0 is bitwise equal to the original, in eval mode and in train mode (every dropout is off)."""
    model = build(entry).eval()
    amp = convert(entry, model, "O0", torch.float16)
    assert set(amp.state_dict()) == set(model.state_dict()), "O0: state_dict keys changed"
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(amp, mode)()
        inputs = entry.inputs(1)
        # (O0 shares the model's buffers: a training call that updates one, spectral norm's power iteration, must
        # leave the converted module's call the values the original's call read)
        buffers = [(b, b.clone()) for b in model.buffers()]
        with torch.no_grad():
            ref = call_model(model, inputs)
            for b, was in buffers:
                b.copy_(was)
            out = call_model(amp, inputs)
        bad = _leaves_equal(ref, out)
        assert not bad, f"O0 not bitwise equal to the original in {mode} mode: {bad[:3]}"
    return {}


def pooled_sqnr(refs: List[torch.Tensor], outs: List[torch.Tensor]) -> float:
    """SQNR with signal and noise energies summed over several draws (float64)."""
    signal = sum(r.double().pow(2).sum().item() for r in refs)
    noise = sum((o.double() - r.double()).pow(2).sum().item() for r, o in zip(refs, outs))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def draws_for(numel: int) -> int:
    """How many input draws give at least ``MIN_COMPARED`` compared values (at most ``MAX_DRAWS``)."""
    return max(1, min(MAX_DRAWS, math.ceil(MIN_COMPARED / max(numel, 1))))


def check_in_place_numerics(entry: Entry, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """:func:`check_numerics` of the model converted in place, block by block (``fxamp.convert_``)."""
    return check_numerics(entry, policy, dtype, in_place=True)


def check_in_place_training(entry: Entry, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """:func:`check_training` of the model converted in place (masters: the float32 originals themselves)."""
    return check_training(entry, policy, dtype, in_place=True)


def check_in_place_rows(entry: Entry, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """In place, every block and glue module computes its ops in the dtypes whole-model conversion gives
    the same module: the aten ops that decide a precision (matmuls, attention, norms, softmax,
    reductions, exp/log/pow, embeddings, convolutions, activations), with the same input and output
    dtypes, as many times, recorded at run time on the same inputs and attributed to the module that
    ran them (a multiset per module: torch.export may order independent ops differently). Outside blocks
    and glue modules, ops run as written, on float32 (no 16-bit input): what convert_ states. A glue module
    whose tensors code around it reads directly (CLIP's ``interpolate_pos_encoding``) keeps them float32
    (``blocks.read_around``): not compared, whole-model conversion sees those readers in its graph."""
    from fxamp.conversion.blocks import converted_modules, family_of, read_around
    model = build(entry).eval()
    inputs = entry.inputs(1)
    blocks = convert(entry, model, policy, dtype, in_place=True)
    whole = convert(entry, model, policy, dtype)
    with torch.no_grad():
        call_model(blocks, inputs)
        call_model(whole, inputs)  # captured: the recorded calls run the graphs only
        units = [path for path, _ in converted_modules(blocks)]
        kept = {n.rpartition(".")[0] for n in read_around(
            blocks, [p for p, m in converted_modules(blocks) if family_of(m).glue])} if policy != "O1" else set()
        with _ByModule(_hooked_path(blocks, units)) as got:
            call_model(blocks, inputs)
        node_module = {r.node: r.module for r in fxamp.report(whole).rows if r.is_op}
        with _ByModule(_graph_line_module(node_module)) as expected:
            call_model(whole, inputs)
    unit_of = lambda module: next((u for u in units if module == u or module.startswith(u + ".")), None)
    got_ops = collections.defaultdict(collections.Counter)
    expected_ops = collections.defaultdict(collections.Counter)
    outside = []
    for record, into in ((got, got_ops), (expected, expected_ops)):
        for module, call in record.tagged:
            if call.op not in _DECIDING or not call.inputs:
                continue
            ins = call.inputs[:3] if "scaled_dot_product" in call.op else call.inputs  # the mask: outside's choice
            unit = unit_of(module or "")
            if unit in kept:  # (a converted module still, computing as converted: not outside, not compared)
                continue
            if unit is not None:
                into[unit][(call.op, ins, call.outputs)] += 1
            elif record is got and any(d in (torch.float16, torch.bfloat16) for d in ins):
                outside.append((module, call.op, ins))
    assert not outside, f"ops outside blocks and glue modules computed on 16-bit inputs: {outside[:4]}"
    # whole-model torch.fx keeps nn.MultiheadAttention a leaf, which in eval runs one fused kernel (not
    # compared: no decision of fxamp's inside it); in place its forward is traced into its ops
    fused = {unit_of(m or "") for m, c in expected.tagged if c.op == "_native_multi_head_attention"}
    if fused >= set(u for u in units if got_ops[u]):  # (kept units recorded nothing)
        raise NotApplicable("whole-model conversion runs every block's attention as nn.MultiheadAttention's "
                            "fused kernel: nothing to compare op by op")
    differ = {u: (sorted((got_ops[u] - expected_ops[u]).items(), key=str)[:3],
                  sorted((expected_ops[u] - got_ops[u]).items(), key=str)[:3])
              for u in units if got_ops[u] != expected_ops[u] and u not in fused | kept}
    assert not differ, "in place (first) vs whole-model (second): " + "; ".join(
        f"{u}: {a} vs {b}" for u, (a, b) in list(differ.items())[:3])
    assert any(got_ops.values()), "no op recorded inside a converted module"
    return {"ops": sum(sum(c.values()) for c in got_ops.values()), "modules": len(set(units) - kept)}


class _ByModule:
    """Records every aten op's dtypes with the module path ``where()`` says is running it."""

    def __init__(self, where):
        from dtype_observer import OpDtypes
        self.where, self.tagged = where, []
        outer = self

        class Mode(OpDtypes):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                outer.tagged.append((outer.where(), self.calls[-1]))
                return out
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        getattr(self.where, "close", lambda: None)()


def _hooked_path(model: nn.Module, paths: List[str]):
    """The path of the innermost converted module running now, kept by forward hooks on each."""
    stack: List[str] = []
    handles = []
    for path in paths:
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(lambda m, a, p=path: stack.append(p)))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: output kept

    def where():
        return stack[-1] if stack else None
    where.close = lambda: [h.remove() for h in handles]
    return where


def _graph_line_module(node_module: Dict[str, str]):
    """The module of the graph node running now: found from the torch.fx generated code's frame (its line
    assigns the node's name) and the report's row for that node."""
    import linecache

    def where():
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith("<eval_with_key"):
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                return node_module.get(line.split(" = ")[0].split(",")[0].strip())
            frame = frame.f_back
        return None
    return where


#: aten ops whose dtype is a precision decision (casts, views and elementwise glue follow from these)
_DECIDING = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "scaled_dot_product_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "native_layer_norm", "native_group_norm", "_native_batch_norm_legit_no_training",
             "_native_batch_norm_legit", "native_batch_norm", "_softmax", "_log_softmax", "softmax", "log_softmax",
             "sum", "mean", "var_mean", "var", "std", "norm", "linalg_vector_norm", "cumsum", "exp", "log", "pow",
             "rsqrt", "sqrt", "embedding", "convolution", "gelu", "silu", "tanh", "sigmoid", "erf"}


def check_numerics(entry: Entry, policy: str, dtype: torch.dtype, *, in_place: bool = False) -> Dict[str, Any]:
    """Convert; state_dict keys; float32 outputs; eval determinism; SQNR within 3 dB of autocast's.

    SQNR is pooled over as many input draws as it takes to compare ``MIN_COMPARED`` values: on a
    handful (a classifier's (2, 10) logits, CLIP's (2, 2) similarities) it is mostly chance —
    CLIP's 4 logits put fxamp anywhere from 10 dB below to 4 dB above autocast by input seed.
    """
    model = build(entry).eval()
    amp = convert(entry, model, policy, dtype, in_place=in_place)
    assert not model.training, "convert() must leave the model's mode as it was"
    assert set(amp.state_dict()) == set(model.state_dict()), (
        f"state_dict keys changed: only in converted {sorted(set(amp.state_dict()) - set(model.state_dict()))[:3]}, "
        f"only in original {sorted(set(model.state_dict()) - set(amp.state_dict()))[:3]}")
    amp.eval()
    refs, outs, autos, auto_error = [], [], [], None
    draws, seed = 1, 1
    while seed <= draws:
        inputs = entry.inputs(seed)
        with torch.no_grad():
            ref = call_model(model, inputs)
            out = call_model(amp, inputs)
            if seed == 1:
                again = call_model(amp, inputs)
            if auto_error is None:
                try:
                    with torch.autocast("cpu", dtype=dtype):
                        autos.append(main_output(call_model(model, inputs)).float())
                except RuntimeError as exc:  # e.g. oneDNN has no float16 LSTM on this CPU: a fixed floor
                    auto_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if seed == 1:
            for leaf in float_leaves(out):
                assert leaf.dtype == torch.float32, f"a floating output came back {leaf.dtype}, not float32"
            bad = _leaves_equal(out, again)
            assert not bad, f"eval output not deterministic (two calls differ): {bad[:3]}"
            draws = draws_for(main_output(ref).numel())
        r, o = main_output(ref), main_output(out)
        assert o.shape == r.shape, f"output shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(o).all(), f"non-finite output: {(~torch.isfinite(o)).sum().item()} of {o.numel()}"
        refs.append(r)
        outs.append(o)
        seed += 1
    db = pooled_sqnr(refs, outs)
    if auto_error is not None:
        assert db >= MIN_SQNR[dtype], f"SQNR {db:.1f} dB < {MIN_SQNR[dtype]} dB (torch.autocast fails here: {auto_error})"
        return {"sqnr": db, "sqnr_autocast": None, "autocast_error": auto_error, "draws": draws}
    db_auto = pooled_sqnr(refs, autos)
    assert db >= db_auto - AUTOCAST_MARGIN_DB, (
        f"SQNR {db:.1f} dB is more than {AUTOCAST_MARGIN_DB} dB below torch.autocast's {db_auto:.1f} dB "
        f"(pooled over {draws} input draws)")
    return {"sqnr": db, "sqnr_autocast": db_auto, "draws": draws}


def loss_of(out: Any) -> torch.Tensor:
    return main_output(out).float().pow(2).mean()


#: the lean masters and state the "training-lean" check runs (issue 28): the leanest explicit pair, so
#: the few steps of the check exercise them ("auto" spends its first steps calibrating in float32)
LEAN = {"masters": "stochastic", "state": "int8"}


def check_training_lean(entry: Entry, policy: str, dtype: torch.dtype) -> Dict[str, Any]:
    """:func:`check_training` with bfloat16 masters rounded stochastically and 8-bit optimizer state."""
    return check_training(entry, policy, dtype, **LEAN)


def check_training(entry: Entry, policy: str, dtype: torch.dtype, *, in_place: bool = False,
                   **lean: str) -> Dict[str, Any]:
    """A few AdamW steps through MixedPrecisionOptimizer track float32's losses and bring the loss down; with
    float32 islands recomputed (the default) the losses are bitwise those without (issue 40)."""
    ref_model = build(entry)
    model = copy.deepcopy(ref_model)  # O0/O1 share the original's parameters: train a separate copy
    start = copy.deepcopy(model)
    amp = convert(entry, model.eval(), policy, dtype, in_place=in_place)
    ref_model.train()
    amp.train()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=TRAIN_LR)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=TRAIN_LR), model=amp, **lean)
    inputs = entry.inputs(2)
    ref_losses, losses = [], []
    for step in range(TRAIN_STEPS):
        ref_opt.zero_grad()
        loss = loss_of(call_model(ref_model, inputs))
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
        opt.zero_grad()
        torch.manual_seed(step)  # (the same dropout masks in the run without recomputation below)
        loss = loss_of(call_model(amp, inputs))
        assert loss.dtype == torch.float32
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    if not lean:  # (stochastic rounding draws its own numbers)
        plain = convert(entry, start.eval(), policy, dtype, in_place=in_place, recompute_islands=False)
        plain.train()
        plain_opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(plain.parameters(), lr=TRAIN_LR), model=plain)
        plain_losses = []
        for step in range(TRAIN_STEPS):
            plain_opt.zero_grad()
            torch.manual_seed(step)
            loss = loss_of(call_model(plain, inputs))
            plain_opt.backward(loss)
            plain_opt.step()
            plain_losses.append(loss.item())
        assert plain_losses == losses, f"recomputed islands changed the losses: {losses} vs {plain_losses} without"
    assert all(math.isfinite(v) for v in losses), f"non-finite losses {losses}"
    scale = max(abs(v) for v in ref_losses)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses)) / scale
    summary = (f"losses {[f'{v:.4g}' for v in losses]} vs float32 {[f'{v:.4g}' for v in ref_losses]}, "
               f"skipped steps {opt.skipped_steps}")
    assert worst <= TRAIN_TOL[dtype], f"losses differ from float32's by {worst:.3f} of its largest loss: {summary}"
    # down, unless float32's did not go down either (a too-large step on a tiny loss): then tracking is the check
    assert losses[-1] < losses[0] or ref_losses[-1] >= ref_losses[0], f"loss did not decrease: {summary}"
    return {"train_dev": worst}


def check_float64(entry: Entry, policy: str = "O1", dtype: torch.dtype = torch.bfloat16) -> Dict[str, Any]:
    """A float64 model with float64 inputs: float64 is never cast, so it comes back float64, as computed."""
    model = build(entry).double().eval()

    def to64(inputs):
        return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                               inputs)

    args, kwargs = to64(entry.inputs(0))
    inputs = to64(entry.inputs(1))
    try:
        with torch.no_grad():
            ref = call_model(model, inputs)
    except Exception as exc:  # e.g. grouped_mm has no float64 kernel on CPU: nothing fxamp could keep
        raise NotApplicable(f"the float64 original itself fails: {type(exc).__name__}: {exc}") from exc
    amp = fxamp.convert(model, policy, dtype=dtype, example_inputs=args, example_kwargs=kwargs,
                        frontend=entry.frontend, **entry.convert_kwargs)
    amp.eval()
    with torch.no_grad():
        out = call_model(amp, inputs)
    dtypes = sorted({str(t.dtype) for t in float_leaves(out)})
    assert dtypes == ["torch.float64"], f"float64 model and inputs: outputs came back {dtypes}"
    db = sqnr(main_output(ref), main_output(out))
    assert db > 200, f"float64 outputs differ from the float64 original: SQNR {db:.1f} dB"
    return {"sqnr": db}


CHECKS = {"o0": check_o0, "numerics": check_numerics, "training": check_training,
          "training-lean": check_training_lean, "in-place-numerics": check_in_place_numerics,
          "in-place-training": check_in_place_training, "in-place-rows": check_in_place_rows,
          "float64": check_float64}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cases(entry: Entry) -> List[tuple]:
    """(check, policy, dtype) for one model: O0; O1/O2 in bfloat16 (and float16 where entry.fp16); O2 with
    lean masters and state; float64."""
    out: List[tuple] = [("o0", None, None)]
    for policy in ("O1", "O2"):
        for dt in ["bfloat16"] + (["float16"] if entry.fp16 else []):
            out.append(("numerics", policy, dt))
            out.append(("training", policy, dt))
    out.append(("training-lean", "O2", "bfloat16"))
    for policy in ("O1", "O2"):
        out.append(("in-place-numerics", policy, "bfloat16"))
    out.append(("in-place-training", "O2", "bfloat16"))
    out.append(("in-place-rows", "O2", "bfloat16"))
    out.append(("float64", "O1", "bfloat16"))
    return out
