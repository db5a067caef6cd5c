//! The summed streaming path (ZeRO-2, gradient accumulation, the exact step inline): each
//! micro-step's reduced buckets are added into a device accumulator of the partition on the comm
//! stream; at the step the norm is taken over the sum on the device and the sum streams through
//! the CPU step chunk by chunk, as the one-micro-step path streams the reduced gradients
//! ([`super::chunks::stream_step`]). Nothing is copied to the host during the window's
//! backwards, there is no host accumulator and no whole-partition upload buffer: the host holds
//! the optimizer state and the bounded staging, as with one micro-step.
//!
//! Events: the comm stream's adds, then the norm on the same stream (`norm_done`), order the
//! step's d2h copies after the sum is complete; the step records `d2h_done` after its last
//! copy, and the accumulator is cleared on the comm stream after it. Where the step is
//! speculated, the window's last backward also copies each summed piece that fits the budget to
//! the host after its add (the piece's `reduced` event, `reduction.rs`), and the courier steps it
//! there; the step then streams the rest.
//!
//! Where one rank holds every weight (`overlap_forward`), the step is left to the next window's
//! first forward, which opens it as the one-micro-step path's is ([`super::opening::Opening`]):
//! the sum is cleared on the comm stream once the opening has recorded `d2h_done`, before that
//! micro-step's backward adds into it. A speculation is validated at the step as the streaming
//! path's is: the pieces that stand go up then, and the opening leaves them alone. The opening is
//! done with the optimizer before the window's last backward, whose pieces the courier steps.
//!
//! With a device share ([`DeviceShare`], `device_share`), the partition's end is stepped from the
//! sum by the device's AdamW on the compute stream, and the comm stream waits for that step before
//! anything clears the sum; the CPU streams the rest.

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, StreamKind};
use zeroflow_optim::AdamWStep;

use super::chunks::{StepIo, finish_stream_step, stream_step};
use super::opening::{Deferral, OpenAt, OpenChunks, Opening};
use super::path::SinkOrOpening;
use super::share::{self, DeviceShare};
use super::shared::Shared;
use super::state::{PathState, SavedState};
use crate::EngineError;
use crate::checkpoint::PartView;
use crate::device_adamw::DeviceAdamW;
use crate::host::StreamBuffers;
use crate::offloader::{Landing, Offloader, Speculating};
use crate::reduction::Sink;
use crate::speculation::{Assumed, Speculation, standing};

/// The summed streaming path's buffers and events.
pub(super) struct Summed<D: Device, P: Float> {
    /// The window's reduced gradients of this rank's partition, summed (loss-scaled units).
    acc: D::Buffer<f32>,
    /// The CPU optimizer and the f32 staging the sum streams through.
    pub(super) buffers: Box<StreamBuffers<P, f32>>,
    /// H2d → comm: a chunk is uploaded, for its gather.
    chunk_uploaded: D::Event,
    /// Gather each uploaded piece while the CPU steps the next (several ranks).
    gather_in_pieces: bool,
    /// The step's speculation (`None`: off).
    pub(super) speculation: Option<Speculation<P>>,
    /// The step left to the next forward ([`Summed::open`]; the `overlap_forward` option,
    /// where one rank holds every weight).
    deferral: Deferral<D>,
    /// The partition's last elements, stepped on the device (`device_share`).
    share: Option<DeviceShare<D>>,
}

impl<D: DeviceAdamW, P: Float> Summed<D, P> {
    /// The path over `buffers`, with a device accumulator of the partition's `partition`
    /// elements; `overlap_forward` is the caller's choice (`UpdatePath::new`).
    pub fn new(
        device: &D,
        buffers: StreamBuffers<P, f32>,
        partition: usize,
        gather_in_pieces: bool,
        speculation: Option<Speculation<P>>,
        overlap_forward: bool,
    ) -> Result<Self, EngineError> {
        let acc = device.alloc::<f32>(partition)?;
        let chunk_uploaded = device.new_event()?;
        let buffers = Box::new(buffers);
        let deferral = Deferral::new(device, overlap_forward)?;
        let share = None;
        Ok(Summed { acc, buffers, chunk_uploaded, gather_in_pieces, speculation, deferral, share })
    }

