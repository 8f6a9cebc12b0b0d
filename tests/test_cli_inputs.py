"""The command line takes what real models take (issue 12 part 2, issue 10's CLI items, issue 9's sys.path).

Keyword inputs (``--input input_ids=2,16:int64``), ``forward(self, x, **kwargs)`` with one
positional input, models from a factory with keyword arguments (``pkg.module:build(d=64)``,
literals only), ``--compare`` errors that name ``--compare``, a directory given as MODEL, and
``sys.path`` restored after loading.  In process through ``fxamp.cli.main``; one subprocess
runs a Hugging Face T5 end to end with keyword inputs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fxamp import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class KwargsNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, **kwargs):
            return self.fc(x)

    class TwoInputs(nn.Module):
        def __init__(self, d=4):
            super().__init__()
            self.enc = nn.Linear(d, d)
            self.dec = nn.Embedding(16, d)

        def forward(self, x, tokens=None):
            y = self.enc(x)
            if tokens is not None:
                y = y + self.dec(tokens).mean(1)
            return y

    def build_model(d=4, layers=1, act="relu", sizes=(1, 2)):
        assert isinstance(sizes, tuple)
        acts = {"relu": nn.ReLU, "gelu": nn.GELU}
        blocks = []
        for _ in range(layers):
            blocks += [nn.Linear(d, d), acts[act]()]
        return nn.Sequential(*blocks)

    instance = KwargsNet()
""")

