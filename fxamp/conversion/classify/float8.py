"""Which safe matmuls run in float8: the shape float8 takes, the cost model, and the choice per node.

:func:`matmul_shape` says whether a graph node is a matmul ``runtime/float8.py`` can run (and its K, N),
:func:`cost_says` whether float8 pays at that shape (:data:`COST_TABLES`), :func:`choose` records the
choice per node (``Decision.float8``: a classify rule, after the categories) and :func:`float8_notes`
says what it chose; ``rewrite/float8.py`` swaps the chosen nodes' targets.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...policy import Float8, Float8Cost, Float8Recipe
from ..graph import Decision, Float8Choice, fetch_attr
from ..op_lists import Category, Source, op_key
from ..passes import Conversion, Pass, Stage, record
from ..runtime.float8 import einsum_plan
from .overrides import FORCE, REFUSE, check_places, override_for, split_overrides

__all__ = ["CostTable", "COST_TABLES", "device_kind", "torchao_default", "cost_says", "FORCE", "REFUSE", "MULTIPLE",
           "matmul_shape", "einsum_args", "choose", "float8_notes", "FLOAT8_CHOICE"]


# -- the cost model -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostTable:
    """Measured speed-ups of float8 over bfloat16 for one device kind, one recipe, by matmul shape.

    device:   what measured it (``torch.cuda.get_device_name()``, or ``"cpu: <lscpu model>"``).
    tokens:   the GEMM's M (rows of the input) it was measured at.
    rows:     ``((K, N, speed-up), ...)``: bf16 time / float8 time of forward + backward, casts included.

    A shape is looked up at the nearest measured (K, N) in log space; float8 pays when its speed-up > 1.
    """

    device: str
    tokens: int
    rows: Tuple[Tuple[int, int, float], ...]

    def speedup(self, k: int, n: int) -> float:
        def dist(row: Tuple[int, int, float]) -> float:
            return abs(math.log2(row[0] / k)) + abs(math.log2(row[1] / n))

        return min(self.rows, key=dist)[2]


#: device kind (:func:`device_kind`) -> recipe -> table; where none was measured, :func:`torchao_default`
#: decides.  Measured with ``python -m benchmarks.float8_cost`` (benchmarks/RESULTS.md has the runs).  On a
#: CPU ``_scaled_mm`` runs emulated: it beats bfloat16 only where bfloat16 itself has no fast kernels.
COST_TABLES: Dict[str, Dict[Float8Recipe, CostTable]] = {
    # Intel Xeon (AVX-512, no AVX-512-BF16, no AMX), 1 thread, 2026-11-27: the mean of two noisy runs
    # (benchmarks/RESULTS.md has both); bfloat16 has no fast kernel there, so emulated float8 wins at 1024
    "cpu:no-bf16-kernels": {
        Float8Recipe.TENSORWISE: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                           ((64, 64, 0.30), (256, 256, 0.95), (1024, 1024, 1.34))),
        Float8Recipe.ROWWISE: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                        ((64, 64, 0.35), (256, 256, 0.62), (1024, 1024, 1.18))),
        Float8Recipe.ROWWISE_WITH_GW_HP: CostTable("cpu: Intel Xeon, AVX-512, no bf16 kernels", 256,
                                                   ((64, 64, 0.26), (256, 256, 0.72), (1024, 1024, 1.04))),
    },
    # NVIDIA H200, torch 2.11.0+cu130, M = 8192, compiled fwd+bwd, medians of 7, 2026-11-29 (two calls of
    # benchmarks.float8_cost --compile; benchmarks/gpu-logs/2026-11-29-h200): float8 pays from 4096 x 4096 on,
    # 1.5x at 8192 x 8192 (tensorwise); at GPT-2 small's widths its scaling kernels cost more than the GEMM saves
    "cuda:NVIDIA H200": {
        Float8Recipe.TENSORWISE: CostTable("NVIDIA H200, compiled", 8192, ((768, 768, 0.67), (768, 3072, 0.67),
                                                                           (3072, 768, 0.68), (4096, 4096, 1.03),
                                                                           (8192, 8192, 1.50))),
        Float8Recipe.ROWWISE: CostTable("NVIDIA H200, compiled", 8192, ((768, 768, 0.60), (768, 3072, 0.67),
                                                                        (3072, 768, 0.66), (4096, 4096, 1.03),
                                                                        (8192, 8192, 1.30))),
        Float8Recipe.ROWWISE_WITH_GW_HP: CostTable("NVIDIA H200, compiled", 8192,
                                                   ((768, 768, 0.60), (768, 3072, 0.71), (3072, 768, 0.71),
                                                    (4096, 4096, 0.92), (8192, 8192, 1.27))),
    },
}


def device_kind(device: Optional[torch.device]) -> str:
    """The key of :data:`COST_TABLES` for a device: ``"cuda:<name>"``, or for a CPU its bfloat16 kernels
    (``"cpu:amx-bf16"``, ``"cpu:avx512-bf16"``, ``"cpu:no-bf16-kernels"``; ``"cpu"`` where unknown)."""
    if device is None or device.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
        except OSError:
            flags = None
        if flags is None:
            return "cpu"
        return ("cpu:amx-bf16" if "amx_bf16" in flags else "cpu:avx512-bf16" if "avx512_bf16" in flags
                else "cpu:no-bf16-kernels")
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def torchao_default(recipe: Float8Recipe, k: int, n: int) -> Tuple[bool, str]:
    """torchao's shape thresholds (``_auto_filter_for_recipe``, measured on an H100): whether float8 pays."""
    if recipe is Float8Recipe.TENSORWISE:
        pays = not (k <= 4096 and n <= 1024)
        rule = "tensorwise skips K <= 4096 and N <= 1024"
    else:  # torchao has no rule for rowwise_with_gw_hp: rowwise's
        pays = not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
        rule = "rowwise skips N <= 2048, K <= 1024, and N <= 4096 with K <= 2048"
    return pays, f"torchao's H100 thresholds ({rule})"


