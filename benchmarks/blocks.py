"""In-place, per-block conversion against whole-model conversion: ``python -m benchmarks.blocks [what ...]``.

what (default: ``capture memory``; ``compile`` is slow, ask for it):

capture   a Llama config with 32 layers (hidden 256, 4 heads, intermediate 512, vocabulary 1000):
          ``fxamp.convert_`` then the first forward (the blocks capture at their first call), counting the
          captures, against ``fxamp.convert`` of the whole model with example inputs (torch.export);
          both O1 bfloat16, batch 2 x 32 tokens; then 8 greedy ``generate`` steps with the KV cache
          (in place only: the whole-model graph has no cache).
memory    peak resident memory of converting a 12-layer Llama (hidden 1024, ~0.2 B parameters) under
          O2 bfloat16, in a fresh process each: ``convert_`` against ``convert``; the float32 model's
          own size for scale.
realmodels every model of tests/realmodels converted in place (O1 bfloat16): output SQNR against float32
          beside torch.autocast's, blocks found, captures made.
compile   ``torch.compile(model)`` first call (4 layers, hidden 256): the model converted in place,
          against the unconverted model under ``torch.autocast``; then the median of 10 later calls.

Prints a table per part; record the CPU (``lscpu``) beside any number you keep (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

BF16 = torch.bfloat16


def llama(layers: int, hidden: int = 256, heads: int = 4, inter: int = 512, vocab: int = 1000):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=inter,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def ids(b: int = 2, s: int = 32, vocab: int = 1000) -> torch.Tensor:
    return torch.randint(1, vocab, (b, s), generator=torch.Generator().manual_seed(0))


def capture() -> None:
    import fxamp
    from fxamp.conversion.blocks import converted_modules, family_of
    x = ids()
    rows = []
    model = llama(32)
    start = time.perf_counter()
    fxamp.convert_(model, "O1", dtype=BF16)
    with torch.no_grad():
        model(x)
    block_s = time.perf_counter() - start
    families = list({id(family_of(m)): family_of(m) for _, m in converted_modules(model)}.values())
    blocks = [f for f in families if not f.glue]
    captures = sum(f.captures for f in blocks)
    glue = sum(f.captures for f in families if f.glue)
    rows.append(("convert_ + first forward (in place)", block_s,
                 f"{captures} block capture(s) for {sum(len(f.paths) for f in blocks)} layers, {glue} glue"))
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(x, max_new_tokens=8, do_sample=False)
    gen_s = time.perf_counter() - start
    rows.append(("generate 8 tokens, KV cache (in place)", gen_s,
                 f"now {sum(f.captures for f in blocks)} block capture(s) (prefill, decode variants)"))
    whole = llama(32)
    start = time.perf_counter()
    amp = fxamp.convert(whole, "O1", dtype=BF16, example_inputs=(x,))
    with torch.no_grad():
        amp(x)
    whole_s = time.perf_counter() - start
    rows.append(("convert (whole model, export) + first forward", whole_s, "1 whole-model capture"))
    print("| 32-layer Llama, O1 bfloat16 | seconds | captures |\n|---|---|---|")
    for what, s, note in rows:
        print(f"| {what} | {s:.2f} | {note} |")
    print(f"\nin place / whole model: {block_s / whole_s:.2f}x the time")


def _peak(mode: str) -> dict:
    """In a fresh process: build the model, note RSS, convert, note the peak."""
    code = f"""
import json, resource, torch, fxamp
from benchmarks.blocks import llama
model = llama(12, hidden=1024, heads=16, inter=2816, vocab=32000)
size = sum(p.numel() * p.element_size() for p in model.parameters())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if {mode!r} == "inplace":
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
else:
    model = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(torch.ones(1, 8, dtype=torch.long),))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"size_mib": size / 2**20, "before_mib": before / 1024, "peak_mib": peak / 1024}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory() -> None:
    print("| O2 bfloat16, 12-layer Llama (hidden 1024) | float32 model MiB | RSS before MiB | peak RSS MiB | "
          "peak - before |\n|---|---|---|---|---|")
    for mode, label in (("inplace", "convert_ (in place)"), ("whole", "convert (whole model, export)")):
        r = _peak(mode)
        print(f"| {label} | {r['size_mib']:.0f} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['peak_mib'] - r['before_mib']:.0f} |")


