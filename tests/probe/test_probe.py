"""Every probe case (``tests/probe/cases_*.py``) works with the right numbers or is refused in fxamp's words."""
import pytest

from .runner import all_cases, run_case

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = list(all_cases())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in CASES])
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
