"""The plain values a captured forward read from its modules, which the graph holds as constants, and the check
at each call that they still hold.

torch.fx and torch.export run forward's Python once: ``x / self.tau`` with ``self.tau = 2.0`` puts ``2.0`` in
the graph, ``if self.use_cache:`` takes one branch for good, and ``F.dropout(x, self.p)`` keeps that ``p``.
Setting the attribute later (a Gumbel temperature or a dropout rate the training loop anneals, Hugging Face's
``gradient_checkpointing`` switched on) would silently change nothing: the converted module keeps computing with
the value it was captured with.  So the capture records each such value (``capture.plain_reads``: the numbers,
flags and strings in the ``__dict__`` of every module whose code it traced through, under a name that code
reads), and each call compares them (:func:`changed_value`, a few dict reads): a whole-model or lazily capturing
module refuses the call, saying what to do; a block converted in place captures again for the values it has now
(``families.Family``: :func:`values_now` is part of its graphs' key).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch.fx as fx
import torch.nn as nn

from ...errors import FxampError

__all__ = ["HELD", "BOUND", "Held", "hold", "bind", "changed_value", "values_now", "check_values", "root_values",
           "held_message"]

#: a captured ``GraphModule``'s ``__dict__`` key: its :data:`Held` values (pickled and copied with it)
HELD = "_fxamp_held_values"
#: a converted module's ``__dict__`` key: its held values bound to its modules (:func:`bind`), made once
BOUND = "_fxamp_held_bound"

#: ``((module path, ((attribute, value), ...)), ...)``: the plain values a capture read, by module
Held = Tuple[Tuple[str, Tuple[Tuple[str, Any], ...]], ...]

#: (path, module or None for the root the check is given, ((attribute, value), ...)): :data:`Held` bound to modules
Bound = Tuple[Tuple[str, Optional[nn.Module], Tuple[Tuple[str, Any], ...]], ...]


def hold(gm: fx.GraphModule, held: Held) -> None:
    """Keep ``held`` on ``gm``, through deepcopy (GraphModule's keeps the attributes its meta lists) and pickling."""
    gm.__dict__[HELD] = held
    gm.meta.setdefault("_user_preserved_attributes", {})[HELD] = held


def bind(root: nn.Module, held: Held) -> Bound:
    """``held`` on ``root``'s modules (the root itself as None: a module does not hold itself, which pickling
    could not rebuild); a path ``root`` lacks (a torch.fx graph keeps only the modules it uses) is checked on
    nothing."""
    out = []
    for path, items in held:
        if not path:
            out.append((path, None, items))
            continue
        try:
            out.append((path, root.get_submodule(path), items))
        except AttributeError:
            pass
    return tuple(out)


def changed_value(root: nn.Module, bound: Bound) -> Optional[Tuple[str, str, Any, Any]]:
    """``(module path, attribute, value captured, value now)`` of the first held value that changed, else None.  An
    attribute deleted counts as unchanged (nothing reads it), as does one equal to its captured value."""
    for path, module, items in bound:
        d = (root if module is None else module).__dict__
        for name, was in items:
            now = d.get(name, was)
            if now is not was and (type(now) is not type(was) or now != was):
                return path, name, was, now
    return None


def values_now(root: nn.Module, bound: Bound) -> Optional[Tuple[Any, ...]]:
    """None when no value ``bound`` holds changed on ``root``, else every one's value now, in order (a key: the
    graphs captured for those values)."""
    if changed_value(root, bound) is None:
        return None
    return tuple((root if m is None else m).__dict__.get(n, v) for _, m, items in bound for n, v in items)


def check_values(module: nn.Module, bound: Bound, where: str = "the converted module") -> None:
    """Refuse the call when a value ``bound`` holds changed on ``module`` (:func:`changed_value`)."""
    changed = changed_value(module, bound)
    if changed is not None:
        raise FxampError(held_message(where, *changed))


def root_values(gm: fx.GraphModule) -> Bound:
    """The bound values of ``gm``'s root alone (a lazily capturing module checks them on itself)."""
    return tuple(b for b in gm.__dict__.get(BOUND, ()) if b[1] is None)


def held_message(where: str, path: str, name: str, was: Any, now: Any) -> str:
    """Why a changed plain value is refused, and what to do instead (``where``: the converted module, as the user
    names it; ``path`` below it)."""
    keep = (f"; for a number you change during training (a temperature, a rate on a schedule) keep it in a buffer "
            f"(self.register_buffer({name!r}, torch.tensor({was!r}))), which the graph reads at each call"
            if type(was) in (int, float) and not isinstance(was, bool) else "")
    return (f"{where}'s {'.'.join(p for p in (path, name) if p)} is {now!r}, but the converted module was captured "
            f"when it was {was!r}: torch.fx and torch.export run forward's Python once, so the graph holds that "
            f"value (an operand, or the branch it took) and would silently compute with {was!r}. Set it back, or "
            f"convert the model again after changing it{keep}")
