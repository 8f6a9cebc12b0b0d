"""Every probe case (``tests/probe/cases_*.py``) works with the right numbers or is refused in fxamp's words."""
import os

import pytest

from .runner import all_cases, run_case

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = list(all_cases())

#: the cases marked slow (Hugging Face models from configs captured once per None pattern, about 15-40 s each
#: on this kind of machine) run with ``python -m tests.probe`` and with FXAMP_PROBE=all; the suite CI runs keeps
#: to its time budget without them (the same paths run in tests/conversion/test_none_patterns.py at smaller cost)
_ALL = os.environ.get("FXAMP_PROBE", "").lower() == "all" or os.environ.get("FXAMP_REALMODELS", "").lower() == "all"
_SLOW = pytest.mark.skip(reason="slow probe case: run with python -m tests.probe or FXAMP_PROBE=all")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[] if _ALL or not c.slow else [pytest.mark.slow, _SLOW])
                                  for c in CASES])
def test_case(case):
    outcome, detail, _ = run_case(case)
    assert outcome in ("ok", "refused"), f"{case.id}: {outcome}: {detail}"
    if case.expect == "works":
        assert outcome == "ok"


def test_the_runner_tells_wrong_numbers_and_torch_tracebacks_from_fxamp_refusals():
    import torch

    from .runner import Case

    def wrong():
        assert torch.equal(torch.zeros(1), torch.ones(1)), "values differ"

    def deep():
        torch.zeros(2) @ torch.zeros(3)  # torch's own error, not fxamp's

    def accepted():
        return None

    judged = {name: run_case(Case("t", name, fn, expect))[0] for name, fn, expect in
              [("wrong", wrong, "works"), ("deep", deep, "either"), ("accepted", accepted, "refused")]}
    assert judged == {"wrong": "silently wrong", "deep": "crash", "accepted": "silently wrong"}
