"""What dtype each value of a captured graph certainly has (``DtypeInference``).

Read-only over a graph: the classifier asks it which inputs of a node are float tensors (and which
are float64, never cast), and the cast inserter asks it which casts would do nothing (dropped) and
which values are known float tensors (a plain ``x.to(dtype)`` instead of the run-time checked cast).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ...dtypes import CASTABLE, NOT_FLOAT
from ..graph import ATTR, CAST, INPUT_DTYPE, Decision, fetch_attr
from ..runtime.recompute import island_input, island_loss, island_upcast
from ..op_lists import KEEP_DTYPE_OPS, NON_FLOAT_OPS, Category, SINGLE_TENSOR_OPS, SPLIT_OPS, op_key

__all__ = ["DtypeInference"]

_EXPLICIT = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad")
#: reductions that give a 0-dim tensor when called without a dim (``x.mean()``, ``torch.sum(x)``)
_FULL_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "norm", "std", "var", "prod",
                              "nansum", "nanmean", "logsumexp"})
_SIZE_OPS = frozenset({"Tensor.size", "Tensor.dim", "Tensor.numel", "Tensor.nelement", torch.ops.aten.sym_size,
                       torch.ops.aten.sym_numel})


class _IfCastable:
    """A value of ``dtype`` if it is a float16/bfloat16/float32 tensor; anything else (a float64
    tensor, an int) passed unchanged through the run-time checked casts that made it."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class DtypeInference:
    """What dtype each value certainly has: a dtype, ``NOT_FLOAT``, or None (unknown until run time).

    Used only to drop casts that would do nothing and to emit plain ``x.to(dtype)`` where the
    value is known to be a float tensor; unknown values keep the run-time checked ``cast``.

    A value that went through a checked ``cast`` of an input whose dtype is unknown is not certain:
    ``cast(x, float16)`` leaves a float64 ``x`` float64.  Such values are unknown to ``__call__``
    but :meth:`if_castable` knows their dtype for the castable case, which is enough to drop a cast
    to that same dtype (a cast to another dtype stays a checked ``cast``, which leaves float64 alone).
    """

    def __init__(self, gm: fx.GraphModule, modules: Dict[str, nn.Module], decisions: Dict[fx.Node, Decision]):
        self.gm, self.modules, self.decisions = gm, modules, decisions
        self.known: Dict[fx.Node, Any] = {}
        self.scalars: set = set()  # nodes certainly holding a Python number or shape (a subset of NOT_FLOAT)

    def __call__(self, node: fx.Node) -> Any:
        known = self._get(node)
        return None if isinstance(known, _IfCastable) else known

    def if_castable(self, node: fx.Node) -> Optional[torch.dtype]:
        """The dtype ``node``'s value has whenever it is a float16/bfloat16/float32 tensor, or None if unknown."""
        known = self._get(node)
        if isinstance(known, _IfCastable):
            return known.dtype
        return known if known in CASTABLE else None

    def _get(self, node: fx.Node) -> Any:
        if node not in self.known:
            known = self._infer(node)
            if isinstance(known, torch.dtype) and not (known.is_floating_point or known.is_complex):
                known = NOT_FLOAT  # x.to(torch.bool), sum(dtype=torch.long): a mask or a count, not a float
            self.known[node] = known
        return self.known[node]

    def _infer(self, node: fx.Node) -> Any:
        if ATTR in node.meta:
            t = fetch_attr(self.gm, node.meta[ATTR])
            return t.dtype if t.is_floating_point() else NOT_FLOAT
        if node.op == "placeholder" and INPUT_DTYPE in node.meta:
            return node.meta[INPUT_DTYPE]  # a graph captured for one input dtype (a block: blocks.py)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            return NOT_FLOAT
        if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):  # Python scalars
            self.scalars.add(node)
            return NOT_FLOAT
        if node.op == "get_attr":
            t = fetch_attr(self.gm, node.target)
            return t.dtype if isinstance(t, torch.Tensor) and t.is_floating_point() else NOT_FLOAT
        if CAST in node.meta:
            src, dtype = node.meta[CAST]
            known = self(src)
            if known in CASTABLE:
                return dtype
            return _IfCastable(dtype) if known is None else known  # NOT_FLOAT or float64: left as it is
        if node.op == "call_function" and node.target is island_input:  # a recomputed island's input, detached
            return self._get(node.args[0])
        # an island whose forward runs in row chunks: the values as written (float32; the chunks compute the same)
        if node.op == "call_function" and node.target is island_upcast:
            return torch.float32 if self(node.args[0]) in CASTABLE else None
        if node.op == "call_function" and node.target is island_loss:  # a cross-entropy: its input's dtype
            return self._get(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], fx.Node) else None
        if node.op == "call_method" and node.target in _EXPLICIT:
            return _EXPLICIT[node.target]
        if node.op == "call_method" and node.target == "to":
            dtype = node.kwargs.get("dtype", next((a for a in node.args if isinstance(a, torch.dtype)), None))
            return dtype
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if self(src) is NOT_FLOAT:
                if src in self.scalars:
                    self.scalars.add(node)  # an item of a shape
                return NOT_FLOAT
            if src.op in ("call_function", "call_method") and op_key(src.target) in SPLIT_OPS:
                return self._get(src.args[0]) if isinstance(src.args[0], fx.Node) else None
            return None
        if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
            if node.args[1] in _META_ATTRS:
                self.scalars.add(node)
                return NOT_FLOAT
            return None
        if node.op not in ("call_function", "call_method", "call_module"):
            return None
        explicit = node.kwargs.get("dtype")
        if isinstance(explicit, torch.dtype) and not (explicit.is_floating_point or explicit.is_complex):
            return NOT_FLOAT  # ones_like(x, dtype=torch.bool), arange(n, dtype=torch.long): whatever the inputs
        module = getattr(node.target, "__module__", None) if node.op == "call_function" else None
        inputs = node.all_input_nodes
        if module == "math" or (module == "_operator" and inputs and all(self(i) is NOT_FLOAT and i in self.scalars
                                                                           for i in inputs)):
            self.scalars.add(node)  # math.sqrt(d), d // heads, n * 2 on traced sizes: a Python number
            return NOT_FLOAT
        key = type(self.modules[node.target]) if node.op == "call_module" else op_key(node.target)
        if key in NON_FLOAT_OPS:
            if key in _SIZE_OPS:
                self.scalars.add(node)
            return NOT_FLOAT
        if key not in SINGLE_TENSOR_OPS or node.kwargs.get("return_indices"):
            return None
        dtype = node.kwargs.get("dtype", next((a for a in node.args if isinstance(a, torch.dtype)), None))
        if dtype is not None:
            return dtype
        floats = [k for k in (self._get(n) for n in node.all_input_nodes) if k is not NOT_FLOAT]
        if not floats and node.all_input_nodes and key in KEEP_DTYPE_OPS:
            return NOT_FLOAT  # mask.triu(1), a view of an integer tensor
        decision = self.decisions.get(node)
        if decision is not None and decision.compute is not None:
            return self._computed(node, decision, floats)
        wide = [k for k in floats if isinstance(k, torch.dtype) and k not in CASTABLE]
        if wide:  # float64 wins any promotion; a cast leaves what else might arrive (complex, float64) alone
            return wide[0] if len(wide) == 1 else torch.promote_types(*wide[:2])
        if not floats or any(k is None for k in floats):
            return None  # unknown inputs, or e.g. arange-like ops on ints: leave undecided
        out = None
        for k in floats:
            d = k.dtype if isinstance(k, _IfCastable) else k
            out = d if out is None else torch.promote_types(out, d)
        if len(set(k.dtype if isinstance(k, _IfCastable) else k for k in floats)) > 1 and any(
                self._maybe_0dim(n) for n in node.all_input_nodes):
            # a low-precision tensor times a float32 one is float32, unless the float32 one is 0-dim (a
            # learned scale, CLIP's logit_scale.exp()): type promotion does not let a 0-dim tensor widen it
            return None
        if out in CASTABLE and any(isinstance(k, _IfCastable) for k in floats):
            return _IfCastable(out)  # a float64 among the uncertain inputs would make it float64
        return out

    def _maybe_0dim(self, node: fx.Node, depth: int = 0) -> bool:
        """Whether ``node`` may hold a 0-dim tensor: a 0-dim parameter or buffer, a full reduction
        (``x.mean()``), ``torch.tensor(2.0)``, or an op on such values alone (a few ops deep: a scale's
        ``clamp(max=...).exp()``).  Inputs and other values are taken to have dims (torch.fx records no
        shapes; torch.export's ``val`` says)."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dim() == 0
        if ATTR in node.meta or node.op == "get_attr":
            t = fetch_attr(self.gm, node.meta[ATTR] if ATTR in node.meta else node.target)
            return isinstance(t, torch.Tensor) and t.dim() == 0
        if node.op not in ("call_function", "call_method"):
            return False
        if node.target is torch.tensor or node.target is torch.scalar_tensor:
            return True
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in _FULL_REDUCTIONS and len(node.args) == 1 and not set(node.kwargs) & {"dim", "axis"}:
            return True
        tensors = node.all_input_nodes
        return bool(tensors) and depth < 8 and all(self._maybe_0dim(n, depth + 1) for n in tensors)

    def _computed(self, node: fx.Node, decision: Decision, floats: list) -> Any:
        """The result of a node whose float inputs were cast to ``decision.compute``."""
        if node.op == "call_module":  # its weights run in compute too (stored so, or cast by call_module_cast)
            m = self.modules[node.target]
            floats = floats + [t.dtype for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()]
        certain = [k for k in floats if isinstance(k, torch.dtype)]
        if any(k not in CASTABLE for k in certain):
            return None  # a float64 input is never cast: the op runs in float64 (or fails, as the original does)
        if len(certain) == len(floats):
            return decision.compute  # every float input was cast to compute, so is its result
        if certain and (decision.resolved is Category.SAFE or decision.norm):
            # matmul-like and norm kernels reject a float64 input beside compute-dtype weights: the
            # result is compute, or the error the original model raises for that input too
            return decision.compute
        return _IfCastable(decision.compute)
