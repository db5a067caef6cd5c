//! A synthetic model with known gradients, a plain single-rank AdamW reference, and a runner
//! that trains the synthetic model with the engine on in-process ranks.

use std::ops::Range;
use std::time::Duration;

use zeroflow_core::layout::{Alignment, FlatLayout, ParamSpec};
use zeroflow_core::{Float, bf16};
use zeroflow_device::cpu::{CpuComm, KernelArgs};
use zeroflow_device::{Chaos, CpuDevice, Device, HostMemory, StreamKind};
use zeroflow_engine::{Engine, EngineError, EngineOptions, LossScaler, ModelIo, Stage, StepReport};
use zeroflow_optim::{
    AdamState, AdamW, AdamWConfig, CpuAdam, Grads, Output, SimdLevel, WeightDecayMode,
};

pub const SHAPES: [&[usize]; 5] = [&[7, 5], &[13], &[3, 11], &[29], &[2, 2, 3]];

pub fn layout(world: usize) -> FlatLayout {
    let specs: Vec<_> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("w{i}"), s.to_vec()))
        .collect();
    FlatLayout::new(&specs, world, Alignment { param: 4, partition: 2 }).unwrap()
}

/// A deterministic value in [0, 1) from a few integers.
fn hash01(a: u64, b: u64, c: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ c.wrapping_add(0x1656_67B1_9E37_79F9);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 24) as f32
}

/// The gradient of element `i` on `rank` at global micro-step `k` for weight `w`:
/// `a_i·w − b`, with `b ∈ [1, 2)` so that it stays away from zero.
pub fn grad(i: usize, w: f32, rank: usize, k: u64) -> f32 {
    let a = 0.5 + hash01(i as u64, 0, 1);
    let b = 1.0 + hash01(i as u64, rank as u64 + 7, k + 3);
    a * w - b
}

pub fn initial<P: Float>(layout: &FlatLayout) -> Vec<P> {
    let mut flat = vec![P::default(); layout.padded_len()];
    for p in layout.params() {
        for i in p.flat_range() {
            flat[i] = P::from_f32(0.2 * (hash01(i as u64, 99, 5) - 0.5));
        }
    }
    flat
}

