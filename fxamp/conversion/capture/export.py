"""The ``torch.export`` front end: capture a model with ``torch.export`` and make the result look like the original.

``torch.export.export(model, args, kwargs).module()`` captures models ``torch.fx.symbolic_trace``
cannot (Hugging Face transformers, shape-dependent branches…) as a graph of ATen ops
(``aten.linear.default``, ``aten.scaled_dot_product_attention.default``…).  Its module differs
from the original in five ways; :class:`ExportFrontEnd` undoes each one, so the later stages (and
the user) see the same module they would get from the fx front end:

1. **Module tree and names.**  The exported module holds the original parameter objects under
   names of its own choosing (a tied weight gets one of its names).  fxamp mirrors the original's
   children, parameters and buffers (``state_dict`` keys are the original's) and points every
   ``get_attr`` at the original name of the tensor it reads, found by identity.  Tensor constants
   created in ``forward`` become non-persistent buffers ``_fxamp_constant_<i>``; higher-order-op
   bodies (``torch.no_grad`` regions…) stay child graph modules under their export names.

2. **train() / eval().**  Export raises ``NotImplementedError`` from both and bakes the mode into
   node arguments.  fxamp captures in training and in eval mode (restoring every module's mode
   afterwards) and, when the graphs agree, keeps the training one with each dropout, attention
   dropout and batch norm reading its module's ``training`` flag at run time; see
   ``fxamp/conversion/capture/modes.py``, shared with the fx front end, for the rewrite and what happens when the
   modes capture different graphs.

3. **Shapes.**  ``dynamic="batch"`` (:class:`~fxamp.conversion.options.Dynamic`) marks the dims users change as ``Dim.AUTO``: dim 0 (batch) of every
   tensor input, dim 1 of integer and bool inputs of rank ≥ 2 (token ids, masks: the sequence) and
   of float inputs of rank 2 and 3 (``(batch, samples)`` waveforms, ``(batch, length, features)``,
   or ``(length, batch, features)``); image-like float inputs (rank ≥ 4) keep their spatial sizes
   static, since symbolic heights and widths through window attention cost minutes of export time.
   ``dynamic="all"`` makes every dim ``Dim.AUTO``; ``dynamic="none"`` none; ``dynamic_shapes=``
   goes to ``torch.export`` as given.  ``Dim.AUTO`` lets what the model does decide: export keeps
   a dim symbolic unless the model fixes it (a ``Linear`` over a ``(batch, features)`` input, a
   Python loop over the positions, a ``view`` to a constant size); sizes of 0 and 1 in the example
   are specialised too, so use examples with batch and length ≥ 2.  The note in ``Captured.notes``
   says which dims stayed dynamic, and names each dim asked dynamic that the capture fixed; a call
   with another size of such a dim is refused with that reason (a lazily capturing module captures
   again instead, :mod:`fxamp.conversion.lazy`).

4. **Inputs and outputs.**  The module is called with the original ``forward``'s signature
   (positional or keyword, as the original allows); non-tensor inputs given at capture
   (``use_cache=False``) are filled in when omitted.  Outputs come back in the original structure
   (``ModelOutput``, tuples, dicts) through export's output spec; the graph's ``output`` node holds
   the flat leaves, which is where the output casts go.  Output values of types ``torch.export``
   cannot return (a Hugging Face ``DynamicCache``) come back as ``None``, with a note.

5. **Run-time checks.**  Export's input checks (the ``_in_spec`` match and shape ranges, run by a
   forward pre-hook) stay; fxamp's input binding, a pre-hook before them, refuses first, in its own
   words, a size outside a range the model's code narrowed (``if x.shape[0] > 2``:
   :func:`.shapes.check_range`).  ``aten._assert_tensor_metadata`` nodes that assert a *floating*
   dtype lose that dtype (mixed precision changes float dtypes on purpose); shape, device and
   integer dtype checks stay.

Models neither front end can capture (data-dependent control flow such as ``if x.sum() > 0:``)
raise :class:`~fxamp.errors.TraceError` naming the source line and the module, and suggesting
``leaf_modules=`` or converting submodules separately.

Like ``ExportedProgram.module()`` itself, the result deep-copies but does not pickle (FX re-traces
a pickled graph module, which an exported graph does not survive): save its ``state_dict`` and
convert again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import logging
import os
import re
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ...errors import TraceError
from ..graph import canonical_names, dedupe_get_attrs, fetch_attr, mirror_module_tree, node_arg, replace_node_arg
from ..options import Dynamic, parse_option
from .common import (LeafSpec, Written, changed_attributes, distributions_hint, plain_attributes,
                     shallow_copy, torchscript_error, user_frame)
from .constants import fit_fill_values
from .hooks import traced_hooks_error, without_hooks
from .regions import region_notes
from .shapes import STATIC_SIZES, OtherInputSet, Range, asked_dims, check_range, dim_ranges, fixed_dims, input_name, shape_note
from .shapes import dynamic_shapes as usual_dynamic_shapes

__all__ = ["ExportFrontEnd"]

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


class ExportFrontEnd:
    """``torch.export`` from example inputs, made to look like the original (see the module docstring).

    fallback_from: the fx front end's error when export runs because torch.fx failed (``"auto"``);
    the notes and errors then say so.  at_call: the inputs are a call's (a lazily capturing module),
    not example inputs the user wrote; errors then talk about the call's arguments.
    """

    name = "export"

    def __init__(self, model: nn.Module, example_inputs: Optional[Tuple[Any, ...]],
                 example_kwargs: Optional[Dict[str, Any]], *, dynamic: Dynamic = Dynamic.BATCH,
                 dynamic_shapes: Any = None, leaf_modules: Sequence[LeafSpec] = (),
                 fallback_from: Optional[TraceError] = None, at_call: bool = False):
        self.model = model
        self.at_call = at_call
        self.fallback_from = fallback_from
        self.args, self.kwargs = _check_inputs(example_inputs, example_kwargs)
        if leaf_modules:
            raise _leaf_modules_error(leaf_modules, self._why())
        refused = traced_hooks_error(model, "torch.export", self._why()) or torchscript_error(model, self._why())
        if refused is not None:
            raise refused
        dynamic = parse_option(Dynamic, dynamic, what="dynamic")
        self.dynamic = "given" if dynamic_shapes is not None else dynamic
        self.signature = _signature(model)
        if dynamic_shapes is not None:
            self.dynamic_shapes = dynamic_shapes
        elif dynamic is not Dynamic.NONE:
            self.dynamic_shapes = usual_dynamic_shapes(self.signature, self.args, self.kwargs,
                                                        every_dim=dynamic is Dynamic.ALL)
        else:
            self.dynamic_shapes = None
        # top-level input name -> the dims asked dynamic (BATCH/ALL), to name those the capture fixed
        self.asked = asked_dims(self.signature, self.args, self.kwargs, self.dynamic_shapes) \
            if dynamic_shapes is None else {}
        self.dropped: List[str] = []
        self.written: List[Written] = []  # plain attributes forward changed while traced
        self.subgraphs: List[nn.Module] = []

    def _why(self) -> Optional[str]:
        """Why export runs, when it is a fallback: ``torch.fx could not trace the model (...)``."""
        e = self.fallback_from
        return None if e is None else f"torch.fx could not trace the model ({e.short})"

    def lead_notes(self) -> List[str]:
        why = self._why()
        return [f"{why}; captured with torch.export instead" if why else
                "captured with torch.export (frontend='export')"]

    def trace(self) -> fx.GraphModule:
        from torch.export import export  # heavy: imported only when used

        # copied per capture: it carries the mode being captured
        root = _export_root(self.model, self.dropped, self.written, self.signature, self.kwargs)
        with _quiet_torch_logs():
            return export(root, self.args, self.kwargs, dynamic_shapes=self.dynamic_shapes).module(check_guards=False)

    def error(self, e: BaseException) -> TraceError:
        return _export_error(self.model, e, self._why(), tuple(self.kwargs), self.at_call)

    def adopt(self, gm: fx.GraphModule) -> None:
        _restore_train_eval(gm)
        self.subgraphs = _adopt_module_tree(gm, self.model)

    def finish(self, gm: fx.GraphModule) -> List[str]:
        relaxed = _relax_dtype_asserts(gm, self.subgraphs)
        dedupe_get_attrs(gm.graph)
        fixed = fixed_dims(gm, self.asked)
        _bind_inputs_as_original(gm, self.signature, self.args, self.kwargs, self.dynamic, fixed)
        # a region (no_grad, autocast) whose outputs nothing reads may still write buffers in place (a VQ-VAE's EMA
        # codebook under torch.no_grad()): torch.fx does not count a higher-order op as a side effect, so say so
        gm.graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() or (
            node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)))
        notes = [shape_note(gm, self.dynamic, fixed)] + fit_fill_values(gm)
        if relaxed:
            notes.append(f"{relaxed} aten._assert_tensor_metadata check(s) no longer pin a float dtype")
        notes += region_notes(self.model, gm, self.subgraphs)
        if self.dropped:
            notes.append("outputs of type " + ", ".join(sorted(set(self.dropped))) + " cannot be returned by "
                         "torch.export: they come back as None")
        return notes


# ---------------------------------------------------------------------------------------------
# Before export: inputs, dynamic shapes, the traced root, training mode
# ---------------------------------------------------------------------------------------------


def _check_inputs(example_inputs: Any, example_kwargs: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    if example_inputs is None and example_kwargs is None:
        raise ValueError("the torch.export front end needs example_inputs=(...) and/or example_kwargs={...}")
    if example_inputs is None:
        args: Tuple[Any, ...] = ()
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        raise TypeError(f"example_inputs must be a tuple of positional inputs such as (x,), not "
                        f"{type(example_inputs).__name__}")
    if example_kwargs is None:
        kwargs: Dict[str, Any] = {}
    elif isinstance(example_kwargs, dict) and all(isinstance(k, str) for k in example_kwargs):
        kwargs = dict(example_kwargs)
    else:
        raise TypeError(f"example_kwargs must be a dict of keyword inputs such as {{'labels': y}}, not "
                        f"{type(example_kwargs).__name__}")
    return args, kwargs


def _signature(model: nn.Module) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return None


_RETURNABLE = (torch.Tensor, int, float, bool, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)


def _export_root(model: nn.Module, dropped: List[str], written: List[Written],
                 signature: Optional[inspect.Signature] = None,
                 kwargs: Sequence[str] = ()) -> nn.Module:
    """A shallow copy of ``model`` (same submodules and tensors) whose forward drops unreturnable outputs.

    torch.export can only return pytrees of tensors and scalars; a value of another type (a cache
    object) is replaced by None, its type name recorded in ``dropped``.  The user's model is not
    touched: the copy has its own ``__dict__``, without the root's hooks (export would trace them in, their
    side effects run once; ``convert`` registers them on the converted module).  Keyword inputs that reach
    ``forward``'s ``**kwargs`` become keyword-only parameters of the copy's signature, which torch.export
    reads: its dynamic shapes then name them, as for any other argument.
    """
    root = shallow_copy(model)
    without_hooks(root)
    # the copy's own forward: what it sets on itself torch.export puts back, and the user's model keeps its values
    # (bound to the model, a batch size forward stored came back to it a SymInt of a finished trace)
    forward = model.__dict__["forward"] if "forward" in model.__dict__ else type(model).forward.__get__(root)

    @functools.wraps(forward)
    def forward_returning_pytree(*args: Any, **kwargs: Any) -> Any:
        def keep(leaf: Any) -> Any:
            if isinstance(leaf, _RETURNABLE):
                return leaf
            if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and any(
                    isinstance(v, torch.Tensor) for v in pytree.tree_leaves(vars(leaf))):
                # the model's output itself (logits, loss), not a cache: None in its place would be wrong
                name = type(leaf).__name__
                raise TraceError(
                    f"torch.export cannot return {name}, a dataclass holding tensors that {type(model).__name__}"
                    f"'s forward returns: register it once before converting, "
                    f"torch.export.register_dataclass({name}), or return a tuple, a dict or a transformers "
                    f"ModelOutput", short=f"forward returns the unregistered dataclass {name}")
            dropped.append(type(leaf).__name__)
            return None

        before = plain_attributes(root)  # (torch.export puts back what forward sets, silently)
        out = forward(*args, **kwargs)
        written.extend(w for w in changed_attributes(root, before) if w not in written)
        return pytree.tree_map(keep, out)

    var_keyword = [p for p in (signature.parameters.values() if signature else ())
                   if p.kind is inspect.Parameter.VAR_KEYWORD]
    if var_keyword:
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        named = {p.name for p in params}
        params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs if k not in named]
        forward_returning_pytree.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    root.forward = forward_returning_pytree
    return root


#: loggers that print tracebacks and graph dumps to stderr while export fails (fake-tensor meta
#: errors, data-dependent guards); fxamp's TraceError says the same in a few lines
_NOISY_LOGGERS = ("torch._dynamo", "torch._export", "torch.export", "torch._subclasses.fake_tensor",
                  "torch.fx.experimental.symbolic_shapes", "torch._functorch", "torch._guards")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Keep a failed capture off stderr: torch's export-time loggers go above CRITICAL, and what
    export prints to ``sys.stderr`` itself (a failed capture's partial graph) is held back and
    written out only if the capture succeeds.  Levels and stderr are restored after."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    held = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        with contextlib.redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())  # reached only when the capture succeeded
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------
# After export: module tree, modes, checks, calling convention
# ---------------------------------------------------------------------------------------------


def _restore_train_eval(gm: fx.GraphModule) -> None:
    # ExportedProgram.module() sets instance attributes train/eval that raise NotImplementedError;
    # dropping them brings back nn.Module's own, which the rewritten graph honours.
    for name in ("train", "eval"):
        gm.__dict__.pop(name, None)


def _fresh_name(gm: nn.Module, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _adopt_module_tree(gm: fx.GraphModule, model: nn.Module) -> List[nn.Module]:
    """Give ``gm`` the original's module tree and point every ``get_attr`` at the original name of its value.

    Returns the modules export added (higher-order ops' bodies), now children of ``gm``.
    """
    getattrs = list(gm.graph.find_nodes(op="get_attr"))
    values = {node: fetch_attr(gm, str(node.target)) for node in getattrs}
    old_targets = {str(node.target) for node in getattrs}
    for name in old_targets:  # export's own copies of constants and subgraphs, about to be renamed
        if "." not in name and name in gm.__dict__:
            delattr(gm, name)
    mirror_module_tree(gm, model)

    canonical = canonical_names(model)
    module_names = {id(m): name for name, m in model.named_modules() if name}
    renamed: Dict[int, str] = {}
    added: List[nn.Module] = []
    constants = 0
    for node in getattrs:
        value = values[node]
        key = id(value)
        if isinstance(value, torch.Tensor) and key in canonical:
            node.target = canonical[key]
        elif isinstance(value, nn.Module) and key in module_names:
            node.target = module_names[key]
        elif key in renamed:
            node.target = renamed[key]
        else:  # a constant made in forward, or a higher-order op's body: a new attribute of gm
            if isinstance(value, nn.Module):
                name = _fresh_name(gm, str(node.target).replace(".", "_"))
                gm.add_module(name, value)
                added.append(value)
            else:
                name = _fresh_name(gm, f"_fxamp_constant_{constants}")
                constants += 1
                if isinstance(value, torch.Tensor):
                    gm.register_buffer(name, value, persistent=False)
                else:
                    setattr(gm, name, value)
            renamed[key] = name
            node.target = name
    dedupe_get_attrs(gm.graph)
    return added


def _relax_dtype_asserts(gm: fx.GraphModule, subgraphs: Sequence[nn.Module]) -> int:
    """Drop float ``dtype=`` from ``aten._assert_tensor_metadata`` (in the graph and export's subgraphs)."""
    relaxed = 0
    graphs = [gm] + [m for m in subgraphs if isinstance(m, fx.GraphModule)]
    for g in graphs:
        before = relaxed
        for node in g.graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default):
            dtype = node_arg(node, 3, "dtype", None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                replace_node_arg(node, 3, "dtype", None)
                relaxed += 1
        if g is not gm and relaxed > before:
            g.recompile()
    return relaxed


class _BindInputs:
    """Forward pre-hook: accept the original forward's calling convention, hand export its captured layout.

    ``positional`` / ``keywords`` are the names captured positionally / by keyword; ``constants``
    the non-tensor values given at capture (filled in when a call omits them).
    """

    def __init__(self, signature: inspect.Signature, positional: Tuple[str, ...], keywords: Tuple[str, ...],
                 constants: Dict[str, Any], static: Dict[str, Tuple[Optional[int], ...]], dynamic: Any,
                 fixed: Optional[Dict[str, Dict[int, str]]] = None,
                 ranges: Optional[Dict[str, Dict[int, Range]]] = None):
        self.signature = signature
        self.positional = positional
        self.keywords = keywords
        self.constants = constants
        self.static = static  # input name -> its size per dim, None where dynamic
        self.dynamic = dynamic  # the dynamic= the capture ran with, for the error
        self.fixed = fixed or {}  # input name -> {dim: why} where the model fixed a dim asked dynamic
        self.ranges = ranges or {}  # input name -> {dim: (low, high)} where a dynamic dim holds only in a range

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{e} (the converted module takes the original forward's arguments: "
                            f"{self.signature})") from None
        # None where the capture had a tensor (labels=None): the input left out, as forward reads it
        given = {n: v for n, v in self._by_name(bound.arguments).items() if v is not None or n in self.constants}
        captured = self.positional + self.keywords
        extra = [n for n in given if n not in captured and not self._is_default(n, given[n])]
        # a value export took as a constant (return_dict=False) holds for that value only: another one, or
        # forward's default where it differs, is another input set (torch's own check would name neither)
        other = [f"{n}={v!r} where the capture had {self.constants[n]!r}" for n, v in
                 ((n, given.get(n, self._default(n, self.constants[n]))) for n in captured if n in self.constants)
                 if not _same_value(v, self.constants[n])]
        for name in captured:
            if name not in given and name in self.constants:
                given[name] = self.constants[name]
        missing = [n for n in captured if n not in given]
        if extra or missing or other:
            problem = other
            if extra:
                problem.append(f"got {', '.join(extra)}, which the capture did not see")
            if missing:
                problem.append(f"{', '.join(missing)} missing")
            raise OtherInputSet(
                f"this module was captured by torch.export for the inputs ({', '.join(captured)}): "
                f"{'; '.join(problem)}. A graph from torch.export has a fixed set of inputs: convert "
                f"with example_inputs/example_kwargs that include exactly the inputs you will pass "
                f"(e.g. one module with labels= for training, one without for inference)"
            )
        self._check_static_sizes(given)
        for name, ranges in self.ranges.items():  # before export's own check, which names neither option nor fix
            check_range(name, given.get(name), ranges, self.dynamic)
        return tuple(given[n] for n in self.positional), {n: given[n] for n in self.keywords}

    def _by_name(self, arguments: Dict[str, Any]) -> Dict[str, Any]:
        given: Dict[str, Any] = {}
        for name, value in arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                given.update(value)
            else:
                given[name] = value
        return given

    def static_sizes(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The sizes a call gives the dims this capture kept static, ``((name, dim, size), ...)``: a
        lazily capturing module keys its cache on them, so that a new size captures again."""
        try:
            given = self._by_name(self.signature.bind(*args, **kwargs).arguments)
        except TypeError:
            return ()  # the call's own error comes from __call__
        out = []
        for name, sizes in self.static.items():
            value = given.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == len(sizes):
                out.extend((name, dim, int(value.shape[dim])) for dim, want in enumerate(sizes) if want is not None)
        return tuple(out)

    def _check_static_sizes(self, given: Dict[str, Any]) -> None:
        """Name the fxamp option when a dim the capture kept static changes (export's own check names its API)."""
        for name, sizes in self.static.items():
            value = given.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() != len(sizes):
                continue
            for dim, (want, got) in enumerate(zip(sizes, value.shape)):
                why = self.fixed.get(name, {}).get(dim)
                if want is not None and got != want and why is not None:
                    raise RuntimeError(
                        f"input {name!r} has size {got} in dim {dim}, which the capture asked dynamic but the "
                        f"model fixed at {want} ({why}). What to do: call with size {want}, convert one module "
                        f"per size, or convert with frontend='export' and no example inputs: that module "
                        f"captures again for each new size")
                if want is not None and got != want:
                    how = ("dynamic='batch' keeps only batch and sequence dims dynamic"
                           if self.dynamic is Dynamic.BATCH else
                           f"captured with dynamic={self.dynamic!r}")
                    raise RuntimeError(
                        f"input {name!r} has size {got} in dim {dim}, which the capture kept static: expected it "
                        f"to be equal to {want} ({how}). What to do: convert with dynamic='all' (every dim "
                        f"dynamic) or pass dynamic_shapes= for this input, or call with size {want}")

    def _default(self, name: str, otherwise: Any) -> Any:
        param = self.signature.parameters.get(name)
        return otherwise if param is None or param.default is inspect.Parameter.empty else param.default

    def _is_default(self, name: str, value: Any) -> bool:
        if value is None:
            return True
        param = self.signature.parameters.get(name)
        if param is None or param.default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
            return False
        try:
            return bool(value == param.default)
        except Exception:  # pragma: no cover - exotic __eq__
            return False


def _same_value(a: Any, b: Any) -> bool:
    """The same Python constant (``True`` is not ``1``)."""
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # pragma: no cover - exotic __eq__
        return False


def _bind_inputs_as_original(gm: fx.GraphModule, signature: Optional[inspect.Signature],
                             args: Tuple[Any, ...], kwargs: Dict[str, Any], dynamic: Any,
                             fixed: Optional[Dict[str, Dict[int, str]]] = None) -> None:
    if signature is None:  # pragma: no cover
        return
    params = list(signature.parameters.values())
    named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                              inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(named) or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        return  # *args or positional-only parameters: keep export's own (strict) convention
    positional = tuple(p.name for p in named[:len(args)])
    constants = {}
    for name, value in list(zip(positional, args)) + list(kwargs.items()):
        leaves = pytree.tree_leaves(value)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            constants[name] = value
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    static = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and input_name(node) in signature.parameters:
            static[input_name(node)] = tuple(int(d) if is_concrete_int(d) else None for d in val.shape)
    ranges = {name: dims for name, dims in dim_ranges(gm).items() if name in signature.parameters}
    hook = _BindInputs(signature, positional, tuple(kwargs), constants, static, dynamic, fixed, ranges)
    gm.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    gm.meta[STATIC_SIZES] = hook.static_sizes


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _leaf_modules_error(leaf_modules: Sequence[Any], why: Optional[str]) -> TraceError:
    names = ", ".join(repr(m) if isinstance(m, str) else getattr(m, "__name__", repr(m)) for m in leaf_modules)
    head = f"{why}, and the torch.export fallback" if why else "the torch.export front end"
    return TraceError(
        f"{head} cannot keep leaf_modules=[{names}] opaque: torch.export traces every module.\n"
        f"What to do: make torch.fx succeed (add the module it failed in to leaf_modules), convert "
        f"that part of the model separately (fxamp.convert(model.<submodule>, ...)), or drop "
        f"leaf_modules and keep a module in float32 under torch.export with "
        f"module_overrides={{'<path>': 'unsafe'}}.",
        short="leaf_modules given to the torch.export front end",
    )


_CALL_RE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)')


def _source_line(e: BaseException) -> Optional[Tuple[str, int, str]]:
    """(file, line, code) of the user code export blamed: from its message, else the traceback."""
    text = str(e)
    marker = text.find("The following call raised this error")
    if marker >= 0:
        m = _CALL_RE.search(text, marker)
        if m:
            return m.group(1), int(m.group(2)), m.group(4).strip()
    f = user_frame(e)
    if f is not None:
        return f.filename, f.lineno or 0, (f.line or "").strip()
    return None


def _owner_of_line(model: nn.Module, filename: str, lineno: int) -> Tuple[str, nn.Module]:
    """The innermost module whose ``forward`` contains ``filename:lineno`` ('' and the model if none)."""
    best: Tuple[str, nn.Module] = ("", model)
    for path, m in model.named_modules():
        fwd = getattr(type(m), "forward", None)
        try:
            src = inspect.getsourcefile(fwd)
            lines, start = inspect.getsourcelines(fwd)
        except (TypeError, OSError):
            continue
        if src and os.path.abspath(src) == os.path.abspath(filename) and start <= lineno < start + len(lines):
            if len(path) >= len(best[0]):
                best = (path, m)
    return best


def _is_data_dependent(e: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    text = str(e)
    return isinstance(e, GuardOnDataDependentSymNode) or "data-dependent" in text or "data dependent" in text


_LABEL_LIKE = re.compile(r"label|target|^y$|^y_|answer|positions$", re.IGNORECASE)


def _label_hint(kwargs: Sequence[str], code: str, at_call: bool = False) -> str:
    """The fix when a loss inside forward checks label values (``if labels.max() >= vocab: raise``), or ''.

    at_call: the capture runs at a call of a lazily capturing module, whose inputs are the call's
    keyword arguments (the user never wrote example_kwargs)."""
    names = [k for k in kwargs if _LABEL_LIKE.search(k)]
    if not names:
        return ""
    named = [k for k in names if re.search(rf"\b{re.escape(k)}\b", code)]
    which = ", ".join(f"{k}=" for k in (named or names))
    source = "the call's keyword arguments" if at_call else "example_kwargs"
    why = "that line checks the values of" if named else f"{source} include"
    fix = (f"Call the converted module without {which}" if at_call else
           f"Convert without {which} in example_kwargs")
    return (f"What to do: {why} {which}, and a check on label values (a loss inside forward) cannot be "
            f"captured. {fix} (forward then returns the logits) and "
            f"compute the loss outside the converted module, in float32 "
            f"(F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())).")


def _export_error(model: nn.Module, e: BaseException, why: Optional[str],
                  kwargs: Sequence[str] = (), at_call: bool = False) -> TraceError:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    short = f"{type(e).__name__}: {first}"
    where = _source_line(e)
    path, owner = _owner_of_line(model, where[0], where[1]) if where else ("", model)
    at = f"{where[0]}:{where[1]}" + (f": `{where[2]}`" if where[2] else "") if where else ""
    module = f"{type(owner).__name__} (module {('at ' + repr(path)) if path else 'at the root'})"
    hint_path = repr(path) if path else "'<submodule>'"
    inputs = "the call's arguments" if at_call else "example_inputs/example_kwargs"
    if _is_data_dependent(e):
        # export's failure is the one to fix: torch.fx's (tried first) often fails elsewhere, for a
        # reason export does not share (HF's "cannot specify both input_ids and inputs_embeds")
        todo = _label_hint(kwargs, where[2] if where else "", at_call) or distributions_hint(e) or (
            f"What to do: keep that module opaque with leaf_modules=[{hint_path}] (fx front end; it then "
            f"runs whole, in float32), convert its submodules separately "
            f"(fxamp.convert(model.{path or '<submodule>'}.<child>, ...)), convert the model in place "
            f"(fxamp.convert_(model): each layer is captured at its own call), or write the branch with "
            f"torch.where / torch.cond.")
        text = (
            f"torch.export could not capture {module}: data-dependent control flow at "
            f"{at or 'an unknown line'}.\n"
            f"    The branch depends on tensor values, which neither torch.fx nor torch.export can "
            f"record in one graph ({short}).\n{todo}"
        )
        if why:
            text += f"\n(torch.export ran because {why}.)"
    else:
        prefix = f"{why}, and torch.export" if why else "torch.export"
        text = (
            f"{prefix} could not capture {module}{(', ' + at) if at else ''}:\n    {short}\n"
            f"What to do: keep that module opaque with leaf_modules=[{hint_path}] (fx front end), convert "
            f"its submodules separately, convert the model in place (fxamp.convert_(model): each layer is "
            f"captured at its own call), or check that {inputs} are what forward expects."
        )
    return TraceError(text, short=short, module_path=path, original=e)
