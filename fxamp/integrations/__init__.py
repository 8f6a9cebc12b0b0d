"""Framework integrations: one line to train with fxamp inside a framework's own training loop.

* ``fxamp.integrations.lightning.FxampPrecision`` (also ``fxamp.lightning``): a PyTorch Lightning
  precision plugin, ``Trainer(plugins=[FxampPrecision("O2", dtype="bf16")])``.
* ``fxamp.integrations.hf.prepare``: a converted model and ``(optimizer, scheduler)`` for
  ``transformers.Trainer(model=..., optimizers=...)``.

Each submodule imports its framework only when imported itself; ``import fxamp`` never does.
They use fxamp's public API only (``fxamp.convert``, ``fxamp.MixedPrecisionOptimizer``...).
"""

from __future__ import annotations

import importlib
from typing import Any, Union

import torch

from ..dtypes import LOW, parse_dtype

__all__ = ["resolve_dtype"]


def __getattr__(name: str) -> Any:
    """``fxamp.integrations.hf`` / ``.lightning`` without importing them first (each imports its framework)."""
    if name in ("hf", "lightning"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Lightning's precision strings, beside the dtype names of ``fxamp.dtypes.NAMES``
_PRECISIONS = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "16": "float16", "16-mixed": "float16",
               "16-true": "float16"}


def resolve_dtype(dtype: Union[str, int, torch.dtype]) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` or ``"16"``/``16``/``"fp16"``/``torch.float16`` → the torch dtype."""
    key = dtype if isinstance(dtype, torch.dtype) else _PRECISIONS.get(str(dtype).lower(), str(dtype))
    try:
        return parse_dtype(key, allowed=LOW)
    except ValueError:
        pass
    raise ValueError(f"dtype={dtype!r} is not a low-precision dtype fxamp trains in; use 'bf16' (bfloat16) "
                     f"or '16' (float16, with dynamic loss scaling)")
