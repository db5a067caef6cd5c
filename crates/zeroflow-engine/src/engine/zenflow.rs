//! The ZenFlow path (DESIGN.md §6; the selection and the compact state are in the crate's
//! `zenflow.rs`).
//!
//! At every step: the selected columns' gradients are gathered on the compute stream (after the
//! comm stream's `norm_done`), stepped by the device AdamW and scattered into the flat weights,
//! and `device_done` is recorded; then the whole partition's gradients are added into the device
//! window and `window_ready` is recorded. When a window ends (after `update_interval` steps, or
//! when Zen-auto says so) the CPU step streams the window through bounded host staging chunk by
//! chunk (`chunks.rs`'s [`stream_chunks`]: d2h copies after `window_ready`, the fused AdamW, the
//! weights' uploads on the h2d stream), and the window is cleared on the compute stream once the
//! CPU has read it. Inline, the weights go straight into the flat weights (the h2d stream after
//! `compute_done`, `params_ready` and `device_done`) and the device's columns are scattered over
//! them again. With `overlap_step` the window is swapped with the aside window, whose CPU step
//! runs on a worker during the next window and uploads into the aside weights, applied at that
//! window's end by a device copy (and the columns scattered over them). With
//! `StreamOptions::zenflow_aside: Host` the window takes the path before instead
//! (`zenflow_host.rs`). `window_ready` is also the event the window's norm and the
//! column importances go to the host by (recorded on the compute stream before each of those
//! reads).

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Float, bf16};
use zeroflow_device::{Comm, HostBuffer, StreamKind};
use zeroflow_optim::{AdamWConfig, AdamWStep};

use super::chunks::{Chunks, stream_chunks, trace_worker};
use super::opening::OpenAt;
use super::shared::{Shared, normalise, overwrite, overwrite_at, slot, sum_to_host};
use super::state::{PathState, RESTORE_PIECE, SavedParts, SavedState, SavedWindow};
use super::zenflow_host::{AppliedOpening, AppliedPieces, HostSide};
use crate::checkpoint::{Elements, MomentView, PartView};
use crate::device_adamw::DeviceAdamW;
use crate::host::{HostMoments, HostOptimizer, StepTimes, StreamBuffers, convert_into};
use crate::zenflow::{Block, EXCHANGE_PIECE, ZenFlow, ZenFlowSnapshot};
use crate::{EngineError, ZenFlowOptions};

/// The ZenFlow path: the device side of the selection and the window, and the host side of the
/// CPU step (inline, or delayed with `overlap_step`).
pub(super) struct ZenFlowUpdate<D: DeviceAdamW, P: Float> {
    pub(super) zenflow: ZenFlow<D, P>,
    pub(super) host: HostSide<P>,
    /// The host path's weights applied in pieces that the next forward opens (`None`: applied
    /// whole before it; always on the streamed path, whose weights are applied on the device).
    pub(super) pieces: Option<AppliedPieces<D>>,
}

/// A ZenFlow checkpoint's state, checked and assembled for this rank before anything is restored.
pub(super) struct ZenFlowRestore<'a> {
    window: SavedWindow<'a>,
    first: ZenFlowSnapshot,
    selection: Vec<(usize, Vec<u32>)>,
}

impl<D: DeviceAdamW, P: Float> ZenFlowUpdate<D, P> {
    pub fn new(
        device: &D,
        layout: &FlatLayout,
        owned: &std::ops::Range<usize>,
        options: &ZenFlowOptions,
        adamw: AdamWConfig,
        host: HostSide<P>,
        pieces: Option<AppliedPieces<D>>,
    ) -> Result<Self, EngineError> {
        // With overlap_step the streamed path sets the window aside on the device.
        let device_aside = options.overlap_step && matches!(host, HostSide::Streamed(_));
        let zenflow = ZenFlow::new(device, layout, owned, options, adamw, device_aside)?;
        Ok(ZenFlowUpdate { zenflow, host, pieces })
    }

    /// True if the host path's weights are on their way in pieces for the next forward to open.
    pub fn defers(&self) -> bool {
        self.pieces.as_ref().is_some_and(AppliedPieces::pending)
    }

    /// The pieces on their way, for the next forward to open.
    pub fn open<'a>(&'a mut self, at: OpenAt<'a, D, P>) -> Option<AppliedOpening<'a, D, P>> {
        self.pieces.as_mut().filter(|pieces| pieces.pending()).map(|pieces| pieces.open(at))
    }

