#!/usr/bin/env bash
# One device call (issue 23): how often the speculative exact offload step stands in real training,
# and what it costs or saves. gpt2-124m from random weights, STEPS steps (default 300) on real text
# (scripts/python-corpus.sh), examples/configs/zero2-offload-bf16.json (exact offload, clipping
# 1.0), twice: without speculation and with a budget that holds the whole partition
# (`--speculation-budget-mib`); both runs must print the same losses (the speculation is
# bit-identical). Then `bench step` at gpt-1.3b with and without the budget: random weights and
# tokens, so the clip (1.0) fires on every step there — what the pauses leave of the cost of
# speculating on clipped steps. The training pair shows the speculation once the clip stops firing.
#
# Printed: per run the redone, paused and speculated steps from the last line of metrics.jsonl
# (the fraction of the run's steps redone), the mean step time from metrics' tokens/s, and whether
# the two runs' losses are identical; the bench lines' s/step and counts.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/speculation-redone.sh   carry: [".gpu"]
# Environment: STEPS (300), MICRO_BATCH (16), SEQ (1024), BUDGET_MIB (4096).
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
STEPS=${STEPS:-300}
MICRO_BATCH=${MICRO_BATCH:-16}
SEQ=${SEQ:-1024}
BUDGET_MIB=${BUDGET_MIB:-4096}
WORK=${WORK:-/tmp/speculation-redone}
rm -rf "$WORK" && mkdir -p "$WORK"
ZEROFLOW=$Z OUT=$OUT bash scripts/python-corpus.sh "$WORK" || exit 1

for budget in 0 "$BUDGET_MIB"; do
    dir=$WORK/run-$budget
    echo "== gpt2-124m, speculation budget $budget MiB, at ${SECONDS}s"
    timeout 240 "$Z" train --device cuda --model gpt2-124m --config examples/configs/zero2-offload-bf16.json \
        --micro-batch "$MICRO_BATCH" --seq "$SEQ" --data "$WORK/train" --eval-data "$WORK/eval" \
        --lr 6e-4 --steps "$STEPS" --eval-every 0 --save-every 0 --log-every 50 \
        --speculation-budget-mib "$budget" --out "$dir" >"$OUT/train-$budget.log" 2>&1
    echo "exit $?"
    cp "$dir/metrics.jsonl" "$OUT/metrics-$budget.jsonl" 2>/dev/null
done
python3 - "$OUT/metrics-0.jsonl" "$OUT/metrics-$BUDGET_MIB.jsonl" <<'PY'
import json, sys
runs = []
for path in sys.argv[1:]:
    try:
        steps = [json.loads(l) for l in open(path) if '"loss"' in l]
    except OSError:
        steps = []
    runs.append(steps)
    if not steps:
        print(f"{path}: no steps"); continue
    last = steps[-1]
    n = last["step"]
    # tokens/s is over the training time so far: its last value is the run's mean.
    print(f"{path.rsplit('/', 1)[-1]}: {n} steps, {last['tokens_per_s']:.0f} tokens/s, loss "
          f"{steps[0]['loss']:.3f} -> {last['loss']:.3f}, grad norm above 1.0 on "
          f"{sum(1 for s in steps if (s['grad_norm'] or 0) > 1.0)} steps")
    if "redone_steps" in last:
        print(f"  speculated {last['speculated_steps']}, redone {last['redone_steps']} "
              f"({last['redone_steps'] / n:.1%} of the steps), sat out {last['paused_steps']}, "
              f"stood {last['speculated_steps'] - last['redone_steps']}")
if all(runs):
    same = [a["loss"] for a in runs[0]] == [b["loss"] for b in runs[1]]
    print(f"losses identical: {same}")
PY

for budget in 0 "$BUDGET_MIB"; do
    echo "== gpt-1.3b bench step, offload, speculation budget $budget MiB, at ${SECONDS}s"
    ZEROFLOW_SPECULATION_BUDGET_MIB=$budget timeout 120 "$Z" bench step --device cuda --model gpt-1.3b \
        --mode offload --micro-batch 8 --steps 8 --warmup 3 --json >"$OUT/bench-$budget.json" 2>/dev/null
    python3 - "$OUT/bench-$budget.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
r, _ = json.JSONDecoder().raw_decode(text[text.find("{"):])
print({k: r.get(k) for k in ["s_per_step_mean", "tokens_per_s", "backward_s_mean",
      "exposed_optimizer_s_mean", "cpu_adam_s_mean", "speculated_steps", "redone_steps",
      "paused_steps", "peak_rss_bytes_per_param"]})
PY
done
echo "== done at ${SECONDS}s"
