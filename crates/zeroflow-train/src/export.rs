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

use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_engine::checkpoint::{self, CheckpointError, Meta, NamedTensor};

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
        let opened = checkpoint::open::<f32>(&from.dir).map_err(|e| input(e.to_string()))?;
        let (weights, tensors) =
            checkpoint::weights_from_master::<f32>(&opened).map_err(|e| input(e.to_string()))?;
        let weights = checkpoint::Elements::lent(&weights);
        checkpoint::write_model(&to, &opened.meta, &weights, &tensors)?;
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
    /// f32 in the flat buffer of `layout`, every tensor of `tensors` there with its shape, read
    /// from the files a tensor (or a piece) at a time.
    pub fn f32_weights(&self, layout: &FlatLayout, tensors: &[NamedTensor]) -> Result<Vec<f32>> {
        let opened = self.open()?;
        let error = |e: CheckpointError| input(e.to_string());
        if !self.upload_pending {
            return opened.flat_weights(tensors, layout.padded_len()).map_err(error);
        }
        let (master, saved) = checkpoint::weights_from_master::<f32>(&opened).map_err(error)?;
        let mut flat = vec![0.0; layout.padded_len()];
        for tensor in tensors {
            let path = self.dir.join("model.safetensors");
            let found = saved.iter().find(|t| t.name == tensor.name).ok_or_else(|| {
                input(format!("{}: it has no tensor {}", path.display(), tensor.name))
            })?;
            if found.shape != tensor.shape {
                return Err(input(format!(
                    "{}: {} has shape {:?}, its model (state.json extra.model) {:?}",
                    path.display(),
                    tensor.name,
                    found.shape,
                    tensor.shape
                )));
            }
            flat[tensor.flat.clone()].copy_from_slice(&master[found.flat.clone()]);
        }
        Ok(flat)
    }

    /// The checkpoint opened for its weights' element type.
    fn open(&self) -> Result<checkpoint::Opened> {
        let opened = if self.weights_dtype == "F32" {
            checkpoint::open::<f32>(&self.dir)
        } else {
            checkpoint::open::<zeroflow_core::bf16>(&self.dir)
        };
        opened.map_err(|e| input(e.to_string()))
    }
}

/// Checks the checkpoint (`checkpoint::open`: every file's header against the file, dtypes
/// agree) and reads its model (a bare
/// shape, from before the family was recorded, is GPT-2's), whether a delayed update's weights
/// were pending when it was saved, and the run's `--init-from`.
pub(crate) fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let meta: Meta = match checkpoint::open::<f32>(dir) {
        Ok(opened) => opened.meta,
        Err(CheckpointError::Mismatch { .. }) => {
            checkpoint::open::<zeroflow_core::bf16>(dir).map_err(|e| input(e.to_string()))?.meta
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
