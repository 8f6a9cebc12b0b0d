"""The benchmark suite runs end to end (tiny sizes, one round): it works; the numbers are not checked here."""

from __future__ import annotations

import json
import os
import pathlib
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


def test_quick_tiny_writes_table_and_json_never_over_the_committed_results():
    """Every benchmark at tiny sizes; --quick (and --tiny) write to a scratch file, never over the committed full
    results."""
    before = os.stat(RESULTS).st_mtime_ns if os.path.exists(RESULTS) else None
    proc = _run("--quick", "--tiny", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = os.stat(RESULTS).st_mtime_ns if os.path.exists(RESULTS) else None
    assert before == after
    written = [line.split(" ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("wrote ")]
    assert written and os.path.abspath(written[0]) != os.path.abspath(RESULTS)
    out = pathlib.Path(written[0])
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
    assert variants == {"fp32", "autocast", "pure bf16", "fxamp O1", "fxamp O2"}
    # the small suite has the no-cast limit too: every train and inference row is measured against it
    for r in records:
        if r["benchmark"] in ("train step", "inference"):
            assert r["vs_limit"] == pytest.approx(
                r["median"] / next(p["median"] for p in records if p["benchmark"] == r["benchmark"]
                                   and p["model"] == r["model"] and p["variant"] == "pure bf16")), r
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


def _saved(device_name, commit, records, **meta):
    return {"meta": {"device_name": device_name, "dtype": "bfloat16", "commit": commit,
                     "date": "2026-11-23T00:00:00+00:00", **meta},
            "records": [dict(dict(median=1.0, unit="ms", vs_fp32=None, vs_autocast=None, vs_limit=None, peak_mib=None,
                                  target="", met=None, note=""), **r) for r in records]}


def test_targets_lines_up_every_target_across_runs(tmp_path, capsys):
    """``--targets``: one row per benchmark, model (its size words left out, so a CPU and a GPU size share
    a row) and variant; per run, the ratio the target is judged on and whether it was met."""
    from benchmarks import run

    cpu = _saved("Intel(R) Xeon(R) Processor (2 cores)", "aaa1111", [
        dict(benchmark="train step (AdamW)", model="GPT d768 h12 L2 vocab8192 b2 s128", variant="fxamp O2",
             vs_autocast=0.8949, target="<= 0.90x autocast", met=True),
        dict(benchmark="train step (AdamW)", model="GPT d768 h12 L2 vocab8192 b2 s128", variant="compile(fxamp O2)",
             vs_autocast=1.2, target="<= 1.00x compile(autocast)", met=False, vs_compile_autocast=1.04,
             note="cold compile 1 s; 1.04x compile(autocast)"),
        dict(benchmark="train step", model="linear-chain 200x16, b4", variant="fxamp O2", vs_autocast=0.71,
             vs_fp32=1.12, target="<= 0.75x autocast, <= 1.10x fp32", met=False),
        dict(benchmark="train step", model="linear-chain 200x16, b4", variant="fp32"),  # no target: no row
        dict(benchmark="train step (AdamW)", model="GPT d768 h12 L2 vocab8192 b2 s128", variant="pure bf16",
             vs_autocast=0.861),  # the no-cast limit, shown beside the targets against autocast
    ], cpu_flags={"amx_bf16": True})
    gpu = _saved("NVIDIA H100 80GB HBM3", "bbb2222", [
        dict(benchmark="train step (AdamW)", model="GPT d768 h12 L12 vocab50257 b8 s1024", variant="fxamp O2",
             vs_autocast=0.93, target="<= 0.95x autocast", met=True),
        dict(benchmark="train step (AdamW)", model="GPT d768 h12 L12 vocab50257 b8 s1024", variant="fxamp O1",
             vs_autocast=1.01, target="<= 1.00x autocast", met=False),
    ])
    paths = []
    for i, saved in enumerate((cpu, gpu)):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(saved, f)
    assert run.main(["--targets", *paths]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert header[3] == "Intel Xeon (2 cores) AMX, bfloat16, aaa1111 (1 met, 2 missed)"
    assert header[4] == "NVIDIA H100 80GB HBM3, bfloat16, bbb2222 (1 met, 1 missed)"
    by_key = {tuple(r[:3]): r[3:] for r in body}
    assert by_key[("train step (AdamW)", "GPT", "fxamp O2")] == \
        ["0.89x (pure 0.86x) yes", "0.93x yes", "<= 0.90x autocast / <= 0.95x autocast"]
    assert by_key[("train step (AdamW)", "GPT", "compile(fxamp O2)")][:2] == ["1.04x NO", ""]
    assert by_key[("train step (AdamW)", "GPT", "fxamp O1")][:2] == ["", "1.01x NO"]
    assert by_key[("train step", "linear-chain 200x16", "fxamp O2")][0] == "0.71x, 1.12x NO"
    assert len(body) == 4  # the fp32 row has no target
    # the GPU-only O1 row sits with the other GPT training rows, not after other benchmarks
    assert [r[:3] for r in body].index(["train step (AdamW)", "GPT", "fxamp O1"]) < \
        [r[:3] for r in body].index(["train step", "linear-chain 200x16", "fxamp O2"])


def test_targets_of_a_file_that_is_not_a_results_file_fails_cleanly(tmp_path, capsys):
    from benchmarks import run

    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    assert run.main(["--targets", str(tmp_path / "missing.json")]) == 2
    assert run.main(["--targets", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") and "not a results file" in line for line in err)


def test_memory_script_prints_the_table_and_the_precision_tables():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--d", "64", "--layers", "1", "--vocab", "256",
                           "--seq", "16", "--steps", "1", "--regimes", "autocast,O2 stochastic+int8", "--tables"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| O2 stochastic+int8 |" in proc.stdout and "peak vs autocast" in proc.stdout
    assert "## O2 stochastic+int8" in proc.stdout and "bytes/param" in proc.stdout


def test_memory_script_loss_inside_with_and_without_recompute():
    """``--loss-inside`` (issue 40): the loss is in forward, fxamp recomputes its float32 island, or not."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--loss-inside", "--d", "64", "--layers", "1",
                           "--vocab", "256", "--seq", "16", "--steps", "1", "--regimes", "autocast,O2,O2 no-recompute"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss inside forward" in proc.stdout and "| O2 no-recompute |" in proc.stdout


def test_float8_benchmarks_run_tiny_on_cpu(capsys):
    """benchmarks/float8_cost.py and float8_gpt.py (prepared for a GPU) run end to end at CPU sizes."""
    from benchmarks import float8_cost, float8_gpt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny float8 GEMMs: two threads on a busy machine are far slower
    try:
        assert float8_cost.main(["--shapes", "32x32", "--tokens", "16", "--repeat", "1"]) == 0
        assert float8_gpt.main(["--size", "tiny", "--steps", "2", "--warmup", "1", "--batch", "2", "--profile", "3"]) == 0
        out = capsys.readouterr().out
        assert "## profile of one step: bf16 O2" in out and "## profile of one step: fxamp float8 tensorwise" in out
    finally:
        torch.set_num_threads(threads)


def test_lean_step_parts_table_runs():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lean_step", "--parts-only"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| int8 encode, both moments |" in proc.stdout and "stochastic rounding into the weight" in proc.stdout
