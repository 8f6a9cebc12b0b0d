"""Run examples/char_gpt.py --quick: every variant trains, fxamp lands within 2% of float32's loss."""

import pytest

from example_loader import load_example as _load


def load_example():
    return _load('char_gpt')


def test_char_gpt_quick_within_margin(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    char_gpt = load_example()
    assert char_gpt.main(["--quick", "--out", str(tmp_path)]) == 0  # exit 1 when the margin is missed
    out = capsys.readouterr().out
    for row in ("float32", "autocast bfloat16", "autocast float16 + GradScaler", "fxamp O1 float16",
                "fxamp O1 bfloat16", "fxamp O2 float16", "fxamp O2 bfloat16"):
        assert row in out
    assert "corpus: pydoc_data.topics" in out
    assert "fxamp front end: export: torch.fx could not trace the model" in out
    assert "all fxamp variants within" in out
    assert char_gpt.LOSS_MARGIN == 0.02
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipping the loss-curve plot" in out
    else:
        assert (tmp_path / "char_gpt_loss.png").stat().st_size > 10_000


def test_margin_check_reports_a_miss():
    char_gpt = load_example()
    ref = char_gpt.Result("float32", final_loss=2.00)
    near = char_gpt.Result("fxamp O1 bfloat16", final_loss=2.03, fxamp=True)
    off = char_gpt.Result("fxamp O2 float16", final_loss=2.10, fxamp=True)
    nan = char_gpt.Result("fxamp O2 bfloat16", final_loss=float("nan"), fxamp=True)
    assert char_gpt.check([ref, near, off, nan]) == [
        "fxamp O2 float16: final loss 2.1000 is 5.0% from float32's 2.0000",
        "fxamp O2 bfloat16: final loss nan is nan% from float32's 2.0000",
    ]
