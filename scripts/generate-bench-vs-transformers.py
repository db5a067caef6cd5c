#!/usr/bin/env python3
"""Generation speed of zeroflow beside transformers' `generate`, on the same random model in one
call (run on the GPU machine, where torch, transformers and a GPU are):

    python3 scripts/generate-bench-vs-transformers.py [--shape SHAPE] [--batch 1,16]
        [--prompt-len 16] [--new-tokens 32] [--device cuda] [--bin-dir DIR] [--seed 0]

SHAPE is `gpt2-124m` (GPT-2 small), `llama-1b` (Llama 3.2 1B's shape) or one of
scripts/generate-oracle.py's small kinds (`gpt2-odd`, `llama-gqa`, …). The model is built with
random weights by transformers and saved (float32 safetensors) in a temporary directory; then

- zeroflow first: `generate-bench DIR --device DEVICE` (crates/zeroflow-train/examples) on that
  directory, which measures the same two calls as transformers' below;
- transformers: the model in bfloat16 on the device (float32 on the CPU), each batch of prompts
  (the same ids as generate-bench's: prompt b, token i is (131 b + 17 i) mod 50) through
  `generate(do_sample=False)`: once with max_new_tokens=1 (the prefill), once with N new tokens
  (min_new_tokens=N, so that no end-of-text token stops it), after a warm-up of each.

Prints one JSON line per (system, batch): `system`, `shape`, `device`, `batch`, `prompt_len`,
`new_tokens`, `prefill_s`, `decode_s`, `decode_tokens_per_s` (the new tokens after the first,
of the whole batch, per second of the calls' difference), then a table. Numbers, not a check:
exit status 0 unless a run fails. zeroflow's example runs as `cargo run -q --release -p
zeroflow-train --example generate-bench --` unless --bin-dir names the directory holding it
(target/release/examples).
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def oracle():
    """scripts/generate-oracle.py as a module: its small kinds and their builder."""
    spec = importlib.util.spec_from_file_location("generate_oracle",
                                                  ROOT / "scripts/generate-oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(shape, seed):
    """The random model of `shape`, float32, evaluation mode."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    torch.manual_seed(seed)
    if shape == "gpt2-124m":
        config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif shape == "llama-1b":
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                             rope_theta=500000.0, tie_word_embeddings=True)
    else:
        return oracle().build(shape, seed)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()


def prompts(batch, prompt_len):
    return [[(b * 131 + i * 17) % 50 for i in range(prompt_len)] for b in range(batch)]


def time_transformers(model, device, batch, args):
    """transformers' prefill and decode times for one batch (after a warm-up of each)."""
    import torch
    ids = torch.tensor(prompts(batch, args.prompt_len), device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (batch, args.prompt_len + new_tokens), out.shape
        return time.perf_counter() - start

    run(1), run(args.new_tokens)
    prefill_s = run(1)
    total_s = run(args.new_tokens)
    return prefill_s, max(total_s - prefill_s, 1e-9)


def zeroflow_lines(args, directory):
    if args.bin_dir:
        command = [str(Path(args.bin_dir) / "generate-bench")]
    else:
        command = ["cargo", "run", "-q", "--release", "-p", "zeroflow-train", "--example",
                   "generate-bench", "--"]
    command += [str(directory), "--batch", args.batch, "--prompt-len", str(args.prompt_len),
                "--new-tokens", str(args.new_tokens), "--device", args.device]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"zeroflow's generate-bench failed: {done.stderr.strip()}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="gpt2-124m")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--bin-dir", help="directory of the built generate-bench example")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.shape, args.seed)
        model.save_pretrained(tmp, safe_serialization=True)
        # zeroflow first, before this process's torch has run a generation on the same cores
        # or device (on the 16-core host, zeroflow's llama-1b decoded at batch 1 at 7.2
        # tokens/s after transformers in the same call, 12.3 alone: BENCHMARKS.md).
        for line in zeroflow_lines(args, tmp):
            rows.append({"system": "zeroflow", "batch": line["batch"],
                         "prefill_s": line["prefill_s"], "decode_s": line["decode_s"],
                         "decode_tokens_per_s": line["decode_tokens_per_s"]})
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = model.to(args.device, dtype)
        model.generation_config.eos_token_id = None
        for batch in map(int, args.batch.split(",")):
            prefill_s, decode_s = time_transformers(model, args.device, batch, args)
            rows.append({"system": "transformers", "batch": batch, "prefill_s": prefill_s,
                         "decode_s": decode_s,
                         "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode_s})
    for row in rows:
        row.update(shape=args.shape, device=args.device, prompt_len=args.prompt_len,
                   new_tokens=args.new_tokens)
        print(json.dumps(row))
    print(f"\n{'system':<14}{'batch':>6}{'prefill s':>12}{'decode s':>12}{'decode tok/s':>14}")
    for row in sorted(rows, key=lambda r: (r["batch"], r["system"])):
        print(f"{row['system']:<14}{row['batch']:>6}{row['prefill_s']:>12.4f}"
              f"{row['decode_s']:>12.4f}{row['decode_tokens_per_s']:>14.1f}")


if __name__ == "__main__":
    main()
