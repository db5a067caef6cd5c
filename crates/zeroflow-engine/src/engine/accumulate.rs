//! The accumulating offload path (gradient accumulation, or f16 weights): each reduced bucket is
//! copied to the host during backward and added into the host accumulator; at the step the CPU
//! steps the whole partition with it, and the updated weights go back in one upload.
//!
//! During backward the d2h stream waits on each bucket's `reduced` (comm, `reduction.rs`) before
//! its copies into staging, and the courier (`courier.rs`) adds a staged piece only after waiting
//! on its copy's token;
//! `d2h_done` is recorded after the backward's last copy. At the step the norm is summed on the
//! host (uploaded and all-reduced where the ranks hold parts). Inline, the CPU step runs at once
//! and its upload on the h2d stream waits on `compute_done` and `params_ready`, then the gather
//! follows. Delayed (after the warm-up), the step before this one is joined and uploaded the same
//! way, and this step's runs on a worker, with the accumulator swapped for the spare one.

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, HostBuffer, HostMemory, StreamKind};
use zeroflow_optim::AdamWStep;

use super::shared::{Shared, sum_to_host};
use super::state::PathState;
use crate::checkpoint::PartView;
use crate::device_adamw::DeviceAdamW;
use crate::host::{
    CpuStep, HostAccumulator, STAGING_BUFFERS, WholeStep, alloc_staging, sum_of_squares,
};
use crate::offloader::{Landing, Offloader, Speculating};
use crate::reduction::Sink;
use crate::speculation::{Assumed, Speculation, Verdict};
use crate::{AccumulateOn, EngineError, EngineOptions};

/// The accumulating path's buffers.
pub(super) struct Accumulate<D: Device, P: Float> {
    pub(super) host: HostAccumulator<P>,
    /// The exact inline step's speculation (`None`: off, or the delayed update).
    pub(super) speculation: Option<Speculation<P>>,
    /// ZeRO-2's window summed on the device ([`crate::AccumulateOn`]), if it is.
    pub(super) on_device: Option<DeviceSum<D>>,
}

/// The device accumulator of a window's reduced gradients and the f32 staging its sum leaves by.
pub(super) struct DeviceSum<D: Device> {
    acc: D::Buffer<f32>,
    staging: Vec<HostBuffer<f32>>,
}

impl<D: Device> DeviceSum<D> {
    /// The accumulator of a partition of `partition` elements where `on` and the device's free
    /// memory say so (ZeRO-2 with accumulation only: the other stages reduce once per window),
    /// and its staging of buffers of at most `piece` elements.
    pub fn new(
        device: &D,
        opts: &EngineOptions,
        on: AccumulateOn,
        partition: usize,
        piece: usize,
        memory: HostMemory,
    ) -> Result<Option<Self>, EngineError>
    where
        D: DeviceAdamW,
    {
        if !crate::memory::sums_on_device(opts, on, partition, || device.free_memory()) {
            return Ok(None);
        }
        let acc = device.alloc::<f32>(partition)?;
        let staging = alloc_staging(device, piece.min(partition), piece, memory, STAGING_BUFFERS)?;
        Ok(Some(DeviceSum { acc, staging }))
    }
}

