#!/usr/bin/env bash
# One device call: what zeroflow's runs hold on the GPU and in host memory, to check the memory
# plan (`zeroflow plan`) against, and llama-8b forward+backward with and without activation
# checkpointing. Runs on the GPU machine with .gpu carried (scripts/gpu-check.sh stages it):
#   bash scripts/measure-memory.sh [PARTS]      PARTS: any of fwd gpt llama8 share (default all but
#                                               share)
# share: exact offload of gpt-1.3b (8 x 1024) and llama-8b (4 x 2048, checkpointing) with the
# optimizer's device share `fit` and 0 (the host holds only the part of the optimizer the GPU does
# not).
# Each bench step line: model, mode, checkpointing, the plan's totals where the binary prints them,
# the measured device memory in use (cuMemGetInfo: context included) and peak RSS.
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/.gpu/out}; mkdir -p "$OUT"
Z=${ZEROFLOW:-.gpu/zeroflow}
PARTS=${1:-fwd gpt llama8}
# One bench step run with ZEROFLOW_DEVICE_SHARE=$1 (the rest as `step`'s).
shared() {
    local share=$1; shift
    ZEROFLOW_DEVICE_SHARE=$share step "$@"
    grep -ho "device share [^:]*: [0-9.]* of the optimizer" "$OUT/$1.err" | head -1
}
has() { [[ " $PARTS " == *" $1 "* ]]; }
free -b | head -2; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
step() { # step NAME TIMEOUT ARGS... : one bench step run, its JSON appended to $OUT/memory.jsonl
    local name=$1 limit=$2; shift 2
    echo "== $name at ${SECONDS}s"
    timeout "$limit" $Z bench step --device cuda --json "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
    local rc=$?
    python3 - "$OUT/$name.json" "$name" "$rc" >>"$OUT/memory.jsonl" <<'PY' || tail -5 "$OUT/$name.err"
import json, sys
text = open(sys.argv[1]).read(); name, rc = sys.argv[2], int(sys.argv[3])
start = text.find("{")
if start < 0:
    print(json.dumps({"name": name, "exit": rc})); sys.exit(1)
r, _ = json.JSONDecoder().raw_decode(text[start:])
keep = ["model", "mode", "micro_batch", "seq", "parameters", "s_per_step_mean", "s_per_step_median",
        "tokens_per_s", "device_memory_in_use_bytes", "peak_rss_bytes", "peak_rss_bytes_per_param",
        "planned_gpu_bytes", "planned_host_bytes"]
row = {"name": name, "exit": rc, **{k: r.get(k) for k in keep}}
row["times"] = r.get("times")
print(json.dumps(row))
PY
    tail -1 "$OUT/memory.jsonl"
}
if has fwd; then
    for ck in "" "--activation-checkpointing"; do
        echo "== llama-8b bench gpt 4x2048 ${ck:-no-ckpt} at ${SECONDS}s"
        timeout 150 $Z bench gpt --model llama-8b --micro-batch 4 --seq 2048 $ck 2>&1 | grep -E "RESULT|rror" | tail -2
    done
fi
if has gpt; then
    for mode in gpu offload zenflow; do
        for ck in "" "--activation-checkpointing"; do
            step "gpt-1.3b-$mode${ck:+-ckpt}" 150 --model gpt-1.3b --mode $mode --micro-batch 8 --seq 1024 \
                --steps 4 --warmup 2 $ck
        done
    done
fi
if has llama8; then
    step llama-8b-gpu-ckpt 200 --model llama-8b --mode gpu --micro-batch 4 --seq 2048 --steps 3 --warmup 1 --activation-checkpointing
    step llama-8b-offload-ckpt 300 --model llama-8b --mode offload --micro-batch 4 --seq 2048 --steps 3 --warmup 1 --activation-checkpointing
fi
if has share; then
    for share in fit 0; do
        shared $share gpt-1.3b-offload-share-$share 150 --model gpt-1.3b --mode offload --micro-batch 8 \
            --seq 1024 --steps 4 --warmup 2
        shared $share llama-8b-offload-ckpt-share-$share 300 --model llama-8b --mode offload --micro-batch 4 \
            --seq 2048 --steps 5 --warmup 3 --activation-checkpointing
    done
fi
echo "== done at ${SECONDS}s"
