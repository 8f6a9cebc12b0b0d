"""train() / eval() on captured graphs: the mode a front end bakes in, made switchable again.

Both front ends run ``forward`` once to capture it, so every ``self.training`` it reads becomes a
constant: ``F.dropout(x, 0.1, training=True)`` (fx), ``aten.dropout(x, 0.1, True)`` and
``aten.batch_norm(..., True, ...)`` (export), ``dropout_p=0.1`` passed to attention.
:func:`capture_in_both_modes` captures in training mode and in eval mode; when the two graphs run
the same ops (dropout, batch-norm counters and layout no-ops aside), the training capture is kept
and :func:`make_modes_switchable` turns each baked flag into a read of the owning module's
``training`` attribute at run time::

    dropout = aten.dropout(x, 0.1, True)                 training = getattr(self.drop, "training")
                                                 ==>     dropout = aten.dropout(x, 0.1, training)
    attn = aten.scaled_dot_product_attention(            training_1 = getattr(self.attn, "training")
        q, k, v, None, 0.1)                              p = 0.1 * training_1      # 0.0 in eval mode
                                                         attn = aten.scaled_dot_product_attention(q, k, v, None, p)
    add_ = aten.add_(bn_num_batches_tracked, 1)  ==>     batch_norm = self.bn(x)      # the original module
    batch_norm = aten.batch_norm(x, bn_weight, …, True, 0.1, 1e-05, False)

The flags are plain ``getattr``/``*`` nodes (neutral ops, no helper functions in the graph).  The
owner is the innermost module the node was traced in (``nn_module_stack``), so
``model.encoder.eval()`` on one submodule works as on the original; a :class:`ModeFlag` child
named ``_fxamp_mode`` stands for the root, which a graph cannot name.  An ``aten.batch_norm`` that
reads exactly its module's tensors becomes a ``call_module`` of the original ``BatchNorm``
(statistics, momentum and ``num_batches_tracked`` then behave as the original's in both modes).

When the two graphs run the same ops but pass different constants (``self.training`` handed to a
``torch.fx.wrap``'d ``drop_path(x, p, training)``, ``p if self.training else 0.``), each such
argument becomes the owner's flag, or ``getitem((eval value, training value), flag)``::

    drop_path = drop_path(linear, 0.5, True)     ==>     training = getattr(self._fxamp_mode, "training")
                                                         drop_path = drop_path(linear, 0.5, training)

When the two captures differ otherwise (a ``DropPath`` that returns its input unless
``self.training``, timm's ``drop_path(x, p, self.training)`` traced through, any other branch on the
mode), no single graph is right in both modes: the capture of the model's current mode is kept, its
dropout and batch-norm flags still switch, and a note names the first op that differs.  Callers
that pass ``graph_per_mode`` hold a graph per mode: ``convert`` (either front end, with or without
example inputs) returns a ``fxamp.conversion.lazy.LazyConverted`` holding this graph for the current
mode, which captures the other mode at its first call in that mode (torch.fx needs no inputs), with
one set of parameters for both; ``convert_``'s families key their graphs by mode too.  Without
``graph_per_mode`` (a direct ``capture``), a warning says the graph follows the mode at capture.

A batch norm's flag is rebound only where it follows the module's mode: it differs between the two
captures, or (one capture) the call is a ``BatchNorm``'s own with running statistics.  A constant
flag stays: weight standardisation (timm's ``ScaledStdConv2d``) normalises a weight with
``F.batch_norm(w, None, None, training=True)`` in both modes.  The comparison reads the flag where
the capture put it (torch.fx records ``F.batch_norm``'s sixth argument as the keyword ``training``), so
a subclass's ``True if self.training else ...`` (timm's ``BatchNormAct2d``) follows the mode.  Only a
``BatchNorm`` running torch's own forward becomes a call of the module (a subclass's forward adds an
activation, which would then run twice); a subclass's ``num_batches_tracked += 1`` that the eval capture
does not run adds ``getitem((0, 1), flag)``, so an eval call changes no buffer.
Limitation: a dropout written with a literal ``training=True`` (or ``False`` in an eval-mode
capture) follows the module's mode.
"""

