//! GPT-2 ([`zeroflow_gpt`]) as a [`Model`]: its CPU model in f32 and its CUDA model in bf16.
//!
//! The impls live here, not in `zeroflow-gpt`, so that the family crate does not depend on the
//! trainer (docs/DESIGN.md §2); each is the model's own methods under the trait's names.

use zeroflow_device::cpu::CpuComm;
use zeroflow_device::cuda::nccl::NcclComm;
use zeroflow_device::{CpuDevice, CudaDevice};
use zeroflow_gpt::cuda::CudaGpt;
use zeroflow_gpt::{CpuGpt, GptError};
use zeroflow_nn::GradsReady;

use crate::model::{Buffer, Model};

impl Model for CpuGpt {
    type Device = CpuDevice;
    type Comm = CpuComm;
    type P = f32;
    type Error = GptError;

    fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError> {
        CpuGpt::set_batch(self, inputs, targets)
    }

    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), GptError> {
        CpuGpt::forward(self, params)
    }

    fn loss(&mut self) -> Result<f32, GptError> {
        CpuGpt::loss(self)
    }

    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), GptError> {
        CpuGpt::backward(self, params, grads, loss_scale, on_ready)
    }
}

impl Model for CudaGpt {
    type Device = CudaDevice;
    type Comm = NcclComm;
    type P = zeroflow_core::bf16;
    type Error = GptError;

    fn memory_in_use(device: &CudaDevice) -> Option<usize> {
        zeroflow_gpt::cuda::device_memory_in_use(device).ok()
    }

    fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError> {
        CudaGpt::set_batch(self, inputs, targets)
    }

    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), GptError> {
        CudaGpt::forward(self, params)
    }

    fn loss(&mut self) -> Result<f32, GptError> {
        CudaGpt::loss(self)
    }

    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), GptError> {
        CudaGpt::backward(self, params, grads, loss_scale, on_ready)
    }
}
