"""The ``fxamp`` command line: each documented error path as a subprocess, the rest in process."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fxamp import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "models.py")

BAD_MODELS = textwrap.dedent("""
    import torch.nn as nn

    class NeedsArgs(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.fc = nn.Linear(n, n)

        def forward(self, x):
            return self.fc(x)

    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return x

    class Good(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    def build():
        return Good()

    def not_a_module():
        return 3

    instance = Good()
    NUMBER = 3
""")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "bad.py").write_text(BAD_MODELS)
    (d / "broken.py").write_text("import this_module_does_not_exist\n")
    pkg = d / "clipkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(BAD_MODELS)
    return d


# name: (arguments, exit code, pattern the one-line error (or stdout, when 0) must match)
SUBPROCESS_CASES = {
    "help": (["--help"], 0, r"usage: fxamp .*report"),
    "table": (["report", "clipkg.models:build", "--input", "2,4", "--dtype", "float16"], 0, r"fxamp report: Good"),
    "untraceable": (["report", "bad.py:Untraceable"], 1,
                    r"torch.fx could not trace Untraceable .*control flow.*--leaf-module PATH"),
    "unknown_policy": (["report", "bad.py:Good", "--policy", "O7"], 2, r"unknown policy 'O7'; use one of O0, O1"),
}
# (each process pays ~2.5 s of CPU for importing torch: one of each exit code, and the help; the other errors,
# and report's own help, are checked in process, below)


@pytest.fixture(scope="module")
def runs(workdir):
    """Start every command at once (each pays for importing torch), then collect them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = {name: subprocess.Popen([sys.executable, "-m", "fxamp", *args], cwd=workdir, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _, _) in SUBPROCESS_CASES.items()}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        results[name] = (p.returncode, out, err)
    return results


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_subprocess(runs, name):
    _, code, pattern = SUBPROCESS_CASES[name]
    rc, out, err = runs[name]
    assert rc == code, (out, err)
    if code == 0:
        assert re.search(pattern, out, re.S), out
        assert err == ""
        return
    assert out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("fxamp: error: ")
    assert re.search(pattern, lines[-1]), lines[-1]
    assert len(lines) == 1, err  # one line, no traceback


def test_subprocess_table(runs):
    _, out, _ = runs["table"]
    header = next(line for line in out.splitlines() if line.startswith("node "))
    assert header.split() == ["node", "op", "category", "reason", "in→compute→out", "casts", "before"]
    assert re.search(r'^linear +fc: linear +safe +linear layer +fp32→fp16→fp16 +x→fp16, fc.weight→fp16,\n +fc.bias→fp16$',
                     out, re.M)
    assert "inputs: 2,4:float32" in out and "low-precision FLOPs: 100.0%" in out


def test_debug_shows_the_traceback(in_workdir, capsys):
    rc, out, err = _run(capsys, "report", "bad.py:Untraceable", "--debug")
    assert rc == 1 and out == ""
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("fxamp: error: torch.fx could not trace Untraceable")


# ---------------------------------------------------------------------------------------------
# in process: the remaining paths and formats
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, code, pattern", [
    (["report", "nowhere/model.py:Net"], 1, r"no such file: 'nowhere/model.py'"),
    (["report", "no_such_pkg.models:Net"], 1, r"no module named 'no_such_pkg'"),
    (["report", "bad.py:NUMBER"], 1, r"'NUMBER' in bad.py is an object of type int, not an nn.Module subclass"),
    (["report", "bad.py:Good", "--input", "2,x"], 2, r"--input '2,x': a shape is comma-separated positive sizes"),
    (["report", "bad.py:Good", "--dtype", "float8"], 2, r"dtype='float8' is not a dtype"),
    (["report", "bad.py:Missing"], 1, r"bad.py has no attribute 'Missing'; it defines NeedsArgs, Untraceable, Good"),
    (["report", "bad.py:NeedsArgs"], 1, r"could not build NeedsArgs\(\): TypeError: .*missing 1 required"),
    (["report", "bad.py:not_a_module"], 1, r"not_a_module\(\) returned an object of type int"),
    (["report", "broken.py:Net"], 1, r"error while running broken.py: ModuleNotFoundError"),
    (["report", "bad.py:Good", "--input", "2,5"], 1, r"failed at node linear .*mat1 and mat2 shapes"),
    (["report", "bad.py:Good", "--input", "2,4", "--input", "3"], 1, r"forward takes 1 input \(x\); 2 example"),
    (["report", "bad.py:Good", "--output", "no/such/dir/r.txt"], 1, r"cannot write 'no/such/dir/r.txt'"),
    (["report", "bad.py:Good", "--input", "2,0"], 2, r"--input '2,0': a shape"),
    (["report", "bad.py:Good", "--input", "-1,4"], 2, r"--input '-1,4': a shape is comma-separated positive sizes"),
    (["report", "bad.py:Good", "-i", "-2,4"], 2, r"--input '-2,4': a shape is comma-separated positive sizes"),
    (["report", "bad.py:Good", "--input", "foo=2,4"], 1, r"Good: the model's forward has no argument 'foo'; "
                                                        r"its arguments are x$"),
    (["report", "bad.py:Good", "--input", "2,4:complex"], 2, r"unknown dtype 'complex'; use one of"),
    (["report", "bad.py:Good", "--dtype", "float32"], 2, r"dtype=float32 is not a low-precision dtype"),
    (["report", "bad.py:Good", "--policy", "compute=int8"], 2, r"compute='int8' is not a dtype"),
    (["report", "bad.py:Good", "--only", "risky"], 2, r"--only 'risky': 'risky' is not a category"),
    (["report", "bad.py:Good", "--format", "xml"], 2, r"invalid choice: 'xml'"),
    (["report", "bad.py:Good", "--compare", "O2", "--only", "safe"], 2, r"does not apply to --compare"),
    (["report", "bad.py:Good", "--frontend", "export"], 2, r"--frontend export needs example inputs"),
    (["report", "bad.py"], 2, r"MODEL 'bad.py' must be path/to/file.py:Name or package.module:Name"),
    (["report"], 2, r"the following arguments are required: MODEL"),
    (["frobnicate"], 2, r"invalid choice: 'frobnicate'"),
])
def test_errors_in_process(in_workdir, capsys, argv, code, pattern):
    rc, out, err = _run(capsys, *argv)
    assert rc == code
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("fxamp: error: "), err
    assert re.search(pattern, err), err


