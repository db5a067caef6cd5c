//! Inference on an NVIDIA GPU in bf16: `zeroflow eval --device cuda` runs every window through
//! the family's CUDA training model's forward and mean loss; `zeroflow generate --device cuda`
//! through [`CudaDecoder`], the family's key/value-cached decoder ([`CudaGptDecoder`],
//! [`CudaLlamaDecoder`]). [`CudaPrefixDecoder`] recomputes each sequence's whole prefix every
//! step through the training forward instead (a step costs a forward of `batch × capacity`
//! tokens): the reference the cached decoders are tested against on the GPU.
//!
//! The prefix decoder's batch is right-padded: sequence `b` occupies positions `0..len_b` of row `b` of a
//! `[batch, capacity]` input, the rest token 0. Causal attention keeps the padding out of every
//! real position, so the logits of position `len_b − 1` are those of the sequence alone.

use std::collections::HashMap;
use std::sync::Arc;

use zeroflow_core::bf16;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_gpt::{CudaGpt, CudaGptDecoder, CudaGptStep};
use zeroflow_llama::{CudaLlama, CudaLlamaDecoder, CudaLlamaStep};
use zeroflow_nn::cuda::cached::CachedDecoder;
use zeroflow_nn::infer::{Decoder, EvalResult, EvalStream, eval_windows};

use super::{HostModel, Params, Weights};
use crate::Model;
use crate::error::{Result, TrainError, input};

/// A family's CUDA training model for one (batch, seq).
enum FamilyModel {
    Gpt(Box<CudaGpt>),
    Llama(Box<CudaLlama>),
}

impl FamilyModel {
    /// The model for `shape` (batch, seq), of packed rows where `packed`.
    fn new(
        device: &CudaDevice,
        blas: &Arc<Blas>,
        weights: &Weights,
        shape: (usize, usize),
        packed: bool,
    ) -> Result<Self> {
        let blas = Arc::clone(blas);
        Ok(match weights {
            Weights::Gpt { config, layout, .. } => {
                let options = zeroflow_gpt::cuda::CudaGptOptions::for_model(config, None);
                let options = zeroflow_gpt::cuda::CudaGptOptions { packed, ..options };
                let (batch, seq) = shape;
                let model =
                    CudaGpt::with_options(device, blas, config, layout, batch, seq, options);
                FamilyModel::Gpt(Box::new(model.map_err(TrainError::model)?))
            }
            Weights::Llama { config, layout, .. } => {
                let options = zeroflow_llama::CudaLlamaOptions::for_model(config, None);
                let options = zeroflow_llama::CudaLlamaOptions { packed, ..options };
                let model = CudaLlama::with_options(device, blas, config, layout, shape, options);
                FamilyModel::Llama(Box::new(model.map_err(TrainError::model)?))
            }
        })
    }

    /// The mean loss of `inputs` against `targets` (`[batch, seq]` each), packed where
    /// `positions` are given (a model built packed).
    fn loss(
        &mut self,
        params: &CudaBuffer<bf16>,
        inputs: &[u32],
        targets: &[u32],
        positions: Option<&[u32]>,
    ) -> Result<f32> {
        match self {
            FamilyModel::Gpt(m) => mean_loss(m.as_mut(), params, inputs, targets, positions),
            FamilyModel::Llama(m) => mean_loss(m.as_mut(), params, inputs, targets, positions),
        }
    }

    /// The logits `[batch, seq, width]` of `inputs` (the width the vocabulary or its padding).
    fn logits(&mut self, params: &CudaBuffer<bf16>, inputs: &[u32]) -> Result<Vec<f32>> {
        let targets = vec![0; inputs.len()];
        self.loss(params, inputs, &targets, None)?;
        match self {
            FamilyModel::Gpt(m) => m.logits().map_err(TrainError::model),
            FamilyModel::Llama(m) => m.logits().map_err(TrainError::model),
        }
    }
}

/// `model`'s mean loss of one batch (its upload, forward and loss), packed where `positions`
/// are given.
fn mean_loss<M: Model<P = bf16, Device = CudaDevice>>(
    model: &mut M,
    params: &CudaBuffer<bf16>,
    inputs: &[u32],
    targets: &[u32],
    positions: Option<&[u32]>,
) -> Result<f32> {
    let run = |model: &mut M| {
        model.set_batch(inputs, targets, positions)?;
        model.forward(params)?;
        model.loss()
    };
    run(model).map_err(TrainError::model)
}

