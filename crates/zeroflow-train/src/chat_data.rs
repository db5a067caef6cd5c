//! `--data FILE.jsonl`: conversations (and documents) tokenized at start-up with the model's
//! tokenizer and chat template (those of `--init-from`'s directory) into token shards with their
//! loss masks in the run directory (`<out>/tokens/rank-N`, replaced at every start: the output
//! depends on the file and the tokenizer alone, so a resumed run reads the same tokens), which
//! the run then trains on as it does on `zeroflow tokenize`'s output.

use std::path::Path;

use zeroflow_data::{ChatTemplate, TokenizeOptions, Tokenizer, tokenize_corpus};

use crate::data::Spec;
use crate::error::{Result, input};

/// The shards of `jsonl` tokenized with the tokenizer and chat template of the Hugging Face
/// directory `model_dir`, written under `out` for `rank`; says what it wrote in the log.
pub fn tokenize_jsonl(
    jsonl: &Path,
    model_dir: Option<&Path>,
    out: &Path,
    rank: usize,
) -> Result<Spec> {
    let shown = jsonl.display();
    let Some(dir) = model_dir else {
        return Err(input(format!(
            "--data {shown}: a .jsonl is tokenized with the model's tokenizer and chat template; \
             give --init-from a Hugging Face directory that has a tokenizer.json (or tokenize it \
             first with `zeroflow tokenize` and train on the directory)"
        )));
    };
    let tokenizer = Tokenizer::from_dir(dir).map_err(|e| input(format!("--data {shown}: {e}")))?;
    let template = ChatTemplate::from_config(tokenizer.config())
        .transpose()
        .map_err(|e| input(format!("--data {shown}: {e}")))?;
    let tokens = out.join("tokens").join(format!("rank-{rank}"));
    if tokens.exists() {
        std::fs::remove_dir_all(&tokens)
            .map_err(|e| input(format!("cannot clear {}: {e}", tokens.display())))?;
    }
    let options = TokenizeOptions {
        out_dir: tokens.clone(),
        shard_tokens: 100_000_000,
        skip_bad_lines: false,
        chat_template: template.as_ref(),
    };
    let summary = tokenize_corpus(&tokenizer, &[jsonl.to_owned()], &options, &|_| {})
        .map_err(|e| input(format!("--data {shown}: {e}")))?;
    tracing::info!("{}", summary.describe(&tokens));
    Ok(Spec::Shards(summary.shards))
}
