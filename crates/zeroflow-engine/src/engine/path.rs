//! The update path: where each reduced bucket goes during backward, how the gradient norm is
//! taken, how the weights are updated and what a checkpoint holds. One of four types, chosen
//! once from the options ([`UpdatePath::new`]):
//!
//! | path | options | the CPU step |
//! |---|---|---|
//! | [`DeviceUpdate`] | `Placement::Device` | none: AdamW on the compute stream |
//! | [`Accumulate`] | offload, `Exact`/`Delayed`, gradient accumulation or f16 (and not `Summed`) | inline (the speculated pieces stepped during the last backward), or delayed after the warm-up |
//! | [`Summed`] | offload, `Exact`, ZeRO-2 with gradient accumulation summed on the device, f32 or bf16 | streamed inline from the device sum (the speculated pieces stepped during the last backward), or by the next window's first forward as it opens the weights (one rank, `overlap_forward`) |
//! | [`Stream`] | offload, `Exact`/`Delayed`, one micro-step, f32 or bf16 | streamed inline (the speculated pieces stepped during backward), or on a worker after the warm-up |
//! | [`ZenFlowUpdate`] | offload, `ZenFlow` | once per window: inline, or on a worker (`overlap_step`) |
//!
//! Every hand-off between streams is an event recorded on one stream and waited on by another.
//! Where each is recorded and waited on:
//!
//! | event (owner) | recorded | waited on |
//! |---|---|---|
//! | `bucket_ready` (shared) | compute, per bucket (`reduction.rs`) | comm, right after |
//! | `reduced` (one per bucket, sent to the courier) | comm, per bucket, accumulating offload (with the device sum: the window's last backward, after the add), and the streaming exact step's pieces it speculates on (`reduction.rs`) | d2h, by the courier before the bucket's copies (`courier.rs`; the mutation self-check skips it) |
//! | `comm_done` (shared) | comm (`Shared::record_comm_done`): after a reducing backward; delayed stream: also after the set-aside copy | compute, at the next backward |
//! | `d2h_done` (shared) | d2h (`Shared::record_d2h_done`): after a reducing backward with offload; stream: after the step's copies, and when a delayed step is applied | compute, at the next backward (a step left to the forward: at its final open); comm, before the delayed stream's set-aside copy and before the device sum is cleared (`accumulate.rs`, `summed.rs`, or a `Summed` step's final open) |
//! | `params_ready` (shared) | `Shared::record_params_ready`: on the partition's writer, then on comm after the gather (`Shared::gather_from`); inline stream with pieces: on comm after the last piece | compute, at the next backward; h2d, before an upload |
//! | `compute_done` (shared) | compute, at the start of every step (`Engine::step`) | comm (norm on the device, gathers), h2d (uploads) |
//! | `norm_done` (shared) | comm, after the norm (and its all-reduce) (`sum_to_host`) | d2h (its copy; inline stream's first chunk); compute (ZenFlow's device step) |
//! | `accumulated` (device) | comm, at the step | compute, before AdamW |
//! | `optimizer_done` (device) | compute, after AdamW | comm, before zeroing the accumulator |
//! | `chunk_uploaded` (stream) | h2d, after each gathered piece's upload | comm, before its broadcasts |
//! | `aside_taken` (delayed stream) | comm, after the set-aside copy | d2h, before the worker's copies |
//! | `window_ready` (ZenFlow) | compute: after the window add, and before the window norm's and the importances' reads (`sum_to_host`) | d2h, before the CPU step's copies of the window (inline, or set aside) and the reads |
//! | `window_copied` (ZenFlow's host path) | d2h, after the window's copy into the host accumulator and its clear | compute, before the next window add |
//! | `device_done` (ZenFlow) | compute, after the device step | h2d, before the CPU's weights are applied |
//! | `applied` (one per piece, ZenFlow's host path with `overlap_forward`) | h2d, after a piece of the CPU's weights and the device's columns over the blocks it completes (`AppliedPieces`) | compute, before the forward reads the piece's weights (`AppliedOpening`) |
//!
//! The host side waits by tokens, not events: a staged piece is added only after its copy's
//! [`zeroflow_device::Filling`] is waited on, and detached tokens (the streamed uploads, ZenFlow's
//! included) are waited on by the host buffer at its next access.

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{Comm, HostMemory};
use zeroflow_optim::{AdamWStep, CpuAdam, NoDecay, SimdLevel, Stores};

