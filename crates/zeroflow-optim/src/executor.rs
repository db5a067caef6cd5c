//! [`CpuAdam`]: runs the kernels over a partition, or a range of it, on a persistent thread pool.

use std::ops::Range;

use half::bf16;

use crate::kernels::{self, SupportedLevel};
pub(crate) use crate::piece::Piece;
use crate::piece::{GradElem, MomentElem, Split};
use crate::rounding::MomentSeeds;
use crate::{AdamWStep, OptimError, SimdLevel};

/// Chunk boundaries between threads fall on multiples of this many elements, counted from the
/// start of the partition: a multiple of every SIMD width and a whole number of 64-byte lines for
/// both f32 and bf16 data.
pub const CHUNK_ALIGN: usize = 64;

/// Chunks per thread by default. One contiguous chunk per thread leaves threads idle while the
/// slowest finishes; with 8, work stealing evens that out. Measured on a 16-core H200 host
/// (5e8 parameters, AVX-512): 1 chunk 4.17, 4 chunks 4.83, 8 chunks 4.93, 16 chunks
/// 4.91 Gparam/s.
const DEFAULT_TASKS_PER_THREAD: usize = 8;

/// No chunk has fewer elements than this (about 1.8 MB of traffic): below it, waking a thread
/// costs more than it saves.
const MIN_TASK_LEN: usize = 1 << 16;

/// The optimizer state of one partition, owned by the caller (the engine keeps it in pinned
/// host buffers): fp32 master weights and both Adam moments as `M` (f32, or bf16 rounded
/// stochastically: [`crate::rounding`]), all of the same length.
#[derive(Debug)]
pub struct AdamState<'a, M = f32> {
    pub params: &'a mut [f32],
    pub exp_avg: &'a mut [M],
    pub exp_avg_sq: &'a mut [M],
}

/// The gradients of the elements being updated, as they arrive: f32 (an accumulator) or bf16
/// (straight from the device). They are multiplied by the step's gradient scale as they are read.
#[derive(Debug, Clone, Copy)]
pub enum Grads<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl Grads<'_> {
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(grads) => grads.len(),
            Grads::Bf16(grads) => grads.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the step writes besides the fp32 state.
#[derive(Debug)]
pub enum Output<'a> {
    /// Only the fp32 master weights (and moments).
    MasterOnly,
    /// Also the updated weights rounded to bf16 (to nearest even, exactly `bf16::from_f32`),
    /// written in the same pass: the buffer the engine uploads to the device.
    AlsoBf16(&'a mut [bf16]),
}

impl Output<'_> {
    fn len(&self) -> Option<usize> {
        match self {
            Output::MasterOnly => None,
            Output::AlsoBf16(out) => Some(out.len()),
        }
    }
}

/// Where [`CpuAdam::step_range_saving`] puts the state it is about to overwrite: the range's
/// master weights and both moments, as f32 (a bf16 moment widened, exactly), `range.len()`
/// elements each.
#[derive(Debug)]
pub struct Saved<'a> {
    pub params: &'a mut [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
}

impl Split for Saved<'_> {
    fn len(&self) -> usize {
        self.params.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (params_a, params_b) = self.params.split_at_mut(mid);
        let (exp_avg_a, exp_avg_b) = self.exp_avg.split_at_mut(mid);
        let (exp_avg_sq_a, exp_avg_sq_b) = self.exp_avg_sq.split_at_mut(mid);
        (
            Saved { params: params_a, exp_avg: exp_avg_a, exp_avg_sq: exp_avg_sq_a },
            Saved { params: params_b, exp_avg: exp_avg_b, exp_avg_sq: exp_avg_sq_b },
        )
    }
}

/// The elements a thread saves and then steps at a time in [`CpuAdam::step_range_saving`]: the
/// state they read to save (12 bytes each, 96 KiB) is still in the core's L2 cache when the
/// kernel reads it again, and the saved copy is written with streaming stores, so the pair
/// moves 40 bytes per element through memory, not the 52 of a copy over the range followed by
/// the step (64 counting the lines its ordinary stores read first). On a 2-core host (2e7
/// elements, AVX2): the step 0.021 s, the saving step 0.039–0.040 s, a copy then the step
/// 0.048–0.050 s; from 1024 to 262144 elements a block, the saving step with ordinary stores
/// took 0.045–0.049 s.
const SAVE_BLOCK: usize = 8192;

