//! [`LlamaConfig`]: the shape and settings of a Llama-family model, read from and written to
//! Hugging Face's `config.json`.
//!
//! Absent fields take the defaults of `transformers`' config class for the architecture (for
//! instance Qwen3's `head_dim` is 128, Mistral's `sliding_window` 4096). A field that changes the
//! model in a way zeroflow does not implement (mixture of experts, quantized weights, another
//! activation or rope type, MLP biases, attention dropout, multimodal rope) is an error naming the
//! field, never a silent approximation. Every field zeroflow does not interpret, and that does not
//! change the model (token ids, `initializer_range`, `use_cache`, Qwen's sliding-window
//! bookkeeping, …), is kept in [`LlamaConfig::extra`] and written back by
//! [`LlamaConfig::to_hf_config`].

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::LlamaConfigError;
use crate::json::{self, Object};
use crate::rope::{self, Llama3RopeScaling};

/// Which `transformers` class a config is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, and models that reuse it).
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v projections always have biases.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head RMSNorm of queries and keys.
    Qwen3,
    /// `MistralForCausalLM`.
    Mistral,
}

impl Architecture {
    pub const ALL: [Architecture; 4] =
        [Architecture::Llama, Architecture::Qwen2, Architecture::Qwen3, Architecture::Mistral];

    /// The class name in `config.json`'s `architectures`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
        }
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Mistral => "mistral",
        }
    }

    /// `max_position_embeddings` when the config does not give it.
    fn default_max_positions(self) -> usize {
        match self {
            Architecture::Llama => 2048,
            Architecture::Qwen2 | Architecture::Qwen3 => 32_768,
            Architecture::Mistral => 4096 * 32,
        }
    }

    /// Whether `attention_bias` is read (Qwen2's biases are fixed; Mistral has none).
    fn reads_attention_bias(self) -> bool {
        matches!(self, Architecture::Llama | Architecture::Qwen3)
    }
}

/// Which attention projections have a bias.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionBias {
    /// `q_proj`, `k_proj` and `v_proj`.
    pub qkv: bool,
    /// `o_proj`.
    pub o: bool,
}

/// A Llama-family model's shape and settings.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Divides `num_attention_heads` (grouped-query attention; equal: multi-head attention).
    pub num_key_value_heads: usize,
    /// Each head's width; `hidden_size / num_attention_heads` unless the config says otherwise.
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    /// `lm_head` is the token embedding (no `lm_head.weight` tensor).
    pub tie_word_embeddings: bool,
    /// Llama's and Qwen3's `attention_bias` (all four projections); Qwen2's fixed q/k/v biases.
    pub attention_bias: AttentionBias,
    /// Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, `head_dim` wide).
    pub qk_norm: bool,
    /// The sliding window in effect, if any: Mistral's `sliding_window`; Qwen's with
    /// `use_sliding_window` on the layers from `max_window_layers` (Qwen's window fields are kept
    /// in [`LlamaConfig::extra`] as read). See [`LlamaConfig::check_sequence_len`].
    pub sliding_window: Option<usize>,
    /// `torch_dtype` (or transformers 5's `dtype`) as given: the dtype the weights were saved in.
    pub torch_dtype: Option<String>,
    /// The fields zeroflow does not interpret, written back as they were.
    pub extra: Object,
}

/// Mixture-of-experts fields: any of them present and > 0 means the model is not dense.
const MOE_FIELDS: &[&str] = &[
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
];

/// The fields [`LlamaConfig::to_hf_config`] writes from the parsed values (all others are in
/// `extra`); `attention_bias` only where the architecture reads it.
const INTERPRETED: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
];

