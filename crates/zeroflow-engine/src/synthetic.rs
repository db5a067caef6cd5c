//! A synthetic model with known gradients, for testing and stress-testing the engine without a
//! real network.
//!
//! Element `i` on rank `r` at global micro-step `k` has the gradient `a_i·w − b` with
//! `a_i ∈ [0.5, 1.5)` and `b ∈ [1, 2)` drawn from a hash: gradients depend on the weights the
//! model reads, differ between ranks and micro-steps, and stay away from zero (so that Adam's
//! sign-sensitive update is well conditioned). [`Reference`] is plain single-rank AdamW on the
//! same gradients, computed on the host in `f64` sums.

use std::ops::Range;

use zeroflow_core::layout::{Alignment, FlatLayout, ParamSpec};
use zeroflow_core::{DType, Float};
use zeroflow_device::cpu::KernelArgs;
use zeroflow_device::cuda::KernelParams;
use zeroflow_device::{CpuDevice, CudaDevice, Device, StreamKind};
use zeroflow_optim::{
    AdamState, AdamW, AdamWConfig, AdamWStep, CpuAdam, Grads, Output, SimdLevel, WeightDecayMode,
};

use crate::{EngineError, ModelIo};

/// Shapes of the synthetic model's parameters: sizes that make partitions straddle parameters.
pub const SHAPES: [&[usize]; 5] = [&[7, 5], &[13], &[3, 11], &[29], &[2, 2, 3]];

/// The synthetic model's parameters, placed for `world` ranks (small alignments, so that
/// partition boundaries fall inside parameters).
pub fn layout(world: usize) -> FlatLayout {
    let specs: Vec<_> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("w{i}"), s.to_vec()))
        .collect();
    FlatLayout::new(&specs, world, Alignment { param: 4, partition: 2 })
        .expect("the synthetic shapes form a valid layout")
}

/// A deterministic value in [0, 1) from three integers.
fn hash01(a: u64, b: u64, c: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ c.wrapping_add(0x1656_67B1_9E37_79F9);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 24) as f32
}

/// The gradient of flat element `i` on `rank` at global micro-step `k` for weight `w`.
pub fn grad(i: usize, w: f32, rank: usize, k: u64) -> f32 {
    let a = 0.5 + hash01(i as u64, 0, 1);
    let b = 1.0 + hash01(i as u64, rank as u64 + 7, k + 3);
    a * w - b
}

/// The initial flat weights (padding zero).
pub fn initial<P: Float>(layout: &FlatLayout) -> Vec<P> {
    let mut flat = vec![P::default(); layout.padded_len()];
    for p in layout.params() {
        for i in p.flat_range() {
            flat[i] = P::from_f32(0.2 * (hash01(i as u64, 99, 5) - 0.5));
        }
    }
    flat
}

/// Forward and backward of the synthetic model on `rank` at micro-step `k`: adds
/// `loss_scale × grad` into the gradients of every parameter on the compute stream, reporting each
/// parameter complete in reverse order. The same gradients, bit for bit, on the CPU and on a GPU.
pub fn forward_backward<D: SyntheticBackward, P: Float>(
    device: &D,
    layout: &FlatLayout,
    io: ModelIo<'_, D, P>,
    grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    rank: usize,
    k: u64,
) -> Result<(), EngineError> {
    let (weights, grads, scale) = (io.params, io.grads, io.loss_scale);
    device.synthetic_backward(layout, weights, grads, scale, grads_ready, (rank, k))
}

/// [`forward_backward`] with a forward that reads the weights as a model's does: each parameter,
/// in the layout's order, opened ([`ModelIo::open`]) and then copied on the compute stream into
/// an activation buffer (on a GPU freed synchronously when it goes, after the kernels that read
/// it), from which the backward computes the gradients. The same gradients, bit for bit, where
/// every copy read the current weights; a copy queued before its weights' upload reads the last
/// step's, and the run differs.
pub fn forward_backward_opening<D: SyntheticBackward, P: Float>(
    device: &D,
    layout: &FlatLayout,
    mut io: ModelIo<'_, D, P>,
    grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    rank: usize,
    k: u64,
) -> Result<(), EngineError> {
    let compute = device.stream(StreamKind::Compute);
    let seen = device.alloc::<P>(layout.padded_len())?;
    for param in layout.params() {
        let range = param.flat_range();
        io.open(range.end);
        device.copy_d2d(compute, io.params, range.clone(), &seen, range.start)?;
    }
    io.open(usize::MAX);
    let (grads, scale) = (io.grads, io.loss_scale);
    device.synthetic_backward(layout, &seen, grads, scale, grads_ready, (rank, k))
}

