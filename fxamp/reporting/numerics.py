"""Measured error per node: the converted graph evaluated twice, once as converted and once in float32.

One graph, two environments.  :class:`SideBySide` runs the converted graph as it is; for every
node it also evaluates the node in float32 from the float32 values of its inputs:

* a cast fxamp inserted (``node.meta[CAST]``) passes its source's float32 value through;
* a parameter or buffer read comes from the float32 reference model (O2/O3 store low-precision
  copies; O0/O1 share the float32 ones);
* a module call (``call_module``, or a leaf run through ``call_module_cast``) calls the reference
  model's module on float32 inputs;
* everything else runs its own target on float32 arguments.

So the float32 environment is exactly the original model's forward, and the converted one exactly
the converted model's; each node's output is compared with its float32 twin::

    SQNR = 20·log10(‖ref‖ / ‖ref − out‖) dB   (+inf when equal)

A node's drop is how far its SQNR falls below the worst of its inputs' (and below what one rounding
to the low-precision dtype gives: ~68 dB for float16, ~50 dB for bfloat16, so the first cast does not
count).  The culprit is the first node whose SQNR falls sharply: at least ``DROP_DB`` below the worst of its
inputs and below what one rounding to the low-precision dtype costs minus ``DROP_DB`` (about 60 dB
for float16, 40 dB for bfloat16).  The "worst op" is the op whose SQNR falls furthest below its
inputs': where the error comes from, not where it has piled up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..dtypes import LOW
from ..conversion.runtime.float8 import PLAIN
from ..conversion.graph import CAST, DECISION, attr_target, fetch_attr
from ..conversion.runtime import call_module_cast, cast_weights
from .records import NodeNumerics, NumericsSummary

__all__ = ["SideBySide", "measure", "summarize", "node_drops", "sqnr", "as_batches", "DROP_DB", "FP16_MAX", "FP16_TINY", "float_leaves"]

FP16_MAX = 65504.0  #: the largest finite float16
FP16_TINY = 2.0 ** -14  #: the smallest normal float16; below it values are subnormal (or zero below 2⁻²⁴)
DROP_DB = 20.0  #: how far below its inputs' SQNR a node must fall to be a culprit
_CAP_DB = 200.0  #: exact values (+inf dB) count as this when measuring a drop
_ROUNDING_DB = {torch.float16: 6.02 * 11 + 1.76, torch.bfloat16: 6.02 * 8 + 1.76}  # one rounding, uniform error


def sqnr(ref: Any, out: Any) -> float:
    """20·log10(‖ref‖ / ‖ref − out‖) in dB over the float tensors of two matching structures.

    +inf when they are equal; -inf when ``out`` has an inf/NaN where ``ref`` is finite (or ``ref`` is 0
    and ``out`` is not).  Elements where ``ref`` itself is not finite are left out.
    """
    r, o = float_leaves(ref), float_leaves(out)
    if len(r) != len(o) or any(x.shape != y.shape for x, y in zip(r, o)):
        raise ValueError(f"cannot compare outputs of different structure ({len(r)} vs {len(o)} float tensors)")
    stats = _Stats()
    stats.add(r, o)
    return stats.sqnr_db


def as_batches(inputs: Any) -> List[Tuple[Any, ...]]:
    """Input batches from: a tensor (one batch of one input), a tuple (one batch), a list of tuples
    (several batches; a list of tensors is one batch), or any other iterable of batches."""
    if inputs is None:
        return []
    if isinstance(inputs, torch.Tensor):
        return [(inputs,)]
    if isinstance(inputs, tuple):
        return [inputs]
    if isinstance(inputs, list):
        if inputs and all(isinstance(b, (tuple, list)) for b in inputs):
            return [tuple(b) for b in inputs]
        return [tuple(inputs)]
    if isinstance(inputs, dict) or not isinstance(inputs, Iterable):
        raise TypeError(f"inputs must be a tensor, a tuple of a forward's arguments, or a list of such tuples "
                        f"(one per batch), not {type(inputs).__name__}")
    return [b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,) for b in inputs]


def float_leaves(tree: Any) -> List[torch.Tensor]:
    """The float tensors in a nest of tuples, lists, dicts and ModelOutputs, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.is_floating_point() else []
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in float_leaves(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in float_leaves(v)]
    if hasattr(tree, "to_tuple"):  # a Hugging Face ModelOutput
        return float_leaves(tree.to_tuple())
    return []


