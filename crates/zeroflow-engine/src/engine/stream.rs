//! The streaming offload path (one micro-step per step, f32 or bf16 weights): the reduced
//! gradients stay on the device until the step, which copies them out chunk by chunk, steps each
//! chunk on the CPU as it arrives and uploads its weights at once ([`stream_chunks`]).
//!
//! Inline, the d2h stream waits on `norm_done` (the gradients are final) and the h2d stream on
//! `compute_done` and `params_ready` (the weights are free); with several ranks each uploaded
//! piece is gathered on the comm stream after `chunk_uploaded` (h2d → comm), and `params_ready`
//! is recorded after the last piece's gather (or by the gather after the step, without pieces).
//! `d2h_done` is recorded after the last chunk's copy.
//!
//! Delayed (after the warm-up), the step's gradients are first set aside on the comm stream
//! (after `d2h_done`: the last delayed step's copies have read the aside buffer), `aside_taken`
//! (comm → d2h) orders the worker's copies after that, and `comm_done` is recorded so the next
//! backward may overwrite the gradients. The worker streams the step into the aside weights; the
//! next step (or a flush) joins it, copies them into the weights on the h2d stream, records
//! `d2h_done` (the joined copies are done reading the aside gradients) and gathers.

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::time::Instant;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, DeviceBuffer, Filling, HostBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use super::path::SinkOrOpening;
use super::share::{self, DeviceShare};
use super::shared::Shared;
use super::state::{PathState, SavedState};
use crate::EngineError;
use crate::checkpoint::PartView;
use crate::device_adamw::DeviceAdamW;
use crate::host::{
    HostOptimizer, OUTGOING_BUFFERS, STAGING_BUFFERS, StepTimes, StreamBuffers, Worker, as_grads,
};
use crate::offloader::{Landing, Offloader, Speculating};
use crate::reduction::Sink;
use crate::speculation::{Assumed, Speculation, segments, standing};

/// The streaming step gathers its uploaded chunks in pieces of this many elements (32 MiB of
/// bf16), however small the chunks, or an eighth of the partition where that is less: one
/// collective per rank and piece.
const GATHER_PIECE: usize = 1 << 24;

/// The streaming path's buffers and events.
pub(super) struct Stream<D: Device, P: Float> {
    pub(super) cpu: StreamCpu<D, P>,
    /// H2d → comm: a chunk of the streaming step is uploaded, for its gather.
    chunk_uploaded: D::Event,
    /// Gather each uploaded piece while the CPU steps the next (several ranks).
    gather_in_pieces: bool,
    /// The exact inline step's speculation (`None`: off, or the delayed update).
    pub(super) speculation: Option<Speculation<P>>,
    /// The exact inline step left to the next forward ([`Opening`]; the `overlap_forward`
    /// option, where one rank holds every weight).
    deferral: Deferral<D>,
    /// The partition's last elements, stepped on the device (`device_share`).
    share: Option<DeviceShare<D>>,
}

/// Where the streaming step runs.
pub(super) enum StreamCpu<D: Device, P: Float> {
    /// On the training thread, inside `step`.
    Inline(Box<StreamBuffers<P>>),
    /// After the warm-up, on a worker while the next forward and backward run.
    Delayed(Box<DelayedStream<D, P>>),
}

impl<D: Device, P: Float> StreamCpu<D, P> {
    /// The CPU optimizer's buffers (a running step is waited for; its weights stay pending),
    /// and whether its weights are pending.
    fn buffers(&mut self) -> Result<(&mut StreamBuffers<P>, bool), EngineError> {
        match self {
            StreamCpu::Inline(buffers) => Ok((buffers, false)),
            StreamCpu::Delayed(delayed) => {
                let (buffers, joined) = delayed.worker.join()?;
                delayed.upload_pending |= joined;
                Ok((buffers, delayed.upload_pending))
            }
        }
    }
}

/// The delayed streaming step's worker and the device buffers it works between: this rank's
/// partition of a step's gradients, set aside while the next backward writes the gradient
/// buffer, and of the updated weights, while the next forward reads the weights (shared with the
/// worker).
pub(super) struct DelayedStream<D: Device, P: Float> {
    warmup: u64,
    worker: Worker<StreamBuffers<P>>,
    grads: Arc<D::Buffer<P>>,
    params: Arc<D::Buffer<P>>,
    /// Comm → d2h: the step's gradients are set aside.
    aside_taken: D::Event,
    /// The worker's weights are newer than the device's (joined, or restored).
    upload_pending: bool,
}

