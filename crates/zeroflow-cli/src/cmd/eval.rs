//! `zeroflow eval`: a model's loss and perplexity over token shards or text, on the CPU or a GPU
//! (`zeroflow_train::infer`).

use std::path::{Path, PathBuf};

use zeroflow_data::Tokenizer;
use zeroflow_train::data::Spec;
use zeroflow_train::infer::{HostModel, InferDevice};

use crate::InputError;

/// The loss of a model (GPT-2 or the Llama family) over data.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face directory, a checkpoint (`state.json`) or a run directory (its newest).
    model: PathBuf,
    /// `cpu` (f32), `cuda` or `cuda:N` (bf16 on that GPU, the training forward).
    #[arg(long, default_value = "cpu")]
    device: InferDevice,
    /// llm.c `.bin` token shards (a file, directory or glob) or text files (encoded by
    /// --tokenizer).
    #[arg(long)]
    data: String,
    /// Encodes text --data: `gpt2`, `bytes`, a `tokenizer.json` or a model directory. Default:
    /// MODEL's own tokenizer.json where MODEL is a directory that has one, else bytes as tokens.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Inputs per window (stride the same, every token predicted once; default: the context).
    #[arg(long, value_name = "W")]
    window: Option<usize>,
    /// Print `{"loss": ..., "tokens": ...}`.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = Spec::parse(&args.data)?;
    let model = HostModel::open(&args.model)?;
    // Only text is encoded: shards need no tokenizer (nor one that does not load).
    let tokenizer = match (&args.tokenizer, &spec) {
        (None, Spec::Text(_)) | (Some(_), _) => {
            model_tokenizer(args.tokenizer.as_deref(), &args.model)?
        }
        (None, _) => None,
    };
    let result = model.eval_data_on(&spec, args.window, args.device, tokenizer.as_ref())?;
    if args.json {
        println!("{}", serde_json::json!({ "loss": result.loss, "tokens": result.tokens }));
    } else {
        let (loss, perplexity, tokens) = (result.loss, result.perplexity(), result.tokens);
        println!("loss {loss:.6}, perplexity {perplexity:.4} over {tokens} tokens");
    }
    Ok(())
}

/// The tokenizer `--tokenizer` names (`gpt2`, `bytes`, a `tokenizer.json` or a model directory),
/// else MODEL's own where MODEL is a directory with a `tokenizer.json` (a Hugging Face
/// directory, an export), else none.
pub(crate) fn model_tokenizer(
    named: Option<&str>,
    model: &Path,
) -> anyhow::Result<Option<Tokenizer>> {
    match named {
        Some(name) => Tokenizer::load(name).map(Some).map_err(InputError::from_display),
        None if model.join("tokenizer.json").is_file() => {
            Tokenizer::from_dir(model).map(Some).map_err(InputError::from_display)
        }
        None => Ok(None),
    }
}
