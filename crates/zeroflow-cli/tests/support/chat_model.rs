//! A tiny random Llama as a Hugging Face directory with a byte-level tokenizer.json and a ChatML
//! template with generation markers, for the test binaries that train or run one (each declares
//! this module itself: `#[path = "support/chat_model.rs"] mod chat_model;`).

use std::path::Path;

use serde_json::json;
use zeroflow_hf::{SaveDtype, SaveOptions};
use zeroflow_llama::{LlamaConfig, flat_layout, init_params, save_hf_dir};

const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}\
{%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}\
{% endgeneration %}{{- '\\n' }}{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}\
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// GPT-2's printable character for a byte (byte-level BPE vocabularies' keys).
pub fn byte_char(byte: u8) -> char {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let b = u32::from(byte);
    if printable(b) {
        return char::from_u32(b).unwrap();
    }
    char::from_u32(256 + (0..b).filter(|&x| !printable(x)).count() as u32).unwrap()
}

/// A byte-level tokenizer.json without merges: byte `b` is token `id_of(b)`; three special
/// tokens after them.
pub fn byte_tokenizer_json(id_of: impl Fn(u8) -> u32) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..=255u8).map(|b| (byte_char(b).to_string(), json!(id_of(b)))).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(256, "<|im_start|>"), special(257, "<|im_end|>"),
                         special(258, "<|endoftext|>")],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

/// The Hugging Face directory: a two-layer Llama over 264 symbols, its tokenizer and template.
pub fn write_model_dir(dir: &Path) {
    let config = LlamaConfig::from_hf_config(&json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 264, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": true,
        "rope_theta": 10000.0,
    }))
    .unwrap();
    let layout = flat_layout(&config, 1).unwrap();
    let mut weights = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 3, &mut weights).unwrap();
    let options =
        SaveOptions { dtype: SaveDtype::F32, max_shard_bytes: u64::MAX, tokenizer_from: None };
    save_hf_dir(dir, &config, &layout, &weights, &options).unwrap();
    let tokenizer = byte_tokenizer_json(u32::from);
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let tokenizer_config = json!({"eos_token": "<|im_end|>", "chat_template": CHATML});
    std::fs::write(dir.join("tokenizer_config.json"), tokenizer_config.to_string()).unwrap();
}

/// `count` conversations whose assistant always answers the same way (something a tiny model
/// learns), one JSON line each, into `path`.
pub fn write_conversations(path: &Path, count: usize) {
    let lines: Vec<String> = (0..count)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("question number {i}?")},
                {"role": "assistant", "content": "the answer is always the same."},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}
