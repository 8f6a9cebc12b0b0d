"""What a converted module calls at run time: the functions its generated code names, and its class.

``casts`` (the casts, the weight cache, the storage guard, a checkpointed block's call), ``sdpa``
(attention with dropout in the low dtype), ``graph_module`` (the converted ``GraphModule``'s class and
its error naming), ``recompute`` (a float32 island recomputed in backward), ``float8`` (the float8
matmuls and their autograd kernels).  Nothing here imports a stage above (capture, classify, rewrite).

This package was the module ``fxamp.conversion.runtime``: graphs converted before the split name its
functions by that path (generated code, ``torch.save`` pickles), so they are bound here as well.
"""

from .casts import (STORAGE_CHECK_NAME, StorageCheck, WeightCastCache, call_module_cast, cast, cast_dense, cast_weights,
                    check_storage, checkpointed, refuse_dtype_change)
from .graph_module import ConvertedGraphModule, NodeErrors, as_converted, name_failing_nodes
from .graph_module import _unpickle_converted  # noqa: F401  (a module pickled before the split names it here)
from .held_values import check_values, root_values
from .sdpa import attention, multi_head_attention

__all__ = ["cast", "cast_dense", "cast_weights", "call_module_cast", "checkpointed", "WeightCastCache", "StorageCheck",
           "STORAGE_CHECK_NAME", "check_storage", "refuse_dtype_change", "attention", "multi_head_attention",
           "NodeErrors", "name_failing_nodes", "ConvertedGraphModule", "as_converted", "check_values", "root_values"]
