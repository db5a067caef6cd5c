//! The offload side: fp32 optimizer state, the gradient accumulator and the staging buffers in
//! host memory (the copies in flight during a backward are `offloader.rs`'s).

use std::ops::Range;
use std::thread::JoinHandle;
use std::time::Duration;

use rayon::prelude::*;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{Element, Float, FloatSlice, FloatSliceMut, bf16};
use zeroflow_device::{Device, HostBuffer, HostMemory};
use zeroflow_optim::{AdamState, AdamWStep, CpuAdam, Grads, Output, Saved};

use crate::EngineError;
use crate::checkpoint::{Elements, MomentView, PartView};
use crate::engine::state::{RESTORE_PIECE, SavedState};
pub(crate) use crate::host_moments::HostMoments;
use crate::speculation::{Stepped, segments};

/// How many staging buffers gradients cycle through on their way to the host.
pub(crate) const STAGING_BUFFERS: usize = 4;

/// The default of [`crate::StreamOptions::chunk`], the most elements one staging buffer
/// holds (16 MiB of bf16): host staging stays this size whatever the model and the bucket size, a
/// bucket larger than it is copied in pieces, and the streaming step goes in chunks of it. On the
/// H200's host (300 MiB of L3), gpt-1.3b's offload step took 0.379 s with 16 MiB chunks and the
/// weight copy in the caches, against 0.403–0.409 s with 32 MiB and non-temporal stores and 0.67 s
/// with 1 MiB (per-chunk overhead): BENCHMARKS.md.
pub const DEFAULT_STREAM_CHUNK: usize = 1 << 23;

/// How many buffers updated weights cycle through on their way back in the streaming step.
pub(crate) const OUTGOING_BUFFERS: usize = 2;

/// Elements per task of the host's parallel loops.
pub(crate) const PAR_CHUNK: usize = 1 << 16;

/// The CPU optimizer's own state for this rank's partition: fp32 master weights and the Adam
/// moments in the run's `optimizer_state_dtype`.
#[derive(Debug)]
pub(crate) struct HostOptimizer {
    pub master: HostBuffer<f32>,
    pub moments: HostMoments,
    pub adam: CpuAdam,
}

/// What an offload path's host side is built of ([`StreamBuffers`], [`ZenFlowHost`],
/// [`HostAccumulator`]): the initial weights its master weights are filled from, the CPU
/// optimizer, and how its buffers are cut.
pub(crate) struct HostParts<P: Float> {
    /// The model's initial weights, all of them (this rank's partition is `owned`): dropped once
    /// the master weights are filled from them, before the moments are allocated.
    pub initial: Vec<P>,
    /// This rank's partition of the flat weights.
    pub owned: Range<usize>,
    /// The partition's elements whose state the host holds, from its first: all of them, or
    /// those before a device share.
    pub len: usize,
    /// The most elements of one staging buffer.
    pub chunk: usize,
    /// The memory of the buffers the device copies from or into (staging, uploads).
    pub memory: HostMemory,
    pub adam: CpuAdam,
    /// The moments' element type.
    pub moments: OptimizerStateDtype,
}

impl<P: Float> HostParts<P> {
    /// The CPU optimizer's state of the host's `len` elements, pageable (only the CPU touches
    /// it): the master weights filled from the initial weights (dropped then), the moments
    /// zeroed.
    fn optimizer<D: Device>(self, device: &D) -> Result<HostOptimizer, EngineError> {
        let HostParts { initial, owned, len, adam, moments, .. } = self;
        let fill_master = move |master: &mut [f32]| {
            master.par_chunks_mut(PAR_CHUNK).zip(initial[owned].par_chunks(PAR_CHUNK)).for_each(
                |(master, initial)| {
                    master.iter_mut().zip(initial).for_each(|(m, p)| *m = p.to_f32());
                },
            );
        };
        HostOptimizer::new(device, len, fill_master, HostMemory::Pageable, adam, moments)
    }
}

impl HostOptimizer {
    /// The state of a partition of `len` elements: master weights filled by `fill_master`,
    /// zeroed moments as `moments`.
    pub(crate) fn new<D: Device>(
        device: &D,
        len: usize,
        fill_master: impl FnOnce(&mut [f32]),
        memory: HostMemory,
        adam: CpuAdam,
        moments: OptimizerStateDtype,
    ) -> Result<Self, EngineError> {
        let mut master = device.alloc_host::<f32>(len, memory)?;
        fill_master(&mut master);
        let moments = HostMoments::alloc(device, len, memory, moments)?;
        Ok(HostOptimizer { master, moments, adam })
    }

