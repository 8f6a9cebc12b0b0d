"""Run every real model through every check and write the coverage table.

    cd <repo> && PYTHONPATH=. python -m tests.realmodels.coverage_table            # all, writes docs/realmodels.md
    python tests/realmodels/coverage_table.py --models gpt2,bert --checks numerics --no-write

Each case is run in this process with a time limit; the result is ``ok``, ``xfail`` (a known
failure, see rm_known.py), ``XPASS`` (a known failure that now passes: remove its entry) or
``FAIL`` (new), with the first line of the error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import rm_checks  # noqa: E402
import rm_invariants  # noqa: E402
from rm_known import known  # noqa: E402
from rm_models import ENTRIES, available  # noqa: E402

REPO = os.path.dirname(os.path.dirname(_HERE))
from rm_checks import DTYPES  # noqa: E402

#: every check by name: the per-policy ones (rm_checks) and the invariants over paths (rm_invariants)
CHECKS = {**rm_checks.CHECKS, **rm_invariants.checks()}


def cases(entry) -> List[tuple]:
    return rm_checks.cases(entry) + rm_invariants.cases(entry)


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def run_case(entry, check: str, policy: Optional[str], dt: Optional[str], limit: int) -> Dict[str, Any]:
    fn = CHECKS[check]
    args = () if check == "o0" else (policy, DTYPES[dt])
    reason = known(entry.name, check, policy, dt)
    torch.manual_seed(0)
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        measured = fn(entry, *args)
        error = None
    except Timeout:
        measured, error = {}, f"timeout after {limit} s"
    except rm_checks.NotApplicable as exc:
        measured, error = {"na": str(exc)}, None
    except BaseException as exc:  # noqa: BLE001 - everything is a result here
        if isinstance(exc, KeyboardInterrupt):
            raise
        measured, error = {}, one_line(exc)
        if os.environ.get("FXAMP_COVERAGE_TRACEBACK"):
            traceback.print_exc()
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    if "na" in measured:
        status = "n/a"
    elif error is None:
        status = "XPASS" if reason else "ok"
    else:
        status = "xfail" if reason else "FAIL"
    return {"model": entry.name, "family": entry.family, "check": check, "policy": policy, "dtype": dt,
            "status": status, "error": error, "known": reason, "seconds": round(seconds, 2), **measured}


def restatus(r: Dict[str, Any]) -> Dict[str, Any]:
    """A stored result's status under today's rm_known (a --jsonl run from before an entry changed)."""
    reason = known(r["model"], r["check"], r["policy"], r["dtype"])
    if r["status"] != "n/a":
        failed = r["error"] is not None
        r["status"] = ("xfail" if failed else "XPASS") if reason else ("FAIL" if failed else "ok")
    r["known"] = reason
    return r


def fmt_db(v: Any) -> str:
    if v is None:
        return ""
    return "inf" if v == float("inf") else f"{v:.1f}"


def autocast_cell(n: Optional[Dict[str, Any]]) -> str:
    if n is None:
        return ""
    if n.get("autocast_error"):
        return f"autocast fails: {n['autocast_error']}"
    return fmt_db(n.get("sqnr_autocast"))


def cell(r: Optional[Dict[str, Any]]) -> str:
    if r is None:
        return ""
    if r["status"] == "ok":
        return "ok"
    if r["status"] == "n/a":
        return f"n/a: {r['na']}"
    if r["status"] == "xfail":
        return f"xfail ({r['known']}); got: {r['error']}"
    if r["status"] == "XPASS":
        return f"**XPASS** (was: {r['known']})"
    return f"**FAIL**: {r['error']}"


def esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def invariants_section(results: List[Dict[str, Any]], header: str) -> str:
    """``## Invariants``: the invariants table of ``results`` (none: an empty string)."""
    by = {(r["model"], r["check"], r["policy"], r["dtype"]): r for r in results if "/" in r["check"]}
    if not by:
        return ""
    counts: Dict[str, int] = {}
    for r in by.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    order = {e.name: i for i, e in enumerate(ENTRIES)}
    models = sorted(dict.fromkeys(r["model"] for r in by.values()), key=lambda m: order.get(m, len(order)))
    return "\n".join(["## Invariants", "", header, "", *invariants_table(by, models), "",
                      "cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""])


def table(results: List[Dict[str, Any]], header: str) -> str:
    results = [r for r in results if "/" not in r["check"]]
    by = {(r["model"], r["check"], r["policy"], r["dtype"]): r for r in results}
    order = {e.name: i for i, e in enumerate(ENTRIES)}  # the registry's order, whatever order cases ran in
    models = sorted(dict.fromkeys(r["model"] for r in results), key=lambda m: order.get(m, len(order)))
    lines = [header, "",
             "| model | family | O0 bitwise (eval, train) | float64 stays float64 (O1 bf16) |",
             "|---|---|---|---|"]
    for m in models:
        fam = next(r["family"] for r in results if r["model"] == m)
        lines.append(f"| {m} | {fam} | {esc(cell(by.get((m, 'o0', None, None))))} | "
                     f"{esc(cell(by.get((m, 'float64', 'O1', 'bfloat16'))))} |")
    lines += ["",
              "| model | policy | dtype | convert, numerics, determinism, state_dict | SQNR fxamp (dB) | "
              "SQNR autocast (dB) | training vs float32 | train max dev |",
              "|---|---|---|---|---|---|---|---|"]
    for m in models:
        for policy in ("O1", "O2"):
            for dt in ("bfloat16", "float16"):
                n = by.get((m, "numerics", policy, dt))
                t = by.get((m, "training", policy, dt))
                if n is None and t is None:
                    continue
                dev = t.get("train_dev") if t else None
                lines.append(f"| {m} | {policy} | {dt} | {esc(cell(n))} | {fmt_db(n.get('sqnr') if n else None)} | "
                             f"{autocast_cell(n)} | {esc(cell(t))} | "
                             f"{'' if dev is None else f'{dev:.4f}'} |")
    counts: Dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines += ["", "cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    return "\n".join(lines)


def short(r: Optional[Dict[str, Any]]) -> str:
    """A status in a few characters: ok, n/a, xfail #<items>, XPASS, FAIL."""
    if r is None:
        return "-"
    if r["status"] in ("xfail", "XPASS"):
        nums = [n for group in re.findall(r"items? (\d+(?:(?:, | and )\d+)*)", r["known"] or "")
                for n in re.findall(r"\d+", group)]
        nums = list(dict.fromkeys(nums))
        return f"{r['status']} #{'/'.join(nums)}" if nums else r["status"]
    return {"ok": "ok", "n/a": "n/a", "FAIL": "**FAIL**"}.get(r["status"], r["status"])


#: the invariant groups of the table: (column, check name prefix, the names' last part in each cell)
GROUPS = [("eval: no buffer changes (O2; shard O1)", "eval-buffers/", rm_invariants.PATHS),
          ("eval after a train step, within 3 dB of autocast", "eval-after-step/", rm_invariants.PATHS),
          ("optimizer modes, strided = contiguous", "layout/", tuple(rm_invariants.MODES)),
          ("round trips: fp32_state_dict, torch.save, save_pretrained, DCP", "roundtrip/", None)]
ABBREV = {"fp32_state_dict": "fp32sd", "torch.save": "save", "save_pretrained": "hf", "dcp": "dcp",
          "in-place": "in-place", "export": "export"}


def invariants_table(by: Dict[tuple, Dict[str, Any]], models: List[str]) -> List[str]:
    """One row per model, one cell per invariant: each path's (or mode's) status."""
    present = {k[1] for k in by if "/" in k[1]}
    checks = [c for c in rm_invariants.checks() if c in present]  # in the order the checks are listed
    if not checks:
        return []
    lines = ["Invariants (issue 37), bfloat16, per conversion path (`fx`, `export`, `lazy`, `in-place` = "
             "`convert_`, `shard` = `convert_` O1 + `fxamp.shard` in a world of one), per optimizer mode, per "
             "round trip (`fp32sd` = `fp32_state_dict` into the unconverted model, `save` = `torch.save`, "
             "`hf` = `save_pretrained`, `dcp`; each after whole-model `export` or `in-place` conversion). "
             "`xfail`: a known difference (reasons in `tests/realmodels/rm_known.py`); `n/a`: the path cannot "
             "take the model (torch.fx "
             "cannot trace it; `convert_` finds no blocks in a model that has none).", "",
             "| model | " + " | ".join(g[0] for g in GROUPS) + " |", "|---|" + "---|" * len(GROUPS)]
    for m in models:
        cells = []
        for _, prefix, parts in GROUPS:
            names = [c for c in checks if c.startswith(prefix)]
            if parts is not None:
                names = [prefix + p for p in parts if prefix + p in names]
            bits = []
            for name in names:
                r = by.get((m, name, rm_invariants.PATH_POLICY.get(name.rsplit("/", 1)[1], "O2"), "bfloat16"))
                if r is None:
                    continue
                label = "/".join(ABBREV.get(x, x) for x in name[len(prefix):].split("/"))
                bits.append(f"{label} {short(r)}")
            cells.append(", ".join(bits))
        if any(cells):
            lines.append(f"| {m} | " + " | ".join(esc(c) for c in cells) + " |")
    failures = [r for r in by.values() if "/" in r["check"] and r["status"] in ("FAIL", "XPASS")]
    if failures:
        lines += ["", "Invariant failures not filed:", ""]
        lines += [f"- {r['model']} {r['check']}: {esc(r['error'] or r['status'])}" for r in failures]
    return lines


DOC_HEAD = """# Real-model coverage

`tests/realmodels/` converts architectures nobody on fxamp wrote (Hugging Face transformers built
from tiny configs with random weights, and `torch.nn` built-ins) under O1 and O2 in bfloat16 (and
float16 for a subset) and checks, per model and policy:

- **convert, numerics**: conversion succeeds; `state_dict` keys are unchanged; floating outputs come
  back float32; two eval calls are bitwise equal; the SQNR of the main output (`logits`, else the first
  floating output) against float32 is at most 3 dB below `torch.autocast("cpu", dtype)`'s on the same
  model and inputs (where autocast itself fails, e.g. oneDNN's float16 LSTM, a fixed floor instead:
  40 dB float16, 25 dB bfloat16), both pooled over as many input draws as it takes to compare 256
  values: one draw of a classifier's (2, 10) logits or CLIP's 2×2 similarities says little (CLIP's put
  fxamp anywhere from 10 dB below to 4 dB above autocast, by seed);
- **training**: 4 AdamW steps (lr 3e-3, loss `mean(out²)`) through `fxamp.MixedPrecisionOptimizer` stay
  within 5% (bfloat16) / 2% (float16) of float32's largest loss at every step, and the loss goes down
  (unless float32's does not either);
- **training-lean**: the same at O2 bfloat16 with lean masters and state (`masters="stochastic",
  state="int8"`: bfloat16 weights rounded stochastically, 8-bit Adam moments; every model, the
  channels_last `resnet-seq-cl` too);
- **in-place-numerics / in-place-training**: the numerics check (O1 and O2) and the training check
  (O2) of the model converted in place, block by block (`fxamp.convert_` of a copy; the masters are
  the float32 originals): 49 of the 50 library models with layer lists pass all three (RWKV's O2 training is
  a strict xfail: its embedding table, predicted low), the 5 without one are n/a (`convert_` refuses them in
  one line until `blocks=` names their blocks);
- **in-place-rows** (O2 bfloat16): in place, every block and glue module runs the same precision-deciding
  aten ops (matmuls, attention, norms, softmax, reductions, exp/log/pow, embeddings, convolutions,
  activations) with the same input and output dtypes, as many times, as whole-model conversion runs for
  that module, recorded at run time on the same inputs; ops outside blocks and glue modules run on
  float32. 39 library models pass, 9 are strict xfails with their reasons (a glue BatchNorm, an embedding
  table predicted low, a Mamba layer that runs as written, ...); `nn.TransformerEncoder` and
  `nn.TransformerDecoder` are n/a (whole-model conversion runs their attention as `nn.MultiheadAttention`'s
  fused kernel), as are the 5 without layer lists;
- **invariants** (issue 37; `rm_invariants.py`, O2 bfloat16, the `shard` path O1), over every conversion
  path: `fx` (`convert(frontend="fx")`), `export` (with the example inputs), `lazy` (`frontend="export"`
  without them), `in-place` (`convert_`) and `shard` (`convert_` + `fxamp.shard` in a gloo world of one):
  **eval-buffers**: eval calls under `no_grad` change no buffer, bitwise (converted from an eval-mode
  model, and after `train()` then `eval()`); **eval-after-step**: one `MixedPrecisionOptimizer` AdamW step
  in train mode, then the eval output's SQNR is at most 3 dB below autocast's, both against the float32
  model as that step left it (the masters' weights, float32's own running statistics); **layout**: float32
  masters, `masters="kahan"`, `"stochastic"` + int8 state and `"auto"` train the model with its 4-D weights
  channels_last and 2-D ones stored transposed exactly as the contiguous model (bitwise where float32
  masters are; float32 masters within 0.5% where a channels_last conv sums in another order);
  **roundtrip**: the user's float32 weights come back bitwise (before training the original's, after a
  step the masters) through `fp32_state_dict` into the unconverted model, `torch.save`/`load` (model and
  optimizer into fresh ones; in place, the model's `state_dict` alone into the unconverted model),
  `save_pretrained`/`from_pretrained` (Hugging Face models in place: float32 weights, float32 config) and
  DCP (`dcp.save({"model": model, "optim": opt})`, loaded into fresh ones; one more step is bitwise the
  uninterrupted run's);
- **patterns of our own** (family `pattern`): `bn-act` (a BatchNorm subclass whose forward computes its
  training flag from `self.training`, a conv-bn-relu `nn.Sequential` stem, a `ModuleList` of blocks),
  `resnet-seq` and `resnet-seq-cl` (`nn.Sequential` stages of residual blocks; the second channels_last),
  `vit-seq-pool` (blocks in an `nn.Sequential`, an `nn.MultiheadAttention` attention-pooling head) and
  `gpt-mask-buffer` (a causal mask buffer inverted in forward, blocks in a `ModuleList`): each goes through
  every check; what issue 37 found in them is fixed, and the differences left are strict xfails with
  their reasons (in place, a glue BatchNorm or a lifted-mask softmax runs float32 where the whole-model
  graph runs it low; `fxamp.shard` refuses the MHA pooling head's low-precision gather in one line);
- **O0** is bitwise equal to the original in eval and in train mode (every dropout set to 0);
- **float64**: a float64 model with float64 inputs converted O1 bfloat16 comes back float64, unchanged.

Run the fast subset with `python -m pytest tests -q -n 2` (CI), everything with
`FXAMP_REALMODELS=all python -m pytest tests/realmodels -q` (or `-m "slow or not slow"`), and
regenerate this file with `PYTHONPATH=. python -m tests.realmodels.coverage_table` (its invariants
section alone with `--invariants-only`, and `--models` to restrict it).

The same checks run under pytest: `FXAMP_REALMODELS=all python -m pytest tests/realmodels -q` (one process,
about 55 minutes for the 65 entries) passes them all but the strict xfails; the CI subset (`FXAMP_REALMODELS` unset) runs in
about 45 s. The tables below are one `coverage_table` run: the commit, time and counts in their first line.

Statuses: `ok`; `xfail (reason)`: a known bug or difference, marked `xfail(strict=True)` in the tests
(list in `tests/realmodels/rm_known.py`); `XPASS`: a known bug that no longer reproduces (remove its
entry); `FAIL`: a failure not yet filed.

timm is not covered: timm 1.0.31 requires torchvision (`import timm` imports
`torchvision.ops.misc`), which cannot be installed next to the CPU torch here.
"""


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--checks", default="", help="comma-separated checks or prefixes of them: o0,numerics,training,float64,"
                                                  "eval-buffers,eval-after-step,layout,roundtrip")
    ap.add_argument("--limit", type=int, default=240, help="seconds per case")
    ap.add_argument("--output", default=os.path.join(REPO, "docs", "realmodels.md"))
    ap.add_argument("--jsonl", default="", help="also append every result as JSON lines to this file")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--invariants-only", action="store_true",
                    help="run the invariant checks only and rewrite only the ## Invariants section of the doc")
    ap.add_argument("--from-jsonl", default="", help="rebuild the table from a --jsonl file of a full run, running nothing")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    wanted = set(filter(None, opts.models.split(",")))
    checks = set(filter(None, opts.checks.split(",")))
    if opts.invariants_only:
        checks = {"eval-buffers/", "eval-after-step/", "layout/", "roundtrip/"}
    results = []
    commit = _commit()
    started = time.perf_counter()
    if opts.from_jsonl:
        with open(opts.from_jsonl) as f:
            results = [restatus(json.loads(line)) for line in f if line.strip()]
        started -= sum(r["seconds"] for r in results)
    for entry in ([] if opts.from_jsonl else ENTRIES):
        if wanted and entry.name not in wanted:
            continue
        why = available(entry)
        if why:
            print(f"skip {entry.name}: {why}", flush=True)
            continue
        for check, policy, dt in cases(entry):
            if checks and not any(check == c or check.startswith(c) for c in checks):
                continue
            r = run_case(entry, check, policy, dt, opts.limit)
            results.append(r)
            extra = "" if r["error"] is None else f"  {r['error']}"
            print(f"{r['status']:5s} {entry.name:22s} {check:8s} {policy or '-':2s} {dt or '-':8s} "
                  f"{r['seconds']:6.1f}s sqnr={fmt_db(r.get('sqnr'))} auto={fmt_db(r.get('sqnr_autocast'))}{extra}",
                  flush=True)
            r["commit"] = commit
            if opts.jsonl:
                with open(opts.jsonl, "a") as f:
                    f.write(json.dumps(r, default=str) + "\n")
    total = time.perf_counter() - started
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commits = sorted({r.get("commit") or "?" for r in results}) or [_commit()]
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    header = (f"## Results\n\n`python -m tests.realmodels.coverage_table` at {'/'.join(commits)}, {stamp}, torch "
              f"{torch.__version__}, {_transformers_version()}, {total:.0f} s on 1 thread: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".")
    invariants = invariants_section(results, header.replace("## Results\n\n", "").replace(
        "coverage_table`", "coverage_table --invariants-only`" if opts.invariants_only else "coverage_table`"))
    if opts.invariants_only:
        text = invariants
    else:
        text = table(results, header) + ("\n" + invariants if invariants else "")
    print(text)
    if opts.invariants_only and not opts.no_write:
        with open(opts.output) as f:
            doc = f.read().split("\n## Invariants\n")[0].rstrip("\n")
        with open(opts.output, "w") as f:
            f.write(doc + "\n\n" + text)
        print(f"wrote the invariants section of {opts.output}")
    elif not opts.no_write and not wanted and not checks:
        os.makedirs(os.path.dirname(opts.output), exist_ok=True)
        with open(opts.output, "w") as f:
            f.write(DOC_HEAD + "\n" + text)
        print(f"wrote {opts.output}")
    return 0


def _commit() -> str:
    """The checkout's short commit, with ``+`` when it has uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _transformers_version() -> str:
    try:
        import transformers
        return f"transformers {transformers.__version__}"
    except Exception:
        return "no transformers"


if __name__ == "__main__":
    sys.exit(main())
