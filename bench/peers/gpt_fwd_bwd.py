#!/usr/bin/env python3
"""Forward+backward of a GPT-2-family model in PyTorch (Hugging Face GPT2LMHeadModel, sdpa
attention, bf16 weights), no optimizer: the peer of `zeroflow bench gpt`.

    python3 bench/peers/gpt_fwd_bwd.py --model gpt-1.3b --micro-batch 8 --seq 1024

Prints one JSON object: median seconds per forward+backward, tokens/s, peak GPU memory (GiB).
The model is randomly initialised (no download); the token ids are uniform random."""

import argparse
import json
import statistics
import time

SIZES = {
    # name: (n_layer, d_model, n_head, vocab, context)
    "gpt2-124m": (12, 768, 12, 50304, 1024),
    "gpt2-350m": (24, 1024, 16, 50304, 1024),
    "gpt2-774m": (36, 1280, 20, 50304, 1024),
    "gpt-1.3b": (24, 2048, 16, 50304, 1024),
    "gpt2-1.5b": (48, 1600, 25, 50304, 1024),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-1.3b", choices=sorted(SIZES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, d, n_head, vocab, context = SIZES[args.model]
    config = GPT2Config(
        n_layer=n_layer, n_embd=d, n_head=n_head, vocab_size=vocab, n_positions=context,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16)
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
