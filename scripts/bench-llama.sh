#!/usr/bin/env bash
# One device call: the Llama family on the H200 against PyTorch and DeepSpeed, and the CUDA
# train -> export -> transformers check. Each part bounded; later parts skipped when time is short.
cd "$(dirname "$0")/.."
# Runs on the GPU machine with .gpu (scripts/gpu-check.sh) and .peers (bench/peers/fetch-wheels.sh)
# carried: bash scripts/bench-llama.sh. The figures are in BENCHMARKS.md, "The Llama family".
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/.gpu/out}; mkdir -p $OUT; export OUT
B=scripts/bench-vs-deepspeed.sh
echo "== train/export check"; timeout 100 python3 scripts/llama-train-export-check.py --zeroflow .gpu/zeroflow /tmp/ltec 2>&1 | grep -v "Writing\|Loading" | tail -6
echo "== llama-1b zeroflow + pytorch at ${SECONDS}s"
MICRO_BATCH=4 SEQ=2048 STEPS=6 WARMUP=3 PARTS="fwd-bwd zeroflow" MODES="gpu offload zenflow" timeout 240 bash $B llama-1b 2>&1 | grep -E "exit|RATIO|^zeroflow|^pytorch" | tail -12
if ((SECONDS < 330)); then echo "== llama-8b checkpointing fwd-bwd at ${SECONDS}s"
MICRO_BATCH=4 SEQ=2048 CHECKPOINTING=1 PARTS="fwd-bwd" timeout 120 bash $B llama-8b 2>&1 | grep -E "exit|RATIO" | tail -4; fi
if ((SECONDS < 420)); then echo "== deepspeed llama-1b at ${SECONDS}s"
MICRO_BATCH=4 SEQ=2048 STEPS=6 WARMUP=3 PARTS="deepspeed" DS_MODES="gpu offload" timeout $((560 - SECONDS)) bash $B llama-1b 2>&1 | grep -E "exit|RATIO|^deepspeed" | tail -10; fi
echo "== table at ${SECONDS}s"; python3 - $OUT/bench.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); t = r.get("times") or []
    p90 = sorted(t)[min(len(t)-1, int(0.9*len(t)))] if t else None
    print(r.get("system"), r.get("model"), r.get("mode"), "mean", r.get("s_per_step_mean"), "median", r.get("s_per_step_median"), "p90", p90, "tok/s", round(r.get("tokens_per_s") or 0), "ckpt", r.get("checkpointing", r.get("gradient_checkpointing")), "rss B/p", r.get("peak_rss_bytes_per_param"))
PY
