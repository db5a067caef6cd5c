//! `zeroflow tokenize`: text, `.jsonl` documents and `.jsonl` conversations into llm.c token
//! shards with a document index and (for conversations) a loss mask beside each, on all cores
//! (`zeroflow_data::tokenize_corpus`; the formats are in docs/data-formats.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use zeroflow_data::{
    ChatOptions, TokenizeError, TokenizeOptions, Tokenizer, json_lines_in, tokenize_corpus,
};

use crate::InputError;

/// Tokenize text and chat files into token shards.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `gpt2`, `bytes`, a `tokenizer.json`, or a model directory (its `tokenizer.json` and
    /// `tokenizer_config.json`).
    #[arg(long)]
    tokenizer: String,
    /// Input files: plain text (each file one document), or JSON Lines (`.jsonl`, or a `.json`
    /// of one object per line) with one `{"text": ...}` or `{"messages": [...]}` per line; a
    /// directory stands for its JSON Lines files, in name order.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The directory to write `tokens_NNNNNN.bin` (+ `.idx`, `.mask`) and `manifest.json` to.
    #[arg(long)]
    out: PathBuf,
    /// A Jinja chat template for the conversations, instead of the tokenizer's own.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Variables for the chat template, a JSON object, as `apply_chat_template(..., **kwargs)`
    /// passes them: `'{"enable_thinking": false}'` trains Qwen3 without its reasoning block.
    #[arg(long, value_name = "JSON", value_parser = super::template_kwargs)]
    chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    /// Close a shard before a document that would take it past this many tokens.
    #[arg(long, default_value_t = zeroflow_data::DEFAULT_SHARD_TOKENS, value_name = "N")]
    shard_tokens: usize,
    /// Skip `.jsonl` lines that are not a document or conversation (and count them) instead of
    /// stopping at the first.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Hold out about N tokens (at most a tenth) of whole documents spread over the inputs
    /// (`.jsonl` records, text files of up to about 1 MiB) into OUT/held-out, out of the
    /// training shards: `train --data OUT` evaluates on them (as it does on data it tokenizes
    /// itself, with N its --eval-tokens, default 1,048,576).
    #[arg(long, value_name = "N")]
    hold_out: Option<std::num::NonZeroU64>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.shard_tokens == 0 {
        return Err(InputError::from_display("--shard-tokens must be at least 1"));
    }
    let tokenizer = Tokenizer::load(&args.tokenizer).map_err(InputError::from_display)?;
    let chat = ChatOptions {
        template: args.chat_template.clone(),
        variables: args.chat_template_kwargs.clone().unwrap_or_default(),
    };
    let template = chat.template(&tokenizer).map_err(InputError::from_display)?;
    println!("{}", zeroflow_data::describe_setup(&tokenizer, template.as_ref()));

    let inputs = expand_directories(&args.inputs)?;
    let total: u64 = inputs.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let shown = crate::log::Shown::new(progress_bar(total));

    let hold_out = args.hold_out.map(|tokens| zeroflow_data::HoldOut {
        out_dir: args.out.join(zeroflow_data::HELD_OUT_DIR),
        tokens: tokens.get(),
    });
    let options = TokenizeOptions {
        shard_tokens: args.shard_tokens,
        skip_bad_lines: args.skip_bad_lines,
        hold_out,
        ..TokenizeOptions::new(args.out.clone(), template.as_ref())
    };
    let start = Instant::now();
    let result = tokenize_corpus(&tokenizer, &inputs, &options, &|bytes| shown.bar().inc(bytes));
    drop(shown);
    let summary = result.map_err(|e| match e {
        TokenizeError::Output { .. } => anyhow::Error::new(e),
        e => InputError::from_display(e),
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let per_second = HumanBytes((summary.input_bytes as f64 / seconds.max(1e-9)) as u64);
    println!("{}", summary.describe(&args.out));
    println!(
        "read {} in {seconds:.2} s ({per_second}/s, {} threads)",
        HumanBytes(summary.input_bytes),
        rayon::current_num_threads()
    );
    Ok(())
}

/// `inputs` with each directory replaced by its JSON Lines files ([`json_lines_in`]); an input
/// error for a directory that has none.
fn expand_directories(inputs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut expanded = Vec::new();
    for input in inputs {
        if !input.is_dir() {
            expanded.push(input.clone());
            continue;
        }
        let files = json_lines_in(input)
            .map_err(|e| InputError::from_display(format!("{}: {e}", input.display())))?;
        if files.is_empty() {
            return Err(InputError::from_display(format!(
                "{}: a directory without JSON Lines files (.jsonl, .json); give the files to read",
                input.display()
            )));
        }
        if let Some(reason) = zeroflow_data::held_out_refusal(input, &files) {
            let what = format!("{}: {reason} to tokenize", input.display());
            return Err(InputError::from_display(what));
        }
        expanded.extend(files);
    }
    Ok(expanded)
}

/// A bar of input bytes with the rate (hidden when stderr is not a terminal).
fn progress_bar(total_bytes: u64) -> ProgressBar {
    let bar = ProgressBar::new(total_bytes);
    let style = ProgressStyle::with_template(
        "{spinner} {bar:30.cyan/blue} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} \
         [{elapsed}, ETA {eta}]",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}
