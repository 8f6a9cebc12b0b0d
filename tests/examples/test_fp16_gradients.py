"""Run examples/fp16_gradients.py --quick: float16 without loss scaling does not learn, with fxamp's scaling it does."""

import re

import pytest

from example_loader import load_example

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fp16_gradients_quick(tmp_path, capsys):
    example = load_example("fp16_gradients")
    assert example.main(["--quick", "--out", str(tmp_path)]) == 0  # exit 1 when the story does not hold
    out = capsys.readouterr().out
    assert re.search(r"params: \d+\.\d+% would flush to zero in float16", out)
    assert "loss scale fxamp's dynamic scaler settles on: 65536" in out
    unscaled = next(line for line in out.splitlines() if "no loss scaling" in line)
    assert "100.0%" in unscaled  # every gradient value was zero
    assert out.strip().splitlines()[-1].startswith("ok:")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install matplotlib" in out
    else:
        assert (tmp_path / "fp16_gradients.png").stat().st_size > 10_000
