//! Inference for `zeroflow generate`, `zeroflow eval` and the inference examples: a model of
//! either family, from a Hugging Face directory, a checkpoint or a run directory
//! ([`HostModel::open`], [`source`]) or a named shape with random weights ([`HostModel::named`]),
//! run through its family's key/value-cached decoder ([`HostModel::generate`]; on a GPU,
//! [`cuda`]) or over a token stream's windows by the training forward ([`HostModel::eval`]).
//! The weights are held on the host in f32, or, where the model is opened for a GPU
//! ([`HostModel::open_for`]), left in their files and read in bf16 as they are uploaded.

use std::borrow::Cow;
use std::ops::ControlFlow;

use zeroflow_data::{ChatOptions, Tokenizer};

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{DType, bf16};
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::{CudaDevice, Device, HostMemory};
use zeroflow_gpt::{GptConfig, GptDecoder};
use zeroflow_llama::{LlamaConfig, LlamaDecoder};
use zeroflow_nn::infer::{Continuation, Decoder, HostDecoder, KvCache, generate};
pub use zeroflow_nn::infer::{EvalResult, EvalStream, GenerateOptions, Sampling};

pub mod cuda;
mod prompts;
pub mod source;

pub use cuda::{CudaDecoder, CudaPrefixDecoder};
pub use prompts::{Prompt, parse_prompts, read_prompts, reply_stops};
pub use source::{ModelDefaults, ModelDir, RunEvalSet};

use crate::ModelSpec;
use crate::data::Spec;
use crate::error::{Result, TrainError, input};
use crate::llama::LlamaSpec;
use crate::weight_files::FileParams;

/// How a prompt is continued ([`HostModel::complete`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Completion {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// End at the model's end-of-text token (kept in the output), where it has one.
    pub stop: bool,
}

/// Where inference runs: the CPU in f32, or a GPU in bf16 (`cuda`: GPU 0, `cuda:N`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InferDevice {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for InferDevice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let gpu = |n: &str| n.parse().map(InferDevice::Cuda).ok();
        match text {
            "cpu" => Ok(InferDevice::Cpu),
            "cuda" => Ok(InferDevice::Cuda(0)),
            _ => text.strip_prefix("cuda:").and_then(gpu).ok_or_else(|| {
                format!("{text:?} is not a device: cpu, cuda or cuda:N (a GPU's index)")
            }),
        }
    }
}

/// A model of either family with its flat parameters (f32, or bf16 where it was opened for a
/// GPU), and its end-of-text tokens.
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
    Gpt { config: GptConfig, layout: FlatLayout, params: Params },
    Llama { config: LlamaConfig, layout: FlatLayout, params: Params },
}

/// The flat parameters: f32, what the CPU's decoders and training forward run; or left in their
/// files for a GPU, which reads them as bf16 a piece at a time as it uploads them
/// ([`HostModel::open_for`]: no copy of a large model in host memory; the same bf16 values as the
/// f32 ones rounded); or bf16 in host memory (a checkpoint's master weights rounded, where its
/// delayed update was pending).
enum Params {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Files(FileParams),
}

impl Params {
    /// As f32: borrowed, widened from bf16 (exactly), or read from the files.
    fn f32(&self) -> Result<Cow<'_, [f32]>> {
        Ok(match self {
            Params::F32(params) => Cow::Borrowed(params),
            Params::Bf16(params) => Cow::Owned(params.iter().map(|p| p.to_f32()).collect()),
            Params::Files(files) => {
                let mut params = vec![0.0; files.len()];
                files.read(0..files.len(), &mut params)?;
                Cow::Owned(params)
            }
        })
    }

    /// On `device` in bf16: uploaded a piece at a time, each rounded (or read from the files) as
    /// it goes, through two upload buffers (no whole copy of the weights on the host).
    fn upload(&self, device: &CudaDevice) -> Result<CudaBuffer<bf16>> {
        Ok(match self {
            Params::F32(params) => device.upload_rounded(params)?,
            Params::Bf16(params) => device.upload(params)?,
            Params::Files(files) => {
                let buffer = device.alloc::<bf16>(files.len())?;
                let piece = zeroflow_device::UPLOAD_PIECE_BYTES / size_of::<bf16>();
                device.synchronize()?;
                let fill = |range, out: &mut [bf16]| files.read(range, out);
                device.upload_in_pieces(&buffer, piece, HostMemory::Pinned, fill)?;
                buffer
            }
        })
    }
}

