//! [`Engine`]: one rank's view of a ZeRO data-parallel job.
//!
//! The data flow of one optimizer step (DESIGN.md §5), with every hand-off between streams an event
//! recorded here and waited on there:
//!
//! 1. `backward`: the compute stream waits until the gradient buffer is free (`grads_free`) and the
//!    weights are current (`params_ready`), zeroes the gradients where the stage asks for it, and
//!    runs the model. As the model reports ranges complete, whole buckets are handed on: the comm
//!    stream waits on `bucket_ready` (compute) and reduces the bucket so that each rank holds the
//!    sum of its own partition; then either the comm stream adds the rank's piece into the device
//!    accumulator, or the d2h stream waits on `reduced` (comm) and copies it into pinned staging,
//!    and the host adds it into the host accumulator once the copy's token has been waited on.
//! 2. `step` at the accumulation boundary: the gradient norm over all ranks, the overflow check,
//!    the clip coefficient, one AdamW step over the partition (on the device, or on the CPU with
//!    the result uploaded on the h2d stream), and the all-gather of the updated partitions, after
//!    which `params_ready` is recorded.
//!
//! With ZenFlow, step 2 splits: the selected columns are stepped on the device every step and
//! the rest on the CPU once per window (`engine_zenflow.rs`, DESIGN.md §6).

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{DType, Float};
use zeroflow_device::{Comm, Device, HostBuffer, HostMemory, ReduceOp, StreamKind};
use zeroflow_optim::{AdamW, CpuAdam, SimdLevel, Stores};

use crate::buckets::Bucketer;
use crate::device_adamw::{DeviceAdamState, DeviceAdamW};
use crate::host::{Carried, Chunks, HostState, Offloader, OptimizerSlot, StepTimes, stream_chunks};
use crate::reduction::{Reduction, Sink};
use crate::zenflow::{ZenFlow, ZenFlowSnapshot};

#[path = "engine_zenflow.rs"]
mod zenflow_step;
use crate::{EngineError, EngineOptions, LossScaler, Stage};

/// What the model gets for one forward and backward.
#[derive(Debug)]
pub struct ModelIo<'a, D: Device, P: Float> {
    /// The flat weights (read them on the compute stream).
    pub params: &'a D::Buffer<P>,
    /// The flat gradients: backward must ADD into them on the compute stream.
    pub grads: &'a D::Buffer<P>,
    /// The factor to multiply the loss by before backward (fp16 loss scaling; 1 otherwise).
    pub loss_scale: f32,
}

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

/// Where the fp32 optimizer state lives.
enum Optimizer<D: Device, P: Float> {
    Device { state: DeviceAdamState<D>, grad_acc: D::Buffer<f32> },
    Host(Box<HostState<P>>),
}

/// Where the streaming delayed update keeps a step's gradients while the next backward writes
/// the gradient buffer, and the updated weights while the next forward reads the weights: this
/// rank's partition of each, on the device (shared with the step's worker thread).
struct Aside<D: Device, P: Float> {
    grads: Arc<D::Buffer<P>>,
    params: Arc<D::Buffer<P>>,
}

/// The streaming step gathers its uploaded chunks in pieces of at least this many elements (32
/// MiB of bf16), however small the chunks, or an eighth of the partition where that is less: one
/// collective per rank and piece.
const GATHER_PIECE: usize = 1 << 24;

/// Events the engine owns, each recorded in one place and waited on in another.
struct Events<D: Device> {
    /// Compute → comm: a bucket's gradients are complete.
    bucket_ready: D::Event,
    /// Comm → d2h: a bucket is reduced.
    reduced: D::Event,
    /// Comm and d2h → compute: the last backward's gradients have been consumed.
    comm_done: Option<D::Event>,
    d2h_done: Option<D::Event>,
    /// → compute: the weights are updated.
    params_ready: Option<D::Event>,
    /// Compute → h2d/comm: the last forward/backward has stopped reading the weights.
    compute_done: D::Event,
    /// Comm → d2h: the global norm is computed.
    norm_done: D::Event,
    /// Comm → compute: the device accumulator is complete.
    accumulated: D::Event,
    /// Compute → comm: the device optimizer has read the accumulator.
    optimizer_done: D::Event,
    /// Comm → d2h: the delayed step's gradients are set aside.
    aside_taken: D::Event,
    /// H2d → comm: a chunk of the streaming step is uploaded, for its gather.
    chunk_uploaded: D::Event,
}

