"""Running the converted graph once on example inputs, keeping each node's argument and result metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ..dtypes import dtype_name
from ..errors import FxampError
from ..conversion.graph import DECISION
from .formats import unique

__all__ = ["Meta", "Recorder", "observe_run", "leaves", "dtype_of_meta", "bind_inputs"]


@dataclass(frozen=True)
class Meta:
    dtype: torch.dtype
    shape: Tuple[int, ...]


def meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return Meta(value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(meta_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(meta_of(v) for v in value.values())
    return None


class Recorder(fx.Interpreter):
    """Runs the converted graph node by node and keeps each node's argument and result metadata."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.args: Dict[fx.Node, Any] = {}
        self.results: Dict[fx.Node, Any] = {}
        self.current: Optional[fx.Node] = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        if n.op != "placeholder":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.args[n] = (meta_of(args), {k: meta_of(v) for k, v in kwargs.items()})
        result = super().run_node(n)
        self.results[n] = meta_of(result)
        return result


def bind_inputs(gm: fx.GraphModule, inputs: Optional[Tuple[Any, ...]], kwargs: Dict[str, Any]) -> List[Any]:
    """The graph's placeholder values for positional ``inputs`` and keyword ``kwargs`` (defaults filled in)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = list(inputs or ())
    variadic = any(str(n.target).startswith("*") for n in placeholders)
    names = {str(n.target) for n in placeholders} | {n.name for n in placeholders}
    unknown = [k for k in kwargs if k not in names]
    if unknown and not variadic:  # named, so a misspelt keyword is not reported as a missing input
        raise ValueError(f"the model's forward has no argument {', '.join(map(repr, unknown))}; its arguments are "
                         f"{', '.join(str(p.target) for p in placeholders) or 'none'}")
    if len(args) > len(placeholders) and not variadic:
        raise ValueError(f"the model's forward takes {len(placeholders)} input{'s' if len(placeholders) != 1 else ''} "
                         f"({', '.join(str(p.target) for p in placeholders)}); {len(args)} example inputs were given")
    for n in placeholders[len(args):]:
        if str(n.target).startswith("*"):
            break  # *args / **kwargs: take what is left (nothing)
        if n.name in kwargs or n.target in kwargs:
            args.append(kwargs.get(n.target, kwargs.get(n.name)))
        elif n.args:
            args.append(n.args[0])  # the default value
        else:
            raise ValueError(f"the model's forward takes {len(placeholders)} inputs ("
                             f"{', '.join(p.target for p in placeholders)}); {len(inputs or ())} example inputs "
                             f"were given{' and ' + ', '.join(kwargs) + ' by keyword' if kwargs else ''}, "
                             f"not {n.target}")
    return args


def observe_run(gm: fx.GraphModule, inputs: Optional[Tuple[Any, ...]], kwargs: Dict[str, Any]) -> Recorder:
    """Run ``gm`` once under ``no_grad`` on the inputs, recording every node (errors name the node)."""
    rec = Recorder(gm)
    args = bind_inputs(gm, inputs, kwargs)
    with torch.no_grad():
        try:
            rec.run(*args)
        except Exception as e:
            node = rec.current
            where = ""
            if node is not None:
                d = node.meta.get(DECISION)
                what = f"{d.op}{f' in {d.module}' if d.module else ''}" if d is not None else str(node.target)
                where = f" at node {node.name} ({what})"
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if "without overflow" in first:
                hint = ("a constant does not fit the low-precision dtype this op runs in; keep the op in float32 "
                        "with overrides= / module_overrides=, or write the constant from torch.finfo(x.dtype)")
            else:
                hint = "check the example inputs' shapes and dtypes"
            raise FxampError(f"running the converted model on the example inputs failed{where}: "
                             f"{type(e).__name__}: {first}; {hint}") from e
    return rec


def leaves(tree: Any) -> List[Meta]:
    if isinstance(tree, Meta):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [m for t in tree for m in leaves(t)]
    if isinstance(tree, dict):
        return [m for t in tree.values() for m in leaves(t)]
    return []

def dtype_of_meta(meta: Any) -> Optional[str]:
    found = leaves(meta)
    if not found:
        return None
    return "|".join(unique(dtype_name(m.dtype) for m in found))

