#!/usr/bin/env bash
# One device call: a full fine-tune-sized run of the llama-8b shape on one H200 (issue 22), on real
# text, for each mode in MODES (default: offload, then zenflow; zenflow-inline is ZenFlow with its
# CPU step not overlapped, `overlap_step: false`; zenflow-aside-host is ZenFlow overlapped with its
# window set aside in host memory and 16-bit moments, the 80 GB GPU's): `zeroflow train` from random
# weights, activation checkpointing on, micro-batch 4 x 2048 (8,192 tokens per step), STEPS steps
# (default 100). Reported per run: the memory plan's header lines, tokens/s over the steps, the
# loss at the first and last steps and the held-out evaluations, the process's peak RSS (VmHWM)
# and the GPU's peak memory in use (nvidia-smi, sampled every 0.5 s).
#
# The text is the machine's Python standard library (every .py file under /usr/lib/python3*),
# GPT-2 BPE tokens (`zeroflow tokenize --tokenizer gpt2`; llama-8b's 128,256 rows cover them),
# the last 300 files held out. A llama-8b checkpoint (f32 weights, fp32 master and moments:
# 128 GB, 160 with ZenFlow) does not fit the machine's 64 GiB disk, so each run is stopped once
# its last step is recorded, before the final save (`--save-every 0`); held-out evaluations at
# steps 25, 50, 75.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/llama-8b-train.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
MODES=${MODES:-offload zenflow}
STEPS=${STEPS:-100}
LIMIT=${LIMIT:-570}
WORK=${WORK:-/tmp/llama-8b-train}
rm -rf "$WORK" && mkdir -p "$WORK/text"

ZEROFLOW=$Z OUT=$OUT bash scripts/python-corpus.sh "$WORK" || exit 1
echo "tokenized at ${SECONDS}s"
free -g | head -2
df -h /tmp | tail -1

for mode in $MODES; do
    config=examples/configs/zero2-offload-bf16.json
    [[ $mode == zenflow ]] && config=examples/configs/zero2-zenflow-bf16.json
    [[ $mode == zenflow-inline ]] && config=examples/configs/zero2-zenflow-inline-bf16.json
    [[ $mode == zenflow-aside-host ]] && config=examples/configs/zero2-zenflow-aside-host-bf16.json
    budget=$((LIMIT - SECONDS - 15))
    ((budget > 120)) || { echo "skipped $mode: ${budget}s left"; continue; }
    dir=$WORK/run-$mode
    echo "== llama-8b $mode at ${SECONDS}s (at most ${budget}s)"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT/gpu-$mode.csv" &
    smi=$!
    "$Z" train --device cuda --model llama-8b --config "$config" --micro-batch 4 --seq 2048 \
        --activation-checkpointing --data "$WORK/train" --eval-data "$WORK/eval" \
        --lr 3e-4 --eval-every 25 --eval-tokens 65536 --steps "$STEPS" --save-every 0 --log-every 10 \
        --out "$dir" >"$OUT/train-$mode.log" 2>&1 &
    pid=$!
    started=$SECONDS
    hwm=
    # Stop once the last step is recorded (its checkpoint would not fit the disk) or at the budget.
    while kill -0 $pid 2>/dev/null; do
        hwm=$(awk '/VmHWM/ { print $2 }' /proc/$pid/status 2>/dev/null || echo "$hwm")
        if grep -q "\"step\":$STEPS," "$dir/metrics.jsonl" 2>/dev/null; then
            break
        fi
        ((SECONDS - started < budget)) || { echo "$mode: budget reached"; break; }
        sleep 1
    done
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    kill $smi 2>/dev/null
    cp "$dir/metrics.jsonl" "$OUT/metrics-$mode.jsonl" 2>/dev/null
    echo "$mode: ran $((SECONDS - started))s; peak RSS $((hwm / 1024)) MiB;" \
        "GPU peak $(sort -n "$OUT/gpu-$mode.csv" | tail -1) MiB (nvidia-smi)"
    grep -iE "plan|host|gpu|total|error|warn" "$OUT/train-$mode.log" | head -40
    tail -4 "$OUT/train-$mode.log"
    python3 - "$OUT/metrics-$mode.jsonl" "$hwm" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "loss" in r]
evals = [(r["step"], round(r["eval_loss"], 4)) for r in rows if "eval_loss" in r]
if steps:
    tps = [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    print(f"steps {steps[0]['step']}..{steps[-1]['step']}: loss {steps[0]['loss']:.4f} -> "
          f"{steps[-1]['loss']:.4f}; tokens/s median {sorted(tps)[len(tps) // 2]:.0f} "
          f"over the last {len(tps)}" if tps else "no tokens/s")
print("evals", evals)
hwm = int(sys.argv[2] or 0) * 1024
print(f"peak RSS {hwm / 2**30:.2f} GiB = {hwm / 8.03e9:.2f} B/param")
PY
done
echo "== done at ${SECONDS}s"
