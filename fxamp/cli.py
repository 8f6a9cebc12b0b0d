"""The ``fxamp`` command line: ``fxamp report MODEL [--input SHAPE[:DTYPE] ...] [--policy O1] ...``,
``fxamp tune MODEL ...`` and ``fxamp convert MODEL ... [--output FILE.pt] [--code]``.

Exit codes: 0 success; 2 the command line is wrong (a bad shape, policy, dtype, format or MODEL
spelling); 1 the model could not be loaded, built, traced, converted or run.  Errors are one line,
``fxamp: error: ...``; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import pickle
import sys
import traceback
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

from .cli_model import ModelError, UsageError, load_model, one_line

__all__ = ["main", "load_model", "parse_input", "parse_inputs", "UsageError", "ModelError"]

_DESCRIPTION = "fxamp: ahead-of-time mixed precision for PyTorch, as a torch.fx graph rewrite."
_REPORT_HELP = "show what each op of a model runs in (safe/neutral/conditional/unsafe), why, and where casts go"
_REPORT_EPILOG = """\
examples:
  fxamp report examples/models.py:TinyTransformerBlock --input 2,8,32
  fxamp report examples/models.py:TinyLM --input 2,16:int64 --policy O2 --dtype bfloat16
  fxamp report mypkg.models:build_model --input 8,3,32,32 --format json --output report.json
  fxamp report examples/models.py:TinyCNN --input 2,3,16,16 --compare O2
  fxamp report mypkg.models:build_model(d=64,layers=2) --input 2,16,64
  fxamp report mypkg.seq2seq:build --input input_ids=2,16:int64 --input decoder_input_ids=2,8:int64