impl<D: DeviceAdamW, P: Float> Stream<D, P> {
    /// The path over `buffers`, delayed after `warmup` steps where `delayed` says so.
    pub fn new(
        device: &D,
        buffers: StreamBuffers<P>,
        delayed: Option<u64>,
        partition: usize,
        gather_in_pieces: bool,
        speculation: Option<Speculation<P>>,
        // The caller's choice (`UpdatePath::new`): the exact inline step, one rank holding every
        // weight.
        overlap_forward: bool,
    ) -> Result<Self, EngineError> {
        let cpu = match delayed {
            None => StreamCpu::Inline(Box::new(buffers)),
            Some(warmup) => StreamCpu::Delayed(Box::new(DelayedStream {
                warmup,
                worker: Worker::Ready(Box::new(buffers)),
                grads: Arc::new(device.alloc::<P>(partition)?),
                params: Arc::new(device.alloc::<P>(partition)?),
                aside_taken: device.new_event()?,
                upload_pending: false,
            })),
        };
        let chunk_uploaded = device.new_event()?;
        let deferral = Deferral::new(device, overlap_forward)?;
        let share = None;
        Ok(Stream { cpu, chunk_uploaded, gather_in_pieces, speculation, deferral, share })
    }

    /// The path with `share` of the partition's end stepped on the device (the exact inline
    /// step's `device_share`; the caller, `UpdatePath::new`, checked that it can act).
    pub fn with_share(mut self, share: Option<DeviceShare<D>>) -> Self {
        self.share = share;
        self
    }