T5_FACTORY = textwrap.dedent("""
    import transformers

    def build_t5(d_model=32):
        config = transformers.T5Config(vocab_size=64, d_model=d_model, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                       decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(config).eval()
""")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "nets.py").write_text(MODELS)
    pkg = tmp_path / "inpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # whatever a test leaves, the next sees the original
    for name in [m for m in sys.modules if m == "inpkg" or m.startswith("inpkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_of(capsys, *argv, code=None):
    rc, out, err = run(capsys, *argv)
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("fxamp: error: "), err
    if code is not None:
        assert rc == code
    return err.strip()


# ---------------------------------------------------------------------------------------------
# --input NAME=SHAPE[:DTYPE]
# ---------------------------------------------------------------------------------------------


def test_parse_inputs():
    assert cli.parse_inputs(["2,4", "tokens=2,3:int64", "3"]) == (
        [((2, 4), "float32"), ((3,), "float32")], {"tokens": ((2, 3), "int64")})
    assert cli.parse_inputs([" input_ids = 2,16:long"]) == ([], {"input_ids": ((2, 16), "int64")})
    for bad, pattern in [("2x=3", r"'2x' is not an argument name"), ("x=", r"a shape is comma-separated"),
                         ("x=2,4:complex", r"unknown dtype 'complex'")]:
        with pytest.raises(cli.UsageError, match=pattern):
            cli.parse_inputs([bad])
    with pytest.raises(cli.UsageError, match=r"--input 'x=3': x is given twice"):
        cli.parse_inputs(["x=2", "x=3"])


def test_keyword_inputs(workdir, capsys):
    rc, out, err = run(capsys, "report", "nets.py:TwoInputs", "--input", "2,4", "--input", "tokens=2,3:int64",
                       "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["inputs"] == ["2,4:float32", "tokens=2,3:int64"]
    nodes = [r["node"] for r in data["rows"]]
    assert "embedding" in nodes  # the tokens branch was traced
    rc, out, err = run(capsys, "report", "nets.py:TwoInputs", "--input", "x=2,4", "--input", "tokens=2,3:int64",
                       "--frontend", "export", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["frontend"] == "export" and data["inputs"] == ["x=2,4:float32", "tokens=2,3:int64"]


def test_keyword_only_inputs_allow_the_export_front_end(workdir, capsys):
    rc, _, err = run(capsys, "report", "nets.py:TwoInputs", "--input", "x=2,4", "--frontend", "export")
    assert rc == 0, err
    assert "given twice" in error_of(capsys, "report", "nets.py:TwoInputs", "-i", "x=2,4", "-i", "x=2,4", code=2)


def test_forward_with_var_keyword_takes_one_input(workdir, capsys):
    rc, out, err = run(capsys, "report", "nets.py:KwargsNet", "--input", "2,4")
    assert rc == 0, err
    assert re.search(r"^linear +fc: linear +safe", out, re.M)
    rc, out, err = run(capsys, "report", "nets.py:instance", "--input", "2,4", "--frontend", "export")
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------
# MODEL: factories with keyword arguments, directories, sys.path
# ---------------------------------------------------------------------------------------------


def test_factory_with_keyword_arguments(workdir, capsys):
    rc, out, err = run(capsys, "report", "inpkg.nets:build_model(d=8, layers=2, act='gelu', sizes=(3, 4))",
                       "--input", "2,8", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["model"] == "Sequential"
    assert sum(r["node"].startswith("linear") for r in data["rows"]) == 2  # layers=2
    assert any(r["op"].endswith("GELU") for r in data["rows"])  # act='gelu'
    model, name = cli.load_model("nets.py:TwoInputs(d=6)")
    assert name == "TwoInputs" and model.enc.in_features == 6


@pytest.mark.parametrize("spec, pattern", [
    ("nets.py:build_model(8)", r"keyword arguments only"),
    ("nets.py:build_model(**{'d': 8})", r"keyword arguments only"),
    ("nets.py:build_model(d=__import__('os').getcwd())", r"d=__import__\('os'\).getcwd\(\) is not a literal"),
    ("nets.py:build_model(d=8", r"arguments are written Name\(key=value, ...\)"),
    ("nets.py:build_model(d=8)x", r"arguments are written Name\(key=value, ...\)"),
])
def test_factory_arguments_are_literals_only(workdir, capsys, spec, pattern):
    assert re.search(pattern, error_of(capsys, "report", spec, code=2))


def test_factory_errors(workdir, capsys):
    err = error_of(capsys, "report", "nets.py:build_model(depth=3)", code=1)
    assert "could not build build_model(depth=3): TypeError" in err and "check the arguments" in err
    err = error_of(capsys, "report", "nets.py:instance(d=3)", code=1)
    assert "is a module instance, not a class or function: it takes no arguments" in err


def test_a_directory_as_model(workdir, capsys):
    err = error_of(capsys, "report", f"{workdir}{os.sep}inpkg:Net", code=1)
    assert "is a directory: MODEL is path/to/file.py:Name (a Python file in it) or package.module:Name" in err
    assert "no such file" not in err
    err = error_of(capsys, "report", "./inpkg:Net", code=1)
    assert "'./inpkg' is a directory" in err


def test_sys_path_is_restored(workdir, capsys):
    before = list(sys.path)
    assert run(capsys, "report", "inpkg.nets:KwargsNet")[0] == 0  # imports from the working directory
    assert sys.path == before
    assert run(capsys, "report", "nets.py:KwargsNet")[0] == 0  # a file: its directory, while loading
    assert sys.path == before
    error_of(capsys, "report", "nets.py:build_model(depth=3)", code=1)  # also when building fails
    assert sys.path == before


def test_compare_errors_name_compare(workdir, capsys):
    err = error_of(capsys, "report", "nets.py:KwargsNet", "--compare", "O9", code=2)
    assert err.startswith("fxamp: error: --compare: unknown policy 'O9'")
    err = error_of(capsys, "report", "nets.py:KwargsNet", "--policy", "O9", "--compare", "O2", code=2)
    assert err.startswith("fxamp: error: --policy/--dtype: unknown policy 'O9'")


def test_help_documents_the_new_forms(capsys):
    rc, out, _ = run(capsys, "report", "--help")
    assert rc == 0
    assert "NAME=SHAPE[:DTYPE] passes it by keyword" in out and "input_ids=2,16:int64" in out
    assert "Name(key=literal,...)" in out and "ast.literal_eval" in out


# ---------------------------------------------------------------------------------------------
# End to end: a Hugging Face encoder-decoder with keyword inputs, from a factory with arguments
# ---------------------------------------------------------------------------------------------


def test_t5_with_keyword_inputs_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "t5factory.py").write_text(T5_FACTORY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "fxamp", "report", "t5factory:build_t5(d_model=32)", "--input", "input_ids=2,16:int64",
         "--input", "decoder_input_ids=2,8:int64", "--policy", "O2", "--dtype", "bfloat16", "--format", "json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"] == "T5ForConditionalGeneration" and data["frontend"] == "export"
    assert data["inputs"] == ["input_ids=2,16:int64", "decoder_input_ids=2,8:int64"]
    assert any(r["compute"] == "bfloat16" for r in data["rows"])
