//! What the trainer needs of a model family's shape ([`Family`]), and the one place that maps a
//! checkpoint's [`ModelSpec`] to its family ([`with_family!`](crate::with_family)): adding a
//! family is one arm there and one file of impls (docs/DESIGN.md §2, "Adding a family").

use std::sync::Arc;
use std::time::Duration;

use zeroflow_core::bf16;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_nn::cuda::ActivationMemory;

use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::nccl::NcclComm;
use zeroflow_device::{CpuDevice, CudaDevice};
use zeroflow_engine::checkpoint::NamedTensor;
use zeroflow_nn::{AttentionKind, PlanOptions};

use crate::{Model, ModelSpec, TrainError};

/// A model family's shape, as the trainer uses it: its size, its flat layout and checkpoint
/// tensors, its initial weights, and its models on each device kind.
pub trait Family: Clone + std::fmt::Debug + serde::Serialize + Send + 'static {
    /// The family's model on the CPU device (f32).
    type Cpu: Model<Device = CpuDevice, Comm = CpuComm>;
    /// The family's model on a GPU.
    type Cuda: Model<Device = CudaDevice, Comm = NcclComm, P = bf16>;

    /// This shape as a checkpoint records it.
    fn spec(&self) -> ModelSpec;
    /// The family, as the checkpoint's `family` tag spells it.
    fn family_name(&self) -> &'static str;
    fn num_params(&self) -> usize;
    fn n_layer(&self) -> usize;
    /// Attention heads (the query heads, where the family groups key/value heads).
    fn n_head(&self) -> usize;
    /// The width of the residual stream (fills an `"auto"` `reduce_bucket_size`).
    fn hidden_size(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// The longest sequence the model takes.
    fn context(&self) -> usize;
    /// The sequence length `train` and `bench step` use unless `--seq` says: GPT-2's context,
    /// the Llama family's 2048 (or its context where shorter).
    fn default_seq(&self) -> usize {
        self.context()
    }
    /// An input error unless the model trains on sequences of `seq` tokens (at most its
    /// context, checked by the caller; the Llama family's sliding window).
    fn check_seq(&self, _seq: usize) -> Result<(), TrainError> {
        Ok(())
    }
    /// The flat layout of the parameters, padded for `world_size` ranks.
    fn flat_layout(&self, world_size: usize) -> Result<FlatLayout, TrainError>;
    /// The checkpoint's tensors: Hugging Face names and shapes over the flat buffer.
    fn tensors(&self, layout: &FlatLayout) -> Result<Vec<NamedTensor>, TrainError>;
    /// Fresh weights from `seed` into `weights` (the padded flat buffer), drawn as f32 and
    /// rounded to `P` where it is narrower (no f32 copy of them beside the buffer).
    fn init<P: Float>(
        &self,
        layout: &FlatLayout,
        seed: u64,
        weights: &mut [P],
    ) -> Result<(), TrainError>;
    /// Elements (f32) of the CPU model's activations for `batch` sequences of `seq` tokens.
    fn cpu_activations(&self, batch: usize, seq: usize) -> usize;
    /// The attention the GPU model runs: `asked`, else the family's best for this shape.
    fn cuda_attention(&self, asked: Option<AttentionKind>) -> AttentionKind;
    /// The CPU model for micro-batches of `batch` sequences of `seq` tokens, packed (its
    /// batches carrying each token's position in its document) where `packed` says.
    fn cpu_model(
        &self,
        device: &CpuDevice,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        packed: bool,
    ) -> Result<Self::Cpu, TrainError>;
    /// The GPU model, sharing `blas` with the device's other users, built with `options`
    /// (attention, activation checkpointing).
    fn cuda_model(
        &self,
        device: &CudaDevice,
        blas: Arc<Blas>,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<Self::Cuda, TrainError>;
    /// The Hugging Face `config.json` of this shape (what an export writes: [`crate::export`]).
    fn hf_config(&self) -> serde_json::Value;
    /// [`Family::cuda_model`] as `bench gpt` builds it: GPT-2's GELU runs as its own kernels
    /// unless `fuse_gelu` (a family without that fusion ignores it).
    #[allow(clippy::too_many_arguments)]
    fn cuda_bench_model(
        &self,
        device: &CudaDevice,
        blas: Arc<Blas>,
        layout: &FlatLayout,
        (batch, seq): (usize, usize),
        options: PlanOptions,
        _fuse_gelu: bool,
    ) -> Result<Self::Cuda, TrainError> {
        self.cuda_model(device, blas, layout, batch, seq, options)
    }
    /// What [`Family::cuda_model`] of these arguments will hold, computed without a GPU.
    fn cuda_planned_activations(
        &self,
        layout: &FlatLayout,
        batch_seq: (usize, usize),
        options: PlanOptions,
    ) -> Result<ActivationMemory, TrainError>;
    /// The activations, their gradients and the scratch the GPU model holds.
    fn cuda_activation_memory(model: &Self::Cuda) -> ActivationMemory;
    /// One more forward and backward of the GPU model's last batch, waiting after each
    /// operation: the time of each kind, in first-run order (`bench gpt --profile`).
    fn cuda_profile(
        model: &mut Self::Cuda,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, TrainError>;
}

/// `$body` with `$family` bound to the [`Family`] that the [`ModelSpec`] `$spec` holds: the one
/// `match` over the families the trainer trains (a new family is a new arm).
#[macro_export]
macro_rules! with_family {
    ($spec:expr, $family:ident => $body:expr) => {
        match $spec {
            $crate::ModelSpec::Gpt2($family) => $body,
            $crate::ModelSpec::Llama($family) => $body,
        }
    };
}

impl ModelSpec {
    pub fn num_params(&self) -> usize {
        with_family!(self, family => family.num_params())
    }

    pub fn n_layer(&self) -> usize {
        with_family!(self, family => family.n_layer())
    }

    pub fn n_head(&self) -> usize {
        with_family!(self, family => family.n_head())
    }

    /// The family as the checkpoint's `family` tag spells it.
    pub fn family(&self) -> &'static str {
        with_family!(self, family => family.family_name())
    }

    pub fn hidden_size(&self) -> usize {
        with_family!(self, family => family.hidden_size())
    }

    pub fn vocab_size(&self) -> usize {
        with_family!(self, family => family.vocab_size())
    }

    pub fn context(&self) -> usize {
        with_family!(self, family => family.context())
    }

    pub fn default_seq(&self) -> usize {
        with_family!(self, family => family.default_seq())
    }

    pub fn flat_layout(&self, world_size: usize) -> Result<FlatLayout, TrainError> {
        with_family!(self, family => family.flat_layout(world_size))
    }

    pub fn tensors(&self, layout: &FlatLayout) -> Result<Vec<NamedTensor>, TrainError> {
        with_family!(self, family => family.tensors(layout))
    }

    pub fn cpu_activations(&self, batch: usize, seq: usize) -> usize {
        with_family!(self, family => family.cpu_activations(batch, seq))
    }

    pub fn cuda_attention(&self, asked: Option<AttentionKind>) -> AttentionKind {
        with_family!(self, family => family.cuda_attention(asked))
    }

    /// The shape alone, as `summary.json` records it (without the family tag).
    pub fn shape_json(&self) -> serde_json::Value {
        with_family!(self, family => serde_json::to_value(family).expect("serialisable"))
    }
}

/// A drawn initial value (f64) as `P`: rounded to f32 first, so that narrower weights are the
/// f32 ones rounded, whatever type the run holds them in.
pub(crate) fn of_f32<P: Float>(x: f64) -> P {
    P::from_f32(x as f32)
}
