#!/usr/bin/env bash
# What reading the rows in a shuffled order (`train --shuffle`, the default) does for a run on data
# that comes sorted, on the CPU: a byte-level GPT trained for one epoch on a file whose first half
# is Python source (the running Python's standard library) and whose second half is English
# licence text (Debian's /usr/share/doc/*/copyright), evaluated on the held-out ends of both; once
# shuffled and once in file order (`--shuffle=off`), the same seed and schedule.
#
#   bash scripts/shuffle-order.sh [WORK_DIR]      (ZEROFLOW=path/to/zeroflow; ~7 min a run on 2 cores)
#
# Prints each run's evaluations (step, eval loss in nats per byte) and its final line.
set -euo pipefail
work=${1:-$(mktemp -d)}
zeroflow=${ZEROFLOW:-target/release/zeroflow}
mkdir -p "$work"
python3 - "$work" <<'PY'
import glob, os, sys
work = sys.argv[1]
stdlib = os.path.dirname(os.__file__)
def take(files, limit):
    out, size = [], 0
    for path in files:
        try:
            text = open(path, encoding="utf-8", errors="ignore").read()
        except OSError:
            continue
        text = text.encode("ascii", "ignore").decode()
        out.append(text)
        size += len(text)
        if size > limit:
            break
    return "".join(out)
code = take(sorted(glob.glob(stdlib + "/*.py")), 1_700_000)
prose = take(sorted(glob.glob("/usr/share/doc/*/copyright")), 1_700_000)
held = 150_000
code, code_held, prose, prose_held = code[:-held], code[-held:], prose[:-held], prose[-held:]
half = min(len(code), len(prose))
open(os.path.join(work, "train.txt"), "w").write(code[:half] + prose[:half])
open(os.path.join(work, "eval.txt"), "w").write(code_held + prose_held)
print(f"train.txt: {half} bytes of Python, then {half} of licence text; eval.txt: {held} + {held}")
PY
model='{"n_layer":4,"n_head":4,"d_model":128,"vocab_size":256,"context":256}'
bytes=$(stat -c %s "$work/train.txt")
steps=$(( (bytes - 1) / (16 * 256) ))   # one epoch
for order in on off; do
    "$zeroflow" train --model "$model" --data "$work/train.txt" --eval-data "$work/eval.txt" \
        --eval-tokens 300000 --seq 256 --micro-batch 16 --steps "$steps" --eval-every 95 \
        --save-every 0 --shuffle=$order --out "$work/run-$order" --force >"$work/log-$order.txt" 2>&1
    echo "--shuffle=$order: $(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print([(r['step'], round(r['eval_loss'], 4)) for r in rows if 'eval_loss' in r])" \
        "$work/run-$order/metrics.jsonl")"
    tail -1 "$work/log-$order.txt"
done