/// The element type a model's parameters are held in on the host: f32 for the CPU, bf16 for a
/// GPU (which runs in bf16).
fn held_in(device: InferDevice) -> DType {
    match device {
        InferDevice::Cpu => DType::F32,
        InferDevice::Cuda(_) => DType::Bf16,
    }
}

impl HostModel {
    /// A named shape (GPT-2's sizes, `llama-1b` …) with random weights from `seed`, without
    /// end-of-text tokens.
    pub fn named(name: &str, seed: u64) -> Result<HostModel> {
        let weights = if let Some(config) = zeroflow_llama::named_shape(name) {
            let layout = zeroflow_llama::flat_layout(&config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            zeroflow_llama::init_params(&config, &layout, seed, &mut params)
                .map_err(TrainError::model)?;
            Weights::Llama { config, layout, params: Params::F32(params) }
        } else {
            let config = GptConfig::named(name).map_err(|e| input(e.to_string()))?;
            let layout = zeroflow_gpt::flat_layout(&config, 1).map_err(TrainError::model)?;
            let mut params = vec![0.0; layout.padded_len()];
            zeroflow_gpt::init_params(&config, &layout, seed, &mut params)
                .map_err(TrainError::model)?;
            Weights::Gpt { config, layout, params: Params::F32(params) }
        };
        Ok(HostModel { weights, end_of_text: Vec::new() })
    }

    /// A model of `spec` over the flat f32 parameters `params` (the padded layout of `spec` for
    /// one rank), without end-of-text tokens.
    pub fn from_params(spec: &crate::ModelSpec, params: Vec<f32>) -> Result<HostModel> {
        let layout = spec.flat_layout(1)?;
        if params.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), params.len());
            return Err(input(format!("{found} parameters for a layout of {expected}")));
        }
        let params = Params::F32(params);
        let weights = match spec {
            crate::ModelSpec::Gpt2(config) => Weights::Gpt { config: *config, layout, params },
            crate::ModelSpec::Llama(spec) => {
                Weights::Llama { config: spec.0.clone(), layout, params }
            }
        };
        Ok(HostModel { weights, end_of_text: Vec::new() })
    }

    /// The logits `[prompts.len(), vocab]` of the token after each of `prompts` (one prefill of
    /// the family's decoder on `device`).
    pub fn next_logits(&self, prompts: &[Vec<u32>], device: InferDevice) -> Result<Vec<f32>> {
        for (b, prompt) in prompts.iter().enumerate() {
            self.check_ids(&format!("prompt {}", b + 1), prompt)?;
        }
        let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let capacity = prompts.iter().map(Vec::len).max().unwrap_or(0);
        match (device, &self.weights) {
            (InferDevice::Cuda(ordinal), _) => {
                self.cuda_decoder(ordinal)?.prefill(&views, capacity)
            }
            (InferDevice::Cpu, Weights::Gpt { config, layout, params }) => {
                let params = params.f32()?;
                let mut decoder =
                    GptDecoder::new(config, layout, &params).map_err(TrainError::model)?;
                decoder.prefill(&views, capacity).map_err(TrainError::model)
            }
            (InferDevice::Cpu, Weights::Llama { config, layout, params }) => {
                let params = params.f32()?;
                let mut decoder =
                    LlamaDecoder::new(config, layout, &params).map_err(TrainError::model)?;
                decoder.prefill(&views, capacity).map_err(TrainError::model)
            }
        }
    }

    /// `gpt2` or `llama`.
    pub fn family(&self) -> &'static str {
        match self.weights {
            Weights::Gpt { .. } => "gpt2",
            Weights::Llama { .. } => "llama",
        }
    }

    /// The model's end-of-text tokens (`config.json`'s `eos_token_id` and
    /// `generation_config.json`'s; none for a named shape).
    pub fn end_of_text(&self) -> &[u32] {
        &self.end_of_text
    }

    /// Ends a completion at `token` too (where `stop` asks for it): the tokenizer's `eos_token`
    /// or a chat template's end of a turn, besides the model's end-of-text ids.
    pub fn also_stop_at(&mut self, token: u32) {
        if !self.end_of_text.contains(&token) {
            self.end_of_text.push(token);
        }
    }

    /// This model, its completions ending at `tokens` too ([`HostModel::also_stop_at`]).
    fn stopping_at(mut self, tokens: Vec<u32>) -> HostModel {
        tokens.into_iter().for_each(|token| self.also_stop_at(token));
        self
    }

    /// Its vocabulary: the token ids it reads are below this.
    pub fn vocab_size(&self) -> usize {
        match &self.weights {
            Weights::Gpt { config, .. } => config.vocab_size,
            Weights::Llama { config, .. } => config.vocab_size,
        }
    }

    /// The model as `train` describes it.
    fn spec(&self) -> ModelSpec {
        match &self.weights {
            Weights::Gpt { config, .. } => ModelSpec::Gpt2(*config),
            Weights::Llama { config, .. } => ModelSpec::Llama(LlamaSpec(config.clone())),
        }
    }

    /// The window `eval` reads in where none is given: the sequence length `train` uses unless
    /// `--seq` says ([`ModelSpec::default_seq`]: GPT-2's context, the Llama family's 2048 or its
    /// context where shorter), not a long context (131,072 for Llama 3.1), whose window the CPU
    /// could not hold.
    pub fn default_window(&self) -> usize {
        self.spec().default_seq()
    }

    /// An input error, naming `--window` (`window`), where a window of `inputs` (at most
    /// `window`: the data may be shorter) needs more than `available` bytes for its activations
    /// on the CPU (f32, as allocated for the forward with its gradients' room).
    fn check_cpu_window(&self, window: usize, inputs: usize, available: Option<u64>) -> Result<()> {
        let Some(available) = available else { return Ok(()) };
        let needed = self.spec().cpu_activations(1, inputs) as u128 * 2 * 4;
        if needed <= u128::from(available) {
            return Ok(());
        }
        let gib = |bytes: u128| bytes as f64 / f64::from(1u32 << 30);
        let which = match inputs == window {
            true => "a window's activations".to_owned(),
            false => format!("the activations of a window of {inputs} inputs (the data's longest)"),
        };
        Err(input(format!(
            "--window {window}: {which} on the CPU need {:.1} GiB of host memory but \
             {:.1} GiB is available; give a smaller --window (the default is {}), or --device \
             cuda",
            gib(needed),
            gib(u128::from(available)),
            self.default_window()
        )))
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
                let params = params.f32()?;
                let mut decoder =
                    GptDecoder::new(config, layout, &params).map_err(TrainError::model)?;
                generate(&mut decoder, prompts, options).map_err(TrainError::model)
            }
            Weights::Llama { config, layout, params } => {
                let params = params.f32()?;
                let mut decoder =
                    LlamaDecoder::new(config, layout, &params).map_err(TrainError::model)?;
                generate(&mut decoder, prompts, options).map_err(TrainError::model)
            }
        }
    }

    /// [`HostModel::generate`] on `device`: the CPU's cached decoder, or a GPU's
    /// [`CudaDecoder`] (the weights uploaded in bf16 first).
    pub fn generate_on(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
        device: InferDevice,
    ) -> Result<Vec<Vec<u32>>> {
        match device {
            InferDevice::Cpu => self.generate(prompts, options),
            InferDevice::Cuda(ordinal) => {
                generate(&mut self.cuda_decoder(ordinal)?, prompts, options)
            }
        }
    }

    /// The loss over `stream` in windows of `window` inputs, by the training forward; the
    /// targets its mask leaves out (a chat's loss mask), where given, not counted; where it is
    /// packed, no attention across its documents.
    pub fn eval(&self, stream: EvalStream<'_>, window: usize) -> Result<EvalResult> {
        match &self.weights {
            Weights::Gpt { config, layout, params } => {
                zeroflow_gpt::eval_stream(config, layout, &params.f32()?, stream, window)
                    .map_err(TrainError::model)
            }
            Weights::Llama { config, layout, params } => {
                zeroflow_llama::eval_stream(config, layout, &params.f32()?, stream, window)
                    .map_err(TrainError::model)
            }
        }
    }

    /// The tokens the model writes after `prompt` as `completion` says; an input error for an
    /// empty prompt, an id outside the vocabulary or a sampling that draws from nothing.
    pub fn complete(&self, prompt: &[u32], completion: &Completion) -> Result<Vec<u32>> {
        let mut generated = self.complete_batch(&[prompt.to_vec()], completion)?;
        Ok(generated.pop().unwrap_or_default())
    }

    /// [`HostModel::complete`] of every prompt of `prompts` as one batch (one prefill, then one
    /// decode step per token for the unfinished sequences); prompt `b` draws from stream `b` of
    /// the seed, so that greedy tokens and a sequence's draws do not depend on the rest of the
    /// batch. The input error of a prompt names it (`prompt 3`, from 1) where there are several.
    pub fn complete_batch(
        &self,
        prompts: &[Vec<u32>],
        completion: &Completion,
    ) -> Result<Vec<Vec<u32>>> {
        self.complete_batch_on(prompts, completion, InferDevice::Cpu)
    }

    /// [`HostModel::complete_batch`] on `device` (a GPU: [`CudaDecoder`]).
    pub fn complete_batch_on(
        &self,
        prompts: &[Vec<u32>],
        completion: &Completion,
        device: InferDevice,
    ) -> Result<Vec<Vec<u32>>> {
        let options = self.checked_options(prompts, completion)?;
        self.generate_on(prompts, &options, device)
    }

    /// What `generate` does for `completion` of `prompts`, after an input error where a prompt
    /// holds an id outside the vocabulary (naming it, `prompt 3` from 1, where there are several)
    /// or the sampling is not a distribution.
    fn checked_options(
        &self,
        prompts: &[Vec<u32>],
        completion: &Completion,
    ) -> Result<GenerateOptions> {
        for (b, prompt) in prompts.iter().enumerate() {
            let what =
                if prompts.len() == 1 { "the prompt".into() } else { format!("prompt {}", b + 1) };
            self.check_ids(&what, prompt)?;
        }
        check_sampling(&completion.sampling)?;
        Ok(self.options(completion))
    }

    /// Completions one after another on `device` with one decoder, made here: a GPU's holds the
    /// weights, uploaded once for all of them (`generate --chat`'s conversation), where
    /// [`HostModel::complete_batch_on`] uploads them for each call; the CPU's reads them in f32,
    /// widened here once where they are not. Its key/value cache is kept from one completion to
    /// the next ([`Session`]).
    pub fn session(&self, device: InferDevice) -> Result<Session<'_>> {
        let decoder = match device {
            InferDevice::Cpu => SessionDecoder::Cpu { weights: self.params().f32()?, cache: None },
            InferDevice::Cuda(ordinal) => {
                SessionDecoder::Cuda(Box::new(self.cuda_decoder(ordinal)?))
            }
        };
        Ok(Session { model: self, decoder, continuation: Continuation::default() })
    }

    /// What `generate` does for `completion`.
    fn options(&self, completion: &Completion) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: completion.max_new_tokens,
            sampling: completion.sampling,
            seed: completion.seed,
            stop_tokens: if completion.stop { self.end_of_text.clone() } else { Vec::new() },
        }
    }

    /// The loss over the data `spec` names in windows of `window` inputs (default: the sequence
    /// length `train` would use, [`HostModel::default_window`]): each shard or text file (bytes
    /// as tokens) a stream of its own, the loss weighted by each one's predicted tokens; a
    /// shard's loss mask (chat data: the assistant's tokens) leaves out the targets it leaves out
    /// in training.
    pub fn eval_data(&self, spec: &Spec, window: Option<usize>) -> Result<EvalResult> {
        let unpacked = false;
        self.eval_data_on(spec, window, InferDevice::Cpu, None, &ChatOptions::default(), unpacked)
    }

    /// [`HostModel::eval_data`] on `device` (a GPU: [`HostModel::eval_cuda`]), text files
    /// encoded by `tokenizer` where one is given (else bytes as tokens), and a `.jsonl` of
    /// documents or conversations tokenized by it and its chat template as `zeroflow tokenize`
    /// does (into a scratch directory, removed after; `chat`: another template, variables for
    /// it), its conversations' loss masks kept. `packed`: each shard's documents (its `.idx`)
    /// attend within themselves alone, positions from 0 at each, as a packed run evaluates (a
    /// text file is one document: the same as unpacked).
    pub fn eval_data_on(
        &self,
        spec: &Spec,
        window: Option<usize>,
        device: InferDevice,
        tokenizer: Option<&Tokenizer>,
        chat: &ChatOptions,
        packed: bool,
    ) -> Result<EvalResult> {
        if let Spec::Synthetic = spec {
            return Err(input("--data synthetic: eval reads token shards or text files"));
        }
        if let Spec::Jsonl(jsonl) = spec {
            let tokenizer = tokenizer.ok_or_else(|| {
                input(format!(
                    "--data {}: a .jsonl is tokenized with the model's tokenizer and chat \
                     template; evaluate a model directory that has a tokenizer.json, or give \
                     --tokenizer",
                    jsonl[0].display()
                ))
            })?;
            let scratch = std::env::temp_dir().join(format!(
                "zeroflow-eval-{}-{}",
                std::process::id(),
                utc_nanos()
            ));
            let shards = tokenize_jsonl(tokenizer, chat, jsonl, &scratch);
            let result = shards.and_then(|shards| {
                let shards = Spec::Shards(shards);
                self.eval_data_on(&shards, window, device, None, chat, packed)
            });
            let _ = std::fs::remove_dir_all(&scratch);
            return result;
        }
        let window = window.unwrap_or(self.default_window());
        if window == 0 || window > self.context() {
            let context = self.context();
            return Err(input(format!("--window {window}: between 1 and the context ({context})")));
        }
        let (mut sum, mut tokens) = (0.0, 0);
        let shards = zeroflow_data::Source::Shards(spec.files().to_vec());
        for (index, path) in spec.files().iter().enumerate() {
            let (stream, mask, documents) = match spec {
                Spec::Text(_) => {
                    let read = |source| TrainError::Io {
                        what: format!("read {}", path.display()),
                        source,
                    };
                    let stream = match tokenizer {
                        None => {
                            std::fs::read(path).map_err(read)?.into_iter().map(u32::from).collect()
                        }
                        // In pieces on all cores, as `zeroflow tokenize` reads text.
                        Some(tokenizer) => {
                            let piece = zeroflow_data::TEXT_PIECE_BYTES;
                            zeroflow_data::encode_text_file(tokenizer, path, piece)
                                .map_err(|e| input(e.to_string()))?
                        }
                    };
                    (stream, None, None)
                }
                // The shard with its loss mask (chat data's) and, packed, where its documents
                // start, as the training's loader reads it.
                _ => {
                    let unit = zeroflow_data::read_unit(&shards, index, self.vocab_size())
                        .map_err(|e| input(e.to_string()))?;
                    let documents = packed
                        .then(|| zeroflow_data::read_document_starts(&shards, index))
                        .transpose()
                        .map_err(|e| input(format!("--pack: {e}")))?;
                    (unit.tokens.to_u32(), unit.mask, documents)
                }
            };
            self.check_ids(&path.display().to_string(), &stream)?;
            let positions = documents.map(|starts| window_positions(&starts, window, stream.len()));
            let stream = EvalStream {
                positions: positions.as_deref(),
                ..EvalStream::of(&stream).masked(mask.as_deref())
            };
            let result = self.eval_on(stream, window, device)?;
            sum += result.loss * result.tokens as f64;
            tokens += result.tokens;
        }
        if tokens == 0 {
            return Err(input(
                "--data: no window to evaluate (the data needs two tokens or more, and a chat's \
                 loss mask an assistant's token)",
            ));
        }
        Ok(EvalResult { loss: sum / tokens as f64, tokens })
    }

    /// The loss over `stream` in windows of `window` inputs on `device` ([`HostModel::eval`]);
    /// on the CPU, an input error naming `--window` first where a window does not fit the
    /// memory.
    pub fn eval_on(
        &self,
        stream: EvalStream<'_>,
        window: usize,
        device: InferDevice,
    ) -> Result<EvalResult> {
        match device {
            InferDevice::Cpu => {
                // The longest window of this stream (a stream shorter than the window is one).
                let longest = window.min(stream.tokens.len().saturating_sub(1));
                self.check_cpu_window(window, longest, crate::limits::available_host_memory())?;
                self.eval(stream, window)
            }
            InferDevice::Cuda(ordinal) => self.eval_cuda(stream, window, ordinal),
        }
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

/// Completions one after another with one decoder ([`HostModel::session`]), as the turns of
/// a conversation: its key/value cache is kept between them, and a prompt that starts with the
/// last prompt and its reply runs only the tokens after them ([`Continuation`]).
#[derive(Debug)]
pub struct Session<'a> {
    model: &'a HostModel,
    decoder: SessionDecoder<'a>,
    continuation: Continuation,
}