def cost_says(kind: str, recipe: Float8Recipe, k: int, n: int,
              tables: Mapping[str, Mapping[Float8Recipe, CostTable]] = COST_TABLES) -> Tuple[bool, str]:
    """Whether float8 pays for a (K, N) matmul on device ``kind``, and why (the table's row, or torchao's rule)."""
    table = tables.get(kind, {}).get(recipe)
    if table is None:
        pays, rule = torchao_default(recipe, k, n)
        emulated = ", where float8 runs emulated," if kind.startswith("cpu") else ""
        return pays, f"no cost table for {kind}{emulated} so {rule}"
    s = table.speedup(k, n)
    return s > 1.0, f"measured {s:.2f}x of bfloat16 near K={k}, N={n} on {table.device}"


# -- choosing the nodes -----------------------------------------------------------------------------

_LINEAR = frozenset(op_key(t) for t in (F.linear, torch.ops.aten.linear.default))
_MATMUL = frozenset(op_key(t) for t in (torch.matmul, torch.mm, operator.matmul, "matmul", "mm",
                                         torch.ops.aten.mm.default, torch.ops.aten.matmul.default))
_ADDMM = frozenset(op_key(t) for t in (torch.addmm, "addmm", torch.ops.aten.addmm.default))
_EINSUM = frozenset(op_key(t) for t in (torch.einsum, torch.ops.aten.einsum.default))
#: GEMM dimensions float8 kernels take (cuBLASLt's _scaled_mm: K and N multiples of 16)
MULTIPLE = 16


def _tensor_shape(gm: fx.GraphModule, value: Any) -> Optional[Tuple[int, ...]]:
    """The shape of a parameter, buffer or constant the graph reads (a get_attr), else None: float8 takes
    weights, not activations (their shapes could be read from torch.export's ``meta["val"]``, on purpose not)."""
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    t = fetch_attr(gm, str(value.target))
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _weight_device(gm: fx.GraphModule, value: Any) -> Optional[torch.device]:
    if isinstance(value, fx.Node) and value.op == "get_attr":
        t = fetch_attr(gm, str(value.target))
        return t.device if isinstance(t, torch.Tensor) else None
    return None


