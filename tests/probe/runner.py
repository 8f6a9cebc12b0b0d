"""The probe's runner: every case either works with the right numbers or is refused in fxamp's words.

A case is a function of no arguments, registered with ``@cases.add(expect=...)`` in a ``cases_<area>.py`` module:

- ``expect="works"``: it must return normally; it checks its own numbers with :func:`like_autocast`,
  :func:`bitwise` or plain ``assert`` (an ``AssertionError`` is a *silently wrong* result);
- ``expect="refused"``: it must raise, and the error must be fxamp's (raised in the ``fxamp`` package, or of a type
  fxamp defines) with a message of one short paragraph;
- ``expect="either"``: works with the right numbers, or is refused as above (what a new user may try where both
  answers are fine, e.g. a model torch.fx cannot trace).

Outcomes: ``ok``, ``refused`` (clearly), ``silently wrong`` (an assertion failed, or an input that must be refused
was accepted), ``crash`` (any other exception: a traceback from deep inside torch, or an unclear fxamp error).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import fxamp

_PACKAGE = str(Path(fxamp.__file__).parent)
EXPECTS = ("works", "refused", "either")
OUTCOMES = ("ok", "refused", "silently wrong", "crash")
#: a clear refusal says what was wrong and what to do in a short paragraph, not a page of dumped state
MAX_MESSAGE = 1200


@dataclasses.dataclass(frozen=True)
class Case:
    area: str
    name: str
    fn: Callable[[], Any]
    expect: str
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{self.area}/{self.name}"


class Cases:
    """One area's cases, in the order written."""

    def __init__(self, area: str) -> None:
        self.area = area
        self.cases: List[Case] = []

    def add(self, expect: str = "works", *, name: Optional[str] = None, slow: bool = False) -> Callable:
        if expect not in EXPECTS:
            raise ValueError(f"expect={expect!r}: one of {EXPECTS}")

        def register(fn: Callable[[], Any]) -> Callable[[], Any]:
            self.cases.append(Case(self.area, name or fn.__name__, fn, expect, slow))
            return fn

        return register


# -- checks a case uses ----------------------------------------------------------------------------------------


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    noise = (ref - out).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum().clamp_min(1e-300) / noise))


def first_float(out: Any) -> torch.Tensor:
    """The main floating output: a tensor, ``.logits``, else the first floating tensor found."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
        return out.logits
    items = out.values() if isinstance(out, dict) else out
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item
    raise AssertionError(f"no floating output in {type(out).__name__}")


def like_autocast(original: torch.nn.Module, converted: Callable, *inputs: Any, dtype: torch.dtype = torch.bfloat16,
                  margin_db: float = 3.0, floor_db: Optional[float] = None, **kwargs: Any) -> float:
    """The converted output against float32 is at most ``margin_db`` below ``torch.autocast``'s (CPU, ``dtype``) on
    the same inputs, or above ``floor_db`` where given and autocast does better; returns fxamp's SQNR."""
    with torch.no_grad():
        ref = first_float(original(*inputs, **kwargs)).float()
        with torch.autocast("cpu", dtype=dtype):
            auto = first_float(original(*inputs, **kwargs)).float()
        out = first_float(converted(*inputs, **kwargs))
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)}, float32's {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"output dtype {out.dtype}, the original's {ref.dtype}"
    got, limit = sqnr(ref, out), sqnr(ref, auto) - margin_db
    if floor_db is not None:
        limit = min(limit, floor_db)
    assert got >= limit, f"SQNR {got:.1f} dB against float32, autocast {limit + margin_db:.1f} dB"
    return got


def bitwise(a: Any, b: Any, what: str = "values") -> None:
    """Tensors (or dicts / sequences of them) equal bit for bit, dtypes included."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            bitwise(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: {len(a)} against {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            bitwise(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} against {b.dtype}"
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: values differ"
    else:
        assert a == b, f"{what}: {a!r} against {b!r}"


def same_error(original: Callable[[], Any], converted: Callable[[], Any]) -> None:
    """Where the user's own call is wrong (a bad shape for their model), the converted model answers as the
    original does: both raise the same exception type, or neither raises."""
    errors = []
    for call in (original, converted):
        try:
            call()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - comparing what each raises
            errors.append(e)
    a, b = errors
    if a is None:
        assert b is None, f"the original runs; the converted model raises {type(b).__name__}: {b}"
    else:
        assert b is not None, f"the original raises {type(a).__name__}; the converted model runs"
        assert isinstance(b, type(a)) or isinstance(a, type(b)) or _is_fxamp(b), (
            f"the original raises {type(a).__name__}, the converted model {type(b).__name__}: {b}")


# -- running ---------------------------------------------------------------------------------------------------


def _is_fxamp(e: BaseException) -> bool:
    if type(e).__module__.split(".")[0] == "fxamp":
        return True
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def _clear(e: BaseException) -> bool:
    text = str(e).strip()
    return _is_fxamp(e) and 0 < len(text) <= MAX_MESSAGE


def run_case(case: Case) -> Tuple[str, str, float]:
    """(outcome, detail, seconds)."""
    started = time.perf_counter()
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            case.fn()
    except AssertionError as e:
        outcome, detail = "silently wrong", f"{e}"
    except Exception as e:  # noqa: BLE001 - the outcome is the point
        where = traceback.extract_tb(e.__traceback__)[-1]
        detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}" \
                 f" [{Path(where.filename).name}:{where.lineno}]"
        if case.expect in ("refused", "either") and _clear(e):
            outcome = "refused"
        else:
            outcome = "crash"
    else:
        outcome, detail = ("silently wrong", "accepted an input that must be refused") if case.expect == "refused" \
            else ("ok", "")
    finally:
        torch.set_num_threads(threads)
    return outcome, detail, time.perf_counter() - started


def all_cases(areas: Sequence[str] = ()) -> Iterator[Case]:
    """Every ``cases_<area>.py`` module's cases beside this file, by area name."""
    here = Path(__file__).parent
    for info in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if not info.name.startswith("cases_"):
            continue
        area = info.name.removeprefix("cases_")
        if areas and area not in areas:
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        yield from module.cases.cases


def main(argv: Optional[List[str]] = None) -> int:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--area", action="append", default=[], help="only these areas (cases_<area>.py); repeatable")
    ap.add_argument("-k", default="", help="only cases whose id contains this")
    ap.add_argument("-v", action="store_true", help="a line per case")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    counts: Dict[str, Dict[str, int]] = {}
    bad = []
    started = time.perf_counter()
    for case in all_cases(opts.area):
        if opts.k and opts.k not in case.id:
            continue
        outcome, detail, seconds = run_case(case)
        counts.setdefault(case.area, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
        if outcome in ("silently wrong", "crash"):
            bad.append((case.id, outcome, detail))
        if opts.v:
            print(f"{outcome:15s} {seconds:5.1f}s {case.id}  {detail}", flush=True)
    rows = [[area, *c.values(), sum(c.values())] for area, c in counts.items()]
    rows.append(["all", *(sum(c[o] for c in counts.values()) for o in OUTCOMES),
                 sum(sum(c.values()) for c in counts.values())])
    print(tabulate(rows, headers=["area", *OUTCOMES, "cases"], tablefmt="github"))
    print(f"{time.perf_counter() - started:.0f} s, torch {torch.__version__}")
    for row in bad:
        print(" | ".join(row))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
