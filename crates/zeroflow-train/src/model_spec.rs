//! Which model a checkpoint holds: its family and that family's shape, as `state.json`'s
//! `extra.model` records it, `{"family": "gpt2", "n_layer": 2, …}`. Checkpoints written before
//! the family was recorded hold a bare GPT-2 shape (`{"n_layer": 2, …}`) and read as `gpt2`.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};
use zeroflow_gpt::GptConfig;
use zeroflow_llama::LlamaConfig;

use crate::llama::LlamaSpec;

/// A model family and its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family")]
pub enum ModelSpec {
    /// GPT-2 (`zeroflow-gpt`).
    #[serde(rename = "gpt2")]
    Gpt2(GptConfig),
    /// The Llama family (`zeroflow-llama`): its `config.json`'s fields beside the tag.
    #[serde(rename = "llama")]
    Llama(crate::llama::LlamaSpec),
}

impl ModelSpec {
    /// The families there are, as `family` spells them.
    pub const FAMILIES: &[&str] = &["gpt2", "llama"];

    /// Reads `extra.model`: tagged with its family, or (checkpoints from before the tag) a bare
    /// GPT-2 shape. An unknown family, or a field the family's shape does not have, is an error.
    pub fn from_json(value: serde_json::Value) -> Result<ModelSpec, serde_json::Error> {
        if let Some(family) = value.get("family") {
            if family.as_str().is_some_and(|name| !Self::FAMILIES.contains(&name)) {
                return Err(serde::de::Error::custom(format_args!(
                    "unknown model family {family} (this zeroflow knows {})",
                    Self::FAMILIES.join(", ")
                )));
            }
            serde_json::from_value(value)
        } else {
            serde_json::from_value::<GptConfig>(value).map(ModelSpec::Gpt2)
        }
    }

    /// The named shapes of every family (`zeroflow models`, `--model`), in order.
    pub fn named_shapes() -> Vec<(&'static str, ModelSpec)> {
        let gpt2 = zeroflow_gpt::NAMED_SIZES
            .iter()
            .map(|&name| (name, ModelSpec::Gpt2(GptConfig::named(name).expect("a named size"))));
        let llama = zeroflow_llama::NAMED_SHAPES.iter().map(|&name| {
            let config = zeroflow_llama::named_shape(name).expect("a named shape");
            (name, ModelSpec::Llama(LlamaSpec(config)))
        });
        gpt2.chain(llama).collect()
    }

    /// `--model`'s value: a named shape of any family (`tiny`, `gpt2-124m`, `llama-1b`, …), a
    /// JSON object (GPT-2's shape, or a Hugging Face `config.json`'s fields), or the path of a
    /// JSON file holding either. A `config.json` (one with `architectures` or `model_type`) is
    /// GPT-2's for `GPT2LMHeadModel`, else the Llama family's (whose errors name the field).
    pub fn parse(text: &str) -> Result<ModelSpec, String> {
        if let Some(config) = zeroflow_llama::named_shape(text) {
            return Ok(ModelSpec::Llama(LlamaSpec(config)));
        }
        let trimmed = text.trim_start();
        let json_text = if trimmed.starts_with('{') {
            trimmed.to_owned()
        } else if text.ends_with(".json") || Path::new(text).is_file() {
            std::fs::read_to_string(text).map_err(|e| format!("cannot read {text}: {e}"))?
        } else {
            return GptConfig::named(text).map(ModelSpec::Gpt2).map_err(|e| {
                let llama = zeroflow_llama::NAMED_SHAPES.join(", ");
                format!("{e}; or a Llama shape ({llama}), or a config.json file")
            });
        };
        let json: serde_json::Value =
            serde_json::from_str(&json_text).map_err(|e| format!("not JSON ({e})"))?;
        Self::from_config_json(&json).unwrap_or_else(|| {
            GptConfig::from_json(&json_text).map(ModelSpec::Gpt2).map_err(|e| e.to_string())
        })
    }

    /// The model of a Hugging Face `config.json` (`None` where `json` has neither
    /// `architectures` nor `model_type`): GPT-2's for `GPT2LMHeadModel` (or `model_type`
    /// `gpt2`), else the Llama family's.
    pub fn from_config_json(json: &serde_json::Value) -> Option<Result<ModelSpec, String>> {
        Some(if Self::names_gpt2(json)? {
            GptConfig::from_hf_config(json).map(ModelSpec::Gpt2).map_err(|e| e.to_string())
        } else {
            LlamaConfig::from_hf_config(json)
                .map(|config| ModelSpec::Llama(LlamaSpec(config)))
                .map_err(|e| e.to_string())
        })
    }

    /// Whether a `config.json` is GPT-2's (`architectures` holds `GPT2LMHeadModel`, or there is
    /// no `architectures` and `model_type` is `gpt2`); `None` where it names neither.
    pub fn names_gpt2(json: &serde_json::Value) -> Option<bool> {
        match (json.get("architectures"), json.get("model_type")) {
            (Some(architectures), _) => Some(
                architectures
                    .as_array()
                    .is_some_and(|names| names.iter().any(|name| name == "GPT2LMHeadModel")),
            ),
            (None, Some(model_type)) => Some(model_type == "gpt2"),
            (None, None) => None,
        }
    }

