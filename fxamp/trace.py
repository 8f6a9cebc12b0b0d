"""Front ends: capture an ``nn.Module`` as a ``torch.fx.GraphModule`` the later stages can classify.

``capture`` is the only entry point.  The ``fx`` front end runs ``torch.fx.symbolic_trace`` with
torch.nn modules as leaves, then *inlines* the simple leaf modules (Linear, ConvNd, Embedding,
PReLU) into their functional form so their weights become graph values that can be cast once
and shared.  The ``export`` front end (``torch.export``) lives in ``export.py``; both return a
:class:`Captured` whose module tree, parameters and buffers are the original model's, under the
same names, so ``state_dict`` keys never change.
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .errors import TraceError
from .runtime import call_module_cast, cast, cast_weights

__all__ = ["Captured", "capture", "module_path_of"]

LeafSpec = Union[str, Type[nn.Module]]


@dataclass
class Captured:
    """A captured graph and how it was captured."""

    graph_module: fx.GraphModule
    frontend: str  # "fx" or "export"
    notes: List[str] = field(default_factory=list)  # what the front end decided, for the report


def capture(
    model: nn.Module,
    *,
    frontend: str = "auto",
    leaf_modules: Sequence[LeafSpec] = (),
    example_inputs: Optional[Tuple[Any, ...]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    dynamic: bool = True,
) -> Captured:
    """Capture ``model`` as a graph.

    frontend: ``"fx"`` (symbolic tracing, no inputs needed), ``"export"`` (``torch.export``, needs
    example inputs) or ``"auto"``: fx first, export when fx fails and example inputs were given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxamp converts nn.Module instances, not {type(model).__name__}")
    if frontend not in ("auto", "fx", "export"):
        raise ValueError(f"frontend={frontend!r} is not one of 'auto', 'fx', 'export'")
    if isinstance(model, fx.GraphModule) and hasattr(model, "_fxamp_info"):
        raise ValueError("this module was already converted by fxamp; convert the original model instead")
    has_inputs = example_inputs is not None or example_kwargs is not None
    if frontend == "export" or (frontend == "auto" and has_inputs and _prefers_export(model)):
        return _capture_export(model, example_inputs, example_kwargs, dynamic, leaf_modules, note=None)
    try:
        return _capture_fx(model, leaf_modules)
    except TraceError as e:
        if frontend == "auto" and has_inputs:
            note = f"torch.fx could not trace the model ({e.short}); captured with torch.export instead"
            return _capture_export(model, example_inputs, example_kwargs, dynamic, leaf_modules, note=note)
        raise


def _prefers_export(model: nn.Module) -> bool:
    return False


def _capture_export(model, example_inputs, example_kwargs, dynamic, leaf_modules, note):
    from .export import capture_export  # torch.export is heavy: import it only when used

    return capture_export(model, example_inputs, example_kwargs, dynamic=dynamic,
                          leaf_modules=leaf_modules, note=note)


# ---------------------------------------------------------------------------------------------
# torch.fx front end
# ---------------------------------------------------------------------------------------------