/// One rank of a ZeRO job. See the crate documentation for the loop that drives it.
pub struct Engine<D: DeviceAdamW, C: Comm<Device = D>, P: Float> {
    device: D,
    comm: C,
    layout: FlatLayout,
    opts: EngineOptions,
    /// The flat elements whose optimizer state this rank holds.
    owned: Range<usize>,
    params: D::Buffer<P>,
    grads: D::Buffer<P>,
    /// The reduced gradients of `owned` (stages 1 and 2 with more than one rank).
    reduced: Option<D::Buffer<P>>,
    optimizer: Optimizer<D, P>,
    /// The streaming delayed update's device buffers (see [`Engine::start_delayed_stream`]).
    aside: Option<Aside<D, P>>,
    /// ZenFlow's selection and device state (see `zenflow.rs`).
    zenflow: Option<ZenFlow<D, P>>,
    norm: D::Buffer<f32>,
    norm_host: HostBuffer<f32>,
    events: Events<D>,
    bucketer: Bucketer,
    adamw: AdamW,
    scaler: LossScaler,
    micro_steps: u64,
    backward_pending: bool,
    /// Time the calling thread has spent on or waiting for the CPU optimizer (see
    /// [`Engine::cpu_wait`]).
    cpu_wait: std::time::Duration,
    /// Where the training thread's optimizer steps went ([`Engine::step_times`]).
    step_times: StepTimes,
    /// The mutation of the self-check (see [`Engine::mutate_remove_d2h_wait`]); always false in
    /// a normal build.
    skip_d2h_wait: bool,
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
            return Err(EngineError::Usage(
                "the layout's world size differs from the communicator's",
            ));
        }
        if initial.len() != layout.padded_len() {
            return Err(EngineError::Usage("initial weights must fill the whole flat buffer"));
        }
        if opts.delayed_update.is_some() && opts.offload.is_none() {
            return Err(EngineError::Usage("the delayed update needs CPU optimizer offload"));
        }
        if opts.grad_accum == 0 {
            return Err(EngineError::Usage("gradient accumulation steps must be at least 1"));
        }
        if opts.stream_chunk == 0 {
            return Err(EngineError::Usage(
                "the offload stream's chunk must be at least 1 element",
            ));
        }
        if opts.zenflow.is_some() {
            check_zenflow(&opts)?;
        }
        let world = comm.world_size();
        let owned = match opts.stage {
            Stage::Zero0 => 0..layout.padded_len(),
            Stage::Zero1 | Stage::Zero2 => layout.partition_range(comm.rank()),
        };
        let params = device.upload(&initial)?;
        let grads = device.alloc::<P>(layout.padded_len())?;
        let reduced = match (opts.stage, world) {
            (Stage::Zero1 | Stage::Zero2, 2..) => Some(device.alloc::<P>(owned.len())?),
            _ => None,
        };
        let optimizer = match opts.offload {
            None => {
                let master: Vec<f32> = initial[owned.clone()].iter().map(|p| p.to_f32()).collect();
                drop(initial);
                Optimizer::Device {
                    state: DeviceAdamState {
                        master: device.upload(&master)?,
                        exp_avg: device.alloc(owned.len())?,
                        exp_avg_sq: device.alloc(owned.len())?,
                    },
                    grad_acc: device.alloc(owned.len())?,
                }
            }
            Some(memory) => {
                let overlap = opts.zenflow.is_some_and(|z| z.overlap_step);
                let delayed = opts.delayed_update.is_some() || overlap;
                let bucket = if opts.zenflow.is_some() { 1 } else { opts.reduce_bucket };
                // One micro-step per step and no delayed update: nothing needs the gradients on
                // the host between backward and step, so the step streams them (the CPU reads
                // f32 and bf16 gradients as they are; f16 goes through the accumulator).
                // ZenFlow sums a window of steps on the device and copies the sum into the
                // accumulator once per window (no staging: nothing goes out bucket by bucket).
                let streaming = opts.grad_accum == 1
                    && opts.zenflow.is_none()
                    && matches!(P::DTYPE, DType::F32 | DType::Bf16);
                // A streamed chunk is uploaded as soon as it is written: from the caches. A whole
                // partition's copy is too big for them: past them, without reading its lines.
                let stores = opts.copy_stores.unwrap_or(if streaming {
                    Stores::Normal
                } else {
                    Stores::NonTemporal
                });
                let adam = CpuAdam::new(opts.cpu_threads.max(1), SimdLevel::detect())?
                    .with_copy_stores(stores);
                let own = owned.clone();
                let fill_master = move |master: &mut [f32]| {
                    let chunk = 1 << 16;
                    master.par_chunks_mut(chunk).zip(initial[own].par_chunks(chunk)).for_each(
                        |(master, initial)| {
                            master.iter_mut().zip(initial).for_each(|(m, p)| *m = p.to_f32());
                        },
                    );
                };
                Optimizer::Host(Box::new(HostState::new(
                    &device,
                    owned.len(),
                    fill_master,
                    bucket,
                    opts.stream_chunk,
                    memory,
                    adam,
                    delayed,
                    streaming,
                )?))
            }
        };
        let streams_delayed = matches!(&optimizer, Optimizer::Host(host) if host.streaming())
            && opts.delayed_update.is_some();
        let aside = if streams_delayed {
            Some(Aside {
                grads: Arc::new(device.alloc::<P>(owned.len())?),
                params: Arc::new(device.alloc::<P>(owned.len())?),
            })
        } else {
            None
        };
        let zenflow = match &opts.zenflow {
            Some(z) => Some(ZenFlow::new(&device, &layout, &owned, z, opts.adamw)?),
            None => None,
        };
        let events = Events {
            bucket_ready: device.new_event()?,
            reduced: device.new_event()?,
            comm_done: None,
            d2h_done: None,
            params_ready: None,
            compute_done: device.new_event()?,
            norm_done: device.new_event()?,
            accumulated: device.new_event()?,
            optimizer_done: device.new_event()?,
            aside_taken: device.new_event()?,
            chunk_uploaded: device.new_event()?,
        };
        Ok(Engine {
            norm: device.alloc(1)?,
            norm_host: device.alloc_host(1, HostMemory::Pinned)?,
            bucketer: Bucketer::new(opts.reduce_bucket, layout.params().len()),
            adamw: AdamW::new(opts.adamw)?,
            scaler: opts.scaler.clone(),
            device,
            comm,
            layout,
            opts,
            owned,
            params,
            grads,
            reduced,
            optimizer,
            aside,
            zenflow,
            events,
            micro_steps: 0,
            backward_pending: false,
            cpu_wait: std::time::Duration::ZERO,
            step_times: StepTimes::default(),
            skip_d2h_wait: false,
        })
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// The flat weights on the device.
    pub fn params(&self) -> &D::Buffer<P> {
        &self.params
    }

    /// Micro-steps taken so far.
    pub fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// Optimizer steps taken so far (skipped steps do not count).
    pub fn optimizer_steps(&self) -> u64 {
        self.adamw.steps_taken()
    }

    /// True if the micro-step about to run (or running) ends an accumulation window.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.micro_steps + 1).is_multiple_of(self.opts.grad_accum)
    }

    /// Sets the learning rate of the following optimizer steps (for schedules).
    pub fn set_lr(&mut self, lr: f64) -> Result<(), EngineError> {
        if let Some(zenflow) = &mut self.zenflow {
            zenflow.cpu_adamw.set_lr(lr)?;
        }
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

    /// The host gradient accumulator of this rank's partition (offload only). Every copy into it
    /// has been waited on before `backward` returns, so it shows only completed data.
    pub fn host_grad_accumulator(&self) -> Option<&[f32]> {
        match &self.optimizer {
            Optimizer::Host(host) => host.grad_acc.as_deref(),
            Optimizer::Device { .. } => None,
        }
    }

    /// Time `step` has spent so far on the CPU optimizer's work or waiting for it (a CPU step
    /// run in line, streamed, or joined from the background): the part of the step time in which
    /// the GPU gets no new work because of the CPU. Zero without offload.
    pub fn cpu_wait(&self) -> std::time::Duration {
        self.cpu_wait
    }

    /// Where the training thread's optimizer steps have gone so far (see [`StepTimes`]): the
    /// wait for the gradient norm, and the inline streaming step's waits and CPU work.
    pub fn step_times(&self) -> StepTimes {
        self.step_times
    }

    /// The fp32 master weights of this rank's partition, downloaded (device) or copied (host).
    /// With the delayed update, waits for a running step first (see [`Engine::flush`]).
    pub fn master_weights(&mut self) -> Result<Vec<f32>, EngineError> {
        match &mut self.optimizer {
            Optimizer::Host(host) => {
                let mut master = host.join()?.master.to_vec();
                let (mut exp_avg, mut exp_avg_sq) = (Vec::new(), Vec::new());
                self.merge_zenflow_state([&mut master, &mut exp_avg, &mut exp_avg_sq])?;
                Ok(master)
            }
            Optimizer::Device { state, .. } => Ok(self.device.download(&state.master)?),
        }
    }

    /// With the delayed update: waits for the step still running and brings its weights into the
    /// model, so that `params()` holds every step taken. Call it before saving or evaluating at
    /// the end. Without the delayed update it does nothing.
    pub fn flush(&mut self) -> Result<(), EngineError> {
        let Optimizer::Host(host) = &mut self.optimizer else { return Ok(()) };
        if host.weights_ahead() {
            host.join()?;
            self.upload_and_gather()?;
        }
        Ok(())
    }

    /// Removes the event wait that orders each device-to-host gradient copy after its reduction:
    /// the mutation that proves the stress check can fail. Not part of a shipped build.
    #[cfg(any(test, feature = "mutation-self-check"))]
    pub fn mutate_remove_d2h_wait(&mut self) {
        self.skip_d2h_wait = true;
    }

    /// This rank's optimizer state and the engine's counters, for a checkpoint (save the weights
    /// of [`Engine::params`] with it). With the delayed update, a running step is waited for but
    /// its weights stay pending, exactly as without the snapshot, so checkpointing does not
    /// change the run.
    pub fn snapshot(&mut self) -> Result<Snapshot, EngineError> {
        let (master, exp_avg, exp_avg_sq, upload_pending) = match &mut self.optimizer {
            Optimizer::Host(host) => {
                let opt = host.join()?;
                let mut state =
                    (opt.master.to_vec(), opt.exp_avg.to_vec(), opt.exp_avg_sq.to_vec());
                let pending = host.upload_pending;
                self.merge_zenflow_state([&mut state.0, &mut state.1, &mut state.2])?;
                (state.0, state.1, state.2, pending)
            }
            Optimizer::Device { state, .. } => (
                self.device.download(&state.master)?,
                self.device.download(&state.exp_avg)?,
                self.device.download(&state.exp_avg_sq)?,
                false,
            ),
        };
        Ok(Snapshot {
            upload_pending,
            part: OptimizerPart { flat: self.owned.clone(), master, exp_avg, exp_avg_sq },
            optimizer_steps: self.adamw.steps_taken(),
            micro_steps: self.micro_steps,
            scaler: self.scaler.clone(),
            zenflow: self.zenflow_snapshot()?,
        })
    }

    /// Continues from a checkpoint: the flat weights (in this engine's layout), the optimizer
    /// state of any set of parts that together cover this rank's parameters (saved at any world
    /// size), and the counters. Call it between optimizer steps, before the next backward.
    ///
    /// A ZenFlow engine resumes with [`Engine::restore_with_zenflow`].
    pub fn restore(&mut self, weights: &[P], from: &Restore<'_>) -> Result<(), EngineError> {
        if self.zenflow.is_some() {
            return Err(EngineError::Usage(
                "a ZenFlow run resumes only with its ZenFlow state (selection, window position \
                 and sums): use restore_with_zenflow",
            ));
        }
        self.restore_state(weights, from)
    }

    /// [`Engine::restore`] without the ZenFlow check.
    fn restore_state(&mut self, weights: &[P], from: &Restore<'_>) -> Result<(), EngineError> {
        let Restore { parts, optimizer_steps, micro_steps, upload_pending, .. } = *from;
        if weights.len() != self.layout.padded_len() {
            return Err(EngineError::Usage("restored weights must fill the whole flat buffer"));
        }
        if self.backward_pending || !micro_steps.is_multiple_of(self.opts.grad_accum) {
            return Err(EngineError::Usage("restore only at an optimizer-step boundary"));
        }
        // Each optimizer step ends a window of micro-steps (skipped steps count none): more is a
        // damaged or hand-made checkpoint, and the next step must still be countable.
        if micro_steps == u64::MAX || optimizer_steps > micro_steps / self.opts.grad_accum {
            return Err(EngineError::Usage(
                "the checkpoint's step counters are inconsistent: more optimizer steps than its \
                 micro-steps allow, or no step left to count",
            ));
        }
        let [master, exp_avg, exp_avg_sq] = assemble(&self.layout, &self.owned, parts)?;
        self.device.synchronize()?;
        overwrite(&self.device, &self.params, weights)?;
        match &mut self.optimizer {
            Optimizer::Host(host) => {
                let opt = host.join()?;
                opt.master.copy_from_slice(&master);
                opt.exp_avg.copy_from_slice(&exp_avg);
                opt.exp_avg_sq.copy_from_slice(&exp_avg_sq);
                opt.refresh_upload();
                host.clear_accumulator();
                host.upload_pending = upload_pending;
                if let Some(aside) = &self.aside {
                    // Where the streaming delayed update keeps weights not yet on the device.
                    let weights: Vec<P> = master.iter().map(|m| P::from_f32(*m)).collect();
                    overwrite(&self.device, &aside.params, &weights)?;
                }
            }
            Optimizer::Device { state, grad_acc } => {
                overwrite(&self.device, &state.master, &master)?;
                overwrite(&self.device, &state.exp_avg, &exp_avg)?;
                overwrite(&self.device, &state.exp_avg_sq, &exp_avg_sq)?;
                overwrite(&self.device, grad_acc, &vec![0.0; master.len()])?;
            }
        }
        self.adamw.resume_at(optimizer_steps);
        self.micro_steps = micro_steps;
        self.scaler = from.scaler.clone();
        Ok(())
    }

    /// The flat range whose optimizer state this rank holds.
    pub fn owned_range(&self) -> Range<usize> {
        self.owned.clone()
    }

    /// Runs one micro-step's forward and backward. `forward_backward` queues the model on the
    /// compute stream and calls `grads_ready(range)` once for each stretch of whole parameters
    /// whose gradients it has finished adding, in backward order.
    pub fn backward<F>(&mut self, forward_backward: F) -> Result<(), EngineError>
    where
        F: FnOnce(
            ModelIo<'_, D, P>,
            &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
        ) -> Result<(), EngineError>,
    {
        if self.backward_pending {
            return Err(EngineError::Usage("backward called twice without step"));
        }
        let reduce_now =
            self.opts.stage == Stage::Zero2 || self.is_gradient_accumulation_boundary();
        let window_start = self.micro_steps.is_multiple_of(self.opts.grad_accum);
        let compute = self.device.stream(StreamKind::Compute);
        let events = [&self.events.comm_done, &self.events.d2h_done, &self.events.params_ready];
        for event in events.into_iter().flatten() {
            self.device.wait_event(compute, event)?;
        }
        if self.opts.stage == Stage::Zero2 || window_start {
            self.device.fill(compute, &self.grads, 0..self.layout.padded_len(), P::default())?;
        }
        let io =
            ModelIo { params: &self.params, grads: &self.grads, loss_scale: self.scaler.scale() };
        let mut flow = Reduction {
            device: &self.device,
            comm: &self.comm,
            layout: &self.layout,
            owned: self.owned.clone(),
            grads: &self.grads,
            reduced: self.reduced.as_ref(),
            bucket_ready: &mut self.events.bucket_ready,
            reduced_event: &mut self.events.reduced,
            sink: match &mut self.optimizer {
                Optimizer::Device { grad_acc, .. } => Sink::Device(grad_acc),
                // ZenFlow adds each step into its window on the device (`engine_zenflow.rs`).
                Optimizer::Host(_) if self.zenflow.is_some() => Sink::Keep,
                Optimizer::Host(host) => match &mut host.grad_acc {
                    Some(acc) => Sink::Host(Offloader::new(&mut host.staging, acc)),
                    None => Sink::Keep,
                },
            },
            enabled: reduce_now,
            skip_d2h_wait: self.skip_d2h_wait,
        };
        self.bucketer.reset();
        let bucketer = &mut self.bucketer;
        let layout = &self.layout;
        forward_backward(io, &mut |range| {
            bucketer.report(layout, range, &mut |bucket| flow.reduce_bucket(bucket))
        })?;
        bucketer.finish(layout, &mut |bucket| flow.reduce_bucket(bucket))?;
        if let Sink::Host(offloader) = &mut flow.sink {
            offloader.drain()?;
        }
        drop(flow);
        self.record_consumers(reduce_now)?;
        self.backward_pending = true;
        Ok(())
    }

    /// Records where the gradients of this backward were last read, so the next backward waits.
    fn record_consumers(&mut self, reduced: bool) -> Result<(), EngineError> {
        if !reduced {
            return Ok(());
        }
        let comm_done = slot(&mut self.events.comm_done, &self.device)?;
        self.device.record(comm_done, self.device.stream(StreamKind::Comm))?;
        if matches!(self.optimizer, Optimizer::Host(_)) {
            let d2h_done = slot(&mut self.events.d2h_done, &self.device)?;
            self.device.record(d2h_done, self.device.stream(StreamKind::D2h))?;
        }
        Ok(())
    }

    /// Ends the micro-step: at an accumulation boundary, one optimizer step.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        if !std::mem::take(&mut self.backward_pending) {
            return Err(EngineError::Usage("step called without backward"));
        }
        let boundary = self.is_gradient_accumulation_boundary();
        self.micro_steps += 1;
        if !boundary {
            return Ok(StepReport::Accumulated);
        }
        let compute = self.device.stream(StreamKind::Compute);
        self.device.record(&mut self.events.compute_done, compute)?;
        let waiting = std::time::Instant::now();
        let sum_squares = self.global_sum_squares()?;
        self.step_times.norm_wait += waiting.elapsed();
        let loss_scale = self.scaler.scale();
        let summed =
            f64::from(loss_scale) * self.comm.world_size() as f64 * self.opts.grad_accum as f64;
        let grad_norm = sum_squares.sqrt() / summed;
        if !grad_norm.is_finite() {
            // (ZenFlow's window is untouched: a step's gradients join it only once stepped.)
            tracing::warn!(loss_scale, "non-finite gradients: step skipped");
            self.scaler.update(true);
            self.zero_accumulator()?;
            return Ok(StepReport::Skipped { loss_scale: self.scaler.scale() });
        }
        let clip_coef = match self.opts.clip {
            Some(max) if grad_norm + 1e-6 > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let step = self.adamw.next_step((clip_coef / summed) as f32);
        let started = std::time::Instant::now();
        self.update_weights(&step)?;
        // An offloaded step is the CPU's; ZenFlow counts its own waits (its device step is not).
        if self.zenflow.is_none() && matches!(self.optimizer, Optimizer::Host(_)) {
            self.cpu_wait += started.elapsed();
        }
        self.zero_accumulator()?;
        self.scaler.update(false);
        Ok(StepReport::Stepped { grad_norm, clip_coef, loss_scale })
    }

    /// Σ g² over the accumulated gradients of all ranks (in loss-scaled, summed units).
    fn global_sum_squares(&mut self) -> Result<f64, EngineError> {
        let comm_stream = self.device.stream(StreamKind::Comm);
        let on_device = self.zenflow.is_some();
        match &mut self.optimizer {
            Optimizer::Device { grad_acc, .. } => {
                self.device.sum_squares(
                    comm_stream,
                    grad_acc,
                    0..self.owned.len(),
                    &self.norm,
                    0,
                )?;
            }
            Optimizer::Host(host) if host.streaming() || on_device => {
                // The reduced gradients are still on the device: the compute stream wrote them
                // (one rank) or the comm stream reduced them after it. (ZenFlow: this step's,
                // not the window's.)
                let compute_done = &self.events.compute_done;
                self.device.wait_event(comm_stream, compute_done)?;
                let (source, at) =
                    reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
                let range = at..at + self.owned.len();
                self.device.sum_squares(comm_stream, source, range, &self.norm, 0)?;
            }
            Optimizer::Host(_) => return self.host_sum_squares(),
        }
        let across = self.across_ranks();
        let (norm, host) = (&self.norm, &mut self.norm_host);
        let done = &mut self.events.norm_done;
        let read =
            sum_to_host(&self.device, &self.comm, across, StreamKind::Comm, done, norm, host)?;
        Ok(f64::from(read[0]))
    }

    /// True if the ranks hold parts of the gradients (stages 1 and 2 with several ranks), so
    /// that sums over them need an all-reduce.
    fn across_ranks(&self) -> bool {
        self.comm.world_size() > 1 && self.opts.stage != Stage::Zero0
    }

    /// Σ g² over the host accumulators of all ranks (in loss-scaled, summed units).
    fn host_sum_squares(&mut self) -> Result<f64, EngineError> {
        let Optimizer::Host(host) = &self.optimizer else {
            return Err(EngineError::Usage("a host norm without offload"));
        };
        let acc = host.grad_acc.as_deref().unwrap_or_default();
        let local: f64 = acc
            .par_chunks(1 << 16)
            .map(|chunk| chunk.iter().map(|g| f64::from(*g).powi(2)).sum::<f64>())
            .sum();
        if !self.across_ranks() {
            return Ok(local);
        }
        // Uploaded and waited for, so the all-reduce is ordered after it.
        self.norm_host[0] = local as f32;
        let h2d = self.device.stream(StreamKind::H2d);
        self.device.copy_h2d(h2d, &self.norm_host, 0..1, &self.norm, 0)?.wait()?;
        let (norm, host) = (&self.norm, &mut self.norm_host);
        let done = &mut self.events.norm_done;
        let read = sum_to_host(&self.device, &self.comm, true, StreamKind::Comm, done, norm, host)?;
        Ok(f64::from(read[0]))
    }

    /// One AdamW step over the partition, then the updated weights back into every rank's flat
    /// buffer.
    fn update_weights(&mut self, step: &zeroflow_optim::AdamWStep) -> Result<(), EngineError> {
        if self.zenflow.is_some() {
            return self.zenflow_update(step);
        }
        let compute = self.device.stream(StreamKind::Compute);
        let comm_stream = self.device.stream(StreamKind::Comm);
        let len = self.owned.len();
        let writer: StreamKind = match &mut self.optimizer {
            Optimizer::Device { state, grad_acc } => {
                // The accumulator is complete once the comm stream is past it (and the norm).
                self.device.record(&mut self.events.accumulated, comm_stream)?;
                self.device.wait_event(compute, &self.events.accumulated)?;
                let out = (&self.params, self.owned.start);
                self.device.adamw(compute, step, state, 0..len, grad_acc, out.0, out.1)?;
                StreamKind::Compute
            }
            Optimizer::Host(host) => {
                let delayed = self.opts.delayed_update.is_some_and(|warm_up| step.step() > warm_up);
                let streaming = host.streaming();
                if !delayed {
                    if !streaming {
                        host.step_now(step)?;
                        return self.upload_and_gather();
                    }
                    return self.stream_step(step);
                }
                // The step before this one finished meanwhile: its weights go to the device now
                // and the next window computes with them; this step runs in the background.
                if host.weights_ahead() {
                    host.join()?;
                    self.upload_and_gather()?;
                }
                if streaming {
                    return self.start_delayed_stream(*step);
                }
                let Optimizer::Host(host) = &mut self.optimizer else { unreachable!() };
                return host.start_delayed(*step);
            }
        };
        self.gather_from(writer)
    }

    /// The streaming CPU step, inline (see [`stream_chunks`]): from the reduced gradients on the
    /// device to the updated weights in this rank's partition of the flat weights, and into the
    /// other ranks' copies chunk by chunk: each chunk, once uploaded, goes from every rank to
    /// every rank on the comm stream (one broadcast per rank, the same chunk of each partition),
    /// while the CPU steps the next ones (pieces of at least [`GATHER_PIECE`] elements). Only the
    /// last piece's gather is left when the CPU is done, not the whole partition's.
    fn stream_step(&mut self, step: &zeroflow_optim::AdamWStep) -> Result<(), EngineError> {
        let Optimizer::Host(host) = &mut self.optimizer else {
            return Err(EngineError::Usage("streaming step without offload"));
        };
        let HostState { optimizer, staging, outgoing, .. } = &mut **host;
        let OptimizerSlot::Ready(optimizer) = optimizer else {
            return Err(EngineError::Usage("streaming step while the optimizer steps"));
        };
        let (source, at) = reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
        let (d2h, h2d) = (self.device.stream(StreamKind::D2h), self.device.stream(StreamKind::H2d));
        let comm_stream = self.device.stream(StreamKind::Comm);
        // The gradients are final once the comm stream has computed the norm over them; the
        // weights are free once forward/backward and the last gather are past them.
        self.device.wait_event(d2h, &self.events.norm_done)?;
        self.device.wait_event(h2d, &self.events.compute_done)?;
        if let Some(gathered) = &self.events.params_ready {
            self.device.wait_event(h2d, gathered)?;
        }
        // The gathers write the other ranks' partitions, which the last forward/backward read.
        let gathers = self.opts.gather_in_pieces && self.owned.len() < self.layout.padded_len();
        if gathers {
            self.device.wait_event(comm_stream, &self.events.compute_done)?;
        }
        let (device, comm, params) = (&self.device, &self.comm, &self.params);
        let (partition, uploaded_event) = (self.owned.len(), &mut self.events.chunk_uploaded);
        // Uploaded chunks not gathered yet: gathered together once they make a piece (small
        // stream chunks would otherwise cost a collective each) or reach the end.
        let piece_len = GATHER_PIECE.min(partition.div_ceil(8)).max(1);
        let mut pending: Option<Range<usize>> = None;
        let mut gather = |chunk: Range<usize>| -> Result<(), EngineError> {
            if !gathers {
                return Ok(());
            }
            let piece = pending.take().map_or(chunk.clone(), |p| p.start..chunk.end);
            if piece.len() < piece_len && piece.end < partition {
                pending = Some(piece);
                return Ok(());
            }
            device.record(uploaded_event, h2d)?;
            device.wait_event(comm_stream, uploaded_event)?;
            for root in 0..comm.world_size() {
                let at = root * partition;
                comm.broadcast(comm_stream, params, at + piece.start..at + piece.end, root)?;
            }
            Ok(())
        };
        let (target, target_at) = (&self.params, self.owned.start);
        let (uploaded, times) = (&mut gather, &mut self.step_times);
        let chunks = Chunks { source, source_at: at, target, target_at, uploaded, times };
        stream_chunks(&self.device, step, optimizer, staging, outgoing, chunks, self.owned.len())?;
        // The next backward overwrites the gradients only after these copies read them.
        let d2h_done = slot(&mut self.events.d2h_done, &self.device)?;
        self.device.record(d2h_done, d2h)?;
        if !gathers {
            return self.gather_from(StreamKind::H2d);
        }
        // The weights are current once the last piece's gather is done.
        let params_ready = slot(&mut self.events.params_ready, &self.device)?;
        self.device.record(params_ready, comm_stream)?;
        Ok(())
    }

    /// The delayed update's streaming step: the reduced gradients are copied aside on the device
    /// (the next backward overwrites them), and a worker thread streams them through the CPU
    /// step into `params_next` while the GPU runs the next forward and backward. The next step
    /// (or a flush) joins it and copies `params_next` into the weights.
    fn start_delayed_stream(&mut self, step: zeroflow_optim::AdamWStep) -> Result<(), EngineError> {
        let Some(aside) = &self.aside else {
            return Err(EngineError::Usage(
                "the streaming delayed update needs its device buffers",
            ));
        };
        let Optimizer::Host(host) = &mut self.optimizer else {
            return Err(EngineError::Usage("delayed step without offload"));
        };
        let (source, at) = reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start);
        let len = self.owned.len();
        let (comm, d2h) =
            (self.device.stream(StreamKind::Comm), self.device.stream(StreamKind::D2h));
        // After the norm (same stream), and after the last delayed step's copies read the copy.
        if let Some(read) = &self.events.d2h_done {
            self.device.wait_event(comm, read)?;
        }
        self.device.copy_d2d(comm, source, at..at + len, &aside.grads, 0)?;
        self.device.record(&mut self.events.aside_taken, comm)?;
        self.device.wait_event(d2h, &self.events.aside_taken)?;
        // The next backward overwrites the gradients only after the copy above read them.
        let comm_done = slot(&mut self.events.comm_done, &self.device)?;
        self.device.record(comm_done, comm)?;
        let OptimizerSlot::Ready(mut optimizer) =
            std::mem::replace(&mut host.optimizer, OptimizerSlot::Lost)
        else {
            return Err(EngineError::Usage("a delayed step started while another runs"));
        };
        let mut staging = std::mem::take(&mut host.staging);
        let mut outgoing = std::mem::take(&mut host.outgoing);
        let device = self.device.clone();
        let (grads, next) = (Arc::clone(&aside.grads), Arc::clone(&aside.params));
        let handle = std::thread::Builder::new()
            .name("zeroflow-delayed-step".into())
            .spawn(move || {
                // The weights stay aside until the next step applies and gathers them.
                let uploaded = &mut |_| Ok(());
                // On its own thread: not the training thread's time.
                let times = &mut StepTimes::default();
                let (source, target) = (&*grads, &*next);
                let chunks = Chunks { source, source_at: 0, target, target_at: 0, uploaded, times };
                stream_chunks(
                    &device,
                    &step,
                    &mut optimizer,
                    &mut staging,
                    &mut outgoing,
                    chunks,
                    len,
                )?;
                // Wait for the last uploads (a write access settles a buffer's pending copies).
                outgoing.iter_mut().for_each(|buffer| {
                    let _ = &mut buffer[..];
                });
                Ok((optimizer, Carried::Buffers { staging, outgoing }))
            })
            .map_err(|_| EngineError::Usage("could not start the delayed optimizer thread"))?;
        host.optimizer = OptimizerSlot::Stepping(handle);
        Ok(())
    }

    /// Uploads the host optimizer's weights into this rank's partition of the flat weights, then
    /// gathers the other partitions.
    fn upload_and_gather(&mut self) -> Result<(), EngineError> {
        let Optimizer::Host(host) = &mut self.optimizer else {
            return Err(EngineError::Usage("upload without offload"));
        };
        let OptimizerSlot::Ready(optimizer) = &host.optimizer else {
            return Err(EngineError::Usage("upload while the optimizer steps"));
        };
        host.upload_pending = false;
        // The weights are free once the last forward/backward has read them and the last
        // gather (after the previous upload, which a flush can follow directly) has written them.
        let h2d = self.device.stream(StreamKind::H2d);
        self.device.wait_event(h2d, &self.events.compute_done)?;
        if let Some(gathered) = &self.events.params_ready {
            self.device.wait_event(h2d, gathered)?;
        }
        // ZenFlow: after the device step wrote its columns (and the compact weights).
        if let Some(done) = self.zenflow.as_ref().and_then(|z| z.device_done.as_ref()) {
            self.device.wait_event(h2d, done)?;
        }
        let len = self.owned.len();
        // ZenFlow's worker uploaded its weights into the aside buffer on this stream.
        let zenflow_aside = self.zenflow.as_mut().and_then(|z| {
            let ready = std::mem::take(&mut z.aside_ready);
            z.aside.as_ref().filter(|_| ready)
        });
        match (&optimizer.upload, &self.aside) {
            _ if let Some(aside) = zenflow_aside => {
                self.device.copy_d2d(h2d, aside, 0..len, &self.params, self.owned.start)?;
            }
            (Some(upload), _) => {
                self.device
                    .copy_h2d(h2d, upload, 0..len, &self.params, self.owned.start)?
                    .wait()?;
            }
            // The streaming delayed step left the weights on the device; after its uploads on
            // the same stream, and before the next one writes there (same stream again).
            (None, Some(aside)) => {
                self.device.copy_d2d(h2d, &aside.params, 0..len, &self.params, self.owned.start)?;
                // The copies of the delayed step read the gradients set aside: done (joined).
                let d2h_done = slot(&mut self.events.d2h_done, &self.device)?;
                self.device.record(d2h_done, self.device.stream(StreamKind::D2h))?;
            }
            (None, None) => {
                return Err(EngineError::Usage("a whole-partition upload while the step streams"));
            }
        }
        // ZenFlow: the CPU's result for the selected columns is discarded, the device's kept.
        if let Some(zenflow) = &self.zenflow {
            zenflow.scatter_weights(&self.device, h2d, &self.params)?;
        }
        self.gather_from(StreamKind::H2d)
    }

    /// Records that `writer` has written this rank's partition of the weights and gathers the
    /// other partitions after it; `params_ready` then marks the weights current.
    fn gather_from(&mut self, writer: StreamKind) -> Result<(), EngineError> {
        let comm_stream = self.device.stream(StreamKind::Comm);
        let writer = self.device.stream(writer);
        let params_ready = slot(&mut self.events.params_ready, &self.device)?;
        self.device.record(params_ready, writer)?;
        if self.owned.len() < self.layout.padded_len() {
            // Gather the other partitions once this rank's is written and nothing reads the
            // weights any more.
            self.device.wait_event(comm_stream, params_ready)?;
            self.device.wait_event(comm_stream, &self.events.compute_done)?;
            let everything = 0..self.layout.padded_len();
            let own = self.owned.clone();
            self.comm.all_gather(comm_stream, &self.params, own, &self.params, everything)?;
            self.device.record(params_ready, comm_stream)?;
        }
        Ok(())
    }

    /// Clears the gradient accumulator for the next window, after everything that reads it.
    fn zero_accumulator(&mut self) -> Result<(), EngineError> {
        match &mut self.optimizer {
            Optimizer::Device { grad_acc, .. } => {
                // The comm stream adds into it and computed the norm; the optimizer read it on
                // the compute stream. Zero it on the comm stream once compute is past it.
                let comm_stream = self.device.stream(StreamKind::Comm);
                let compute = self.device.stream(StreamKind::Compute);
                self.device.record(&mut self.events.optimizer_done, compute)?;
                self.device.wait_event(comm_stream, &self.events.optimizer_done)?;
                self.device.fill(comm_stream, grad_acc, 0..self.owned.len(), 0.0)?;
            }
            // ZenFlow's window is on the device, cleared when a window ends.
            Optimizer::Host(_) if self.zenflow.is_some() => {}
            Optimizer::Host(host) => host.clear_accumulator(),
        }
        Ok(())
    }
}

