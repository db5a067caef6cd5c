//! [`Engine`]: one rank's view of a ZeRO data-parallel job.
//!
//! The data flow of one optimizer step (DESIGN.md §5):
//!
//! 1. `backward`: the compute stream waits until the gradient buffer is free (`comm_done`,
//!    `d2h_done`) and the weights are current (`params_ready`), zeroes the gradients where the
//!    stage asks for it, and runs the model. As the model reports ranges complete, whole buckets
//!    are handed on: the comm stream waits on `bucket_ready` (compute) and reduces the bucket so
//!    that each rank holds the sum of its own partition, which goes where the update path's sink
//!    says (`reduction.rs`): pieces for the host go to a courier thread (`courier.rs`), which
//!    copies them out and lands them (and, in the backward that ends an exact offload step,
//!    steps them speculatively: `speculation.rs`) while the model's backward is being queued.
//! 2. `step` at the accumulation boundary: `compute_done` is recorded, the path gives the
//!    gradient norm over all ranks, the overflow check and the clip coefficient follow
//!    ([`normalise`]), and the path updates the weights, after which `params_ready` is recorded.
//!    Device errors parked during the step (by tokens dropped without a wait) are collected last.
//!
//! The update path is one of five types, each in its own module with the buffers and events it
//! owns (`engine/path.rs` has the table of where each event is recorded and waited on):
//! `device.rs` (AdamW on the device), `accumulate.rs` (the host accumulator and the CPU step,
//! inline or delayed), `stream.rs` (one micro-step: gradients out and weights back chunk by
//! chunk, inline, left to the next forward, or delayed), `summed.rs` (the same from a window's
//! sum on the device) and `zenflow.rs` (ZenFlow's split update, DESIGN.md §6). `chunks.rs` holds
//! the chunk stream the streamed steps go through, with the inline step's gather in pieces;
//! `opening.rs` the step left to the next forward; `shared.rs` what every path uses: the flat
//! buffers, the shared events and the all-gather; `state.rs` the snapshot and the restore;
//! `model_io.rs` what the model gets, with the opener through which its forward starts before an
//! exact step's weights are all uploaded (`opening.rs`'s `Opening`).

mod accumulate;
mod chunks;
mod device;
mod model_io;
mod opening;
mod path;
mod share;
mod shared;
pub(crate) mod state;
mod stream;
mod summed;
mod zenflow;
mod zenflow_host;

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{Comm, HostMemory, StreamKind};
use zeroflow_optim::AdamW;

pub(crate) use self::chunks::{Handoff, StagingSlots};
pub use self::model_io::{ModelIo, Opener};
use self::opening::OpenEvents;
use self::path::{Open, OpenAt, UpdatePath};
pub use self::share::{SHARE_UPLOAD_BYTES, SHARE_UPLOAD_PIECE_BYTES};
pub(crate) use self::share::{staged_device_bytes, staged_piece};
use self::shared::{Events, Shared, normalise, reduced_source};
pub use self::state::{CheckpointState, OptimizerPart, Restore, SavedParts, Snapshot};
use crate::buckets::Bucketer;
use crate::courier;
use crate::device_adamw::DeviceAdamW;
use crate::host::StepTimes;
use crate::reduction::Reduction;
use crate::speculation::{Assumed, SpeculationStats};
use crate::{EngineError, EngineOptions, LossScaler, Stage};

/// What an optimizer step did.
#[derive(Clone, Debug, PartialEq)]
pub enum StepReport {
    /// Not an accumulation boundary: gradients were accumulated, nothing else.
    Accumulated,
    /// The weights were updated.
    Stepped { grad_norm: f64, clip_coef: f64, loss_scale: f32 },
    /// The gradients were not finite: the step was skipped (and with fp16 the scale adjusted).
    Skipped { loss_scale: f32 },
}

/// One rank of a ZeRO job. See the crate documentation for the loop that drives it.
pub struct Engine<D: DeviceAdamW, C: Comm<Device = D>, P: Float> {
    shared: Shared<D, C, P>,
    path: UpdatePath<D, P>,
    grad_accum: u64,
    bucketer: Bucketer,
    adamw: AdamW,
    scaler: LossScaler,
    /// The element type the optimizer keeps the moments in (fp32 on the device).
    moments: OptimizerStateDtype,
    micro_steps: u64,
    backward_pending: bool,
    /// The mutation of the self-check (see `Engine::mutate_remove_d2h_wait`, in tests and the
    /// `mutation-self-check` feature only); always false in a normal build.
    skip_d2h_wait: bool,
    /// The speculation steps what its budget holds however late ([`Engine::speculate_late`]).
    speculate_late: bool,
}

