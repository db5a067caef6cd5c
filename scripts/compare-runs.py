#!/usr/bin/env python3
"""Compares two `zeroflow train` run directories that trained on the same data with the same global
batch (e.g. one GPU with --micro-batch 8 and two GPUs with --micro-batch 4): their loss curves
(metrics.jsonl) and the weights of their last checkpoints (model.safetensors).

    python3 scripts/compare-runs.py BASE OTHER [--reference REF] [--label NAME]

BASE is the run the others are measured against. REF, if given, is a run that computes the same
thing in another order on the same device count (one GPU with --micro-batch 4 --accum 2): how far
it lands from BASE is the reordering noise of bf16 on that model, the scale against which OTHER's
distance is judged. The weights are compared as relative L2 distances (over all tensors, and the
worst tensor), and in bf16 units in the last place of BASE's value (the checkpoints hold bf16
weights widened to f32).

Verdict (one line starting `RESULT`): `match` when every common step's loss is within --loss-tol
(relative) of BASE's, and the weights' relative L2 distance is within the bound: twice REF's
distance (but at least one bf16 ulp, 2^-8) when REF is given, else --weight-tol.
Exit status 0 on `match`, 1 on `differ`, 2 when a run is missing or unreadable.
Needs numpy only (the safetensors format is read here)."""

import argparse
import json
import pathlib
import struct
import sys

import numpy as np

BF16_ULP = 2.0**-8


def losses(run):
    """The training loss of each logged step, by step."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def last_checkpoint(run):
    steps = sorted((run / "checkpoints").glob("step-*"))
    if not steps:
        raise FileNotFoundError(f"{run}: no checkpoints/step-*")
    return steps[-1]


def read_safetensors(path):
    """Every tensor of a safetensors file as a flat float64 array (F32, BF16 and F16)."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = body[start:end]
        dtype = entry["dtype"]
        if dtype == "F32":
            values = np.frombuffer(raw, dtype="<f4")
        elif dtype == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F16":
            values = np.frombuffer(raw, dtype="<f2")
        else:
            raise ValueError(f"{path}: {name} has dtype {dtype}")
        tensors[name] = values.astype(np.float64)
    return tensors


def ulps(base, other):
    """|other - base| in bf16 units in the last place of base (the spacing at base's exponent)."""
    _, exponent = np.frexp(base)
    spacing = np.ldexp(1.0, exponent - 8)
    return np.abs(other - base) / np.maximum(spacing, np.finfo(np.float32).tiny)


def weight_distance(base_dir, other_dir):
    """Relative L2 over all tensors, the worst tensor's, and the ulp figures."""
    base = read_safetensors(last_checkpoint(base_dir) / "model.safetensors")
    other = read_safetensors(last_checkpoint(other_dir) / "model.safetensors")
    if base.keys() != other.keys():
        raise ValueError(f"the tensors differ: {sorted(base.keys() ^ other.keys())[:5]}")
    diff2 = size2 = 0.0
    per_tensor = []
    all_ulps = []
    for name in sorted(base):
        a, b = base[name], other[name]
        if a.shape != b.shape:
            raise ValueError(f"{name}: {a.shape} vs {b.shape}")
        d2, s2 = float(np.sum((a - b) ** 2)), float(np.sum(a**2))
        diff2, size2 = diff2 + d2, size2 + s2
        per_tensor.append(((d2 / s2) ** 0.5 if s2 > 0 else float(d2 > 0) * float("inf"), name))
        all_ulps.append(ulps(a, b))
    all_ulps = np.concatenate(all_ulps)
    per_tensor.sort(reverse=True)
    return {
        "rel_l2": (diff2 / size2) ** 0.5,
        "worst_tensors": per_tensor[:3],
        "identical": float(np.mean(all_ulps == 0)),
        "within_1_ulp": float(np.mean(all_ulps <= 1)),
        "ulp_p99": float(np.percentile(all_ulps, 99)),
        "ulp_max": float(np.max(all_ulps)),
    }


def loss_distance(base, other):
    common = sorted(set(base) & set(other))
    if not common:
        return float("nan"), 0
    worst = max(abs(other[s] - base[s]) / abs(base[s]) for s in common)
    return worst, len(common)


def describe(name, w):
    worst = ", ".join(f"{n} {r:.2e}" for r, n in w["worst_tensors"])
    return (f"{name}: weights rel_l2={w['rel_l2']:.3e}; identical {w['identical']:.1%}, "
            f"within 1 bf16 ulp {w['within_1_ulp']:.1%}, p99 {w['ulp_p99']:.1f} ulp, "
            f"max {w['ulp_max']:.0f} ulp; worst tensors: {worst}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=pathlib.Path)
    parser.add_argument("other", type=pathlib.Path)
    parser.add_argument("--reference", type=pathlib.Path)
    parser.add_argument("--label", default="")
    parser.add_argument("--loss-tol", type=float, default=1e-2)
    parser.add_argument("--weight-tol", type=float, default=2e-2)
    args = parser.parse_args()
    label = f"{args.label} " if args.label else ""
    try:
        base_losses, other_losses = losses(args.base), losses(args.other)
        loss_rel, steps = loss_distance(base_losses, other_losses)
        weights = weight_distance(args.base, args.other)
        reference = None
        if args.reference:
            ref_loss_rel, _ = loss_distance(base_losses, losses(args.reference))
            reference = weight_distance(args.base, args.reference)
    except (OSError, ValueError, KeyError) as error:
        print(f"RESULT {label}compare: cannot compare: {error}")
        return 2
    print(f"{label}losses: max rel {loss_rel:.2e} over {steps} steps "
          f"(base {base_losses[min(base_losses)]:.4f} -> {base_losses[max(base_losses)]:.4f}, "
          f"other -> {other_losses[max(other_losses)]:.4f})")
    print(describe(f"{label}other vs base", weights))
    if reference is not None:
        print(f"{label}reference losses: max rel {ref_loss_rel:.2e}")
        print(describe(f"{label}reference vs base", reference))
        bound = max(2 * reference["rel_l2"], BF16_ULP)
        why = f"2 x reference {reference['rel_l2']:.2e}, at least 2^-8"
    else:
        bound, why = args.weight_tol, "--weight-tol"
    expected_steps = max(base_losses)
    ok = (steps == expected_steps and loss_rel <= args.loss_tol
          and weights["rel_l2"] <= bound)
    print(f"RESULT {label}{'match' if ok else 'differ'}: loss max_rel={loss_rel:.2e} "
          f"(tol {args.loss_tol:g}, {steps}/{expected_steps} steps) weights "
          f"rel_l2={weights['rel_l2']:.2e} (bound {bound:.2e}: {why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
