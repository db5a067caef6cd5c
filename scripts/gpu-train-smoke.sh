#!/usr/bin/env bash
# Runs on the GPU machine: what a new user does first with `zeroflow train --device cuda`, with the
# binary scripts/gpu-check.sh staged in .gpu/: a short run (its summary names the settings it ran
# with; it writes two samples), `eval` of that run without --data, Ctrl-C in the middle of a run (exit 130, a checkpoint, a resume that finishes the run), a
# micro-batch too large for the GPU (an error naming the flag to lower), and a GPU ordinal that
# does not exist. Each check prints one `SMOKE name: ok|FAILED ...` line; logs go to $OUT.
#
#   there: bash scripts/gpu-train-smoke.sh        carry: [".gpu"]   (about a minute on the H200)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
Z=${ZEROFLOW:-.gpu/zeroflow}
MODEL=${MODEL:-gpt2-124m}
run=$OUT/smoke-run
rm -rf "$run" "$OUT/smoke-sigint" "$OUT/smoke-oom"

say() { # say NAME OK? DETAIL
    if [[ $2 == 0 ]]; then echo "SMOKE $1: ok $3"; else echo "SMOKE $1: FAILED $3"; fi
}

# A short run: exit 0, the summary records the attention and host waits it used, and a sample
# written at steps 10 and 20 (the weights downloaded from the GPU a piece at a time into f32).
timeout 120 "$Z" train --device cuda --model "$MODEL" --micro-batch 8 --steps 20 --eval-every 10 \
    --sample-every 10 --sample-prompt "The" --out "$run" >"$OUT/smoke-run.log" 2>&1
status=$?
settings=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["settings"]))' \
    "$run/summary.json" 2>/dev/null)
samples=$(wc -l <"$run/samples.jsonl" 2>/dev/null)
[[ $status == 0 && $settings == *'"attention": "flash"'* && $samples == 2 ]]
say run $? "exit $status, settings $settings, ${samples:-no} samples; $(tail -n 1 "$OUT/smoke-run.log")"

# `eval` of the run on the GPU without --data: its evaluation set rebuilt, in its windows; the
# loss within 1 % of its last evaluation's (bf16 both; a window at a time against 8).
eval_json=$(timeout 120 "$Z" eval "$run" --device cuda --json 2>"$OUT/smoke-eval.log")
status=$?
python3 - "$run/metrics.jsonl" "$eval_json" >>"$OUT/smoke-eval.log" 2>&1 <<'PY'
import json, sys
logged = [json.loads(l)["eval_loss"] for l in open(sys.argv[1]) if "eval_loss" in l][-1]
loss = json.loads(sys.argv[2])["loss"]
print(f"eval {loss:.6f} against the run's {logged:.6f}")
sys.exit(0 if abs(loss - logged) <= 0.01 * logged else 1)
PY
checked=$?
[[ $status == 0 && $checked == 0 ]]
say eval $? "exit $status; $(tail -n 1 "$OUT/smoke-eval.log")"

# Ctrl-C during a run: a message at once, exit 130, a checkpoint; the resume finishes the run.
sig=$OUT/smoke-sigint
# A plain `timeout`, as a user's wrapper: it passes the signal on to the run and then to its whole
# process group, the run among them, so the run may see two SIGINTs at once; the run takes them as
# one request (a second signal exits without saving only a second or more after the first).
timeout 200 "$Z" train --device cuda --model "$MODEL" --micro-batch 8 --steps 400 \
    --eval-every 0 --out "$sig" >"$OUT/smoke-sigint.log" 2>&1 &
pid=$!
# Interrupted once it trains (its first metrics lines written), well before its 400 steps end: a
# fixed wait let a fast start finish the run first.
for _ in $(seq 600); do
    [[ $(wc -l <"$sig/metrics.jsonl" 2>/dev/null || echo 0) -ge 2 ]] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
done
kill -INT "$pid"
wait "$pid"
status=$?
saved=$(ls "$sig/checkpoints" 2>/dev/null | tail -n 1)
[[ $status == 130 && -n $saved ]]
say sigint $? "exit $status, checkpoint ${saved:-none}; $(grep -m1 SIGINT "$OUT/smoke-sigint.log" | cut -c1-160)"
timeout 200 "$Z" train --device cuda --resume latest --out "$sig" >"$OUT/smoke-resume.log" 2>&1
status=$?
[[ $status == 0 ]] && grep -q "step 400/400" "$OUT/smoke-resume.log"
say resume $? "exit $status; $(tail -n 1 "$OUT/smoke-resume.log")"

# A micro-batch the GPU cannot hold: exit 2 and a message naming --micro-batch.
timeout 120 "$Z" train --device cuda --model gpt-1.3b --micro-batch 1024 --steps 1 \
    --out "$OUT/smoke-oom" >"$OUT/smoke-oom.log" 2>&1
status=$?
[[ $status != 0 ]] && grep -q -- "--micro-batch" "$OUT/smoke-oom.log"
say oom $? "exit $status; $(grep -m1 -i 'error\|hint' "$OUT/smoke-oom.log" | cut -c1-240)"

# A GPU that is not there.
count=$(nvidia-smi -L 2>/dev/null | wc -l)
timeout 60 "$Z" train --device cuda --gpu "$count" --steps 1 --out "$OUT/smoke-gpu" \
    >"$OUT/smoke-gpu.log" 2>&1
status=$?
[[ $status == 2 ]]
say gpu-ordinal $? "exit $status; $(grep -m1 error "$OUT/smoke-gpu.log" | cut -c1-240)"
