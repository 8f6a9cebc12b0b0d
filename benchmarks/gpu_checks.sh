#!/usr/bin/env bash
# The GPU checks, in one call of a leased GPU machine (at most 8 minutes on one H100/H200), each step
# bounded so that one that hangs leaves the others their time; every log lands in $OUT (or ./gpu-out).
#   bash benchmarks/gpu_checks.sh            torchao rows need torchao on PYTHONPATH (pip install --no-deps torchao)
# 1. float8's cost table for this GPU, compiled (paste its COST_TABLES entry into fxamp/conversion/classify/float8.py)
# 2. where a training step's time goes (torch.profiler, top kernels): pure bf16, O2, O2 lean auto (calibrated), stochastic+int8
# 3. GPT-2 small tokens/s compiled (the rows that matter): bf16 O2, fxamp float8 :always, torchao float8; one step of each profiled
# 4. the memory suite at GPT-2 small size on CUDA: bytes/param and peak by the allocator, every lean mode
# 5. GPT-2 small tokens/s eager, all variants (cost model and :always)
# 6. the CUDA tests (tests/test_cuda.py, the device-decided step's), which CI cannot run
# FSDP2=1 adds FSDP2 over NCCL (one rank per GPU): fxamp's low-dtype gather against float32's and FSDP2's
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() { local t=$1 name=$2; shift 2; echo "=== $name ($(date +%T), limit ${t}s): $*"
        timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc $? for $name"; grep -v "Warning\|warn" "$OUT/$name.log" | tail -40; }
{ nvidia-smi -L; python3 -c "import torch, fxamp; print('torch', torch.__version__, torch.version.cuda)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1; nproc; } > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
run 110 float8_cost python3 -m benchmarks.float8_cost --device cuda --compile --repeat 9 --shapes 768x768,768x3072,3072x768,4096x4096,8192x8192
run 60 profile python3 -m benchmarks.profile_real --device cuda --model gpt --steps 3 --top 20 --variants "pure bf16" "fxamp O2" "fxamp O2 (lean auto)" "fxamp O2 (lean stochastic+int8)"
run "${COMPILE_S:-110}" float8_gpt_compiled python3 -m benchmarks.float8_gpt --size small --steps 15 --batch 8 --compile --profile 20 --variants "bf16 O2,tensorwise:always,torchao"
run 120 memory python3 -m benchmarks.memory --device cuda --layers 12 --vocab 50304 --seq 1024 --batch 8 --steps 5 --threads 8 --tables
run 70 float8_gpt python3 -m benchmarks.float8_gpt --size small --steps 15 --batch 8
run 90 test_cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/training/test_step_on_device.py
if [ "${FSDP2:-0}" = 1 ]; then
  run 80 fsdp2_nccl python3 -m benchmarks.fsdp2 --backend nccl --world "$(nvidia-smi -L | wc -l)" --d 512 --layers 4 --steps 10
fi
