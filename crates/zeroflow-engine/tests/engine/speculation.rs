//! The exact offload step's speculation (pieces stepped during backward, before the norm is
//! known, then kept or rolled back and redone) gives the step without speculation bit for bit:
//! the final weights on every rank, the master weights and both moments, and every step report,
//! whether clipping fires or not, with overflowing steps skipped, for any backup budget, calm and
//! under chaos; and it counts the steps it had to redo.

use std::time::Duration;

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Float, f16};
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::{CpuDevice, Device};
use zeroflow_engine::synthetic::{forward_backward, forward_backward_opening, initial};
use zeroflow_engine::{
    AccumulateOn, DynamicScaler, Engine, LossScaler, Snapshot, SpeculationStats, Stage, StepReport,
};

use crate::harness::{Bf16, Outcome, Setup, WHOLE_BUDGET, layout, norms, options, train};

/// Room for about 20 elements of backup (12 bytes each, 14–16 on the streaming path): some of a
/// rank's pieces (buckets of up to 23 elements of a partition of 41–122) fit, not all.
const PARTIAL_BUDGET: usize = 300;

/// The budgets checked against speculation off: part of the partition, and all of it.
const BUDGETS: [usize; 2] = [PARTIAL_BUDGET, WHOLE_BUDGET];

/// Trains `setup` with speculation off and with `budget`, and checks that both end alike in
/// every respect: weights (after the final flush and as a checkpoint saw them), each rank's
/// optimizer state, and the step reports. Returns the speculating run.
fn check_bit_identical<P: Float>(
    setup: &Setup,
    budget: usize,
    scaler: &LossScaler,
    poison: Option<(usize, u64)>,
) -> Outcome<P> {
    let off = Setup { speculation_budget: 0, chaos: None, ..setup.clone() };
    let plain = train::<P>(&off, scaler.clone(), poison);
    let speculating = Setup { speculation_budget: budget, ..setup.clone() };
    let out = train::<P>(&speculating, scaler.clone(), poison);
    assert_eq!(out.weights, plain.weights, "{speculating:?}: weights differ");
    assert_eq!(out.device_weights, plain.device_weights, "{speculating:?}: device weights differ");
    for (rank, (got, want)) in out.snapshots.iter().zip(&plain.snapshots).enumerate() {
        assert_eq!(got.part, want.part, "{speculating:?} rank {rank}: master or moments differ");
    }
    assert_eq!(out.reports, plain.reports, "{speculating:?}: step reports differ");
    for traffic in &plain.traffic {
        assert_eq!(traffic.speculation.speculated_elements, 0, "a budget of 0 speculated");
    }
    out
}

/// A clip threshold that fires on some of the steps of `setup` and not on others: the median of
/// its unclipped norms.
fn median_norm(setup: &Setup) -> f64 {
    let unclipped = Setup { clip: None, speculation_budget: 0, ..setup.clone() };
    let mut norms = norms(&train::<f32>(&unclipped, LossScaler::None, None).reports[0]);
    norms.sort_by(f64::total_cmp);
    norms[norms.len() / 2]
}

