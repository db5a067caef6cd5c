#!/usr/bin/env python3
"""Writes a large byte-level BPE `tokenizer.json` for the tokenizer oracle's throughput check, with
no network: tiktoken's cl100k_base (100,256 tokens, the vocabulary Llama-3's 128,256 extend), from
the copy in the cargo registry's tiktoken-rs, converted by transformers' `TikTokenConverter` with
Llama-3's split pattern and an <|endoftext|> special token. Needs `tiktoken` and `transformers`
here (the GPU machine has transformers but not tiktoken: build it here and carry the file).

    python3 scripts/cl100k-tokenizer.py OUT.json
    python3 scripts/tokenizer-oracle.py --extra-tokenizer OUT.json ...
"""

import glob
import os
import sys

from tokenizers import AddedToken
from transformers.convert_slow_tokenizer import TikTokenConverter

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

if len(sys.argv) != 2:
    raise SystemExit(__doc__)
home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
found = sorted(glob.glob(f"{home}/registry/src/*/tiktoken-rs-*/assets/cl100k_base.tiktoken"))
if not found:
    raise SystemExit("no cl100k_base.tiktoken in the cargo registry (cargo fetch first)")
converter = TikTokenConverter(vocab_file=found[-1], pattern=LLAMA3_SPLIT,
                              additional_special_tokens=["<|endoftext|>"])
tokenizer = converter.converted()
# Some transformers versions drop `additional_special_tokens` here: the oracle needs the document
# separator, so it is added where it is missing.
if tokenizer.token_to_id("<|endoftext|>") is None:
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
tokenizer.save(sys.argv[1])
print(f"{sys.argv[1]}: {tokenizer.get_vocab_size()} tokens")
