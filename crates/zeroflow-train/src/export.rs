//! A checkpoint as a Hugging Face model directory that `transformers`' `from_pretrained` loads.
//! The checkpoint's `extra.model` says the family ([`ModelSpec`]), whose
//! [`Family::export`](crate::Family::export) writes the directory:
//!
//! - GPT-2: the checkpoint's `model.safetensors` already holds the weights under Hugging Face's
//!   names and shapes (the vocabulary padding dropped, `lm_head` tied to `wte`), so it is copied
//!   ([`copy_weights`]) beside the model's `config.json`.
//! - The Llama family: the weights ([`Checkpoint::f32_weights`]) written by
//!   `zeroflow_llama::save_hf_dir` (`config.json` of the same architecture, sharded above 5 GB
//!   with `model.safetensors.index.json`, in the checkpoint's dtype), with the tokenizer files of
//!   the run's `--init-from` directory where it had one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_engine::checkpoint::{self, CheckpointError, Meta, NamedTensor, Stored};

use crate::error::{Result, input, io};
use crate::{Family, ModelSpec, with_family};

/// A checkpoint to export, checked: its directory and what its `state.json` says.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub model: ModelSpec,
    /// A delayed optimizer step's weights were still on their way to the model when it was saved.
    pub upload_pending: bool,
    /// The element type of its `model.safetensors` (`F32`, `BF16`).
    pub weights_dtype: String,
    /// The Hugging Face directory the run started from (`--init-from`), where it had one.
    pub init_from: Option<PathBuf>,
}

/// Writes the checkpoint `dir` as a Hugging Face model directory `out` (which must not exist,
/// or be empty).
pub fn export(dir: &Path, out: &Path) -> Result<()> {
    let from = read_checkpoint(dir)?;
    if out.exists() && out.read_dir().map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(input(format!(
            "{}: exists and is not empty; choose a new --out directory",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(io(format!("create {}", out.display())))?;
    with_family!(&from.model, family => family.export(&from, out))
}

/// GPT-2's export: the checkpoint's `model.safetensors` copied (or, saved during a delayed
/// update, the optimizer's master weights written in its place) and `config` as `config.json`.
pub fn copy_weights(from: &Checkpoint, out: &Path, config: &serde_json::Value) -> Result<()> {
    let source = from.dir.join("model.safetensors");
    let to = out.join("model.safetensors");
    if from.upload_pending {
        // Export the run's final weights, not the saved model weights.
        let loaded = checkpoint::load::<f32>(&from.dir).map_err(|e| input(e.to_string()))?;
        let (weights, tensors) =
            checkpoint::weights_from_master(&loaded).map_err(|e| input(e.to_string()))?;
        let weights = checkpoint::Elements::lent(&weights);
        checkpoint::write_model(&to, &loaded.meta, &weights, &tensors)?;
    } else {
        let copying = format!("copy {} to {}", source.display(), to.display());
        std::fs::copy(&source, &to).map_err(io(copying))?;
    }
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(config).expect("JSON values serialise") + "\n";
    std::fs::write(&path, text).map_err(io(format!("write {}", path.display())))
}

impl Checkpoint {
    /// The checkpoint's weights (the optimizer's master weights when an update was pending) as
    /// f32 in the flat buffer of `layout`, every tensor of `tensors` there with its shape.
    pub fn f32_weights(&self, layout: &FlatLayout, tensors: &[NamedTensor]) -> Result<Vec<f32>> {
        let by_name = if self.weights_dtype == "F32" {
            let loaded = checkpoint::load::<f32>(&self.dir).map_err(|e| input(e.to_string()))?;
            if self.upload_pending { master_tensors(&loaded)? } else { loaded.tensors }
        } else {
            let loaded = checkpoint::load::<zeroflow_core::bf16>(&self.dir)
                .map_err(|e| input(e.to_string()))?;
            to_f32(loaded.tensors)
        };
        let mut flat = vec![0.0; layout.padded_len()];
        for tensor in tensors {
            let path = self.dir.join("model.safetensors");
            let (shape, values) = by_name.get(&tensor.name).ok_or_else(|| {
                input(format!("{}: it has no tensor {}", path.display(), tensor.name))
            })?;
            if *shape != tensor.shape {
                return Err(input(format!(
                    "{}: {} has shape {shape:?}, its model (state.json extra.model) {:?}",
                    path.display(),
                    tensor.name,
                    tensor.shape
                )));
            }
            flat[tensor.flat.clone()].copy_from_slice(values);
        }
        Ok(flat)
    }
}

/// The master weights of the optimizer parts, by tensor name.
fn master_tensors(loaded: &checkpoint::Loaded<f32>) -> Result<checkpoint::Tensors<f32>> {
    let (flat, tensors) =
        checkpoint::weights_from_master(loaded).map_err(|e| input(e.to_string()))?;
    Ok(tensors.into_iter().map(|t| (t.name, (t.shape, flat[t.flat].to_vec()))).collect())
}

fn to_f32<P: Stored + Float>(tensors: checkpoint::Tensors<P>) -> checkpoint::Tensors<f32> {
    let convert = |(shape, values): (Vec<usize>, Vec<P>)| {
        (shape, values.into_iter().map(Float::to_f32).collect())
    };
    tensors.into_iter().map(|(name, tensor)| (name, convert(tensor))).collect::<HashMap<_, _>>()
}

/// Checks the checkpoint fully (every file parses, dtypes agree) and reads its model (a bare
/// shape, from before the family was recorded, is GPT-2's), whether a delayed update's weights
/// were pending when it was saved, and the run's `--init-from`.
pub(crate) fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let meta: Meta = match checkpoint::load::<f32>(dir) {
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
    let init_from =
        meta.extra.pointer("/run/init_from").and_then(|v| v.as_str()).map(PathBuf::from);
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        model,
        upload_pending: meta.upload_pending,
        weights_dtype: meta.weights_dtype,
        init_from,
    })
}