MODEL is path/to/file.py:Name or package.module:Name, where Name is an nn.Module subclass
(built with no arguments), a function returning a module, or a module instance.  A class or
function may be called with keyword arguments: Name(d=64,act="gelu"); the values are Python
literals (numbers, strings, True/False/None, tuples, lists, dicts), read with ast.literal_eval,
never run as code.  Quote MODEL in the shell when it has parentheses.
--input gives one example input per flag: comma-separated sizes, float32 unless :DTYPE
follows; integer inputs (token ids, indices) are filled with the values 0 and 1.  NAME=SHAPE
passes the input by keyword (forward's argument NAME); inputs without a name are positional,
in order.
Without --input, dtypes that depend on the inputs show as 'runtime' and FLOPs are not estimated.

exit codes: 0 success, 2 bad command line, 1 the model could not be loaded, traced or run.
"""

_TUNE_HELP = "move the fewest modules/ops of a model to float32 until its output matches float32's closely enough"
_TUNE_EPILOG = """\
examples:
  fxamp tune examples/models.py:TinyTransformerBlock --input 2,8,32 --min-sqnr 40 --save overrides.json
  fxamp report examples/models.py:TinyTransformerBlock --input 2,8,32 --overrides overrides.json --numerics

The search converts with --policy, compares the output with float32's on --batches random
batches, ranks what runs in low precision by the error each node introduces, and bisects for
the shortest list of module paths (or, for ops at the root, single ops by node name) to run in
float32.
"""

_CONVERT_HELP = "convert a model and save the converted module (torch.save) or print its generated code"
_CONVERT_EPILOG = """examples:
  fxamp convert examples/models.py:TinyTransformerBlock --input 2,8,32 --code
  fxamp convert examples/models.py:TinyLM --input 2,16:int64 --policy O2 --dtype bfloat16 --output tiny_lm_o2.pt
  fxamp convert mypkg.models:build_model --overrides overrides.json --output model_amp.pt

The saved file is the whole converted module: load it with torch.load(FILE, weights_only=False)
where fxamp is installed (its generated code calls fxamp's run-time casts).  A model torch.fx
cannot trace (or --frontend export) is saved as a module that captures with torch.export at its
first call, after loading too: exported graphs do not pickle.  With --input the converted module
is run once on those inputs and the output dtypes are printed (and --code shows the captured
graph's code).
"""

_INPUT_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64", "fp64": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "int8": "int8",
    "uint8": "uint8", "bool": "bool",
}


_DTYPE_HELP = ("low-precision dtype of a preset: float16 or bfloat16 (default: autocast's for the model's device, "
               "bfloat16 on CPU; the report's notes say which)")


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line and raise instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxamp", description=_DESCRIPTION,
                     epilog="run 'fxamp report --help' for the report's options")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("report", help=_REPORT_HELP, description=_REPORT_HELP[0].upper() + _REPORT_HELP[1:] + ".",
                       epilog=_REPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="path/to/file.py:Name or package.module:Name, optionally Name(key=literal,...)")
    p.add_argument("--input", "-i", action="append", default=[], metavar="SHAPE[:DTYPE]",
                   help="an example input, e.g. 8,3,32,32 or 2,16:int64; NAME=SHAPE[:DTYPE] passes it by keyword, e.g. "
                        "input_ids=2,16:int64; "
                        "repeat for each forward argument")
    p.add_argument("--policy", "-p", default="O1",
                   help="O0, O1, O2, O3 or a string such as 'params=float32,compute=bfloat16' (default: O1)")
    p.add_argument("--dtype", "-d", default=None, help=_DTYPE_HELP)
    p.add_argument("--keep-norms-fp32", action="store_true", help="O3 only: keep normalisation layers in float32")
    p.add_argument("--format", "-f", default="table", choices=("table", "json", "csv"), help="output format")
    p.add_argument("--only", default=None, metavar="CATEGORIES",
                   help="show only these categories, comma-separated (safe,neutral,conditional,unsafe,unlisted)")
    p.add_argument("--compare", default=None, metavar="POLICY",
                   help="instead, list the nodes whose category or dtype change from --policy to this policy")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="write to FILE instead of standard output")
    p.add_argument("--wide", action="store_true", help="table: show reasons in full")
    p.add_argument("--leaf-module", action="append", default=[], metavar="PATH",
                   help="a submodule path torch.fx must not trace into (repeatable)")
    p.add_argument("--frontend", default="auto", choices=("auto", "fx", "export"),
                   help="graph capture: fx, export (needs --input) or auto (fx, then export if --input given)")
    p.add_argument("--numerics", action="store_true",
                   help="also run float32 and the converted model side by side (needs --input): SQNR per node, "
                        "the culprit and the worst op")
    p.add_argument("--batches", type=int, default=None, metavar="N",
                   help="with --numerics: measure N random input batches (default 1)")
    p.add_argument("--overrides", default=None, metavar="FILE",
                   help="apply overrides saved by 'fxamp tune --save FILE'")
    p.add_argument("--gradients", action="store_true",
                   help="run one backward (loss: a scalar output, else the outputs' mean square) and report float16 gradient underflow "
                        "and the loss scale that avoids it (needs --input)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="with --gradients: draw the histogram of log2|gradient| with float16's range (matplotlib)")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")

    t = sub.add_parser("tune", help=_TUNE_HELP, description=_TUNE_HELP[0].upper() + _TUNE_HELP[1:] + ".",
                       epilog=_TUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("model", metavar="MODEL", help="path/to/file.py:Name or package.module:Name")
    t.add_argument("--input", "-i", action="append", default=[], metavar="SHAPE[:DTYPE]",
                   help="an example input, e.g. 8,3,32,32 or 2,16:int64; repeat for each forward argument")
    t.add_argument("--policy", "-p", default="O1", help="the policy to start from (default: O1)")
    t.add_argument("--dtype", "-d", default=None, help=_DTYPE_HELP)
    t.add_argument("--min-sqnr", type=float, default=None, metavar="DB",
                   help="the output's SQNR against float32 that must hold on every batch, in dB (default 30; "
                        "15 for a policy with float8=)")
    t.add_argument("--batches", type=int, default=2, metavar="N", help="random input batches to check (default 2)")
    t.add_argument("--save", default=None, metavar="FILE", help="write the overrides as JSON (for --overrides)")
    t.add_argument("--leaf-module", action="append", default=[], metavar="PATH",
                   help="a submodule path torch.fx must not trace into (repeatable)")
    t.add_argument("--frontend", default="auto", choices=("auto", "fx", "export"), help="graph capture")
    t.add_argument("--debug", action="store_true", help="show the full traceback on errors")

    c = sub.add_parser("convert", help=_CONVERT_HELP, description=_CONVERT_HELP[0].upper() + _CONVERT_HELP[1:] + ".",
                       epilog=_CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", metavar="MODEL",
                   help="path/to/file.py:Name or package.module:Name, optionally Name(key=literal,...)")
    c.add_argument("--input", "-i", action="append", default=[], metavar="SHAPE[:DTYPE]",
                   help="an example input (as for report); the converted module is run once on them")
    c.add_argument("--policy", "-p", default="O1", help="O0, O1, O2, O3 or a 'params=...,compute=...' string")
    c.add_argument("--dtype", "-d", default=None, help=_DTYPE_HELP)
    c.add_argument("--keep-norms-fp32", action="store_true", help="O3 only: keep normalisation layers in float32")
    c.add_argument("--leaf-module", action="append", default=[], metavar="PATH",
                   help="a submodule path torch.fx must not trace into (repeatable)")
    c.add_argument("--frontend", default="auto", choices=("auto", "fx", "export"), help="graph capture")
    c.add_argument("--overrides", default=None, metavar="FILE",
                   help="overrides JSON (from fxamp tune --save) applied to the conversion")
    c.add_argument("--output", "-o", default=None, metavar="FILE.pt", help="torch.save the converted module here")
    c.add_argument("--code", action="store_true", help="print the converted module's generated code")
    c.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    joined: List[str] = []
    for a in argv:  # argparse takes the "-1,64" of "--input -1,64" for a flag: keep it a shape, refused as one
        if joined and joined[-1] in ("--input", "-i") and a[:1] == "-" and a[1:2].isdigit():
            joined[-1] = f"--input={a}"
        else:
            joined.append(a)
    argv = joined
    debug = "--debug" in argv
    parser = _build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return {"tune": _tune, "convert": _convert}.get(args.command, _report)(args)
    except UsageError as e:
        return _fail(e, 2, debug)
    except ModelError as e:
        return _fail(e, 1, debug)
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except Exception as e:  # a bug in fxamp: still one line, unless --debug
        return _fail(ModelError(f"{type(e).__name__}: {one_line(str(e))} (rerun with --debug for the traceback)"),
                     1, debug, cause=e)


def _fail(e: Exception, code: int, debug: bool, cause: Optional[BaseException] = None) -> int:
    if debug:
        traceback.print_exception(cause or e.__cause__ or e, file=sys.stderr)
    print(f"fxamp: error: {one_line(str(e))}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------------------------
# fxamp report
# ---------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    import torch

    from .policy import resolve_policy
    from .reporting import report

    # validate everything on the command line before loading the model
    positional, named = parse_inputs(args.input)
    for flag, policy in [("--policy/--dtype", args.policy)] + ([("--compare", args.compare)] if args.compare else []):
        try:
            resolve_policy(policy, args.dtype, keep_norms_fp32=args.keep_norms_fp32)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{flag}: {e}") from e
    only = _parse_only(args.only)
    if only and args.compare:
        raise UsageError("--only filters a report's rows; it does not apply to --compare")
    if args.frontend == "export" and not (positional or named):
        raise UsageError("--frontend export needs example inputs: pass --input SHAPE[:DTYPE]")
    for flag, on in (("--numerics", args.numerics), ("--gradients", args.gradients)):
        if on and not (positional or named):
            raise UsageError(f"{flag} runs the model: pass --input SHAPE[:DTYPE] for each forward argument")
        if on and args.compare:
            raise UsageError(f"{flag} does not apply to --compare; report each policy with {flag} instead")
    if args.plot and not args.gradients:
        raise UsageError("--plot draws the gradient histogram: add --gradients")
    if args.batches is not None and not args.numerics:  # --gradients runs the first batch only
        raise UsageError(f"--batches {args.batches} is the number of batches --numerics measures: add --numerics")
    args.batches = 1 if args.batches is None else args.batches
    if args.batches < 1:
        raise UsageError(f"--batches {args.batches}: give a positive number of batches")
    overrides = _load_overrides(args.overrides)

    model, name = load_model(args.model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        batches = [tuple(_make_input(shape, dtype) for shape, dtype in positional) for _ in range(args.batches)]
        kwargs = {key: _make_input(shape, dtype) for key, (shape, dtype) in named.items()} or None
    inputs = batches[0] if positional else (() if kwargs else None)
    options = dict(dtype=args.dtype, keep_norms_fp32=args.keep_norms_fp32, leaf_modules=tuple(args.leaf_module),
                   frontend=args.frontend, **overrides)
    if args.numerics:
        options["numerics"] = True
    if args.gradients:
        options["gradients"] = True
        if args.plot:
            options["plot"] = args.plot

    def run(policy: str):
        data = batches if (args.numerics or args.gradients) and len(batches) > 1 else inputs
        try:
            with _quiet(not args.debug):
                return report(model, policy, example_inputs=data, example_kwargs=kwargs, **options)
        except Exception as e:
            raise ModelError(_explain(e, name, has_inputs=inputs is not None)) from e

    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = run(args.policy)
        if args.compare:
            result: Any = first.diff(run(args.compare))
        else:
            result = first.only(*only) if only else first
    if args.format == "json":
        text = result.to_json()
    elif args.format == "csv":
        text = result.to_csv()
    else:
        text = result.to_table(wide=args.wide) if hasattr(result, "to_table") else str(result)
    _write(text, args.output)
    return 0


def _load_overrides(path: Optional[str]) -> dict:
    from .reporting import load_overrides

    if path is None:
        return {}
    try:
        return load_overrides(path)
    except ValueError as e:
        raise UsageError(f"--overrides: {e}") from e


# ---------------------------------------------------------------------------------------------
# fxamp tune
# ---------------------------------------------------------------------------------------------


def _tune(args: argparse.Namespace) -> int:
    import torch

    from .policy import resolve_policy
    from .reporting import autotune, save_overrides

    shapes = [parse_input(text) for text in args.input]
    if not shapes:
        raise UsageError("tune compares outputs with float32's: pass --input SHAPE[:DTYPE] for each forward argument")
    try:
        resolve_policy(args.policy, args.dtype)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--policy/--dtype: {e}") from e
    if args.batches < 1:
        raise UsageError(f"--batches {args.batches}: give a positive number of batches")
    model, name = load_model(args.model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        batches = [tuple(_make_input(shape, dtype) for shape, dtype in shapes) for _ in range(args.batches)]
        try:
            with _quiet(not args.debug):
                _, overrides = autotune(model, args.policy, example_inputs=batches, dtype=args.dtype,
                                        min_sqnr_db=args.min_sqnr, leaf_modules=tuple(args.leaf_module), frontend=args.frontend, verbose=True)
        except Exception as e:
            raise ModelError(_explain(e, name, has_inputs=True)) from e
    if args.save:
        try:
            save_overrides(overrides, args.save)
        except OSError as e:
            raise ModelError(f"cannot write {args.save!r}: {e.strerror or e}") from e
        print(f"fxamp tune: overrides written to {args.save}; use them with fxamp report --overrides {args.save} "
              f"or fxamp.convert(model, **fxamp.load_overrides({args.save!r}))")
    return 0


# ---------------------------------------------------------------------------------------------
# fxamp convert
# ---------------------------------------------------------------------------------------------


def _convert(args: argparse.Namespace) -> int:
    import torch

    from .conversion.convert import conversion_info, convert
    from .errors import TraceError
    from .conversion.lazy import LazyConverted
    from .policy import resolve_policy

    positional, named = parse_inputs(args.input)
    try:
        resolve_policy(args.policy, args.dtype, keep_norms_fp32=args.keep_norms_fp32)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--policy/--dtype: {e}") from e
    if not (args.output or args.code):
        raise UsageError("nothing to do: pass --output FILE.pt to save the converted module, --code to print it, "
                         "or both")
    overrides = _load_overrides(args.overrides)
    model, name = load_model(args.model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        inputs = tuple(_make_input(shape, dtype) for shape, dtype in positional)
        kwargs = {key: _make_input(shape, dtype) for key, (shape, dtype) in named.items()}
    has_inputs = bool(positional or named)
    try:
        with _quiet(not args.debug):
            # no example inputs here: a model torch.fx cannot trace (or frontend export) then becomes a
            # LazyConverted, which pickles (graphs from torch.export do not) and captures at its first call
            amp = convert(model, args.policy, dtype=args.dtype, keep_norms_fp32=args.keep_norms_fp32,
                          leaf_modules=tuple(args.leaf_module), frontend=args.frontend, **overrides)
            out = None
            if has_inputs:
                with torch.no_grad():
                    out = amp(*inputs, **kwargs)
    except Exception as e:
        raise ModelError(_explain(e, name, has_inputs=has_inputs)) from e
    info = conversion_info(amp)
    lines = [f"fxamp convert: {name}  policy {info.policy if info is not None else args.policy}"]
    lines += [f"note: {note}" for note in (info.notes if info is not None else ()) if note.startswith("dtype=")]
    if out is not None:
        leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        lines.append("outputs: " + ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in leaves))
    lazy = isinstance(amp, LazyConverted)
    if args.code:
        try:
            code = amp.code.strip()
        except (RuntimeError, TraceError):  # a LazyConverted not called yet
            code = "(captured with torch.export at the first call: pass --input to see the graph's code)"
        lines += ["", code, ""]
    if args.output:
        try:
            torch.save(amp, args.output)
        except OSError as e:
            raise ModelError(f"cannot save to {args.output!r}: {e.strerror or e}") from e
        except (RuntimeError, pickle.PicklingError, AttributeError, TypeError) as e:  # a missing folder; a model
            raise ModelError(f"cannot save to {args.output!r}: {one_line(str(e))}") from e  # that cannot pickle
        lines.append(f"saved to {args.output}: torch.load({args.output!r}, weights_only=False) where fxamp is installed"
                     + ("" if not lazy else "; it captures a graph per train/eval mode with torch.fx again at first use"
                        if info is not None and info.frontend == "fx" else
                        "; it captures with torch.export again at its first call (exported graphs do not pickle)"))
    print("\n".join(lines))
    return 0


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Keep torch's own chatter (torch.export prints partial graphs when it fails) out of a one-line error.

    What was written is shown again if the command succeeds; ``--debug`` turns this off.
    """
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] == "torch"]
    levels = [lg.level for lg in loggers]
    buffer = io.StringIO()
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    sys.stderr.write(buffer.getvalue())  # only reached on success


def _write(text: str, path: Optional[str]) -> None:
    if not text.endswith("\n"):
        text += "\n"
    if path is None:
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ModelError(f"cannot write {path!r}: {e.strerror or e}") from e


def _parse_only(text: Optional[str]) -> Tuple[str, ...]:
    from .conversion.op_lists import Category

    if text is None:
        return ()
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    valid = [c.value for c in Category]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"--only {text!r}: {', '.join(map(repr, bad)) or 'nothing'} is not a category; "
                         f"use a comma-separated list of {', '.join(valid)}")
    return names


