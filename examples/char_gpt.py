"""Train a character-level GPT-2 on Python's own documentation in float32, torch.autocast and fxamp O1/O2; compare.

    python examples/char_gpt.py [--quick] [--out examples/out/] [--steps N] [--seed S]

The corpus is ``pydoc_data.topics`` (the help texts behind ``help("if")``: ~0.47 M characters of
English and code, shipped with CPython), split 90/10 into training and validation text.  The model
is Hugging Face's ``GPT2LMHeadModel`` (2 layers, width 64, 4 heads, 64-character context, no
dropout) built from a config with random weights, and it computes its own loss from ``labels=``.
torch.fx cannot trace it, so fxamp captures it with ``torch.export`` (the run prints why); batch
sizes stay dynamic, so validation runs on larger batches than training.

Every variant starts from the same weights and sees the same batches; the fxamp variants train
through ``fxamp.initialize`` (the converted model plus ``MixedPrecisionOptimizer``: float32
master weights, dynamic loss scaling for float16).  The table gives each one's final validation
loss (nats per character, the same validation batches for all), its difference from float32,
skipped steps and final loss scale; the PNG plots the training-loss curves.  The run fails
(exit 1) when an fxamp variant's final validation loss is more than ``LOSS_MARGIN`` (relative)
from float32's.

Measured margins (seeds 0-2): at 300 steps (the default; validation loss ≈ 2.15) every fxamp
variant lands within 0.7% of float32's validation loss, as torch.autocast does (within 0.2%); with
``--quick`` (40 steps at lr 1e-3, still on the unigram plateau, loss ≈ 3.0-3.1) within 0.8%.  A full
run takes about 3 minutes here, most of it in float16: this CPU has no fast float16/bfloat16 kernels.

Needs ``pip install -e ".[examples]"`` (transformers; matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from tabulate import tabulate

import fxamp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script or loaded by path
from loss_curves import plot_loss_curves  # noqa: E402

#: how far an fxamp variant's final validation loss may land from float32's (relative)
LOSS_MARGIN = 0.02


@dataclass(frozen=True)
class Setup:
    """The sizes of one run."""

    steps: int = 300  # optimizer steps
    batch: int = 16  # sequences per training step
    block: int = 64  # characters per sequence (the model's context)
    eval_batches: int = 8  # validation batches of 4 * batch sequences each
    lr: float = 2e-3
    seed: int = 0


QUICK = Setup(steps=40, batch=8, block=32, eval_batches=2, lr=1e-3)


def load_corpus() -> Tuple[str, str]:
    """``pydoc_data.topics`` joined in topic order: (training text, validation text)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


class Chars:
    """Character ↔ id over the characters of the whole corpus."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.chars)


def build_model(vocab: int, block: int):
    """A small GPT-2 from a config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=block, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batches(data: torch.Tensor, count: int, batch: int, block: int, gen: torch.Generator) -> List[torch.Tensor]:
    """``count`` batches of ``batch`` random windows of ``block`` characters (the labels are the inputs:
    GPT-2 shifts them itself)."""
    starts = torch.randint(0, len(data) - block, (count, batch), generator=gen)
    return [torch.stack([data[s:s + block] for s in row.tolist()]) for row in starts]


@dataclass
class Result:
    name: str
    curve: List[float] = field(default_factory=list)  # training loss per step
    final_loss: float = float("nan")  # validation loss after training
    skipped: int = 0
    scale: Optional[float] = None
    seconds: float = 0.0
    fxamp: bool = False
    note: str = ""


