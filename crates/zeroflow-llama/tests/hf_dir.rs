//! Tiny random models of each architecture written as Hugging Face directories by `zeroflow-hf`
//! and read back against the family's names and shapes.

use serde_json::json;
use zeroflow_hf::{HfCheckpoint, OutTensor, SaveDtype, SaveOptions};
use zeroflow_llama::{LlamaConfig, hf_params};

/// Odd tiny shapes: GQA 3:1, untied, llama3 rope (Llama); Qwen2's biases; Qwen3's head_dim ≠
/// hidden / heads; Mistral.
fn tiny_configs() -> Vec<serde_json::Value> {
    let base = |arch: &str, model_type: &str| {
        json!({
            "architectures": [arch], "model_type": model_type, "vocab_size": 97,
            "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
            "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": false,
        })
    };
    let mut llama = base("LlamaForCausalLM", "llama");
    llama["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let mut qwen2 = base("Qwen2ForCausalLM", "qwen2");
    qwen2["tie_word_embeddings"] = json!(true);
    let mut qwen3 = base("Qwen3ForCausalLM", "qwen3");
    qwen3["head_dim"] = json!(12);
    let mistral = base("MistralForCausalLM", "mistral");
    vec![llama, qwen2, qwen3, mistral]
}

#[test]
fn tiny_random_models_of_every_architecture_read_back_with_their_names_and_values() {
    for (i, json) in tiny_configs().into_iter().enumerate() {
        let config = LlamaConfig::from_hf_config(&json).unwrap();
        let params = hf_params(&config);
        let values: Vec<Vec<f32>> = params
            .iter()
            .enumerate()
            .map(|(t, p)| (0..p.numel()).map(|j| ((t * 31 + j) as f32 * 0.01).cos()).collect())
            .collect();
        let tensors: Vec<OutTensor<'_>> = params
            .iter()
            .zip(&values)
            .map(|(p, v)| OutTensor { name: &p.name, shape: &p.shape, values: v })
            .collect();
        let dir =
            std::env::temp_dir().join(format!("zeroflow-llama-hf-{i}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options =
            SaveOptions { dtype: SaveDtype::F32, max_shard_bytes: 20_000, tokenizer_from: None };
        let saved = zeroflow_hf::save(&dir, &config.to_hf_config(), &tensors, &options).unwrap();
        assert!(saved.weight_files.len() > 1, "{:?}: sharded", config.architecture);

        let read = HfCheckpoint::open(&dir).unwrap();
        let back = LlamaConfig::from_hf_config(read.config().unwrap()).unwrap();
        assert_eq!(LlamaConfig { torch_dtype: config.torch_dtype.clone(), ..back.clone() }, config);
        assert_eq!(back.torch_dtype.as_deref(), Some("float32"));
        let expected = params.iter().map(|p| (p.name.as_str(), p.shape.as_slice()));
        read.check(expected, |_| false).unwrap();
        for (p, v) in params.iter().zip(&values) {
            assert_eq!(&read.read_f32(&p.name).unwrap(), v, "{}", p.name);
        }
        // A family whose names differ (a Qwen2 read as if it had no biases) is told what differs.
        let without_biases: Vec<_> = params
            .iter()
            .filter(|p| !p.name.ends_with(".bias"))
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        let has_biases = params.len() != without_biases.len();
        assert_eq!(read.check(without_biases, |_| false).is_err(), has_biases);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
