#!/usr/bin/env bash
# One device call: a run-time setting's values against each other on the real models, with the
# binary scripts/gpu-check.sh staged. VAR names the setting's environment variable, VALUES its
# values, the first against each of the others (scripts/overlap-forward.sh: the overlap on and off).
#
# 1. Exactness: gpt2-124m and llama-1b, 12 steps of exact offload
#    (examples/configs/zero2-offload-bf16.json, random weights, synthetic tokens) with an
#    evaluation every 6, once per value and the last value again. Printed per model and run:
#    whether its losses, gradient norms and eval losses are the first value's, and whether its
#    final checkpoint's weights and optimizer state are, bit for bit
#    (scripts/compare-checkpoints.py, which says where and by how much they differ; checkpoints
#    are deleted once compared: two at most on disk, 17 GB each at llama-1b). The last value's
#    repeat (against the last value) shows the GPU's own determinism.
# 2. Speed, `bench step` in one call, for each of SPEED_MODELS (gpt-* at 8 × 1024, llama-* at
#    4 × 2048): `gpu`, then `offload` at each value, ROUNDS times interleaved. The step times, the
#    forward/backward/optimizer breakdown and the CPU wait come from the bench's JSON line.
#
# With ACCUM > 1 every run takes that many micro-steps per step, summed on the device
# (ZEROFLOW_ACCUMULATE_ON=device: the step streams from the sum, the `Summed` path).
#
# Here: bash scripts/gpu-check.sh.
# There: VAR=ZEROFLOW_DEVICE_SHARE VALUES="0 0.5" bash scripts/setting-ab.sh   carry: [".gpu"]
# The value `default` leaves VAR unset: the binary's default.
# Environment: VAR, VALUES (required), PARTS ("exact speed"), SPEED_MODELS ("gpt-1.3b llama-1b"),
# EXACT_MODELS ("gpt2-124m llama-1b"), ROUNDS (2), STEPS (8), WARMUP (3), ACCUM (1);
# OFFLOAD_ARGS: more `bench step` arguments for the offload rows (e.g. "--state-dtype bf16"),
# TAG: a suffix to their names, GPU_ROW=0: no `gpu` row; CONFIG: the exactness runs' config
# (examples/configs/zero2-offload-bf16.json).
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
: "${VAR:?name the setting by its environment variable}" "${VALUES:?and give its values}"
read -ra values <<<"$VALUES"
PARTS=${PARTS:-exact speed}
ROUNDS=${ROUNDS:-2}
SPEED_MODELS=${SPEED_MODELS:-gpt-1.3b llama-1b}
EXACT_MODELS=${EXACT_MODELS:-gpt2-124m llama-1b}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
ACCUM=${ACCUM:-1}
read -ra offload_args <<<"${OFFLOAD_ARGS:-}"
WORK=${WORK:-/tmp/setting-ab}
export ZEROFLOW_ACCUMULATE_ON=device
rm -rf "$WORK" && mkdir -p "$WORK"
# `VAR=value` for env, nothing for `default`.
setting() { [[ $1 == default ]] || echo "$VAR=$1"; }

