"""The contract of a pass: what the pipeline (``pipeline.PASSES``) runs, in order, over a captured graph.

A :class:`Pass` belongs to a stage (:class:`Stage`: ``classify/`` decides, ``rewrite/`` changes the graph),
says when it applies, and runs as ``run(gm, conversion) -> notes``: it reads and changes the graph and
``conversion.decisions`` and returns the lines it has to say (``ConversionInfo.notes``; those of a pass that
``warns`` are warnings too: something the user may want to change).  Each pass lives in its stage's folder,
next to the function that does the work, so the pipeline names each one and special-cases none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Sequence

import torch.fx as fx

from ..dtypes import StrEnum
from ..policy import Policy
from .graph import DECISION, Decision
from .options import ConvertOptions

__all__ = ["Stage", "Conversion", "Pass", "record", "always"]


class Stage(StrEnum):
    """The stage a pass belongs to, in the order they run (the folder its module is in)."""

    CLASSIFY = "classify"  # decides: one Decision per node (node.meta["fxamp"]); the graph is not changed
    REWRITE = "rewrite"  # changes the graph as the decisions say


@dataclass(frozen=True)
class Conversion:
    """What every pass reads: the policy, the options, the storage rule and the capture's front end, and the
    decisions the classify passes make (one :class:`Decision` per node, filled in as they run).

    storage: ``"decide"`` (O2/O3 re-bind parameters to the dtype their consumers run in) or ``"keep"`` (the
    parameters already have their dtypes: consumers that want another get a cast).
    """

    policy: Policy
    options: ConvertOptions
    storage: str = "decide"
    frontend: str = "fx"
    decisions: Dict[fx.Node, Decision] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.storage not in ("decide", "keep"):
            raise ValueError(f"storage={self.storage!r} is not 'decide' or 'keep'")
        if not isinstance(self.options, ConvertOptions):
            raise TypeError(f"options must be a ConvertOptions, not {type(self.options).__name__}")


def always(conversion: Conversion) -> bool:
    """The condition of a pass that always runs."""
    return True


@dataclass(frozen=True)
class Pass:
    """One step after capture.  ``run(gm, conversion)`` returns its notes; it runs only where ``applies``."""

    name: str
    stage: Stage
    run: Callable[[fx.GraphModule, Conversion], Sequence[str]]
    applies: Callable[[Conversion], bool] = always
    warns: bool = False  # its notes are warnings too


def record(decisions: Dict[fx.Node, Decision]) -> None:
    """Write each decision where the rewrite and the report read it: ``node.meta["fxamp"]`` (``graph.decision_of``)."""
    for node, decision in decisions.items():
        node.meta[DECISION] = decision
