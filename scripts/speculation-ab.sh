#!/usr/bin/env bash
# The exact offload step's speculation, on and off, with the whole optimizer in host memory
# (ZEROFLOW_DEVICE_SHARE=0 unless set: what the CPU must step is the whole partition), through
# scripts/setting-ab.sh with VAR=ZEROFLOW_SPECULATION_BUDGET_MIB VALUES="0 $BUDGET_MIB":
#
#   exact   gpt2-124m and llama-1b, 12 steps of exact offload without clipping (every speculated
#           step stands), losses and the final checkpoints bit for bit, off against on
#   speed   gpt-1.3b (8 × 1024) and llama-1b (4 × 2048): `gpu`, then offload off and on, twice
#           interleaved, with no clip (`--gradient-clipping 0`: the steps a speculation can hide,
#           a fine-tune's common case), then once each with clipping at 1.0 (from random weights
#           the clip fires on every step: the cost of a speculation that does not stand)
#   llama-3b  the same at 4 × 2048 with activation checkpointing, no `gpu` row
#   buckets   gpt-1.3b and llama-1b without clipping at each reduce bucket size of BUCKETS
#             (elements; default DeepSpeed's 5e8, 5e7, and 4194304: an "auto" size at d 2048),
#             off and on: the smaller the bucket, the earlier in the backward its pieces reach
#             the host to be stepped under it; with BEFORE (a binary's path), that binary's
#             speculating rows beside each size's
#   interleaved  BEFORE's (a binary's path) speculating rows and this tree's, no clip, model by
#             model (SPEED_MODELS), two rounds in opposite orders: a change's A/B where the
#             host's speed drifts between runs
#   llama-8b  4 × 2048 with activation checkpointing at the default device share (`fit`: on an
#             H100 0.25 of the optimizer on the GPU, the rest stepped by the CPU), off and on,
#             no clip and clip 1.0, STEPS timed steps (default 15): whether the speculation
#             should be on where a model's optimizer does not fit the GPU
#   clip-long gpt-1.3b (8 × 1024) with the clip at 1.0, off and on, STEPS timed steps (default
#             40): what a speculation that is redone and then sits out (1, 2, 4, … steps) costs
#             over a longer run than `speed`'s
#   accum     SPEED_MODELS (default gpt-1.3b) at accumulation ACCUM (default 4) summed on the
#             device (the `Summed` path, its step opened by the next window's forward), off and
#             on, no clip, two rounds interleaved, the `gpu` row first; with
#             ZEROFLOW_DEVICE_SHARE=fit (set before the part) a share beside the speculation
#
#   here:  bash scripts/gpu-check.sh
#   there: bash scripts/speculation-ab.sh PART     carry: [".gpu"]   (exact about 5 minutes,
#          speed about 7, llama-3b about 4, buckets about 5, interleaved about 3, llama-8b about
#          6 on an H100, clip-long about 2, accum about 3 for gpt-1.3b)
set -uo pipefail
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
part=${1:?which part: exact, speed, llama-3b, buckets, interleaved, llama-8b, clip-long or accum}
export ZEROFLOW_DEVICE_SHARE=${ZEROFLOW_DEVICE_SHARE:-0}
common=(VAR=ZEROFLOW_SPECULATION_BUDGET_MIB "VALUES=0 ${BUDGET_MIB:-16384}")
# The speculating value alone (a binary's rows against another's).
speculating=(VAR=ZEROFLOW_SPECULATION_BUDGET_MIB "VALUES=${BUDGET_MIB:-16384}")
case $part in
exact)
    config=$OUT/zero2-offload-bf16-noclip.json
    python3 - "$config" <<'PY'
import json, sys
config = json.load(open("examples/configs/zero2-offload-bf16.json"))
config["gradient_clipping"] = 0.0
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY
    env "${common[@]}" CONFIG="$config" PARTS=exact bash scripts/setting-ab.sh | grep -E "EXACT|FAILED|differ"
    ;;
