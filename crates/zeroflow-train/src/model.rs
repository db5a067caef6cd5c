//! What the training loop needs of a model on a device ([`Model`]), whatever its family, and what
//! opening one gives the trainer ([`Opened`]).

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device};
use zeroflow_engine::DeviceAdamW;
use zeroflow_nn::GradsReady;

use crate::dist::Group;

/// A model the trainer drives through the engine, on one device kind: a family's CPU model or
/// its CUDA one. Its errors are its own ([`Model::Error`]), and reach the trainer's caller as
/// themselves.
pub trait Model: Sized {
    type Device: DeviceAdamW;
    type Comm: Comm<Device = Self::Device>;
    /// The element type of the weights and gradients on the device.
    type P: Float + zeroflow_engine::checkpoint::Stored;
    /// What the model's calls fail with.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Queues the upload of a micro-batch, with each token's position in its document where the
    /// rows are packed (the model must have been built for packing; a CUDA model refuses them).
    fn set_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: Option<&[u32]>,
    ) -> Result<(), Self::Error>;

    /// Queues forward.
    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), Self::Error>;

    /// Queues forward, telling `open(end)` before queuing the first operation that reads flat
    /// weights below `end` (growing), and `open(usize::MAX)` once the forward is queued: the
    /// engine's `ModelIo::open`, which lets the forward start while the last step's weights are
    /// still being uploaded. By default everything is opened first, then [`Model::forward`] runs.
    fn forward_opening(
        &mut self,
        params: &Buffer<Self>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), Self::Error> {
        open(usize::MAX);
        self.forward(params)
    }

    /// Waits for the last forward and returns its mean loss.
    fn loss(&mut self) -> Result<f32, Self::Error>;

    /// The device memory in use (all of it, the driver's context included), where the device
    /// can say.
    fn memory_in_use(_device: &Self::Device) -> Option<usize> {
        None
    }

    /// Queues backward, adding the gradients into `grads` and telling `on_ready` as each group's
    /// gradients are complete.
    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), Self::Error>;
}

/// `impl Model for $model` for a family's model whose own methods of the trait's names fail with
/// `$error`: each trait method is the model's own (the families' CPU and CUDA models alike). A
/// CUDA model names how it reports the memory in use (`memory_in_use: cuda_memory_in_use`).
macro_rules! model_impl {
    ($model:ty, $device:ty, $comm:ty, $element:ty, $error:ty $(, memory_in_use: $memory:path)?) => {
        impl $crate::model::Model for $model {
            type Device = $device;
            type Comm = $comm;
            type P = $element;
            type Error = $error;

            $(
                fn memory_in_use(device: &$device) -> Option<usize> {
                    $memory(device)
                }
            )?

            fn set_batch(
                &mut self,
                inputs: &[u32],
                targets: &[u32],
                positions: Option<&[u32]>,
            ) -> Result<(), $error> {
                match positions {
                    None => <$model>::set_batch(self, inputs, targets),
                    Some(positions) => {
                        <$model>::set_packed_batch(self, inputs, targets, positions)
                    }
                }
            }

            fn forward(&mut self, params: &$crate::model::Buffer<Self>) -> Result<(), $error> {
                <$model>::forward(self, params)
            }

            fn forward_opening(
                &mut self,
                params: &$crate::model::Buffer<Self>,
                open: &mut dyn FnMut(usize),
            ) -> Result<(), $error> {
                <$model>::forward_opening(self, params, open)
            }

            fn loss(&mut self) -> Result<f32, $error> {
                <$model>::loss(self)
            }

            fn backward(
                &mut self,
                params: &$crate::model::Buffer<Self>,
                grads: &$crate::model::Buffer<Self>,
                loss_scale: f64,
                on_ready: &mut dyn FnMut(&zeroflow_nn::GradsReady),
            ) -> Result<(), $error> {
                <$model>::backward(self, params, grads, loss_scale, on_ready)
            }
        }
    };
}
pub(crate) use model_impl;

/// Bytes of the GPU's memory in use now, by every process and context (`cuMemGetInfo`): a CUDA
/// model allocates everything up front, so after a step this is the peak.
pub fn cuda_memory_in_use(device: &zeroflow_device::CudaDevice) -> Option<usize> {
    device.memory_info().ok().map(|(free, total)| total - free)
}

/// A model's flat weight or gradient buffer.
pub type Buffer<M> = <<M as Model>::Device as Device>::Buffer<<M as Model>::P>;

/// A device, this rank's communicator, the model on that device, and the side channel to the
/// other ranks' processes.
pub struct Opened<M: Model> {
    pub device: M::Device,
    pub comm: M::Comm,
    pub model: M,
    pub group: Group,
}

impl<M: Model> std::fmt::Debug for Opened<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").field("group", &self.group).finish_non_exhaustive()
    }
}
