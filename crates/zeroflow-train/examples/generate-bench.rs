//! Generation speed: tokens per second of the prefill and of the decode steps, at each batch
//! size, for a named shape with random weights or a model directory, on the CPU (f32, the
//! key/value-cached decoder) or a GPU (`--device cuda`: bf16, the family's cached GPU decoder;
//! its prefill includes allocating the batch's buffers and cache).
//! Numbers are printed, not asserted.
//!
//! `generate-bench MODEL [--batch 1,16] [--prompt-len 16] [--new-tokens 32] [--device cuda]`
//!
//! MODEL is a named shape (`tiny`, `gpt2-124m`, `llama-1b`, …) or a directory. Prints one JSON
//! line per batch size: `model`, `family`, `device`, `batch`, `prompt_len`, `new_tokens`, `prefill_s`,
//! `prefill_tokens_per_s`, `decode_s`, `decode_tokens_per_s` (new tokens of the whole batch per
//! second, the first one, from the prefill's logits, included in the prefill).

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use zeroflow_nn::infer::{GenerateOptions, Sampling, generate};
use zeroflow_train::infer::InferDevice;

#[allow(dead_code, reason = "each example uses part of the shared support")]
mod support;

use support::{Error, Model, ids};

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            eprintln!(
                "usage: generate-bench MODEL [--batch 1,16] [--prompt-len 16] [--new-tokens 32] \
                 [--device cpu|cuda|cuda:N]"
            );
            ExitCode::from(2)
        }
    }
}

fn run(args: Vec<String>) -> Result<(), Error> {
    let (mut name, mut batches, mut prompt_len, mut new_tokens) = (None, vec![1, 16], 16, 32);
    let mut device = InferDevice::Cpu;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} takes a value"));
        match arg.as_str() {
            "--batch" => batches = ids(&value()?)?.into_iter().map(|b| b as usize).collect(),
            "--prompt-len" => prompt_len = value()?.parse()?,
            "--new-tokens" => new_tokens = value()?.parse()?,
            "--device" => device = value()?.parse()?,
            _ if name.is_none() && !arg.starts_with("--") => name = Some(arg),
            _ => return Err(format!("unknown argument {arg}").into()),
        }
    }
    let name = name.ok_or("no model")?;
    let model = match Path::new(&name).is_dir() {
        true => Model::open(Path::new(&name))?,
        false => Model::named(&name, 0)?,
    };
    let mut cuda = match device {
        InferDevice::Cuda(ordinal) => Some(model.cuda_decoder(ordinal)?),
        InferDevice::Cpu => None,
    };
    let mut run = |prompts: &[Vec<u32>], options: &GenerateOptions| -> Result<_, Error> {
        Ok(match cuda.as_mut() {
            Some(decoder) => generate(decoder, prompts, options)?,
            None => model.generate(prompts, options)?,
        })
    };
    for batch in batches {
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|b| (0..prompt_len).map(|i| ((b * 131 + i * 17) % 50) as u32).collect())
            .collect();
        let greedy = |max_new_tokens| GenerateOptions {
            max_new_tokens,
            sampling: Sampling::GREEDY,
            seed: 0,
            stop_tokens: Vec::new(),
        };
        // A warm-up (the GPU compiles its kernels, or loads them from the cache, on the first).
        run(&prompts, &greedy(1))?;
        let start = Instant::now();
        run(&prompts, &greedy(1))?;
        let prefill_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let generated = run(&prompts, &greedy(new_tokens))?;
        let total_s = start.elapsed().as_secs_f64();
        let decode_s = (total_s - prefill_s).max(f64::MIN_POSITIVE);
        let decoded: usize = generated.iter().map(|g| g.len().saturating_sub(1)).sum();
        let line = serde_json::json!({
            "model": name, "family": model.family(), "device": format!("{device:?}"),
            "batch": batch,
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": (batch * prompt_len) as f64 / prefill_s,
            "decode_s": decode_s,
            "decode_tokens_per_s": decoded as f64 / decode_s,
        });
        println!("{line}");
    }
    Ok(())
}
