"""Accuracy-driven fallback: move the fewest modules/ops to float32 until the output is accurate enough.

``autotune(model, "O1", example_inputs=batches, min_sqnr_db=30)`` (or ``metric=fn, tolerance=t``):

1. convert with the policy and compare the output with float32's on every batch; done if it holds;
2. otherwise measure each node side by side (:mod:`.numerics`) and rank the units that run in low
   precision (the innermost module owning a node, or a node at the root by itself) by the error
   they introduce (a node's SQNR drop below its inputs'; a float32 node's drop is charged to the
   low-precision units feeding it);
3. check that moving every unit to float32 meets the tolerance (else the error is not mixed
   precision's: an error says so), then bisect for the shortest prefix of the ranking that meets
   it (``log2(units)`` evaluations), and drop any unit of that prefix the tolerance holds without.

Under a policy with ``float8=``, a step comes first: every matmul that runs in float8 is measured
(:mod:`.float8`: its float8 result against its bfloat16 one) and each one under ``float8_min_sqnr_db``
is kept in bfloat16 (``node_overrides={name: "no_float8"}``); the search above then runs with those, its
default output target lowered to ``FLOAT8_OUTPUT_SQNR_DB`` (float8 keeps 3 mantissa bits: a healthy
network's output lands at 20-25 dB against float32).

The result is ``(converted, overrides)``: ``overrides`` is ``{"module_overrides": {path: "unsafe"},
"node_overrides": {node name: "unsafe"}, "overrides": {op: "unsafe"}}`` (the user's own overrides,
and what the search added), keyword arguments :func:`fxamp.convert` accepts as they are
(``fxamp.convert(model, "O1", **overrides)``); :func:`save_overrides` / :func:`load_overrides`
write and read it as JSON (ops by name).
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from ..conversion.convert import convert, policy_of
from ..errors import FxampError, warn_deprecated
from ..conversion.graph import CAST, DECISION, attr_target
from ..conversion.op_lists import op_name
from ..policy import Policy, device_type_of, resolve_policy
from .arguments import policy_and_inputs
from .float8 import FLOAT8_MIN_SQNR_DB, float8_refusals, measure_float8
from .numerics import SideBySide, as_batches, node_drops, sqnr
from .observe import bind_inputs

__all__ = ["autotune", "save_overrides", "load_overrides", "TuneResult"]

_FLOAT32 = "unsafe"  # the category that puts a node in float32
_JSON_VERSION = 2  # 2: "node_overrides" (files of version 1 have none)
#: autotune's default output target (dB against float32) for a policy with float8
FLOAT8_OUTPUT_SQNR_DB = 15.0


@dataclass(frozen=True)
class TuneResult:
    """How the search went (``autotune(..., return_result=True)``).

    units:        the candidate units, best first (module paths, or op names for root-level ops).
    chosen:       the units moved to float32.
    evaluations:  conversions evaluated against float32 (the first, with the policy as is, included).
    score_before / score_after: output SQNR in dB (or the metric) before and after.
    """

    units: Tuple[str, ...]
    chosen: Tuple[str, ...]
    evaluations: int
    score_before: float
    score_after: float
    float8_refused: Tuple[str, ...] = ()  # matmuls kept in bfloat16 for their measured float8 error


def autotune(
    model: nn.Module,
    policy: Union[str, Policy] = "O1",
    *deprecated_order: Any,
    example_inputs: Any = None,
    dtype: Union[str, torch.dtype, None] = None,
    min_sqnr_db: Optional[float] = None,
    metric: Optional[Callable[[Any, Any], float]] = None,
    tolerance: Optional[float] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    verbose: bool = False,
    return_result: bool = False,
    float8_min_sqnr_db: float = FLOAT8_MIN_SQNR_DB,
    **convert_options: Any,
) -> Any:
    """Convert ``model`` with ``policy``, moving the fewest modules/ops to float32 until the output holds.

    example_inputs: a tuple of forward arguments, or a list of such tuples (batches; all must hold); the
                 arguments are ``convert``'s (the older ``autotune(model, inputs, policy)`` still works for one
                 release, with a DeprecationWarning, as does ``inputs=``).
    min_sqnr_db: the output's SQNR against float32, in dB, on every batch (default 30).
    metric:      instead, ``metric(out_fp32, out_amp) -> float`` (or a one-element tensor), an error that
                 must stay ``<= tolerance``.  Give one criterion: both is an error, never one ignored.
    verbose:     print the search and the chosen overrides.
    float8_min_sqnr_db: a policy with ``float8=``: a float8 matmul whose result falls below this SQNR against
                 its bfloat16 result (dB, the worst batch) stays in bfloat16 (default 20).
    convert_options: as for :func:`fxamp.convert` (``frontend``, ``leaf_modules``, ``overrides``, ...).

    Returns ``(converted, overrides)`` (and a :class:`TuneResult` third with ``return_result=True``).
    """
    if "inputs" in convert_options:  # the older name of example_inputs
        if example_inputs is not None:
            raise TypeError("autotune got inputs= and example_inputs=: pass example_inputs= alone")
        warn_deprecated("autotune(inputs=...)", "write autotune(model, policy, example_inputs=...)")
        example_inputs = convert_options.pop("inputs")
    policy, inputs = policy_and_inputs("autotune", policy, deprecated_order, example_inputs, default="O1")
    if policy_of(model) is not None:
        raise ValueError("autotune needs the original float32 model: pass it, not the module fxamp.convert returned")
    if metric is not None and min_sqnr_db is not None:
        raise ValueError(f"autotune takes one criterion: min_sqnr_db={min_sqnr_db!r} or metric= with tolerance=, "
                         f"not both")
    if metric is not None and tolerance is None:
        raise ValueError("metric= needs tolerance=: the largest metric(out_fp32, out_amp) that is acceptable")
    if metric is None and tolerance is not None:
        raise ValueError(f"tolerance={tolerance!r} bounds metric=, which was not given: pass metric=callable(out_fp32, "
                         f"out_amp), or min_sqnr_db= alone")
    pol = resolve_policy(policy, dtype, device_type=device_type_of(model))
    if metric is None:
        default = FLOAT8_OUTPUT_SQNR_DB if pol.float8 is not None else 30.0
        min_sqnr_db = default if min_sqnr_db is None else min_sqnr_db
        if isinstance(min_sqnr_db, bool) or not isinstance(min_sqnr_db, (int, float)):
            raise ValueError(f"min_sqnr_db must be a number of dB (such as 30.0), not {min_sqnr_db!r}; "
                             f"or pass metric=")
    batches = as_batches(inputs)
    if not batches:
        raise ValueError("autotune compares outputs: pass example_inputs= (a tuple of forward arguments, or a list "
                         "of them)")
    kwargs = dict(example_kwargs or {})
    user_overrides = dict(convert_options.pop("overrides", None) or {})
    user_modules = dict(convert_options.pop("module_overrides", None) or {})
    user_nodes = dict(convert_options.pop("node_overrides", None) or {})

    def given() -> Dict[str, Dict[Any, Any]]:
        return {"module_overrides": dict(user_modules), "node_overrides": dict(user_nodes),
                "overrides": dict(user_overrides)}
    say = print if verbose else (lambda *a, **k: None)

    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            refs = [model(*b, **kwargs) for b in batches]

        def score(out_ref: Any, out: Any) -> float:
            if metric is None:
                return sqnr(out_ref, out)
            value = metric(out_ref, out)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                value = value.item()  # the natural (out - ref).abs().max()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                        else type(value).__name__)
                raise TypeError(f"metric must return a number (a float, or a one-element tensor), not {what}: "
                                f"reduce it, e.g. (out_amp - out_fp32).abs().max()")
            return float(value)

        def holds(value: float) -> bool:
            if math.isnan(value):
                return False
            return value <= tolerance if metric is not None else value >= min_sqnr_db

        evaluations = 0

        def build(units: Sequence[Tuple[str, Any]]) -> fx.GraphModule:
            chosen = given()
            for kind, key in units:
                chosen[_KEYS[kind]][key] = _FLOAT32
            return convert(model, policy, dtype=dtype, overrides=chosen["overrides"] or None,
                           module_overrides=chosen["module_overrides"] or None,
                           node_overrides=chosen["node_overrides"] or None,
                           example_inputs=batches[0], example_kwargs=kwargs or None, **convert_options)

        def evaluate(units: Sequence[Tuple[str, Any]]) -> Tuple[float, fx.GraphModule]:
            nonlocal evaluations
            evaluations += 1
            amp = build(units)
            amp.eval()
            with torch.no_grad():
                values = [score(r, amp(*b, **kwargs)) for r, b in zip(refs, batches)]
            worst = max(values) if metric is not None else min(values)
            if any(math.isnan(v) for v in values):
                worst = math.nan
            return worst, amp

        refused: Tuple[str, ...] = ()
        if pol.float8 is not None:  # first: keep in bfloat16 the float8 matmuls whose own error is too large
            first = build(())
            measured = measure_float8(first, batches, kwargs)
            refusals = {k: v for k, v in float8_refusals(first, measured, float8_min_sqnr_db).items()
                        if k not in user_nodes}
            user_nodes.update(refusals)
            refused = tuple(refusals)
            say(f"fxamp tune: float8 kept out of {len(refused)} matmul{'s' if len(refused) != 1 else ''} under "
                f"{float8_min_sqnr_db} dB against bfloat16" + (f": {', '.join(refused)}" if refused else ""))
        before, amp = evaluate(())
        target = f"metric <= {tolerance}" if metric is not None else f"SQNR >= {min_sqnr_db} dB"
        say(f"fxamp tune: {type(model).__name__} under {policy}: {_fmt(before, metric)} ({target})")
        if holds(before):
            say("fxamp tune: the tolerance holds as converted; no overrides")
            result = TuneResult((), (), evaluations, before, before, refused)
            return _returned(amp, given(), result, return_result)

        ranked = rank_units(amp, model, batches, kwargs)
        names = tuple(_unit_name(u) for u in ranked)
        say(f"fxamp tune: {len(ranked)} candidate units, ranked by the error they introduce: "
            f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}")
        if not ranked:
            raise FxampError(f"autotune: {_fmt(before, metric)} misses {target}, but nothing runs in low "
                             f"precision: the error is not mixed precision's")
        everything, _ = evaluate(ranked)
        if not holds(everything):
            raise FxampError(f"autotune: even with every low-precision op in float32 the output gives "
                             f"{_fmt(everything, metric)}, missing {target}: the difference is not from mixed "
                             f"precision (nondeterministic ops? a metric that is never met?); relax the tolerance")
        lo, hi = 1, len(ranked)  # the shortest prefix that holds lies in [lo, hi]; hi holds
        while lo < hi:
            mid = (lo + hi) // 2
            value, _ = evaluate(ranked[:mid])
            if holds(value):
                hi = mid
            else:
                lo = mid + 1
        chosen = list(ranked[:hi])
        for unit in list(reversed(chosen)):  # prune: units the tolerance holds without
            if len(chosen) == 1:
                break
            rest = [u for u in chosen if u != unit]
            value, _ = evaluate(rest)
            if holds(value):
                chosen = rest
        after, amp = evaluate(chosen)
        overrides = given()
        for kind, key in chosen:
            overrides[_KEYS[kind]][key] = _FLOAT32
        say(f"fxamp tune: {len(chosen)} unit{'s' if len(chosen) != 1 else ''} to float32 after {evaluations} "
            f"evaluations: {', '.join(_unit_name(u) for u in chosen)}; {_fmt(after, metric)}")
        say(json.dumps(overrides_to_json(overrides), indent=2))
        result = TuneResult(names, tuple(_unit_name(u) for u in chosen), evaluations, before, after, refused)
        return _returned(amp, overrides, result, return_result)
    finally:
        for m, mode in modes:
            m.training = mode


def _returned(amp: fx.GraphModule, overrides: Dict[str, Any], result: TuneResult, full: bool) -> Any:
    return (amp, overrides, result) if full else (amp, overrides)


def _fmt(value: float, metric: Any) -> str:
    return f"metric {value:.4g}" if metric is not None else f"output SQNR {value:.1f} dB"


#: the keyword of convert() that moves a unit of each kind
_KEYS = {"module": "module_overrides", "node": "node_overrides", "op": "overrides"}


def _unit_name(unit: Tuple[str, Any]) -> str:
    kind, key = unit
    return key if kind == "module" else f"node {key}" if kind == "node" else op_name(key)


def rank_units(amp: fx.GraphModule, model: nn.Module, batches: Sequence[Tuple[Any, ...]],
               kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The units (``("module", path)``, or ``("node", name)`` at the root) that run in low precision, by the
    error they introduce."""
    interp = SideBySide(amp, model)
    low_nodes = set()
    with torch.no_grad():
        for b in batches:
            interp.run(*bind_inputs(amp, b, kwargs))
    units: Dict[Tuple[str, Any], float] = {}
    order: List[Tuple[str, Any]] = []
    drops = node_drops(amp, interp.stats, policy_of(amp).compute)
    for n in amp.graph.nodes:
        d = n.meta.get(DECISION)
        if d is None or not n.op.startswith("call_") or attr_target(n) is not None:
            continue
        if interp.low.get(n.name):
            low_nodes.add(n)
            unit = _unit_of(n)
            if unit not in units:
                units[unit] = 0.0
                order.append(unit)
            units[unit] = max(units[unit], drops.get(n.name, 0.0))
    for n in amp.graph.nodes:  # a float32 node's drop is charged to the low-precision units feeding it
        if n.name in drops and n not in low_nodes and n.op.startswith("call_"):
            for i in n.all_input_nodes:
                while CAST in i.meta:
                    i = i.meta[CAST][0]
                if i in low_nodes:
                    unit = _unit_of(i)
                    units[unit] = max(units[unit], drops[n.name])
    return sorted(order, key=lambda u: -units[u])  # stable: graph order among equals