pub(super) use super::accumulate::{Accumulate, DeviceSum};
pub(super) use super::device::DeviceUpdate;
pub(super) use super::opening::{OpenAt, Opening};
use super::share::{DeviceShare, staged_piece};
use super::shared::Shared;
use super::state::{PathState, Restore, SavedState};
pub(super) use super::stream::Stream;
pub(super) use super::summed::Summed;
pub(super) use super::zenflow::{ZenFlowRestore, ZenFlowUpdate};
use super::zenflow_host::{AppliedOpening, AppliedPieces, HostSide};
use crate::checkpoint::{Elements, MomentView, PartView};
use crate::device_adamw::DeviceAdamW;
use crate::host::{Delayed, HostAccumulator, HostParts, StreamBuffers, ZenFlowHost};
use crate::memory::{device_share_len, sums_on_device};
use crate::reduction::Sink;
use crate::speculation::{Assumed, Speculation, SpeculationStats};
use crate::zenflow::ZenFlowSnapshot;
use crate::{
    EngineError, EngineOptions, Offload, OffloadUpdate, Placement, ZenFlowAside, ZenFlowOptions,
};

/// The elements of the partition `owned` of `layout` that take no weight decay
/// ([`ParamView::takes_weight_decay`](zeroflow_core::layout::ParamView::takes_weight_decay)),
/// counted from its start.
pub(crate) fn no_decay(layout: &FlatLayout, owned: &Range<usize>) -> NoDecay {
    let params = layout.params().iter().filter(|param| !param.takes_weight_decay());
    NoDecay::new(params.map(|param| param.flat_range()).collect()).within(owned.clone())
}

/// A backward's sink and the exact step left for its forward to open (`Stream::open`,
/// `Summed::open`).
pub(super) type SinkOrOpening<'a, D, P> = (Sink<'a, D, P>, Option<Opening<'a, D, P>>);

/// A backward's sink and what its forward opens ([`UpdatePath::sink_or_open`]).
pub(super) type SinkOrOpen<'a, D, P> = (Sink<'a, D, P>, Option<Open<'a, D, P>>);

/// What the next forward opens as it reaches the weights ([`crate::ModelIo::open`]): the exact
/// step left to it ([`Opening`]: the CPU steps the weights then), or ZenFlow's weights applied
/// from host memory in pieces ([`AppliedOpening`]: the forward waits for their copies).
// One lives on the stack for one backward: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Open<'a, D: DeviceAdamW, P: Float> {
    Step(Opening<'a, D, P>),
    Applied(AppliedOpening<'a, D, P>),
}

impl<D: DeviceAdamW, P: Float> Open<'_, D, P> {
    /// [`crate::ModelIo::open`]: the weights below flat `end`.
    pub fn open(&mut self, end: usize) {
        match self {
            Open::Step(opening) => opening.open(end),
            Open::Applied(opening) => opening.open(end),
        }
    }

    /// Ends the opening after the model: whether the model opened everything itself (else the
    /// first error), and the time spent on the CPU's step.
    pub fn end(self) -> (Result<bool, EngineError>, std::time::Duration) {
        match self {
            Open::Step(opening) => opening.end(),
            Open::Applied(opening) => (opening.end(), std::time::Duration::ZERO),
        }
    }
}

/// The engine's update path (see the module documentation).
pub(super) enum UpdatePath<D: DeviceAdamW, P: Float> {
    Device(DeviceUpdate<D>),
    Accumulate(Accumulate<D, P>),
    Stream(Stream<D, P>),
    Summed(Summed<D, P>),
    ZenFlow(Box<ZenFlowUpdate<D, P>>),
}

/// Where the optimizer's device share cannot act (`UpdatePath::new`).
const SHARE_REFUSED: EngineError = EngineError::Config(
    "the optimizer's device share (--device-share, ZEROFLOW_DEVICE_SHARE, \
     zeroflow.offload.device_share) acts on the exact offload step: with one micro-step per \
     step, or with a window summed on the device (ZeRO-2 with --accumulate-on device, \
     ZEROFLOW_ACCUMULATE_ON=device or zeroflow.offload.accumulate_on \"device\") where one rank \
     holds every weight (one GPU, or ZeRO-0): set it to 0 for this run",
);

