#!/usr/bin/env bash
# Runs on the GPU machine: ZenFlow's loss against full AdamW on a real corpus (issue "ZenFlow",
# acceptance 3), `gpt2-124m`, bf16, ZeRO-2, one call:
#
#   pretrain   AdamW on the GPU (examples/configs/zero2-bf16.json), PRE_STEPS steps at --lr 6e-4 on
#              the first half of the training files;
#   continued  from that run's last checkpoint, FT_STEPS steps at --lr 3e-4 on the second half (text
#              the model has not seen: the loader reads from the start), once with full AdamW
#              (examples/configs/zero2-offload-bf16.json) and once with ZenFlow
#              (examples/configs/zero2-zenflow-bf16.json: topk 0.05, update_interval 4, overlap);
#              the two configs differ only in their `zenflow` section;
#   scratch    (SCRATCH=1) the same pair from random weights, SCRATCH_STEPS steps at --lr 6e-4.
#
# A pair runs side by side, one run per GPU, where the machine has two (each is deterministic:
# timing changes nothing in it), else one after the other. The corpus is the machine's Python
# sources as bytes, sorted by path: the last 300 files held out for evaluation (zz-eval.txt:
# `--eval-data`, its first 131,073 bytes: the 16 micro-batches of 8 × 1024 of earlier runs), the
# rest split into two halves by file,
# a/train.txt for pretraining and b/train.txt for the continued runs (and the scratch pair), each
# folder with the same zz-eval.txt. Each run's metrics.jsonl, summary.json and log land in
# $OUT/accuracy-<run>.*; the overlay plots and the final table come from scripts/plot-loss.py, and
# the table of every evaluation point is printed last.
#
#   here:  bash scripts/gpu-check.sh                  (stages .gpu/zeroflow)
#   there: bash scripts/zenflow-accuracy.sh           carry: [".gpu"]   (~3 minutes on one H200)
#
# Environment: PRE_STEPS (300), FT_STEPS (300), SCRATCH=1, SCRATCH_STEPS (400), MICRO_BATCH (8),
# EVAL_EVERY (50), RUN_TIMEOUT (150 s per run); MODEL (gpt2-124m) and DEVICE (cuda) for a trial of
# the script itself on the CPU with a small model.
set -uo pipefail
cd "$(dirname "$0")/.."

PRE_STEPS=${PRE_STEPS:-300}
FT_STEPS=${FT_STEPS:-300}
SCRATCH_STEPS=${SCRATCH_STEPS:-400}
MICRO_BATCH=${MICRO_BATCH:-8}
EVAL_EVERY=${EVAL_EVERY:-50}
MODEL=${MODEL:-gpt2-124m}
DEVICE=${DEVICE:-cuda}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
OUT=${OUT:-$PWD/.gpu/out}
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
Z=${ZEROFLOW:-.gpu/zeroflow}
WORK=${WORK:-/tmp/zenflow-accuracy}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
started=$SECONDS
rm -rf "$WORK" && mkdir -p "$WORK/a" "$WORK/b"

# The corpus.
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort >"$WORK/files.txt"
files=$(wc -l <"$WORK/files.txt")
if ((files < 600)); then
    echo "zenflow-accuracy: only $files Python files under /usr/lib/python3*: too small a corpus" >&2
    exit 1
fi
half=$(((files - 300) / 2))
head -n "$half" "$WORK/files.txt" | xargs cat >"$WORK/a/train.txt" 2>/dev/null
head -n $((files - 300)) "$WORK/files.txt" | tail -n +$((half + 1)) | xargs cat >"$WORK/b/train.txt" 2>/dev/null
tail -n 300 "$WORK/files.txt" | xargs cat >"$WORK/a/zz-eval.txt" 2>/dev/null
cp "$WORK/a/zz-eval.txt" "$WORK/b/zz-eval.txt"
echo "corpus: $files files; pretraining $(stat -c %s "$WORK/a/train.txt") bytes, continued" \
    "$(stat -c %s "$WORK/b/train.txt") bytes, held out $(stat -c %s "$WORK/a/zz-eval.txt") bytes;" \
    "$GPUS GPUs"

