//! ZeRO-2 with offload and gradient accumulation summing a window on the device (one copy to the
//! host per window) against the host's sum (every micro-step copied out and added there). The
//! sums are the same f32 additions, element by element, in micro-step order. With the exact
//! update the device's window streams through the CPU step from the device, and its norm is
//! taken there (the `Summed` path): the norm is summed in another order than the host's, so the
//! reports' norms agree to rounding, and the weights and optimizer state are identical bit for bit
//! wherever the clip does not fire (the step's scalars are then the same), within rounding where
//! it does. The delayed update copies the device's sum to the host accumulator: identical
//! everywhere. Each path is identical to itself with and without speculation and under chaos,
//! in f32, bf16 and f16 (with an overflow skipping a step).

use zeroflow_core::{Float, f16};
use zeroflow_engine::{AccumulateOn, DynamicScaler, LossScaler, Stage, StepReport};

use crate::harness::{Bf16, Outcome, Setup, WHOLE_BUDGET, max_rel_diff, to_f32, train};

/// Bytes copied device → host by every rank, summed.
fn d2h_bytes<P>(out: &Outcome<P>) -> u64 {
    out.traffic.iter().map(|t| t.copied.device_to_host).sum()
}

/// True if a step of `out` clipped its gradients.
fn clipped<P>(out: &Outcome<P>) -> bool {
    out.reports
        .iter()
        .flatten()
        .any(|r| matches!(r, StepReport::Stepped { clip_coef, .. } if *clip_coef != 1.0))
}

/// Asserts that `got` and `want` are the same run bit for bit: weights, optimizer state, reports.
fn assert_identical<P: Float>(got: &Outcome<P>, want: &Outcome<P>, what: &str) {
    assert_eq!(got.weights, want.weights, "{what}: weights differ");
    for (rank, (got, want)) in got.snapshots.iter().zip(&want.snapshots).enumerate() {
        assert_eq!(got.part, want.part, "{what} rank {rank}: optimizer state differs");
    }
    assert_eq!(got.reports, want.reports, "{what}: step reports differ");
}

/// Asserts that the summed path's run `device` is the host sum's run `host`: the same steps taken
/// or skipped with the same loss scales, norms within `1e-6` (relative), and, where no step
/// clipped, the same weights and state bit for bit; where one did, weights within `1e-5`.
fn assert_same_as_host<P: Float>(device: &Outcome<P>, host: &Outcome<P>, setup: &Setup) {
    for (got, want) in device.reports.iter().flatten().zip(host.reports.iter().flatten()) {
        match (got, want) {
            (
                StepReport::Stepped { grad_norm: g, clip_coef: gc, loss_scale: gs },
                StepReport::Stepped { grad_norm: w, clip_coef: wc, loss_scale: ws },
            ) => {
                assert!((g - w).abs() <= 1e-6 * w.abs(), "{setup:?}: norm {g} against {w}");
                assert!((gc - wc).abs() <= 1e-6 * wc, "{setup:?}: clip {gc} against {wc}");
                assert_eq!(gs, ws, "{setup:?}: loss scales differ");
            }
            (got, want) => assert_eq!(got, want, "{setup:?}: step reports differ"),
        }
    }
    assert_eq!(device.reports.iter().flatten().count(), host.reports.iter().flatten().count());
    if !clipped(host) {
        assert_eq!(device.weights, host.weights, "{setup:?}: weights differ");
        for (rank, (got, want)) in device.snapshots.iter().zip(&host.snapshots).enumerate() {
            assert_eq!(got.part, want.part, "{setup:?} rank {rank}: optimizer state differs");
        }
        return;
    }
    let layout = zeroflow_engine::synthetic::layout(setup.world);
    for (got, want) in device.weights.iter().zip(&host.weights) {
        let worst = max_rel_diff(&layout, &to_f32(got), &to_f32(want));
        assert!(worst <= 1e-5, "{setup:?}: weights differ by {worst:e} (relative)");
    }
}

/// Trains `setup` summing on the host (calm, no speculation) and on the device (as `setup`
/// says), and also on the device calm without speculation; checks the device runs against each
/// other (identical) and against the host's; returns the host's and the device's.
fn check_device_sum<P: Float>(
    setup: &Setup,
    scaler: &LossScaler,
    poison: Option<(usize, u64)>,
) -> (Outcome<P>, Outcome<P>) {
    let plain = Setup { chaos: None, speculation_budget: 0, ..setup.clone() };
    let on_host = train::<P>(
        &Setup { accumulate_on: AccumulateOn::Host, ..plain.clone() },
        scaler.clone(),
        poison,
    );
    let device = Setup { accumulate_on: AccumulateOn::Device, ..setup.clone() };
    let on_device = train::<P>(&device, scaler.clone(), poison);
    let plain_device = Setup { accumulate_on: AccumulateOn::Device, ..plain };
    if setup.chaos.is_some() || setup.speculation_budget > 0 {
        let want = train::<P>(&plain_device, scaler.clone(), poison);
        assert_identical(&on_device, &want, &format!("{device:?} against {plain_device:?}"));
    }
    // The exact update with f32 or bf16 weights streams the device's sum (no host accumulator);
    // the delayed update and f16 weights copy it into the host accumulator.
    let streams = setup.delayed.is_none() && P::DTYPE != zeroflow_core::DType::F16;
    let kept = on_device.traffic.iter().map(|t| t.host_accumulator).collect::<Vec<_>>();
    assert!(kept.iter().all(|&kept| kept != streams), "{device:?}: host accumulators {kept:?}");
    assert!(on_host.traffic.iter().all(|t| t.host_accumulator), "{setup:?}: the host sum");
    if !streams {
        assert_identical(&on_device, &on_host, &format!("{device:?} against the host sum"));
    } else {
        assert_same_as_host(&on_device, &on_host, &device);
    }
    (on_host, on_device)
}

