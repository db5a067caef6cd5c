#!/usr/bin/env python3
"""Checks zeroflow's Hugging Face directories and configs against `transformers` (run where torch
and transformers are installed, e.g. the GPU machine; no network needed).

    python3 scripts/hf-check.py load DIR...
        AutoModelForCausalLM.from_pretrained(DIR, output_loading_info=True) must report no
        missing, unexpected or mismatched keys, and every tensor in DIR's safetensors files must
        equal the loaded model's.
    python3 scripts/hf-check.py config [FIXTURE.json...]
        each fixture (default: crates/zeroflow-llama/tests/fixtures/*.json) and zeroflow's
        to_hf_config of it (`dump-config`) read by AutoConfig to equal configs; the named shapes
        llama-1b/3b/8b build models of the published parameter counts.
    python3 scripts/hf-check.py random OUT [--kind KIND] [--dtype float32|bfloat16]
                                           [--max-shard-size 200KB] [--seed 0]
        tiny random models (transformers, every parameter drawn from N(0, 0.02)) saved with
        save_pretrained, sharded, one directory per kind under OUT, each with reference-stats.json
        (every stored tensor's shape, sum and absolute sum) for `verify-read`.
    python3 scripts/hf-check.py verify-read DIR...
        zeroflow reads each DIR (`hf-dir stats`: config.json parsed by zeroflow-llama, names and
        shapes checked, tensors read by zeroflow-hf) and must find the sums of reference-stats.json.
    python3 scripts/hf-check.py all OUT
        random (both dtypes), verify-read, `hf-dir copy` of each (zeroflow writes it back,
        sharded), load of every copy and of a directory `hf-dir write` makes, and config.

zeroflow's binaries run as `cargo run -q -p zeroflow-llama --example dump-config --` and
`... --example hf-dir --` unless --bin-dir names a directory holding the built `dump-config` and
`hf-dir` (target/debug/examples). Exit status 1 on the first kind of failure found, listing all of
its instances; 0 when everything agrees.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates" / "zeroflow-llama" / "tests" / "fixtures"
# to_dict() keys that say where and by what a config was written, not what it is.
PROVENANCE = {"transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset"}
NAMED_COUNTS = {"llama-1b": 1_235_814_400, "llama-3b": 3_212_749_824, "llama-8b": 8_030_261_248}

# Odd tiny shapes, as the fidelity acceptance asks: GQA 3:1 with untied embeddings, llama3 rope
# scaling, Qwen2's biases, Qwen3's q/k norms with head_dim != hidden / heads, Mistral.
BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, tie_word_embeddings=False)
KINDS = {
    "llama-gqa": ("llama", {}),
    "llama-rope": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("qwen3", dict(head_dim=12, rope_theta=1e6)),
    "mistral": ("mistral", dict(sliding_window=None, rope_theta=1e6)),
}


def dtype_argument(value):
    """`from_pretrained`'s dtype keyword: `dtype` from transformers 5 on, `torch_dtype` before."""
    import transformers
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": value} if major >= 5 else {"torch_dtype": value}


def fail(what, problems):
    print(f"FAIL {what}:", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    sys.exit(1)


def zeroflow(args, name):
    """The command line of zeroflow example `name`."""
    if args.bin_dir:
        return [str(Path(args.bin_dir) / name)]
    return ["cargo", "run", "-q", "-p", "zeroflow-llama", "--example", name, "--"]


def run(command):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        fail(" ".join(command), [done.stderr.strip() or f"exit status {done.returncode}"])
    return done.stdout


def safetensors_files(directory):
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    return [directory / "model.safetensors"]


def stored_tensors(directory):
    """(name, torch tensor) of every tensor in the directory's weight files."""
    from safetensors import safe_open
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load(args):
    import torch
    from transformers import AutoModelForCausalLM
    problems = []
    for directory in map(Path, args.dirs):
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, output_loading_info=True, **dtype_argument("auto"))
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            if info.get(key):
                problems.append(f"{directory}: {key}: {sorted(map(str, info[key]))}")
        state = model.state_dict()
        for name, stored in stored_tensors(directory):
            loaded = state.get(name)
            if loaded is None:
                problems.append(f"{directory}: {name} is stored but not in the model")
            elif not torch.equal(loaded.cpu().to(stored.dtype), stored):
                problems.append(f"{directory}: {name} loads with other values")
        count = sum(p.numel() for p in model.parameters())
        print(f"ok load {directory}: {type(model).__name__}, {count} parameters, "
              f"dtype {next(model.parameters()).dtype}")
    if problems:
        fail("load", problems)


def auto_config(config_json):
    from transformers import AutoConfig
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        return AutoConfig.from_pretrained(tmp)


def config_dict(config):
    return {k: v for k, v in config.to_dict().items() if k not in PROVENANCE}


def differences(a, b):
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, "<absent>"), b.get(key, "<absent>")
        same = x == y or (isinstance(x, (int, float)) and isinstance(y, (int, float))
                          and math.isclose(x, y, rel_tol=1e-12))
        if not same:
            out.append(f"{key}: published {x!r}, zeroflow {y!r}")
    return out


