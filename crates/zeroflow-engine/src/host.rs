//! The offload side: fp32 optimizer state, the gradient accumulator and the staging buffers in
//! host memory, and the queue of device-to-host copies in flight during a backward.

use std::thread::JoinHandle;

use zeroflow_core::Float;
use zeroflow_device::{Device, Filling, HostBuffer, HostMemory};
use zeroflow_optim::{AdamState, AdamWStep, CpuAdam, Grads, Output};

use crate::EngineError;

/// How many staging buffers gradients cycle through on their way to the host.
pub(crate) const STAGING_BUFFERS: usize = 4;

/// The CPU optimizer's own state for this rank's partition: what a delayed step takes to its
/// worker thread and brings back.
#[derive(Debug)]
pub(crate) struct HostOptimizer<P: Float> {
    pub master: HostBuffer<f32>,
    pub exp_avg: HostBuffer<f32>,
    pub exp_avg_sq: HostBuffer<f32>,
    /// The updated weights, as the model's dtype, on their way back.
    pub upload: HostBuffer<P>,
    pub adam: CpuAdam,
}

impl<P: Float> HostOptimizer<P> {
    /// One AdamW step over the partition with the accumulated gradients, then the weights as `P`
    /// into the upload buffer.
    pub(crate) fn step(&mut self, step: &AdamWStep, grad_acc: &[f32]) -> Result<(), EngineError> {
        let HostOptimizer { master, exp_avg, exp_avg_sq, upload, adam } = self;
        let state = AdamState { params: master, exp_avg, exp_avg_sq };
        adam.step(step, state, Grads::F32(grad_acc), Output::MasterOnly)?;
        upload.iter_mut().zip(master.iter()).for_each(|(u, m)| *u = P::from_f32(*m));
        Ok(())
    }
}

/// The result of a delayed step: the optimizer and the accumulator it read, given back.
pub(crate) type DelayedStep<P> =
    JoinHandle<Result<(Box<HostOptimizer<P>>, HostBuffer<f32>), EngineError>>;

/// Where the CPU optimizer is.
#[derive(Debug)]
pub(crate) enum OptimizerSlot<P: Float> {
    /// Here, its weights uploaded (or about to be, in the same step).
    Ready(Box<HostOptimizer<P>>),
    /// On a worker thread, stepping with the accumulator it took (delayed update).
    Stepping(DelayedStep<P>),
    /// Lost to a failed or panicked delayed step.
    Lost,
}

/// Everything the offload path keeps in host memory for this rank's partition.
#[derive(Debug)]
pub(crate) struct HostState<P: Float> {
    pub optimizer: OptimizerSlot<P>,
    /// The rank's gradient partition, summed over ranks and micro-steps (in the loss-scaled
    /// model's units).
    pub grad_acc: HostBuffer<f32>,
    /// With the delayed update: the accumulator a running step does not hold, swapped in at each
    /// step.
    pub spare_acc: Option<HostBuffer<f32>>,
    /// Device-to-host staging of one bucket piece each.
    pub staging: Vec<HostBuffer<P>>,
    /// With the delayed update: the optimizer holds weights newer than the device's, to be
    /// uploaded at the next step (set when a delayed step was joined for a snapshot, or restored).
    pub upload_pending: bool,
}

impl<P: Float> HostState<P> {
    pub(crate) fn new<D: Device>(
        device: &D,
        master: &[f32],
        bucket: usize,
        memory: HostMemory,
        adam: CpuAdam,
        delayed: bool,
    ) -> Result<Self, EngineError> {
        let partition = master.len();
        let staging_len = bucket.min(partition).max(1);
        let staging = (0..STAGING_BUFFERS)
            .map(|_| device.alloc_host::<P>(staging_len, memory))
            .collect::<Result<_, _>>()?;
        let mut optimizer = HostOptimizer {
            master: device.alloc_host(partition, memory)?,
            exp_avg: device.alloc_host(partition, memory)?,
            exp_avg_sq: device.alloc_host(partition, memory)?,
            upload: device.alloc_host(partition, memory)?,
            adam,
        };
        optimizer.master.copy_from_slice(master);
        let spare_acc = if delayed { Some(device.alloc_host(partition, memory)?) } else { None };
        Ok(HostState {
            optimizer: OptimizerSlot::Ready(Box::new(optimizer)),
            grad_acc: device.alloc_host(partition, memory)?,
            spare_acc,
            staging,
            upload_pending: false,
        })
    }

    /// True if the optimizer's weights have not reached the device yet.
    pub(crate) fn weights_ahead(&self) -> bool {
        self.upload_pending || matches!(self.optimizer, OptimizerSlot::Stepping(_))
    }

