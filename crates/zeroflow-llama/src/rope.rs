//! Rotary position embeddings' settings: `rope_theta` and `rope_scaling` (transformers 4.x), or
//! `rope_parameters` (transformers 5).

use serde_json::{Value, json};

use crate::error::LlamaConfigError;
use crate::json::{self, Object};

/// `rope_scaling` of type `llama3` (Llama 3.1 and 3.2): the inverse frequencies of wavelengths
/// longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
/// those shorter than `original_max_position_embeddings / high_freq_factor` are kept, and the
/// ones between are interpolated.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// As `config.json`'s `rope_scaling`.
    pub fn to_json(&self) -> Value {
        json!({
            "factor": self.factor,
            "high_freq_factor": self.high_freq_factor,
            "low_freq_factor": self.low_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "rope_type": "llama3",
        })
    }
}

const IMPLEMENTED: &str = "rope_type \"llama3\" or \"default\" (or no scaling: null)";

/// `rope_theta` and the scaling, from `rope_parameters` where the config has it (transformers 5),
/// else from `rope_theta` (default 10000) and `rope_scaling`.
pub(crate) fn parse(map: &Object) -> Result<(f64, Option<Llama3RopeScaling>), LlamaConfigError> {
    if let Some(parameters) = json::object(map, "rope_parameters")? {
        let theta = json::float(parameters, "rope_theta")?;
        let theta = theta.or(json::float(map, "rope_theta")?).unwrap_or(10_000.0);
        return Ok((theta, scaling(parameters, "rope_parameters")?));
    }
    let theta = json::float(map, "rope_theta")?.unwrap_or(10_000.0);
    let scaling = match json::object(map, "rope_scaling")? {
        Some(object) => scaling(object, "rope_scaling")?,
        None => None,
    };
    Ok((theta, scaling))
}

fn scaling(object: &Object, prefix: &str) -> Result<Option<Llama3RopeScaling>, LlamaConfigError> {
    let (field, kind) = match json::string(object, "rope_type")? {
        Some(kind) => ("rope_type", kind),
        None => ("type", json::string(object, "type")?.unwrap_or("default")),
    };
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let number = |name: &str| {
                json::float(object, name)?
                    .ok_or_else(|| LlamaConfigError::Missing { field: format!("{prefix}.{name}") })
            };
            let original = "original_max_position_embeddings";
            let original_max = json::uint(object, original)?.ok_or_else(|| {
                LlamaConfigError::Missing { field: format!("{prefix}.{original}") }
            })?;
            let scaling = Llama3RopeScaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: original_max,
            };
            if !(scaling.factor > 0.0 && scaling.high_freq_factor > scaling.low_freq_factor) {
                return Err(LlamaConfigError::Invalid {
                    field: prefix.to_string(),
                    reason: "llama3 scaling needs factor > 0 and high_freq_factor > \
                             low_freq_factor"
                        .into(),
                });
            }
            Ok(Some(scaling))
        }
        other => Err(LlamaConfigError::Unsupported {
            field: format!("{prefix}.{field}"),
            found: format!("{other:?}"),
            implemented: IMPLEMENTED,
        }),
    }
}
