//! Greedy generation and the stream loss of a Hugging Face directory of either family
//! (`GPT2LMHeadModel`, or Llama / Qwen2 / Qwen3 / Mistral), on the CPU in f32 or on a GPU in
//! bf16 (`--device cuda`), for `scripts/generate-oracle.py` to compare with `transformers`:
//!
//! `generate DIR --prompt IDS [--prompt IDS …] --max-new-tokens N [--eval IDS --window W]
//! [--device cpu|cuda|cuda:N]`
//!
//! The prompts (`1,2,3`) run as one batch of sequences of their own lengths through the
//! family's key/value-cached decoder (on a GPU, its cached GPU decoder), greedy, without
//! stopping at an end-of-text token. With `--eval`, the loss over those ids in windows of `W`
//! inputs (stride `W`) by the training forward (on a GPU, the CUDA training model's). Prints one
//! JSON object: `family`, `generated` (the new ids of each prompt), and `eval` (`loss`,
//! `tokens`) or null.

use std::path::PathBuf;
use std::process::ExitCode;

use zeroflow_nn::infer::{GenerateOptions, Sampling};
use zeroflow_train::infer::{EvalStream, InferDevice};

#[allow(dead_code, reason = "each example uses part of the shared support")]
mod support;

use support::{Error, Model, ids};

const USAGE: &str = "usage: generate DIR --prompt IDS [--prompt IDS …] --max-new-tokens N \
                     [--eval IDS --window W] [--device cpu|cuda|cuda:N]";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Vec<String>) -> Result<(), Error> {
    let (mut dir, mut prompts, mut max_new, mut eval, mut window) = (None, vec![], 0, None, None);
    let mut device = InferDevice::Cpu;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} takes a value"));
        match arg.as_str() {
            "--prompt" => prompts.push(ids(&value()?)?),
            "--max-new-tokens" => max_new = value()?.parse()?,
            "--eval" => eval = Some(ids(&value()?)?),
            "--window" => window = Some(value()?.parse::<usize>()?),
            "--device" => device = value()?.parse()?,
            _ if dir.is_none() && !arg.starts_with("--") => dir = Some(PathBuf::from(&arg)),
            _ => return Err(format!("unknown argument {arg}").into()),
        }
    }
    let dir = dir.ok_or("no model directory")?;
    let model = Model::open(&dir)?;
    let options = GenerateOptions {
        max_new_tokens: max_new,
        sampling: Sampling::GREEDY,
        seed: 0,
        stop_tokens: Vec::new(),
    };
    let generated = model.generate_on(&prompts, &options, device)?;
    let eval = match eval {
        Some(stream) => {
            let window = window.ok_or("--eval needs --window")?;
            let result = match device {
                InferDevice::Cpu => model.eval(EvalStream::of(&stream), window)?,
                InferDevice::Cuda(ordinal) => {
                    model.eval_cuda(EvalStream::of(&stream), window, ordinal)?
                }
            };
            serde_json::json!({ "loss": result.loss, "tokens": result.tokens })
        }
        None => serde_json::Value::Null,
    };
    let out = serde_json::json!({ "family": model.family(), "generated": generated, "eval": eval });
    println!("{out}");
    Ok(())
}
