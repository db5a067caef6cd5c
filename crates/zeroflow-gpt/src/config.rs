//! Model shapes: the named GPT-2 sizes and custom ones.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::GptError;

/// The shape of a GPT-2 family model. Serialises as the small JSON a custom size is given in:
/// `{"n_layer": 2, "n_head": 4, "d_model": 128, "vocab_size": 64, "context": 64}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads; divides `d_model`.
    pub n_head: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of real tokens. The embedding is padded to [`GptConfig::padded_vocab_size`] rows.
    pub vocab_size: usize,
    /// Longest sequence (rows of the position embedding).
    pub context: usize,
}

/// The sizes that have names. `tiny` is the CPU default; the GPT-2 sizes have Hugging Face's shapes.
pub const NAMED_SIZES: [&str; 6] =
    ["tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1.3b"];

impl GptConfig {
    /// The CPU default: trains on the built-in synthetic corpus (vocabulary 64) in about a minute
    /// on two cores.
    pub const TINY: GptConfig =
        GptConfig { n_layer: 2, n_head: 4, d_model: 128, vocab_size: 64, context: 64 };

    const fn gpt2(n_layer: usize, n_head: usize, d_model: usize) -> GptConfig {
        GptConfig { n_layer, n_head, d_model, vocab_size: 50257, context: 1024 }
    }

    /// A named size (see [`NAMED_SIZES`]).
    pub fn named(name: &str) -> Result<GptConfig, GptError> {
        let config = match name {
            "tiny" => Self::TINY,
            "gpt2-124m" | "gpt2" => Self::gpt2(12, 12, 768),
            "gpt2-350m" | "gpt2-medium" => Self::gpt2(24, 16, 1024),
            "gpt2-774m" | "gpt2-large" => Self::gpt2(36, 20, 1280),
            "gpt2-1.5b" | "gpt2-xl" => Self::gpt2(48, 25, 1600),
            "gpt-1.3b" => GptConfig {
                n_layer: 24,
                n_head: 16,
                d_model: 2048,
                vocab_size: 50304,
                context: 1024,
            },
            _ => return Err(GptError::UnknownSize(name.to_string())),
        };
        Ok(config)
    }

    /// Parses a custom size from JSON and validates it.
    pub fn from_json(json: &str) -> Result<GptConfig, GptError> {
        let config: GptConfig =
            serde_json::from_str(json).map_err(|e| GptError::ConfigJson(e.to_string()))?;
        config.validate()
    }

    /// Checks that the shape is usable: every size non-zero and heads dividing the width.
    pub fn validate(self) -> Result<GptConfig, GptError> {
        let fields = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
            ("vocab_size", self.vocab_size),
            ("context", self.context),
        ];
        if let Some((field, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(GptError::InvalidConfig(format!("{field} must be at least 1")));
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(GptError::InvalidConfig(format!(
                "d_model {} is not a multiple of n_head {}",
                self.d_model, self.n_head
            )));
        }
        Ok(self)
    }

    /// The shape a Hugging Face `GPT2Config` (`config.json`) gives: `n_layer`, `n_head`, `n_embd`,
    /// `vocab_size`, and `n_positions` (or the older `n_ctx`).
    pub fn from_hf_config(json: &serde_json::Value) -> Result<GptConfig, GptError> {
        let field = |keys: &[&str]| {
            keys.iter()
                .find_map(|key| json.get(*key).and_then(serde_json::Value::as_u64))
                .map(|v| v as usize)
                .ok_or_else(|| GptError::ConfigJson(format!("no {} number", keys.join(" or "))))
        };
        Ok(GptConfig {
            n_layer: field(&["n_layer"])?,
            n_head: field(&["n_head"])?,
            d_model: field(&["n_embd"])?,
            vocab_size: field(&["vocab_size"])?,
            context: field(&["n_positions", "n_ctx"])?,
        })
    }

    /// `transformers`' `GPT2Config` for this shape (GELU-tanh, tied embeddings, no dropout).
    /// GPT-2's `<|endoftext|>` (50256) is the BOS/EOS token only where the vocabulary has it.
    pub fn to_hf_config(&self) -> serde_json::Value {
        let end_of_text = (self.vocab_size > 50256).then_some(50256);
        serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.context,
            "n_ctx": self.context,
            "n_embd": self.d_model,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "initializer_range": 0.02,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "tie_word_embeddings": true,
            "bos_token_id": end_of_text,
            "eos_token_id": end_of_text,
            "torch_dtype": "float32",
        })
    }

    /// The vocabulary rounded up to a multiple of 64 (50257 becomes 50304, as in llm.c), the row
    /// count of the embedding and the width of the logits. The padded logits are masked out of the
    /// loss, their embedding rows start at zero and get zero gradient, and export drops them.
    pub fn padded_vocab_size(&self) -> usize {
        self.vocab_size.div_ceil(64) * 64
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }

    /// Number of parameters, the padded embedding rows excluded (Hugging Face's count).
    pub fn num_params(&self) -> usize {
        let (l, c) = (self.n_layer, self.d_model);
        let per_layer = 12 * c * c + 13 * c;
        self.vocab_size * c + self.context * c + l * per_layer + 2 * c
    }
}

impl FromStr for GptConfig {
    type Err = GptError;

    /// A named size, or a JSON object for a custom one.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim_start().starts_with('{') { Self::from_json(s) } else { Self::named(s) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_gpt2_sizes_have_hugging_face_parameter_counts() {
        // The counts Hugging Face reports for the GPT-2 checkpoints.
        let expected = [
            ("gpt2-124m", 124_439_808),
            ("gpt2-350m", 354_823_168),
            ("gpt2-774m", 774_030_080),
            ("gpt2-1.5b", 1_557_611_200),
        ];
        for (name, count) in expected {
            assert_eq!(GptConfig::named(name).unwrap().num_params(), count, "{name}");
        }
        assert_eq!(GptConfig::named("gpt2-124m").unwrap().padded_vocab_size(), 50304);
    }

    #[test]
    fn a_custom_size_parses_from_json_and_bad_shapes_are_refused() {
        let json = r#"{"n_layer": 3, "n_head": 3, "d_model": 36, "vocab_size": 70, "context": 17}"#;
        let config: GptConfig = json.parse().unwrap();
        assert_eq!(config.padded_vocab_size(), 128);
        let bad = r#"{"n_layer": 3, "n_head": 5, "d_model": 36, "vocab_size": 70, "context": 17}"#;
        assert!(matches!(bad.parse::<GptConfig>(), Err(GptError::InvalidConfig(_))));
        assert!(matches!("gpt5".parse::<GptConfig>(), Err(GptError::UnknownSize(_))));
    }
}
