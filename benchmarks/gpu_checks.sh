#!/usr/bin/env bash
# The GPU checks, in one call of a leased GPU machine (about 9 minutes on one H100/H200), each step
# bounded so that one that hangs leaves the others their time; every log lands in $OUT (or ./gpu-out).
#   bash benchmarks/gpu_checks.sh            torchao rows need torchao on PYTHONPATH (pip install --no-deps torchao)
# 1. float8's cost table for this GPU (paste its COST_TABLES entry into fxamp/conversion/float8.py)
# 2. GPT-2 small tokens/s: bf16 O2, fxamp float8 (cost model and :always), torchao float8, eager
# 3. the memory suite at GPT-2 small size on CUDA: bytes/param and peak by the allocator, every lean mode
# 4. FSDP2 over NCCL (one rank per GPU): fxamp's low-dtype gather against float32's and FSDP2's policies
# 5. step 2 compiled (the tokens/s that matter), as many rows as the time left allows
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() { local t=$1 name=$2; shift 2; echo "=== $name ($(date +%T), limit ${t}s): $*"
        timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc $? for $name"; grep -v "Warning\|warn" "$OUT/$name.log" | tail -40; }
{ nvidia-smi -L; python3 -c "import torch, fxamp; print('torch', torch.__version__, torch.version.cuda)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1; nproc; } > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
run 60 float8_cost python3 -m benchmarks.float8_cost --device cuda --repeat 9
run 100 float8_gpt python3 -m benchmarks.float8_gpt --size small --steps 25 --batch 8
run 150 memory python3 -m benchmarks.memory --device cuda --layers 12 --vocab 50304 --seq 1024 --batch 8 --steps 5 --threads 8 --tables
run 80 fsdp2_nccl python3 -m benchmarks.fsdp2 --backend nccl --world "$(nvidia-smi -L | wc -l)" --d 512 --layers 4 --steps 10
run "${COMPILE_S:-130}" float8_gpt_compiled python3 -m benchmarks.float8_gpt --size small --steps 15 --batch 8 --compile --variants "bf16 O2,torchao,tensorwise:always"
