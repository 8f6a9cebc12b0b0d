"""The one dtype vocabulary both wings share: the low-precision and castable sets, names, parsing;
and :class:`StrEnum`, the base of every string option (``Category``, ``ScaleKind``, ``StatePrecision``...).

Conversion, training, reporting and the integrations all read dtypes from here; what dtype a
graph value certainly has is the conversion's business (``fxamp.conversion.classify.inference``).
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Tuple, Type, Union

import torch

__all__ = ["StrEnum", "DtypeEnum", "LOW", "CASTABLE", "NOT_FLOAT", "NAMES", "short_name", "dtype_name", "parse_dtype", "dtype_member", "spellings"]


class StrEnum(str, enum.Enum):
    """A string option: ``"safe"`` and ``Category.SAFE`` are interchangeable, and its ``str`` is its value
    (what the user typed, in messages and reports), as Python 3.11's ``enum.StrEnum`` has it."""

    def __str__(self) -> str:
        return self.value



class DtypeEnum(StrEnum):
    """A string option whose values are dtypes' short names (``"fp32"``, ``"bf16"``) among others: it also takes
    the dtype's other spellings (``"bfloat16"``, ``torch.bfloat16``: :func:`dtype_member`)."""

    @classmethod
    def _missing_(cls, value: Any) -> Optional["DtypeEnum"]:
        return dtype_member(cls, value)

#: the low-precision float dtypes fxamp computes in
LOW = (torch.float16, torch.bfloat16)
#: the only dtypes fxamp ever casts: integer, bool and complex tensors carry ids, masks and
#: indices, and float64 is never cast down
CASTABLE = (torch.float32, torch.float16, torch.bfloat16)

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
          "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool"}


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"`` (strings pass through)."""
    return str(dtype).removeprefix("torch.")


def short_name(dtype: Union[torch.dtype, str]) -> str:
    """``torch.float16`` or ``"float16"`` -> ``"fp16"``; ``"float16|float32"`` -> ``"fp16|fp32"``."""
    text = dtype_name(dtype)
    return "|".join(_SHORT.get(t, t) for t in text.split("|"))


#: marks a value known not to be a float tensor (an int, a shape, a bool mask)
NOT_FLOAT = "not float"

#: every name a user may type for a dtype fxamp computes in
NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(value: Union[str, torch.dtype], *, what: str = "dtype",
                allowed: Tuple[torch.dtype, ...] = CASTABLE) -> torch.dtype:
    """Turn ``torch.float16`` or one of its names (``"float16"``, ``"fp16"``, ``"half"``…) into a dtype.

    ``allowed`` narrows the answer (``LOW`` where only a low-precision dtype makes sense); a value
    outside it is a ``ValueError`` naming ``what`` and the valid names.
    """
    valid = ", ".join(dtype_name(d) for d in allowed)
    if isinstance(value, torch.dtype):
        if value not in allowed:
            raise ValueError(f"{what}={value} is not supported; use one of {valid}")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if NAMES.get(key) in allowed:
            return NAMES[key]
    names = sorted(k for k, d in NAMES.items() if d in allowed)
    raise ValueError(f"{what}={value!r} is not a dtype fxamp understands; use a torch dtype or one of {names}")


def dtype_member(kind: Type[Any], value: Any) -> Optional[Any]:
    """The member of the str enum ``kind`` whose value is the short name (``"bf16"``) of the dtype ``value``
    names, or None: each precision enum's ``_missing_``, so ``StatePrecision("bfloat16")`` and
    ``StatePrecision(torch.bfloat16)`` are ``StatePrecision.BF16`` as ``"bf16"`` is."""
    try:
        dtype = parse_dtype(value)
    except ValueError:
        return None
    return kind._value2member_map_.get(short_name(dtype))


def spellings(kind: Type[Any]) -> str:
    """The values of the str enum ``kind`` for an error message, each dtype one with its other names:
    ``"'fp32' (float32), 'bf16' (bfloat16), 'int8', 'auto'"``."""
    long = {short_name(d): dtype_name(d) for d in CASTABLE}
    return ", ".join(f"{m.value!r}" + (f" ({long[m.value]})" if m.value in long else "") for m in kind)
