//! Where an inference model comes from: a Hugging Face directory, a zeroflow checkpoint
//! (`state.json` with the family-tagged shape in `extra.model`, `model.safetensors` under
//! Hugging Face names), or a run directory (its newest checkpoint).

use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{DType, Float};
use zeroflow_gpt::HfGpt;
use zeroflow_llama::HfLlama;

use super::{HostModel, InferDevice, Params, Weights, held_in};
use crate::data::{EvalSet, EvalTokens, Spec, holds_shards, run_eval_stream};
use crate::error::{Result, TrainError, input};
use crate::weight_files::FileParams;
use crate::{Family, ModelSpec, checkpoints, export, resume_point, with_family};

/// What a MODEL directory is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelDir {
    /// A Hugging Face directory (`config.json`).
    HuggingFace(PathBuf),
    /// A zeroflow checkpoint (`state.json`): the directory itself, or a run directory's newest.
    Checkpoint(PathBuf),
}

/// What `generate` and `eval` do with a MODEL by default. Its text is encoded with a Hugging Face
/// directory's own tokenizer and chat template; a checkpoint's, with those its run trained with,
/// the tokenizer of its `--init-from` directory (where that is still there) and its
/// `--chat-template` file (where still there) and `--chat-template-kwargs`. A checkpoint's `eval`
/// reads in the windows its run trained on (and without `--data`, its run's evaluation set:
/// [`ModelDir::run_eval_set`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelDefaults {
    /// The directory whose `tokenizer.json` (and `tokenizer_config.json`) encode text.
    pub tokenizer_dir: Option<PathBuf>,
    /// The chat template file (`None`: the tokenizer's own) and its variables.
    pub chat: zeroflow_data::ChatOptions,
    /// The run's `--seq`, for a checkpoint that records it.
    pub seq: Option<usize>,
    /// Whether the run packed its rows (`--pack`): `eval` reads packed by default.
    pub packed: bool,
}

/// A run's evaluation set as its trainer evaluated on it ([`crate::data::run_eval_stream`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RunEvalSet {
    /// Its tokens, their loss mask (chat data's) and, where the run packed its rows, where its
    /// documents start.
    pub tokens: EvalTokens,
    /// The run's `--seq`: the windows its evaluations read.
    pub window: usize,
    /// What it is, as the run's header said.
    pub description: String,
}

impl RunEvalSet {
    /// Each token's position in its document, 0 at the start of every window of `window`
    /// inputs, where the run packed its rows (its evaluations attended within documents alone):
    /// the stream's [`super::EvalStream::positions`].
    pub fn positions(&self, window: usize) -> Option<Vec<u32>> {
        let starts = self.tokens.documents.as_deref()?;
        Some(super::window_positions(starts, window, self.tokens.tokens.len()))
    }
}

impl ModelDir {
    /// What its text is encoded with by default ([`ModelDefaults`]).
    pub fn defaults(&self) -> Result<ModelDefaults> {
        match self {
            ModelDir::HuggingFace(dir) => {
                Ok(ModelDefaults { tokenizer_dir: Some(dir.clone()), ..ModelDefaults::default() })
            }
            ModelDir::Checkpoint(dir) => {
                let checkpoint = export::read_checkpoint(dir)?;
                Ok(ModelDefaults {
                    tokenizer_dir: checkpoint.init_from.filter(|dir| dir.is_dir()),
                    chat: zeroflow_data::ChatOptions {
                        template: checkpoint.chat_template.filter(|file| file.is_file()),
                        variables: checkpoint.chat_template_kwargs,
                    },
                    seq: checkpoint.seq,
                    packed: checkpoint.packed,
                })
            }
        }
    }

