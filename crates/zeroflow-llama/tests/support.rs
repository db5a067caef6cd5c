//! Tiny Llama-family models at odd shapes, their perturbed parameters, random batches, and
//! per-tensor comparisons.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use zeroflow_core::layout::FlatLayout;
use zeroflow_llama::{LlamaConfig, flat_layout, init_params};

/// A tiny model's `config.json` of `architecture`, with `fields` on top.
pub fn tiny_json(architecture: &str, fields: Value) -> Value {
    let mut config = json!({
        "architectures": [architecture],
        "vocab_size": 11,
        "hidden_size": 10,
        "intermediate_size": 14,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50.0,
        "tie_word_embeddings": false,
        "initializer_range": 0.2,
    });
    for (key, value) in fields.as_object().expect("fields are an object") {
        config[key] = value.clone();
    }
    config
}

pub fn tiny(architecture: &str, fields: Value) -> LlamaConfig {
    LlamaConfig::from_hf_config(&tiny_json(architecture, fields)).unwrap()
}

/// The models of the whole-model checks, each with what it exercises.
pub fn models() -> Vec<(&'static str, LlamaConfig)> {
    vec![
        // 6 query heads over 2 key/value heads, head_dim 4 with hidden 10 (q width 24), untied.
        ("llama gqa 3:1 untied", tiny("LlamaForCausalLM", json!({}))),
        (
            "llama3 rope scaling, attention biases, tied",
            tiny(
                "LlamaForCausalLM",
                json!({
                    "hidden_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 6, "attention_bias": true, "tie_word_embeddings": true,
                    "rope_theta": 500.0,
                    "rope_scaling": {
                        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16
                    },
                }),
            ),
        ),
        (
            "qwen2 q/k/v biases",
            tiny(
                "Qwen2ForCausalLM",
                json!({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": null, "intermediate_size": 13}),
            ),
        ),
        (
            "qwen3 q/k norm, head_dim 6 with hidden 10",
            tiny(
                "Qwen3ForCausalLM",
                json!({"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6}),
            ),
        ),
        (
            "mistral tied",
            tiny(
                "MistralForCausalLM",
                json!({"tie_word_embeddings": true, "sliding_window": null,
                       "num_attention_heads": 3, "num_key_value_heads": 3}),
            ),
        ),
        (
            "mqa",
            tiny("LlamaForCausalLM", json!({"num_attention_heads": 4, "num_key_value_heads": 1})),
        ),
    ]
}

/// Parameters of `config` (for one rank), initialised and then perturbed so that the norm
/// weights and biases are not at their initial values.
pub fn perturbed_params(config: &LlamaConfig, seed: u64) -> (FlatLayout, Vec<f64>) {
    let layout = flat_layout(config, 1).unwrap();
    let mut params = vec![0.0f64; layout.padded_len()];
    init_params(config, &layout, seed, &mut params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    for view in layout.params() {
        for x in &mut params[view.flat_range()] {
            *x += rng.random_range(-0.1..0.1);
        }
    }
    (layout, params)
}

/// Random `[batch, seq]` inputs and targets below `vocab`.
pub fn random_batch(vocab: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut draw = || (0..n).map(|_| rng.random_range(0..vocab as u32)).collect::<Vec<_>>();
    (draw(), draw())
}

/// ‖a − b‖₂ / max(‖a‖₂, ‖b‖₂, tiny): the relative error of one tensor.
pub fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    norm(&diff) / norm(a).max(norm(b)).max(1e-30)
}
