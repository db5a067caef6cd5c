#!/usr/bin/env python3
"""Compares zeroflow's generation and evaluation with `transformers` on random models of both
families (run where torch and transformers are installed, e.g. the GPU machine; no network
needed, everything on the CPU in float32).

    python3 scripts/generate-oracle.py [OUT] [--kind KIND] [--bin-dir DIR] [--seed 0]
                                       [--new-tokens 32] [--device cpu|cuda]

For each kind (default: all) a random model is built with transformers (float32, eager
attention; GPT-2 as GPT2LMHeadModel at an odd shape, and the six Llama-family kinds of
scripts/llama-oracle.py), its weights drawn wide (N(0, 0.15), GPT-2's N(0, 0.3); norm weights
1 + N(0, 0.1), biases N(0, 0.1)) so that greedy choices are not near-ties, and saved with save_pretrained
under OUT (default: a temporary directory). Then:

- generation: three prompts of different lengths, each through transformers'
  `generate(do_sample=False, max_new_tokens=N)` alone (no end-of-text token), against
  zeroflow's `generate` example running the three as one batch through its key/value cache
  (f32). The N ids must be equal; the first divergence is printed where they are not, with
  the smallest gap between transformers' two largest logits along its path (a near-tie there
  explains a divergence).
- evaluation: a random stream cut into windows of W inputs (stride W), transformers' loss
  `model(ids, labels=ids)` of each window `stream[s : s + W + 1]` weighted by its tokens,
  against zeroflow's (relative difference bound 1e-4).

With `--device cuda` zeroflow runs on GPU 0 in bf16 (the weights rounded, every activation
bf16), against transformers in float32 on the CPU as before: greedy ids cannot be expected to
agree all the way, so each prompt reports its first divergence with transformers' top-2 logit
gap at that token (a divergence is a failure only where that gap is above CUDA_GAP_BOUND, which
bf16 rounding does not explain), and the loss bound is CUDA_LOSS_BOUND.

Exit status 1 when a model fails either check (all are run and listed first), 0 when all agree.
zeroflow's binary runs as `cargo run -q --release -p zeroflow-train --example generate --`
unless --bin-dir names a directory holding the built `generate` (target/release/examples).
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS_BOUND = 1e-4
# bf16 on the GPU: the loss's relative bound, and the top-2 logit gap above which a greedy
# divergence is more than rounding.
CUDA_LOSS_BOUND = 2e-2
CUDA_GAP_BOUND = 1.0
PROMPT_LENS = (5, 1, 9)
STREAM_LEN, WINDOW = 50, 16


def llama_oracle():
    """scripts/llama-oracle.py as a module: its kinds and its model builder."""
    spec = importlib.util.spec_from_file_location("llama_oracle", ROOT / "scripts/llama-oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LLAMA = llama_oracle()
# GPT-2 at an odd shape: 3 heads of 12 over width 36, vocabulary 97, 3 layers.
GPT2 = dict(vocab_size=97, n_positions=64, n_embd=36, n_layer=3, n_head=3,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True)
# At N(0, 0.15) a random GPT-2 (its head tied to the embedding) greedily repeats one token;
# at 0.3 its sequences vary, which is what the comparison needs.
GPT2_STD = 0.3
KINDS = ["gpt2-odd", *LLAMA.KINDS]


def build(kind, seed):
    """The random model of `kind` in float32, eager attention, evaluation mode."""
    import torch
    if kind == "gpt2-odd":
        from transformers import AutoModelForCausalLM, GPT2Config
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(GPT2Config(**GPT2), attn_implementation="eager",
                                                 **LLAMA.dtype_argument(torch.float32))
        if type(model).__name__ != "GPT2LMHeadModel":
            raise RuntimeError(f"{kind}: transformers built {type(model).__name__}")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".ln_" in name and name.endswith(".weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
                else:
                    p.normal_(0.0, GPT2_STD)
        model = model.eval()
    else:
        model = LLAMA.build(kind, seed)
    return model


def without_end_token(model):
    """`model` generating exactly the tokens asked for (no end-of-text token ends it early)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def zeroflow(args):
    if args.bin_dir:
        return [str(Path(args.bin_dir) / "generate")]
    return ["cargo", "run", "-q", "--release", "-p", "zeroflow-train", "--example", "generate",
            "--"]


