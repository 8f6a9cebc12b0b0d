"""What ``convert`` leaves on a module: :class:`ConversionInfo`, read back by :func:`conversion_info`.

A low module (it imports only the policy) so that the training side can read a module's policy
without importing the conversion pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch.nn as nn

from .policy import Policy

__all__ = ["ConversionInfo", "INFO_ATTR", "conversion_info", "policy_of"]


@dataclass(frozen=True)
class ConversionInfo:
    """What ``convert`` did; kept on the converted module (through deepcopy and pickling)."""

    policy: Policy
    frontend: str  # "fx" or "export"
    notes: Tuple[str, ...] = ()
    # a module that captures at its first call (fxamp.LazyConverted): the call signatures it holds a
    # graph for, in the order captured; None for a module captured by convert() itself
    signatures: Optional[Tuple[str, ...]] = None


#: the attribute of a converted module that holds its ConversionInfo
INFO_ATTR = "_fxamp_info"


def conversion_info(module: nn.Module) -> Optional[ConversionInfo]:
    """How fxamp converted ``module`` (policy, front end, notes), or None if it did not."""
    info = getattr(module, INFO_ATTR, None)
    return info if isinstance(info, ConversionInfo) else None


def policy_of(module: nn.Module) -> Optional[Policy]:
    """The policy a module was converted with, or None if fxamp did not convert it."""
    info = conversion_info(module)
    return None if info is None else info.policy
