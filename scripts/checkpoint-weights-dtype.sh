#!/usr/bin/env bash
# One device call: a GPU run's checkpoint with its weights in the type the run trains in (bf16)
# against a binary that widened them to f32. A (default .gpu/before/zeroflow) and B (the staged
# binary) each train MODEL (default llama-1b) for STEPS (default 2) steps of exact offload on
# synthetic data (`examples/configs/zero2-offload-bf16.json`, micro-batch 4 x 2048) and save; for
# each checkpoint: its bytes, model.safetensors' bytes and dtypes, the save's time. B then resumes
# A's checkpoint and its own (`--steps STEPS+2 --extend-schedule`, stopped once step STEPS+1 is
# recorded, as scripts/resume-memory.sh does): the resumed losses. Each binary exports its own
# checkpoint and B exports A's too; `scripts/hf-check.py load` loads each with transformers, and
# the exports' tensors are compared value for value. Last, gpt2-124m (GPT-2's export copies the
# checkpoint's model file) trained by B (micro-batch 4 x 1024), exported and loaded the same way.
# PARTS (default "llama gpt2") picks the parts.
#
# Here: bash scripts/gpu-check.sh, and the binary to compare with at .gpu/before/zeroflow.
# There: bash scripts/checkpoint-weights-dtype.sh   carry: [".gpu"]
cd "$(dirname "$0")/.." && source scripts/gpu-env.sh
A=${A:-$PWD/.gpu/before/zeroflow}
B=${B:-$Z}
MODEL=${MODEL:-llama-1b}
STEPS=${STEPS:-2}
WORK=${WORK:-/tmp/checkpoint-dtype}
rm -rf "$WORK" && mkdir -p "$WORK"
df -h /tmp | tail -1
PARTS=${PARTS:-llama gpt2}
common=(--device cuda --config examples/configs/zero2-offload-bf16.json --micro-batch 4
    --data synthetic --eval-every 0 --log-every 1)
step_dir() { printf '%s/checkpoints/step-%08d' "$1" "$2"; }
dtypes() { # dtypes FILE: the dtypes of a safetensors file's tensors
    python3 -c 'import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
print(sorted({v["dtype"] for k, v in h.items() if k != "__metadata__"}))' "$1"
}
resume() { # resume BINARY CHECKPOINT NAME: one resumed step, stopped before it saves
    local metrics
    metrics="$(dirname "$(dirname "$2")")/metrics.jsonl"
    "$1" train "${common[@]}" --seq 2048 --resume "$2" --steps $((STEPS + 2)) --extend-schedule \
        >"$OUT/$3.log" 2>&1 &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        grep -q "\"step\":$((STEPS + 1))," "$metrics" 2>/dev/null && kill -9 "$pid" 2>/dev/null
        sleep 0.2
    done
    wait "$pid" 2>/dev/null
    echo "$3: $(grep "\"step\":$((STEPS + 1))," "$metrics" | cut -c1-110)"
}

for side in A B; do
    [[ $PARTS == *llama* ]] || break
    bin=${!side}
    echo "== $side ($bin): $MODEL, $STEPS steps, saved (at ${SECONDS}s)"
    "$bin" train "${common[@]}" --seq 2048 --model "$MODEL" --steps "$STEPS" --out "$WORK/$side" \
        >"$OUT/$side-train.log" 2>&1 || tail -5 "$OUT/$side-train.log"
    ckpt=$(step_dir "$WORK/$side" "$STEPS")
    echo "$side: checkpoint $(du -sb "$ckpt" | cut -f1) B, model.safetensors" \
        "$(stat -c %s "$ckpt/model.safetensors") B $(dtypes "$ckpt/model.safetensors")"
    grep -h "saved .* in " "$OUT/$side-train.log" | sed 's/.*INFO //' | cut -c1-160
    grep -h '"loss"' "$WORK/$side/metrics.jsonl" | cut -c1-110
done

if [[ $PARTS == *llama* ]]; then
echo "== B resumes A's checkpoint and its own (at ${SECONDS}s)"
resume "$B" "$(step_dir "$WORK/A" "$STEPS")" B-resumes-A
resume "$B" "$(step_dir "$WORK/B" "$STEPS")" B-resumes-B

echo "== exports (at ${SECONDS}s)"
for pair in "A A" "B B" "B A"; do
    read -r who what <<<"$pair"
    bin=${!who}
    started=$SECONDS
    "$bin" export "$(step_dir "$WORK/$what" "$STEPS")" --out "$WORK/hf-$who-$what" \
        >"$OUT/export-$who-$what.log" 2>&1 || tail -3 "$OUT/export-$who-$what.log"
    echo "$who exports $what's checkpoint: $(du -sb "$WORK/hf-$who-$what" | cut -f1) B in" \
        "$((SECONDS - started)) s, $(dtypes "$(ls "$WORK/hf-$who-$what"/*.safetensors | head -1)")"
done
cmp -s <(cd "$WORK/hf-A-A" && sha256sum ./*.safetensors) \
    <(cd "$WORK/hf-B-A" && sha256sum ./*.safetensors) &&
    echo "B's export of A's checkpoint: the same files as A's" ||
    echo "B's export of A's checkpoint DIFFERS from A's"
python3 - "$WORK/hf-A-A" "$WORK/hf-B-B" <<'EOF'
import sys
import torch
from safetensors.torch import load_file
import glob, os
def tensors(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a.keys() == b.keys(), "the exports name different tensors"
equal = all(torch.equal(a[k].float(), b[k].float()) for k in a)
print(f"exports of A (f32) and B (bf16): {len(a)} tensors, equal values: {equal}")
EOF
for dir in hf-A-A hf-B-B; do
    python3 scripts/hf-check.py load "$WORK/$dir" 2>&1 | tail -2 | sed "s|^|$dir: |"
done

fi

if [[ $PARTS == *gpt2* ]]; then
for side in A B; do
    bin=${!side}
    echo "== gpt2-124m, $side (at ${SECONDS}s)"
    "$bin" train "${common[@]}" --seq 1024 --model gpt2-124m --steps "$STEPS" \
        --out "$WORK/gpt2-$side" >"$OUT/gpt2-$side-train.log" 2>&1 || tail -5 "$OUT/gpt2-$side-train.log"
    ckpt=$(step_dir "$WORK/gpt2-$side" "$STEPS")
    echo "gpt2-124m $side: checkpoint $(du -sb "$ckpt" | cut -f1) B, model.safetensors" \
        "$(stat -c %s "$ckpt/model.safetensors") B $(dtypes "$ckpt/model.safetensors")"
    "$bin" export "$ckpt" --out "$WORK/hf-gpt2-$side" >"$OUT/export-gpt2-$side.log" 2>&1 ||
        tail -3 "$OUT/export-gpt2-$side.log"
    python3 scripts/hf-check.py load "$WORK/hf-gpt2-$side" 2>&1 | tail -1 | sed "s|^|hf-gpt2-$side: |"
    grep -h torch_dtype "$WORK/hf-gpt2-$side/config.json"
done
python3 - "$WORK/hf-gpt2-A" "$WORK/hf-gpt2-B" <<'EOF'
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(f"{d}/model.safetensors") for d in sys.argv[1:])
equal = a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
print(f"gpt2-124m exports of A and B: {len(a)} tensors, equal values: {equal}")
EOF
fi
[[ ${KEEP:-0} == 1 ]] || rm -rf "$WORK"
echo "== done at ${SECONDS}s"
