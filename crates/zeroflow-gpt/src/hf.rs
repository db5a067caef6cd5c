//! Hugging Face GPT-2 directories in, through `zeroflow-hf`: `config.json` of a
//! `GPT2LMHeadModel` (what zeroflow's GPT-2 does not compute is an error naming the field) and
//! its weights (`model.safetensors` or the shards of its index; BF16, F16 or F32), read by name
//! into the flat parameter buffer. Names are `GPT2LMHeadModel`'s (`transformer.h.0.…`) or
//! `GPT2Model`'s (without the `transformer.` prefix, as the original `gpt2` files hold them).

use std::path::Path;

use serde_json::Value;
use zeroflow_core::Float;
use zeroflow_core::layout::{FlatLayout, ranges_mut};
use zeroflow_hf::{CONFIG_FILE, HfCheckpoint, HfError};

use crate::GptConfig;
use crate::error::GptError;
use crate::params::hf_tensors;

/// A Hugging Face GPT-2 directory, opened: its shape and its weights (only the headers read).
#[derive(Debug)]
pub struct HfGpt {
    pub config: GptConfig,
    pub checkpoint: HfCheckpoint,
    /// The end-of-text tokens (`config.json`'s `eos_token_id`, none where it has none).
    pub eos_token_ids: Vec<u32>,
}

/// Tensors a directory may hold that the model does not read: the causal-mask buffers of older
/// files, and the LM head, tied to the embedding.
fn ignored(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") || name == "lm_head.weight"
}

impl HfGpt {
    /// Opens `dir`: its `config.json` and the names, shapes and dtypes of its weights (an error
    /// names the file and the field or the tensor).
    pub fn open(dir: &Path) -> Result<HfGpt, GptError> {
        let checkpoint = HfCheckpoint::open(dir)?;
        let json = checkpoint.config().ok_or_else(|| {
            GptError::ConfigJson(format!("{}: missing", dir.join(CONFIG_FILE).display()))
        })?;
        let path = dir.join(CONFIG_FILE);
        let config = check_config(json)
            .and_then(|()| GptConfig::from_hf_config(json)?.validate())
            .map_err(|error| GptError::ConfigJson(format!("{}: {error}", path.display())))?;
        let eos_token_ids = zeroflow_hf::eos_token_ids(json);
        let hf = HfGpt { config, checkpoint, eos_token_ids };
        let layout = crate::flat_layout(&config, 1)?;
        let (mut missing, mut expected) = (Vec::new(), Vec::new());
        for tensor in hf_tensors(&config, &layout)? {
            match hf.stored_name(&tensor.name) {
                Some(name) => expected.push(name.to_string()),
                None => missing.push(tensor.name),
            }
        }
        let unexpected: Vec<String> = hf
            .checkpoint
            .names()
            .filter(|name| !ignored(name) && !expected.iter().any(|e| e == name))
            .map(str::to_string)
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            let dir = dir.to_path_buf();
            return Err(HfError::Names { dir, missing, unexpected }.into());
        }
        Ok(hf)
    }

    /// The name tensor `name` (`GPT2LMHeadModel`'s) has in this directory.
    fn stored_name<'a>(&self, name: &'a str) -> Option<&'a str> {
        let bare = name.strip_prefix("transformer.").unwrap_or(name);
        [name, bare].into_iter().find(|n| self.checkpoint.tensor(n).is_some())
    }

    /// Each tensor's name in this directory's files, its shape and its range of the flat buffer
    /// of `layout`, to read a piece at a time (`zeroflow_hf::SafetensorsFile::read_range`).
    pub fn stored_ranges(
        &self,
        layout: &FlatLayout,
    ) -> Result<Vec<zeroflow_hf::StoredRange>, GptError> {
        let tensors = hf_tensors(&self.config, layout)?;
        Ok(tensors
            .into_iter()
            .map(|t| {
                let name = self.stored_name(&t.name).expect("checked by HfGpt::open");
                (name.to_string(), t.shape, t.flat_range)
            })
            .collect())
    }

    /// Reads every tensor into its range of the flat buffer `params` of `layout` (converted to
    /// `T` through f32); the padded embedding rows and the alignment gaps are left as they are.
    pub fn read_params<T: Float>(
        &self,
        layout: &FlatLayout,
        params: &mut [T],
    ) -> Result<(), GptError> {
        if params.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), params.len());
            return Err(GptError::Length { what: "flat parameter buffer", expected, found });
        }
        let tensors = hf_tensors(&self.config, layout)?;
        let ranges: Vec<_> = tensors.iter().map(|t| t.flat_range.clone()).collect();
        let outs = ranges_mut(params, &ranges).expect("a layout's parameters do not overlap");
        let wanted = tensors.iter().zip(outs).map(|(tensor, out)| {
            let name = self.stored_name(&tensor.name).expect("checked by HfGpt::open");
            (name, &tensor.shape[..], out)
        });
        self.checkpoint.read_tensors_into(wanted.collect())?;
        Ok(())
    }
}

/// The `GPT2Config` fields whose other values zeroflow's GPT-2 does not compute.
fn check_config(json: &Value) -> Result<(), GptError> {
    let refuse = |field: &str, found: &Value, implemented: &str| {
        Err(GptError::ConfigJson(format!("{field}: {found}; zeroflow implements {implemented}")))
    };
    let get = |field: &str| json.get(field).filter(|v| !v.is_null());
    if let Some(found) = get("activation_function")
        && !matches!(found.as_str(), Some("gelu_new" | "gelu_pytorch_tanh"))
    {
        return refuse("activation_function", found, "\"gelu_new\" (GELU, tanh form)");
    }
    let width = json.get("n_embd").and_then(Value::as_u64);
    if let Some(found) = get("n_inner")
        && found.as_u64() != width.map(|w| 4 * w)
    {
        return refuse("n_inner", found, "null (4 · n_embd)");
    }
    if let Some(found) = get("layer_norm_epsilon")
        && found.as_f64() != Some(1e-5)
    {
        return refuse("layer_norm_epsilon", found, "1e-5");
    }
    for (field, implemented) in [
        ("scale_attn_by_inverse_layer_idx", false),
        ("tie_word_embeddings", true),
        ("scale_attn_weights", true),
    ] {
        if let Some(found) = get(field)
            && found.as_bool() != Some(implemented)
        {
            return refuse(field, found, if implemented { "true" } else { "false" });
        }
    }
    Ok(())
}
