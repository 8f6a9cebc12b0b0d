"""The ``torch.fx`` front end: symbolic tracing, no example inputs needed.

``torch.fx.symbolic_trace`` runs with torch.nn modules as leaves; then the simple leaf modules
(Linear, ConvNd, PReLU, Embedding) are *inlined* into their functional form, so their weights
become graph values that can be cast once and shared::

    linear = self.fc(x)         ==>     fc_weight = self.fc.weight;  fc_bias = self.fc.bias
                                        linear = F.linear(x, fc_weight, fc_bias)   # meta[graph.MODULE] = ("fc", nn.Linear)

A tied weight is read under one name (its first), so it is cast once whoever uses it.
torch.nn's transformers are not leaves: they are traced through their reference path
(``capture/transformer.py``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import itertools
import linecache
import re
import sys
import textwrap
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ...errors import TraceError
from ..op_lists import VIEW_OPS, is_inplace, op_key
from ..graph import MODULE, canonical_names, dedupe_get_attrs, fetch_attr, mirror_module_tree, rename_node
from ..runtime.recompute import island_input, island_loss, island_on, island_output, island_upcast
from ..runtime import attention, call_module_cast, cast, cast_weights, checkpointed, multi_head_attention
from .common import (_FXAMP_DIR, _TORCH_DIR, LeafSpec, UnsoundCapture, Written, changed_attributes, shallow_copy,
                     plain_attributes, user_line)
from .constants import fit_fill_values, fit_scalar
from .hooks import has_own_hooks, traced_hooks_error
from .regions import (confirmed, fx_region_error, region_note, region_state, scan,
                      traced_region_error, unreadable_region)
from .transformer import FORWARDS, canonical_masks, causal_hint, fast_path_padding, traced_class

__all__ = ["FxFrontEnd", "FxTracer", "identity_test_error"]


class FxFrontEnd:
    """``torch.fx`` symbolic tracing with ``leaf_modules`` kept opaque (see :class:`~fxamp.conversion.capture.common.FrontEnd`)."""

    name = "fx"
    trace_with_grad = True  # see trace()

    def __init__(self, model: nn.Module, leaf_modules: Sequence[LeafSpec] = (), none_inputs: Sequence[str] = ()):
        self.model = model
        # forward's inputs traced as None (``labels=None``): torch.fx traces every other input as a value, so
        # ``if labels is not None:`` takes the branch where it is given (a graph per None pattern: lazy.py)
        self.none_inputs = tuple(none_inputs)
        self.written: List[Written] = []  # plain attributes forward changed while traced
        refused = traced_hooks_error(model, "torch.fx")
        if refused is not None:
            raise refused
        self.leaf_types, self.leaf_paths = _split_leaves(model, leaf_modules)
        self.opaque = tuple(p for p, m in model.named_modules()
                            if p and (p in self.leaf_paths or isinstance(m, self.leaf_types) or has_own_hooks(m)))

    def lead_notes(self) -> List[str]:
        return []

    def trace(self) -> fx.GraphModule:
        model = self.model
        tracer = self.make_tracer()
        tracer.stack_traces = True  # where each node came from: regions and checkpoint calls (regions.py)
        # Trace a shallow copy: the tracer stores tensor constants as attributes of the root, and
        # the user's model must not change.
        root = shallow_copy(model)
        if FORWARDS.get(type(model)) is not None:  # a torch.nn transformer at the root
            root.__class__ = traced_class(type(model))
        # grad enabled while tracing (not when the trace runs the call's values: concrete.py): a no_grad
        # region then changes the grad mode even when convert() is called under torch.no_grad()
        grad = torch.enable_grad() if self.trace_with_grad else contextlib.nullcontext()
        with _buffer_writes_refused(model), grad:
            before = plain_attributes(root)  # (the copy's own, and its submodules', which are the model's)
            try:
                graph = tracer.trace(root, {name: None for name in self.none_inputs} or None)
            except Exception as e:  # anything torch.fx raises while running forward on proxies
                raise _trace_error(model, tracer, e) from e
            finally:
                self.written.extend(w for w in changed_attributes(root, before) if w not in self.written)
        _named_as_forward(graph, self.none_inputs)
        for node in graph.nodes:
            if isinstance(node.type, str):
                # a postponed annotation (``from __future__ import annotations``, or fxamp's own
                # forward): the generated code would hold the string as a global, which pickling
                # (torch.save of the converted module) cannot import; annotations change nothing else
                node.type = None
        for path, _, f in confirmed(scan(model, self.opaque, [graph]), [graph]):
            if f.kind in ("grad", "autocast"):  # torch.fx records nothing of it: refuse rather than drop it
                raise fx_region_error(model, path, f)
        if tracer.region is not None:  # a region the source scan could not see (no source to read)
            raise traced_region_error(model, *tracer.region)
        return fx.GraphModule(root, graph, class_name=type(model).__name__)

    def make_tracer(self) -> fx.Tracer:
        """The tracer of one trace (a subclass's may trace with the values of a call: ``concrete.py``)."""
        return FxTracer(self.leaf_types, self.leaf_paths)

    def error(self, e: BaseException) -> TraceError:  # pragma: no cover - trace() raises TraceError itself
        return TraceError(f"torch.fx could not trace {type(self.model).__name__}: {e}", short=str(e), original=e)

    def adopt(self, gm: fx.GraphModule) -> None:
        mirror_module_tree(gm, self.model)
        _canonicalize_get_attrs(gm, self.model)
        _inline_simple_modules(gm)

    def finish(self, gm: fx.GraphModule) -> List[str]:
        _fresh_written_constants(gm)
        return fit_fill_values(gm)  # (the root's hooks: convert registers them on what it returns)


def stack_trace() -> str:
    """What torch.fx records as a node's ``stack_trace`` with ``record_stack_traces`` (the frames from the outermost
    ``forward`` on, less torch's tracing internals, as ``traceback`` formats them, without the caret lines), read
    from the live frames: torch.fx's own recording symbolizes and formats every frame of the stack, half the time of
    an in-place capture of T5 (1 ms a node)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    first = next((i for i, f in enumerate(frames) if f.f_code.co_name == "forward"), None)
    if first is None:
        return ""
    boring = _uninteresting_files()
    lines = []
    for f in frames[first:]:
        code = f.f_code
        if code.co_filename in boring:
            continue
        lineno = f.f_lineno or 0  # (None while a frame has no line: Python 3.12's instrumentation)
        lines.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        text = linecache.getline(code.co_filename, lineno).strip()
        if text:
            lines.append(f"    {text}\n")
    return "".join(lines).strip()


@functools.lru_cache(maxsize=1)
def _uninteresting_files() -> frozenset:
    from torch.fx.experimental.symbolic_shapes import uninteresting_files
    return frozenset(uninteresting_files())


class FxTracer(fx.Tracer):
    # fxamp's run-time casts stay calls when a converted module is traced again (FX re-traces
    # the generated code when it unpickles a GraphModule).
    def __init__(self, leaf_types: Tuple[type, ...] = (), leaf_paths: Tuple[str, ...] = ()):
        super().__init__(autowrap_functions=(cast, cast_weights, call_module_cast, checkpointed, attention,
                                             multi_head_attention, island_on, island_input, island_output,
                                             island_upcast, island_loss,
                                             fit_scalar, canonical_masks, causal_hint, fast_path_padding))
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths
        self._region_start = region_state()
        self.region: Optional[Tuple[fx.Node, str]] = None  # the first node made inside a grad/autocast region
        self._constants: Dict[int, Tuple[torch.Tensor, int]] = {}  # tensors the graph holds as constants
        self.stack_traces = False  # record each node's stack_trace (stack_trace(), not torch.fx's own recording)

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        self._region_start, self.region, self._constants = region_state(), None, {}
        graph = super().trace(root, concrete_args)
        self._refuse_written_constants(graph)
        return graph

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and a not in self.tensor_attrs:
            self._constants.setdefault(id(a), (a, a._version))  # (its version when the graph first read it)
        return super().create_arg(a)

    def _refuse_written_constants(self, graph: fx.Graph) -> None:
        """A tensor forward makes without inputs (``state = [torch.zeros(8)]``) is a constant of the graph; an
        in-place write into it by code that reads no traced value (``state[0].add_(1)``) runs once, now, and is
        not recorded: every use in the graph, before the write too, would read the written value."""
        written = [t for t, version in self._constants.values() if t._version != version]
        if not written:
            return
        names = {id(v): k for k, v in vars(self.root).items() if isinstance(v, torch.Tensor)}
        where = ""
        for node in graph.find_nodes(op="get_attr"):
            if names.get(id(written[0])) == node.target and node.users:
                found = [f for f in _FRAME_LINE.findall(next(iter(node.users)).meta.get("stack_trace") or "")
                         if not f[0].startswith((_TORCH_DIR, _FXAMP_DIR))]
                if found:
                    where = f" (read at {found[-1][0]}:{found[-1][1]}: `{found[-1][2].strip()}`)"
                break
        raise WrittenConstant(
            f"forward writes in place into a tensor it made from constants ({tuple(written[0].shape)}, "
            f"{written[0].dtype}){where} after the graph read it: torch.fx ran that write once, while tracing, "
            f"and the graph would read the written value at every call")

    def create_node(self, kind: str, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    name: Optional[str] = None, type_expr: Optional[Any] = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self.stack_traces and not node.stack_trace:
            node.stack_trace = stack_trace()
        if self.region is None and kind != "placeholder":
            # torch.fx records no grad-mode or autocast region: see, as forward runs, whether it is in one
            region = unreadable_region(self._region_start, FxTracer.trace.__code__)
            if region is not None:
                self.region = (node, region)
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_paths:
            return True
        if has_own_hooks(m):  # traced through, its hooks would run once, at capture: called, they run each time
            return True
        if isinstance(m, torch.jit.ScriptModule):  # compiled: torch.fx records its C++ object's forward, a call
            return True                            # classified as a tensor method; called, it is an opaque leaf
        if type(m) in FORWARDS:  # torch.nn's transformers: traced into (capture/transformer.py)
            return False
        if parametrize.is_parametrized(m):
            # torch makes ParametrizedLinear in torch.nn's namespace, which torch.fx keeps whole: traced into, its
            # linear is converted and its weight is made by its ParametrizationList, a leaf (op_lists)
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        body = FORWARDS.get(type(m))
        if body is not None:  # their reference path, without the checks that choose the inference fast path
            forward = functools.partial(body, m)
        if not self._installed(m):
            return self._made_at_call_time(m, forward, args, kwargs)
        return super().call_module(m, forward, args, kwargs)

    def _installed(self, m: nn.Module) -> bool:
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True

    def _made_at_call_time(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
                           kwargs: Dict[str, Any]) -> Any:
        """A module the forward makes as it runs (Mamba's ``ACT2FN[activation](out)``, ``nn.SiLU()(x)``,
        ``nn.Sequential(self.a, self.b)(x)``): torch.fx names every module it calls by its place under the root,
        and this one has none.  Holding no tensor of its own, it is its ops (and its children's calls): traced
        through, as it runs.  A parameter or buffer made with it would be new at every call: refused."""
        held = {id(t) for t in itertools.chain(self.root.parameters(), self.root.buffers())}
        own = [n for n, t in itertools.chain(m.named_parameters(), m.named_buffers()) if id(t) not in held]
        if own:  # (the trace's error names the user's line)
            raise NameError(f"the forward makes a {type(m).__name__} as it runs, with tensors of its own "
                            f"({', '.join(own[:3])}): they would be new at every call, and torch.fx records only "
                            f"modules set as attributes; make it once in __init__")
        return forward(*args, **kwargs)


class WrittenConstant(RuntimeError):
    """A constant of the graph written after the graph read it (:meth:`FxTracer._refuse_written_constants`):
    raised after the trace, so no frame of it is the user's (the message names the line)."""

    raised_after_forward = True


#: a frame of a node's ``stack_trace``: file, line, and the code on the next line
_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


def identity_test_error(model: nn.Module) -> Optional[TraceError]:
    """Refuse a forward that tests one of its inputs with a non-None default by identity (``if flag is True:``,
    ``if mode is DEFAULT:``): torch.fx evaluates the test once, on the input's proxy (never the value), and the
    graph would hold that branch for every call, silently.  ``is None`` tests of inputs that default to None
    are the None patterns' (lazy.py); a branch on a flag's truth torch.fx refuses itself."""
    if FORWARDS.get(type(model)) is not None:  # torch.nn's transformers: traced through their reference path
        return None
    forward = type(model).forward
    try:
        params = inspect.signature(forward).parameters
        lines, start = inspect.getsourcelines(forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, ValueError, SyntaxError):  # no source to read: nothing to tell
        return None
    flags = {n for n, p in params.items() if p.default is not inspect.Parameter.empty and p.default is not None}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)):
            continue
        name = next((e.id for e in (node.left, *node.comparators) if isinstance(e, ast.Name) and e.id in flags), None)
        if name is not None:
            line = lines[node.lineno - 1].strip()
            return TraceError(
                f"torch.fx cannot capture {type(model).__name__}: its forward tests the input {name!r} by identity "
                f"(`{line}`, line {start + node.lineno - 1}), which torch.fx evaluates once, on a placeholder, not "
                f"on the value a call passes: the graph would take one branch for every value. Capture it with "
                f"torch.export, which takes each value as given (a graph per value): pass example_inputs=(...), or "
                f"leave frontend='auto' (fxamp then captures it at its first call).",
                short=f"forward tests input {name} by identity")
    return None