    /// [`ModelSpec::from_json`] for a field that `#[serde(deserialize_with)]` reads.
    pub fn deserialize_tagged_or_bare<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<ModelSpec, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        ModelSpec::from_json(value).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--model` takes every family's named shapes, a config.json's fields (inline or in a file)
    /// as the family its architecture says, and GPT-2's own JSON; an unknown name lists the
    /// known ones.
    #[test]
    fn model_flags_parse_to_their_family() {
        let ModelSpec::Llama(LlamaSpec(one_b)) = ModelSpec::parse("llama-1b").unwrap() else {
            panic!("llama-1b is a Llama shape")
        };
        assert_eq!((one_b.num_hidden_layers, one_b.num_key_value_heads), (16, 8));
        assert_eq!(ModelSpec::parse("tiny").unwrap(), ModelSpec::Gpt2(GptConfig::TINY));
        let qwen = r#"{"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2}"#;
        let path = std::env::temp_dir().join(format!("zeroflow-spec-{}.json", std::process::id()));
        std::fs::write(&path, qwen).unwrap();
        let from_file = ModelSpec::parse(path.to_str().unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(from_file, ModelSpec::parse(qwen).unwrap());
        assert_eq!(
            from_file.num_params(),
            zeroflow_llama::param_count(&match &from_file {
                ModelSpec::Llama(spec) => spec.0.clone(),
                ModelSpec::Gpt2(_) => panic!("a Qwen2 config is the Llama family's"),
            }) as usize
        );
        let gpt = r#"{"n_layer": 1, "n_head": 2, "d_model": 16, "vocab_size": 64, "context": 16}"#;
        assert_eq!(ModelSpec::parse(gpt).unwrap(), ModelSpec::Gpt2(SHAPE));
        let moe = qwen.replace(
            "\"num_key_value_heads\": 2",
            "\"num_key_value_heads\": 2, \"num_experts\": 4",
        );
        assert!(ModelSpec::parse(&moe).unwrap_err().contains("num_experts"));
        let unknown = ModelSpec::parse("llama-70b").unwrap_err();
        assert!(unknown.contains("llama-8b") && unknown.contains("gpt-1.3b"), "{unknown}");
    }

    const SHAPE: GptConfig =
        GptConfig { n_layer: 1, n_head: 2, d_model: 16, vocab_size: 64, context: 16 };

    /// The family is a field beside the shape's own, so a reader of `extra.model.d_model` (as
    /// before the tag) still finds it.
    #[test]
    fn writes_the_family_beside_the_shape() {
        let json = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        let expected = serde_json::json!({
            "family": "gpt2", "n_layer": 1, "n_head": 2, "d_model": 16, "vocab_size": 64,
            "context": 16
        });
        assert_eq!(json, expected);
        assert_eq!(ModelSpec::from_json(json).unwrap(), ModelSpec::Gpt2(SHAPE));
    }

    #[test]
    fn a_bare_shape_from_before_the_tag_reads_as_gpt2() {
        let bare = serde_json::to_value(SHAPE).unwrap();
        assert!(bare.get("family").is_none());
        assert_eq!(ModelSpec::from_json(bare).unwrap(), ModelSpec::Gpt2(SHAPE));
    }

    /// An unknown family is named in the error; a tagged shape with a field GPT-2's shape does not
    /// have is refused, as the bare shape always was.
    #[test]
    fn unknown_families_and_fields_are_errors() {
        let mut mamba = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        mamba["family"] = "mamba".into();
        let e = ModelSpec::from_json(mamba).unwrap_err().to_string();
        assert_eq!(e, r#"unknown model family "mamba" (this zeroflow knows gpt2, llama)"#);
        let mut extra_field = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        extra_field["n_kv_head"] = 2.into();
        let e = ModelSpec::from_json(extra_field).unwrap_err().to_string();
        assert!(e.contains("n_kv_head"), "{e}");
        let e = ModelSpec::from_json(serde_json::json!({"n_layer": 1, "rope": true}));
        assert!(e.unwrap_err().to_string().contains("rope"));
    }

    /// `{"family": "llama", …}` holds the fields of the model's `config.json` beside the tag and
    /// reads back as the same configuration.
    #[test]
    fn a_llama_spec_is_tagged_beside_its_config_json_fields() {
        let config = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": true,
        });
        let llama = zeroflow_llama::LlamaConfig::from_hf_config(&config).unwrap();
        let spec = ModelSpec::Llama(LlamaSpec(llama));
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["family"], "llama");
        assert_eq!(json["architectures"], serde_json::json!(["Qwen2ForCausalLM"]));
        assert_eq!(json["num_key_value_heads"], 2);
        assert_eq!(ModelSpec::from_json(json).unwrap(), spec);
    }
}