impl<D: DeviceAdamW, C: Comm<Device = D>, P: Float> Engine<D, C, P> {
    /// Allocates every buffer of the job (nothing is allocated later) and uploads `initial`
    /// weights (the whole flat buffer, padding zero).
    pub fn new(
        device: D,
        comm: C,
        layout: FlatLayout,
        opts: EngineOptions,
        initial: &[P],
    ) -> Result<Self, EngineError> {
        Self::with_weights(device, comm, layout, opts, initial.to_vec())
    }

    /// [`Engine::new`] taking the initial weights by value: they are dropped as soon as they are
    /// on the device and in the master weights, before the moments are allocated, so that host
    /// memory never holds them and the whole optimizer state at once (what a large model with
    /// offload needs to fit).
    pub fn with_weights(
        device: D,
        comm: C,
        layout: FlatLayout,
        opts: EngineOptions,
        initial: Vec<P>,
    ) -> Result<Self, EngineError> {
        if layout.world_size() != comm.world_size() {
            return Err(EngineError::Misuse(
                "the layout's world size differs from the communicator's",
            ));
        }
        if initial.len() != layout.padded_len() {
            return Err(EngineError::Misuse("initial weights must fill the whole flat buffer"));
        }
        opts.check()?;
        let owned = match opts.stage {
            Stage::Zero0 => 0..layout.padded_len(),
            Stage::Zero1 | Stage::Zero2 => layout.partition_range(comm.rank()),
        };
        let params = device.upload(&initial)?;
        let grads = device.alloc::<P>(layout.padded_len())?;
        let reduced = match (opts.stage, comm.world_size()) {
            (Stage::Zero1 | Stage::Zero2, 2..) => Some(device.alloc::<P>(owned.len())?),
            _ => None,
        };
        let path = UpdatePath::new(&device, &layout, &owned, &opts, initial)?;
        let events = Events::new(&device)?;
        let shared = Shared {
            norm: device.alloc(1)?,
            norm_host: device.alloc_host(1, HostMemory::Pinned)?,
            device,
            comm,
            layout,
            stage: opts.stage,
            clip: opts.clip,
            owned,
            params,
            grads,
            reduced,
            events,
            cpu_wait: std::time::Duration::ZERO,
            step_times: StepTimes::default(),
        };
        // Every host buffer is allocated: one warning with the total, where some that the
        // device copies from or into are pageable for want of pinned memory.
        shared.device.pinned_budget().warn_fallback();
        // One rank reduces nothing, so where its pieces go to the host, a bucket holds no more
        // than one copy's worth (a staging buffer's): its pieces reach the host, to be added or
        // stepped under the backward, as the backward finishes them, not a reduce bucket (5e8
        // elements by default) later (BENCHMARKS.md, "The speculation's pieces as the backward
        // finishes them").
        let to_host = match (shared.comm.world_size(), opts.offload()) {
            (1, Some(offload)) => offload.stream.chunk,
            _ => opts.reduce_bucket,
        };
        Ok(Engine {
            bucketer: Bucketer::new(opts.reduce_bucket, to_host, shared.layout.params().len()),
            adamw: AdamW::new(opts.adamw)?,
            scaler: opts.scaler.clone(),
            grad_accum: opts.grad_accum,
            moments: opts.offload().map_or(OptimizerStateDtype::Fp32, |offload| offload.moments),
            shared,
            path,
            micro_steps: 0,
            backward_pending: false,
            skip_d2h_wait: false,
            speculate_late: false,
        })
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.shared.layout
    }

    pub fn device(&self) -> &D {
        &self.shared.device
    }

    /// The flat weights on the device. With `StreamOptions::overlap_forward` the last step's
    /// weights may still be on their way (its forward opens them): call
    /// [`Engine::complete_step`] before reading them outside `backward`.
    pub fn params(&self) -> &D::Buffer<P> {
        &self.shared.params
    }