/// Stages 1 and 2, 1–3 ranks, accumulation 1–4 (the streaming step and the accumulating one),
/// no clip, a clip that never fires and one that fires on about half the steps, partial and
/// whole budgets: all bit-identical to speculation off. Without clipping every step stands
/// (nothing is redone); where the clip fires, redone steps are counted.
#[test]
fn speculation_is_bit_identical_to_the_plain_exact_step() {
    for stage in [Stage::Zero1, Stage::Zero2] {
        for world in [1, 2, 3] {
            for accum in 1..=4 {
                let setup = Setup { steps: 8, ..Setup::new(stage, world, accum, true) };
                let sometimes = median_norm(&setup);
                for clip in [None, Some(1e9), Some(sometimes)] {
                    for budget in BUDGETS {
                        let setup = Setup { clip, ..setup.clone() };
                        let out =
                            check_bit_identical::<f32>(&setup, budget, &LossScaler::None, None);
                        for (rank, traffic) in out.traffic.iter().enumerate() {
                            let stats = traffic.speculation;
                            assert!(
                                stats.speculated_elements > 0,
                                "{setup:?} rank {rank}: {stats:?}"
                            );
                            if clip != Some(sometimes) {
                                assert_eq!(stats.redone_steps, 0, "{setup:?} rank {rank}");
                                assert_eq!(stats.speculated_steps, 8, "{setup:?} rank {rank}");
                            }
                        }
                        if clip == Some(sometimes) {
                            let redone: u64 =
                                out.traffic.iter().map(|t| t.speculation.redone_steps).sum();
                            assert!(redone > 0, "{setup:?}: the clip fired, nothing was redone");
                        }
                    }
                }
            }
        }
    }
}

/// A clip that fires on every step, but only once most of a step's pieces are in (95 % of the
/// smallest unclipped norm): the speculation pauses after each step it redoes, for 1, 2, 4 …
/// steps (`MAX_PAUSE`), so of 12 steps one rank speculates on steps 0, 2, 5 and 10 only
/// (streaming and accumulating paths), where it would otherwise redo all 12; with several ranks
/// each rank pauses after the steps it redid. The run is still the plain exact step's.
#[test]
fn a_clip_that_always_fires_pauses_the_speculation() {
    for (stage, world, accum) in [(Stage::Zero2, 1, 1), (Stage::Zero2, 1, 3), (Stage::Zero1, 2, 1)]
    {
        let setup = Setup { steps: 12, ..Setup::new(stage, world, accum, true) };
        let unclipped = Setup { clip: None, speculation_budget: 0, ..setup.clone() };
        let norms = norms(&train::<f32>(&unclipped, LossScaler::None, None).reports[0]);
        let clip = 0.95 * norms.iter().copied().fold(f64::INFINITY, f64::min);
        let setup = Setup { clip: Some(clip), ..setup };
        let out = check_bit_identical::<f32>(&setup, WHOLE_BUDGET, &LossScaler::None, None);
        assert!(out.reports.iter().flatten().all(|report| match report {
            StepReport::Stepped { clip_coef, .. } => *clip_coef < 1.0,
            _ => false,
        }));
        for (rank, traffic) in out.traffic.iter().enumerate() {
            let stats = traffic.speculation;
            let counts = (stats.speculated_steps, stats.redone_steps, stats.paused_steps);
            if world == 1 {
                assert_eq!(counts, (4, 4, 8), "{setup:?}: {stats:?}");
            }
            assert_eq!(stats.redone_steps, stats.speculated_steps, "{setup:?} rank {rank}");
            assert!(stats.speculated_steps + stats.paused_steps <= 12, "{setup:?} rank {rank}");
        }
        let paused: u64 = out.traffic.iter().map(|t| t.speculation.paused_steps).sum();
        assert!(paused > 0, "{setup:?}: no rank paused");
    }
}

/// bf16 weights: the streaming step reads bf16 gradients and the kernel writes the bf16 copy of
/// the speculated pieces itself.
#[test]
fn speculation_is_bit_identical_in_bf16() {
    for (stage, world, accum) in [(Stage::Zero2, 2, 1), (Stage::Zero1, 3, 1), (Stage::Zero2, 3, 3)]
    {
        let setup = Setup { steps: 8, ..Setup::new(stage, world, accum, true) };
        for clip in [None, Some(median_norm(&setup))] {
            for budget in BUDGETS {
                let setup = Setup { clip, ..setup.clone() };
                check_bit_identical::<Bf16>(&setup, budget, &LossScaler::None, None);
            }
        }
    }
}

