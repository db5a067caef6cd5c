//! Which model a checkpoint holds: its family and that family's shape, as `state.json`'s
//! `extra.model` records it, `{"family": "gpt2", "n_layer": 2, …}`. Checkpoints written before
//! the family was recorded hold a bare GPT-2 shape (`{"n_layer": 2, …}`) and read as `gpt2`.

use serde::{Deserialize, Deserializer, Serialize};
use zeroflow_gpt::GptConfig;

/// A model family and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "family")]
pub enum ModelSpec {
    /// GPT-2 (`zeroflow-gpt`).
    #[serde(rename = "gpt2")]
    Gpt2(GptConfig),
}

impl ModelSpec {
    /// The families there are, as `family` spells them.
    pub const FAMILIES: [&str; 1] = ["gpt2"];

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
        let mut llama = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        llama["family"] = "llama".into();
        let e = ModelSpec::from_json(llama).unwrap_err().to_string();
        assert_eq!(e, r#"unknown model family "llama" (this zeroflow knows gpt2)"#);
        let mut extra_field = serde_json::to_value(ModelSpec::Gpt2(SHAPE)).unwrap();
        extra_field["n_kv_head"] = 2.into();
        let e = ModelSpec::from_json(extra_field).unwrap_err().to_string();
        assert!(e.contains("n_kv_head"), "{e}");
        let e = ModelSpec::from_json(serde_json::json!({"n_layer": 1, "rope": true}));
        assert!(e.unwrap_err().to_string().contains("rope"));
    }
}
