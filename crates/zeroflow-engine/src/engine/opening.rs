//! The exact step left to the next forward (`overlap_forward`, DESIGN.md §5): what a streaming
//! path's [`Deferral`] keeps of the step it leaves, and the [`Opening`] that steps its chunks as
//! the forward reaches their weights.
//!
//! The opening orders the d2h stream after `norm_done` and the h2d stream after `compute_done`
//! and `params_ready`, as the inline step does; after each chunk it records `opened` on the h2d
//! stream and the compute stream waits for it; once the forward is queued it records `d2h_done`
//! and `params_ready` and the compute stream waits for both before the gradients are zeroed.

use std::ops::Range;
use std::sync::mpsc::SyncSender;
use std::time::Instant;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, DeviceBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use super::chunks::{ChunkStream, Chunks, Handoff, order_for_step};
use super::shared::Shared;
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::{StepTimes, StreamBuffers};
use crate::speculation::Speculation;

/// What [`Stream::open`](super::stream::Stream::open) borrows from the engine for one forward.
pub(in crate::engine) struct OpenAt<'a, D: Device, P: Float> {
    pub device: &'a D,
    pub params: &'a D::Buffer<P>,
    /// This rank's reduced gradients and where they start.
    pub source: (&'a D::Buffer<P>, usize),
    pub owned: Range<usize>,
    pub padded_len: usize,
    pub events: OpenEvents<'a, D>,
    /// Told of each chunk uploaded (nothing to gather: one rank holds every weight).
    pub uploaded: &'a mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    pub times: &'a mut StepTimes,
    /// The gradients to zero once the forward is queued (the backward's zeroing, which must
    /// wait for the step's copies of them).
    pub zero: Option<&'a D::Buffer<P>>,
}

/// The shared events an [`Opening`] waits on and records.
pub(in crate::engine) struct OpenEvents<'a, D: Device> {
    pub norm_done: &'a D::Event,
    pub compute_done: &'a D::Event,
    pub d2h_done: &'a mut Option<D::Event>,
    pub params_ready: &'a mut Option<D::Event>,
}

/// A step left to the next forward ([`Deferral::take`]): the step, the event its opening
/// records, and the ranges a speculation stepped already.
pub(super) type LeftStep<'a, D> = (AdamWStep, &'a mut <D as Device>::Event, Vec<Range<usize>>);

/// Whether a streaming path leaves its exact step to the next forward (`overlap_forward`), the
/// step left, the ranges of it a speculation stepped (their weights uploaded already), and the
/// event its [`Opening`] records (h2d → compute).
pub(super) struct Deferral<D: Device> {
    enabled: bool,
    step: Option<AdamWStep>,
    stepped: Vec<Range<usize>>,
    opened: D::Event,
}

impl<D: Device> Deferral<D> {
    pub fn new(device: &D, enabled: bool) -> Result<Self, EngineError> {
        let stepped = Vec::new();
        Ok(Deferral { enabled, step: None, stepped, opened: device.new_event()? })
    }

    /// True where the path leaves its steps to the next forward.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// True if a step is left to the next forward.
    pub fn pending(&self) -> bool {
        self.step.is_some()
    }

    /// The step left, taken, with the event its opening records and the ranges stepped already.
    pub fn take(&mut self) -> Option<LeftStep<'_, D>> {
        let stepped = std::mem::take(&mut self.stepped);
        Some((self.step.take()?, &mut self.opened, stepped))
    }
}