/// Forward and backward of the synthetic model: adds `loss_scale × grad` into the gradients of
/// every parameter on the compute stream, reporting each parameter in reverse order.
pub fn model<P: Float>(
    device: &CpuDevice,
    layout: &FlatLayout,
    io: ModelIo<'_, CpuDevice, P>,
    grads_ready: &mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    rank: usize,
    k: u64,
) -> Result<(), EngineError> {
    let compute = device.stream(StreamKind::Compute);
    let scale = io.loss_scale;
    for param in layout.params().iter().rev() {
        let range = param.flat_range();
        let args =
            KernelArgs::new().input(io.params, range.clone()).in_out(io.grads, range.clone());
        let start = range.start;
        device.launch(compute, "synthetic_backward", args, move |ctx| {
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

#[derive(Clone, Debug)]
pub struct Setup {
    pub stage: Stage,
    pub world: usize,
    pub accum: u32,
    pub offload: bool,
    pub steps: u32,
    pub clip: Option<f64>,
    pub chaos: Option<u64>,
    pub bucket: usize,
}

impl Setup {
    pub fn new(stage: Stage, world: usize, accum: u32, offload: bool) -> Self {
        Setup { stage, world, accum, offload, steps: 20, clip: Some(0.8), chaos: None, bucket: 23 }
    }
}

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

pub fn options(setup: &Setup, scaler: LossScaler) -> EngineOptions {
    EngineOptions {
        stage: setup.stage,
        grad_accum: u64::from(setup.accum),
        clip: setup.clip,
        offload: setup.offload.then_some(HostMemory::Pinned),
        reduce_bucket: setup.bucket,
        adamw: adamw_config(),
        scaler,
        cpu_threads: 2,
    }
}

/// Final flat weights of every rank, and every rank's step reports.
pub struct Outcome<P> {
    pub weights: Vec<Vec<P>>,
    pub reports: Vec<Vec<StepReport>>,
}

/// Trains the synthetic model with the engine; `inject(rank, k)` may poison micro-step `k`.
pub fn train<P: Float>(
    setup: &Setup,
    scaler: LossScaler,
    poison: Option<(usize, u64)>,
) -> Outcome<P> {
    let devices: Vec<CpuDevice> = (0..setup.world)
        .map(|r| {
            match setup.chaos {
                Some(seed) => CpuDevice::with_chaos(Chaos {
                    seed: seed * 131 + r as u64,
                    max_delay: Duration::from_micros(30),
                    percent_delayed: 30,
                }),
                None => CpuDevice::new(),
            }
            .unwrap()
        })
        .collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(30));
    let results: Vec<(Vec<P>, Vec<StepReport>)> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (device, comm))| {
                let scaler = scaler.clone();
                s.spawn(move || {
                    let layout = layout(setup.world);
                    let init = initial::<P>(&layout);
                    let mut engine: Engine<CpuDevice, CpuComm, P> = Engine::new(
                        device.clone(),
                        comm,
                        layout.clone(),
                        options(setup, scaler),
                        &init,
                    )
                    .unwrap();
                    let mut reports = Vec::new();
                    for k in 0..u64::from(setup.steps * setup.accum) {
                        engine
                            .backward(|io, ready| {
                                let scale =
                                    if poison == Some((rank, k)) { f32::INFINITY } else { 1.0 };
                                let io = ModelIo { loss_scale: io.loss_scale * scale, ..io };
                                model(&device, &layout, io, ready, rank, k)
                            })
                            .unwrap_or_else(|e| panic!("rank {rank} micro-step {k}: {e}"));
                        let report =
                            engine.step().unwrap_or_else(|e| panic!("rank {rank} step {k}: {e}"));
                        if report != StepReport::Accumulated {
                            reports.push(report);
                        }
                    }
                    (device.download(engine.params()).unwrap(), reports)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (weights, reports) = results.into_iter().unzip();
    Outcome { weights, reports }
}

/// Plain single-rank AdamW on the mean gradient over ranks and micro-steps, with the model
/// reading its weights as `P`. Returns the fp32 master weights (flat, padding zero) and the
/// gradient norm of every step.
pub fn reference<P: Float>(setup: &Setup) -> (Vec<f32>, Vec<f64>) {
    let layout = layout(1);
    let mut master: Vec<f32> = initial::<P>(&layout).iter().map(|p| p.to_f32()).collect();
    let n = master.len();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut adamw = AdamW::new(adamw_config()).unwrap();
    let adam = CpuAdam::new(1, SimdLevel::detect()).unwrap();
    let params: Vec<Range<usize>> = layout.params().iter().map(|p| p.flat_range()).collect();
    let mut norms = Vec::new();
    for step in 0..u64::from(setup.steps) {
        let mut g = vec![0f64; n];
        for micro in 0..u64::from(setup.accum) {
            let k = step * u64::from(setup.accum) + micro;
            for range in &params {
                for i in range.clone() {
                    let w = P::from_f32(master[i]).to_f32();
                    for rank in 0..setup.world {
                        g[i] += f64::from(grad(i, w, rank, k));
                    }
                }
            }
        }
        let count = (setup.world as f64) * f64::from(setup.accum);
        let mean: Vec<f32> = g.iter().map(|x| (x / count) as f32).collect();
        let norm = mean.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let coef = match setup.clip {
            Some(max) if norm + 1e-6 > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        norms.push(norm);
        let step_scalars = adamw.next_step(coef as f32);
        let state = AdamState { params: &mut master, exp_avg: &mut m, exp_avg_sq: &mut v };
        adam.step(&step_scalars, state, Grads::F32(&mean), Output::MasterOnly).unwrap();
    }
    (master, norms)
}

/// The gradient norms of the steps in `reports`.
pub fn norms(reports: &[StepReport]) -> Vec<f64> {
    reports
        .iter()
        .map(|r| match r {
            StepReport::Stepped { grad_norm, .. } => *grad_norm,
            other => panic!("expected a step, got {other:?}"),
        })
        .collect()
}

/// Largest relative difference over parameter elements, relative to max(|reference|, 1e-3).
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

pub fn to_f32<P: Float>(flat: &[P]) -> Vec<f32> {
    flat.iter().map(|p| p.to_f32()).collect()
}

/// The bf16 type, for tests that name it.
pub type Bf16 = bf16;