/// 1–3 ranks, accumulation 2–4, speculation on and off, a clip that fires and one that does
/// not. With 4 micro-steps of f32 and no speculation, the device sum copies about a quarter of
/// the host's gradient bytes (one f32 window instead of four f32 micro-steps), which shows that
/// the device accumulator is what ran. (A speculated step whose pieces are rolled back copies
/// them twice: during the last backward, and in the step's stream.)
#[test]
fn summing_on_the_device_gives_the_host_sum() {
    for world in [1, 2, 3] {
        for accum in 2..=4 {
            for budget in [0, WHOLE_BUDGET] {
                for clip in [Some(1e9), Some(0.8)] {
                    let setup = Setup {
                        steps: 6,
                        clip,
                        speculation_budget: budget,
                        ..Setup::new(Stage::Zero2, world, accum, true)
                    };
                    let (on_host, on_device) =
                        check_device_sum::<f32>(&setup, &LossScaler::None, None);
                    assert_eq!(
                        clipped(&on_host),
                        clip == Some(0.8),
                        "{setup:?}: the clip's premise"
                    );
                    if accum == 4 && budget == 0 {
                        let (host, device) = (d2h_bytes(&on_host), d2h_bytes(&on_device));
                        assert!(device < host / 3, "{setup:?}: {device} bytes out against {host}");
                    }
                }
            }
        }
    }
}

/// The delayed update sums on the device too, and copies the sum into the host accumulator:
/// identical to the host sum, bit for bit.
#[test]
fn the_delayed_update_sums_on_the_device_as_on_the_host() {
    for (world, accum) in [(1, 2), (2, 3), (3, 4)] {
        let setup =
            Setup { steps: 6, delayed: Some(2), ..Setup::new(Stage::Zero2, world, accum, true) };
        check_device_sum::<f32>(&setup, &LossScaler::None, None);
    }
}

/// bf16 and f16 gradients are summed in f32 on both sides; an overflow on one rank (f16,
/// dynamic loss scale) skips its step on every rank alike, and the device accumulator is cleared
/// for the next window as the host's is; a non-finite bf16 gradient skips its step alike. (f16
/// weights sum on the device with the accumulating path.)
#[test]
fn summing_on_the_device_gives_the_host_sum_in_16_bits() {
    let scaler = LossScaler::Dynamic(DynamicScaler::new(10, 1000, 1.0, 1, false));
    for (world, accum) in [(2, 2), (3, 4)] {
        for budget in [0, WHOLE_BUDGET] {
            let setup = Setup {
                steps: 5,
                speculation_budget: budget,
                ..Setup::new(Stage::Zero2, world, accum, true)
            };
            check_device_sum::<Bf16>(&setup, &LossScaler::None, None);
            let poison = Some((world - 1, 2 * u64::from(accum)));
            check_device_sum::<f16>(&setup, &scaler, poison);
            // A non-finite bf16 gradient skips the step on the streamed path too, and its
            // accumulator is cleared for the next window.
            let (on_host, _) = check_device_sum::<Bf16>(&setup, &LossScaler::None, poison);
            let skipped = on_host.reports.iter().flatten();
            assert!(skipped.filter(|r| matches!(r, StepReport::Skipped { .. })).count() > 0);
        }
    }
}

/// Under chaos the device sum's run is its calm run: each window's copies wait for the sums, and
/// the clearing of the accumulator waits for the copies.
#[test]
fn summing_on_the_device_under_chaos_gives_the_host_sum() {
    for seed in 1..=4 {
        for (world, accum) in [(2, 3), (1, 4), (3, 2)] {
            let setup = Setup {
                steps: 6,
                chaos: Some(seed),
                speculation_budget: if seed % 2 == 0 { WHOLE_BUDGET } else { 0 },
                ..Setup::new(Stage::Zero2, world, accum, true)
            };
            check_device_sum::<f32>(&setup, &LossScaler::None, None);
        }
    }
}

/// Stages 1 and 0 reduce once per window (the gradients sum in the gradient buffer): asking for
/// the device accumulator changes nothing, not even the bytes copied.
#[test]
fn stages_that_reduce_once_per_window_need_no_device_sum() {
    for stage in [Stage::Zero1, Stage::Zero0] {
        let setup = Setup { steps: 4, ..Setup::new(stage, 2, 3, true) };
        let plain = Setup { speculation_budget: 0, ..setup.clone() };
        let on_host = train::<f32>(
            &Setup { accumulate_on: AccumulateOn::Host, ..plain.clone() },
            LossScaler::None,
            None,
        );
        let on_device = train::<f32>(
            &Setup { accumulate_on: AccumulateOn::Device, ..plain },
            LossScaler::None,
            None,
        );
        assert_identical(&on_device, &on_host, &format!("{setup:?}"));
        assert_eq!(d2h_bytes(&on_device), d2h_bytes(&on_host), "{setup:?}");
    }
}
