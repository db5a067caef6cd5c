#!/usr/bin/env bash
# One device call: zeroflow's memory plan and the device share `fit` beside another process that
# holds part of the GPU (a Python process with torch holding HOG_GIB, default 110). Runs on the
# GPU machine with .gpu carried (scripts/gpu-check.sh stages it):
#   bash scripts/beside-another-process.sh
# Each case prints its command, its exit status and the lines of the plan, the share and the
# refusal; full output under $OUT. What is expected: the plan's table counts what the other
# process holds; a run that fits the GPU alone but not beside it (gpt-1.3b's `gpu` mode) is
# refused before allocating, exit 2, naming what the other process holds; the exact offload with
# the default share chooses one that fits beside it and runs; share 0 runs.
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/.gpu/out}; mkdir -p "$OUT"
Z=${ZEROFLOW:-.gpu/zeroflow}
HOG_GIB=${HOG_GIB:-110}
GPT="--model gpt-1.3b --micro-batch 8 --seq 1024"

python3 -u - "$HOG_GIB" >"$OUT/hog.log" 2>&1 <<'PY' &
import sys, time, torch
held = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device="cuda")
held.fill_(1)
torch.cuda.synchronize()
print("hog ready", flush=True)
time.sleep(1200)
PY
HOG=$!
trap 'kill $HOG 2>/dev/null' EXIT
for _ in $(seq 120); do grep -q "hog ready" "$OUT/hog.log" && break; sleep 1; done
grep -q "hog ready" "$OUT/hog.log" || { echo "the other process did not start:"; cat "$OUT/hog.log"; exit 1; }
nvidia-smi --query-gpu=memory.total,memory.used --format=csv

case_() { # case_ NAME TIMEOUT ARGS...: one zeroflow command beside the other process
    local name=$1 limit=$2; shift 2
    echo "== $name: zeroflow $*"
    timeout "$limit" $Z "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
    echo "exit $?"
    grep -hE "other processes|device share|does not fit|fits|GPU total|tokens_per_s|RESULT|rror" \
        "$OUT/$name.out" "$OUT/$name.err" | cut -c1-400 | head -12
}
case_ plan-gpu 60 plan --device cuda $GPT --mode gpu
case_ step-gpu 120 bench step --device cuda $GPT --mode gpu --steps 3 --warmup 1 --json
case_ step-offload-default 200 bench step --device cuda $GPT --mode offload --steps 3 --warmup 1 --json
case_ step-offload-share0 200 bench step --device cuda $GPT --mode offload --device-share 0 --steps 3 --warmup 1 --json
case_ train-gpt2 200 train --device cuda --model gpt2-124m --data synthetic --steps 5 --micro-batch 8 \
    --out "$OUT/train-gpt2"
nvidia-smi --query-gpu=memory.total,memory.used --format=csv
echo "== done at ${SECONDS}s"