/// An overflow on one rank (fp16 with a dynamic loss scale; f32 and bf16 weights, whose step
/// streams at accumulation 1, and from a window summed on the device where one is asked, its
/// step inline or left to the next forward) skips the step on every rank. The overflow falls on
/// the last micro-step of step 2, or on its first (then the window's sum is already infinite
/// when its last backward speculates); the reduction carries it into every rank's partition.
/// Without a clip the pieces are stepped speculatively with infinite gradients and restored at
/// the step (the run continues exactly as without speculation, and the restore is counted); with
/// one, the running norm is infinite at the first piece and nothing is stepped.
#[test]
fn an_overflow_restores_the_speculated_pieces() {
    let scaler = LossScaler::Dynamic(DynamicScaler::new(10, 1000, 1.0, 1, false));
    let summed = |overlap_forward| Setup {
        overlap_forward,
        accumulate_on: AccumulateOn::Device,
        ..Setup::new(Stage::Zero2, 1, 3, true)
    };
    let cases = [
        Setup::new(Stage::Zero2, 2, 1, true),
        Setup::new(Stage::Zero1, 3, 2, true),
        Setup::new(Stage::Zero2, 1, 4, true),
        summed(false),
        summed(true),
    ];
    for case in cases {
        let (world, accum) = (case.world, case.accum);
        for clip in [None, Some(1e9)] {
            let setup = Setup { steps: 5, clip, ..case.clone() };
            let accum = u64::from(accum);
            for k in [2 * accum + accum - 1, 2 * accum] {
                for budget in BUDGETS {
                    let poison = Some((world - 1, k));
                    let out = check_bit_identical::<f16>(&setup, budget, &scaler, poison);
                    let skipped = |reports: &Vec<StepReport>| matches!(reports[2], StepReport::Skipped { loss_scale } if loss_scale == 512.0);
                    assert!(out.reports.iter().all(skipped), "{setup:?}: step 2 not skipped");
                    check_bit_identical::<f32>(&setup, budget, &scaler, poison);
                    let out = check_bit_identical::<Bf16>(&setup, budget, &scaler, poison);
                    for traffic in &out.traffic {
                        let redone = traffic.speculation.redone_steps;
                        match clip {
                            None => assert_eq!(redone, 1, "{setup:?} poisoned at {k}"),
                            Some(_) => assert_eq!(redone, 0, "{setup:?} poisoned at {k}"),
                        }
                    }
                }
            }
        }
    }
}

/// Under chaos (random delays before every device operation) the speculating runs equal the
/// calm run without speculation: the pieces copied out during backward wait for their
/// reductions, and their uploads at the step for the weights to be free.
#[test]
fn speculation_under_chaos_is_bit_identical() {
    for (stage, world, accum) in [(Stage::Zero2, 2, 1), (Stage::Zero1, 3, 1), (Stage::Zero2, 2, 3)]
    {
        let setup = Setup { steps: 8, ..Setup::new(stage, world, accum, true) };
        let clip = Some(median_norm(&setup));
        for seed in 1..=3 {
            for budget in BUDGETS {
                let setup = Setup { clip, chaos: Some(seed), ..setup.clone() };
                check_bit_identical::<f32>(&setup, budget, &LossScaler::None, None);
            }
        }
    }
}

/// The same with a model that opens every weight at once before its forward reads any: the
/// final open alone steps the rest around the pieces that stood, hands the optimizer on and
/// orders every upload before the forward's reads.
#[test]
fn speculation_beside_a_forward_that_opens_at_once_is_bit_identical() {
    let setup = Setup {
        steps: 6,
        overlap_forward: true,
        open_at_once: true,
        clip: None,
        ..Setup::new(Stage::Zero2, 1, 1, true)
    };
    let out = check_bit_identical::<f32>(&setup, WHOLE_BUDGET, &LossScaler::None, None);
    let stats = out.traffic[0].speculation;
    assert!(stats.speculated_elements > 0 && stats.redone_steps == 0, "{stats:?}");
}