/// The CPU AdamW of an offload path: its threads; the stores of the weights it writes out (a
/// streamed chunk is uploaded as soon as it is written: from the caches; a whole partition's copy
/// is too big for them: past them, without reading its lines); its rounding draws of bf16
/// moments keyed by the element's index in the model; the elements that take no decay.
fn cpu_adam<P: Float>(
    opts: &EngineOptions,
    offload: &Offload,
    owned: &Range<usize>,
    no_decay: &NoDecay,
) -> Result<CpuAdam, EngineError> {
    let zenflow = matches!(offload.update, OffloadUpdate::ZenFlow(_));
    let zenflow_streams = zenflow && offload.stream.zenflow_aside == ZenFlowAside::Device;
    let default_stores = if opts.streams(P::DTYPE) || zenflow_streams {
        Stores::Normal
    } else {
        Stores::NonTemporal
    };
    Ok(CpuAdam::new(offload.cpu_threads.max(1), SimdLevel::detect())?
        .with_copy_stores(offload.stream.copy_stores.unwrap_or(default_stores))
        .with_rounding_offset(owned.start)
        .with_no_decay(no_decay.clone()))
}

/// What the offload paths are built from besides their host side ([`UpdatePath::new`]).
struct OffloadPath<'a, D> {
    device: &'a D,
    layout: &'a FlatLayout,
    opts: &'a EngineOptions,
    offload: &'a Offload,
}

