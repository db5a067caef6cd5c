//! The device path: the fp32 optimizer state and the gradient accumulator of this rank's
//! partition in device memory, stepped by the device's AdamW on the compute stream.
//!
//! During backward the comm stream adds each reduced bucket into the accumulator. At the step
//! the comm stream computes the norm over it, `accumulated` (comm → compute) orders the AdamW
//! after the last addition, the AdamW writes the weights of the partition, and the gather
//! follows. `optimizer_done` (compute → comm) orders the zeroing of the accumulator on the comm
//! stream after the AdamW read it.

use zeroflow_core::Float;
use zeroflow_device::{Comm, StreamKind};
use zeroflow_optim::{AdamWStep, NoDecay};

use super::shared::{Shared, overwrite};
use super::state::PathState;
use crate::EngineError;
use crate::device_adamw::{DeviceAdamState, DeviceAdamW};

/// The device path's buffers and events.
pub(super) struct DeviceUpdate<D: DeviceAdamW> {
    pub(super) state: DeviceAdamState<D>,
    /// The reduced gradients of the partition, summed over the window's micro-steps.
    pub(super) grad_acc: D::Buffer<f32>,
    /// Comm → compute: the accumulator is complete.
    accumulated: D::Event,
    /// Compute → comm: the AdamW has read the accumulator.
    optimizer_done: D::Event,
}

impl<D: DeviceAdamW> DeviceUpdate<D> {
    /// The state of a partition whose fp32 master weights are `master`, its elements
    /// `no_decay` without weight decay.
    pub fn new(device: &D, master: &[f32], no_decay: NoDecay) -> Result<Self, EngineError> {
        let len = master.len();
        Ok(DeviceUpdate {
            state: DeviceAdamState {
                master: device.upload(master)?,
                exp_avg: device.alloc(len)?,
                exp_avg_sq: device.alloc(len)?,
                no_decay,
            },
            grad_acc: device.alloc(len)?,
            accumulated: device.new_event()?,
            optimizer_done: device.new_event()?,
        })
    }

    /// Σ g² over the accumulator of all ranks.
    pub fn sum_squares<C: Comm<Device = D>, P: Float>(
        &self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<f64, EngineError> {
        shared.comm_sum_squares(&self.grad_acc, 0..shared.owned.len())
    }

    /// One AdamW step over the partition on the compute stream, then the gather.
    pub fn update<C: Comm<Device = D>, P: Float>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let device = &shared.device;
        let (compute, comm_stream) =
            (device.stream(StreamKind::Compute), device.stream(StreamKind::Comm));
        // The accumulator is complete once the comm stream is past it (and the norm).
        device.record(&mut self.accumulated, comm_stream)?;
        device.wait_event(compute, &self.accumulated)?;
        let (out, at, len) = (&shared.params, shared.owned.start, shared.owned.len());
        self.state.step(device, compute, step, 0..len, &self.grad_acc, out, at)?;
        shared.gather_from(StreamKind::Compute)
    }

    /// Clears the accumulator for the next window, after everything that reads it: the comm
    /// stream adds into it and computed the norm; the optimizer read it on the compute stream.
    pub fn zero_accumulator(&mut self, device: &D, len: usize) -> Result<(), EngineError> {
        let comm_stream = device.stream(StreamKind::Comm);
        let compute = device.stream(StreamKind::Compute);
        device.record(&mut self.optimizer_done, compute)?;
        device.wait_event(comm_stream, &self.optimizer_done)?;
        device.fill(comm_stream, &self.grad_acc, 0..len, 0.0)?;
        Ok(())
    }

    /// The master weights, downloaded.
    pub fn master(&self, device: &D) -> Result<Vec<f32>, EngineError> {
        Ok(device.download(&self.state.master)?)
    }

    /// The state, downloaded.
    pub fn state(&self, device: &D) -> Result<PathState, EngineError> {
        Ok(PathState {
            master: device.download(&self.state.master)?,
            exp_avg: device.download(&self.state.exp_avg)?,
            exp_avg_sq: device.download(&self.state.exp_avg_sq)?,
            upload_pending: false,
        })
    }

    /// Takes a checkpoint's state, with an empty accumulator.
    pub fn restore(&mut self, device: &D, state: [Vec<f32>; 3]) -> Result<(), EngineError> {
        let [master, exp_avg, exp_avg_sq] = state;
        overwrite(device, &self.state.master, &master)?;
        overwrite(device, &self.state.exp_avg, &exp_avg)?;
        overwrite(device, &self.state.exp_avg_sq, &exp_avg_sq)?;
        overwrite(device, &self.grad_acc, &vec![0.0; master.len()])?;
        Ok(())
    }
}
