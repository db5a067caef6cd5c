//! The ZeRO engine on real GPUs: the synthetic model (whose CUDA backward computes the CPU's
//! gradients bit for bit) trained through `CudaDevice` and NCCL reproduces plain single-rank AdamW,
//! for every stage, with and without CPU offload, with accumulation, in f32 and bf16, on one GPU and
//! (where the machine has them) on every visible GPU.
//!
//! Every test first opens GPU 0; where there is none it prints `skipped: no CUDA device (…)` and
//! passes (`ZEROFLOW_REQUIRE_GPU=1` makes that a failure). Run with `--test-threads=1 --nocapture`.

use zeroflow_core::config::{Selection, UpdateInterval};
use zeroflow_core::{Float, bf16};
use zeroflow_device::cuda::nccl::NcclComm;
use zeroflow_device::{CudaDevice, Device, HostMemory};
use zeroflow_engine::synthetic::{
    Reference, adamw_config, forward_backward, forward_backward_opening, initial, layout,
    max_rel_diff,
};
use zeroflow_engine::{
    AccumulateOn, DEFAULT_STREAM_CHUNK, DEFAULT_ZENFLOW_ASIDE, Engine, EngineOptions, LossScaler,
    Offload, OffloadUpdate, Placement, ShareState, Stage, StepReport, ZenFlowAside, ZenFlowOptions,
};

/// GPU 0's device, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    zeroflow_device::cuda::info::gpu_or_skip(0)
}

/// Every visible GPU, opened; `None` (saying why, `what` being skipped) without a GPU or with
/// only one.
fn every_gpu(what: &str) -> Option<Vec<CudaDevice>> {
    let first = gpu()?;
    let count = zeroflow_device::cuda::info::list_gpus().map_or(1, |gpus| gpus.len());
    if count < 2 {
        println!("skipped: one GPU visible, {what} needs two or more");
        return None;
    }
    let mut devices = vec![first];
    devices.extend((1..count).map(|i| CudaDevice::new(i).expect("every visible GPU opens")));
    Some(devices)
}

/// A speculation budget that covers the whole partition (4 GiB; the default is none).
const WHOLE_BUDGET: usize = 4 << 30;