impl<D: DeviceAdamW> OffloadPath<'_, D> {
    /// ZenFlow's path: its CPU step streams the device's window through bounded staging (inline,
    /// or on a worker with `overlap_step`), or the window is copied into the host accumulator
    /// at its end (no staging: nothing goes out bucket by bucket), `overlap_step` its delayed
    /// update from the first window on, with the one accumulator (the worker is joined before
    /// the next window's copy).
    fn zenflow<P: Float>(
        &self,
        zenflow: &ZenFlowOptions,
        parts: HostParts<P>,
    ) -> Result<UpdatePath<D, P>, EngineError> {
        let (device, stream) = (self.device, &self.offload.stream);
        let (owned, memory) = (parts.owned.clone(), parts.memory);
        let host = match stream.zenflow_aside {
            ZenFlowAside::Device => HostSide::Streamed(ZenFlowHost::new(device, parts)?),
            ZenFlowAside::Host => {
                let delayed = zenflow.overlap_step.then_some(Delayed { warmup: 0, spare: false });
                // The window is copied straight into the accumulator.
                let host = HostAccumulator::new(device, parts, 1, memory, delayed)?;
                HostSide::Accumulated(host)
            }
        };
        // The next forward opens the host path's weights in pieces where this rank holds them
        // all (nothing to gather).
        let one = owned.len() == self.layout.padded_len() && stream.overlap_forward;
        let on_host = matches!(host, HostSide::Accumulated(_));
        let pieces = (one && on_host).then(|| AppliedPieces::new(stream.chunk));
        let adamw = self.opts.adamw;
        let path = ZenFlowUpdate::new(device, self.layout, &owned, zenflow, adamw, host, pieces)?;
        Ok(UpdatePath::ZenFlow(Box::new(path)))
    }

    /// The exact path (`delayed` none) or the delayed update's: streamed (one micro-step), from
    /// the window's sum on the device, or through the host accumulator; with a device share and
    /// the speculation where they act.
    fn exact_or_delayed<P: Float>(
        &self,
        delayed: Option<u64>,
        no_decay: &NoDecay,
        mut parts: HostParts<P>,
    ) -> Result<UpdatePath<D, P>, EngineError> {
        let (device, opts, stream) = (self.device, self.opts, &self.offload.stream);
        let len = parts.len;
        let holds_all = len == self.layout.padded_len();
        // Only the exact update speculates: the delayed one already hides the CPU step.
        let budget = if delayed.is_none() { stream.speculation_budget } else { 0 };
        // The device share acts on the exact streaming step: one micro-step (on every rank's
        // partition), or the window's sum on the device where one rank holds every weight; the
        // speculation, if any, steps the host's elements only.
        let on_device = sums_on_device(opts, stream.accumulate_on, len, || device.free_memory());
        let (streaming, summed) = (opts.streams(P::DTYPE), opts.streams_sum(P::DTYPE, on_device));
        let share = stream.device_share;
        if share > 0.0 && !opts.shares(P::DTYPE, on_device, holds_all) {
            return Err(SHARE_REFUSED);
        }
        // The streaming steps keep the speculated pieces' weights until their upload; a device
        // share's elements (the partition's last) are stepped on the device, not speculated on.
        let host_len = len - device_share_len(len, share);
        let with_weights = streaming || summed;
        let speculation = Speculation::new(device, host_len, budget, with_weights, parts.memory)?;
        let pieces = stream.gather_in_pieces;
        if !with_weights {
            let bucket = opts.reduce_bucket;
            let (on, chunk, memory) = (stream.accumulate_on, parts.chunk, parts.memory);
            let on_device = DeviceSum::new(device, opts, on, len, bucket.min(chunk), memory)?;
            // Only the CPU adds into the accumulator (from staging): pageable. The micro-steps
            // of the next window add into the spare while the worker steps.
            let delayed = delayed.map(|warmup| Delayed { warmup, spare: true });
            let host = HostAccumulator::new(device, parts, bucket, HostMemory::Pageable, delayed)?;
            return Ok(UpdatePath::Accumulate(Accumulate { host, speculation, on_device }));
        }
        // The next forward opens the exact inline step's weights only where this rank holds
        // them all (nothing to gather). A speculation beside it takes the state from the opening
        // once it is done (the streaming path's), or steps the window's last backward, after its
        // first forward's opening (the path summed on the device).
        let overlap = stream.overlap_forward && delayed.is_none() && holds_all;
        // The device share, the partition's last elements, keeps its state on the device only:
        // the host optimizer holds the elements before it. Its staging takes the window's f32
        // sum (summed) or the gradients (streamed).
        let share_initial = &parts.initial[parts.owned.start + host_len..parts.owned.end];
        let place = (stream.device_share_state, staged_piece(parts.chunk));
        let share =
            DeviceShare::new(device, host_len, share_initial, parts.moments, no_decay, place)?;
        parts.len = host_len;
        if summed {
            let buffers = StreamBuffers::new(device, parts)?;
            let path = Summed::new(device, buffers, len, pieces, speculation, overlap)?;
            return Ok(UpdatePath::Summed(path.with_share(share)));
        }
        let buffers = StreamBuffers::new(device, parts)?;
        let path = Stream::new(device, buffers, delayed, len, pieces, speculation, overlap)?;
        Ok(UpdatePath::Stream(path.with_share(share)))
    }
}

impl<D: DeviceAdamW, P: Float> UpdatePath<D, P> {
    /// The path the options ask for, with its buffers, for the partition `owned` of the
    /// `initial` weights (dropped once they are in the master weights, on the host and in a
    /// device share).
    pub fn new(
        device: &D,
        layout: &FlatLayout,
        owned: &Range<usize>,
        opts: &EngineOptions,
        initial: Vec<P>,
    ) -> Result<Self, EngineError> {
        // The partition's elements of 1-D parameters (norms' weights, biases) take no decay.
        let no_decay = no_decay(layout, owned);
        let offload = match &opts.placement {
            Placement::Device => {
                let master: Vec<f32> = initial[owned.clone()].iter().map(|p| p.to_f32()).collect();
                drop(initial);
                return Ok(UpdatePath::Device(DeviceUpdate::new(device, &master, no_decay)?));
            }
            Placement::Offload(offload) => offload,
        };
        if offload.stream.device_share > 0.0 && offload.update != OffloadUpdate::Exact {
            return Err(SHARE_REFUSED);
        }
        let parts = HostParts {
            initial,
            owned: owned.clone(),
            len: owned.len(),
            chunk: offload.stream.chunk,
            memory: offload.memory,
            adam: cpu_adam::<P>(opts, offload, owned, &no_decay)?,
            moments: offload.moments,
        };
        let path = OffloadPath { device, layout, opts, offload };
        match offload.update {
            OffloadUpdate::ZenFlow(zenflow) => path.zenflow(&zenflow, parts),
            OffloadUpdate::Exact => path.exact_or_delayed(None, &no_decay, parts),
            OffloadUpdate::Delayed { warmup } => {
                path.exact_or_delayed(Some(warmup), &no_decay, parts)
            }
        }
    }

