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
"""

from __future__ import annotations

import importlib
from typing import Any, List, NamedTuple, Sequence, Tuple

import torch

from ...dtypes import LOW

__all__ = ["Ref", "island_on", "island_input", "island_output", "run_program", "resolve"]


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
    steps, outputs = program
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