    /// The path with `share` of the partition's end stepped on the device from the sum (the
    /// exact step's `device_share`; the caller, `UpdatePath::new`, checked that it can act).
    pub fn with_share(mut self, share: Option<DeviceShare<D>>) -> Self {
        self.share = share;
        self
    }

    /// Backward's sink: the device accumulator; at the window's last backward, where the step is
    /// speculated, each summed piece that fits the budget also goes to the host and is stepped
    /// there at once.
    pub fn sink(&mut self, assumed: Option<Assumed>, boundary: bool) -> Sink<'_, D, P> {
        let acc = &self.acc;
        let offloader = match (&mut self.speculation, boundary) {
            (Some(speculation), true) => {
                let StreamBuffers { state, staging, .. } = &mut *self.buffers;
                speculation.begin(state, assumed);
                speculation.active().then(|| {
                    let speculating = Speculating { speculation, state: Some(state), upload: None };
                    Offloader::new(staging, Landing::Step(speculating))
                })
            }
            _ => None,
        };
        Sink::DeviceThenHost { acc, offloader }
    }

    /// Σ g² over the sums of all ranks, on the comm stream after its adds (loss-scaled, summed
    /// units).
    pub fn sum_squares<C: Comm<Device = D>>(
        &self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<f64, EngineError> {
        shared.comm_sum_squares(&self.acc, 0..shared.owned.len())
    }

    /// The streamed step from the sum, the pieces stepped during the last backward kept where
    /// the speculation stands; or, with `overlap_forward`, the step left for the next forward
    /// (the speculation validated now, and the weights of the pieces that stand sent up).
    pub fn update<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let speculated = standing(self.speculation.as_mut(), &mut self.buffers.state, step);
        if self.deferral.enabled() {
            self.deferral.leave(shared, step, speculated)?;
        } else {
            let stood = speculated.is_some();
            self.step_inline(shared, step, stood)?;
        }
        shared.cpu_wait += started.elapsed();
        Ok(())
    }

    /// The step, on this thread; `stood`: the speculation was validated and its pieces stand
    /// (stepped already, their weights uploaded with the rest).
    fn step_inline<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
        stood: bool,
    ) -> Result<(), EngineError> {
        let speculated = self.speculation.as_ref().filter(|_| stood);
        let Summed { acc, buffers, chunk_uploaded, gather_in_pieces, share, .. } = self;
        let params = (&shared.params, shared.owned.start);
        let len = step_share(
            share,
            &shared.device,
            step,
            (&shared.events.norm_done, &shared.events.compute_done),
            acc,
            params,
        )?
        .unwrap_or(shared.owned.len());
        let mut times = std::mem::take(&mut shared.step_times);
        let io = StepIo {
            source: &*acc,
            at: 0,
            len,
            uploaded_event: chunk_uploaded,
            gather_in_pieces: *gather_in_pieces,
            times: &mut times,
        };
        let gathered = stream_step(shared, buffers, io, step, speculated, None);
        shared.step_times = times;
        finish_stream_step(shared, gathered?)
    }

    /// True if the last step's CPU work is left for the next forward to open.
    pub fn defers(&self) -> bool {
        self.deferral.pending()
    }

    /// The step left for this forward, opened to it piece by piece from the sum but for the
    /// pieces a speculation stepped (their weights up already), the sum cleared by the opening
    /// once its copies are done (`None` where no step is left); and the backward's sink: the
    /// sum, which its adds reach after the clear (the window's first backward ends no step, so
    /// nothing goes to the host).
    pub fn open<'a>(
        &'a mut self,
        at: OpenAt<'a, D, P>,
    ) -> Result<SinkOrOpening<'a, D, P>, EngineError> {
        let Summed { acc, buffers, deferral, share, .. } = self;
        let sink = Sink::DeviceThenHost { acc, offloader: None };
        let Some((step, opened, stepped)) = deferral.take() else { return Ok((sink, None)) };
        let params = (at.params, at.owned.start);
        let len = step_share(
            share,
            at.device,
            &step,
            (at.events.norm_done, at.events.compute_done),
            acc,
            params,
        )?
        .unwrap_or(at.owned.len());
        let (source, clear, buffers) = (((&*acc, 0), len), Some(&*acc), &mut **buffers);
        let wrap = OpenChunks::Summed;
        let opening = Opening::new(at, step, buffers, source, &stepped, opened, clear, wrap)?;
        Ok((sink, Some(opening)))
    }

    /// Runs the step left for the next forward now, in line, and clears the sum after it (a
    /// speculation that stood still holds its pieces: uploaded once more with the rest).
    pub fn complete<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let Some((step, _, stepped)) = self.deferral.take() else { return Ok(()) };
        let started = std::time::Instant::now();
        self.step_inline(shared, &step, !stepped.is_empty())?;
        shared.cpu_wait += started.elapsed();
        self.zero_accumulator(shared)
    }

    /// Clears the accumulator for the next window on the comm stream (where the next
    /// micro-step's adds go), after the step's copies out of it (`d2h_done`); a step left to the
    /// next forward clears it there, after its copies.
    pub fn zero_accumulator<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        if self.defers() {
            return Ok(());
        }
        let comm = shared.device.stream(StreamKind::Comm);
        if let Some(copied) = &shared.events.d2h_done {
            shared.device.wait_event(comm, copied)?;
        }
        shared.device.fill(comm, &self.acc, 0..shared.owned.len(), 0.0)?;
        Ok(())
    }

    /// Restores the pieces stepped speculatively and not yet validated (a skipped step, or a
    /// state read before the step).
    pub fn abandon_speculation(&mut self) {
        if let Some(speculation) = &mut self.speculation {
            speculation.abandon(&mut self.buffers.state);
        }
    }

    /// The master weights (the device share's downloaded after the host's).
    pub fn master(&mut self, device: &D) -> Result<Vec<f32>, EngineError> {
        self.abandon_speculation();
        share::master(self.share.as_ref(), device, &self.buffers.state)
    }

    /// The optimizer state (nothing is pending: the step is inline; the device share's
    /// downloaded after the host's).
    pub fn state(&mut self, device: &D) -> Result<PathState, EngineError> {
        self.abandon_speculation();
        let [master, exp_avg, exp_avg_sq] =
            share::state(self.share.as_ref(), device, &self.buffers.state)?;
        Ok(PathState { master, exp_avg, exp_avg_sq, upload_pending: false })
    }

    /// [`Summed::state`] of the partition `flat`: the host's part borrowed, the device share's
    /// downloaded a piece at a time.
    pub fn view<'a>(
        &'a mut self,
        device: &'a D,
        flat: Range<usize>,
    ) -> Result<PartView<'a>, EngineError> {
        self.abandon_speculation();
        share::view(self.share.as_ref(), device, &self.buffers.state, flat)
    }

    /// Takes a checkpoint's state: the host's part, and the device share's.
    pub fn restore(&mut self, device: &D, state: &SavedState<'_>) -> Result<(), EngineError> {
        self.abandon_speculation();
        share::restore(self.share.as_mut(), device, &mut self.buffers.state, state)
    }
}

/// The device share's step from the window's sum, where there is a share: its AdamW on the
/// compute stream, and the comm stream (where the sum is cleared for the next window) made to
/// wait for its reading of the sum. Gives how many elements the CPU steps then.
fn step_share<D: DeviceAdamW, P: Float>(
    share: &mut Option<DeviceShare<D>>,
    device: &D,
    step: &AdamWStep,
    events: (&D::Event, &D::Event),
    acc: &D::Buffer<f32>,
    params: (&D::Buffer<P>, usize),
) -> Result<Option<usize>, EngineError> {
    let Some(share) = share else { return Ok(None) };
    share.step(device, step, events, (acc, 0), params)?;
    // A share staged from host memory: all of it now (nothing queues it between the CPU's
    // chunks on this path).
    share.finish(device, (acc, 0), params)?;
    share.order_after_step(device, StreamKind::Comm)?;
    Ok(Some(share.from()))
}
