//! Named shapes: the Llama 3.x models of 1, 3 and 8 B parameters, as their published
//! `config.json` gives them (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B).

use serde_json::Map;

use crate::config::{Architecture, AttentionBias, LlamaConfig};
use crate::rope::Llama3RopeScaling;

/// The names [`named_shape`] knows.
pub const NAMED_SHAPES: [&str; 3] = ["llama-1b", "llama-3b", "llama-8b"];

/// The configuration of a named shape, `None` for another name.
pub fn named_shape(name: &str) -> Option<LlamaConfig> {
    // (layers, hidden, heads, kv heads, ffn, tied, rope factor)
    let (layers, hidden, heads, kv_heads, ffn, tied, factor) = match name {
        "llama-1b" => (16, 2048, 32, 8, 8192, true, 32.0),
        "llama-3b" => (28, 3072, 24, 8, 8192, true, 32.0),
        "llama-8b" => (32, 4096, 32, 8, 14336, false, 8.0),
        _ => return None,
    };
    Some(LlamaConfig {
        architecture: Architecture::Llama,
        vocab_size: 128_256,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        max_position_embeddings: 131_072,
        tie_word_embeddings: tied,
        attention_bias: AttentionBias::default(),
        qk_norm: false,
        sliding_window: None,
        torch_dtype: Some("bfloat16".into()),
        extra: Map::new(),
    })
}