impl LlamaConfig {
    /// Reads a `config.json` of `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or
    /// `MistralForCausalLM`.
    pub fn from_hf_config(json: &Value) -> Result<LlamaConfig, LlamaConfigError> {
        let map = json.as_object().ok_or(LlamaConfigError::NotAnObject)?;
        let architecture = architecture(map)?;
        reject_unsupported(map)?;
        let vocab_size = json::positive(map, "vocab_size")?;
        let hidden_size = json::positive(map, "hidden_size")?;
        let intermediate_size = json::positive(map, "intermediate_size")?;
        let num_hidden_layers = json::positive(map, "num_hidden_layers")?;
        let num_attention_heads = json::positive(map, "num_attention_heads")?;
        let num_key_value_heads = key_value_heads(map, num_attention_heads)?;
        let head_dim = head_dim(map, architecture, hidden_size, num_attention_heads)?;
        let rms_norm_eps = json::float(map, "rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            let reason = "must be > 0".into();
            return Err(LlamaConfigError::Invalid { field: "rms_norm_eps".into(), reason });
        }
        let (rope_theta, rope_scaling) = rope::parse(map)?;
        let max_position_embeddings = json::uint(map, "max_position_embeddings")?
            .unwrap_or(architecture.default_max_positions());
        let tie_word_embeddings = json::boolean(map, "tie_word_embeddings")?.unwrap_or(false);
        let torch_dtype = match json::string(map, "torch_dtype")? {
            Some(dtype) => Some(dtype),
            None => json::string(map, "dtype")?,
        };
        let extra = map
            .iter()
            .filter(|(key, _)| !interpreted(architecture, key))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        Ok(LlamaConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            attention_bias: attention_bias(map, architecture)?,
            qk_norm: architecture == Architecture::Qwen3,
            sliding_window: sliding_window(map, architecture, num_hidden_layers)?,
            torch_dtype: torch_dtype.map(str::to_string),
            extra,
        })
    }

    /// The `config.json` of this model (keys sorted, as `transformers` writes them), which
    /// `transformers.AutoConfig` reads back to the same configuration.
    pub fn to_hf_config(&self) -> Value {
        let mut map: BTreeMap<String, Value> =
            self.extra.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut put = |key: &str, value: Value| {
            map.insert(key.to_string(), value);
        };
        put("architectures", Value::from(vec![self.architecture.hf_class()]));
        put("model_type", self.architecture.model_type().into());
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_hidden_layers", self.num_hidden_layers.into());
        put("num_attention_heads", self.num_attention_heads.into());
        put("num_key_value_heads", self.num_key_value_heads.into());
        let derived_head_dim = self.hidden_size / self.num_attention_heads;
        if self.architecture != Architecture::Qwen2 || self.head_dim != derived_head_dim {
            put("head_dim", self.head_dim.into());
        }
        put("hidden_act", "silu".into());
        put("rms_norm_eps", self.rms_norm_eps.into());
        put("rope_theta", self.rope_theta.into());
        put("rope_scaling", self.rope_scaling.as_ref().map_or(Value::Null, |s| s.to_json()));
        put("max_position_embeddings", self.max_position_embeddings.into());
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        if self.architecture.reads_attention_bias() {
            put("attention_bias", self.attention_bias.qkv.into());
        }
        if let Some(dtype) = &self.torch_dtype {
            put("torch_dtype", dtype.as_str().into());
        }
        self.put_sliding_window(&mut map);
        Value::Object(map.into_iter().collect())
    }

    /// Mistral's `sliding_window` (always written: `MistralConfig` defaults to 4096); for Qwen,
    /// whose window fields are kept in `extra` as read, the fields that give `transformers` the
    /// window of a configuration built in code.
    fn put_sliding_window(&self, map: &mut BTreeMap<String, Value>) {
        let window = self.sliding_window.map_or(Value::Null, Value::from);
        match self.architecture {
            Architecture::Llama => {}
            Architecture::Mistral => {
                map.insert("sliding_window".into(), window);
            }
            Architecture::Qwen2 | Architecture::Qwen3 => {
                if !map.contains_key("use_sliding_window") && self.sliding_window.is_some() {
                    map.insert("use_sliding_window".into(), true.into());
                    map.insert("sliding_window".into(), window);
                    map.insert("max_window_layers".into(), 0.into());
                }
            }
        }
    }

    /// Refuses to train sequences of `seq_len` tokens if a sliding window shorter than that is in
    /// effect: `transformers` would mask the keys beyond the window, zeroflow does not.
    pub fn check_sequence_len(&self, seq_len: usize) -> Result<(), LlamaConfigError> {
        match self.sliding_window {
            Some(window) if window < seq_len => Err(LlamaConfigError::SlidingWindow {
                field: "sliding_window".into(),
                window,
                seq_len,
            }),
            _ => Ok(()),
        }
    }

    /// Key/value projection width: `num_key_value_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Query projection width: `num_attention_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
}

fn interpreted(architecture: Architecture, key: &str) -> bool {
    INTERPRETED.contains(&key)
        || (key == "attention_bias" && architecture.reads_attention_bias())
        || (key == "sliding_window" && architecture == Architecture::Mistral)
}

/// The architecture from `architectures` (its one entry), else from `model_type`.
fn architecture(map: &Object) -> Result<Architecture, LlamaConfigError> {
    let by_class = |class: &str| Architecture::ALL.into_iter().find(|a| a.hf_class() == class);
    if let Some(list) = map.get("architectures").filter(|v| !v.is_null()) {
        let classes: Vec<&str> =
            list.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        return match classes.as_slice() {
            [class] => by_class(class)
                .ok_or_else(|| LlamaConfigError::Architecture { found: class.to_string() }),
            _ => Err(LlamaConfigError::Architecture { found: list.to_string() }),
        };
    }
    let model_type = json::string(map, "model_type")?
        .ok_or_else(|| LlamaConfigError::Missing { field: "architectures".into() })?;
    Architecture::ALL
        .into_iter()
        .find(|a| a.model_type() == model_type)
        .ok_or_else(|| LlamaConfigError::Architecture { found: format!("model_type {model_type}") })
}

fn unsupported(field: &str, found: &Value, implemented: &'static str) -> LlamaConfigError {
    LlamaConfigError::Unsupported {
        field: field.to_string(),
        found: found.to_string(),
        implemented,
    }
}