    /// The evaluation set of a checkpoint's run as its trainer made it: its data as it read it
    /// (the tokens it tokenized at start-up, where its run directory still holds them, else its
    /// `--data`), and of that its `--eval-data` (tokenized at start-up likewise), the documents
    /// it held out, or the tail of its last file (the synthetic corpus: its other stream), its
    /// `--eval-tokens` and `--seq`, packed where it packed its rows (or as `pack` says, where
    /// given). `None` for a Hugging Face directory, which has no run.
    pub fn run_eval_set(&self, pack: Option<bool>) -> Result<Option<RunEvalSet>> {
        let ModelDir::Checkpoint(dir) = self else { return Ok(None) };
        let opened = zeroflow_engine::checkpoint::open(dir).map_err(|e| input(e.to_string()))?;
        let extra = resume_point::extra_of(dir, &opened)?;
        let run = resume_point::run_dir_of(dir);
        let run = run.as_deref();
        let tokenized = |folder: &str| {
            let found = run.map(|run| run.join("tokens").join(folder)).filter(|d| holds_shards(d));
            found.map(|dir| Spec::parse(&dir.display().to_string())).transpose()
        };
        // Files as the run read them: the tokens it made of them at start-up (a .jsonl; text,
        // with a model directory), where its run directory still holds them, else as they are.
        let as_read = |folder: &str, data: &str| -> Result<Spec> {
            if let Some(spec) = tokenized(folder)? {
                return Ok(spec);
            }
            let spec = Spec::parse(data)?;
            let made_at_start = match &spec {
                Spec::Jsonl(_) => true,
                Spec::Text(_) => extra.run.init_from.is_some(),
                _ => false,
            };
            if made_at_start {
                let folder = run.map(|run| run.join("tokens").join(folder).display().to_string());
                return Err(input(format!(
                    "its run read {data} as the tokens it made of it at start-up, which are no \
                     longer in {}",
                    folder.unwrap_or_else(|| "its run directory".into())
                )));
            }
            Ok(spec)
        };
        let spec = as_read("rank-0", &extra.data)?;
        let given =
            extra.eval_data.as_deref().map(|data| as_read("eval-rank-0", data)).transpose()?;
        let held_out = match extra.documents_held_out {
            Some(true) => match tokenized("rank-0/held-out")? {
                Some(spec) => Some(spec),
                None => Spec::held_out_beside(&extra.data)?,
            },
            _ => None,
        };
        let eval = EvalSet::of(given.as_ref(), held_out.as_ref());
        let window = match extra.seq {
            Some(seq) => seq as usize,
            None => extra.model.default_seq(),
        };
        let eval_tokens = extra.eval_tokens.map(|n| n as usize);
        let vocab = extra.model.vocab_size();
        let packed = pack.unwrap_or_else(|| crate::settings::packed_in(&extra.settings));
        let (tokens, mut description) =
            run_eval_stream(&spec, eval, vocab, window, eval_tokens, packed, extra.seed)?;
        if packed {
            description.push_str(", packed (no attention across documents)");
        }
        Ok(Some(RunEvalSet { tokens, window, description }))
    }

    /// `dir` as a checkpoint where it has `state.json`, as its newest checkpoint where it is a
    /// run directory (`checkpoints/step-N`), else as a Hugging Face directory (`config.json`);
    /// an input error, saying what MODEL may be, where it is none of them.
    pub fn find(dir: &Path) -> Result<ModelDir> {
        if dir.join("state.json").is_file() {
            return Ok(ModelDir::Checkpoint(dir.to_path_buf()));
        }
        let newest = checkpoints::list(dir).map_err(TrainError::model)?.pop();
        let hf = dir.join("config.json").exists();
        match newest {
            Some((_, checkpoint)) if !hf => Ok(ModelDir::Checkpoint(checkpoint)),
            _ if hf => Ok(ModelDir::HuggingFace(dir.to_path_buf())),
            _ => Err(input(format!(
                "MODEL {}: {}; give a Hugging Face model directory (config.json and its \
                 safetensors), a checkpoint (<run>/checkpoints/step-N, with state.json) or a run \
                 directory (its newest checkpoint)",
                dir.display(),
                if dir.is_dir() { "holds no model" } else { "no such directory" }
            ))),
        }
    }

    /// Its model, its parameters in f32: a Hugging Face directory's ([`HostModel::open_hf`]) or
    /// a checkpoint's ([`HostModel::open_checkpoint`]).
    pub fn open(&self) -> Result<HostModel> {
        self.open_for(InferDevice::Cpu)
    }

    /// [`ModelDir::open`] for inference on `device`: the parameters read into f32 for the CPU,
    /// left in their files for a GPU (read as bf16 while they are uploaded: no copy of a large
    /// model in host memory).
    pub fn open_for(&self, device: InferDevice) -> Result<HostModel> {
        match self {
            ModelDir::HuggingFace(dir) => HostModel::open_hf(dir, held_in(device)),
            ModelDir::Checkpoint(dir) => HostModel::open_checkpoint(dir, held_in(device)),
        }
    }
}

impl HostModel {
    /// The model of the directory `dir` ([`ModelDir::find`], [`ModelDir::open`]).
    pub fn open(dir: &Path) -> Result<HostModel> {
        ModelDir::find(dir)?.open()
    }

    /// [`HostModel::open`] for inference on `device` ([`ModelDir::open_for`]).
    pub fn open_for(dir: &Path, device: InferDevice) -> Result<HostModel> {
        ModelDir::find(dir)?.open_for(device)
    }