    /// Anything but a forward reads the weights next: after `params_ready`, which follows the
    /// last piece.
    pub fn complete(&mut self) {
        self.pieces.iter_mut().for_each(AppliedPieces::clear);
    }

    /// One ZenFlow step: a selection if one is due, the device step of the selected columns,
    /// this step's gradients added into the window, and at the end of a window the CPU step of
    /// the rest.
    pub fn update<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
        loss_scale: f32,
    ) -> Result<(), EngineError> {
        // The gradients are final once the comm stream has computed the norm over them.
        let compute = shared.device.stream(StreamKind::Compute);
        shared.device.wait_event(compute, &shared.events.norm_done)?;
        let selecting = self.zenflow.selection_due();
        if selecting {
            self.reselect(shared)?;
        }
        self.device_step(shared, step)?;
        self.add_to_window(shared)?;
        // Zen-auto weighs this step's column masses (a selection has just computed them).
        if self.zenflow.auto.is_some() && !selecting {
            self.column_importance(shared)?;
        }
        let zenflow = &mut self.zenflow;
        zenflow.steps_in_window += 1;
        zenflow.since_selection = zenflow.since_selection.map(|s| s + 1);
        let ends = match &mut zenflow.auto {
            Some(auto) => auto.observe(&zenflow.importance_host, zenflow.steps_in_window),
            None => zenflow.steps_in_window >= zenflow.update_interval,
        };
        // Steps 1..=full_warm_up_rounds each end a window (DeepSpeed's rule: warm-up steps are
        // update boundaries, and the windows of update_interval count from the last of them).
        let warming_up = step.step() <= zenflow.full_warm_up_rounds;
        if !warming_up && !ends {
            return shared.gather_from(StreamKind::Compute);
        }
        if let Some(auto) = &mut zenflow.auto {
            auto.reset();
        }
        let window = std::mem::take(&mut zenflow.steps_in_window);
        self.end_window(shared, step, window, loss_scale)
    }

    /// The end of a window of `window` steps: the CPU step streams the window inline, or (with
    /// `overlap_step`) the last window's weights are applied and this window's step starts on
    /// the worker.
    fn end_window<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
        window: u64,
        loss_scale: f32,
    ) -> Result<(), EngineError> {
        let begun = std::time::Instant::now();
        let cpu_step = self.window_step(shared, step, window, loss_scale)?;
        let normed = begun.elapsed();
        if let HostSide::Accumulated(_) = self.host {
            return self.end_window_on_host(shared, cpu_step);
        }
        let started = std::time::Instant::now();
        if !self.zenflow.overlap_step {
            self.step_inline(shared, &cpu_step)?;
            shared.cpu_wait += started.elapsed();
            return Ok(());
        }
        // The last window's CPU step finished meanwhile: its weights go to the device now; this
        // window's runs in the background until the next window ends.
        if self.host.weights_ahead() {
            self.host.join()?;
            shared.cpu_wait += started.elapsed();
            self.apply_and_gather(shared)?;
        } else {
            shared.gather_from(StreamKind::Compute)?;
        }
        let applied = begun.elapsed();
        self.set_window_aside(shared)?;
        self.start_worker(shared, cpu_step)?;
        tracing::debug!(
            window,
            ?normed,
            ?applied,
            started = ?begun.elapsed(),
            "ZenFlow window end: norm, last CPU step applied, window set aside, next started"
        );
        Ok(())
    }

    /// Adds this step's gradients into the window, on the compute stream (which cleared it after
    /// the last window's CPU step read it, or after `window_copied`: the host has its copy), and
    /// marks the window ready.
    fn add_to_window<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let zenflow = &mut self.zenflow;
        let device = &shared.device;
        let compute = device.stream(StreamKind::Compute);
        if let Some(copied) = &zenflow.window_copied {
            device.wait_event(compute, copied)?;
        }
        let (source, at) = shared.reduced_source();
        let len = shared.owned.len();
        device.accumulate(compute, source, at..at + len, &*zenflow.window, 0, 1.0)?;
        device.record(&mut zenflow.window_ready, compute)?;
        Ok(())
    }

    /// The CPU step of the window that ends now, on this thread: the window streams through the
    /// host chunk by chunk, the weights go straight into this rank's partition of the flat
    /// weights with the device's columns over them, then the window is cleared and gathered.
    fn step_inline<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        cpu_step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let StreamBuffers { state, staging, outgoing } = self.host.streamed()?.join()?;
        shared.h2d_after_weights_free()?;
        let device = &shared.device;
        let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
        // After the device step wrote its columns (and the compact weights).
        if let Some(done) = &self.zenflow.device_done {
            device.wait_event(h2d, done)?;
        }
        device.wait_event(d2h, &self.zenflow.window_ready)?;
        let (len, at) = (shared.owned.len(), shared.owned.start);
        let (source, target) = (&*self.zenflow.window, &shared.params);
        let uploaded = &mut |_| Ok(());
        // Not the streaming offload path's breakdown: the window step's time is `cpu_wait`.
        let times = &mut StepTimes::default();
        let chunks =
            Chunks { state_at: 0, source, source_at: 0, target, target_at: at, uploaded, times };
        stream_chunks(device, cpu_step, state, staging, outgoing, chunks, len)?;
        // This step's weights supersede any still pending.
        self.host.streamed()?.upload_pending = false;
        self.zenflow.aside_ready = false;
        // Every chunk's copy has been waited on: the window is read.
        let compute = device.stream(StreamKind::Compute);
        device.fill(compute, &*self.zenflow.window, 0..len, 0.0)?;
        // The CPU's result for the selected columns is discarded, the device's kept.
        self.zenflow.scatter_weights(device, h2d, &shared.params)?;
        shared.gather_from(StreamKind::H2d)
    }

    /// Swaps the window that ends now with the aside window (whose last CPU step has been
    /// joined: nothing reads it any more) and clears the new window on the compute stream; the
    /// worker's copies of the aside window wait on the d2h stream for its last add and reads
    /// (`window_ready`).
    fn set_window_aside<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let (device, len) = (&shared.device, shared.owned.len());
        let zenflow = &mut self.zenflow;
        let d2h = device.stream(StreamKind::D2h);
        device.wait_event(d2h, &zenflow.window_ready)?;
        let aside = zenflow.window_aside.as_mut();
        let aside = aside.ok_or(EngineError::Internal("overlap_step without its aside window"))?;
        std::mem::swap(&mut zenflow.window, aside);
        let compute = device.stream(StreamKind::Compute);
        device.fill(compute, &*zenflow.window, 0..len, 0.0)?;
        Ok(())
    }

    /// Starts the CPU step of the window just set aside on the worker: it streams the aside
    /// window through the host and uploads the weights into the aside weights on the h2d stream
    /// (after the last application of the aside weights, queued there before).
    fn start_worker<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
        cpu_step: AdamWStep,
    ) -> Result<(), EngineError> {
        let missing = EngineError::Internal("overlap_step without its aside weights");
        let weights = Arc::clone(self.zenflow.aside.as_ref().ok_or(missing)?);
        let missing = EngineError::Internal("overlap_step without its aside window");
        let window = Arc::clone(self.zenflow.window_aside.as_ref().ok_or(missing)?);
        let (device, len) = (shared.device.clone(), shared.owned.len());
        self.zenflow.aside_ready = true;
        self.host.streamed()?.worker.start(move |buffers| {
            let StreamBuffers { state, staging, outgoing } = buffers;
            let (source, target) = (&*window, &*weights);
            let uploaded = &mut |_| Ok(());
            // On its own thread: not the training thread's time, but said at debug level.
            let begun = std::time::Instant::now();
            let times = &mut StepTimes::default();
            let chunks =
                Chunks { state_at: 0, source, source_at: 0, target, target_at: 0, uploaded, times };
            stream_chunks(&device, &cpu_step, state, staging, outgoing, chunks, len)?;
            // Wait for the last uploads.
            outgoing.iter_mut().for_each(HostBuffer::settle);
            trace_worker("ZenFlow", begun, times);
            Ok(())
        })
    }

    /// Brings the CPU's weights into this rank's partition of the flat weights from the aside
    /// weights (where the worker uploaded them, or a restore put them; on the host path, else
    /// from its upload buffer), with the device's columns over them, then gathers.
    pub(super) fn apply_and_gather<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        // The host path's weights not aside are in its upload buffer.
        let upload = match &mut self.host {
            HostSide::Accumulated(host) => Some(host.upload()?),
            HostSide::Streamed(host) => {
                host.join()?;
                host.upload_pending = false;
                None
            }
        };
        shared.h2d_after_weights_free()?;
        let device = &shared.device;
        let h2d = device.stream(StreamKind::H2d);
        // After the device step wrote its columns (and the compact weights).
        if let Some(done) = &self.zenflow.device_done {
            device.wait_event(h2d, done)?;
        }
        let (len, at) = (shared.owned.len(), shared.owned.start);
        // The worker uploaded its weights into the aside buffer on this stream.
        let ready = std::mem::take(&mut self.zenflow.aside_ready);
        match (self.zenflow.aside.as_ref().filter(|_| ready), upload) {
            (Some(aside), _) => device.copy_d2d(h2d, aside, 0..len, &shared.params, at)?,
            (None, Some(upload)) => {
                if let Some(pieces) = &mut self.pieces {
                    // The device's columns over each piece, for the next forward to open.
                    pieces.queue(device, upload, len, &shared.params, at, &self.zenflow)?;
                    return shared.gather_from(StreamKind::H2d);
                }
                device.copy_h2d(h2d, upload, 0..len, &shared.params, at)?.wait()?
            }
            (None, None) => return Err(EngineError::Internal("ZenFlow's weights are not aside")),
        }
        // The CPU's result for the selected columns is discarded, the device's kept.
        self.zenflow.scatter_weights(device, h2d, &shared.params)?;
        shared.gather_from(StreamKind::H2d)
    }

    /// Waits for a CPU step still running and brings its weights into the model.
    pub fn flush<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        if self.host.weights_ahead() {
            self.host.join()?;
            self.apply_and_gather(shared)?;
        }
        Ok(())
    }

    /// The CPU's step for the window of `window` steps that ends now: the gradients are its mean
    /// over the window's steps, clipped by the window's own norm. A window of one step is the
    /// step itself, so its scale is the device step's (no second norm).
    fn window_step<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
        window: u64,
        loss_scale: f32,
    ) -> Result<AdamWStep, EngineError> {
        let update_interval = window.max(1);
        let grad_scale = if update_interval == 1 {
            step.scalars().grad_scale
        } else {
            let sum_squares = self.window_sum_squares(shared)?;
            let world = shared.comm.world_size();
            normalise(sum_squares, loss_scale, world, update_interval, shared.clip).grad_scale
        };
        Ok(self.zenflow.cpu_adamw.next_step(grad_scale))
    }

    /// Σ g² over the windows of all ranks (in loss-scaled, summed units), on the device.
    fn window_sum_squares<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<f64, EngineError> {
        let across = shared.across_ranks();
        let zenflow = &mut self.zenflow;
        let device = &shared.device;
        let compute = device.stream(StreamKind::Compute);
        let len = shared.owned.len();
        device.sum_squares(compute, &*zenflow.window, 0..len, &shared.norm, 0)?;
        let ready = &mut zenflow.window_ready;
        let (norm, host) = (&shared.norm, &mut shared.norm_host);
        let read =
            sum_to_host(device, &shared.comm, across, StreamKind::Compute, ready, norm, host)?;
        Ok(f64::from(read[0]))
    }

    /// The selected columns: gather their gradients, AdamW over the compact state, scatter the
    /// weights back, all on the compute stream.
    fn device_step<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        step: &AdamWStep,
    ) -> Result<(), EngineError> {
        let zenflow = &mut self.zenflow;
        let len = zenflow.compact_len;
        if len == 0 {
            return Ok(());
        }
        let device = &shared.device;
        let compute = device.stream(StreamKind::Compute);
        // Flat element `i` of the partition is at `i - shift` of `source`.
        let (source, at) = shared.reduced_source();
        let shift = shared.owned.start - at;
        for block in &zenflow.blocks {
            let (full, index) = (block.full(source, shift), block.index.clone());
            let compact = block.compact(&zenflow.grads);
            device.gather_columns(compute, full, &zenflow.index, index, compact)?;
        }
        device.cast(compute, &zenflow.grads, 0..len, &zenflow.grads_f32, 0)?;
        let (state, grads) = (&zenflow.state, &zenflow.grads_f32);
        state.step(device, compute, step, 0..len, grads, &zenflow.weights, 0)?;
        zenflow.scatter_weights(device, compute, &shared.params)?;
        let done = slot(&mut zenflow.device_done, device)?;
        device.record(done, compute)?;
        Ok(())
    }

    /// A new selection from this step's gradients (a selection starts a window), with the state
    /// re-synchronised (see `zenflow.rs`). Waits for the device and for a CPU step still
    /// running: the state it exchanges must be current.
    fn reselect<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        if self.host.weights_ahead() {
            self.host.join()?;
            self.apply_and_gather(shared)?;
        }
        shared.device.synchronize()?;
        let owned_start = shared.owned.start;
        let optimizer = self.host.join()?;
        {
            let zenflow = &self.zenflow;
            // The columns leaving the selection: their device state is the current one, handed to
            // the host a piece of EXCHANGE_PIECE elements at a time (not the whole compact state).
            let len = zenflow.compact_len;
            let state = &zenflow.state;
            let mut selected = zenflow.selected_elements().take(len);
            for start in (0..len).step_by(EXCHANGE_PIECE) {
                let piece = start..(start + EXCHANGE_PIECE).min(len);
                let device_state = state
                    .arrays()
                    .map(|buffer| shared.device.download_range(buffer, piece.clone()));
                let [master, exp_avg, exp_avg_sq] = device_state;
                let (master, exp_avg, exp_avg_sq) = (master?, exp_avg?, exp_avg_sq?);
                for (j, flat) in (&mut selected).take(piece.len()).enumerate() {
                    let i = flat - owned_start;
                    optimizer.master[i] = master[j];
                    // The device keeps fp32 moments; bf16 host moments take them to nearest.
                    optimizer.moments.set(i, (exp_avg[j], exp_avg_sq[j]));
                }
            }
        }
        self.column_importance(shared)?;
        self.zenflow.select();
        // The columns entering the selection: their host state is the current one.
        let optimizer = &*self.host.join()?;
        load_selected(&shared.device, &self.zenflow, optimizer, owned_start, false)
    }

    /// Tells ZenFlow that the trainer's data has completed an epoch: with `select_strategy`
    /// `"epoch"` (or `"auto"`: every epoch) the columns are selected again at the next window
    /// start once `select_interval` epochs have ended since the last selection.
    pub fn end_epoch(&mut self) {
        if self.zenflow.select_epochs.is_some() {
            self.zenflow.epochs_since_selection += 1;
        }
    }

    /// This step's column importances (Σ|g| per column of every 2-D weight, summed over ranks,
    /// so that every rank selects the same columns and ends the same windows) into
    /// `importance_host`: computed on the compute stream from the reduced gradients.
    fn column_importance<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let across = shared.across_ranks();
        let zenflow = &mut self.zenflow;
        let (source, at) = shared.reduced_source();
        let device = &shared.device;
        let compute = device.stream(StreamKind::Compute);
        zenflow.queue_importance(device, compute, source, shared.owned.start - at)?;
        let ready = &mut zenflow.window_ready;
        let (importance, host) = (&zenflow.importance, &mut zenflow.importance_host);
        let comm = &shared.comm;
        sum_to_host(device, comm, across, StreamKind::Compute, ready, importance, host)?;
        Ok(())
    }

    /// The consolidated optimizer state (the host's, with the device's for the selected
    /// columns); a running CPU step is waited for, its weights staying pending. `master_only`
    /// leaves the moments empty.
    pub fn state<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
        master_only: bool,
    ) -> Result<PathState, EngineError> {
        let [mut master, mut exp_avg, mut exp_avg_sq] = match master_only {
            true => [self.host.join()?.master.to_vec(), Vec::new(), Vec::new()],
            false => self.host.state()?,
        };
        self.merge_device_state(shared, [&mut master, &mut exp_avg, &mut exp_avg_sq])?;
        let upload_pending = self.host.upload_pending();
        Ok(PathState { master, exp_avg, exp_avg_sq, upload_pending })
    }

    /// This rank's state as a checkpoint writes it (a running CPU step is waited for, its weights
    /// staying pending), and whether its weights are pending: the host's optimizer state lent,
    /// each piece merged with the device's state of the selected columns as it is written (the
    /// device's compact state downloaded once: a few percent of the partition), the window's
    /// sums downloaded a piece at a time.
    pub fn checkpoint_view<'a, C: Comm<Device = D>>(
        &'a mut self,
        shared: &'a Shared<D, C, P>,
    ) -> Result<(PartView<'a>, bool), EngineError> {
        self.host.join()?;
        let snapshot = ZenFlowSnapshot { window_grads: Vec::new(), ..self.meta(shared) };
        let upload_pending = self.host.upload_pending();
        let zenflow = &self.zenflow;
        let state = &zenflow.state;
        let host =
            self.host.settled().ok_or(EngineError::Internal("a joined step is not ready"))?;
        let owned = shared.owned.clone();
        let n = owned.len();
        let selection = Selection { zenflow, at: owned.start };
        let device = &shared.device;
        let master = selection.merged(device, &host.master, &state.master, |v| v);
        let (exp_avg, exp_avg_sq) = match &host.moments {
            HostMoments::F32 { exp_avg, exp_avg_sq } => (
                MomentView::F32(selection.merged(device, exp_avg, &state.exp_avg, |v| v)),
                MomentView::F32(selection.merged(device, exp_avg_sq, &state.exp_avg_sq, |v| v)),
            ),
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                let (m, v) = (&state.exp_avg, &state.exp_avg_sq);
                (
                    MomentView::Bf16(selection.merged(device, exp_avg, m, bf16::from_f32)),
                    MomentView::Bf16(selection.merged(device, exp_avg_sq, v, bf16::from_f32)),
                )
            }
        };
        let window = Elements::downloaded(device, &*zenflow.window, n);
        let part = PartView {
            flat: owned,
            master,
            exp_avg,
            exp_avg_sq,
            zenflow: Some((snapshot, window)),
        };
        Ok((part, upload_pending))
    }

    /// Overwrites the selected elements of a partition's host-side state (master, moments; a
    /// shorter vector is skipped) with the device's, which is the current state of those columns.
    fn merge_device_state<C: Comm<Device = D>>(
        &self,
        shared: &Shared<D, C, P>,
        state: [&mut Vec<f32>; 3],
    ) -> Result<(), EngineError> {
        let zenflow = &self.zenflow;
        if zenflow.compact_len == 0 {
            return Ok(());
        }
        let device = &zenflow.state;
        let owned = &shared.owned;
        for (buffer, host) in device.arrays().into_iter().zip(state) {
            if host.len() < owned.len() {
                continue;
            }
            let compact = shared.device.download(buffer)?;
            for (j, flat) in zenflow.selected_elements().enumerate() {
                host[flat - owned.start] = compact[j];
            }
        }
        Ok(())
    }

    /// ZenFlow's part of a snapshot (the optimizer has been joined).
    pub fn snapshot<C: Comm<Device = D>>(
        &self,
        shared: &Shared<D, C, P>,
    ) -> Result<ZenFlowSnapshot, EngineError> {
        let window = shared.device.download_range(&*self.zenflow.window, 0..shared.owned.len());
        Ok(ZenFlowSnapshot { window_grads: window?, ..self.meta(shared) })
    }

    /// [`ZenFlowUpdate::snapshot`] without the window's sums.
    fn meta<C: Comm<Device = D>>(&self, shared: &Shared<D, C, P>) -> ZenFlowSnapshot {
        let zenflow = &self.zenflow;
        ZenFlowSnapshot {
            selection: zenflow.selection(),
            steps_in_window: zenflow.steps_in_window,
            since_selection: zenflow.since_selection,
            epochs_since_selection: zenflow.epochs_since_selection,
            cpu_steps: zenflow.cpu_adamw.steps_taken(),
            window_flat: shared.owned.clone(),
            window_grads: Vec::new(),
            auto: zenflow.auto.as_ref().map(|a| a.state()).unwrap_or_default(),
        }
    }

    /// Checks the ZenFlow snapshots of any number of ranks and that their windows (in memory, or
    /// in the files of `parts`) cover this rank's, before anything is restored.
    pub fn check_restore<'a, C: Comm<Device = D>>(
        shared: &Shared<D, C, P>,
        saved: &'a [ZenFlowSnapshot],
        parts: &SavedParts<'a>,
    ) -> Result<ZenFlowRestore<'a>, EngineError> {
        let rank = shared.comm.rank();
        let Some(first) = saved.first() else {
            let reason = "a ZenFlow run resumes only with its ZenFlow state (selection, window \
                          position and sums), and the checkpoint has none";
            return Err(EngineError::Restore { rank, reason });
        };
        let counters = |s: &ZenFlowSnapshot| {
            (s.steps_in_window, s.since_selection, s.epochs_since_selection, s.cpu_steps)
        };
        if saved.iter().any(|s| counters(s) != counters(first)) {
            return Err(EngineError::Restore {
                rank,
                reason: "the ranks' ZenFlow states disagree",
            });
        }
        let window = SavedWindow::new(&shared.layout, &shared.owned, saved, parts, rank)?;
        let selection = saved.iter().flat_map(|s| s.selection.iter().cloned()).collect();
        Ok(ZenFlowRestore { window, first: first.clone(), selection })
    }

    /// Takes a checkpoint's optimizer state, and ZenFlow's from a checked checkpoint: the
    /// selection, the window's position and its device window; the selected columns' device
    /// state is taken from the host's. Master weights newer than the flat weights
    /// (`upload_pending`) go into the aside weights, to be applied where a CPU step's would be.
    pub fn restore<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
        state: &SavedState<'_>,
        upload_pending: bool,
        saved: Option<ZenFlowRestore<'_>>,
    ) -> Result<(), EngineError> {
        self.host.restore(state, upload_pending)?;
        self.restore_pending_weights(shared, upload_pending)?;
        let Some(ZenFlowRestore { window, first, selection }) = saved else { return Ok(()) };
        let (device, rank) = (&shared.device, shared.comm.rank());
        let zenflow = &mut self.zenflow;
        // The window's sums, a piece at a time.
        let mut piece = vec![0.0f32; RESTORE_PIECE.min(window.len())];
        for start in (0..window.len()).step_by(RESTORE_PIECE) {
            let end = (start + RESTORE_PIECE).min(window.len());
            window.read(start..end, &mut piece[..end - start])?;
            overwrite_at(device, &*zenflow.window, start, &piece[..end - start])?;
        }
        zenflow.restore_selection(&selection, rank)?;
        if let Some(auto) = &mut zenflow.auto {
            auto.restore(&first.auto, rank)?;
        }
        zenflow.steps_in_window = first.steps_in_window;
        zenflow.since_selection = first.since_selection;
        zenflow.epochs_since_selection = first.epochs_since_selection;
        zenflow.cpu_adamw.resume_at(first.cpu_steps);
        zenflow.device_done = None;
        let optimizer = &*self.host.join()?;
        load_selected(device, &self.zenflow, optimizer, shared.owned.start, true)
    }
}

