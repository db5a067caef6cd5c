#!/usr/bin/env python3
"""DeepSpeed ZeRO-2 training steps of a Hugging Face GPT2LMHeadModel or LlamaForCausalLM (sdpa
attention, bf16; shapes in models.py), the peer of `zeroflow bench step`:

    python3 bench/peers/ds_train.py --mode offload --model gpt-1.3b --micro-batch 8 --steps 12
    python3 bench/peers/ds_train.py --mode zenflow --model llama-1b --micro-batch 4 --seq 2048

`--gradient-checkpointing` turns on transformers' own (non-reentrant) checkpointing.

A custom size instead of a named one: `--n-layer 40 --d-model 4096 --n-head 32` (vocabulary 50304,
context 1024 unless `--vocab`/`--context` say otherwise), as scripts/largest-model.sh uses it;
`--init-device cuda` builds the model on the GPU instead of the CPU (faster for large models, and
without the CPU copy of the fp32 weights). With `--llama-kv-heads K --llama-ffn F` (and `--vocab`)
the custom size is a Llama shape instead (LlamaForCausalLM, untied, head width d/heads).

Modes: `gpu` (ZeRO-2, optimizer on the GPU), `offload` (ZeRO-2 + CPU optimizer offload, pinned),
`zenflow` (ZeRO-2 + offload + ZenFlow: topk 0.05, update_interval 4, overlap_step). Prints one JSON
object: median and mean seconds per optimizer step (after the warm-up steps), tokens/s, peak GPU
memory. Needs DeepSpeed on PYTHONPATH (bench/peers/README.md) and, for one process,
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=<free port>.

Several processes, one per GPU, under torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; deepspeed.initialize then initialises torch.distributed from them):

    OMP_NUM_THREADS=16 python3 -m torch.distributed.run --nproc-per-node 2 \
        bench/peers/ds_train.py --mode offload --model gpt-1.3b --micro-batch 8

`--micro-batch` is per GPU. Each rank uses the GPU of its LOCAL_RANK and trains on its own rows of
one global batch; only rank 0 prints, and its tokens/s counts every rank's tokens (over the slowest
rank's mean step). Set OMP_NUM_THREADS to the host's cores / the processes: torchrun sets it to 1
with several processes unless it is set, which would leave DeepSpeed's CPU Adam one thread."""

import argparse
import json
import os
import resource
import statistics
import time

from models import NAMES, build


