//! Inference on the CPU, in f32, for `zeroflow generate`, `zeroflow eval` and the inference
//! examples: a model of either family, from a Hugging Face directory ([`HostModel::open`]) or a
//! named shape with random weights ([`HostModel::named`]), run through its family's
//! key/value-cached decoder ([`HostModel::generate`]) or over a token stream's windows by the
//! training forward ([`HostModel::eval`]).

use std::path::Path;

use zeroflow_data::read_shard;

use zeroflow_core::layout::FlatLayout;
use zeroflow_gpt::{GptConfig, GptDecoder, HfGpt};
use zeroflow_llama::{HfLlama, LlamaConfig, LlamaDecoder};
use zeroflow_nn::infer::generate;
pub use zeroflow_nn::infer::{EvalResult, GenerateOptions, Sampling};

use crate::data::Spec;
use crate::error::{Result, TrainError, input};

/// How a prompt is continued ([`HostModel::complete`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Completion {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// End at the model's end-of-text token (kept in the output), where it has one.
    pub stop: bool,
}

/// A model of either family with its flat f32 parameters, and its end-of-text tokens.
pub struct HostModel {
    weights: Weights,
    end_of_text: Vec<u32>,
}

impl std::fmt::Debug for HostModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = self.family();
        let (vocab, context) = (self.vocab_size(), self.context());
        write!(f, "HostModel({family}, vocabulary {vocab}, context {context})")
    }
}

enum Weights {
    Gpt { config: GptConfig, layout: FlatLayout, params: Vec<f32> },
    Llama { config: LlamaConfig, layout: FlatLayout, params: Vec<f32> },
}

