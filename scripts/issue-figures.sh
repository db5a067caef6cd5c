#!/usr/bin/env bash
# One device call: the speed figures of issue 23 (the exact offload against the `gpu` mode, and
# llama-1b against DeepSpeed's offload) or of issue 22 (llama-3b with activation checkpointing
# against DeepSpeed's offload), each with the binary's default device share and with the whole
# optimizer in host memory (`--device-share 0`), the way the ninth session measured them
# (BENCHMARKS.md, "The device share `fit` by default on one GPU"), and then once more at share 0
# with 16-bit moments (`--state-dtype bf16`, which keeps the whole optimizer in host memory: 20
# bytes per parameter of the CPU AdamW's traffic instead of 28, not the fp32 step's numerics), and
# at share 0 with fp32 moments and the speculative step on (`--speculation-budget-mib 16384`, off
# by default: the CPU steps pieces under the backward, the issue's own mechanism) without the clip
# (`bench step` clips at 1.0 by default, which fires on every step of a model at its initial
# weights: the speculation is then redone or paused).
#
#   here:  bash scripts/gpu-check.sh; bench/peers/fetch-wheels.sh
#   there: bash scripts/issue-figures.sh 23     carry: [".gpu", ".peers"]   (about 5 minutes)
#          bash scripts/issue-figures.sh 22     (about 3.5 minutes)
#
# Every `bench step` row goes to $OUT/bench.jsonl (tagged with its name) and a BENCH line;
# DeepSpeed's rows to $OUT/ds/bench.jsonl. Each part is bounded by its own timeout.
set -uo pipefail
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
issue=${1:?which issue: 22 or 23}
base=(VAR=ZEROFLOW_DEVICE_SHARE 'VALUES=default 0' PARTS=speed ROUNDS=1)
# The 16-bit moments' offload row beside them (no `gpu` row again: the one above is the ratio's).
bf16=(VAR=ZEROFLOW_DEVICE_SHARE VALUES=0 PARTS=speed ROUNDS=1 GPU_ROW=0 TAG=-bf16
    'OFFLOAD_ARGS=--state-dtype bf16')
spec=(VAR=ZEROFLOW_DEVICE_SHARE VALUES=0 PARTS=speed ROUNDS=1 GPU_ROW=0 TAG=-spec-noclip
    'OFFLOAD_ARGS=--speculation-budget-mib 16384 --gradient-clipping 0')
ds() { # ds MODEL [ENV...]: DeepSpeed's offload on MODEL at 4 × 2048
    local model=$1
    shift
    env "$@" MICRO_BATCH=4 SEQ=2048 PARTS=deepspeed DS_MODES=offload STEPS=6 WARMUP=3 \
        OUT="$OUT/ds" bash scripts/bench-vs-deepspeed.sh "$model" 2>&1 | tail -n 4
}
# rows ENV...: scripts/setting-ab.sh's speed rows with fp32 moments, then with 16-bit ones, then
# fp32 at share 0 speculating.
rows() {
    local setting
    for setting in base bf16 spec; do
        declare -n args=$setting
        env "${args[@]}" "$@" bash scripts/setting-ab.sh | grep BENCH
    done
}
# The host first: the share-0 rows' CPU AdamW depends on its CPU, cores, memory and SIMD level
# (every row's "host" says the same).
"$Z" env | grep -E '^(host|cores|memory|simd) '
case $issue in
23)
    echo "## gpt-1.3b, 8 × 1024, accumulation 1, at ${SECONDS}s"
    rows STEPS=6 WARMUP=3 SPEED_MODELS=gpt-1.3b
    echo "## gpt-1.3b, 8 × 1024, accumulation 4, at ${SECONDS}s"
    rows ACCUM=4 STEPS=4 WARMUP=2 SPEED_MODELS=gpt-1.3b
    echo "## llama-1b, 4 × 2048, accumulation 1, at ${SECONDS}s"
    rows STEPS=6 WARMUP=3 SPEED_MODELS=llama-1b
    echo "## DeepSpeed offload, llama-1b, at ${SECONDS}s"
    ds llama-1b
    ;;
22)
    for share in default 0 0-bf16 0-spec; do
        echo "## llama-3b, 4 × 2048, checkpointing, device share $share, at ${SECONDS}s"
        setting=()
        [[ $share == default ]] || setting=(ZEROFLOW_DEVICE_SHARE="${share%%-*}")
        [[ $share == *-bf16 ]] && setting+=("ZF_ARGS=--state-dtype bf16")
        [[ $share == *-spec ]] && setting+=("ZF_ARGS=--speculation-budget-mib 16384 --gradient-clipping 0")
        env "${setting[@]}" MICRO_BATCH=4 SEQ=2048 CHECKPOINTING=1 STEPS=6 WARMUP=3 MODES=offload \
            PARTS=zeroflow OUT="$OUT/zf-$share" bash scripts/bench-vs-deepspeed.sh \
            llama-3b 2>&1 | tail -n 4
    done
    echo "## DeepSpeed offload, llama-3b, checkpointing, at ${SECONDS}s"
    ds llama-3b CHECKPOINTING=1
    ;;
*)
    echo "issue-figures: 22 or 23, not $issue" >&2
    exit 2
    ;;
esac
echo "## done at ${SECONDS}s"