impl<D: DeviceAdamW, P: Float> ZenFlowUpdate<D, P> {
    /// With `upload_pending`, writes the master weights as `P` into the aside weights chunk by
    /// chunk through an outgoing buffer (allocating them without `overlap_step`, where only a
    /// restore needs them) and marks them ready; without, marks nothing aside.
    fn restore_pending_weights<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        // The host path keeps them in its upload buffer (refreshed by its restore).
        let host_path = matches!(self.host, HostSide::Accumulated(_));
        self.zenflow.aside_ready = upload_pending && !host_path;
        if !self.zenflow.aside_ready {
            return Ok(());
        }
        let (device, len) = (&shared.device, shared.owned.len());
        if self.zenflow.aside.is_none() {
            self.zenflow.aside = Some(Arc::new(device.alloc(len.max(1))?));
        }
        let aside = self.zenflow.aside.as_deref().expect("allocated above");
        let StreamBuffers { state, outgoing, .. } = self.host.streamed()?.join()?;
        let out = outgoing.first_mut().ok_or(EngineError::Internal("no outgoing buffer"))?;
        let h2d = device.stream(StreamKind::H2d);
        let mut start = 0;
        while start < len {
            let end = (start + out.len()).min(len);
            convert_into(&state.adam, &mut out[..end - start], &state.master[start..end]);
            device.copy_h2d(h2d, out, 0..end - start, aside, start)?.wait()?;
            start = end;
        }
        Ok(())
    }
}