    /// One AdamW step over `range` of the partition with `grads` (the range's), writing the
    /// updated weights as `P` into `out` (the range's): in the kernel's pass for bf16, after it
    /// for another type.
    pub(crate) fn step_range<P: Float>(
        &mut self,
        step: &AdamWStep,
        range: Range<usize>,
        grads: Grads<'_>,
        out: &mut [P],
    ) -> Result<(), EngineError> {
        self.step_range_saving(step, range, grads, out, None)
    }

    /// [`HostOptimizer::step_range`], saving the range's state into `saved` first where given
    /// (in the same pass over memory: [`CpuAdam::step_range_saving`]).
    pub(crate) fn step_range_saving<P: Float>(
        &mut self,
        step: &AdamWStep,
        range: Range<usize>,
        grads: Grads<'_>,
        out: &mut [P],
        saved: Option<Saved<'_>>,
    ) -> Result<(), EngineError> {
        let HostOptimizer { master, moments, adam } = self;
        let copy = as_bf16_mut(out);
        let copied = copy.is_some();
        let output = copy.map_or(Output::MasterOnly, Output::AlsoBf16);
        let params = &mut **master;
        match moments {
            HostMoments::F32 { exp_avg, exp_avg_sq } => {
                let state = AdamState { params, exp_avg, exp_avg_sq };
                adam.step_range_saving(step, state, range.clone(), grads, output, saved)?;
            }
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                let state = AdamState { params, exp_avg, exp_avg_sq };
                adam.step_range_saving(step, state, range.clone(), grads, output, saved)?;
            }
        }
        if !copied {
            convert_into(adam, out, &master[range]);
        }
        Ok(())
    }

    /// The state of the partition `flat`, lent, as a checkpoint writes it.
    pub(crate) fn view(&self, flat: Range<usize>) -> PartView<'_> {
        let (exp_avg, exp_avg_sq) = match &self.moments {
            HostMoments::F32 { exp_avg, exp_avg_sq } => (
                MomentView::F32(Elements::lent(exp_avg)),
                MomentView::F32(Elements::lent(exp_avg_sq)),
            ),
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => (
                MomentView::Bf16(Elements::lent(exp_avg)),
                MomentView::Bf16(Elements::lent(exp_avg_sq)),
            ),
        };
        let master = Elements::lent(&self.master);
        PartView { flat, master, exp_avg, exp_avg_sq, zenflow: None }
    }

    /// `[master, exp_avg, exp_avg_sq]` as f32 vectors.
    pub(crate) fn to_f32(&self) -> [Vec<f32>; 3] {
        let [exp_avg, exp_avg_sq] = self.moments.to_f32(&self.adam);
        [self.master.to_vec(), exp_avg, exp_avg_sq]
    }

    /// Takes the whole partition's saved state, an array at a time, each read in one pass (a
    /// file's streamed from the disk): the master weights and fp32 moments in place, bf16 moments
    /// through two pieces' buffers (rounded to nearest), so that a resume never holds a second
    /// copy of the state.
    pub(crate) fn restore(&mut self, saved: &SavedState<'_>) -> Result<(), EngineError> {
        if saved.len() != self.master.len() {
            return Err(EngineError::Internal(
                "a restored state's length differs from the partition's",
            ));
        }
        self.restore_head(saved)
    }

    /// [`HostOptimizer::restore`] of the saved partition's first elements, as many as this
    /// state holds (the rest are a device share's: `DeviceShare::restore`).
    pub(crate) fn restore_head(&mut self, saved: &SavedState<'_>) -> Result<(), EngineError> {
        let len = self.master.len();
        if saved.len() < len {
            return Err(EngineError::Internal("a restored state is shorter than the host's"));
        }
        let started = std::time::Instant::now();
        let said = |array: &str| {
            let seconds = started.elapsed().as_secs_f64();
            tracing::debug!("restore: the host optimizer's {array} read by {seconds:.2} s");
        };
        saved.read_array(0, 0..len, &mut self.master)?;
        said("master weights");
        if let HostMoments::F32 { exp_avg, exp_avg_sq } = &mut self.moments {
            saved.read_array(1, 0..len, exp_avg)?;
            said("first moments");
            saved.read_array(2, 0..len, exp_avg_sq)?;
            said("second moments");
            return Ok(());
        }
        let piece = RESTORE_PIECE.min(len);
        let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; piece], vec![0.0; piece]);
        let mut start = 0;
        while start < len {
            let end = (start + piece).min(len);
            let n = end - start;
            saved.read_array(1, start..end, &mut exp_avg[..n])?;
            saved.read_array(2, start..end, &mut exp_avg_sq[..n])?;
            self.moments.write(&self.adam, start..end, [&exp_avg[..n], &exp_avg_sq[..n]]);
            start = end;
        }
        Ok(())
    }
}