COMMON=(--device "$DEVICE" --model "$MODEL" --micro-batch "$MICRO_BATCH" --eval-every "$EVAL_EVERY"
    --save-every 0 --log-every 100 --eval-tokens 131073)

# train NAME GPU ARGS...: one run on GPU (its output under $WORK/NAME, its files copied to $OUT).
train() {
    local name=$1 gpu=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout "$RUN_TIMEOUT" "$Z" train "${COMMON[@]}" --out "$WORK/$name" \
        "$@" >"$OUT/accuracy-$name.log" 2>&1
    local status=$?
    cp "$WORK/$name/metrics.jsonl" "$OUT/accuracy-$name-metrics.jsonl" 2>/dev/null
    cp "$WORK/$name/summary.json" "$OUT/accuracy-$name-summary.json" 2>/dev/null
    echo "$name: exit $status ($((SECONDS - started)) s); $(tail -1 "$OUT/accuracy-$name.log" | cut -c1-200)"
}

# pair TAG ARGS...: full AdamW and ZenFlow with the same arguments, side by side on two GPUs.
pair() {
    local tag=$1
    shift
    if ((GPUS >= 2)); then
        train "$tag-adamw" 0 --config examples/configs/zero2-offload-bf16.json "$@" &
        train "$tag-zenflow" 1 --config examples/configs/zero2-zenflow-bf16.json "$@"
        wait
    else
        train "$tag-adamw" 0 --config examples/configs/zero2-offload-bf16.json "$@"
        train "$tag-zenflow" 0 --config examples/configs/zero2-zenflow-bf16.json "$@"
    fi
    python3 scripts/plot-loss.py "AdamW=$OUT/accuracy-$tag-adamw-metrics.jsonl" \
        "ZenFlow=$OUT/accuracy-$tag-zenflow-metrics.jsonl" --svg "$OUT/accuracy-$tag-loss.svg" \
        --title "gpt2-124m, $tag: full AdamW vs ZenFlow (topk 0.05, update interval 4, overlap)" \
        | tee "$OUT/accuracy-$tag-table.md"
    # Every evaluation point, not only the last.
    python3 - "$OUT/accuracy-$tag-adamw-metrics.jsonl" "$OUT/accuracy-$tag-zenflow-metrics.jsonl" <<'PY' | tee -a "$OUT/accuracy-$tag-table.md"
import json, sys
def evals(path):
    try:
        lines = [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        return {}
    return {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}
adamw, zenflow = (evals(p) for p in sys.argv[1:])
print("\n| step | AdamW eval loss | ZenFlow eval loss | ZenFlow ÷ AdamW |\n|---:|---:|---:|---:|")
for step in sorted(set(adamw) & set(zenflow)):
    print(f"| {step} | {adamw[step]:.4f} | {zenflow[step]:.4f} | {zenflow[step] / adamw[step]:.3f} |")
PY
}

train pretrain 0 --data "$WORK/a/train.txt" --eval-data "$WORK/a/zz-eval.txt" --config examples/configs/zero2-bf16.json --lr 6e-4 \
    --steps "$PRE_STEPS"
checkpoint=$(ls -d "$WORK"/pretrain/checkpoints/step-* 2>/dev/null | tail -1)
if [[ -n "$checkpoint" ]]; then
    pair continued --data "$WORK/b/train.txt" --eval-data "$WORK/b/zz-eval.txt" --lr 3e-4 --steps "$FT_STEPS" --init-from "$checkpoint"
else
    echo "pretrain left no checkpoint: no continued pair" >&2
fi
if [[ -n "${SCRATCH:-}" ]]; then
    pair scratch --data "$WORK/b/train.txt" --eval-data "$WORK/b/zz-eval.txt" --lr 6e-4 --steps "$SCRATCH_STEPS"
fi
echo "total $((SECONDS - started)) s"
