"""The options of a conversion, as one frozen object: :class:`ConvertOptions`, and the two string enums
it holds, :class:`DebugOverflow` and :class:`Dynamic`.

``fxamp.convert(model, policy, **keywords)`` builds one ``ConvertOptions`` (its constructor
checks and normalises every keyword) and hands it on unchanged: to ``capture`` (``dynamic``), to
``pipeline.rewrite_captured`` (everything else) and, when the capture waits for the first call, to
:class:`~fxamp.conversion.lazy.LazyConverted`, which keeps it for every later capture.  It pickles and deep-copies
(a deep copy shares it: nothing in it changes).

Each option has one type.  The enums are ``str`` enums, so ``"raise"`` and ``DebugOverflow.RAISE``
are interchangeable wherever an option is given; the old ``True``/``False`` forms are refused
with a ``TypeError`` that names the value to write instead.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type, TypeVar, Union

from ..dtypes import StrEnum
from ..errors import warn_deprecated
from .op_lists import DEFAULT_OP_LISTS, Category, OpEntry, OpKey, OpLists, op_key

__all__ = ["ConvertOptions", "DebugOverflow", "Dynamic", "ModuleOverrides", "NodeOverrides", "parse_option",
           "RECOMPUTE", "NO_RECOMPUTE", "WHOLE_FORWARD"]

#: module path -> category: every op under the module (``{"encoder.layers.3": "unsafe"}``)
ModuleOverrides = Mapping[str, Union[str, Category, OpEntry]]
#: node name (the report's ``node`` column) -> category: one op, wherever it is (a root-level op too)
NodeOverrides = Mapping[str, Union[str, Category, OpEntry]]

#: override values (``node_overrides``/``module_overrides``) that decide a float32 island (``conversion.rewrite.islands``)
RECOMPUTE = "recompute"  # recompute the island this node belongs to whatever the rule says (where it can)
NO_RECOMPUTE = "no_recompute"  # keep this node's island as it runs without recomputation
WHOLE_FORWARD = "whole_forward"  # the rule decides the recompute; a loss's forward then runs whole, not in row chunks
_ISLAND_VALUES = (RECOMPUTE, NO_RECOMPUTE, WHOLE_FORWARD)


class DebugOverflow(StrEnum):
    """``convert(debug_overflow=...)``: overflow checks after every node (:mod:`fxamp.conversion.rewrite.debug`)."""

    OFF = "off"  # no checks, no cost
    RECORD = "record"  # record the first node whose output or gradient has inf/NaN (fxamp.overflow_info)
    RAISE = "raise"  # raise FxampError there


class Dynamic(StrEnum):
    """``convert(dynamic=...)``: which input dims a ``torch.export`` capture keeps dynamic."""

    BATCH = "batch"  # dim 0, and the sequence dim of token ids, masks and (batch, length, features) inputs
    ALL = "all"  # every dim (image sizes too: slower to export)
    NONE = "none"  # none: every size is fixed at the capture's


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
    model, the policy and the capture's inputs, with ``convert``'s keywords: the constructor accepts
    the enums' strings and applies ``overrides`` (an init-only argument) to ``op_lists``.

    op_lists:         the op lists (None: the defaults), with the user's ``overrides`` applied.
    module_overrides: ``{module path: category}``, or None.
    node_overrides:   ``{node name: category}``, or None.
    weight_cache:     reuse low-precision weight copies across no-grad calls.
    debug_overflow:   :class:`DebugOverflow`.
    dynamic:          :class:`Dynamic` (``torch.export`` captures only).
    override_keys:    the op keys of the user's ``overrides`` (already in ``op_lists``), so that the
                      classification can say which of them matched no op of the graph.
    recompute_islands: float32 islands whose inputs are exact upcasts keep those low-precision inputs for
                      backward and recompute (``conversion.rewrite.islands``).
    island_overrides: ``(("node" or "module", name or path, RECOMPUTE or NO_RECOMPUTE), ...)``: the
                      ``node_overrides``/``module_overrides`` entries with those values (the constructor moves them here).
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
    overrides: InitVar[Optional[Mapping[OpKey, Union[str, Category, OpEntry]]]] = None

    def __post_init__(self, overrides: Optional[Mapping[OpKey, Union[str, Category, OpEntry]]]) -> None:
        """Normalise ``convert``'s keywords (strings, None, empty mappings, ``overrides``), then check."""
        lists = self.op_lists if self.op_lists is not None else DEFAULT_OP_LISTS
        if not isinstance(lists, OpLists):
            raise TypeError(f"op_lists must be an fxamp.conversion.op_lists.OpLists, not {type(lists).__name__}")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"overrides must be a mapping such as {{torch.exp: 'neutral', nn.GELU: 'unsafe'}}, "
                            f"not {type(overrides).__name__}")
        if overrides:
            lists = lists.with_overrides(overrides)
            object.__setattr__(self, "override_keys", tuple(op_key(k) for k in overrides))
        if not isinstance(self.weight_cache, bool):
            raise TypeError(f"weight_cache must be True or False, not {self.weight_cache!r}")
        if not isinstance(self.recompute_islands, bool):
            raise TypeError(f"recompute_islands must be True or False, not {self.recompute_islands!r}")
        if not isinstance(self.island_overrides, tuple):
            raise TypeError(f"island_overrides must be a tuple, not {type(self.island_overrides).__name__}")
        self._split_island_overrides()
        if not isinstance(self.override_keys, tuple):
            raise TypeError(f"override_keys must be a tuple, not {type(self.override_keys).__name__}")
        object.__setattr__(self, "op_lists", lists)
        for name in ("module_overrides", "node_overrides"):
            object.__setattr__(self, name, _frozen_mapping(getattr(self, name), name))
        object.__setattr__(self, "debug_overflow", parse_option(DebugOverflow, self.debug_overflow, what="debug_overflow"))
        object.__setattr__(self, "dynamic", parse_option(Dynamic, self.dynamic, what="dynamic"))

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
        """Deprecated: the constructor takes the same keywords, ``ConvertOptions(overrides=..., dynamic="all")``."""
        warn_deprecated("ConvertOptions.build(...)", "write ConvertOptions(...): the constructor takes convert's keywords")
        return cls(op_lists=op_lists, overrides=overrides, module_overrides=module_overrides,
                   node_overrides=node_overrides, weight_cache=weight_cache, debug_overflow=debug_overflow,
                   dynamic=dynamic, recompute_islands=recompute_islands)

    def _split_island_overrides(self) -> None:
        """``"recompute"``/``"no_recompute"`` values of ``module_overrides``/``node_overrides`` are no categories:
        they move to ``island_overrides`` (checked against ``recompute_islands``)."""
        module_overrides = _frozen_mapping(self.module_overrides, "module_overrides")
        node_overrides = _frozen_mapping(self.node_overrides, "node_overrides")
        islands = tuple((kind, key, value) for kind, given in (("module", module_overrides), ("node", node_overrides))
                        for key, value in (given or {}).items() if value in _ISLAND_VALUES)
        islands = self.island_overrides + islands
        forced = next((key for _, key, value in islands if value == RECOMPUTE), None)
        if forced is not None and not self.recompute_islands:
            raise ValueError(f"overrides: {forced!r} asks for {RECOMPUTE!r}, but recompute_islands=False turns "
                             f"recomputation off; drop one of the two")
        if islands:
            module_overrides = {k: v for k, v in (module_overrides or {}).items() if v not in _ISLAND_VALUES}
            node_overrides = {k: v for k, v in (node_overrides or {}).items() if v not in _ISLAND_VALUES}
        object.__setattr__(self, "module_overrides", module_overrides or None)
        object.__setattr__(self, "node_overrides", node_overrides or None)
        object.__setattr__(self, "island_overrides", islands)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ConvertOptions":
        return self  # immutable: copies of a converted module share it