def test_no_command_prints_help(capsys):
    rc, out, err = _run(capsys)
    assert rc == 2 and "usage: fxamp" in err


def test_report_help_names_the_options(capsys):
    rc, out, err = _run(capsys, "report", "--help")
    assert rc == 0 and err == ""
    assert re.search(r"--input SHAPE\[:DTYPE\].*--policy.*--format \{table,json,csv\}", out, re.S), out


def test_formats_and_output_file(in_workdir, capsys):
    rc, out, _ = _run(capsys, "report", "bad.py:instance", "--format", "csv", "--only", "safe", "--dtype", "float16")
    assert rc == 0
    records = list(csv.DictReader(io.StringIO(out)))
    assert [r["node"] for r in records if r["record"] == "node"] == ["linear"]
    assert records[0]["output_dtype"] == "float16" and records[0]["input_dtypes"] == "runtime float32 float32"
    rc, out, _ = _run(capsys, "report", "clipkg.models:build", "--input", "2,4", "--format", "json")
    data = json.loads(out)
    assert rc == 0 and data["model"] == "Good" and data["inputs"] == ["2,4:float32"]
    assert data["rows"][-1]["node"] == "output"
    target = in_workdir / "report.json"
    rc, out, err = _run(capsys, "report", "bad.py:build", "-i", "2,4", "-p", "O2", "-d", "bf16", "-f", "json",
                        "-o", str(target))
    assert (rc, out, err) == (0, "", "")
    data = json.loads(target.read_text())
    assert data["policy"].startswith("O2 (params=bfloat16")
    assert next(r for r in data["rows"] if r["node"] == "linear")["compute"] == "bfloat16"


def test_integer_inputs_and_compare(capsys):
    rc, out, _ = _run(capsys, "report", EXAMPLES + ":TinyLM", "--input", "2,6:int64", "--only", "neutral")
    assert rc == 0
    assert re.search(r"^ids +input .*·→-→i64", out, re.M)
    # the lookup is conditional (float32 when only float32-listed ops use it); here it resolves neutral
    rc, out, _ = _run(capsys, "report", EXAMPLES + ":TinyLM", "--input", "2,6:int64", "--only", "conditional")
    assert rc == 0
    assert re.search(r'^embedding +embed: embedding +neutral\* .* i64,fp32→fp32→fp32', out, re.M)
    rc, out, _ = _run(capsys, "report", EXAMPLES + ":TinyMLP", "--input", "2,64", "--compare", "O2", "-d", "float16")
    assert rc == 0
    assert "fxamp compare: TinyMLP" in out and re.search(r"^fc1_weight .* fp32 → fp16", out, re.M)


def test_wide_keeps_reasons(capsys):
    rc, out, _ = _run(capsys, "report", EXAMPLES + ":TinyMLP", "--wide")
    assert rc == 0 and "float32 accumulation in the kernel" in out and "…" not in out


