//! The offload side: fp32 optimizer state, the gradient accumulator and the staging buffers in
//! host memory, and the queue of device-to-host copies in flight during a backward.

use std::collections::VecDeque;

use zeroflow_core::Float;
use zeroflow_device::{Device, Filling, HostBuffer, HostMemory};
use zeroflow_optim::CpuAdam;

use crate::EngineError;

/// How many staging buffers gradients cycle through on their way to the host.
pub(crate) const STAGING_BUFFERS: usize = 4;

/// Everything the CPU optimizer owns for this rank's partition.
#[derive(Debug)]
pub(crate) struct HostState<P: Float> {
    pub master: HostBuffer<f32>,
    pub exp_avg: HostBuffer<f32>,
    pub exp_avg_sq: HostBuffer<f32>,
    /// The rank's gradient partition, summed over ranks and micro-steps (in the loss-scaled
    /// model's units).
    pub grad_acc: HostBuffer<f32>,
    /// Device-to-host staging of one bucket piece each.
    pub staging: Vec<HostBuffer<P>>,
    /// The updated weights, as the model's dtype, on their way back.
    pub upload: HostBuffer<P>,
    pub adam: CpuAdam,
}

impl<P: Float> HostState<P> {
    pub(crate) fn new<D: Device>(
        device: &D,
        partition: usize,
        bucket: usize,
        memory: HostMemory,
        adam: CpuAdam,
    ) -> Result<Self, EngineError> {
        let staging_len = bucket.min(partition).max(1);
        let staging = (0..STAGING_BUFFERS)
            .map(|_| device.alloc_host::<P>(staging_len, memory))
            .collect::<Result<_, _>>()?;
        Ok(HostState {
            master: device.alloc_host(partition, memory)?,
            exp_avg: device.alloc_host(partition, memory)?,
            exp_avg_sq: device.alloc_host(partition, memory)?,
            grad_acc: device.alloc_host(partition, memory)?,
            staging,
            upload: device.alloc_host(partition, memory)?,
            adam,
        })
    }
}

/// Copies of gradient pieces to the host that are in flight, and the staging buffers they fill.
/// A piece is added into the accumulator only after its copy's token has been waited on: there is
/// no way to read a staging buffer earlier.
pub(crate) struct Offloader<'s, P: Float> {
    free: Vec<&'s mut HostBuffer<P>>,
    in_flight: VecDeque<(usize, usize, Filling<'s, P>)>,
    grad_acc: &'s mut HostBuffer<f32>,
}

impl<'s, P: Float> Offloader<'s, P> {
    pub(crate) fn new(staging: &'s mut [HostBuffer<P>], grad_acc: &'s mut HostBuffer<f32>) -> Self {
        Offloader { free: staging.iter_mut().collect(), in_flight: VecDeque::new(), grad_acc }
    }

    /// A free staging buffer, waiting for the oldest copy if all are in flight.
    pub(crate) fn staging(&mut self) -> Result<&'s mut HostBuffer<P>, EngineError> {
        if self.free.is_empty() {
            self.retire_oldest()?;
        }
        Ok(self.free.pop().expect("a buffer was just retired"))
    }

    /// Registers a copy of `len` gradients into the staging buffer that `filling` holds,
    /// destined for `grad_acc[offset..offset + len]`.
    pub(crate) fn push(&mut self, offset: usize, len: usize, filling: Filling<'s, P>) {
        self.in_flight.push_back((offset, len, filling));
    }

    /// Waits for the oldest copy and adds its piece into the accumulator.
    fn retire_oldest(&mut self) -> Result<(), EngineError> {
        let (offset, len, filling) = self.in_flight.pop_front().expect("a copy is in flight");
        let staged = filling.wait()?;
        let acc = &mut self.grad_acc[offset..offset + len];
        acc.iter_mut().zip(&staged[..len]).for_each(|(a, g)| *a += g.to_f32());
        self.free.push(staged);
        Ok(())
    }

    /// Waits for every copy and adds it in, in the order the copies were made.
    pub(crate) fn drain(&mut self) -> Result<(), EngineError> {
        while !self.in_flight.is_empty() {
            self.retire_oldest()?;
        }
        Ok(())
    }
}
