//! ZenFlow's host side, either of two: the window streamed from the device through bounded
//! staging (`ZenFlowAside::Device`, `zenflow.rs`), or the path before it, kept whole and
//! selectable (`ZenFlowAside::Host`) for a GPU without room for the second window: at the window
//! end the window is copied into the pinned host accumulator and cleared on the d2h stream
//! (`window_copied`, d2h → compute, orders the next add after it); the CPU steps the whole
//! partition from there into the upload buffer, whose weights reach the flat weights from the
//! host: at once (inline), or with `overlap_step` at the next window's end, where the worker is
//! joined and its weights uploaded before that window is copied into the same accumulator (one
//! rank with `overlap_forward`: uploaded in pieces that the next forward opens as it reaches them,
//! [`AppliedPieces`], the window's copy out queued right after them). 18 B
//! per parameter of host memory with fp32 moments (14 with bf16), and on the device the window
//! alone, as inline.

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, HostBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use super::opening::OpenAt;
use super::shared::{Shared, slot};
use super::state::SavedState;
use super::zenflow::ZenFlowUpdate;
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::{CpuStep, HostAccumulator, HostOptimizer, ZenFlowHost};
use crate::zenflow::ZenFlow;

/// ZenFlow's host side ([`crate::ZenFlowAside`]).
#[derive(Debug)]
pub(super) enum HostSide<P: Float> {
    /// The window stays on the device and is streamed through the CPU step.
    Streamed(ZenFlowHost<P>),
    /// The window is copied into the host accumulator (the path before).
    Accumulated(HostAccumulator<P>),
}

impl<P: Float> HostSide<P> {
    /// True if the optimizer's weights have not reached the device's flat weights yet.
    pub(super) fn weights_ahead(&self) -> bool {
        match self {
            HostSide::Streamed(host) => host.weights_ahead(),
            HostSide::Accumulated(host) => host.weights_ahead(),
        }
    }

    /// The optimizer, after waiting for a running CPU step (whose weights are then pending).
    pub(super) fn join(&mut self) -> Result<&mut HostOptimizer, EngineError> {
        match self {
            HostSide::Streamed(host) => Ok(&mut host.join()?.state),
            HostSide::Accumulated(host) => Ok(&mut host.join()?.state),
        }
    }

    /// This rank's optimizer state, copied (waiting for a running step first).
    pub(super) fn state(&mut self) -> Result<[Vec<f32>; 3], EngineError> {
        match self {
            HostSide::Streamed(host) => host.state(),
            HostSide::Accumulated(host) => host.state(),
        }
    }

    /// Takes a checkpoint's state (waiting for a running step first).
    pub(super) fn restore(
        &mut self,
        state: &SavedState<'_>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        match self {
            HostSide::Streamed(host) => host.restore(state, upload_pending),
            HostSide::Accumulated(host) => host.restore(state, upload_pending),
        }
    }

    /// The optimizer, where no step is running (after [`HostSide::join`]).
    pub(super) fn settled(&self) -> Option<&HostOptimizer> {
        match self {
            HostSide::Streamed(host) => host.settled(),
            HostSide::Accumulated(host) => host.settled(),
        }
    }

    /// The optimizer holds weights newer than the device's flat weights.
    pub(super) fn upload_pending(&self) -> bool {
        match self {
            HostSide::Streamed(host) => host.upload_pending,
            HostSide::Accumulated(host) => host.upload_pending,
        }
    }

    /// The streamed host side, or an internal error on the host path.
    pub(super) fn streamed(&mut self) -> Result<&mut ZenFlowHost<P>, EngineError> {
        match self {
            HostSide::Streamed(host) => Ok(host),
            HostSide::Accumulated(_) => Err(EngineError::Internal("ZenFlow's host path streamed")),
        }
    }

    /// The host accumulator (the host path).
    pub(super) fn accumulator(&self) -> Option<&[f32]> {
        match self {
            HostSide::Streamed(_) => None,
            HostSide::Accumulated(host) => Some(&host.acc),
        }
    }
}

