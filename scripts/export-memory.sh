#!/usr/bin/env bash
# One device call: the host memory and time of `zeroflow export` of a large checkpoint. zeroflow
# trains llama-1b for one step on the GPU (exact offload, the default device share, micro-batch 4
# x 2048 of synthetic tokens), which saves its checkpoint (bf16 weights, 2.5 GB of them); then
# each binary (.gpu/before/zeroflow, where there is one, and this one) exports it as a Hugging
# Face directory, its peak RSS (VmHWM) and seconds printed, and the two directories compared byte
# for byte.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/export-memory.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
source scripts/rss-watch.sh
WORK=${WORK:-/tmp/export-memory}
rm -rf "$WORK" && mkdir -p "$WORK"
$Z train --device cuda --model llama-1b --config examples/configs/zero2-offload-bf16.json \
    --micro-batch 4 --seq 2048 --data synthetic --eval-every 0 --steps 1 --out "$WORK/run" \
    >"$OUT/export-memory-train.log" 2>&1 || tail -5 "$OUT/export-memory-train.log"
grep -E "saved" "$OUT/export-memory-train.log" | cut -c1-200
checkpoint=$(ls -d "$WORK"/run/checkpoints/step-* | tail -1)
du -sh "$checkpoint"
for bin in .gpu/before/zeroflow "$Z"; do
    [[ -x $bin ]] || continue
    name=$(basename "$(dirname "$bin")")
    sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
    started=$(date +%s.%N)
    "$bin" export "$checkpoint" --out "$WORK/hf-$name" >"$OUT/export-$name.log" 2>&1 &
    hwm=$(watch_rss $! /dev/null "")
    echo "export with $bin: peak RSS $(python3 -c "print(f'{$hwm / 2**20:.2f}')") GiB," \
        "$(python3 -c "print(f'{$(date +%s.%N) - $started:.1f}')") s"
    cut -c1-200 "$OUT/export-$name.log"
done
if [[ -d $WORK/hf-before ]]; then
    diff -r "$WORK/hf-before" "$WORK/hf-.gpu" >/dev/null && echo "the same files, byte for byte" \
        || { echo "the directories differ:"; diff -rq "$WORK/hf-before" "$WORK/hf-.gpu"; }
fi
rm -rf "$WORK"
echo "== done at ${SECONDS}s"