/// The fields whose value asks for something zeroflow does not implement.
fn reject_unsupported(map: &Object) -> Result<(), LlamaConfigError> {
    for field in MOE_FIELDS {
        if let Some(value) = map.get(*field)
            && value.as_f64().is_some_and(|n| n > 0.0)
        {
            return Err(unsupported(field, value, "dense MLPs (no mixture of experts)"));
        }
    }
    if let Some(value) = map.get("quantization_config").filter(|v| !v.is_null()) {
        return Err(unsupported("quantization_config", value, "unquantized weights"));
    }
    if let Some(act) = json::string(map, "hidden_act")?
        && act != "silu"
    {
        return Err(unsupported("hidden_act", &act.into(), "\"silu\" (SwiGLU MLPs)"));
    }
    if json::boolean(map, "mlp_bias")? == Some(true) {
        return Err(unsupported("mlp_bias", &true.into(), "MLPs without biases"));
    }
    if let Some(p) = json::float(map, "attention_dropout")?
        && p != 0.0
    {
        return Err(unsupported("attention_dropout", &p.into(), "no attention dropout (0.0)"));
    }
    if json::boolean(map, "use_mrope")? == Some(true) {
        return Err(unsupported("use_mrope", &true.into(), "1-D rotary positions"));
    }
    if let Some(f) = json::float(map, "partial_rotary_factor")?
        && f != 1.0
    {
        return Err(unsupported(
            "partial_rotary_factor",
            &f.into(),
            "rotary on the whole head (1.0)",
        ));
    }
    Ok(())
}

/// `num_key_value_heads` (default: one per attention head), which must divide the heads.
fn key_value_heads(map: &Object, heads: usize) -> Result<usize, LlamaConfigError> {
    let kv_heads = match json::uint(map, "num_key_value_heads")? {
        Some(n) => json::positive_value("num_key_value_heads", n)?,
        None => heads,
    };
    if !heads.is_multiple_of(kv_heads) {
        return Err(LlamaConfigError::Invalid {
            field: "num_key_value_heads".into(),
            reason: format!("{kv_heads} key/value heads do not divide {heads} attention heads"),
        });
    }
    Ok(kv_heads)
}

/// Qwen2's q/k/v biases are always there (its `nn.Linear`s have `bias=True`, `o_proj` none);
/// Mistral has none; Llama's and Qwen3's `attention_bias` puts one on all four projections.
fn attention_bias(
    map: &Object,
    architecture: Architecture,
) -> Result<AttentionBias, LlamaConfigError> {
    Ok(match architecture {
        Architecture::Qwen2 => AttentionBias { qkv: true, o: false },
        Architecture::Mistral => AttentionBias::default(),
        Architecture::Llama | Architecture::Qwen3 => {
            let on = json::boolean(map, "attention_bias")?.unwrap_or(false);
            AttentionBias { qkv: on, o: on }
        }
    })
}

/// `head_dim` when given; else Qwen3Config's default of 128, or `hidden_size / heads`.
fn head_dim(
    map: &Object,
    architecture: Architecture,
    hidden_size: usize,
    heads: usize,
) -> Result<usize, LlamaConfigError> {
    if let Some(dim) = json::uint(map, "head_dim")? {
        return json::positive_value("head_dim", dim);
    }
    if architecture == Architecture::Qwen3 {
        return Ok(128);
    }
    if !hidden_size.is_multiple_of(heads) {
        return Err(LlamaConfigError::Invalid {
            field: "hidden_size".into(),
            reason: format!(
                "{hidden_size} is not a multiple of {heads} heads, and there is no head_dim"
            ),
        });
    }
    Ok(hidden_size / heads)
}

/// The sliding window `transformers` applies, if any. Mistral: `sliding_window` (default 4096,
/// `null` for none). Qwen2/Qwen3: `layer_types` where given (any `"sliding_attention"` layer),
/// else `use_sliding_window` (default off) on the layers from `max_window_layers` (default 28).
fn sliding_window(
    map: &Object,
    architecture: Architecture,
    layers: usize,
) -> Result<Option<usize>, LlamaConfigError> {
    let window = |default: Option<usize>| -> Result<Option<usize>, LlamaConfigError> {
        match map.get("sliding_window") {
            None => Ok(default),
            Some(_) => json::uint(map, "sliding_window"),
        }
    };
    match architecture {
        Architecture::Llama => Ok(None),
        Architecture::Mistral => window(Some(4096)),
        Architecture::Qwen2 | Architecture::Qwen3 => {
            if let Some(types) = map.get("layer_types").filter(|v| !v.is_null()) {
                let mut sliding = false;
                for kind in types.as_array().into_iter().flatten() {
                    match kind.as_str() {
                        Some("full_attention") => {}
                        Some("sliding_attention") => sliding = true,
                        _ => {
                            return Err(unsupported(
                                "layer_types",
                                kind,
                                "\"full_attention\" and \"sliding_attention\" layers",
                            ));
                        }
                    }
                }
                return if sliding { window(Some(4096)) } else { Ok(None) };
            }
            if json::boolean(map, "use_sliding_window")? != Some(true) {
                return Ok(None);
            }
            let first_sliding = json::uint(map, "max_window_layers")?.unwrap_or(28);
            if first_sliding >= layers {
                return Ok(None);
            }
            window(Some(4096))
        }
    }
}