@dataclass
class _Stats:
    """One node's numbers, accumulated over batches."""

    sqnr_db: float = math.inf
    max_rel: float = 0.0
    nonfinite: int = 0
    overflow: Optional[float] = None
    underflow: Optional[float] = None
    batches: int = 0

    def add(self, ref: List[torch.Tensor], out: List[torch.Tensor]) -> None:
        self.batches += 1
        fp16 = any(o.dtype == torch.float16 for o in out)
        sig = err = 0.0
        scale = diff_max = 0.0
        big = tiny = count = 0
        for r, o in zip(ref, out):
            r, o = r.detach().float(), o.detach().float()
            d = r - o
            a = r.abs()
            # one synchronisation per tensor: the sums and maxima together
            parts = [r.square().sum(dtype=torch.float64), d.square().sum(dtype=torch.float64),
                     a.max() if a.numel() else a.new_zeros(()), d.abs().max() if d.numel() else d.new_zeros(())]
            if fp16:
                parts += [(a > FP16_MAX).sum(), ((a < FP16_TINY) & (a > 0)).sum()]
            values = torch.stack([p.double() for p in parts]).tolist()
            if not all(math.isfinite(v) for v in values[:4]):  # an inf/NaN somewhere: the careful path
                finite = torch.isfinite(r)
                self.nonfinite += int((finite & ~torch.isfinite(o)).sum())
                r_f, o_f = r[finite], o[finite]
                d_f = r_f - o_f
                values[0] = float(r_f.double().square().sum())
                values[1] = float(d_f.double().square().sum()) if bool(torch.isfinite(d_f).all()) else math.inf
                values[2] = float(r_f.abs().max()) if r_f.numel() else 0.0
                ok = torch.isfinite(d_f)
                values[3] = float(d_f[ok].abs().max()) if bool(ok.any()) else 0.0
            sig += values[0]
            err += values[1]
            scale, diff_max = max(scale, values[2]), max(diff_max, values[3])
            count += r.numel()
            if fp16:
                big += int(values[4])
                tiny += int(values[5])
        value = math.inf if err == 0.0 else -math.inf if (math.isinf(err) or sig == 0.0) else \
            10.0 * math.log10(sig / err)
        self.sqnr_db = min(self.sqnr_db, value)
        if scale > 0:
            self.max_rel = max(self.max_rel, diff_max / scale)
        if fp16 and count:
            self.overflow = max(self.overflow or 0.0, big / count)
            self.underflow = max(self.underflow or 0.0, tiny / count)

    def result(self, culprit: bool) -> NodeNumerics:
        return NodeNumerics(self.sqnr_db, self.max_rel, self.nonfinite, self.overflow, self.underflow, culprit)


class SideBySide(fx.Interpreter):
    """Runs a converted graph and, node by node, its float32 twin (see the module docstring).

    ``run(*args)`` returns the converted module's output; ``reference`` holds the float32 output
    of the last run and ``stats`` each original node's numbers so far.
    """

    def __init__(self, gm: fx.GraphModule, reference: nn.Module):
        super().__init__(gm)
        self.reference_model = reference
        self.ref_env: Dict[fx.Node, Any] = {}
        self.stats: Dict[str, _Stats] = {}
        self.low: Dict[str, bool] = {}  # node name -> whether its output has a low-precision float tensor
        self.reference: Any = None
        self.current: Optional[fx.Node] = None
        self._ref_mode = False

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.ref_env = {}
        self._pending: List[Tuple[str, List[torch.Tensor], List[torch.Tensor]]] = []
        out = super().run(*args, **kwargs)
        for name, r, o in self._pending:  # compared after the forward: interleaving slows low-precision kernels
            self.stats.setdefault(name, _Stats()).add(r, o)
        self._pending = []
        return out

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        ref = self.reference_value(n, out)
        self.ref_env[n] = ref
        if n.op == "output":
            self.reference = ref
        if DECISION in n.meta and n.op not in ("placeholder", "get_attr") and attr_target(n) is None:
            r, o = float_leaves(ref), float_leaves(out)
            if r and len(r) == len(o) and all(a.shape == b.shape for a, b in zip(r, o)):
                self._pending.append((n.name, r, o))
                self.low[n.name] = self.low.get(n.name, False) or any(t.dtype in LOW for t in o)
        for dead in self.user_to_last_uses.get(n, []):
            self.ref_env.pop(dead, None)
        return out

    # -- the float32 twin --------------------------------------------------------------------
    def reference_value(self, n: fx.Node, out: Any) -> Any:
        if n.op == "placeholder":
            return out
        if CAST in n.meta:
            n = n.meta[CAST][0]
            if n in self.ref_env:
                return self.ref_env[n]
        target = attr_target(n)
        if target is not None:
            try:
                return fetch_attr(self.reference_model, target)
            except AttributeError:
                return out
        if n.op == "call_function" and n.target is cast_weights:
            return None  # its items are casts (CAST meta) of float32 weights
        saved = self.env
        self.env, self._ref_mode = self.ref_env, True
        try:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.op == "call_function" and n.target in PLAIN:  # the float32 twin of a float8 matmul is no float8
                return PLAIN[n.target](*args, **kwargs)
            if n.op == "call_function" and n.target is call_module_cast:
                kwargs = {k: v for k, v in kwargs.items() if k != "_fxamp_cache"}
                return args[0](*args[2:], **kwargs)
            return getattr(self, n.op)(n.target, args, kwargs)
        finally:
            self.env, self._ref_mode = saved, False

    def fetch_attr(self, target: str) -> Any:
        if self._ref_mode:
            try:
                return fetch_attr(self.reference_model, target)
            except AttributeError:
                pass
        return super().fetch_attr(target)


