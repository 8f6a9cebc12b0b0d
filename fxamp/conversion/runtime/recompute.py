"""What a recomputed float32 island calls at run time (the graph side is ``conversion/rewrite/islands.py``).

An island's ops stay in the converted graph; three calls around them make backward keep the
island's low-precision inputs instead of the float32 tensors its ops would save::

    on = island_on(logits)                       # recompute this call? (a bool)
    x = island_input(logits, on)                 # each input, detached when on: the ops below
    lab = island_input(labels, on)               #   record no autograd graph and save nothing
    f = x.float(); ce = cross_entropy(f.view(-1, V), lab.view(-1))
    out = island_output(on, PROGRAM, (logits, labels), (f, ce))   # _Recomputed: saves logits (bf16)
    f2, ce2 = out[0], out[1]                     # what the rest of the graph reads

``PROGRAM`` is the island's ops written as data in the generated code (op names, arguments, and
:class:`Ref` to earlier values), so a graph that runs with another ``self`` (a block of
``fxamp.convert_``), a pickled module and a deep copy all carry it.  In backward,
:class:`_Recomputed` runs it again from the saved inputs and differentiates it: the same ops on
the same values, so the same gradients bit for bit.

Off (everything runs as written) when grad is disabled, under ``torch.compile`` (compile chooses
its own recomputation) and when an upcast's input is not low precision at run time.

**Row chunks.** Run whole, the recompute of the loss's island holds the float32 tensors of the
logits' size its backward needs (upcast, log-probabilities, their gradient, the input's gradient)
on top of the kept bfloat16 logits, at the start of backward, where every activation is alive.
An island that is row-independent up to its last op (:func:`row_plan`: views and slices of the
upcast input, then elementwise ops, softmax/log_softmax over a dim other than 0, and
cross_entropy/nll_loss with reduction mean/sum/none) runs its backward in chunks of rows of
about :data:`CHUNK_BYTES` of float32: each chunk is cast up, recomputed, differentiated, and its
gradient written into one gradient of the input's (low) dtype, so backward holds the kept input,
its low-precision gradient and one chunk's float32 temporaries.  A mean's backward divides by the
whole batch's count (``total_weight``: targets not ``ignore_index``), as the kernel does, so each
chunk runs the sum and receives ``grad / total_weight``: the same gradients bit for bit.

**Row chunks in forward.** A loss island's forward (an upcast, views, a cross-entropy: :func:`deferred_upcast`)
would hold the float32 upcast and log-probabilities of the whole input for a moment, the step's peak at a large
vocabulary.  Its upcasts become :func:`island_upcast` (the low-precision value itself while the island
recomputes) and its loss :func:`island_loss` (each chunk cast up, its rows' negative log-likelihoods taken,
then reduced by ``nll_loss`` itself in the whole call's order): the same loss bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.fx.operator_schemas import normalize_function

from ...dtypes import LOW
from .casts import cast

__all__ = ["Ref", "island_on", "island_input", "island_output", "run_program", "resolve", "RowPlan", "row_plan",
           "CHUNK_BYTES", "ACCELERATOR_CHUNK_BYTES", "chunked_grads", "deferred_upcast", "island_upcast", "island_loss"]

#: float32 bytes of one chunk of rows in a row-chunked backward.  Small, so that a chunk's temporaries stay
#: in cache and the allocator reuses their blocks: a backward over whole float32 logits spends much of its
#: time faulting in fresh pages.  Measured (GPT d256, vocabulary 8192, 4 x 256 tokens, O2, CPU time): 1-4 MiB
#: chunks 0.96-0.99x the step without the recompute, 16-64 MiB 1.05-1.07x.  A chunk costs ~0.1 ms of Python
#: (GPT-2 small's 8 x 1024 tokens: ~400 chunks, 40 ms of a CPU step of tens of seconds); on an accelerator,
#: where that Python is the cost, chunks are larger (the step engine's segments follow the same split)
CHUNK_BYTES = 4 << 20
ACCELERATOR_CHUNK_BYTES = 64 << 20


class Ref(NamedTuple):
    """An island program's reference to a value: the island's ``i``-th input, then its ops' results in order."""

    i: int


