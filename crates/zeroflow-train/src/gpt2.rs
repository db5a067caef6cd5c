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

/// `impl Model for $model`, each method the model's own of the same name.
macro_rules! gpt2_model {
    ($model:ty, $device:ty, $comm:ty, $element:ty $(, memory_in_use: $memory:expr)?) => {
        impl Model for $model {
            type Device = $device;
            type Comm = $comm;
            type P = $element;
            type Error = GptError;

            $(
                fn memory_in_use(device: &$device) -> Option<usize> {
                    $memory(device).ok()
                }
            )?

            fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError> {
                <$model>::set_batch(self, inputs, targets)
            }

            fn forward(&mut self, params: &Buffer<Self>) -> Result<(), GptError> {
                <$model>::forward(self, params)
            }

            fn loss(&mut self) -> Result<f32, GptError> {
                <$model>::loss(self)
            }

            fn backward(
                &mut self,
                params: &Buffer<Self>,
                grads: &Buffer<Self>,
                loss_scale: f64,
                on_ready: &mut dyn FnMut(&GradsReady),
            ) -> Result<(), GptError> {
                <$model>::backward(self, params, grads, loss_scale, on_ready)
            }
        }
    };
}

gpt2_model!(CpuGpt, CpuDevice, CpuComm, f32);
gpt2_model!(
    CudaGpt,
    CudaDevice,
    NcclComm,
    zeroflow_core::bf16,
    memory_in_use: zeroflow_gpt::cuda::device_memory_in_use
);