/// The accumulating paths' CPU optimizer: the state, and the whole partition's updated weights
/// as `P` on their way back to the device.
#[derive(Debug)]
pub(crate) struct WholeStep<P: Float> {
    pub state: HostOptimizer,
    pub upload: HostBuffer<P>,
}

impl<P: Float> WholeStep<P> {
    /// One AdamW step over the partition with the accumulated gradients, then the weights as `P`
    /// into the upload buffer.
    pub(crate) fn step(&mut self, step: &AdamWStep, grad_acc: &[f32]) -> Result<(), EngineError> {
        let whole = 0..self.state.master.len();
        self.state.step_range(step, whole, Grads::F32(grad_acc), &mut self.upload)
    }

    /// [`WholeStep::step`] over the partition except the pieces already `stepped` (sorted, as
    /// the speculation hands them): the same elements' results, range by range.
    pub(crate) fn step_except(
        &mut self,
        step: &AdamWStep,
        grad_acc: &[f32],
        stepped: &[Stepped],
    ) -> Result<(), EngineError> {
        for (range, speculated) in segments(grad_acc.len(), stepped) {
            if speculated.is_some() {
                continue;
            }
            let grads = Grads::F32(&grad_acc[range.clone()]);
            let out = &mut self.upload[range.clone()];
            self.state.step_range(step, range, grads, out)?;
        }
        Ok(())
    }

    /// Writes the master weights as `P` into the upload buffer (after a restore).
    pub(crate) fn refresh_upload(&mut self) {
        convert_into(&self.state.adam, &mut self.upload, &self.state.master);
    }
}

/// Σ x² of `values` (f32, or bf16 gradients) in f64, on all cores: pieces of 64 Ki elements,
/// each in 8 independent running sums (combined in a fixed order, then the tail). One running sum
/// is a chain of dependent f64 additions, 4 cycles each, which held the accumulating path's norm
/// to about a third of the host's memory bandwidth (0.10 s for gpt-1.3b's 1.31 B gradients on the
/// H200's 16 cores); eight of them let the loop run at memory speed.
pub(crate) fn sum_of_squares<T: Float>(values: &[T]) -> f64 {
    use rayon::prelude::*;
    values.par_chunks(1 << 16).map(piece_sum_of_squares).sum()
}

/// [`sum_of_squares`] of one piece, on the calling thread.
fn piece_sum_of_squares<T: Float>(values: &[T]) -> f64 {
    const LANES: usize = 8;
    let square = |x: &T| f64::from(x.to_f32()).powi(2);
    let mut lanes = [0.0f64; LANES];
    let mut blocks = values.chunks_exact(LANES);
    for block in &mut blocks {
        for (lane, x) in lanes.iter_mut().zip(block) {
            *lane += square(x);
        }
    }
    let tail: f64 = blocks.remainder().iter().map(square).sum();
    lanes.iter().sum::<f64>() + tail
}

/// `out[i] = P::from_f32(master[i])`, on the optimizer's threads.
pub(crate) fn convert_into<P: Float>(adam: &CpuAdam, out: &mut [P], master: &[f32]) {
    adam.for_each_chunk_mut(out, |offset, chunk| {
        let master = &master[offset..offset + chunk.len()];
        chunk.iter_mut().zip(master).for_each(|(o, m)| *o = P::from_f32(*m));
    });
}

/// The slice as bf16, if `P` is bf16.
pub(crate) fn as_bf16_mut<P: Float>(slice: &mut [P]) -> Option<&mut [bf16]> {
    match P::slice_mut(slice) {
        FloatSliceMut::Bf16(slice) => Some(slice),
        FloatSliceMut::F32(_) | FloatSliceMut::F16(_) => None,
    }
}

/// Gradients of type `P` as the CPU optimizer reads them, if it reads `P` directly (f32, bf16).
pub(crate) fn as_grads<P: Float>(slice: &[P]) -> Option<Grads<'_>> {
    match P::slice(slice) {
        FloatSlice::Bf16(grads) => Some(Grads::Bf16(grads)),
        FloatSlice::F32(grads) => Some(Grads::F32(grads)),
        FloatSlice::F16(_) => None,
    }
}