/// A device the synthetic model runs on: its backward kernel, one launch per parameter on the
/// compute stream (a host kernel on the CPU, `kernels/synthetic.cu` on a GPU).
pub trait SyntheticBackward: Device {
    /// The synthetic backward from `weights` into `grads` (see [`forward_backward`]).
    fn synthetic_backward<P: Float>(
        &self,
        layout: &FlatLayout,
        weights: &Self::Buffer<P>,
        grads: &Self::Buffer<P>,
        scale: f32,
        grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
        rank_step: (usize, u64),
    ) -> Result<(), EngineError>;
}

impl SyntheticBackward for CpuDevice {
    fn synthetic_backward<P: Float>(
        &self,
        layout: &FlatLayout,
        weights: &Self::Buffer<P>,
        grads: &Self::Buffer<P>,
        scale: f32,
        grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
        (rank, k): (usize, u64),
    ) -> Result<(), EngineError> {
        let compute = self.stream(StreamKind::Compute);
        for param in layout.params().iter().rev() {
            let range = param.flat_range();
            let args = KernelArgs::new().input(weights, range.clone()).in_out(grads, range.clone());
            let start = range.start;
            self.launch(compute, "synthetic_backward", args, move |ctx| {
                let (w, g) = (ctx.input::<P>(0), ctx.output::<P>(1));
                for (j, (g, w)) in g.iter_mut().zip(w).enumerate() {
                    *g = P::from_f32(g.to_f32() + scale * grad(start + j, w.to_f32(), rank, k));
                }
                Ok(())
            })?;
            grads_ready(range)?;
        }
        Ok(())
    }
}

impl SyntheticBackward for CudaDevice {
    fn synthetic_backward<P: Float>(
        &self,
        layout: &FlatLayout,
        weights: &Self::Buffer<P>,
        grads: &Self::Buffer<P>,
        scale: f32,
        grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
        (rank, k): (usize, u64),
    ) -> Result<(), EngineError> {
        let kernel = match P::DTYPE {
            DType::F32 => "synthetic_backward_f32",
            DType::Bf16 => "synthetic_backward_bf16",
            DType::F16 => "synthetic_backward_f16",
            _ => {
                return Err(EngineError::Misuse(
                    "the synthetic model computes in f32, bf16 or f16",
                ));
            }
        };
        let module = self.load_module("synthetic", include_str!("../kernels/synthetic.cu"))?;
        let function = module.function(kernel)?;
        let compute = self.stream(StreamKind::Compute);
        for param in layout.params().iter().rev() {
            let range = param.flat_range();
            let n = range.len() as u64;
            let params = KernelParams::new()
                .ptr(weights, range.start)
                .ptr(grads, range.start)
                .u64(range.start as u64)
                .u64(n)
                .u64(rank as u64)
                .u64(k)
                .f32(scale);
            let blocks = n.div_ceil(256).min(4096) as u32;
            // SAFETY: the arguments match `synthetic_backward_*` (two `P` pointers, four u64,
            // one f32); both pointers address `n` elements inside the flat buffers (the range is a
            // parameter of the layout the buffers were allocated for); the engine orders the
            // compute stream.
            unsafe { self.launch(compute, &function, blocks, 256, 0, &params)? };
            grads_ready(range)?;
        }
        Ok(())
    }
}

/// The AdamW settings the synthetic tests use: a learning rate large enough that a lost or stale
/// gradient shows, and weight decay so that the decoupled term is exercised.
pub fn adamw_config() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
        mode: WeightDecayMode::Decoupled,
        bias_correction: true,
    }
}

/// Plain single-rank AdamW on the mean gradient over `world` ranks and `accum` micro-steps, the
/// model reading its weights as `P`; the 1-D parameters without weight decay.
#[derive(Debug)]
pub struct Reference {
    layout: FlatLayout,
    world: usize,
    accum: u64,
    clip: Option<f64>,
    /// fp32 master weights, flat in the single-rank layout.
    pub master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    adamw: AdamW,
    adam: CpuAdam,
    steps: u64,
}

impl Reference {
    pub fn new<P: Float>(world: usize, accum: u64, clip: Option<f64>, adamw: AdamWConfig) -> Self {
        let layout = layout(1);
        let master: Vec<f32> = initial::<P>(&layout).iter().map(|p| p.to_f32()).collect();
        let n = master.len();
        Reference {
            layout,
            world,
            accum,
            clip,
            master,
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            adamw: AdamW::new(adamw).expect("a valid AdamW configuration"),
            adam: CpuAdam::new(1, SimdLevel::detect()).expect("one thread is always available"),
            steps: 0,
        }
    }

