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
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, HostBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use super::chunks::{Chunks, StepIo, finish_stream_step, stream_chunks, stream_step, trace_worker};
use super::opening::{Deferral, OpenAt, OpenChunks, Opening, SharePump};
use super::path::SinkOrOpening;
use super::share::{self, DeviceShare};
use super::shared::Shared;
use super::state::{PathState, SavedState};
use crate::EngineError;
use crate::checkpoint::PartView;
use crate::device_adamw::DeviceAdamW;
use crate::host::{StepTimes, StreamBuffers, Worker};
use crate::offloader::{Landing, Offloader, Speculating};
use crate::reduction::Sink;
use crate::speculation::{Assumed, Speculation, standing};

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
        let opening =
            Opening::new(at, step, buffers, source, &stepped, opened, None, wrap)?.with_share(pump);
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
