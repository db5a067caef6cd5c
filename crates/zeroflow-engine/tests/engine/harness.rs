//! A runner that trains the synthetic model with the engine on in-process CPU ranks, and the
//! single-rank reference to compare with.

use std::time::Duration;

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{Float, bf16};
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::{Chaos, CopiedBytes, CpuDevice, Device, HostMemory, PinnedUse};
pub use zeroflow_engine::synthetic::layout;
use zeroflow_engine::synthetic::{
    Reference, adamw_config, forward_backward, forward_backward_opening, initial,
};
use zeroflow_engine::{
    AccumulateOn, DEFAULT_SPECULATION_BUDGET, DEFAULT_STREAM_CHUNK, DEFAULT_ZENFLOW_ASIDE, Engine,
    EngineOptions, LossScaler, ModelIo, Offload, OffloadUpdate, OptimizerPart, Placement, Restore,
    ShareState, Snapshot, SpeculationStats, Stage, StepReport, StreamOptions, ZenFlowAside,
    ZenFlowOptions, ZenFlowSnapshot,
};
use zeroflow_optim::Stores;

/// A speculation budget that covers every test's whole partition (4 GiB; the default is none).
pub const WHOLE_BUDGET: usize = 4 << 30;

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
    /// Delayed update after this many exact steps.
    pub delayed: Option<u64>,
    /// ZenFlow's split update (needs `offload` and `accum` 1).
    pub zenflow: Option<ZenFlowOptions>,
    /// Report the end of an epoch to the engine after every this many steps.
    pub epoch_steps: Option<u64>,
    /// Elements per host staging buffer and streaming-step chunk (offload).
    pub stream_chunk: usize,
    /// How the CPU AdamW writes the bf16 weight copy (offload; `None`: the engine's choice).
    pub copy_stores: Option<Stores>,
    /// The streaming step gathers in pieces while it steps (offload, several ranks; the engine's
    /// default); `stream_tuning` checks the gather after the step against it.
    pub gather_in_pieces: bool,
    /// Bytes of host memory for the exact offload step's speculative backups (0: off).
    pub speculation_budget: usize,
    /// Where ZeRO-2 with accumulation sums a window (offload).
    pub accumulate_on: AccumulateOn,
    /// The host Adam moments' element type (offload).
    pub moments: OptimizerStateDtype,
    /// Where ZenFlow's overlapped CPU step reads its window from.
    pub zenflow_aside: ZenFlowAside,
    /// Bytes of pinned host memory each rank's device may hold (`None`: no limit).
    pub pinned_budget: Option<usize>,
    /// The exact streaming step leaves its CPU work to the next forward, which opens the
    /// weights parameter by parameter (`forward_backward_opening`; the plain model otherwise).
    pub overlap_forward: bool,
    /// With `overlap_forward`, the model opens every weight at once (`open(usize::MAX)`) before
    /// its forward reads any, instead of parameter by parameter.
    pub open_at_once: bool,
    /// The share of the partition stepped on the device (`StreamOptions::device_share`).
    pub device_share: f64,
    /// Where the share keeps its state (`StreamOptions::device_share_state`).
    pub share_state: ShareState,
    /// The speculation stops stepping pieces once the device is past the backward, as the
    /// engine does by default; otherwise (`Engine::speculate_late`) it steps what its budget
    /// holds, so that the tests see pieces stepped whatever the CPU device's timing.
    pub speculation_stops: bool,
}

impl Setup {
    pub fn new(stage: Stage, world: usize, accum: u32, offload: bool) -> Self {
        Setup {
            stage,
            world,
            accum,
            offload,
            steps: 20,
            clip: Some(0.8),
            chaos: None,
            bucket: 23,
            delayed: None,
            zenflow: None,
            epoch_steps: None,
            stream_chunk: DEFAULT_STREAM_CHUNK,
            copy_stores: None,
            gather_in_pieces: true,
            speculation_budget: DEFAULT_SPECULATION_BUDGET,
            accumulate_on: AccumulateOn::Auto,
            moments: OptimizerStateDtype::Fp32,
            zenflow_aside: DEFAULT_ZENFLOW_ASIDE,
            pinned_budget: None,
            overlap_forward: false,
            speculation_stops: false,
            open_at_once: false,
            device_share: 0.0,
            share_state: ShareState::Device,
        }
    }
}

