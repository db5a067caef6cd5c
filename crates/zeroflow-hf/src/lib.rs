//! Hugging Face model directories in and out, for every model family of zeroflow.
//!
//! - [`HfCheckpoint::open`] reads a directory: `config.json` (handed to the family as JSON) and
//!   the weights of `model.safetensors`, or of the `model-0000N-of-0000M.safetensors` shards that
//!   `model.safetensors.index.json` maps, in BF16, F16 or F32, read by name into f32.
//!   [`HfCheckpoint::check`] compares the names and shapes with the family's.
//! - [`save`] writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads:
//!   `config.json`, the weights in BF16 or F32 (sharded above [`SaveOptions::max_shard_bytes`],
//!   with the index), and the tokenizer files of a source directory, atomically; [`save_with`]
//!   the same directory of tensors that a caller writes from where they are, a piece at a time.
//!
//! The crate knows no family: names, shapes and `config.json`'s meaning are the family's.

pub mod direct;
pub mod error;
pub mod read;
pub mod write;

pub use error::HfError;
pub use read::{HfCheckpoint, SafetensorsFile, TensorEntry, read_config};
pub use safetensors::Dtype;
pub use write::{
    CHAT_TEMPLATE_FILE, CHAT_TEMPLATES_DIR, DEFAULT_MAX_SHARD_BYTES, DirLayout,
    GENERATION_CONFIG_FILE, OutTensor, SaveDtype, SaveOptions, Saved, TOKENIZER_FILES,
    TokenizerSource, plan_shards, save, save_with, with_torch_dtype,
};

/// A tensor of a model: its name in a directory's files, its shape, and its range of the
/// model's flat parameter buffer (what a family maps its tensors to, to read them a piece at a
/// time).
pub type StoredRange = (String, Vec<usize>, std::ops::Range<usize>);

/// The model's configuration file.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded model.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded model's weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The end-of-text tokens of a `config.json`: its `eos_token_id`, a number or a list of numbers
/// (Llama 3's), empty where it has none.
pub fn eos_token_ids(config: &serde_json::Value) -> Vec<u32> {
    let id = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match config.get("eos_token_id") {
        Some(serde_json::Value::Array(ids)) => ids.iter().filter_map(id).collect(),
        Some(value) => id(value).into_iter().collect(),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod eos_tests {
    use super::*;

    #[test]
    fn eos_token_ids_read_a_number_a_list_or_nothing() {
        assert_eq!(eos_token_ids(&serde_json::json!({"eos_token_id": 50256})), vec![50256]);
        let llama3 = serde_json::json!({"eos_token_id": [128001, 128008, 128009]});
        assert_eq!(eos_token_ids(&llama3), vec![128001, 128008, 128009]);
        assert_eq!(eos_token_ids(&serde_json::json!({"eos_token_id": null})), Vec::<u32>::new());
        assert_eq!(eos_token_ids(&serde_json::json!({})), Vec::<u32>::new());
    }
}
