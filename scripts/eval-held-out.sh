#!/usr/bin/env bash
# What the default evaluation set of a `.jsonl` measures when the file comes sorted, on the CPU:
# a tiny random Llama (a BPE tokenizer of 2,048 tokens trained on the data, `tokenizers`; the
# weights from `transformers`) fine-tuned for one epoch on records whose first half is Python
# source (the running Python's standard library, in pieces of about 2 kB) and whose second half
# is English licence text (Debian's /usr/share/doc/*/copyright), without --eval-data. The run's
# evaluation set is records held out across the file; the script then evaluates the trained model
# (`zeroflow eval`) on unseen records of each kind and of both, which the file's tail (the
# default before records were held out: the end of the last file) would not have been.
#
#   bash scripts/eval-held-out.sh [WORK_DIR]     (ZEROFLOW=path/to/zeroflow; ~5 min on 2 cores)
#
# Prints where each run's evaluation set comes from, its evaluations, and the three losses.
set -euo pipefail
work=${1:-$(mktemp -d)}
zeroflow=${ZEROFLOW:-target/release/zeroflow}
mkdir -p "$work"
python3 - "$work" <<'PY'
import glob, json, os, sys
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM

work = sys.argv[1]
stdlib = os.path.dirname(os.__file__)

def pieces(files, limit, size=2000):
    out, total = [], 0
    for path in files:
        try:
            text = open(path, encoding="utf-8", errors="ignore").read()
        except OSError:
            continue
        text = text.encode("ascii", "ignore").decode()
        for start in range(0, len(text), size):
            piece = text[start:start + size]
            if len(piece.strip()) > 100:
                out.append(piece)
                total += len(piece)
        if total > limit:
            break
    return out

code = pieces(sorted(glob.glob(stdlib + "/*.py")), 1_700_000)
prose = pieces(sorted(glob.glob("/usr/share/doc/*/copyright")), 1_700_000)
# Every tenth piece of each kind is kept out of the file, to evaluate on afterwards.
code_eval, code = code[::10], [p for i, p in enumerate(code) if i % 10]
prose_eval, prose = prose[::10], [p for i, p in enumerate(prose) if i % 10]
n = min(len(code), len(prose))
code, prose = code[:n], prose[:n]

def write(name, texts):
    with open(os.path.join(work, name), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

write("train.jsonl", code + prose)
k = min(len(code_eval), len(prose_eval))
write("code-eval.jsonl", code_eval[:k])
write("prose-eval.jsonl", prose_eval[:k])
write("mix-eval.jsonl", [t for pair in zip(code_eval[:k], prose_eval[:k]) for t in pair])
print(f"train.jsonl: {n} records of Python, then {n} of licence text; "
      f"eval files: {k} records of each kind unseen")

model_dir = os.path.join(work, "model")
os.makedirs(model_dir, exist_ok=True)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(code + prose, trainer)
tok.save(os.path.join(model_dir, "tokenizer.json"))
json.dump({"eos_token": "<|endoftext|>", "bos_token": None,
           "tokenizer_class": "PreTrainedTokenizerFast"},
          open(os.path.join(model_dir, "tokenizer_config.json"), "w"))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, tie_word_embeddings=False,
                     eos_token_id=tok.token_to_id("<|endoftext|>"))
LlamaForCausalLM(config).save_pretrained(model_dir)
PY
# BEFORE=path/to/an-earlier-zeroflow trains and evaluates the same way with that binary too (one
# from before records were held out evaluates on the file's tail).
for which in after ${BEFORE:+before}; do
    binary=$zeroflow
    [ "$which" = before ] && binary=$BEFORE
    run="$work/run-$which"
    "$binary" train --init-from "$work/model" --data "$work/train.jsonl" --seq 256 \
        --micro-batch 16 --epochs 1 --lr 3e-3 --eval-every 50 --save-every 0 --out "$run" \
        --force >"$work/log-$which.txt" 2>&1
    echo "== $which ($binary)"
    grep -o "eval: .*" "$work/log-$which.txt" | head -1
    python3 - "$run" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
print("the run's evaluations (step, loss):",
      [(r["step"], round(r["eval_loss"], 4)) for r in rows if "eval_loss" in r])
PY
    for kind in code prose mix; do
        printf '%s-eval.jsonl: ' "$kind"
        "$binary" eval "$run" --data "$work/$kind-eval.jsonl" --window 256 --json 2>/dev/null
    done
done