impl<D: DeviceAdamW, P: Float> Accumulate<D, P> {
    /// Backward's sink: the staging that fills the accumulator (each micro-step, or from the
    /// device accumulator at the window's last) and, at a boundary of the exact inline step, the
    /// speculative step of each final piece.
    pub fn sink(&mut self, assumed: Option<Assumed>, boundary: bool) -> Sink<'_, D, P> {
        let HostAccumulator { acc, staging, cpu, .. } = &mut self.host;
        let speculate = match (cpu, &mut self.speculation) {
            (CpuStep::Inline(whole), Some(speculation)) => {
                let WholeStep { state, upload } = &mut **whole;
                speculation.begin(state, assumed);
                Some(Speculating { speculation, state: Some(state), upload: Some(upload) })
            }
            _ => None,
        };
        let landing = Landing::Accumulate { acc, speculate };
        match &mut self.on_device {
            None => Sink::Host(Offloader::new(staging, landing)),
            Some(DeviceSum { acc, staging }) => {
                let offloader = boundary.then(|| Offloader::new(staging, landing));
                Sink::DeviceThenHost { acc, offloader }
            }
        }
    }

    /// Clears the accumulators for the next window: the host's, and the device's on the comm
    /// stream before the next micro-step's sums (same stream) and after the window's copies out
    /// of it (`d2h_done`; their tokens were waited on in backward already, so this keeps the
    /// streams' order without relying on it).
    pub fn zero_accumulator<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        self.host.clear_accumulator();
        if let Some(DeviceSum { acc, .. }) = &self.on_device {
            let comm = shared.device.stream(StreamKind::Comm);
            if let Some(copied) = &shared.events.d2h_done {
                shared.device.wait_event(comm, copied)?;
            }
            shared.device.fill(comm, acc, 0..shared.owned.len(), 0.0)?;
        }
        Ok(())
    }

    /// Restores the pieces stepped speculatively and not yet validated (a skipped step, or a
    /// state read before the step).
    pub fn abandon_speculation(&mut self) {
        if let (Some(speculation), CpuStep::Inline(whole)) =
            (&mut self.speculation, &mut self.host.cpu)
        {
            speculation.abandon(&mut whole.state);
        }
    }

    /// The master weights (a running step is waited for).
    pub fn master(&mut self) -> Result<Vec<f32>, EngineError> {
        self.abandon_speculation();
        Ok(self.host.join()?.state.master.to_vec())
    }

    /// Σ g² over the host accumulators of all ranks (in loss-scaled, summed units).
    pub fn sum_squares<C: Comm<Device = D>>(
        &self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<f64, EngineError> {
        host_sum_squares(shared, &self.host.acc)
    }

    /// The CPU step: inline (and the warm-up of the delayed update), or the last step's weights
    /// applied and this one started on the worker.
    pub fn update<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let host = &mut self.host;
        let delayed = matches!(&host.cpu, CpuStep::Delayed { warmup, .. } if step.step() > *warmup);
        if delayed {
            // The step before this one finished meanwhile: its weights go to the device now and
            // the next window computes with them; this step runs in the background.
            if host.weights_ahead() {
                upload_and_gather(shared, host.upload()?)?;
            }
            host.start_delayed(*step)?;
        } else {
            let verdict = match (&mut self.speculation, &mut host.cpu) {
                (Some(speculation), CpuStep::Inline(whole)) => {
                    match speculation.validate(&mut whole.state, Some(step)) {
                        Verdict::Stands => {
                            whole.step_except(step, &host.acc, speculation.stepped())?;
                            Verdict::Stands
                        }
                        other => other,
                    }
                }
                _ => Verdict::Nothing,
            };
            if verdict != Verdict::Stands {
                host.step_now(step)?;
            }
            upload_and_gather(shared, host.upload()?)?;
        }
        shared.cpu_wait += started.elapsed();
        Ok(())
    }

    /// Waits for a delayed step still running and brings its weights into the model.
    pub fn flush<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        if self.host.weights_ahead() {
            upload_and_gather(shared, self.host.upload()?)?;
        }
        Ok(())
    }

    /// The optimizer state (a running step is waited for; its weights stay pending).
    pub fn state(&mut self) -> Result<PathState, EngineError> {
        self.abandon_speculation();
        let [master, exp_avg, exp_avg_sq] = self.host.state()?;
        Ok(PathState { master, exp_avg, exp_avg_sq, upload_pending: self.host.upload_pending })
    }

    /// [`Accumulate::state`] of the partition `flat`, borrowed, and whether its weights are
    /// pending.
    pub fn view(&mut self, flat: Range<usize>) -> Result<(PartView<'_>, bool), EngineError> {
        self.abandon_speculation();
        self.host.join()?;
        let state =
            self.host.settled().ok_or(EngineError::Internal("a joined step is not ready"))?;
        Ok((state.view(flat), self.host.upload_pending))
    }
}

/// Σ g² over the host accumulators of all ranks (in loss-scaled, summed units): on the host, then
/// uploaded and summed on the comm stream where the ranks hold parts.
pub(super) fn host_sum_squares<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &mut Shared<D, C, P>,
    acc: &HostBuffer<f32>,
) -> Result<f64, EngineError> {
    let local = sum_of_squares(acc);
    if !shared.across_ranks() {
        return Ok(local);
    }
    // Uploaded and waited for, so the all-reduce is ordered after it.
    shared.norm_host[0] = local as f32;
    let h2d = shared.device.stream(StreamKind::H2d);
    shared.device.copy_h2d(h2d, &shared.norm_host, 0..1, &shared.norm, 0)?.wait()?;
    let (norm, host) = (&shared.norm, &mut shared.norm_host);
    let done = &mut shared.events.norm_done;
    let (device, comm) = (&shared.device, &shared.comm);
    let read = sum_to_host(device, comm, true, StreamKind::Comm, done, norm, host)?;
    Ok(f64::from(read[0]))
}

/// Uploads the host optimizer's weights into this rank's partition of the flat weights, then
/// gathers the other partitions. The weights are free once the last forward/backward has read
/// them and the last gather (after the previous upload, which a flush can follow directly) has
/// written them.
pub(super) fn upload_and_gather<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &mut Shared<D, C, P>,
    upload: &HostBuffer<P>,
) -> Result<(), EngineError> {
    shared.h2d_after_weights_free()?;
    let h2d = shared.device.stream(StreamKind::H2d);
    let (len, at) = (shared.owned.len(), shared.owned.start);
    shared.device.copy_h2d(h2d, upload, 0..len, &shared.params, at)?.wait()?;
    shared.gather_from(StreamKind::H2d)
}
