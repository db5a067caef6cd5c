#!/usr/bin/env bash
# One device call for what the Llama family (issue 19) and eval/generate (issue 21) still need
# measured on the H200, in order of priority, each part bounded so that the call ends inside the
# device tool's 10 minutes:
#
#   1. llama-1b (4 x 2048): zeroflow `gpu` and ZenFlow (`bench step`), mean / median / p90;
#   2. CUDA bf16 evaluation loss and greedy ids against transformers (fp32), 7 random models at odd
#      shapes (scripts/generate-oracle.py --device cuda);
#   3. generation speed beside transformers' `generate`, gpt2-124m and llama-1b, batch 1 and 16, on
#      the GPU, then on the host's cores;
#   4. llama-8b forward + backward with activation checkpointing off and on (`bench gpt`);
#   5. DeepSpeed ZenFlow at llama-1b (needs .peers), for the ratio in the same call.
#
# Here: bash scripts/gpu-check.sh, then stage the examples:
#   cargo build --release -p zeroflow-train --example generate --example generate-bench
#   mkdir -p .gpu/examples && cp target/release/examples/{generate,generate-bench} .gpu/examples/
# There: bash scripts/check-llama-generate.sh      carry: [".gpu", ".peers"]
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export OUT
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
B=scripts/bench-vs-deepspeed.sh
Z=.gpu/zeroflow
LIMIT=${LIMIT:-570} # seconds: every part starts only with enough of them left
left() { echo $((LIMIT - SECONDS)); }

echo "== 1. llama-1b zeroflow gpu and zenflow at ${SECONDS}s"
MICRO_BATCH=4 SEQ=2048 STEPS=12 WARMUP=3 PARTS=zeroflow MODES="gpu zenflow" timeout 150 \
    bash $B llama-1b 2>&1 | grep -E "exit|^zeroflow" | tail -4

echo "== 2. CUDA eval and greedy generation against transformers at ${SECONDS}s"
timeout 150 python3 scripts/generate-oracle.py /tmp/oracle --device cuda --bin-dir .gpu/examples \
    >"$OUT/generate-oracle-cuda.log" 2>&1
echo "exit $?"
grep -v "^Loading\|Writing" "$OUT/generate-oracle-cuda.log" | tail -30

echo "== 3. generation speed at ${SECONDS}s"
for device in cuda cpu; do
    for shape in gpt2-124m llama-1b; do
        ((SECONDS + 60 < LIMIT)) || { echo "skipped $shape on $device: time"; continue; }
        new=32
        [[ $device == cpu && $shape == llama-1b ]] && new=8
        timeout $(($(left) - 30)) python3 scripts/generate-bench-vs-transformers.py --shape $shape \
            --batch 1,16 --new-tokens $new --device $device --bin-dir .gpu/examples \
            >"$OUT/generate-bench-$shape-$device.log" 2>&1
        echo "$shape $device: exit $?"
        grep -E "^\{" "$OUT/generate-bench-$shape-$device.log" >>"$OUT/generate-bench.jsonl"
        tail -6 "$OUT/generate-bench-$shape-$device.log"
    done
done

echo "== 4. llama-8b forward + backward at ${SECONDS}s"
for ck in off on; do
    ((SECONDS + 70 < LIMIT)) || { echo "skipped llama-8b checkpointing $ck: time"; continue; }
    timeout 100 $Z bench gpt --model llama-8b --micro-batch 4 --seq 2048 \
        --activation-checkpointing=$ck >"$OUT/llama-8b-fwd-bwd-$ck.log" 2>&1
    echo "checkpointing $ck: exit $?"
    grep -E "RESULT|memory|rror" "$OUT/llama-8b-fwd-bwd-$ck.log" | tail -3
done

echo "== 5. DeepSpeed ZenFlow llama-1b at ${SECONDS}s"
if [[ -d .peers ]] && ((SECONDS + 120 < LIMIT)); then
    MICRO_BATCH=4 SEQ=2048 STEPS=6 WARMUP=3 PARTS=deepspeed DS_MODES=zenflow \
        timeout $(($(left) - 10)) bash $B llama-1b 2>&1 | grep -E "exit|^deepspeed" | tail -3
else
    echo "skipped: no .peers or too little time"
fi

echo "== table at ${SECONDS}s"
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    t = sorted(r.get("times") or [])
    p90 = t[min(len(t) - 1, int(0.9 * len(t)))] if t else None
    print(r.get("system"), r.get("model"), r.get("mode"), "mean", r.get("s_per_step_mean"),
          "median", r.get("s_per_step_median"), "p90", p90,
          "tok/s", round(r.get("tokens_per_s") or 0))
PY
