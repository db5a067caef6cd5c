//! One module per subcommand.

use std::path::Path;

use zeroflow_data::Tokenizer;
use zeroflow_train::infer::ModelDefaults;

pub mod bench;
pub mod bench_copy;
pub mod bench_gemm;
pub mod bench_gpt;
pub mod bench_train;
pub mod config;
pub mod dist_check;
pub mod env;
pub mod eval;
pub mod export;
pub mod generate;
pub mod launch;
pub mod models;
pub mod plan;
pub mod stress;
pub mod tokenize;
pub mod train;

/// The tokenizer of `generate` and `eval`: the one `--tokenizer` names (`gpt2`, `bytes`, a
/// `tokenizer.json` or a model directory), else MODEL's own where MODEL is a directory with a
/// `tokenizer.json` (a Hugging Face directory, an export), or for a checkpoint or run directory
/// the tokenizer its run trained with (its `--init-from` directory's, said), else none.
pub(crate) fn model_tokenizer(
    named: Option<&str>,
    text: &ModelDefaults,
    model: &Path,
) -> anyhow::Result<Option<Tokenizer>> {
    let tokenizer = match (named, &text.tokenizer_dir) {
        (Some(name), _) => Tokenizer::load(name).map(Some),
        (None, Some(dir)) => {
            let tokenizer = Tokenizer::of_dir(dir);
            if dir != model && matches!(tokenizer, Ok(Some(_))) {
                tracing::info!(
                    "{}: encoding with the tokenizer of its run's --init-from {}",
                    model.display(),
                    dir.display()
                );
            }
            tokenizer
        }
        (None, None) => Ok(None),
    };
    tokenizer.map_err(crate::InputError::from_display)
}

/// The chat template options of `generate` and `eval`: the flags', else what MODEL's run trained
/// with ([`ModelDefaults::chat`]).
pub(crate) fn chat_options(
    template: Option<std::path::PathBuf>,
    variables: Option<zeroflow_data::TemplateVariables>,
    text: &ModelDefaults,
) -> zeroflow_data::ChatOptions {
    zeroflow_data::ChatOptions {
        template: template.or_else(|| text.chat.template.clone()),
        variables: variables.unwrap_or_else(|| text.chat.variables.clone()),
    }
}

/// Parses `--chat-template-kwargs`: a JSON object of variables for the chat template, as
/// `apply_chat_template(..., **kwargs)` passes them (`{"enable_thinking": false}`).
pub(crate) fn template_kwargs(text: &str) -> Result<zeroflow_data::TemplateVariables, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err("not a JSON object (give e.g. '{\"enable_thinking\": false}')".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}
