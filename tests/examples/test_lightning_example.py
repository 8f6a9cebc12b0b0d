"""Run examples/lightning_three_ways.py --quick: the three runs train and the table comes out."""

import pytest

from example_loader import load_example

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lightning_three_ways_quick(capsys):
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    example = load_example("lightning_three_ways")
    assert example.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("32-true", "bf16-mixed", "fxamp O2 bf16"):
        assert row in out
    for column in ("val loss", "activations KiB", "optimizer KiB", "peak KiB", "step ms"):
        assert column in out
    assert "not an allocator peak" in out
    assert ("neither AMX nor AVX-512-BF16" in out) == (not example.has_fast_bf16())
    rows = [line for line in out.splitlines() if line.startswith(("32-true", "bf16-mixed", "fxamp O2"))]
    vs_fp32 = [float(next(t for t in row.split() if t.endswith("%"))[:-1]) for row in rows]
    assert len(vs_fp32) == 3 and all(abs(v) < 2.0 for v in vs_fp32), rows  # seed 0, 2 epochs: within 1%
