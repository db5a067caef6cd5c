#!/usr/bin/env bash
# Runs on the GPU machine: zeroflow's `bench step` / `bench gpt` and the peers (PyTorch forward +
# backward, DeepSpeed ZeRO-2 on the GPU, with CPU offload, and ZenFlow) on the same model, one after
# the other in one call, and prints every result as one JSON line plus a table of ratios.
#
#   here:  cargo build --release && bash scripts/gpu-check.sh      (stages .gpu/zeroflow)
#          bench/peers/fetch-wheels.sh                            (once: DeepSpeed into .peers/)
#   there: run  command: bash scripts/bench-vs-deepspeed.sh gpt-1.3b   carry: [".gpu", ".peers"]
#
# Environment: MODES (default "gpu offload offload-delayed"), DS_MODES (default "gpu offload
# zenflow"), STEPS (10), WARMUP (4), MICRO_BATCH (8), SKIP_DS=1 to run zeroflow and PyTorch only,
# SKIP_ZF=1 to run DeepSpeed only (results append to $OUT/bench-MODEL.jsonl, so two calls can split
# the work when one would exceed the device tool's 600 s).
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-gpt-1.3b}
MODES=${MODES:-gpu offload offload-delayed}
DS_MODES=${DS_MODES:-gpu offload zenflow}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-4}
MICRO_BATCH=${MICRO_BATCH:-8}
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
RESULTS=$OUT/bench-$MODEL.jsonl
touch "$RESULTS"
Z=.gpu/zeroflow

json_line() { # json_line LOG: the last line of LOG that is a JSON object
    grep -h '^{' "$1" | tail -1
}

[[ -n "${SKIP_ZF:-}" ]] && MODES=""
for mode in $MODES; do
    log=$OUT/zeroflow-$MODEL-$mode.log
    timeout 300 $Z bench step --device cuda --model "$MODEL" --mode "$mode" \
        --micro-batch "$MICRO_BATCH" --steps "$STEPS" --warmup "$WARMUP" --json >"$log" 2>"$log.err"
    echo "zeroflow $mode: exit $?"
    python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$log" \
        >>"$RESULTS" 2>/dev/null || tail -5 "$log" "$log.err"
done
if [[ -z "${SKIP_ZF:-}" ]]; then
timeout 200 $Z bench gpt --model "$MODEL" --micro-batch "$MICRO_BATCH" >"$OUT/zeroflow-$MODEL-fwd-bwd.log" 2>&1
grep '^RESULT' "$OUT/zeroflow-$MODEL-fwd-bwd.log"
timeout 300 python3 bench/peers/gpt_fwd_bwd.py --model "$MODEL" --micro-batch "$MICRO_BATCH" \
    >"$OUT/torch-$MODEL.log" 2>&1
json_line "$OUT/torch-$MODEL.log" >>"$RESULTS"
fi

if [[ -z "${SKIP_DS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/wheels/*.whl >/dev/null 2>&1
    mkdir -p /tmp/ds && tar -xzf .peers/deepspeed-0.19.8.tar.gz -C /tmp/ds
    (cd /tmp/ds/deepspeed-0.19.8 && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation --target /tmp/site . >/dev/null 2>&1)
    export PYTHONPATH=/tmp/site RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
    port=29600
    for mode in $DS_MODES; do
        port=$((port + 1))
        log=$OUT/deepspeed-$MODEL-$mode.log
        MASTER_PORT=$port timeout 400 python3 bench/peers/ds_train.py --mode "$mode" \
            --model "$MODEL" --micro-batch "$MICRO_BATCH" --steps "$STEPS" --warmup "$WARMUP" \
            >"$log" 2>&1
        echo "deepspeed $mode: exit $?"
        json_line "$log" >>"$RESULTS" || tail -5 "$log"
    done
fi

python3 - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def find(system, mode=None):
    for r in rows:
        if r.get("system") == system and (mode is None or r.get("mode") == mode):
            return r
# GPU memory: zeroflow reports all memory in use on the device (its context included), the
# PyTorch-based peers torch.cuda.max_memory_allocated (their caching allocator's peak, without the
# context's few hundred MiB).
print(f"\n{'system':10} {'mode':16} {'s/step mean':>11} {'tokens/s':>9} {'fwd+bwd s':>9} {'exposed opt s':>13} {'RSS B/param':>11} {'GPU GiB':>7}")
nan = float("nan")
for r in rows:
    gpu = r.get("device_memory_in_use_bytes")
    gpu = gpu / 2**30 if gpu else r.get("peak_gib", nan)
    print(f"{r['system']:10} {r.get('mode','fwd+bwd'):16} {r.get('s_per_step_mean', r.get('s_per_step_median', 0)):11.4f} "
          f"{r['tokens_per_s']:9.0f} {r.get('forward_backward_s_mean', nan):9.4f} "
          f"{r.get('exposed_optimizer_s_mean', nan):13.4f} {r.get('peak_rss_bytes_per_param') or nan:11.1f} {gpu:7.1f}")
print()
for ours, theirs in [("gpu", "gpu"), ("offload", "offload"), ("offload-delayed", "offload"), ("offload-delayed", "zenflow")]:
    a, b = find("zeroflow", ours), find("deepspeed", theirs)
    if a and b:
        print(f"RATIO zeroflow {ours} / deepspeed {theirs}: {a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s")
PY