if [[ $PARTS == *exact* ]]; then
    # Each value once, the last again.
    runs=("${values[@]}" "${values[-1]}-again")
    last=$((${#runs[@]} - 1))
    for model in $EXACT_MODELS; do
        for i in "${!runs[@]}"; do
            run=${runs[i]}
            dir=$WORK/$model-$run
            echo "== train $model, $VAR=${run%-again}, at ${SECONDS}s"
            env $(setting "${run%-again}") timeout 240 "$Z" train --device cuda --model "$model" \
                --config "${CONFIG:-examples/configs/zero2-offload-bf16.json}" --micro-batch 4 --seq 1024 \
                --accum "$ACCUM" --steps 12 --eval-every 6 --save-every 0 --out "$dir" >"$OUT/train-$model-$run.log" 2>&1 ||
                { echo "FAILED: exit $?"; tail -n 5 "$OUT/train-$model-$run.log"; }
            cp "$dir/metrics.jsonl" "$OUT/metrics-$model-$run.jsonl" 2>/dev/null
            ((i == 0)) && continue
            # The final checkpoints, bit for bit: each value's against the first's, the repeat
            # against the last value's; then those no later run needs go.
            against=${runs[0]}
            ((i == last)) && against=${runs[i - 1]}
            python3 scripts/compare-checkpoints.py "$WORK/$model-$against"/checkpoints/step-* \
                "$dir"/checkpoints/step-* >"$dir/state" 2>&1
            cp "$dir/state" "$OUT/state-$model-$run-vs-$against.txt"
            grep -v '^STATE identical' "$dir/state" | head -n 8
            ((i == last - 1 || i == last)) && rm -rf "$WORK/$model-${runs[0]}/checkpoints"
            ((i != last - 1)) && rm -rf "$dir/checkpoints"
            ((i == last)) && rm -rf "$WORK/$model-${runs[i - 1]}/checkpoints"
        done
        python3 - "$WORK/$model" "${runs[@]}" <<'PY'
import json, os, sys
base, runs = sys.argv[1], sys.argv[2:]
def read(run):
    rows = [json.loads(l) for l in open(f"{base}-{run}/metrics.jsonl")]
    steps = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    path = f"{base}-{run}/state"
    state = os.path.exists(path) and "STATE identical" in open(path).read()
    return steps, evals, state
name = base.rsplit("/", 1)[1]
first = read(runs[0])
print(f"EXACT {name}: {len(first[0])} steps, {len(first[1])} evals, last loss {first[0][-1][1]!r}")
for run, against in [(r, runs[0]) for r in runs[1:-1]] + [(runs[-1], runs[-2])]:
    a, b = read(run), read(against)
    same_state = a[2]
    print(f"EXACT {name}: {run} against {against}: metrics equal: {a[:2] == b[:2]}; "
          f"final weights and optimizer state equal: {same_state}")
    if a[0] != b[0]:
        worst = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a[0], b[0]))
        print(f"EXACT {name}: worst relative loss difference {worst:.3e}")
PY
    done
fi

# bench NAME ARGS...: one `bench step` run (with $VAR=$VALUE where VALUE is set), its JSON line
# tagged with NAME into $OUT/bench.jsonl.
bench() {
    local name=$1
    shift
    echo "== bench $name, at ${SECONDS}s"
    env $(setting "${VALUE:-default}") timeout 240 "$Z" bench step --device cuda --json --steps "$STEPS" --warmup "$WARMUP" \
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
            "cpu_wait_s_mean", "cpu_wait_in_forward_backward_s_mean", "cpu_adam_s_mean",
            "peak_rss_bytes_per_param", "speculated_steps", "redone_steps", "paused_steps",
            "host_steal_fraction"]
    def find(value, key):  # the first `key` anywhere in `value` (the settings' nesting)
        if isinstance(value, dict):
            for k, v in value.items():
                found = v if k == key else find(v, key)
                if found is not None:
                    return found
        return None
    extra = []
    if row.get("device_memory_in_use_bytes"):
        extra.append(f"gpu_gib={row['device_memory_in_use_bytes'] / 2**30:.2f}")
    if row.get("speculated_steps") and row.get("speculated_elements") is not None:
        share = row["speculated_elements"] / (row["speculated_steps"] * row["parameters"])
        extra.append(f"speculated_share={share:.3f}")
        # The courier's time per speculated step: waiting for copies, stepping pieces.
        for key, label in (("speculation_copy_wait_s", "copy_wait"),
                           ("speculation_stepping_s", "stepping")):
            if row.get(key) is not None:
                extra.append(f"{label}_per_step={row[key] / row['speculated_steps']:.4f}")
        if row.get("stopped_at_backward_end") is not None:
            extra.append(f"stopped_at_backward_end={row['stopped_at_backward_end']}")
    if (row.get("host") or {}).get("simd"):
        extra.append(f"simd={row['host']['simd']}")
    if find(row.get("settings"), "device_share") is not None:
        extra.append(f"device_share={find(row['settings'], 'device_share')}")
    print("BENCH", name, " ".join([f"{k}={row[k]:.4g}" for k in keys if row.get(k) is not None] + extra))
PY
}

if [[ $PARTS == *speed* ]]; then
    for model in $SPEED_MODELS; do
        case $model in
            llama-*) shape=(--micro-batch 4 --seq 2048) ;;
            *) shape=(--micro-batch 8) ;;
        esac
        [[ ${GPU_ROW:-1} == 0 ]] || bench "$model-gpu" --model "$model" --mode gpu "${shape[@]}"
        for round in $(seq "$ROUNDS"); do
            for value in "${values[@]}"; do
                VALUE=$value bench "$model-offload-$value${TAG:-}" --model "$model" --mode offload \
                    "${shape[@]}" "${offload_args[@]}"
            done
        done
    done
fi
echo "done at ${SECONDS}s"
