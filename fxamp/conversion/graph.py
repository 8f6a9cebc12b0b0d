"""The contract between fxamp's passes: the ``node.meta`` keys they exchange, the :class:`Decision`
record, and the one copy of each graph helper they share.

Who writes and who reads each key (``docs/DESIGN.md`` draws the whole flow):

========================  ==================================  ==========================================
key                       written by                          read by
========================  ==================================  ==========================================
``DECISION`` "fxamp"      ``classify/`` (its first pass)      ``decision_of`` (rewrite, ``reporting``)
``CAST``  "fxamp_cast"    ``rewrite.insert_casts``            ``cast_of`` (``inference.DtypeInference``,
                                                              ``reporting``)
``ATTR``  "fxamp_attr"    ``rewrite.lower_attribute_reads``   ``attr_target`` (rewrite, inference,
                                                              reporting)
``MODULE`` "fxamp_module" ``capture.fx`` (inlined leaf calls)  ``module_path_of``, ``reporting``
========================  ==================================  ==========================================

A ``DECISION`` is a :class:`Decision`; a ``CAST`` is ``(source node, dtype)``; an ``ATTR`` is the
dotted name of the parameter or buffer the node reads; a ``MODULE`` is ``(module path, class)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from .op_lists import Category, Source
from ..info import remember_loaded, remember_origin

__all__ = [
    "keep_loaded_float32",
    "INPUT_DTYPE",
    "DECISION", "CAST", "ATTR", "MODULE", "RECEIVER", "Decision", "Float8Choice", "IslandChoice",
    "region_in_order", "fetch_attr", "attr_target", "module_path_of", "covering", "clean_export_path", "node_arg", "replace_node_arg",
    "canonical_names", "dedupe_get_attrs", "mirror_module_tree", "rename_node", "decision_of", "cast_of",
    "tensor_slots", "replace_tensors", "rebind",
]

DECISION = "fxamp"
CAST = "fxamp_cast"
ATTR = "fxamp_attr"
#: on a placeholder of a graph captured for one input dtype (a block's, ``blocks.py``): that dtype
INPUT_DTYPE = "fxamp_input_dtype"
MODULE = "fxamp_module"
#: on a method call whose receiver is an object, not a tensor (a KV cache's ``update``, recorded by the capture with
#: the call's values): the receiver's class name, so the report names ``DynamicCache.update``, not ``Tensor.update``
RECEIVER = "fxamp_receiver"


@dataclass(frozen=True)
class Float8Choice:
    """Whether a matmul that could run in float8 (a policy with ``float8=``) does, and why.

    chosen: runs in float8 (``conversion/classify/float8.py`` chose it); False: in the policy's compute dtype (bfloat16).
    reason: the rule that decided, in words (the shape, the cost model's row, an override).
    source: :class:`~fxamp.conversion.op_lists.Source`: DEFAULT (cost model), GRAPH (shape), or an override.
    """

    chosen: bool
    reason: str
    source: Source = Source.DEFAULT


@dataclass(frozen=True)
class IslandChoice:
    """Whether a float32 island (``conversion.rewrite.islands``) keeps its low-precision input for backward and
    recomputes its float32 ops there, instead of keeping the float32 tensors its ops save.

    island:  the island's name (its first node's, ``island_<node>``); every node of it carries the choice.
    chosen:  recomputed in backward; False: runs as it did (the reason says why).
    reason:  the rule that decided, in words.
    saved:   the dtype the island keeps for backward in place of float32 (the upcasts' inputs'), or None.
    entries: the names of the upcast nodes it starts from (the report counts the bytes saved from their shapes).
    source:  :class:`~fxamp.conversion.op_lists.Source`: DEFAULT (the rule), or a node/module override.
    chunked: its backward runs in chunks of rows (``conversion.runtime.recompute.row_plan``), holding one chunk's
             float32 tensors at a time; False: it recomputes the island whole.
    forward_chunked: its forward runs in chunks of rows too (a loss over an upcast and its views:
             ``conversion.runtime.recompute.deferred_upcast``), holding no float32 tensor of the input's size.
    """

    island: str
    chosen: bool
    reason: str
    saved: Optional[torch.dtype] = None
    entries: Tuple[str, ...] = ()
    source: Source = Source.DEFAULT
    chunked: bool = False
    forward_chunked: bool = False


@dataclass(frozen=True)
class Decision:
    """What fxamp does with one node.

    op:       qualified op name (``torch.nn.functional.linear``, ``Tensor.sum``, ``torch.nn.LayerNorm``).
    category: where the op sits (a conditional op keeps CONDITIONAL).
    reason:   the rule that decided, in words.
    compute:  the dtype its floating inputs are cast to before it runs; None: as they arrive.
    norm:     a normalisation op (its parameters follow ``Policy.norms``).
    source:   where the rule came from (:class:`~fxamp.conversion.op_lists.Source`).
    module:   the module path the node belongs to ("" for the root).
    resolved: what the node behaves as: its category, or for a conditional op the category its
              condition chose (safe, neutral or unsafe).
    float8:   a :class:`Float8Choice` for a matmul float8 could run (policy with ``float8=``), else None.
    recompute: an :class:`IslandChoice` for a node of a float32 island (``conversion.rewrite.islands``), else None.
    """

    op: str
    category: Category
    reason: str
    compute: Optional[torch.dtype]
    norm: bool = False
    source: Source = Source.OP_LIST
    module: str = ""
    resolved: Optional[Category] = None  # required: Decision.of fills it in from category
    float8: Optional[Float8Choice] = None
    recompute: Optional[IslandChoice] = None

    def __post_init__(self) -> None:
        """Checks only: :meth:`of` fills ``resolved`` in."""
        for name, kind in (("category", Category), ("resolved", Category), ("source", Source)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"Decision's {name} must be a {kind.__name__}, not {getattr(self, name)!r} "
                                f"(Decision.of sets resolved to the category)")

    @classmethod
    def of(cls, op: str, category: Category, reason: str, compute: Optional[torch.dtype], *, norm: bool = False,
           source: Source = Source.OP_LIST, module: str = "", resolved: Optional[Category] = None) -> "Decision":
        """A decision whose ``resolved`` is its category unless a condition chose another."""
        return cls(op, category, reason, compute, norm=norm, source=source, module=module,
                   resolved=category if resolved is None else resolved)


def decision_of(node: fx.Node) -> Optional[Decision]:
    """The :class:`Decision` the classify stage recorded on ``node`` (``meta[DECISION]``), or None."""
    return node.meta.get(DECISION)


def cast_of(node: fx.Node) -> Optional[Tuple[fx.Node, torch.dtype]]:
    """``(source node, dtype)`` for a cast the rewrite inserted (``meta[CAST]``), None for any other node."""
    return node.meta.get(CAST)


def region_in_order(graph: fx.Graph, region: Iterable[fx.Node]
                    ) -> Tuple[Dict[fx.Node, int], List[fx.Node], List[fx.Node]]:
    """``(each node's position in the graph, the region's nodes in graph order, the values they read from outside
    the region, first read first)``: what a pass moving a region into a call (checkpointing, islands) starts from."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = sorted(region, key=order.__getitem__)
    inside = set(nodes)
    outside = list(dict.fromkeys(v for n in nodes for v in n.all_input_nodes if v not in inside))
    return order, nodes, outside