/// The model's weights in bf16 on the GPU, with its cuBLASLt handle.
struct OnDevice<'a> {
    device: CudaDevice,
    blas: Arc<Blas>,
    weights: &'a Weights,
    params: CudaBuffer<bf16>,
}

impl<'a> OnDevice<'a> {
    fn new(host: &'a HostModel, ordinal: usize) -> Result<Self> {
        let device = CudaDevice::new(ordinal)?;
        let blas = Arc::new(Blas::new(&device)?);
        let params = host.params().upload(&device)?;
        Ok(OnDevice { device, blas, weights: &host.weights, params })
    }
}

impl HostModel {
    /// [`HostModel::eval`] on GPU `ordinal` in bf16: every window through the family's CUDA
    /// training forward and mean loss (a model per window length: the full windows share one).
    pub fn eval_cuda(
        &self,
        stream: EvalStream<'_>,
        window: usize,
        ordinal: usize,
    ) -> Result<EvalResult> {
        let gpu = OnDevice::new(self, ordinal)?;
        let packed = stream.positions.is_some();
        let mut models: HashMap<usize, FamilyModel> = HashMap::new();
        eval_windows(stream, window, |inputs, targets, positions| {
            let model = match models.entry(inputs.len()) {
                std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::hash_map::Entry::Vacant(entry) => {
                    let (device, blas, shape) = (&gpu.device, &gpu.blas, (1, inputs.len()));
                    entry.insert(FamilyModel::new(device, blas, gpu.weights, shape, packed)?)
                }
            };
            Ok(f64::from(model.loss(&gpu.params, inputs, targets, positions)?))
        })
    }

    /// The padded flat parameters.
    pub(super) fn params(&self) -> &Params {
        match &self.weights {
            Weights::Gpt { params, .. } | Weights::Llama { params, .. } => params,
        }
    }

    /// The family's key/value-cached decoder on GPU `ordinal` ([`CudaDecoder`]).
    pub fn cuda_decoder(&self, ordinal: usize) -> Result<CudaDecoder> {
        let device = CudaDevice::new(ordinal)?;
        let blas = Arc::new(Blas::new(&device)?);
        let weights = self.params().upload(&device)?;
        Ok(match &self.weights {
            Weights::Gpt { config, layout, .. } => CudaDecoder::Gpt(
                CudaGptStep::on_device(&device, blas, config, layout, weights)
                    .map(CachedDecoder::new)
                    .map_err(TrainError::model)?,
            ),
            Weights::Llama { config, layout, .. } => CudaDecoder::Llama(
                CudaLlamaStep::on_device(&device, blas, config, layout, weights)
                    .map(CachedDecoder::new)
                    .map_err(TrainError::model)?,
            ),
        })
    }

    /// [`CudaPrefixDecoder`] on GPU `ordinal`, for either family.
    pub fn cuda_prefix_decoder(&self, ordinal: usize) -> Result<CudaPrefixDecoder<'_>> {
        let gpu = OnDevice::new(self, ordinal)?;
        let (vocab, max_positions) = (self.vocab_size(), self.max_positions());
        Ok(CudaPrefixDecoder {
            gpu,
            model: None,
            vocab,
            max_positions,
            sequences: Vec::new(),
            capacity: 0,
        })
    }

    /// The longest sequence the decoder takes: the context (for the Llama family, the sliding
    /// window where shorter, as its CPU decoder).
    fn max_positions(&self) -> usize {
        match &self.weights {
            Weights::Gpt { config, .. } => config.context,
            Weights::Llama { config, .. } => {
                let max = config.max_position_embeddings;
                config.sliding_window.map_or(max, |window| window.min(max))
            }
        }
    }
}

/// A [`Decoder`] on the GPU that runs each step as a training forward over every sequence's
/// whole prefix, right-padded to the batch's capacity (see the module documentation).
pub struct CudaPrefixDecoder<'a> {
    gpu: OnDevice<'a>,
    model: Option<FamilyModel>,
    vocab: usize,
    max_positions: usize,
    sequences: Vec<Vec<u32>>,
    capacity: usize,
}

impl std::fmt::Debug for CudaPrefixDecoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (batch, capacity) = (self.sequences.len(), self.capacity);
        write!(f, "CudaPrefixDecoder(batch {batch}, capacity {capacity})")
    }
}