def variants(lr: float, example: torch.Tensor):
    """name -> builds (step function, stats function, validation loss function) from a fresh float32 model."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

    def plain(model, autocast_dtype=None, scaler=None):
        opt = adamw(model.parameters())

        def loss_of(ids):
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                return model(ids, labels=ids).loss.float()

        def step(ids):
            opt.zero_grad()
            loss = loss_of(ids)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss

        def stats():
            return (0, scaler.get_scale()) if scaler is not None else (0, None)

        return model, step, stats, loss_of

    def fx(model, policy, dtype, **lean):
        # the example batch only fixes which inputs the graph takes (input_ids and labels):
        # batch and sequence sizes stay dynamic
        amp, opt = fxamp.initialize(model, adamw(model.parameters()), policy, dtype=dtype,
                                    example_inputs=(example,), example_kwargs={"labels": example}, **lean)

        def loss_of(ids):
            return amp(ids, labels=ids).loss  # float32: the loss is on fxamp's float32 list

        def step(ids):
            opt.zero_grad()
            loss = loss_of(ids)
            opt.backward(loss)
            opt.step()
            return loss

        return amp, step, (lambda: (opt.skipped_steps, opt.current_scale)), loss_of

    return {
        "float32": lambda m: plain(m),
        "autocast bfloat16": lambda m: plain(m, torch.bfloat16),
        "autocast float16 + GradScaler": lambda m: plain(m, torch.float16, torch.amp.GradScaler("cpu")),
        "fxamp O1 float16": lambda m: fx(m, "O1", torch.float16),
        "fxamp O1 bfloat16": lambda m: fx(m, "O1", torch.bfloat16),
        "fxamp O2 float16": lambda m: fx(m, "O2", torch.float16),
        "fxamp O2 bfloat16": lambda m: fx(m, "O2", torch.bfloat16),
        # no float32 master, 8-bit Adam state: 6 bytes per parameter instead of 16 (docs/training.md)
        "fxamp O2 bfloat16 stochastic+int8": lambda m: fx(m, "O2", torch.bfloat16, masters="stochastic", state="int8"),
    }


def train_all(setup: Setup, only: Optional[List[str]] = None, log: Callable[[str], None] = print) -> List[Result]:
    """Train every variant for ``setup.steps`` steps from the same initial weights and batches."""
    train_text, val_text = load_corpus()
    chars = Chars(train_text + val_text)
    train, val = chars.encode(train_text), chars.encode(val_text)
    gen = torch.Generator().manual_seed(setup.seed)
    train_batches = batches(train, setup.steps, setup.batch, setup.block, gen)
    val_batches = batches(val, setup.eval_batches, 4 * setup.batch, setup.block, gen)
    torch.manual_seed(setup.seed)
    init = build_model(len(chars), setup.block).state_dict()
    log(f"corpus: pydoc_data.topics, {len(train):,} training / {len(val):,} validation characters, "
        f"{len(chars)} distinct")
    results = []
    for name, build in variants(setup.lr, train_batches[0][:2]).items():
        if only and name not in only:
            continue
        model = build_model(len(chars), setup.block)
        model.load_state_dict(init)
        model.train()
        model, step, stats, loss_of = build(model)
        res = Result(name, fxamp=name.startswith("fxamp"))
        if res.fxamp:
            info = fxamp.conversion_info(model)
            res.note = f"{info.frontend}: {info.notes[0]}"
        start = time.perf_counter()
        for ids in train_batches:
            res.curve.append(step(ids).item())
        res.seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            res.final_loss = sum(loss_of(ids).item() for ids in val_batches) / len(val_batches)
        res.skipped, res.scale = stats()
        log(f"  {name:32s} validation loss {res.final_loss:.4f}  ({res.seconds:.1f}s)")
        results.append(res)
    return results


def check(results: List[Result]) -> List[str]:
    """The fxamp variants that land outside the margin, with why."""
    ref = next(r for r in results if r.name == "float32")
    bad = []
    for r in results:
        rel = abs(r.final_loss - ref.final_loss) / ref.final_loss
        if r.fxamp and not rel <= LOSS_MARGIN:  # `not <=`: a NaN loss fails too
            bad.append(f"{r.name}: final loss {r.final_loss:.4f} is {rel:.1%} from float32's {ref.final_loss:.4f}")
    return bad


def table(results: List[Result]) -> str:
    ref = next(r for r in results if r.name == "float32")
    rows = [(r.name, f"{r.final_loss:.4f}", f"{(r.final_loss - ref.final_loss) / ref.final_loss:+.2%}",
             f"{r.curve[-1]:.4f}", r.skipped if r.fxamp else "", "" if r.scale is None else f"{r.scale:g}",
             f"{r.seconds:.1f}") for r in results]
    return tabulate(rows, headers=["variant", "val loss", "vs fp32", "last train loss", "skipped", "loss scale", "s"],
                    disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 short steps, for the test (seconds)")
    parser.add_argument("--steps", type=int, default=None, help="default 300, or 40 with --quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", help="run only this variant (repeatable; float32 always runs)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else Setup()
    setup = Setup(**{**setup.__dict__, "seed": args.seed, **({"steps": args.steps} if args.steps else {})})
    only = None if not args.only else ["float32", *args.only]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and the numbers do not depend on the machine
    try:
        print(f"character-level GPT-2 (2 layers, width 64), AdamW lr {setup.lr:g}, {setup.steps} steps of "
              f"{setup.batch} x {setup.block} characters, seed {setup.seed}")
        results = train_all(setup, only=only)
    finally:
        torch.set_num_threads(threads)
    notes = sorted({r.note for r in results if r.note})
    for note in notes:
        print(f"fxamp front end: {note}")
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    png = plot_loss_curves(results, os.path.join(args.out, "char_gpt_loss.png"), title="character-level GPT-2",
                           ylabel="training loss, nats/char")
    if png:
        print(f"\nloss curves: {png}")
    bad = check(results)
    print(f"\nmargin: final validation loss within {LOSS_MARGIN:.0%} of float32's: "
          f"{'all fxamp variants within' if not bad else 'FAILED'}")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
