//! GPT-2 ([`zeroflow_gpt`]) as a [`Model`](crate::Model) (its CPU model in f32 and its CUDA
//! model in bf16) and its shape as a [`Family`].
//!
//! The impls live here, not in `zeroflow-gpt`, so that the family crate does not depend on the
//! trainer (docs/DESIGN.md §2); each is the model's own methods under the trait's names.

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
use zeroflow_gpt::cuda::{CudaGpt, CudaGptOptions};
use zeroflow_gpt::{ActLayout, CpuGpt, GptConfig, GptError};
use zeroflow_nn::{AttentionKind, PlanOptions};

use crate::family::of_f32;
use crate::model::{cuda_memory_in_use, model_impl};
use crate::{Family, ModelSpec, TrainError};

model_impl!(CpuGpt, CpuDevice, CpuComm, f32, GptError);
model_impl!(CudaGpt, CudaDevice, NcclComm, bf16, GptError, memory_in_use: cuda_memory_in_use);

impl From<GptError> for TrainError {
    fn from(error: GptError) -> TrainError {
        TrainError::model(error)
    }
}

impl Family for GptConfig {
    type Cpu = CpuGpt;
    type Cuda = CudaGpt;

    fn spec(&self) -> ModelSpec {
        ModelSpec::Gpt2(*self)
    }

    fn family_name(&self) -> &'static str {
        "gpt2"
    }

    fn num_params(&self) -> usize {
        GptConfig::num_params(self)
    }

    fn n_layer(&self) -> usize {
        self.n_layer
    }

    fn n_head(&self) -> usize {
        self.n_head
    }

    fn hidden_size(&self) -> usize {
        self.d_model
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn context(&self) -> usize {
        self.context
    }

    fn flat_layout(&self, world_size: usize) -> Result<FlatLayout, TrainError> {
        zeroflow_gpt::flat_layout(self, world_size)
            .map_err(|e| TrainError::model(e).context("cannot lay out the model"))
    }

    fn tensors(&self, layout: &FlatLayout) -> Result<Vec<NamedTensor>, TrainError> {
        let tensors = zeroflow_gpt::hf_tensors(self, layout)?;
        Ok(tensors
            .into_iter()
            .map(|t| NamedTensor { name: t.name, shape: t.shape, flat: t.flat_range })
            .collect())
    }

    fn init<P: Float>(
        &self,
        layout: &FlatLayout,
        seed: u64,
        weights: &mut [P],
    ) -> Result<(), TrainError> {
        Ok(zeroflow_gpt::init_params_as(self, layout, seed, weights, of_f32)?)
    }

    fn cpu_activations(&self, batch: usize, seq: usize) -> usize {
        ActLayout::new(self, batch, seq, AttentionKind::Gemm).len
    }

    fn cuda_attention(&self, asked: Option<AttentionKind>) -> AttentionKind {
        CudaGptOptions::for_model(self, asked).attention
    }

    fn cpu_model(
        &self,
        device: &CpuDevice,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        packed: bool,
    ) -> Result<CpuGpt, TrainError> {
        let options = PlanOptions { packed, ..PlanOptions::default() };
        Ok(CpuGpt::with_options(device, self, layout, batch, seq, options)?)
    }

    fn cuda_model(
        &self,
        device: &CudaDevice,
        blas: Arc<Blas>,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        plan: PlanOptions,
    ) -> Result<CudaGpt, TrainError> {
        let options = cuda_options(plan);
        Ok(CudaGpt::with_options(device, blas, self, layout, batch, seq, options)?)
    }

    fn cuda_planned_activations(
        &self,
        layout: &FlatLayout,
        batch_seq: (usize, usize),
        plan: PlanOptions,
    ) -> Result<ActivationMemory, TrainError> {
        let options = cuda_options(plan);
        Ok(zeroflow_gpt::cuda::planned_memory(self, layout, batch_seq, options)?)
    }

    fn hf_config(&self) -> serde_json::Value {
        self.to_hf_config()
    }

    fn cuda_bench_model(
        &self,
        device: &CudaDevice,
        blas: Arc<Blas>,
        layout: &FlatLayout,
        (batch, seq): (usize, usize),
        plan: PlanOptions,
        fuse_gelu: bool,
    ) -> Result<CudaGpt, TrainError> {
        let options = CudaGptOptions {
            fuse_gelu,
            attention: plan.attention,
            activation_checkpointing: plan.activation_checkpointing,
            packed: plan.packed,
        };
        Ok(CudaGpt::with_options(device, blas, self, layout, batch, seq, options)?)
    }

    fn cuda_activation_memory(model: &CudaGpt) -> ActivationMemory {
        model.activation_memory()
    }

    fn cuda_profile(
        model: &mut CudaGpt,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, TrainError> {
        Ok(model.profile(params, grads)?)
    }
}

/// The CUDA model's options of a family-neutral [`PlanOptions`].
fn cuda_options(plan: PlanOptions) -> CudaGptOptions {
    CudaGptOptions {
        attention: plan.attention,
        activation_checkpointing: plan.activation_checkpointing,
        packed: plan.packed,
        ..CudaGptOptions::default()
    }
}