def island_on(*entries: Any) -> bool:
    """Whether this call recomputes its island: grad recorded, not compiling, every upcast's input low precision."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and all(isinstance(t, torch.Tensor) and t.dtype in LOW for t in entries))


def island_input(value: Any, on: bool) -> Any:
    """``value`` detached when the island recomputes (its forward then records and saves nothing)."""
    return value.detach() if on and isinstance(value, torch.Tensor) else value


def island_output(on: bool, program: Tuple[Any, ...], inputs: Tuple[Any, ...], outputs: Tuple[Any, ...]
                  ) -> Tuple[Any, ...]:
    """The island's outputs, joined to its inputs by :class:`_Recomputed` when ``on`` (else as they are)."""
    if not on:
        return tuple(outputs)
    tensors = [k for k, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
    joined = _Recomputed.apply(program, [outputs[k] for k in tensors], tensors, *inputs)
    out = list(outputs)
    for k, t in zip(tensors, joined):
        out[k] = t
    return tuple(out)


class _Recomputed(torch.autograd.Function):
    """Saves the island's inputs; backward runs the island's program again and differentiates it."""

    @staticmethod
    def forward(ctx, program, outputs, tensor_at, *inputs):
        ctx.set_materialize_grads(False)  # an output no loss reads gets no gradient, as without the island
        ctx.program, ctx.tensor_at = program, tensor_at
        ctx.literals = [None if isinstance(v, torch.Tensor) else v for v in inputs]
        ctx.save_for_backward(*(v if isinstance(v, torch.Tensor) else None for v in inputs))
        ctx.mark_non_differentiable(*(o for o in outputs if not (o.is_floating_point() or o.is_complex())))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # backward with create_graph=True: the recompute's graph is cut from the inputs
            raise RuntimeError("fxamp: a recomputed float32 island cannot be differentiated twice (create_graph=True); "
                               "convert with recompute_islands=False for higher-order gradients")
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        values = [ctx.literals[i] if t is None else t.detach().requires_grad_(needs[i]) for i, t in enumerate(saved)]
        wanted = [i for i, n in enumerate(needs) if n]
        out: List[Any] = [None] * len(values)
        # what the recompute saves is used at once, here: past any saved-tensor hooks around the backward call
        # (a checkpoint's, an offload to CPU's, a measurement's)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            plan = row_plan(ctx.program, len(values))
            if isinstance(plan, RowPlan) and wanted:
                got = chunked_grads(ctx.program, plan, values, needs, dict(zip(ctx.tensor_at, grads)))
                if got is not None:
                    return (None, None, None, *got)
            results = run_program(ctx.program, values)
            pairs = [(results[k], g) for k, g in zip(ctx.tensor_at, grads)
                     if g is not None and isinstance(results[k], torch.Tensor) and results[k].requires_grad]
            if pairs and wanted:
                got = torch.autograd.grad([r for r, _ in pairs], [values[i] for i in wanted], [g for _, g in pairs],
                                          allow_unused=True)
                for i, g in zip(wanted, got):
                    out[i] = g
        return (None, None, None, *out)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def run_program(program: Tuple[Any, ...], inputs: Sequence[Any]) -> List[Any]:
    """Run an island's ``(steps, outputs)`` on ``inputs``; returns the values of ``outputs``.

    A step is ``(kind, target, args, kwargs)``: kind ``"f"`` calls the function named ``target``
    (:func:`resolve`), ``"m"`` the method ``target`` of its first argument; ``kwargs`` is a tuple of
    pairs; a :class:`Ref` in the arguments stands for an earlier value.
    """
    steps, outputs = program[0], program[1]
    env = list(inputs)
    for kind, target, args, kwargs in steps:
        args, kw = _load(args, env), {k: _load(v, env) for k, v in kwargs}
        env.append(resolve(target)(*args, **kw) if kind == "f" else getattr(args[0], target)(*args[1:], **kw))
    return [env[i] for i in outputs]


def _load(a: Any, env: List[Any]) -> Any:
    """``a`` with each :class:`Ref` replaced by its value (a module function: a recursive closure would make a
    reference cycle that holds the recomputed tensors until the garbage collector runs)."""
    if isinstance(a, Ref):
        return env[a.i]
    if isinstance(a, (tuple, list)):
        return type(a)(_load(v, env) for v in a)
    if isinstance(a, slice):
        return slice(_load(a.start, env), _load(a.stop, env), _load(a.step, env))
    return a


def resolve(name: str) -> Any:
    """The object a qualified name names (``torch.nn.functional.cross_entropy``, ``torch.ops.aten.mul.Tensor``)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"fxamp: cannot resolve {name!r} in a recomputed island")


# ---- row chunks: which islands are row-independent, and their chunked backward -------------------------------

#: ops that move or view values without computing (their backward moves gradients back, exactly in any dtype)
_LAYOUT = frozenset({"view", "reshape", "_unsafe_view", "unsafe_view", "flatten", "contiguous", "getitem", "slice",
                     "narrow", "select", "squeeze", "unsqueeze", "permute", "transpose", "t", "clone", "alias"})
#: ops that read a tensor's shape (ints: the whole tensor's, computed before the chunks)
_QUERY = frozenset({"size", "dim", "numel", "sym_size"})
#: casts (a dtype argument): float32 ones are the upcast, others elementwise
_CASTS = frozenset({"float", "to", "type", "cast", "cast_dense", "_to_copy"})
#: elementwise ops: row r of the result reads row r of its tensor arguments only
_ELEMENTWISE = _CASTS | frozenset({
    "add", "sub", "rsub", "mul", "div", "truediv", "neg", "pow", "exp", "log", "tanh", "sigmoid", "erf", "sqrt",
    "rsqrt", "abs", "clamp", "clamp_min", "clamp_max", "square", "reciprocal", "log1p", "expm1", "relu", "gelu",
    "silu", "softplus"})
#: normalisations over one dim (chunked along dim 0: that dim must not be 0)
_ROWWISE = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax"})
#: losses of class indices, reduced over the rows (the mean by the count of targets not ignore_index)
_LOSSES = frozenset({"cross_entropy", "nll_loss", "cross_entropy_loss", "nll_loss_nd"})
_REDUCTIONS = {"none": "none", "mean": "mean", "sum": "sum", 0: "none", 1: "mean", 2: "sum"}


def op_name(target: str) -> str:
    """The op a program step's target names: ``torch.ops.aten.view.default`` -> ``view``, ``_operator.mul`` -> ``mul``."""
    parts = target.split(".")
    return parts[3] if parts[:2] == ["torch", "ops"] and len(parts) > 3 else parts[-1]


def _cast_dtype(step: Tuple[Any, ...]) -> Optional[torch.dtype]:
    """The dtype a cast step casts to (``x.float()``, ``x.to(dtype)``, fxamp's ``cast``), else None."""
    _, target, args, kwargs = step
    name = op_name(target)
    if name == "float":
        return torch.float32 if len(args) == 1 and not kwargs else None
    if name not in _CASTS:
        return None
    extra = [*args[1:], *(v for _, v in kwargs)]
    return extra[0] if len(extra) == 1 and isinstance(extra[0], torch.dtype) else None


def _refs(a: Any) -> List[int]:
    if isinstance(a, Ref):
        return [a.i]
    if isinstance(a, (tuple, list)):
        return [i for v in a for i in _refs(v)]
    if isinstance(a, slice):
        return _refs((a.start, a.stop, a.step))
    return []


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """How an island's backward runs in chunks of rows (dim 0 of ``x``); indices are the program's values.

    entry:   the input the island casts up (low precision).
    x:       the value chunked: ``entry`` through the island's leading views and slices (float32 in the
             program; in backward they run on the low-precision input, the upcast per chunk).
    prefix:  the leading steps (views, slices, shape queries, casts to float32) run once, before the chunks.
    aliases: values that are ``x`` cast up (float32), and ``entry`` itself where no view precedes ``x``.
    rows:    other inputs read row by row with ``x`` (targets, elementwise operands), chunked along dim 0.
    losses:  ``(value, reduction)`` of each loss; its chunks run the sum.
    scalar_of: ``(value, loss)``: a step after a mean/sum loss that passes its value on (a cast, a view).
    dims:    ``(value, dim)`` of each softmax (its dim must not be dim 0, checked at run time).
    """

    entry: int
    x: int
    prefix: FrozenSet[int]
    aliases: FrozenSet[int]
    rows: FrozenSet[int]
    losses: Tuple[Tuple[int, str], ...]
    scalar_of: Tuple[Tuple[int, int], ...]
    dims: Tuple[Tuple[int, int], ...]


def row_plan(program: Tuple[Any, ...], n_inputs: int) -> Union[RowPlan, str]:
    """The island's :class:`RowPlan`, or why its backward cannot run in chunks of rows (a sentence)."""
    steps = program[0]
    first = steps[0] if steps else None
    if first is None or _cast_dtype(first) != torch.float32 or not isinstance(first[2][0], Ref) \
            or first[2][0].i >= n_inputs:
        return "it does not start with one upcast of its input"
    entry = first[2][0].i
    chain, kinds, prefix, aliases, viewed = entry, {}, set(), {entry}, False
    j = 0
    while j < len(steps):  # the leading views, slices and casts of the upcast value
        kind, target, args, kwargs = steps[j]
        idx, name, refs = n_inputs + j, op_name(target), _refs((args, kwargs))
        if name in _QUERY and refs and all(r in prefix or r == entry for r in refs):
            kinds[idx] = "meta"
        elif args and args[0] == Ref(chain) and all(kinds.get(r) == "meta" for r in refs[1:]) and \
                (_cast_dtype(steps[j]) == torch.float32 or (name in _LAYOUT and not _tensor_index(steps[j]))):
            if _cast_dtype(steps[j]) == torch.float32:
                aliases.add(idx)
            else:
                viewed, aliases = True, {idx}
            kinds[idx], chain = "row", idx
        else:
            break
        prefix.add(idx)
        j += 1
    if viewed:
        aliases = {a for a in aliases if a != entry}
    rows, losses, scalar_of, dims = set(), [], {}, []
    for a in aliases:
        kinds[a] = "row"
    for j in range(j, len(steps)):
        kind, target, args, kwargs = steps[j]
        idx, name, refs = n_inputs + j, op_name(target), _refs((args, kwargs))
        if any(r in prefix and r not in aliases and kinds.get(r) != "meta" for r in refs) or \
                (entry in refs and entry not in aliases):
            return f"{name} reads a value of the island before its rows are set"
        tensors = [r for r in refs if kinds.get(r) != "meta"]
        inputs = [r for r in tensors if r < n_inputs and r not in aliases]
        if name in _LOSSES:
            norm = _loss_arguments(resolve(target), args, kwargs)
            if norm is None:
                return f"{name}: its arguments are not understood"
            inp, tgt = list(norm.values())[:2]
            reduction = _REDUCTIONS.get(norm.get("reduction"))
            if not (isinstance(inp, Ref) and kinds.get(inp.i) == "row" and isinstance(tgt, Ref) and tgt.i < n_inputs
                    and tgt.i not in aliases):
                return f"{name} reads its input or target from elsewhere than the rows"
            if norm.get("weight") is not None or norm.get("label_smoothing", 0.0) != 0.0 or reduction is None or \
                    norm.get("size_average") is not None or norm.get("reduce") is not None:
                return f"{name} with class weights, label smoothing or a legacy reduction"
            rows.add(tgt.i)
            losses.append((idx, reduction))
            kinds[idx] = "per-row" if reduction == "none" else "scalar"  # one value a row (rank 1)
        elif tensors and all(kinds.get(r) == "scalar" for r in tensors) and len(set(tensors)) == 1 and \
                (_cast_dtype(steps[j]) == torch.float32 or name in _LAYOUT):
            src = tensors[0]
            scalar_of[idx] = scalar_of.get(src, src)
            kinds[idx] = "scalar"
        elif name in _ELEMENTWISE and len({kinds.get(r) for r in tensors if r not in inputs}) == 1 and \
                kinds.get(next(r for r in tensors if r not in inputs)) in ("row", "per-row"):
            # (rows and per-row values never meet: (r, V) * (r,) would broadcast along V, not along the rows)
            rows.update(inputs)
            kinds[idx] = kinds.get(next(r for r in tensors if r not in inputs))
        elif name in _ROWWISE and args and isinstance(args[0], Ref) and kinds.get(args[0].i) == "row" and \
                len(tensors) == 1 and isinstance(args[1] if len(args) > 1 else dict(kwargs).get("dim"), int) and \
                (args[1] if len(args) > 1 else dict(kwargs)["dim"]) != 0:  # (a negative dim is checked at run time)
            dims.append((args[0].i, args[1] if len(args) > 1 else dict(kwargs)["dim"]))
            kinds[idx] = "row"
        else:
            return f"{name} is not row-wise (elementwise, softmax over a row, or a loss over rows)"
    if not losses and not any(n_inputs + k not in prefix for k in range(len(steps))):
        return "it computes nothing on its rows"
    return RowPlan(entry, chain, frozenset(prefix), frozenset(aliases), frozenset(rows), tuple(losses),
                   tuple(scalar_of.items()), tuple(dims))


def _tensor_index(step: Tuple[Any, ...]) -> bool:
    """An indexing step with a tensor or list index (a gather: its backward adds gradients, so not a move)."""
    return op_name(step[1]) == "getitem" and any(isinstance(a, list) or (isinstance(a, Ref)) for a in
                                                 (step[2][1] if isinstance(step[2][1], tuple) else (step[2][1],)))


def _loss_arguments(fn: Any, args: Any, kwargs: Any) -> Optional[Dict[str, Any]]:
    """A loss call's arguments by name, in its signature's order (input and target first)."""
    try:
        pair = normalize_function(fn, tuple(args), dict(kwargs), normalize_to_only_use_kwargs=True)
    except Exception:  # a signature fx cannot read: not chunked
        return None
    return None if pair is None else dict(pair.kwargs)


def chunked_grads(program: Tuple[Any, ...], plan: RowPlan, values: List[Any], needs: Sequence[bool],
                   grads: Dict[int, Optional[torch.Tensor]]) -> Optional[List[Any]]:
    """The inputs' gradients, the island's backward run in chunks of rows; None where the run's shapes do not
    fit the plan (the caller then recomputes the island whole).  Runs with grad enabled."""
    steps, outputs = program[0], program[1]
    n = len(values)
    env: List[Any] = list(values) + [None] * len(steps)
    for idx in sorted(plan.prefix):  # the leading views on the low-precision input (casts up pass it through)
        step = steps[idx - n]
        env[idx] = env[step[2][0].i] if _cast_dtype(step) == torch.float32 else _run_step(step, env)
    x = env[plan.x]
    if not (isinstance(x, torch.Tensor) and x.dtype in LOW and x.dim() >= 1 and x.shape[0] > 0):
        return None
    rows_n, rank = x.shape[0], x.dim()
    losses = dict(plan.losses)
    for r in plan.rows:  # (an input that is no tensor, a dtype say, is passed whole)
        v = values[r]
        if not isinstance(v, torch.Tensor):
            continue
        if v.shape[:1] != x.shape[:1]:
            return None
        is_target = not v.is_floating_point()
        if (v.dim() != rank - 1) if is_target else (v.dim() != rank):
            return None
    if losses and rank != 2 or any(d % rank == 0 for _, d in plan.dims if isinstance(d, int)):
        return None
    # the gradient each chunk receives: rows of a per-row output's, a loss's (divided by the count for a mean)
    scalar_of = dict(plan.scalar_of)
    row_grads: Dict[int, torch.Tensor] = {}
    loss_grads: Dict[int, torch.Tensor] = {}
    for k, g in grads.items():
        if g is None:
            continue
        idx = outputs[k]
        src = scalar_of.get(idx, idx)
        if idx in plan.prefix and idx not in plan.aliases:
            return None
        if src in losses and losses[src] != "none":
            if src in loss_grads or g.numel() != 1:
                return None  # two outputs of one loss would add their gradients: whole, as autograd does
            loss_grads[src] = g.reshape(())
        elif g.shape[:1] == x.shape[:1] and idx not in plan.aliases:
            row_grads[idx] = g
        else:
            return None
    for idx, reduction in plan.losses:
        if reduction == "mean" and idx in loss_grads:
            norm = _loss_arguments(resolve(steps[idx - n][1]), steps[idx - n][2], steps[idx - n][3])
            target = values[list(norm.values())[1].i]
            total = (target != norm.get("ignore_index", -100)).sum().to(loss_grads[idx].dtype)
            loss_grads[idx] = loss_grads[idx] / total  # the kernel's grad_output / total_weight, bit for bit
    if not row_grads and not loss_grads:
        return None
    chunked = [r for r in sorted(plan.rows) if isinstance(values[r], torch.Tensor)]
    wrt = [r for r in chunked if needs[r] and values[r].is_floating_point()]
    want_x = needs[plan.entry]
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
    bufs = {r: torch.empty_like(values[r], memory_format=torch.contiguous_format) for r in wrt}
    used = dict.fromkeys([plan.x, *wrt], False)
    step_rows = _rows_per_chunk(x)
    calls = {}  # each loss's function and arguments, its chunks running the sum
    for idx, reduction in plan.losses:
        norm = _loss_arguments(resolve(steps[idx - n][1]), steps[idx - n][2], steps[idx - n][3])
        if reduction != "none":
            norm["reduction"] = "sum" if isinstance(norm["reduction"], str) else 2
        calls[idx] = (resolve(steps[idx - n][1]), tuple(norm.values()))
    for r0 in range(0, rows_n, step_rows):
        r1 = min(rows_n, r0 + step_rows)
        xc = x[r0:r1].detach().requires_grad_(want_x)
        up = xc.to(torch.float32)
        cenv: List[Any] = list(env)
        for i in chunked:
            cenv[i] = values[i][r0:r1].detach().requires_grad_(i in bufs)
        for a in plan.aliases:
            cenv[a] = xc if a == plan.entry else up
        for j in range(len(steps)):
            idx = n + j
            if idx in plan.prefix:
                continue
            step = steps[j]
            if idx in calls:
                fn, call_args = calls[idx]
                cenv[idx] = fn(*_load(call_args, cenv))
            else:
                cenv[idx] = _run_step(step, cenv)
        outs = [(cenv[i], g[r0:r1]) for i, g in row_grads.items()] + [(cenv[i], g) for i, g in loss_grads.items()]
        leaves = ([xc] if want_x else []) + [cenv[r] for r in wrt]
        got = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs], allow_unused=True)
        for key, g, buf in zip([plan.x, *wrt], got, ([gx] if want_x else []) + [bufs[r] for r in wrt]):
            if g is None:
                buf[r0:r1].zero_()
            else:
                buf[r0:r1].copy_(g)
                used[key] = True
        del outs, leaves, got, cenv, up, xc
    out: List[Any] = [None] * n
    if want_x and used[plan.x]:
        out[plan.entry] = gx if x is values[plan.entry] else torch.autograd.grad(x, values[plan.entry], gx)[0]
    for r in wrt:
        out[r] = bufs[r] if used[r] else None
    return out


