"""Which input dims a ``torch.export`` capture keeps dynamic, and the note that says so truthfully.

``dynamic="batch"`` asks ``Dim.AUTO`` for the dims users change between calls (:func:`usual_dims`);
``Dim.AUTO`` lets the model decide: torch.export keeps a dim symbolic unless the model's code fixes
it, and then returns a plain size without failing.  :func:`fixed_dims` finds those dims after the
capture, :func:`shape_note` names them ("dim 1 of x is static: the model specialised it (...)"),
and the export front end's call-time check refuses another size with the same reason; a lazily
capturing module keys its cache on those sizes (:data:`STATIC_SIZES`) and captures again.

A dim export keeps dynamic may still hold only in a range: a Python branch on it (``if x.shape[0] > 2``)
or a slice of a fixed-size table narrows ``range_constraints``.  :func:`dim_ranges` reads those ranges
after the capture and :func:`check_range` refuses a size outside them in fxamp's words
(:class:`OutsideCapturedRange`), before torch.export's own input check would in its words; a lazily
capturing module catches that error and captures again for the call's range.

Sizes 0 and 1 are outside every such range: ``Dim.AUTO`` starts a dynamic dim at 2, and the capture
decides ``x.shape[0] == 1`` (or a squeeze, a broadcast) as for a size of at least 2 without recording a
guard, so torch's own check lets a size-1 call run the other branch's graph.  :func:`check_range`
refuses it too, and the refusal is the signal: a lazily capturing module keys its calls on 0/1 sizes and
captures for them anyway; a module ``convert`` captured from example inputs catches it and captures a
graph for that call's range on the same parameters (``lazy.RangeFallback``).  Only where the user gave
``dynamic_shapes=`` does the call fail, naming them.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ...errors import FxampError
from ..options import Dynamic

__all__ = ["STATIC_SIZES", "OutsideCapturedRange", "OtherInputSet", "Range", "asked_dims", "check_range", "dim_ranges", "dynamic_shapes",
           "fixed_dims", "input_name", "shape_note", "usual_dims"]

#: ``gm.meta`` key of a captured graph module's ``static_sizes(args, kwargs)``: the sizes a call
#: gives the dims the capture kept static (set by the export front end's input binding)
STATIC_SIZES = "fxamp_static_sizes"

#: (lowest, highest) size a dynamic dim's capture holds for; None where unbounded on that side
Range = Tuple[Optional[int], Optional[int]]


class OutsideCapturedRange(FxampError):
    """A call gives a dynamic dim a size outside the range its capture holds for (:func:`check_range`).

    Raised by the converted module's input binding, a forward pre-hook: nothing of forward ran, so a
    lazily capturing module can capture again for the call's size.
    """


class OtherInputSet(TypeError):
    """A call gives inputs other than the ones its torch.export capture took (``labels`` left out, or given where
    the capture had none).  Raised by the converted module's input binding, before anything of forward ran:
    a module ``convert`` captured from example inputs captures the call again (``lazy.RangeFallback``)."""


def input_name(node: fx.Node) -> str:
    """The forward parameter a placeholder stands for: its target (torch.fx renames a node that would shadow a
    builtin: ``nn.Sequential``'s ``input`` is the node ``input_1``)."""
    return node.target if isinstance(node.target, str) else node.name


def usual_dims(t: torch.Tensor) -> range:
    """The dims users change between calls: batch; the sequence of token ids, masks, ``(batch, samples)``
    waveforms and ``(batch, length, features)``.  Not the sizes of images (rank ≥ 4 floats): see the
    module docstring.  A 2-D float may be ``(batch, features)`` instead: the model's first layer then
    fixes dim 1 (``Dim.AUTO``), and the shape note says so."""
    if t.dim() == 0:
        return range(0)
    if t.dim() >= 2 and (not t.is_floating_point() or t.dim() <= 3):
        return range(2)
    return range(1)


def asked_dims(signature: Optional[inspect.Signature], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               shapes: Any) -> Dict[str, Tuple[int, ...]]:
    """Top-level tensor input name -> the dims ``shapes`` (made by :func:`dynamic_shapes`) asks dynamic."""
    if signature is None or not isinstance(shapes, dict):
        return {}
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:  # pragma: no cover - dynamic_shapes raised already
        return {}
    flat = {**{k: v for k, v in bound.items()
               if signature.parameters[k].kind is not inspect.Parameter.VAR_KEYWORD},
            **next((v for k, v in bound.items()
                    if signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD), {})}
    return {name: tuple(shapes[name]) for name, value in flat.items()
            if isinstance(value, torch.Tensor) and isinstance(shapes.get(name), dict)}


def fixed_dims(gm: fx.GraphModule, asked: Dict[str, Tuple[int, ...]]) -> Dict[str, Dict[int, str]]:
    """Input name -> {dim: why} for each dim asked dynamic that the capture made static.

    With ``Dim.AUTO`` torch.export does not fail when the model fixes a dim: the placeholder's size
    comes back as a plain int.  The note and the call-time check then tell the truth about it.
    """
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    fixed: Dict[str, Dict[int, str]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        name = input_name(node)
        if name not in asked or not isinstance(val, torch.Tensor):
            continue
        for dim in asked[name]:
            if dim < val.dim() and is_concrete_int(val.shape[dim]):
                size = int(val.shape[dim])
                why = (f"the example has size {size} there, and torch.export specialises sizes 0 and 1: "
                       f"capture with a size of at least 2" if size < 2 else
                       f"its code depends on the size being {size}: a Python loop or range over it, a view "
                       f"or reshape to a constant size, or a layer of that width")
                fixed.setdefault(name, {})[dim] = why
    return fixed


def _dims(value: Any, every_dim: bool) -> Any:
    """``{dim: Dim.AUTO}`` for the dynamic dims of every tensor in ``value`` (same structure), None elsewhere."""
    from torch.export import Dim

    def spec(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return {i: Dim.AUTO for i in (range(leaf.dim()) if every_dim else usual_dims(leaf))}
        return None

    return pytree.tree_map(spec, value)


def dynamic_shapes(signature: Optional[inspect.Signature], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    every_dim: bool) -> Any:
    if signature is None:  # pragma: no cover
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"example inputs do not fit the model's forward{signature}: {e}") from None
    shapes: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            # as top-level names: the export root's signature names them (_export_root), since torch.export
            # fails on a **kwargs entry in dynamic_shapes ("Must provide a tree_name when there might be a
            # mismatch", torch 2.9)
            shapes.update({k: _dims(v, every_dim) for k, v in value.items()})
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(_dims(v, every_dim) for v in value)
        else:
            shapes[name] = _dims(value, every_dim)
    return shapes


def shape_note(gm: fx.GraphModule, dynamic: Union[Dynamic, str],
                fixed: Optional[Dict[str, Dict[int, str]]] = None) -> str:
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    parts = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims = ", ".join(str(d) if is_concrete_int(d) else "*" for d in val.shape)
            parts.append(f"{input_name(node)} ({dims})")
    if not parts:
        return "no tensor inputs"
    how = {Dynamic.BATCH: "dynamic batch and sequence dims (dynamic='batch': dim 0, and dim 1 of token/mask, "
                          "(batch, samples) and (batch, length, features) inputs; dynamic='all' for every dim, "
                          "e.g. image sizes)",
           Dynamic.ALL: "every dim dynamic (dynamic='all')",
           Dynamic.NONE: "static shapes (dynamic='none')",
           "given": "dynamic_shapes as given"}[dynamic]
    note = f"{how}; input sizes, * = dynamic: " + ", ".join(parts)
    for name, dims in (fixed or {}).items():
        for dim, why in dims.items():
            note += f"; dim {dim} of {name} is static: the model specialised it ({why})"
    return note


def _as_int(bound: Any) -> Optional[int]:
    """A range bound as an int; None for torch's integer infinities (``int_oo``) and anything not an integer."""
    import sympy

    if isinstance(bound, bool):
        return None
    return int(bound) if isinstance(bound, (int, sympy.Integer)) else None


def dim_ranges(gm: fx.GraphModule) -> Dict[str, Dict[int, Range]]:
    """Input name -> {dim: (low, high)} for each dynamic dim of a top-level input whose capture holds only in
    a range narrower than any size: export's ``range_constraints`` on a dim that is one plain symbol.

    A lower bound of 2 is a bound (every ``Dim.AUTO`` dim has it): the capture assumed sizes 0 and 1 away,
    though torch's own check lets them through (see the module docstring).  A lower bound of 0 or 1 (a
    ``dynamic_shapes=`` range torch kept) is none.  Dims related to others (``2 * s0``), or a layout this
    does not recognise, give no entry: torch.export's input check, which stays on the module, still
    refuses them, in its own words.
    """
    constraints = getattr(gm, "range_constraints", None)
    if not isinstance(constraints, dict) or not constraints:
        return {}
    ranges: Dict[str, Dict[int, Range]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            expr = getattr(getattr(size, "node", None), "expr", None) if isinstance(size, torch.SymInt) else None
            bounds = constraints.get(expr) if getattr(expr, "is_Symbol", False) else None
            if bounds is None:
                continue
            low, high = _as_int(getattr(bounds, "lower", None)), _as_int(getattr(bounds, "upper", None))
            low = low if low is not None and low >= 2 else None
            if low is not None or high is not None:
                ranges.setdefault(input_name(node), {})[dim] = (low, high)
    return ranges


def _describe_range(low: Optional[int], high: Optional[int]) -> str:
    if low is not None and high is not None:
        return f"sizes {low} to {high}"
    return f"sizes >= {low}" if low is not None else f"sizes <= {high}"


def check_range(name: str, value: Any, ranges: Dict[int, Range], dynamic: Any) -> None:
    """Refuse a size of input ``name`` outside the range its capture holds for, saying what to do."""
    if not isinstance(value, torch.Tensor):
        return
    for dim, (low, high) in ranges.items():
        if dim >= value.dim():
            continue
        got = int(value.shape[dim])
        if low == 2 and got < 2 and dynamic == "given":
            raise OutsideCapturedRange(
                f"input {name!r} has size {got} in dim {dim}, but your dynamic_shapes= declared that dim for sizes "
                f">= 2 (torch.export assumes sizes 0 and 1 away there), so this graph may compute something else for "
                f"size {got}. What to do: call with sizes of at least 2 in dim {dim}, or convert without "
                f"dynamic_shapes= (that module captures a graph again for a call outside its range)")
        if low == 2 and got < 2:
            raise OutsideCapturedRange(
                f"input {name!r} has size {got} in dim {dim}, but torch.export captured that dim for sizes >= 2 "
                f"only (it assumes sizes 0 and 1 away: code such as `if {name}.shape[{dim}] == 1`, a squeeze or a "
                f"broadcast of that dim was recorded as for a larger size), so this graph may compute something "
                f"else for size {got}. What to do: convert with example inputs of size {got} in dim {dim} (a module "
                f"for that size), or with frontend='export' and no example inputs (that module captures again for "
                f"sizes 0 and 1)")
        if (low is not None and got < low) or (high is not None and got > high):
            given = (" or widen that dim's range in dynamic_shapes=" if dynamic == "given" else "")
            raise OutsideCapturedRange(
                f"input {name!r} has size {got} in dim {dim}, but this capture holds only for "
                f"{_describe_range(low, high)} there: torch.export recorded the model's code for the example "
                f"inputs' size, and that code depends on the size (a Python branch on "
                f"`{name}.shape[{dim}]`, or a slice of a fixed-size table). What to do: convert with "
                f"frontend='export' and no example inputs (that module captures again for each range it is "
                f"called with), or convert with example inputs whose sizes are in the range you will call it "
                f"with{given}")