    /// The model of the Hugging Face directory `dir`: GPT-2 where `config.json`'s
    /// `architectures` says `GPT2LMHeadModel` (or its `model_type` is `gpt2`), else the Llama
    /// family (Llama, Qwen2, Qwen3, Mistral); its end-of-text tokens are `eos_token_id`'s, and
    /// `generation_config.json`'s where it has one (`generation_stops`). The
    /// parameters are read into f32 (`dtype` F32), or left in the files for a GPU (BF16: read
    /// as bf16 as they are uploaded, the stored values rounded as f32 ones would be).
    pub fn open_hf(dir: &Path, dtype: DType) -> Result<HostModel> {
        let json = read_config(&dir.join("config.json"))?;
        let end_of_text = zeroflow_hf::eos_token_ids(&json);
        let stops = generation_stops(dir)?;
        let gpt2 = json["architectures"].get(0).and_then(|a| a.as_str()) == Some("GPT2LMHeadModel")
            || json["model_type"].as_str() == Some("gpt2");
        let weights = if gpt2 {
            let hf = HfGpt::open(dir).map_err(TrainError::model)?;
            let layout = zeroflow_gpt::flat_layout(&hf.config, 1).map_err(TrainError::model)?;
            let params = match dtype {
                DType::Bf16 => {
                    let stored = hf.stored_ranges(&layout).map_err(TrainError::model)?;
                    Params::Files(FileParams::of_hf(&hf.checkpoint, stored, layout.padded_len())?)
                }
                _ => Params::F32(filled(&layout, |p| hf.read_params(&layout, p))?),
            };
            Weights::Gpt { config: hf.config, layout, params }
        } else {
            let hf = HfLlama::open(dir).map_err(TrainError::model)?;
            let layout = zeroflow_llama::flat_layout(&hf.config, 1).map_err(TrainError::model)?;
            let params = match dtype {
                DType::Bf16 => {
                    let stored = hf.stored_ranges(&layout).map_err(TrainError::model)?;
                    Params::Files(FileParams::of_hf(&hf.checkpoint, stored, layout.padded_len())?)
                }
                _ => Params::F32(filled(&layout, |p| hf.read_params(&layout, p))?),
            };
            Weights::Llama { config: hf.config, layout, params }
        };
        Ok(HostModel { weights, end_of_text }.stopping_at(stops))
    }

    /// The model of the checkpoint `dir` (what `zeroflow train` saves): the family and shape of
    /// its `state.json`, the weights of its `model.safetensors` (the optimizer's master weights
    /// where a delayed update was pending, rounded: then held in host memory), in `dtype` (F32,
    /// or BF16: left in the file for a GPU as [`HostModel::open_hf`] leaves them). Its
    /// end-of-text tokens are its shape's `config.json`'s (GPT-2's 50256), else those
    /// of the run's `--init-from` directory, with that directory's `generation_stops`.
    pub fn open_checkpoint(dir: &Path, dtype: DType) -> Result<HostModel> {
        let checkpoint = export::read_checkpoint(dir)?;
        let mut end_of_text =
            zeroflow_hf::eos_token_ids(&with_family!(&checkpoint.model, f => f.hf_config()));
        let mut stops = Vec::new();
        if let Some(init_from) = checkpoint.init_from.as_deref().filter(|d| d.is_dir()) {
            if end_of_text.is_empty() {
                let config = read_config(&init_from.join("config.json"))?;
                end_of_text = zeroflow_hf::eos_token_ids(&config);
            }
            stops = generation_stops(init_from)?;
        }
        let layout = checkpoint.model.flat_layout(1)?;
        let tensors = checkpoint.model.tensors(&layout)?;
        let params = match dtype {
            DType::Bf16 if !checkpoint.upload_pending => {
                Params::Files(checkpoint.weight_files(&tensors, layout.padded_len())?)
            }
            DType::Bf16 => Params::Bf16(checkpoint.weights(&layout, &tensors)?),
            _ => Params::F32(checkpoint.weights(&layout, &tensors)?),
        };
        let weights = match &checkpoint.model {
            ModelSpec::Gpt2(config) => Weights::Gpt { config: *config, layout, params },
            ModelSpec::Llama(spec) => Weights::Llama { config: spec.0.clone(), layout, params },
        };
        Ok(HostModel { weights, end_of_text }.stopping_at(stops))
    }
}

/// The padded flat parameters of `layout` in `T`, filled by `read`.
fn filled<T: Float, E: std::error::Error + Send + Sync + 'static>(
    layout: &FlatLayout,
    read: impl FnOnce(&mut [T]) -> std::result::Result<(), E>,
) -> Result<Vec<T>> {
    let mut params = vec![T::default(); layout.padded_len()];
    read(&mut params).map_err(TrainError::model)?;
    Ok(params)
}

/// A `config.json`, parsed.
fn read_config(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
        what: format!("read {} (a Hugging Face model directory's config)", path.display()),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| input(format!("{}: not JSON: {e}", path.display())))
}

/// The ids of the `eos_token_id` of the model directory `dir`'s `generation_config.json`, where
/// it has one: `transformers`' `generate` stops at them (an instruct model's end of a turn among
/// them, Llama-3's `<|eot_id|>`), as generation here does.
fn generation_stops(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join(zeroflow_hf::GENERATION_CONFIG_FILE);
    match path.is_file() {
        true => Ok(zeroflow_hf::eos_token_ids(&read_config(&path)?)),
        false => Ok(Vec::new()),
    }
}