/// Uploads the host optimizer's state of the selected elements into ZenFlow's compact device
/// state, and with `weights` their master weights as `P` into the compact weights (as the device
/// step would have left them: a restore), [`EXCHANGE_PIECE`] elements at a time, each piece
/// gathered on all cores; then the column indices.
fn load_selected<D: DeviceAdamW, P: Float>(
    device: &D,
    zenflow: &ZenFlow<D, P>,
    optimizer: &HostOptimizer,
    owned_start: usize,
    weights: bool,
) -> Result<(), EngineError> {
    let len = zenflow.compact_len;
    if len == 0 {
        return Ok(());
    }
    let (state, master, moments) = (&zenflow.state, &optimizer.master[..], &optimizer.moments);
    let mut selected = zenflow.selected_elements().map(|flat| flat - owned_start);
    let mut piece = Vec::with_capacity(EXCHANGE_PIECE.min(len));
    for start in (0..len).step_by(EXCHANGE_PIECE) {
        piece.clear();
        piece.extend((&mut selected).take(EXCHANGE_PIECE.min(len - start)));
        let gather = |value: &(dyn Fn(usize) -> f32 + Sync)| -> Vec<f32> {
            piece.par_iter().map(|&i| value(i)).collect()
        };
        overwrite_at(device, &state.master, start, &gather(&|i| master[i]))?;
        overwrite_at(device, &state.exp_avg, start, &gather(&|i| moments.get(i).0))?;
        overwrite_at(device, &state.exp_avg_sq, start, &gather(&|i| moments.get(i).1))?;
        if weights {
            let compact: Vec<P> = piece.par_iter().map(|&i| P::from_f32(master[i])).collect();
            overwrite_at(device, &zenflow.weights, start, &compact)?;
        }
    }
    overwrite(device, &zenflow.index, &zenflow.indices)
}

