"""Where the time of a real-size training step goes: ``python -m benchmarks.profile_real [--model gpt|resnet]``.

Profiles a few training steps (AdamW) of the variants named with ``--variants`` (default: autocast,
pure bf16 and fxamp O2) with ``torch.profiler`` and prints, per variant, the ops with the most self
CPU time (``--device cuda``: self CUDA time, and the step's wall time) and the totals of a few
groups (matmul/conv, casts/copies, optimizer foreach ops).  ``--inference`` profiles no-grad eval
forwards instead; the encoder (``--model encoder``, or ``encoder-export`` for its torch.export
conversion) is inference only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import real as R

GROUPS = {
    "matmul/conv": ("aten::mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::linear", "aten::matmul",
                    "aten::convolution",
                    "aten::_convolution", "aten::mkldnn_convolution", "aten::convolution_backward",
                    "aten::_scaled_dot_product_flash_attention_for_cpu",
                    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                    "aten::cudnn_convolution", "aten::convolution_backward",
                    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
                    "aten::_scaled_dot_product_efficient_attention",
                    "aten::_scaled_dot_product_efficient_attention_backward",
                    "aten::_scaled_dot_product_cudnn_attention",
                    "aten::_scaled_dot_product_cudnn_attention_backward"),
    "casts/copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"),
    "optimizer foreach/fused": ("aten::_foreach_", "aten::_fused_adamw", "aten::_fused_adam"),
    "amp checks": ("aten::_amp_",),
}


#: --model: the index of its case in :func:`benchmarks.real.cases`
_MODELS = {"gpt": 0, "resnet": 1, "encoder": 2, "encoder-export": 3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(_MODELS) + ("gpt-math",), default="gpt",
                   help="gpt-math: the throughput benchmark's GPT-2 small (attention written out, dropout 0.1); "
                        "encoder, encoder-export: the BERT-width encoder converted by default or with "
                        "frontend='export' (inference only)")
    p.add_argument("--inference", action="store_true", help="profile no-grad eval forwards, not training steps")
    p.add_argument("--adamw", choices=("default", "fused", "foreach"), default="default",
                   help="AdamW's implementation in every variant (default: fused where available)")
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--variants", nargs="+", default=[R.AUTOCAST, R.LIMIT, R.O2])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    if args.model == "gpt-math":
        case = R.gpt_math_case(args.size, device)
    else:
        case = R.cases(args.size, device)[_MODELS[args.model]]
    inference = args.inference or not case.train
    adamw = None if args.adamw == "default" else {args.adamw: True}
    torch.manual_seed(0)
    base = case.build()
    x, y = case.make_x(), case.make_y()
    what_runs = "forwards (no_grad, eval)" if inference else "steps"
    print(f"# {case.name}, {args.device}, {args.dtype}, {args.steps} {what_runs}, {args.threads} thread(s)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # torch renamed the CUDA columns "device" (2.4); the key names follow the installed torch
    key = "self_cpu_time_total"
    if cuda:
        probe = torch.autograd.profiler_util.FunctionEventAvg()
        key = "self_device_time_total" if hasattr(probe, "self_device_time_total") else "self_cuda_time_total"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for v in args.variants:
        if inference:
            step = R.forward(v, base, case, x, dtype)
        else:
            step = R.train_step(v, base, case, x, y, dtype, adamw)[0]
        for _ in range(3):
            step()
        walls = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            walls.append(time.perf_counter() - t0)
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            sync()
        ka = prof.key_averages()
        total = sum(getattr(e, key) for e in ka)
        groups = defaultdict(float)
        for e in ka:
            for g, prefixes in GROUPS.items():
                if e.key.startswith(prefixes) and (g != "matmul/conv" or e.key in prefixes):
                    groups[g] += getattr(e, key)
        what = "self CUDA" if cuda else "self CPU"
        unit = "forward" if inference else "step"
        print(f"\n## {v}: wall {statistics.median(walls) * 1e3:.1f} ms per {unit} (median of 5); "
              f"{total / args.steps / 1e3:.1f} ms {what} per {unit}; "
              + ", ".join(f"{g} {t / max(total, 1e-9):.0%}" for g, t in groups.items()))
        print(ka.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
        del step
    return 0


if __name__ == "__main__":
    sys.exit(main())