/// This rank's optimizer state and the engine's counters (see [`Engine::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub part: OptimizerPart,
    /// The delayed update's weights are newer than the saved device weights.
    pub upload_pending: bool,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    pub scaler: LossScaler,
    /// ZenFlow's selection, window position and window sums (`part` holds the consolidated optimizer
    /// state: the device's for the selected columns).
    pub zenflow: Option<ZenFlowSnapshot>,
}

/// What [`Engine::restore`] continues from, besides the weights.
#[derive(Clone, Copy, Debug)]
pub struct Restore<'a> {
    /// Optimizer state saved by any number of ranks.
    pub parts: &'a [OptimizerPart],
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    /// See [`Snapshot::upload_pending`].
    pub upload_pending: bool,
    pub scaler: &'a LossScaler,
}

/// The fp32 optimizer state of one flat range: a rank's partition, as saved.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerPart {
    pub flat: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

/// Master weights and moments of `owned` from parts saved at any world size. Parameter elements
/// must be covered; padding may be missing (it is zero).
fn assemble(
    layout: &FlatLayout,
    owned: &Range<usize>,
    parts: &[OptimizerPart],
) -> Result<[Vec<f32>; 3], EngineError> {
    let mut out = [vec![0f32; owned.len()], vec![0f32; owned.len()], vec![0f32; owned.len()]];
    let mut covered = vec![false; owned.len()];
    for part in parts {
        let lens = [part.master.len(), part.exp_avg.len(), part.exp_avg_sq.len()];
        if lens.iter().any(|&len| len != part.flat.len()) {
            return Err(EngineError::Usage("an optimizer part's arrays differ from its range"));
        }
        let start = part.flat.start.max(owned.start);
        let end = part.flat.end.min(owned.end);
        for i in start..end {
            let (src, dst) = (i - part.flat.start, i - owned.start);
            out[0][dst] = part.master[src];
            out[1][dst] = part.exp_avg[src];
            out[2][dst] = part.exp_avg_sq[src];
            covered[dst] = true;
        }
    }
    for index in layout.params_in(owned.clone()) {
        let param = &layout.params()[index];
        let range = param.flat_range();
        let inside = range.start.max(owned.start)..range.end.min(owned.end);
        if inside.clone().any(|i| !covered[i - owned.start]) {
            return Err(EngineError::IncompleteOptimizerState { param: param.name.clone() });
        }
    }
    Ok(out)
}