impl CudaPrefixDecoder<'_> {
    /// The logits `[seqs.len(), vocab]` of the last position of each sequence of `seqs`.
    fn step(&mut self, seqs: &[usize]) -> Result<Vec<f32>> {
        let (batch, capacity) = (self.sequences.len(), self.capacity);
        let mut inputs = vec![0u32; batch * capacity];
        for (row, sequence) in inputs.chunks_mut(capacity).zip(&self.sequences) {
            row[..sequence.len()].copy_from_slice(sequence);
        }
        let model = self.model.as_mut().expect("prefill builds the model");
        let logits = model.logits(&self.gpu.params, &inputs)?;
        let width = logits.len() / (batch * capacity);
        Ok(seqs
            .iter()
            .flat_map(|&seq| {
                let last = seq * capacity + self.sequences[seq].len() - 1;
                logits[last * width..][..self.vocab].iter().copied()
            })
            .collect())
    }
}

impl Decoder for CudaPrefixDecoder<'_> {
    type Float = f32;
    type Error = TrainError;

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn prefill(&mut self, prompts: &[&[u32]], capacity: usize) -> Result<Vec<f32>> {
        let capacity = capacity.min(self.max_positions);
        if let Some(b) = prompts.iter().position(|p| p.is_empty() || p.len() > capacity) {
            let len = prompts[b].len();
            return Err(input(format!(
                "prompt {b} has {len} tokens; the batch takes 1 to {capacity}"
            )));
        }
        let shape = (prompts.len(), capacity);
        self.model = Some(FamilyModel::new(
            &self.gpu.device,
            &self.gpu.blas,
            self.gpu.weights,
            shape,
            false,
        )?);
        self.sequences = prompts.iter().map(|p| p.to_vec()).collect();
        self.capacity = capacity;
        self.step(&(0..prompts.len()).collect::<Vec<_>>())
    }

    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<f32>> {
        let full = |&(seq, _): &(usize, u32)| {
            self.sequences.get(seq).is_none_or(|s| s.len() == self.capacity)
        };
        if let Some(&(seq, _)) = next.iter().find(|n| full(n)) {
            let capacity = self.capacity;
            return Err(input(format!("sequence {seq} is not in the batch, or at its {capacity}")));
        }
        next.iter().for_each(|&(seq, token)| self.sequences[seq].push(token));
        self.step(&next.iter().map(|&(seq, _)| seq).collect::<Vec<_>>())
    }

    /// The kept prefix and `tokens` as a new prompt: a prefill of the whole sequence.
    fn extend(&mut self, keep: usize, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        let held = match self.sequences.as_slice() {
            [one] => one.as_slice(),
            _ => &[],
        };
        if tokens.is_empty() || keep > held.len() {
            let n = (tokens.len(), held.len());
            return Err(input(format!("{} tokens after {keep} of a sequence of {}", n.0, n.1)));
        }
        let sequence = [&held[..keep], tokens].concat();
        self.prefill(&[&sequence], capacity)
    }
}

/// The decoder `--device cuda` runs: the family's key/value-cached GPU decoder.
#[derive(Debug)]
pub enum CudaDecoder {
    Gpt(CudaGptDecoder),
    Llama(CudaLlamaDecoder),
}

impl Decoder for CudaDecoder {
    type Float = f32;
    type Error = TrainError;

    fn vocab_size(&self) -> usize {
        match self {
            CudaDecoder::Gpt(d) => d.vocab_size(),
            CudaDecoder::Llama(d) => d.vocab_size(),
        }
    }

    fn max_positions(&self) -> usize {
        match self {
            CudaDecoder::Gpt(d) => d.max_positions(),
            CudaDecoder::Llama(d) => d.max_positions(),
        }
    }

    fn prefill(&mut self, prompts: &[&[u32]], capacity: usize) -> Result<Vec<f32>> {
        match self {
            CudaDecoder::Gpt(d) => d.prefill(prompts, capacity).map_err(TrainError::model),
            CudaDecoder::Llama(d) => d.prefill(prompts, capacity).map_err(TrainError::model),
        }
    }

    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<f32>> {
        match self {
            CudaDecoder::Gpt(d) => d.decode(next).map_err(TrainError::model),
            CudaDecoder::Llama(d) => d.decode(next).map_err(TrainError::model),
        }
    }

    fn extend(&mut self, keep: usize, tokens: &[u32], capacity: usize) -> Result<Vec<f32>> {
        match self {
            CudaDecoder::Gpt(d) => d.extend(keep, tokens, capacity).map_err(TrainError::model),
            CudaDecoder::Llama(d) => d.extend(keep, tokens, capacity).map_err(TrainError::model),
        }
    }
}