    /// Where the reduced gradient pieces of a backward go; `boundary`: the backward ends an
    /// optimizer step, `assumed` the step the exact offload step speculates on then.
    pub fn sink(&mut self, assumed: Option<Assumed>, boundary: bool) -> Sink<'_, D, P> {
        match self {
            UpdatePath::Device(device) => Sink::Device(&device.grad_acc),
            UpdatePath::Accumulate(a) => a.sink(assumed, boundary),
            UpdatePath::Stream(s) => s.sink(assumed),
            UpdatePath::Summed(s) => s.sink(assumed, boundary),
            // ZenFlow adds each step into its window on the device at the step.
            UpdatePath::ZenFlow(_) => Sink::Keep,
        }
    }

    /// True if the last step's CPU work is left for the next forward to open (`Stream::open`,
    /// `Summed::open`), or ZenFlow's weights are on their way in pieces for it.
    pub fn defers(&self) -> bool {
        match self {
            UpdatePath::Stream(s) => s.defers(),
            UpdatePath::Summed(s) => s.defers(),
            UpdatePath::ZenFlow(z) => z.defers(),
            _ => false,
        }
    }

    /// Where the reduced gradient pieces of a backward go (see [`UpdatePath::sink`]), and the
    /// step left for its forward to open, if any (nothing else goes to the host then).
    pub fn sink_or_open<'a>(
        &'a mut self,
        assumed: Option<Assumed>,
        boundary: bool,
        at: OpenAt<'a, D, P>,
    ) -> Result<SinkOrOpen<'a, D, P>, EngineError> {
        if !self.defers() {
            return Ok((self.sink(assumed, boundary), None));
        }
        let step = |(sink, opening): SinkOrOpening<'a, D, P>| (sink, opening.map(Open::Step));
        match self {
            UpdatePath::Stream(stream) => stream.open(at, assumed).map(step),
            UpdatePath::Summed(summed) => summed.open(at).map(step),
            // ZenFlow adds each step into its window on the device at the step.
            UpdatePath::ZenFlow(z) => Ok((Sink::Keep, z.open(at).map(Open::Applied))),
            _ => Err(EngineError::Internal("only a streaming step is left to the forward")),
        }
    }

    /// Runs a step left for the next forward now (before the weights or the state are read
    /// other than by a forward).
    pub fn complete<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        match self {
            UpdatePath::Stream(s) => s.complete(shared),
            UpdatePath::Summed(s) => s.complete(shared),
            UpdatePath::ZenFlow(z) => {
                z.complete();
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The step is skipped: speculatively stepped pieces are restored.
    pub fn skip(&mut self) {
        match self {
            UpdatePath::Accumulate(a) => a.abandon_speculation(),
            UpdatePath::Stream(s) => s.abandon_speculation(),
            UpdatePath::Summed(s) => s.abandon_speculation(),
            UpdatePath::Device(_) | UpdatePath::ZenFlow(_) => {}
        }
    }

    /// What the speculative step did so far (`None` where the path does not speculate).
    pub fn speculation_stats(&self) -> Option<SpeculationStats> {
        let speculation = match self {
            UpdatePath::Accumulate(a) => a.speculation.as_ref(),
            UpdatePath::Stream(s) => s.speculation.as_ref(),
            UpdatePath::Summed(s) => s.speculation.as_ref(),
            UpdatePath::Device(_) | UpdatePath::ZenFlow(_) => None,
        };
        speculation.map(Speculation::stats)
    }

    /// True if the d2h stream reads the gradients (everything but the device path).
    pub fn offloads(&self) -> bool {
        !matches!(self, UpdatePath::Device(_))
    }

    /// Σ g² over the accumulated gradients of all ranks (in loss-scaled, summed units).
    pub fn sum_squares<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<f64, EngineError> {
        match self {
            UpdatePath::Device(device) => device.sum_squares(shared),
            UpdatePath::Accumulate(a) => a.sum_squares(shared),
            UpdatePath::Summed(s) => s.sum_squares(shared),
            // (ZenFlow: this step's, not the window's.)
            UpdatePath::Stream(_) | UpdatePath::ZenFlow(_) => shared.reduced_sum_squares(),
        }
    }

    /// One optimizer step over the partition, then the updated weights into every rank's flat
    /// buffer (now, or with the delayed update at the next step).
    pub fn update<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
        loss_scale: f32,
    ) -> Result<(), EngineError> {
        match self {
            UpdatePath::Device(device) => device.update(shared, step),
            UpdatePath::Accumulate(a) => a.update(shared, step),
            UpdatePath::Stream(s) => s.update(shared, step),
            UpdatePath::Summed(s) => s.update(shared, step),
            UpdatePath::ZenFlow(z) => z.update(shared, step, loss_scale),
        }
    }

    /// Clears the gradient accumulator for the next window, after everything that reads it.
    pub fn zero_accumulator<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        match self {
            UpdatePath::Device(device) => {
                device.zero_accumulator(&shared.device, shared.owned.len())
            }
            UpdatePath::Accumulate(a) => a.zero_accumulator(shared),
            UpdatePath::Summed(s) => s.zero_accumulator(shared),
            // Nothing accumulates; ZenFlow's window is cleared when a window ends.
            UpdatePath::Stream(_) | UpdatePath::ZenFlow(_) => Ok(()),
        }
    }

    /// Brings a delayed step's weights into the model (see [`crate::Engine::flush`]).
    pub fn flush<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        match self {
            UpdatePath::Device(_) | UpdatePath::Summed(_) => Ok(()),
            UpdatePath::Accumulate(a) => a.flush(shared),
            UpdatePath::Stream(s) => s.flush(shared),
            UpdatePath::ZenFlow(z) => z.flush(shared),
        }
    }

    /// The optimizer state of the partition (a running CPU step is waited for).
    pub fn state<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
    ) -> Result<PathState, EngineError> {
        match self {
            UpdatePath::Device(device) => device.state(&shared.device),
            UpdatePath::Accumulate(a) => a.state(),
            UpdatePath::Stream(s) => s.state(&shared.device),
            UpdatePath::Summed(s) => s.state(&shared.device),
            UpdatePath::ZenFlow(z) => z.state(shared, false),
        }
    }

    /// This rank's optimizer state as a checkpoint writes it, and whether its weights are newer
    /// than the device's: lent by the host optimizer on the offload paths, fetched a piece at a
    /// time otherwise (downloaded from the device optimizer; ZenFlow's merged with its device
    /// columns), so that saving holds no second copy of a large model's state.
    pub fn checkpoint_view<'a, C: Comm<Device = D>>(
        &'a mut self,
        shared: &'a Shared<D, C, P>,
    ) -> Result<(PartView<'a>, bool), EngineError> {
        let flat = shared.owned.clone();
        match self {
            UpdatePath::Accumulate(a) => a.view(flat),
            UpdatePath::Stream(s) => s.view(&shared.device, flat),
            UpdatePath::Summed(s) => Ok((s.view(&shared.device, flat)?, false)),
            UpdatePath::ZenFlow(z) => z.checkpoint_view(shared),
            UpdatePath::Device(d) => {
                let n = flat.len();
                let fetched =
                    |buffer: &'a D::Buffer<f32>| Elements::downloaded(&shared.device, buffer, n);
                let state = &d.state;
                let part = PartView {
                    flat,
                    master: fetched(&state.master),
                    exp_avg: MomentView::F32(fetched(&state.exp_avg)),
                    exp_avg_sq: MomentView::F32(fetched(&state.exp_avg_sq)),
                    zenflow: None,
                };
                Ok((part, false))
            }
        }
    }

    /// The master weights of the partition (a running CPU step is waited for).
    pub fn master_weights<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
    ) -> Result<Vec<f32>, EngineError> {
        match self {
            UpdatePath::Device(device) => device.master(&shared.device),
            UpdatePath::Accumulate(a) => a.master(),
            UpdatePath::Stream(s) => s.master(&shared.device),
            UpdatePath::Summed(s) => s.master(&shared.device),
            UpdatePath::ZenFlow(z) => Ok(z.state(shared, true)?.master),
        }
    }

    /// ZenFlow's part of a snapshot.
    pub fn zenflow_snapshot<C: Comm<Device = D>>(
        &self,
        shared: &Shared<D, C, P>,
    ) -> Result<Option<ZenFlowSnapshot>, EngineError> {
        match self {
            UpdatePath::ZenFlow(z) => Ok(Some(z.snapshot(shared)?)),
            _ => Ok(None),
        }
    }

    /// What this path refuses in a checkpoint, checked before anything is restored; for ZenFlow
    /// its state, assembled for this rank.
    pub fn check_restore<'a, C: Comm<Device = D>>(
        &self,
        shared: &Shared<D, C, P>,
        from: &Restore<'a>,
    ) -> Result<Option<ZenFlowRestore<'a>>, EngineError> {
        let rank = shared.comm.rank();
        match self {
            UpdatePath::ZenFlow(_) => {
                Ok(Some(ZenFlowUpdate::check_restore(shared, from.zenflow, &from.parts)?))
            }
            _ if !from.zenflow.is_empty() => Err(EngineError::Restore {
                rank,
                reason: "the checkpoint holds ZenFlow state, and this run does not use ZenFlow",
            }),
            _ if from.upload_pending && self.refuses_pending() => Err(EngineError::Restore {
                rank,
                reason: "its newest weights are still in the delayed update's optimizer: \
                         resume it with the delayed update, or with gradient accumulation summed \
                         on the host (`accumulate_on: \"host\"`)",
            }),
            _ => Ok(None),
        }
    }

    /// True if a checkpoint whose newest weights are still on the host cannot resume here: the
    /// inline streaming steps (one micro-step, or the device's sum) have no buffer to upload them
    /// from before their first step.
    fn refuses_pending(&self) -> bool {
        match self {
            UpdatePath::Stream(s) => s.refuses_pending(),
            UpdatePath::Summed(_) => true,
            UpdatePath::Device(_) | UpdatePath::Accumulate(_) | UpdatePath::ZenFlow(_) => false,
        }
    }

    /// Takes a checkpoint's optimizer state (`[master, exp_avg, exp_avg_sq]` of the partition),
    /// then ZenFlow's (checked by [`UpdatePath::check_restore`]).
    pub fn restore<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        state: SavedState<'_>,
        upload_pending: bool,
        zenflow: Option<ZenFlowRestore<'_>>,
    ) -> Result<(), EngineError> {
        match self {
            UpdatePath::Device(device) => device.restore(&shared.device, state.to_vecs()?),
            UpdatePath::Accumulate(a) => {
                a.abandon_speculation();
                a.host.restore(&state, upload_pending)
            }
            UpdatePath::Stream(s) => s.restore(&shared.device, &state, upload_pending),
            UpdatePath::Summed(s) => s.restore(&shared.device, &state),
            UpdatePath::ZenFlow(z) => z.restore(shared, &state, upload_pending, zenflow),
        }
    }

    /// The host gradient accumulator (the accumulating paths).
    pub fn host_grad_accumulator(&self) -> Option<&[f32]> {
        match self {
            UpdatePath::Accumulate(a) => Some(&a.host.acc),
            // ZenFlow's window stays on the device unless it takes the host path.
            UpdatePath::ZenFlow(z) => z.host.accumulator(),
            UpdatePath::Device(_) | UpdatePath::Stream(_) | UpdatePath::Summed(_) => None,
        }
    }

    /// Sets the learning rate of ZenFlow's CPU schedule (the engine sets its own).
    pub fn set_lr(&mut self, lr: f64) -> Result<(), EngineError> {
        if let UpdatePath::ZenFlow(z) = self {
            z.zenflow.cpu_adamw.set_lr(lr)?;
        }
        Ok(())
    }

    /// An epoch of the trainer's data has ended (ZenFlow's epoch-based selection).
    pub fn end_epoch(&mut self) {
        if let UpdatePath::ZenFlow(z) = self {
            z.end_epoch();
        }
    }
}