def test_parse_input():
    assert cli.parse_input("8,3,32,32") == ((8, 3, 32, 32), "float32")
    assert cli.parse_input("2,16:int64") == ((2, 16), "int64")
    assert cli.parse_input(" 4 : bf16") == ((4,), "bfloat16")
    for bad in ("", ":int64", "2,-1", "2.5", "a"):
        with pytest.raises(cli.UsageError):
            cli.parse_input(bad)


def test_console_script_is_declared():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'fxamp = "fxamp.cli:main"' in text


# ---------------------------------------------------------------------------------------------
# issue 11: --numerics, --gradients/--plot, --overrides, fxamp tune
# ---------------------------------------------------------------------------------------------

PLANTED = os.path.join(ROOT, "tests", "planted.py")


def test_report_numerics(capsys):
    rc, out, err = _run(capsys, "report", PLANTED + ":Overflows", "--input", "4,16", "--numerics", "--batches", "2",
                        "--dtype", "float16")
    assert rc == 0, err
    assert "SQNR dB" in out and "worst op: mul_1" in out and "numerics over 2 batches" in out
    assert re.search(r"^mul_1 .* -inf ◀", out, re.M)
    rc, out, _ = _run(capsys, "report", PLANTED + ":Overflows", "--input", "4,16", "--numerics", "--format", "json",
                    "--dtype", "float16")
    assert json.loads(out)["numerics_summary"]["culprit"] == "mul_1"


def test_report_gradients_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "g.png"
    rc, out, err = _run(capsys, "report", PLANTED + ":Healthy", "--input", "4,16", "--gradients", "--plot", str(png))
    assert rc == 0, err
    assert "loss scale fxamp's dynamic scaler settles on" in out and png.exists()


@pytest.mark.parametrize("argv, message", [
    (["--numerics"], "--numerics runs the model: pass --input"),
    (["--input", "4,16", "--plot", "x.png"], "--plot draws the gradient histogram: add --gradients"),
    (["--input", "4,16", "--numerics", "--compare", "O2"], "--numerics does not apply to --compare"),
    (["--input", "4,16", "--numerics", "--batches", "0"], "--batches 0: give a positive number"),
    (["--input", "4,16", "--batches", "3"], "--batches 3 is the number of batches --numerics measures: add --numerics"),
    (["--input", "4,16", "--gradients", "--batches", "2"], "--batches 2 is the number of batches --numerics measures"),
])
def test_report_issue11_usage_errors(capsys, argv, message):
    rc, _, err = _run(capsys, "report", PLANTED + ":Healthy", *argv)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_tune_then_report_with_overrides(capsys, tmp_path):
    path = tmp_path / "overrides.json"
    rc, out, err = _run(capsys, "tune", PLANTED + ":TwoCulprits", "--input", "4,16", "--min-sqnr", "30",
                        "--save", str(path), "--dtype", "float16")
    assert rc == 0, err
    assert "2 units to float32" in out and f"overrides written to {path}" in out
    assert json.loads(path.read_text())["module_overrides"] == {"energy": "unsafe", "shrink": "unsafe"}
    rc, out, err = _run(capsys, "report", PLANTED + ":TwoCulprits", "--input", "4,16", "--overrides", str(path),
                        "--numerics", "--format", "json", "--dtype", "float16")
    assert rc == 0, err
    data = json.loads(out)
    assert data["numerics_summary"]["output_sqnr_db"] > 30
    mul = next(r for r in data["rows"] if r["node"] == "mul" and r["module"] == "shrink")
    assert (mul["compute"], mul["source"]) == ("float32", "module override")


def test_tune_usage_errors(capsys, tmp_path):
    rc, _, err = _run(capsys, "tune", PLANTED + ":Healthy")
    assert rc == 2 and "tune compares outputs with float32's: pass --input" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    rc, _, err = _run(capsys, "report", PLANTED + ":Healthy", "--overrides", str(bad))
    assert rc == 2 and "--overrides:" in err and "is not JSON" in err
    rc, out, err = _run(capsys, "tune", PLANTED + ":Healthy", "--input", "4,16")
    assert rc == 0 and "no overrides" in out


# ---------------------------------------------------------------------------------------------
# fxamp convert
# ---------------------------------------------------------------------------------------------


def test_convert_saves_a_module_that_loads_and_runs_as_converted(capsys, tmp_path):
    """examples/models.py uses postponed annotations: the saved graph must not hold them as strings."""
    import torch

    import fxamp

    path = tmp_path / "amp.pt"
    rc, out, err = _run(capsys, "convert", EXAMPLES + ":TinyTransformerBlock", "--input", "2,8,32",
                        "--policy", "O2", "--dtype", "bfloat16", "--output", str(path), "--code")
    assert rc == 0, err
    assert "policy params=bfloat16,compute=bfloat16" in out and "outputs: (2, 8, 32) float32" in out
    assert "def forward(self, x):" in out and f"saved to {path}" in out
    loaded = torch.load(path, weights_only=False)
    model, _ = cli.load_model(EXAMPLES + ":TinyTransformerBlock")
    torch.manual_seed(0)
    model = type(model)()  # the CLI builds its model under no seed: compare through the saved weights
    here = fxamp.convert(model, "O2", dtype=torch.bfloat16)
    here.load_state_dict(loaded.state_dict())
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), here(x))
    assert fxamp.info.policy_of(loaded) == fxamp.info.policy_of(here)


