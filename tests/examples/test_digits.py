"""Run examples/digits.py --quick: every variant trains, fxamp lands within the stated margins of float32."""

import pytest

from example_loader import load_example as _load


def load_example():
    return _load('digits')


def test_digits_quick_within_margins(tmp_path, capsys):
    pytest.importorskip("sklearn")
    digits = load_example()
    assert digits.main(["--quick", "--out", str(tmp_path)]) == 0  # exit 1 when a margin is missed
    out = capsys.readouterr().out
    for row in ("float32", "autocast bfloat16", "autocast float16 + GradScaler", "fxamp O1 float16",
                "fxamp O1 bfloat16", "fxamp O2 float16", "fxamp O2 bfloat16"):
        assert row in out
    assert "all fxamp variants within" in out
    assert digits.LOSS_MARGIN == 0.02 and digits.ACC_MARGIN == 0.01
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipping the loss-curve plot" in out
    else:
        assert (tmp_path / "digits_loss.png").stat().st_size > 10_000


def test_margin_check_reports_a_miss():
    digits = load_example()
    ref = digits.Result("float32", final_loss=0.20, accuracy=0.95)
    off = digits.Result("fxamp O2 float16", final_loss=0.21, accuracy=0.93, fxamp=True)
    assert digits.check([ref, off]) == [
        "fxamp O2 float16: final loss 0.2100 is 5.0% from float32's 0.2000",
        "fxamp O2 float16: test accuracy 0.9300 < float32's 0.9500 - 0.01",
    ]
