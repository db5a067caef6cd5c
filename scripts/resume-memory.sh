#!/usr/bin/env bash
# One device call: the host memory of a resumed run against its plan and against the run it
# continues. MODEL (default llama-1b) trains STEPS (default 2) steps of exact offload on synthetic
# data (`examples/configs/zero2-offload-bf16.json`, micro-batch 4 x 2048) and saves its final
# checkpoint; a second process resumes it (`--resume DIR --steps STEPS+2 --extend-schedule`) and is
# stopped once its first step is recorded (a resume's peak is its set-up: reading the checkpoint
# and restoring the engine; stopping spares the disk a second checkpoint). Reported per process:
# the plan's host lines, the peak RSS (VmHWM, sampled every 0.2 s) and the losses; then the
# checkpoint is exported (`zeroflow export`) with its peak RSS, and a run starts from the export
# (`--init-from`, its BF16 weights read into the run's bf16), stopped once its first step is
# recorded.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/resume-memory.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
MODEL=${MODEL:-llama-1b}
STEPS=${STEPS:-2}
WORK=${WORK:-/tmp/resume-memory}
rm -rf "$WORK" && mkdir -p "$WORK"
df -h /tmp | tail -1
free -g | head -2
common=(--device cuda --config examples/configs/zero2-offload-bf16.json --micro-batch 4 --seq 2048
    --data synthetic --eval-every 0 --log-every 1)

source scripts/rss-watch.sh

echo "== $MODEL: $STEPS steps, saved at the end (at ${SECONDS}s)"
$Z train "${common[@]}" --model "$MODEL" --steps "$STEPS" --out "$WORK/run" >"$OUT/first.log" 2>&1 &
hwm=$(watch_rss $! "$WORK/run/metrics.jsonl" "")
report first "$OUT/first.log" "$hwm"
tail -3 "$OUT/first.log"
ckpt=$(ls -d "$WORK"/run/checkpoints/step-* | tail -1)
du -sh "$ckpt"
cp "$WORK/run/metrics.jsonl" "$OUT/first-metrics.jsonl"

echo "== resumed from $ckpt (at ${SECONDS}s)"
next=$((STEPS + 1))
$Z plan "${common[@]}" --resume "$ckpt" --steps $((STEPS + 2)) --extend-schedule 2>&1 | grep -iE "checkpoint|total|peak|fits" | cut -c1-200
$Z train "${common[@]}" --resume "$ckpt" --steps $((STEPS + 2)) --extend-schedule \
    >"$OUT/resumed.log" 2>&1 &
hwm=$(watch_rss $! "$WORK/run/metrics.jsonl" "\"step\":$next,")
report resumed "$OUT/resumed.log" "$hwm"
cp "$WORK/run/metrics.jsonl" "$OUT/resumed-metrics.jsonl"
grep -h '"loss"' "$WORK/run/metrics.jsonl" | cut -c1-160

echo "== exported as a Hugging Face directory (at ${SECONDS}s)"
$Z export "$ckpt" --out "$WORK/hf" >"$OUT/export.log" 2>&1 &
hwm=$(watch_rss $! /dev/null "")
report export "$OUT/export.log" "$hwm"
tail -1 "$OUT/export.log"
du -sh "$WORK/hf"

echo "== started from the export (--init-from, at ${SECONDS}s)"
$Z train "${common[@]}" --init-from "$WORK/hf" --steps 2 --out "$WORK/init" >"$OUT/init-from.log" 2>&1 &
hwm=$(watch_rss $! "$WORK/init/metrics.jsonl" '"step":1,')
report init-from "$OUT/init-from.log" "$hwm"
grep -h '"loss"' "$WORK/init/metrics.jsonl" | cut -c1-160
# KEEP=1 leaves the run and the checkpoint in $WORK (for another binary to read them).
[[ ${KEEP:-0} == 1 ]] || rm -rf "$WORK"
echo "== done at ${SECONDS}s"
