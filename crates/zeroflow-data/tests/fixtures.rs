//! Small tokenizers and chat templates written by the tests (no network): a byte-level BPE
//! `tokenizer.json` (GPT-2 / Llama-3 style, a handful of merges), a WordLevel one whose ids need
//! u32 shards, and a Llama-3-style and a ChatML (Qwen-style) template with generation markers.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// A scratch directory for this test, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// GPT-2's map from bytes to the printable characters that byte-level BPE vocabularies use.
pub fn byte_to_char(byte: u8) -> char {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let b = u32::from(byte);
    if printable(b) {
        return char::from_u32(b).unwrap();
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shift).unwrap()
}

/// The merges of [`byte_level_bpe`], in rank order; merge `i` makes token `256 + i`.
pub const MERGES: [(&str, &str); 9] = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
];

/// Special tokens of [`byte_level_bpe`], ids from 265, right after the merges (`tokenizers` gives
/// added tokens the ids after the model's vocabulary, whatever the file says).
pub const SPECIAL: [&str; 7] = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
];

pub fn special_id(token: &str) -> u32 {
    265 + SPECIAL.iter().position(|&t| t == token).unwrap() as u32
}

fn added_token(id: u32, content: &str) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true
    })
}

/// A byte-level BPE tokenizer.json: byte `b` is token `b`, merges from 256, specials from 265.
pub fn byte_level_bpe() -> Value {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_to_char(b).to_string(), json!(b));
    }
    for (i, (a, b)) in MERGES.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + i));
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": SPECIAL.iter().enumerate()
            .map(|(i, t)| added_token(265 + i as u32, t)).collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    })
}

/// Llama-3's split of text into words (its tokenizer.json's `Split` pre-tokenizer).
pub const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// [`byte_level_bpe`] with Llama-3's split before the byte-level mapping, and merges of line
/// breaks, spaces and a full stop with a break (so that where the text is split shows in the
/// ids): `<|endoftext|>` after them.
pub fn llama3_split_bpe() -> Value {
    let mut tokenizer = byte_level_bpe();
    let extra = [("Ċ", "Ċ"), (".", "Ċ"), ("Ġ", "Ġ"), ("ĠĠ", "Ċ")];
    let first = 256 + MERGES.len() as u64;
    for (i, (a, b)) in extra.iter().enumerate() {
        tokenizer["model"]["vocab"][format!("{a}{b}")] = json!(first + i as u64);
        let merge = json!(format!("{a} {b}"));
        tokenizer["model"]["merges"].as_array_mut().unwrap().push(merge);
    }
    let end = first + extra.len() as u64;
    tokenizer["added_tokens"] = json!([added_token(end as u32, "<|endoftext|>")]);
    tokenizer["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
         "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    tokenizer
}

/// How a sentencepiece-style tokenizer.json marks the start of a text with `"▁"`: Llama-2's
/// normalizer (`Prepend`, then spaces replaced), or Mistral's `Metaspace` pre-tokenizer that
/// prepends to the first word.
#[derive(Clone, Copy)]
pub enum Sentencepiece {
    Llama2,
    Mistral,
}

/// A sentencepiece-style BPE tokenizer.json (Llama-2 / Mistral): `<unk>`, `<s>`, `</s>`, the 256
/// byte tokens `<0x00>`… (byte fallback: a line break is `<0x0A>`), `"▁"` and the lowercase letters
/// and digits, merges of `"▁"` with a letter and of letter pairs; a BOS before each text.
pub fn sentencepiece_bpe(style: Sentencepiece) -> Value {
    let mut vocab = serde_json::Map::new();
    for (i, token) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(token.to_string(), json!(i));
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    let singles = std::iter::once('▁').chain('a'..='z').chain('0'..='9');
    let merges: Vec<(String, String)> = ('a'..='z')
        .map(|c| ("▁".to_string(), c.to_string()))
        .chain(["in", "er", "ld", "ll", "or", "he", "li"].map(|p| (p[..1].into(), p[1..].into())))
        .chain(
            [("▁h", "e"), ("▁l", "in"), ("▁he", "ll"), ("▁w", "or"), ("▁wor", "ld")]
                .map(|(a, b)| (a.to_string(), b.to_string())),
        )
        .collect();
    let tokens = singles.map(String::from).chain(merges.iter().map(|(a, b)| format!("{a}{b}")));
    for token in tokens {
        let id = vocab.len();
        vocab.entry(token).or_insert(json!(id));
    }
    let (normalizer, pre_tokenizer) = match style {
        Sentencepiece::Llama2 => (
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ]}),
            Value::Null,
        ),
        Sentencepiece::Mistral => (
            Value::Null,
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                   "split": false}),
        ),
    };
    let special = |id: u32, t: &str| {
        json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    })
}

/// A WordLevel tokenizer.json (whitespace-split words) with ids up to 70000: u32 shards.
pub fn word_level_big() -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added_token(70000, "</s>")],
        "normalizer": null,
        "pre_tokenizer": { "type": "WhitespaceSplit" },
        "post_processor": null,
        "decoder": null,
        "model": {
            "type": "WordLevel",
            "vocab": { "[UNK]": 0, "hello": 1, "world": 2, "big": 69999, "</s>": 70000 },
            "unk_token": "[UNK]"
        }
    })
}

/// Writes a model directory: tokenizer.json and, if given, tokenizer_config.json.
pub fn model_dir(dir: &Path, tokenizer: &Value, config: Option<&Value>) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    dir.to_path_buf()
}

/// A Llama-3-style template (BOS, header tokens, `| trim`, `<|eot_id|>`) with generation markers.
pub const LLAMA3_TEMPLATE: &str = r#"{{- bos_token }}
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
"#;

/// A ChatML (Qwen-style) template: a default system prompt, Python's `.strip()`,
/// `raise_exception` on an unknown role, and generation markers around the assistant's content
/// and `<|im_end|>` (not the newline after it).
pub const CHATML_TEMPLATE: &str = r#"{%- if messages[0].role != 'system' %}
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
"#;

/// `template` without its generation markers (for the prefix-rendering fallback).
pub fn without_markers(template: &str) -> String {
    ["{% generation %}", "{% endgeneration %}", "{%- generation %}", "{%- endgeneration %}"]
        .iter()
        .fold(template.to_string(), |t, tag| t.replace(tag, ""))
}

/// A three-turn conversation (user, assistant, user, assistant, user, assistant) with unicode,
/// digits and whitespace to trim.
pub fn three_turns() -> Vec<Value> {
    vec![
        json!({"role": "user", "content": "hello world"}),
        json!({"role": "assistant", "content": " hello! 42 \n"}),
        json!({"role": "user", "content": "naïve café?"}),
        json!({"role": "assistant", "content": "world\tworld"}),
        json!({"role": "user", "content": "  and  then"}),
        json!({"role": "assistant", "content": "ünïcode ✓ done"}),
    ]
}

/// The one document of a conversation that is not written turn by turn.
pub fn one<T: std::fmt::Debug>(conversation: zeroflow_data::Conversation<T>) -> T {
    assert!(!conversation.turn_by_turn, "{conversation:?}");
    let [document] = <[T; 1]>::try_from(conversation.documents).expect("one document");
    document
}
