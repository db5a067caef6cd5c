#!/usr/bin/env bash
# Real text on the GPU machine, which has no network: its Python standard library (every .py file
# under /usr/lib/python3*), tokenized with GPT-2's BPE (`zeroflow tokenize --tokenizer gpt2`), the
# last 300 files held out. Writes WORK/train and WORK/eval (token shards) and WORK/text/{train,eval}.txt,
# the tokenize logs into $OUT, and prints one line on the corpus. Used by the GPU scripts that train
# on real text (llama-8b-train.sh, moments-loss.sh, speculation-redone.sh):
#
#   ZEROFLOW=.gpu/zeroflow OUT=... bash scripts/python-corpus.sh WORK
set -uo pipefail
WORK=${1:?usage: python-corpus.sh WORK}
Z=${ZEROFLOW:-$PWD/.gpu/zeroflow}
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$WORK/text" "$OUT"
find /usr/lib/python3* -name '*.py' 2>/dev/null | sort >"$WORK/files.txt"
files=$(wc -l <"$WORK/files.txt")
head -n $((files - 300)) "$WORK/files.txt" | xargs cat >"$WORK/text/train.txt" 2>/dev/null
tail -n 300 "$WORK/files.txt" | xargs cat >"$WORK/text/eval.txt" 2>/dev/null
for part in train eval; do
    "$Z" tokenize --tokenizer gpt2 "$WORK/text/$part.txt" --out "$WORK/$part" >"$OUT/tokenize-$part.log" 2>&1 ||
        { echo "tokenize $part failed:"; tail -5 "$OUT/tokenize-$part.log"; exit 1; }
done
echo "corpus: $files files, $(stat -c %s "$WORK/text/train.txt") bytes trained on," \
    "$(stat -c %s "$WORK/text/eval.txt") held out"