    /// Waits for a delayed step, if one runs, and takes the optimizer back; its accumulator
    /// becomes the spare, and its weights are pending upload.
    pub(crate) fn join(&mut self) -> Result<&mut HostOptimizer<P>, EngineError> {
        if let OptimizerSlot::Stepping(_) = self.optimizer {
            self.upload_pending = true;
            let OptimizerSlot::Stepping(handle) =
                std::mem::replace(&mut self.optimizer, OptimizerSlot::Lost)
            else {
                unreachable!("matched above")
            };
            let (optimizer, acc) = handle
                .join()
                .map_err(|_| EngineError::Usage("the delayed optimizer step panicked"))??;
            self.spare_acc = Some(acc);
            self.optimizer = OptimizerSlot::Ready(optimizer);
        }
        match &mut self.optimizer {
            OptimizerSlot::Ready(optimizer) => Ok(optimizer),
            OptimizerSlot::Stepping(_) => unreachable!("joined above"),
            OptimizerSlot::Lost => {
                Err(EngineError::Usage("the CPU optimizer was lost to an earlier failure"))
            }
        }
    }

    /// One step now, on this thread (waiting for a delayed step first).
    pub(crate) fn step_now(&mut self, step: &AdamWStep) -> Result<(), EngineError> {
        self.join()?;
        let OptimizerSlot::Ready(optimizer) = &mut self.optimizer else {
            unreachable!("joined above")
        };
        optimizer.step(step, &self.grad_acc)
    }

    /// Starts a delayed step of the (joined) optimizer on a worker thread, handing it the full
    /// accumulator and swapping in the spare for the next window.
    pub(crate) fn start_delayed(&mut self, step: AdamWStep) -> Result<(), EngineError> {
        let OptimizerSlot::Ready(mut optimizer) =
            std::mem::replace(&mut self.optimizer, OptimizerSlot::Lost)
        else {
            return Err(EngineError::Usage("a delayed step started while another runs"));
        };
        let spare = self
            .spare_acc
            .take()
            .ok_or(EngineError::Usage("the delayed update needs a spare accumulator"))?;
        let acc = std::mem::replace(&mut self.grad_acc, spare);
        let handle = std::thread::Builder::new()
            .name("zeroflow-delayed-step".into())
            .spawn(move || {
                optimizer.step(&step, &acc)?;
                Ok((optimizer, acc))
            })
            .map_err(|_| EngineError::Usage("could not start the delayed optimizer thread"))?;
        self.optimizer = OptimizerSlot::Stepping(handle);
        Ok(())
    }
}

/// Copies of gradient pieces to the host that are in flight, and the staging buffers they fill.
/// A piece is added into the accumulator only after its copy's token has been waited on: there is
/// no way to read a staging buffer earlier. Fixed-size arrays, so a backward allocates nothing.
pub(crate) struct Offloader<'s, P: Float> {
    free: [Option<&'s mut HostBuffer<P>>; STAGING_BUFFERS],
    /// A ring of copies in flight, oldest at `head`: (offset in the accumulator, length, token).
    in_flight: [Option<(usize, usize, Filling<'s, P>)>; STAGING_BUFFERS],
    head: usize,
    count: usize,
    grad_acc: &'s mut HostBuffer<f32>,
}

impl<'s, P: Float> Offloader<'s, P> {
    pub(crate) fn new(staging: &'s mut [HostBuffer<P>], grad_acc: &'s mut HostBuffer<f32>) -> Self {
        let mut buffers = staging.iter_mut();
        Offloader {
            free: std::array::from_fn(|_| buffers.next()),
            in_flight: std::array::from_fn(|_| None),
            head: 0,
            count: 0,
            grad_acc,
        }
    }

    /// A free staging buffer, waiting for the oldest copy if all are in flight.
    pub(crate) fn staging(&mut self) -> Result<&'s mut HostBuffer<P>, EngineError> {
        if self.free.iter().all(Option::is_none) {
            self.retire_oldest()?;
        }
        Ok(self.free.iter_mut().find_map(Option::take).expect("a buffer is free"))
    }

    /// Registers a copy of `len` gradients into the staging buffer that `filling` holds,
    /// destined for `grad_acc[offset..offset + len]`.
    pub(crate) fn push(&mut self, offset: usize, len: usize, filling: Filling<'s, P>) {
        let slot = (self.head + self.count) % STAGING_BUFFERS;
        self.in_flight[slot] = Some((offset, len, filling));
        self.count += 1;
    }

    /// Waits for the oldest copy and adds its piece into the accumulator.
    fn retire_oldest(&mut self) -> Result<(), EngineError> {
        let (offset, len, filling) = self.in_flight[self.head].take().expect("a copy is in flight");
        self.head = (self.head + 1) % STAGING_BUFFERS;
        self.count -= 1;
        let staged = filling.wait()?;
        let acc = &mut self.grad_acc[offset..offset + len];
        acc.iter_mut().zip(&staged[..len]).for_each(|(a, g)| *a += g.to_f32());
        let slot = self.free.iter_mut().find(|slot| slot.is_none()).expect("a slot is empty");
        *slot = Some(staged);
        Ok(())
    }

    /// Waits for every copy and adds it in, in the order the copies were made.
    pub(crate) fn drain(&mut self) -> Result<(), EngineError> {
        while self.count > 0 {
            self.retire_oldest()?;
        }
        Ok(())
    }
}
