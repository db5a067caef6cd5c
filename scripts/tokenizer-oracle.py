#!/usr/bin/env python3
"""Checks `zeroflow tokenize` against the Python `tokenizers` and `transformers` packages.

Builds its own tokenizers (no network): a Llama-3-style byte-level BPE (its split regex, a BOS
post-processor) and a Llama-2-style Metaspace BPE with byte fallback (a `Prepend` normalizer, and
the same model behind a Mistral-style `Metaspace` pre-tokenizer), both trained here on mixed
text (unicode, digits, whitespace runs, code); and GPT-2's own, from the local Hugging Face cache
or built from GPT-2's original encoder.json and vocab.bpe (--gpt2-files, or tiktoken-rs's copy in
the cargo registry). For each it runs `zeroflow tokenize` on a `.jsonl` of documents and compares every
document of the shards with `[end-of-text] + tokenizer.encode(text).ids`; it also times
`zeroflow tokenize` against `encode_batch` on the same texts.

A text file: the texts joined by line breaks into one `.txt` (over 1 MiB from --megabytes 2 on),
which zeroflow reads and encodes in pieces of about 1 MiB ending at line breaks (the first with the
tokenizer's special tokens, the rest without them and without the mark of a text's start, a
Metaspace's or a Prepend normalizer's "▁"): compared with the same pieces encoded here, and
counted against the file encoded whole.

Then chat: for a Llama-3-style, a ChatML (Qwen-style) and a Qwen-2.5-style tool-calling template
(`tojson`, `is defined`, `set`, neighbours through `loop.index0`) with `{% generation %}` markers
it compares ids and loss masks of `zeroflow tokenize` with transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` on many multi-turn conversations,
and the prefix-rendering fallback (the same templates with the markers removed, through
`--chat-template`) with the same masks.

With --extra-tokenizer, a real model's tokenizer.json gets the documents and text-file checks.
The model-template check (a template without markers: the ids of every document zeroflow writes,
the conversation whole or turn by turn, as transformers renders it, the trained tokens holding
each assistant content, and the same conversations refused) runs on the conversations, plain and
with tool calls: with --model-template JINJA, on the Llama-3-style tokenizer; with --model-dir, on
a model's tokenizer.json and tokenizer_config.json (its own template and special tokens).

Exits 1 on any mismatch.

    python3 scripts/tokenizer-oracle.py --zeroflow target/release/zeroflow [--megabytes 1]
"""

import argparse
import array
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
{%- if message['role'] == 'assistant' %}
{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}
{%- else %}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = r"""{%- if messages[0].role != 'system' %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- generation %}
{{- message.content.strip() + '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen2.5-style: tool calls with `tojson` arguments, `is defined`, `set` in a loop, tool results
# grouped by looking at neighbours (`loop.index0`, `loop.last`), and generation markers.
QWEN_TOOLS_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
        {%- if message.content %}
            {{- message.content.lstrip('\n') }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WORDS = ["the", "model", "naïve", "café", "Straße", "日本語", "テキスト", "données", "🙂", "✓",
         "résumé", "über", "Ελληνικά", "русский", "العربية", "x", "tokens", "loss", "ZeRO"]
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "fn main() { println!(\"{}\", 1 + 2); }\n", "    if x:\n        y = {'a': [1, 2]}\n"]


def mixed_text(rng):
    """One document: words, numbers, whitespace runs, code, newlines."""
    parts = []
    for _ in range(rng.randint(5, 60)):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(WORDS) + rng.choice([" ", " ", ", ", ". ", "\n"]))
        elif r < 0.7:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))) + rng.choice([" ", "-", "\n"]))
        elif r < 0.8:
            parts.append(rng.choice(["  ", "   ", "\t", "\n\n", " \n ", "\r\n"]))
        else:
            parts.append(rng.choice(CODE))
    return "".join(parts)


def corpus(rng, megabytes):
    texts, size = [], 0
    while size < megabytes * 1e6:
        texts.append(mixed_text(rng))
        size += len(texts[-1].encode())
    return texts


def llama3_style(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                      special_tokens=[("<|begin_of_text|>", 0)]),
    ])
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def metaspace_byte_fallback(texts):
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", "<s>", "</s>"] + bytes_)
    # Trained as sentencepiece trains (`split_by_whitespace`, a text per line): no token holds a
    # line break or a "▁" after its first character; encoded, as Llama-2's tokenizer.json is,
    # with no pre-tokenizer.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Split("▁", "merged_with_next")])
    tok.train_from_iterator(texts, trainer)
    tok.pre_tokenizer = None
    return tok


def mistral_style(llama2):
    """`llama2`'s model with Mistral's pipeline: no normalizer, a `Metaspace` pre-tokenizer that
    prepends "▁" to the text's first word and does not split."""
    tok = Tokenizer.from_str(llama2.to_str())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return tok