/// Host staging: [`STAGING_BUFFERS`] buffers of `len` elements (at most `stream_chunk`, at
/// least one).
pub(crate) fn alloc_staging<D: Device, P: Element>(
    device: &D,
    len: usize,
    stream_chunk: usize,
    memory: HostMemory,
    count: usize,
) -> Result<Vec<HostBuffer<P>>, EngineError> {
    let len = staging_len(len, stream_chunk);
    Ok((0..count).map(|_| device.alloc_host::<P>(len, memory)).collect::<Result<_, _>>()?)
}

/// The elements of one staging buffer for pieces of at most `len` elements: at most
/// `stream_chunk`, at least one.
pub(crate) fn staging_len(len: usize, stream_chunk: usize) -> usize {
    len.min(stream_chunk).max(1)
}

/// Where a CPU step that runs in the background is: here, or on its worker thread.
#[derive(Debug)]
pub(crate) enum Worker<T> {
    /// Here (its weights uploaded, or about to be in the same step).
    Ready(Box<T>),
    /// On a worker thread, stepping.
    Stepping(JoinHandle<Result<Box<T>, EngineError>>),
    /// Lost to a failed or panicked step.
    Lost,
}

impl<T: Send + 'static> Worker<T> {
    pub(crate) fn is_stepping(&self) -> bool {
        matches!(self, Worker::Stepping(_))
    }

    /// The state, where no step is running (after [`Worker::join`]).
    pub(crate) fn ready(&self) -> Option<&T> {
        match self {
            Worker::Ready(state) => Some(state),
            Worker::Stepping(_) | Worker::Lost => None,
        }
    }

    /// Waits for a running step, if there is one, and gives the state back, with whether a step
    /// was joined.
    pub(crate) fn join(&mut self) -> Result<(&mut T, bool), EngineError> {
        let mut joined = false;
        match std::mem::replace(self, Worker::Lost) {
            Worker::Stepping(handle) => {
                joined = true;
                let result = handle
                    .join()
                    .map_err(|_| EngineError::Internal("the delayed optimizer step panicked"))?;
                *self = Worker::Ready(result?);
            }
            other => *self = other,
        }
        match self {
            Worker::Ready(state) => Ok((state, joined)),
            Worker::Stepping(_) | Worker::Lost => Err(EngineError::Misuse(
                "the CPU optimizer was lost to an earlier failure; the engine cannot go on",
            )),
        }
    }

    /// Runs `work` with the (joined) state on a worker thread.
    pub(crate) fn start(
        &mut self,
        work: impl FnOnce(&mut T) -> Result<(), EngineError> + Send + 'static,
    ) -> Result<(), EngineError> {
        let mut state = match std::mem::replace(self, Worker::Lost) {
            Worker::Ready(state) => state,
            other => {
                *self = other;
                return Err(EngineError::Internal("a delayed step started while another runs"));
            }
        };
        let handle = std::thread::Builder::new()
            .name("zeroflow-delayed-step".into())
            .spawn(move || {
                work(&mut state)?;
                Ok(state)
            })
            .map_err(EngineError::Thread)?;
        *self = Worker::Stepping(handle);
        Ok(())
    }
}

/// Where the training thread spent its optimizer steps, by the host's clock and summed over the
/// steps: the breakdown a benchmark reports ([`crate::Engine::step_times`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// Waiting for the global gradient norm: the last reductions, the norm and its copy to the
    /// host (every mode).
    pub norm_wait: Duration,
    /// Offload, the streaming step on the training thread: waiting for gradient chunks to reach
    /// the host,
    pub chunk_wait: Duration,
    /// for an outgoing buffer's last upload to finish before the next chunk's weights go there,
    pub upload_wait: Duration,
    /// and the CPU AdamW over the chunks (with the weights' copy in the model's dtype).
    pub adam: Duration,
}

impl StepTimes {
    /// What was added since `earlier` (an earlier reading of the same engine).
    pub fn since(&self, earlier: &StepTimes) -> StepTimes {
        StepTimes {
            norm_wait: self.norm_wait.saturating_sub(earlier.norm_wait),
            chunk_wait: self.chunk_wait.saturating_sub(earlier.chunk_wait),
            upload_wait: self.upload_wait.saturating_sub(earlier.upload_wait),
            adam: self.adam.saturating_sub(earlier.adam),
        }
    }
}

