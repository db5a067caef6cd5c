#!/usr/bin/env bash
# One device call: the optimizer's device share staged from host memory
# (`--device-share-state host`, DESIGN.md §5) against the whole optimizer stepped by the CPU
# (share 0) and the `gpu` mode, with the binary scripts/gpu-check.sh staged.
#
#   here:  bash scripts/gpu-check.sh; bench/peers/fetch-wheels.sh (part B only)
#   there: PART=A bash scripts/staged-share.sh     carry: [".gpu"]            (about 6 minutes)
#          PART=B bash scripts/staged-share.sh     carry: [".gpu", ".peers"]  (about 4 minutes)
#
# A: speed (scripts/setting-ab.sh's `bench step` rows: gpt-1.3b 8 × 1024 and llama-1b 4 × 2048,
#    `gpu`, then offload at each of SHARES, staged), without a clip and speculating with 16 GiB
#    (where speculation stands every step); then exactness: gpt2-124m, 12 steps at share 0 and
#    0.4 staged (and 0.4 again), losses and final checkpoints compared bit for bit.
# B: llama-1b 4 × 2048 with the clip at 1.0 as DeepSpeed's ds_train.py clips (it fires at the
#    benchmark's random start, so nothing speculates), at share 0 and each staged share of
#    SHARES, then DeepSpeed's offload on the same shape: the ratio of issue 23.
# Environment: PART (A or B), SHARES ("0 0.3 0.45"; the first is the baseline).
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
PART=${PART:?A or B}
SHARES=${SHARES:-0 0.3 0.45}
export ZEROFLOW_DEVICE_SHARE_STATE=host
case $PART in
A)
    echo "## speed, no clip, speculating, shares $SHARES (state in host memory), at ${SECONDS}s"
    ZEROFLOW_SPECULATION_BUDGET_MIB=16384 VAR=ZEROFLOW_DEVICE_SHARE VALUES="$SHARES" ROUNDS=1 \
        PARTS=speed OFFLOAD_ARGS="--gradient-clipping 0" TAG=-noclip OUT="$OUT/speed" \
        timeout 380 bash scripts/setting-ab.sh | grep -E "^(BENCH|FAILED)|rror"
    echo "## exactness, gpt2-124m, at ${SECONDS}s"
    VAR=ZEROFLOW_DEVICE_SHARE VALUES="0 0.4" PARTS=exact EXACT_MODELS=gpt2-124m \
        OUT="$OUT/exact" timeout 150 bash scripts/setting-ab.sh | grep -E "^(EXACT|FAILED)|rror"
    ;;
B)
    echo "## llama-1b, clip 1.0, no speculation, shares $SHARES, at ${SECONDS}s"
    ZEROFLOW_SPECULATION_BUDGET_MIB=0 VAR=ZEROFLOW_DEVICE_SHARE VALUES="$SHARES" ROUNDS=1 \
        PARTS=speed SPEED_MODELS=llama-1b STEPS=6 WARMUP=3 OUT="$OUT/clip" \
        timeout 200 bash scripts/setting-ab.sh | grep -E "^(BENCH|FAILED)|rror"
    echo "## DeepSpeed offload, llama-1b, at ${SECONDS}s"
    MICRO_BATCH=4 SEQ=2048 PARTS=deepspeed DS_MODES=offload STEPS=6 WARMUP=3 OUT="$OUT/ds" \
        timeout 300 bash scripts/bench-vs-deepspeed.sh llama-1b 2>&1 | tail -n 4
    ;;
*)
    echo "staged-share: PART is A or B, not $PART" >&2
    exit 2
    ;;
esac
echo "## done at ${SECONDS}s"