    /// The gradients of flat `range`, summed over every rank and the first `micro_steps`
    /// micro-steps of the current window (what rank-summed accumulation holds then).
    pub fn window_sum<P: Float>(&self, range: Range<usize>, micro_steps: u64) -> Vec<f64> {
        self.window_sum_at::<P>(range, micro_steps, &self.master)
    }

    /// [`Reference::window_sum`] with the model reading `weights` instead of the current master.
    pub fn window_sum_at<P: Float>(
        &self,
        range: Range<usize>,
        micro_steps: u64,
        weights: &[f32],
    ) -> Vec<f64> {
        let first = self.steps * self.accum;
        range
            .map(|i| {
                if !self.layout.holds_parameters(i..i + 1) {
                    return 0.0;
                }
                let w = P::from_f32(weights[i]).to_f32();
                (first..first + micro_steps)
                    .flat_map(|k| (0..self.world).map(move |rank| f64::from(grad(i, w, rank, k))))
                    .sum()
            })
            .collect()
    }

    /// The reference's master weights over `range` of the layout of any world size: the
    /// parameters sit at the same offsets in every world's layout (their alignment does not
    /// depend on it), only the padding at the end grows with the world size, so elements past
    /// the single-rank buffer are padding (0).
    pub fn master_in(&self, range: Range<usize>) -> Vec<f32> {
        range.map(|i| self.master.get(i).copied().unwrap_or(0.0)).collect()
    }

    /// One optimizer step over the whole window; returns the gradient norm.
    pub fn step<P: Float>(&mut self) -> f64 {
        let weights = self.master.clone();
        self.step_at::<P>(&weights)
    }

    /// One optimizer step with the model having read `weights` during the window (the delayed
    /// update's stale weights); returns the gradient norm.
    pub fn step_at<P: Float>(&mut self, weights: &[f32]) -> f64 {
        let n = self.master.len();
        let count = self.world as f64 * self.accum as f64;
        let sums = self.window_sum_at::<P>(0..n, self.accum, weights);
        let mean: Vec<f32> = sums.iter().map(|g| (g / count) as f32).collect();
        let norm = mean.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let coef = match self.clip {
            Some(max) if norm + 1e-6 > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        let step: AdamWStep = self.adamw.next_step(coef as f32);
        let no_decay = one_d_elements(&self.layout);
        let state = [&mut self.master, &mut self.exp_avg, &mut self.exp_avg_sq];
        adamw_each(&self.adam, &step, state, &mean, &no_decay);
        self.steps += 1;
        norm
    }
}

/// Whether each element of `layout` belongs to a 1-D parameter, which takes no weight decay
/// (the references' own reading of the rule, apart from the engine's).
pub fn one_d_elements(layout: &FlatLayout) -> Vec<bool> {
    let mut one_d = vec![false; layout.padded_len()];
    for param in layout.params().iter().filter(|p| p.shape.len() < 2) {
        one_d[param.flat_range()].fill(true);
    }
    one_d
}

/// One AdamW `step` of the state `[master, exp_avg, exp_avg_sq]` with `grads`, element `i`
/// without weight decay where `no_decay[i]`: the whole state stepped both ways, each element
/// kept from one (the references' way, apart from the engine's runs).
pub fn adamw_each(
    adam: &CpuAdam,
    step: &AdamWStep,
    state: [&mut Vec<f32>; 3],
    grads: &[f32],
    no_decay: &[bool],
) {
    let stepped = |step: &AdamWStep| {
        let [mut master, mut exp_avg, mut exp_avg_sq] = state.each_ref().map(|v| v.to_vec());
        let view =
            AdamState { params: &mut master, exp_avg: &mut exp_avg, exp_avg_sq: &mut exp_avg_sq };
        adam.step(step, view, Grads::F32(grads), Output::MasterOnly)
            .expect("the reference's buffers have equal lengths");
        [master, exp_avg, exp_avg_sq]
    };
    let (decayed, undecayed) = (stepped(step), stepped(&step.without_weight_decay()));
    for (k, values) in state.into_iter().enumerate() {
        for (i, value) in values.iter_mut().enumerate() {
            *value = if no_decay[i] { undecayed[k][i] } else { decayed[k][i] };
        }
    }
}

/// Largest relative difference over the parameter elements of `layout` (padding ignored), relative
/// to max(|reference|, 1e-3): how the tests compare trained weights with [`Reference`].
pub fn max_rel_diff(layout: &FlatLayout, got: &[f32], want: &[f32]) -> f64 {
    let mut worst = 0f64;
    for p in layout.params() {
        for i in p.flat_range() {
            let (g, w) = (f64::from(got[i]), f64::from(want[i]));
            worst = worst.max((g - w).abs() / w.abs().max(1e-3));
        }
    }
    worst
}
