#!/usr/bin/env python3
"""Forward+backward of a model in PyTorch (Hugging Face GPT2LMHeadModel or LlamaForCausalLM, sdpa
attention, bf16 weights), no optimizer: the peer of `zeroflow bench gpt`.

    python3 bench/peers/gpt_fwd_bwd.py --model gpt-1.3b --micro-batch 8 --seq 1024
    python3 bench/peers/gpt_fwd_bwd.py --model llama-8b --micro-batch 4 --seq 2048 --gradient-checkpointing

Prints one JSON object: median seconds per forward+backward, tokens/s, peak GPU memory (GiB).
The model is randomly initialised (no download); the token ids are uniform random."""

import argparse
import json
import statistics
import time

from models import NAMES, build



def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-1.3b", choices=NAMES)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each layer's forward in backward (transformers' own)")
    args = parser.parse_args()

    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):
        model, vocab = build(args.model, context=args.seq)
    model = model.to(dtype=torch.bfloat16)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), device="cuda")
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        return loss

    times = []
    for i in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens_per_step = args.micro_batch * args.seq
    print(json.dumps({
        "system": "pytorch",
        "torch": torch.__version__,
        "model": args.model,
        "gradient_checkpointing": args.gradient_checkpointing,
        "parameters": sum(p.numel() for p in model.parameters()),
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "s_per_step_median": seconds,
        "tokens_per_s": tokens_per_step / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "times": times,
    }))


if __name__ == "__main__":
    main()