def read_file(path, magics):
    data = Path(path).read_bytes()
    header = array.array("i", data[:1024])
    if sys.byteorder != "little":
        header.byteswap()
    magic, version, count = header[0], header[1], header[2]
    if magic not in magics:
        raise SystemExit(f"{path}: magic {magic}, expected one of {magics}")
    kind = magics[magic]
    body = array.array(kind, data[1024:])
    if sys.byteorder != "little":
        body.byteswap()
    return list(body)


def read_output(out_dir):
    """The documents of `zeroflow tokenize`'s output: (tokens, mask or None) per document."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    documents = []
    for shard in manifest["shards"]:
        tokens = read_file(out_dir / shard["tokens"], {20240520: "H", 20240801: "I"})
        offsets = read_file(out_dir / shard["documents"], {20261201: "Q"})
        mask = None
        if shard["loss_mask"]:
            mask = list(Path(out_dir / shard["loss_mask"]).read_bytes()[1024:])
        for start, end in zip(offsets, offsets[1:]):
            documents.append((tokens[start:end], mask[start:end] if mask else None))
    return manifest, documents


def run_zeroflow(zeroflow, tokenizer, inputs, out_dir, extra=()):
    command = [zeroflow, "tokenize", "--tokenizer", str(tokenizer), *map(str, inputs),
               "--out", str(out_dir), *extra]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
    return seconds, result.stdout


class Failures:
    def __init__(self):
        self.count = 0

    def check(self, ok, what):
        if not ok:
            self.count += 1
            if self.count <= 20:
                print(f"MISMATCH {what}")
        return ok


def check_documents(name, tok, tokenizer_arg, eot, texts, work, zeroflow, failures, ordinary=False):
    jsonl = work / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    out = work / f"{name}-out"
    seconds, stdout = run_zeroflow(zeroflow, tokenizer_arg, [jsonl], out)
    _, documents = read_output(out)
    failures.check(len(documents) == len(texts), f"{name}: {len(documents)} documents, expected {len(texts)}")
    start = time.perf_counter()
    encodings = tok.encode_batch(texts)
    python_seconds = time.perf_counter() - start
    bad = 0
    for i, (text, encoding, (tokens, _)) in enumerate(zip(texts, encodings, documents)):
        expected = [eot] + encoding.ids
        if not failures.check(tokens == expected, f"{name}: document {i} {text[:40]!r}: zeroflow "
                                                  f"{tokens[:12]}..., tokenizers {expected[:12]}..."):
            bad += 1
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    print(f"{name}: {len(texts)} documents, {megabytes:.2f} MB, {bad} mismatched; zeroflow tokenize "
          f"{megabytes / seconds:.2f} MB/s (process wall time, start-up included), tokenizers "
          f"encode_batch {megabytes / python_seconds:.2f} MB/s, ratio {python_seconds / seconds:.2f}")
    # The same wall-time comparison with Python's loading counted too (`Tokenizer.from_file` of
    # the same tokenizer.json), as zeroflow's process wall time counts its own.
    saved = work / f"{name}-python.json"
    tok.save(str(saved))
    start = time.perf_counter()
    Tokenizer.from_file(str(saved))
    load_seconds = time.perf_counter() - start
    print(f"    loading counted on both sides (from_file {load_seconds:.2f} s): ratio "
          f"{(python_seconds + load_seconds) / seconds:.2f}")
    last = stdout.strip().splitlines()[-1]
    print("   ", last)
    # zeroflow's own timing of its pass (`read ... in S s`): reading, parsing, tokenizing and
    # writing, without the process's start-up and the tokenizer's loading, which encode_batch's
    # timing leaves out too (Tokenizer.from_file, the texts already in memory).
    found = re.search(r"read .* in ([0-9.]+) s", last)
    if found:
        pass_seconds = float(found.group(1))
        print(f"    start-up excluded on both sides: zeroflow {megabytes / pass_seconds:.2f} MB/s, "
              f"ratio {python_seconds / pass_seconds:.2f}")


TEXT_PIECE_BYTES = 1 << 20  # zeroflow_data::TEXT_PIECE_BYTES


def text_pieces(data, piece=TEXT_PIECE_BYTES):
    """The pieces zeroflow encodes a text file's bytes in (corpus.rs `piece_end`): each ends with
    the first line break from `piece` bytes to twice as many between two bytes that are not white
    space, else the first line break from `piece` bytes on; where a line runs on for four times as many more, before its
    first space from `piece` bytes on, else before the last UTF-8 character that starts within
    its last three bytes."""
    white = b" \t\n\r\x0c"  # Rust's is_ascii_whitespace
    pieces, start, n = [], 0, len(data)
    while True:
        end = min(start + 5 * piece, n)
        chunk, eof = data[start:end], end == n
        newline = next((at for at in range(max(piece, 2) - 1, min(2 * piece, len(chunk) - 1))
                        if chunk[at] == 10 and chunk[at - 1] not in white
                        and chunk[at + 1] not in white), chunk.find(b"\n", piece - 1))
        if eof and len(chunk) <= piece:
            cut = len(chunk)
        elif newline >= 0:
            cut = newline + 1
        elif eof:
            cut = len(chunk)
        elif chunk.find(b" ", piece) >= 0:
            cut = chunk.find(b" ", piece)
        else:
            cut = next((at for at in range(len(chunk) - 1, len(chunk) - 4, -1)
                        if at > 0 and chunk[at] & 0xC0 != 0x80), len(chunk))
        pieces.append(data[start:start + cut])
        start += cut
        if eof and start == n:
            return pieces


def without_prefix(tok):
    """`tok` without what marks the start of a text (tokenizer.rs `without_prefix`): no `Prepend`
    normalizer, a `Metaspace` that prepends `never`, a `ByteLevel` without `add_prefix_space`."""
    config = json.loads(tok.to_str())

    def normalizer(n):
        if n is None or n["type"] == "Prepend":
            return None
        if n["type"] == "Sequence":
            n["normalizers"] = [m for m in map(normalizer, n["normalizers"]) if m is not None]
        return n

    def pre_tokenizer(p):
        if p is None:
            return
        if p["type"] == "Metaspace":
            p["prepend_scheme"] = "never"
        elif p["type"] == "ByteLevel":
            p["add_prefix_space"] = False
        elif p["type"] == "Sequence":
            for q in p["pretokenizers"]:
                pre_tokenizer(q)

    config["normalizer"] = normalizer(config["normalizer"])
    pre_tokenizer(config["pre_tokenizer"])
    return Tokenizer.from_str(json.dumps(config))


def check_text_file(name, tok, tokenizer_arg, eot, texts, work, zeroflow, failures):
    text = "\n".join(texts) + "\n"
    path = work / f"{name}.txt"
    path.write_text(text)
    out = work / f"{name}-text-out"
    run_zeroflow(zeroflow, tokenizer_arg, [path], out)
    _, documents = read_output(out)
    pieces = text_pieces(text.encode())
    expected, more = [eot], without_prefix(tok)
    for k, piece in enumerate(pieces):
        expected += (more if k else tok).encode(piece.decode(), add_special_tokens=k == 0).ids
    tokens = documents[0][0] if len(documents) == 1 else []
    failures.check(len(documents) == 1 and tokens == expected,
                   f"{name}: the text file in {len(pieces)} pieces: {len(documents)} documents, "
                   f"{len(tokens)} tokens against {len(expected)}")
    whole = [eot] + tok.encode(text).ids
    differ = sum(a != b for a, b in zip(whole, tokens)) + abs(len(whole) - len(tokens))
    print(f"{name}: a {len(text.encode()) / 1e6:.2f} MB text file in {len(pieces)} pieces: "
          f"{'the same' if tokens == expected else 'NOT the same'} ids as the pieces encoded here; "
          f"{len(tokens)} tokens against {len(whole)} encoded whole, {differ} positions differ")


def conversations(rng, count):
    result = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": mixed_text(rng)[:200]})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": mixed_text(rng)[:300]})
            messages.append({"role": "assistant", "content": rng.choice(["", " "]) + mixed_text(rng)[:300]})
        result.append(messages)
    return result


def tool_conversations(rng, count):
    """Conversations with tool calls (arguments as dicts, unicode and nesting) and tool results."""
    result = []
    for messages in conversations(rng, count):
        with_tools = []
        for m in messages:
            with_tools.append(m)
            if m["role"] == "assistant" and rng.random() < 0.5:
                calls = [{"type": "function", "function": {"name": rng.choice(["search", "weather", "calc"]),
                          "arguments": {"q": mixed_text(rng)[:40], "n": rng.randint(0, 99),
                                        "opts": {"deep": rng.random() < 0.5, "tags": ["é", "x<y"]}}}}
                         for _ in range(rng.randint(1, 2))]
                content = rng.choice(["", mixed_text(rng)[:80]])
                with_tools.append({"role": "assistant", "content": content, "tool_calls": calls})
                with_tools.extend({"role": "tool", "content": mixed_text(rng)[:60]} for _ in calls)
                with_tools.append({"role": "assistant", "content": mixed_text(rng)[:100]})
        result.append(with_tools)
    return result


def without_markers(template):
    for tag in ["{% generation %}", "{% endgeneration %}", "{%- generation %}", "{%- endgeneration %}"]:
        template = template.replace(tag, "")
    return template


def chat_model(name, template, tok, work, tokens=None):
    """A model directory under `work` with `tok` and `template` (and `tokens`, the special tokens'
    names, default Llama-3's begin and end of text), and transformers' tokenizer of it."""
    from transformers import PreTrainedTokenizerFast

    tokens = tokens or {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    model = work / f"{name}-model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    config = {**tokens, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"), **tokens)
    hf.chat_template = template
    return model, hf


def check_chat(name, template, tok, work, zeroflow, chats, failures):
    model, hf = chat_model(name, template, tok, work)
    jsonl = work / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in chats))
    plain = work / f"{name}-plain.jinja"
    plain.write_text(without_markers(template))
    eot = hf.convert_tokens_to_ids("<|end_of_text|>")
    for how, extra in [("markers", []), ("prefix fallback", ["--chat-template", str(plain)])]:
        out = work / f"{name}-{how.replace(' ', '-')}"
        run_zeroflow(zeroflow, model, [jsonl], out, extra)
        _, documents = read_output(out)
        bad = 0
        for i, (messages, (tokens, mask)) in enumerate(zip(chats, documents)):
            expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            ids, expected_mask = list(expected["input_ids"]), list(expected["assistant_masks"])
            ok = failures.check(tokens == [eot] + ids, f"{name} {how}: conversation {i} ids")
            ok &= failures.check(mask == [0] + expected_mask,
                                 f"{name} {how}: conversation {i} mask: zeroflow {mask[1:]}, "
                                 f"transformers {expected_mask}")
            bad += not ok
        print(f"{name} chat ({how}): {len(chats)} conversations, "
              f"{sum(len(m) for m in chats)} messages, {bad} mismatched")


def expected_documents(hf, messages):
    """The documents zeroflow's prefix rendering makes of `messages`, by transformers' rendering:
    ([(ids, the assistant contents trained on)], whether turn by turn) — one document where each assistant turn's
    conversation so far renders as the start of the whole, else one per assistant turn (the
    conversation through it, that turn alone trained on)."""
    whole = hf.apply_chat_template(messages, tokenize=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    throughs = {i: hf.apply_chat_template(messages[:i + 1], tokenize=False) for i in turns}
    for i in turns:
        before = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not throughs[i].startswith(before):
            raise RuntimeError(f"turn {i} does not follow its conversation so far")
    ids = lambda m: list(hf.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
    # A turn that calls tools may render its calls in place of its content (Llama-3.1's does).
    content = lambda i: "" if messages[i].get("tool_calls") else messages[i]["content"].strip()
    if all(whole.startswith(throughs[i]) for i in turns):
        return [(ids(messages), [content(i) for i in turns])], False
    return [(ids(messages[:i + 1]), [content(i)]) for i in turns], True


def trained_runs(hf, tokens, mask):
    """The text of each run of trained tokens."""
    runs, at = [], 0
    while at < len(mask):
        if mask[at]:
            end = next((j for j in range(at, len(mask)) if not mask[j]), len(mask))
            runs.append(hf.decode(tokens[at:end]))
            at = end
        else:
            at += 1
    return runs


def check_model_template(name, template, tok, work, zeroflow, chats, failures, tokens=None):
    """A model's own template (no generation markers: zeroflow renders prefixes): the ids of every
    document as transformers' `apply_chat_template` renders it, the conversation whole or, where
    the template renders a turn differently once later messages follow, through each assistant
    turn; and the tokens zeroflow trains on, read back, each assistant content in order."""
    model, hf = chat_model(name, template, tok, work, tokens)
    eot = hf.convert_tokens_to_ids(hf.eos_token)
    # A conversation the template raises on (transformers' TemplateError), or whose turns do not
    # follow their conversation so far (RuntimeError): zeroflow must refuse it too.
    expected, refused = [], {}
    for i, m in enumerate(chats):
        try:
            expected.append(expected_documents(hf, m))
        except Exception as error:
            refused.setdefault(f"{type(error).__name__}: {str(error)[:100]}", []).append(i)
            expected.append(([], False))
    jsonl = work / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in chats))
    out = work / f"{name}-out"
    _, said = run_zeroflow(zeroflow, model, [jsonl], out, ["--skip-bad-lines"])
    skipped = int((re.search(r"skipped (\d+) bad line", said) or [0, 0])[1])
    refusals = sum(len(v) for v in refused.values())
    failures.check(skipped == refusals, f"{name}: zeroflow skipped {skipped} conversations, "
                                        f"transformers' rendering refuses {refusals}")
    documents = read_output(out)[1] if (out / "manifest.json").exists() else []
    flat = [(i, d) for i, (docs, _) in enumerate(expected) for d in docs]
    failures.check(len(documents) == len(flat), f"{name}: {len(documents)} documents, expected {len(flat)}")
    bad = set()
    for (i, (ids, contents)), (tokens, mask) in zip(flat, documents):
        ok = failures.check(tokens == [eot] + ids, f"{name}: conversation {i} ids")
        runs = trained_runs(hf, tokens, mask)
        found = len(runs) == len(contents) and all(c in r for c, r in zip(contents, runs))
        ok &= failures.check(found, f"{name}: conversation {i}: trained on {runs!r}, "
                                    f"the assistant wrote {contents!r}")
        if not ok:
            bad.add(i)
    turn_by_turn = sum(by_turn for _, by_turn in expected)
    print(f"{name} (its own template, prefix rendering): {len(chats)} conversations, "
          f"{sum(len(m) for m in chats)} messages, {len(flat)} documents ({turn_by_turn} conversations "
          f"turn by turn), {len(bad)} mismatched; {refusals} refused as transformers' rendering "
          f"refuses them" + "".join(f"\n    {len(v)}: {k}" for k, v in refused.items()))


def gpt2_tokenizer(files):
    """GPT-2's own tokenizer as `tokenizers` has it: from the local Hugging Face cache, else built
    from GPT-2's original `encoder.json` and `vocab.bpe` (byte-level BPE, no prefix space, as
    the hub's `gpt2/tokenizer.json`) in `files` or in the cargo registry's copy of tiktoken-rs."""
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return Tokenizer.from_pretrained("gpt2")
    except Exception as e:
        cached = type(e).__name__
    candidates = [Path(files)] if files else sorted(
        Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo")).glob("registry/src/*/tiktoken-rs-*/assets"))
    for folder in candidates:
        vocab, merges = folder / "encoder.json", folder / "vocab.bpe"
        if vocab.exists() and merges.exists():
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens(["<|endoftext|>"])
            print(f"gpt2: built from {merges.parent.name}/{{encoder.json,vocab.bpe}} (not in the cache: {cached})")
            return tok
    print(f"gpt2: skipped (not in the local Hugging Face cache: {cached}; no encoder.json/vocab.bpe found)")
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zeroflow", default=None, help="the zeroflow binary (default: target/release, then debug)")
    parser.add_argument("--megabytes", type=float, default=1.0, help="text per tokenizer (default 1)")
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpt2-files", default=None,
                        help="a folder with GPT-2's encoder.json and vocab.bpe (default: the cache, then tiktoken-rs's)")
    parser.add_argument("--model-template", action="append", default=[], metavar="JINJA",
                        help="a model's own chat template (e.g. Qwen3's) to check, repeatable")
    parser.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                        help="a model's tokenizer.json and tokenizer_config.json (its chat template "
                             "and special tokens) to check chat with, repeatable")
    parser.add_argument("--extra-tokenizer", action="append", default=[], metavar="TOKENIZER_JSON",
                        help="also check and time this tokenizer.json (a real model's, or "
                             "scripts/cl100k-tokenizer.py's 100k-token byte-level BPE); its end-of-text "
                             "token is <|endoftext|>, <|end_of_text|> or </s>, whichever it has")
    args = parser.parse_args()
    zeroflow = args.zeroflow
    if zeroflow is None:
        root = Path(__file__).resolve().parent.parent
        found = [p for p in (root / "target/release/zeroflow", root / "target/debug/zeroflow") if p.exists()]
        if not found:
            raise SystemExit("no zeroflow binary: cargo build --release, or give --zeroflow")
        zeroflow = str(found[0])
    rng = random.Random(args.seed)
    texts = corpus(rng, args.megabytes)
    failures = Failures()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        llama3 = llama3_style(texts)
        llama2 = metaspace_byte_fallback(texts)
        for name, tok, eot_token in [("llama3-style", llama3, "<|end_of_text|>"),
                                     ("metaspace-byte-fallback", llama2, "</s>"),
                                     ("metaspace-first", mistral_style(llama2), "</s>")]:
            path = work / f"{name}.json"
            tok.save(str(path))
            check_documents(name, tok, path, tok.token_to_id(eot_token), texts, work, zeroflow, failures)
            check_text_file(name, tok, path, tok.token_to_id(eot_token), texts, work, zeroflow, failures)
        gpt2 = gpt2_tokenizer(args.gpt2_files)
        if gpt2 is not None:
            # zeroflow's bundled GPT-2 BPE reads "<|endoftext|>" in text as text; these texts have none.
            check_documents("gpt2", gpt2, "gpt2", 50256, texts, work, zeroflow, failures)
            gpt2_path = work / "gpt2.json"
            gpt2.save(str(gpt2_path))
            check_documents("gpt2-tokenizer.json", gpt2, gpt2_path, 50256, texts, work, zeroflow, failures)
        for path in args.extra_tokenizer:
            tok = Tokenizer.from_file(path)
            eot = next((tok.token_to_id(t) for t in ["<|endoftext|>", "<|end_of_text|>", "</s>"]
                        if tok.token_to_id(t) is not None), None)
            if eot is None:
                raise SystemExit(f"{path}: no <|endoftext|>, <|end_of_text|> or </s> token")
            # Named by its folder where it is a model's (llama3/tokenizer.json), else by itself.
            named = Path(path).parent.name if Path(path).name == "tokenizer.json" else Path(path).stem
            name = f"{named}-{tok.get_vocab_size()}"
            check_documents(name, tok, path, eot, texts, work, zeroflow, failures)
            check_text_file(name, tok, path, eot, texts, work, zeroflow, failures)
        chats = conversations(rng, args.conversations)
        for name, template in [("llama3", LLAMA3_TEMPLATE), ("chatml", CHATML_TEMPLATE)]:
            check_chat(name, template, llama3, work, zeroflow, chats, failures)
        tool_chats = tool_conversations(rng, args.conversations)
        check_chat("qwen-tools", QWEN_TOOLS_TEMPLATE, llama3, work, zeroflow, tool_chats, failures)
        for path in args.model_template:
            name, template = Path(path).stem, Path(path).read_text()
            check_model_template(name, template, llama3, work, zeroflow, chats, failures)
            check_model_template(f"{name}-tools", template, llama3, work, zeroflow, tool_chats, failures)
        for folder in map(Path, args.model_dir):
            config = json.loads((folder / "tokenizer_config.json").read_text())
            if not config.get("chat_template"):
                print(f"{folder.name}: no chat template; skipped")
                continue
            tokens = {k: config[k] for k in ("bos_token", "eos_token") if isinstance(config.get(k), str)}
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            for kind, these in [("", chats), ("-tools", tool_chats)]:
                check_model_template(f"{folder.name}-own{kind}", config["chat_template"], tok, work,
                                     zeroflow, these, failures, tokens)
    if failures.count:
        print(f"FAILED: {failures.count} mismatches")
        sys.exit(1)
    print("all ids and masks agree")


if __name__ == "__main__":
    main()
