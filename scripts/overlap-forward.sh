#!/usr/bin/env bash
# One device call (issue 23, point 3): the exact offload step overlapped with the next forward
# (`--overlap-forward on`, the default) against the step done before it (`off`), with the binary
# scripts/gpu-check.sh staged.
#
# 1. Exactness on the real models: gpt2-124m and llama-1b, 12 steps of exact offload
#    (examples/configs/zero2-offload-bf16.json, random weights, synthetic tokens) with an
#    evaluation every 6, three times: on, off, off. Printed per model: whether on's losses, gradient
#    norms and eval losses are off's (and off's its own repeat's: the GPU's own determinism).
# 2. Speed, `bench step` in one call, for each of SPEED_MODELS (gpt-* at 8 × 1024, llama-* at
#    4 × 2048): `gpu`, then `offload` on and off, ROUNDS times interleaved. The step times, the
#    forward/backward/optimizer breakdown and the CPU wait come from the bench's JSON line.
#
# With ACCUM > 1 every run takes that many micro-steps per step, summed on the device
# (ZEROFLOW_ACCUMULATE_ON=device: the step streams from the sum, the `Summed` path).
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/overlap-forward.sh   carry: [".gpu"]
# Environment: PARTS ("exact speed"), SPEED_MODELS ("gpt-1.3b llama-1b"), ROUNDS (2), STEPS (8),
# WARMUP (3), ACCUM (1).
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
PARTS=${PARTS:-exact speed}
ROUNDS=${ROUNDS:-2}
SPEED_MODELS=${SPEED_MODELS:-gpt-1.3b llama-1b}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
ACCUM=${ACCUM:-1}
WORK=${WORK:-/tmp/overlap-forward}
export ZEROFLOW_ACCUMULATE_ON=device
rm -rf "$WORK" && mkdir -p "$WORK"

if [[ $PARTS == *exact* ]]; then
    for model in gpt2-124m llama-1b; do
        for run in on off off2; do
            dir=$WORK/$model-$run
            echo "== train $model, overlap ${run%2}, at ${SECONDS}s"
            ZEROFLOW_OVERLAP_FORWARD=${run%2} timeout 200 "$Z" train --device cuda --model "$model" \
                --config examples/configs/zero2-offload-bf16.json --micro-batch 4 --seq 1024 \
                --accum "$ACCUM" --steps 12 --eval-every 6 --save-every 0 --out "$dir" >"$OUT/train-$model-$run.log" 2>&1 ||
                { echo "FAILED: exit $?"; tail -n 5 "$OUT/train-$model-$run.log"; }
            cp "$dir/metrics.jsonl" "$OUT/metrics-$model-$run.jsonl" 2>/dev/null
        done
        python3 - "$WORK/$model" <<'PY'
import json, sys
base = sys.argv[1]
def read(run):
    rows = [json.loads(l) for l in open(f"{base}-{run}/metrics.jsonl")]
    steps = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    return steps, evals
on, off, off2 = read("on"), read("off"), read("off2")
name = base.rsplit("/", 1)[1]
print(f"EXACT {name}: {len(on[0])} steps, {len(on[1])} evals; on == off: {on == off}; "
      f"off == off again: {off == off2}; last loss on {on[0][-1][1]!r} off {off[0][-1][1]!r}")
if on != off:
    worst = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(on[0], off[0]))
    print(f"EXACT {name}: worst relative loss difference {worst:.3e}")
PY
    done
fi

# bench NAME ARGS...: one `bench step` run, its JSON line tagged with NAME into $OUT/bench.jsonl.
bench() {
    local name=$1
    shift
    echo "== bench $name, at ${SECONDS}s"
    timeout 240 "$Z" bench step --device cuda --json --steps "$STEPS" --warmup "$WARMUP" \
        --accum "$ACCUM" "$@" \
        >"$OUT/bench-$name.log" 2>&1 || { echo "FAILED: exit $?"; tail -n 5 "$OUT/bench-$name.log"; }
    python3 - "$name" "$OUT/bench-$name.log" "$OUT/bench.jsonl" <<'PY'
import json, sys
name, log, out = sys.argv[1:]
text = open(log, errors="replace").read()
# `--json` prints one indented object, after the plan and any warnings.
start = text.find("\n{") + 1 if not text.startswith("{") else 0
rows = []
if start > 0 or text.startswith("{"):
    rows = [json.JSONDecoder().raw_decode(text[start:])[0]]
for row in rows:
    row["name"] = name
    open(out, "a").write(json.dumps(row) + "\n")
    times = sorted(row.get("times") or [])
    if times:
        row["s_per_step_p90"] = times[min(len(times) - 1, int(0.9 * len(times)))]
    keys = ["tokens_per_s", "s_per_step_mean", "s_per_step_median", "s_per_step_p90",
            "forward_s_mean", "backward_s_mean", "exposed_optimizer_s_mean",
            "cpu_wait_s_mean", "cpu_adam_s_mean", "peak_rss_bytes_per_param"]
    print("BENCH", name, " ".join(f"{k}={row[k]:.4g}" for k in keys if row.get(k) is not None))
PY
}

if [[ $PARTS == *speed* ]]; then
    for model in $SPEED_MODELS; do
        case $model in
            llama-*) shape=(--micro-batch 4 --seq 2048) ;;
            *) shape=(--micro-batch 8) ;;
        esac
        bench "$model-gpu" --model "$model" --mode gpu "${shape[@]}"
        for round in $(seq "$ROUNDS"); do
            for overlap in on off; do
                bench "$model-offload-$overlap" --model "$model" --mode offload "${shape[@]}" \
                    --overlap-forward "$overlap"
            done
        done
    done
fi
echo "done at ${SECONDS}s"
