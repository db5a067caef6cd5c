//! Which model a checkpoint holds: its family and that family's shape, as `state.json`'s
//! `extra.model` records it, `{"family": "gpt2", "n_layer": 2, …}`. Checkpoints written before
//! the family was recorded hold a bare GPT-2 shape (`{"n_layer": 2, …}`) and read as `gpt2`.

use serde::{Deserialize, Deserializer, Serialize};
use zeroflow_gpt::GptConfig;

/// A model family and its shape.
///
/// The `llama` variant is behind the `llama` feature until the trainer (moving from
/// zeroflow-cli) has an arm for it in each `match`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(not(feature = "llama"), derive(Copy, Eq))]
#[serde(tag = "family")]
pub enum ModelSpec {
    /// GPT-2 (`zeroflow-gpt`).
    #[serde(rename = "gpt2")]
    Gpt2(GptConfig),
    /// The Llama family (`zeroflow-llama`): its `config.json`'s fields beside the tag.
    #[cfg(feature = "llama")]
    #[serde(rename = "llama")]
    Llama(crate::llama::LlamaSpec),
}

impl ModelSpec {
    /// The families there are, as `family` spells them.
    pub const FAMILIES: &[&str] = &[
        "gpt2",
        #[cfg(feature = "llama")]
        "llama",
    ];

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
        let known = if cfg!(feature = "llama") { "gpt2, llama" } else { "gpt2" };
        assert_eq!(e, format!(r#"unknown model family "mamba" (this zeroflow knows {known})"#));
        let mut extra_field = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        extra_field["n_kv_head"] = 2.into();
        let e = ModelSpec::from_json(extra_field).unwrap_err().to_string();
        assert!(e.contains("n_kv_head"), "{e}");
        let e = ModelSpec::from_json(serde_json::json!({"n_layer": 1, "rope": true}));
        assert!(e.unwrap_err().to_string().contains("rope"));
    }

    /// `{"family": "llama", …}` holds the fields of the model's `config.json` beside the tag and
    /// reads back as the same configuration.
    #[cfg(feature = "llama")]
    #[test]
    fn a_llama_spec_is_tagged_beside_its_config_json_fields() {
        let config = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": true,
        });
        let llama = zeroflow_llama::LlamaConfig::from_hf_config(&config).unwrap();
        let spec = ModelSpec::Llama(crate::llama::LlamaSpec(llama));
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["family"], "llama");
        assert_eq!(json["architectures"], serde_json::json!(["Qwen2ForCausalLM"]));
        assert_eq!(json["num_key_value_heads"], 2);
        assert_eq!(ModelSpec::from_json(json).unwrap(), spec);
    }
}
