//! Parameter names, shapes and counts in Hugging Face's layout.

use zeroflow_llama::{LlamaConfig, ParamKind, hf_params, named_shape, param_count};

use crate::fixture;

#[test]
fn named_shapes_have_the_published_parameter_counts() {
    // Llama-3.2-1B: 1.24 B, Llama-3.2-3B: 3.21 B, Llama-3.1-8B: 8.03 B.
    assert_eq!(param_count(&named_shape("llama-1b").unwrap()), 1_235_814_400);
    assert_eq!(param_count(&named_shape("llama-3b").unwrap()), 3_212_749_824);
    assert_eq!(param_count(&named_shape("llama-8b").unwrap()), 8_030_261_248);
}

#[test]
fn published_models_have_their_published_parameter_counts() {
    let count = |name: &str| param_count(&LlamaConfig::from_hf_config(&fixture(name)).unwrap());
    // Qwen2.5-0.5B: 0.49 B (biases included); Qwen3-0.6B: 0.6 B; Mistral-7B: 7.25 B.
    assert_eq!(count("Qwen2.5-0.5B"), 494_032_768);
    assert_eq!(count("Qwen3-0.6B"), 596_049_920);
    assert_eq!(count("Mistral-7B-v0.3"), 7_248_023_552);
}

#[test]
fn llama_names_and_shapes_follow_transformers_state_dict() {
    let config = named_shape("llama-8b").unwrap();
    let params = hf_params(&config);
    assert_eq!(params.len(), 1 + 32 * 9 + 2);
    let layer0: Vec<(&str, &[usize])> =
        params[1..10].iter().map(|p| (p.name.as_str(), p.shape.as_slice())).collect();
    let expected: [(&str, &[usize]); 9] = [
        ("model.layers.0.self_attn.q_proj.weight", &[4096, 4096]),
        ("model.layers.0.self_attn.k_proj.weight", &[1024, 4096]),
        ("model.layers.0.self_attn.v_proj.weight", &[1024, 4096]),
        ("model.layers.0.self_attn.o_proj.weight", &[4096, 4096]),
        ("model.layers.0.mlp.gate_proj.weight", &[14336, 4096]),
        ("model.layers.0.mlp.up_proj.weight", &[14336, 4096]),
        ("model.layers.0.mlp.down_proj.weight", &[4096, 14336]),
        ("model.layers.0.input_layernorm.weight", &[4096]),
        ("model.layers.0.post_attention_layernorm.weight", &[4096]),
    ];
    assert_eq!(layer0, expected);
    assert_eq!(params[0].name, "model.embed_tokens.weight");
    assert_eq!(params[0].shape, [128256, 4096]);
    let last: Vec<&str> = params[params.len() - 2..].iter().map(|p| p.name.as_str()).collect();
    assert_eq!(last, ["model.norm.weight", "lm_head.weight"]);
    let tied = hf_params(&named_shape("llama-1b").unwrap());
    assert!(tied.iter().all(|p| p.name != "lm_head.weight"));
}

#[test]
fn qwen2_has_q_k_v_biases_and_qwen3_q_k_norms_of_head_dim() {
    let qwen2 = hf_params(&LlamaConfig::from_hf_config(&fixture("Qwen2.5-0.5B")).unwrap());
    let names: Vec<&str> = qwen2.iter().map(|p| p.name.as_str()).collect();
    for bias in ["q_proj.bias", "k_proj.bias", "v_proj.bias"] {
        let name = format!("model.layers.23.self_attn.{bias}");
        let p = qwen2.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(p.kind, ParamKind::Bias);
    }
    assert!(!names.contains(&"model.layers.0.self_attn.o_proj.bias"));
    let k_bias = qwen2.iter().find(|p| p.name == "model.layers.0.self_attn.k_proj.bias").unwrap();
    assert_eq!(k_bias.shape, [128], "2 kv heads × 64");

    let qwen3 = hf_params(&LlamaConfig::from_hf_config(&fixture("Qwen3-0.6B")).unwrap());
    let q_norm = qwen3.iter().find(|p| p.name == "model.layers.0.self_attn.q_norm.weight").unwrap();
    assert_eq!((q_norm.shape.as_slice(), q_norm.kind), (&[128][..], ParamKind::Norm));
    assert!(qwen3.iter().any(|p| p.name == "model.layers.27.self_attn.k_norm.weight"));
    let q = qwen3.iter().find(|p| p.name == "model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.shape, [2048, 1024], "16 heads × 128 out, 1024 in");
    let o = qwen3.iter().find(|p| p.name == "model.layers.0.self_attn.o_proj.weight").unwrap();
    assert_eq!(o.shape, [1024, 2048]);
}

#[test]
fn every_2d_parameter_splits_on_axis_1_and_records_its_output_axis() {
    let config = named_shape("llama-8b").unwrap();
    for p in hf_params(&config) {
        match p.kind {
            ParamKind::Linear => {
                assert_eq!((p.output_axis, p.split_axis), (0, Some(1)), "{}", p.name)
            }
            ParamKind::Embedding => assert_eq!((p.output_axis, p.split_axis), (1, Some(1))),
            ParamKind::Bias | ParamKind::Norm => {
                assert_eq!((p.shape.len(), p.split_axis), (1, None), "{}", p.name)
            }
        }
    }
}
