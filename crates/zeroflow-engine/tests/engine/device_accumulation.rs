//! ZeRO-2 with offload and gradient accumulation summing a window on the device (one copy to the
//! host per window) gives the host's sum (every micro-step copied out and added there) bit for
//! bit: the same f32 additions, element by element, in micro-step order. So the whole run is
//! identical: weights, optimizer state, step reports, with and without speculation, calm and
//! under chaos, in f32, bf16 and f16 (with an overflow skipping a step).

use zeroflow_core::{Float, f16};
use zeroflow_engine::{AccumulateOn, DynamicScaler, LossScaler, Stage};

use crate::harness::{Bf16, Outcome, Setup, WHOLE_BUDGET, train};

/// Trains `setup` summing on the host (calm) and on the device, checks that both end alike, and
/// returns both.
fn check_device_sum_is_the_host_sum<P: Float>(
    setup: &Setup,
    scaler: &LossScaler,
    poison: Option<(usize, u64)>,
) -> (Outcome<P>, Outcome<P>) {
    let host = Setup { accumulate_on: AccumulateOn::Host, chaos: None, ..setup.clone() };
    let on_host = train::<P>(&host, scaler.clone(), poison);
    let device = Setup { accumulate_on: AccumulateOn::Device, ..setup.clone() };
    let on_device = train::<P>(&device, scaler.clone(), poison);
    assert_eq!(on_device.weights, on_host.weights, "{device:?}: weights differ");
    for (rank, (got, want)) in on_device.snapshots.iter().zip(&on_host.snapshots).enumerate() {
        assert_eq!(got.part, want.part, "{device:?} rank {rank}: optimizer state differs");
    }
    assert_eq!(on_device.reports, on_host.reports, "{device:?}: step reports differ");
    (on_host, on_device)
}

/// Bytes copied device → host by every rank, summed.
fn d2h_bytes<P>(out: &Outcome<P>) -> u64 {
    out.traffic.iter().map(|t| t.copied.device_to_host).sum()
}

/// 1–3 ranks, accumulation 2–4, speculation on and off, clipping: identical. With 4 micro-steps
/// of f32, the device sum copies a quarter of the host's gradient bytes (one f32 window instead of
/// four f32 micro-steps), which shows that the device accumulator is what ran.
#[test]
fn summing_on_the_device_gives_the_host_sum() {
    for world in [1, 2, 3] {
        for accum in 2..=4 {
            for budget in [0, WHOLE_BUDGET] {
                let setup = Setup {
                    steps: 6,
                    clip: Some(10.0),
                    speculation_budget: budget,
                    ..Setup::new(Stage::Zero2, world, accum, true)
                };
                let (on_host, on_device) =
                    check_device_sum_is_the_host_sum::<f32>(&setup, &LossScaler::None, None);
                if accum == 4 {
                    let (host, device) = (d2h_bytes(&on_host), d2h_bytes(&on_device));
                    assert!(device < host / 2, "{setup:?}: {device} bytes out against {host}");
                }
            }
        }
    }
}

/// bf16 and f16 gradients are summed in f32 on both sides; an overflow on one rank (f16,
/// dynamic loss scale) skips its step on every rank alike, and the device accumulator is cleared
/// for the next window as the host's is.
#[test]
fn summing_on_the_device_gives_the_host_sum_in_16_bits() {
    let scaler = LossScaler::Dynamic(DynamicScaler::new(10, 1000, 1.0, 1, false));
    for (world, accum) in [(2, 2), (3, 4)] {
        let setup = Setup { steps: 5, ..Setup::new(Stage::Zero2, world, accum, true) };
        check_device_sum_is_the_host_sum::<Bf16>(&setup, &LossScaler::None, None);
        let poison = Some((world - 1, 2 * u64::from(accum)));
        check_device_sum_is_the_host_sum::<f16>(&setup, &scaler, poison);
    }
}

/// Under chaos the device sum still equals the calm host sum: each window's copies wait for the
/// sums, and the clearing of the accumulator waits for the copies.
#[test]
fn summing_on_the_device_under_chaos_gives_the_host_sum() {
    for seed in 1..=4 {
        for (world, accum) in [(2, 3), (1, 4)] {
            let setup = Setup {
                steps: 6,
                chaos: Some(seed),
                ..Setup::new(Stage::Zero2, world, accum, true)
            };
            check_device_sum_is_the_host_sum::<f32>(&setup, &LossScaler::None, None);
        }
    }
}

/// Stages 1 and 0 reduce once per window (the gradients sum in the gradient buffer): asking for
/// the device accumulator changes nothing, not even the bytes copied.
#[test]
fn stages_that_reduce_once_per_window_need_no_device_sum() {
    for stage in [Stage::Zero1, Stage::Zero0] {
        let setup = Setup { steps: 4, ..Setup::new(stage, 2, 3, true) };
        let (on_host, on_device) =
            check_device_sum_is_the_host_sum::<f32>(&setup, &LossScaler::None, None);
        assert_eq!(d2h_bytes(&on_device), d2h_bytes(&on_host), "{setup:?}");
    }
}