/// Replaces the contents of `buffer` with `data` (set-up and restore only: it synchronizes).
fn overwrite<D: Device, T: zeroflow_core::Element>(
    device: &D,
    buffer: &D::Buffer<T>,
    data: &[T],
) -> Result<(), EngineError> {
    let mut host = device.alloc_host::<T>(data.len(), HostMemory::Pageable)?;
    host.copy_from_slice(data);
    device.synchronize()?;
    let h2d = device.stream(StreamKind::H2d);
    device.copy_h2d(h2d, &host, 0..data.len(), buffer, 0)?.wait()?;
    device.synchronize()?;
    Ok(())
}

/// The event in `slot`, created on first use.
fn slot<'e, D: Device>(
    slot: &'e mut Option<D::Event>,
    device: &D,
) -> Result<&'e mut D::Event, EngineError> {
    if slot.is_none() {
        *slot = Some(device.new_event()?);
    }
    Ok(slot.as_mut().expect("just filled"))
}

impl<D: DeviceAdamW, C: Comm<Device = D>, P: Float> std::fmt::Debug for Engine<D, C, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("device", &self.device)
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("stage", &self.opts.stage)
            .field("owned", &self.owned)
            .field("micro_steps", &self.micro_steps)
            .finish_non_exhaustive()
    }
}