pub fn options(setup: &Setup, scaler: LossScaler) -> EngineOptions {
    let update = match (setup.zenflow, setup.delayed) {
        (None, None) => OffloadUpdate::Exact,
        (None, Some(warmup)) => OffloadUpdate::Delayed { warmup },
        (Some(zenflow), None) => OffloadUpdate::ZenFlow(zenflow),
        (Some(_), Some(_)) => panic!("ZenFlow and the delayed update exclude each other"),
    };
    let placement = match setup.offload {
        true => Placement::Offload(Offload {
            memory: HostMemory::Pinned,
            cpu_threads: 2,
            update,
            stream: StreamOptions {
                chunk: setup.stream_chunk,
                copy_stores: setup.copy_stores,
                gather_in_pieces: setup.gather_in_pieces,
                speculation_budget: setup.speculation_budget,
                accumulate_on: setup.accumulate_on,
                zenflow_aside: setup.zenflow_aside,
                overlap_forward: setup.overlap_forward,
                device_share: setup.device_share,
                device_share_state: setup.share_state,
            },
            moments: setup.moments,
        }),
        false => {
            assert_eq!(update, OffloadUpdate::Exact, "the delayed update and ZenFlow offload");
            Placement::Device
        }
    };
    EngineOptions {
        stage: setup.stage,
        grad_accum: u64::from(setup.accum),
        clip: setup.clip,
        reduce_bucket: setup.bucket,
        adamw: adamw_config(),
        scaler,
        placement,
    }
}

/// Final flat weights of every rank, and every rank's step reports.
pub struct Outcome<P> {
    pub weights: Vec<Vec<P>>,
    pub reports: Vec<Vec<StepReport>>,
    /// Every rank's state at the end (taken before the final flush).
    pub snapshots: Vec<Snapshot>,
    /// Every rank's device weights at the snapshot: what a checkpoint saves.
    pub device_weights: Vec<Vec<P>>,
    /// Every rank's host-link traffic and CPU-optimizer time over its steps.
    pub traffic: Vec<Traffic>,
}

/// What a rank's steps copied between host and device and spent on the CPU optimizer: from after
/// the engine was set up (and restored) to right after the last step, before the snapshot.
#[derive(Clone, Copy, Debug)]
pub struct Traffic {
    pub copied: CopiedBytes,
    pub cpu_wait: Duration,
    /// What the speculative step did over the steps.
    pub speculation: SpeculationStats,
    /// The device's pinned host memory once the engine was set up.
    pub pinned: PinnedUse,
    /// The engine keeps a host gradient accumulator (the accumulating paths).
    pub host_accumulator: bool,
}

/// Trains the synthetic model with the engine; `inject(rank, k)` may poison micro-step `k`.
pub fn train<P: Float>(
    setup: &Setup,
    scaler: LossScaler,
    poison: Option<(usize, u64)>,
) -> Outcome<P> {
    train_from(setup, scaler, poison, None)
}

/// One rank's flushed weights, step reports, snapshot, weights at the snapshot and traffic.
type RankResult<P> = (Vec<P>, Vec<StepReport>, Snapshot, Vec<P>, Traffic);

/// A point to resume from: the flat weights and the optimizer state as saved.
#[derive(Clone, Debug)]
pub struct Resume<P> {
    pub weights: Vec<P>,
    pub parts: Vec<OptimizerPart>,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    pub upload_pending: bool,
    pub scaler: LossScaler,
    /// Every rank's ZenFlow state (empty without ZenFlow).
    pub zenflow: Vec<ZenFlowSnapshot>,
    /// The checkpoint these came from, when each rank restores its optimizer state from the
    /// files themselves, a piece at a time (as `zeroflow train --resume` does), not from `parts`.
    pub files: Option<std::path::PathBuf>,
}