def cpu_steal():
    """CPU seconds the hypervisor has taken from this machine, summed over its CPUs (the `steal`
    column of /proc/stat), and the CPUs listed there, as `zeroflow bench step` reads them; None
    where there is none."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat]
        fields = next(line for line in lines if line[:1] == ["cpu"])
        cpus = sum(1 for line in lines if line and line[0].startswith("cpu")) - 1
        return int(fields[8]) / os.sysconf("SC_CLK_TCK"), cpus
    except (OSError, StopIteration, IndexError, ValueError, ZeroDivisionError):
        return None


def ds_config(mode, micro_batch):
    zero = {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    }
    if mode in ("offload", "zenflow"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if mode == "zenflow":
        zero["zenflow"] = {
            "topk_ratio": 0.05,
            "update_interval": 4,
            "full_warm_up_rounds": 0,
            "overlap_step": True,
        }
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": zero,
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="offload", choices=["gpu", "offload", "zenflow"])
    parser.add_argument("--model", default="gpt-1.3b", choices=NAMES)
    parser.add_argument("--n-layer", type=int, help="custom size: layers (with --d-model, --n-head)")
    parser.add_argument("--d-model", type=int, help="custom size: width")
    parser.add_argument("--n-head", type=int, help="custom size: attention heads")
    parser.add_argument("--vocab", type=int, default=50304, help="custom size: vocabulary")
    parser.add_argument("--context", type=int, default=1024, help="custom size: positions")
    parser.add_argument("--llama-kv-heads", type=int,
                        help="a custom size is a Llama shape (LlamaForCausalLM, untied, head "
                             "width d/heads) with this many key/value heads")
    parser.add_argument("--llama-ffn", type=int, help="a custom Llama shape's intermediate size")
    parser.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model is built before deepspeed.initialize")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each layer's forward in backward (transformers' own)")
    args = parser.parse_args()
    custom = (args.n_layer, args.d_model, args.n_head)
    if any(custom) and not all(custom):
        parser.error("a custom size needs --n-layer, --d-model and --n-head")
    if all(custom) and args.d_model % args.n_head:
        parser.error("--d-model must be a multiple of --n-head")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import deepspeed
    import torch

    # torchrun's variables (one process without them). The GPU is chosen before anything touches
    # CUDA, so that no rank opens a context on GPU 0.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    name = f"custom-{args.n_layer}x{args.d_model}" if all(custom) else args.model
    llama = None
    if args.llama_kv_heads:
        if not (all(custom) and args.llama_ffn):
            parser.error("a custom Llama shape needs --n-layer, --d-model, --n-head, --llama-ffn")
        name = f"custom-llama-{args.n_layer}x{args.d_model}"
        llama = (*custom, args.llama_kv_heads, args.llama_ffn, args.vocab, False)
    torch.manual_seed(0)
    with torch.device(args.init_device):
        model, vocab = build(
            args.model, context=args.seq,
            custom=(*custom, args.vocab, args.context) if all(custom) else None, llama=llama)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = model.config
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config=ds_config(args.mode, args.micro_batch))
    # One global batch of world × micro-batch rows, the same on every rank (the seed); each rank
    # takes its own rows.
    tokens = torch.randint(0, vocab, (world * args.micro_batch, args.seq + 1), device=engine.device)
    tokens = tokens[rank * args.micro_batch:(rank + 1) * args.micro_batch]
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times, losses, steal, cpus = [], [], [], None
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        steal_before = cpu_steal()
        start = time.perf_counter()
        logits = engine(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.view(-1))
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            steal_after = cpu_steal()
            known = None not in (steal_before, steal_after)
            steal.append(steal_after[0] - steal_before[0] if known else None)
            cpus = steal_after[1] if known else None
        if world > 1:
            # The ranks' mean, after the clock stopped.
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    tokens_per_step = world * args.micro_batch * args.seq
    mean = statistics.mean(times)
    slowest = mean
    if world > 1:
        slowest = torch.tensor(mean, device=engine.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        slowest = slowest.item()
    # Peak resident set of this process (ru_maxrss is in KiB on Linux). ZenFlow's and the
    # offload's worker processes, if any, are not included.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank != 0:
        return
    print(json.dumps({
        "system": "deepspeed",
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "mode": args.mode,
        "model": name,
        "n_layer": config.num_hidden_layers,
        "d_model": config.hidden_size,
        "n_head": config.num_attention_heads,
        "gradient_checkpointing": args.gradient_checkpointing,
        "init_device": args.init_device,
        "world_size": world,
        "parameters": sum(p.numel() for p in model.parameters()),
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "tokens_per_step": tokens_per_step,
        "s_per_step_median": statistics.median(times),
        "s_per_step_mean": mean,
        "s_per_step_p90": sorted(times)[min(len(times) - 1, int(0.9 * len(times)))],
        "tokens_per_s": tokens_per_step / slowest,
        "tokens_per_s_per_gpu": tokens_per_step / slowest / world,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_rss_bytes": rss,
        "peak_rss_bytes_per_param": rss / sum(p.numel() for p in model.parameters()),
        "times": times,
        "losses": losses,
        # What the hypervisor took from the host's CPUs in each timed step, and over them as a
        # fraction of the host's CPU time (the offloaded CPU Adam slows by it), as zeroflow's rows.
        "host_steal_s_per_step": steal,
        "host_steal_fraction": None if None in steal or not cpus
        else sum(steal) / (sum(times) * cpus),
    }))


if __name__ == "__main__":
    main()