def config(args):
    import torch
    from transformers import AutoModelForCausalLM
    import transformers
    fixtures = [Path(f) for f in args.fixtures] or sorted(FIXTURES.glob("*.json"))
    problems = []
    for fixture in fixtures:
        if fixture.stem.endswith("-transformers5") and int(transformers.__version__.split(".")[0]) < 5:
            print(f"skipped config {fixture.name}: transformers {transformers.__version__} reads "
                  "no rope_parameters")
            continue
        written = json.loads(run(zeroflow(args, "dump-config") + [str(fixture)]))
        diff = differences(config_dict(auto_config(json.loads(fixture.read_text()))),
                           config_dict(auto_config(written)))
        problems += [f"{fixture.name}: {d}" for d in diff]
        print(f"{'ok' if not diff else 'DIFFERENT'} config {fixture.name}")
    for name, expected in NAMED_COUNTS.items():
        cfg = auto_config(json.loads(run(zeroflow(args, "dump-config") + [name])))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        count = sum(p.numel() for p in model.parameters())
        print(f"{'ok' if count == expected else 'DIFFERENT'} named {name}: {count} parameters")
        if count != expected:
            problems.append(f"{name}: transformers counts {count}, zeroflow {expected}")
    if problems:
        fail("config", problems)


def random_models(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    out = Path(args.out)
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    dtype = getattr(torch, args.dtype)
    made = []
    for kind in kinds:
        model_type, settings = KINDS[kind]
        cfg = AutoConfig.for_model(model_type, **{**BASE, **settings})
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(cfg, **dtype_argument(dtype))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        directory = out / f"{kind}-{args.dtype}"
        model.save_pretrained(directory, max_shard_size=args.max_shard_size)
        stats = {name: {"shape": list(t.shape), "sum": t.double().sum().item(),
                        "abs_sum": t.double().abs().sum().item()}
                 for name, t in stored_tensors(directory)}
        (directory / "reference-stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
        print(f"wrote {directory}: {len(safetensors_files(directory))} weight file(s), "
              f"{len(stats)} tensors")
        made.append(directory)
    return made


def verify_read(args):
    problems = []
    for directory in map(Path, args.dirs):
        reference = json.loads((directory / "reference-stats.json").read_text())
        read = json.loads(run(zeroflow(args, "hf-dir") + ["stats", str(directory)]))
        if set(read) != set(reference):
            problems.append(f"{directory}: zeroflow reads {sorted(set(read) ^ set(reference))} "
                            "differently (names in one and not the other)")
        for name in sorted(set(read) & set(reference)):
            r, z = reference[name], read[name]
            if r["shape"] != z["shape"]:
                problems.append(f"{directory}: {name} shape {z['shape']}, stored {r['shape']}")
            for key in ("sum", "abs_sum"):
                if not math.isclose(r[key], z[key], rel_tol=1e-9, abs_tol=1e-9):
                    problems.append(f"{directory}: {name} {key} {z[key]}, stored {r[key]}")
        print(f"{'ok' if not problems else 'DIFFERENT'} verify-read {directory}: {len(read)} tensors")
    if problems:
        fail("verify-read", problems)


def same_values(originals, copies):
    """Every tensor of each copy equals the original's (zeroflow read it and wrote it back)."""
    import torch
    problems = []
    for original, copy in zip(originals, copies):
        stored = dict(stored_tensors(original))
        copied = dict(stored_tensors(copy))
        if set(stored) != set(copied):
            problems.append(f"{copy}: names differ: {sorted(set(stored) ^ set(copied))}")
        for name in sorted(set(stored) & set(copied)):
            if not torch.equal(stored[name].to(copied[name].dtype), copied[name]):
                problems.append(f"{copy}: {name} differs from {original}")
        print(f"{'ok' if not problems else 'DIFFERENT'} copy {copy}: {len(copied)} tensors")
    if problems:
        fail("copy", problems)


def everything(args):
    out = Path(args.out)
    made = []
    for dtype in ("float32", "bfloat16"):
        made += random_models(argparse.Namespace(out=out / "transformers", kind="all", dtype=dtype,
                                                 max_shard_size="100KB", seed=0))
    verify_read(argparse.Namespace(dirs=made, bin_dir=args.bin_dir))
    copies = []
    for directory in made:
        copy = out / "zeroflow" / directory.name
        flags = ["--f32"] if directory.name.endswith("float32") else []
        run(zeroflow(args, "hf-dir") + ["copy", str(directory), str(copy), "--max-shard-bytes",
                                        "60000"] + flags)
        copies.append(copy)
    same_values(made, copies)
    written = out / "zeroflow" / "tiny-llama-written"
    tiny = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama")
    (out / "tiny-llama.json").write_text(json.dumps(tiny))
    run(zeroflow(args, "hf-dir") + ["write", str(out / "tiny-llama.json"), str(written),
                                    "--max-shard-bytes", "50000"])
    load(argparse.Namespace(dirs=copies + [written]))
    config(argparse.Namespace(fixtures=[], bin_dir=args.bin_dir))
    print("all checks agree")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", help="directory of the built dump-config and hf-dir")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("load")
    p.add_argument("dirs", nargs="+")
    p = sub.add_parser("config")
    p.add_argument("fixtures", nargs="*")
    p = sub.add_parser("random")
    p.add_argument("out")
    p.add_argument("--kind", default="all", choices=["all", *KINDS])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-shard-size", default="200KB")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("verify-read")
    p.add_argument("dirs", nargs="+")
    p = sub.add_parser("all")
    p.add_argument("out")
    args = parser.parse_args()
    {"load": load, "config": config, "random": random_models, "verify-read": verify_read,
     "all": everything}[args.mode](args)


if __name__ == "__main__":
    main()