/// [`train`] for `setup.steps` more steps, starting from `resume` if given.
pub fn train_from<P: Float>(
    setup: &Setup,
    scaler: LossScaler,
    poison: Option<(usize, u64)>,
    resume: Option<&Resume<P>>,
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
    let results: Vec<RankResult<P>> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (device, comm))| {
                let scaler = scaler.clone();
                s.spawn(move || {
                    let layout = layout(setup.world);
                    let init = initial::<P>(&layout);
                    device.pinned_budget().set_limit(setup.pinned_budget);
                    let mut engine: Engine<CpuDevice, CpuComm, P> = Engine::new(
                        device.clone(),
                        comm,
                        layout.clone(),
                        options(setup, scaler),
                        &init,
                    )
                    .unwrap();
                    if !setup.speculation_stops {
                        engine.speculate_late();
                    }
                    if let Some(r) = resume {
                        let opened = r
                            .files
                            .as_deref()
                            .map(|dir| zeroflow_engine::checkpoint::open(dir).unwrap().parts);
                        let from = Restore {
                            parts: match &opened {
                                Some(files) => files.as_slice().into(),
                                None => r.parts.as_slice().into(),
                            },
                            optimizer_steps: r.optimizer_steps,
                            micro_steps: r.micro_steps,
                            upload_pending: r.upload_pending,
                            scaler: &r.scaler,
                            zenflow: &r.zenflow,
                        };
                        engine.restore(Some(&r.weights), from).unwrap();
                    }
                    let pinned = device.pinned_budget().usage();
                    let mut reports = Vec::new();
                    let (copied, waited) = (device.copied_bytes(), engine.cpu_wait());
                    let first = engine.micro_steps();
                    for k in first..first + u64::from(setup.steps * setup.accum) {
                        engine
                            .backward(|io, ready| {
                                let scale =
                                    if poison == Some((rank, k)) { f32::INFINITY } else { 1.0 };
                                let mut io = ModelIo { loss_scale: io.loss_scale * scale, ..io };
                                if setup.open_at_once {
                                    io.open(usize::MAX);
                                }
                                match setup.overlap_forward {
                                    true => forward_backward_opening(
                                        &device, &layout, io, ready, rank, k,
                                    ),
                                    false => forward_backward(&device, &layout, io, ready, rank, k),
                                }
                            })
                            .unwrap_or_else(|e| panic!("rank {rank} micro-step {k}: {e}"));
                        let report =
                            engine.step().unwrap_or_else(|e| panic!("rank {rank} step {k}: {e}"));
                        if report != StepReport::Accumulated {
                            reports.push(report);
                        }
                        let (done, accum) = (engine.micro_steps(), u64::from(setup.accum));
                        let epoch_ends = setup.epoch_steps.is_some_and(|e| {
                            done.is_multiple_of(accum) && (done / accum).is_multiple_of(e)
                        });
                        if epoch_ends {
                            engine.end_epoch();
                        }
                    }
                    let traffic = Traffic {
                        copied: device.copied_bytes().since(copied),
                        cpu_wait: engine.cpu_wait() - waited,
                        speculation: engine.speculation_stats().unwrap_or_default(),
                        pinned,
                        host_accumulator: engine.host_grad_accumulator().is_some(),
                    };
                    let snapshot = engine.snapshot().unwrap();
                    let device_weights = device.download(engine.params()).unwrap();
                    same_as_lent(&snapshot, &engine.checkpoint_state().unwrap(), &device_weights);
                    engine.flush().unwrap();
                    let weights = device.download(engine.params()).unwrap();
                    (weights, reports, snapshot, device_weights, traffic)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut outcome = Outcome {
        weights: Vec::new(),
        reports: Vec::new(),
        snapshots: Vec::new(),
        device_weights: Vec::new(),
        traffic: Vec::new(),
    };
    for (weights, reports, snapshot, device_weights, traffic) in results {
        outcome.weights.push(weights);
        outcome.reports.push(reports);
        outcome.snapshots.push(snapshot);
        outcome.device_weights.push(device_weights);
        outcome.traffic.push(traffic);
    }
    outcome
}

/// Plain single-rank AdamW (see [`Reference`]): the final fp32 master weights (flat, single-rank
/// layout) and the gradient norm of every step.
pub fn reference<P: Float>(setup: &Setup) -> (Vec<f32>, Vec<f64>) {
    let world = setup.world;
    let mut reference =
        Reference::new::<P>(world, u64::from(setup.accum), setup.clip, adamw_config());
    let mut previous = reference.master.clone();
    let mut norms = Vec::new();
    for t in 0..u64::from(setup.steps) {
        // With the delayed update, window t > warm-up computes with the weights before the last
        // step (DESIGN.md §5).
        let stale = setup.delayed.is_some_and(|warm_up| t > warm_up);
        let current = reference.master.clone();
        norms.push(reference.step_at::<P>(if stale { &previous } else { &current }));
        previous = current;
    }
    (reference.master, norms)
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

pub use zeroflow_engine::synthetic::max_rel_diff;

pub fn to_f32<P: Float>(flat: &[P]) -> Vec<f32> {
    flat.iter().map(|p| p.to_f32()).collect()
}

/// The bf16 type, for tests that name it.
pub type Bf16 = bf16;

/// What [`Engine::checkpoint_state`] gives a checkpoint (lent where the state is in host
/// memory, fetched in pieces otherwise) is the state [`Engine::snapshot`] copies: the same
/// master weights, moments (bf16 ones widened exactly), counters, ZenFlow state and window, and
/// the device's weights.
fn same_as_lent<P: Float>(
    snapshot: &Snapshot,
    lent: &zeroflow_engine::CheckpointState<'_, P>,
    device_weights: &[P],
) {
    use zeroflow_engine::checkpoint::{Elements, MomentView};
    fn all<T: Clone>(elements: &Elements<'_, T>) -> Vec<T> {
        elements.get(0..elements.len()).unwrap().into_owned()
    }
    // The moments as a checkpoint stores them: f32 bits, or bf16 bits where the run keeps bf16
    // moments (ZenFlow's selected columns are f32 on the device, rounded to bf16 when stored).
    let stored = |moment: &MomentView<'_>| -> Vec<u32> {
        match moment {
            MomentView::F32(values) => all(values).iter().map(|v| v.to_bits()).collect(),
            MomentView::Bf16AsF32(values) => {
                all(values).iter().map(|&v| u32::from(bf16::from_f32(v).to_bits())).collect()
            }
            MomentView::Bf16(values) => {
                all(values).iter().map(|v| u32::from(v.to_bits())).collect()
            }
        }
    };
    let copied = |values: &[f32]| -> Vec<u32> {
        match snapshot.part.moments {
            OptimizerStateDtype::Fp32 => values.iter().map(|v| v.to_bits()).collect(),
            OptimizerStateDtype::Bf16 => {
                values.iter().map(|&v| u32::from(bf16::from_f32(v).to_bits())).collect()
            }
        }
    };
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let part = &snapshot.part;
    assert_eq!(lent.part.flat, part.flat);
    assert_eq!(bits(&all(&lent.part.master)), bits(&part.master), "master");
    assert_eq!(stored(&lent.part.exp_avg), copied(&part.exp_avg), "exp_avg");
    assert_eq!(stored(&lent.part.exp_avg_sq), copied(&part.exp_avg_sq), "exp_avg_sq");
    assert_eq!(lent.moments, part.moments);
    assert_eq!(
        (lent.upload_pending, lent.optimizer_steps, lent.micro_steps),
        (snapshot.upload_pending, snapshot.optimizer_steps, snapshot.micro_steps)
    );
    assert_eq!(&lent.scaler, &snapshot.scaler);
    let zenflow = lent
        .part
        .zenflow
        .as_ref()
        .map(|(meta, window)| ZenFlowSnapshot { window_grads: all(window), ..meta.clone() });
    assert_eq!(zenflow, snapshot.zenflow);
    assert!(all(&lent.weights) == device_weights, "the weights lent differ from the device's");
}