/// The host side of the accumulating paths (ZeRO-Offload's exact and delayed step, and
/// ZenFlow's CPU step with `ZenFlowAside::Host`): the gradient accumulator, the staging that fills it during backward, and
/// the CPU optimizer.
#[derive(Debug)]
pub(crate) struct HostAccumulator<P: Float> {
    /// The rank's gradient partition, summed over ranks and micro-steps (in the loss-scaled
    /// model's units).
    pub acc: HostBuffer<f32>,
    /// Device-to-host staging of one bucket piece each.
    pub staging: Vec<HostBuffer<P>>,
    pub cpu: CpuStep<P>,
    /// The optimizer holds weights newer than the device's, to be uploaded at the next step
    /// (set when a delayed step was joined for a snapshot, or restored).
    pub upload_pending: bool,
}

/// Where the accumulating paths' CPU step runs.
#[derive(Debug)]
pub(crate) enum CpuStep<P: Float> {
    /// On the training thread, inside `step`.
    Inline(Box<WholeStep<P>>),
    /// After `warmup` inline steps, on a worker thread while the next window computes (the
    /// delayed update; ZenFlow's `overlap_step` with `ZenFlowAside::Host`, whose `warmup` is 0
    /// and which has no `spare`).
    Delayed { warmup: u64, spare: bool, worker: Worker<Swapped<P>> },
}

/// How [`HostAccumulator::new`]'s step is delayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Delayed {
    /// Steps taken inline before the first on the worker.
    pub warmup: u64,
    /// A second accumulator, which the next window fills while the worker steps with the first
    /// (the delayed update adds into its accumulator at every micro-step). Without it (ZenFlow's
    /// host path, whose device window is copied in only at the window's end, after the worker
    /// is joined) the worker borrows the one accumulator and hands it back when joined.
    pub spare: bool,
}

/// What a delayed step takes to its worker: the optimizer, and the accumulator it steps with
/// (swapped with the engine's at its start, so the next window fills the other one; without a
/// spare, swapped back when the worker is joined).
#[derive(Debug)]
pub(crate) struct Swapped<P: Float> {
    pub whole: WholeStep<P>,
    pub stepped: HostBuffer<f32>,
}

impl<P: Float> HostAccumulator<P> {
    /// The host side of `parts` with buckets of `bucket` elements, delayed where `delayed` says
    /// so (with a spare accumulator or without). `parts.memory` is that of the buffers the
    /// device copies from or into (staging, the upload buffer), `acc_memory` the accumulators'
    /// (pinned where the device copies straight into them, as ZenFlow's window; pageable where
    /// only the CPU adds into them); the optimizer state is pageable, as only the CPU touches it.
    pub(crate) fn new<D: Device>(
        device: &D,
        parts: HostParts<P>,
        bucket: usize,
        acc_memory: HostMemory,
        delayed: Option<Delayed>,
    ) -> Result<Self, EngineError> {
        let (partition, stream_chunk, memory) = (parts.len, parts.chunk, parts.memory);
        let state = parts.optimizer(device)?;
        let staging_len = bucket.min(partition);
        let staging = alloc_staging(device, staging_len, stream_chunk, memory, STAGING_BUFFERS)?;
        let whole = WholeStep { state, upload: device.alloc_host(partition, memory)? };
        let cpu = match delayed {
            None => CpuStep::Inline(Box::new(whole)),
            Some(Delayed { warmup, spare }) => {
                // Without a spare, the accumulator's place on the worker while it is here.
                let stepped = match spare {
                    true => device.alloc_host(partition, acc_memory)?,
                    false => device.alloc_host(0, HostMemory::Pageable)?,
                };
                CpuStep::Delayed {
                    warmup,
                    spare,
                    worker: Worker::Ready(Box::new(Swapped { whole, stepped })),
                }
            }
        };
        let acc = device.alloc_host(partition, acc_memory)?;
        Ok(HostAccumulator { acc, staging, cpu, upload_pending: false })
    }

    /// Zeroes the accumulator (on the optimizer's threads where they are here).
    pub(crate) fn clear_accumulator(&mut self) {
        let adam = match &self.cpu {
            CpuStep::Inline(whole) => Some(&whole.state.adam),
            CpuStep::Delayed { worker: Worker::Ready(swapped), .. } => {
                Some(&swapped.whole.state.adam)
            }
            CpuStep::Delayed { .. } => None,
        };
        match adam {
            Some(adam) => adam.for_each_chunk_mut(&mut self.acc, |_, chunk| chunk.fill(0.0)),
            None => self.acc.fill(0.0),
        }
    }