from __future__ import annotations

import contextlib
import operator
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..graph import fetch_attr, module_path_of, node_arg, replace_node_arg
from .common import UnsoundCapture, warn
from .mode_reads import mode_reader

__all__ = ["MODE_FLAG", "ModeFlag", "training_mode", "mode_reader", "capture_modes", "capture_in_both_modes",
           "make_modes_switchable"]

aten = torch.ops.aten


#: the child of a graph module whose ``training`` flag stands for the root's
MODE_FLAG = "_fxamp_mode"


class ModeFlag(nn.Module):
    """A parameterless child that follows the root's ``train()``/``eval()``: the owner of root-level dropouts."""

    def forward(self) -> bool:  # pragma: no cover - never called, only read
        return self.training


@contextlib.contextmanager
def training_mode(model: nn.Module, mode: bool) -> Iterator[None]:
    """Set every module's ``training`` to ``mode`` (the attribute, not ``train()``, which classes may
    override); restore each module's own flag on exit."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = mode
        yield
    finally:
        for m, old in modes:
            m.training = old


# ---------------------------------------------------------------------------------------------
# Capturing in both modes
# ---------------------------------------------------------------------------------------------

#: (target, index, name) of each mode flag: dropouts and batch norms, torch-level and aten
_DROPOUT_FLAGS = {
    F.dropout: (2, "training"), F.dropout1d: (2, "training"), F.dropout2d: (2, "training"),
    F.dropout3d: (2, "training"), F.alpha_dropout: (2, "training"), F.feature_alpha_dropout: (2, "training"),
    torch.dropout: (2, "train"), torch.alpha_dropout: (2, "train"), torch.feature_alpha_dropout: (2, "train"),
    torch.feature_dropout: (2, "train"),
    aten.dropout.default: (2, "train"), aten.feature_dropout.default: (2, "train"),
    aten.alpha_dropout.default: (2, "train"), aten.feature_alpha_dropout.default: (2, "train"),
    aten.native_dropout.default: (2, "train"),
}
_ATTENTION = {F.scaled_dot_product_attention: (4, "dropout_p"),
              aten.scaled_dot_product_attention.default: (4, "dropout_p")}
_BATCH_NORM_FLAGS = {F.batch_norm: (5, "training"), torch.batch_norm: (5, "training"),
                     aten.batch_norm.default: (5, "training")}
#: ops a mode may add or drop without changing what the graph computes
_MODE_NOISE = {aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
               aten.detach_.default, aten.lift_fresh_copy.default, aten._assert_tensor_metadata.default}
_MODE_NOISE_METHODS = {"contiguous", "clone", "detach"}


def _is_counter_update(node: fx.Node) -> bool:
    """``num_batches_tracked += 1`` (batch norm in training mode)."""
    if node.target in (aten.add_.Tensor, "add_", operator.iadd) and node.args:
        first = node.args[0]
        return isinstance(first, fx.Node) and str(first.target).endswith("num_batches_tracked")
    return False


def _op_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes running the ops a graph runs, minus those a mode may change without changing the computation."""
    nodes = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.target in _DROPOUT_FLAGS or node.target in _MODE_NOISE or _is_counter_update(node):
            continue
        if node.op == "call_method" and node.target in _MODE_NOISE_METHODS:
            continue
        nodes.append(node)
    return nodes


def _first_difference(a: fx.GraphModule, b: fx.GraphModule) -> Optional[fx.Node]:
    """The first node of ``a`` (or ``b``) whose op the other graph does not run at that point."""
    ops_a = [(n.op, n.target) for n in _op_nodes(a)]
    ops_b = [(n.op, n.target) for n in _op_nodes(b)]
    if ops_a == ops_b:
        return None
    i = next((i for i, (x, y) in enumerate(zip(ops_a, ops_b)) if x != y), min(len(ops_a), len(ops_b)))
    for gm, ops in ((a, ops_a), (b, ops_b)):
        if i < len(ops):
            nodes = [n for n in gm.graph.nodes if (n.op, n.target) == ops[i]]
            if nodes:
                return nodes[0]
    return None  # pragma: no cover


