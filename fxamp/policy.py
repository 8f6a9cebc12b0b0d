"""Mixed precision policies: which dtype parameters, safe ops, unsafe ops, norms and outputs use.

A :class:`Policy` is a frozen dataclass.  The apex opt levels ``"O0"``..``"O3"`` are presets, and
every policy prints to (and parses from) a string of ``key=dtype`` pairs::

    >>> str(Policy.from_preset("O2", torch.bfloat16))
    'params=bfloat16,compute=bfloat16,unsafe=float32,norms=float32,output=float32'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from .dtypes import CASTABLE, LOW, dtype_name, parse_dtype

__all__ = ["Policy", "PRESETS", "resolve_policy", "parse_dtype", "default_dtype", "device_type_of"]

_KEYS = ("params", "compute", "unsafe", "norms", "output")
PRESETS = ("O0", "O1", "O2", "O3")


@dataclass(frozen=True)
class Policy:
    """Which dtype each part of a model uses.

    params:  storage dtype of parameters (and float buffers) whose consumers all run in low
             precision; float32 means weights stay float32 and are cast at use (O1).
    compute: dtype of *safe* ops (matmul, conv, linear…); float32 turns mixed precision off (O0).
    unsafe:  dtype of *unsafe* ops (exp, log, softmax, sums, losses…): float32 except in O3.
    norms:   dtype of normalisation layers' parameters and math (batch/layer/group/rms norm).
    output:  dtype the converted module's float16/bfloat16/float32 outputs come back in (float64
             outputs stay float64: fxamp never casts float64); None leaves them as computed.
    """

    params: torch.dtype = torch.float32
    compute: torch.dtype = torch.float16
    unsafe: torch.dtype = torch.float32
    norms: torch.dtype = torch.float32
    output: Optional[torch.dtype] = torch.float32

    def __post_init__(self) -> None:
        """Checks only: names (``"bfloat16"``) become dtypes in :meth:`of`, :meth:`parse` and :meth:`replace`."""
        for key in _KEYS:
            value = getattr(self, key)
            if key == "output" and value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"Policy's {key} must be a torch.dtype, not {value!r}: "
                                f"write Policy.of({key}={value!r}) to give dtypes by name")
            parse_dtype(value, what=key)  # one fxamp casts (float64 is a ValueError)
        lows = {d for d in (self.params, self.compute, self.unsafe, self.norms) if d in LOW}
        if len(lows) > 1:
            raise ValueError(
                f"policy {self} mixes float16 and bfloat16; pick one low-precision dtype"
            )
        if self.compute == torch.float32 and lows:
            raise ValueError(
                f"policy {self} has compute=float32 but stores or runs something in "
                f"{dtype_name(lows.pop())}; with compute=float32 every other dtype must be float32 too"
            )
        if self.output is not None and self.output == torch.float64:  # pragma: no cover
            raise ValueError("output=float64 is not supported")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls, name: str, dtype: Union[str, torch.dtype] = torch.float16, *, keep_norms_fp32: bool = False
    ) -> "Policy":
        """Build an apex-style opt level: O0 fp32, O1 casts per op, O2 low-precision weights, O3 pure low precision.

        ``keep_norms_fp32`` only matters for O3 (apex's ``keep_batchnorm_fp32``): O1/O2 always keep norms fp32.
        """
        low = parse_dtype(dtype)
        if low not in LOW:
            raise ValueError(f"dtype={dtype_name(low)} is not a low-precision dtype; use float16 or bfloat16")
        name = name.strip().upper() if isinstance(name, str) else name
        f32 = torch.float32
        if name == "O0":
            return cls(params=f32, compute=f32, unsafe=f32, norms=f32, output=f32)
        if name == "O1":
            return cls(params=f32, compute=low, unsafe=f32, norms=f32, output=f32)
        if name == "O2":
            return cls(params=low, compute=low, unsafe=f32, norms=f32, output=f32)
        if name == "O3":
            return cls(params=low, compute=low, unsafe=low, norms=f32 if keep_norms_fp32 else low, output=f32)
        raise ValueError(f"unknown policy {name!r}; use one of {', '.join(PRESETS)} or a string like "
                         f"'params=float32,compute=float16,output=float32'")

    @classmethod
    def of(cls, **fields: Union[str, torch.dtype, None]) -> "Policy":
        """A policy from dtypes or their names: ``Policy.of(params="float32", compute="bf16")``; missing
        keys take the O1 defaults, ``output=None`` leaves outputs as computed."""
        return cls(**_dtypes(fields))

    @classmethod
    def parse(cls, text: str) -> "Policy":
        """Parse ``"params=float32,compute=bfloat16,output=float32"``; missing keys take the O1 defaults."""
        fields: dict = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"cannot parse {part!r} in policy {text!r}; expected key=dtype with key in {', '.join(_KEYS)}"
                )
            if key in fields:
                raise ValueError(f"policy {text!r} sets {key} twice")
            value = value.strip()
            fields[key] = None if key == "output" and value.lower() in ("none", "keep") else parse_dtype(value, what=key)
        if "compute" not in fields:
            raise ValueError(f"policy {text!r} does not say compute=<dtype>")
        return cls(**fields)

    def __str__(self) -> str:
        parts = [f"{k}={dtype_name(getattr(self, k)) if getattr(self, k) is not None else 'keep'}" for k in _KEYS]
        return ",".join(parts)

    # -- derived ------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for an all-float32 policy (O0): convert then changes nothing."""
        return any(getattr(self, k) != torch.float32 for k in ("params", "compute", "unsafe", "norms"))

    def replace(self, **changes: Union[str, torch.dtype, None]) -> "Policy":
        """A copy with some fields changed, given as dtypes or their names (validated again)."""
        return dataclasses.replace(self, **_dtypes(changes))


def _dtypes(fields: dict) -> dict:
    """``{key: dtype or name}`` -> ``{key: dtype}`` (``output`` may be None); unknown keys are a TypeError."""
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise TypeError(f"Policy has no field {', '.join(unknown)}; its fields are {', '.join(_KEYS)}")
    return {k: None if k == "output" and v is None else parse_dtype(v, what=k) for k, v in fields.items()}


def device_type_of(model: nn.Module) -> str:
    """The device type of ``model``'s first parameter or buffer (``"cpu"`` for a model without any)."""
    for t in model.parameters():
        return t.device.type
    for t in model.buffers():
        return t.device.type
    return "cpu"


def default_dtype(device_type: str) -> Tuple[torch.dtype, str]:
    """The low-precision dtype a preset gets without ``dtype=``: autocast's default for ``device_type``
    (bfloat16 on CPU, float16 on CUDA), and the note that says so.

    As autocast does: float16 on a CPU without float16 kernels is several times slower than float32.
    """
    try:
        low = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device autocast does not know (meta)
        low = None
    if low not in LOW:
        return torch.float16, f"dtype=float16 (autocast has no default on {device_type}; pass dtype= to choose)"
    return low, f"dtype={dtype_name(low)} (autocast's default on {device_type}; pass dtype= to choose)"


def resolve_policy(
    policy: Union[str, Policy], dtype: Union[str, torch.dtype, None] = None, *, keep_norms_fp32: bool = False,
    device_type: str = "cpu",
) -> Policy:
    """Accept a :class:`Policy`, a preset name (``"O2"``) or a ``key=dtype`` string; ``dtype`` picks the low
    precision of a preset, by default autocast's for ``device_type`` (:func:`default_dtype`)."""
    if isinstance(policy, Policy):
        if dtype is not None and parse_dtype(dtype) != policy.compute and policy.enabled:
            raise ValueError(
                f"dtype={dtype} contradicts the policy's compute={dtype_name(policy.compute)}; pass one or the other"
            )
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a Policy or a string such as 'O1', not {type(policy).__name__}")
    if "=" in policy:
        if keep_norms_fp32:
            raise ValueError("keep_norms_fp32 applies to the preset O3; in a policy string say norms=float32")
        parsed = Policy.parse(policy)
        if dtype is not None and parse_dtype(dtype) != parsed.compute:
            raise ValueError(f"dtype={dtype} contradicts compute={dtype_name(parsed.compute)} in {policy!r}")
        return parsed
    if keep_norms_fp32 and policy.strip().upper() != "O3":
        raise ValueError(f"keep_norms_fp32 only applies to O3 (O1 and O2 always keep norms in float32), not {policy!r}")
    low = default_dtype(device_type)[0] if dtype is None else dtype
    return Policy.from_preset(policy, low, keep_norms_fp32=keep_norms_fp32)
