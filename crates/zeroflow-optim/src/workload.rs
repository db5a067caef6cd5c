//! The buffers of an AdamW benchmark, allocated and filled the way the optimizer will use them.

use half::bf16;
use half::vec::HalfBitsVecExt;

use crate::kernels;
use crate::piece::MomentElem;
use crate::roofline::{self, RooflineVariant};
use std::time::Instant;

use crate::{
    AdamState, AdamW, AdamWConfig, AdamWStep, CpuAdam, Grads, OptimError, OptimizerStateDtype,
    Output, Saved,
};

/// The element type of the benchmark's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradDtype {
    F32,
    Bf16,
}

impl GradDtype {
    pub const fn size(self) -> usize {
        match self {
            GradDtype::F32 => 4,
            GradDtype::Bf16 => 2,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            GradDtype::F32 => "f32",
            GradDtype::Bf16 => "bf16",
        }
    }
}

/// Owned gradients of either type.
#[derive(Debug)]
enum GradBuffer {
    F32(Aligned<f32>),
    Bf16(Aligned<bf16>),
}

/// A buffer whose used part starts on a 64-byte line (as pinned, page-aligned host buffers do):
/// allocated with slack and used from its first aligned element.
#[derive(Debug)]
struct Aligned<T> {
    data: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Send> Aligned<T> {
    /// Fresh memory (zero pages, not yet touched), filled by `fill(offset, chunk)` on `adam`'s
    /// threads with the executor's chunking: the first touch.
    fn new(adam: &CpuAdam, len: usize, zero: T, fill: impl Fn(usize, &mut [T]) + Sync) -> Self
    where
        Vec<T>: FromZeroed<T>,
    {
        let slack = 64 / size_of::<T>();
        let mut data = <Vec<T>>::zeroed(len + slack, zero);
        let start = data.as_ptr().align_offset(64).min(slack);
        adam.for_each_chunk_mut(&mut data[start..start + len], fill);
        Aligned { data, start, len }
    }

    fn get(&self) -> &[T] {
        &self.data[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [T] {
        &mut self.data[self.start..self.start + self.len]
    }
}

/// `vec![zero; len]` for the element types the workload holds, by a route that maps fresh zero
/// pages without writing them.
trait FromZeroed<T> {
    fn zeroed(len: usize, zero: T) -> Self;
}

impl FromZeroed<f32> for Vec<f32> {
    fn zeroed(len: usize, zero: f32) -> Self {
        vec![zero; len]
    }
}

impl FromZeroed<bf16> for Vec<bf16> {
    fn zeroed(len: usize, _zero: bf16) -> Self {
        // `vec![0u16; n]` is a zeroed allocation, and reinterpreting it does not touch it.
        vec![0u16; len].reinterpret_into()
    }
}

/// Owned Adam moments of either type.
#[derive(Debug)]
enum MomentBuffers {
    F32 { exp_avg: Aligned<f32>, exp_avg_sq: Aligned<f32> },
    Bf16 { exp_avg: Aligned<bf16>, exp_avg_sq: Aligned<bf16> },
}

/// One partition's state (fp32 weights, moments of the asked dtype), its gradients and optionally a bf16 copy buffer, in fresh memory
/// whose pages were first touched by the executor's threads with the executor's chunking (so that
/// on a multi-socket host each chunk lives where it is updated), filled with random non-zero
/// values.
#[derive(Debug)]
pub struct Workload {
    params: Aligned<f32>,
    moments: MomentBuffers,
    grads: GradBuffer,
    bf16_copy: Option<Aligned<bf16>>,
}

impl Workload {
    /// Bytes allocated per parameter: weights, both moments, gradients, the bf16 copy.
    pub const fn bytes_allocated_per_param(
        grad: GradDtype,
        moments: OptimizerStateDtype,
        bf16_copy: bool,
    ) -> usize {
        moments.state_bytes_per_param() + grad.size() + if bf16_copy { 2 } else { 0 }
    }

    /// Bytes one AdamW step (or roofline pass) reads and writes per parameter.
    pub const fn bytes_moved_per_param(
        grad: GradDtype,
        moments: OptimizerStateDtype,
        bf16_copy: bool,
    ) -> usize {
        roofline::bytes_per_param(grad.size(), moments.bytes(), bf16_copy)
    }

    /// Allocates `len` parameters' buffers, each starting on a 64-byte line, and fills them on
    /// `adam`'s threads. Weights are ±0.5..1.5, first moments ±1e-3..0.1, second moments
    /// 1e-6..1e-2 (rounded to bf16 for bf16 moments), gradients ±1e-3..1, all non-zero and
    /// determined by `seed` and the element's index alone.
    pub fn new(
        adam: &CpuAdam,
        len: usize,
        grad: GradDtype,
        moments: OptimizerStateDtype,
        bf16_copy: bool,
        seed: u64,
    ) -> Self {
        let random = |stream: u64, lo: f32, hi: f32, signed: bool| {
            move |offset: usize, chunk: &mut [f32]| {
                for (i, x) in chunk.iter_mut().enumerate() {
                    *x = random_value(seed, stream, (offset + i) as u64, lo, hi, signed);
                }
            }
        };
        let random_bf16 = |stream: u64, lo: f32, hi: f32, signed: bool| {
            move |offset: usize, chunk: &mut [bf16]| {
                for (i, x) in chunk.iter_mut().enumerate() {
                    let value = random_value(seed, stream, (offset + i) as u64, lo, hi, signed);
                    *x = bf16::from_f32(value);
                }
            }
        };
        let params = Aligned::new(adam, len, 0.0, random(0, 0.5, 1.5, true));
        let moments = match moments {
            OptimizerStateDtype::Fp32 => MomentBuffers::F32 {
                exp_avg: Aligned::new(adam, len, 0.0, random(1, 1e-3, 0.1, true)),
                exp_avg_sq: Aligned::new(adam, len, 0.0, random(2, 1e-6, 1e-2, false)),
            },
            OptimizerStateDtype::Bf16 => MomentBuffers::Bf16 {
                exp_avg: Aligned::new(adam, len, bf16::ZERO, random_bf16(1, 1e-3, 0.1, true)),
                exp_avg_sq: Aligned::new(adam, len, bf16::ZERO, random_bf16(2, 1e-6, 1e-2, false)),
            },
        };
        let grads = match grad {
            GradDtype::F32 => {
                GradBuffer::F32(Aligned::new(adam, len, 0.0, random(3, 1e-3, 1.0, true)))
            }
            GradDtype::Bf16 => GradBuffer::Bf16(Aligned::new(
                adam,
                len,
                bf16::ZERO,
                random_bf16(3, 1e-3, 1.0, true),
            )),
        };
        let bf16_copy = bf16_copy
            .then(|| Aligned::new(adam, len, bf16::ZERO, |_, chunk| chunk.fill(bf16::ONE)));
        Workload { params, moments, grads, bf16_copy }
    }

    pub fn len(&self) -> usize {
        self.params.len
    }

    pub fn is_empty(&self) -> bool {
        self.params.len == 0
    }

    /// Whether the workload has a bf16 copy buffer.
    pub fn has_bf16_copy(&self) -> bool {
        self.bf16_copy.is_some()
    }

    /// The moments' element type.
    pub fn moments(&self) -> OptimizerStateDtype {
        match self.moments {
            MomentBuffers::F32 { .. } => OptimizerStateDtype::Fp32,
            MomentBuffers::Bf16 { .. } => OptimizerStateDtype::Bf16,
        }
    }

    /// One AdamW step over the whole workload.
    pub fn step(&mut self, adam: &CpuAdam, step: &AdamWStep) -> Result<(), OptimError> {
        let Workload { params, moments, grads, bf16_copy } = self;
        let (params, grads, out) = (params.get_mut(), grads_of(grads), output_of(bf16_copy));
        match moments {
            MomentBuffers::F32 { exp_avg, exp_avg_sq } => {
                let state = AdamState {
                    params,
                    exp_avg: exp_avg.get_mut(),
                    exp_avg_sq: exp_avg_sq.get_mut(),
                };
                adam.step(step, state, grads, out)
            }
            MomentBuffers::Bf16 { exp_avg, exp_avg_sq } => {
                let state = AdamState {
                    params,
                    exp_avg: exp_avg.get_mut(),
                    exp_avg_sq: exp_avg_sq.get_mut(),
                };
                adam.step(step, state, grads, out)
            }
        }
    }

    /// Room to save the whole workload's state into (f32, 12 bytes per parameter), first
    /// touched on `adam`'s threads.
    pub fn save_buffers(&self, adam: &CpuAdam) -> SaveBuffers {
        let zeroed = || Aligned::new(adam, self.len(), 0.0f32, |_, chunk| chunk.fill(0.0));
        SaveBuffers { buffers: [zeroed(), zeroed(), zeroed()] }
    }

    /// One AdamW step over the whole workload that saves the state first into `into`: in the
    /// step's pass ([`CpuAdam::step_range_saving`]) or, `copy_first`, as a copy over the whole
    /// state before the step (the traffic of a backup taken apart from the step).
    pub fn step_saving(
        &mut self,
        adam: &CpuAdam,
        step: &AdamWStep,
        into: &mut SaveBuffers,
        copy_first: bool,
    ) -> Result<(), OptimError> {
        let Workload { params, moments, grads, bf16_copy } = self;
        let (params, grads, out) = (params.get_mut(), grads_of(grads), output_of(bf16_copy));
        let [params_into, exp_avg_into, exp_avg_sq_into] =
            into.buffers.each_mut().map(Aligned::get_mut);
        let saved =
            Saved { params: params_into, exp_avg: exp_avg_into, exp_avg_sq: exp_avg_sq_into };
        match moments {
            MomentBuffers::F32 { exp_avg, exp_avg_sq } => {
                let (exp_avg, exp_avg_sq) = (exp_avg.get_mut(), exp_avg_sq.get_mut());
                let state = AdamState { params, exp_avg, exp_avg_sq };
                save_then_step(adam, step, state, grads, out, saved, copy_first)
            }
            MomentBuffers::Bf16 { exp_avg, exp_avg_sq } => {
                let (exp_avg, exp_avg_sq) = (exp_avg.get_mut(), exp_avg_sq.get_mut());
                let state = AdamState { params, exp_avg, exp_avg_sq };
                save_then_step(adam, step, state, grads, out, saved, copy_first)
            }
        }
    }

    /// One roofline pass (the traffic of a step, bf16 copy included; trivial arithmetic) over
    /// the whole workload.
    pub fn roofline_pass(
        &mut self,
        adam: &CpuAdam,
        variant: RooflineVariant,
    ) -> Result<(), OptimError> {
        let Workload { params, moments, grads, bf16_copy } = self;
        let (params, grads, out) = (params.get_mut(), grads_of(grads), output_of(bf16_copy));
        match moments {
            MomentBuffers::F32 { exp_avg, exp_avg_sq } => {
                let state = AdamState {
                    params,
                    exp_avg: exp_avg.get_mut(),
                    exp_avg_sq: exp_avg_sq.get_mut(),
                };
                roofline::pass(adam, state, grads, out, 0.0, variant)
            }
            MomentBuffers::Bf16 { exp_avg, exp_avg_sq } => {
                let state = AdamState {
                    params,
                    exp_avg: exp_avg.get_mut(),
                    exp_avg_sq: exp_avg_sq.get_mut(),
                };
                roofline::pass(adam, state, grads, out, 0.0, variant)
            }
        }
    }
}

/// Where [`Workload::step_saving`] saves the state: f32 weights and moments.
#[derive(Debug)]
pub struct SaveBuffers {
    buffers: [Aligned<f32>; 3],
}

/// [`Workload::step_saving`] over `state`, the whole workload.
fn save_then_step<M: MomentElem>(
    adam: &CpuAdam,
    step: &AdamWStep,
    state: AdamState<'_, M>,
    grads: Grads<'_>,
    out: Output<'_>,
    saved: Saved<'_>,
    copy_first: bool,
) -> Result<(), OptimError> {
    if !copy_first {
        let len = state.params.len();
        return adam.step_range_saving(step, state, 0..len, grads, out, Some(saved));
    }
    // As the engine's speculation took its backups before `step_range_saving`.
    let params = &*state.params;
    adam.for_each_chunk_mut(saved.params, |at, chunk| {
        chunk.copy_from_slice(&params[at..at + chunk.len()]);
    });
    widen_into(adam, saved.exp_avg, state.exp_avg);
    widen_into(adam, saved.exp_avg_sq, state.exp_avg_sq);
    adam.step(step, state, grads, out)
}

/// `into[i] = from[i]` as f32, on `adam`'s threads.
fn widen_into<M: MomentElem>(adam: &CpuAdam, into: &mut [f32], from: &[M]) {
    adam.for_each_chunk_mut(into, |at, chunk| kernels::widen(&from[at..at + chunk.len()], chunk));
}

fn output_of(bf16_copy: &mut Option<Aligned<bf16>>) -> Output<'_> {
    match bf16_copy {
        Some(copy) => Output::AlsoBf16(copy.get_mut()),
        None => Output::MasterOnly,
    }
}

fn grads_of(grads: &GradBuffer) -> Grads<'_> {
    match grads {
        GradBuffer::F32(grads) => Grads::F32(grads.get()),
        GradBuffer::Bf16(grads) => Grads::Bf16(grads.get()),
    }
}

/// A value log-uniform in `[lo, hi)`, of random sign if `signed`, from a counter-based hash of
/// (seed, stream, index): independent of the chunking that computes it.
fn random_value(seed: u64, stream: u64, index: u64, lo: f32, hi: f32, signed: bool) -> f32 {
    let bits = splitmix64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ splitmix64(index));
    let unit = (bits >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
    let magnitude = lo * (hi / lo).powf(unit);
    if signed && bits & 1 == 1 { -magnitude } else { magnitude }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The medians of [`measure`], in seconds per pass.
#[derive(Debug)]
pub struct Timings {
    pub adamw: f64,
    /// With save buffers: the step that saves the state in its pass, and the copy of the state
    /// followed by the step ([`Workload::step_saving`]).
    pub saving: Option<[f64; 2]>,
    /// One median per way of streaming that the roofline tried.
    pub roofline: Vec<(RooflineVariant, f64)>,
}

impl Timings {
    /// The fastest roofline variant: the ceiling.
    pub fn best_roofline(&self) -> (RooflineVariant, f64) {
        let by_time =
            |a: &&(RooflineVariant, f64), b: &&(RooflineVariant, f64)| a.1.total_cmp(&b.1);
        *self.roofline.iter().min_by(by_time).expect("at least one roofline variant")
    }
}

/// Warm-up, then `iters` rounds of one AdamW step and one roofline pass of each variant over
/// `workload` (and with `save`, its two saving steps), interleaved so that a noisy neighbour or
/// a clock change hits all of them alike (`zeroflow bench cpu-adam`).
pub fn measure(
    adam: &CpuAdam,
    workload: &mut Workload,
    mut save: Option<&mut SaveBuffers>,
    warmup: u32,
    iters: u32,
) -> Result<Timings, OptimError> {
    let mut optimizer = AdamW::new(AdamWConfig::default())?;
    let grad_scale = 1.0 / 1024.0;
    let variants = RooflineVariant::candidates(workload.has_bf16_copy());
    let mut adamw = Vec::with_capacity(iters as usize);
    let mut roofline = vec![Vec::with_capacity(iters as usize); variants.len()];
    let mut saving = [0, 1].map(|_| Vec::with_capacity(iters as usize));
    for round in 0..warmup + iters {
        let step = optimizer.next_step(grad_scale);
        let adamw_s = time(|| workload.step(adam, &step))?;
        let roofline_s: Vec<f64> = variants
            .iter()
            .map(|&variant| time(|| workload.roofline_pass(adam, variant)))
            .collect::<Result<_, _>>()?;
        let saving_s = match save.as_deref_mut() {
            Some(into) => [false, true]
                .map(|copy_first| time(|| workload.step_saving(adam, &step, into, copy_first)))
                .into_iter()
                .collect::<Result<Vec<f64>, _>>()?,
            None => Vec::new(),
        };
        if round >= warmup {
            adamw.push(adamw_s);
            roofline.iter_mut().zip(roofline_s).for_each(|(samples, s)| samples.push(s));
            saving.iter_mut().zip(saving_s).for_each(|(samples, s)| samples.push(s));
        }
    }
    let roofline = variants.into_iter().zip(roofline.iter_mut().map(|s| median(s))).collect();
    let saving = save.is_some().then(|| saving.each_mut().map(|s| median(s)));
    Ok(Timings { adamw: median(&mut adamw), saving, roofline })
}

fn time<E>(f: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    if samples.len() % 2 == 1 { samples[mid] } else { (samples[mid - 1] + samples[mid]) / 2.0 }
}