    /// True if the optimizer's weights have not reached the device yet.
    pub(crate) fn weights_ahead(&self) -> bool {
        self.upload_pending
            || matches!(&self.cpu, CpuStep::Delayed { worker, .. } if worker.is_stepping())
    }

    /// Waits for a delayed step, if one runs, and gives the optimizer back; the weights of a
    /// step joined here are pending upload.
    pub(crate) fn join(&mut self) -> Result<&mut WholeStep<P>, EngineError> {
        join_cpu(&mut self.cpu, &mut self.acc, &mut self.upload_pending)
    }

    /// The optimizer, where no delayed step is running (after [`HostAccumulator::join`]).
    pub(crate) fn settled(&self) -> Option<&HostOptimizer> {
        match &self.cpu {
            CpuStep::Inline(whole) => Some(&whole.state),
            CpuStep::Delayed { worker, .. } => worker.ready().map(|swapped| &swapped.whole.state),
        }
    }

    /// One step now, on this thread (waiting for a delayed step first).
    pub(crate) fn step_now(&mut self, step: &AdamWStep) -> Result<(), EngineError> {
        let HostAccumulator { acc, cpu, upload_pending, .. } = self;
        join_cpu(cpu, acc, upload_pending)?.step(step, acc)
    }

    /// The optimizer's weights for the device (waiting for a delayed step first), no longer
    /// pending once the caller has queued their upload.
    pub(crate) fn upload(&mut self) -> Result<&HostBuffer<P>, EngineError> {
        let HostAccumulator { acc, cpu, upload_pending, .. } = self;
        let whole = join_cpu(cpu, acc, upload_pending)?;
        *upload_pending = false;
        Ok(&whole.upload)
    }

    /// Starts a delayed step of the (joined) optimizer on its worker, handing it the full
    /// accumulator and putting the one it stepped with last in its place for the next window
    /// (without a spare, an empty one until the worker is joined).
    pub(crate) fn start_delayed(&mut self, step: AdamWStep) -> Result<(), EngineError> {
        let CpuStep::Delayed { worker, .. } = &mut self.cpu else {
            return Err(EngineError::Internal("a delayed step on the inline path"));
        };
        if let Worker::Ready(swapped) = worker {
            std::mem::swap(&mut self.acc, &mut swapped.stepped);
        }
        worker.start(move |swapped| {
            let begun = std::time::Instant::now();
            swapped.whole.step(&step, &swapped.stepped)?;
            let took = begun.elapsed();
            tracing::debug!(?took, "delayed CPU step on the worker");
            Ok(())
        })
    }

    /// This rank's optimizer state, copied (waiting for a delayed step first).
    pub(crate) fn state(&mut self) -> Result<[Vec<f32>; 3], EngineError> {
        Ok(self.join()?.state.to_f32())
    }

    /// Takes a checkpoint's state, with an empty accumulator and the upload buffer refreshed.
    pub(crate) fn restore(
        &mut self,
        state: &SavedState<'_>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        let whole = self.join()?;
        whole.state.restore(state)?;
        whole.refresh_upload();
        self.clear_accumulator();
        self.upload_pending = upload_pending;
        Ok(())
    }
}

/// See [`HostAccumulator::join`]: without a spare, the accumulator the worker stepped with is
/// `acc` again.
fn join_cpu<'c, P: Float>(
    cpu: &'c mut CpuStep<P>,
    acc: &mut HostBuffer<f32>,
    upload_pending: &mut bool,
) -> Result<&'c mut WholeStep<P>, EngineError> {
    match cpu {
        CpuStep::Inline(whole) => Ok(whole),
        CpuStep::Delayed { worker, spare, .. } => {
            let (swapped, joined) = worker.join()?;
            *upload_pending |= joined;
            // A step just joined had the accumulator.
            if joined && !*spare {
                std::mem::swap(acc, &mut swapped.stepped);
            }
            Ok(&mut swapped.whole)
        }
    }
}

/// The streaming paths' CPU optimizer and the host buffers the step streams through: no
/// accumulator and no whole-partition upload buffer (about 12 bytes per parameter in all with
/// fp32 moments, 8 with bf16). The gradients arrive as `G`: the model's `P` (the streaming
/// offload path), or ZenFlow's `f32` window.
#[derive(Debug)]
pub(crate) struct StreamBuffers<P: Float, G: Float = P> {
    pub state: HostOptimizer,
    /// Device-to-host staging of one step chunk each.
    pub staging: Vec<HostBuffer<G>>,
    /// Updated weights on their way back to the device, one chunk each.
    pub outgoing: Vec<HostBuffer<P>>,
}

