"""A family of converted blocks (``fxamp.convert_``, ``blocks.py``): instances of one class that share graphs.

A :class:`Family` captures its class's forward at the first call per call signature and runs the graph
with ``self`` = the called instance::

    Family.run(block, args, kwargs)
      ├─ key: the call's structure (which arguments are None, constants' values, tensors' dtypes); for a
      │  signature torch.export captured, each tensor's range class too (per dim: size 0, 1 or >= 2)
      ├─ graphs[key] hit → the graph's code, run with ``self`` = this block (guards pick among variants)
      └─ miss → capture the class's own forward: torch.fx; else torch.fx with the call's values
         (``capture/concrete.py``); else torch.export when no argument is an opaque object
         → classify → rewrite (storage kept) → cache

A graph reads the block's tensors through ``self``, never through the capture's copy, so the graph of one
instance runs any instance of its family.

A graph runs inline the submodules its capture traced through, where a hook never runs: the family's
instances have hooks on the same submodules (kept as calls, or the block runs as written), and each call
first checks that no hook came or went since (:func:`hook_watch`); one that did moves the block to the family
of its new hooked submodules (:meth:`Family.rehome`), which captures with them kept as calls.

A torch.export graph holds for a range of sizes only: ``Dim.AUTO`` starts a dynamic dim at 2 and records a
branch on ``x.size(0) == 1`` as for a larger size, with no guard; a branch on ``x.size(0) > 2`` narrows the
range.  Its code runs here without torch's input checks, so a signature export captured keys its graphs by
range class (size 0, 1 or >= 2 per dim: a new class captures again, a new size within one does not), and
each export graph checks the narrower ranges it holds for as an early guard (outside: the next variant, or a
capture for that range).
"""

from __future__ import annotations

import copy
import itertools
import logging
import operator
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen

from .calls import bound_root, describe_call, flatten_call, leaf_names, undo_point
from .capture import capture, capture_with_values
from .capture.hooks import HOOK_DICTS, global_hooks, submodule_hooks
from .capture.common import user_line
from .capture.carried_state import CarriedState
from .capture.concrete import LATE_BRANCH, GuardFailed, LateGuardFailed, guard
from .capture.modes import MODE_FLAG, ModeFlag
from .capture.shapes import STATIC_SIZES, dim_ranges, input_name
from ..dtypes import LOW
from ..errors import FxampError, TraceError
from .graph import INPUT_DTYPE, fetch_attr, node_arg, replace_node_arg
from ..info import INFO_ATTR, origin_of
from .storage import float32_for_capture
from .options import ConvertOptions
from .pipeline import rewrite_captured
from ..policy import Policy
from .runtime.held_values import BOUND, HELD, Held, bind, values_now

__all__ = ["Family", "FAMILY", "LIFTED", "HOOKS", "PRIVATE", "OriginalDtypes", "follow_the_mode", "hook_watch"]

logger = logging.getLogger("fxamp")

#: a converted block's attribute holding its Family
FAMILY = "_fxamp_family"
#: a converted block's attribute holding the values of its family's lifted attributes
LIFTED = "_fxamp_lifted"
#: a converted block's attribute holding what each call checks for hooks on its submodules (:func:`hook_watch`)
HOOKS = "_fxamp_hooks"
#: a converted block's own attributes, which the module torch.fx traces must not have
PRIVATE = (FAMILY, LIFTED, HOOKS, INFO_ATTR, BOUND)


def hook_watch(block: nn.Module, path: str) -> Tuple[Tuple[Any, ...], Tuple[Any, ...], Tuple[int, ...], str]:
    """``(empty, held, counts, path)``: the hook tables of ``block``'s submodules (``HOOK_DICTS``, where
    ``register_*_hook`` adds), those empty now and those holding hooks with their sizes, and the block's path.

    :meth:`Family.run` checks them at every call: ``any(empty)`` and the sizes of ``held`` (a few at most:
    submodules hooked at conversion, torch's weight_norm): about a microsecond per block call (timeit, a GPT-2
    block's 48 empty tables, one thread, AMD EPYC: 1.1 us).  What it cannot see: a hook removed and another added
    to one table between two calls (its size stays), only in a table that held hooks at the last look: a module
    kept as a call then, unless those were torch's pure hooks (weight_norm) and the one added is the user's."""
    tables = [getattr(m, t) for p, m in block.named_modules() if p for t in HOOK_DICTS]
    held = tuple(t for t in tables if t)
    return tuple(t for t in tables if not t), held, tuple(map(len, held)), path


