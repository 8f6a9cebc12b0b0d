"""One argument order for every entry point: ``(model, policy, *, example_inputs=...)``, as ``fxamp.convert``.

``report``, ``compare`` and ``autotune`` took ``(model, example_inputs, policy)`` before; a call in that
order still works for one release, with a DeprecationWarning.  It is told apart by what stands where the
policy goes: a policy is a string or a :class:`~fxamp.Policy` (``compare``: a pair of them), inputs are
anything else (a tensor, a tuple or list of them).
"""

from __future__ import annotations

from typing import Any, Tuple

from ..errors import warn_deprecated
from ..policy import Policy

__all__ = ["is_policy", "policy_and_inputs"]


def is_policy(value: Any, *, pair: bool = False) -> bool:
    """Whether ``value`` is a policy (``pair``: two policies, as ``compare`` takes)."""
    if pair:
        return isinstance(value, (tuple, list)) and all(isinstance(v, (str, Policy)) for v in value)
    return isinstance(value, (str, Policy))


def policy_and_inputs(name: str, policy: Any, rest: Tuple[Any, ...], example_inputs: Any, *, default: Any,
                      pair: bool = False) -> Tuple[Any, Any]:
    """``(policy, example_inputs)`` of ``name(model, policy, *rest, example_inputs=...)``.

    ``policy`` None is ``default``.  Inputs where the policy goes (the older order ``name(model, inputs,
    policy)``) are read as that order, with a DeprecationWarning naming the call to write.
    """
    if is_policy(policy, pair=pair) or (policy is None and not rest):
        if rest:
            raise TypeError(f"fxamp.{name} takes (model, policy, *, example_inputs=...): pass the inputs by keyword, "
                            f"not {len(rest)} more positional argument(s) after the policy")
        return (default if policy is None else policy), example_inputs
    if example_inputs is not None and policy is not None:
        raise TypeError(f"fxamp.{name} got inputs twice: where the policy goes (a {type(policy).__name__}) and as "
                        f"example_inputs=; write fxamp.{name}(model, policy, example_inputs=...)")
    if len(rest) > 1 or (rest and rest[0] is not None and not is_policy(rest[0], pair=pair)):
        raise TypeError(f"fxamp.{name} takes (model, policy, *, example_inputs=...), not these {1 + len(rest)} "
                        f"positional arguments after the model")
    what = "policies" if pair else "policy"
    warn_deprecated(f"fxamp.{name}(model, example_inputs, {what})",
                    f"write fxamp.{name}(model, {what}, example_inputs=...), the order of fxamp.convert", stacklevel=4)
    old = rest[0] if rest else None
    return (default if old is None else old), (example_inputs if policy is None else policy)
