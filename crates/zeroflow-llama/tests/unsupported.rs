//! Every field that asks for something zeroflow does not implement is refused, naming it.

use serde_json::{Value, json};
use zeroflow_llama::{LlamaConfig, LlamaConfigError};

use crate::fixture;

/// The error for the Llama-3.2-1B fixture with `field` set to `value`.
fn error_with(base: &str, field: &str, value: Value) -> LlamaConfigError {
    let mut json = fixture(base);
    json[field] = value;
    LlamaConfig::from_hf_config(&json).unwrap_err()
}

fn assert_names(error: &LlamaConfigError, field: &str) {
    let message = error.to_string();
    assert!(message.starts_with(field), "the message must name {field}: {message}");
}

#[test]
fn mixture_of_experts_fields_are_refused() {
    for field in [
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_routed_experts",
    ] {
        let error = error_with("Qwen3-0.6B", field, json!(8));
        assert!(matches!(error, LlamaConfigError::Unsupported { .. }), "{field}: {error:?}");
        assert_names(&error, field);
    }
    // Zero experts is a dense model.
    let mut dense = fixture("Qwen3-0.6B");
    dense["num_experts"] = json!(0);
    LlamaConfig::from_hf_config(&dense).unwrap();
}

#[test]
fn another_rope_type_is_refused_naming_the_field() {
    for kind in ["linear", "dynamic", "yarn", "longrope"] {
        let error =
            error_with("Llama-3.2-1B", "rope_scaling", json!({"rope_type": kind, "factor": 2.0}));
        assert_names(&error, "rope_scaling.rope_type");
        assert!(error.to_string().contains(kind), "{error}");
    }
    let legacy =
        error_with("Llama-3.2-1B", "rope_scaling", json!({"type": "linear", "factor": 2.0}));
    assert_names(&legacy, "rope_scaling.type");
    let v5 = error_with(
        "Qwen3-0.6B-transformers5",
        "rope_parameters",
        json!({"rope_type": "yarn", "rope_theta": 1e6}),
    );
    assert_names(&v5, "rope_parameters.rope_type");
}

#[test]
fn an_incomplete_llama3_scaling_names_the_missing_field() {
    let error = error_with(
        "Llama-3.2-1B",
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    );
    assert_eq!(
        error,
        LlamaConfigError::Missing { field: "rope_scaling.original_max_position_embeddings".into() }
    );
}

#[test]
fn other_activations_biases_dropout_and_quantization_are_refused() {
    let cases = [
        ("hidden_act", json!("gelu")),
        ("mlp_bias", json!(true)),
        ("attention_dropout", json!(0.1)),
        ("quantization_config", json!({"quant_method": "gptq", "bits": 4})),
        ("use_mrope", json!(true)),
        ("partial_rotary_factor", json!(0.5)),
    ];
    for (field, value) in cases {
        let error = error_with("Llama-3.2-1B", field, value);
        assert!(matches!(error, LlamaConfigError::Unsupported { .. }), "{field}: {error:?}");
        assert_names(&error, field);
    }
}

#[test]
fn other_architectures_are_refused_naming_them() {
    let error = error_with("Llama-3.2-1B", "architectures", json!(["Qwen2MoeForCausalLM"]));
    assert!(
        error.to_string().starts_with("architectures")
            && error.to_string().contains("Qwen2MoeForCausalLM"),
        "{error}"
    );
    let mut by_type = fixture("Mistral-7B-v0.3");
    by_type.as_object_mut().unwrap().remove("architectures");
    let config = LlamaConfig::from_hf_config(&by_type).unwrap();
    assert_eq!(config.architecture, zeroflow_llama::Architecture::Mistral, "model_type decides");
}

#[test]
fn bad_shapes_are_refused_naming_the_field() {
    assert_names(
        &error_with("Llama-3.2-1B", "num_key_value_heads", json!(5)),
        "num_key_value_heads",
    );
    assert_names(&error_with("Llama-3.2-1B", "hidden_size", json!(0)), "hidden_size");
    assert_names(&error_with("Llama-3.2-1B", "vocab_size", json!("many")), "vocab_size");
    assert_names(&error_with("Llama-3.2-1B", "intermediate_size", json!(-1)), "intermediate_size");
    let mut missing = fixture("Llama-3.2-1B");
    missing.as_object_mut().unwrap().remove("num_hidden_layers");
    assert_eq!(
        LlamaConfig::from_hf_config(&missing).unwrap_err(),
        LlamaConfigError::Missing { field: "num_hidden_layers".into() }
    );
}