class _Tracer(fx.Tracer):
    # fxamp's run-time casts stay calls when a converted module is traced again (FX re-traces
    # the generated code when it unpickles a GraphModule).
    def __init__(self, leaf_types: Tuple[type, ...] = (), leaf_paths: Tuple[str, ...] = ()):
        super().__init__(autowrap_functions=(cast, cast_weights, call_module_cast))
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_paths:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _split_leaves(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> Tuple[Tuple[type, ...], Tuple[str, ...]]:
    types, paths = [], []
    names = dict(model.named_modules())
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        elif isinstance(leaf, str):
            if leaf not in names:
                raise ValueError(
                    f"leaf_modules: {leaf!r} is not a submodule path of {type(model).__name__}; "
                    f"some paths it has: {', '.join(list(names)[1:6]) or '(none)'}"
                )
            paths.append(leaf)
        else:
            raise TypeError(f"leaf_modules takes nn.Module classes or module paths (str), not {leaf!r}")
    return tuple(types), tuple(paths)


def _capture_fx(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> Captured:
    from .modes import capture_in_both_modes, make_modes_switchable

    leaf_types, leaf_paths = _split_leaves(model, leaf_modules)

    def trace() -> fx.GraphModule:
        tracer = _Tracer(leaf_types, leaf_paths)
        # Trace a shallow copy: the tracer stores tensor constants as attributes of the root, and
        # the user's model must not change.
        root = copy.copy(model)
        root.__dict__ = dict(model.__dict__)
        try:
            graph = tracer.trace(root)
        except Exception as e:  # anything torch.fx raises while running forward on proxies
            raise _trace_error(model, tracer, e) from e
        return fx.GraphModule(root, graph, class_name=type(model).__name__)

    # traced in both modes: functional dropout flags (F.dropout(x, p, self.training)) become
    # switchable again when the modes trace the same ops (fxamp/modes.py)
    gm, mode, notes = capture_in_both_modes(model, trace)
    _mirror_module_tree(gm, model)
    _canonicalize_get_attrs(gm, model)
    _inline_simple_modules(gm)
    notes += make_modes_switchable(gm, mode)
    gm.graph.lint()
    gm.recompile()
    return Captured(gm, "fx", notes)


def _trace_error(model: nn.Module, tracer: _Tracer, e: Exception) -> TraceError:
    stack = list(getattr(tracer, "module_stack", {}).keys())
    path = next((p for p in reversed(stack) if p), "")
    owner = dict(model.named_modules()).get(path, model)
    where = _user_frame(e)
    msg_first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    short = f"{type(e).__name__}: {msg_first}"
    hint_path = repr(path) if path else "a submodule path such as 'encoder'"
    text = (
        f"torch.fx could not trace {type(owner).__name__} "
        f"(module {('at ' + repr(path)) if path else 'at the root'}){where}:\n"
        f"    {short}\n"
        f"What to do: keep that module opaque with leaf_modules=[{hint_path}] (it then runs whole, "
        f"in float32 unless you override its category), convert its submodules separately, or pass "
        f"example_inputs=(...) so fxamp captures the model with torch.export instead."
    )
    err = TraceError(text)
    err.short = short
    err.module_path = path
    return err


def _user_frame(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    fx_dir = os.path.join(torch_dir, "fx")
    outside_fx = [f for f in frames if not f.filename.startswith((fx_dir, here))]
    user = [f for f in outside_fx if not f.filename.startswith(torch_dir)]
    frame = (user or outside_fx or frames or [None])[-1]
    if frame is None:
        return ""
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f", {frame.filename}:{frame.lineno}{code}"


def _mirror_module_tree(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give ``gm`` exactly the original's children, parameters and buffers, in order.

    ``GraphModule`` copies only the attributes its graph uses (and rebuilds inlined parents as
    bare Modules); mirroring the original keeps ``state_dict`` keys, unused parameters and
    submodule classes intact.
    """
    # tensor constants the tracer made (``_tensor_constant0``) are buffers of gm only: keep them,
    # non-persistent, so state_dict keys stay the original's
    constants = {k: v for k, v in gm._buffers.items() if k not in model._buffers and k not in model._modules}
    for name in list(gm._modules):
        del gm._modules[name]
    for name in list(gm._parameters):
        del gm._parameters[name]
    for name in list(gm._buffers):
        del gm._buffers[name]
    for name, p in model._parameters.items():
        gm.register_parameter(name, p)
    for name, b in model._buffers.items():
        gm.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
    for name, m in model._modules.items():
        gm.add_module(name, m)
    for name, t in constants.items():
        gm.register_buffer(name, t, persistent=False)
    gm.training = model.training


def _canonical_names(model: nn.Module) -> Dict[int, str]:
    names: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names


def _canonicalize_get_attrs(gm: fx.GraphModule, model: nn.Module) -> None:
    """Name each tied parameter by one path, so one value is cast once whoever uses it."""
    canonical = _canonical_names(model)
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            value = _fetch(gm, node.target)
        except AttributeError:
            continue
        name = canonical.get(id(value))
        if name is not None and name != node.target:
            node.target = name
    _dedupe_get_attrs(gm.graph)


def _dedupe_get_attrs(graph: fx.Graph) -> None:
    first: Dict[str, fx.Node] = {}
    for node in [n for n in graph.nodes if n.op == "get_attr"]:  # graph order, not insertion order
        keep = first.setdefault(node.target, node)
        if keep is not node:
            node.replace_all_uses_with(keep)
            graph.erase_node(node)


def _fetch(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def module_path_of(node: fx.Node) -> str:
    """The module path a node belongs to: a call_module's target, else the innermost module it was traced in."""
    if node.op == "call_module":
        return str(node.target)
    if "fxamp_module" in node.meta:
        return node.meta["fxamp_module"][0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean_export_path(path)
    return ""


def _clean_export_path(path: str) -> str:
    # torch.export spells paths as "L['self'].encoder.layers[3]" or "encoder.layers.3"
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
    return path.replace("[", ".").replace("]", "").replace("'", "").replace("..", ".")


def _has_hooks(m: nn.Module) -> bool:
    g = nn.modules.module
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        or g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )


_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}


def _functional_form(m: nn.Module, node: fx.Node) -> Optional[Tuple[Any, List[Any], Tuple[Any, ...]]]:
    """(function, tensor attribute names, extra args) when ``m(x)`` equals ``function(x, *tensors, *extra)``."""
    kind = type(m)
    if len(node.args) != 1 or node.kwargs or _has_hooks(m):
        return None
    if kind is nn.Linear:
        return F.linear, ["weight", "bias"], ()
    if kind in _CONV and m.padding_mode == "zeros":
        return _CONV[kind], ["weight", "bias"], (m.stride, m.padding, m.dilation, m.groups)
    if kind in _CONV_T and m.padding_mode == "zeros":
        return _CONV_T[kind], ["weight", "bias"], (m.stride, m.padding, m.output_padding, m.groups, m.dilation)
    if kind is nn.PReLU:
        return F.prelu, ["weight"], ()
    if kind is nn.Embedding and m.max_norm is None:  # max_norm renormalises the table in place
        return F.embedding, ["weight"], (m.padding_idx, None, m.norm_type, m.scale_grad_by_freq, m.sparse)
    return None


def _inline_simple_modules(gm: fx.GraphModule) -> None:
    """Replace ``call_module`` of plain Linear/ConvNd/PReLU/Embedding with the functional call over get_attr weights.

    The weight then is a graph value: cast once per forward however many nodes use it (tied
    weights included), stored in low precision by O2, and visible in the report.
    """
    modules = dict(gm.named_modules())
    canonical = _canonical_names(gm)
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_module")):
        m = modules[node.target]
        form = _functional_form(m, node)
        if form is None:
            continue
        fn, attrs, extra = form
        with graph.inserting_before(node):
            tensors = []
            for attr in attrs:
                t = getattr(m, attr)
                tensors.append(None if t is None else graph.get_attr(canonical.get(id(t), f"{node.target}.{attr}")))
            new = graph.call_function(fn, (node.args[0], *tensors, *extra))
        new.meta = dict(node.meta)
        new.meta["fxamp_module"] = (str(node.target), type(m))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    _dedupe_get_attrs(graph)