class Family:
    """Instances of one module class with the same structure: the graphs they share, by call signature.

    lifted:  ``(submodule path, attribute)`` of plain attributes whose values differ between the
             instances; a capture reads them as graph inputs, so every instance runs its own values.
    glue:    module-level: the policy's outputs, and the report marks its rows.
    hooked:  the submodules with hooks of their own in each instance (a capture keeps them as calls);
    kin:     the families by hooked submodules that instances of this one move between (:meth:`rehome`).
    """

    def __init__(self, cls: type, paths: List[str], policy: Policy, options: ConvertOptions,
                 lifted: Tuple[Tuple[str, str], ...], glue: bool, hooked: Tuple[str, ...] = (),
                 kin: Optional[Dict[Tuple[str, ...], "Family"]] = None):
        self.cls = cls
        self.paths = paths
        # a block's outputs come back in policy.output, as a whole model's do: the ops that read them next
        # (a norm, a float32 residual add) are float32 ones, so ops feeding the output resolve as in the
        # whole-model graph, where those readers are visible
        self.policy = policy
        self.options = options
        self.lifted = lifted
        self.glue = glue
        # the submodules (paths below a block) with hooks of their own in every instance, which a capture keeps
        # as calls; kin: the families of this one's instances by their hooked submodules (rehome)
        self.hooked = hooked
        self.kin = {hooked: self} if kin is None else kin
        # (signature, None | the training mode it is right in) -> its variants (guards pick), latest first
        self.graphs: Dict[Any, List["_Graph"]] = {}
        self.static: Dict[Any, Callable[..., Any]] = {}  # signature -> the sizes of the dims export kept static
        self.per_instance = False  # an export capture read a lifted attribute: graphs keyed by their values too
        self.ranged: set = set()  # signatures torch.export captured: their keys hold the call's range class
        self.captures = 0
        self.capture_seconds = 0.0
        self.as_written: Dict[Any, "_AsWritten"] = {}  # signature -> a call no front end could capture
        # the plain values its graphs hold (not the lifted ones, which they take as inputs): checked at each call
        self.held: Held = ()
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_lock"] = None
        state["graphs"] = {}  # a copy captures again: the graphs hold the original instances' modules
        state["static"] = {}
        state["per_instance"] = False
        state["ranged"] = set()
        state["captures"] = 0
        state["as_written"] = {}
        state["capture_seconds"] = 0.0
        state["held"] = ()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("hooked", ())
        self.__dict__.setdefault("kin", {self.hooked: self})
        self.__dict__.setdefault("held", ())
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Family":
        new = Family.__new__(Family)
        memo[id(self)] = new
        new.__setstate__(self.__getstate__())  # (shares the class, policy and options: none changes)
        new.paths = list(self.paths)  # (rehome moves paths between a copy's families)
        new.kin = copy.deepcopy(self.kin, memo)
        return new

    def rehome(self, block: nn.Module) -> "Family":
        """The family ``block`` runs in, a hook on one of its submodules having been added or removed (or its
        watch missing: a model pickled before there was one): this one while its hooked submodules are this
        family's, else the kin family for those, made at the first such block (warned, naming the modules and
        hook kinds added: its graphs capture again, which keeps them as calls).  A hook removed again takes the
        block back to the family it left, whose graphs it runs again."""
        path = block.__dict__.get(HOOKS, ((), (), (), ""))[3]
        found = submodule_hooks(block)
        hooked = tuple(p for p, _ in found)
        block.__dict__[HOOKS] = hook_watch(block, path)
        if hooked == self.hooked:
            return self
        family = self.kin.get(hooked)
        if family is None:
            family = self.kin.setdefault(hooked, Family(self.cls, [], self.policy, self.options, self.lifted,
                                                        self.glue, hooked, self.kin))
            added = [f"{'.'.join(filter(None, (path, p)))!r} ({', '.join(kinds)})" for p, kinds in found
                     if p not in self.hooked]
            if added:
                where = f"block {path!r} ({self.cls.__name__})" if path else f"a {self.cls.__name__} block"
                warnings.warn(
                    f"fxamp.convert_: hooks on {', '.join(added)} were registered after conversion, and {where} "
                    f"runs a graph of its family that traced through those modules, where a hook never runs: the "
                    f"block captures its own graphs now, keeping them as calls (or runs as written where no front "
                    f"end can). Register hooks before fxamp.convert_ to skip the capture; handle.remove() takes "
                    f"the block back to its family's graphs", RuntimeWarning, stacklevel=6)  # (the block's caller)
        if path in self.paths:
            self.paths.remove(path)
        family.paths.append(path)
        block.__dict__[FAMILY] = family
        return family

    def run(self, block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        watch = block.__dict__.get(HOOKS)  # a hook added to or removed from a submodule since the last call?
        if watch is None or any(watch[0]) or tuple(map(len, watch[1])) != watch[2]:
            self = self.rehome(block)  # (not a call of its run: warnings name the block's caller)
        changed = self._held_now(block) if self.held else None
        if self.lifted:
            _refresh_lifted(block, self.lifted)
        base, leaves, tree = flatten_call(args, kwargs)
        static = self.static.get(base)  # an export capture kept some dims static: their sizes are part of the key
        key = base if static is None else (base, tuple(static(tuple(leaves), {})))
        if base in self.ranged:  # (a few integer compares, for signatures export captured only)
            key = (key, _range_class(leaves))
        if changed is not None:  # a plain value the graphs hold was set to another: graphs for the values now
            key = (key, changed)
        mode = block.training
        graphs = self.graphs
        keys = [(key, None), (key, mode)]
        if self.per_instance:  # export graphs that read a lifted attribute: one per value
            values = block.__dict__[LIFTED]
            keys += [((key, values), None), ((key, values), mode)]
        for variants in [graphs[k] for k in keys if k in graphs]:
            for graph in variants:
                undo = undo_point(block, leaves) if graph.late else None
                try:
                    out = graph.call(block, leaves)
                except GuardFailed:  # an early guard: this call takes another branch; nothing ran that matters
                    continue
                except LateGuardFailed:  # a cache method ran first: try the others if it can be undone
                    if undo is None or not undo():
                        raise
                    continue
                if graph is not variants[0]:
                    variants.remove(graph)
                    variants.insert(0, graph)  # the latest variant first (a decoding loop's steps)
                return out
        written = self.as_written.get(base)
        if written is not None:
            if not written.global_hooks or global_hooks():
                return written.call(block, args, kwargs)
            del self.as_written[base]  # the global module hook that refused the capture is gone: capture now
        # (under torch.compile the capture, torch.fx tracing and all, runs outside dynamo: a graph break, once)
        capture = torch.compiler.disable(self._capture) if torch.compiler.is_compiling() else self._capture
        with self._lock:
            try:
                graph = capture(block, base, key, tree, leaves)
            except TraceError as e:  # no front end can take this call: the block runs as its class wrote it
                written = self.as_written[base] = _AsWritten(self, tree, leaves, e)
                return written.call(block, args, kwargs)
        try:
            return graph.call(block, leaves)
        except GuardFailed:  # its own early copy of a late guard: a method it ran changed what the branch read
            raise FxampError(LATE_BRANCH) from None

    def _capture(self, block: nn.Module, base: Any, key: Any, tree: Any, leaves: List[Any]) -> "_Graph":
        start = time.perf_counter()
        names = leaf_names(tree, len(leaves))
        what = f"{'glue module' if self.glue else 'block'} {self.paths[0]!r} ({self.cls.__name__})"
        described = describe_call(tree, leaves)
        lifted = True
        concrete_error: Optional[TraceError] = None
        root = bound_root(block, self.cls, tree, names, self.lifted, drop=PRIVATE)
        captured = fx_error = None
        if all(isinstance(v, torch.Tensor) for v in leaves):  # (an object's proxy fails isinstance checks)
            try:
                captured = capture(root, frontend="fx", graph_per_mode=True)  # (graphs are kept per mode)
            except TraceError as e:
                fx_error = e
            made = _extras(captured.graph_module, block) if captured is not None else {}
            if made:  # torch.fx computed them from the traced instance's buffers (~self.mask): not per instance
                fx_error = TraceError(f"torch.fx made constants of the traced instance ({', '.join(sorted(made))})",
                                      short="constants of one instance")
                captured = None
        if captured is None:  # shapes unpacked or branched on: trace with this call's values, branches guarded
            try:
                with float32_for_capture(root, _stored_low(root)) as restore:  # the forward runs as written
                    captured = capture_with_values(root, [*leaves, *block.__dict__[LIFTED]])
                    restore.also(captured.graph_module)
            except TraceError as e:
                concrete_error = e
                logger.info("fxamp: %s: torch.fx with the call's values failed too: %s", what, e.short)
        if captured is None:
            e = fx_error or concrete_error
            carried = next((x for x in (fx_error, concrete_error) if isinstance(x, CarriedState)), None)
            if carried is not None:  # (torch.export would refuse it too)
                raise carried
            opaque = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
            if opaque:
                raise TraceError(
                    f"{what} could not be captured for a call with {described}: torch.fx failed ({e.short}), "
                    f"with the call's values too ({concrete_error.short if concrete_error else '-'}), and "
                    f"torch.export cannot take the {', '.join(opaque)} argument", short=e.short,
                    module_path=self.paths[0], original=e.original) from e
        if captured is None:
            # torch.export bakes Python values in: the lifted attributes are first set to a value that
            # refuses every use, so a graph that succeeds cannot depend on them and serves every instance;
            # else each distinct set of values gets its own capture
            lifted, values = False, None
            try:
                captured = self._export(block, tree, names, leaves, (_UNREAD,) * len(self.lifted), fx_error)
            except Exception:
                if not self.lifted:
                    raise
                self.per_instance = True
                values = block.__dict__[LIFTED]
                captured = self._export(block, tree, names, leaves, values, fx_error)
            static = captured.graph_module.meta.get(STATIC_SIZES)
            if base not in self.static and static is not None and static(tuple(leaves), {}):
                self.static[base] = static
            known = self.static.get(base)  # the key as run() makes it for this call from now on
            key = base if known is None else (base, tuple(known(tuple(leaves), {})))
            self.ranged.add(base)
            key = (key, _range_class(leaves))
            if values is not None:
                key = (key, values)
        placeholders = list(captured.graph_module.graph.find_nodes(op="placeholder"))
        ranges = _leaf_ranges(captured.graph_module, placeholders) if captured.frontend == "export" else ()
        for node, leaf in zip(placeholders, leaves):  # the key holds each tensor's dtype: the graph may know it
            if isinstance(leaf, torch.Tensor):
                node.meta[INPUT_DTYPE] = leaf.dtype
        if issubclass(self.cls, nn.modules.batchnorm._BatchNorm) and captured.only_mode is None:
            follow_the_mode(captured.graph_module)
        gm = rewrite_captured(captured, self.policy, self.options, storage="keep",
                              notes=[f"{what}, shared by {len(self.paths)} instance(s), captured with "
                                     f"{captured.frontend} for a call with {described}"])
        constants = _lift_constants(gm, block)
        lifted_pairs = set(self.lifted)
        self.held = _merged(self.held, tuple((p, tuple((n, v) for n, v in items if (p, n) not in lifted_pairs))
                                             for p, items in gm.__dict__.get(HELD, ())))
        graph = _Graph(gm, _forward_of(gm), described, captured.frontend, lifted, constants, ranges)
        self.graphs.setdefault((key, captured.only_mode), []).insert(0, graph)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        logger.info("fxamp: captured %s with %s for a call with %s", what, captured.frontend, described)
        return graph

    def _held_now(self, block: nn.Module) -> Optional[Tuple[Any, ...]]:
        """None while the plain values this family's first graphs hold are ``block``'s (the graphs computed with
        them), else ``block``'s values of them now, a part of the key of the graphs captured for those."""
        bound = block.__dict__.get(BOUND)
        if bound is None or bound[0] is not self.held:  # (a graph captured since, or the block's first call)
            bound = block.__dict__[BOUND] = (self.held, bind(block, self.held))
        return values_now(block, bound[1])

    def _export(self, block: nn.Module, tree: Any, names: List[str], leaves: List[Any], values: Tuple[Any, ...],
                fx_error: TraceError) -> Any:
        root = bound_root(block, self.cls, tree, names, self.lifted, values=values, drop=PRIVATE)
        root.training = block.training
        with float32_for_capture(root, _stored_low(root)) as restore, torch.enable_grad():
            captured = capture(root, frontend="export", example_inputs=tuple(leaves), example_kwargs={},
                               dynamic=self.options.dynamic, fx_error=fx_error, graph_per_mode=True, at_call=True)
            restore.also(captured.graph_module)
        return captured


def _merged(a: Held, b: Held) -> Held:
    """The held values of ``a`` and ``b``, each (path, attribute) once, with its value in ``a`` if it has one (a graph
    captured for other values holds those)."""
    out = {p: dict(items) for p, items in a}
    for p, items in b:
        for name, value in items:
            out.setdefault(p, {}).setdefault(name, value)
    return tuple((p, tuple(items.items())) for p, items in out.items() if items)


def _refresh_lifted(block: nn.Module, lifted: Tuple[Tuple[str, str], ...]) -> None:
    """The block's lifted attributes as they are now (a graph takes them as inputs, or is keyed by them): a value
    set since conversion is the one its next call computes with."""
    values = block.__dict__[LIFTED]
    now = tuple((block if not p else block.get_submodule(p)).__dict__.get(a, v)
                for (p, a), v in zip(lifted, values))
    if now != values:
        block.__dict__[LIFTED] = now


def _range_class(leaves: List[Any]) -> Tuple[Any, ...]:
    """Per tensor leaf, its sizes with every size from 2 up as 2: torch.export specialises sizes 0 and 1."""
    return tuple(tuple(s if s < 2 else 2 for s in leaf.shape) if isinstance(leaf, torch.Tensor) else None
                 for leaf in leaves)


def _leaf_ranges(gm: fx.GraphModule, placeholders: List[fx.Node]) -> Tuple[Tuple[int, int, Any, Any], ...]:
    """``(leaf index, dim, low, high)`` for each dim an export capture holds in a range narrower than its range
    class: a size it kept static (``(i, dim, n, n)``: a capture for size 2 of a branch on ``x.size(0) > 2``),
    or a range a branch narrowed (a lower bound of 2 is the class's own)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    out = [(i, dim, int(size), int(size)) for i, node in enumerate(placeholders)
           if isinstance(node.meta.get("val"), torch.Tensor)
           for dim, size in enumerate(node.meta["val"].shape) if is_concrete_int(size) and int(size) >= 2]
    index = {input_name(node): i for i, node in enumerate(placeholders)}
    out.extend((index[name], dim, low if low is not None and low > 2 else None, high)
               for name, dims in dim_ranges(gm).items() if name in index
               for dim, (low, high) in dims.items() if (low is not None and low > 2) or high is not None)
    return tuple(out)


def _stored_low(root: nn.Module) -> frozenset:
    return frozenset(n for n, t in itertools.chain(root.named_parameters(), root.named_buffers()) if t.dtype in LOW)


def _forward_of(gm: fx.GraphModule) -> Callable[..., Any]:
    """The graph's code as a function of (self, *leaves).  An exported graph flattens its inputs and
    unflattens its outputs through ``self._in_spec``/``_out_spec``; the leaves are flat already, so its
    code is made plain and the outputs are unflattened here (``self`` is the block, not the graph)."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        return type(gm).forward
    out_spec = codegen.pytree_info.out_spec
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    plain = type(gm).forward
    if out_spec is None:
        return plain

    def forward(self: nn.Module, *leaves: Any) -> Any:
        return pytree.tree_unflatten(plain(self, *leaves), out_spec)
    return forward


class _Unread:
    """Stands for a lifted attribute in a torch.export capture: any use of it fails the capture."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("fxamp: a per-instance attribute was read during the capture")

    __index__ = __int__ = __float__ = __bool__ = __eq__ = __ne__ = __lt__ = __gt__ = __le__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __hash__ = __str__ = __format__ = _refuse
    __truediv__ = __floordiv__ = __mod__ = __neg__ = __len__ = __iter__ = __getitem__ = __call__ = _refuse

    def __repr__(self) -> str:
        return "<fxamp: per-instance attribute>"


_UNREAD = _Unread()


def _where(error: TraceError) -> str:
    """``, at <file>:<line>: `<code>```: the line of the model's code the front end failed at, if known."""
    line = user_line(error.original, short=True) if error.original is not None else ""
    return f", at {line}" if line else ""


def _what_to_do(error: TraceError, family: "Family") -> str:
    if isinstance(error, CarriedState):  # (whole, it is refused too)
        held = ("the block itself" if isinstance(error.module, family.cls) else
                f"the {type(error.module).__name__} holding the state")
        return (f"to convert the rest of it, give convert_ finer blocks (blocks=[...] globs under "
                f"{family.paths[0]!r}) that leave out {held}")
    return "to convert it, make its forward traceable there, or convert the model whole with fxamp.convert"


class _AsWritten:
    """A call signature of a family that no front end could capture: the block's class's own forward runs,
    unconverted, in float32.  Tensors conversion stored low (O2/O3) are read as float32 values cast from
    them (``OriginalDtypes``: the dtypes they had), differentiably, so their gradients reach the stored
    tensors an optimizer steps; a buffer's in-place update (running statistics) is written back.  Named
    once in a warning and in the report's notes."""

    def __init__(self, family: "Family", tree: Any, leaves: List[Any], error: TraceError):
        self.cls = family.cls
        self.tree = tree
        self.description = describe_call(tree, leaves)
        self.global_hooks = bool(global_hooks())  # (while one is registered, no front end captures)
        what = f"{'glue module' if family.glue else 'block'} {family.paths[0]!r} ({family.cls.__name__})"
        shared = f" and the {len(family.paths) - 1} other(s) of its family" if len(family.paths) > 1 else ""
        self.note = (f"fxamp.convert_: {what}{shared} run(s) as written (unconverted, float32) for calls with "
                     f"{self.description}: it could not be captured ({error.short}{_where(error)}); "
                     f"{_what_to_do(error, family)}")
        warnings.warn(self.note, RuntimeWarning, stacklevel=6)  # (the line that called the block)
        logger.info("%s", error)

    def call(self, block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The class's forward on the call's own arguments (a list it changes is the caller's)."""
        hook = next((h for h in block._state_dict_hooks.values() if isinstance(h, OriginalDtypes)), None)
        swapped = []
        for name, dtype in (hook.dtypes.items() if hook is not None else ()):
            path, _, attr = name.rpartition(".")
            owner = block.get_submodule(path)
            table = owner._parameters if attr in owner._parameters else owner._buffers
            stored = table[attr]
            if stored is None or stored.dtype == dtype:
                continue
            table[attr] = stored.to(dtype) if table is owner._parameters else stored.detach().to(dtype)
            swapped.append((table, attr, stored, table[attr], table[attr]._version))
        try:
            return self.cls.forward(block, *args, **kwargs)
        finally:
            for table, attr, stored, value, version in swapped:
                table[attr] = stored
                if value._version != version:  # a buffer updated in place (a batch norm's statistics)
                    with torch.no_grad():
                        stored.copy_(value)


class OriginalDtypes:
    """A state_dict hook of a converted module: its re-bound tensors come out in the dtypes they had before
    conversion (float32), under the same names, a parameter as its master's (or original's) exact float32
    value (``fxamp.info.origin_of``); ``load_state_dict`` copies them back into the stored dtypes."""

    def __init__(self, dtypes: Dict[str, torch.dtype]):
        self.dtypes = dtypes  # name below the module -> original dtype

    def __call__(self, module: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, dtype in self.dtypes.items():
            key = prefix + name
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                # the float32 truth while the weight is its rounding: the master an optimizer steps, or the original
                exact = origin_of(fetch_attr(module, name))
                state[key] = exact.detach() if exact is not None and exact.dtype == dtype else value.to(dtype)


class _Graph:
    """One capture of a family: the converted graph module (for the report) and its forward code."""

    def __init__(self, gm: fx.GraphModule, fn: Callable[..., Any], description: str, frontend: str,
                 lifted: bool, constants: Tuple[Any, ...] = (), ranges: Tuple[Tuple[int, int, Any, Any], ...] = ()):
        self.lifted = lifted  # its forward takes the lifted attributes' values after the call's leaves
        self.constants = constants  # ... and then these (_lift_constants)
        self.gm = gm
        self.fn = fn
        self.description = description
        self.frontend = frontend
        self.ranges = ranges  # (leaf index, dim, low, high): the sizes an export capture holds for (_leaf_ranges)
        # a guard after a side effect (capture/concrete.py): a failing call must be undone before another try
        self.late = any(n.target is guard and n.args[2] is False for n in gm.graph.find_nodes(op="call_function",
                                                                                             target=guard))

    def call(self, block: nn.Module, leaves: List[Any]) -> Any:
        for i, dim, low, high in self.ranges:  # an early guard: outside, the next variant or a new capture
            size = leaves[i].shape[dim]
            if (low is not None and size < low) or (high is not None and size > high):
                raise GuardFailed
        if self.lifted:
            return self.fn(block, *leaves, *block.__dict__[LIFTED], *self.constants)
        return self.fn(block, *leaves, *self.constants)


def _extras(gm: fx.GraphModule, block: nn.Module) -> Dict[str, Any]:
    """What a graph reads from ``self`` beyond the block's own tree: higher-order-op bodies, constants."""
    own = set(block._modules) | set(block._parameters) | set(block._buffers)
    # (the weight cache is each instance's own; the root's mode flag is the block itself: see converted_class)
    extras = {n: m for n, m in gm._modules.items() if n not in own and n not in ("_fxamp_weight_cache", MODE_FLAG)}
    extras.update({n: t for n, t in itertools.chain(gm._parameters.items(), gm._buffers.items()) if n not in own})
    return extras


def _lift_constants(gm: fx.GraphModule, block: nn.Module) -> Tuple[Any, ...]:
    """What a capture made beyond the block's own tree becomes the graph's last inputs, which its calls pass:
    a graph runs with ``self`` = any instance, which has no such attribute.  Tensor constants (torch.export's
    ``_fxamp_constant_<i>``: ``torch.tensor(scale)`` in forward) depend on no instance's tensors (those are
    graph values: parameters, and buffers, which both tracers read as ``get_attr`` nodes); a higher-order
    op's body (a ``torch.no_grad`` region's graph) takes the parameters it reads as arguments.  So every
    instance shares them."""
    extras = _extras(gm, block)
    if not extras:
        return ()
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    values = []
    for name, value in extras.items():
        with graph.inserting_after(placeholders[-1]) if placeholders else \
                graph.inserting_before(next(iter(graph.nodes))):
            new = graph.placeholder(f"_fxamp_constant_input_{len(values)}")
        placeholders.append(new)
        for node in list(graph.find_nodes(op="get_attr", target=name)):
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        delattr(gm, name)
        values.append(value)
    graph.lint()
    gm.recompile()
    return tuple(values)


#: batch norm ops: (index of running_mean, index and keyword of the training flag)
_BATCH_NORMS = {torch.nn.functional.batch_norm: (1, 5, "training"), torch.batch_norm: (3, 5, "training"),
                torch.ops.aten.batch_norm.default: (3, 5, "training")}
_INCREMENTS = ("add_", operator.iadd, torch.ops.aten.add_.Tensor)


def follow_the_mode(gm: fx.GraphModule) -> int:
    """A batch norm captured as the graph's root (a glue ``BatchNorm2d`` outside the blocks) reads its
    statistics and bumps its counter in the mode it was captured in; make both follow the module's mode,
    as they do for a batch norm inside a block (``capture/modes.py``, whose owner of a node is a
    submodule, never the root).  In eval mode the counter gets ``add_(False)``: its value stays.
    Returns the number of nodes changed."""
    graph = gm.graph
    flag: Optional[fx.Node] = None

    def the_flag() -> fx.Node:
        nonlocal flag
        if flag is None:
            if MODE_FLAG not in gm._modules:  # (a converted block's class reads it as the block itself)
                gm.add_module(MODE_FLAG, ModeFlag())
            with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                flag = graph.call_function(getattr, (graph.get_attr(MODE_FLAG), "training"))
            flag.meta["val"] = True
        return flag

    def own(arg: Any, name: str) -> bool:
        return isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) == name

    changed = 0
    for node in list(graph.nodes):
        where = _BATCH_NORMS.get(node.target) if node.op == "call_function" else None
        if where is not None and own(node_arg(node, where[0], "running_mean", None), "running_mean"):
            _, index, name = where
            current = node_arg(node, index, name, None)
            if current is True:
                replace_node_arg(node, index, name, the_flag())
                changed += 1
        elif node.target in _INCREMENTS and len(node.args) == 2 and own(node.args[0], "num_batches_tracked") and \
                node.args[1] == 1:
            node.args = (node.args[0], the_flag())
            changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    return changed