def parse_input(text: str) -> Tuple[Tuple[int, ...], str]:
    """``"8,3,32,32"`` → ``((8, 3, 32, 32), "float32")``; ``"2,16:int64"`` → ``((2, 16), "int64")``."""
    shape_text, sep, dtype_text = text.strip().partition(":")
    dtype = "float32"
    if sep:
        key = dtype_text.strip().lower().removeprefix("torch.")
        if key not in _INPUT_DTYPES:
            raise UsageError(f"--input {text!r}: unknown dtype {dtype_text!r}; use one of "
                             f"{', '.join(sorted(set(_INPUT_DTYPES.values())))}")
        dtype = _INPUT_DTYPES[key]
    parts = [p.strip() for p in shape_text.replace("x", ",").split(",")] if shape_text.strip() else []
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"--input {text!r}: a shape is comma-separated positive sizes, optionally followed by "
                         f":DTYPE, e.g. 8,3,32,32 or 2,16:int64")
    return tuple(int(p) for p in parts), dtype


def parse_inputs(texts: Sequence[str]) -> Tuple[List[Tuple[Tuple[int, ...], str]],
                                                 Dict[str, Tuple[Tuple[int, ...], str]]]:
    """The ``--input`` flags: positional ``SHAPE[:DTYPE]`` in order, and keyword ``NAME=SHAPE[:DTYPE]`` by name.

    ``["2,16:int64", "labels=2,16:int64"]`` → ``([((2, 16), "int64")], {"labels": ((2, 16), "int64")})``.
    """
    positional: List[Tuple[Tuple[int, ...], str]] = []
    named: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for text in texts:
        key, sep, rest = text.partition("=")
        if not sep:
            positional.append(parse_input(text))
            continue
        key = key.strip()
        if not key.isidentifier():
            raise UsageError(f"--input {text!r}: {key!r} is not an argument name; write NAME=SHAPE[:DTYPE], "
                             f"e.g. input_ids=2,16:int64")
        if key in named:
            raise UsageError(f"--input {text!r}: {key} is given twice")
        named[key] = parse_input(rest)
    return positional, named


def _make_input(shape: Tuple[int, ...], dtype: str) -> Any:
    import torch

    dt = getattr(torch, dtype)
    if dt.is_floating_point:
        return torch.randn(shape).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return torch.randint(0, 2, shape, dtype=dt)  # small values: valid token ids and indices


def _explain(e: Exception, name: str, *, has_inputs: bool) -> str:
    from .errors import FxampError, TraceError

    text = one_line(str(e))
    if isinstance(e, TraceError):
        hint = " On the command line: --leaf-module PATH keeps a submodule opaque"
        return text + hint + ("." if has_inputs else "; --input SHAPE lets fxamp fall back to torch.export.")
    if isinstance(e, (FxampError, ValueError, TypeError)):
        return f"{name}: {text}"
    return f"{name}: {type(e).__name__}: {text}"