#: the literal arguments a switchable graph may hold different values for: the flags rewritten below
_HANDLED_ARGS = {**_ATTENTION, **_BATCH_NORM_FLAGS}
#: node.meta key (this module only): ``[(index or keyword, value in eval mode, value in training mode)]``
_MODE_ARGS = "fxamp_mode_args"
#: node.meta key (this module only), on batch norms of a graph compared with the other mode's: whether
#: its ``training`` flag differed between the modes (it follows the module's mode, so it may be rebound)
_FLAG_FOLLOWS_MODE = "fxamp_flag_follows_mode"
#: node.meta key (this module only), on a training graph's ``num_batches_tracked += 1`` that the eval
#: graph does not run (``if self.training: ...``): it must run in training mode only
_COUNTS_IN_TRAINING = "fxamp_counts_in_training"


def _literal(value: Any) -> bool:
    """A constant ``getitem((eval, train), flag)`` can select: no graph values inside."""
    if isinstance(value, (list, tuple)):
        return all(_literal(v) for v in value)
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and isinstance(b, fx.Node)  # graph values: the op sequence matched
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b  # nan
    try:
        return bool(a == b)
    except Exception:  # tensors and other objects with an elementwise __eq__
        return a is b


_MISSING = object()


def _arg(node: fx.Node, index: Optional[int], key: Optional[str]) -> Any:
    """Positional argument ``index``, else keyword ``key`` (where both are given: torch.fx records
    ``F.batch_norm(x, rm, rv, w, b, flag)`` with ``training=flag`` as a keyword), else an ATen op's
    schema default."""
    if index is None:
        return node.kwargs.get(key, _MISSING)
    if index < len(node.args):
        return node.args[index]
    if key is not None and key in node.kwargs:
        return node.kwargs[key]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and index < len(schema.arguments):
        argument = schema.arguments[index]
        if argument.name in node.kwargs:
            return node.kwargs[argument.name]
        if argument.has_default_value():
            return argument.default_value
    return _MISSING


def _mode_dependent_args(train_gm: fx.GraphModule, eval_gm: fx.GraphModule) -> Optional[fx.Node]:
    """Record on each training-graph node the literal arguments that differ in the eval graph (``_MODE_ARGS``).

    The two graphs run the same ops; a literal that differs came from a ``self.training`` read (a
    flag passed to a wrapped function, ``p if self.training else 0.``).  Returns the first node
    whose difference cannot be selected by the mode (graph values inside it), else None.
    """
    marks: Dict[fx.Node, List[Tuple[Any, Any, Any]]] = {}
    for t, e in zip(_op_nodes(train_gm), _op_nodes(eval_gm)):
        handled = _HANDLED_ARGS.get(t.target) if t.op == "call_function" else None
        if t.op == "call_function" and t.target in _BATCH_NORM_FLAGS:
            index, name = _BATCH_NORM_FLAGS[t.target]
            t.meta[_FLAG_FOLLOWS_MODE] = not _same(_arg(t, index, name), _arg(e, index, name))
        found = []
        keys = [(i, None) for i in range(max(len(t.args), len(e.args)))]
        keys += [(None, k) for k in sorted(set(t.kwargs) | set(e.kwargs))]
        for i, k in keys:
            tv, ev = _arg(t, i, k), _arg(e, i, k)
            if handled is not None and (i == handled[0] or k == handled[1]):
                continue
            if tv is not _MISSING and ev is not _MISSING and _same(tv, ev):
                continue
            if tv is _MISSING or ev is _MISSING or not (_literal(tv) and _literal(ev)):
                return t
            where = k if i is None else i if i < len(t.args) else t.target._schema.arguments[i].name
            found.append((where, ev, tv))
        if found:
            marks[t] = found
    for node, found in marks.items():  # only once every difference is known to be selectable
        node.meta[_MODE_ARGS] = found
    return None