#[derive(Debug)]
enum SessionDecoder<'a> {
    /// The weights in f32 (widened once, where they are not), and the cache between turns (a
    /// decoder borrows the weights, and is made for each turn around the cache).
    Cpu { weights: Cow<'a, [f32]>, cache: Option<KvCache<f32>> },
    /// A GPU's decoder, its weights uploaded, its cache on the GPU.
    Cuda(Box<CudaDecoder>),
}

impl Session<'_> {
    /// [`HostModel::complete`] on the session's device, continuing the earlier turns' cache
    /// where `prompt` starts with what they ran.
    pub fn complete(&mut self, prompt: &[u32], completion: &Completion) -> Result<Vec<u32>> {
        self.complete_with(prompt, completion, |_| ControlFlow::Continue(()))
    }

    /// [`Session::complete`], telling `on_token` of each new token as it is chosen (to show the
    /// completion as it is written); the completion ends with the token at which it breaks (a
    /// reply the user stopped).
    pub fn complete_with(
        &mut self,
        prompt: &[u32],
        completion: &Completion,
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Vec<u32>> {
        let options = self.model.checked_options(&[prompt.to_vec()], completion)?;
        let continuation = &mut self.continuation;
        let (weights, cache) = match &mut self.decoder {
            SessionDecoder::Cuda(decoder) => {
                return continuation.generate_with(decoder.as_mut(), prompt, &options, on_token);
            }
            SessionDecoder::Cpu { weights, cache } => (&**weights, cache),
        };
        let cached = cache.take();
        match &self.model.weights {
            Weights::Gpt { config, layout, .. } => {
                let decoder =
                    GptDecoder::new(config, layout, weights).map_err(TrainError::model)?;
                cpu_turn(decoder, (cache, cached), continuation, prompt, &options, on_token)
            }
            Weights::Llama { config, layout, .. } => {
                let decoder =
                    LlamaDecoder::new(config, layout, weights).map_err(TrainError::model)?;
                cpu_turn(decoder, (cache, cached), continuation, prompt, &options, on_token)
            }
        }
    }

    /// The last prompt's tokens that ran; the rest of it the cache held from earlier turns.
    pub fn last_ran(&self) -> usize {
        self.continuation.last_ran()
    }
}

