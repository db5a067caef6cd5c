#!/usr/bin/env bash
# One device call: DeepSpeed ZenFlow and zeroflow ZenFlow at llama-1b (4 x 2048), with .gpu and
# .peers carried (BENCHMARKS.md, "The Llama family").
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/.gpu/out}; mkdir -p $OUT; export OUT
B=scripts/bench-vs-deepspeed.sh
MICRO_BATCH=4 SEQ=2048 STEPS=6 WARMUP=3 PARTS="deepspeed" DS_MODES="zenflow" timeout 135 bash $B llama-1b 2>&1 | grep -E "exit|^deepspeed" | tail -3
echo "at ${SECONDS}s"
MICRO_BATCH=4 SEQ=2048 STEPS=6 WARMUP=3 PARTS="zeroflow" MODES="zenflow" timeout 50 bash $B llama-1b 2>&1 | grep -E "exit|RATIO|^zeroflow" | tail -4
python3 - $OUT/bench.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); t = r.get("times") or []
    p90 = sorted(t)[min(len(t)-1, int(0.9*len(t)))] if t else None
    print(r.get("system"), r.get("mode"), "mean", r.get("s_per_step_mean"), "median", r.get("s_per_step_median"), "p90", p90, "tok/s", round(r.get("tokens_per_s") or 0), "times", [round(x,3) for x in t])
PY
echo "done ${SECONDS}s"
