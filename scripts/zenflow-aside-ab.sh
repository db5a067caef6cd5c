#!/usr/bin/env bash
# One device call: ZenFlow with its window set aside in host memory (`--zenflow-aside host`, the
# path an 80 GB GPU needs at llama-8b), this tree's binary against BEFORE (another binary's path),
# and this binary with `--overlap-forward off` (the CPU's weights copied whole at a window's end,
# not opened by the next forward in pieces), as BENCHMARKS.md's "ZenFlow's weights from host
# memory opened by the next forward" measured them:
#
#   gpt-1.3b  8 × 1024, 16 timed steps after 4, ZenFlow's defaults (top-k 0.05, windows of 4,
#             the step overlapped): BEFORE and this binary alternating, two rounds, then this
#             binary with `--overlap-forward off`, and with `--zenflow-aside device` (the GPU
#             holding the window: the floor)
#   llama-8b  4 × 2048, activation checkpointing, 16-bit moments (fp32 moments do not fit a
#             128 GiB host with the window there), 12 timed steps after 4: this binary with
#             `--overlap-forward on`, then `off`, then BEFORE where given
#
#   here:  bash scripts/gpu-check.sh; cp <the other tree's .gpu/zeroflow> .gpu/zeroflow-before
#   there: BEFORE=.gpu/zeroflow-before bash scripts/zenflow-aside-ab.sh   carry: [".gpu"]
#          (about 5 minutes with BEFORE, 3.5 without; PARTS="gpt-1.3b llama-8b" by default)
#
# Each run's JSON goes to $OUT/<model>-<run>.json; a ROW line per run gives the step times' mean,
# median and p90, the step that waits for a window's weights (the longest but the last: the bench
# drains the last window's copy out at its last step), and tokens/s.
set -uo pipefail
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
PARTS=${PARTS:-gpt-1.3b llama-8b}
BEFORE=${BEFORE:-}
if [[ -n $BEFORE && ! -x $BEFORE ]]; then
    echo "zenflow-aside-ab: BEFORE=$BEFORE is not an executable binary" >&2
    exit 2
fi
# run NAME BINARY MODEL LIMIT ARGS...: one `bench step` run, its JSON kept and summarised.
run() {
    local name=$1 binary=$2 model=$3 limit=$4
    shift 4
    local json=$OUT/$model-$name.json
    timeout "$limit" "$binary" bench step --device cuda --model "$model" --mode zenflow --json \
        "$@" >"$json" 2>"$OUT/$model-$name.err"
    local status=$?
    ((status == 0)) || echo "FAILED $model $name: exit $status (see $model-$name.err)"
    python3 - "$json" "$model" "$name" <<'PY'
import json, statistics, sys
path, model, name = sys.argv[1:]
text = open(path).read()
try:
    row = json.loads(text[text.find("{"):])
except ValueError:
    sys.exit(0)
times = row.get("times") or []
waits = max(times[:-1]) if len(times) > 1 else float("nan")
p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))] if times else float("nan")
print(f"ROW {model} {name} mean={row['s_per_step_mean']:.4f} "
      f"median={row['s_per_step_median']:.4f} p90={p90:.4f} window_wait_step={waits:.4f} "
      f"tokens_per_s={row['tokens_per_s']:.0f} "
      f"rss_bytes_per_param={row.get('peak_rss_bytes_per_param', float('nan')):.2f}")
PY
}
for part in $PARTS; do
    echo "## $part at ${SECONDS}s"
    case $part in
    gpt-1.3b)
        gpt=(--micro-batch 8 --steps 16 --warmup 4)
        for round in 1 2; do
            [[ -n $BEFORE ]] && run "before-host-$round" "$BEFORE" gpt-1.3b 90 "${gpt[@]}" \
                --zenflow-aside host
            run "after-host-$round" "$Z" gpt-1.3b 90 "${gpt[@]}" --zenflow-aside host
        done
        run after-host-whole "$Z" gpt-1.3b 90 "${gpt[@]}" --zenflow-aside host \
            --overlap-forward off
        run after-device "$Z" gpt-1.3b 90 "${gpt[@]}" --zenflow-aside device
        ;;
    llama-8b)
        llama=(--micro-batch 4 --seq 2048 --activation-checkpointing --state-dtype bf16
            --zenflow-aside host --steps 12 --warmup 4)
        run after-on "$Z" llama-8b 200 "${llama[@]}" --overlap-forward on
        run after-off "$Z" llama-8b 200 "${llama[@]}" --overlap-forward off
        [[ -n $BEFORE ]] && run before "$BEFORE" llama-8b 200 "${llama[@]}"
        ;;
    *)
        echo "zenflow-aside-ab: PARTS holds gpt-1.3b or llama-8b, not $part" >&2
        exit 2
        ;;
    esac
done
echo "## done at ${SECONDS}s"
