#!/usr/bin/env bash
# One device call: the host memory of a full fine-tune that starts from a Hugging Face directory
# (`train --init-from`), its BF16 weights read straight into the run's bf16. A random model of the
# Llama-3-8B shape is written in bfloat16 by `transformers` (`save_pretrained`, 5 GB shards); then
# `zeroflow train --init-from` trains it with exact offload (the default device share),
# activation checkpointing, micro-batch 4 x 2048 of synthetic tokens, and is stopped once its step
# 1 is recorded (a checkpoint of 8 B parameters does not fit the machine's 64 GiB disk). Reported:
# the plan's lines, the peak RSS (VmHWM), the times the run logs, the loss of step 1. Then
# `zeroflow generate` on the GPU continues a prompt with the same directory (8 new tokens), with
# the binary to compare with (.gpu/before/zeroflow, where there is one) and this one: each one's
# peak RSS and tokens. TRAIN=0 leaves the training run out; EVAL=1 adds `zeroflow eval --device
# cuda` of the directory over 87 KiB of random text read as bytes (windows of 2048), with its peak
# RSS and loss, for each binary.
#
# Here: bash scripts/gpu-check.sh. There: bash scripts/init-from-memory.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
source scripts/rss-watch.sh
WORK=${WORK:-/tmp/init-from-memory}
rm -rf "$WORK" && mkdir -p "$WORK"
python3 - "$WORK/hf" <<'PY' 2>&1 | grep -v Warning
import sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
started = time.time()
config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[1], max_shard_size="5GB")
params = sum(p.numel() for p in model.parameters())
print(f"wrote a random Llama-3-8B-shaped model ({params} parameters, bfloat16) in "
      f"{time.time() - started:.0f} s")
PY
du -sh "$WORK/hf"
free -g | head -2
df -h /tmp | tail -1
args=(--device cuda --config examples/configs/zero2-offload-bf16.json --micro-batch 4 --seq 2048
    --activation-checkpointing --data synthetic --eval-every 0 --log-every 1 --init-from "$WORK/hf")
if [[ ${TRAIN:-1} == 1 ]]; then
    echo "== train --init-from (at ${SECONDS}s)"
    $Z train "${args[@]}" --steps 2 --out "$WORK/run" >"$OUT/init-from.log" 2>&1 &
    hwm=$(watch_rss $! "$WORK/run/metrics.jsonl" '"step":1,')
    report init-from "$OUT/init-from.log" "$hwm"
    grep -E "device share|read|built|ready|restor" "$OUT/init-from.log" | head -8 | cut -c1-200
    grep -h '"loss"' "$WORK/run/metrics.jsonl" | cut -c1-200
    tail -3 "$OUT/init-from.log" | cut -c1-300
fi
for bin in .gpu/before/zeroflow "$Z"; do
    [[ -x $bin ]] || continue
    echo "== generate --device cuda with $bin (at ${SECONDS}s)"
    "$bin" generate "$WORK/hf" --device cuda --prompt-tokens 128000,791,6460 --max-new-tokens 8 \
        --json >"$OUT/generate.json" 2>"$OUT/generate.err" &
    hwm=$(watch_rss $! /dev/null "")
    echo "generate: peak RSS $(python3 -c "print(f'{$hwm / 2**20:.2f}')") GiB"
    cut -c1-200 "$OUT/generate.json"
    tail -2 "$OUT/generate.err" | cut -c1-200
    if [[ ${EVAL:-0} == 1 ]]; then
        echo "== eval --device cuda with $bin (at ${SECONDS}s)"
        [[ -f $WORK/text.txt ]] || head -c 65537 /dev/urandom | base64 >"$WORK/text.txt"
        "$bin" eval "$WORK/hf" --device cuda --data "$WORK/text.txt" --window 2048 --json \
            >"$OUT/eval.json" 2>"$OUT/eval.err" &
        hwm=$(watch_rss $! /dev/null "")
        echo "eval: peak RSS $(python3 -c "print(f'{$hwm / 2**20:.2f}')") GiB"
        cut -c1-200 "$OUT/eval.json"
        tail -2 "$OUT/eval.err" | cut -c1-200
    fi
done
rm -rf "$WORK"
echo "== done at ${SECONDS}s"
