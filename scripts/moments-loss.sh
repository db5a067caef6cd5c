#!/usr/bin/env bash
# One device call (issue 22): the loss cost of 16-bit Adam moments in continued training. gpt2-124m
# is first trained BASE_STEPS steps (fp32 moments, offload) on real text and exported as a Hugging
# Face directory; from those weights two runs continue STEPS steps each, identical but for
# `zeroflow.optimizer_state_dtype` (fp32, then bf16), with held-out evaluations every EVAL_EVERY
# steps. Printed last: both runs' final eval loss and their ratio, and plot-loss.py's table; the
# curves go to $OUT/moments-loss.svg and each run's metrics.jsonl to $OUT.
#
# The text is the machine's Python standard library, GPT-2 BPE tokens, the last 300 files held out
# (scripts/python-corpus.sh).
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/moments-loss.sh   carry: [".gpu"]
# Environment: BASE_STEPS (200), STEPS (300), EVAL_EVERY (50), MICRO_BATCH (16), SEQ (1024).
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
BASE_STEPS=${BASE_STEPS:-200}
STEPS=${STEPS:-300}
EVAL_EVERY=${EVAL_EVERY:-50}
MICRO_BATCH=${MICRO_BATCH:-16}
SEQ=${SEQ:-1024}
WORK=${WORK:-/tmp/moments-loss}
rm -rf "$WORK" && mkdir -p "$WORK/text"

ZEROFLOW=$Z OUT=$OUT bash scripts/python-corpus.sh "$WORK" || exit 1

# The offload config with the moments' dtype set.
config() { # config DTYPE
    python3 - "$1" "$WORK/offload-$1.json" <<'PY'
import json, sys
config = json.load(open("examples/configs/zero2-offload-bf16.json"))
config.setdefault("zeroflow", {})["optimizer_state_dtype"] = sys.argv[1]
json.dump(config, open(sys.argv[2], "w"), indent=1)
PY
    echo "$WORK/offload-$1.json"
}
common=(--device cuda --micro-batch "$MICRO_BATCH" --seq "$SEQ" --data "$WORK/train"
    --eval-data "$WORK/eval" --eval-tokens 262144 --eval-every "$EVAL_EVERY" --log-every 10)

echo "== base: gpt2-124m, $BASE_STEPS steps, fp32 moments (at ${SECONDS}s)"
"$Z" train --model gpt2-124m --config "$(config fp32)" "${common[@]}" --steps "$BASE_STEPS" \
    --lr 6e-4 --save-every "$BASE_STEPS" --out "$WORK/base" >"$OUT/base.log" 2>&1 ||
    { echo "base run failed:"; tail -5 "$OUT/base.log"; exit 1; }
checkpoint=$(ls -d "$WORK"/base/checkpoints/step-* | tail -1)
"$Z" export "$checkpoint" --out "$WORK/base-hf" >"$OUT/export.log" 2>&1 ||
    { echo "export failed:"; tail -5 "$OUT/export.log"; exit 1; }
tail -2 "$OUT/base.log"

for dtype in fp32 bf16; do
    echo "== continued: $STEPS steps from the base weights, $dtype moments (at ${SECONDS}s)"
    "$Z" train --init-from "$WORK/base-hf" --config "$(config $dtype)" "${common[@]}" \
        --steps "$STEPS" --lr 3e-4 --save-every 0 --out "$WORK/$dtype" >"$OUT/$dtype.log" 2>&1 ||
        { echo "$dtype run failed:"; tail -5 "$OUT/$dtype.log"; }
    grep -iE "moments|host|warn" "$OUT/$dtype.log" | head -5
    tail -2 "$OUT/$dtype.log"
    cp "$WORK/$dtype/metrics.jsonl" "$OUT/metrics-$dtype.jsonl" 2>/dev/null
done

python3 scripts/plot-loss.py fp32="$OUT/metrics-fp32.jsonl" bf16="$OUT/metrics-bf16.jsonl" \
    --svg "$OUT/moments-loss.svg" --smooth 10 --baseline fp32 \
    --title "gpt2-124m continued from $BASE_STEPS steps: fp32 vs bf16 Adam moments"
echo "== done at ${SECONDS}s"