def _mark_counters(train_gm: fx.GraphModule, eval_gm: fx.GraphModule) -> None:
    """Mark (``_COUNTS_IN_TRAINING``) the training graph's counter updates the eval graph does not run."""
    in_eval: Dict[str, int] = {}
    for node in eval_gm.graph.nodes:
        if _is_counter_update(node):
            in_eval[str(node.args[0].target)] = in_eval.get(str(node.args[0].target), 0) + 1
    for node in train_gm.graph.nodes:
        if _is_counter_update(node):
            target = str(node.args[0].target)
            if in_eval.get(target, 0) > 0:
                in_eval[target] -= 1
            else:
                node.meta[_COUNTS_IN_TRAINING] = True


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    # the innermost frame of the user's code: torch.fx's tracer records its own frames (proxy.py) after it
    for i in range(len(lines) - 2, -1, -1):
        if lines[i].startswith("File ") and not lines[i + 1].startswith("File ") \
                and not any(root in lines[i] for root in _LIBRARY_ROOTS):
            return f" ({lines[i]}: `{lines[i + 1]}`)"
    return ""


_LIBRARY_ROOTS = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep)  # torch's, fxamp's


#: GraphModule.meta key: the error of the other mode's capture, when it failed (a graph for one mode only)
OTHER_MODE_FAILED = "fxamp_other_mode_failed"


def capture_in_both_modes(
    model: nn.Module, capture: Callable[[], fx.GraphModule], *, graph_per_mode: bool = False
) -> Tuple[fx.GraphModule, bool, List[str]]:
    """Run ``capture`` in the model's current mode and in the other; returns (graph, the mode it was
    captured in, notes).  The training-mode graph when the two agree, else the current mode's.

    graph_per_mode: the caller keeps a graph per mode (captures the other mode when it is used), so
    graphs that differ, or another mode that fails to capture, are no warning, and the note says so.
    """
    current = model.training
    with training_mode(model, current):
        first = capture()  # errors here are the front end's errors
    try:
        with training_mode(model, not current):
            second = capture()
    except UnsoundCapture:  # the front end cannot capture this model in any mode
        raise
    except Exception as e:  # the other mode fails: keep the capture that worked
        if graph_per_mode:  # the caller captures the other mode at its first call, in its own words if it fails
            # again (or with another front end: a block's torch.export), so this graph is for this mode only
            first.meta[OTHER_MODE_FAILED] = e  # (capture() tries torch.export first, when it has inputs)
            return first, current, [f"captured in {_mode(current)} mode ({_mode(not current)} mode failed: "
                                    f"{type(e).__name__}): a graph per mode, the {_mode(not current)} mode's is "
                                    f"captured at its first call"]
        note = (f"captured in {_mode(current)} mode only ({_mode(not current)} mode failed: {type(e).__name__}); "
                f"train()/eval() switch its dropout and batch norms")
        warn(note)
        return first, current, [note]
    train_gm, eval_gm = (first, second) if current else (second, first)
    _mark_counters(train_gm, eval_gm)
    diff = _first_difference(train_gm, eval_gm)
    if diff is None:
        diff = _mode_dependent_args(train_gm, eval_gm)
        if diff is None:
            return train_gm, True, []
        what = "an argument that is not a constant"
    else:
        what = "a different op"
    op = diff.target if isinstance(diff.target, str) else getattr(diff.target, "__name__", str(diff.target))
    head = f"training and eval mode capture different graphs (first at {op}{_where(diff)}: {what})"
    if graph_per_mode:
        return first, current, [f"{head}: a graph per mode; this one is for {_mode(current)} mode, the other "
                                f"mode's is captured at its first call"]
    note = (f"{head}: the graph follows {_mode(current)} mode, the mode at capture; train()/eval() switch only "
            f"its dropout and batch norms. Convert in the mode you will run it in.")
    warn(note)
    return first, current, [note]