    /// Micro-steps taken so far.
    pub fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// Optimizer steps taken so far (skipped steps do not count).
    pub fn optimizer_steps(&self) -> u64 {
        self.adamw.steps_taken()
    }

    /// The flat range whose optimizer state this rank holds.
    pub fn owned_range(&self) -> Range<usize> {
        self.shared.owned.clone()
    }

    /// True if the micro-step about to run (or running) ends an accumulation window.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.micro_steps + 1).is_multiple_of(self.grad_accum)
    }

    /// Sets the learning rate of the following optimizer steps (for schedules).
    pub fn set_lr(&mut self, lr: f64) -> Result<(), EngineError> {
        self.path.set_lr(lr)?;
        Ok(self.adamw.set_lr(lr)?)
    }

    /// The learning rate of the next optimizer step.
    pub fn lr(&self) -> f64 {
        self.adamw.config().lr
    }

    /// The current loss scale.
    pub fn loss_scale(&self) -> f32 {
        self.scaler.scale()
    }

    /// The host gradient accumulator of this rank's partition (the accumulating offload paths),
    /// complete when `backward` returns. Where the window is summed on the device
    /// ([`crate::AccumulateOn`]) it holds the sum only after the window's last backward, and
    /// with the exact update and f32 or bf16 weights (the sum streamed) there is none.
    pub fn host_grad_accumulator(&self) -> Option<&[f32]> {
        self.path.host_grad_accumulator()
    }

    /// Time `step` has spent so far on the CPU optimizer's work or waiting for it (a CPU step
    /// run in line, streamed, or joined from the background): the part of the step time in which
    /// the GPU gets no new work because of the CPU. Zero without offload.
    pub fn cpu_wait(&self) -> std::time::Duration {
        self.shared.cpu_wait
    }

    /// Where the training thread's optimizer steps have gone so far (see [`StepTimes`]): the
    /// wait for the gradient norm, and the inline streaming step's waits and CPU work.
    pub fn step_times(&self) -> StepTimes {
        self.shared.step_times
    }

    /// What the exact offload step's speculation did so far: the steps it stepped pieces of
    /// during backward, those it had to redo or undo (`redone_steps`) and those it sat out. `None`
    /// where it does not run (no offload, the delayed update, ZenFlow, a budget of 0).
    pub fn speculation_stats(&self) -> Option<SpeculationStats> {
        self.path.speculation_stats()
    }

    /// The fp32 master weights of this rank's partition, downloaded (device) or copied (host).
    /// With the delayed update, waits for a running step first (see [`Engine::flush`]).
    pub fn master_weights(&mut self) -> Result<Vec<f32>, EngineError> {
        self.complete_step()?;
        self.path.master_weights(&self.shared)
    }

    /// With the delayed update: waits for the step still running and brings its weights into the
    /// model, so that `params()` holds every step taken. Call it before saving or evaluating at
    /// the end. Without the delayed update it does nothing.
    pub fn flush(&mut self) -> Result<(), EngineError> {
        self.complete_step()?;
        self.path.flush(&mut self.shared)
    }

    /// With `StreamOptions::overlap_forward`: runs the CPU work of the last step, which the next
    /// forward would have overlapped, now, so that [`Engine::params`] and the optimizer state
    /// hold every step taken. Call it before reading the weights outside `backward` (an
    /// evaluation, a download). The results do not change; otherwise it does nothing, and the
    /// delayed update's weights stay pending (see [`Engine::flush`]).
    pub fn complete_step(&mut self) -> Result<(), EngineError> {
        self.path.complete(&mut self.shared)
    }

    /// Tells ZenFlow that the trainer's data has completed an epoch (see
    /// [`crate::ZenFlowOptions::selection`]). Call it between steps, on every rank alike;
    /// without ZenFlow it does nothing.
    pub fn end_epoch(&mut self) {
        self.path.end_epoch();
    }

    /// Lets the exact offload step's speculation step every piece its budget holds, however late
    /// it reaches the host. By default no piece is stepped speculatively once the device is past
    /// the backward: a piece the backward does not hide costs its backup besides its step, more
    /// than the step after the backward spends on it. The results are the same either way; this
    /// is for tests that need pieces stepped whatever the device's timing.
    pub fn speculate_late(&mut self) {
        self.speculate_late = true;
    }

    /// Removes the event wait that orders each device-to-host gradient copy after its reduction:
    /// the mutation that proves the stress check can fail. Not part of a shipped build.
    #[cfg(any(test, feature = "mutation-self-check"))]
    pub fn mutate_remove_d2h_wait(&mut self) {
        self.skip_d2h_wait = true;
    }

    /// The element type the optimizer keeps the Adam moments in.
    pub fn optimizer_state_dtype(&self) -> OptimizerStateDtype {
        self.moments
    }

    /// Runs one micro-step's forward and backward. `forward_backward` queues the model on the
    /// compute stream and calls `grads_ready(range)` once for each stretch of whole parameters
    /// whose gradients it has finished adding, in backward order. Its own error type `E` reaches
    /// the caller as it is; the engine's errors become `E` through `From`.
    pub fn backward<F, E>(&mut self, forward_backward: F) -> Result<(), E>
    where
        F: FnOnce(
            ModelIo<'_, D, P>,
            &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
        ) -> Result<(), E>,
        E: From<EngineError>,
    {
        let (reduce_now, zero) = self.begin_backward()?;
        let boundary = reduce_now && self.is_gradient_accumulation_boundary();
        let assumed = boundary.then(|| self.assumed_step());
        let (loss_scale, skip_d2h_wait) = (self.scaler.scale(), self.skip_d2h_wait);
        let speculate_late = self.speculate_late;
        let Engine { shared, path, bucketer, .. } = self;
        let Shared { device, comm, layout, events, params, grads, reduced, owned, .. } = shared;
        let times = &mut shared.step_times;
        let Events { bucket_ready, d2h_done, params_ready, compute_done, norm_done, .. } = events;
        let (device, grads, params) = (&*device, &*grads, &*params);
        let source = reduced_source::<D, P>(reduced, grads, owned.start);
        // A step left for this forward (`overlap_forward`): opened as the model reads weights.
        let mut no_gather = |_| Ok(());
        let at = OpenAt {
            device,
            params,
            source,
            owned: owned.clone(),
            padded_len: layout.padded_len(),
            events: OpenEvents { norm_done, compute_done, d2h_done, params_ready },
            uploaded: &mut no_gather,
            times,
            zero: zero.then_some(grads),
        };
        let (sink, mut opening) = path.sink_or_open(assumed, boundary, at)?;
        let to_host = sink.to_host();
        let deferred = opening.is_some();
        let mut open = |end| opening.iter_mut().for_each(|opening| opening.open(end));
        let weights = match deferred {
            true => Opener { open: Some(&mut open) },
            false => Opener::current(),
        };
        let io = ModelIo { params, grads, loss_scale, weights };
        let (model, landed) = courier::run(device, sink, source.0, |route| {
            let mut flow = Reduction {
                device,
                comm,
                layout,
                owned: owned.clone(),
                grads,
                reduced: reduced.as_ref(),
                bucket_ready,
                route,
                enabled: reduce_now,
                skip_d2h_wait,
            };
            bucketer.reset(to_host);
            forward_backward(io, &mut |range| {
                bucketer.report(layout, range, &mut |bucket| flow.reduce_bucket(bucket))
            })?;
            bucketer.finish(layout, &mut |bucket| flow.reduce_bucket(bucket))?;
            match speculate_late {
                true => Ok(()),
                false => flow.backward_queued().map_err(E::from),
            }
        });
        if let Some((opened_all, spent)) = opening.map(Open::end) {
            self.shared.cpu_wait += spent;
            if !opened_all? {
                return Err(EngineError::Misuse(
                    "the model read the weights without opening them (ModelIo::open) while the \
                     last step was left to its forward (StreamOptions::overlap_forward)",
                )
                .into());
            }
        }
        model?;
        landed?;
        if reduce_now {
            self.shared.record_consumers(self.path.offloads())?;
        }
        self.backward_pending = true;
        Ok(())
    }

    /// The step that the backward ending this optimizer step speculates on: the next step's
    /// scalars if the norm is within the clip, exactly as [`Engine::step`] will compute them then.
    fn assumed_step(&self) -> Assumed {
        let (loss_scale, world) = (self.scaler.scale(), self.shared.comm.world_size());
        let unclipped = normalise(0.0, loss_scale, world, self.grad_accum, None);
        let summed = f64::from(loss_scale) * world as f64 * self.grad_accum as f64;
        let step = self.adamw.clone().next_step(unclipped.grad_scale);
        Assumed { step, summed, clip: self.shared.clip }
    }

    /// The start of a backward: the compute stream waits until the gradients are free and the
    /// weights current, and the gradients are zeroed where the stage asks for it. Returns whether
    /// this backward reduces its gradients, and whether the gradients are zeroed later, once the
    /// forward has opened a step left to it (which reads them meanwhile).
    fn begin_backward(&mut self) -> Result<(bool, bool), EngineError> {
        if self.backward_pending {
            return Err(EngineError::Misuse("backward called twice without step"));
        }
        let reduce_now =
            self.shared.stage == Stage::Zero2 || self.is_gradient_accumulation_boundary();
        let window_start = self.micro_steps.is_multiple_of(self.grad_accum);
        let deferred = self.path.defers();
        let Shared { device, events, grads, layout, stage, .. } = &self.shared;
        let compute = device.stream(StreamKind::Compute);
        // With a step left to the forward, its opening waits for the copies and the uploads.
        let waits = match deferred {
            false => [&events.comm_done, &events.d2h_done, &events.params_ready],
            true => [&events.comm_done, &None, &None],
        };
        for event in waits.into_iter().flatten() {
            device.wait_event(compute, event)?;
        }
        let zero = *stage == Stage::Zero2 || window_start;
        if zero && !deferred {
            device.fill(compute, grads, 0..layout.padded_len(), P::default())?;
        }
        Ok((reduce_now, zero && deferred))
    }

    /// Ends the micro-step: at an accumulation boundary, one optimizer step. Then the device
    /// errors parked since the last step (DESIGN.md §3 rule 4) are returned, the first of them.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let report = self.optimizer_step()?;
        let mut parked = self.shared.device.take_errors().into_iter();
        match parked.next() {
            None => Ok(report),
            Some(first) => {
                for later in parked {
                    tracing::warn!(error = %later, "a further device error parked in this step");
                }
                Err(first.into())
            }
        }
    }

    /// [`Engine::step`] before the parked errors: norm, skip on non-finite, clip, update, zero.
    fn optimizer_step(&mut self) -> Result<StepReport, EngineError> {
        if !std::mem::take(&mut self.backward_pending) {
            return Err(EngineError::Misuse("step called without backward"));
        }
        let boundary = self.is_gradient_accumulation_boundary();
        self.micro_steps += 1;
        if !boundary {
            return Ok(StepReport::Accumulated);
        }
        let compute = self.shared.device.stream(StreamKind::Compute);
        self.shared.device.record(&mut self.shared.events.compute_done, compute)?;
        let waiting = std::time::Instant::now();
        let sum_squares = self.path.sum_squares(&mut self.shared)?;
        self.shared.step_times.norm_wait += waiting.elapsed();
        let loss_scale = self.scaler.scale();
        let world = self.shared.comm.world_size();
        let norm = normalise(sum_squares, loss_scale, world, self.grad_accum, self.shared.clip);
        if !norm.grad_norm.is_finite() {
            // (ZenFlow's window is untouched: a step's gradients join it only once stepped.)
            tracing::warn!(loss_scale, "non-finite gradients: step skipped");
            self.scaler.update(true);
            self.path.skip();
            self.path.zero_accumulator(&mut self.shared)?;
            return Ok(StepReport::Skipped { loss_scale: self.scaler.scale() });
        }
        let step = self.adamw.next_step(norm.grad_scale);
        self.path.update(&mut self.shared, &step, loss_scale)?;
        self.path.zero_accumulator(&mut self.shared)?;
        self.scaler.update(false);
        let (grad_norm, clip_coef) = (norm.grad_norm, norm.clip_coef);
        Ok(StepReport::Stepped { grad_norm, clip_coef, loss_scale })
    }
}

impl<D: DeviceAdamW, C: Comm<Device = D>, P: Float> std::fmt::Debug for Engine<D, C, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("device", &self.shared.device)
            .field("rank", &self.shared.comm.rank())
            .field("world_size", &self.shared.comm.world_size())
            .field("stage", &self.shared.stage)
            .field("owned", &self.shared.owned)
            .field("micro_steps", &self.micro_steps)
            .finish_non_exhaustive()
    }
}
