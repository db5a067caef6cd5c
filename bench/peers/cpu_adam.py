#!/usr/bin/env python3
"""The peers of `zeroflow bench cpu-adam`: CPU AdamW steps of PyTorch and DeepSpeed.

Measures, on one flat fp32 parameter of N elements with an fp32 gradient and T threads, the
median step time and Gparam/s of

- torch.optim.AdamW(fused=True) on the CPU      ("torch-fused")
- torch.optim.AdamW(foreach=True) on the CPU    ("torch-foreach")
- deepspeed.ops.adam.DeepSpeedCPUAdam            ("deepspeed"; skipped, with the reason, if
  deepspeed cannot be imported; its C++ op is JIT-built with ninja on first use, outside timing)

Prints one JSON object per optimizer, with the fields of `zeroflow bench cpu-adam --json` that
apply: optimizer, params, threads, iters, median_s, gparams_per_s, bytes_per_param (28: read p, g,
m, v, write p, m, v), gb_per_s.

Usage: python3 bench/peers/cpu_adam.py [--params 5e8] [--threads T] [--iters 10] [--warmup 2]
                                       [--optimizers torch-fused,torch-foreach,deepspeed]
See bench/peers/README.md for running it on the GPU machine with DeepSpeed.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

OPTIMIZERS = ("torch-fused", "torch-foreach", "deepspeed")
BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=5e8, help="parameters (5e8 or 500000000)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads")
    parser.add_argument("--iters", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help="comma-separated subset of " + ", ".join(OPTIMIZERS),
    )
    args = parser.parse_args()
    args.optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    unknown = [name for name in args.optimizers if name not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown optimizers {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if args.params < 1 or args.threads < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--params, --threads and --iters must be positive, --warmup non-negative")
    return args


def random_nonzero(torch, n, low, high, generator):
    """n values with magnitudes log-uniform in [low, high) and random signs (never zero)."""
    magnitude = torch.empty(n, dtype=torch.float32)
    magnitude.uniform_(0.0, 1.0, generator=generator)
    magnitude.mul_(torch.log(torch.tensor(high / low))).exp_().mul_(low)
    sign = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int8)
    magnitude[sign == 0] *= -1.0
    return magnitude


def make_optimizer(name, param):
    import torch

    if name == "torch-fused":
        return torch.optim.AdamW([param], fused=True, **HYPER)
    if name == "torch-foreach":
        return torch.optim.AdamW([param], foreach=True, **HYPER)
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds its op on first use

    return DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)


def versions(name):
    import torch

    found = {"torch": torch.__version__}
    if name == "deepspeed":
        import deepspeed

        found["deepspeed"] = deepspeed.__version__
    return found


def bench(name, args):
    import torch

    n = int(args.params)
    generator = torch.Generator().manual_seed(0x5EED)
    param = torch.nn.Parameter(random_nonzero(torch, n, 0.5, 1.5, generator))
    param.grad = random_nonzero(torch, n, 1e-3, 1.0, generator)
    result = {"optimizer": name, "params": n, "threads": args.threads, "iters": args.iters}
    try:
        optimizer = make_optimizer(name, param)
        result.update(versions(name))
    except Exception as err:  # deepspeed missing or its op failing to build
        result["skipped"] = f"{type(err).__name__}: {err}"
        return result
    samples = []
    for step in range(args.warmup + args.iters):
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            samples.append(elapsed)
    median = statistics.median(samples)
    result.update(
        median_s=median,
        min_s=min(samples),
        gparams_per_s=n / median / 1e9,
        bytes_per_param=BYTES_PER_PARAM,
        gb_per_s=n * BYTES_PER_PARAM / median / 1e9,
    )
    del optimizer, param
    gc.collect()
    return result


def main():
    args = parse_args()
    # Before torch (and DeepSpeed's OpenMP op) start their thread pools.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder parses it
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions")
    import torch

    torch.set_num_threads(args.threads)
    for name in args.optimizers:
        print(json.dumps(bench(name, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