def capture_modes(
    model: nn.Module, capture: Callable[[], fx.GraphModule], *, graph_per_mode: bool = False
) -> Tuple[fx.GraphModule, bool, List[str], Optional[bool]]:
    """Capture once (training mode) when no code of ``model`` reads ``training`` (:func:`mode_reader`),
    else in both modes (:func:`capture_in_both_modes`).  Returns (graph, the mode it was captured in,
    notes, the one mode the graph is right in or None when it is right in both); a note says which."""
    reader = mode_reader(model)
    if reader is None:
        with training_mode(model, True):
            gm = capture()
        return gm, True, ["captured once, in training mode: no module's code reads self.training besides "
                          "torch.nn's dropout and batch-norm layers, whose flags train()/eval() switch, and "
                          "reads that pick between values equal in both modes"], None
    gm, mode, notes = capture_in_both_modes(model, capture, graph_per_mode=graph_per_mode)
    only_mode = mode if notes else None  # notes from capture_in_both_modes: the modes' graphs differ
    return gm, mode, notes + [f"captured in training and in eval mode: the code of {reader} reads "
                              f"self.training, so the graph may depend on the mode"], only_mode


def _mode(training: bool) -> str:
    return "training" if training else "eval"


# ---------------------------------------------------------------------------------------------
# Making the baked flags switchable
# ---------------------------------------------------------------------------------------------


class _Owners:
    """``getattr(owner, "training")`` nodes: the owner is the innermost module a node was traced in."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.flags: Dict[str, fx.Node] = {}  # one flag per owner, made before its first use

    def module(self, node: fx.Node) -> Optional[nn.Module]:
        path = module_path_of(node)
        return self.modules.get(path) if path else None

    def flag(self, node: fx.Node, fresh: bool = False) -> fx.Node:
        """The owner's flag, made before ``node`` if it is its first use (``fresh``: a new read there)."""
        path = module_path_of(node)
        if not path or path not in self.modules:
            path = MODE_FLAG
            if path not in self.modules:
                self.gm.add_module(path, ModeFlag())
                self.modules[path] = self.gm.get_submodule(path)
                self.modules[path].training = self.gm.training
        if path not in self.flags or fresh:
            graph = self.gm.graph
            with graph.inserting_before(node):
                owner = graph.get_attr(path)
                flag = graph.call_function(getattr, (owner, "training"))
            flag.meta["val"] = True
            if fresh:
                return flag
            self.flags[path] = flag
        return self.flags[path]


