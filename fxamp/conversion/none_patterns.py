"""A torch.fx capture whose forward has inputs that default to None: a graph per None pattern.

torch.fx traces every input as a value, so ``if labels is not None:`` takes the branch where labels are
given and the graph ``convert`` captured has no path for a call without them::

    def forward(self, x, labels=None):                 amp = fxamp.convert(model, "O1")
        logits = self.head(x)                          amp(x, labels)   # the graph convert captured
        loss = None                                    amp(x)           # labels None: captured once more,
        if labels is not None:                                          # tracing labels as None, then kept
            loss = F.cross_entropy(logits, labels)     amp(x, None)     # the same graph as amp(x)
        return logits, loss

The converted ``GraphModule``'s call (its ``_wrapped_call``, :class:`NonePatterns`) looks at the inputs whose
default is None and which the graph computes with (``runtime.graph_module.optional_inputs``): a call that
gives them all runs the graph as before; one that leaves some None runs ``module``, a
:class:`~fxamp.conversion.lazy.LazyConverted` with ``frontend="fx"`` on the same parameters and buffers (O2
storage included), which captures with torch.fx once per (mode, None pattern), each input left None traced as
None.  ``graph``, ``code``, ``state_dict`` and ``fxamp.report`` stay the converted graph's; the graphs of the
other patterns are ``none_patterns(amp).graph_modules()``.  Copies and pickles take ``module`` along (it
captures again at its first call); a pickle of a model whose class pickle cannot find by name (one defined
in a function) leaves it out: the loaded module refuses a call that leaves those inputs None, saying why.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import LeafSpec
from .lazy import LazyConverted, call_fallback
from .options import ConvertOptions
from ..policy import Policy
from .runtime import NodeErrors
from .runtime.graph_module import none_pattern, optional_inputs

__all__ = ["NonePatterns", "with_none_patterns", "none_patterns"]


class NonePatterns(NodeErrors):
    """How a converted torch.fx ``GraphModule`` with optional inputs is called (see the module docstring):
    as any converted module (:class:`~fxamp.conversion.runtime.NodeErrors`), but a call that leaves one of
    ``optional`` ((position, name) pairs) None runs ``module``, which captures a graph for that pattern."""

    def __init__(self, module: LazyConverted, optional: Tuple[Tuple[int, str], ...]):
        self.module = module
        self.optional = optional

    def __call__(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        pattern = none_pattern(self.optional, args, kwargs)
        if not pattern:
            return super().__call__(gm, *args, **kwargs)
        names = ", ".join(pattern)
        return call_fallback(gm, self.module, args, kwargs, lambda _entry: (
            f"captured a graph with torch.fx for {names} None, sharing this module's parameters: the graph convert "
            f"captured traced {names} as given (`if {pattern[0]} is not None:` took that branch); calls leaving "
            f"them None run it from now on"))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "NonePatterns":
        return NonePatterns(copy.deepcopy(self.module, memo), self.optional)

    def __reduce__(self) -> Any:
        if not _pickles(self.module):  # the original's class has no importable name: the pickle keeps NodeErrors
            return (NodeErrors, ())
        return (NonePatterns, (self.module, self.optional))


def with_none_patterns(gm: fx.GraphModule, source: nn.Module, policy: Policy, options: ConvertOptions, *,
                       owns_model: bool, leaf_modules: Sequence[LeafSpec] = ()) -> fx.GraphModule:
    """Give ``gm`` (captured with torch.fx from ``source``) a :class:`NonePatterns` call when its forward has
    inputs that default to None and that it computes with; ``gm`` as it is otherwise."""
    optional = optional_inputs(gm)
    if not optional:
        return gm
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    lazy = LazyConverted(source, policy, options, owns_model=owns_model, tensors=tensors, frontend="fx",
                         leaf_modules=leaf_modules, optional=optional,
                         lead_note="captures with torch.fx a call that leaves an optional input None, once per "
                                   "(mode, None pattern), for the module convert captured with them given")
    gm._wrapped_call = NonePatterns(lazy, optional)
    gm.meta.setdefault("_user_preserved_attributes", {})["_wrapped_call"] = gm._wrapped_call
    return gm


def none_patterns(gm: nn.Module) -> Optional[LazyConverted]:
    """The :class:`LazyConverted` that captures the calls of ``gm`` (a module ``convert`` captured with torch.fx)
    that leave an optional input None, on ``gm``'s parameters; None if it has none."""
    call = gm.__dict__.get("_wrapped_call")
    return call.module if isinstance(call, NonePatterns) else None


class _NoTensors(pickle.Pickler):
    """A pickler that writes tensors as references: whether a module pickles, without copying its weights."""

    def persistent_id(self, obj: Any) -> Optional[int]:
        return id(obj) if isinstance(obj, torch.Tensor) else None


def _pickles(module: nn.Module) -> bool:
    try:
        _NoTensors(io.BytesIO()).dump(module)
    except Exception:  # any reason it does not pickle (a class defined in a function, a lambda attribute)
        return False
    return True