/// A turn of a session on the CPU: `decoder` around the cache the last turn left (`cached`),
/// which goes back into `cache` whether the turn runs or fails.
fn cpu_turn<D: HostDecoder<Float = f32>>(
    decoder: D,
    (cache, cached): (&mut Option<KvCache<f32>>, Option<KvCache<f32>>),
    continuation: &mut Continuation,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Vec<u32>> {
    let mut decoder = match cached {
        Some(kv) => decoder.with_cache(kv).map_err(|e| TrainError::Model(e.into()))?,
        None => decoder,
    };
    let generated = continuation.generate_with(&mut decoder, prompt, options, on_token);
    *cache = Some(decoder.take_cache());
    generated.map_err(TrainError::model)
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

/// The positions of a stream of `len` tokens whose documents start at `starts` (ascending), in
/// windows of `window` inputs: each token's position in its document, 0 at every document's and
/// every window's start, as the trainer's packed evaluation batches give them
/// ([`zeroflow_data::eval_batches`]).
pub(crate) fn window_positions(starts: &[u64], window: usize, len: usize) -> Vec<u32> {
    let mut positions = Vec::with_capacity(len);
    zeroflow_data::document_positions(starts, 0, window, len, &mut positions);
    positions
}

/// Token ids written `1,2,3`.
pub fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    let ids = text.split(',').map(|id| id.trim().parse::<u32>()).collect::<Result<Vec<_>, _>>();
    ids.map_err(|_| format!("{text:?} is not token ids separated by commas (1,2,3)"))
}

/// The shards of the `jsonl` files tokenized by `tokenizer` (and its chat template) into `dir`,
/// as `zeroflow tokenize` writes them.
fn tokenize_jsonl(
    tokenizer: &Tokenizer,
    chat: &ChatOptions,
    jsonl: &[std::path::PathBuf],
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>> {
    let shown = jsonl[0].display();
    let template = chat.template(tokenizer).map_err(|e| input(format!("--data {shown}: {e}")))?;
    let options = zeroflow_data::TokenizeOptions::new(dir.to_path_buf(), template.as_ref());
    let summary = zeroflow_data::tokenize_corpus(tokenizer, jsonl, &options, &|_| {})
        .map_err(|e| input(format!("--data {shown}: {e}")))?;
    Ok(summary.shards)
}

/// Nanoseconds since the epoch, to tell scratch directories apart.
fn utc_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
}

#[cfg(test)]
mod tests;