    /// Backward's sink: where the exact inline step speculates, the pieces that fit the budget
    /// go to the host and are stepped there at once; the rest stay on the device for the step.
    pub fn sink(&mut self, assumed: Option<Assumed>) -> Sink<'_, D, P> {
        match (&mut self.cpu, &mut self.speculation) {
            (StreamCpu::Inline(buffers), Some(speculation)) => {
                let StreamBuffers { state, staging, .. } = &mut **buffers;
                speculation.begin(state, assumed);
                if !speculation.active() {
                    return Sink::Keep;
                }
                let speculating = Speculating { speculation, state: Some(state), upload: None };
                Sink::Host(Offloader::new(staging, Landing::Step(speculating)))
            }
            _ => Sink::Keep,
        }
    }

    /// Restores the pieces stepped speculatively and not yet validated (a skipped step, or a
    /// state read before the step).
    pub fn abandon_speculation(&mut self) {
        if let (StreamCpu::Inline(buffers), Some(speculation)) =
            (&mut self.cpu, &mut self.speculation)
        {
            speculation.abandon(&mut buffers.state);
        }
    }

    /// The streaming step: inline (and the warm-up of the delayed update), or the last step's
    /// weights applied and this one started on the worker.
    pub fn update<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let (uploaded, pieces) = (&mut self.chunk_uploaded, self.gather_in_pieces);
        match &mut self.cpu {
            // The next forward opens the weights as the CPU steps them (`Stream::open`); where a
            // speculation stands, its pieces are stepped already and their weights go up now.
            StreamCpu::Inline(buffers) if self.deferral.enabled() => {
                let speculated = standing(self.speculation.as_mut(), &mut buffers.state, step);
                self.deferral.leave(shared, step, speculated)?;
                // A share staged from host memory starts now, its first pieces going up while
                // the trainer reaches the next forward, whose opening queues the rest.
                if let Some(share) = self.share.as_mut().filter(|share| share.staged()) {
                    let params = (&shared.params, shared.owned.start);
                    let events = (&shared.events.norm_done, &shared.events.compute_done);
                    share.step(&shared.device, step, events, shared.reduced_source(), params)?;
                }
            }
            StreamCpu::Inline(buffers) => {
                let speculated = standing(self.speculation.as_mut(), &mut buffers.state, step);
                let share = self.share.as_mut();
                stream_reduced(shared, buffers, uploaded, pieces, step, speculated, share)?;
            }
            StreamCpu::Delayed(delayed) if step.step() <= delayed.warmup => {
                let (buffers, joined) = delayed.worker.join()?;
                delayed.upload_pending |= joined;
                stream_reduced(shared, buffers, uploaded, pieces, step, None, None)?;
            }
            StreamCpu::Delayed(delayed) => {
                // The step before this one finished meanwhile: its weights go to the device now
                // and the next window computes with them; this step runs in the background.
                if delayed.weights_ahead() {
                    delayed.apply(shared)?;
                }
                delayed.start(shared, *step)?;
            }
        }
        shared.cpu_wait += started.elapsed();
        Ok(())
    }

    /// True if the last step's CPU work is left for the next forward to open.
    pub fn defers(&self) -> bool {
        self.deferral.pending()
    }

    /// Runs the step left for the next forward now, in line (before anything but a forward reads
    /// the weights or the optimizer state).
    pub fn complete<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let (Some((step, _, stepped)), StreamCpu::Inline(buffers)) =
            (self.deferral.take(), &mut self.cpu)
        else {
            return Ok(());
        };
        let started = Instant::now();
        let (uploaded, pieces) = (&mut self.chunk_uploaded, self.gather_in_pieces);
        let share = self.share.as_mut();
        // A speculation that stood still holds its pieces: uploaded once more with the rest.
        let speculated = self.speculation.as_ref().filter(|_| !stepped.is_empty());
        stream_reduced(shared, buffers, uploaded, pieces, &step, speculated, share)?;
        shared.cpu_wait += started.elapsed();
        Ok(())
    }

    /// The step left for this forward, opened to it piece by piece ([`Opening`]; `None` where
    /// none is left), but for the pieces a speculation stepped; and the backward's sink: where
    /// this step speculates ([`assumed`](Stream::sink)), its pieces go to the host and are
    /// stepped there with the optimizer and the staging that the opening hands on once it has
    /// stepped every chunk, before the backward's first piece is reduced.
    pub fn open<'a>(
        &'a mut self,
        at: OpenAt<'a, D, P>,
        assumed: Option<Assumed>,
    ) -> Result<SinkOrOpening<'a, D, P>, EngineError> {
        let Stream { cpu, speculation, deferral, share, .. } = self;
        let (Some((step, opened, stepped)), StreamCpu::Inline(buffers)) = (deferral.take(), cpu)
        else {
            return Ok((Sink::Keep, None));
        };
        let (source, wrap) = (at.source, OpenChunks::Reduced);
        let mut len = at.owned.len();
        let mut pump = None;
        if let Some(share) = share {
            let (device, params) = (at.device, (at.params, at.owned.start));
            let events = (at.events.norm_done, at.events.compute_done);
            if !share.running() {
                share.step(device, &step, events, source, params)?;
            }
            len = share.from();
            // A share staged from host memory is queued between the CPU's chunks.
            if share.staged() {
                pump = Some(Box::new(move |all: bool| match all {
                    true => share.finish(device, source, params),
                    false => share.pump(device, source, params),
                }) as SharePump<'a>);
            }
        }
        let buffers = &mut **buffers;
        // The last step's speculation was validated by that step.
        let speculating = match speculation {
            Some(speculation) => {
                speculation.begin(&mut buffers.state, assumed);
                speculation.active().then_some(speculation)
            }
            None => None,
        };
        let source = (source, len);
        let mut opening = Opening::new(at, step, buffers, source, &stepped, opened, None, wrap)?;
        opening.share = pump;
        let Some(speculation) = speculating else { return Ok((Sink::Keep, Some(opening))) };
        let (handoff, handed) = sync_channel(1);
        let landing = Landing::Step(Speculating { speculation, state: None, upload: None });
        let sink = Sink::Host(Offloader::handed(handed, landing));
        Ok((sink, Some(opening.handing_on(handoff))))
    }

    /// Waits for a delayed step still running and brings its weights into the model.
    pub fn flush<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        match &mut self.cpu {
            StreamCpu::Delayed(delayed) if delayed.weights_ahead() => delayed.apply(shared),
            StreamCpu::Inline(_) | StreamCpu::Delayed(_) => Ok(()),
        }
    }

    /// The master weights (the device share's downloaded after the host's).
    pub fn master(&mut self, device: &D) -> Result<Vec<f32>, EngineError> {
        self.abandon_speculation();
        let (buffers, _) = self.cpu.buffers()?;
        share::master(self.share.as_ref(), device, &buffers.state)
    }

    /// The optimizer state (the device share's downloaded after the host's).
    pub fn state(&mut self, device: &D) -> Result<PathState, EngineError> {
        self.abandon_speculation();
        let (buffers, upload_pending) = self.cpu.buffers()?;
        let [master, exp_avg, exp_avg_sq] =
            share::state(self.share.as_ref(), device, &buffers.state)?;
        Ok(PathState { master, exp_avg, exp_avg_sq, upload_pending })
    }

    /// [`Stream::state`] of the partition `flat`, borrowed, and whether its weights are
    /// pending.
    pub fn view<'a>(
        &'a mut self,
        device: &'a D,
        flat: Range<usize>,
    ) -> Result<(PartView<'a>, bool), EngineError> {
        self.abandon_speculation();
        let (_, upload_pending) = self.cpu.buffers()?;
        let buffers = match &self.cpu {
            StreamCpu::Inline(buffers) => Some(&**buffers),
            StreamCpu::Delayed(delayed) => delayed.worker.ready(),
        };
        let buffers = buffers.ok_or(EngineError::Internal("a joined step is not ready"))?;
        let view = share::view(self.share.as_ref(), device, &buffers.state, flat)?;
        Ok((view, upload_pending))
    }

    /// True if a checkpoint whose newest weights are still on the host cannot resume here: the
    /// inline streaming step has no buffer to upload them from before its first step.
    pub fn refuses_pending(&self) -> bool {
        matches!(self.cpu, StreamCpu::Inline(_))
    }

    /// Takes a checkpoint's state; the delayed step's weights not yet on the device go aside.
    pub fn restore(
        &mut self,
        device: &D,
        state: &SavedState<'_>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        self.abandon_speculation();
        let (buffers, _) = self.cpu.buffers()?;
        share::restore(self.share.as_mut(), device, &mut buffers.state, state)?;
        if let StreamCpu::Delayed(delayed) = &mut self.cpu {
            delayed.upload_pending = upload_pending;
            // Where the streaming delayed update keeps weights not yet on the device.
            let (buffers, _) = delayed.worker.join()?;
            let weights: Vec<P> = buffers.state.master.iter().map(|m| P::from_f32(*m)).collect();
            super::shared::overwrite(device, &delayed.params, &weights)?;
        }
        Ok(())
    }
}

