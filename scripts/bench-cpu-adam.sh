#!/usr/bin/env bash
# CPU AdamW of zeroflow against the memory roofline, DeepSpeedCPUAdam and torch's AdamW, in one run
# on one machine (the GPU machine's host). Runs there from the repository root, with the release
# binary at target/release/zeroflow and .peers/ from bench/peers/fetch-wheels.sh carried along:
#
#   cargo build --release && bench/peers/fetch-wheels.sh
#   device run: carry [target/release/zeroflow, .peers], command: bash scripts/bench-cpu-adam.sh
#
# Logs go to $OUT (default /tmp/out): bench.log (zeroflow), peers.jsonl (peers).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
B=target/release/zeroflow
run() { echo "== zeroflow bench cpu-adam $*"; $B bench cpu-adam "$@" 2>&1 | tee -a "$OUT/bench.log"; }
$B env
run --params 5e8
run --params 5e8 --json
run --params 5e8 --simd avx2
run --params 5e8 --simd scalar
run --params 5e8 --grad bf16
run --params 5e8 --bf16-copy
run --params 5e8 --threads 8
run --params 2e8 --threads 1 --iters 5
echo "== DeepSpeed 0.19.8 install"
bash bench/peers/install-deepspeed.sh
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
echo "== peers"
PYTHONUNBUFFERED=1 timeout 400 python3 bench/peers/cpu_adam.py --params 5e8 --threads 16 2>"$OUT/peers.err" | tee "$OUT/peers.jsonl"
tail -20 "$OUT/peers.err"
run --params 5e8
