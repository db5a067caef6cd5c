//! The reduction pipeline of one backward: each bucket of complete gradients is reduced so that
//! every rank holds the sum of its own partition, and the rank's piece goes on to the device
//! accumulator or, through the courier and pinned staging, to the host (`courier.rs`).

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{Comm, Device, Kernels, ReduceOp, StreamKind};

use crate::EngineError;
use crate::courier::{Request, Route};
use crate::offloader::Offloader;

/// Where reduced gradient pieces go.
#[allow(
    clippy::large_enum_variant,
    reason = "one value per backward, on the stack: boxing would allocate"
)]
pub(crate) enum Sink<'s, D: Device, P: Float> {
    /// Added into the device accumulator on the comm stream.
    Device(&'s D::Buffer<f32>),
    /// Copied to the host, and added there or stepped speculatively (see [`Offloader`]).
    Host(Offloader<'s, P, P>),
    /// Added into the device accumulator on the comm stream; at the end of the window (an
    /// offloader), the piece's sum is copied to the host from there, and lands as above.
    DeviceThenHost { acc: &'s D::Buffer<f32>, offloader: Option<Offloader<'s, f32, P>> },
    /// Left where the reduction put them, for the streaming step to copy out.
    Keep,
}

impl<D: Device, P: Float> Sink<'_, D, P> {
    /// True where this backward's pieces go to the host (through the courier).
    pub(crate) fn to_host(&self) -> bool {
        matches!(self, Sink::Host(_) | Sink::DeviceThenHost { offloader: Some(_), .. })
    }
}

/// The reduction pipeline during one backward.
pub(crate) struct Reduction<'s, D: Device, C: Comm<Device = D>, P: Float> {
    pub(crate) device: &'s D,
    pub(crate) comm: &'s C,
    pub(crate) layout: &'s FlatLayout,
    pub(crate) owned: Range<usize>,
    pub(crate) grads: &'s D::Buffer<P>,
    pub(crate) reduced: Option<&'s D::Buffer<P>>,
    pub(crate) bucket_ready: &'s mut D::Event,
    pub(crate) route: Route<'s, D>,
    pub(crate) enabled: bool,
    pub(crate) skip_d2h_wait: bool,
}

impl<D: Device + Kernels, C: Comm<Device = D>, P: Float> Reduction<'_, D, C, P> {
    /// Reduces one bucket of complete gradients and sends this rank's piece on.
    pub(crate) fn reduce_bucket(&mut self, bucket: Range<usize>) -> Result<(), EngineError> {
        if !self.enabled {
            return Ok(());
        }
        let comm_stream = self.device.stream(StreamKind::Comm);
        self.device.record(self.bucket_ready, self.device.stream(StreamKind::Compute))?;
        self.device.wait_event(comm_stream, self.bucket_ready)?;
        // `source` holds this rank's reduced piece of the bucket at `source_offset`.
        let (source, source_offset) = match self.reduced {
            Some(reduced) => {
                for rank in 0..self.comm.world_size() {
                    let part = self.layout.partition_range(rank);
                    let piece = bucket.start.max(part.start)..bucket.end.min(part.end);
                    if piece.is_empty() {
                        continue;
                    }
                    let offset = piece.start - part.start;
                    self.comm.reduce(
                        comm_stream,
                        self.grads,
                        piece,
                        reduced,
                        offset,
                        rank,
                        ReduceOp::Sum,
                    )?;
                }
                (reduced, self.owned.start)
            }
            None => {
                if self.comm.world_size() > 1 {
                    self.comm.all_reduce(comm_stream, self.grads, bucket.clone(), ReduceOp::Sum)?;
                }
                (self.grads, 0)
            }
        };
        let mine = bucket.start.max(self.owned.start)..bucket.end.min(self.owned.end);
        if mine.is_empty() {
            return Ok(());
        }
        let at_source = mine.start - source_offset..mine.end - source_offset;
        let at_acc = mine.start - self.owned.start;
        let summed = at_acc..at_acc + at_source.len();
        let (device, skip_wait) = (self.device, self.skip_d2h_wait);
        match &self.route {
            Route::Keep => {}
            Route::Add(acc) => {
                device.accumulate(comm_stream, source, at_source, acc, at_acc, 1.0)?;
            }
            Route::Copy(courier) => {
                let reduced = reduced_marker(device, skip_wait)?;
                // A courier that stopped has its error; the backward goes on without it.
                let request = Request { range: at_source, offset: at_acc, reduced };
                let _ = courier.requests.send(request);
            }
            Route::AddThenCopy(acc, courier) => {
                device.accumulate(comm_stream, source, at_source, acc, at_acc, 1.0)?;
                let reduced = reduced_marker(device, skip_wait)?;
                let request = Request { range: summed, offset: at_acc, reduced };
                let _ = courier.requests.send(request);
            }
        }
        Ok(())
    }
}

impl<D: Device, C: Comm<Device = D>, P: Float> Reduction<'_, D, C, P> {
    /// The whole backward is queued: where pieces go to the courier, it is given an event
    /// recorded after the backward's last kernel on the compute stream, so that it steps no
    /// piece speculatively once the GPU is past the backward ([`crate::offloader`]).
    pub(crate) fn backward_queued(&mut self) -> Result<(), EngineError> {
        let (Route::Copy(courier) | Route::AddThenCopy(_, courier)) = &self.route else {
            return Ok(());
        };
        if !self.enabled {
            return Ok(());
        }
        let mut queued = self.device.new_event()?;
        self.device.record(&mut queued, self.device.stream(StreamKind::Compute))?;
        // Once per backward: a second call changes nothing.
        let _ = courier.backward_queued.set(queued);
        Ok(())
    }
}

/// A fresh event recorded on the comm stream after what it has queued (the bucket's reduction,
/// and its add), for the courier's d2h wait; none where the mutation self-check skips the wait.
fn reduced_marker<D: Device>(device: &D, skip_wait: bool) -> Result<Option<D::Event>, EngineError> {
    if skip_wait {
        return Ok(None);
    }
    let mut reduced = device.new_event()?;
    device.record(&mut reduced, device.stream(StreamKind::Comm))?;
    Ok(Some(reduced))
}