def _compiled(variant: str) -> dict:
    """In a fresh process with an empty inductor cache: the first call of torch.compile(model), then 10 more."""
    code = f"""
import json, statistics, time, torch, fxamp
from benchmarks.blocks import llama, ids
x = ids()
model = llama(4)
autocast = {variant!r} == "autocast"
if not autocast:
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # the blocks capture first (as a user's first eager call would)
compiled = torch.compile(model)
with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
    start = time.perf_counter()
    compiled(x)
    first = time.perf_counter() - start
    times = []
    for _ in range(10):
        start = time.perf_counter()
        compiled(x)
        times.append(time.perf_counter() - start)
    eager = []
    for _ in range(5):
        start = time.perf_counter()
        model(x)
        eager.append(time.perf_counter() - start)
print(json.dumps({{"first": first, "later": statistics.median(times), "eager": statistics.median(eager)}}))
"""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_() -> None:
    rows = [(label, _compiled(variant)) for label, variant in (("unconverted under autocast", "autocast"),
                                                               ("converted in place", "inplace"))]
    print("| torch.compile, 4-layer Llama, no_grad, fresh inductor cache | first call s | later call ms | "
          "eager ms |\n|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['first']:.1f} | {r['later'] * 1e3:.1f} | {r['eager'] * 1e3:.1f} |")
    print(f"\nfirst call, in place / autocast: {rows[1][1]['first'] / rows[0][1]['first']:.2f}x")


def realmodels() -> None:
    """Every model of the real-model suite (tests/realmodels) converted in place, O1 bfloat16, eval, against
    float32: the worst output SQNR beside torch.autocast's, the blocks found and the captures made."""
    import copy
    import os
    import warnings
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(root, "tests"), os.path.join(root, "tests", "realmodels")]
    warnings.filterwarnings("ignore")
    import fxamp
    from fxamp.conversion.blocks import converted_modules, family_of
    from rm_checks import float_leaves
    from rm_models import ENTRIES, available
    print("| model | in place | SQNR dB (autocast) | blocks / captures |\n|---|---|---|---|")
    for entry in ENTRIES:
        if available(entry) is not None:
            continue
        torch.manual_seed(0)
        model = entry.build().eval()
        ref = copy.deepcopy(model)
        args, kwargs = entry.inputs(0)
        try:
            fxamp.convert_(model, "O1", dtype=BF16)
        except ValueError as e:
            print(f"| {entry.name} | refused: {str(e).split(':')[1].strip()[:70]} | | |")
            continue
        with torch.no_grad():
            out = float_leaves(model(*args, **kwargs))
            with torch.autocast("cpu", BF16):
                ac = float_leaves(ref(*args, **kwargs))
            fp = float_leaves(ref(*args, **kwargs))
        ours = min(fxamp.reporting.numerics.sqnr(f, o) for f, o in zip(fp, out))
        theirs = min(fxamp.reporting.numerics.sqnr(f, a) for f, a in zip(fp, ac))
        families = {id(family_of(m)): family_of(m) for _, m in converted_modules(model)}.values()
        blocks = [f for f in families if not f.glue]
        print(f"| {entry.name} | ok | {ours:.1f} ({theirs:.1f}) | {sum(len(f.paths) for f in blocks)} / "
              f"{sum(f.captures for f in blocks)} |")


PARTS = {"capture": capture, "memory": memory, "compile": compile_, "realmodels": realmodels}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m benchmarks.blocks", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("parts", nargs="*", metavar="what", help=f"one or more of {', '.join(PARTS)} (default: capture memory)")
    parts = ap.parse_args(argv).parts or ["capture", "memory"]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r}: choose from {', '.join(PARTS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for part in parts:
        PARTS[part]()
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