def _unit_of(node: fx.Node) -> Tuple[str, Any]:
    d = node.meta[DECISION]
    if d.module:
        return ("module", d.module)
    return ("node", node.name)  # at the root: this op alone, not every op of its kind


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def overrides_to_json(overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The overrides with op keys as names (``operator.mul``, ``aten.exp``, ``Tensor.sum``, ``torch.nn.GELU``)."""
    return {"version": _JSON_VERSION,
            "module_overrides": {str(k): _cat(v) for k, v in (overrides.get("module_overrides") or {}).items()},
            "node_overrides": {str(k): _cat(v) for k, v in (overrides.get("node_overrides") or {}).items()},
            "overrides": {op_name(k): _cat(v) for k, v in (overrides.get("overrides") or {}).items()}}


def _cat(value: Any) -> str:
    return str(getattr(value, "value", value))


def save_overrides(overrides: Dict[str, Any], path: str) -> None:
    """Write ``autotune``'s overrides to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(overrides_to_json(overrides), f, indent=2)
        f.write("\n")


def load_overrides(path: str) -> Dict[str, Any]:
    """Read overrides JSON (from :func:`save_overrides` or ``fxamp tune --save``): keyword arguments for ``convert``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read overrides file {path!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not JSON ({e}); write it with fxamp tune --save or fxamp.save_overrides") from e
    return overrides_from_json(data, where=path)


def overrides_from_json(data: Any, where: str = "overrides") -> Dict[str, Any]:
    if not isinstance(data, dict) or not set(data) <= {"version", "module_overrides", "node_overrides", "overrides"}:
        raise ValueError(f"{where}: expected an object with 'module_overrides', 'node_overrides' and 'overrides', "
                         f"as fxamp tune --save writes")
    mods = data.get("module_overrides") or {}
    nodes = data.get("node_overrides") or {}
    ops = data.get("overrides") or {}
    if not all(isinstance(m, dict) for m in (mods, nodes, ops)):
        raise ValueError(f"{where}: 'module_overrides', 'node_overrides' and 'overrides' must map names to categories")
    return {"module_overrides": dict(mods), "node_overrides": dict(nodes),
            "overrides": {resolve_op(name, where): cat for name, cat in ops.items()}}


def resolve_op(name: str, where: str = "overrides") -> Any:
    """An op key from its name: ``Tensor.sum``, ``aten.exp``, ``operator.mul``, ``torch.exp``, ``torch.nn.GELU``."""
    if name.startswith("Tensor."):
        return name
    obj: Any = None
    if name.startswith("aten."):
        obj = getattr(torch.ops.aten, name[5:], None)
    elif name.startswith("operator."):
        obj = getattr(operator, name[9:], None)
    elif name.startswith("torch."):
        obj = torch
        for part in name[6:].split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
    if obj is None:
        raise ValueError(f"{where}: unknown op {name!r}; name ops as Tensor.<method>, aten.<op>, operator.<op> or "
                         f"torch.<function>")
    return obj
