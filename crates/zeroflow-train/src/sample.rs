//! Samples during training (`train --sample-every N --sample-prompt TEXT`): every N optimizer
//! steps and after the last, rank 0 continues the prompt greedily by the model's current device
//! weights (the ones a checkpoint of that step saves), run by the family's CPU decoder in f32 (no
//! GPU memory is taken from the training), logs it, and appends it to `<out>/samples.jsonl` as
//! `{"step", "prompt", "tokens", "text"}` (`text` null where no tokenizer fits).
//!
//! The prompt is encoded by the model directory's tokenizer where it has one (`--init-from`'s, or
//! the resumed run's), else by bytes for text data, GPT-2's for a vocabulary of 50257 or more,
//! bytes for one of 256 or more; for a smaller vocabulary (the synthetic corpus) it is token ids
//! (`1,2,3`). Where the run trains on conversations, the prompt is a user message rendered by the
//! run's chat template with the assistant's turn opened (as `generate --chat` renders it), and the
//! sample ends at the template's end of a turn; any sample ends at the tokenizer's end of text.

use std::io::Write;
use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_data::{ChatOptions, Tokenizer};

use crate::data::Spec;
use crate::error::{Result, TrainError, input};
use crate::infer::{Completion, HostModel, Prompt, Sampling, parse_ids, reply_stops};
use crate::{Family, ModelSpec, with_family};

/// New tokens per sample.
pub const SAMPLE_TOKENS: usize = 32;

/// What `--sample-every` and `--sample-prompt` ask for.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SampleOptions {
    pub every: u64,
    pub prompt: String,
}

/// The checked sampling of a run: its prompt's ids and the tokenizer that decodes the samples.
#[derive(Debug)]
pub struct Sampler {
    every: u64,
    prompt_text: String,
    prompt: Vec<u32>,
    tokenizer: Option<Tokenizer>,
    /// The tokens a sample ends at: the tokenizer's end of text, the chat template's end of a
    /// turn.
    stops: Vec<u32>,
    /// Whether the prompt is a user message in the chat template.
    as_chat: bool,
    file: PathBuf,
}

impl Sampler {
    /// The sampler of `options` for `model` trained on `data` (from the directory `init_from`, if
    /// any, itself or in the run resumed; `chat`: the run's chat options where it trains on
    /// conversations), writing into the run directory `out`; an input error where the prompt does
    /// not encode or holds an id outside the vocabulary.
    pub fn new(
        options: &SampleOptions,
        model: &ModelSpec,
        data: &Spec,
        init_from: Option<&Path>,
        chat: Option<&ChatOptions>,
        out: &Path,
    ) -> Result<Sampler> {
        let vocab = model.vocab_size();
        let tokenizer = tokenizer_for(vocab, data, init_from)?;
        let template = match (&tokenizer, chat) {
            (Some(tokenizer), Some(chat)) => {
                chat.template(tokenizer).map_err(|e| input(format!("--sample-prompt: {e}")))?
            }
            _ => None,
        };
        let text = Prompt::Text(options.prompt.clone());
        let prompt = match (&tokenizer, &template) {
            (Some(tokenizer), Some(template)) => text.chat_tokens(tokenizer, template),
            (Some(tokenizer), None) => tokenizer.encode(&options.prompt),
            (None, _) => parse_ids(&options.prompt),
        }
        .map_err(|e| input(format!("--sample-prompt: {e}")))?;
        let stops =
            tokenizer.as_ref().map(|t| reply_stops(t, template.as_ref())).unwrap_or_default();
        match prompt.iter().find(|&&id| id as usize >= vocab) {
            _ if prompt.is_empty() => return Err(input("--sample-prompt has no tokens")),
            Some(id) => {
                let reason = format!("token {id} is outside the vocabulary ({vocab})");
                return Err(input(format!("--sample-prompt: {reason}")));
            }
            None => {}
        }
        if options.every == 0 {
            return Err(input("--sample-every 0: at least 1"));
        }
        Ok(Sampler {
            every: options.every,
            prompt_text: options.prompt.clone(),
            prompt,
            tokenizer,
            stops,
            as_chat: template.is_some(),
            file: out.join("samples.jsonl"),
        })
    }

    /// Whether step `step` (the run's last where `last`) samples.
    pub fn due(&self, step: u64, last: bool) -> bool {
        last || step.is_multiple_of(self.every)
    }

    /// The sample of `step` by `weights` (the flat f32 weights of `layout`, the engine's), logged
    /// and appended to `samples.jsonl`; the new tokens.
    pub fn sample(
        &self,
        step: u64,
        model: &ModelSpec,
        layout: &FlatLayout,
        weights: Vec<f32>,
    ) -> Result<Vec<u32>> {
        let mut host = HostModel::from_params(model, one_rank_weights(model, layout, weights)?)?;
        self.stops.iter().for_each(|&token| host.also_stop_at(token));
        let completion = Completion {
            max_new_tokens: SAMPLE_TOKENS,
            sampling: Sampling::GREEDY,
            seed: 0,
            stop: true,
        };
        let tokens = host.complete(&self.prompt, &completion)?;
        let text = self.tokenizer.as_ref().map(|t| t.decode(&tokens)).transpose();
        let text = text.map_err(|e| input(format!("a sample does not decode: {e}")))?;
        let shown = text.clone().unwrap_or_else(|| format!("{tokens:?}"));
        let asked = if self.as_chat { " (a user message in the chat template)" } else { "" };
        tracing::info!("sample at step {step}: {:?}{asked} → {shown:?}", self.prompt_text);
        let line = serde_json::json!({
            "step": step, "prompt": self.prompt_text, "chat": self.as_chat, "tokens": tokens,
            "text": text,
        });
        let append = || -> std::io::Result<()> {
            let mut file =
                std::fs::OpenOptions::new().create(true).append(true).open(&self.file)?;
            writeln!(file, "{line}")
        };
        append().map_err(|source| TrainError::Io {
            what: format!("append to {}", self.file.display()),
            source,
        })?;
        Ok(tokens)
    }
}

/// The tokenizer of the samples (see the module documentation), `None` for token ids.
fn tokenizer_for(vocab: usize, data: &Spec, init_from: Option<&Path>) -> Result<Option<Tokenizer>> {
    let own = init_from.map(Tokenizer::of_dir).transpose();
    if let Some(tokenizer) = own.map_err(|e| input(format!("--sample-prompt: {e}")))?.flatten() {
        return Ok(Some(tokenizer));
    }
    let name = match data {
        Spec::Text(_) => "bytes",
        _ if vocab >= 50257 => "gpt2",
        _ if vocab >= 256 => "bytes",
        _ => return Ok(None),
    };
    Tokenizer::load(name).map(Some).map_err(|e| input(format!("--sample-prompt: {e}")))
}

/// `weights` of the engine's `layout` (padded for its ranks) in the layout of one rank.
fn one_rank_weights(model: &ModelSpec, layout: &FlatLayout, weights: Vec<f32>) -> Result<Vec<f32>> {
    let single = with_family!(model, family => family.flat_layout(1))?;
    if single.padded_len() == layout.padded_len() {
        return Ok(weights);
    }
    let mut out = vec![0.0; single.padded_len()];
    for view in single.params() {
        let from = layout.param(&view.name).ok_or_else(|| {
            TrainError::Input(format!("the engine's layout has no parameter {}", view.name))
        })?;
        out[view.flat_range()].copy_from_slice(&weights[from.flat_range()]);
    }
    Ok(out)
}
