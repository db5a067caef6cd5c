//! README's "Fine-tune a Hugging Face model on chat data", step by step on the CPU: a tiny random
//! Llama directory with a byte-level tokenizer.json and a ChatML template with generation markers
//! (written here), `train --init-from DIR --data chat.jsonl` (tokenized at start-up into the run
//! directory, with the assistant-only loss mask, and an evaluation set held out from its end),
//! then `export` of the last checkpoint.

use std::path::Path;

use serde_json::json;
use zeroflow_hf::{SaveDtype, SaveOptions};
use zeroflow_llama::{LlamaConfig, flat_layout, init_params, save_hf_dir};

use super::{read_lines, scratch, text, train};

const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}\
{%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}\
{% endgeneration %}{{- '\\n' }}{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}\
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// GPT-2's printable character for a byte (byte-level BPE vocabularies' keys).
fn byte_char(byte: u8) -> char {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let b = u32::from(byte);
    if printable(b) {
        return char::from_u32(b).unwrap();
    }
    char::from_u32(256 + (0..b).filter(|&x| !printable(x)).count() as u32).unwrap()
}

/// A byte-level tokenizer.json without merges: byte `b` is token `id_of(b)`; three special
/// tokens after them.
pub(super) fn byte_tokenizer_json(id_of: impl Fn(u8) -> u32) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..=255u8).map(|b| (byte_char(b).to_string(), json!(id_of(b)))).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
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
pub(super) fn write_model_dir(dir: &Path) {
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

/// Conversations whose assistant always answers the same way: something a tiny model learns.
fn write_chat(path: &Path) {
    let lines: Vec<String> = (0..60)
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

#[test]
fn readme_fine_tune_on_chat_data_trains_and_exports() {
    let dir = scratch("chat_fine_tune");
    let (model, chat, run, exported) =
        (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"), dir.join("exported"));
    write_model_dir(&model);
    write_chat(&chat);
    let args = [
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        chat.to_str().unwrap(),
        "--steps",
        "20",
        "--micro-batch",
        "4",
        "--seq",
        "32",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--out",
        run.to_str().unwrap(),
    ];
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    assert!(run.join("tokens/rank-0/tokens_000000.mask").is_file(), "the loss mask was written");
    let lines = read_lines(&run.join("metrics.jsonl"));
    let losses: Vec<f64> = lines.iter().filter_map(|l| l.get("loss")?.as_f64()).collect();
    assert_eq!(losses.len(), 20);
    assert!(losses[19] < losses[0] - 1.0, "the assistant's reply is learned: {losses:?}");
    let evals: Vec<f64> = lines.iter().filter_map(|l| l.get("eval_loss")?.as_f64()).collect();
    // Evaluated at the start (--init-from) and at the end, on the held-out tail.
    assert_eq!(evals.len(), 2, "{lines:?}");
    assert!(evals[1] < evals[0], "{evals:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let eval_data = summary["eval_data"].as_str().unwrap();
    assert!(eval_data.contains("held out from the end") && eval_data.contains("never trained"));
    let events = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents."))
        .count();
    assert_eq!(events, 1, "one TensorBoard event file");

    let last = run.join("checkpoints").join("step-00000020");
    let export = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["export", last.to_str().unwrap(), "--out", exported.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", text(&export.stderr));
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(exported.join(file).is_file(), "{file} exported");
    }
}

/// `train --data chat.jsonl --pack`: the conversations tokenized at start-up come with their
/// document index, so the Llama model trains on packed rows (each conversation attending only
/// to itself, the loss still the assistant's only) and evaluates on packed windows.
#[test]
fn chat_data_trains_packed() {
    let dir = scratch("chat_packed");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    write_model_dir(&model);
    write_chat(&chat);
    let args = [
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        chat.to_str().unwrap(),
        "--pack",
        "--steps",
        "10",
        "--micro-batch",
        "4",
        "--seq",
        "64",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--out",
        run.to_str().unwrap(),
    ];
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    assert!(run.join("tokens/rank-0/tokens_000000.idx").is_file(), "the document index");
    let lines = read_lines(&run.join("metrics.jsonl"));
    let losses: Vec<f64> = lines.iter().filter_map(|l| l.get("loss")?.as_f64()).collect();
    assert_eq!(losses.len(), 10);
    assert!(losses[9] < losses[0], "it learns: {losses:?}");
    let evals = lines.iter().filter(|l| l.get("eval_loss").is_some()).count();
    assert_eq!(evals, 2, "{lines:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["settings"]["pack"], true, "{summary}");
}
