"""The benchmark suite runs end to end (tiny sizes, one round): it works; the numbers are not checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"benchmark", "model", "variant", "median", "unit", "vs_fp32", "vs_autocast", "vs_limit", "peak_mib"}
RESULTS = os.path.join(ROOT, "benchmarks", "results.json")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_quick_tiny_writes_table_and_json(tmp_path):
    out = tmp_path / "results.json"
    proc = _run("--quick", "--tiny", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| benchmark" in proc.stdout and "vs autocast" in proc.stdout
    data = json.loads(out.read_text())
    records = data["records"]
    assert data["meta"]["tiny"] and data["meta"]["device"] == "cpu"
    assert {r["benchmark"] for r in records} >= {
        "train step", "inference", "activation memory", "optimizer step", "convert",
        "casts/forward (train)", "casts/forward (no_grad)", "throughput",
        "train step (AdamW)", "inference (real)", "peak memory (train step)",
    }
    assert data["meta"]["size"] == "tiny" and "cpu_flags" in data["meta"] and "matmul_probe" in data["meta"]
    for r in records:
        assert KEYS <= set(r), r
        assert r["median"] is None or r["median"] >= 0, r
    variants = {r["variant"] for r in records if r["benchmark"] == "train step"}
    assert variants == {"fp32", "autocast", "fxamp O1", "fxamp O2"}
    # every timed variant ran (the optimizer wrapper is available), and O1 never served a stale weight
    assert all(r["median"] is not None for r in records if r["benchmark"] == "train step")
    assert all(r["fresh_after_update"] for r in records if r["benchmark"] == "inference" and r["variant"] == "fxamp O1")
    # the real-size suite: every variant of each model, ratios against pure low precision, peak memory
    real = [r for r in records if r["benchmark"] == "train step (AdamW)"]
    assert {r["variant"] for r in real} == {"fp32", "autocast", "pure bf16", "fxamp O1", "fxamp O2",
                                           "fxamp O2 (compiled step)"}
    assert all(r["median"] is not None and r["vs_limit"] is not None for r in real)
    peaks = [r for r in records if r["benchmark"] == "peak memory (train step)"]
    assert peaks and all(r["peak_mib"] > 0 and r["peak_mib"] == r["median"] for r in peaks)
    # ratios are against the fp32 and autocast rows of the same model
    fp32 = {r["model"]: r["median"] for r in records if r["benchmark"] == "train step" and r["variant"] == "fp32"}
    for r in records:
        if r["benchmark"] == "train step":
            assert r["vs_fp32"] == pytest.approx(r["median"] / fp32[r["model"]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_cuda_without_cuda_fails_cleanly(tmp_path):
    proc = _run("--device", "cuda", "--json", str(tmp_path / "r.json"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "CUDA" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_quick_does_not_touch_committed_results():
    """--quick (and --tiny) write to a scratch file, never over the committed full results."""
    before = os.stat(RESULTS).st_mtime_ns if os.path.exists(RESULTS) else None
    proc = _run("--quick", "--tiny", "--only", "convert")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = os.stat(RESULTS).st_mtime_ns if os.path.exists(RESULTS) else None
    assert before == after
    written = [line.split(" ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("wrote ")]
    assert written and os.path.abspath(written[0]) != os.path.abspath(RESULTS)
    assert os.path.exists(written[0])


@pytest.mark.parametrize("model, extra, unit", [("gpt", (), "step"), ("encoder", (), "forward"),
                                                ("resnet", ("--inference",), "forward")])
def test_profile_real_runs(model, extra, unit, capsys):
    """``python -m benchmarks.profile_real`` profiles training steps, or forwards (the encoder, --inference)."""
    from benchmarks import profile_real

    assert profile_real.main(["--model", model, "--size", "tiny", "--steps", "1", "--top", "2", *extra]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("## ")] == \
        ["## autocast", "## pure bf16", "## fxamp O2"]
    assert f"ms per {unit}" in out