/// How a kernel writes a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stores {
    /// Ordinary stores: the line is read into the cache first (for a buffer that is only
    /// written, that read is wasted traffic).
    Normal,
    /// Streaming (non-temporal) stores for the aligned body of each chunk, where the SIMD level
    /// has them (not the portable one); ordinary stores for the rest. They write whole lines
    /// without reading them first, and bypass the caches.
    NonTemporal,
}

impl Stores {
    pub const ALL: [Stores; 2] = [Stores::Normal, Stores::NonTemporal];

    pub const fn name(self) -> &'static str {
        match self {
            Stores::Normal => "normal",
            Stores::NonTemporal => "non-temporal",
        }
    }
}

/// The CPU AdamW executor: a SIMD level and a persistent pool of threads.
///
/// Each call splits its elements into contiguous chunks, up to [`CpuAdam::tasks_per_thread`]
/// per thread (8 by default), whose boundaries are multiples of [`CHUNK_ALIGN`] counted from the
/// partition's start, and hands them to the pool's threads by work stealing (`rayon::join`, no
/// allocation); small calls use fewer chunks, and one chunk runs on the calling thread. Results
/// do not depend on the number of threads: every element is computed by the same instructions
/// wherever it falls.
#[derive(Debug)]
pub struct CpuAdam {
    level: SupportedLevel,
    threads: usize,
    tasks_per_thread: usize,
    copy_stores: Stores,
    /// Added to an element's index in the partition to key its bf16 moments' rounding draws.
    rounding_offset: usize,
    /// The partition's elements stepped without weight decay.
    no_decay: crate::NoDecay,
    /// `None` with one thread: the calling thread does the work.
    pool: Option<rayon::ThreadPool>,
}