def matmul_shape(gm: fx.GraphModule, node: fx.Node) -> Tuple[Optional[str], Optional[Tuple[int, int]], Any]:
    """``(kind, (K, N), weight node)`` for a matmul float8 could run (kind "linear", "matmul", "addmm" or "einsum"),
    with (K, N) None when the second operand is no 2-D parameter or buffer; ``(None, None, None)`` for
    any other node."""
    if node.op not in ("call_function", "call_method"):
        return None, None, None
    key = op_key(node.target)
    if key in _LINEAR:
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        shape = _tensor_shape(gm, w)
        return "linear", ((shape[1], shape[0]) if shape is not None and len(shape) == 2 else None), w
    if key in _MATMUL:
        if len(node.args) != 2 or node.kwargs:
            return "matmul", None, None
        shape = _tensor_shape(gm, node.args[1])
        return "matmul", ((shape[0], shape[1]) if shape is not None and len(shape) == 2 else None), node.args[1]
    if key in _ADDMM:
        if len(node.args) != 3 or node.kwargs:  # beta= / alpha=: not a plain bias + matmul
            return "addmm", None, None
        shape = _tensor_shape(gm, node.args[2])
        return "addmm", ((shape[0], shape[1]) if shape is not None and len(shape) == 2 else None), node.args[2]
    if key in _EINSUM:
        eq, operands = einsum_args(node)
        if eq is None or len(operands) != 2:
            return "einsum", None, None
        b_shape = _tensor_shape(gm, operands[1])
        a_dim = len(eq.split("->")[0].split(",")[0]) if "->" in eq else 0  # no "..." (einsum_plan refuses it)
        plan = einsum_plan(eq, a_dim, len(b_shape)) if b_shape is not None else None
        if plan is None:
            return "einsum", None, None
        k_at = 1 if plan[1] else 0
        return "einsum", (b_shape[k_at], b_shape[1 - k_at]), operands[1]
    return None, None, None


def einsum_args(node: fx.Node) -> Tuple[Optional[str], List[Any]]:
    args = list(node.args)
    if not args or not isinstance(args[0], str):
        return None, []
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    return args[0], operands


def _check_device(device: Optional[torch.device], config: Float8) -> None:
    """A clear line for a device ``_scaled_mm`` cannot run on (before any graph runs)."""
    if device is None or device.type == "cpu":
        return
    if device.type == "cuda" and not torch.version.hip:
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"float8={config} needs a GPU with float8 matmuls (compute capability 8.9 or newer: "
                             f"Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. "
                             f"Drop float8 from the policy (plain 'O2' runs bfloat16)")
        return
    if device.type != "cuda":
        raise ValueError(f"float8={config}: torch._scaled_mm has no float8 matmul on {device.type!r}; "
                         f"float8 runs on CUDA (compute capability 8.9+) and, emulated, on CPU")


def choose(gm: fx.GraphModule, decisions: Dict[fx.Node, Decision], policy: Any,
           module_overrides: Mapping[str, str], node_overrides: Mapping[str, str]) -> None:
    """Give every safe matmul running in the policy's compute dtype a :class:`Float8Choice` (in ``decisions``).

    In order: a node override, then a module override (``"float8"`` / ``"no_float8"``); a matmul whose
    second operand is no 2-D parameter or buffer, or whose K or N is no multiple of 16, stays bfloat16
    (a forced one is an error); then the policy's ``cost`` (``always``, or the cost model).
    """
    config: Optional[Float8] = policy.float8
    if config is None:
        if module_overrides or node_overrides:
            where = next(iter({**module_overrides, **node_overrides}))
            raise ValueError(f"overrides: {where!r} asks for {({**module_overrides, **node_overrides})[where]!r}, "
                             f"but the policy runs no float8; add float8=<recipe> to it ('O2,float8=tensorwise')")
        return
    check_places(gm, module_overrides, node_overrides)
    checked = set()
    for node, d in list(decisions.items()):
        kind, kn, weight = matmul_shape(gm, node)
        if kind is None or d.resolved is not Category.SAFE or d.compute != policy.compute:
            if node.name in node_overrides and kind is None:
                raise ValueError(f"node_overrides: {node.name!r} ({d.op}) is not a matmul, so "
                                 f"{node_overrides[node.name]!r} means nothing for it")
            continue
        device = _weight_device(gm, weight)
        if device not in checked:
            _check_device(device, config)
            checked.add(device)
        choice = _choose_one(node, kind, kn, config, device, module_overrides, node_overrides)
        decisions[node] = dataclasses.replace(d, float8=choice)