/// The exact step left for the next forward (`overlap_forward`, DESIGN.md §5): the forward
/// opens the weights as it reaches them ([`crate::ModelIo::open`]), the CPU steps the chunks that
/// hold them then and there, and the compute stream waits for their upload only (`opened`, h2d →
/// compute), so the GPU runs each layer while the CPU steps the next. Once the forward is queued
/// (an `end` past the weights) the rest is stepped, `d2h_done` and `params_ready` are recorded
/// as the inline step records them, and the compute stream waits for both and zeroes the
/// gradients for the backward; where the step streams from the window's sum on the device
/// ([`super::summed::Summed`]), the comm stream clears the sum after `d2h_done`, before the
/// backward adds into it. The same chunks in the same order as the inline step: the same
/// results, bit for bit.
pub(in crate::engine) struct Opening<'a, D: Device, P: Float> {
    /// `None` once the final open has taken them (every chunk stepped, the optimizer handed
    /// on; or its error kept).
    chunks: Option<OpenChunks<'a, D, P>>,
    /// Where the optimizer and the staging go once every chunk is stepped: the backward's
    /// speculation ([`Stream::open`](super::stream::Stream::open)).
    handoff: Option<SyncSender<Handoff<'a, P>>>,
    device: &'a D,
    opened_event: &'a mut D::Event,
    d2h_done: &'a mut Option<D::Event>,
    params_ready: &'a mut Option<D::Event>,
    zero: Option<&'a D::Buffer<P>>,
    /// The window's sum the step streams from, cleared once its copies are done.
    clear_sum: Option<&'a D::Buffer<f32>>,
    /// Where this rank's partition starts in the flat weights, and their padded length.
    start: usize,
    padded_len: usize,
    /// The compute stream waits for the partition's uploads up to here.
    opened: usize,
    failed: Option<EngineError>,
    /// Time spent stepping and queuing for the forward.
    spent: std::time::Duration,
    /// A device share staged from host memory: queued between the CPU's chunks (`false`), and
    /// the rest (`true`, [`DeviceShare::finish`](super::share::DeviceShare::finish)) once the
    /// forward reaches its weights.
    share: Option<SharePump<'a>>,
}

/// What an [`Opening`] calls to queue a device share's staged step ([`Opening::share`]).
pub(super) type SharePump<'a> = Box<dyn FnMut(bool) -> Result<(), EngineError> + 'a>;

/// The chunks an [`Opening`] steps: from the reduced gradients (`P`), or from the window's sum on
/// the device (`f32`).
pub(in crate::engine) enum OpenChunks<'a, D: Device, P: Float> {
    Reduced(ChunkStream<'a, D, P, P>),
    Summed(ChunkStream<'a, D, f32, P>),
}

impl<'a, D: Device, P: Float> OpenChunks<'a, D, P> {
    /// The optimizer and the staging of a stream of the model's gradients, for the backward's
    /// speculation (the sum's opening hands nothing on: the window's first backward ends no
    /// step, and its last one speculates with the path's own).
    fn release(self) -> Option<Handoff<'a, P>> {
        match self {
            OpenChunks::Reduced(chunks) => Some(chunks.release()),
            OpenChunks::Summed(_) => None,
        }
    }

    fn advance(&mut self, to: usize) -> Result<(), EngineError> {
        match self {
            OpenChunks::Reduced(chunks) => chunks.advance(to),
            OpenChunks::Summed(chunks) => chunks.advance(to),
        }
    }

    fn done(&self) -> usize {
        match self {
            OpenChunks::Reduced(chunks) => chunks.done(),
            OpenChunks::Summed(chunks) => chunks.done(),
        }
    }

    /// The elements the CPU steps, from the first.
    fn len(&self) -> usize {
        match self {
            OpenChunks::Reduced(chunks) => chunks.len(),
            OpenChunks::Summed(chunks) => chunks.len(),
        }
    }
}

