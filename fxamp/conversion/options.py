"""The options of a conversion, as one frozen object: :class:`ConvertOptions`, and the two string enums
it holds, :class:`DebugOverflow` and :class:`Dynamic`.

``fxamp.convert(model, policy, **keywords)`` builds one ``ConvertOptions`` (:meth:`ConvertOptions.build`
checks and normalises every keyword) and hands it on unchanged: to ``capture`` (``dynamic``), to
``pipeline.rewrite_captured`` (everything else) and, when the capture waits for the first call, to
:class:`~fxamp.LazyConverted`, which keeps it for every later capture.  It pickles and deep-copies
(a deep copy shares it: nothing in it changes).

Each option has one type.  The enums are ``str`` enums, so ``"raise"`` and ``DebugOverflow.RAISE``
are interchangeable wherever an option is given; the old ``True``/``False`` forms are refused
with a ``TypeError`` that names the value to write instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type, TypeVar, Union

from .op_lists import DEFAULT_OP_LISTS, Category, OpEntry, OpKey, OpLists, op_key

__all__ = ["ConvertOptions", "DebugOverflow", "Dynamic", "ModuleOverrides", "NodeOverrides", "parse_option",
           "RECOMPUTE", "NO_RECOMPUTE"]

#: module path -> category: every op under the module (``{"encoder.layers.3": "unsafe"}``)
ModuleOverrides = Mapping[str, Union[str, Category, OpEntry]]
#: node name (the report's ``node`` column) -> category: one op, wherever it is (a root-level op too)
NodeOverrides = Mapping[str, Union[str, Category, OpEntry]]

#: override values (``node_overrides``/``module_overrides``) that decide a float32 island (``conversion.islands``)
RECOMPUTE = "recompute"  # recompute the island this node belongs to whatever the rule says (where it can)
NO_RECOMPUTE = "no_recompute"  # keep this node's island as it runs without recomputation


class DebugOverflow(str, enum.Enum):
    """``convert(debug_overflow=...)``: overflow checks after every node (:mod:`fxamp.conversion.debug`)."""

    OFF = "off"  # no checks, no cost
    RECORD = "record"  # record the first node whose output or gradient has inf/NaN (fxamp.overflow_info)
    RAISE = "raise"  # raise FxampError there

    def __str__(self) -> str:
        return self.value


class Dynamic(str, enum.Enum):
    """``convert(dynamic=...)``: which input dims a ``torch.export`` capture keeps dynamic."""

    BATCH = "batch"  # dim 0, and the sequence dim of token ids, masks and (batch, length, features) inputs
    ALL = "all"  # every dim (image sizes too: slower to export)
    NONE = "none"  # none: every size is fixed at the capture's

    def __str__(self) -> str:
        return self.value


#: what each refused bool meant, for the error that names the new spelling
_BOOL_MEANT: Dict[type, Dict[bool, str]] = {
    DebugOverflow: {True: "record", False: "off"},
    Dynamic: {True: "batch", False: "none"},
}

E = TypeVar("E", DebugOverflow, Dynamic)


def parse_option(kind: Type[E], value: Union[str, E], *, what: str) -> E:
    """``value`` as a member of the enum ``kind``: a member, or its string (``"raise"``).

    A bool (the old spelling) is a ``TypeError`` naming the string it meant; any other value a
    ``ValueError`` naming the valid ones.
    """
    valid = ", ".join(repr(m.value) for m in kind)
    if isinstance(value, bool):
        raise TypeError(f"{what}={value!r} is no longer accepted: write {what}={_BOOL_MEANT[kind][value]!r} "
                        f"(one of {valid})")
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"{what}={value!r} is not one of {valid}")


def _frozen_mapping(value: Optional[Mapping[str, Any]], what: str) -> Optional[Mapping[str, Any]]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping such as {{'encoder.layers.3': 'unsafe'}}, "
                        f"not {type(value).__name__}")
    return dict(value) or None


@dataclass(frozen=True)
class ConvertOptions:
    """How a conversion classifies, rewrites and captures; everything ``convert`` takes except the
    model, the policy and the capture's inputs.  Build one with :meth:`build` (which accepts the
    enums' strings and applies ``overrides``); the constructor only checks types.

    op_lists:         the op lists, with the user's ``overrides`` applied.
    module_overrides: ``{module path: category}``, or None.
    node_overrides:   ``{node name: category}``, or None.
    weight_cache:     reuse low-precision weight copies across no-grad calls.
    debug_overflow:   :class:`DebugOverflow`.
    dynamic:          :class:`Dynamic` (``torch.export`` captures only).
    override_keys:    the op keys of the user's ``overrides`` (already in ``op_lists``), so that the
                      classification can say which of them matched no op of the graph.
    recompute_islands: float32 islands whose inputs are exact upcasts keep those low-precision inputs for
                      backward and recompute (``conversion.islands``).
    island_overrides: ``(("node" or "module", name or path, RECOMPUTE or NO_RECOMPUTE), ...)``: the
                      ``node_overrides``/``module_overrides`` entries with those values (:meth:`build` moves them here).
    """

    op_lists: OpLists = field(default_factory=lambda: DEFAULT_OP_LISTS)
    module_overrides: Optional[ModuleOverrides] = None
    node_overrides: Optional[NodeOverrides] = None
    weight_cache: bool = True
    debug_overflow: DebugOverflow = DebugOverflow.OFF
    dynamic: Dynamic = Dynamic.BATCH
    override_keys: Tuple[OpKey, ...] = ()
    recompute_islands: bool = True
    island_overrides: Tuple[Tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        checks = (("op_lists", OpLists, "an fxamp.OpLists"), ("weight_cache", bool, "a bool"),
                  ("recompute_islands", bool, "a bool"), ("island_overrides", tuple, "a tuple"),
                  ("debug_overflow", DebugOverflow, "a DebugOverflow (ConvertOptions.build accepts its strings)"),
                  ("dynamic", Dynamic, "a Dynamic (ConvertOptions.build accepts its strings)"))
        for name, kind, words in checks:
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"{name} must be {words}, not {value!r}")
        for name in ("module_overrides", "node_overrides"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name} must be a dict or None, not {type(value).__name__}")
        if not isinstance(self.override_keys, tuple):
            raise TypeError(f"override_keys must be a tuple, not {type(self.override_keys).__name__}")

    @classmethod
    def build(
        cls,
        *,
        op_lists: Optional[OpLists] = None,
        overrides: Optional[Mapping[OpKey, Union[str, Category, OpEntry]]] = None,
        module_overrides: Optional[ModuleOverrides] = None,
        node_overrides: Optional[NodeOverrides] = None,
        weight_cache: bool = True,
        debug_overflow: Union[str, DebugOverflow] = DebugOverflow.OFF,
        dynamic: Union[str, Dynamic] = Dynamic.BATCH,
        recompute_islands: bool = True,
    ) -> "ConvertOptions":
        """Check and normalise ``convert``'s keywords, then construct (the arguments are ``convert``'s)."""
        lists = op_lists if op_lists is not None else DEFAULT_OP_LISTS
        if not isinstance(lists, OpLists):
            raise TypeError(f"op_lists must be an fxamp.OpLists, not {type(lists).__name__}")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"overrides must be a mapping such as {{torch.exp: 'neutral', nn.GELU: 'unsafe'}}, "
                            f"not {type(overrides).__name__}")
        if overrides:
            lists = lists.with_overrides(overrides)
        if not isinstance(weight_cache, bool):
            raise TypeError(f"weight_cache must be True or False, not {weight_cache!r}")
        if not isinstance(recompute_islands, bool):
            raise TypeError(f"recompute_islands must be True or False, not {recompute_islands!r}")
        module_overrides = _frozen_mapping(module_overrides, "module_overrides")
        node_overrides = _frozen_mapping(node_overrides, "node_overrides")
        islands = tuple((kind, key, value) for kind, given in (("module", module_overrides), ("node", node_overrides))
                        for key, value in (given or {}).items() if value in (RECOMPUTE, NO_RECOMPUTE))
        forced = next((key for _, key, value in islands if value == RECOMPUTE), None)
        if forced is not None and not recompute_islands:
            raise ValueError(f"overrides: {forced!r} asks for {RECOMPUTE!r}, but recompute_islands=False turns "
                             f"recomputation off; drop one of the two")
        if islands:
            module_overrides = {k: v for k, v in module_overrides.items() if v not in (RECOMPUTE, NO_RECOMPUTE)} \
                if module_overrides else None
            node_overrides = {k: v for k, v in node_overrides.items() if v not in (RECOMPUTE, NO_RECOMPUTE)} \
                if node_overrides else None
        return cls(op_lists=lists,
                   module_overrides=module_overrides or None,
                   node_overrides=node_overrides or None,
                   recompute_islands=recompute_islands, island_overrides=islands,
                   weight_cache=weight_cache,
                   debug_overflow=parse_option(DebugOverflow, debug_overflow, what="debug_overflow"),
                   dynamic=parse_option(Dynamic, dynamic, what="dynamic"),
                   override_keys=tuple(op_key(k) for k in (overrides or {})))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ConvertOptions":
        return self  # immutable: copies of a converted module share it