def fetch_attr(module: nn.Module, target: str) -> Any:
    """The object at dotted path ``target`` below ``module`` (``"layers.0.weight"``)."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def attr_target(node: fx.Node) -> Optional[str]:
    """The dotted name of the parameter, buffer or constant a node reads, or None."""
    if node.op == "get_attr":
        return str(node.target)
    return node.meta.get(ATTR)


def module_path_of(node: fx.Node) -> str:
    """The module path a node belongs to: a call_module's target, else the innermost module it was traced in."""
    if node.op == "call_module":
        return str(node.target)
    if MODULE in node.meta:
        return node.meta[MODULE][0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        return clean_export_path(list(stack.values())[-1][0])
    return ""


V = TypeVar("V")


def covering(path: str, overrides: Mapping[str, V]) -> Optional[Tuple[str, V]]:
    """The override that covers the module at ``path``: the longest prefix of it, on a dot (``"enc"``
    covers ``"enc.0"``, not ``"encoder"``); ``""`` covers every module. ``(prefix, value)``, or None."""
    best = None
    for prefix, value in overrides.items():
        if path == prefix or path.startswith(prefix + ".") or prefix == "":
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, value)
    return best


def clean_export_path(path: str) -> str:
    """``"L['self'].encoder.layers[3]"`` (torch.export's spelling) -> ``"encoder.layers.3"``."""
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
    return path.replace("[", ".").replace("]", "").replace("'", "").replace("..", ".")


