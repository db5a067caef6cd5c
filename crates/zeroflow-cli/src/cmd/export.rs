//! `zeroflow export`: a checkpoint to a Hugging Face GPT-2 directory (`model.safetensors` and
//! `config.json`) that `transformers.GPT2LMHeadModel.from_pretrained` loads
//! ([`zeroflow_train::export`]).

use std::path::PathBuf;

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
    zeroflow_train::export::export(&args.checkpoint, &args.out)?;
    println!("exported {} to {}", args.checkpoint.display(), args.out.display());
    Ok(())
}
