#!/usr/bin/env python3
"""Compares zeroflow's Llama family with `transformers` on random models (run where torch and
transformers >= 4.45 are installed, e.g. the GPU machine; no network needed, everything on the
CPU in float32).

    python3 scripts/llama-oracle.py [OUT] [--kind KIND] [--attention gemm|flash|both]
                                    [--bin-dir DIR] [--seed 0] [--keep]

For each kind (default: all) a random model is built with transformers (float32, eager
attention), its parameters drawn wide enough that the logits are far from uniform (weights
N(0, 0.15), norm weights 1 + N(0, 0.1), biases N(0, 0.1)), saved with save_pretrained under OUT
(default: a temporary directory), and run on random token ids `ids [batch, seq + 1]` by
transformers (`model(ids, labels=ids)`: its loss, and its logits of the first `seq` positions)
and by zeroflow (`llama-loss DIR IDS.json --logits FILE`: the CpuDevice's fp32 loss and the
logits `[batch, seq, vocab]`). Printed per model and attention form: the loss relative
difference (bound 1e-4) and the largest |logit difference| (bound 1e-3). Exit status 1 when a
model is outside a bound (all of them are run and listed first), 0 when all agree.

zeroflow's binary runs as `cargo run -q -p zeroflow-llama --example llama-loss --` unless
--bin-dir names a directory holding the built `llama-loss` (target/debug/examples).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS_BOUND = 1e-4
LOGIT_BOUND = 1e-3
BATCH, SEQ = 2, 17

# Odd tiny shapes: 6 query heads over 2 key/value heads (3:1), width 48, vocabulary 97, 3 layers.
BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, tie_word_embeddings=False)
# kind: (transformers class name, config settings on top of BASE)
KINDS = {
    "llama-gqa-untied": ("LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama-rope-llama3": ("LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-bias-mqa": ("LlamaForCausalLM", dict(attention_bias=True, num_key_value_heads=1)),
    "qwen2-biases": ("Qwen2ForCausalLM", dict(rope_theta=1e6, use_sliding_window=False)),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=12, rope_theta=1e6,
                                               use_sliding_window=False)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None, rope_theta=1e6)),
}


def dtype_argument(value):
    """`from_config`'s dtype keyword: `dtype` from transformers 5 on, `torch_dtype` before."""
    import transformers
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": value} if major >= 5 else {"torch_dtype": value}


def zeroflow(args):
    """The command line of the `llama-loss` example."""
    if args.bin_dir:
        return [str(Path(args.bin_dir) / "llama-loss")]
    return ["cargo", "run", "-q", "-p", "zeroflow-llama", "--example", "llama-loss", "--"]


def build(kind, seed):
    """The random model of `kind`, in float32 with eager attention, in evaluation mode."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    class_name, settings = KINDS[kind]
    config = getattr(transformers, class_name).config_class(**{**BASE, **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             **dtype_argument(torch.float32))
    if type(model).__name__ != class_name:
        raise RuntimeError(f"{kind}: transformers built {type(model).__name__}, not {class_name}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def compare(args, kind, directory, model, ids, attention):
    """(loss relative difference, max |logit difference|) of zeroflow against `model`."""
    import torch
    ids_file = directory / "ids.json"
    ids_file.write_text(json.dumps(ids.tolist()))
    logits_file = directory / f"logits-{attention}.f32"
    command = zeroflow(args) + [str(directory), str(ids_file), "--attention", attention,
                                "--logits", str(logits_file)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    ours = json.loads(done.stdout)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    reference_loss = out.loss.item()
    reference_logits = out.logits[:, :-1, :].float()
    logits = torch.frombuffer(bytearray(logits_file.read_bytes()), dtype=torch.float32)
    logits = logits.reshape(ours["batch"], ours["seq"], ours["vocab"])
    loss_difference = abs(ours["loss"] - reference_loss) / abs(reference_loss)
    logit_difference = (logits - reference_logits).abs().max().item()
    return reference_loss, ours["loss"], loss_difference, logit_difference


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where the models are saved (default: temporary)")
    parser.add_argument("--kind", choices=["all", *KINDS], default="all")
    parser.add_argument("--attention", choices=["gemm", "flash", "both"], default="both")
    parser.add_argument("--bin-dir", help="directory of the built llama-loss example")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    attentions = ["gemm", "flash"] if args.attention == "both" else [args.attention]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        for number, kind in enumerate(kinds):
            model = build(kind, args.seed + number)
            directory = out / kind
            model.save_pretrained(directory, safe_serialization=True)
            generator = torch.Generator().manual_seed(args.seed + 100 + number)
            ids = torch.randint(0, BASE["vocab_size"], (BATCH, SEQ + 1), generator=generator)
            for attention in attentions:
                try:
                    reference, ours, loss_diff, logit_diff = compare(
                        args, kind, directory, model, ids, attention)
                except RuntimeError as error:
                    failures.append(f"{kind} ({attention}): {error}")
                    print(f"FAIL {kind} ({attention}): {error}")
                    continue
                ok = loss_diff <= LOSS_BOUND and logit_diff <= LOGIT_BOUND
                print(f"{'ok' if ok else 'FAIL'} {kind} ({attention}): loss transformers "
                      f"{reference:.6f} zeroflow {ours:.6f}, relative difference {loss_diff:.2e} "
                      f"(bound {LOSS_BOUND:g}), max |logit difference| {logit_diff:.2e} "
                      f"(bound {LOGIT_BOUND:g})")
                if not ok:
                    failures.append(f"{kind} ({attention}): loss {loss_diff:.2e}, "
                                    f"logits {logit_diff:.2e}")
    if failures:
        print("FAIL llama-oracle:", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {len(kinds)} models agree with transformers")


if __name__ == "__main__":
    main()
