#!/usr/bin/env bash
# One device call: why the exact offload's CPU AdamW can run much slower inside a run than
# `zeroflow bench cpu-adam` on the same host. On an H100 of the forty-first session, one lease:
# `bench cpu-adam --params 5e8` 5.17–5.35 Gparam/s (96–97 % of the host's roofline), then
# llama-3b's `bench step` with the whole fp32 optimizer in host memory stepped its 3.21e9
# parameters in 1.647 s (1.95 Gparam/s; 0.585 s on the thirty-eighth session's H100), the step
# times rising from 1.34 s to 2.25 s over six steps; the fortieth session's H200 ran gpt-1.3b's
# in 0.78 s (0.21–0.30 s on earlier hosts). Here, on one machine:
#
# 1. the host: CPUs, transparent huge pages, steal time, memory;
# 2. `bench cpu-adam` at gpt-1.3b's partition (1.3e9 parameters, bf16 gradients and copy, as a
#    run steps them) and at 5e8;
# 3. gpt-1.3b's exact offload at share 0 (8 × 1024, 6 steps after 3) with the settings that
#    decide what else runs beside the CPU AdamW: how host threads wait for the GPU
#    (ZEROFLOW_CUDA_WAIT), the CPU AdamW's threads (ZEROFLOW_CPU_THREADS), the step overlapped
#    with the next forward or not (ZEROFLOW_OVERLAP_FORWARD); each run's steal time (the
#    hypervisor's), and a `top -H` of its threads 25 s in (which threads take the cores).
#
# Its first run (2026-12-08, an H100; BENCHMARKS.md, "What runs beside the CPU AdamW"): with next
# to no steal the run's AdamW was at the bench's speed under every setting; the slow runs were in
# the one minute the hypervisor took 12 CPU seconds. `bench step` now records each step's steal.
#
#   here:  bash scripts/gpu-check.sh      there: bash scripts/in-run-adam-probe.sh   carry: [".gpu"]
#   (about 7 minutes)
set -uo pipefail
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
steal() { awk '/^cpu / { print $9 }' /proc/stat; } # jiffies the hypervisor took from this VM
echo "## host at ${SECONDS}s"
nproc
lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node|Hypervisor|L3"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
free -g | head -2
"$Z" env | grep -E '^(host|cores|memory|simd) '
echo "## bench cpu-adam at ${SECONDS}s (steal $(steal))"
"$Z" bench cpu-adam --params 1.3e9 --iters 10 --grad bf16 --bf16-copy --copy-stores normal | tail -4
"$Z" bench cpu-adam --params 5e8 --iters 10 | tail -4
# row VAR VALUES: gpt-1.3b at share 0, one run per value, each with its steal time and a view
# of its threads.
row() {
    local var=$1 values=$2 before
    echo "## $var: $values, at ${SECONDS}s"
    (
        sleep 25
        pid=$(pgrep -n -f "zeroflow bench step") # the newest: the run, not its `timeout`
        [[ -n $pid ]] && top -b -H -n 1 -d 1 -p "$pid" | sed -n '7,26p'
    ) &
    before=$(steal)
    ZEROFLOW_DEVICE_SHARE=0 VAR=$var VALUES=$values PARTS=speed ROUNDS=1 GPU_ROW=0 \
        SPEED_MODELS=gpt-1.3b STEPS=6 WARMUP=3 TAG="-$var" OUT="$OUT/$var" \
        bash scripts/setting-ab.sh | grep BENCH
    echo "steal: $(($(steal) - before)) jiffies over the runs"
    wait
}
row ZEROFLOW_CUDA_WAIT "default block spin"
row ZEROFLOW_CPU_THREADS "default 15 12"
row ZEROFLOW_OVERLAP_FORWARD "default off"
echo "## done at ${SECONDS}s"