def test_convert_with_overrides_and_usage_errors(capsys, tmp_path):
    path = tmp_path / "overrides.json"
    path.write_text(json.dumps({"version": 2, "node_overrides": {"softmax": "neutral"}}))
    rc, out, err = _run(capsys, "convert", PLANTED + ":Healthy", "--code")
    assert rc == 0, err
    assert re.search(r"softmax = to_\d+\.softmax", out)  # unsafe: its input cast to float32 first
    rc, out, err = _run(capsys, "convert", PLANTED + ":Healthy", "--overrides", str(path), "--code")
    assert rc == 0, err
    assert "softmax = linear_1.softmax(-1)" in out  # the root-level softmax overridden alone: as it arrives
    rc, _, err = _run(capsys, "convert", PLANTED + ":Healthy")
    assert rc == 2 and "nothing to do: pass --output FILE.pt" in err
    rc, _, err = _run(capsys, "convert", PLANTED + ":Healthy", "--policy", "O7", "--code")
    assert rc == 2 and "--policy/--dtype:" in err
    rc, _, err = _run(capsys, "convert", PLANTED + ":Healthy", "--code", "--output", str(tmp_path / "no" / "x.pt"))
    assert rc == 1 and "cannot save to" in err and "does not exist" in err and err.count("\n") == 1


def test_convert_saves_a_model_torch_fx_cannot_trace(capsys, tmp_path):
    """torch.fx cannot trace len(x): the saved module captures with torch.export at its first call (the
    exported graphs themselves do not pickle), after loading too."""
    import torch

    import fxamp

    src = tmp_path / "lenmodel.py"
    src.write_text(textwrap.dedent("""
        import torch.nn as nn

        class LenModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x) * len(x)
    """))
    path = tmp_path / "amp.pt"
    rc, out, err = _run(capsys, "convert", f"{src}:LenModel", "--input", "3,4", "--output", str(path), "--code")
    assert rc == 0, err
    assert "outputs: (3, 4) float32" in out and "aten.linear" in out and "captures with torch.export again" in out
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded, fxamp.conversion.lazy.LazyConverted) and loaded(torch.randn(5, 4)).shape == (5, 4)
    rc, out, err = _run(capsys, "convert", f"{src}:LenModel", "--code")
    assert rc == 0 and "pass --input to see the graph's code" in out


def test_the_default_dtype_is_autocasts_for_the_device_and_is_printed(in_workdir, capsys):
    note = "note: dtype=bfloat16 (autocast's default on cpu; pass dtype= to choose)"
    rc, out, err = _run(capsys, "report", "bad.py:Good", "--input", "2,4")
    assert rc == 0, err
    assert "compute=bfloat16" in out.splitlines()[0] and note in out
    rc, out, err = _run(capsys, "report", "bad.py:Good", "--input", "2,4", "--dtype", "float16")
    assert rc == 0 and "compute=float16" in out.splitlines()[0] and "autocast's default" not in out
    rc, out, err = _run(capsys, "convert", "bad.py:Good", "--input", "2,4", "--code")
    assert rc == 0 and "compute=bfloat16" in out.splitlines()[0] and out.splitlines()[1] == note


def test_convert_saves_a_per_mode_fx_module_saying_how_it_captures_again(tmp_path, capsys):
    """A model whose modes capture different graphs (stochastic depth) holds a torch.fx graph per mode."""
    import torch

    import fxamp

    src = tmp_path / "droppath.py"
    src.write_text(textwrap.dedent("""
        import torch.nn as nn

        def drop_path(x, p, training):
            if not training:
                return x
            return x * x.new_empty((x.shape[0], 1)).bernoulli_(1 - p) / (1 - p)

        class DropPathModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return x + drop_path(self.fc(x), 0.5, self.training)
    """))
    path = tmp_path / "amp.pt"
    rc, out, err = _run(capsys, "convert", f"{src}:DropPathModel", "--output", str(path), "--code")
    assert rc == 0, err
    assert "bernoulli_" in out and "with torch.fx again at first use" in out
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded, fxamp.conversion.lazy.LazyConverted)
    x = torch.randn(64, 4)
    assert torch.equal(loaded.eval()(x), loaded(x))
