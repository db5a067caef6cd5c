//! Published configurations read as `transformers` reads them, and written back unchanged.

use serde_json::json;
use zeroflow_llama::{Architecture, AttentionBias, Llama3RopeScaling, LlamaConfig, named_shape};

use crate::{FIXTURES, fixture};

fn parse(name: &str) -> LlamaConfig {
    LlamaConfig::from_hf_config(&fixture(name)).unwrap()
}

#[test]
fn llama_3_2_1b_is_the_llama_1b_named_shape() {
    let config = parse("Llama-3.2-1B");
    assert_eq!(config.architecture, Architecture::Llama);
    assert_eq!(config.head_dim, 64);
    assert_eq!(
        config.rope_scaling,
        Some(Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    assert_eq!(config.attention_bias, AttentionBias::default());
    assert_eq!(config.extra["bos_token_id"], 128000);
    let named = named_shape("llama-1b").unwrap();
    assert_eq!(LlamaConfig { extra: config.extra.clone(), ..named }, config);
}

#[test]
fn qwen2_5_has_q_k_v_biases_and_no_window_in_effect() {
    let config = parse("Qwen2.5-0.5B");
    assert_eq!(config.architecture, Architecture::Qwen2);
    assert_eq!(
        (config.hidden_size, config.num_attention_heads, config.num_key_value_heads),
        (896, 14, 2)
    );
    assert_eq!(config.head_dim, 64, "896 / 14");
    assert_eq!(config.attention_bias, AttentionBias { qkv: true, o: false });
    assert!(!config.qk_norm);
    assert_eq!((config.rms_norm_eps, config.rope_theta), (1e-6, 1e6));
    assert_eq!(config.rope_scaling, None);
    assert!(config.tie_word_embeddings);
    assert_eq!(config.sliding_window, None, "use_sliding_window is false");
    config.check_sequence_len(1 << 20).unwrap();
}

#[test]
fn qwen3_has_q_k_norms_and_a_head_dim_not_hidden_over_heads() {
    for name in ["Qwen3-0.6B", "Qwen3-0.6B-transformers5"] {
        let config = parse(name);
        assert_eq!(config.architecture, Architecture::Qwen3);
        assert!(config.qk_norm);
        assert_eq!((config.head_dim, config.hidden_size / config.num_attention_heads), (128, 64));
        assert_eq!((config.q_dim(), config.kv_dim()), (2048, 1024));
        assert_eq!(config.attention_bias, AttentionBias::default());
        assert_eq!(config.rope_theta, 1e6, "{name}");
        assert_eq!(config.rope_scaling, None);
        assert_eq!(config.sliding_window, None);
        assert_eq!(config.torch_dtype.as_deref(), Some("bfloat16"), "{name}");
    }
}

#[test]
fn qwen3_without_head_dim_takes_qwen3configs_default_of_128() {
    let mut json = fixture("Qwen3-0.6B");
    json.as_object_mut().unwrap().remove("head_dim");
    assert_eq!(LlamaConfig::from_hf_config(&json).unwrap().head_dim, 128);
    let mut llama = fixture("Llama-3.2-1B");
    llama.as_object_mut().unwrap().remove("head_dim");
    assert_eq!(LlamaConfig::from_hf_config(&llama).unwrap().head_dim, 2048 / 32);
}

#[test]
fn mistral_v0_3_is_untied_with_no_sliding_window() {
    let config = parse("Mistral-7B-v0.3");
    assert_eq!(config.architecture, Architecture::Mistral);
    assert_eq!((config.vocab_size, config.head_dim), (32768, 128));
    assert!(!config.tie_word_embeddings);
    assert_eq!(config.sliding_window, None);
    assert_eq!(config.attention_bias, AttentionBias::default());
}

#[test]
fn every_fixture_round_trips_through_to_hf_config() {
    for name in FIXTURES {
        let config = parse(name);
        let written = config.to_hf_config();
        assert_eq!(LlamaConfig::from_hf_config(&written).unwrap(), config, "{name}");
        // Every field of the published file is written back, with the same value where
        // zeroflow does not rewrite it (transformers 5's rope_parameters become rope_theta).
        for (key, value) in fixture(name).as_object().unwrap() {
            if key == "rope_parameters" || key == "dtype" {
                continue;
            }
            let back = &written[key.as_str()];
            let same =
                back == value || (back.as_f64().is_some() && back.as_f64() == value.as_f64());
            assert!(same, "{name}: {key} was {value}, is written {back}");
        }
    }
}

#[test]
fn named_shapes_round_trip_and_write_llama3_rope_scaling() {
    for name in zeroflow_llama::NAMED_SHAPES {
        let config = named_shape(name).unwrap();
        let written = config.to_hf_config();
        assert_eq!(LlamaConfig::from_hf_config(&written).unwrap(), config, "{name}");
        assert_eq!(written["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(written["architectures"], json!(["LlamaForCausalLM"]));
    }
    assert_eq!(named_shape("llama-8b").unwrap().rope_scaling.unwrap().factor, 8.0);
    assert!(named_shape("llama-70b").is_none());
}

#[test]
fn qwen2_writes_head_dim_only_when_it_is_not_hidden_over_heads() {
    let config = parse("Qwen2.5-0.5B");
    assert!(config.to_hf_config().get("head_dim").is_none());
    let odd = LlamaConfig { head_dim: 96, ..config };
    let written = odd.to_hf_config();
    assert_eq!(written["head_dim"], 96);
    assert_eq!(LlamaConfig::from_hf_config(&written).unwrap(), odd);
}

#[test]
fn a_sliding_window_in_effect_refuses_longer_sequences_only() {
    let mut mistral = fixture("Mistral-7B-v0.3");
    mistral["sliding_window"] = json!(4096);
    let config = LlamaConfig::from_hf_config(&mistral).unwrap();
    assert_eq!(config.sliding_window, Some(4096));
    config.check_sequence_len(4096).unwrap();
    let message = config.check_sequence_len(4097).unwrap_err().to_string();
    assert!(
        message.contains("sliding_window") && message.contains("4096") && message.contains("4097"),
        "{message}"
    );
    // Mistral's default window (the field absent) is 4096, as MistralConfig's.
    mistral.as_object_mut().unwrap().remove("sliding_window");
    assert_eq!(LlamaConfig::from_hf_config(&mistral).unwrap().sliding_window, Some(4096));

    // Qwen: in effect only with use_sliding_window and layers from max_window_layers on.
    let mut qwen = fixture("Qwen2.5-0.5B");
    qwen["use_sliding_window"] = json!(true);
    assert_eq!(
        LlamaConfig::from_hf_config(&qwen).unwrap().sliding_window,
        None,
        "24 of 24 layers full"
    );
    qwen["max_window_layers"] = json!(20);
    let config = LlamaConfig::from_hf_config(&qwen).unwrap();
    assert_eq!(config.sliding_window, Some(32768));
    assert!(config.check_sequence_len(32769).is_err());
    // transformers 5's layer_types decide where given.
    let mut qwen3 = fixture("Qwen3-0.6B-transformers5");
    qwen3["layer_types"][27] = json!("sliding_attention");
    qwen3["sliding_window"] = json!(1024);
    let config = LlamaConfig::from_hf_config(&qwen3).unwrap();
    assert_eq!(config.sliding_window, Some(1024));
    assert!(config.check_sequence_len(2048).is_err());
}

#[test]
fn a_window_built_in_code_is_written_so_that_it_reads_back() {
    let mut config = parse("Qwen2.5-0.5B");
    for key in ["use_sliding_window", "sliding_window", "max_window_layers"] {
        config.extra.remove(key);
    }
    config.sliding_window = Some(512);
    let back = LlamaConfig::from_hf_config(&config.to_hf_config()).unwrap();
    assert_eq!(back.sliding_window, Some(512));
    let mistral = LlamaConfig { sliding_window: None, ..parse("Mistral-7B-v0.3") };
    let mut without = mistral.clone();
    without.extra.remove("sliding_window");
    assert_eq!(
        without.to_hf_config()["sliding_window"],
        serde_json::Value::Null,
        "not MistralConfig's 4096"
    );
}
