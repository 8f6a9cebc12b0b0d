"""fxamp: ahead-of-time automatic mixed precision for PyTorch, as a torch.fx graph rewrite.

``fxamp.convert(model, policy="O1")`` traces the model, classifies every op (safe / neutral /
conditional / unsafe), and returns a ``GraphModule`` with explicit casts: no autocast, nothing
patched.
"""

from .conversion.classify import classify
from .conversion.graph import Decision
from .conversion.convert import ConversionInfo, clear_cast_cache, conversion_info, convert, convert_, policy_of
from .conversion.debug import OverflowInfo, overflow_info
from .errors import ConversionError, FxampError, LossScaleError, OptimizerStateError, TraceError
from .conversion.lazy import LazyConverted
from .training.config import LossScaleConfig, ScaleKind
from .training.loss_scale import LossScaler
from .conversion.op_lists import DEFAULT_OP_LISTS, Category, OpEntry, OpLists
from .conversion.options import ConvertOptions, DebugOverflow, Dynamic
from .api import initialize
from .info import release_originals
from .sharding import shard, sharding_table
from .training.lean import LeanConfig, MasterPrecision, StatePrecision
from .training.optimizer import MixedPrecisionOptimizer
from .training.sharded_checkpoint import load_sharded_state_dict, sharded_state_dict
from .policy import Float8, Float8Cost, Float8Recipe, Policy
from .reporting import PolicyDiff, Report, Row, autotune, compare, load_overrides, report, save_overrides, sqnr

__version__ = "0.1.0"

__all__ = [
    "convert",
    "convert_",
    "release_originals",
    "LazyConverted",
    "policy_of",
    "conversion_info",
    "ConversionInfo",
    "clear_cast_cache",
    "ConvertOptions",
    "DebugOverflow",
    "Dynamic",
    "classify",
    "Decision",
    "Policy",
    "Float8",
    "Float8Recipe",
    "Float8Cost",
    "Category",
    "OpEntry",
    "OpLists",
    "DEFAULT_OP_LISTS",
    "FxampError",
    "TraceError",
    "ConversionError",
    "LossScaleError",
    "OptimizerStateError",
    "MixedPrecisionOptimizer",
    "LeanConfig",
    "MasterPrecision",
    "StatePrecision",
    "initialize",
    "shard",
    "sharding_table",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "LossScaler",
    "LossScaleConfig",
    "ScaleKind",
    "report",
    "compare",
    "Report",
    "Row",
    "PolicyDiff",
    "sqnr",
    "autotune",
    "save_overrides",
    "load_overrides",
    "overflow_info",
    "OverflowInfo",
]