def measure(gm: fx.GraphModule, reference: nn.Module, batches: Sequence[Tuple[Any, ...]], kwargs: Dict[str, Any],
            low: Optional[torch.dtype]) -> Tuple[Dict[str, NodeNumerics], NumericsSummary]:
    """Run every batch side by side (both in eval mode, under ``no_grad``) and return per-node numbers.

    ``reference`` is the float32 model ``gm`` was converted from; ``low`` the policy's compute dtype.
    """
    from .observe import bind_inputs

    interp = SideBySide(gm, reference)
    modes = [(m, m.training) for m in list(gm.modules()) + list(reference.modules())]
    for m, _ in modes:
        m.training = False
    out_sqnr = math.inf
    try:
        with torch.no_grad():
            for batch in batches:
                out = interp.run(*bind_inputs(gm, batch, kwargs))
                out_sqnr = min(out_sqnr, sqnr(interp.reference, out))
    finally:
        for m, mode in modes:
            m.training = mode
    return summarize(gm, interp.stats, low, out_sqnr, len(batches))


def node_drops(gm: fx.GraphModule, stats: Dict[str, _Stats], low: Optional[torch.dtype]) -> Dict[str, float]:
    """Each measured node's SQNR drop in dB below its inputs' (and below one rounding to ``low``)."""
    expected = _ROUNDING_DB.get(low, _CAP_DB)  # what one rounding to ``low`` costs anyway
    drops: Dict[str, float] = {}
    for n in gm.graph.nodes:
        s = stats.get(n.name)
        if s is None or n.op == "output":
            continue
        before = min([_input_sqnr(i, stats) for i in n.all_input_nodes] + [expected])
        drops[n.name] = _cap(before) - _cap(s.sqnr_db)
    return drops


def summarize(gm: fx.GraphModule, stats: Dict[str, _Stats], low: Optional[torch.dtype], out_sqnr: float,
              batches: int) -> Tuple[Dict[str, NodeNumerics], NumericsSummary]:
    """Mark the culprit and the worst op from the per-node numbers."""
    floor = _ROUNDING_DB.get(low, _CAP_DB) - DROP_DB
    drops = node_drops(gm, stats, low)
    culprit = next((name for name, drop in drops.items() if drop >= DROP_DB and stats[name].sqnr_db < floor), None)
    worst = max(drops, key=lambda k: drops[k], default=None)  # first of the largest, in graph order
    if worst is not None and drops[worst] <= 0:
        worst = None
    per_node = {name: s.result(name == culprit) for name, s in stats.items()}
    summary = NumericsSummary(out_sqnr, worst, None if worst is None else stats[worst].sqnr_db, culprit, batches)
    return per_node, summary


def _input_sqnr(node: fx.Node, stats: Dict[str, _Stats]) -> float:
    while CAST in node.meta:
        node = node.meta[CAST][0]
    s = stats.get(node.name)
    return math.inf if s is None else s.sqnr_db


def _cap(db: float) -> float:
    if math.isnan(db):
        return -_CAP_DB
    return max(-_CAP_DB, min(_CAP_DB, db))
