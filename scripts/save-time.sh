#!/usr/bin/env bash
# One device call: how long a checkpoint's save takes, binary A (default .gpu/before/zeroflow)
# against B (the staged one), ROUNDS (default 2) times each, alternating. Each run trains MODEL
# (default llama-1b) for STEPS (default 1) steps of exact offload on synthetic data
# (`examples/configs/zero2-offload-bf16.json`, micro-batch 4 x 2048) and saves at its end; per run:
# the save's time (the run's own log line), the checkpoint's bytes, the page cache's size and dirty
# bytes after the run (/proc/meminfo, the cache dropped before each run where allowed), and in
# the first round the SHA-256 of every file but state.json (which records timings). Last (unless
# RESUME=0), B resumes its last checkpoint for one step (stopped once it is recorded), the page
# cache dropped first: the time to that step and its loss; then the disk's cold read rate over the
# optimizer file, buffered and O_DIRECT (dd).
#
# Here: bash scripts/gpu-check.sh, and the binary to compare with at .gpu/before/zeroflow.
# There: bash scripts/save-time.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
A=${A:-$PWD/.gpu/before/zeroflow}
B=${B:-$Z}
MODEL=${MODEL:-llama-1b}
STEPS=${STEPS:-1}
ROUNDS=${ROUNDS:-2}
WORK=${WORK:-/tmp/save-time}
rm -rf "$WORK" && mkdir -p "$WORK"
df -h /tmp | tail -1
common=(--device cuda --config examples/configs/zero2-offload-bf16.json --micro-batch 4 --seq 2048
    --data synthetic --eval-every 0 --log-every 1 --model "$MODEL")
meminfo() { awk '/^(Cached|Dirty|Writeback):/ { printf "%s %.2f GiB  ", $1, $2 / 2^20 }' /proc/meminfo; }

for round in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        bin=${!side}
        run=$WORK/$side-$round
        sync
        echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
        "$bin" train "${common[@]}" --steps "$STEPS" --out "$run" >"$OUT/$side-$round.log" 2>&1 ||
            tail -5 "$OUT/$side-$round.log"
        ckpt=$(printf '%s/checkpoints/step-%08d' "$run" "$STEPS")
        echo "round $round $side: $(grep -ho "saved .* in .* s" "$OUT/$side-$round.log" | sed 's|saved [^ ]* ||');" \
            "$(du -sb "$ckpt" | cut -f1) B; after the run: $(meminfo)"
        if ((round == 1)); then
            (cd "$ckpt" && sha256sum model.safetensors optim/*.safetensors) >"$OUT/$side-sha256.txt"
        fi
        ((round == ROUNDS)) && [[ $side == B ]] || rm -rf "$run"
    done
done
cmp -s "$OUT/A-sha256.txt" "$OUT/B-sha256.txt" && echo "A's and B's checkpoint files: identical" ||
    { echo "A's and B's checkpoint files DIFFER"; cat "$OUT/A-sha256.txt" "$OUT/B-sha256.txt"; }

if [[ ${RESUME:-1} == 0 ]]; then
    rm -rf "$WORK"
    exit 0
fi
run=$WORK/B-$ROUNDS
ckpt=$(printf '%s/checkpoints/step-%08d' "$run" "$STEPS")
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
started=$(date +%s.%N)
"$B" train "${common[@]}" --resume "$ckpt" --steps $((STEPS + 2)) --extend-schedule \
    >"$OUT/resumed.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
    grep -q "\"step\":$((STEPS + 1))," "$run/metrics.jsonl" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    sleep 0.2
done
wait "$pid" 2>/dev/null
echo "B resumed (cache dropped first): step $((STEPS + 1)) recorded after" \
    "$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s; $(meminfo)"
grep -h "restored\|read " "$OUT/resumed.log" | cut -c1-300
echo "B resumed: $(grep -h '"loss"' "$run/metrics.jsonl" | cut -c1-100 | tr '\n' ' ')"
# The disk's read rate over the optimizer file, cold, buffered and direct.
for flag in "" iflag=direct; do
    sync
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
    echo "read of $(basename "$ckpt")/optim/rank-0.safetensors ${flag:-buffered}:" \
        "$(dd if="$ckpt/optim/rank-0.safetensors" of=/dev/null bs=64M $flag 2>&1 | tail -1)"
done
[[ ${KEEP:-0} == 1 ]] || rm -rf "$WORK"
echo "== done at ${SECONDS}s"
