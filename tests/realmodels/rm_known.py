"""Known failures, one reason each: the tests mark these ``xfail(strict=True)``, so a fix flips them to
XPASS, which fails the run until the entry here is removed.

Keys: ``(model, check, policy, dtype)``, each a glob (``fnmatch``: ``"*"`` matches anything,
``"roundtrip/*/in-place"`` every round trip of the in-place path).  ``check`` is one of ``rm_checks``'
(``o0``, ``numerics``, ``training``, ...) or ``rm_invariants``' (``eval-buffers/<path>``,
``eval-after-step/<path>``, ``layout/<mode>``, ``roundtrip/<kind>/<path>``); dtype is
``"bfloat16"``/``"float16"``, ``"-"`` where the case has none.  The first matching entry gives the reason.
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Optional, Tuple

Key = Tuple[str, str, str, str]

#: issue 37's items, as the reasons say them
_I1 = "issue 37 item 1: a BatchNorm whose training flag follows self.training runs batch statistics in eval"
_I1_2 = ("issue 37 items 1 and 2: BatchNorm in eval runs batch statistics (the BNAct blocks' flag follows "
         "self.training; convert_'s glue BatchNorm ignores eval())")
_I3 = ("issue 37 item 3: convert_ under O2 gives the bfloat16-rounded weights back, not the user's float32 "
       "(fp32_state_dict matches masters by id(); save_pretrained writes bfloat16)")
_I4 = ("issue 37 item 4: lean masters/state on channels_last or transposed weights train differently "
       "(kahan) or crash (stochastic, auto: 'view size is not compatible')")
_I8 = ("issue 37 item 8: DCP's Stateful idiom {'model': model, 'optim': opt} resumes differently from the "
       "uninterrupted run, without a word")
_I10 = ("issue 37 item 10: convert_ refuses a block whose mask buffer is inverted in forward "
        "(torch.fx folds ~self.mask into _tensor_constant0)")
_I11 = "issue 37 item 11: convert_ finds blocks only in nn.ModuleList, not in nn.Sequential stages"

KNOWN: Dict[Key, str] = {}

# CLIPModel bfloat16 was listed (4 dB below autocast) until the numerics check pooled its SQNR over enough
# input draws: on CLIP's 2×2 similarity matrix one draw put fxamp anywhere from 10 dB below to 4 dB above
# autocast, by seed (rm_checks.MIN_COMPARED).


def known(model: str, check: str, policy: Optional[str], dtype: Optional[str]) -> Optional[str]:
    """The reason this case is a known failure, or None."""
    for (m, c, p, d), reason in KNOWN.items():
        if (fnmatch.fnmatchcase(model, m) and fnmatch.fnmatchcase(check, c)
                and fnmatch.fnmatchcase(policy or "-", p) and fnmatch.fnmatchcase(dtype or "-", d)):
            return reason
    return None
