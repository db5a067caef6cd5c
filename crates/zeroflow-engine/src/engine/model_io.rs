//! What the model gets for one forward and backward ([`ModelIo`]), and how its forward opens the
//! weights where the last step is still being written ([`Opener`], DESIGN.md §5).

use zeroflow_core::Float;
use zeroflow_device::Device;

/// What the model gets for one forward and backward.
#[derive(Debug)]
pub struct ModelIo<'a, D: Device, P: Float> {
    /// The flat weights (read them on the compute stream, each range once [`ModelIo::open`]
    /// has opened it).
    pub params: &'a D::Buffer<P>,
    /// The flat gradients: backward must ADD into them on the compute stream.
    pub grads: &'a D::Buffer<P>,
    /// The factor to multiply the loss by before backward (fp16 loss scaling; 1 otherwise).
    pub loss_scale: f32,
    /// Opens the weights as the forward reaches them (see [`ModelIo::open`]).
    pub weights: Opener<'a>,
}

impl<D: Device, P: Float> ModelIo<'_, D, P> {
    /// Opens the flat weights below `end` to the kernels queued next on the compute stream: call
    /// it before queuing any kernel that reads weights below `end`, with `end` growing through
    /// the forward, and with `usize::MAX` once the forward is queued, before the backward. Where
    /// the last optimizer step is still being written (`StreamOptions::overlap_forward`), the
    /// CPU steps the weights up to `end` now and the compute stream waits for their upload, so
    /// the forward runs while the CPU steps the rest; otherwise it does nothing.
    pub fn open(&mut self, end: usize) {
        self.weights.open(end);
    }
}

/// The engine's side of [`ModelIo::open`].
pub struct Opener<'a> {
    pub(super) open: Option<&'a mut dyn FnMut(usize)>,
}

impl<'a> Opener<'a> {
    /// An opener that has nothing to open (the weights are current).
    pub fn current() -> Self {
        Opener { open: None }
    }

    /// [`ModelIo::open`].
    pub fn open(&mut self, end: usize) {
        if let Some(open) = &mut self.open {
            open(end);
        }
    }
}

impl std::fmt::Debug for Opener<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener").field("pending", &self.open.is_some()).finish()
    }
}