def make_modes_switchable(gm: fx.GraphModule, captured_in: bool) -> List[str]:
    """Rewrite the flags ``gm`` was captured with (``captured_in``: training mode?); returns notes."""
    owners = _Owners(gm)
    graph = gm.graph
    counts: Dict[str, int] = {}

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    lost = 0
    for node in list(graph.nodes):
        for where, in_eval, in_training in node.meta.pop(_MODE_ARGS, ()):
            flag = owners.flag(node)
            if in_eval is not False or in_training is not True:  # not the flag itself: select by it
                with graph.inserting_before(node):
                    flag = graph.call_function(operator.getitem, ((in_eval, in_training), flag))
                flag.meta["val"] = in_training
            index, name = (where, "") if isinstance(where, int) else (len(node.args), where)
            replace_node_arg(node, index, name, flag)
            count("mode argument")
        if node.op != "call_function":
            continue
        target = node.target
        if target in _DROPOUT_FLAGS:
            index, name = _DROPOUT_FLAGS[target]
            default = True if target in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d) else None
            if node_arg(node, index, name, default) is captured_in:
                replace_node_arg(node, index, name, owners.flag(node))
                count("dropout")
        elif target in _ATTENTION:
            index, name = _ATTENTION[target]
            p = node_arg(node, index, name, 0.0)
            if captured_in and isinstance(p, (int, float)) and p > 0:
                flag = owners.flag(node)
                with graph.inserting_before(node):
                    p_node = graph.call_function(operator.mul, (float(p), flag))  # p if training else 0.0
                p_node.meta["val"] = float(p)
                replace_node_arg(node, index, name, p_node)
                count("attention dropout")
            elif not captured_in and isinstance(p, (int, float)) and p == 0:
                lost += 1
        elif target in _BATCH_NORM_FLAGS:
            index, name = _BATCH_NORM_FLAGS[target]
            follows = node.meta.pop(_FLAG_FOLLOWS_MODE, None)
            if follows is None:  # not compared with the other mode's capture: only a BatchNorm's own call
                follows = _runs_batch_norm_module(owners, node)
            if target is aten.batch_norm.default and _batch_norm_to_module(gm, owners, node):
                count("batch norm")
            elif follows and node_arg(node, index, name, False) is captured_in:
                replace_node_arg(node, index, name, owners.flag(node))
                count("functional batch norm")
    for node in list(graph.nodes):  # counters a call of the original BatchNorm did not take over
        if node.meta.pop(_COUNTS_IN_TRAINING, False):
            flag = owners.flag(node, fresh=True)  # (the owner's first flag may come after its counter)
            with graph.inserting_before(node):
                step = graph.call_function(operator.getitem, ((0, 1), flag))  # num_batches_tracked += 0 in eval
            step.meta["val"] = 1
            node.args = (node.args[0], step, *node.args[2:])
            count("batch counter")
    notes = []
    if counts:
        notes.append("train()/eval() reach " + ", ".join(f"{what} x{n}" for what, n in sorted(counts.items())) +
                     ": each reads its module's training flag at run time")
    if lost:
        notes.append(f"captured in eval mode: {lost} attention call(s) have dropout_p=0 baked in, in train() too")
    return notes


def _runs_batch_norm_module(owners: _Owners, node: fx.Node) -> bool:
    """A batch norm traced inside a torch ``BatchNorm`` with running statistics: its flag is the module's mode.

    Any other ``F.batch_norm`` may pass a constant on purpose (weight standardisation normalises a
    weight with ``training=True`` and no statistics, in both modes), so its flag is left as captured.
    """
    m = owners.module(node)
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and node_arg(node, 1, "running_mean", None) is not None


def _batch_norm_to_module(gm: fx.GraphModule, owners: _Owners, node: fx.Node) -> bool:
    """Replace ``aten.batch_norm`` (and its ``num_batches_tracked += 1``) by a call of the original BatchNorm."""
    m = owners.module(node)
    if not isinstance(m, nn.modules.batchnorm._BatchNorm) or node.kwargs or not _torch_forward(m):
        return False
    expected = (m.weight, m.bias, m.running_mean, m.running_var)
    for arg, want in zip(node.args[1:5], expected):
        if want is None:
            if arg is not None:
                return False
        elif not (isinstance(arg, fx.Node) and arg.op == "get_attr" and fetch_attr(gm, str(arg.target)) is want):
            return False
    counters = [n for n in gm.graph.find_nodes(op="call_function", target=aten.add_.Tensor)
                if m.num_batches_tracked is not None and isinstance(n.args[0], fx.Node)
                and n.args[0].op == "get_attr" and fetch_attr(gm, str(n.args[0].target)) is m.num_batches_tracked
                and not n.users]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(module_path_of(node), (node.args[0],))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    for c in counters:
        gm.graph.erase_node(c)
    return True


def _torch_forward(m: nn.Module) -> bool:
    """Whether ``m`` runs torch's own BatchNorm forward: a subclass's forward (norm, then an activation:
    timm's ``BatchNormAct2d``) does more than the one op a call of it would replace."""
    return getattr(type(m).forward, "__module__", None) == nn.modules.batchnorm.__name__