def _choose_one(node: fx.Node, kind: str, kn: Optional[Tuple[int, int]], config: Float8,
                device: Optional[torch.device], module_overrides: Mapping[str, str],
                node_overrides: Mapping[str, str]) -> Float8Choice:
    forced = override_for(node, node_overrides, module_overrides)
    if forced is not None and forced.value == REFUSE:
        return Float8Choice(False, f"no_float8 for {forced.where} (override): runs in bfloat16", forced.source)
    bad = None
    if kn is None:
        bad = (f"its second operand is no 2-D parameter or buffer (a {kind} of two activations, a batched or "
               f"sliced weight, or an einsum that is no single matmul): float8 takes one 2-D weight")
    elif kn[0] % MULTIPLE or kn[1] % MULTIPLE:
        bad = f"K={kn[0]}, N={kn[1]}: float8 GEMMs need K and N multiples of {MULTIPLE}"
    if bad is not None:
        if forced is not None:
            raise ValueError(f"{'node_overrides' if forced.source is Source.NODE_OVERRIDE else 'module_overrides'}: "
                             f"{forced.where} asks for float8 at {node.name} ({node.format_node()}), but {bad}; "
                             f"drop the override, or pad the layer")
        return Float8Choice(False, f"kept in bfloat16: {bad}", Source.GRAPH)
    if forced is not None:
        return Float8Choice(True, f"float8 for {forced.where} (override), whatever the cost", forced.source)
    if config.cost is Float8Cost.ALWAYS:
        return Float8Choice(True, f"float8 (cost=always; K={kn[0]}, N={kn[1]})", Source.DEFAULT)
    pays, why = cost_says(device_kind(device), config.recipe, kn[0], kn[1])
    if pays:
        return Float8Choice(True, f"float8: pays at K={kn[0]}, N={kn[1]} ({why})", Source.DEFAULT)
    return Float8Choice(False, f"{_COST_KEPT}K={kn[0]}, N={kn[1]} ({why}); {_FORCE}", Source.DEFAULT)


_COST_KEPT = "kept in bfloat16: too small to pay at "
_FORCE = "':always' or a node/module override 'float8' forces it"


def float8_notes(decisions: Mapping[fx.Node, Decision], config: Optional[Float8] = None) -> List[str]:
    """One line saying how many matmuls run in float8, which the cost model kept in bfloat16 (why, and how
    to force them: on a CPU it keeps them all) and which stayed in bfloat16 for their shape."""
    choices = [(n, d.float8) for n, d in decisions.items() if d.float8 is not None]
    if not choices:
        return []
    chosen = sum(c.chosen for _, c in choices)
    shape = [n.name for n, c in choices if not c.chosen and c.source is Source.GRAPH]
    cost = [(n, c) for n, c in choices if not c.chosen and c.reason.startswith(_COST_KEPT)]
    line = f"float8: {chosen} of {len(choices)} matmuls run in float8"
    if cost:
        always = f"'float8={dataclasses.replace(config, cost=Float8Cost.ALWAYS)}'" if config else "':always'"
        # "K=64, N=64 (why)" -> "K=64, N=64: why"
        why = cost[0][1].reason[len(_COST_KEPT):-len(_FORCE) - 2].replace(" (", ": ", 1)[:-1]
        line += (f"; the cost model kept {len(cost)} in bfloat16 as too small to pay ({cost[0][0].name} at {why}); "
                 f"{always} or a node/module override 'float8' forces them")
    if shape:
        line += (f"; kept in bfloat16 for their shape (see the report): {', '.join(shape[:5])}"
                 + (", …" if len(shape) > 5 else ""))
    return [line]


def _choose_float8(gm: fx.GraphModule, conversion: Conversion) -> List[str]:
    """The rule after the categories: the float8 choice of each safe matmul (override values ``"float8"``/
    ``"no_float8"``), recorded on the nodes it decides; its note says how many run in float8."""
    options = conversion.options
    before = dict(conversion.decisions)
    choose(gm, conversion.decisions, conversion.policy, split_overrides(options.module_overrides)[1],
           split_overrides(options.node_overrides)[1])
    record({n: d for n, d in conversion.decisions.items() if d is not before[n]})
    return float8_notes(conversion.decisions, conversion.policy.float8)


FLOAT8_CHOICE = Pass("float8 choice", Stage.CLASSIFY, _choose_float8)