impl<D: DeviceAdamW, P: Float> DelayedStream<D, P> {
    /// True if the optimizer's weights have not reached the device yet.
    fn weights_ahead(&self) -> bool {
        self.upload_pending || self.worker.is_stepping()
    }

    /// Joins the worker and copies its weights, left on the device, into this rank's partition
    /// of the weights, then gathers: after the worker's uploads on the same stream, and before
    /// the next one writes there (same stream again).
    fn apply<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        self.worker.join()?;
        self.upload_pending = false;
        shared.h2d_after_weights_free()?;
        let h2d = shared.device.stream(StreamKind::H2d);
        let (len, at) = (shared.owned.len(), shared.owned.start);
        shared.device.copy_d2d(h2d, &self.params, 0..len, &shared.params, at)?;
        // The copies of the delayed step read the gradients set aside: done (joined).
        shared.record_d2h_done()?;
        shared.gather_from(StreamKind::H2d)
    }

    /// Sets this step's reduced gradients aside on the device and starts the worker, which
    /// streams them through the CPU into the aside weights while the GPU runs the next forward
    /// and backward.
    fn start<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: AdamWStep,
    ) -> Result<(), EngineError> {
        let (source, at) = shared.reduced_source();
        let len = shared.owned.len();
        let device = &shared.device;
        let (comm, d2h) = (device.stream(StreamKind::Comm), device.stream(StreamKind::D2h));
        // After the norm (same stream), and after the last delayed step's copies read the copy.
        if let Some(read) = &shared.events.d2h_done {
            device.wait_event(comm, read)?;
        }
        device.copy_d2d(comm, source, at..at + len, &self.grads, 0)?;
        device.record(&mut self.aside_taken, comm)?;
        device.wait_event(d2h, &self.aside_taken)?;
        // The next backward overwrites the gradients only after the copy above read them.
        shared.record_comm_done()?;
        let device = shared.device.clone();
        let (grads, next) = (Arc::clone(&self.grads), Arc::clone(&self.params));
        self.worker.start(move |buffers| {
            let StreamBuffers { state, staging, outgoing } = buffers;
            // The weights stay aside until the next step applies and gathers them.
            let uploaded = &mut |_| Ok(());
            // On its own thread: not the training thread's time, but said at debug level.
            let begun = Instant::now();
            let times = &mut StepTimes::default();
            let (source, target) = (&*grads, &*next);
            let chunks =
                Chunks { state_at: 0, source, source_at: 0, target, target_at: 0, uploaded, times };
            stream_chunks(&device, &step, state, staging, outgoing, chunks, len)?;
            // Wait for the last uploads.
            outgoing.iter_mut().for_each(HostBuffer::settle);
            trace_worker("delayed", begun, times);
            Ok(())
        })
    }
}

