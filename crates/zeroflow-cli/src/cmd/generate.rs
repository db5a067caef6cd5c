//! `zeroflow generate`: what a Hugging Face model writes after a prompt, on the CPU
//! (`zeroflow_train::infer`).

use std::path::PathBuf;

use zeroflow_data::Tokenizer;
use zeroflow_train::infer::{Completion, HostModel, Sampling, parse_ids};

use crate::InputError;

/// Continue a prompt with a Hugging Face model directory (GPT-2 or the Llama family).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model's directory (`config.json`, `model.safetensors`).
    model: PathBuf,
    /// The prompt as token ids (`1,2,3`).
    #[arg(long, value_name = "IDS", required_unless_present = "prompt", conflicts_with = "prompt")]
    prompt_tokens: Option<String>,
    /// The prompt as text, encoded by --tokenizer.
    #[arg(long, requires = "tokenizer")]
    prompt: Option<String>,
    /// `gpt2`, a `tokenizer.json` or a model directory: encodes --prompt, decodes the output.
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
    /// Print `{"tokens": [the new ids], "text": the new text or null}`.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let tokenizer = args.tokenizer.as_deref().map(Tokenizer::load).transpose();
    let tokenizer = tokenizer.map_err(InputError::from_display)?;
    let prompt = match (&args.prompt_tokens, &args.prompt, &tokenizer) {
        (Some(ids), ..) => {
            parse_ids(ids).map_err(|e| InputError(format!("--prompt-tokens {e}")))?
        }
        (None, Some(text), Some(tokenizer)) => {
            tokenizer.encode(text).map_err(|e| InputError(format!("--prompt: {e}")))?
        }
        _ => unreachable!("clap requires --prompt-tokens, or --prompt with --tokenizer"),
    };
    let model = HostModel::open(&args.model)?;
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    let completion = Completion {
        max_new_tokens: args.max_new_tokens,
        sampling,
        seed: args.seed,
        stop: !args.no_stop,
    };
    let tokens = model.complete(&prompt, &completion)?;
    let text = tokenizer.map(|t| t.decode(&tokens)).transpose().map_err(InputError)?;
    if args.json {
        println!("{}", serde_json::json!({ "tokens": tokens, "text": text }));
    } else {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        println!("{}", text.unwrap_or_else(|| ids.join(",")));
    }
    Ok(())
}
