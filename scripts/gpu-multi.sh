#!/usr/bin/env bash
# The 2-GPU acceptance run of multi-GPU training, on `nvidia-h200-x2`, with the zeroflow binary
# that scripts/gpu-check.sh staged in .gpu/ (or ZEROFLOW=path):
#
#   bash scripts/gpu-check.sh        # here: builds and stages .gpu/zeroflow
#   run  kind: nvidia-h200-x2  command: bash scripts/gpu-multi.sh  carry: [".gpu"]  (≤ 600 s)
#
# 1. `one`: 1 GPU, --micro-batch 8 (global batch 8);
# 2. `two`: `zeroflow launch --nproc-per-node 2`, --micro-batch 4 (global batch 8, the same
#    sequences): its losses must follow `one`'s (bf16: to ~1e-2 relative, not bit for bit);
# 3. `resume`: a copy of `two`'s run directory without its last checkpoint, continued from its
#    checkpoint at STEPS/2 with `--resume latest`: its losses after the checkpoint must equal
#    `two`'s (to ~1e-6 relative; bit for bit if the kernels and NCCL are deterministic);
# 4. `kill`: 2 GPUs, rank 1 killed with SIGKILL mid-run: the launcher must exit within 60 s naming
#    rank 1 (`killed by signal 9`);
# 5. `bare`: the same without the launcher (ranks started by hand): rank 0 must exit with status 3
#    within 60 s, naming rank 1.
# Logs and run directories go under $OUT; a table of RESULT lines is printed last. QUICK=1 runs
# only 1 and 2. The ZeRO-1/ZeRO-2 × offload matrix with the final weights compared is
# scripts/gpu-multi-matrix.sh; the gpt-1.3b two-GPU benchmark, scripts/bench-multi-gpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/.gpu/out}
# Everything small under $OUT comes back from the device in one bundle (scripts/bundle-out.sh).
trap 'OUT="$OUT" bash scripts/bundle-out.sh >/dev/null 2>&1 || true' EXIT
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# NVLink multicast must stay off on the lent machines: keep this in every environment.
export NCCL_NVLS_ENABLE=0
export RUST_BACKTRACE=1
ZEROFLOW=${ZEROFLOW:-.gpu/zeroflow}
MODEL=${MODEL:-gpt2-124m}
CONFIG=${CONFIG:-examples/configs/zero2-offload-bf16.json}
STEPS=${STEPS:-50}
# Without --steps and --save-every, which each run adds (clap refuses a flag given twice).
COMMON=(--device cuda --model "$MODEL" --config "$CONFIG" --lr 6e-4 --eval-every 0 --log-every 10)
half=$((STEPS / 2))

results=()
result() { results+=("$*"); echo "RESULT $*"; }

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
"$ZEROFLOW" env >"$OUT/env.log" 2>&1 || true

started=$SECONDS
"$ZEROFLOW" train "${COMMON[@]}" --steps "$STEPS" --save-every 0 --micro-batch 8 \
    --out "$OUT/one" >"$OUT/one.log" 2>&1
result "one status=$? seconds=$((SECONDS - started))"

started=$SECONDS
"$ZEROFLOW" launch --nproc-per-node 2 -- train "${COMMON[@]}" --steps "$STEPS" --save-every "$half" \
    --micro-batch 4 --out "$OUT/two" >"$OUT/two.log" 2>&1
result "two status=$? seconds=$((SECONDS - started))"

if [[ -z "${QUICK:-}" ]]; then
started=$SECONDS
rm -rf "$OUT/resume"
cp -r "$OUT/two" "$OUT/resume"
rm -rf "$OUT/resume/checkpoints/step-$(printf %08d "$STEPS")"
ls "$OUT/resume/checkpoints" >"$OUT/resume-checkpoints.log" 2>&1
"$ZEROFLOW" launch --nproc-per-node 2 -- train "${COMMON[@]}" --steps "$STEPS" --save-every 0 \
    --micro-batch 4 --out "$OUT/resume" --resume latest >"$OUT/resume.log" 2>&1
result "resume status=$? seconds=$((SECONDS - started))"

# Rank 1 dies by SIGKILL 40 s into a long run; the launcher must end within 60 s of it.
"$ZEROFLOW" launch --nproc-per-node 2 -- train "${COMMON[@]}" --steps 100000 --save-every 0 \
    --micro-batch 4 --out "$OUT/kill" >"$OUT/kill.log" 2>&1 &
launcher=$!
sleep 40
rank1=
children=$(ps -o pid= --ppid "$launcher")
for child in $children; do
    tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx 'RANK=1' && rank1=$child
done
ps -o pid=,args= --ppid "$launcher" >"$OUT/kill-children.log"
killed=$SECONDS
[[ -n "$rank1" ]] && kill -9 "$rank1"
if ! timeout 90 tail --pid="$launcher" -f /dev/null; then
    echo "kill: the launcher still runs 90 s after rank 1 died: HUNG" | tee -a "$OUT/kill.log"
    kill -9 "$launcher" $children 2>/dev/null
fi
wait "$launcher"
result "kill status=$? seconds_after_kill=$((SECONDS - killed)) rank1_pid=${rank1:-none}"

# The same without the launcher: two ranks started by hand.
port=$((29500 + RANDOM % 1000))
pids=()
for rank in 0 1; do
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "$ZEROFLOW" train "${COMMON[@]}" --steps 100000 --save-every 0 --micro-batch 4 --out "$OUT/bare" \
        >"$OUT/bare-$rank.log" 2>&1 &
    pids+=($!)
done
sleep 40
killed=$SECONDS
kill -9 "${pids[1]}"
if ! timeout 90 tail --pid="${pids[0]}" -f /dev/null; then
    echo "bare: rank 0 still runs 90 s after rank 1 died: HUNG" | tee -a "$OUT/bare-0.log"
    kill -9 "${pids[0]}" 2>/dev/null
fi
wait "${pids[0]}"
result "bare status=$? seconds_after_kill=$((SECONDS - killed))"
fi

python3 - "$OUT" "$STEPS" <<'EOF' | tee -a "$OUT/compare.log"
import json, sys, pathlib
out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def losses(run):
    path = out / run / "metrics.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return {l["step"]: l for l in lines if "loss" in l}
one, two, resume = losses("one"), losses("two"), losses("resume")
def worst(a, b):
    common = sorted(set(a) & set(b))
    if not common:
        return "n/a"
    rel = max(abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in common)
    return f"{rel:.2e} over {len(common)} steps"
print(f"RESULT loss two_vs_one max_rel={worst(two, one)}")
after = {s: l for s, l in resume.items() if s > steps // 2}
print(f"RESULT loss resume_vs_two after_checkpoint max_rel={worst(after, two)}")
for name, run in (("one", one), ("two", two)):
    if run:
        last = run[max(run)]
        print(f"RESULT {name} last_step={max(run)} loss={last['loss']:.4f} "
              f"grad_norm={last['grad_norm']} tokens_per_s={last['tokens_per_s']:.0f}")
for step in sorted(set(one) & set(two))[:: max(1, steps // 10)]:
    print(f"step {step:5d} one {one[step]['loss']:.4f} two {two[step]['loss']:.4f}")
EOF
grep -h "error:" "$OUT/kill.log" "$OUT/bare-0.log" 2>/dev/null | tail -4

echo
echo "== results"
printf '%s\n' "${results[@]}"
grep -h '^RESULT loss\|^RESULT one\|^RESULT two' "$OUT/compare.log"
