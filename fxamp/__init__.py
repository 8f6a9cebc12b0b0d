"""fxamp: ahead-of-time automatic mixed precision for PyTorch, as a torch.fx graph rewrite.

``fxamp.convert(model, policy="O1")`` traces the model, classifies every op (safe / neutral /
conditional / unsafe), and returns a ``GraphModule`` with explicit casts: no autocast, nothing
patched.

The top level holds what a user types, and nothing else (24 names; jmp keeps its internals under a
private package the same way):

* convert a model: ``convert``, ``convert_`` (in place, block by block), ``conversion_info`` (what
  convert did: policy, front end, notes), ``release_originals`` (after ``convert_``), ``overflow_info``;
* the option types a user builds: ``Policy``, ``Float8``, ``LeanConfig``, ``LossScaleConfig`` (every
  other option is a string: ``dynamic="all"``, ``state="bf16"``, ``debug_overflow="raise"``);
* train: ``MixedPrecisionOptimizer``, ``initialize`` (both at once), ``shard`` (FSDP2),
  ``sharded_state_dict`` / ``load_sharded_state_dict``;
* inspect: ``report``, ``compare``, ``autotune``, ``save_overrides`` / ``load_overrides``;
* the errors a user catches: ``FxampError`` and its four kinds.

The types of returned values (``Report``, ``ConversionInfo``, ``LazyConverted``…), the string
enums, the op lists and the machinery (``classify``, ``Decision``, ``LossScaler``) live in their
modules: ``from fxamp.training.loss_scale import LossScaler``.  The names that left the top level
still resolve here for one release, with a ``DeprecationWarning`` naming their module (:data:`_MOVED`).

One vocabulary across them.  A config type has one factory, ``parse``, from the string form its
``str()`` prints, presets included (``Policy.parse("O2")``, ``Float8.parse("rowwise")``,
``LossScaleConfig.parse("static:1024")``, ``LeanConfig.parse("lean")``), as jmp's ``get_policy``
reads ``"p=f32,c=f16"``; the constructors take the fields, each a value or its name
(``LeanConfig("kahan", "bf16")``), as torch's constructors take their options.  ``parse`` because every
option already reads a string (``"O2"``, ``loss_scale="static:1024"``, ``float8="rowwise"``) and that
reader was ``parse``; ``of``, ``build`` and ``LossScaleConfig``'s ``static``/``dynamic``/``none`` only
repeated the constructor (they, ``from_preset`` and ``preset`` warn for one release).  Every dtype option takes a ``torch.dtype`` or a name of
:data:`fxamp.dtypes.NAMES` (``bf16``/``bfloat16``, ``fp16``/``float16``, ``fp32``/``float32``).  Every
entry point takes ``(model, policy, *, example_inputs=...)``, in ``convert``'s order.
"""

import types as _types

from .api import initialize
from .conversion.convert import convert, convert_
from .conversion.rewrite.debug import overflow_info
from .errors import ConversionError, FxampError, LossScaleError, OptimizerStateError, TraceError
from .errors import moved_names as _moved_names
from .info import conversion_info, release_originals
from .policy import Float8, Policy
from .reporting import autotune, compare, load_overrides, report, save_overrides
from .sharding import shard
from .training.config import LossScaleConfig
from .training.config import LeanConfig
from .training.optimizer import MixedPrecisionOptimizer
from .training.sharded_checkpoint import load_sharded_state_dict, sharded_state_dict

__version__ = "0.1.0"

__all__ = [
    "convert",
    "convert_",
    "conversion_info",
    "release_originals",
    "overflow_info",
    "Policy",
    "Float8",
    "LeanConfig",
    "LossScaleConfig",
    "MixedPrecisionOptimizer",
    "initialize",
    "shard",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "report",
    "compare",
    "autotune",
    "save_overrides",
    "load_overrides",
    "FxampError",
    "TraceError",
    "ConversionError",
    "LossScaleError",
    "OptimizerStateError",
]

#: the names that left the top level, and the module each is imported from now; ``fxamp.<name>``
#: still returns them for one release, with a DeprecationWarning naming the import to write
_MOVED = _types.MappingProxyType({
    "classify": "fxamp.conversion.classify.categories",
    "Decision": "fxamp.conversion.graph",
    "ConversionInfo": "fxamp.info",
    "policy_of": "fxamp.info",
    "clear_cast_cache": "fxamp.conversion.convert",
    "LazyConverted": "fxamp.conversion.lazy",
    "OverflowInfo": "fxamp.conversion.rewrite.debug",
    "ConvertOptions": "fxamp.conversion.options",
    "DebugOverflow": "fxamp.conversion.options",
    "Dynamic": "fxamp.conversion.options",
    "Category": "fxamp.conversion.op_lists",
    "OpEntry": "fxamp.conversion.op_lists",
    "OpLists": "fxamp.conversion.op_lists",
    "DEFAULT_OP_LISTS": "fxamp.conversion.op_lists",
    "Float8Recipe": "fxamp.policy",
    "Float8Cost": "fxamp.policy",
    "MasterPrecision": "fxamp.training.config",
    "StatePrecision": "fxamp.training.config",
    "ScaleKind": "fxamp.training.config",
    "LossScaler": "fxamp.training.loss_scale",
    "sharding_table": "fxamp.sharding",
    "Report": "fxamp.reporting.records",
    "Row": "fxamp.reporting.records",
    "PolicyDiff": "fxamp.reporting.diff",
    "sqnr": "fxamp.reporting.numerics",
})

__getattr__ = _moved_names("fxamp", _MOVED)
