#!/usr/bin/env bash
# One device call: how long a resume takes to read its checkpoint, binary A (default
# .gpu/before/zeroflow) against B (the staged one). B trains MODEL (default llama-3b) for one step
# of exact offload on synthetic data (`examples/configs/zero2-offload-bf16.json`, micro-batch
# 4 x 2048) and saves; then, ROUNDS (default 2) times, A and B each resume that checkpoint with the
# page cache dropped first, and are stopped once their first step is recorded. Per resume: the
# seconds from the start to that step (the process's start, the plan, the weights, the model, the
# optimizer state and the step), the times the binary logs for its reads (B's "read the
# checkpoint's weights" and "restored the checkpoint's optimizer state", and at the engine's debug
# level, on by default here, each array's read and the device share's upload), its loss and
# gradient norm, its peak RSS and the page cache after it.
#
# Here: bash scripts/gpu-check.sh, and the binary to compare with at .gpu/before/zeroflow.
# There: bash scripts/resume-time.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
A=${A:-$PWD/.gpu/before/zeroflow}
B=${B:-$Z}
MODEL=${MODEL:-llama-3b}
ROUNDS=${ROUNDS:-2}
WORK=${WORK:-/tmp/resume-time}
rm -rf "$WORK" && mkdir -p "$WORK"
df -h /tmp | tail -1
common=(--device cuda --config examples/configs/zero2-offload-bf16.json --micro-batch 4 --seq 2048
    --data synthetic --eval-every 0 --log-every 1 --model "$MODEL")
meminfo() { awk '/^(Cached):/ { printf "%s %.2f GiB", $1, $2 / 2^20 }' /proc/meminfo; }

run=$WORK/run
"$B" train "${common[@]}" --steps 1 --out "$run" >"$OUT/$MODEL-train.log" 2>&1 ||
    tail -5 "$OUT/$MODEL-train.log"
ckpt=$run/checkpoints/step-00000001
echo "$MODEL: checkpoint $(du -sb "$ckpt" | cut -f1) B, $(grep -ho "saved .* in .* s" \
    "$OUT/$MODEL-train.log" | sed 's|saved [^ ]* ||')"

for round in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        bin=${!side}
        log=$OUT/$MODEL-resume-$side-$round.log
        : >"$run/metrics.jsonl"
        sync
        echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
        started=$(date +%s.%N)
        ZEROFLOW_LOG=${ZEROFLOW_LOG:-info,zeroflow_engine=debug} \
            "$bin" train "${common[@]}" --resume "$ckpt" --steps 3 --extend-schedule >"$log" 2>&1 &
        pid=$!
        peak=0
        while kill -0 "$pid" 2>/dev/null; do
            hwm=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
            ((${hwm:-0} > peak)) && peak=$hwm
            grep -q '"step":2,' "$run/metrics.jsonl" 2>/dev/null && kill -9 "$pid" 2>/dev/null
            sleep 0.2
        done
        wait "$pid" 2>/dev/null
        took=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        reads=$(grep -ho "read the checkpoint's weights .*\|restored the checkpoint's .*\|restore: .*" \
            "$log" | tr '\n' ';')
        step=$(grep -h '"step":2,' "$run/metrics.jsonl" | grep -o '"loss":[^,]*,"lr":[^,]*,"grad_norm":[^,]*')
        echo "round $round $side: step 2 after $took s; peak RSS $((peak / 1024)) MiB; $(meminfo);" \
            "${reads:-(no read times logged)} $step"
    done
done
rm -rf "$WORK"
echo "== done at ${SECONDS}s"