def transformers_generate(model, prompt, new_tokens):
    """transformers' greedy ids after `prompt`, and the top-1/top-2 logit gap of each."""
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):].tolist()
    gaps = [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    return generated, gaps


def transformers_eval(model, stream):
    """transformers' loss over `stream` in windows of WINDOW inputs, weighted by tokens."""
    import torch
    total, tokens = 0.0, 0
    for start in range(0, len(stream) - 1, WINDOW):
        end = min(start + WINDOW, len(stream) - 1)
        ids = torch.tensor([stream[start:end + 1]])
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        total += loss * (end - start)
        tokens += end - start
    return total / tokens, tokens


def check(args, kind, directory, model, generator):
    """The failures of `kind` (empty when it agrees), printing what was compared."""
    import torch
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    stream = torch.randint(0, vocab, (STREAM_LEN,), generator=generator).tolist()
    command = zeroflow(args) + [str(directory), "--max-new-tokens", str(args.new_tokens),
                                "--eval", ",".join(map(str, stream)), "--window", str(WINDOW),
                                "--device", args.device]
    for prompt in prompts:
        command += ["--prompt", ",".join(map(str, prompt))]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return [f"{kind}: {' '.join(command[:3])} …: {done.stderr.strip()}"]
    ours = json.loads(done.stdout)
    failures = []
    cuda = args.device == "cuda"
    for number, (prompt, generated) in enumerate(zip(prompts, ours["generated"])):
        reference, gaps = transformers_generate(model, prompt, args.new_tokens)
        gap = min(gaps)
        divergence = next((i for i, (a, b) in enumerate(zip(reference, generated)) if a != b),
                          None)
        if divergence is None and len(reference) != len(generated):
            divergence = min(len(reference), len(generated))
        if divergence is None:
            print(f"ok {kind}: prompt {number} ({len(prompt)} ids): the same {len(reference)} "
                  f"ids (smallest top-2 logit gap {gap:.3f})")
            continue
        at = gaps[divergence] if divergence < len(gaps) else float("nan")
        message = (f"{kind}: prompt {number} ({len(prompt)} ids): first divergence at new "
                   f"token {divergence}: transformers {reference[divergence:divergence + 4]}, "
                   f"zeroflow {generated[divergence:divergence + 4]} (top-2 logit gap there "
                   f"{at:.3g}, smallest {gap:.3g})")
        if cuda and not at > CUDA_GAP_BOUND:
            print(f"ok {message}: within bf16 rounding (gap bound {CUDA_GAP_BOUND:g})")
        else:
            print(f"FAIL {message}")
            failures.append(message)
    reference_loss, tokens = transformers_eval(model, stream)
    difference = abs(ours["eval"]["loss"] - reference_loss) / abs(reference_loss)
    bound = CUDA_LOSS_BOUND if cuda else LOSS_BOUND
    ok = difference <= bound and ours["eval"]["tokens"] == tokens
    print(f"{'ok' if ok else 'FAIL'} {kind}: eval over {tokens} tokens in windows of {WINDOW}: "
          f"transformers {reference_loss:.6f} zeroflow {ours['eval']['loss']:.6f}, relative "
          f"difference {difference:.2e} (bound {bound:g}, {args.device})")
    if not ok:
        failures.append(f"{kind}: eval relative difference {difference:.2e}, tokens "
                        f"{ours['eval']['tokens']} against {tokens}")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where the models are saved (default: temporary)")
    parser.add_argument("--kind", choices=["all", *KINDS], default="all")
    parser.add_argument("--bin-dir", help="directory of the built generate example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where zeroflow runs (cuda: GPU 0, bf16)")
    args = parser.parse_args()
    import torch
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    kinds = KINDS if args.kind == "all" else [args.kind]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        for number, kind in enumerate(kinds):
            model = build(kind, args.seed + number)
            directory = out / kind
            model.save_pretrained(directory, safe_serialization=True)
            without_end_token(model)
            generator = torch.Generator().manual_seed(args.seed + 100 + number)
            failures += check(args, kind, directory, model, generator)
    if failures:
        print("FAIL generate-oracle:", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {len(kinds)} models generate and evaluate as transformers does")


if __name__ == "__main__":
    main()