/// Where a partition's selected elements are in ZenFlow's compact device state.
struct Selection<'a, D: DeviceAdamW, P: Float> {
    zenflow: &'a ZenFlow<D, P>,
    /// The flat index of the partition's first element.
    at: usize,
}

impl<D: DeviceAdamW, P: Float> Clone for Selection<'_, D, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: DeviceAdamW, P: Float> Copy for Selection<'_, D, P> {}

impl<'a, D: DeviceAdamW, P: Float> Selection<'a, D, P> {
    /// `values` (the host's state of the partition, as `T`) for a checkpoint, each piece merged,
    /// as it is written, with the device's state of its selected elements: the span of `compact`
    /// that piece touches, downloaded for it alone.
    fn merged<T: Clone>(
        self,
        device: &'a D,
        values: &'a [T],
        compact: &'a D::Buffer<f32>,
        into: fn(f32) -> T,
    ) -> Elements<'a, T> {
        Elements::fetched(values.len(), move |range: Range<usize>| {
            let mut piece = values[range.clone()].to_vec();
            let within = self.compact_range(range.clone());
            if !within.is_empty() {
                let part = device.download_range(compact, within.clone());
                let part = part.map_err(|e| e.to_string())?;
                self.patch(&mut piece, range, &part, within.start, into);
            }
            Ok(piece)
        })
    }

    /// The blocks that hold elements of the partition's elements `range`, each with its selected
    /// columns and the rows of it that `range` touches.
    fn touched(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (&Block, &[u32], Range<usize>)> + '_ {
        let (first, last) = (self.at + range.start, self.at + range.end);
        let zenflow = self.zenflow;
        zenflow.blocks.iter().filter_map(move |block| {
            let end = block.start + block.rows * block.cols;
            if end <= first || block.start >= last {
                return None;
            }
            let columns = &zenflow.indices[block.index.clone()];
            let rows = (first.max(block.start) - block.start) / block.cols
                ..(last.min(end) - block.start).div_ceil(block.cols);
            Some((block, columns, rows))
        })
    }

    /// The span of compact positions that [`Selection::patch`] reads for the partition's elements
    /// `range` (empty where none of them is selected).
    fn compact_range(&self, range: Range<usize>) -> Range<usize> {
        let spans = self.touched(range).filter(|(_, columns, _)| !columns.is_empty()).map(
            |(block, columns, rows)| {
                let n = columns.len();
                block.compact + rows.start * n..block.compact + rows.end * n
            },
        );
        spans.reduce(|a, b| a.start.min(b.start)..a.end.max(b.end)).unwrap_or(0..0)
    }

    /// Overwrites the selected elements of `piece` (the partition's elements `range`) with their
    /// values in `compact`, the compact buffer's elements from position `compact_at` on (in
    /// compact order), made `T` by `into`.
    fn patch<T>(
        &self,
        piece: &mut [T],
        range: Range<usize>,
        compact: &[f32],
        compact_at: usize,
        into: impl Fn(f32) -> T,
    ) {
        let (first, last) = (self.at + range.start, self.at + range.end);
        for (block, columns, rows) in self.touched(range) {
            for r in rows {
                for (k, &c) in columns.iter().enumerate() {
                    let flat = block.start + r * block.cols + c as usize;
                    if (first..last).contains(&flat) {
                        let at = block.compact + r * columns.len() + k - compact_at;
                        piece[flat - first] = into(compact[at]);
                    }
                }
            }
        }
    }
}
