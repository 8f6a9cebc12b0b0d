"""Mixed precision policies: which dtype parameters, safe ops, unsafe ops, norms and outputs use.

A :class:`Policy` is a frozen dataclass.  The apex opt levels ``"O0"``..``"O3"`` are presets, and
every policy prints to (and parses from) a string of ``key=dtype`` pairs::

    >>> str(Policy.parse("O2", torch.bfloat16))
    'params=bfloat16,compute=bfloat16,unsafe=float32,norms=float32,output=float32'

A policy may also run its safe matmuls in float8 (:class:`Float8`): ``float8=tensorwise`` (or
``rowwise``, ``rowwise_with_gw_hp``) after the dtypes, or after a preset: ``"O2,float8=rowwise"``.
:meth:`Policy.parse` reads all of these (presets too); ``convert`` reads its policy through it.

Factories: ``parse`` is the one, on every config type (``Float8.parse``, ``LossScaleConfig.parse``,
``LeanConfig.parse``): it reads the string form ``str()`` prints, presets included, as jmp's
``get_policy`` reads ``"p=f32,c=f16"``.  The constructors take the fields, each a value or its name
(``Policy(compute="bf16")``, ``Float8("rowwise")``), as torch's constructors take their options.  The
older ``Policy.of`` and ``Policy.from_preset`` warn and work for one release.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from .dtypes import LOW, StrEnum, dtype_name, parse_dtype
from .errors import warn_deprecated

__all__ = ["Policy", "Float8", "Float8Recipe", "Float8Cost", "PRESETS", "resolve_policy", "parse_dtype", "default_dtype", "device_type_of"]

_KEYS = ("params", "compute", "unsafe", "norms", "output")
PRESETS = ("O0", "O1", "O2", "O3")


class Float8Recipe(StrEnum):
    """How a float8 matmul scales and casts its operands (torchao.float8's recipes, same names)."""

    TENSORWISE = "tensorwise"  # one scale per tensor; e4m3 input and weight, e5m2 gradients
    ROWWISE = "rowwise"  # one scale per row (of the GEMM's operand); e4m3 everywhere; power-of-two scales
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"  # rowwise, with grad_weight computed in high precision


class Float8Cost(StrEnum):
    """Which eligible matmuls run in float8: those the cost model says pay, or all of them."""

    AUTO = "auto"  # skip a matmul the cost table (fxamp.conversion.classify.float8) says is too small to pay
    ALWAYS = "always"  # every eligible matmul, whatever it costs (tests; a CPU, where float8 never pays)


def _member(kind: type, value: object, what: str) -> StrEnum:
    """``value`` as a member of the str enum ``kind``: a member or its string; else a ValueError naming the valid ones."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {', '.join(repr(m.value) for m in kind)}, not {value!r}") from None


@dataclass(frozen=True)
class Float8:
    """Run the policy's safe matmuls (linear, matmul/mm with a 2-D operand, einsum reducing to one) in float8.

    recipe: :class:`Float8Recipe`.
    pow2:   round every scale down to a power of two (exact in float8's exponent); None: the recipe's
            default (torchao's: rowwise recipes yes, tensorwise no).
    cost:   :class:`Float8Cost`.

    Its string form is the recipe with ``:``-separated flags: ``"tensorwise"``, ``"rowwise:always"``,
    ``"tensorwise:pow2"``, ``"rowwise:nopow2"``.
    """

    recipe: Float8Recipe = Float8Recipe.TENSORWISE
    pow2: Optional[bool] = None
    cost: Float8Cost = Float8Cost.AUTO

    def __post_init__(self) -> None:
        """Names become members (``"rowwise"``: ``Float8Recipe.ROWWISE``), then checks (``pow2`` None: the
        recipe's default, :attr:`power_of_two`)."""
        object.__setattr__(self, "recipe", _member(Float8Recipe, self.recipe, "Float8's recipe"))
        object.__setattr__(self, "cost", _member(Float8Cost, self.cost, "Float8's cost"))
        if self.pow2 is not None and not isinstance(self.pow2, bool):
            raise TypeError(f"Float8's pow2 must be a bool or None, not {self.pow2!r}")

    @property
    def power_of_two(self) -> bool:
        """Whether scales are rounded to powers of two: ``pow2``, or the recipe's default when it is None."""
        return self.recipe is not Float8Recipe.TENSORWISE if self.pow2 is None else self.pow2

    @classmethod
    def parse(cls, text: Union[str, "Float8"]) -> "Float8":
        """``"rowwise"``, ``"tensorwise:pow2:always"``…: a recipe, then flags (``pow2``/``nopow2``,
        ``always``/``auto``)."""
        if isinstance(text, Float8):
            return text
        if not isinstance(text, str):
            raise TypeError(f"float8 must be a recipe name such as 'tensorwise' or a Float8, not {text!r}")
        name, *flags = [t.strip().lower() for t in text.split(":")]
        recipes = ", ".join(repr(r.value) for r in Float8Recipe)
        try:
            recipe = Float8Recipe(name)
        except ValueError:
            raise ValueError(f"float8={text!r}: {name!r} is not a float8 recipe; use one of {recipes}, "
                             f"optionally followed by ':pow2', ':nopow2', ':always' or ':auto'") from None
        fields: dict = {}
        for flag in flags:
            key, value = {"pow2": ("pow2", True), "nopow2": ("pow2", False), "always": ("cost", Float8Cost.ALWAYS),
                          "auto": ("cost", Float8Cost.AUTO)}.get(flag, (None, None))
            if key is None:
                raise ValueError(f"float8={text!r}: unknown flag {flag!r}; flags are pow2, nopow2, always, auto")
            if key in fields:
                raise ValueError(f"float8={text!r} sets {key} twice")
            fields[key] = value
        if fields.get("pow2") == (recipe is not Float8Recipe.TENSORWISE):
            del fields["pow2"]  # the recipe's default, written out: the same Float8 as without it
        return cls(recipe, **fields)

    def __str__(self) -> str:
        default = self.recipe is not Float8Recipe.TENSORWISE
        flags = [] if self.power_of_two == default else ["pow2" if self.power_of_two else "nopow2"]
        flags += ["always"] if self.cost is Float8Cost.ALWAYS else []
        return ":".join([self.recipe.value, *flags])


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
    float8:  None, or a :class:`Float8`: the safe matmuls run in float8 (compute must be bfloat16,
             the dtype everything around them and their outputs keep).
    """

    params: torch.dtype = torch.float32
    compute: torch.dtype = torch.float16
    unsafe: torch.dtype = torch.float32
    norms: torch.dtype = torch.float32
    output: Optional[torch.dtype] = torch.float32
    float8: Optional[Float8] = None

    def __post_init__(self) -> None:
        """Names become dtypes (``"bf16"``: ``torch.bfloat16``; ``float8="rowwise"``: a :class:`Float8`), then checks."""
        for key in _KEYS:
            value = getattr(self, key)
            if key == "output" and value is None:
                continue
            if not isinstance(value, (torch.dtype, str)):
                raise TypeError(f"Policy's {key} must be a torch.dtype or its name (such as 'bf16'), not {value!r}")
            object.__setattr__(self, key, parse_dtype(value, what=key))  # one fxamp casts (float64: ValueError)
        if isinstance(self.float8, str):
            object.__setattr__(self, "float8", Float8.parse(self.float8))
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
        if self.float8 is not None:
            if not isinstance(self.float8, Float8):
                raise TypeError(f"Policy's float8 must be a Float8, its name (such as 'rowwise') or None, "
                                f"not {self.float8!r}")
            if self.compute != torch.bfloat16:
                raise ValueError(
                    f"float8={self.float8} needs compute=bfloat16, not {dtype_name(self.compute)}: float8 recipes "
                    f"keep everything around a float8 matmul (and its output) in bfloat16; there is no float8 "
                    f"recipe with float16. Use dtype=bfloat16 (e.g. 'O2,float8={self.float8}' with dtype='bf16')")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls, name: str, dtype: Union[str, torch.dtype] = torch.float16, *, keep_norms_fp32: bool = False
    ) -> "Policy":
        """Deprecated: ``Policy.parse(name, dtype)`` (this default dtype is float16, ``parse``'s autocast's)."""
        warn_deprecated("Policy.from_preset(name, dtype)", "write Policy.parse(name, dtype)")
        return cls.parse(name, dtype, keep_norms_fp32=keep_norms_fp32)

    @classmethod
    def _preset(cls, name: str, dtype: Union[str, torch.dtype], *, keep_norms_fp32: bool = False) -> "Policy":
        """An apex-style opt level: O0 fp32, O1 casts per op, O2 low-precision weights, O3 pure low precision.

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
        """Deprecated: the constructor takes names, ``Policy(params="float32", compute="bf16")``."""
        warn_deprecated("Policy.of(...)", "write Policy(...): the constructor takes dtypes or their names")
        return cls(**_fields(fields))

    @classmethod
    def parse(
        cls, text: str, dtype: Union[str, torch.dtype, None] = None, *, keep_norms_fp32: bool = False,
        device_type: str = "cpu",
    ) -> "Policy":
        """Parse every string ``convert`` takes: a preset (``"O2"``), a preset changed by ``key=value`` parts
        (``"O2,float8=rowwise"``), or ``key=dtype`` pairs (``"params=float32,compute=bfloat16"``: missing keys
        take the O1 defaults).  ``dtype`` picks a preset's low precision, by default autocast's for
        ``device_type`` (:func:`default_dtype`: bfloat16 on a CPU); a preset with float8 takes bfloat16
        (float8 takes no other).  The one parser: :func:`resolve_policy` (``convert``'s) calls it."""
        if not isinstance(text, str):
            raise TypeError(f"policy must be a Policy or a string such as 'O1', not {type(text).__name__}")
        head, sep, rest = text.partition(",")
        if "=" not in head and head.strip().upper() in PRESETS:
            return cls._parse_preset(text, dtype, keep_norms_fp32=keep_norms_fp32, device_type=device_type)
        if "=" not in text:
            raise ValueError(f"unknown policy {text!r}; use one of {', '.join(PRESETS)} or a string like "
                             f"'params=float32,compute=float16,output=float32'")
        if keep_norms_fp32:
            raise ValueError("keep_norms_fp32 applies to the preset O3; in a policy string say norms=float32")
        fields: dict = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _KEYS + ("float8",):
                raise ValueError(
                    f"cannot parse {part!r} in policy {text!r}; expected key=dtype with key in {', '.join(_KEYS)} "
                    f"(or float8=<recipe>), or a preset ({', '.join(PRESETS)}) first"
                )
            if key in fields:
                raise ValueError(f"policy {text!r} sets {key} twice")
            value = value.strip()
            if key == "float8":
                fields[key] = Float8.parse(value)
            else:
                fields[key] = None if key == "output" and value.lower() in ("none", "keep") \
                    else parse_dtype(value, what=key)
        if "compute" not in fields:
            raise ValueError(f"policy {text!r} does not say compute=<dtype>")
        parsed = cls(**fields)
        if dtype is not None and parse_dtype(dtype) != parsed.compute:
            raise ValueError(f"dtype={dtype} contradicts compute={dtype_name(parsed.compute)} in {text!r}")
        return parsed

    @classmethod
    def _parse_preset(
        cls, text: str, dtype: Union[str, torch.dtype, None], *, keep_norms_fp32: bool, device_type: str
    ) -> "Policy":
        """``"O2"`` or ``"O2,float8=rowwise,output=keep"``: a preset, then ``key=value`` parts that change it."""
        head, sep, rest = text.partition(",")
        changes: dict = {}
        if sep:
            if "=" not in rest:
                raise ValueError(f"policy {text!r}: after the preset {head.strip()!r} write key=value parts, "
                                 f"such as 'O2,float8=tensorwise'")
            for part in filter(None, (p.strip() for p in rest.split(","))):
                key, _, value = part.partition("=")
                key = key.strip().lower()
                if key in changes:
                    raise ValueError(f"policy {text!r} sets {key} twice")
                changes[key] = None if key == "output" and value.strip().lower() in ("none", "keep") else value.strip()
        name = head.strip().upper()
        if keep_norms_fp32 and name != "O3":
            raise ValueError(f"keep_norms_fp32 only applies to O3 (O1 and O2 always keep norms in float32), "
                             f"not {text!r}")
        if dtype is None:
            # float8 recipes take bfloat16 alone, whatever autocast's default for the device
            dtype = torch.bfloat16 if changes.get("float8") is not None else default_dtype(device_type)[0]
        base = cls._preset(name, dtype, keep_norms_fp32=keep_norms_fp32)
        try:
            return base.replace(**changes)
        except TypeError as e:
            raise ValueError(f"policy {text!r}: {e}") from e

    def __str__(self) -> str:
        parts = [f"{k}={dtype_name(getattr(self, k)) if getattr(self, k) is not None else 'keep'}" for k in _KEYS]
        return ",".join(parts + ([f"float8={self.float8}"] if self.float8 is not None else []))

    # -- derived ------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for an all-float32 policy (O0): convert then changes nothing."""
        return any(getattr(self, k) != torch.float32 for k in ("params", "compute", "unsafe", "norms"))

    def replace(self, **changes: Union[str, torch.dtype, None]) -> "Policy":
        """A copy with some fields changed, given as dtypes or their names (validated again)."""
        return dataclasses.replace(self, **_fields(changes))


def _fields(fields: dict) -> dict:
    """``fields`` unchanged, when each key is a field of Policy; else a TypeError naming the fields."""
    unknown = sorted(set(fields) - set(_KEYS) - {"float8"})
    if unknown:
        raise TypeError(f"Policy has no field {', '.join(unknown)}; its fields are {', '.join(_KEYS)}, float8")
    return fields


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
    """Accept a :class:`Policy` or any string :meth:`Policy.parse` takes (a preset ``"O2"``, ``"O2,float8=rowwise"``,
    ``key=dtype`` pairs); ``dtype`` picks the low precision of a preset, by default autocast's for ``device_type``
    (:func:`default_dtype`)."""
    if isinstance(policy, Policy):
        if dtype is not None and parse_dtype(dtype) != policy.compute and policy.enabled:
            raise ValueError(
                f"dtype={dtype} contradicts the policy's compute={dtype_name(policy.compute)}; pass one or the other"
            )
        if keep_norms_fp32 and policy.norms != torch.float32:  # a Policy states its norms: say so, never ignore it
            raise ValueError(f"keep_norms_fp32=True with a Policy whose norms={dtype_name(policy.norms)}: a Policy states "
                             f"its norms itself; pass policy.replace(norms='float32'), or the preset string 'O3'")
        return policy
    return Policy.parse(policy, dtype, keep_norms_fp32=keep_norms_fp32, device_type=device_type)