/// With the step left to the next forward (`overlap_forward`, one rank), the speculation steps
/// the backward's pieces with the optimizer that forward's opening hands on once it has stepped
/// the rest, and the next opening leaves the pieces that stood alone: bit-identical to the
/// overlapped step without speculation (itself the inline step's, `overlap.rs`), stages 1 and
/// 2, f32 and bf16, with no clip (every step stands), a clip that fires on about half the
/// steps, calm and under chaos; and with the engine's default, stepping no piece once the device
/// is past the backward, the same.
#[test]
fn speculation_beside_the_forward_opening_is_bit_identical() {
    for stage in [Stage::Zero1, Stage::Zero2] {
        let setup = Setup { steps: 8, overlap_forward: true, ..Setup::new(stage, 1, 1, true) };
        check_beside_the_opening(&setup);
    }
}

/// With gradient accumulation summed on the device and the step left to the next window's first
/// forward (`overlap_forward`, one rank), the window's last backward speculates (the first
/// forward's opening is done with the optimizer by then), the step validates it and sends the
/// weights of the pieces that stand up, and the opening steps the rest around them:
/// bit-identical to the same run without speculation (itself the inline step's, `overlap.rs`),
/// accumulation 2–4, as [`speculation_beside_the_forward_opening_is_bit_identical`] checks the
/// streaming path.
#[test]
fn speculation_beside_the_opening_of_a_device_sum_is_bit_identical() {
    for accum in 2..=4 {
        let setup = Setup {
            steps: 6,
            stream_chunk: 7,
            overlap_forward: true,
            accumulate_on: AccumulateOn::Device,
            ..Setup::new(Stage::Zero2, 1, accum, true)
        };
        check_beside_the_opening(&setup);
    }
}

/// The speculating runs of `setup` (one rank, its step left to the next forward) against the
/// same run without speculation: with no clip (every step speculated, none redone), a clip that
/// fires on about half the steps (some redone), calm and under chaos, partial and whole
/// budgets, with the engine's stop at the backward's end and without it; and in bf16 with the
/// clip.
fn check_beside_the_opening(setup: &Setup) {
    let sometimes = median_norm(setup);
    for (clip, chaos) in [(None, None), (Some(sometimes), None), (Some(sometimes), Some(5))] {
        for budget in BUDGETS {
            let setup = Setup { clip, chaos, ..setup.clone() };
            let out = check_bit_identical::<f32>(&setup, budget, &LossScaler::None, None);
            let stats = out.traffic[0].speculation;
            assert!(stats.speculated_elements > 0, "{setup:?}: {stats:?}");
            // The courier's stepping is timed where it steps.
            assert!(stats.stepping > std::time::Duration::ZERO, "{setup:?}: {stats:?}");
            match clip {
                None => {
                    let counts = (stats.speculated_steps, stats.redone_steps);
                    assert_eq!(counts, (u64::from(setup.steps), 0), "{setup:?}: {stats:?}");
                }
                Some(_) => assert!(stats.redone_steps > 0, "{setup:?}: {stats:?}"),
            }
            let stopping = Setup { speculation_stops: true, ..setup.clone() };
            check_bit_identical::<f32>(&stopping, budget, &LossScaler::None, None);
        }
    }
    let bf16 = Setup { clip: Some(sometimes), ..setup.clone() };
    for budget in BUDGETS {
        check_bit_identical::<Bf16>(&bf16, budget, &LossScaler::None, None);
    }
}

