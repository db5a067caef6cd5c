#!/usr/bin/env python3
"""Reads a zeroflow run directory's TensorBoard event file(s) with the `tensorboard` package
(EventAccumulator) and compares every scalar with metrics.jsonl.

    python3 scripts/tensorboard-check.py RUN_DIR

The tags: train/loss, train/lr, train/grad_norm (steps that were not skipped), train/loss_scale,
train/tokens_per_s, train/epoch (runs on files; one per step) and eval/loss (one per evaluation). Values are float32 in the
event file, so each must equal metrics.jsonl's to float32 precision (relative 1e-6). Exit status
1 on a missing tag, a different set of steps or a different value.
"""

import json
import math
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/loss_scale": "loss_scale",
    "train/tokens_per_s": "tokens_per_s",
    "train/epoch": "epoch",
    "eval/loss": "eval_loss",
}


def main():
    run = Path(sys.argv[1])
    files = sorted(run.glob("events.out.tfevents.*"))
    if not files:
        sys.exit(f"no event file in {run}")
    expected = {tag: {} for tag in TAGS}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for tag, key in TAGS.items():
            if record.get(key) is not None:
                expected[tag][record["step"]] = record[key]
    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})
    accumulator.Reload()
    have = accumulator.Tags()["scalars"]
    failures = 0
    for tag, by_step in expected.items():
        if not by_step:
            continue
        if tag not in have:
            print(f"FAIL {tag}: not in the event files ({len(by_step)} values in metrics.jsonl)")
            failures += 1
            continue
        got = {e.step: e.value for e in accumulator.Scalars(tag)}
        if set(got) != set(by_step):
            print(f"FAIL {tag}: steps {sorted(got)[:5]}... vs {sorted(by_step)[:5]}...")
            failures += 1
            continue
        worst = max(abs(got[s] - v) / max(abs(v), 1e-30) for s, v in by_step.items())
        ok = worst <= 1e-6 and all(math.isfinite(got[s]) for s in got)
        print(f"{'ok  ' if ok else 'FAIL'} {tag}: {len(got)} values, worst relative error {worst:.2e}")
        failures += not ok
    print(f"{len(files)} event file(s): {'all match' if failures == 0 else f'{failures} tag(s) differ'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
