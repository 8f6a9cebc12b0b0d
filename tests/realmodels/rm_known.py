"""Known failures (issue 10), one reason each: the tests mark these ``xfail(strict=True)``, so a fix
flips them to XPASS, which fails the run until the entry here is removed.

Keys: ``(model, check, policy, dtype)``; ``"*"`` matches anything.  ``check`` is one of
``o0``, ``numerics``, ``training``, ``float64``; dtype is ``"bfloat16"``/``"float16"``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

Key = Tuple[str, str, str, str]

KNOWN: Dict[Key, str] = {}

KNOWN[("clip", "numerics", "*", "bfloat16")] = (
    "new (realmodels): CLIPModel logits_per_image SQNR 46.1 dB (O1) / 43.6 (O2) vs autocast 51.1 though "
    "text_embeds/image_embeds match autocast's: the loss is in the contrastive head (normalise, matmul, "
    "logit_scale.exp() *)")


def known(model: str, check: str, policy: Optional[str], dtype: Optional[str]) -> Optional[str]:
    """The reason this case is a known failure, or None."""
    for (m, c, p, d), reason in KNOWN.items():
        if (m in ("*", model) and c in ("*", check) and p in ("*", policy or "-")
                and d in ("*", dtype or "-")):
            return reason
    return None