/// The step of a window summed on the device is still left to the next forward where it
/// speculates: after `step` the device holds the speculated pieces' new weights (sent up at the
/// step) and the rest's old ones; `complete_step` brings the rest, and the weights are those of
/// the run without speculation.
#[test]
fn a_speculated_step_of_a_device_sum_is_left_to_the_forward() {
    let setup = Setup {
        steps: 1,
        stream_chunk: 7,
        overlap_forward: true,
        clip: None,
        accumulate_on: AccumulateOn::Device,
        speculation_budget: PARTIAL_BUDGET,
        ..Setup::new(Stage::Zero2, 1, 3, true)
    };
    let mut one = OneRank::new(&setup);
    let init = initial::<f32>(&one.layout);
    for k in 0..u64::from(setup.accum) {
        one.backward(k);
        one.engine.step().unwrap();
    }
    let OneRank { device, mut engine, .. } = one;
    let held = device.download(engine.params()).unwrap();
    let stats = engine.speculation_stats().unwrap();
    assert_eq!((stats.speculated_steps, stats.redone_steps), (1, 0), "{stats:?}");
    engine.complete_step().unwrap();
    let stepped = device.download(engine.params()).unwrap();
    let plain =
        train::<f32>(&Setup { speculation_budget: 0, ..setup.clone() }, LossScaler::None, None);
    assert_eq!(stepped, plain.weights[0], "the run without speculation's weights");
    let changed = |a: &[f32], b: &[f32]| a.iter().zip(b).filter(|(a, b)| a != b).count();
    // The speculated pieces' weights are up at the step; the rest waits for the forward.
    assert!(changed(&held, &init) > 0, "nothing speculated was sent up at the step");
    assert!(changed(&held, &stepped) > 0, "nothing was left to the forward");
    assert!(changed(&held, &init) as u64 <= stats.speculated_elements, "{stats:?}");
    let (old_or_new, n) = (held.iter().zip(&init).zip(&stepped), held.len());
    assert_eq!(old_or_new.filter(|((h, i), s)| h == i || h == s).count(), n, "neither old nor new");
}

/// With a device share, the speculation steps the host's elements only, the share's being
/// stepped on the device: bit-identical to the run with neither, ZeRO-1 and 2 on one rank and
/// ZeRO-2 on two with one micro-step per step, and ZeRO-2 on one rank with a window of three
/// summed on the device; the step before the next forward and (one rank) overlapped with it, no
/// clip and a clip that fires on about half the steps, calm and under chaos. (A piece of the
/// share's stepped on the host would reach past the host's state and panic.)
#[test]
fn speculation_beside_a_device_share_is_bit_identical() {
    for (stage, world, accum, accumulate_on) in [
        (Stage::Zero1, 1, 1, AccumulateOn::Auto),
        (Stage::Zero2, 1, 1, AccumulateOn::Auto),
        (Stage::Zero2, 2, 1, AccumulateOn::Auto),
        (Stage::Zero2, 1, 3, AccumulateOn::Device),
    ] {
        let setup = Setup {
            steps: 8,
            stream_chunk: 7,
            accumulate_on,
            ..Setup::new(stage, world, accum, true)
        };
        let sometimes = median_norm(&setup);
        for clip in [None, Some(sometimes)] {
            let neither = Setup { clip, ..setup.clone() };
            let want = train::<f32>(&neither, LossScaler::None, None);
            for (overlap_forward, chaos) in [(false, None), (true, None), (true, Some(4))] {
                let case = Setup {
                    overlap_forward,
                    chaos,
                    device_share: 0.4,
                    speculation_budget: WHOLE_BUDGET,
                    ..neither.clone()
                };
                let out = train::<f32>(&case, LossScaler::None, None);
                assert_eq!(out.weights, want.weights, "{case:?}: weights");
                assert_eq!(out.device_weights, want.device_weights, "{case:?}: saved weights");
                assert_eq!(out.snapshots, want.snapshots, "{case:?}: optimizer state");
                assert_eq!(out.reports, want.reports, "{case:?}: step reports");
                for traffic in &out.traffic {
                    let stats = traffic.speculation;
                    assert!(stats.speculated_elements > 0, "{case:?}: {stats:?}");
                }
            }
        }
    }
}

