#!/usr/bin/env python3
"""Compares two zeroflow checkpoints bit for bit: model.safetensors and every
optim/rank-R.safetensors (master weights and Adam moments). For each tensor that differs, prints
how many elements differ, the largest difference in units in the last place of its dtype, the
largest relative difference, and where the differing elements lie (first and last index, as a
fraction of the tensor: a device share's elements are the partition's last).

    python3 scripts/compare-checkpoints.py CHECKPOINT_A CHECKPOINT_B

The files are read through memory maps, a slice at a time, so that a checkpoint of tens of GB
compares in bounded memory. Needs numpy only. The last line starts `STATE` and says `identical`
(exit 0) or `differ` (exit 1); exit 2 when a file is missing or the two disagree in layout."""

import json
import pathlib
import struct
import sys

import numpy as np

SLICE = 1 << 26  # elements compared at a time
BITS = {"F32": np.uint32, "BF16": np.uint16, "F16": np.uint16}
FLOAT = {"F32": np.float32, "F16": np.float16}


def tensors(path):
    """name -> (dtype, element count, byte offset in the file) of a safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        width = np.dtype(BITS[entry["dtype"]]).itemsize
        out[name] = (entry["dtype"], (end - start) // width, base + start)
    return out


def as_f32(bits, dtype):
    if dtype == "BF16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(FLOAT[dtype]).astype(np.float32)


def ordered(bits, dtype):
    """Integers whose difference is the distance in units in the last place (sign-magnitude
    floats mapped onto a line)."""
    width = 8 * np.dtype(BITS[dtype]).itemsize
    wide = bits.astype(np.int64)
    sign = wide >> (width - 1)
    magnitude = wide & ((1 << (width - 1)) - 1)
    return np.where(sign == 1, -magnitude, magnitude)


def compare_file(a, b, label):
    """Prints the differing tensors of two files; gives whether they are identical."""
    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys() or any(ta[k][:2] != tb[k][:2] for k in ta):
        print(f"STATE {label}: the two files hold different tensors")
        sys.exit(2)
    ma, mb = np.memmap(a, dtype=np.uint8, mode="r"), np.memmap(b, dtype=np.uint8, mode="r")
    same = True
    for name, (dtype, count, offset) in ta.items():
        offset_b = tb[name][2]
        kind = BITS[dtype]
        width = np.dtype(kind).itemsize
        differ, worst_ulp, worst_rel, first, last = 0, 0, 0.0, None, None
        for start in range(0, count, SLICE):
            n = min(SLICE, count - start)
            xa = ma[offset + start * width:offset + (start + n) * width].view(kind)
            xb = mb[offset_b + start * width:offset_b + (start + n) * width].view(kind)
            where = np.flatnonzero(xa != xb)
            if where.size == 0:
                continue
            differ += where.size
            first = start + where[0] if first is None else first
            last = start + where[-1]
            da, db = xa[where], xb[where]
            worst_ulp = max(worst_ulp, int(np.abs(ordered(da, dtype) - ordered(db, dtype)).max()))
            fa, fb = as_f32(da, dtype).astype(np.float64), as_f32(db, dtype).astype(np.float64)
            rel = np.abs(fa - fb) / np.maximum(np.abs(fa), np.finfo(np.float32).tiny)
            worst_rel = max(worst_rel, float(np.nanmax(rel)))
        if differ:
            same = False
            print(f"STATE {label} {name}: {differ} of {count} {dtype} elements differ "
                  f"({differ / count:.2e}); at most {worst_ulp} ulp, relative {worst_rel:.2e}; "
                  f"from index {first} ({first / count:.4f}) to {last} ({last / count:.4f})")
    return same


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    a, b = map(pathlib.Path, sys.argv[1:])
    names = ["model.safetensors"] + sorted(
        str(p.relative_to(a)) for p in (a / "optim").glob("rank-*.safetensors"))
    same = True
    for name in names:
        if not (a / name).exists() or not (b / name).exists():
            print(f"STATE {name}: missing in one checkpoint")
            sys.exit(2)
        same &= compare_file(a / name, b / name, name)
    print(f"STATE {'identical' if same else 'differ'}: {a} against {b}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
