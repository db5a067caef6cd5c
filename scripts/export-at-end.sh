#!/usr/bin/env bash
# One device call: a full fine-tune of the Llama-3-8B shape on a disk too small for its
# checkpoints hands back its final weights anyway (`train --export`). zeroflow trains llama-8b
# from the seed with exact offload (the default device share), activation checkpointing and
# micro-batch 4 x 2048 of synthetic tokens for STEPS steps; a checkpoint of 8 B parameters takes
# 112 GB and the machine's disk has 64 GiB, so every save is refused (a warning) and the run goes
# on; at its end `--export` writes the weights (bf16, 16 GB in 5 GB shards) from the GPU.
# Reported: the warnings, the export's line (size, files, seconds), the peak RSS (VmHWM) against
# the plan's host total, and `transformers` loading the directory (no missing or unexpected
# weights) and its greedy continuation of a prompt beside `zeroflow generate --device cuda`'s.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/export-at-end.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
source scripts/rss-watch.sh
WORK=${WORK:-/tmp/export-at-end}
STEPS=${STEPS:-3}
rm -rf "$WORK" && mkdir -p "$WORK"
df -h /tmp | tail -1
args=(--device cuda --model llama-8b --config examples/configs/zero2-offload-bf16.json
    --micro-batch 4 --seq 2048 --activation-checkpointing --data synthetic --eval-every 0
    --log-every 1 --save-every 2 --steps "$STEPS" --out "$WORK/run" --export "$WORK/hf")
echo "== train --export (at ${SECONDS}s)"
$Z train "${args[@]}" >"$OUT/train.log" 2>&1 &
hwm=$(watch_rss $! /dev/null "")
report train "$OUT/train.log" "$hwm"
grep -E "WARN|wrote|ready|final|Error|error" "$OUT/train.log" | cut -c1-400
grep -h '"loss"' "$WORK/run/metrics.jsonl" | cut -c1-160
python3 -c "import json, sys; s = json.load(open(sys.argv[1]))
print('checkpoints refused:', s['checkpoints_refused'], 'exported:', s['exported'])" \
    "$WORK/run/summary.json"
ls -la "$WORK/hf"
echo "== transformers loads the directory (at ${SECONDS}s)"
python3 - "$WORK/hf" <<'PY' 2>&1 | grep -v Warning
import sys, time
import torch
from transformers import AutoModelForCausalLM
started = time.time()
model, info = AutoModelForCausalLM.from_pretrained(
    sys.argv[1], torch_dtype=torch.bfloat16, device_map="cuda", output_loading_info=True)
params = sum(p.numel() for p in model.parameters())
print(f"loaded {params} parameters ({model.dtype}) in {time.time() - started:.1f} s; missing "
      f"{info['missing_keys']}, unexpected {info['unexpected_keys']}, mismatched "
      f"{info['mismatched_keys']}")
prompt = torch.tensor([[128000, 791, 6460]], device="cuda")
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
print("transformers greedy:", out[0, 3:].tolist())
PY
echo "== zeroflow generate --device cuda (at ${SECONDS}s)"
$Z generate "$WORK/hf" --device cuda --prompt-tokens 128000,791,6460 --max-new-tokens 8 --no-stop \
    --json 2>"$OUT/generate.err" | cut -c1-200
tail -2 "$OUT/generate.err" | cut -c1-200
rm -rf "$WORK"
echo "== done at ${SECONDS}s"