def node_arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """An argument given by position ``index`` or keyword ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def replace_node_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    """Set the argument at position ``index`` / keyword ``name``, wherever the node passes it."""
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def canonical_names(model: nn.Module) -> Dict[int, str]:
    """``id(tensor) -> its first dotted name`` for every parameter and buffer (tied ones: one name)."""
    names: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names


def dedupe_get_attrs(graph: fx.Graph) -> None:
    """Keep one ``get_attr`` node per target (the first in graph order)."""
    first: Dict[str, fx.Node] = {}
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        keep = first.setdefault(node.target, node)
        if keep is not node:
            node.replace_all_uses_with(keep)
            graph.erase_node(node)


def mirror_module_tree(gm: fx.GraphModule, model: nn.Module, keep_buffers: bool = True) -> None:
    """Give ``gm`` exactly the original's children, parameters and buffers, in order.

    ``GraphModule`` copies only the attributes its graph uses (and rebuilds inlined parents as
    bare Modules); mirroring the original keeps ``state_dict`` keys, unused parameters and
    submodule classes intact.  With ``keep_buffers``, tensor constants the tracer made
    (``_tensor_constant0``) stay as non-persistent buffers, so ``state_dict`` keys stay the original's.
    """
    # nn.Module's own tables (_modules/_parameters/_buffers): the public iterators drop duplicate
    # names (a module or tensor registered twice) and cannot clear a module, and the
    # non-persistent set has no public reader; copying the tables is the only exact mirror.
    constants = ({k: v for k, v in gm._buffers.items() if k not in model._buffers and k not in model._modules}
                 if keep_buffers else {})
    for table in (gm._modules, gm._parameters, gm._buffers):
        table.clear()
    for name, p in model._parameters.items():
        gm.register_parameter(name, p)
    for name, b in model._buffers.items():
        gm.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
    for name, m in model._modules.items():
        gm.add_module(name, m)
    for name, t in constants.items():
        gm.register_buffer(name, t, persistent=False)
    gm.training = model.training


def rename_node(graph: fx.Graph, node: fx.Node, name: str) -> None:
    """Give ``node`` the name an erased node had, so users (and the report) keep knowing it by that name.

    FX never frees an erased node's name; its namespace has no public way to, so this reaches
    into ``_graph_namespace._used_names`` and fails loudly (not silently) if FX renames it.
    """
    used = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)
    if not isinstance(used, set):  # pragma: no cover - only if torch.fx changes its internals
        raise RuntimeError("fxamp: torch.fx's graph namespace changed (no _used_names set); "
                           "please report this with your torch version")
    used.discard(name)
    node._rename(name)


# ---------------------------------------------------------------------------------------------
# Re-binding parameters and buffers
# ---------------------------------------------------------------------------------------------


def tensor_slots(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """``(dotted name, owner, attribute, tensor)`` for every registered parameter and buffer below
    ``module``, a tied or twice-registered tensor once per place it is registered.

    The owners' own ``_parameters``/``_buffers`` tables: ``named_parameters()`` hides duplicate
    names, and a re-binding must reach every place.
    """
    for path, m in module.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    yield (f"{path}.{name}" if path else name), m, name, t


def replace_tensors(module: nn.Module, new_for: Callable[[str, torch.Tensor], Optional[torch.Tensor]]
                    ) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Re-bind every parameter and buffer for which ``new_for(dotted name, tensor)`` gives a
    replacement (None: keep it).  ``new_for`` is asked once per tensor object, at its first name,
    so tied tensors stay tied.  ``setattr``, so RNNs refresh their flat weights.  Returns
    ``{name: (old, new)}`` for every name re-bound."""
    made: Dict[int, Optional[torch.Tensor]] = {}
    changed: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for name, owner, attr, t in list(tensor_slots(module)):
        if id(t) not in made:
            made[id(t)] = new_for(name, t)
        new = made[id(t)]
        if new is not None and new is not t:
            setattr(owner, attr, new)
            changed[name] = (t, new)
    return changed


def rebind(module: nn.Module, dtypes: Mapping[str, torch.dtype], *, values: bool = True
           ) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Re-bind the parameters and buffers ``dtypes`` names (dotted, as in ``state_dict``) to copies
    in those dtypes; tensors already in theirs are left alone, tied tensors stay tied (one copy).

    A parameter's copy is an ``nn.Parameter`` with the same ``requires_grad``.  ``values=False``
    leaves parameters' copies uninitialised (stand-ins for a trace with fake values); buffers'
    copies always hold the values (a forward may read them).  Returns ``{name: (old, new)}``.
    """
    def new_for(name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
        dtype = dtypes.get(name)
        if dtype is None or dtype == t.dtype:
            return None
        if isinstance(t, nn.Parameter):
            data = t.detach().to(dtype) if values else torch.empty_like(t, dtype=dtype)
            new = nn.Parameter(data, requires_grad=t.requires_grad)
            if values:
                remember_origin(new, t)  # a master is made from ``t``'s exact values (fxamp.info.ORIGIN)
            return new
        return t.detach().to(dtype)

    return replace_tensors(module, new_for)


def keep_loaded_float32(module: nn.Module, state_dict: Mapping[str, Any], prefix: str) -> None:
    """Before ``load_state_dict`` copies into a converted module (its ``_load_from_state_dict``): a float32 value
    loaded into a low-precision parameter below it (a float32 checkpoint) is copied into the stored dtype, as torch
    does, and kept as its float32 original (``fxamp.info.remember_loaded``), so a master built later, or one that
    follows the load, starts from the loaded values, not their rounding.  (A method, not a load hook: a hook holds
    its module, which a pickled converted root or block, rebuilt from its ``__dict__``, cannot hold.)"""
    for name, p in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            remember_loaded(p, value)