impl CpuAdam {
    /// An executor with `threads` worker threads (started now, kept until drop) running the
    /// kernels of `level`, which this CPU must support ([`SimdLevel::detect`] for the best).
    pub fn new(threads: usize, level: SimdLevel) -> Result<Self, OptimError> {
        let level = SupportedLevel::new(level).ok_or(OptimError::SimdUnavailable {
            requested: level,
            detected: SimdLevel::detect(),
        })?;
        if threads == 0 {
            return Err(OptimError::ZeroThreads);
        }
        let pool = if threads == 1 {
            None
        } else {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|index| format!("zeroflow-adam-{index}"))
                .build()
                .map_err(|source| OptimError::ThreadPool { threads, source })?;
            Some(pool)
        };
        Ok(CpuAdam {
            level,
            threads,
            tasks_per_thread: DEFAULT_TASKS_PER_THREAD,
            copy_stores: Stores::NonTemporal,
            rounding_offset: 0,
            no_decay: crate::NoDecay::default(),
            pool,
        })
    }

    /// Splits each call into up to `tasks_per_thread` chunks per thread (default 8). More chunks
    /// let idle threads steal work from slow ones, at the cost of shorter streams; 1 gives each
    /// thread one contiguous stretch.
    pub fn with_tasks_per_thread(mut self, tasks_per_thread: usize) -> Self {
        self.tasks_per_thread = tasks_per_thread.max(1);
        self
    }

    /// How the bf16 copy of the weights is written (default: [`Stores::NonTemporal`], which
    /// skips reading lines that are only written: 4.68 against 4.36 Gparam/s with the copy on a
    /// 16-core H200 host). The copy then goes to memory rather than the caches, which suits a
    /// buffer that is uploaded to the device next.
    pub fn with_copy_stores(mut self, copy_stores: Stores) -> Self {
        self.copy_stores = copy_stores;
        self
    }

    /// Keys the rounding draws of bf16 moments by `offset + index in the partition` (default 0):
    /// with the partition's start in the whole model, every element draws the same whatever the
    /// number of ranks ([`crate::rounding`]).
    pub fn with_rounding_offset(mut self, offset: usize) -> Self {
        self.rounding_offset = offset;
        self
    }

    /// Steps the partition's elements `no_decay` (its 1-D parameters') without weight decay
    /// ([`AdamWStep::without_weight_decay`]); by default every element decays.
    pub fn with_no_decay(mut self, no_decay: crate::NoDecay) -> Self {
        self.no_decay = no_decay;
        self
    }

    /// The partition's elements stepped without weight decay.
    pub fn no_decay(&self) -> &crate::NoDecay {
        &self.no_decay
    }

    pub fn tasks_per_thread(&self) -> usize {
        self.tasks_per_thread
    }

    pub fn copy_stores(&self) -> Stores {
        self.copy_stores
    }

    pub fn simd_level(&self) -> SimdLevel {
        self.level.level()
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One AdamW step over a whole partition: `grads` and `out` have the partition's length.
    pub fn step<M: MomentElem>(
        &self,
        step: &AdamWStep,
        state: AdamState<'_, M>,
        grads: Grads<'_>,
        out: Output<'_>,
    ) -> Result<(), OptimError> {
        let len = state.params.len();
        self.step_range(step, state, 0..len, grads, out)
    }

    /// One AdamW step over the elements `range` of a partition: `state` holds the whole
    /// partition, while `grads` and `out` hold only the range (`range.len()` elements: the
    /// bucket's staging buffer and its upload buffer). Stepping every range of a partition once
    /// gives exactly the bits of one [`CpuAdam::step`] over it (bf16 moments included: their
    /// rounding draws depend on the step and the element's index in the partition alone).
    pub fn step_range<M: MomentElem>(
        &self,
        step: &AdamWStep,
        state: AdamState<'_, M>,
        range: Range<usize>,
        grads: Grads<'_>,
        out: Output<'_>,
    ) -> Result<(), OptimError> {
        self.step_range_saving(step, state, range, grads, out, None)
    }

    /// [`CpuAdam::step_range`], saving the range's state first into `saved` where given (each
    /// `range.len()` elements), block by block on the thread that steps it: the state the step
    /// overwrites, for a speculative step to be put back. The step's results are
    /// [`CpuAdam::step_range`]'s, bit for bit.
    pub fn step_range_saving<M: MomentElem>(
        &self,
        step: &AdamWStep,
        state: AdamState<'_, M>,
        range: Range<usize>,
        grads: Grads<'_>,
        out: Output<'_>,
        saved: Option<Saved<'_>>,
    ) -> Result<(), OptimError> {
        if let Some(saved) = &saved {
            check_len("saved weights", saved.params.len(), range.len())?;
            check_len("saved exp_avg", saved.exp_avg.len(), range.len())?;
            check_len("saved exp_avg_sq", saved.exp_avg_sq.len(), range.len())?;
        }
        let len = state.params.len();
        check_len("exp_avg", state.exp_avg.len(), len)?;
        check_len("exp_avg_sq", state.exp_avg_sq.len(), len)?;
        if range.start > range.end || range.end > len {
            return Err(OptimError::RangeOutOfBounds { start: range.start, end: range.end, len });
        }
        check_len("grads", grads.len(), range.len())?;
        if let Some(out_len) = out.len() {
            check_len("bf16 output", out_len, range.len())?;
        }
        let AdamState { params, exp_avg, exp_avg_sq } = state;
        let (params, exp_avg, exp_avg_sq) = (
            &mut params[range.clone()],
            &mut exp_avg[range.clone()],
            &mut exp_avg_sq[range.clone()],
        );
        match grads {
            Grads::F32(grads) => {
                let piece = Piece { params, grads, exp_avg, exp_avg_sq, out };
                self.run_runs(step, range, piece, saved);
            }
            Grads::Bf16(grads) => {
                let piece = Piece { params, grads, exp_avg, exp_avg_sq, out };
                self.run_runs(step, range, piece, saved);
            }
        }
        Ok(())
    }

    /// The kernel over `piece`, the elements `range` of the partition: run by run of
    /// [`CpuAdam::no_decay`], each with the step or the step without weight decay, each block of
    /// [`SAVE_BLOCK`] saved first where `saved` is given. Every element is computed as it is in
    /// one run (see the type's documentation).
    fn run_runs<G: GradElem, M: MomentElem>(
        &self,
        step: &AdamWStep,
        range: Range<usize>,
        mut piece: Piece<'_, G, M>,
        mut saved: Option<Saved<'_>>,
    ) {
        let (level, copy_stores) = (self.level, self.copy_stores);
        let seeds = MomentSeeds::of_step(step.step());
        let key = self.rounding_offset;
        for (run, step) in self.no_decay.steps(step, range) {
            let (head, rest) = piece.split_at(run.len());
            piece = rest;
            let scalars = &step.scalars;
            let adamw = |piece, offset| {
                kernels::adamw(level, scalars, seeds, copy_stores, key + offset, piece)
            };
            let save = saved.take().map(|all| {
                let (save, rest) = all.split_at(run.len());
                saved = Some(rest);
                save
            });
            match save {
                None => self.run(head, run.start, &adamw),
                Some(save) => self.run((head, save), run.start, &|(piece, save), offset| {
                    save_then_step(level, piece, save, offset, &adamw)
                }),
            }
        }
    }

    /// Calls `f(offset, chunk)` on the chunks of `data` that a step over a partition of
    /// `data.len()` elements gives each thread, on the pool's threads. Filling fresh buffers
    /// this way places their pages (first touch) where the optimizer's threads will use them.
    pub fn for_each_chunk_mut<T: Send>(&self, data: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
        self.run(data, 0, &|chunk, offset| f(offset, chunk));
    }

    /// Runs `f(piece, offset)` over the chunks of `piece`, whose first element is element
    /// `start` of the partition.
    pub(crate) fn run<P: Split>(&self, piece: P, start: usize, f: &(impl Fn(P, usize) + Sync)) {
        let max_tasks = self.threads * self.tasks_per_thread;
        let tasks = piece.len().div_ceil(MIN_TASK_LEN).clamp(1, max_tasks);
        match &self.pool {
            Some(pool) if tasks > 1 => pool.install(|| split_run(piece, start, tasks, f)),
            _ => f(piece, start),
        }
    }
}