/// What [`Stream::open`] borrows from the engine for one forward.
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
    /// speculation ([`Stream::open`]).
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
    /// the rest (`true`, [`DeviceShare::finish`]) once the forward reaches its weights.
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
            OpenChunks::Reduced(chunks) => chunks.len,
            OpenChunks::Summed(chunks) => chunks.len,
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

/// [`stream_step`] from this step's reduced gradients, where the reduction left them.
fn stream_reduced<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &mut Shared<D, C, P>,
    buffers: &mut StreamBuffers<P>,
    uploaded_event: &mut D::Event,
    gather_in_pieces: bool,
    step: &AdamWStep,
    speculated: Option<&Speculation<P>>,
    mut share: Option<&mut DeviceShare<D>>,
) -> Result<(), EngineError> {
    let mut times = std::mem::take(&mut shared.step_times);
    let (source, at) = shared.reduced_source();
    let mut len = shared.owned.len();
    if let Some(share) = share.as_deref_mut() {
        let params = (&shared.params, shared.owned.start);
        let events = (&shared.events.norm_done, &shared.events.compute_done);
        // (A staged share's step left to the next forward may have started at the step.)
        if !share.running() {
            share.step(&shared.device, step, events, (source, at), params)?;
        }
        // A share staged from host memory: all of it now, before the CPU's chunks (its last
        // pieces' gathers wait for it; only the next forward's opening queues it between them).
        share.finish(&shared.device, (source, at), params)?;
        len = share.from();
    }
    let io = StepIo { source, at, len, uploaded_event, gather_in_pieces, times: &mut times };
    let gathered = stream_step(shared, buffers, io, step, speculated, share.as_deref());
    shared.step_times = times;
    finish_stream_step(shared, gathered?)
}

/// The gradients a streaming step reads (`source` from element `at`: this rank's partition of
/// them), the event its pieces' gathers wait on, whether it gathers in pieces, and where the
/// training thread's time goes.
pub(super) struct StepIo<'a, D: Device, G: Float> {
    pub(super) source: &'a D::Buffer<G>,
    pub(super) at: usize,
    /// The partition's elements the CPU steps, from the first (all but a device share).
    pub(super) len: usize,
    pub(super) uploaded_event: &'a mut D::Event,
    pub(super) gather_in_pieces: bool,
    pub(super) times: &'a mut StepTimes,
}

/// The streaming CPU step, inline (see [`stream_chunks`]): from this rank's gradients on the
/// device (`io`: the reduced gradients, or the window's sum) to the updated weights in this
/// rank's partition of the flat weights, and into the other ranks' copies piece by piece: each
/// piece, once uploaded, goes from every rank to every rank on the comm stream (one broadcast
/// per rank, the same piece of each partition), while the CPU steps the next chunks
/// ([`PieceGather`]). Only the last piece's gather is left when the CPU is done, not the whole
/// partition's. Where a speculation stands, its pieces are stepped already: their weights are
/// uploaded from where it keeps them, and only the rest is streamed. Gives whether the pieces
/// were gathered, for [`finish_stream_step`].
pub(super) fn stream_step<D: DeviceAdamW, C: Comm<Device = D>, P: Float, G: Float>(
    shared: &Shared<D, C, P>,
    buffers: &mut StreamBuffers<P, G>,
    io: StepIo<'_, D, G>,
    step: &AdamWStep,
    speculated: Option<&Speculation<P>>,
    share: Option<&DeviceShare<D>>,
) -> Result<bool, EngineError> {
    let Shared { ref device, ref comm, ref params, ref events, ref owned, ref layout, .. } =
        *shared;
    let StepIo { source, at, len, uploaded_event, gather_in_pieces, times } = io;
    let h2d = device.stream(StreamKind::H2d);
    order_for_step(device, &events.norm_done, &events.compute_done, events.params_ready.as_ref())?;
    // The gathers write the other ranks' partitions, which the last forward/backward read.
    let gathers = gather_in_pieces && owned.len() < layout.padded_len();
    if gathers {
        device.wait_event(device.stream(StreamKind::Comm), &events.compute_done)?;
    }
    let partition = owned.len();
    let mut gather = PieceGather::new(device, comm, params, uploaded_event, partition, gathers);
    let stepped = speculated.map_or(&[][..], Speculation::stepped);
    let StreamBuffers { state, staging, outgoing } = buffers;
    for (segment, speculated_at) in segments(len, stepped) {
        let target_at = owned.start + segment.start;
        if let (Some(from), Some(weights)) =
            (speculated_at, speculated.and_then(Speculation::weights))
        {
            let len = segment.len();
            device.copy_h2d(h2d, weights, from..from + len, params, target_at)?.detach();
            gather.uploaded(segment)?;
            continue;
        }
        let offset = segment.start;
        let uploaded = &mut |r: Range<usize>| gather.uploaded(offset + r.start..offset + r.end);
        let times = &mut *times;
        let source_at = at + offset;
        let (state_at, target) = (offset, params);
        let chunks = Chunks { state_at, source, source_at, target, target_at, uploaded, times };
        stream_chunks(device, step, state, staging, outgoing, chunks, segment.len())?;
    }
    // The device share's weights (the partition from `len` on), written on the compute stream
    // before the CPU's, go to the other ranks once that step is done: in the gather's last
    // pieces, or with the whole partition after the step (`finish_stream_step`).
    if let Some(share) = share
        && partition < layout.padded_len()
    {
        share.order_after_step(device, StreamKind::Comm)?;
        gather.uploaded(len..partition)?;
    }
    Ok(gathers)
}