impl<D: DeviceAdamW, P: Float> ZenFlowUpdate<D, P> {
    /// The host path's end of a window (its norm taken): the window to the host and the CPU
    /// step, inline or (with `overlap_step`) on the worker after the last window's step is
    /// joined and its weights applied.
    pub(super) fn end_window_on_host<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        cpu_step: AdamWStep,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let (zenflow, host) = self.accumulated()?;
        if let CpuStep::Inline(_) = host.cpu {
            take_window(shared, zenflow, host)?;
            host.step_now(&cpu_step)?;
            shared.cpu_wait += started.elapsed();
            return self.apply_and_gather(shared);
        }
        // The last window's CPU step finished meanwhile: joined, it hands the accumulator back,
        // and its weights go to the device now; this window's runs in the background until the
        // next window ends, its weights left in the upload buffer until then.
        if host.weights_ahead() {
            host.join()?;
            shared.cpu_wait += started.elapsed();
            self.apply_and_gather(shared)?;
        } else {
            shared.gather_from(StreamKind::Compute)?;
        }
        let (zenflow, host) = self.accumulated()?;
        take_window(shared, zenflow, host)?;
        host.start_delayed(cpu_step)
    }

    /// The device side and the host accumulator (the host path).
    fn accumulated(
        &mut self,
    ) -> Result<(&mut ZenFlow<D, P>, &mut HostAccumulator<P>), EngineError> {
        match &mut self.host {
            HostSide::Accumulated(host) => Ok((&mut self.zenflow, host)),
            HostSide::Streamed(_) => {
                Err(EngineError::Internal("ZenFlow's streamed path on the host"))
            }
        }
    }
}

/// Copies the window into the host accumulator and clears it, on the d2h stream. The copy's token
/// is detached: the accumulator remembers the copy, and the CPU step's first read of it (here or
/// on the worker) waits for it.
fn take_window<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &Shared<D, C, P>,
    zenflow: &mut ZenFlow<D, P>,
    host: &mut HostAccumulator<P>,
) -> Result<(), EngineError> {
    let device = &shared.device;
    let d2h = device.stream(StreamKind::D2h);
    device.wait_event(d2h, &zenflow.window_ready)?;
    let len = shared.owned.len();
    device.copy_d2h(d2h, &*zenflow.window, 0..len, &mut host.acc, 0)?.detach();
    device.fill(d2h, &*zenflow.window, 0..len, 0.0)?;
    let copied = slot(&mut zenflow.window_copied, device)?;
    device.record(copied, d2h)?;
    Ok(())
}

/// The host path's weights applied in pieces for the next forward (one rank, the forward
/// opening the weights: `StreamOptions::overlap_forward`): the partition's copy from the upload
/// buffer goes in pieces of the stream chunk on the h2d stream, each followed by the device's
/// columns scattered over the blocks it completes and an event (h2d → compute), so that the
/// forward's kernels wait for the pieces of the weights they read only ([`AppliedOpening`]),
/// not for the whole partition's copy (15 GiB at llama-8b: 0.35 s on an H100). The copies'
/// tokens are detached: the upload buffer waits for them before the next CPU step writes it.
pub(super) struct AppliedPieces<D: Device> {
    /// One event per piece, recorded after the piece (reused from window to window).
    events: Vec<D::Event>,
    /// The flat end of each piece queued and not yet opened to a forward (empty: none).
    ends: Vec<usize>,
    /// Elements per piece.
    piece: usize,
}

impl<D: Device> AppliedPieces<D> {
    pub(super) fn new(piece: usize) -> Self {
        AppliedPieces { events: Vec::new(), ends: Vec::new(), piece: piece.max(1) }
    }

    /// True if pieces are queued that no forward has opened yet.
    pub(super) fn pending(&self) -> bool {
        !self.ends.is_empty()
    }

    /// Forgets the pieces queued: whatever reads the weights next waits for `params_ready`
    /// (recorded after the last piece), which covers them all.
    pub(super) fn clear(&mut self) {
        self.ends.clear();
    }