impl<'a, D: Device, P: Float> Opening<'a, D, P> {
    /// The opening of `step` over `buffers`, streaming the gradients from `source` (its buffer,
    /// where this rank's partition starts in it, and how many of the partition's elements the
    /// CPU steps: all but a device share) through the chunks `wrap` makes, but for the ranges
    /// `stepped` (a speculation's, stepped and uploaded already); where `clear_sum` is given,
    /// that sum is cleared once the step's copies have read it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new<G: Float>(
        at: OpenAt<'a, D, P>,
        step: AdamWStep,
        buffers: &'a mut StreamBuffers<P, G>,
        source: ((&'a D::Buffer<G>, usize), usize),
        stepped: &[Range<usize>],
        opened_event: &'a mut D::Event,
        clear_sum: Option<&'a D::Buffer<f32>>,
        wrap: fn(ChunkStream<'a, D, G, P>) -> OpenChunks<'a, D, P>,
    ) -> Result<Self, EngineError> {
        let OpenAt { device, params, owned, padded_len, events, uploaded, times, zero, .. } = at;
        order_for_step(
            device,
            events.norm_done,
            events.compute_done,
            events.params_ready.as_ref(),
        )?;
        let StreamBuffers { state, staging, outgoing } = buffers;
        let ((source, source_at), len) = source;
        let io = Chunks {
            state_at: 0,
            source,
            source_at,
            target: params,
            target_at: owned.start,
            uploaded,
            times,
        };
        let stream = ChunkStream::new(device, step, state, staging, outgoing, io, len, stepped);
        Ok(Opening {
            chunks: Some(wrap(stream)),
            handoff: None,
            device,
            opened_event,
            d2h_done: events.d2h_done,
            params_ready: events.params_ready,
            zero,
            clear_sum,
            start: owned.start,
            padded_len,
            opened: 0,
            failed: None,
            spent: std::time::Duration::ZERO,
            share: None,
        })
    }
}

impl<'a, D: Device, P: Float> Opening<'a, D, P> {
    /// The opening, queuing a device share's staged step with `pump` between its chunks.
    pub(super) fn with_share(mut self, pump: Option<SharePump<'a>>) -> Self {
        self.share = pump;
        self
    }

    /// The opening, handing the optimizer and the staging on to `handoff` once it has stepped
    /// every chunk.
    pub(super) fn handing_on(mut self, handoff: SyncSender<Handoff<'a, P>>) -> Self {
        self.handoff = Some(handoff);
        self
    }

    /// [`crate::ModelIo::open`]: the weights below flat `end` (all of them, and the forward
    /// queued, at or past the padded length). The first error is kept ([`Opening::end`]) and
    /// nothing more is opened after it.
    pub fn open(&mut self, end: usize) {
        if self.finished() || self.failed.is_some() {
            return;
        }
        let started = Instant::now();
        let opened = match end >= self.padded_len {
            true => self.finish(),
            false => self.open_to(end.saturating_sub(self.start)),
        };
        self.spent += started.elapsed();
        if let Err(e) = opened {
            self.failed = Some(e);
        }
    }

    /// True once the final open has run.
    fn finished(&self) -> bool {
        self.chunks.is_none()
    }

    fn open_to(&mut self, to: usize) -> Result<(), EngineError> {
        let chunks = self.chunks.as_mut().ok_or(EngineError::Internal("opened after its end"))?;
        // Past the elements the CPU steps, a device share's: written on the compute stream, or
        // staged, the compute stream made to wait for them.
        let share_wanted = to > chunks.len();
        let to = to.min(chunks.len());
        if to > self.opened {
            advance(chunks, to, self.share.as_mut())?;
            let (h2d, compute) =
                (self.device.stream(StreamKind::H2d), self.device.stream(StreamKind::Compute));
            self.device.record(self.opened_event, h2d)?;
            self.device.wait_event(compute, self.opened_event)?;
            self.opened = chunks.done();
        } else if let Some(pump) = self.share.as_mut() {
            // Nothing left for the CPU here (a speculation stepped it): the share's pieces go
            // on as the forward opens its layers.
            pump(false)?;
        }
        if let Some(mut finish) = self.share.take_if(|_| share_wanted) {
            finish(true)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), EngineError> {
        let mut chunks = self.chunks.take().ok_or(EngineError::Internal("finished twice"))?;
        advance(&mut chunks, usize::MAX, self.share.as_mut())?;
        // Before the gradients are zeroed (the share's step reads them) and the forward's
        // kernels past the CPU's elements.
        if let Some(mut finish) = self.share.take() {
            finish(true)?;
        }
        // The backward's speculation takes them from here (a backward whose courier is gone
        // has none).
        if let (Some(handoff), Some(released)) = (self.handoff.take(), chunks.release()) {
            let _ = handoff.send(released);
        }
        let device = self.device;
        let streams = [StreamKind::D2h, StreamKind::H2d].map(|kind| device.stream(kind));
        let compute = device.stream(StreamKind::Compute);
        // As `finish_stream_step` records them for one rank: the step's copies have read the
        // gradients, its uploads have written the weights.
        for (slot, stream) in
            [&mut *self.d2h_done, &mut *self.params_ready].into_iter().zip(streams)
        {
            let event = super::shared::slot(slot, device)?;
            device.record(event, stream)?;
            device.wait_event(compute, event)?;
        }
        if let Some(grads) = self.zero {
            device.fill(compute, grads, 0..self.padded_len, P::default())?;
        }
        if let Some(sum) = self.clear_sum {
            // After the step's copies out of it (`d2h_done`, recorded above), before the
            // backward's adds into it (the same stream).
            let comm = device.stream(StreamKind::Comm);
            let copied = self.d2h_done.as_ref().ok_or(EngineError::Internal("d2h_done is set"))?;
            device.wait_event(comm, copied)?;
            device.fill(comm, sum, 0..sum.len(), 0.0)?;
        }
        Ok(())
    }

    /// Ends the opening after the model: steps what the forward did not open, and gives whether
    /// the model opened everything itself (a model that did not may have read weights before
    /// their upload: a misuse the caller reports, before any error that followed from it), else
    /// the first error, and the time spent.
    pub fn end(mut self) -> (Result<bool, EngineError>, std::time::Duration) {
        let opened_all = self.finished();
        self.open(usize::MAX);
        let result = match self.failed.take() {
            Some(e) if opened_all => Err(e),
            _ => Ok(opened_all),
        };
        (result, self.spent)
    }
}

/// Steps `chunks` up to `to` (at most all), and where a device share is staged (`share`),
/// queues what it can of it after each chunk.
fn advance<D: Device, P: Float>(
    chunks: &mut OpenChunks<'_, D, P>,
    to: usize,
    share: Option<&mut SharePump<'_>>,
) -> Result<(), EngineError> {
    let Some(pump) = share else { return chunks.advance(to) };
    while chunks.done() < to.min(chunks.len()) {
        chunks.advance(chunks.done() + 1)?;
        pump(false)?;
    }
    Ok(())
}

impl<D: DeviceAdamW> Deferral<D> {
    /// Leaves `step` to the next forward (the path's callers ask only where it leaves its steps
    /// so, [`Deferral::enabled`]), but for the pieces of a speculation that stands
    /// (`speculated`): their weights' uploads are queued now, and the opening leaves their ranges
    /// alone.
    pub fn leave<C: Comm<Device = D>, P: Float>(
        &mut self,
        shared: &Shared<D, C, P>,
        step: &AdamWStep,
        speculated: Option<&Speculation<P>>,
    ) -> Result<(), EngineError> {
        debug_assert!(self.enabled, "a step left to the forward where the path steps in line");
        self.stepped = upload_speculated(shared, speculated)?;
        self.step = Some(*step);
        Ok(())
    }
}

/// Queues the uploads of the pieces of a speculation that stands (`speculated`), after the last
/// forward and backward read the weights, and gives their ranges (none where nothing stands).
fn upload_speculated<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &Shared<D, C, P>,
    speculated: Option<&Speculation<P>>,
) -> Result<Vec<Range<usize>>, EngineError> {
    let Some((speculation, weights)) = speculated.and_then(|s| Some((s, s.weights()?))) else {
        return Ok(Vec::new());
    };
    let Shared { ref device, ref params, ref events, ref owned, .. } = *shared;
    order_for_step(device, &events.norm_done, &events.compute_done, events.params_ready.as_ref())?;
    let h2d = device.stream(StreamKind::H2d);
    let stepped = speculation.stepped();
    for piece in stepped {
        let (from, at) = (piece.at..piece.at + piece.range.len(), owned.start + piece.range.start);
        device.copy_h2d(h2d, weights, from, params, at)?.detach();
    }
    Ok(stepped.iter().map(|piece| piece.range.clone()).collect())
}
