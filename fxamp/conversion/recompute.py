"""Moved to :mod:`fxamp.conversion.runtime.recompute`; kept for graphs converted before the move.

Their generated code and ``torch.save`` pickles name the island functions by this path, so they load
and run as they are, without a warning (a user has nothing to change in a saved model).
"""

from .runtime.recompute import Ref, island_input, island_on, island_output, resolve, run_program

__all__ = ["Ref", "island_on", "island_input", "island_output", "run_program", "resolve"]