/// Orders the streams a streaming step copies on: the d2h stream after `norm_done` (the comm
/// stream computed the norm over the final gradients), the h2d stream after `compute_done` and
/// `params_ready` (the last forward/backward and the last upload or gather are past the weights).
fn order_for_step<D: Device>(
    device: &D,
    norm_done: &D::Event,
    compute_done: &D::Event,
    params_ready: Option<&D::Event>,
) -> Result<(), EngineError> {
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    device.wait_event(d2h, norm_done)?;
    device.wait_event(h2d, compute_done)?;
    if let Some(written) = params_ready {
        device.wait_event(h2d, written)?;
    }
    Ok(())
}

/// After [`stream_step`]: the next backward overwrites the gradients only after its copies read
/// them; the weights are current once the last piece's gather is done (`gathered`), or after
/// the gather of the whole partition queued here.
pub(super) fn finish_stream_step<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &mut Shared<D, C, P>,
    gathered: bool,
) -> Result<(), EngineError> {
    shared.record_d2h_done()?;
    if !gathered {
        return shared.gather_from(StreamKind::H2d);
    }
    shared.record_params_ready(StreamKind::Comm)
}

/// The streaming step's gather in pieces: every rank's partition is cut into the same pieces
/// (of [`GATHER_PIECE`] elements, or an eighth of the partition where that is less), and each
/// piece goes from every rank to every rank once this rank's uploads cover it. The pieces do not
/// depend on how the uploads are cut (chunks, speculated pieces), so the ranks' collectives match.
struct PieceGather<'a, D: Device, C: Comm<Device = D>, P: Float> {
    device: &'a D,
    comm: &'a C,
    params: &'a D::Buffer<P>,
    uploaded_event: &'a mut D::Event,
    partition: usize,
    piece_len: usize,
    /// Uploads are queued for the partition up to here.
    uploaded_to: usize,
    /// Pieces are gathered up to here.
    gathered_to: usize,
    enabled: bool,
}

impl<'a, D: Device, C: Comm<Device = D>, P: Float> PieceGather<'a, D, C, P> {
    fn new(
        device: &'a D,
        comm: &'a C,
        params: &'a D::Buffer<P>,
        uploaded_event: &'a mut D::Event,
        partition: usize,
        enabled: bool,
    ) -> Self {
        let piece_len = GATHER_PIECE.min(partition.div_ceil(8)).max(1);
        let (uploaded_to, gathered_to) = (0, 0);
        PieceGather {
            device,
            comm,
            params,
            uploaded_event,
            partition,
            piece_len,
            uploaded_to,
            gathered_to,
            enabled,
        }
    }

    /// The upload of `range` of the partition (the next after the last) is queued on the h2d
    /// stream (or, for the device share's, the comm stream waits for its step): gathers the
    /// pieces it completes.
    fn uploaded(&mut self, range: Range<usize>) -> Result<(), EngineError> {
        if !self.enabled {
            return Ok(());
        }
        if range.start != self.uploaded_to {
            return Err(EngineError::Internal("the streaming step's uploads skipped a range"));
        }
        self.uploaded_to = range.end;
        let (device, comm_stream) = (self.device, self.device.stream(StreamKind::Comm));
        let mut recorded = false;
        while self.gathered_to < self.partition {
            let end = (self.gathered_to + self.piece_len).min(self.partition);
            if end > self.uploaded_to {
                break;
            }
            if !recorded {
                device.record(self.uploaded_event, device.stream(StreamKind::H2d))?;
                device.wait_event(comm_stream, self.uploaded_event)?;
                recorded = true;
            }
            for root in 0..self.comm.world_size() {
                let at = root * self.partition;
                let piece = at + self.gathered_to..at + end;
                self.comm.broadcast(comm_stream, self.params, piece, root)?;
            }
            self.gathered_to = end;
        }
        Ok(())
    }
}

