#!/usr/bin/env python3
"""How fast the disk under a directory takes large sequential writes: 16 GiB of one random 64 MiB
block, written buffered then fsynced, and with O_DIRECT, by one writer and by several at once.

    python3 scripts/disk-write-probe.py DIR      (needs about 16 GiB free in DIR; the files are removed)
"""
import os, time, mmap, threading, sys
GiB = 1 << 30
buf = mmap.mmap(-1, 64 << 20)
buf.write(os.urandom(64 << 20))
def write(path, gib, direct=False, sync=True):
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    for _ in range(gib * 16):
        os.write(fd, buf)
    if sync:
        os.fsync(fd)
    os.close(fd)
def timed(name, fn, gib):
    t = time.time(); fn(); dt = time.time() - t
    print(f"{name}: {gib} GiB in {dt:.1f} s = {gib * GiB / dt / 1e9:.2f} GB/s", flush=True)
d = sys.argv[1]
timed("buffered + fsync, 1 writer", lambda: write(f"{d}/a", 16), 16)
os.remove(f"{d}/a")
timed("O_DIRECT, 1 writer", lambda: write(f"{d}/a", 16, direct=True), 16)
os.remove(f"{d}/a")
def two():
    ts = [threading.Thread(target=write, args=(f"{d}/{n}", 8)) for n in "ab"]
    [t.start() for t in ts]; [t.join() for t in ts]
timed("buffered + fsync, 2 writers", two, 16)
os.remove(f"{d}/a"); os.remove(f"{d}/b")
def four_direct():
    ts = [threading.Thread(target=write, args=(f"{d}/{n}", 4, True)) for n in "abcd"]
    [t.start() for t in ts]; [t.join() for t in ts]
timed("O_DIRECT, 4 writers", four_direct, 16)
for n in "abcd": os.remove(f"{d}/{n}")
