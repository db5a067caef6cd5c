//! `zeroflow generate`: what a model (a Hugging Face directory or a zeroflow checkpoint) writes
//! after a prompt or a file of prompts, on the CPU or a GPU (`zeroflow_train::infer`).

use std::path::PathBuf;

use zeroflow_train::infer::{
    Completion, HostModel, InferDevice, Sampling, parse_ids, read_prompts,
};

use crate::InputError;

/// Continue a prompt with a model (GPT-2 or the Llama family).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face directory, a checkpoint (`state.json`) or a run directory (its newest).
    model: PathBuf,
    /// The prompt as token ids (`1,2,3`).
    #[arg(long, value_name = "IDS", required_unless_present_any = ["prompt", "prompts"])]
    #[arg(conflicts_with_all = ["prompt", "prompts"])]
    prompt_tokens: Option<String>,
    /// A file of prompts generated as one batch: a prompt per line (text, encoded by the
    /// tokenizer; ids where there is none), or `.jsonl` lines with "prompt" or "prompt_tokens";
    /// one output line each.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    prompts: Option<PathBuf>,
    /// `cpu` (f32), `cuda` or `cuda:N` (bf16 on that GPU).
    #[arg(long, default_value = "cpu")]
    device: InferDevice,
    /// The prompt as text, encoded by the tokenizer (--tokenizer, or MODEL's own).
    #[arg(long)]
    prompt: Option<String>,
    /// `gpt2`, `bytes`, a `tokenizer.json` or a model directory: encodes --prompt, decodes the
    /// output. Default: MODEL's own tokenizer.json where MODEL is a directory that has one.
    #[arg(long)]
    tokenizer: Option<String>,
    #[arg(long, value_name = "N")]
    max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    #[arg(long, value_name = "P")]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Go on past the model's end-of-text token.
    #[arg(long)]
    no_stop: bool,
    /// Print `{"tokens": [the new ids], "text": the new text or null}` (with "index", from 0, per
    /// prompt of --prompts).
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let tokenizer = super::eval::model_tokenizer(args.tokenizer.as_deref(), &args.model)?;
    let prompts = match (&args.prompts, &args.prompt_tokens, &args.prompt, &tokenizer) {
        (Some(file), ..) => read_prompts(file)?
            .iter()
            .enumerate()
            .map(|(i, p)| {
                p.tokens(tokenizer.as_ref())
                    .map_err(|e| InputError(format!("prompt {}: {e}", i + 1)))
            })
            .collect::<Result<_, _>>()?,
        (None, Some(ids), ..) => {
            vec![parse_ids(ids).map_err(|e| InputError(format!("--prompt-tokens {e}")))?]
        }
        (None, None, Some(text), Some(tokenizer)) => {
            vec![tokenizer.encode(text).map_err(|e| InputError(format!("--prompt: {e}")))?]
        }
        (None, None, Some(_), None) => {
            return Err(InputError::from_display(format!(
                "--prompt is text and {} has no tokenizer.json: give --tokenizer (gpt2, bytes, a \
                 tokenizer.json or a model directory), or the prompt as --prompt-tokens",
                args.model.display()
            )));
        }
        (None, None, None, _) => {
            unreachable!("clap requires --prompt-tokens, --prompts or --prompt")
        }
    };
    let model = HostModel::open(&args.model)?;
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    let completion = Completion {
        max_new_tokens: args.max_new_tokens,
        sampling,
        seed: args.seed,
        stop: !args.no_stop,
    };
    let generated = model.complete_batch_on(&prompts, &completion, args.device)?;
    for (index, tokens) in generated.iter().enumerate() {
        let text = tokenizer.as_ref().map(|t| t.decode(tokens)).transpose().map_err(InputError)?;
        if args.json {
            let mut line = serde_json::json!({ "tokens": tokens, "text": text });
            if args.prompts.is_some() {
                line["index"] = index.into();
            }
            println!("{line}");
        } else {
            let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
            println!("{}", text.unwrap_or_else(|| ids.join(",")));
        }
    }
    Ok(())
}
