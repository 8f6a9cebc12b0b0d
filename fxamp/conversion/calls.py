"""A block's call as a graph sees it: :func:`flatten_call` splits ``(args, kwargs)`` into a hashable key,
the leaves that become graph inputs (tensors and opaque objects) and a tree to rebuild the call from;
:func:`bound_root` is the module torch.fx traces for one call (``blocks.py``); :func:`undo_point` keeps what a
call's opaque objects held, so a graph whose late guard fails can be undone::

    block(h, mask=None, cache=c, use_cache=True)
      key    ((("T", float32, 3, "cpu"),), (("cache", ("O", DynamicCache)), ("mask", ("C", NoneType, None)),
                                     ("use_cache", ("C", bool, True))))
      leaves [h, c]                  -> forward(self, arg0, cache, <lifted attributes>)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..dtypes import short_name

__all__ = ["SIMPLE", "ContainerWritten", "flatten_call", "rebuild_call", "leaf_names", "describe_call", "bound_root",
           "undo_point"]

#: values a call's key holds as constants (baked into its graph); anything else that is not a tensor is opaque
SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def flatten_call(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, List[Any], Any]:
    """(key, leaves, tree): tensors and opaque objects become leaves (graph inputs); None, numbers, strings,
    dtypes and ``torch.Size`` values stay constants in ``tree`` and in the key."""
    leaves: List[Any] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return ("T", x.dtype, x.dim(), x.device.type)  # (a graph may hold the device type: concrete.py)
        kind = type(x)
        if kind in (tuple, list):
            return (kind, tuple(walk(v) for v in x))
        if kind is dict:
            return (dict, tuple((k, walk(v)) for k, v in x.items()))
        if isinstance(x, SIMPLE) or kind is torch.Size:  # (a Size is a shape: its sizes are constants too)
            return ("C", kind, x)
        leaves.append(x)
        return ("O", kind)

    tree = (tuple(walk(a) for a in args), tuple((k, walk(kwargs[k])) for k in sorted(kwargs)))
    return tree, leaves, tree  # (keywords walked in sorted order: the leaves follow the tree)


def rebuild_call(tree: Any, leaves: Sequence[Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    it = iter(leaves)

    def build(node: Any) -> Any:
        tag = node[0]
        if tag in ("T", "O"):
            return next(it)
        if tag == "C":
            return node[2]
        if tag is dict:
            return {k: build(v) for k, v in node[1]}
        return tag(build(v) for v in node[1])

    args = tuple(build(a) for a in tree[0])
    kwargs = {k: build(v) for k, v in tree[1]}
    return args, kwargs


def leaf_names(tree: Any, count: int) -> List[str]:
    """Placeholder names: the argument's name, with an index for a leaf inside a container."""
    names = [name for node, name in _named_nodes(tree, "arg{}".format, str, "{}_{}".format, "{}_{}".format)
             if node[0] in ("T", "O")]
    clean = ["".join(c if c.isalnum() or c == "_" else "_" for c in n) for n in names]
    seen: Dict[str, int] = {}
    out = []
    for n in clean:
        n = n if n and not n[0].isdigit() else f"x_{n}"
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    assert len(out) == count
    return out


def describe_call(tree: Any, leaves: Sequence[Any]) -> str:
    args, kwargs = rebuild_call(tree, leaves)

    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{short_name(v.dtype)}[{v.dim()}d]"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(one(x) for x in v) + ")"
        if isinstance(v, SIMPLE):
            return repr(v)
        return type(v).__name__
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) or "no arguments"


def bound_root(block: nn.Module, cls: type, tree: Any, names: List[str],
                lifted: Tuple[Tuple[str, str], ...], values: Optional[Tuple[Any, ...]] = None,
                drop: Sequence[str] = ()) -> nn.Module:
    """What torch.fx traces: the block's class's own forward, with the call's constants baked in, its
    tensors and opaque objects as inputs, and the lifted attributes as inputs set on the submodules
    for the trace only."""
    lifted_names = [f"_fxamp_attr_{p.replace('.', '_')}_{a}" if p else f"_fxamp_attr_{a}" for p, a in lifted]
    if values is not None:  # set as constants, not taken as inputs (torch.export)
        scope_values = {f"_v{i}": v for i, v in enumerate(values)}
        lifted_names, given = [], ", ".join(scope_values)
    else:
        scope_values, given = {}, ", ".join(lifted_names)
    params = ", ".join(["self", *names, *lifted_names])
    scope: Dict[str, Any] = dict(scope_values)
    exec(f"def forward({params}):\n    return _call(self, ({', '.join(names)}{',' if names else ''}), "
         f"({given}{',' if given else ''}))\n", scope)

    def _call(self: nn.Module, leaves: Tuple[Any, ...], values: Tuple[Any, ...]) -> Any:
        args, kwargs = rebuild_call(tree, leaves)
        owners = [(self.get_submodule(p) if p else self, a) for p, a in lifted]
        old = [o.__dict__.get(a) for o, a in owners]
        for (owner, attr), v in zip(owners, values):
            owner.__dict__[attr] = v
        held = [c for v in (*args, *kwargs.values()) for c in _contents(v)]  # (in the tree's order, as _names)
        try:
            out = cls.forward(self, *args, **kwargs)
        finally:
            for (owner, attr), v in zip(owners, old):
                owner.__dict__[attr] = v
        changed = next((name for (c, before), name in zip(held, _names(held, tree)) if _changed(c, before)), None)
        if changed is not None:
            raise ContainerWritten(
                f"{cls.__name__}.forward changes the {type(changed[0]).__name__} it is given as {changed[1]} "
                f"(an item assigned, added or removed): a graph returns values and cannot change its caller's "
                f"{type(changed[0]).__name__}, so no capture can keep that; make the block return the new values")
        return out

    scope["forward"].__globals__["_call"] = _call
    traced = type(cls.__name__, (cls,), {"forward": scope["forward"], "__module__": cls.__module__})
    root = traced.__new__(traced)
    root.__dict__ = {k: v for k, v in block.__dict__.items() if k not in drop}
    for table in ("_parameters", "_buffers", "_modules"):
        root.__dict__[table] = dict(block.__dict__[table])
    for table in _CALL_HOOKS:  # the block's own hooks run at its real call, not inside a capture (FSDP2's reshard)
        if table in root.__dict__:
            root.__dict__[table] = type(root.__dict__[table])()
    return root