impl<P: Float, G: Float> StreamBuffers<P, G> {
    /// The host side of a streamed partition (`parts`), in chunks of at most `parts.chunk`
    /// elements (at least one): the staging and outgoing buffers in `parts.memory`, the
    /// optimizer state pageable (only the CPU touches it).
    pub(crate) fn new<D: Device>(device: &D, parts: HostParts<P>) -> Result<Self, EngineError> {
        let (partition, stream_chunk, memory) = (parts.len, parts.chunk, parts.memory);
        let state = parts.optimizer(device)?;
        let staging = alloc_staging(device, partition, stream_chunk, memory, STAGING_BUFFERS)?;
        let outgoing = alloc_staging(device, partition, stream_chunk, memory, OUTGOING_BUFFERS)?;
        Ok(StreamBuffers { state, staging, outgoing })
    }

    /// The bytes of host memory these buffers hold: the optimizer state, the staging and the
    /// outgoing buffers.
    pub(crate) fn host_bytes(&self) -> usize {
        fn bytes<T: Element>(buffer: &HostBuffer<T>) -> usize {
            buffer.len() * std::mem::size_of::<T>()
        }
        let HostOptimizer { master, moments, .. } = &self.state;
        let state = bytes(master) + moments.host_bytes();
        state
            + self.staging.iter().map(bytes).sum::<usize>()
            + self.outgoing.iter().map(bytes).sum::<usize>()
    }
}

/// ZenFlow's host side: the CPU optimizer and the bounded buffers its step streams the device's
/// fp32 window through, chunk by chunk (no accumulator, no whole-partition upload buffer: about
/// 12 bytes per parameter), on a worker thread with `overlap_step` and on the training thread
/// without (both through [`Worker`], which is `Ready` between steps).
#[derive(Debug)]
pub(crate) struct ZenFlowHost<P: Float> {
    pub worker: Worker<StreamBuffers<P, f32>>,
    /// The optimizer holds weights newer than the device's flat weights (a step joined before
    /// its weights were applied, or restored).
    pub upload_pending: bool,
}

impl<P: Float> ZenFlowHost<P> {
    /// The host side of `parts`, streamed in chunks of at most `parts.chunk` elements.
    pub(crate) fn new<D: Device>(device: &D, parts: HostParts<P>) -> Result<Self, EngineError> {
        let partition = parts.len;
        let buffers = StreamBuffers::new(device, parts)?;
        let bytes = buffers.host_bytes();
        tracing::debug!(partition, bytes, "ZenFlow's host side: optimizer state and staging");
        Ok(ZenFlowHost { worker: Worker::Ready(Box::new(buffers)), upload_pending: false })
    }

    /// True if the optimizer's weights have not reached the device's flat weights yet.
    pub(crate) fn weights_ahead(&self) -> bool {
        self.upload_pending || self.worker.is_stepping()
    }

    /// Waits for a running CPU step, if there is one, and gives the buffers back; the weights of
    /// a step joined here are pending.
    pub(crate) fn join(&mut self) -> Result<&mut StreamBuffers<P, f32>, EngineError> {
        let (buffers, joined) = self.worker.join()?;
        self.upload_pending |= joined;
        Ok(buffers)
    }

    /// The optimizer, where no step is running (after [`ZenFlowHost::join`]).
    pub(crate) fn settled(&self) -> Option<&HostOptimizer> {
        self.worker.ready().map(|buffers| &buffers.state)
    }

    /// This rank's optimizer state, copied (waiting for a running step first).
    pub(crate) fn state(&mut self) -> Result<[Vec<f32>; 3], EngineError> {
        Ok(self.join()?.state.to_f32())
    }

