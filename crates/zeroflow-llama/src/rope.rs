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

impl Llama3RopeScaling {
    /// One inverse frequency after the scaling, as `transformers`' `_compute_llama3_parameters`:
    /// wavelengths shorter than `original / high_freq_factor` kept, longer than
    /// `original / low_freq_factor` divided by `factor`, and between them interpolated by
    /// `smooth = (original / wavelength − low_freq_factor) / (high_freq_factor − low_freq_factor)`.
    pub fn scale_inv_freq(&self, inv_freq: f64) -> f64 {
        let original = self.original_max_position_embeddings as f64;
        let (low, high) = (self.low_freq_factor, self.high_freq_factor);
        let wavelength = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelength < original / high {
            inv_freq
        } else if wavelength > original / low {
            inv_freq / self.factor
        } else {
            let smooth = (original / wavelength - low) / (high - low);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// The rotary frequencies of a model: `head_dim` (even), `rope_theta` and the `llama3` scaling if
/// any. The rotation of pair `i` of a head at position `p` is by the angle `p · inv_freq[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    pub head_dim: usize,
    pub theta: f64,
    pub scaling: Option<Llama3RopeScaling>,
}

impl RopeFreqs {
    /// `inv_freq[i] = theta^(−2i / head_dim)` for `i < head_dim / 2` (`transformers`'
    /// `_compute_default_rope_parameters`, here in f64), then scaled.
    pub fn inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let inv_freq = 1.0 / self.theta.powf((2 * i) as f64 / dim);
                match &self.scaling {
                    Some(scaling) => scaling.scale_inv_freq(inv_freq),
                    None => inv_freq,
                }
            })
            .collect()
    }
}