class ContainerWritten(RuntimeError):
    """A block's forward changed a list or dict of its call (:func:`bound_root`): no capture can keep that."""

    raised_after_forward = True  # (checked once forward returned: no line of the model's to name)


def _contents(x: Any, out: Optional[List[Tuple[Any, Any]]] = None) -> List[Tuple[Any, Any]]:
    """Each list and dict in an argument of a rebuilt call, with a shallow copy of what it held."""
    out = [] if out is None else out
    if type(x) is list or type(x) is tuple:
        if type(x) is list:
            out.append((x, list(x)))
        for v in x:
            _contents(v, out)
    elif type(x) is dict:
        out.append((x, dict(x)))
        for v in x.values():
            _contents(v, out)
    return out


def _changed(container: Any, before: Any) -> bool:
    if type(container) is list:
        return len(container) != len(before) or any(a is not b for a, b in zip(container, before))
    return container.keys() != before.keys() or any(container[k] is not before[k] for k in before)


def _names(held: List[Tuple[Any, Any]], tree: Any) -> List[Tuple[Any, str]]:
    """``(container, the argument it is or sits in)`` for each of :func:`_contents`'s, in its order."""
    names = [name for node, name in _named_nodes(tree, "argument {}".format, repr, "{}[{!r}]".format, "{}[{}]".format)
             if node[0] is list or node[0] is dict]
    return [(c, n) for (c, _), n in zip(held, names)]


def _named_nodes(tree: Any, arg: Callable[[int], str], keyword: Callable[[str], str], key: Callable[[str, Any], str],
                 item: Callable[[str, int], str]) -> List[Tuple[Any, str]]:
    """Every node of a call's tree (:func:`flatten_call`) with a name, in the leaves' order: ``arg(i)`` or
    ``keyword(k)`` for an argument, ``key(name, k)`` / ``item(name, i)`` for what a dict / tuple or list holds."""
    out: List[Tuple[Any, str]] = []

    def walk(node: Any, name: str) -> None:
        out.append((node, name))
        if node[0] is dict:
            for k, v in node[1]:
                walk(v, key(name, k))
        elif node[0] in (tuple, list):
            for i, v in enumerate(node[1]):
                walk(v, item(name, i))

    for i, a in enumerate(tree[0]):
        walk(a, arg(i))
    for k, v in tree[1]:
        walk(v, keyword(k))
    return out


_CALL_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def undo_point(block: nn.Module, leaves: Sequence[Any]) -> Callable[[], bool]:
    """A way back to the state before a call that may fail a late guard (a branch read after a KV cache's
    ``update``): the attributes and container contents of the call's opaque objects, kept by reference.
    Undoing puts them back, and succeeds only if no tensor among them, the call's tensors or the block's
    buffers changed in place (a cache that rebinds ``keys = cat(keys, k)`` can be undone; one that
    writes into a preallocated tensor, or a batch norm's statistics, cannot)."""
    saved: List[Tuple[Any, Any]] = []
    versions: List[Tuple[torch.Tensor, int]] = [(t, t._version) for t in block.buffers()]
    seen: set = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            versions.append((x, x._version))
            return
        if isinstance(x, SIMPLE) or isinstance(x, nn.Module) or callable(x) or id(x) in seen:
            return
        seen.add(id(x))
        if type(x) is list:
            saved.append((x, list(x)))
            values: Any = x
        elif type(x) is dict:
            saved.append((x, dict(x)))
            values = x.values()
        elif type(x) in (tuple, set, frozenset):
            values = x
        elif hasattr(x, "__dict__"):
            saved.append((x, dict(x.__dict__)))
            values = x.__dict__.values()
        else:
            return
        for v in list(values):
            walk(v)

    for leaf in leaves:
        walk(leaf)

    def undo() -> bool:
        if any(t._version != v for t, v in versions):
            return False
        for obj, state in saved:
            if type(obj) is list:
                obj[:] = state
            elif type(obj) is dict:
                obj.clear()
                obj.update(state)
            else:
                obj.__dict__.clear()
                obj.__dict__.update(state)
        return True
    return undo
