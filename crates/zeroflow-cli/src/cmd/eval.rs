//! `zeroflow eval`: a model's loss and perplexity over token shards or text, on the CPU or a GPU
//! (`zeroflow_train::infer`).

use std::path::PathBuf;

use zeroflow_train::data::Spec;
use zeroflow_train::infer::{EvalStream, InferDevice, ModelDir};

use crate::InputError;

/// The loss of a model (GPT-2 or the Llama family) over data.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face directory, a checkpoint (`state.json`) or a run directory (its newest).
    model: PathBuf,
    /// `cpu` (f32), `cuda` or `cuda:N` (bf16 on that GPU, the training forward).
    #[arg(long, default_value = "cpu")]
    device: InferDevice,
    /// llm.c `.bin` token shards (a file, directory or glob; a shard's loss mask, chat data's,
    /// leaves out what it leaves out in training), text files (encoded by --tokenizer), or
    /// `.jsonl` files (one, or a directory or glob of them) of documents or conversations
    /// (tokenized by --tokenizer and its chat template, the loss on the assistant's tokens only,
    /// as in training). Default, for a checkpoint or run directory: its run's evaluation set as
    /// the run made it (the documents it held out, the end of its data, or the first
    /// --eval-tokens of its --eval-data), in its windows, packed where the run packed its rows
    /// (no attention across documents).
    #[arg(long)]
    data: Option<String>,
    /// Encodes text and `.jsonl` --data: `gpt2`, `bytes`, a `tokenizer.json` or a model
    /// directory. Default: MODEL's own tokenizer.json where MODEL is a directory that has one,
    /// the tokenizer its run trained with where MODEL is a checkpoint or run directory (its
    /// --init-from directory's), else bytes as tokens.
    #[arg(long)]
    tokenizer: Option<String>,
    /// A Jinja chat template for a `.jsonl` --data, instead of the tokenizer's own (for a
    /// checkpoint or run directory: its run's --chat-template where it gave one).
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// Variables for the chat template of a `.jsonl` --data, a JSON object, as
    /// `apply_chat_template(..., **kwargs)` passes them (`'{"enable_thinking": false}'`).
    /// Default: none (for a checkpoint or run directory: its run's).
    #[arg(long, value_name = "JSON", value_parser = super::template_kwargs)]
    chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    /// Inputs per window (stride the same, every token predicted once). Default: for a checkpoint
    /// or run directory, the --seq its run trained on (its evaluations' windows); else the one
    /// `train` would use: GPT-2's context, the Llama family's 2048 (or its context where
    /// shorter).
    #[arg(long, value_name = "W")]
    window: Option<usize>,
    /// Read --data's documents packed: each attends within itself alone, positions from 0 at
    /// each (a shard's document index, .idx, says where they start; a text file is one), as a
    /// run with `--pack` evaluates. `--pack` alone is `=on`. Default: for a checkpoint or run
    /// directory, as its run read (so that its loss is the one its evaluations logged); else off.
    #[arg(
        long,
        value_name = "on|off",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "on",
        value_parser = crate::settings::flag(&crate::settings::names::SWITCH)
    )]
    pack: Option<bool>,
    /// Print `{"loss": ..., "tokens": ..., "window": ..., "packed": ...}`.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let source = ModelDir::find(&args.model)?;
    let text = source.defaults()?;
    let Some(data) = args.data.as_deref() else { return run_set(&args, &source) };
    let spec = Spec::parse(data)?;
    let model = source.open_for(args.device)?;
    // Text and .jsonl are encoded; shards need MODEL's own tokenizer no more than a named one.
    let encoded = matches!(spec, Spec::Text(_) | Spec::Jsonl(_));
    let tokenizer = match encoded || args.tokenizer.is_some() {
        true => super::model_tokenizer(args.tokenizer.as_deref(), &text, &args.model)?,
        false => None,
    };
    // Shards tokenized with another tokenizer than MODEL's are refused, as `train` refuses them.
    if let (Spec::Shards(_), Some(dir)) = (&spec, &text.tokenizer_dir)
        && let Some(own) = zeroflow_data::Tokenizer::of_dir(dir).ok().flatten()
    {
        spec.check_tokenized_with(&own, dir, "--data")?;
    }
    let chat = super::chat_options(args.chat_template, args.chat_template_kwargs, &text);
    // A run's own windows, so that its checkpoint's loss is the one its evaluations logged.
    let window = args.window.or(text.seq).unwrap_or_else(|| model.default_window());
    let (device, packed) = (args.device, args.pack.unwrap_or(text.packed));
    let tokenizer = tokenizer.as_ref();
    let result = model.eval_data_on(&spec, Some(window), device, tokenizer, &chat, packed)?;
    say(&result, window, packed, args.json);
    Ok(())
}

/// `eval` of a checkpoint or run directory without `--data`: its run's evaluation set, as the
/// run evaluated on it, in its windows (or `--window`'s).
fn run_set(args: &Args, source: &ModelDir) -> anyhow::Result<()> {
    let encoding = args.tokenizer.is_some()
        || args.chat_template.is_some()
        || args.chat_template_kwargs.is_some();
    if encoding {
        return Err(InputError::from_display(
            "--tokenizer, --chat-template and --chat-template-kwargs encode --data; without it \
             the run's evaluation set is read as the run made it",
        ));
    }
    let set = source.run_eval_set(args.pack).map_err(|e| {
        InputError(format!(
            "the run's evaluation set: {e} (give --data to evaluate on files of your own)"
        ))
    })?;
    let Some(set) = set else {
        return Err(InputError::from_display(
            "give --data: token shards, text or .jsonl files to evaluate on (only a checkpoint \
             or run directory has an evaluation set of its own)",
        ));
    };
    tracing::info!("the run's evaluation set: {}", set.description);
    let model = source.open_for(args.device)?;
    let window = args.window.unwrap_or(set.window);
    let positions = set.positions(window);
    let stream = EvalStream {
        tokens: &set.tokens.tokens,
        mask: set.tokens.mask.as_deref(),
        positions: positions.as_deref(),
    };
    let result = model.eval_on(stream, window, args.device)?;
    say(&result, window, stream.positions.is_some(), args.json);
    Ok(())
}

/// The loss, as JSON (`--json`) or as a line.
fn say(result: &zeroflow_train::infer::EvalResult, window: usize, packed: bool, json: bool) {
    let (loss, perplexity, tokens) = (result.loss, result.perplexity(), result.tokens);
    if json {
        let said = serde_json::json!({
            "loss": loss, "tokens": tokens, "window": window, "packed": packed
        });
        println!("{said}");
    } else {
        let packed = if packed { ", packed" } else { "" };
        println!(
            "loss {loss:.6}, perplexity {perplexity:.4} over {tokens} tokens (windows of \
             {window}{packed})"
        );
    }
}
