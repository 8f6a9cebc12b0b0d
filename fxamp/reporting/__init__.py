"""What a converted model runs in which dtype, and why: one typed record per graph node.

``report(model, policy, example_inputs=...)`` calls :func:`fxamp.convert` and reads the converted graph
itself: every original node carries its :class:`~fxamp.conversion.graph.Decision` in
``node.meta["fxamp"]`` and every inserted cast carries ``node.meta["fxamp_cast"]``, so the report
and the conversion cannot disagree.  With example inputs the converted module runs once (on a
copy of the model, under ``no_grad``) and each node's dtypes and shapes are recorded; without,
the report shows what is known before running and says ``runtime`` for the rest::

    >>> r = fxamp.report(model, example_inputs=torch.randn(2, 8, 32))
    >>> print(r)                       # table, summary, dtype leaks
    >>> r.to_json(); r.to_csv()
    >>> print(r.diff(fxamp.report(model, "O2", example_inputs=torch.randn(2, 8, 32))))

The package, by job: ``records`` (Row, Summary, Report), ``observe`` (the run-time recorder),
``build`` (rows from a graph), ``lints``, ``flops``, ``diff`` (two policies), ``formats``
(table, JSON, CSV), ``numerics`` (error against float32, node by node), ``gradients``
(underflow and loss scale), ``tuning`` (``autotune``: float32 fallback until a tolerance holds),
``debug`` (the first node to overflow).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..conversion.blocks import BLOCKS_FRONTEND
from ..conversion.rewrite.checkpointing import checkpoint_calls, inline_checkpoints_
from ..conversion.convert import convert, policy_of
from ..info import conversion_info
from ..conversion.lazy import LazyConverted
from ..policy import Policy
from .arguments import policy_and_inputs
from .tuning import TuneResult, autotune, load_overrides, save_overrides
from .blocks import blocks_report
from .build import build_report
from .diff import DiffRow, PolicyDiff
from .float8 import measure_float8
from .formats import CSV_COLUMNS, FLOAT8_COLUMNS, NUMERICS_COLUMNS
from .numerics import as_batches, measure, sqnr
from .gradients import GradientReport, GradStats, plot_histogram, scan_gradients
from .observe import bind_inputs, observe_run
from .records import CastIn, Float8Cell, Float8Measure, Lint, NodeNumerics, NumericsSummary, Report, Row, Summary

__all__ = ["Report", "Row", "CastIn", "Lint", "Summary", "NodeNumerics", "NumericsSummary", "PolicyDiff", "DiffRow",
           "CSV_COLUMNS", "NUMERICS_COLUMNS", "FLOAT8_COLUMNS", "Float8Cell", "Float8Measure", "report", "compare", "sqnr", "autotune", "save_overrides",
           "load_overrides", "TuneResult", "GradientReport", "GradStats", "plot_histogram"]


def report(
    model: nn.Module,
    policy: Union[str, Policy, None] = None,
    *deprecated_order: Any,
    example_inputs: Any = None,
    dtype: Union[str, torch.dtype, None] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    numerics: bool = False,
    gradients: bool = False,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    plot: Optional[str] = None,
    **convert_options: Any,
) -> Report:
    """Convert ``model`` as :func:`fxamp.convert` would and report every node's category, reason and dtypes.

    The arguments are ``convert``'s: ``report(model, "O2", example_inputs=x)`` (the older order
    ``report(model, x, "O2")`` still works for one release, with a DeprecationWarning).
    example_inputs: a tensor or a tuple of them; when given, a copy of the converted model runs
                    once under ``no_grad`` to observe dtypes, shapes and FLOPs.  A list of tuples
                    (or another iterable of them) is several batches: the first is observed,
                    all are measured with ``numerics``.
    numerics:       also run the float32 model and the converted one side by side on every batch
                    (both in eval mode) and add each node's SQNR against float32, max relative
                    error, inf/NaN count and float16 overflow/underflow fractions, the culprit
                    (first sharp drop) and the worst op (see :mod:`fxamp.reporting.numerics`).  Under a
                    policy with ``float8=``, also each candidate matmul's float8 SQNR against bfloat16
                    and its amax and scale ranges (the float8 column; :mod:`fxamp.reporting.float8`).
    gradients:      also run one forward and backward of the float32 model on the first batch and
                    report, per parameter and per node, the gradient values float16 would flush to
                    zero or keep only as subnormals, and the loss scale fxamp's dynamic scaler would
                    settle on (``Report.gradients``, see :mod:`fxamp.reporting.gradients`).
    loss_fn:        with ``gradients``: ``loss_fn(output) -> scalar``; default: the model's own
                    ``output.loss``, else a 0-dim output (the loss), else the mean square of its float outputs.
    plot:           with ``gradients``: write the histogram of log2|gradient| to this PNG (matplotlib).
    policy, dtype:  as for ``convert`` (default ``"O1"``).  A module that ``convert`` already
                    returned is reported as it is (then pass no policy or options).
    convert_options: the other keyword options of ``convert`` (``overrides``, ``module_overrides``,
                    ``leaf_modules``, ``keep_norms_fp32``, ``frontend``, ``op_lists``, ``dynamic``…).
    """
    policy, example_inputs = policy_and_inputs("report", policy, deprecated_order, example_inputs, default=None)
    if isinstance(model, LazyConverted):
        model = model.graph_module  # the graph its latest call ran (an error before its first call)
    info = conversion_info(model) if isinstance(model, nn.Module) else None
    if info is not None and info.frontend == BLOCKS_FRONTEND:  # converted in place (fxamp.convert_)
        if example_inputs is not None or policy is not None or dtype is not None or convert_options or \
                example_kwargs or numerics or gradients:
            raise ValueError("fxamp.report of a model converted in place (fxamp.convert_) reports the graphs its "
                             "blocks captured: pass the model alone (call it first, with the inputs you use)")
        return blocks_report(model)
    batches = as_batches(example_inputs)
    inputs = batches[0] if batches else None
    for flag, on in (("numerics", numerics), ("gradients", gradients)):
        if on and not batches and not example_kwargs:
            raise ValueError(f"{flag}=True runs the model: pass example_inputs (a tuple, or a list of tuples)")
        if on and policy_of(model) is not None:
            raise ValueError(f"{flag}=True needs the original float32 model: pass it, not the module fxamp.convert "
                             f"returned")
    if (loss_fn is not None or plot is not None) and not gradients:
        raise ValueError("loss_fn= and plot= go with gradients=True")
    if policy_of(model) is not None:
        if policy is not None or dtype is not None or convert_options or example_kwargs:
            raise ValueError("this module was already converted by fxamp: report it without policy, dtype or "
                             "convert options, or report the original model")
        gm = model
        if inputs is not None or example_kwargs:
            gm = copy.deepcopy(model)
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxamp.report takes an nn.Module, not {type(model).__name__}")
        # Running the model would update its BatchNorm statistics (O1 shares them): run a copy.
        source = copy.deepcopy(model) if (inputs is not None or example_kwargs) else model
        gm = convert(source, "O1" if policy is None else policy, dtype=dtype, example_inputs=inputs,
                     example_kwargs=example_kwargs, **convert_options)
        if isinstance(gm, LazyConverted) and (inputs is not None or example_kwargs):
            # a graph per mode, or a torch.export capture of a root with hooks: the graph captured from the example
            # inputs is the one reported (the root's hooks, held by the LazyConverted, are no op of it)
            gm = gm.graph_module
    if checkpoint_calls(gm):  # every op in one table: the blocks run inline in the report's own copy
        gm = copy.deepcopy(gm) if gm is model else gm
        inline_checkpoints_(gm)
    observed = observe_run(gm, inputs, example_kwargs or {}) if (inputs is not None or example_kwargs) else None
    rep = build_report(gm, type(model).__name__, inputs or (), example_kwargs or {}, observed)
    if numerics:
        low = policy_of(gm).compute
        per_node, summary = measure(gm, source, batches or [()], example_kwargs or {}, low)
        f8 = measure_float8(gm, batches or [()], example_kwargs or {})
        rows = tuple(dataclasses.replace(r, numerics=per_node.get(r.node), float8=r.float8 if r.float8 is None
                                         else dataclasses.replace(r.float8, measured=f8.get(r.node)))
                     for r in rep.rows)
        rep = dataclasses.replace(rep, rows=rows, numerics_summary=summary)
    if gradients:
        scan = scan_gradients(gm, source, bind_inputs(gm, inputs, example_kwargs or {}), loss_fn)
        rep = dataclasses.replace(rep, gradients=scan)
        if plot is not None:
            plot_histogram(scan, plot, title=None)
    return rep


def compare(
    model: nn.Module,
    policies: Optional[Tuple[Union[str, Policy], Union[str, Policy]]] = None,
    *deprecated_order: Any,
    example_inputs: Any = None,
    dtype: Union[str, torch.dtype, None] = None,
    **convert_options: Any,
) -> PolicyDiff:
    """Report ``model`` under two policies (default ``("O1", "O2")``) and return the nodes that change category
    or dtype: ``compare(model, ("O1", "O2"), example_inputs=x)``, the order of ``convert`` (the older
    ``compare(model, x, policies)`` still works for one release, with a DeprecationWarning)."""
    policies, example_inputs = policy_and_inputs("compare", policies, deprecated_order, example_inputs,
                                                 default=("O1", "O2"), pair=True)
    if len(policies) != 2:
        raise ValueError(f"compare takes two policies, such as ('O1', 'O2'), not {policies!r}")
    a, b = (report(model, p, example_inputs=example_inputs, dtype=dtype, **convert_options) for p in policies)
    return a.diff(b)