def _run_step(step: Tuple[Any, ...], env: List[Any]) -> Any:
    kind, target, args, kwargs = step
    args, kw = _load(args, env), {k: _load(v, env) for k, v in kwargs}
    return resolve(target)(*args, **kw) if kind == "f" else getattr(args[0], target)(*args[1:], **kw)


def _rows_per_chunk(x: torch.Tensor) -> int:
    """Rows of ``x`` (dim 0) in one chunk of about :data:`CHUNK_BYTES` of float32."""
    row_numel = max(1, x[0].numel())
    return max(1, (CHUNK_BYTES if x.device.type == "cpu" else ACCELERATOR_CHUNK_BYTES) // (4 * row_numel))


# ---- row chunks in forward: a loss island's upcast deferred to its chunks ------------------------------------

#: the losses whose forward runs in row chunks (log-softmax then the negative log-likelihood; see island_loss)
_CHUNKED_FORWARD = frozenset({"cross_entropy", "cross_entropy_loss"})


def deferred_upcast(program: Tuple[Any, ...], n_inputs: int) -> Union[Tuple[Tuple[int, ...], int], str]:
    """``(upcasts, loss)``: the indices (in the program's values, its inputs first) of the casts to float32 and of
    the loss of an island whose forward can run in row chunks too, or why not (a sentence).

    It must be: an upcast, views and slices of it (and casts to float32, which do nothing there), one
    cross-entropy over them, and only values of the loss after it; the island returns the loss alone (never
    the upcast or a view of it).  The casts then return their low-precision input while the island recomputes
    (:func:`island_upcast`), the views run on that, and :func:`island_loss` casts up one chunk of rows at a
    time: forward never holds the float32 upcast or log-probabilities of the whole input (8 bytes per logit).
    """
    plan = row_plan(program, n_inputs)
    if not isinstance(plan, RowPlan):
        return plan
    steps, outputs, n = program[0], program[1], n_inputs
    if len(plan.losses) != 1 or op_name(steps[plan.losses[0][0] - n][1]) not in _CHUNKED_FORWARD:
        return "not one cross_entropy"
    loss = plan.losses[0][0]
    scalars = {i for i, _ in plan.scalar_of}
    casts = tuple(sorted(i for i in plan.prefix if _cast_dtype(steps[i - n]) is not None))
    if any(i not in plan.prefix and i != loss and i not in scalars for i in range(n, n + len(steps))):
        return "it computes more than the loss on its rows"
    rows = plan.prefix - {i for i in plan.prefix if op_name(steps[i - n][1]) in _QUERY}
    if any(o in rows for o in outputs):
        return "it returns its float32 rows"
    _, _, args, kwargs = steps[loss - n]
    read = _refs((args, kwargs))
    if any(r in rows and r != plan.x for r in read) or Ref(plan.x) not in (*args[:1], *(v for k, v in kwargs)):
        return "its loss reads other rows than the last view"
    for j in range(len(steps)):  # a row value read by anything but the next view, a shape query or the loss
        if n + j in rows or n + j == loss:
            continue
        if any(r in rows for r in _refs((steps[j][2], steps[j][3]))) and n + j not in plan.prefix:
            return "its rows are read elsewhere"
    return casts, loss


def island_upcast(x: Any, on: bool, dense: bool) -> Any:
    """An island's upcast whose forward :func:`island_loss` runs in row chunks: ``x`` itself (low precision) while
    the island recomputes (the views after it run on that), else ``x`` cast to float32 as written (``dense``:
    fxamp's :func:`~fxamp.conversion.runtime.casts.cast`, else ``x.to(float32)``)."""
    if on:
        return x
    return cast(x, torch.float32) if dense else x.to(torch.float32)


def island_loss(on: bool, name: str, *args: Any, **kwargs: Any) -> Any:
    """The loss ``name`` (a cross-entropy) of an island whose upcast :func:`island_upcast` deferred.

    While the island recomputes, its input arrives in low precision and the loss runs in chunks of rows of about
    :data:`CHUNK_BYTES` of float32: each chunk cast up, its log-softmax and each row's negative log-likelihood
    taken (``reduction="none"``: one value a row, the same bits as the whole call's), then the rows' values
    reduced by ``nll_loss`` itself over a two-column tensor holding them (its sum runs over the rows in the
    same order whatever the number of classes), so mean and sum are the whole call's bit for bit.  Else, or
    for a form it does not chunk (class weights, label smoothing, not 2-D), the whole loss on the input cast up.
    """
    fn = resolve(name)
    norm = _loss_arguments(fn, args, kwargs) if on else None
    if norm is None:  # (recompute off: the input arrives in float32, as written; row_plan read the signature)
        up = [a.to(torch.float32) if k == 0 and isinstance(a, torch.Tensor) and a.dtype in LOW else a
              for k, a in enumerate(args)]
        return fn(*up, **kwargs)
    values = list(norm.values())
    x = values[0]
    if not (isinstance(x, torch.Tensor) and x.dtype in LOW):
        return fn(*values)
    target = values[1]
    reduction = _REDUCTIONS.get(norm.get("reduction"))
    if (x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0 or not isinstance(target, torch.Tensor)
            or target.dim() != 1 or target.shape[0] != x.shape[0] or target.is_floating_point()
            or norm.get("weight") is not None or norm.get("label_smoothing", 0.0) != 0.0 or reduction is None
            or norm.get("size_average") is not None or norm.get("reduce") is not None):
        return fn(x.to(torch.float32), *values[1:])
    ignore = norm.get("ignore_index", -100)
    rows = x.shape[0]
    picked = torch.empty(rows, dtype=torch.float32, device=x.device)
    step = _rows_per_chunk(x)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        logp = torch.log_softmax(x[r0:r1].to(torch.float32), 1)
        picked[r0:r1] = torch.nn.functional.nll_loss(logp, target[r0:r1], reduction="none", ignore_index=ignore)
        del logp
    if reduction == "none":
        return picked
    column = 1 if ignore == 0 else 0
    kept = torch.zeros(rows, 2, dtype=torch.float32, device=x.device)
    kept[:, column] = picked.neg_()  # the log-probability of each row's target (exactly: a negation)
    classes = torch.where(target == ignore, target, torch.full_like(target, column))
    return torch.nn.functional.nll_loss(kept, classes, reduction=reduction, ignore_index=ignore)