    /// Takes a checkpoint's state (waiting for a running step first).
    pub(crate) fn restore(
        &mut self,
        state: &SavedState<'_>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        self.join()?.state.restore(state)?;
        self.upload_pending = upload_pending;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_device::CpuDevice;
    use zeroflow_optim::SimdLevel;

    use super::*;

    /// Σ x² in eight running sums: exact where every partial sum is (small integers, every
    /// length up to three blocks and a tail), and within f64 rounding of one running sum over a
    /// long vector of mixed signs and scales; the same on every call.
    #[test]
    fn the_sum_of_squares_is_the_plain_sum_in_f64() {
        for len in 0..=27 {
            let values: Vec<f32> = (0..len).map(|i| i as f32 - 13.0).collect();
            let plain: f64 = values.iter().map(|x| f64::from(*x).powi(2)).sum();
            assert_eq!(piece_sum_of_squares(&values), plain, "length {len}");
        }
        let values: Vec<f32> = (0..100_003u32)
            .map(|i| {
                ((i.wrapping_mul(2_654_435_761) >> 7) as f32 * 1e-6 - 8.0)
                    * 10f32.powi((i % 7) as i32 - 3)
            })
            .collect();
        let plain: f64 = values.iter().map(|x| f64::from(*x).powi(2)).sum();
        let lanes = piece_sum_of_squares(&values);
        assert!((lanes - plain).abs() <= 1e-12 * plain, "{lanes} against {plain}");
        assert_eq!(piece_sum_of_squares(&values).to_bits(), lanes.to_bits());
    }

    /// The parts of a host side over `len` elements of zero weights, in chunks of `chunk`.
    fn parts<P: Float>(len: usize, chunk: usize, moments: OptimizerStateDtype) -> HostParts<P> {
        HostParts {
            initial: vec![P::from_f32(0.0); len],
            owned: 0..len,
            len,
            chunk,
            memory: HostMemory::Pinned,
            adam: CpuAdam::new(1, SimdLevel::detect()).unwrap(),
            moments,
        }
    }

    /// The lengths of the staging and outgoing buffers of a host side over 60 elements with
    /// buckets of 23 and `stream_chunk`.
    fn buffer_lens(streaming: bool, stream_chunk: usize) -> (Vec<usize>, Vec<usize>) {
        let device = CpuDevice::new().unwrap();
        let lens = |buffers: &[HostBuffer<f32>]| buffers.iter().map(|b| b.len()).collect();
        let parts = parts::<f32>(60, stream_chunk, OptimizerStateDtype::Fp32);
        if streaming {
            let host = StreamBuffers::<f32>::new(&device, parts).unwrap();
            (lens(&host.staging), lens(&host.outgoing))
        } else {
            let host =
                HostAccumulator::new(&device, parts, 23, HostMemory::Pageable, None).unwrap();
            (lens(&host.staging), vec![])
        }
    }

    /// A staging buffer holds one chunk of the stream (or one bucket, or the whole partition,
    /// where that is less), and never nothing.
    #[test]
    fn staging_and_outgoing_buffers_hold_one_stream_chunk() {
        assert_eq!(buffer_lens(true, 7), (vec![7; STAGING_BUFFERS], vec![7; OUTGOING_BUFFERS]));
        assert_eq!(buffer_lens(true, 100), (vec![60; STAGING_BUFFERS], vec![60; OUTGOING_BUFFERS]));
        assert_eq!(buffer_lens(false, 7), (vec![7; STAGING_BUFFERS], vec![]));
        assert_eq!(buffer_lens(false, 100), (vec![23; STAGING_BUFFERS], vec![]));
        assert_eq!(buffer_lens(true, 0), (vec![1; STAGING_BUFFERS], vec![1; OUTGOING_BUFFERS]));
        let (staging, _) = buffer_lens(false, DEFAULT_STREAM_CHUNK);
        assert_eq!(staging, vec![23; STAGING_BUFFERS]);
    }

    /// ZenFlow's host side over a partition of five million parameters holds the fp32 master
    /// weights and moments (12 B per parameter) and, streamed in chunks of 2^16 elements, four
    /// fp32 staging and two bf16 outgoing buffers of one chunk each: nothing else grows with the
    /// partition (no accumulator, no second accumulator, no whole-partition upload buffer, which
    /// `ZenFlowAside::Host`, the path before, still allocates: 22 B per parameter in all).
    #[test]
    fn zenflow_host_side_is_twelve_bytes_per_parameter_and_bounded_staging() {
        let device = CpuDevice::new().unwrap();
        let (partition, chunk) = (5_000_000, 1 << 16);
        let staging = chunk * (STAGING_BUFFERS * 4 + OUTGOING_BUFFERS * 2);
        // With bf16 moments (`zeroflow.optimizer_state_dtype`) the state is 8 B per parameter.
        for (moments, state) in [(OptimizerStateDtype::Fp32, 12), (OptimizerStateDtype::Bf16, 8)] {
            let host = ZenFlowHost::new(&device, parts::<bf16>(partition, chunk, moments)).unwrap();
            let Worker::Ready(buffers) = &host.worker else { panic!("a new host side is ready") };
            assert_eq!(buffers.host_bytes(), state * partition + staging, "{moments:?}");
            let per_parameter = buffers.host_bytes() as f64 / partition as f64;
            assert!(per_parameter < state as f64 + 0.5, "{per_parameter} B per parameter");
        }
    }
}