/// Where the streaming step reads gradients and writes weights: `len` elements of each, from
/// element `source_at` of `source` and `target_at` of `target`, stepping the optimizer's state
/// from `state_at`; `uploaded` hears of each chunk (its range from the first element) once its
/// upload is queued on the h2d stream (the engine gathers
/// it from there); `times` adds up where the calling thread's time went. The gradients are `G`:
/// the model's `P`, or ZenFlow's `f32` window.
pub(super) struct Chunks<'a, D: Device, G: Float, P: Float> {
    /// Where the elements start in the optimizer's state (the partition).
    pub(super) state_at: usize,
    pub(super) source: &'a D::Buffer<G>,
    pub(super) source_at: usize,
    pub(super) target: &'a D::Buffer<P>,
    pub(super) target_at: usize,
    pub(super) uploaded: &'a mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    pub(super) times: &'a mut StepTimes,
}

/// Says at debug level how long a CPU step on a worker (`path`: the delayed update's or
/// ZenFlow's) took since `begun`, and where: chunk waits, upload waits, the AdamW.
pub(super) fn trace_worker(path: &'static str, begun: Instant, times: &StepTimes) {
    let StepTimes { chunk_wait, upload_wait, adam, .. } = *times;
    let took = begun.elapsed();
    tracing::debug!(path, ?took, ?chunk_wait, ?upload_wait, ?adam, "CPU step on the worker");
}

/// The streaming CPU step over `len` elements of a partition, all of it: [`ChunkStream`] run to
/// its end.
pub(super) fn stream_chunks<'a, D: Device, G: Float, P: Float>(
    device: &'a D,
    step: &AdamWStep,
    optimizer: &'a mut HostOptimizer,
    staging: &'a mut [HostBuffer<G>],
    outgoing: &'a mut [HostBuffer<P>],
    io: Chunks<'a, D, G, P>,
    len: usize,
) -> Result<(), EngineError> {
    ChunkStream::new(device, *step, optimizer, staging, outgoing, io, len, &[]).advance(len)
}

/// The streaming CPU step over `len` elements of a partition, advanced as far as its caller
/// asks ([`ChunkStream::advance`]): the gradients go to the host chunk by chunk on the d2h stream
/// (up to [`STAGING_BUFFERS`] chunks ahead), the CPU steps each chunk as soon as its copy's token
/// has been waited on, writing the new weights as `P` into an outgoing buffer, and that buffer's
/// upload on the h2d stream starts at once, overlapping the next chunks. The caller orders the
/// d2h stream after the gradients' writers and the h2d stream after the target's readers; the
/// uploads are not waited for (each outgoing buffer remembers its copy, and its next write waits
/// for it).
pub(super) struct ChunkStream<'a, D: Device, G: Float, P: Float> {
    device: &'a D,
    step: AdamWStep,
    optimizer: &'a mut HostOptimizer,
    outgoing: &'a mut [HostBuffer<P>],
    io: Chunks<'a, D, G, P>,
    free: StagingSlots<'a, G>,
    in_flight: [Option<Filling<'a, G>>; STAGING_BUFFERS],
    len: usize,
    /// The chunks to step, in order: the `len` elements cut into pieces of at most a staging
    /// buffer, around the ranges stepped already (a speculation's, [`ChunkStream::new`]).
    pieces: Vec<Range<usize>>,
    /// Chunks whose copy is queued, and chunks stepped (and their uploads queued).
    issued: usize,
    stepped: usize,
}

/// The staging buffers a chunk stream or an offloader holds, each `None` while its copy is in
/// flight.
pub(crate) type StagingSlots<'a, G> = [Option<&'a mut HostBuffer<G>>; STAGING_BUFFERS];

/// What an [`Opening`] hands the backward's speculation once it has stepped everything: the
/// optimizer and the staging buffers, which the speculation steps and copies through while the
/// backward runs (`offloader.rs`).
pub(crate) type Handoff<'a, G> = (&'a mut HostOptimizer, StagingSlots<'a, G>);

