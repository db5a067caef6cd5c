//! What the inference examples share: a model of either family, from a Hugging Face directory
//! or a named shape with random weights, as a `Decoder` and as a stream's evaluator.

use std::path::Path;

use zeroflow_core::layout::FlatLayout;
use zeroflow_gpt::{GptConfig, GptDecoder, HfGpt};
use zeroflow_llama::{HfLlama, LlamaConfig, LlamaDecoder};
use zeroflow_nn::infer::{EvalResult, GenerateOptions, generate};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A model of either family with its flat f32 parameters.
pub enum Model {
    Gpt { config: GptConfig, layout: FlatLayout, params: Vec<f32> },
    Llama { config: LlamaConfig, layout: FlatLayout, params: Vec<f32> },
}

impl Model {
    /// The model of a Hugging Face directory: GPT-2 where `config.json`'s `architectures` says
    /// `GPT2LMHeadModel` (or its `model_type` `gpt2`), else the Llama family.
    pub fn open(dir: &Path) -> Result<Model, Error> {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        let gpt2 = json["architectures"].get(0).and_then(|a| a.as_str()) == Some("GPT2LMHeadModel")
            || json["model_type"].as_str() == Some("gpt2");
        if gpt2 {
            let hf = HfGpt::open(dir)?;
            let layout = zeroflow_gpt::flat_layout(&hf.config, 1)?;
            let mut params = vec![0.0; layout.padded_len()];
            hf.read_params(&layout, &mut params)?;
            Ok(Model::Gpt { config: hf.config, layout, params })
        } else {
            let hf = HfLlama::open(dir)?;
            let layout = zeroflow_llama::flat_layout(&hf.config, 1)?;
            let mut params = vec![0.0; layout.padded_len()];
            hf.read_params(&layout, &mut params)?;
            Ok(Model::Llama { config: hf.config, layout, params })
        }
    }

    /// A named shape (GPT-2's sizes, `llama-1b` …) with random weights from `seed`.
    pub fn named(name: &str, seed: u64) -> Result<Model, Error> {
        if let Some(config) = zeroflow_llama::named_shape(name) {
            let layout = zeroflow_llama::flat_layout(&config, 1)?;
            let mut params = vec![0.0; layout.padded_len()];
            zeroflow_llama::init_params(&config, &layout, seed, &mut params)?;
            return Ok(Model::Llama { config, layout, params });
        }
        let config = GptConfig::named(name)?;
        let layout = zeroflow_gpt::flat_layout(&config, 1)?;
        let mut params = vec![0.0; layout.padded_len()];
        zeroflow_gpt::init_params(&config, &layout, seed, &mut params)?;
        Ok(Model::Gpt { config, layout, params })
    }

    pub fn family(&self) -> &'static str {
        match self {
            Model::Gpt { .. } => "gpt2",
            Model::Llama { .. } => "llama",
        }
    }

    /// `generate` through the family's key/value-cached decoder.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
    ) -> Result<Vec<Vec<u32>>, Error> {
        Ok(match self {
            Model::Gpt { config, layout, params } => {
                generate(&mut GptDecoder::new(config, layout, params)?, prompts, options)?
            }
            Model::Llama { config, layout, params } => {
                generate(&mut LlamaDecoder::new(config, layout, params)?, prompts, options)?
            }
        })
    }

    /// The loss over `stream` in windows of `window` inputs, by the training forward (f32).
    pub fn eval(&self, stream: &[u32], window: usize) -> Result<EvalResult, Error> {
        Ok(match self {
            Model::Gpt { config, layout, params } => {
                zeroflow_gpt::eval_stream(config, layout, params, stream, window)?
            }
            Model::Llama { config, layout, params } => {
                zeroflow_llama::eval_stream(config, layout, params, stream, window)?
            }
        })
    }
}

/// Token ids written `1,2,3`.
pub fn ids(text: &str) -> Result<Vec<u32>, Error> {
    Ok(text.split(',').map(|id| id.trim().parse()).collect::<Result<_, _>>()?)
}
