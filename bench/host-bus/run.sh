#!/usr/bin/env bash
# Runs on the GPU machine (it has nvcc): how much of the host's memory bandwidth the GPU can add to
# the CPU's for an optimizer step whose state stays in host memory. Times, with the zeroflow binary
# scripts/gpu-check.sh staged:
#   1. `zeroflow bench cpu-adam` alone (1.3e9 parameters, bf16 gradients, the bf16 copy: 28 bytes
#      per parameter, gpt-1.3b's step);
#   2. zero_copy_adamw.cu alone: the GPU's kernel over mapped host memory at several grid sizes,
#      and the state staged through device buffers;
#   3. each of the two GPU passes again, looping, while `bench cpu-adam` runs: both rates.
#
#   there: bash bench/host-bus/run.sh        carry: [".gpu"]
# Writes its JSON under $OUT (the device tool's folder, else .gpu/out).
cd "$(dirname "$0")/../.." && source scripts/gpu-env.sh
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node" | tee -a "$OUT/gpu.txt"
bin=/tmp/zero_copy_adamw
nvcc -O3 -arch=sm_90 -o "$bin" bench/host-bus/zero_copy_adamw.cu || exit 1
cpu=("$Z" bench cpu-adam --params 1.3e9 --grad bf16 --bf16-copy --iters 12 --warmup 2 --json)
echo "== cpu alone"; "${cpu[@]}" | tee "$OUT/cpu_alone.json"
echo "== gpu alone"
for blocks in 66 132 264 528 1056; do "$bin" 5e8 "$blocks" 3 0; done | tee "$OUT/gpu_alone.jsonl"
"$bin" 5e8 0 3 1 | tee -a "$OUT/gpu_alone.jsonl"
for mode in 0 1; do
    echo "== together, mode $mode"
    "$bin" 5e8 264 45 "$mode" trace >"$OUT/trace_$mode.txt" &
    gpu=$!
    sleep 4
    a=$(date +%s.%N)
    "${cpu[@]}" >"$OUT/cpu_with_$mode.json"
    b=$(date +%s.%N)
    echo "cpu window $a $b" >>"$OUT/trace_$mode.txt"
    cat "$OUT/cpu_with_$mode.json"
    kill "$gpu"
    wait "$gpu" 2>/dev/null
    # The GPU's passes that ran wholly inside the CPU's timed passes (3 s after it started).
    python3 - "$OUT/trace_$mode.txt" <<'PY'
import sys
lines = open(sys.argv[1]).read().split("\n")
a, b = map(float, [l for l in lines if l.startswith("cpu window")][0].split()[2:4])
passes = [l.split() for l in lines if l.startswith("pass")]
inside = sorted(float(p[3]) for p in passes if a + 3 < float(p[1]) < b)
before = sorted(float(p[3]) for p in passes if float(p[1]) < a)
median = lambda xs: xs[len(xs) // 2] if xs else None
print(f"gpu GB/s beside the CPU: {median(inside)} ({len(inside)} passes); before it: {median(before)}")
PY
done