impl<'a, D: Device, G: Float, P: Float> ChunkStream<'a, D, G, P> {
    /// The stream over `len` elements but the ranges in `stepped` (sorted and disjoint, within
    /// `len`: stepped already, their weights uploaded by the caller), which it leaves alone.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        device: &'a D,
        step: AdamWStep,
        optimizer: &'a mut HostOptimizer,
        staging: &'a mut [HostBuffer<G>],
        outgoing: &'a mut [HostBuffer<P>],
        io: Chunks<'a, D, G, P>,
        len: usize,
        stepped: &[Range<usize>],
    ) -> Self {
        let chunk = staging.first().map_or(1, |b| b.len()).max(1);
        let free = {
            let mut buffers = staging.iter_mut();
            std::array::from_fn(|_| buffers.next())
        };
        let in_flight = Default::default();
        let mut pieces = Vec::with_capacity(len.div_ceil(chunk) + stepped.len());
        let mut cut = |range: Range<usize>| {
            let mut start = range.start;
            while start < range.end {
                let end = (start + chunk).min(range.end);
                pieces.push(start..end);
                start = end;
            }
        };
        let mut cursor = 0;
        for range in stepped {
            cut(cursor..range.start.min(len));
            cursor = cursor.max(range.end);
        }
        cut(cursor..len);
        ChunkStream {
            device,
            step,
            optimizer,
            outgoing,
            io,
            free,
            in_flight,
            len,
            pieces,
            issued: 0,
            stepped: 0,
        }
    }

    /// Elements done so far, from the first: stepped (their uploads queued) or left alone.
    pub(super) fn done(&self) -> usize {
        self.pieces.get(self.stepped).map_or(self.len, |piece| piece.start)
    }

    fn piece(&self, c: usize) -> Range<usize> {
        self.pieces[c].clone()
    }

    /// The optimizer and the staging buffers back, every chunk stepped ([`Handoff`]).
    pub(super) fn release(self) -> Handoff<'a, G> {
        (self.optimizer, self.free)
    }

    /// Steps chunks until the first `to` elements (at most all) are stepped and their uploads
    /// queued.
    pub(super) fn advance(&mut self, to: usize) -> Result<(), EngineError> {
        let (d2h, h2d) = (self.device.stream(StreamKind::D2h), self.device.stream(StreamKind::H2d));
        let chunks = self.pieces.len();
        while self.done() < to.min(self.len) {
            let c = self.stepped;
            // Keep the d2h stream busy: every free staging buffer receives the next chunk.
            while self.issued < chunks {
                let Some(buffer) = self.free.iter_mut().find_map(Option::take) else { break };
                let range = self.piece(self.issued);
                let from = self.io.source_at + range.start..self.io.source_at + range.end;
                let filling = self.device.copy_d2h(d2h, self.io.source, from, buffer, 0)?;
                self.in_flight[self.issued % STAGING_BUFFERS] = Some(filling);
                self.issued += 1;
            }
            let range = self.piece(c);
            let filling = self.in_flight[c % STAGING_BUFFERS].take().expect("issued above");
            let times = &mut *self.io.times;
            let waiting = Instant::now();
            let staged = filling.wait()?;
            times.chunk_wait += waiting.elapsed();
            let grads = as_grads(&staged[..range.len()])
                .ok_or(EngineError::Internal("the streaming step reads f32 or bf16 gradients"))?;
            // Waits for the upload that last read this buffer (its token was let go below).
            let waiting = Instant::now();
            let out = &mut self.outgoing[c % OUTGOING_BUFFERS][..range.len()];
            let stepping = Instant::now();
            times.upload_wait += stepping - waiting;
            let in_state = self.io.state_at + range.start..self.io.state_at + range.end;
            self.optimizer.step_range(&self.step, in_state, grads, out)?;
            times.adam += stepping.elapsed();
            let outgoing_buffer = &self.outgoing[c % OUTGOING_BUFFERS];
            let target = self.io.target_at + range.start;
            let draining = self.device.copy_h2d(
                h2d,
                outgoing_buffer,
                0..range.len(),
                self.io.target,
                target,
            )?;
            // Not waited on here: the buffer remembers the copy, and its next write (two chunks
            // on, or the next step) waits for it. That is what lets the upload overlap the CPU.
            draining.detach();
            (self.io.uploaded)(range)?;
            *self.free.iter_mut().find(|slot| slot.is_none()).expect("a slot is empty") =
                Some(staged);
            self.stepped += 1;
        }
        Ok(())
    }
}