def _named_as_forward(graph: fx.Graph, none_inputs: Sequence[str]) -> None:
    """Give the inputs traced as None their own names back: torch.fx names such a placeholder ``labels_1``
    (a call by keyword, ``labels=None``, would not bind).  Its check stays (``_assert_is_none``): this
    graph refuses a value where it traced None."""
    for node in graph.find_nodes(op="placeholder"):
        name = str(node.target)
        if name.endswith("_1") and name[:-2] in none_inputs:
            node.target = name[:-2]
            rename_node(graph, node, name[:-2])  # (as the report and node_overrides name it)


@contextlib.contextmanager
def _buffer_writes_refused(model: nn.Module) -> Iterator[None]:
    """Refuse a forward that writes a buffer in place (timm's ``BatchNormAct2d`` counts batches with
    ``self.num_batches_tracked.add_(1)``).  torch.fx does not trace buffers: it would run the write once,
    now, on the user's model, and leave it out of the graph.  The buffer gets its value back.

    Values are compared, not only version counters: a trace with the call's values (``concrete.py``)
    updates a batch norm's running statistics without bumping them."""
    buffers = [(name, b, b._version, b.detach().clone()) for name, b in model.named_buffers()]
    # where each buffer is bound: ``self.seen += n`` (a Proxy's result) or ``self.seen = self.seen + 1``
    # re-binds the attribute, on the user's own modules (the traced root shares their ``_buffers``)
    bound = [(f"{path}.{name}" if path else name, module, name, b) for path, module in model.named_modules()
             for name, b in module._buffers.items() if b is not None]
    try:
        yield
    finally:  # (a trace that failed half way may have written some too)
        written = [(name, b, saved) for name, b, version, saved in buffers
                   if b._version != version or not _same_bits(b.detach(), saved)]
        rebound = [(full, module, name, b) for full, module, name, b in bound if module._buffers.get(name) is not b]
        for _, module, name, b in rebound:
            module._buffers[name] = b
        written += [(full, b, None) for full, _, _, b in rebound if all(full != w[0] for w in written)]
        with torch.no_grad():
            for _, b, saved in written:
                if saved is not None:
                    b.copy_(saved)
    if not written:
        return
    names = ", ".join(name for name, _, _ in written)
    path, _, attr = written[0][0].rpartition(".")
    # the line that writes the first one, when it is the model's own code (torch's BatchNorm is not scanned)
    line = next((region_note(p, f) for p, _, f in scan(model) if p == path and f.kind == "state:" + attr), None)
    where = f"({line})" if line else ("(a counter's `self.num_batches_tracked.add_(1)`, a batch norm's running "
                                       "statistics)")
    raise UnsoundCapture(
        f"torch.fx cannot capture {type(model).__name__}: its forward writes the buffer(s) {names} in place "
        f"{where}, which torch.fx "
        f"would run once while tracing and leave out of the graph. Capture it with torch.export, which keeps "
        f"the write: pass example_inputs=(...), or leave frontend= at 'auto' (fxamp then captures it at its "
        f"first call).",
        short=f"forward writes buffer {written[0][0]} in place", module_path=path)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a buffer holding NaN is not written by reading it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _split_leaves(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> Tuple[Tuple[type, ...], Tuple[str, ...]]:
    types, paths = [], []
    names = dict(model.named_modules())
    if isinstance(leaf_modules, str) or isinstance(leaf_modules, type):  # one path or class, not a list of them
        raise TypeError(f"leaf_modules takes a list of module classes or paths, not {leaf_modules!r} alone: "
                        f"write leaf_modules=[{getattr(leaf_modules, '__name__', None) or repr(leaf_modules)}]")
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


def _trace_error(model: nn.Module, tracer: FxTracer, e: Exception) -> TraceError:
    stack = list(getattr(tracer, "module_stack", {}).keys())
    path = next((p for p in reversed(stack) if p), "")
    owner = dict(model.named_modules()).get(path, model)
    line = user_line(e)
    where = f", {line}" if line else ""
    msg_first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    short = f"{type(e).__name__}: {msg_first}"
    hint_path = repr(path) if path else "a submodule path such as 'encoder'"
    finfo = ("    torch.finfo(x.dtype) needs a real dtype, which a traced value does not have; with "
             "example_inputs=(...) torch.export captures it, and fxamp fits the constant to the dtype the op "
             "runs in.\n" if "finfo" in str(e) else "")
    text = (
        f"torch.fx could not trace {type(owner).__name__} "
        f"(module {('at ' + repr(path)) if path else 'at the root'}){where}:\n"
        f"    {short}\n{finfo}"
        f"What to do: keep that module opaque with leaf_modules=[{hint_path}] (it then runs whole, "
        f"in float32 unless you override its category), convert its submodules separately, or pass "
        f"example_inputs=(...) so fxamp captures the model with torch.export instead."
    )
    return TraceError(text, short=short, module_path=path, original=e)


def _canonicalize_get_attrs(gm: fx.GraphModule, model: nn.Module) -> None:
    """Name each tied parameter by one path, so one value is cast once whoever uses it."""
    canonical = canonical_names(model)
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            value = fetch_attr(gm, node.target)
        except AttributeError:
            continue
        name = canonical.get(id(value))
        if name is not None and name != node.target:
            node.target = name
    dedupe_get_attrs(gm.graph)


def _fresh_written_constants(gm: fx.GraphModule) -> None:
    """A tensor ``forward`` makes from constants (``torch.zeros(4, 8)``) is run once by torch.fx and kept as an
    attribute (``_tensor_constant0``); an in-place write into it (``.index_add_(...)``, ``[i] = v``), or into a
    view of it, would then change that one tensor at every call, where the original starts from a fresh one.
    Such a constant is cloned at each call before it is used."""
    graph = gm.graph
    for node in list(graph.find_nodes(op="get_attr")):
        if not str(node.target).startswith("_tensor_constant"):
            continue
        seen, todo, written = {node}, [node], False
        while todo and not written:  # the constant and its views: is any of them written in place?
            for user in todo.pop().users:
                if is_inplace(user.op, user.target) and user.args and user.args[0] in seen:
                    written = True
                    break
                if user.op in ("call_method", "call_function") and op_key(user.target) in VIEW_OPS \
                        and user not in seen:
                    seen.add(user)
                    todo.append(user)
        if not written:
            continue
        with graph.inserting_after(node):
            fresh = graph.call_method("clone", (node,))
        node.replace_all_uses_with(fresh, delete_user_cb=lambda user: user is not fresh)
    graph.lint()


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
    canonical = canonical_names(gm)
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
        new.meta[MODULE] = (str(node.target), type(m))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    dedupe_get_attrs(graph)