/// One rank trained for 6 steps with `budget`, whose learning rate changes between each
/// backward and its step after the first two, and which is snapshotted between the backward and
/// the step of step 4: its final weights, optimizer state and speculation counters. With
/// `overlap`, each step is left to the next forward (a window summed on the device).
fn train_with_schedule(
    accum: u64,
    budget: usize,
    overlap: bool,
) -> (Vec<f32>, Snapshot, SpeculationStats) {
    let accumulate_on = if overlap { AccumulateOn::Device } else { AccumulateOn::Auto };
    let setup = Setup {
        speculation_budget: budget,
        clip: None,
        overlap_forward: overlap,
        accumulate_on,
        ..Setup::new(Stage::Zero2, 1, accum.try_into().unwrap(), true)
    };
    let mut one = OneRank::new(&setup);
    for k in 0..6 * accum {
        one.backward(k);
        let engine = &mut one.engine;
        let step = k / accum;
        if engine.is_gradient_accumulation_boundary() {
            if step >= 2 {
                engine.set_lr(1e-2 / (step as f64)).unwrap();
            }
            if step == 4 {
                engine.snapshot().unwrap();
            }
        }
        engine.step().unwrap();
    }
    let OneRank { device, mut engine, .. } = one;
    let snapshot = engine.snapshot().unwrap();
    let stats = engine.speculation_stats().unwrap_or_default();
    (device.download(engine.params()).unwrap(), snapshot, stats)
}

/// One rank's f32 engine of `setup` on a CPU device, stepping every piece its budget holds
/// (`Engine::speculate_late`), driven micro-step by micro-step by the tests that look between a
/// backward and its step.
struct OneRank {
    device: CpuDevice,
    layout: FlatLayout,
    engine: Engine<CpuDevice, CpuComm, f32>,
    /// The model opens the weights as it reads them (`setup.overlap_forward`).
    opening: bool,
}

impl OneRank {
    fn new(setup: &Setup) -> Self {
        let (device, layout) = (CpuDevice::new().unwrap(), layout(1));
        let comm = CpuComm::group(std::slice::from_ref(&device), Duration::from_secs(30)).remove(0);
        let options = options(setup, LossScaler::None);
        let init = initial::<f32>(&layout);
        let mut engine = Engine::new(device.clone(), comm, layout.clone(), options, &init).unwrap();
        engine.speculate_late();
        OneRank { device, layout, engine, opening: setup.overlap_forward }
    }

    /// Micro-step `k`'s backward.
    fn backward(&mut self, k: u64) {
        let OneRank { device, layout, engine, opening } = self;
        engine
            .backward(|io, ready| match opening {
                true => forward_backward_opening(device, layout, io, ready, 0, k),
                false => forward_backward(device, layout, io, ready, 0, k),
            })
            .unwrap();
    }
}

/// A learning rate set between a backward and its step changes the step the speculation assumed:
/// the speculated pieces are redone with it; a snapshot taken there restores them first (and the
/// step then runs in full). Either way the run equals the one without speculation bit for bit:
/// one micro-step per step and a window of three, the step inline and left to the next forward.
#[test]
fn a_learning_rate_changed_after_backward_redoes_the_speculated_step() {
    for (accum, overlap) in [(1, false), (3, false), (1, true), (3, true)] {
        let what = format!("accumulation {accum}, overlapped {overlap}");
        let (plain_weights, plain, _) = train_with_schedule(accum, 0, overlap);
        let (weights, speculated, stats) = train_with_schedule(accum, WHOLE_BUDGET, overlap);
        assert_eq!(weights, plain_weights, "{what}: weights differ");
        assert_eq!(speculated.part, plain.part, "{what}: optimizer state differs");
        // Steps 2, 3 and 5 are redone for their learning rate; step 4 is restored by the
        // snapshot; steps 0 and 1 stand.
        assert_eq!(stats.redone_steps, 4, "{what}: {stats:?}");
        assert_eq!(stats.speculated_steps, 6, "{what}: {stats:?}");
    }
}
