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
    type P: Float;
    /// What the model's calls fail with.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Queues the upload of a micro-batch.
    fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), Self::Error>;

    /// Queues forward.
    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), Self::Error>;

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