speed)
    env "${common[@]}" PARTS=speed ROUNDS=2 SPEED_MODELS="gpt-1.3b llama-1b" \
        OFFLOAD_ARGS="--gradient-clipping 0" TAG=-noclip bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    env "${common[@]}" PARTS=speed ROUNDS=1 GPU_ROW=0 SPEED_MODELS="gpt-1.3b llama-1b" \
        OFFLOAD_ARGS="--gradient-clipping 1" TAG=-clip1 bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    ;;
llama-3b)
    for clip in 0 1; do
        env "${common[@]}" PARTS=speed ROUNDS=1 GPU_ROW=0 SPEED_MODELS=llama-3b STEPS=6 WARMUP=3 \
            OFFLOAD_ARGS="--activation-checkpointing --gradient-clipping $clip" TAG=-clip$clip \
            bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    done
    ;;
buckets)
    gpu_row=1
    for bucket in ${BUCKETS:-500000000 50000000 4194304}; do
        env "${common[@]}" PARTS=speed ROUNDS=1 GPU_ROW=$gpu_row SPEED_MODELS="${SPEED_MODELS:-gpt-1.3b llama-1b}" \
            OFFLOAD_ARGS="--gradient-clipping 0 --reduce-bucket-size $bucket" TAG=-noclip-b$bucket \
            bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
        # BEFORE: another binary's speculating rows beside them (a change A/B).
        [[ -z ${BEFORE:-} ]] || env "${speculating[@]}" ZEROFLOW="$BEFORE" \
            PARTS=speed ROUNDS=1 GPU_ROW=0 SPEED_MODELS="${SPEED_MODELS:-gpt-1.3b llama-1b}" \
            OFFLOAD_ARGS="--gradient-clipping 0 --reduce-bucket-size $bucket" \
            TAG=-noclip-b$bucket-before bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
        gpu_row=0
    done
    ;;
llama-8b)
    for clip in 0 1; do
        env "${common[@]}" ZEROFLOW_DEVICE_SHARE=fit PARTS=speed ROUNDS=1 GPU_ROW=0 \
            SPEED_MODELS=llama-8b STEPS="${STEPS:-15}" WARMUP=3 TAG=-fit-clip$clip \
            OFFLOAD_ARGS="--activation-checkpointing --gradient-clipping $clip" \
            bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    done
    ;;
clip-long)
    env "${common[@]}" PARTS=speed ROUNDS=1 GPU_ROW=0 SPEED_MODELS=gpt-1.3b STEPS="${STEPS:-40}" \
        WARMUP=3 OFFLOAD_ARGS="--gradient-clipping 1" TAG=-clip1-long \
        bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    ;;
accum)
    env "${common[@]}" PARTS=speed ROUNDS=2 GPU_ROW=1 SPEED_MODELS="${SPEED_MODELS:-gpt-1.3b}" \
        ACCUM="${ACCUM:-4}" STEPS="${STEPS:-5}" WARMUP=2 OFFLOAD_ARGS="--gradient-clipping 0" \
        TAG=-accum-noclip bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
    ;;
interleaved)
    before=${BEFORE:?name the binary to compare with: BEFORE=<path>}
    for round in 1 2; do
        for model in ${SPEED_MODELS:-gpt-1.3b llama-1b}; do
            order=(before after)
            ((round == 2)) && order=(after before)
            for which in "${order[@]}"; do
                binary=$before
                [[ $which == after ]] && binary=$PWD/.gpu/zeroflow
                env "${speculating[@]}" ZEROFLOW="$binary" PARTS=speed \
                    ROUNDS=1 GPU_ROW=0 SPEED_MODELS="$model" OFFLOAD_ARGS="--gradient-clipping 0" \
                    TAG=-$which-r$round bash scripts/setting-ab.sh | grep -E "BENCH|FAILED"
            done
        done
    done
    ;;
*) echo "speculation-ab: no part $part (exact, speed, llama-3b, buckets, interleaved, llama-8b, clip-long, accum)" >&2; exit 2 ;;
esac
