//! A checkpoint as a Hugging Face model directory (`model.safetensors` and `config.json`) that
//! `transformers`' `from_pretrained` loads. The checkpoint's `extra.model` says the family
//! ([`ModelSpec`]), whose [`Family::hf_config`](crate::Family::hf_config) writes `config.json`.
//!
//! A checkpoint's `model.safetensors` already holds the weights under Hugging Face's names and
//! shapes (the vocabulary padding dropped, `lm_head` tied to `wte`), so exporting checks the
//! checkpoint, copies the weights, and writes the model's `config.json`.

use std::path::Path;

use zeroflow_engine::checkpoint::{self, CheckpointError};

use crate::error::{Result, input, io};
use crate::{Family, ModelSpec, with_family};

/// Writes the checkpoint `dir` as a Hugging Face model directory `out` (which must not exist,
/// or be empty).
pub fn export(dir: &Path, out: &Path) -> Result<()> {
    let (model, upload_pending) = read_model_config(dir)?;
    if out.exists() && out.read_dir().map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(input(format!(
            "{}: exists and is not empty; choose a new --out directory",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(io(format!("create {}", out.display())))?;
    let from = dir.join("model.safetensors");
    let to = out.join("model.safetensors");
    if upload_pending {
        // The checkpoint was saved while a delayed optimizer step's weights were still on their
        // way to the model: export those (the run's final weights), not the saved model weights.
        let loaded = checkpoint::load::<f32>(dir).map_err(|e| input(e.to_string()))?;
        let (weights, tensors) =
            checkpoint::weights_from_master(&loaded).map_err(|e| input(e.to_string()))?;
        checkpoint::write_model(&to, &weights, &tensors)?;
    } else {
        let copying = format!("copy {} to {}", from.display(), to.display());
        std::fs::copy(&from, &to).map_err(io(copying))?;
    }
    let config = with_family!(model, family => family.hf_config());
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).expect("JSON values serialise") + "\n";
    std::fs::write(&path, text).map_err(io(format!("write {}", path.display())))
}

/// Checks the checkpoint fully (every file parses, dtypes agree) and returns its model (a bare
/// shape, from before the family was recorded, is GPT-2's) and whether a delayed update's weights
/// were pending when it was saved.
fn read_model_config(dir: &Path) -> Result<(ModelSpec, bool)> {
    let meta = match checkpoint::load::<f32>(dir) {
        Ok(loaded) => loaded.meta,
        Err(CheckpointError::Mismatch { .. }) => {
            checkpoint::load::<zeroflow_core::bf16>(dir).map_err(|e| input(e.to_string()))?.meta
        }
        Err(e) => return Err(input(e.to_string())),
    };
    let model = meta.extra.get("model").cloned().ok_or_else(|| {
        input(format!(
            "{}: the checkpoint does not record its model's shape (state.json extra.model)",
            dir.display()
        ))
    })?;
    let model = ModelSpec::from_json(model)
        .map_err(|e| input(format!("{}: extra.model in state.json: {e}", dir.display())))?;
    if meta.upload_pending && meta.weights_dtype != "F32" {
        return Err(input(format!(
            "{}: exporting a {} checkpoint saved during a delayed update is not supported yet; \
             export a checkpoint saved without the delayed update",
            dir.display(),
            meta.weights_dtype
        )));
    }
    Ok((model, meta.upload_pending))
}
