//! What the training loop needs of a model on a device, and how each device kind is opened.

use std::time::Duration;

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Float, bf16};
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::cuda::nccl::NcclComm;
use zeroflow_device::{Comm, CpuDevice, CudaDevice, Device};
use zeroflow_engine::DeviceAdamW;
use zeroflow_gpt::cuda::CudaGpt;
use zeroflow_gpt::{CpuGpt, GptConfig, GptError, GradsReady};

/// A model the trainer drives through the engine: the CPU model or the CUDA one.
pub trait Model: Sized {
    type Device: DeviceAdamW;
    type Comm: Comm<Device = Self::Device>;
    /// The element type of the weights and gradients on the device.
    type P: Float;

    /// Queues the upload of a micro-batch.
    fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError>;

    /// Queues forward.
    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), GptError>;

    /// Waits for the last forward and returns its mean loss.
    fn loss(&mut self) -> Result<f32, GptError>;

    /// Queues backward, adding the gradients into `grads` and telling `on_ready` as each group's
    /// gradients are complete.
    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), GptError>;
}

/// A model's flat weight or gradient buffer.
pub type Buffer<M> = <<M as Model>::Device as Device>::Buffer<<M as Model>::P>;

/// A device, this rank's communicator and the model on that device.
pub struct Opened<M: Model> {
    pub device: M::Device,
    pub comm: M::Comm,
    pub model: M,
}

impl Model for CpuGpt {
    type Device = CpuDevice;
    type Comm = CpuComm;
    type P = f32;

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

/// How to open a device kind: the model's shape, the micro-batch (sequences) and the flat layout.
pub type Open<M> = fn(&GptConfig, usize, &FlatLayout) -> anyhow::Result<Opened<M>>;

/// The CPU device, a communicator of one, and the model in f32.
pub fn open_cpu(
    model: &GptConfig,
    micro_batch: usize,
    layout: &FlatLayout,
) -> anyhow::Result<Opened<CpuGpt>> {
    let device = CpuDevice::new()?;
    let comm = CpuComm::group(std::slice::from_ref(&device), Duration::from_secs(60))
        .pop()
        .expect("a group of one");
    let model = CpuGpt::new(&device, model, layout, micro_batch, model.context)?;
    Ok(Opened { device, comm, model })
}

impl Model for CudaGpt {
    type Device = CudaDevice;
    type Comm = NcclComm;
    type P = bf16;

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

/// GPU 0, an NCCL communicator of one, and the model in bf16.
pub fn open_cuda(
    model: &GptConfig,
    micro_batch: usize,
    layout: &FlatLayout,
) -> anyhow::Result<Opened<CudaGpt>> {
    let device = CudaDevice::new(0)?;
    let comm = NcclComm::group(std::slice::from_ref(&device))?.pop().expect("a group of one");
    let model = CudaGpt::new(&device, model, layout, micro_batch, model.context)?;
    tracing::info!(
        "GPU model: {:.2} GiB of activations and scratch",
        model.activation_bytes() as f64 / f64::from(1u32 << 30)
    );
    Ok(Opened { device, comm, model })
}