/// What ZenFlow needs from the rest of the options.
fn check_zenflow(opts: &EngineOptions) -> Result<(), EngineError> {
    if opts.offload.is_none() {
        return Err(EngineError::Usage("ZenFlow needs CPU optimizer offload"));
    }
    if opts.delayed_update.is_some() {
        return Err(EngineError::Usage(
            "ZenFlow and the delayed update exclude each other; ZenFlow's overlap_step is its \
             delayed update",
        ));
    }
    if opts.grad_accum != 1 {
        return Err(EngineError::Usage(
            "ZenFlow needs gradient_accumulation_steps 1: every step is one ZenFlow iteration, and \
             update_interval is its accumulation window (DeepSpeed sets gradient_accumulation_steps \
             to update_interval instead)",
        ));
    }
    if matches!(opts.scaler, LossScaler::Dynamic(_)) {
        return Err(EngineError::Usage(
            "ZenFlow does not support dynamic loss scaling (a window's gradient sum would mix \
             scales); use bf16, fp32 or a static loss scale",
        ));
    }
    Ok(())
}

/// Reads `buf[..host.len()]` into `host` once what `writer` has queued so far is done, summed
/// over the ranks first when `across` (an all-reduce on the comm stream): `event` is recorded on
/// the writer (and again after the all-reduce), the copy runs on the d2h stream and is waited for.
fn sum_to_host<'h, D: Device, C: Comm<Device = D>>(
    device: &D,
    comm: &C,
    across: bool,
    writer: StreamKind,
    event: &mut D::Event,
    buf: &D::Buffer<f32>,
    host: &'h mut HostBuffer<f32>,
) -> Result<&'h mut HostBuffer<f32>, EngineError> {
    let len = host.len();
    device.record(event, device.stream(writer))?;
    if across {
        let comm_stream = device.stream(StreamKind::Comm);
        device.wait_event(comm_stream, event)?;
        comm.all_reduce(comm_stream, buf, 0..len, ReduceOp::Sum)?;
        device.record(event, comm_stream)?;
    }
    let d2h = device.stream(StreamKind::D2h);
    device.wait_event(d2h, event)?;
    Ok(device.copy_d2h(d2h, buf, 0..len, host, 0)?.wait()?)
}

/// Where this rank's reduced gradients are: the `reduced` buffer from its start (stages 1 and 2
/// with several ranks), or the gradient buffer at the partition's start.
fn reduced_source<'a, D: Device, P: Float>(
    reduced: &'a Option<D::Buffer<P>>,
    grads: &'a D::Buffer<P>,
    owned_start: usize,
) -> (&'a D::Buffer<P>, usize) {
    match reduced {
        Some(reduced) => (reduced, 0),
        None => (grads, owned_start),
    }
}