impl HostModel {
    /// The model of the Hugging Face directory `dir`: GPT-2 where `config.json`'s
    /// `architectures` says `GPT2LMHeadModel` (or its `model_type` is `gpt2`), else the Llama
    /// family (Llama, Qwen2, Qwen3, Mistral); its end-of-text tokens are `eos_token_id`'s.
    pub fn open(dir: &Path) -> Result<HostModel> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| TrainError::Io {
            what: format!("read {} (a Hugging Face model directory's config)", path.display()),
            source,
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| input(format!("{}: not JSON: {e}", path.display())))?;
        let end_of_text = zeroflow_hf::eos_token_ids(&json);
        let gpt2 = json["architectures"].get(0).and_then(|a| a.as_str()) == Some("GPT2LMHeadModel")
            || json["model_type"].as_str() == Some("gpt2");
        let weights = if gpt2 {
            let hf = HfGpt::open(dir).map_err(TrainError::model)?;
            let layout = zeroflow_gpt::flat_layout(&hf.config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            hf.read_params(&layout, &mut params).map_err(TrainError::model)?;
            Weights::Gpt { config: hf.config, layout, params }
        } else {
            let hf = HfLlama::open(dir).map_err(TrainError::model)?;
            let layout = zeroflow_llama::flat_layout(&hf.config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            hf.read_params(&layout, &mut params).map_err(TrainError::model)?;
            Weights::Llama { config: hf.config, layout, params }
        };
        Ok(HostModel { weights, end_of_text })
    }

    /// A named shape (GPT-2's sizes, `llama-1b` …) with random weights from `seed`, without
    /// end-of-text tokens.
    pub fn named(name: &str, seed: u64) -> Result<HostModel> {
        let weights = if let Some(config) = zeroflow_llama::named_shape(name) {
            let layout = zeroflow_llama::flat_layout(&config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            zeroflow_llama::init_params(&config, &layout, seed, &mut params)
                .map_err(TrainError::model)?;
            Weights::Llama { config, layout, params }
        } else {
            let config = GptConfig::named(name).map_err(|e| input(e.to_string()))?;
            let layout = zeroflow_gpt::flat_layout(&config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            zeroflow_gpt::init_params(&config, &layout, seed, &mut params)
                .map_err(TrainError::model)?;
            Weights::Gpt { config, layout, params }
        };
        Ok(HostModel { weights, end_of_text: Vec::new() })
    }

    /// `gpt2` or `llama`.
    pub fn family(&self) -> &'static str {
        match self.weights {
            Weights::Gpt { .. } => "gpt2",
            Weights::Llama { .. } => "llama",
        }
    }

    /// The model's end-of-text tokens (`config.json`'s `eos_token_id`; none for a named shape).
    pub fn end_of_text(&self) -> &[u32] {
        &self.end_of_text
    }

    /// Its vocabulary: the token ids it reads are below this.
    pub fn vocab_size(&self) -> usize {
        match &self.weights {
            Weights::Gpt { config, .. } => config.vocab_size,
            Weights::Llama { config, .. } => config.vocab_size,
        }
    }

    /// The longest sequence the model takes.
    pub fn context(&self) -> usize {
        match &self.weights {
            Weights::Gpt { config, .. } => config.context,
            Weights::Llama { config, .. } => config.max_position_embeddings,
        }
    }

    /// The tokens the model adds to each of `prompts` (zeroflow-nn's `generate`) through the
    /// family's key/value-cached decoder.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
    ) -> Result<Vec<Vec<u32>>> {
        match &self.weights {
            Weights::Gpt { config, layout, params } => {
                let mut decoder =
                    GptDecoder::new(config, layout, params).map_err(TrainError::model)?;
                generate(&mut decoder, prompts, options).map_err(TrainError::model)
            }
            Weights::Llama { config, layout, params } => {
                let mut decoder =
                    LlamaDecoder::new(config, layout, params).map_err(TrainError::model)?;
                generate(&mut decoder, prompts, options).map_err(TrainError::model)
            }
        }
    }

    /// The loss over `stream` in windows of `window` inputs, by the training forward.
    pub fn eval(&self, stream: &[u32], window: usize) -> Result<EvalResult> {
        match &self.weights {
            Weights::Gpt { config, layout, params } => {
                zeroflow_gpt::eval_stream(config, layout, params, stream, window)
                    .map_err(TrainError::model)
            }
            Weights::Llama { config, layout, params } => {
                zeroflow_llama::eval_stream(config, layout, params, stream, window)
                    .map_err(TrainError::model)
            }
        }
    }

    /// The tokens the model writes after `prompt` as `completion` says; an input error for an
    /// empty prompt, an id outside the vocabulary or a sampling that draws from nothing.
    pub fn complete(&self, prompt: &[u32], completion: &Completion) -> Result<Vec<u32>> {
        self.check_ids("the prompt", prompt)?;
        check_sampling(&completion.sampling)?;
        let options = GenerateOptions {
            max_new_tokens: completion.max_new_tokens,
            sampling: completion.sampling,
            seed: completion.seed,
            stop_tokens: if completion.stop { self.end_of_text.clone() } else { Vec::new() },
        };
        let mut generated = self.generate(&[prompt.to_vec()], &options)?;
        Ok(generated.pop().unwrap_or_default())
    }

    /// The loss over the data `spec` names in windows of `window` inputs (default: the model's
    /// context): each shard or text file (bytes as tokens) a stream of its own, the loss
    /// weighted by each one's predicted tokens.
    pub fn eval_data(&self, spec: &Spec, window: Option<usize>) -> Result<EvalResult> {
        if let Spec::Synthetic = spec {
            return Err(input("--data synthetic: eval reads token shards or text files"));
        }
        let window = window.unwrap_or(self.context());
        if window == 0 || window > self.context() {
            let context = self.context();
            return Err(input(format!("--window {window}: between 1 and the context ({context})")));
        }
        let (mut sum, mut tokens) = (0.0, 0);
        for path in spec.files() {
            let stream = match spec {
                Spec::Text(_) => std::fs::read(path)
                    .map_err(|source| TrainError::Io {
                        what: format!("read {}", path.display()),
                        source,
                    })?
                    .into_iter()
                    .map(u32::from)
                    .collect(),
                _ => {
                    read_shard(path, self.vocab_size()).map_err(|e| input(e.to_string()))?.to_u32()
                }
            };
            self.check_ids(&path.display().to_string(), &stream)?;
            let result = self.eval(&stream, window)?;
            sum += result.loss * result.tokens as f64;
            tokens += result.tokens;
        }
        if tokens == 0 {
            return Err(input("--data: no window to evaluate (the data needs two tokens or more)"));
        }
        Ok(EvalResult { loss: sum / tokens as f64, tokens })
    }

    /// An input error unless `ids` (of `what`) are some, all within the vocabulary.
    fn check_ids(&self, what: &str, ids: &[u32]) -> Result<()> {
        let vocab = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab) {
            _ if ids.is_empty() => Err(input(format!("{what} has no tokens"))),
            Some(id) => {
                Err(input(format!("{what}: token {id} is outside the vocabulary ({vocab})")))
            }
            None => Ok(()),
        }
    }
}

/// An input error for a sampling that is not a distribution: a negative or non-finite
/// temperature, a top-k of 0, a top-p outside (0, 1].
fn check_sampling(sampling: &Sampling) -> Result<()> {
    let Sampling { temperature, top_k, top_p } = *sampling;
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(input(format!("--temperature {temperature}: 0 (greedy) or more")));
    }
    if top_k == Some(0) {
        return Err(input("--top-k 0: at least 1"));
    }
    match top_p {
        Some(p) if !(p > 0.0 && p <= 1.0) => Err(input(format!("--top-p {p}: in (0, 1]"))),
        _ => Ok(()),
    }
}

/// Token ids written `1,2,3`.
pub fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    let ids = text.split(',').map(|id| id.trim().parse::<u32>()).collect::<Result<Vec<_>, _>>();
    ids.map_err(|_| format!("{text:?} is not token ids separated by commas (1,2,3)"))
}

#[cfg(test)]
mod tests;