    /// Queues the copy of `upload`'s first `len` elements into the flat weights from `at` in
    /// pieces on the h2d stream (which waits for the weights to be free and the device step to
    /// be done already), each piece followed by the device's columns over the blocks it
    /// completes and its event.
    pub(super) fn queue<P: Float>(
        &mut self,
        device: &D,
        upload: &HostBuffer<P>,
        len: usize,
        params: &D::Buffer<P>,
        at: usize,
        zenflow: &ZenFlow<D, P>,
    ) -> Result<(), EngineError>
    where
        D: DeviceAdamW,
    {
        let h2d = device.stream(StreamKind::H2d);
        self.ends.clear();
        for (i, start) in (0..len).step_by(self.piece).enumerate() {
            let end = (start + self.piece).min(len);
            device.copy_h2d(h2d, upload, start..end, params, at + start)?.detach();
            // The blocks whose last element this piece holds are whole on the device now.
            zenflow.scatter_weights_ending(device, h2d, params, at + start..at + end)?;
            if i == self.events.len() {
                self.events.push(device.new_event()?);
            }
            device.record(&mut self.events[i], h2d)?;
            self.ends.push(at + end);
        }
        Ok(())
    }

    /// The pieces queued, handed to the next forward to open.
    pub(super) fn open<'a, P: Float>(
        &'a mut self,
        at: OpenAt<'a, D, P>,
    ) -> AppliedOpening<'a, D, P> {
        let OpenAt { device, padded_len, events, zero, .. } = at;
        AppliedOpening {
            device,
            events: &self.events,
            ends: std::mem::take(&mut self.ends),
            waited: 0,
            d2h_done: events.d2h_done.as_ref(),
            params_ready: events.params_ready.as_ref(),
            zero,
            padded_len,
            finished: false,
            failed: None,
        }
    }
}

/// ZenFlow's weights applied in pieces ([`AppliedPieces`]), opened to the forward: the compute
/// stream waits for the event of the piece that holds the last weight below each `end` (the
/// pieces are recorded in order on one stream); at the final open, as the backward would
/// without it, for `d2h_done` and `params_ready` (after the last piece), and the gradients are
/// zeroed where the backward asks for it.
pub(in crate::engine) struct AppliedOpening<'a, D: Device, P: Float> {
    device: &'a D,
    events: &'a [D::Event],
    ends: Vec<usize>,
    /// The pieces the compute stream waits for so far.
    waited: usize,
    d2h_done: Option<&'a D::Event>,
    params_ready: Option<&'a D::Event>,
    zero: Option<&'a D::Buffer<P>>,
    padded_len: usize,
    finished: bool,
    failed: Option<EngineError>,
}

impl<D: Device, P: Float> AppliedOpening<'_, D, P> {
    /// [`crate::ModelIo::open`]: the weights below flat `end` (all of them, and the forward
    /// queued, at or past the padded length). The first error is kept ([`Self::end`]).
    pub fn open(&mut self, end: usize) {
        if self.finished || self.failed.is_some() {
            return;
        }
        if let Err(e) = self.open_to(end) {
            self.failed = Some(e);
        }
    }

    fn open_to(&mut self, end: usize) -> Result<(), EngineError> {
        let compute = self.device.stream(StreamKind::Compute);
        if end >= self.padded_len {
            self.finished = true;
            for event in [self.d2h_done, self.params_ready].into_iter().flatten() {
                self.device.wait_event(compute, event)?;
            }
            if let Some(grads) = self.zero {
                self.device.fill(compute, grads, 0..self.padded_len, P::default())?;
            }
            return Ok(());
        }
        // The pieces up to the one holding flat element `end - 1`.
        let wanted = self.ends.partition_point(|&e| e < end) + 1;
        let wanted = wanted.min(self.ends.len());
        if wanted > self.waited {
            self.device.wait_event(compute, &self.events[wanted - 1])?;
            self.waited = wanted;
        }
        Ok(())
    }

    /// Ends the opening after the model: opens what the forward did not, and gives whether the
    /// model opened everything itself (see [`super::opening::Opening::end`]), else the first
    /// error.
    pub fn end(mut self) -> Result<bool, EngineError> {
        let opened_all = self.finished;
        self.open(usize::MAX);
        match self.failed.take() {
            Some(e) if opened_all => Err(e),
            _ => Ok(opened_all),
        }
    }
}
