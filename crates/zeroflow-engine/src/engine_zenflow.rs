//! The engine's ZenFlow step (DESIGN.md §6; the selection and the compact state are in
//! `zenflow.rs`).
//!
//! At every step: the selected columns' gradients are gathered on the compute stream (after the
//! comm stream's `norm_done`), stepped by the device AdamW and scattered into the flat weights,
//! and `device_done` is recorded; then the whole partition's gradients are added into the device
//! window. When a window ends (after `update_interval` steps, or when Zen-auto says so) the window
//! is copied into the host accumulator and cleared on the d2h stream, the CPU steps the partition
//! with it, and its weights reach the flat weights on the h2d stream (after `device_done`) with
//! the device's columns scattered over them again. With `overlap_step` the CPU step of a window
//! runs on a worker during the next window, uploads into the aside buffer, and is applied at that
//! window's end by a device copy.

use zeroflow_core::Float;
use zeroflow_device::{Comm, StreamKind};
use zeroflow_optim::AdamWStep;

use super::{
    Engine, Optimizer, OptimizerPart, Restore, assemble, overwrite, reduced_source, slot,
    sum_to_host,
};
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::HostOptimizer;
use crate::zenflow::{ZenFlow, ZenFlowSnapshot};

impl<D: DeviceAdamW, C: Comm<Device = D>, P: Float> Engine<D, C, P> {
    /// One ZenFlow step: a selection if one is due, the device step of the selected columns,
    /// this step's gradients added into the window, and at the end of a window the CPU step of
    /// the rest.
    pub(super) fn zenflow_update(&mut self, step: &AdamWStep) -> Result<(), EngineError> {
        // The gradients are final once the comm stream has computed the norm over them.
        let compute = self.device.stream(StreamKind::Compute);
        self.device.wait_event(compute, &self.events.norm_done)?;
        let selecting = self.zenflow.as_ref().is_some_and(|z| z.selection_due());
        if selecting {
            self.reselect()?;
        }
        self.zenflow_device_step(step)?;
        self.add_to_window()?;
        // Zen-auto weighs this step's column masses (a selection has just computed them).
        let auto = self.zenflow.as_ref().is_some_and(|z| z.auto.is_some());
        if auto && !selecting {
            self.column_importance()?;
        }
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
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
            return self.gather_from(StreamKind::Compute);
        }
        if let Some(auto) = &mut zenflow.auto {
            auto.reset();
        }
        let window = std::mem::take(&mut zenflow.steps_in_window);
        let overlap = zenflow.overlap;
        let begun = std::time::Instant::now();
        let cpu_step = self.window_step(step, window)?;
        let normed = begun.elapsed();
        self.take_window()?;
        let taken = begun.elapsed();
        let Optimizer::Host(host) = &mut self.optimizer else {
            return Err(EngineError::Usage("ZenFlow without offload"));
        };
        let started = std::time::Instant::now();
        if !overlap {
            host.step_now(&cpu_step)?;
            self.cpu_wait += started.elapsed();
            return self.upload_and_gather();
        }
        // The last window's CPU step finished meanwhile: its weights go to the device now; this
        // window's runs in the background until the next window ends.
        if host.weights_ahead() {
            host.join()?;
            self.cpu_wait += started.elapsed();
            self.upload_and_gather()?;
        } else {
            self.gather_from(StreamKind::Compute)?;
        }
        let applied = begun.elapsed();
        self.start_worker(cpu_step)?;
        tracing::debug!(
            window,
            ?normed,
            ?taken,
            ?applied,
            started = ?begun.elapsed(),
            "ZenFlow window end: norm, window copy queued, last CPU step applied, next started"
        );
        Ok(())
    }

    /// Adds this step's gradients into the window, on the compute stream (after the last
    /// window's copy has cleared it), and marks the window ready.
    fn add_to_window(&mut self) -> Result<(), EngineError> {
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
        let compute = self.device.stream(StreamKind::Compute);
        if let Some(copied) = &zenflow.window_copied {
            self.device.wait_event(compute, copied)?;
        }
        let (source, at) = reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
        let len = self.owned.len();
        self.device.accumulate(compute, source, at..at + len, &zenflow.window, 0, 1.0)?;
        let ready = slot(&mut zenflow.window_ready, &self.device)?;
        self.device.record(ready, compute)?;
        Ok(())
    }

    /// Copies the window into the host accumulator and clears it, on the d2h stream. The copy's
    /// token is let go: the accumulator remembers the copy, and the CPU step's first read of it
    /// (here or on the worker) waits for it.
    fn take_window(&mut self) -> Result<(), EngineError> {
        let (Optimizer::Host(host), Some(zenflow)) = (&mut self.optimizer, &mut self.zenflow)
        else {
            return Err(EngineError::Usage("ZenFlow without offload"));
        };
        let d2h = self.device.stream(StreamKind::D2h);
        let ready = zenflow.window_ready.as_ref().ok_or(EngineError::Usage("an empty window"))?;
        self.device.wait_event(d2h, ready)?;
        let acc = host.grad_acc.as_mut().ok_or(EngineError::Usage("ZenFlow streams"))?;
        let len = self.owned.len();
        let copy = self.device.copy_d2h(d2h, &zenflow.window, 0..len, acc, 0)?;
        std::mem::forget(copy);
        self.device.fill(d2h, &zenflow.window, 0..len, 0.0)?;
        let copied = slot(&mut zenflow.window_copied, &self.device)?;
        self.device.record(copied, d2h)?;
        Ok(())
    }

    /// Starts the CPU step of the window just taken on the worker, which then uploads its
    /// weights into the aside buffer on the h2d stream (after the last application of the aside
    /// buffer, queued there before).
    fn start_worker(&mut self, cpu_step: AdamWStep) -> Result<(), EngineError> {
        let (Optimizer::Host(host), Some(zenflow)) = (&mut self.optimizer, &mut self.zenflow)
        else {
            return Err(EngineError::Usage("ZenFlow without offload"));
        };
        let aside = zenflow.aside.clone().ok_or(EngineError::Usage("overlap without aside"))?;
        let (device, len) = (self.device.clone(), self.owned.len());
        zenflow.aside_ready = true;
        host.start_delayed_then(cpu_step, move |optimizer| {
            let upload = optimizer.upload.as_ref().ok_or(EngineError::Usage("no upload"))?;
            let h2d = device.stream(StreamKind::H2d);
            device.copy_h2d(h2d, upload, 0..len, &aside, 0)?.wait()?;
            Ok(())
        })
    }

    /// The CPU's step for the window of `window` steps that ends now: the gradients are its mean
    /// over the window's steps, clipped by the window's own norm. A window of one step is the step
    /// itself, so its scale is the device step's (no second norm).
    fn window_step(&mut self, step: &AdamWStep, window: u64) -> Result<AdamWStep, EngineError> {
        let update_interval = window.max(1);
        let grad_scale = if update_interval == 1 {
            step.scalars().grad_scale
        } else {
            let summed = f64::from(self.scaler.scale())
                * self.comm.world_size() as f64
                * update_interval as f64;
            let norm = self.window_sum_squares()?.sqrt() / summed;
            let clip_coef = match self.opts.clip {
                Some(max) if norm + 1e-6 > max => max / (norm + 1e-6),
                _ => 1.0,
            };
            (clip_coef / summed) as f32
        };
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
        Ok(zenflow.cpu_adamw.next_step(grad_scale))
    }

    /// Σ g² over the windows of all ranks (in loss-scaled, summed units), on the device.
    fn window_sum_squares(&mut self) -> Result<f64, EngineError> {
        let across = self.across_ranks();
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
        let compute = self.device.stream(StreamKind::Compute);
        self.device.sum_squares(compute, &zenflow.window, 0..self.owned.len(), &self.norm, 0)?;
        let ready = slot(&mut zenflow.window_ready, &self.device)?;
        let (norm, host) = (&self.norm, &mut self.norm_host);
        let read =
            sum_to_host(&self.device, &self.comm, across, StreamKind::Compute, ready, norm, host)?;
        Ok(f64::from(read[0]))
    }

    /// The selected columns: gather their gradients, AdamW over the compact state, scatter the
    /// weights back, all on the compute stream.
    fn zenflow_device_step(&mut self, step: &AdamWStep) -> Result<(), EngineError> {
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
        let len = zenflow.compact_len;
        if len == 0 {
            return Ok(());
        }
        let compute = self.device.stream(StreamKind::Compute);
        // Flat element `i` of the partition is at `i - shift` of `source`.
        let (source, at) = reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
        let shift = self.owned.start - at;
        for block in &zenflow.blocks {
            let (full, index) = (block.full(source, shift), block.index.clone());
            let compact = block.compact(&zenflow.grads);
            self.device.gather_columns(compute, full, &zenflow.index, index, compact)?;
        }
        self.device.cast(compute, &zenflow.grads, 0..len, &zenflow.grads_f32, 0)?;
        let (state, grads) = (&zenflow.state, &zenflow.grads_f32);
        self.device.adamw(compute, step, state, 0..len, grads, &zenflow.weights, 0)?;
        zenflow.scatter_weights(&self.device, compute, &self.params)?;
        let done = slot(&mut zenflow.device_done, &self.device)?;
        self.device.record(done, compute)?;
        Ok(())
    }

    /// A new selection from this step's gradients (a selection starts a window),
    /// with the state re-synchronised (see `zenflow.rs`). Waits for the device and for a CPU step
    /// still running: the state it exchanges must be current.
    fn reselect(&mut self) -> Result<(), EngineError> {
        if let Optimizer::Host(host) = &mut self.optimizer
            && host.weights_ahead()
        {
            host.join()?;
            self.upload_and_gather()?;
        }
        self.device.synchronize()?;
        let owned_start = self.owned.start;
        let (Optimizer::Host(host), Some(zenflow)) = (&mut self.optimizer, &mut self.zenflow)
        else {
            return Err(EngineError::Usage("ZenFlow without offload"));
        };
        let optimizer = host.join()?;
        // The columns leaving the selection: their device state is the current one.
        if zenflow.compact_len > 0 {
            let len = zenflow.compact_len;
            let state = &zenflow.state;
            let device_state = [&state.master, &state.exp_avg, &state.exp_avg_sq]
                .map(|buffer| self.device.download(buffer));
            let [master, exp_avg, exp_avg_sq] = device_state;
            let (master, exp_avg, exp_avg_sq) = (master?, exp_avg?, exp_avg_sq?);
            for (j, flat) in zenflow.selected_elements().enumerate().take(len) {
                let i = flat - owned_start;
                optimizer.master[i] = master[j];
                optimizer.exp_avg[i] = exp_avg[j];
                optimizer.exp_avg_sq[i] = exp_avg_sq[j];
            }
        }
        self.column_importance()?;
        let (Optimizer::Host(host), Some(zenflow)) = (&mut self.optimizer, &mut self.zenflow)
        else {
            unreachable!("checked above")
        };
        zenflow.select();
        // The columns entering the selection: their host state is the current one.
        load_selected(&self.device, zenflow, host.join()?, owned_start)?;
        Ok(())
    }

    /// Tells ZenFlow that the trainer's data has completed an epoch. With `select_strategy`
    /// `"epoch"` (or `"auto"`: every epoch) the columns are selected again at the next window
    /// start once `select_interval` epochs have ended since the last selection. Call it between
    /// steps, on every rank alike; without ZenFlow, or with step-based selection, it does nothing.
    pub fn end_epoch(&mut self) {
        if let Some(zenflow) = &mut self.zenflow
            && zenflow.select_epochs.is_some()
        {
            zenflow.epochs_since_selection += 1;
        }
    }

    /// This step's column importances (Σ|g| per column of every 2-D weight, summed over ranks,
    /// so that every rank selects the same columns and ends the same windows) into
    /// `importance_host`: computed on the compute stream from the reduced gradients.
    fn column_importance(&mut self) -> Result<(), EngineError> {
        let across = self.across_ranks();
        let Some(zenflow) = &mut self.zenflow else { unreachable!("a ZenFlow step") };
        let (source, at) = reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
        let compute = self.device.stream(StreamKind::Compute);
        zenflow.queue_importance(&self.device, compute, source, self.owned.start - at)?;
        let ready = slot(&mut zenflow.window_ready, &self.device)?;
        let (importance, host) = (&zenflow.importance, &mut zenflow.importance_host);
        sum_to_host(
            &self.device,
            &self.comm,
            across,
            StreamKind::Compute,
            ready,
            importance,
            host,
        )?;
        Ok(())
    }

    /// Overwrites the selected elements of a partition's host-side state (master, moments; a
    /// shorter vector is skipped) with the device's, which is the current state of those columns.
    pub(super) fn merge_zenflow_state(&self, state: [&mut Vec<f32>; 3]) -> Result<(), EngineError> {
        let Some(zenflow) = &self.zenflow else { return Ok(()) };
        if zenflow.compact_len == 0 {
            return Ok(());
        }
        let device = &zenflow.state;
        for (buffer, host) in
            [&device.master, &device.exp_avg, &device.exp_avg_sq].into_iter().zip(state)
        {
            if host.len() < self.owned.len() {
                continue;
            }
            let compact = self.device.download(buffer)?;
            for (j, flat) in zenflow.selected_elements().enumerate() {
                host[flat - self.owned.start] = compact[j];
            }
        }
        Ok(())
    }

    /// ZenFlow's part of a snapshot (the optimizer has been joined).
    pub(super) fn zenflow_snapshot(&self) -> Result<Option<ZenFlowSnapshot>, EngineError> {
        let Some(zenflow) = &self.zenflow else { return Ok(None) };
        let mut window = self.device.download(&zenflow.window)?;
        window.truncate(self.owned.len());
        Ok(Some(ZenFlowSnapshot {
            selection: zenflow.selection(),
            steps_in_window: zenflow.steps_in_window,
            since_selection: zenflow.since_selection,
            epochs_since_selection: zenflow.epochs_since_selection,
            cpu_steps: zenflow.cpu_adamw.steps_taken(),
            window_flat: self.owned.clone(),
            window_grads: window,
            auto: zenflow.auto.as_ref().map(|a| a.state()).unwrap_or_default(),
        }))
    }

    /// [`Engine::restore`] for a ZenFlow run: also the selection, the window's position and its
    /// device window, from the ZenFlow snapshots of any number of ranks (`from.parts` hold
    /// the consolidated optimizer state). The selected columns' device state is taken from it.
    pub fn restore_with_zenflow(
        &mut self,
        weights: &[P],
        from: &Restore<'_>,
        saved: &[ZenFlowSnapshot],
    ) -> Result<(), EngineError> {
        if self.zenflow.is_none() {
            return Err(EngineError::Usage("ZenFlow state given to an engine without ZenFlow"));
        }
        let first = saved.first().ok_or(EngineError::Usage("no ZenFlow state to restore"))?;
        let counters = |s: &ZenFlowSnapshot| {
            (s.steps_in_window, s.since_selection, s.epochs_since_selection, s.cpu_steps)
        };
        if saved.iter().any(|s| counters(s) != counters(first)) {
            return Err(EngineError::Usage("the ranks' ZenFlow states disagree"));
        }
        let window: Vec<OptimizerPart> = saved
            .iter()
            .map(|s| OptimizerPart {
                flat: s.window_flat.clone(),
                master: s.window_grads.clone(),
                exp_avg: vec![0.0; s.window_grads.len()],
                exp_avg_sq: vec![0.0; s.window_grads.len()],
            })
            .collect();
        let [window, _, _] = assemble(&self.layout, &self.owned, &window)?;
        self.restore_state(weights, from)?;
        let (Optimizer::Host(host), Some(zenflow)) = (&mut self.optimizer, &mut self.zenflow)
        else {
            unreachable!("checked above")
        };
        overwrite(&self.device, &zenflow.window, &window)?;
        zenflow.aside_ready = false;
        let selection: Vec<(usize, Vec<u32>)> =
            saved.iter().flat_map(|s| s.selection.iter().cloned()).collect();
        zenflow.restore_selection(&selection)?;
        if let Some(auto) = &mut zenflow.auto {
            auto.restore(&first.auto)?;
        }
        zenflow.steps_in_window = first.steps_in_window;
        zenflow.since_selection = first.since_selection;
        zenflow.epochs_since_selection = first.epochs_since_selection;
        zenflow.cpu_adamw.resume_at(first.cpu_steps);
        zenflow.device_done = None;
        let optimizer = host.join()?;
        let selected = load_selected(&self.device, zenflow, optimizer, self.owned.start)?;
        if selected.is_empty() {
            return Ok(());
        }
        // The selected columns' weights, as the device step would have left them.
        let compact: Vec<P> = selected.iter().map(|&i| P::from_f32(optimizer.master[i])).collect();
        overwrite(&self.device, &zenflow.weights, &compact)?;
        Ok(())
    }
}

/// Loads the selected elements' master weights and moments from the host optimizer (the current
/// state of those columns) into the compact device state, and the selection's column indices;
/// returns the selected elements' indices in the partition (empty: nothing to load).
fn load_selected<D: DeviceAdamW, P: Float>(
    device: &D,
    zenflow: &ZenFlow<D, P>,
    optimizer: &HostOptimizer<P>,
    owned_start: usize,
) -> Result<Vec<usize>, EngineError> {
    let selected: Vec<usize> = zenflow.selected_elements().map(|f| f - owned_start).collect();
    if selected.is_empty() {
        return Ok(selected);
    }
    let state = &zenflow.state;
    for (buffer, host_state) in [
        (&state.master, &optimizer.master),
        (&state.exp_avg, &optimizer.exp_avg),
        (&state.exp_avg_sq, &optimizer.exp_avg_sq),
    ] {
        let compact: Vec<f32> = selected.iter().map(|&i| host_state[i]).collect();
        overwrite(device, buffer, &compact)?;
    }
    overwrite(device, &zenflow.index, &zenflow.indices)?;
    Ok(selected)
}