/// ZenFlow with windows of `update` steps (`UpdateInterval::Every`), `topk_ratio` of the columns
/// on the device, the columns chosen anew every `interval` steps, the CPU step overlapped or not.
fn zenflow(topk_ratio: f64, interval: u64, update: u64, overlap_step: bool) -> ZenFlowOptions {
    ZenFlowOptions {
        topk_ratio,
        selection: Selection::Step { interval },
        update_interval: UpdateInterval::Every(update),
        auto_ratio: 0.99,
        overlap_step,
        full_warm_up_rounds: 0,
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    stage: Stage,
    world: usize,
    accum: u64,
    offload: bool,
    steps: u64,
    /// The delayed update after this many exact steps.
    delayed: Option<u64>,
    /// ZenFlow, with offload.
    zenflow: Option<ZenFlowOptions>,
    /// Offload: the exact step's speculation budget (bytes, 0 off) and where ZeRO-2 sums a window.
    speculation_budget: usize,
    accumulate_on: AccumulateOn,
    /// Offload: the stream's chunk (elements), and where ZenFlow's overlapped step reads its
    /// window from.
    stream_chunk: usize,
    zenflow_aside: ZenFlowAside,
    clip: Option<f64>,
    /// Offload: the share of the partition stepped on the device (0: none), and where it keeps
    /// its state.
    device_share: f64,
    share_state: ShareState,
    /// Offload, one rank: the step left to the next forward, which opens the weights as it reads
    /// them (`forward_backward_opening`).
    overlap_forward: bool,
}

impl Case {
    /// Offload's defaults, clipping at 0.8.
    fn new(stage: Stage, world: usize, accum: u64, offload: bool, steps: u64) -> Self {
        Case {
            stage,
            world,
            accum,
            offload,
            steps,
            delayed: None,
            zenflow: None,
            speculation_budget: WHOLE_BUDGET,
            accumulate_on: AccumulateOn::Auto,
            stream_chunk: DEFAULT_STREAM_CHUNK,
            zenflow_aside: DEFAULT_ZENFLOW_ASIDE,
            clip: Some(0.8),
            device_share: 0.0,
            share_state: ShareState::Device,
            overlap_forward: false,
        }
    }
}

fn options(case: &Case) -> EngineOptions {
    let update = match (case.zenflow, case.delayed) {
        (Some(zenflow), _) => OffloadUpdate::ZenFlow(zenflow),
        (None, Some(warmup)) => OffloadUpdate::Delayed { warmup },
        (None, None) => OffloadUpdate::Exact,
    };
    let placement = match case.offload {
        true => {
            let mut offload = Offload { update, ..Offload::exact(HostMemory::Pinned, 2) };
            offload.stream.speculation_budget = case.speculation_budget;
            offload.stream.accumulate_on = case.accumulate_on;
            offload.stream.chunk = case.stream_chunk;
            offload.stream.zenflow_aside = case.zenflow_aside;
            offload.stream.device_share = case.device_share;
            offload.stream.device_share_state = case.share_state;
            offload.stream.overlap_forward = case.overlap_forward;
            Placement::Offload(offload)
        }
        false => Placement::Device,
    };
    EngineOptions {
        stage: case.stage,
        grad_accum: case.accum,
        clip: case.clip,
        reduce_bucket: 23,
        adamw: adamw_config(),
        scaler: LossScaler::None,
        placement,
    }
}

/// Trains `case` on GPUs `0..case.world` (one thread per rank); every rank's final weights and
/// gradient norms.
fn train<P: Float>(devices: &[CudaDevice], case: &Case) -> Vec<(Vec<f32>, Vec<f64>)> {
    let comms = NcclComm::group(devices).expect("an NCCL group over the GPUs");
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .cloned()
            .zip(comms)
            .enumerate()
            .map(|(rank, (device, comm))| {
                s.spawn(move || {
                    let layout = layout(case.world);
                    let init = initial::<P>(&layout);
                    let mut engine: Engine<CudaDevice, NcclComm, P> =
                        Engine::new(device.clone(), comm, layout.clone(), options(case), &init)
                            .unwrap();
                    let mut norms = Vec::new();
                    for k in 0..case.steps * case.accum {
                        engine
                            .backward(|io, ready| match case.overlap_forward {
                                true => {
                                    forward_backward_opening(&device, &layout, io, ready, rank, k)
                                }
                                false => forward_backward(&device, &layout, io, ready, rank, k),
                            })
                            .unwrap_or_else(|e| panic!("{case:?} rank {rank} micro-step {k}: {e}"));
                        match engine.step().unwrap() {
                            StepReport::Stepped { grad_norm, .. } => norms.push(grad_norm),
                            StepReport::Accumulated => {}
                            other => panic!("{case:?} rank {rank}: unexpected {other:?}"),
                        }
                    }
                    engine.flush().unwrap();
                    let weights = device.download(engine.params()).unwrap();
                    (weights.iter().map(|w| w.to_f32()).collect(), norms)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Plain single-rank AdamW's final weights and gradient norms for `case` (with the delayed update,
/// window t > warm-up computes with the weights before the last step).
fn reference<P: Float>(case: &Case) -> (Vec<f32>, Vec<f64>) {
    let mut reference = Reference::new::<P>(case.world, case.accum, Some(0.8), adamw_config());
    let mut previous = reference.master.clone();
    let mut norms = Vec::new();
    for t in 0..case.steps {
        let stale = case.delayed.is_some_and(|warm_up| t > warm_up);
        let current = reference.master.clone();
        norms.push(reference.step_at::<P>(if stale { &previous } else { &current }));
        previous = current;
    }
    (reference.master, norms)
}

/// Checks every rank of `case` against the reference; returns the worst weight difference.
fn check<P: Float>(devices: &[CudaDevice], case: Case, weight_tol: f64, norm_tol: f64) -> f64 {
    let ranks = train::<P>(devices, &case);
    let (want, want_norms) = reference::<P>(&case);
    let single = layout(1);
    let mut worst = 0f64;
    for (rank, (weights, norms)) in ranks.iter().enumerate() {
        let diff = max_rel_diff(&single, &weights[..want.len()], &want);
        assert!(diff <= weight_tol, "{case:?} rank {rank}: max relative difference {diff:e}");
        assert_eq!(norms.len() as u64, case.steps, "{case:?} rank {rank}: steps");
        for (step, (got, want)) in norms.iter().zip(&want_norms).enumerate() {
            let rel = (got - want).abs() / want;
            assert!(rel <= norm_tol, "{case:?} rank {rank} step {step}: norm {got} vs {want}");
        }
        worst = worst.max(diff);
    }
    assert!(ranks.windows(2).all(|w| w[0].0 == w[1].0), "{case:?}: ranks disagree");
    worst
}

fn cases(world: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for accum in [1, 3] {
            for offload in [false, true] {
                cases.push(Case::new(stage, world, accum, offload, 12));
            }
        }
    }
    cases
}

/// Every stage × accumulation 1 and 3 × offload off and on, one GPU, f32: the final weights equal
/// plain AdamW within 1e-5 relative (the GPU's AdamW rounds its square root and division on its own
/// hardware; the CPU tests' bound is 1e-6) and every gradient norm within 1e-5.
#[test]
fn one_gpu_matches_plain_adamw_in_f32() {
    let Some(device) = gpu() else { return };
    for case in cases(1) {
        let worst = check::<f32>(std::slice::from_ref(&device), case, 1e-5, 1e-5);
        println!("RESULT engine_gpu f32 {case:?} max_rel={worst:.2e}");
    }
}

/// The same matrix in bf16: within bf16 bounds (2e-2).
#[test]
fn one_gpu_matches_plain_adamw_in_bf16() {
    let Some(device) = gpu() else { return };
    for case in cases(1) {
        let worst = check::<bf16>(std::slice::from_ref(&device), case, 2e-2, 2e-2);
        println!("RESULT engine_gpu bf16 {case:?} max_rel={worst:.2e}");
    }
}

/// The delayed update (streaming with one micro-step per step, through the accumulator with
/// more): plain AdamW with one-step-stale gradients after the warm-up, in f32 and bf16.
#[test]
fn one_gpu_delayed_update_matches_stale_adamw() {
    let Some(device) = gpu() else { return };
    for (stage, accum) in [(Stage::Zero2, 1), (Stage::Zero1, 2), (Stage::Zero0, 1)] {
        let case = Case { delayed: Some(3), ..Case::new(stage, 1, accum, true, 12) };
        let worst = check::<f32>(std::slice::from_ref(&device), case, 1e-5, 1e-5);
        println!("RESULT engine_gpu delayed f32 {case:?} max_rel={worst:.2e}");
        let worst = check::<bf16>(std::slice::from_ref(&device), case, 2e-2, 2e-2);
        println!("RESULT engine_gpu delayed bf16 {case:?} max_rel={worst:.2e}");
    }
}

/// ZenFlow on the GPU: `topk_ratio` 1 (every column on the device) gives the engine without offload
/// bit for bit, and `topk_ratio` 0 with a window of one step gives plain offload bit for bit, with
/// and without the overlapped CPU step where that applies; a mixed run (a quarter of the columns,
/// windows of 2, overlapped) is deterministic and agrees across stages 1 and 2.
#[test]
fn one_gpu_zenflow_matches_its_limits() {
    let Some(device) = gpu() else { return };
    let devices = std::slice::from_ref(&device);
    let base = Case::new(Stage::Zero2, 1, 1, true, 12);
    for overlap in [false, true] {
        let all = Case { zenflow: Some(zenflow(1.0, 4, 2, overlap)), ..base };
        let got = train::<f32>(devices, &all);
        let want = train::<f32>(devices, &Case { offload: false, ..base });
        let diff = same_run(&got, &want, "topk 1 vs the device optimizer");
        println!("RESULT engine_gpu zenflow topk=1 overlap={overlap} vs_device_adamw={diff:.2e}");
    }
    let none = Case { zenflow: Some(zenflow(0.0, 4, 1, false)), ..base };
    let diff = same_run(&train::<f32>(devices, &none), &train::<f32>(devices, &base), "topk 0");
    println!("RESULT engine_gpu zenflow topk=0 update=1 vs_offload={diff:.2e}");
    let mixed = Case { zenflow: Some(zenflow(0.25, 4, 2, true)), ..base };
    let (a, b) = (train::<f32>(devices, &mixed), train::<f32>(devices, &mixed));
    assert_eq!(a, b, "a mixed ZenFlow run is deterministic");
    let z1 = train::<f32>(devices, &Case { stage: Stage::Zero1, ..mixed });
    let diff = max_rel_diff(&layout(1), &a[0].0, &z1[0].0);
    assert!(diff <= 1e-5, "stage 1 vs stage 2: {diff:e}");
    println!(
        "RESULT engine_gpu zenflow topk=0.25 update=2 overlap deterministic=true zero1_vs_zero2={diff:.2e}"
    );
    // Zen-auto: with auto_ratio 0 every step ends a window (= update_interval 1); with 0.99 the
    // windows follow the column masses, the same ones run after run.
    let auto = |auto_ratio| Case {
        zenflow: Some(ZenFlowOptions {
            update_interval: UpdateInterval::Auto,
            auto_ratio,
            ..zenflow(0.25, 4, 1, true)
        }),
        ..base
    };
    let every = Case { zenflow: Some(zenflow(0.25, 4, 1, true)), ..base };
    let diff =
        same_run(&train::<f32>(devices, &auto(0.0)), &train::<f32>(devices, &every), "auto 0");
    let (a, b) = (train::<f32>(devices, &auto(0.99)), train::<f32>(devices, &auto(0.99)));
    assert_eq!(a, b, "a Zen-auto run is deterministic");
    println!(
        "RESULT engine_gpu zenflow auto_ratio=0 vs_update_1={diff:.2e} auto_ratio=0.99 deterministic=true"
    );
}

/// ZenFlow's CPU step streams the device window through the host in chunks: on the GPU, chunks
/// of 7 elements (many copies in flight on the d2h and h2d streams, from the worker with
/// `overlap_step`) give the one-chunk run bit for bit, inline and overlapped, and so does the
/// overlapped step reading its window from host memory (`ZenFlowAside::Host`).
#[test]
fn one_gpu_zenflow_streams_its_window_bit_identically() {
    let Some(device) = gpu() else { return };
    let devices = std::slice::from_ref(&device);
    for (update, overlap_step) in [(2, false), (2, true), (3, true)] {
        let base = Case {
            zenflow: Some(zenflow(0.25, 6, update, overlap_step)),
            zenflow_aside: ZenFlowAside::Device,
            ..Case::new(Stage::Zero2, 1, 1, true, 12)
        };
        let want = train::<f32>(devices, &base);
        for (stream_chunk, zenflow_aside) in [(7, ZenFlowAside::Device), (7, ZenFlowAside::Host)] {
            let got = train::<f32>(devices, &Case { stream_chunk, zenflow_aside, ..base });
            assert_eq!(got, want, "update {update} overlap {overlap_step} {zenflow_aside:?}");
        }
        println!(
            "RESULT engine_gpu zenflow streamed chunk=7 update={update} overlap={overlap_step} bit_identical=true"
        );
    }
}

/// The largest relative weight difference of two runs of one rank, after checking that their
/// weights agree within 1e-6 and their gradient norms within 1e-9 (0 when bit-identical, as on the
/// CPU device; the GPU may sum a norm in another order on another path).
fn same_run(got: &[(Vec<f32>, Vec<f64>)], want: &[(Vec<f32>, Vec<f64>)], what: &str) -> f64 {
    let diff = max_rel_diff(&layout(1), &got[0].0, &want[0].0);
    assert!(diff <= 1e-6, "{what}: weights differ by {diff:e}");
    for (step, (a, b)) in got[0].1.iter().zip(&want[0].1).enumerate() {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "{what}: step {step} norm {a} vs {b}");
    }
    assert_eq!(got[0].1.len(), want[0].1.len(), "{what}: steps");
    diff
}

/// Every visible GPU as one data-parallel job (skipped with fewer than two).
#[test]
fn every_gpu_matches_plain_adamw() {
    let Some(devices) = every_gpu("the multi-GPU matrix") else { return };
    let count = devices.len();
    for case in cases(count) {
        let worst = check::<f32>(&devices, case, 1e-5, 1e-5);
        println!("RESULT engine_gpu world {count} f32 {case:?} max_rel={worst:.2e}");
    }
}

/// The exact offload step's speculation and ZeRO-2's window summed on the device, on `devices`:
/// for stages 1 and 2, accumulation 1 and 3, no clip, a clip that never fires and one that fires
/// on some steps, every budget (none, part of the partition, all of it) gives the plain run (no
/// speculation) of the same accumulator bit for bit on every rank. The device's sum against the
/// host's (ZeRO-2, accumulation 3: the window streams from the device, its norm taken there, in
/// another order than the host's): norms within 1e-6 (relative), weights bit for bit where the clip
/// does not fire, within 1e-5 (relative) where it does.
fn check_speculation_and_device_sum(devices: &[CudaDevice]) {
    let world = devices.len();
    for stage in [Stage::Zero1, Stage::Zero2] {
        for accum in [1, 3] {
            // The median of the unclipped norms: a clip that fires on about half the steps.
            let unclipped = Case { clip: None, ..Case::new(stage, world, accum, true, 8) };
            let mut norms = train::<f32>(devices, &unclipped)[0].1.clone();
            norms.sort_by(f64::total_cmp);
            let median = norms[norms.len() / 2];
            for clip in [None, Some(1e9), Some(median)] {
                let mut plain_runs = Vec::new();
                for on in [AccumulateOn::Host, AccumulateOn::Device] {
                    let plain = Case {
                        speculation_budget: 0,
                        accumulate_on: on,
                        clip,
                        ..Case::new(stage, world, accum, true, 8)
                    };
                    let want = train::<f32>(devices, &plain);
                    for budget in [300, WHOLE_BUDGET] {
                        let case = Case { speculation_budget: budget, ..plain };
                        assert_eq!(train::<f32>(devices, &case), want, "{case:?}");
                        println!(
                            "RESULT engine_gpu speculation world {world} {case:?} bit_identical=true"
                        );
                    }
                    plain_runs.push(want);
                }
                let (host, device) = (&plain_runs[0], &plain_runs[1]);
                let fires = clip == Some(median);
                let (mut norm_rel, mut weight_rel) = (0f64, 0f64);
                for ((dw, dn), (hw, hn)) in device.iter().zip(host) {
                    for (d, h) in dn.iter().zip(hn) {
                        norm_rel = norm_rel.max((d - h).abs() / h.abs());
                    }
                    for (d, h) in dw.iter().zip(hw) {
                        let (d, h) = (f64::from(*d), f64::from(*h));
                        weight_rel = weight_rel.max((d - h).abs() / h.abs().max(1e-3));
                    }
                }
                let what = format!("{stage:?} accumulation {accum} clip {clip:?}");
                assert!(norm_rel <= 1e-6, "{what}: device-sum norms differ by {norm_rel:e}");
                if fires {
                    assert!(
                        weight_rel <= 1e-5,
                        "{what}: device-sum weights differ by {weight_rel:e}"
                    );
                } else {
                    assert_eq!(weight_rel, 0.0, "{what}: device-sum weights differ");
                }
                println!(
                    "RESULT engine_gpu device_sum world {world} {what} \
                     norm_rel={norm_rel:.1e} weight_rel={weight_rel:.1e}"
                );
            }
        }
    }
}

/// [`check_speculation_and_device_sum`] on one GPU.
#[test]
fn one_gpu_speculation_and_device_sum_are_bit_identical() {
    let Some(device) = gpu() else { return };
    check_speculation_and_device_sum(std::slice::from_ref(&device));
}

/// [`check_speculation_and_device_sum`] on every visible GPU (skipped with fewer than two).
#[test]
fn every_gpu_speculation_and_device_sum_are_bit_identical() {
    let Some(devices) = every_gpu("the multi-GPU check") else { return };
    check_speculation_and_device_sum(&devices);
}

/// The optimizer's device share on `devices`: the partition's end stepped by the GPU's AdamW
/// while the CPU's AVX kernels step the rest gives the all-CPU step's weights and norms bit for
/// bit on every rank — both do the same operations, fused multiply-adds included, with a
/// correctly rounded square root and division — for stages 1 and 2 with one micro-step (with
/// several GPUs each rank shares its own partition, gathered to the others), ZeRO-2 with three
/// summed on the device (one GPU: the sum needs one rank holding every weight), clipping that
/// fires and none, f32 and bf16, with the step before the next forward.
fn check_device_share(devices: &[CudaDevice]) {
    let world = devices.len();
    let mut runs = vec![(Stage::Zero1, 1), (Stage::Zero2, 1)];
    if world == 1 {
        runs.push((Stage::Zero2, 3));
    }
    for (stage, accum) in runs {
        for clip in [None, Some(0.8)] {
            let all_cpu = Case {
                speculation_budget: 0,
                accumulate_on: AccumulateOn::Device,
                stream_chunk: 1000,
                clip,
                ..Case::new(stage, world, accum, true, 6)
            };
            let shares = [0.3, 0.75].map(|share| (share, ShareState::Device));
            for (device_share, share_state) in shares.into_iter().chain([(0.5, ShareState::Host)]) {
                let case = Case { device_share, share_state, ..all_cpu };
                let f32s = (train::<f32>(devices, &all_cpu), train::<f32>(devices, &case));
                let bf16s = (train::<bf16>(devices, &all_cpu), train::<bf16>(devices, &case));
                for (dtype, (want, got)) in [("f32", f32s), ("bf16", bf16s)] {
                    for (rank, (want, got)) in want.iter().zip(&got).enumerate() {
                        let differ = want.0.iter().zip(&got.0).filter(|(w, g)| w != g).count();
                        assert_eq!(
                            differ, 0,
                            "{dtype} {case:?} rank {rank}: {differ} weights differ"
                        );
                        assert_eq!(want.1, got.1, "{dtype} {case:?} rank {rank}: gradient norms");
                    }
                    assert_eq!(want.len(), world, "{dtype} {case:?}: every rank's result");
                    println!(
                        "RESULT engine_gpu device_share world {world} {dtype} {case:?} \
                         bit_identical=true"
                    );
                }
            }
        }
    }
}

/// [`check_device_share`] on one GPU.
#[test]
fn one_gpu_device_share_is_bit_identical() {
    let Some(device) = gpu() else { return };
    check_device_share(std::slice::from_ref(&device));
}

/// [`check_device_share`] on every visible GPU (skipped with fewer than two).
#[test]
fn every_gpu_device_share_is_bit_identical() {
    let Some(devices) = every_gpu("the multi-GPU check") else { return };
    check_device_share(&devices);
}

/// The exact step left to the next forward (`overlap_forward`, one rank) on a GPU: the forward
/// opens each parameter's weights and copies them on the compute stream before the backward reads
/// the copy (`forward_backward_opening`), so a copy queued before its piece's upload would
/// read the last step's weights and the run would differ. Streamed in chunks of 7 elements (many
/// pieces, each with its own upload and event), for ZeRO-1 and ZeRO-2 with one micro-step and
/// ZeRO-2 with a window of three summed on the device, no clip and a clip that fires on every
/// step, the speculation off and covering the partition, with a device share and without, and
/// ZenFlow's window set aside in host memory: the same run with the step before the next forward,
/// bit for bit, in f32 and bf16.
#[test]
fn one_gpu_overlapped_forward_is_bit_identical() {
    let Some(device) = gpu() else { return };
    let devices = std::slice::from_ref(&device);
    let mut bases = Vec::new();
    for (stage, accum) in [(Stage::Zero1, 1), (Stage::Zero2, 1), (Stage::Zero2, 3)] {
        for clip in [None, Some(0.8)] {
            for speculation_budget in [0, WHOLE_BUDGET] {
                for device_share in [0.0, 0.4] {
                    bases.push(Case {
                        speculation_budget,
                        accumulate_on: AccumulateOn::Device,
                        stream_chunk: 7,
                        clip,
                        device_share,
                        ..Case::new(stage, 1, accum, true, 6)
                    });
                }
            }
        }
    }
    bases.push(Case {
        zenflow: Some(zenflow(0.25, 6, 2, true)),
        zenflow_aside: ZenFlowAside::Host,
        stream_chunk: 7,
        ..Case::new(Stage::Zero2, 1, 1, true, 12)
    });
    for base in bases {
        let overlapped = Case { overlap_forward: true, ..base };
        let want = train::<f32>(devices, &base);
        assert_eq!(train::<f32>(devices, &overlapped), want, "f32 {overlapped:?}");
        let want = train::<bf16>(devices, &base);
        assert_eq!(train::<bf16>(devices, &overlapped), want, "bf16 {overlapped:?}");
        println!("RESULT engine_gpu overlap_forward {overlapped:?} bit_identical=true");
    }
}
