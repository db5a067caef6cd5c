//! The Llama family: published `config.json` files read, every unsupported field refused by
//! name, the round trip through `to_hf_config`, the named shapes, the kernels, and the model
//! (finite differences, the device, Hugging Face directories).

mod checkpointing;
mod decode;
mod device;
mod fixtures;
mod gradcheck;
mod hf_dir;
mod hf_model;
mod kernels;
mod packing;
mod params;
mod reference;
mod support;
mod transformers_dir;
mod unsupported;

use serde_json::Value;

/// A fixture of `tests/fixtures` (a published `config.json`) as JSON.
pub fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

pub const FIXTURES: [&str; 5] =
    ["Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "Qwen3-0.6B-transformers5", "Mistral-7B-v0.3"];