/// Cuts `piece` into `tasks` nearly equal chunks at multiples of [`CHUNK_ALIGN`] (counted from
/// the partition's start) and runs them through `rayon::join`, which hands halves to idle
/// threads without allocating.
fn split_run<P: Split>(piece: P, start: usize, tasks: usize, f: &(impl Fn(P, usize) + Sync)) {
    if tasks <= 1 {
        return f(piece, start);
    }
    let len = piece.len();
    let left_tasks = tasks / 2;
    let left_len = (len as u128 * left_tasks as u128 / tasks as u128) as usize;
    let mid = (start + left_len).next_multiple_of(CHUNK_ALIGN).min(start + len);
    let (left, right) = piece.split_at(mid - start);
    rayon::join(
        || split_run(left, start, left_tasks, f),
        || split_run(right, mid, tasks - left_tasks, f),
    );
}

/// Saves and steps (`adamw(block, offset)`) `piece`, whose first element is element `offset`,
/// block by block of [`SAVE_BLOCK`] elements.
fn save_then_step<'a, G: GradElem, M: MomentElem>(
    level: SupportedLevel,
    mut piece: Piece<'a, G, M>,
    mut save: Saved<'a>,
    mut offset: usize,
    adamw: &impl Fn(Piece<'a, G, M>, usize),
) {
    while piece.len() > 0 {
        let n = piece.len().min(SAVE_BLOCK);
        let (block, piece_rest) = piece.split_at(n);
        let (into, save_rest) = save.split_at(n);
        save_state(level, &block, into);
        adamw(block, offset);
        (piece, save, offset) = (piece_rest, save_rest, offset + n);
    }
}

/// Copies `piece`'s master weights and moments (widened to f32) into `saved`.
fn save_state<G, M: MomentElem>(level: SupportedLevel, piece: &Piece<'_, G, M>, saved: Saved<'_>) {
    kernels::save(level, &*piece.params, saved.params);
    kernels::save(level, &*piece.exp_avg, saved.exp_avg);
    kernels::save(level, &*piece.exp_avg_sq, saved.exp_avg_sq);
}

fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<(), OptimError> {
    if actual == expected {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch { what, actual, expected })
    }
}

/// Builds the piece for a whole-partition call of the roofline, checking the lengths.
pub(crate) fn whole_piece<'a, G: GradElem, M: MomentElem>(
    state: AdamState<'a, M>,
    grads: &'a [G],
    out: Output<'a>,
) -> Result<Piece<'a, G, M>, OptimError> {
    let len = state.params.len();
    check_len("exp_avg", state.exp_avg.len(), len)?;
    check_len("exp_avg_sq", state.exp_avg_sq.len(), len)?;
    check_len("grads", grads.len(), len)?;
    if let Some(out_len) = out.len() {
        check_len("bf16 output", out_len, len)?;
    }
    let AdamState { params, exp_avg, exp_avg_sq } = state;
    Ok(Piece { params, grads, exp_avg, exp_avg_sq, out })
}
