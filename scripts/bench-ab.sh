#!/usr/bin/env bash
# Runs on the GPU machine: the same zeroflow benchmarks with two binaries, A and B, interleaved
# (A then B for each mode, ROUNDS times), so that a code change is measured against its parent in
# one device call: `bench step` in every mode and `bench gpt` (forward + backward alone). Prints
# a table of tokens/s (the median over rounds) and B/A last; every result is one JSON line in
# $OUT/ab.jsonl with "binary": "A" or "B".
#
#   here:  cp target/release/zeroflow of the parent into .gpu/before/zeroflow (stripped), then
#          bash scripts/gpu-check.sh                  (stages the change's binary as .gpu/zeroflow)
#   there: bash scripts/bench-ab.sh gpt-1.3b           carry: [".gpu"]
#
# Environment: A (default .gpu/before/zeroflow), B (default .gpu/zeroflow), MODES (default
# "gpu offload offload-delayed zenflow"), FWD_BWD (1: also `bench gpt`; 0: not), STEPS (8), WARMUP (3), MICRO_BATCH (8),
# ACCUM (gradient accumulation of `bench step`, 1), ROUNDS (1),
# OUT (the device tool's folder, else .gpu/out).
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-gpt-1.3b}
A=${A:-.gpu/before/zeroflow}
B=${B:-.gpu/zeroflow}
MODES=${MODES:-gpu offload offload-delayed zenflow}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
MICRO_BATCH=${MICRO_BATCH:-8}
ACCUM=${ACCUM:-1}
ROUNDS=${ROUNDS:-1}
FWD_BWD=${FWD_BWD:-1}
EXTRA=fwd-bwd
((FWD_BWD)) || EXTRA=
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
RESULTS=$OUT/ab.jsonl
: >"$RESULTS"

# record BINARY MODE LOG: appends the run's result to $RESULTS as one JSON line.
record() {
    python3 - "$RESULTS" "$@" <<'PY'
import json, sys
results, binary, mode, log = sys.argv[1:]
row = None
text = open(log, errors="replace").read()
for line in text.splitlines():
    if line.startswith("RESULT gpt_fwd_bwd "):
        fields = dict(pair.split("=", 1) for pair in line.split()[2:])
        row = {"tokens_per_s": float(fields["tokens_per_s"]),
               "s_per_step_median": float(fields["s_per_step"])}
if row is None and "{" in text:
    # bench step --json prints one pretty-printed object.
    row, _ = json.JSONDecoder().raw_decode(text, text.index("{"))
    row.pop("times", None)
    row.pop("losses", None)
if row is None:
    print(f"  no result in {log}")
    sys.exit(1)
row.update(binary=binary, ab_mode=mode)
with open(results, "a") as out:
    out.write(json.dumps(row) + "\n")
print(f"  {binary} {mode}: {row['tokens_per_s']:.0f} tokens/s")
PY
}

for ((round = 1; round <= ROUNDS; round++)); do
    for mode in $MODES $EXTRA; do
        for side in A B; do
            binary=${!side}
            log=$OUT/ab-$MODEL-$mode-$side-$round.log
            if [[ $mode == fwd-bwd ]]; then
                timeout 200 "$binary" bench gpt --model "$MODEL" --micro-batch "$MICRO_BATCH" \
                    >"$log" 2>&1
            else
                timeout 300 "$binary" bench step --device cuda --model "$MODEL" --mode "$mode" \
                    --micro-batch "$MICRO_BATCH" --accum "$ACCUM" --steps "$STEPS" --warmup "$WARMUP" --json \
                    >"$log" 2>"$log.err"
            fi
            echo "$side $MODEL $mode (round $round): exit $?"
            record "$side" "$mode" "$log" || tail -n 5 "$log" "$log.err" 2>/dev/null
        done
    done
done

python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"\n{'mode':<18} {'A tokens/s':>12} {'B tokens/s':>12} {'B/A':>7}")
for mode in dict.fromkeys(r["ab_mode"] for r in rows):
    side = {s: [r["tokens_per_s"] for r in rows if r["ab_mode"] == mode and r["binary"] == s]
            for s in "AB"}
    if not side["A"] or not side["B"]:
        print(f"{mode:<18} missing a side")
        continue
    a, b = statistics.median(side["A"]), statistics.median(side["B"])
    print(f"{mode:<18} {a:>12.0f} {b:>12.0f} {b / a:>7.3f}")
PY
