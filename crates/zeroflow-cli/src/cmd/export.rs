//! `zeroflow export`: a checkpoint to a Hugging Face directory of its family (weights and
//! `config.json`) that `transformers`' `from_pretrained` loads ([`zeroflow_train::export`]).

use std::path::PathBuf;

/// Write a checkpoint as a Hugging Face model directory (GPT-2 or the Llama family).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The checkpoint directory (a `step-…` directory under a run's `checkpoints/`), or a run
    /// directory (its newest checkpoint).
    checkpoint: PathBuf,
    /// Where to write the weights, config.json and (for a run started --init-from a directory)
    /// its tokenizer files, with the run's --chat-template where it gave one; must not exist, or
    /// be empty.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let checkpoint = zeroflow_train::export::checkpoint_in(&args.checkpoint)?;
    let saved = zeroflow_train::export::export(&checkpoint, &args.out)?;
    println!(
        "exported {} to {} ({} of weights in {} file(s){})",
        checkpoint.display(),
        args.out.display(),
        zeroflow_engine::checkpoint::disk_size(saved.total_size),
        saved.weight_files.len(),
        match saved.tokenizer_files.len() {
            0 => String::new(),
            n => format!(", {n} tokenizer file(s)"),
        }
    );
    Ok(())
}
