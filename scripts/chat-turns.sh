#!/usr/bin/env bash
# A conversation on the CPU, timed: `zeroflow generate --chat` reads eight user messages from
# standard input after a system message of about 1,300 tokens, on a random Qwen3-shaped model of
# 76 M parameters (12 layers, hidden 768, 12 query heads over 4 key/value heads, tied; a
# byte-level BPE of 2,048 tokens trained on the messages' words, with a ChatML template; the
# weights from `transformers`), greedy, 32 new tokens a reply. Prints each binary's wall time
# and peak RSS, whether their replies are the same, and (ZEROFLOW_LOG=debug) how many of each
# turn's tokens ran.
#
#   bash scripts/chat-turns.sh [WORK_DIR]   (ZEROFLOW=path/to/zeroflow, default target/release;
#                                            BEFORE=path/to/an-earlier-zeroflow to compare;
#                                            DEVICE=cuda on a GPU)
set -euo pipefail
work=${1:-$(mktemp -d)}
zeroflow=${ZEROFLOW:-target/release/zeroflow}
mkdir -p "$work"
python3 - "$work" <<'PY'
import json, os, sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

work = sys.argv[1]
messages = [
    "Tell me about the history of the river and the town that grew beside it.",
    "Why did the mill close, and what happened to the workers afterwards?",
    "Which of those families still live there today?",
    "Describe the old bridge in detail, stone by stone.",
    "What would you change about the town square if you could?",
    "Summarise everything we have talked about so far in a few sentences.",
    "Now write a short poem about the river in winter.",
    "Thank you. One last question: what should a visitor see first?",
]
system = " ".join(
    ["You are a careful assistant for the town archive. Answer from the records, cite the year "
     "of each record you use, say when the records are silent, and keep to plain language."] * 36)
open(os.path.join(work, "messages.txt"), "w").write("\n".join(messages) + "\n")
open(os.path.join(work, "system.txt"), "w").write(system)

model_dir = os.path.join(work, "model")
os.makedirs(model_dir, exist_ok=True)
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=specials,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(messages + [system] * 4, trainer)
tok.save(os.path.join(model_dir, "tokenizer.json"))
template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template,
           "tokenizer_class": "PreTrainedTokenizerFast"},
          open(os.path.join(model_dir, "tokenizer_config.json"), "w"))
torch.manual_seed(0)
config = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=768, intermediate_size=2048,
                     num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                     head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                     eos_token_id=tok.token_to_id("<|im_end|>"))
model = Qwen3ForCausalLM(config)
model.save_pretrained(model_dir)
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; "
      f"system message {len(tok.encode(system).ids)} tokens")
PY
device=${DEVICE:-cpu}
for which in after ${BEFORE:+before}; do
    binary=$zeroflow
    [ "$which" = before ] && binary=$BEFORE
    /usr/bin/time -f "$which ($binary): wall %e s, peak RSS %M KB" "$binary" generate \
        "$work/model" --chat --system "$(cat "$work/system.txt")" --max-new-tokens 32 \
        --temperature 0 --json --device "$device" <"$work/messages.txt" \
        >"$work/replies-$which.jsonl" 2>"$work/time-$which.txt"
    tail -n 1 "$work/time-$which.txt"
done
if [ -n "${BEFORE:-}" ]; then
    cmp -s "$work/replies-after.jsonl" "$work/replies-before.jsonl" &&
        echo "the same replies" || echo "the replies differ"
fi
ZEROFLOW_LOG=debug "$zeroflow" generate "$work/model" --chat --system "$(cat "$work/system.txt")" \
    --max-new-tokens 32 --temperature 0 --device "$device" <"$work/messages.txt" 2>&1 \
    >/dev/null | grep -o "turn [0-9]*: .* tokens run"
