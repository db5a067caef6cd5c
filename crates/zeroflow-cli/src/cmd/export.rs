//! `zeroflow export`: a checkpoint to a Hugging Face GPT-2 directory (`model.safetensors` and
//! `config.json`) that `transformers.GPT2LMHeadModel.from_pretrained` loads. The checkpoint's
//! `extra.model` says the family ([`ModelSpec`]); GPT-2 is the one there is.
//!
//! A checkpoint's `model.safetensors` already holds the weights under Hugging Face's names and
//! shapes (the vocabulary padding dropped, `lm_head` tied to `wte`), so exporting checks the
//! checkpoint, copies the weights, and writes the model's `config.json`.

use std::path::{Path, PathBuf};

use crate::InputError;
use anyhow::Context as _;
use zeroflow_engine::checkpoint::{self, CheckpointError};
use zeroflow_train::ModelSpec;

/// Write a checkpoint as a Hugging Face GPT-2 model directory.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The checkpoint directory (a `step-…` directory under a run's `checkpoints/`).
    checkpoint: PathBuf,
    /// Where to write `model.safetensors` and `config.json` (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (model, upload_pending) = read_model_config(&args.checkpoint)?;
    if args.out.exists() && args.out.read_dir().map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(InputError::from_display(format!(
            "{}: exists and is not empty; choose a new --out directory",
            args.out.display()
        )));
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let from = args.checkpoint.join("model.safetensors");
    let to = args.out.join("model.safetensors");
    if upload_pending {
        // The checkpoint was saved while a delayed optimizer step's weights were still on their
        // way to the model: export those (the run's final weights), not the saved model weights.
        let loaded = checkpoint::load::<f32>(&args.checkpoint).map_err(InputError::from_display)?;
        let (weights, tensors) =
            checkpoint::weights_from_master(&loaded).map_err(InputError::from_display)?;
        checkpoint::write_model(&to, &weights, &tensors)?;
    } else {
        std::fs::copy(&from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    let config = hf_config(&model);
    std::fs::write(args.out.join("config.json"), serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("writing {}", args.out.join("config.json").display()))?;
    println!("exported {} to {}", args.checkpoint.display(), args.out.display());
    Ok(())
}

/// The Hugging Face `config.json` of the checkpoint's model. A family that export cannot write
/// gets an arm that refuses it, naming the family.
fn hf_config(model: &ModelSpec) -> serde_json::Value {
    match model {
        ModelSpec::Gpt2(shape) => shape.to_hf_config(),
    }
}

/// Checks the checkpoint fully (every file parses, dtypes agree) and returns its model (a bare
/// shape, from before the family was recorded, is GPT-2's) and whether a delayed update's weights
/// were pending when it was saved.
fn read_model_config(dir: &Path) -> anyhow::Result<(ModelSpec, bool)> {
    let meta = match checkpoint::load::<f32>(dir) {
        Ok(loaded) => loaded.meta,
        Err(CheckpointError::Mismatch { .. }) => {
            checkpoint::load::<zeroflow_core::bf16>(dir).map_err(InputError::from_display)?.meta
        }
        Err(e) => return Err(InputError::from_display(e)),
    };
    let model = meta.extra.get("model").cloned().ok_or_else(|| {
        InputError::from_display(format!(
            "{}: the checkpoint does not record its model's shape (state.json extra.model)",
            dir.display()
        ))
    })?;
    let model = ModelSpec::from_json(model).map_err(|e| {
        InputError::from_display(format!("{}: extra.model in state.json: {e}", dir.display()))
    })?;
    if meta.upload_pending && meta.weights_dtype != "F32" {
        return Err(InputError::from_display(format!(
            "{}: exporting a {} checkpoint saved during a delayed update is not supported yet; \
             export a checkpoint saved without the delayed update",
            dir.display(),
            meta.weights_dtype
        )));
    }
    Ok((model, meta.upload_pending))
}
