"""Run examples/float8_gpt.py --quick: bfloat16 O2 and float8 (tensorwise, rowwise) land within 2% of each other."""

from example_loader import load_example as _load


def load_example():
    return _load("float8_gpt")


def test_float8_gpt_quick_within_margin(capsys):
    example = load_example()
    assert example.main(["--quick"]) == 0  # exit 1 when a float8 variant misses the margin
    out = capsys.readouterr().out
    for row in ("O2 ", "O2,float8=tensorwise:always", "O2,float8=rowwise:always"):
        assert row in out
    assert "all float8 variants within 2%" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("O2,float8")]
    assert [int(line[1]) for line in lines] == [8, 8]  # 4 linears per block; the head stays bfloat16


def test_margin_check_reports_a_miss():
    example = load_example()
    ref = example.Result("O2", final_loss=2.00)
    near = example.Result("O2,float8=tensorwise:always", final_loss=2.03)
    off = example.Result("O2,float8=rowwise:always", final_loss=2.10)
    assert example.check([ref, near, off]) == [
        "O2,float8=rowwise:always: final loss 2.1000 is 5.0% from bfloat16 O2's 2.0000"]
